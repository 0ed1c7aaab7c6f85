"""The three agent stages: build requests for a batch, and parse completions.

`*_request` builds one `ChatRequest`; `parse_solution` / `parse_verification`
turn a `Completion` into a typed result. `solve`, `verify` and `correct` do both
around a single policy call, for callers that run one stage on a batch (the
Solver-only baseline, RL rollouts); the system loop mixes the builders and
parsers of all stages in one call per round (see `system.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from mars_jax.agents import prompts
from mars_jax.agents.policy import ChatRequest, Completion, Policy, check_batch
from mars_jax.rewards.agent_rewards import parse_verdict
from mars_jax.rewards.grader import extract_answer
from mars_jax.rewards.text import strip_thinking


@dataclasses.dataclass(frozen=True)
class SolutionOutput:
    """A parsed Solver or Corrector output.

    Attributes:
      completion: the raw completion.
      solution: its text with thinking stripped (what later agents see).
      answer: the extracted final answer, or None.
    """

    completion: Completion
    solution: str
    answer: str | None

    @property
    def usable(self) -> bool:
        """Whether the output ended by itself (not truncated, no policy error)."""
        return self.completion.finish_reason == "stop"


@dataclasses.dataclass(frozen=True)
class VerificationOutput:
    """A parsed Verifier output.

    Attributes:
      completion: the raw completion.
      passed: True for Correctness "Correct", False for "Wrong", None if unparseable.
      report: the bug report (Final Verdict + List of Findings) for the Corrector.
    """

    completion: Completion
    passed: bool | None
    report: str

    @property
    def usable(self) -> bool:
        """Whether the output ended by itself and its Correctness could be read."""
        return self.completion.finish_reason == "stop" and self.passed is not None


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
    text, opened = completion.text, completion.thinking_open
    return VerificationOutput(completion, parse_verdict(text, thinking_open=opened),
                              prompts.bug_report(text, thinking_open=opened))


def solve(policy: Policy, problems: Sequence[str], *, max_new_tokens: int) -> list[SolutionOutput]:
    """One Solver call per problem, in one batch; no retries."""
    requests = [solver_request(p, max_new_tokens) for p in problems]
    return [parse_solution(c) for c in complete(policy, requests)]


def verify(policy: Policy, problems: Sequence[str], solutions: Sequence[str], *,
           max_new_tokens: int) -> list[VerificationOutput]:
    """One Verifier call per (problem, solution) pair, in one batch; no retries."""
    requests = [verifier_request(p, s, max_new_tokens) for p, s in zip(problems, solutions, strict=True)]
    return [parse_verification(c) for c in complete(policy, requests)]


def correct(policy: Policy, problems: Sequence[str], solutions: Sequence[str], reports: Sequence[str], *,
            max_new_tokens: int) -> list[SolutionOutput]:
    """One Corrector call per (problem, solution, report), in one batch; no retries."""
    requests = [corrector_request(p, s, r, max_new_tokens)
                for p, s, r in zip(problems, solutions, reports, strict=True)]
    return [parse_solution(c) for c in complete(policy, requests)]


def complete(policy: Policy, requests: list[ChatRequest]) -> list[Completion]:
    """`policy`'s completions of `requests`, checked to answer each one."""
    completions = policy.complete(requests) if requests else []
    check_batch(requests, completions)
    return completions
