"""The three agent stages: requests, and the parsing of completions.

Parsers' `usable` says whether the next agent may use an output; `correct` grades, `complete` makes
one checked policy call. The paper's rules: a reply cut off by its budget is never graded, and text
inside thinking never reaches the next agent or is read as an answer or verdict.
"""

from __future__ import annotations

import dataclasses

from mars_jax.agents import prompts
from mars_jax.agents.policy import ChatRequest, Completion, Policy, check_batch
from mars_jax.rewards.agent_rewards import read_verification
from mars_jax.rewards.grader import extract_answer, is_equivalent_many
from mars_jax.rewards.text import strip_thinking


@dataclasses.dataclass(frozen=True)
class SolutionOutput:
    """A parsed Solver or Corrector output: the raw `completion`, its `solution` text without
    thinking (what later agents see) and the extracted `answer` (or None)."""

    completion: Completion
    solution: str
    answer: str | None

    @property
    def usable(self) -> bool:
        """Whether the output ended by itself (no truncation or error) with visible text."""
        return self.completion.finish_reason == "stop" and bool(self.solution)


@dataclasses.dataclass(frozen=True)
class VerificationOutput:
    """A parsed Verifier output: the raw `completion`, `passed` (Correctness "Correct" True,
    "Wrong" False, unparseable None) and the bug `report` for the Corrector."""

    completion: Completion
    passed: bool | None
    report: str

    @property
    def usable(self) -> bool:
        """Whether the output ended by itself and its Correctness could be read."""
        return self.completion.finish_reason == "stop" and self.passed is not None

    @property
    def verdict(self) -> bool | None:
        """`passed` when usable, else None (a truncated or unreadable report)."""
        return self.passed if self.usable else None


def solver_request(problem: str, max_new_tokens: int, style: str = "full") -> ChatRequest:
    return ChatRequest(prompts.solver_messages(problem, style), "solver", max_new_tokens)


def verifier_request(problem: str, solution: str, max_new_tokens: int,
                     style: str = "full") -> ChatRequest:
    return ChatRequest(prompts.verifier_messages(problem, solution, style), "verifier", max_new_tokens)


def corrector_request(problem: str, solution: str, report: str, max_new_tokens: int,
                      style: str = "full") -> ChatRequest:
    return ChatRequest(prompts.corrector_messages(problem, solution, report, style), "corrector",
                       max_new_tokens)


def parse_solution(completion: Completion) -> SolutionOutput:
    solution = strip_thinking(completion.text, thinking_open=completion.thinking_open).strip()
    return SolutionOutput(completion, solution, extract_answer(solution))


def parse_verification(completion: Completion) -> VerificationOutput:
    read = read_verification(completion.text, thinking_open=completion.thinking_open)
    return VerificationOutput(completion, read.verdict, read.report)


def correct(outputs: list[SolutionOutput], golds: list[str]) -> list[bool]:
    """Per output: usable and its boxed answer equivalent to its gold (`grader`)."""
    graded = [i for i, out in enumerate(outputs) if out.usable and out.answer is not None]
    result = [False] * len(outputs)
    hits = is_equivalent_many([outputs[i].answer for i in graded], [golds[i] for i in graded])
    for i, hit in zip(graded, hits):
        result[i] = hit
    return result


def complete(policy: Policy, requests: list[ChatRequest]) -> list[Completion]:
    """`policy`'s completions of `requests`, checked to answer each one."""
    completions = policy.complete(requests) if requests else []
    check_batch(requests, completions)
    return completions
