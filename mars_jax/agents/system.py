"""The V-C reasoning system: a per-problem state machine and a round-batched driver.

Rules per problem (the released MarsRL loop, `vc_reasoning_system.py`):
  * The Solver's candidate is verified; then up to `max_iterations` iterations, each: after a
    failed verification the Corrector revises the candidate with its report; then verify.
  * `k_accept` consecutive passes accept a candidate; a failure resets the streak. Out of
    iterations, the `fallback` candidate is returned: 'most_passed' (ties to the latest: the
    paper's rule) or 'most_verified' (ties to the earliest: the released code's).
  * An unusable output (truncated, errored, no visible text, no parseable Correctness) is
    retried up to `max_retries` times; then a Solver's problem fails, a Corrector's returns the
    fallback, a Verifier's counts as a failed verification without report (verdict None).

`run_system` makes one policy call per round carrying every unfinished problem's next request.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from mars_jax.agents import stages
from mars_jax.agents.policy import ChatRequest, Completion, Policy, check_batch
from mars_jax.preemption import Stopped
from mars_jax.types import ROLES

ACCEPTED, FALLBACK, FAILED = "accepted", "fallback", "failed"
FALLBACKS = ("most_passed", "most_verified")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Parameters of the V-C loop (see the module docstring for the rules)."""

    k_accept: int = 4
    max_iterations: int = 10
    max_retries: int = 2
    max_new_tokens: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: {"solver": 8192, "verifier": 8192, "corrector": 8192})
    prompt_style: str = "full"  # see `mars_jax.agents.prompts.STYLES`
    fallback: str = "most_passed"  # one of FALLBACKS

    def __post_init__(self) -> None:
        for field, value, least in (("k_accept", self.k_accept, 1),
                                    ("max_iterations", self.max_iterations, 0),
                                    ("max_retries", self.max_retries, 0)):
            if value < least:
                raise ValueError(f"{field}: must be >= {least}, got {value}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback: {self.fallback!r} is not one of {FALLBACKS}")
        missing = set(ROLES) - set(self.max_new_tokens)
        if missing:
            raise ValueError(f"max_new_tokens lacks roles {sorted(missing)}")
        small = {role: n for role, n in self.max_new_tokens.items() if n < 1}
        if small:
            raise ValueError(f"max_new_tokens: must be >= 1 for every role, got {small}")


