"""The V-C loop stopped by a preemption notice: it stops before the next round, the pairs finished
so far are recorded, and a rerun evaluates only the rest, ending with the uninterrupted records."""
import pytest

from mars_jax.agents.eval import evaluate
from mars_jax.preemption import Stopped
from tests.agents.test_agent_eval import CONFIG, PROBLEMS, OraclePolicy


def test_a_stopped_evaluation_keeps_the_finished_pairs_and_a_rerun_finishes_the_rest(tmp_path):
    whole, summary = evaluate(PROBLEMS, OraclePolicy(), num_samples=2, config=CONFIG)

    path = tmp_path / "records.jsonl"
    policy = OraclePolicy()
    rounds = iter(range(100))  # asked before each round: stop before the sixth
    with pytest.raises(Stopped, match="before round 6, 2 of 4"):
        evaluate(PROBLEMS, policy, num_samples=2, config=CONFIG, records_path=str(path),
                 should_stop=lambda: next(rounds) >= 5)
    assert len(policy.calls) == 5  # Problem-A's pairs take 5 rounds (S V V V V), B's 7
    policy = OraclePolicy()
    records, again = evaluate(PROBLEMS, policy, num_samples=2, config=CONFIG,
                              records_path=str(path))
    assert policy.calls[0] == ["solver", "solver"]  # Problem-B's two pairs only
    assert records == whole and again == summary
