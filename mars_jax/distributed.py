"""Multi-host runs: one JAX process per host, one global mesh, each host its own data shard.

`initialize` must run before anything touches a backend; collectives here must be called on every
process. `HostGroup` agrees on host-side decisions through the coordination service's key-value
store, with no device program.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
import time
import uuid
from typing import NoReturn

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

from mars_jax import sharding
from mars_jax.types import TrainBatch

MODES = ("auto", "on", "off")

_MODE = flags.DEFINE_enum("distributed", "auto", MODES,
                          "Start jax.distributed: 'auto' when addresses are given or a "
                          "multi-process cluster is detected, 'on' always, 'off' never.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0's coordinator (multi-process runs).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id in [0, num_processes).")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 60, "Seconds without a process's heartbeat after which the "
    "coordination service ends every process, naming it (jax's default: 100).")
_EXCHANGE_TIMEOUT = flags.DEFINE_float(
    "exchange_timeout_s", 3600.0, "Seconds a host exchange (`HostGroup`) waits for the slowest "
    "host (an update's compile on a cold cache included) before it ends the run with exit 1.")

EXCHANGE_KEYS = "mars_jax/exchange"  # `HostGroup`'s keys in the coordination service
LOG_EVERY_S = 60.0  # a waiting `HostGroup` names the hosts it waits for this often
_GROUPS: collections.Counter = collections.Counter()  # `HostGroup`s made, by (name, process)

# Environment variables whose presence means "one of several processes" (jax reads them itself).
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS")
_CLUSTER_SIZE_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def cluster_detected(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment says this is one process of a multi-process job."""
    env = os.environ if environ is None else environ
    if any(env.get(key) for key in _CLUSTER_ENV):
        return True
    if "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        return True
    return any(int(env.get(key, "1") or "1") > 1 for key in _CLUSTER_SIZE_ENV)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, mode: str = "auto",
               heartbeat_timeout_s: int = 60) -> bool:
    """Starts `jax.distributed` when this is one of several processes; whether it runs."""
    if mode not in MODES:
        raise ValueError(f"distributed: {mode!r} is not one of {MODES}")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes: must be positive, got {num_processes}")
    if process_id is not None and not 0 <= process_id < (num_processes or process_id + 1):
        raise ValueError(f"process_id: {process_id} is not in [0, num_processes={num_processes})")
    explicit = any(v is not None for v in (coordinator_address, num_processes, process_id))
    if mode == "off" or (mode == "auto" and not explicit and not cluster_detected()):
        return False
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    return True


def initialize_from_flags() -> bool:
    """`initialize` from this module's flags."""
    return initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _MODE.value,
                      _HEARTBEAT.value)


def exchange_timeout_s() -> float:
    """`--exchange_timeout_s` (its default before flags are parsed)."""
    return _EXCHANGE_TIMEOUT.value if flags.FLAGS.is_parsed() else _EXCHANGE_TIMEOUT.default


def end_run(message: str) -> NoReturn:
    """Logs `message` and ends this process at once with exit code 1: a normal exit would run
    jax's shutdown barrier, which waits minutes for the hosts that did not answer."""
    logging.error(message)
    print(message, file=sys.stderr, flush=True)
    _flush()
    os._exit(1)


def exit_process(code: int, within_s: float | None = None) -> NoReturn:
    """Leaves `jax.distributed` with the other processes, then `os._exit(code)` (at the latest
    after `within_s`): a normal exit's teardown would make each host wait for the slowest. Call
    once everything is written: atexit handlers and other threads' buffers do not run."""
    _flush()
    if within_s is not None:
        timer = threading.Timer(within_s, _force_exit, [code, within_s])
        timer.daemon = True
        timer.start()
    if jax.distributed.is_initialized():
        try:
            jax.distributed.shutdown()
        except Exception as e:  # noqa: BLE001 - a lost peer: this host's work is done anyway
            logging.error("leaving jax.distributed failed (%s); exiting with %d", e, code)
            _flush()
    os._exit(code)


def _force_exit(code: int, waited_s: float) -> None:
    logging.error("leaving jax.distributed took over %g s (a host did not arrive); exiting "
                  "with %d", waited_s, code)
    _flush()
    os._exit(code)


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on at least one (a collective: call everywhere)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray(bool(flag)))))