@dataclasses.dataclass(frozen=True)
class Step:
    """One policy call made for a problem (retries included), in order."""

    role: str
    completion: Completion
    verdict: bool | None = None  # Verifier steps only: the parsed Correctness.


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A solution under verification, and the verdict of each verification it received."""

    source: str  # 'solver' | 'corrector'
    output: stages.SolutionOutput  # the usable output it is
    verdicts: tuple[bool | None, ...] = ()

    @property
    def solution(self) -> str:
        return self.output.solution

    @property
    def answer(self) -> str | None:
        return self.output.answer

    @property
    def passes(self) -> int:
        return sum(v is True for v in self.verdicts)

    @property
    def verified(self) -> int:
        """Verifications that returned a verdict (pass or fail)."""
        return sum(v is not None for v in self.verdicts)

    @property
    def streak(self) -> int:
        """Consecutive passing verdicts at the end of `verdicts`."""
        n = 0
        for v in reversed(self.verdicts):
            if v is not True:
                break
            n += 1
        return n


@dataclasses.dataclass(frozen=True)
class SystemResult:
    """Outcome of the loop on one problem: `status` ('accepted', 'fallback' or 'failed'), `final`
    (the chosen candidate's index, None when failed), every candidate (the Solver's first), the
    verifications spent (retries not counted), every policy call, and `failure` (why it stopped
    early, else None)."""

    status: str
    final: int | None
    candidates: tuple[Candidate, ...]
    verifications: int
    steps: tuple[Step, ...]
    failure: str | None = None

    @property
    def iterations(self) -> int:
        """Verifications after the first one (the released loop's iteration count)."""
        return max(self.verifications - 1, 0)

    @property
    def solution(self) -> str | None:
        return None if self.final is None else self.candidates[self.final].solution

    @property
    def answer(self) -> str | None:
        return None if self.final is None else self.candidates[self.final].answer

    def tokens_by_role(self) -> dict[str, int]:
        """Generated tokens per agent, retries included."""
        tokens = dict.fromkeys(ROLES, 0)
        for step in self.steps:
            tokens[step.role] += step.completion.num_tokens
        return tokens


class ProblemLoop:
    """The V-C loop on one problem: `next_request()`, then `advance(completion)`, until `done`."""

    def __init__(self, problem: str, config: LoopConfig):
        self.problem = problem
        self.config = config
        self._stage = "solver"
        self._attempt = 0  # unusable outputs so far for the pending request
        self._report = ""  # bug report of the last failing verification
        self._verifications = 0
        self._candidates: list[Candidate] = []
        self._steps: list[Step] = []
        self._result: SystemResult | None = None

    @property
    def done(self) -> bool:
        return self._result is not None

    def result(self) -> SystemResult:
        if self._result is None:
            raise RuntimeError("the loop has not finished")
        return self._result

    def next_request(self) -> ChatRequest:
        """The request this problem needs next."""
        if self.done:
            raise RuntimeError("the loop has finished")
        budget = self.config.max_new_tokens[self._stage]
        if self._stage == "solver":
            return stages.solver_request(self.problem, budget, self.config.prompt_style)
        solution = self._candidates[-1].solution
        if self._stage == "verifier":
            return stages.verifier_request(self.problem, solution, budget, self.config.prompt_style)
        return stages.corrector_request(self.problem, solution, self._report, budget,
                                         self.config.prompt_style)

    def advance(self, completion: Completion) -> None:
        """Consumes the completion of `next_request()`."""
        if self.done:
            raise RuntimeError("the loop has finished")
        if self._stage == "verifier":
            self._on_verification(stages.parse_verification(completion))
        else:
            self._on_solution(stages.parse_solution(completion))

    def _on_solution(self, output: stages.SolutionOutput) -> None:
        self._steps.append(Step(self._stage, output.completion))
        if not output.usable:
            if self._retry():
                return
            reason = output.completion.finish_reason if output.solution else "no visible text"
            self._finish(FALLBACK if self._candidates else FAILED,
                         f"{self._stage} output unusable ({reason}) "
                         f"after {self.config.max_retries + 1} attempts")
            return
        self._attempt = 0
        self._candidates.append(Candidate(self._stage, output))
        self._stage = "verifier"

    def _on_verification(self, output: stages.VerificationOutput) -> None:
        self._steps.append(Step("verifier", output.completion, output.passed))
        if not output.usable and self._retry():
            return
        self._attempt = 0
        self._verifications += 1
        verdict = output.passed if output.usable else None
        last = self._candidates[-1]
        candidate = self._candidates[-1] = dataclasses.replace(last, verdicts=(*last.verdicts, verdict))
        iterations_left = self.config.max_iterations - (self._verifications - 1)
        if candidate.streak >= self.config.k_accept:
            self._finish(ACCEPTED)
        elif iterations_left <= 0:
            self._finish(FALLBACK)
        elif verdict is False:
            self._report = output.report
            self._stage = "corrector"

    def _retry(self) -> bool:
        """Counts an unusable output; True if the request may be made again."""
        self._attempt += 1
        return self._attempt <= self.config.max_retries

    def _finish(self, status: str, failure: str | None = None) -> None:
        final = None
        if status == ACCEPTED:
            final = len(self._candidates) - 1
        elif status == FALLBACK:
            final = fallback_candidate(self._candidates, self.config.fallback)
        self._result = SystemResult(status, final, tuple(self._candidates), self._verifications,
                                    tuple(self._steps), failure)


def fallback_candidate(candidates: Sequence[Candidate], rule: str) -> int:
    """Index of the candidate `rule` (one of FALLBACKS, see the module docstring) picks."""
    if rule == "most_passed":
        most = max(c.passes for c in candidates)
        return max(i for i, c in enumerate(candidates) if c.passes == most)
    if rule == "most_verified":
        most = max(c.verified for c in candidates)
        return min(i for i, c in enumerate(candidates) if c.verified == most)
    raise ValueError(f"fallback: {rule!r} is not one of {FALLBACKS}")


@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """Passed to the per-round hook after each round."""

    round: int  # 1-based
    requests_by_role: dict[str, int]
    finished: int  # problems finished so far
    total: int


def run_system(
    problems: Sequence[str],
    policy: Policy,
    config: LoopConfig | None = None,
    *,
    max_in_flight: int | None = None,
    on_round: Callable[[RoundInfo], None] | None = None,
    on_result: Callable[[int, SystemResult], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[SystemResult]:
    """Runs the V-C loop on every problem, all in flight together (at most `max_in_flight`), and
    returns one `SystemResult` per problem, in order. `should_stop`, asked before each round,
    raises `Stopped` (problems in flight dropped)."""
    config = config or LoopConfig()
    limit = len(problems) if max_in_flight is None else max_in_flight
    if limit < 1 and problems:
        raise ValueError("max_in_flight must be positive")
    results: list[SystemResult | None] = [None] * len(problems)
    active: dict[int, ProblemLoop] = {}
    started = finished = round_index = 0
    while True:
        while started < len(problems) and len(active) < limit:
            active[started] = ProblemLoop(problems[started], config)
            started += 1
        if not active:
            break
        if should_stop is not None and should_stop():
            raise Stopped(f"V-C loop: stopped before round {round_index + 1}, {finished} of "
                          f"{len(problems)} problems finished")
        round_index += 1
        requests = [loop.next_request() for loop in active.values()]
        completions = policy.complete(requests)
        check_batch(requests, completions)
        for (index, loop), completion in zip(list(active.items()), completions):
            loop.advance(completion)
            if loop.done:
                del active[index]
                results[index] = loop.result()
                finished += 1
                if on_result is not None:
                    on_result(index, results[index])
        if on_round is not None:
            by_role = dict.fromkeys(ROLES, 0)
            for request in requests:
                by_role[request.role] += 1
            on_round(RoundInfo(round_index, by_role, finished, len(problems)))
    return results  # type: ignore[return-value]  # every problem finishes
