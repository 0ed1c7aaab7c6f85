"""Typed settings built from a run's `ml_collections` config: rollouts, loss, update program,
learner, the rollout scheduler's keyword options (`stream_options`, a plain dict), the decode
engines and the held-out probe. It is not the config's only reader: `rl.trainer` still reads some
fields (e.g. `learner.offload_optimizer`) from the `ConfigDict`, as do `builders`, `memory_fit`
and `config_validation`."""
from __future__ import annotations

import jax
from ml_collections import ConfigDict

from mars_jax.rl.learner import LearnerConfig
from mars_jax.rl.losses import LossConfig
from mars_jax.rl.rollout import RolloutConfig
from mars_jax.rl.streaming import auto_inflight_rows
from mars_jax.rl.update import UpdateConfig
from mars_jax.sampling import EngineSettings, batch_shards
from mars_jax.sft.probe import ProbeSettings

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
    return LearnerConfig(ppo_epochs=config.learner.ppo_epochs,
                         mini_batches=config.learner.mini_batches, pi_old=config.loss.pi_old)


def stream_options(config: ConfigDict) -> dict:
    """`StreamingRollouts`' keyword settings (all but its collaborators) for this process:
    `max_inflight_rows` is this host's share of `rollout.max_inflight_rows` (0:
    `streaming.auto_inflight_rows`)."""
    r = config.rollout
    cap = r.max_inflight_rows or auto_inflight_rows(rollout_config(config), r.prompts_per_step)
    return dict(mode=r.mode, prompts_per_step=r.prompts_per_step,
                samples_per_update=r.samples_per_update or r.prompts_per_step * r.group_size,
                max_inflight_rows=-(-cap // jax.process_count()),
                staleness_bound=r.staleness_bound, resume=r.resume,
                roles_trained=r.roles_trained, drop_zero_variance=r.drop_zero_variance,
                mask_truncated=config.loss.mask_truncated,
                sampling=dict(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
                chunks_per_round=r.exchange_chunks)


def engine_shape(config: ConfigDict, mesh=None) -> tuple[int, int]:
    """(slots, positions per slot) of a config's engine: `rollout.engine_slots` (0: 16) rounded
    up to the mesh's batch shards; the longest prompt plus the largest budget."""
    r = config.rollout
    multiple = batch_shards(mesh)
    slots = r.engine_slots or 16
    return (-(-slots // multiple) * multiple,
            r.max_prompt_tokens + max(dict(r.max_new_tokens).values()))


def _engine_options(config: ConfigDict) -> dict:
    r = config.rollout
    return dict(chunk_steps=r.engine_chunk_steps, admit_batch=r.engine_admit_batch,
                prefill_ahead=r.engine_prefill_ahead, kv_pages=r.engine_kv_pages or None,
                page_size=r.engine_page_size, paged_attention=r.engine_paged_attention)


def engine_settings(config: ConfigDict, mesh=None) -> EngineSettings:
    """The rollout decode engine on `mesh` (its rollout mesh): one base seed for the whole run
    (a request's key depends only on it and the rollout's sequence seed)."""
    r = config.rollout
    slots, length = engine_shape(config, mesh)
    return EngineSettings(
        kind=r.decode_engine, seed=(config.seed * 1_000_003) % (1 << 32), slots=slots,
        max_length=length, record_routing=config.learner.routing_replay,
        options=_engine_options(config), precompile=bool(r.engine_precompile),
        max_prompt_tokens=r.max_prompt_tokens, max_rows=r.max_decode_rows)


def eval_engine_settings(config: ConfigDict, slots: int) -> EngineSettings:
    """The in-process evaluation's and probe's engine: `slots` > 0 slots with the rollout
    engine's options (paged KV, chunking, ...), else static batches; `seed` the run's."""
    length = config.rollout.max_prompt_tokens + max(dict(config.eval.max_new_tokens).values())
    if not slots:
        return EngineSettings(kind="generate", seed=config.seed,
                              max_rows=config.rollout.max_decode_rows)
    return EngineSettings(kind="engine", seed=config.seed, slots=slots, max_length=length,
                          options=_engine_options(config))


def probe_settings(config: ConfigDict, slots: int) -> ProbeSettings:
    """The held-out probe at the `eval` section's sampling settings and budgets, on
    `eval_engine_settings(config, slots)`."""
    e = config.eval
    return ProbeSettings(temperature=e.temperature, top_p=e.top_p, seed=config.seed,
                         max_new_tokens=dict(e.max_new_tokens), style=config.rollout.prompt_style,
                         engine=eval_engine_settings(config, slots))
