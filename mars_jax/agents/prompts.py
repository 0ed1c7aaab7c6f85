"""Chat prompts of the three agents (after the MarsRL paper, wording our own) and the bug report
passed from Verifier to Corrector.

`full` style is for real models, `compact` for tiny CPU models with a short context. Thinking never
travels between agents.
"""

from __future__ import annotations

import dataclasses

from mars_jax.rewards.agent_rewards import read_verification
from mars_jax.rewards.text import strip_thinking

Messages = tuple[dict[str, str], ...]

SOLVER_INSTRUCTION = (
    "Solve the problem above. Reason carefully and justify every step, "
    "and write the final answer inside \\boxed{}."
)

VERIFIER_SYSTEM = """\
You are an exacting reviewer of mathematical solutions. You receive a problem and a \
proposed solution. Check the solution step by step. Do not write your own solution \
and do not repair this one: your task is to find and report what is wrong with it.

Sort every issue you find into one of two kinds:
* Critical Error: a step that is false or breaks the chain of reasoning, such as a \
wrong calculation, an invalid deduction or a wrong final answer. Do not check later \
steps that rely on it, but do check the independent parts of the solution.
* Justification Gap: a step whose claim may well be true but whose argument is missing, \
incomplete or hand-waving. Assume the claim holds and keep checking the rest.

Your response must have exactly three parts, in this order:

**Final Verdict:** one sentence: is the solution correct, or does it contain Critical \
Errors or Justification Gaps?

**List of Findings:** one entry per issue, in the form
* **Location:** quote or point to the part of the solution concerned
  **Issue:** Critical Error or Justification Gap, then what exactly is wrong
Write "None" if you found no issue.

**Correctness:** a single word, Correct or Wrong. Answer Correct only when the final \
answer is right and the solution has no Critical Error and no Justification Gap that \
leaves a step in doubt; otherwise answer Wrong."""

VERIFIER_REMINDER = (
    "Review the solution above step by step. Reply with exactly the three parts "
    "**Final Verdict**, **List of Findings** and **Correctness** (one word: Correct or Wrong)."
)

CORRECTOR_INSTRUCTION = """\
A reviewer checked your solution and wrote the bug report below. Write an improved \
solution that fixes every issue in the report. If you believe an item of the report is \
mistaken, keep that part of your solution and explain why the item does not apply. \
Give the complete revised solution, not only the changes, with the final answer \
inside \\boxed{}.

## Bug Report
"""



@dataclasses.dataclass(frozen=True)
class PromptStyle:
    solver_instruction: str
    verifier_system: str
    verifier_reminder: str
    corrector_instruction: str


STYLES = {
    "full": PromptStyle(SOLVER_INSTRUCTION, VERIFIER_SYSTEM, VERIFIER_REMINDER, CORRECTOR_INSTRUCTION),
    "compact": PromptStyle(
        solver_instruction="Box the answer.",
        verifier_system=("Check the solution. Reply with **Final Verdict:**, **List of Findings:** "
                         "(Location, Issue: Critical Error or Justification Gap) and "
                         "**Correctness:** Correct or Wrong."),
        verifier_reminder="Verdict, Findings, Correctness.",
        corrector_instruction="Fix it using the report.\n## Bug Report\n"),
}


def _style(name: str) -> PromptStyle:
    if name not in STYLES:
        raise ValueError(f"prompt style {name!r} is unknown; choose one of {sorted(STYLES)}")
    return STYLES[name]


def solver_messages(problem: str, style: str = "full") -> Messages:
    """The Solver's chat: the problem and the boxed-answer instruction."""
    return ({"role": "user", "content": f"{problem.strip()}\n\n{_style(style).solver_instruction}"},)


def verifier_messages(problem: str, solution: str, style: str = "full") -> Messages:
    """The Verifier's chat: instructions, then Problem, Solution (thinking stripped), reminder."""
    user = (
        f"## Problem\n{problem.strip()}\n\n"
        f"## Solution\n{strip_thinking(solution).strip()}\n\n"
        f"## Reminder\n{_style(style).verifier_reminder}"
    )
    return ({"role": "system", "content": _style(style).verifier_system},
            {"role": "user", "content": user})


def corrector_messages(problem: str, solution: str, report: str, style: str = "full") -> Messages:
    """The Corrector's chat: Solver turn, previous solution as assistant turn, fix request."""
    return (
        *solver_messages(problem, style),
        {"role": "assistant", "content": strip_thinking(solution).strip()},
        {"role": "user", "content": _style(style).corrector_instruction + report.strip()},
    )


def bug_report(verifier_text: str, *, thinking_open: bool = False) -> str:
    """Final Verdict + List of Findings of a Verifier output: its visible text before the last
    Correctness heading (`read_verification`; the prompt asks for Correctness as the last part)."""
    return read_verification(verifier_text, thinking_open=thinking_open).report
