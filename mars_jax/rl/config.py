"""The RL job's typed settings built from its `ml_collections` config, all at once by
`train_settings`: rollouts (`RolloutConfig`), loss (`LossConfig`), update program
(`UpdateConfig`), learner (`LearnerConfig`), the rollout scheduler (`StreamSettings`), the
held-out probe (`sft.probe.ProbeSettings`) and the training loop's own (`RunSettings`); its
optimizer (`build_optimizer`); and the check of `learner.micro_batch_size` against the
processes."""
from __future__ import annotations

import dataclasses

import jax
import optax
from ml_collections import ConfigDict

from mars_jax import distributed
from mars_jax.errors import Problem
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.learner import LearnerConfig
from mars_jax.rl.losses import LossConfig
from mars_jax.rl.rollout import RolloutConfig
from mars_jax.rl.streaming import (StreamSettings, auto_inflight_rows,
                                   auto_problems_per_update)
from mars_jax.rl.update import UpdateConfig
from mars_jax.sft.config import probe_settings
from mars_jax.sft.probe import ProbeSettings


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The training loop's own settings (`rl.trainer`): `total_steps` steps; `seed` seeds the
    rollouts and each step's mini-batch shuffle; the run stops after `max_nonfinite_updates`
    steps in a row with a non-finite update, and `preemption_grace_s` after SIGTERM; a trace of
    steps `profile_steps` = (first, last), () none; a checkpoint every `checkpoint_every` steps,
    the newest `checkpoint_keep` kept, saved in the background with `async_save`; the held-out
    probe on `probe_problems` problems every `probe_every` steps (0: never); `normalize_std`:
    GRPO advantages divided by their group's reward std (`samples.training_samples`);
    `rollout_devices` > 0: the rollout mesh on devices of its own (mesh.rollout.devices)."""

    total_steps: int
    seed: int
    max_nonfinite_updates: int
    preemption_grace_s: float
    profile_steps: tuple[int, ...]
    checkpoint_every: int
    checkpoint_keep: int
    async_save: bool
    probe_every: int
    probe_problems: int
    normalize_std: bool
    rollout_devices: int


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Every typed setting of a training run (`train_settings`)."""

    run: RunSettings
    rollout: RolloutConfig
    update: UpdateConfig
    learner: LearnerConfig
    stream: StreamSettings
    probe: ProbeSettings


def train_settings(config: ConfigDict) -> TrainSettings:
    """A training run's typed settings, built once at its start (after the processes joined:
    `stream_settings` splits a cap over them)."""
    return TrainSettings(run=run_settings(config), rollout=rollout_config(config),
                         update=update_program_config(config), learner=learner_config(config),
                         stream=stream_settings(config),
                         probe=probe_settings(config, config.eval.engine_slots))


def run_settings(config: ConfigDict) -> RunSettings:
    return RunSettings(
        total_steps=config.total_steps, seed=config.seed,
        max_nonfinite_updates=config.max_nonfinite_updates,
        preemption_grace_s=config.preemption_grace_s, profile_steps=tuple(config.profile_steps),
        checkpoint_every=config.checkpoint.every_steps, checkpoint_keep=config.checkpoint.keep,
        async_save=config.checkpoint.async_save, probe_every=config.eval.probe_every,
        probe_problems=config.eval.probe_problems, normalize_std=config.rollout.normalize_std,
        rollout_devices=config.mesh.rollout.devices)


def build_optimizer(config: ConfigDict) -> optax.GradientTransformation:
    """config.optimizer's optimizer; `decay_steps` 0: the run's optimizer updates
    (total_steps x learner.ppo_epochs x learner.mini_batches)."""
    decay = config.optimizer.decay_steps or (
        config.total_steps * config.learner.ppo_epochs * config.learner.mini_batches)
    return make_optimizer(**{**dict(config.optimizer), "decay_steps": decay})


def rollout_config(config: ConfigDict) -> RolloutConfig:
    r = config.rollout
    return RolloutConfig(
        group_size=r.group_size, fan_out=r.fan_out, selection=r.selection,
        verifier_selection=r.verifier_selection,
        max_stages=1 if r.roles_trained == "solver" else r.max_stages,
        max_new_tokens=dict(r.max_new_tokens), max_prompt_tokens=r.max_prompt_tokens,
        enable_thinking=r.enable_thinking, prompt_style=r.prompt_style,
        truncated_reward=r.truncated_reward, verify_truncated=r.verify_truncated)


# Fields of config.loss that are not `LossConfig` fields (they act outside the loss function).
_LOSS_OUTSIDE = ("pi_old", "mask_truncated")
_OPTIONAL_LOSS = ("clip_c", "behaviour_weight_cap", "mastered_mask_prob", "target_entropy",
                  "max_response_len")


