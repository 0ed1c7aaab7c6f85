"""The MarsRL training loop: rollouts -> agent-specific rewards -> group advantages -> update.

Each step (`_Run`) runs four phases: collect (`StreamingRollouts.collect`, on one decode engine
that lives across steps: `rl.streaming`), update (`learner.train_mini_batches` on the samples of
the groups handed out: `rl.samples`), publish the weights (`rl.publisher`: the engine decodes
the update's own arrays on one shared mesh, or a copy on its own submesh with
`mesh.rollout.devices > 0`, metrics `sync/*`) and checkpoint. The policy version counts the steps
whose update changed the parameters. In pipeline mode on a rollout submesh the engine keeps
decoding while the update runs in a thread named `update`, which runs programs on the training
devices only: its batches are built, and the hosts' joined, on the main thread first. With
`eval.probe_every` > 0 each role's decisions are probed on held-out problems (`sft.probe`) before
step 1 (a step-0 line) and after every `eval.probe_every`-th step.

The workdir (a local path or a `gs://` URL: `mars_jax.storage`) holds the metrics, TensorBoard
logs, checkpoints, the resolved config (`config.json`, compared on resume: `config_diff`) and the
trace of `profile_steps`. Rerunning the command on it resumes from the newest readable checkpoint.

Preemption (`mars_jax.preemption`): after SIGTERM every host stops at the next check they agree
on: between decode rounds, between micro-batches of the update (the longest of a step,
`time/micro_batch`, sizes the watchdog; a host stopped by another's notice arms its own) or after
a step. Stopped in step s, the run saves checkpoint s with `steps_done` = s - 1: the train state
from before the update (`UpdateStopped` hands it back) and the queues to redo step s from (the
requests in flight as partial outputs; once collected, the step's groups put back as ready). It
then raises `Preempted` (exit 75) within `preemption_grace_s`. A checkpoint saved mid-step is
replaced only while another exists (or at the last step), so a replacement cut short never leaves
none.

Several processes run one job on a global training mesh: each host draws its own problems and
decodes on its own devices with its own copy of the weights (`weight_sync.HostCopies`: a model
must fit one host), agreeing on the update cadence through `distributed.HostGroup`. The update
trains on all hosts' samples as one global batch (`distributed.global_train_batch`), each host
building an equal share of the `learner.micro_batch_size` rows. Checkpoints hold each host's data
and queue state. Rollout metrics are per host (host 0: `metrics.jsonl`, host i:
`host{i}/metrics.jsonl`); update metrics are global.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
import optax
import tqdm
from etils import epath
from flax import nnx
from ml_collections import ConfigDict

from mars_jax import (builders, config_diff, console, distributed, memory_fit, offload,
                      preemption, sharding, storage, weight_sync)
from mars_jax.agents.eval_stats import confusion
from mars_jax.checkpoint import CONFIG_KEY, CheckpointMismatch, Checkpointer
from mars_jax.errors import ConfigError
from mars_jax.data.iterator import ProblemIterator
from mars_jax.data.tokenizer import encode_chat, eos_token_ids
from mars_jax.metrics import MetricsWriter
from mars_jax.profiling import StepProfiler
from mars_jax.rl.batching import TrainSample, empty_batch, make_batch
from mars_jax.rl import config as rl_config
from mars_jax.rl import queue_arrays, update_fit
from mars_jax.rl.config import micro_batch_problem
from mars_jax.rl.learner import (LearnerConfig, UpdateStopped, split_mini_batches,
                                 summarize_updates, train_mini_batches)
from mars_jax.rl.rollout import AgenticRollouts, Rollout
from mars_jax.rl.publisher import WeightPublisher
from mars_jax.rl.samples import training_samples
from mars_jax.rl.streaming import StreamBatch, StreamingRollouts, StreamSettings
from mars_jax.rl.update import TrainState, UpdateConfig, init_train_state
from mars_jax.sampling import EngineSettings, batch_shards, make_engine
from mars_jax.sampling.config import engine_settings
from mars_jax.sft.probe import ProbeSettings, probe_model
from mars_jax.types import ROLES, TrainBatch

PREEMPTED_EXIT_CODE = preemption.EXIT_CODE
Preempted = preemption.Preempted  # raised after SIGTERM, once what can be saved is saved
STEPS_DONE_KEY = "steps_done"  # meta of a checkpoint saved mid-step: the steps it completed
UPDATE_THREAD = "update"  # the name of the thread that runs an update overlapped with decoding


class NonFiniteUpdates(RuntimeError):
    """Too many steps with non-finite updates in a row; the last good checkpoint is kept."""

    exit_code = 65  # EX_DATAERR: inspect metrics.jsonl, fix the config, rerun to resume


def role_metrics(groups: Sequence[list[Rollout]]) -> dict[str, float]:
    """Per role: mean reward and output tokens, the share of outputs cut off by their budget
    (`truncated/`) and of groups without gradient (`groups_all_wrong/`: every reward <= 0,
    `groups_all_right/`: >= 1); the Verifier's verdict statistics (`agents.eval_stats`: accuracy,
    recall, specificity, balanced accuracy, precision, pass rate) and the share of its replies
    without a readable verdict (`verifier/no_verdict`)."""
    samples = [r for g in groups for r in g]
    metrics: dict[str, float] = {}
    share = lambda flags: float(np.mean(flags)) if flags else float("nan")
    for role in ROLES:
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


def _global_batch(samples: Sequence[TrainSample], learner: LearnerConfig,
                  experts: tuple[int, int] | None, mesh: jax.sharding.Mesh) -> TrainBatch:
    """This host's samples as a `TrainBatch` of its share of each micro-batch's
    `learner.micro_batch_size` rows (the rows over the whole training mesh, split evenly over
    the processes), joined with the other hosts' into one global batch of that many rows per
    micro-batch when several processes run (a host without samples contributes padding, with
    routing of `experts` = (MoE layers, experts per token) where replayed). A collective when
    several processes run: on the thread that owns every device (the main one)."""
    micro = learner.micro_batch_size // jax.process_count()  # divides: checked in _start
    if samples:
        batch = make_batch(samples, micro_batch_size=micro, min_length=learner.min_length,
                           min_micro=learner.min_micro_batches, by_length=True,
                           pack=learner.pack)
    else:
        batch = empty_batch(micro_batch_size=micro, length=learner.min_length, experts=experts,
                            pack=learner.pack)
    return batch if jax.process_count() == 1 else distributed.global_train_batch(batch, mesh)


def _build_stream(settings: StreamSettings, engine: EngineSettings, rollouts: AgenticRollouts,
                  model, eos, problems, mesh: jax.sharding.Mesh, should_stop: Callable[[], bool]
                  ) -> StreamingRollouts:
    """The rollout scheduler on a fresh `engine` over `model` (whose arrays live on `mesh`, this
    host's rollout mesh); with several processes one per host, agreeing through a
    `distributed.HostGroup`."""
    with sharding.use_mesh(mesh):
        engine = make_engine(engine, model, eos, mesh=mesh)
    return StreamingRollouts(rollouts, engine, problems, settings, stop_ids=eos,
                             hosts=distributed.HostGroup("stream"), should_stop=should_stop)


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


def _check_resident_memory(settings: rl_config.TrainSettings, engine: EngineSettings, state,
                           model_config, mesh: jax.sharding.Mesh,
                           rollout_mesh: jax.sharding.Mesh) -> int:
    """Refuses (ConfigError, exit 2) a run whose train state, engine weights and KV cache cannot
    all stay on a chip (`memory_fit`; where the backend reports its memory). Static batches
    (`engine.kind='generate'`) keep no KV cache between rounds; with the optimizer offloaded,
    decoding and the update are checked apart (`memory_fit.offloaded_phases`). Returns the
    bytes of KV cache a training chip keeps through the update (0 on a split mesh)."""
    kv = 0 if engine.kind == "generate" else memory_fit.engine_kv_bytes(
        engine, model_config, batch_shards(rollout_mesh))
    copy = ((state.params, weight_sync.rollout_shardings(state.params, rollout_mesh))
            if rollout_mesh is not mesh else None)
    kv_through_update = settings.stream.resume != "recompute"
    phases = (memory_fit.offloaded_phases(state, copy, kv, rollout_mesh,
                                          kv_through_update=kv_through_update)
              if settings.learner.offload_optimizer
              else (memory_fit.resident(state, copy, kv, rollout_mesh),))
    shared = settings.run.rollout_devices == 0
    for parts in phases:
        memory_fit.check(parts, memory_fit.device_memory(), shared=shared)
    return phases[-1].kv_cache if shared else 0


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
    last step's metrics. The typed settings are built from `config` here, once
    (`rl_config.train_settings`); the config itself reaches only the builders of the meshes,
    model, tokenizer, problems, engine and optimizer, and the config record. A resume whose
    config changes fields of `config_diff.RESUME_FIELDS` not in `allow_config_change` raises
    `config_diff.ConfigChanged`.

    Raises `Preempted` after SIGTERM (final checkpoint saved), `NonFiniteUpdates` after
    `config.max_nonfinite_updates` steps in a row with a non-finite update (each such update
    is skipped; no checkpoint of the streak is saved, so the newest one is the last good state)
    and `CheckpointSaveError` when a save fails.
    """
    settings = rl_config.train_settings(config)
    with preemption.catch_sigterm(settings.run.preemption_grace_s) as notice:
        run, start = _start(config, settings, storage.path(workdir), notice,
                            tuple(allow_config_change))
        return run.train(start)  # nothing of the set-up kept alive but what the run holds


def _recorded_config(workdir_path: epath.Path) -> dict | None:
    """Process 0's `config_diff.read_record` of the workdir, the same on every host."""
    recorded = config_diff.read_record(workdir_path) if jax.process_index() == 0 else None
    return recorded if jax.process_count() == 1 else distributed.allgather_json(recorded)[0]


class _Resumed(NamedTuple):
    """Where a run starts: step, train state, the scheduler's saved state, counters."""

    start: int
    state: TrainState
    stream: tuple[dict, dict | None] | None
    nonfinite_streak: int
    version: int
    restored: bool


def _restore(config: ConfigDict, workdir_path: epath.Path, checkpointer: Checkpointer, state,
             problems, tokenizer, allow_config_change: tuple[str, ...]) -> _Resumed:
    """The newest readable checkpoint (config changes checked: `config_diff.check_resume`), or a
    fresh start; writes the run's config record once a resume accepted it."""
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
    return _Resumed(start, state, saved_stream, nonfinite_streak, version, restored is not None)


def _held_out_probe(problems: list[dict], settings: ProbeSettings, mesh: jax.sharding.Mesh,
                    graphdef, tokenizer) -> Callable[[nnx.State], dict[str, float]]:
    """params -> each role's decisions on the held-out `problems` (`sft.probe`), timed."""

    def held_out_probe(params) -> dict[str, float]:
        t = time.perf_counter()
        with sharding.use_mesh(mesh):
            decisions = probe_model(nnx.merge(graphdef, params), tokenizer, problems, settings)
        return {**decisions, "time/probe": time.perf_counter() - t}

    return held_out_probe


def _start(config: ConfigDict, settings: rl_config.TrainSettings, workdir_path: epath.Path,
           notice: preemption.Notice, allow_config_change: tuple[str, ...]) -> tuple[_Run, int]:
    """The run, resumed where `workdir_path` has a checkpoint, and the steps it has done."""
    run_settings, learner, update_config = settings.run, settings.learner, settings.update
    if problem := micro_batch_problem(learner.micro_batch_size, jax.process_count()):
        raise ConfigError([problem])
    workdir_path.mkdir(parents=True, exist_ok=True)
    mesh, rollout_mesh = builders.build_meshes(config)
    with sharding.use_mesh(mesh):  # the rules the update's batches are placed with
        if problem := rl_config.micro_batch_split_problem(learner.micro_batch_size, mesh,
                                                          jax.process_count()):
            raise ConfigError([problem])
        model = builders.build_model(config, mesh)
    tokenizer = builders.build_tokenizer(config)
    problems = builders.build_problem_iterator(config)
    optimizer = rl_config.build_optimizer(config)
    graphdef, _ = nnx.split(model, nnx.Param)
    state = distributed.replicate_scalars(init_train_state(model, optimizer), mesh)
    ref_params = (jax.tree.map(lambda x: x.copy(), state.params)
                  if update_config.loss.needs_ref_logprobs else None)
    rollouts = AgenticRollouts(tokenizer, settings.rollout, seed=run_settings.seed,
                               encode=encode_chat)
    checkpointer = Checkpointer(workdir_path / "checkpoints", keep=run_settings.checkpoint_keep,
                                async_save=run_settings.async_save,
                                config=config_diff.record(config))
    resumed = _restore(config, workdir_path, checkpointer, state, problems, tokenizer,
                       allow_config_change)
    model_config = model.config
    # a restored run must not keep the initial weights alive beside the restored ones
    del model, state
    # Rollout metrics are this host's; host 0 writes workdir/metrics.jsonl, host i workdir/host{i}/.
    host = jax.process_index()
    host_dir = workdir_path / f"host{host}" if host else workdir_path
    writer = MetricsWriter(host_dir, resume_step=resumed.start if resumed.restored else -1)
    profiler = StepProfiler(run_settings.profile_steps, host_dir / "tensorboard")
    eos = eos_token_ids(tokenizer)
    engine = engine_settings(config, rollout_mesh)
    held = _check_resident_memory(settings, engine, resumed.state, model_config, mesh,
                                  rollout_mesh)
    experts = ((model_config.num_hidden_layers, model_config.num_experts_per_tok)
               if update_config.routing_replay and model_config.num_experts else None)
    if jax.default_backend() != "cpu":  # on CPU the memory is the host's: nothing to learn
        shape = update_fit.update_shape(settings.learner, settings.rollout, settings.stream)
        update_fit.check(shape, settings.learner, resumed.state, ref_params, mesh,
                         graphdef=graphdef, update_config=update_config, experts=experts,
                         limit=memory_fit.device_memory(), held=held)
    publisher = WeightPublisher(graphdef, resumed.state.params, mesh, rollout_mesh)
    policy = publisher.first_model(resumed.state.params)
    stream = _build_stream(settings.stream, engine, rollouts, policy, eos, problems,
                           rollout_mesh, notice)
    if resumed.stream is not None:
        stream.load_state_dict(*resumed.stream)
    probe_problems = (builders.load_eval_records(config, run_settings.probe_problems)
                      if run_settings.probe_every else [])
    held_out_probe = _held_out_probe(probe_problems, settings.probe, mesh, graphdef, tokenizer)
    if run_settings.probe_every and resumed.start == 0:
        writer.write(0, held_out_probe(resumed.state.params))
    run = _Run(settings=run_settings, notice=notice, mesh=mesh,
               overlap=run_settings.rollout_devices > 0 and settings.stream.mode == "pipeline",
               graphdef=graphdef, optimizer=optimizer, update_config=update_config,
               learner=learner, experts=experts, problems=problems, stream=stream,
               publisher=publisher, checkpointer=checkpointer, writer=writer, profiler=profiler,
               held_out_probe=held_out_probe, update_stop=_agreed_stop(notice),
               state=resumed.state, ref_params=ref_params, version=resumed.version,
               nonfinite_streak=resumed.nonfinite_streak)
    return run, resumed.start


@dataclasses.dataclass
class _Run:
    """A run's steps, each in phases: collect (`_collect`), update (`_update`), publish the
    weights (`_publish`), checkpoint (`_checkpoint`); and what those phases share."""

    settings: rl_config.RunSettings
    notice: preemption.Notice
    mesh: jax.sharding.Mesh
    overlap: bool            # the update in a thread while the rollout devices decode
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    update_config: UpdateConfig
    learner: LearnerConfig
    experts: tuple[int, int] | None  # (MoE layers, experts per token) of replayed routing
    problems: ProblemIterator
    stream: StreamingRollouts
    publisher: WeightPublisher
    checkpointer: Checkpointer
    writer: MetricsWriter
    profiler: StepProfiler
    held_out_probe: Callable[[nnx.State], dict[str, float]]
    update_stop: Callable[[], bool]
    state: TrainState
    ref_params: nnx.State | None
    version: int             # the policy version: steps whose update changed the parameters
    nonfinite_streak: int

    def train(self, start: int) -> dict[str, float]:
        """Steps `start + 1` to `settings.total_steps`; returns the last step's metrics."""
        settings, metrics = self.settings, {}
        bar = tqdm.tqdm(range(start + 1, settings.total_steps + 1), initial=start,
                        total=settings.total_steps, desc="marsrl",
                        disable=jax.process_index() != 0)
        try:
            for step in bar:
                self.profiler.before(step)
                metrics = self._step(step)
                self.profiler.after(step)
                bar.set_postfix(console.postfix(metrics))
                if self.nonfinite_streak >= settings.max_nonfinite_updates:
                    raise NonFiniteUpdates(f"{self.nonfinite_streak} steps with non-finite "
                                           f"updates in a row at step {step}; the last good "
                                           "checkpoint is kept")
                self._checkpoint(step)
        finally:
            self.profiler.close()
            self.writer.close()
            bar.close()
            self.checkpointer.close()  # raises CheckpointSaveError if the last save failed
        return metrics

    def _step(self, step: int) -> dict[str, float]:
        """Collect, update, publish; writes and returns the step's metrics."""
        try:
            groups, metrics = self._collect()
            t1 = time.perf_counter()
            history = self._update(step, groups, metrics)
        except preemption.Stopped as stopped:
            raise Preempted(self._stopped(step, stopped)) from None
        if history is not None:
            update_metrics = summarize_updates(history)
            metrics.update({f"update/{k}": v for k, v in update_metrics.items()})
            metrics.update(self._publish(update_metrics["optimizer_steps"] > 0))
            self._count_nonfinite(step, update_metrics)
        metrics["update/nonfinite_streak"] = self.nonfinite_streak
        metrics["time/update"] = time.perf_counter() - t1
        metrics["policy_version"] = self.version
        probe_every = self.settings.probe_every
        if probe_every and step % probe_every == 0:
            metrics.update(self.held_out_probe(self.state.params))
        self.writer.write(step, metrics)
        return metrics

    def _collect(self) -> tuple[list[list[Rollout]], dict[str, float]]:
        """Decodes until an update is due: (the groups to train, the rollout metrics)."""
        if self.learner.offload_optimizer:  # on the host while the engine decodes
            self.state, self.ref_params = offload.move_update_state(
                self.state, self.ref_params, "host")
        batch = self.stream.collect(self.version)
        metrics = role_metrics(batch.all_groups)
        metrics.update(_stream_metrics(batch, self.stream))
        return batch.groups, metrics

    def _update(self, step: int, groups: list[list[Rollout]], metrics: dict[str, float]
                ) -> list[dict] | None:
        """Trains on `groups` (in a thread named `UPDATE_THREAD` while the rollout
        devices decode, with `overlap`); the update's history, None when no host had samples."""
        mesh = self.mesh
        if self.learner.offload_optimizer:  # back for the update (and the checkpoint)
            self.stream.free_kv()  # into the KV cache's room where nothing is lost
            self.state, self.ref_params = offload.move_update_state(
                self.state, self.ref_params, "device")
        samples = training_samples(groups, rules=self.stream.rules,
                                   normalize_std=self.settings.normalize_std)
        metrics["samples/trained"] = len(samples)
        history, micro_seconds = None, []

        def micro_batch_done(seconds: float) -> None:
            micro_seconds.append(seconds)
            self.notice.measured(seconds)  # sizes the watchdog

        if distributed.any_process(bool(samples)):
            # Built here, not on the update's thread: joining the hosts' batches runs
            # programs on every device, the rollout ones included (launch/README.md).
            with sharding.use_mesh(mesh):
                batches = split_mini_batches(
                    samples, self.learner, np.random.default_rng([self.settings.seed, step]),
                    lambda part: _global_batch(part, self.learner, self.experts, mesh))

            def update(state=self.state, ref_params=self.ref_params):
                with sharding.use_mesh(mesh):
                    return train_mini_batches(
                        state, batches, ref_params=ref_params, graphdef=self.graphdef,
                        optimizer=self.optimizer, update_config=self.update_config,
                        learner=self.learner, should_stop=self.update_stop,
                        micro_batch_seconds=micro_batch_done)

            if self.overlap:  # decode on the rollout devices during the update
                with concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix=UPDATE_THREAD) as pool:
                    running = pool.submit(update)
                    self.stream.decode_while(lambda: not running.done(), self.version)
                    self.state, history = running.result()
            else:
                self.state, history = update()
        if micro_seconds:
            metrics["time/micro_batch"] = max(micro_seconds)
        return history

    def _publish(self, changed: bool) -> dict[str, float]:
        """The engine takes the updated weights, a new policy version if the update `changed`
        them; returns the copy's metrics."""
        if not changed:
            self.publisher.unchanged(self.stream, self.state.params)
            return {}
        self.version += 1
        return self.publisher.publish(self.stream, self.state.params, self.version)

    def _count_nonfinite(self, step: int, update_metrics: dict[str, float]) -> None:
        finite = update_metrics["finite"] > 0
        self.nonfinite_streak = 0 if finite else self.nonfinite_streak + 1
        if not finite:
            logging.warning("step %d: non-finite loss or gradient in %d of %d updates, "
                            "those skipped (%d such steps in a row)", step,
                            update_metrics["updates"] - update_metrics["optimizer_steps"],
                            update_metrics["updates"], self.nonfinite_streak)

    def _checkpoint(self, step: int) -> None:
        """Saves checkpoint `step` when due (or when any host was asked to stop); after an
        agreed stop before the last step raises `Preempted`."""
        preempted = distributed.any_process(self.notice())
        if preempted:
            self.notice.stop_agreed()
        saved = False
        last = self.settings.total_steps
        if self.nonfinite_streak == 0 and (step % self.settings.checkpoint_every == 0
                                           or step == last or preempted):
            saved = self._save(step, self.state, self.problems.get_state(),
                               self.stream.state_dict(), self.stream.routing(),
                               must=step == last)
        if preempted and step < last:
            self.checkpointer.wait()
            raise Preempted(f"SIGTERM at step {step}; " + (
                "checkpoint saved" if saved else
                f"no checkpoint during {self.nonfinite_streak} non-finite updates, the last "
                "good one is kept" if self.nonfinite_streak else
                f"checkpoint {step} (from earlier in the step) kept"))

    def _save(self, number: int, state, data: dict, queue: dict, routing: dict, *,
              steps_done=None, must: bool = True) -> bool:
        """Starts saving checkpoint `number` (a collective); `steps_done` when saved mid-step.
        A checkpoint `number` already there (saved mid-step) is replaced only while another
        exists, or when the save `must` happen; returns whether it saved."""
        existing = self.checkpointer.steps()
        if number in existing:
            if len(existing) < 2 and not must:
                return False
            self.checkpointer.delete(number)
        queue_meta, arrays = _queue_meta(queue, routing)
        extra = {} if steps_done is None else {STEPS_DONE_KEY: steps_done}
        self.checkpointer.save(number, state, distributed.gather_process_meta({
            "data": data, **queue_meta, "nonfinite_streak": self.nonfinite_streak,
            "policy_version": self.version, **extra}), arrays=arrays or None)
        return True

    def _stopped(self, step: int, stopped: preemption.Stopped) -> str:
        """After an agreed stop in `step`: saves a checkpoint to redo the step from (module
        docstring); returns what happened, for `Preempted`."""
        self.notice.stop_agreed()
        put_back = isinstance(stopped, UpdateStopped)
        if put_back:
            self.state = stopped.state
        elif self.learner.offload_optimizer:
            self.state, self.ref_params = offload.move_update_state(
                self.state, self.ref_params, "device")
        what = f"SIGTERM in step {step}"
        if self.nonfinite_streak:
            return (f"{what}; no checkpoint during {self.nonfinite_streak} non-finite updates, "
                    "the last good one is kept")
        queue, routing = self.stream.state_dict(put_back), self.stream.routing(put_back)
        if not self._save(step, self.state, self.problems.get_state(), queue, routing,
                          steps_done=step - 1, must=False):
            return f"{what}; checkpoint {step} (from earlier in the step) kept"
        self.checkpointer.wait()
        return f"{what}; checkpoint {step} saved to redo the step from"