def _pad(x: np.ndarray, sizes: dict[int, int]) -> np.ndarray:
    return np.pad(x, [(0, sizes.get(axis, n) - n) for axis, n in enumerate(x.shape)])


def agreed_batch_shape(shapes: np.ndarray) -> tuple[int, int]:
    """The maxima (M, L) of every process's `TrainBatch` `[M, b, L]`; raises if `b` differ."""
    shapes = np.asarray(shapes).reshape(-1, 3)
    rows = sorted(set(shapes[:, 1].tolist()))
    if len(rows) != 1:
        raise ValueError(f"learner.micro_batch_size: processes built micro-batches of different "
                         f"sizes {rows}; use the same on every host")
    return int(shapes[:, 0].max()), int(shapes[:, 2].max())


def pad_train_batch(batch: TrainBatch, num_micro: int, length: int) -> TrainBatch:
    """`batch` zero-padded (masks zero) to `num_micro` micro-batches of `length`."""
    micro_and_length = {0: num_micro, 2: length}
    return TrainBatch(
        tokens=_pad(batch.tokens, micro_and_length),
        attention_mask=_pad(batch.attention_mask, micro_and_length),
        loss_mask=_pad(batch.loss_mask, micro_and_length),
        advantages=_pad(batch.advantages, micro_and_length),
        sampler_logprobs=_pad(batch.sampler_logprobs, micro_and_length),
        expert_ids=None if batch.expert_ids is None else _pad(batch.expert_ids,
                                                              {0: num_micro, 3: length}),
        segments=None if batch.segments is None else _pad(batch.segments, micro_and_length))


def global_train_batch(batch: TrainBatch, mesh: jax.sharding.Mesh) -> TrainBatch:
    """Each process's `TrainBatch` (numpy `[M, b, L]`) as one global batch of `b x processes`
    rows per micro-batch over the mesh's batch axes, padded to the agreed shape with zero-mask
    rows."""
    local = jax.tree.map(np.asarray, batch)
    agreed = multihost_utils.process_allgather(np.asarray(local.tokens.shape))
    local = pad_train_batch(local, *agreed_batch_shape(agreed))
    procs = jax.process_count()

    def to_global(x: np.ndarray, batch_axis: int) -> jax.Array:
        shape = list(x.shape)
        shape[batch_axis] *= procs
        names = [None] * len(shape)
        names[batch_axis] = "batch"
        target = sharding.named_sharding(mesh, names, shape)
        if batch_split(shape[batch_axis], mesh) % procs:  # refused at start-up (rl/config.py)
            raise ValueError(f"learner.micro_batch_size: {shape[batch_axis]} rows per micro-batch "
                             f"cannot be split over the mesh's batch axes across {procs} processes")
        return jax.make_array_from_process_local_data(target, x, tuple(shape))

    return TrainBatch(tokens=to_global(local.tokens, 1),
                      attention_mask=to_global(local.attention_mask, 1),
                      loss_mask=to_global(local.loss_mask, 1),
                      advantages=to_global(local.advantages, 1),
                      sampler_logprobs=to_global(local.sampler_logprobs, 1),
                      expert_ids=None if local.expert_ids is None
                      else to_global(local.expert_ids, 2),
                      segments=None if local.segments is None else to_global(local.segments, 1))


def batch_split(rows: int, mesh: jax.sharding.Mesh) -> int:
    """Into how many parts the current rules' `batch` axes of `mesh` split a micro-batch of
    `rows` rows (the product of the axes that divide it, as `global_train_batch` places it)."""
    spec = sharding.fitted_spec(["batch"], [rows], mesh)
    return int(np.prod([mesh.shape[a] for a in sharding.spec_axes(spec[0])], dtype=int))


def allgather_json(value) -> list:
    """Every process's JSON-serialisable `value`, in process order (a collective: call everywhere)."""
    if jax.process_count() == 1:
        return [value]
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray(data.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(row[:n].tobytes()) for row, n in zip(gathered, sizes)]


def gather_process_meta(meta: dict) -> dict:
    """Every process's JSON-serialisable `meta`, as one dict to save (call on every process)."""
    processes = allgather_json(meta)
    return {"process_count": len(processes), "processes": processes}


