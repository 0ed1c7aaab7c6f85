"""bug_report cuts at the same Correctness headings that parse_verdict reads."""

import pytest

from mars_jax.agents import prompts


@pytest.mark.parametrize(
    "report",
    [
        "Verdict: bad.\n3. **Correctness:** Wrong",
        "Verdict: bad.\n**3. Correctness:** Wrong",
        "Verdict: bad.\r\n**Correctness**\r\nWrong\r\n",
    ],
)
def test_bug_report_drops_numbered_and_crlf_headings(report):
    assert prompts.bug_report(report) == "Verdict: bad."
