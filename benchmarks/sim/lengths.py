"""Output lengths per role: log-normal, capped at the budget (mass above the cap ends by length).

Fit to the MarsRL paper (Qwen3-30B-A3B-Thinking-2507, 64k output budget): the Solver's mean
response grows from ~19k to ~28k tokens over training. A length is min(X, cap) with
X ~ LogNormal(mu, sigma); `mu` is solved so that the capped mean equals the role's mean at the
training progress p in [0, 1] (Solver: 19k + 9k p). The paper gives no Verifier / Corrector
lengths: they are assumed to be fractions of the Solver's mean (`ROLE_SCALE`, stated in
benchmarks/NOTEBOOK.md), with the same sigma. A draw depends only on (seed, role, sequence seed, p).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

ROLES = ("solver", "verifier", "corrector")
ROLE_SCALE = {"solver": 1.0, "verifier": 0.5, "corrector": 0.75}  # x the Solver's mean


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X ~ LogNormal(mu, sigma)."""
    log_cap = math.log(cap)
    below = math.exp(mu + sigma ** 2 / 2) * _phi((log_cap - mu - sigma ** 2) / sigma)
    return below + cap * (1.0 - _phi((log_cap - mu) / sigma))


def fit_mu(mean: float, sigma: float, cap: float) -> float:
    """The mu whose capped log-normal has mean `mean` (bisection; `mean` must be < cap)."""
    if not 0 < mean < cap:
        raise ValueError(f"mean: need 0 < mean < cap, got {mean} (cap {cap})")
    lo, hi = math.log(mean) - 5 * sigma, math.log(cap) + 5 * sigma
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_lognormal_mean(mid, sigma, cap) < mean else (lo, mid)
    return (lo + hi) / 2


@dataclasses.dataclass(frozen=True)
class LengthModel:
    """Per-role capped log-normal lengths at training progress `progress`."""

    cap: int = 64 * 1024
    sigma: float = 0.7
    solver_mean_start: float = 19_000.0
    solver_mean_end: float = 28_000.0
    progress: float = 0.0
    seed: int = 0
    median: float = 0.0   # > 0: every role's uncapped median is this x its scale (no mean fit)
    role_scale: tuple = tuple(ROLE_SCALE.items())

    def mean(self, role: str) -> float:
        solver = self.solver_mean_start + (self.solver_mean_end - self.solver_mean_start) * (
            self.progress)
        return solver * dict(self.role_scale)[role]

    def mu(self, role: str) -> float:
        if self.median > 0:
            return math.log(self.median * dict(self.role_scale)[role])
        return fit_mu(self.mean(role), self.sigma, self.cap)

    def truncated_fraction(self, role: str) -> float:
        """P(X >= cap): the share of outputs that end by length."""
        return 1.0 - _phi((math.log(self.cap) - self.mu(role)) / self.sigma)

    def draw(self, role: str, sequence_seed: int) -> int:
        """The length (tokens, stop token included) the output of `sequence_seed` for `role`
        would have without a budget; one longer than the budget ends by length there."""
        rng = np.random.default_rng([self.seed, ROLES.index(role), int(sequence_seed)])
        return int(max(1, round(rng.lognormal(self._mus[role], self.sigma))))

    @property
    def _mus(self) -> dict[str, float]:
        cached = self.__dict__.get("_mu_cache")
        if cached is None:
            cached = {role: self.mu(role) for role in ROLES}
            object.__setattr__(self, "_mu_cache", cached)
        return cached
