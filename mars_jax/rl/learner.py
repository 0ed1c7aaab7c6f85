"""The PPO structure of one RL step: pi_old fixed for the step, `ppo_epochs` passes over
`mini_batches` optimizer updates each.

The step's samples are shuffled once (the trainer seeds the generator with (seed, step), so a
resumed step draws the same mini-batches) and split into `mini_batches` near-equal mini-batches,
visited in that order every epoch (verl's split-once structure). pi_old:

sampler    the sampler's log-probabilities; for samples decoded under earlier versions (pipeline
           mode) this is vanilla off-policy PPO around the behaviour policy.
recompute  one forward under the parameters at the start of the step (verl's `old_log_prob`);
           the sampler's stay the behaviour policy of the decoupled objective (AReaL): clipping
           around the recomputed (proximal) policy, each token weighted by
           `min(pi_prox / pi_behav, loss.behaviour_weight_cap)`.

The first update of a step runs under the step's starting parameters, so its ratio is 1 up to
rounding ('recompute') or the sampler/trainer difference ('sampler'; stale samples start off 1).

Stopping (`mars_jax.preemption`): `should_stop` is asked before every pi_old forward and every
micro-batch (each micro-batch a program of its own, waited for, so a stop waits for one
micro-batch); when it says so the update raises `UpdateStopped` with the state it started from,
so the step can be redone. Updates donate their state, so with more than one update a copy of
the starting state waits in host memory (pinned_host).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mars_jax.distributed import CompiledTogether
from mars_jax.preemption import Stopped
from mars_jax.rl.batching import TrainSample
from mars_jax.rl.update import (TrainState, UpdateConfig, apply_gradients, micro_batch_gradients,
                                policy_logprobs)
from mars_jax.types import TrainBatch

PI_OLD = ("sampler", "recompute")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """How a step's samples become optimizer updates; the defaults are config.learner's
    (experiments/configs/common.py)."""

    ppo_epochs: int = 1
    mini_batches: int = 1
    pi_old: str = "sampler"
    # On one shared mesh: the optimizer state (and KL reference) in host memory while the engine
    # decodes (`mars_jax.offload`).
    offload_optimizer: bool = False
    # The mini-batches' shape (`batching.make_batch`, built by the trainer): micro-batches of
    # `micro_batch_size` rows over the whole training mesh (each host an equal share), at least
    # `min_length` columns and `min_micro_batches` micro-batches; `pack`: several samples a row.
    micro_batch_size: int = 8
    min_length: int = 32
    min_micro_batches: int = 1
    pack: bool = True

    def __post_init__(self) -> None:
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError(f"ppo_epochs and mini_batches must be >= 1, got {self.ppo_epochs}, "
                             f"{self.mini_batches}")
        if self.pi_old not in PI_OLD:
            raise ValueError(f"pi_old must be one of {PI_OLD}, got {self.pi_old!r}")


class UpdateStopped(Stopped):
    """`train_mini_batches` stopped before its end; `state` is the one it started from."""

    def __init__(self, state: Any, updates_done: int) -> None:
        super().__init__(f"update stopped after {updates_done} optimizer updates; the state "
                         "from before the step's update is kept")
        self.state = state


def _to_memory(tree: Any, kind: str) -> Any:
    """A copy of every array of `tree` in memory `kind` of the devices holding it."""
    return jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), tree))


def mini_batch_indices(num_samples: int, mini_batches: int, rng: np.random.Generator
                       ) -> list[np.ndarray]:
    """A seeded shuffle of `range(num_samples)` split into `mini_batches` near-equal parts (some
    empty when there are fewer samples than mini-batches)."""
    return np.array_split(rng.permutation(num_samples), mini_batches)


# Several processes: each program compiled on every host before any host runs it.
_MICRO_BATCH = CompiledTogether(micro_batch_gradients, "micro_batch_gradients")
_APPLY = CompiledTogether(apply_gradients, "apply_gradients")
_POLICY_LOGPROBS = CompiledTogether(policy_logprobs, "policy_logprobs")
# The programs of one optimizer update, in order (`train_mini_batches`; compiled ahead of time by
# experiments/aot_compile.py under these names).
UPDATE_PROGRAMS = (_MICRO_BATCH.name, _APPLY.name)


def split_mini_batches(samples: Sequence[TrainSample], learner: LearnerConfig,
                       rng: np.random.Generator,
                       build_batch: Callable[[Sequence[TrainSample]], TrainBatch]
                       ) -> list[TrainBatch]:
    """The step's `learner.mini_batches` mini-batches of `samples` (`mini_batch_indices`), each
    built by `build_batch`, even when empty (so every host makes the same number of updates)."""
    parts = mini_batch_indices(len(samples), learner.mini_batches, rng)
    return [build_batch([samples[i] for i in part]) for part in parts]


def ppo_update(state: TrainState, samples: Sequence[TrainSample], *,
               build_batch: Callable[[Sequence[TrainSample]], TrainBatch], ref_params: Any,
               graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
               update_config: UpdateConfig, learner: LearnerConfig, rng: np.random.Generator,
               should_stop: Callable[[], bool] | None = None,
               micro_batch_seconds: Callable[[float], None] | None = None
               ) -> tuple[TrainState, list[dict[str, float]]]:
    """`train_mini_batches` on `split_mini_batches(samples, learner, rng, build_batch)`."""
    return train_mini_batches(state, split_mini_batches(samples, learner, rng, build_batch),
                              ref_params=ref_params, graphdef=graphdef, optimizer=optimizer,
                              update_config=update_config, learner=learner,
                              should_stop=should_stop, micro_batch_seconds=micro_batch_seconds)


def train_mini_batches(state: TrainState, batches: Sequence[TrainBatch], *, ref_params: Any,
                       graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                       update_config: UpdateConfig, learner: LearnerConfig,
                       should_stop: Callable[[], bool] | None = None,
                       micro_batch_seconds: Callable[[float], None] | None = None
                       ) -> tuple[TrainState, list[dict[str, float]]]:
    """`learner.ppo_epochs` passes of one optimizer update per mini-batch of `batches`; returns
    the new state and each update's metrics, in order. Runs only on the devices of its inputs, so
    a worker thread can run it beside a decode on other devices. `should_stop` (module docstring)
    is asked equally often on every host and must answer alike on all. `micro_batch_seconds`
    gets each micro-batch's run time, from its dispatch's return (past any compile) to its end."""
    start = state
    if should_stop is not None and learner.ppo_epochs * len(batches) > 1:
        start = _to_memory(state, "pinned_host")  # the updates donate `state`

    def check(done: int) -> None:
        if should_stop is not None and should_stop():
            if done == 0:
                raise UpdateStopped(state, done)
            for x in jax.tree.leaves(state):  # make room for the starting state
                x.delete()
            raise UpdateStopped(_to_memory(start, "device"), done)

    if learner.pi_old == "recompute":  # every mini-batch's pi_old before the first update
        with_old = []
        for batch in batches:
            check(0)
            with_old.append(batch.replace(old_logprobs=_POLICY_LOGPROBS(
                state.params, batch, graphdef=graphdef, config=update_config)))
        batches = with_old
    history = []
    for _ in range(learner.ppo_epochs):
        for batch in batches:
            grads, micro_metrics = jax.tree.map(jnp.zeros_like, state.params), []
            for index in range(batch.tokens.shape[0]):
                check(len(history))
                grads, metrics = _MICRO_BATCH(grads, state.params, batch, np.int32(index),
                                              ref_params, graphdef=graphdef,
                                              config=update_config)
                dispatched = time.perf_counter()  # after its compile, if it had to
                micro_metrics.append(jax.block_until_ready(metrics))
                if micro_batch_seconds is not None:
                    micro_batch_seconds(time.perf_counter() - dispatched)
            state, metrics = _APPLY(state, grads, micro_metrics, batch, optimizer=optimizer)
            history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def summarize_updates(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """A step's update metrics: means over the updates that saw tokens (`tokens`: the sum), the
    first and last one's ratio and clip fractions, `optimizer_steps` (applied) and `updates`
    (attempted), `finite` = 1 only if every update was finite."""
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
