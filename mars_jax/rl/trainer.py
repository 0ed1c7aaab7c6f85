"""The MarsRL training loop: rollouts -> agent-specific rewards -> group advantages -> update.

Each step is one `StreamingRollouts.collect` (one decode engine across steps,
`mars_jax.rl.streaming`, pipeline or sequential mode; `rollout.decode_engine` 'engine' or
'generate'), then an update on the groups it handed out, metrics, a checkpoint. On one shared
mesh engine and update share the same parameter arrays; the policy version is the number of steps
whose update changed the parameters (a step makes `learner.ppo_epochs * learner.mini_batches`
optimizer updates, `mars_jax.rl.learner`). The config is read through `mars_jax.rl.config`.
With `mesh.rollout.devices > 0` the engine runs on its own
submesh with its own copy of the weights (`weight_sync`, copied after every update, metrics
`sync/*`); in pipeline mode it keeps decoding while the update runs in a worker thread on the
training mesh (`StreamingRollouts.decode_while`), which runs programs on the training devices
only: its batches are built (and the hosts' joined) on the main thread before it starts.
With `eval.probe_every` > 0 each role's decisions are sampled on held-out problems
(`mars_jax.sft.probe`) before step 1 (a step-0 line) and after every `eval.probe_every`-th step.
Re-running the same command on the same workdir resumes from the newest readable checkpoint.
The workdir is a local path or a `gs://` URL (`mars_jax.storage`): metrics, TensorBoard logs,
checkpoints, the run's resolved config (`config.json`, written at start and compared on resume:
`config_diff`) and a `jax.profiler` trace of `profile_steps` (under `tensorboard/`).

Preemption (`mars_jax.preemption`): after SIGTERM the loops stop at their next check, agreed by
every host: between decode rounds (`StreamingRollouts`), between micro-batches of the update
(`learner.train_mini_batches`; their longest run time in a step is the metric
`time/micro_batch`, and sizes the watchdog); the loop also checks after each step. A host
stopped by another's notice arms its own watchdog. Stopped in step s, the run saves checkpoint s
with `steps_done` = s - 1 in its meta,
the train state from before step s's update (an update stopped half-way is redone:
`learner.UpdateStopped` hands back its starting state) and the queues to redo step s from: the
requests in flight as partial outputs and, once the rollouts are collected, the step's groups put
back as ready (`StreamingRollouts.state_dict(put_back=True)`), with the data position after them.
Then it raises `Preempted` (exit 75) within
`preemption_grace_s` of the signal (or the watchdog exits with 75). A resumed run starts at
step s. A checkpoint saved mid-step is replaced when its step is saved again (at its end, or
stopped again) only while another checkpoint exists (or at the last step), so a replacement cut
short never leaves none; otherwise it stays (a valid point to redo its step from).

Several processes (`experiments/run.py --num_processes=...`, or a detected TPU pod / Slurm job)
run one job on a global training mesh: each host draws its own problems and keeps its own rollout
queues. Each host decodes on an engine of its own over its own devices (all, or its
`mesh.rollout.devices`), with its own copy of the weights (`weight_sync.HostCopies`), and the
hosts agree on the update cadence through `distributed.HostGroup` (`rl/streaming.py`), so a
model's weights must fit one host's devices. The update
trains on all hosts' samples joined into one global batch (`distributed.global_train_batch`)
of `learner.micro_batch_size` rows per micro-batch in all, each host building an equal share;
checkpoints hold each host's data and queue state (`distributed.gather_process_meta`) and the
recorded routing of its queued rollouts as arrays (`distributed.host_arrays`). Rollout metrics
are per host (host 0: `metrics.jsonl`, host i: `host{i}/metrics.jsonl`); update metrics are
global.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
import tqdm
from etils import epath
from flax import nnx
from ml_collections import ConfigDict

from mars_jax import (builders, config_diff, console, distributed, memory_fit, offload,
                      preemption, sharding, storage, weight_sync)
from mars_jax.agents.eval_stats import confusion
from mars_jax.checkpoint import CONFIG_KEY, CheckpointMismatch, Checkpointer
from mars_jax.data.tokenizer import encode_chat, eos_token_ids
from mars_jax.errors import ConfigError
from mars_jax.metrics import MetricsWriter
from mars_jax.optimizer import make_optimizer
from mars_jax.profiling import StepProfiler
from mars_jax.rl.advantages import group_advantages_np
from mars_jax.rl.batching import TrainSample, empty_batch, make_batch
from mars_jax.rl import config as rl_config
from mars_jax.rl import queue_arrays
from mars_jax.rl.config import micro_batch_problem
from mars_jax.rl.learner import (LearnerConfig, UpdateStopped, split_mini_batches,
                                 summarize_updates, train_mini_batches)
from mars_jax.rl.rollout import AgenticRollouts, Rollout
from mars_jax.rl.streaming import StreamBatch, StreamingRollouts
from mars_jax.rl.update import init_train_state
from mars_jax.sampling import EngineSettings, batch_shards, make_engine
from mars_jax.sampling.config import engine_settings
from mars_jax.sft.config import probe_settings as eval_probe_settings
from mars_jax.sft.probe import probe_model
from mars_jax.types import TrainBatch

PREEMPTED_EXIT_CODE = preemption.EXIT_CODE
Preempted = preemption.Preempted  # raised after SIGTERM, once what can be saved is saved
STEPS_DONE_KEY = "steps_done"  # meta of a checkpoint saved mid-step: the steps it completed
UPDATE_THREAD = "update"  # the name of the thread that runs an update overlapped with decoding


class NonFiniteUpdates(RuntimeError):
    """Too many steps with non-finite updates in a row; the last good checkpoint is kept."""

    exit_code = 65  # EX_DATAERR: inspect metrics.jsonl, fix the config, rerun to resume


def role_metrics(groups: Sequence[list[Rollout]]) -> dict[str, float]:
    """Per role: mean reward and output tokens, the share of outputs cut off by their token
    budget (`truncated/`) and of groups whose every reward is <= 0 (`groups_all_wrong/`) or >= 1
    (`groups_all_right/`: with the other, the groups without gradient); the Verifier's accuracy
    (verdict right), recall (wrong solutions flagged Wrong), specificity, balanced accuracy,
    precision and pass rate (verdicts Correct: what lets the V-C loop accept), as in
    `mars_jax.agents.eval_stats`, and the share of its replies without a readable verdict, cut
    off or not (`verifier/no_verdict`: no reward whatever the solution)."""
    samples = [r for g in groups for r in g]
    metrics: dict[str, float] = {}
    share = lambda flags: float(np.mean(flags)) if flags else float("nan")
    for role in ("solver", "verifier", "corrector"):
        members = [r for r in samples if r.role == role]
        metrics[f"reward/{role}"] = share([r.reward for r in members])
        metrics[f"samples/{role}"] = len(members)
        metrics[f"length/{role}"] = share([len(r.response_ids) for r in members])
        metrics[f"truncated/{role}"] = share([r.finish_reason == "length" for r in members])
        role_groups = [g for g in groups if g and g[0].role == role]
        metrics[f"groups_all_wrong/{role}"] = share([max(r.reward for r in g) <= 0
                                                     for g in role_groups])
        metrics[f"groups_all_right/{role}"] = share([min(r.reward for r in g) >= 1
                                                     for g in role_groups])
    verifiers = [r for r in samples if r.role == "verifier"]
    verdicts = confusion((bool(r.judged_correct), r.verdict) for r in verifiers)
    metrics["verifier/accuracy"] = metrics["reward/verifier"]
    metrics["verifier/no_verdict"] = share([r.verdict is None for r in verifiers])
    for key in ("recall", "specificity", "balanced_accuracy", "precision", "pass_rate"):
        metrics[f"verifier/{key}"] = float(getattr(verdicts, key))
    return metrics


def training_samples(groups: Sequence[list[Rollout]], *, drop_zero_variance: bool,
                     normalize_std: bool, mask_truncated: bool = False) -> list[TrainSample]:
    """GRPO advantages within each (problem, role, parent) group, then one TrainSample each.

    Samples of zero-variance groups (advantage 0) are dropped, or with `drop_zero_variance=False`
    kept with a zero loss mask (same gradient, fixed batch shapes); either way they add nothing
    to the loss's normalisation. With `mask_truncated` an output that ended by length is left
    out of the batch (DAPO's overlong filtering) after it took part in its group's advantages."""
    if not groups:
        return []
    members = [r for g in groups for r in g]
    ids = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    result = group_advantages_np(np.array([r.reward for r in members], np.float32), ids,
                                 normalize_std=normalize_std)
    return [TrainSample(r.prompt_ids, r.response_ids, r.logprobs, float(a), r.expert_ids,
                        in_loss=not zero)
            for r, a, zero in zip(members, result.advantages, result.zero_variance)
            if not (drop_zero_variance and zero)
            and not (mask_truncated and r.finish_reason == "length")]


def _global_batch(samples: Sequence[TrainSample], config: ConfigDict, model_config,
                  mesh: jax.sharding.Mesh) -> TrainBatch:
    """This host's samples as a `TrainBatch` of its share of each micro-batch's
    `learner.micro_batch_size` rows (the rows over the whole training mesh, split evenly over
    the processes), joined with the other hosts' into one global batch of that many rows per
    micro-batch when several processes run (a host without samples contributes padding). A
    collective when several processes run: on the thread that owns every device (the main one)."""
    micro = config.learner.micro_batch_size // jax.process_count()  # divides: checked in _train
    min_length = config.learner.min_length
    if samples:
        batch = make_batch(samples, micro_batch_size=micro, min_length=min_length,
                           min_micro=config.learner.min_micro_batches, by_length=True,
                           pack=config.learner.pack)
    else:
        experts = ((model_config.num_hidden_layers, model_config.num_experts_per_tok)
                   if config.learner.routing_replay and model_config.num_experts else None)
        batch = empty_batch(micro_batch_size=micro, length=min_length, experts=experts,
                            pack=config.learner.pack)
    return batch if jax.process_count() == 1 else distributed.global_train_batch(batch, mesh)


def _build_stream(config: ConfigDict, engine: EngineSettings, rollouts: AgenticRollouts, model,
                  eos, problems, mesh: jax.sharding.Mesh, should_stop: Callable[[], bool]
                  ) -> StreamingRollouts:
    """The rollout scheduler on a fresh `engine` over `model` (whose arrays live on `mesh`, this
    host's rollout mesh); with several processes one per host, agreeing through a
    `distributed.HostGroup`."""
    with sharding.use_mesh(mesh):
        engine = make_engine(engine, model, eos, mesh=mesh)
    return StreamingRollouts(rollouts, engine, problems, rl_config.stream_settings(config),
                             stop_ids=eos, hosts=distributed.HostGroup("stream"),
                             should_stop=should_stop)


def _stream_metrics(batch: StreamBatch, stream: StreamingRollouts) -> dict[str, float]:
    return {"tokens_per_second": batch.generated_tokens / max(batch.seconds, 1e-9),
            "staleness/max": max(batch.staleness, default=0),
            "staleness/mean": float(np.mean(batch.staleness)) if batch.staleness else 0.0,
            "stream/occupancy": batch.occupancy, "stream/inflight": batch.inflight,
            "stream/problems_admitted": batch.problems_admitted,
            "stream/deferred_seconds": batch.deferred_seconds,
            "stream/sync_seconds": batch.sync_seconds,
            "rollouts/context_cuts": stream.rollouts.context_cuts,
            "rollouts/context_drops": stream.rollouts.context_drops,
            "time/rollout": batch.seconds}


def _check_resident_memory(config: ConfigDict, engine: EngineSettings, learner: LearnerConfig,
                           state, model_config, mesh: jax.sharding.Mesh,
                           rollout_mesh: jax.sharding.Mesh) -> None:
    """Refuses (ConfigError, exit 2) a run whose train state, engine weights and KV cache cannot
    all stay on a chip (`memory_fit`; where the backend reports its memory). Static batches
    (`engine.kind='generate'`) keep no KV cache between rounds; with the optimizer offloaded,
    decoding and the update are checked apart (`memory_fit.offloaded_phases`)."""
    kv = 0 if engine.kind == "generate" else memory_fit.engine_kv_bytes(
        engine, model_config, batch_shards(rollout_mesh))
    copy = ((state.params, weight_sync.rollout_shardings(state.params, rollout_mesh))
            if rollout_mesh is not mesh else None)
    phases = (memory_fit.offloaded_phases(state, copy, kv, rollout_mesh,
                                          kv_through_update=config.rollout.resume != "recompute")
              if learner.offload_optimizer
              else (memory_fit.resident(state, copy, kv, rollout_mesh),))
    for parts in phases:
        memory_fit.check(parts, memory_fit.device_memory(), shared=config.mesh.rollout.devices == 0)


def _weight_copier(params, mesh: jax.sharding.Mesh, rollout_mesh: jax.sharding.Mesh):
    """params -> (this host's engine copy, `weight_sync.Transfer`): on one process a
    `device_put` to the rollout mesh's shardings, on several `weight_sync.HostCopies`."""
    if jax.process_count() > 1:
        return weight_sync.HostCopies(params, mesh, rollout_mesh).copy
    shardings = weight_sync.rollout_shardings(params, rollout_mesh)
    return lambda current: weight_sync.copy_weights(current, shardings)


def _agreed_stop(notice: preemption.Notice) -> Callable[[], bool]:
    """`should_stop` for the update: whether any host's `notice` came, through a
    `distributed.HostGroup` (no device program: safe beside a decode on another thread)."""
    hosts = distributed.HostGroup("update")

    def should_stop() -> bool:
        stop = any(hosts.gather(notice()))
        if stop:
            notice.stop_agreed()
        return stop

    return should_stop


_ARRAYS = ("routing", "queue")  # a checkpoint's per-host arrays (`distributed.host_arrays`)


def _queue_meta(queue: dict, routing: dict) -> tuple[dict, dict]:
    """(this host's checkpoint meta for the scheduler's `queue` state, under "stream", and its
    `routing`; the arrays to save): token ids and log-probabilities as arrays (`queue_arrays`),
    the rest of the queue and the arrays' index in the meta. A collective
    (`distributed.host_arrays`)."""
    packed, arrays = queue_arrays.pack(queue)
    meta, saved = {"stream": packed}, {}
    for name, values in (("routing", routing), ("queue", queue_arrays.host_blocks(arrays))):
        meta[name], array = distributed.host_arrays(values)
        if array is not None:
            saved[name] = array
    return meta, saved


def _restore_queues(meta: dict, arrays: dict, decode: Callable[[list[int]], str]):
    """(the queue state, recorded routing by uid) of a restored checkpoint's meta (this host's)
    and arrays: the queue's token ids and log-probabilities read back from the arrays."""
    routing = (distributed.unpack_host_arrays(meta["routing"], arrays["routing"])
               if meta.get("routing") is not None else None)
    if "stream" not in meta:
        raise CheckpointMismatch("the checkpoint was written by the per-step rollout scheduler "
                                 "(rollout.scheduler='step'), which no longer exists: resume it "
                                 "with a mars_jax from before its removal, or start afresh")
    queue = meta["stream"]
    if meta.get("queue") is not None:
        blocks = distributed.unpack_host_arrays(meta["queue"], arrays["queue"])
        queue = queue_arrays.unpack(queue, queue_arrays.from_host_blocks(blocks), decode)
    return queue, routing


def train(config: ConfigDict, workdir: str, *, allow_config_change: Sequence[str] = ()
          ) -> dict[str, float]:
    """Trains for `config.total_steps` steps (resuming if `workdir` has checkpoints); returns the
    last step's metrics. A resume whose config changes fields of `config_diff.RESUME_FIELDS`
    not in `allow_config_change` raises `config_diff.ConfigChanged`.

    Raises `Preempted` after SIGTERM (final checkpoint saved), `NonFiniteUpdates` after
    `config.max_nonfinite_updates` steps in a row with a non-finite update (each such update
    is skipped; no checkpoint of the streak is saved, so the newest one is the last good state)
    and `CheckpointSaveError` when a save fails.
    """
    with preemption.catch_sigterm(config.preemption_grace_s) as notice:
        return _train(config, storage.path(workdir), notice, tuple(allow_config_change))


def _recorded_config(workdir_path: epath.Path) -> dict | None:
    """Process 0's `config_diff.read_record` of the workdir, the same on every host."""
    recorded = config_diff.read_record(workdir_path) if jax.process_index() == 0 else None
    return recorded if jax.process_count() == 1 else distributed.allgather_json(recorded)[0]


def _train(config: ConfigDict, workdir_path: epath.Path, notice: preemption.Notice,
           allow_config_change: tuple[str, ...] = ()) -> dict[str, float]:
    if problem := micro_batch_problem(config.learner.micro_batch_size, jax.process_count()):
        raise ConfigError([problem])
    workdir_path.mkdir(parents=True, exist_ok=True)
    mesh, rollout_mesh = builders.build_meshes(config)
    copied_weights = rollout_mesh is not mesh  # the engine decodes on a copy of the weights
    overlap = config.mesh.rollout.devices > 0 and config.rollout.mode == "pipeline"
    with sharding.use_mesh(mesh):
        model = builders.build_model(config, mesh)
    tokenizer = builders.build_tokenizer(config)
    problems = builders.build_problem_iterator(config)
    decay = config.optimizer.decay_steps or (  # 0: over the run's optimizer updates
        config.total_steps * config.learner.ppo_epochs * config.learner.mini_batches)
    optimizer = make_optimizer(**{**dict(config.optimizer), "decay_steps": decay})
    graphdef, _ = nnx.split(model, nnx.Param)
    state = distributed.replicate_scalars(init_train_state(model, optimizer), mesh)
    update_config = rl_config.update_program_config(config)
    ref_params = (jax.tree.map(lambda x: x.copy(), state.params)
                  if update_config.loss.needs_ref_logprobs else None)
    rollouts = AgenticRollouts(tokenizer, rl_config.rollout_config(config), seed=config.seed,
                               encode=encode_chat)
    checkpointer = Checkpointer(workdir_path / "checkpoints", keep=config.checkpoint.keep,
                                async_save=config.checkpoint.async_save,
                                config=config_diff.record(config))
    learner = rl_config.learner_config(config)
    start, nonfinite_streak, version, saved_stream = 0, 0, 0, None
    recorded = _recorded_config(workdir_path)
    restored = checkpointer.restore_latest(state, arrays_target=lambda saved: {
        name: distributed.host_arrays_target(index)
        for name, index in distributed.local_process_meta(saved).items()
        if name in _ARRAYS and index is not None},
        check_meta=lambda step, saved: config_diff.check_resume(
            saved.get(CONFIG_KEY) if recorded is None else recorded, config, step=step,
            allowed=allow_config_change))
    if jax.process_index() == 0:  # the run's record, once a resume accepted this config
        config_diff.write_record(workdir_path, config)
    model_config = model.config
    del model  # a restored run must not keep the initial weights alive beside the restored ones
    if restored is not None:
        start, state, saved, arrays = restored
        meta = distributed.local_process_meta(saved)
        start = meta.get(STEPS_DONE_KEY, start)  # saved mid-step: that step is redone
        problems.set_state(meta["data"])
        queue, routing = _restore_queues(
            meta, arrays or {}, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        saved_stream = (queue, routing)
        nonfinite_streak = meta["nonfinite_streak"]
        version = meta.get("policy_version", int(state.step))  # absent in older checkpoints
        console.note(f"resumed from step {start}")
    # Rollout metrics are this host's; host 0 writes workdir/metrics.jsonl, host i workdir/host{i}/.
    host = jax.process_index()
    host_dir = workdir_path / f"host{host}" if host else workdir_path
    writer = MetricsWriter(host_dir, resume_step=start if restored is not None else -1)
    profiler = StepProfiler(config.profile_steps, host_dir / "tensorboard")
    eos = eos_token_ids(tokenizer)
    metrics: dict[str, float] = {}
    engine = engine_settings(config, rollout_mesh)
    _check_resident_memory(config, engine, learner, state, model_config, mesh, rollout_mesh)
    policy = nnx.merge(graphdef, state.params)
    if copied_weights:
        copy_weights = _weight_copier(state.params, mesh, rollout_mesh)
        policy = weight_sync.rollout_model(graphdef, copy_weights(state.params)[0])
    stream = _build_stream(config, engine, rollouts, policy, eos, problems, rollout_mesh, notice)
    if saved_stream is not None:
        stream.load_state_dict(*saved_stream)
    probe_every = config.eval.probe_every
    probe_problems = (builders.load_eval_records(config, config.eval.probe_problems)
                      if probe_every else [])
    probe_settings = eval_probe_settings(config, config.eval.engine_slots)

    def held_out_probe(params) -> dict[str, float]:
        t = time.perf_counter()
        with sharding.use_mesh(mesh):
            decisions = probe_model(nnx.merge(graphdef, params), tokenizer, probe_problems,
                                    probe_settings)
        return {**decisions, "time/probe": time.perf_counter() - t}

    if probe_every and start == 0:
        writer.write(0, held_out_probe(state.params))
    update_stop = _agreed_stop(notice)

    def save(number: int, state, data: dict, queue: dict, routing: dict, *, steps_done=None,
             must: bool = True) -> bool:
        """Starts saving checkpoint `number` (a collective); `steps_done` when saved mid-step.
        A checkpoint `number` already there (saved mid-step) is replaced only while another
        exists, or when the save `must` happen; returns whether it saved."""
        existing = checkpointer.steps()
        if number in existing:
            if len(existing) < 2 and not must:
                return False
            checkpointer.delete(number)
        queue_meta, arrays = _queue_meta(queue, routing)
        extra = {} if steps_done is None else {STEPS_DONE_KEY: steps_done}
        checkpointer.save(number, state, distributed.gather_process_meta({
            "data": data, **queue_meta, "nonfinite_streak": nonfinite_streak,
            "policy_version": version, **extra}), arrays=arrays or None)
        return True

    def save_stopped(step: int, state, put_back: bool) -> str:
        """Saves a checkpoint to redo `step` from (module docstring); returns what happened,
        for `Preempted`."""
        what = f"SIGTERM in step {step}"
        if nonfinite_streak:
            return (f"{what}; no checkpoint during {nonfinite_streak} non-finite updates, the "
                    "last good one is kept")
        queue, routing = stream.state_dict(put_back), stream.routing(put_back)
        if not save(step, state, problems.get_state(), queue, routing, steps_done=step - 1,
                    must=False):
            return f"{what}; checkpoint {step} (from earlier in the step) kept"
        checkpointer.wait()
        return f"{what}; checkpoint {step} saved to redo the step from"

    bar = tqdm.tqdm(range(start + 1, config.total_steps + 1), initial=start,
                    total=config.total_steps, desc="marsrl", disable=jax.process_index() != 0)
    try:
        for step in bar:
            profiler.before(step)
            try:
                if learner.offload_optimizer:  # on the host while the engine decodes
                    state, ref_params = offload.move_update_state(state, ref_params, "host")
                batch = stream.collect(version)
                groups = batch.groups
                metrics = role_metrics(batch.all_groups)
                metrics.update(_stream_metrics(batch, stream))
                t1 = time.perf_counter()
                if learner.offload_optimizer:  # back for the update (and the checkpoint)
                    stream.free_kv()  # into the KV cache's room where nothing is lost
                    state, ref_params = offload.move_update_state(state, ref_params, "device")
                samples = training_samples(
                    groups, drop_zero_variance=config.rollout.drop_zero_variance,
                    normalize_std=config.rollout.normalize_std,
                    mask_truncated=config.loss.mask_truncated)
                metrics["samples/trained"] = len(samples)
                history, micro_seconds = None, []

                def micro_batch_done(seconds: float) -> None:
                    micro_seconds.append(seconds)
                    notice.measured(seconds)  # sizes the watchdog

                if distributed.any_process(bool(samples)):
                    # Built here, not on the update's thread: joining the hosts' batches runs
                    # programs on every device, the rollout ones included (launch/README.md).
                    with sharding.use_mesh(mesh):
                        batches = split_mini_batches(
                            samples, learner, np.random.default_rng([config.seed, step]),
                            lambda part: _global_batch(part, config, model_config, mesh))

                    def update(state=state, batches=batches):
                        with sharding.use_mesh(mesh):
                            return train_mini_batches(
                                state, batches, ref_params=ref_params, graphdef=graphdef,
                                optimizer=optimizer, update_config=update_config,
                                learner=learner, should_stop=update_stop,
                                micro_batch_seconds=micro_batch_done)

                    if overlap:  # decode on the rollout devices during the update
                        with concurrent.futures.ThreadPoolExecutor(
                                1, thread_name_prefix=UPDATE_THREAD) as pool:
                            running = pool.submit(update)
                            stream.decode_while(lambda: not running.done(), version)
                            state, history = running.result()
                    else:
                        state, history = update()
            except preemption.Stopped as stopped:
                notice.stop_agreed()
                if isinstance(stopped, UpdateStopped):
                    state = stopped.state
                elif learner.offload_optimizer:
                    state, ref_params = offload.move_update_state(state, ref_params, "device")
                raise Preempted(save_stopped(step, state,
                                             put_back=isinstance(stopped, UpdateStopped))
                                ) from None
            if micro_seconds:
                metrics["time/micro_batch"] = max(micro_seconds)
            if history is not None:
                update_metrics = summarize_updates(history)
                metrics.update({f"update/{k}": v for k, v in update_metrics.items()})
                if update_metrics["optimizer_steps"] > 0:
                    version += 1
                    if copied_weights:
                        copied, transfer = copy_weights(state.params)
                        stream.weights_updated(weight_sync.rollout_model(graphdef, copied),
                                               version)
                        metrics.update({"sync/seconds": transfer.seconds,
                                        "sync/bytes": transfer.bytes,
                                        "sync/bytes_per_device": transfer.bytes_per_device})
                    else:
                        stream.weights_updated(nnx.merge(graphdef, state.params), version)
                elif not copied_weights:  # the same weights in the arrays the update returned:
                    # it donated those the engine decodes with
                    stream.engine.update_weights(nnx.merge(graphdef, state.params))
                finite = update_metrics["finite"] > 0
                nonfinite_streak = 0 if finite else nonfinite_streak + 1
                if not finite:
                    logging.warning("step %d: non-finite loss or gradient in %d of %d updates, "
                                    "those skipped (%d such steps in a row)", step,
                                    update_metrics["updates"] - update_metrics["optimizer_steps"],
                                    update_metrics["updates"], nonfinite_streak)
            metrics["update/nonfinite_streak"] = nonfinite_streak
            metrics["time/update"] = time.perf_counter() - t1
            metrics["policy_version"] = version
            if probe_every and step % probe_every == 0:
                metrics.update(held_out_probe(state.params))
            writer.write(step, metrics)
            profiler.after(step)
            bar.set_postfix(console.postfix(metrics))
            if nonfinite_streak >= config.max_nonfinite_updates:
                raise NonFiniteUpdates(f"{nonfinite_streak} steps with non-finite updates in a "
                                       f"row at step {step}; the last good checkpoint is kept")
            preempted = distributed.any_process(notice())
            if preempted:
                notice.stop_agreed()
            saved = False
            if nonfinite_streak == 0 and (step % config.checkpoint.every_steps == 0
                                          or step == config.total_steps or preempted):
                saved = save(step, state, problems.get_state(), stream.state_dict(),
                             stream.routing(), must=step == config.total_steps)
            if preempted and step < config.total_steps:
                checkpointer.wait()
                raise Preempted(f"SIGTERM at step {step}; " + (
                    "checkpoint saved" if saved else
                    f"no checkpoint during {nonfinite_streak} non-finite updates, the last good "
                    "one is kept" if nonfinite_streak else
                    f"checkpoint {step} (from earlier in the step) kept"))
    finally:
        profiler.close()
        writer.close()
        bar.close()
        checkpointer.close()  # raises CheckpointSaveError if the last save failed
    return metrics