def replicate_scalars(tree, mesh: jax.sharding.Mesh):
    """Scalar arrays (step and optimizer counters) as mesh-replicated global arrays, the way a
    jitted step returns them, so every host's first step reuses the same executable."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: x if x.ndim else jax.make_array_from_process_local_data(
        replicated, np.asarray(x)), tree)


def local_process_meta(saved: dict) -> dict:
    """This process's part of `gather_process_meta` output read back from a checkpoint."""
    count = saved.get("process_count")
    if count != jax.process_count():
        raise ValueError(f"checkpoint meta: written by {count} processes, this run has "
                         f"{jax.process_count()}; resume with the same number of hosts")
    return saved["processes"][jax.process_index()]


def _host_block_sharding() -> jax.sharding.NamedSharding:
    """Axis 0 over processes, axis 1 over each process's own devices (`host_arrays`' layout)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(jax.process_count(), jax.local_device_count())
    mesh = jax.sharding.Mesh(grid, ("process", "local"))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("process", "local"))


def host_arrays(arrays: dict[str, np.ndarray]) -> tuple[dict | None, jax.Array | None]:
    """Packs this process's non-negative integer `arrays` `[L, T, k]` (equal but in T) into one
    global array `[processes, rows, L, k]` in the smallest unsigned dtype that holds every value.
    Returns (this process's JSON index for the checkpoint meta, the array), or (None, None) when
    no process has any."""
    names = list(arrays)
    shapes = [arrays[n].shape for n in names]
    if any(len(a) != 3 or a[::2] != shapes[0][::2] for a in shapes):
        raise ValueError(f"host_arrays: shapes {sorted(set(shapes))} are not 3-D, equal but on "
                         "axis 1")
    if any(arrays[n].min(initial=0) < 0 for n in names):
        raise ValueError("host_arrays: negative values")
    rows = sum(a[1] for a in shapes)
    top = max((int(arrays[n].max(initial=0)) for n in names), default=0)
    dtype = str(arrays[names[0]].dtype) if names else None
    everyone = allgather_json([rows, list(shapes[0][::2]) if names else None, top, dtype])
    layouts = [entry[1] for entry in everyone if entry[1] is not None]
    if not layouts:
        return None, None
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(f"host_arrays: processes hold arrays of layouts {layouts}")
    (layers, k), devices = layouts[0], jax.local_device_count()
    total = max(1, max(entry[0] for entry in everyone))
    total = -(-total // devices) * devices
    stored = np.min_scalar_type(max(entry[2] for entry in everyone))
    block = np.zeros((total, layers, k), stored)
    index, start = {}, 0
    for name in names:
        length = arrays[name].shape[1]
        block[start:start + length] = np.moveaxis(arrays[name], 1, 0)
        index[name] = [start, start + length]
        start += length
    shape = (jax.process_count(), total, layers, k)
    array = jax.make_array_from_process_local_data(_host_block_sharding(), block[None], shape)
    dtype = dtype or next(entry[3] for entry in everyone if entry[3] is not None)
    return dict(rows=index, shape=list(shape), stored_dtype=stored.name, dtype=dtype), array


def host_arrays_target(index: dict) -> jax.ShapeDtypeStruct:
    """The restore target of the array `host_arrays` returned with `index`."""
    return jax.ShapeDtypeStruct(tuple(index["shape"]), np.dtype(index["stored_dtype"]),
                                sharding=_host_block_sharding())


def unpack_host_arrays(index: dict, array: jax.Array) -> dict[str, np.ndarray]:
    """This process's named arrays back from `host_arrays` output (read back from a checkpoint)."""
    shards = sorted(array.addressable_shards, key=lambda shard: shard.index[1].start or 0)
    block = np.concatenate([np.asarray(shard.data)[0] for shard in shards], axis=0)
    dtype = np.dtype(index["dtype"])
    return {name: np.ascontiguousarray(np.moveaxis(block[start:stop], 0, 1)).astype(dtype)
            for name, (start, stop) in index["rows"].items()}


class HostGroup:
    """The job's processes exchanging small JSON values in rounds through `jax.distributed`'s
    key-value store: `gather(value)` returns every process's value of the round, in process
    order. Every process must call `gather` equally often and create its groups of one `name` in
    the same order. At most two rounds' keys exist; a host missing past `timeout_s` ends the run
    naming it."""

    def __init__(self, name: str, timeout_s: float | None = None, *,
                 log_every_s: float = LOG_EVERY_S, client=None, process: int | None = None,
                 processes: int | None = None):
        """The coordination service `client`, this `process` and the `processes` (default:
        jax's)."""
        self.name = name
        self.count = jax.process_count() if processes is None else processes
        self.index = jax.process_index() if process is None else process
        self.timeout_s = exchange_timeout_s() if timeout_s is None else timeout_s
        self.log_every_s = log_every_s
        self.seconds = 0.0
        self._client = client
        self._prefix: str | None = None  # made at the first exchange
        self._instance = _GROUPS[(name, self.index)]
        _GROUPS[(name, self.index)] += 1
        self._round = 0

    def gather(self, value) -> list:
        if self.count == 1:
            return [value]
        start = time.perf_counter()
        if self._client is None:
            from jax._src import distributed as jax_distributed  # the coordination service
            self._client = jax_distributed.global_state.client
        if self._prefix is None:
            self._prefix = f"{EXCHANGE_KEYS}/{self._attempt()}/{self.name}.{self._instance}"
        values = self._exchange(json.dumps(value))
        self._round += 1
        self.seconds += time.perf_counter() - start
        return [json.loads(v) for v in values]

    def _exchange(self, value: str) -> list[str]:
        client, here = self._client, f"{self._prefix}/{self._round}"
        client.key_value_set(f"{here}/values/{self.index}", value)
        if client.key_value_increment(f"{here}/count", 1) < self.count:
            return json.loads(self._wait(f"{here}/all", lambda: self._missing(here)))
        values = [v for _, v in sorted(client.key_value_dir_get(f"{here}/values/"),
                                       key=lambda item: int(item[0].rsplit("/", 1)[1]))]
        client.key_value_set(f"{here}/all", json.dumps(values))
        client.key_value_delete(f"{here}/values/")
        if self._round:
            client.key_value_delete(f"{self._prefix}/{self._round - 1}/")
        return values

    def _attempt(self) -> str:
        """The token of this start of the job: process 0's, published once."""
        key = f"{EXCHANGE_KEYS}/attempt"
        if self.index == 0:
            try:
                return self._client.key_value_try_get(key)
            except jax.errors.JaxRuntimeError as error:
                if "NOT_FOUND" not in str(error):
                    raise
            token = uuid.uuid4().hex[:12]
            self._client.key_value_set(key, token)
            return token
        return self._wait(key, lambda: [0])

    def _missing(self, here: str) -> list[int]:
        """The hosts that have not written round `here` (none once its list is published)."""
        written = {int(k.rsplit("/", 1)[1])
                   for k, _ in self._client.key_value_dir_get(f"{here}/values/")}
        if not written:
            return []
        return sorted(set(range(self.count)) - written)

    def _wait(self, key: str, missing) -> str:
        """`key`'s value once written, logging the `missing()` hosts; `end_run` after
        `timeout_s`."""
        start = time.monotonic()
        while True:
            left = self.timeout_s - (time.monotonic() - start)
            wait_ms = max(1, int(min(self.log_every_s, left) * 1000))
            try:
                return self._client.blocking_key_value_get(key, wait_ms)
            except jax.errors.JaxRuntimeError as error:
                if "DEADLINE_EXCEEDED" not in str(error):
                    raise
            waited, hosts = time.monotonic() - start, missing()
            where = f"host exchange {self.name!r} round {self._round} (process {self.index})"
            if waited >= self.timeout_s:
                end_run(f"{where}: hosts {hosts} did not answer within {self.timeout_s:g} s "
                        f"(--exchange_timeout_s); ending the run")
            if hosts:
                logging.warning("%s: waiting %.0f s for hosts %s", where, waited, hosts)


class CompiledTogether:
    """Calls `jitted` so that every process has compiled a new program before any runs it (a
    `HostGroup` barrier after compiling): XLA:CPU's gloo collectives give other hosts only 30 s
    to join a program's first run. Every process must make the same calls in the same order."""

    def __init__(self, jitted, name: str):
        self.jitted, self.name = jitted, name
        self.hosts: HostGroup | None = None  # made at the first call, after jax.distributed
        self._compiled: dict = {}

    def __call__(self, *args, **static):
        if jax.process_count() == 1:
            return self.jitted(*args, **static)
        self.hosts = self.hosts or HostGroup(self.name)
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves),
               tuple(sorted(static.items(), key=lambda item: item[0])))
        if key not in self._compiled:
            self._compiled[key] = self.jitted.lower(*args, **static).compile()
            self.hosts.gather(True)
        return self._compiled[key](*args)
