"""The PPO structure of one RL step: pi_old fixed for the step, `ppo_epochs` passes over
`mini_batches` optimizer updates each.

The step's samples are shuffled once, by a generator seeded with (seed, step) so that a resumed
step draws the same mini-batches, and split into `mini_batches` near-equal mini-batches; every
epoch visits them in that order (verl's split-once structure). pi_old:

sampler    the sampler's log-probabilities (equal to the trainer's by construction; their
           parity is tested to 1e-5). For samples decoded under earlier versions (pipeline
           mode) this is vanilla off-policy PPO around the behaviour policy.
recompute  one forward under the parameters at the start of the step, before its first update
           (verl's `old_log_prob`); the sampler's log-probabilities stay the behaviour policy
           of the decoupled objective (AReaL): clipping around the recomputed (proximal)
           policy, each token weighted by `min(pi_prox / pi_behav, loss.behaviour_weight_cap)`.

On the first update of a step the parameters are those at its start: with 'recompute' the
ratio is 1 up to the rounding of the two forwards; with 'sampler' it is 1 up to the
sampler/trainer difference for samples decoded under these parameters (stale samples start off
it). From the second update on the ratio departs from 1 and the clip acts.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optax
from flax import nnx

from mars_jax.rl.batching import TrainSample
from mars_jax.rl.update import TrainBatch, TrainState, UpdateConfig, policy_logprobs, train_step

PI_OLD = ("sampler", "recompute")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """How a step's samples become optimizer updates."""

    ppo_epochs: int = 1
    mini_batches: int = 1
    pi_old: str = "sampler"

    def __post_init__(self) -> None:
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError(f"ppo_epochs and mini_batches must be >= 1, got {self.ppo_epochs}, "
                             f"{self.mini_batches}")
        if self.pi_old not in PI_OLD:
            raise ValueError(f"pi_old must be one of {PI_OLD}, got {self.pi_old!r}")


def mini_batch_indices(num_samples: int, mini_batches: int, rng: np.random.Generator
                       ) -> list[np.ndarray]:
    """A seeded shuffle of `range(num_samples)` split into `mini_batches` near-equal parts (some
    empty when there are fewer samples than mini-batches)."""
    return np.array_split(rng.permutation(num_samples), mini_batches)


def ppo_update(state: TrainState, samples: Sequence[TrainSample], *,
               build_batch: Callable[[Sequence[TrainSample]], TrainBatch], ref_params: Any,
               graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
               update_config: UpdateConfig, learner: LearnerConfig, rng: np.random.Generator
               ) -> tuple[TrainState, list[dict[str, float]]]:
    """`learner.ppo_epochs * learner.mini_batches` optimizer updates on `samples`; returns the new
    state and each update's metrics, in order. `build_batch` turns a (possibly empty) list of
    samples into the mini-batch's `TrainBatch` (in a multi-host run: the global batch, so every
    host makes the same number of updates)."""
    parts = mini_batch_indices(len(samples), learner.mini_batches, rng)
    batches = [build_batch([samples[i] for i in part]) for part in parts]
    if learner.pi_old == "recompute":  # every mini-batch's pi_old before the first update
        batches = [batch.replace(old_logprobs=policy_logprobs(state.params, batch,
                                                              graphdef=graphdef,
                                                              config=update_config))
                   for batch in batches]
    history = []
    for _ in range(learner.ppo_epochs):
        for batch in batches:
            state, metrics = train_step(state, batch, ref_params, graphdef=graphdef,
                                        optimizer=optimizer, config=update_config)
            history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def summarize_updates(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """A step's update metrics: each metric's mean over the updates that saw tokens, the first
    and last update's ratio and clip fractions, `optimizer_steps` (applied updates) and
    `updates` (attempted), `finite` = 1 only if every update was finite."""
    seen = [m for m in history if m["tokens"] > 0] or list(history)
    summary = {k: float(np.mean([m[k] for m in seen])) for k in seen[0]}
    summary["tokens"] = float(sum(m["tokens"] for m in history))
    summary["finite"] = float(all(m["finite"] > 0 for m in history))
    summary["updates"] = float(len(history))
    summary["optimizer_steps"] = float(sum(m["finite"] > 0 for m in history))
    for key in ("ratio_mean", "clip_frac_low", "clip_frac_high"):
        summary[f"{key}/first"] = seen[0][key]
        summary[f"{key}/last"] = seen[-1][key]
    return summary