def loss_config(config: ConfigDict) -> LossConfig:
    """config.loss as a `LossConfig`; 0 (or '') switches an optional term off (None)."""
    fields = {k: (None if v in ("", 0) and k in _OPTIONAL_LOSS else v)
              for k, v in config.loss.items() if k not in _LOSS_OUTSIDE}
    return LossConfig(**fields)


def update_program_config(config: ConfigDict) -> UpdateConfig:
    """The update program's static settings from config.loss, config.learner and the rollout
    temperature."""
    return UpdateConfig(loss=loss_config(config), temperature=config.rollout.temperature,
                        logits_chunk=config.learner.logits_chunk,
                        routing_replay=config.learner.routing_replay,
                        length_halvings=config.learner.length_halvings,
                        fine_cuts=config.learner.fine_cuts)


def learner_config(config: ConfigDict) -> LearnerConfig:
    learner = config.learner
    return LearnerConfig(ppo_epochs=learner.ppo_epochs, mini_batches=learner.mini_batches,
                         pi_old=config.loss.pi_old, offload_optimizer=learner.offload_optimizer,
                         micro_batch_size=learner.micro_batch_size,
                         min_length=learner.min_length,
                         min_micro_batches=learner.min_micro_batches, pack=learner.pack)


def stream_settings(config: ConfigDict) -> StreamSettings:
    """The rollout scheduler's settings for this process: `samples_per_update` is
    `rollout.samples_per_update` (0: `prompts_per_step * group_size`),
    `max_problems_per_update` (0: `streaming.auto_problems_per_update`), `max_inflight_rows` this
    host's share of `rollout.max_inflight_rows` (0: `streaming.auto_inflight_rows`)."""
    r = config.rollout
    cap = r.max_inflight_rows or auto_inflight_rows(rollout_config(config), r.prompts_per_step)
    return StreamSettings(
        mode=r.mode, prompts_per_step=r.prompts_per_step,
        samples_per_update=r.samples_per_update or r.prompts_per_step * r.group_size,
        max_problems_per_update=(r.max_problems_per_update
                                 or auto_problems_per_update(r.prompts_per_step)),
        max_inflight_rows=-(-cap // jax.process_count()),
        staleness_bound=r.staleness_bound, resume=r.resume,
        roles_trained=r.roles_trained, drop_zero_variance=r.drop_zero_variance,
        mask_truncated=config.loss.mask_truncated,
        sampling=dict(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
        chunks_per_round=r.exchange_chunks)


def micro_batch_problem(micro_batch_size: int, processes: int) -> Problem | None:
    """The problem of `learner.micro_batch_size` (rows per micro-batch over the whole training
    mesh, each of `processes` hosts building an equal share of them) when it does not split
    evenly over the hosts; None when it does."""
    if micro_batch_size % processes == 0:
        return None
    return Problem("learner.micro_batch_size",
                   f"{micro_batch_size} rows per micro-batch (over the whole training mesh) do "
                   f"not split evenly over {processes} processes (hosts), each of which builds "
                   "an equal share",
                   f"set it to a multiple of {processes}, e.g. "
                   f"{max(processes, micro_batch_size // processes * processes)}")


def micro_batch_split_problem(micro_batch_size: int, mesh: jax.sharding.Mesh,
                              processes: int) -> Problem | None:
    """The problem of `learner.micro_batch_size` when the training `mesh`'s batch axes (the
    current rules') cannot place each of `processes` hosts' equal share of its rows on that
    host's own devices (`distributed.batch_split`); None when they can. Checked once the meshes
    exist, before anything is collected."""
    split = distributed.batch_split(micro_batch_size, mesh)
    if split % processes == 0:
        return None
    fits = [rows for rows in range(processes, micro_batch_size + 2 * mesh.size + 1, processes)
            if distributed.batch_split(rows, mesh) % processes == 0]
    fix = (f"set it to a size the batch axes split over the hosts, e.g. "
           f"{min(fits, key=lambda rows: (abs(rows - micro_batch_size), rows))}" if fits else
           "lay the training mesh's batch axes (mesh.data, mesh.fsdp, mesh.expert) over the "
           "hosts")
    return Problem("learner.micro_batch_size",
                   f"{micro_batch_size} rows per micro-batch are split over {split} of the "
                   f"training mesh's {mesh.size} devices (the batch axes of {dict(mesh.shape)} "
                   f"that divide it), which does not give each of {processes} processes its own "
                   "rows", fix)
