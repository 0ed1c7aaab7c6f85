"""Each role's decisions sampled on held-out problems: the warm-start bar of the toy study.

A per-token loss hides a 2-token verdict, so `probe` grades whole replies (Solver accuracy, Verifier
recall / specificity, Corrector fix rate).
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

from mars_jax.agents import prompts, stages
from mars_jax.agents.policy import Policy
from mars_jax.agents.sampler_policy import SamplerPolicy
from mars_jax.data.arith import evaluate
from mars_jax.models import Qwen3
from mars_jax.sampling import EngineSettings
from mars_jax.sft import traces


def probe(policy: Policy, problems: Sequence[dict], *, max_new_tokens: Mapping[str, int],
          seed: int, style: str = "compact") -> dict[str, float]:
    """`probe/solver_accuracy`, `probe/verifier_{recall,specificity,balanced_accuracy}` and
    `probe/corrector_fix_rate` of `policy` on `problems`, one request each (flawed values drawn
    from `seed`)."""
    rng = random.Random(seed)
    texts = [p["problem"] for p in problems]
    exprs = [traces.parse_problem(t) for t in texts]
    values = [evaluate(e) for e in exprs]
    golds = [str(v) for v in values]
    right = [traces.solution_text(e, v) for e, v in zip(exprs, values)]
    wrong_values = [traces.flawed_steps(e, rng)[-1].result for e in exprs]
    flawed = [traces.solution_text(e, v) for e, v in zip(exprs, wrong_values)]
    reports = [prompts.bug_report(traces.verifier_text(e, v)) for e, v in zip(exprs, wrong_values)]
    requests = (
        [stages.solver_request(t, max_new_tokens["solver"], style) for t in texts]
        + [stages.verifier_request(t, s, max_new_tokens["verifier"], style)
           for t, s in zip(texts * 2, right + flawed)]
        + [stages.corrector_request(t, s, r, max_new_tokens["corrector"], style)
           for t, s, r in zip(texts, flawed, reports)])
    completions = stages.complete(policy, requests)
    n = len(texts)
    solved = [stages.parse_solution(c) for c in completions[:n]]
    verdicts = [stages.parse_verification(c) for c in completions[n:3 * n]]
    fixed = [stages.parse_solution(c) for c in completions[3 * n:]]

    def share(hits: Sequence[bool]) -> float:
        return sum(hits) / len(hits)

    specificity = share([v.usable and v.passed for v in verdicts[:n]])
    recall = share([v.usable and not v.passed for v in verdicts[n:]])
    return {"probe/solver_accuracy": share([s.usable and s.answer == g for s, g in zip(solved, golds)]),
            "probe/verifier_recall": recall, "probe/verifier_specificity": specificity,
            "probe/verifier_balanced_accuracy": (recall + specificity) / 2,
            "probe/corrector_fix_rate": share([s.usable and s.answer == g
                                               for s, g in zip(fixed, golds)])}


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """Sampling settings and budgets of `probe_model`, decoding on `engine`."""

    temperature: float
    top_p: float
    seed: int
    max_new_tokens: Mapping[str, int]
    style: str
    engine: EngineSettings


def probe_model(model: Qwen3, tokenizer, problems: Sequence[dict], settings: ProbeSettings
                ) -> dict[str, float]:
    """`probe` of `model` in-process under `settings`."""
    policy = SamplerPolicy(model, tokenizer, temperature=settings.temperature,
                           top_p=settings.top_p, engine=settings.engine)
    return probe(policy, problems, max_new_tokens=settings.max_new_tokens, seed=settings.seed,
                 style=settings.style)
