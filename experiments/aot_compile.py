r"""Ahead-of-time compilation of every program of a MarsRL training step for a TPU or GPU topology.

  pip install -e .[tpu]          # libtpu: compiles for any TPU topology from a CPU machine
  python experiments/aot_compile.py --config=experiments/configs/marsrl_qwen3_30b_a3b.py \
      --topology=v5p:4x4x4
  python experiments/aot_compile.py --config=experiments/configs/smoke.py \
      --config.model.preset=bench --topology=v5e:2x2
  python experiments/aot_compile.py --config=experiments/configs/marsrl_qwen3_30b_a3b_gpu.py \
      --topology=h200:8            # needs the CUDA PJRT plugin (pip install jax[cuda12])

Programs, at the shapes the configured lengths bucket to (`mars_jax.sampling`, `rl.batching`):
  prefill   with `rollout.decode_engine='generate'`: prefill of a decode batch + its decode
            (`sampler.prefill_and_decode`)
  decode    a continued decode of that batch (`sampler.continue_decode`)
  engine_prefill  with `rollout.decode_engine='engine'` instead of the two above: one
            `prefill_chunk` piece of a prefill of every slot's prompt at once
  engine_insert   a prefilled row copied into a slot
  engine_decode   one decode chunk over all slots at the full KV span; the engine's KV bytes
            per token / per slot / per device are printed with it and written to the JSON
            report (`kv_bytes`)
  engine_shrink / engine_expand (only when asked) the running half of the slots gathered into
            a half-size state and written back
  (the engine's programs as `sampling.program_plan` lowers them: `prefill`, `insert`,
  `decode_chunk`, `take_slots` / `put_slots` of `sampling.engine_programs`)
  logprobs  forward-only token log-probabilities of one micro-batch (reference / old policy)
  update    the two programs of an optimizer update, as `rl.learner.train_mini_batches` runs
            them on one mini-batch: `micro_batch_gradients` (one micro-batch's gradient added to
            the donated sum; its row `beside` counts the optimizer state the trainer holds on
            the device meanwhile) and `apply_gradients` (AdamW on the summed gradient; beside
            it: the reference parameters, when the loss has a KL term)
The micro-batches have `learner.micro_batch_size` rows over the whole training mesh, as the
trainer builds them on any number of hosts: each host an equal share (`host_micro_batch` in
the printed shapes; a size the target's hosts cannot share evenly exits 2).
By default the programs the config's decode path runs (`step_programs`). `--json` writes the
report (with the config); with `--merge_json` the file's results of programs not compiled now
are kept, so one topology's report can be built one program per command.
With `mesh.rollout.devices` > 0 the devices are split (`builders.build_meshes`): the decode
programs compile on the rollout submesh, logprobs and update on the training submesh, and it
prints the bytes one weight copy from the training to the rollout submesh writes
(`weight_sync.transfer_bytes`), e.g. for v5p-512 split 192:64 (3:1):
  python experiments/aot_compile.py --config=experiments/configs/marsrl_qwen3_30b_a3b.py \
      --topology=v5p:8x8x4 --config.rollout.decode_engine=engine \
      --config.mesh.rollout.devices=192 --config.mesh.rollout.data=3 \
      --config.mesh.rollout.fsdp=-1 --config.learner.micro_batch_size=64
On a topology of several hosts (TPU: 4 chips a host on v5p) the engine programs compile for one
host's engine mesh (`sharding.make_meshes`: host 0's devices, or its last `mesh.rollout.devices`)
and the update for the global training mesh, as the rollout scheduler runs them.
Per program it prints per-device HBM of arguments, outputs and temporaries (`memory_analysis()`),
FLOPs and bytes accessed (XLA's `cost_analysis()`: per device, a loop body counted once) and
whether it fits the chip;
the exit code is 1 when a program does not fit. `--num_layers` compiles a shallower model of the
same width (compile time grows with depth where the layer loop is unrolled: without
`model.scan_layers`; with it the engine programs scan the layers too, over stacked weights).
"""
from __future__ import annotations

import os

for _key, _value in (("JAX_PLATFORMS", "cpu"), ("TPU_SKIP_MDS_QUERY", "1"),
                     ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(_key, _value)

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from ml_collections import ConfigDict, config_flags  # noqa: E402

from mars_jax import builders, sharding, weight_sync  # noqa: E402
from mars_jax.config_validation import validate  # noqa: E402
from mars_jax.errors import ConfigError  # noqa: E402
from mars_jax.layers.attention import KVCache, cache_layout, stacked_cache_layout  # noqa: E402
from mars_jax.layers.paged_kv import POOL_AXES, default_kernel  # noqa: E402
from mars_jax.models import Qwen3, Qwen3Config, get_preset  # noqa: E402
from mars_jax.optimizer import make_optimizer  # noqa: E402
from mars_jax.rl.learner import UPDATE_PROGRAMS  # noqa: E402
from mars_jax.rl.update import (TrainState, apply_gradients,  # noqa: E402
                                micro_batch_gradients, opt_state_shardings, token_logprobs)
from mars_jax.types import TrainBatch  # noqa: E402
from mars_jax.rl.config import (  # noqa: E402
    learner_config, micro_batch_problem, rollout_config, stream_settings, update_program_config)
from mars_jax.rl.update_fit import (  # noqa: E402
    OOM, UpdateShape, abstract, abstract_batch, scalar, sharded, update_shape)
from mars_jax.sampling import engine, engine_programs, sampler  # noqa: E402
from mars_jax.sampling import program_plan as plan  # noqa: E402
from mars_jax.sampling import batch_shards as sharding_multiple  # noqa: E402
from mars_jax.sampling.config import engine_shape  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "configs"))
from common import base_config  # noqa: E402
import colocated_slots  # noqa: E402

PROGRAMS = ("prefill", "decode", "logprobs", "update")
ENGINE_PROGRAMS = ("engine_prefill", "engine_insert", "engine_decode", "logprobs", "update")
# Run when the engine compacts its running slots (`take_slots` / `put_slots`); compiled for
# half the slots, where the mesh's batch shards allow it.
SHRINK_PROGRAMS = ("engine_shrink", "engine_expand")
ALL_PROGRAMS = PROGRAMS[:2] + ENGINE_PROGRAMS + SHRINK_PROGRAMS
# `update` names the two programs an optimizer update runs (`rl.learner.UPDATE_PROGRAMS`):
# `micro_batch_gradients` once per micro-batch, then `apply_gradients`; each compiled and reported.
TRAIN_PROGRAMS = ("logprobs", "update") + UPDATE_PROGRAMS  # on the training submesh; the rest on
# the rollout one
GiB = 1 << 30
# HBM per device by `device_kind` (TPU compile-only devices do not report it).
TPU_HBM = {"TPU v4": 32 * GiB, "TPU v5 lite": 16 * GiB, "TPU v5": int(95.74 * GiB),
           "TPU v6 lite": 32 * GiB}
# Deviceless GPU targets (`stream_executor.GpuTargetConfigProto`, from XLA's gpu_specs).
GPU_SPECS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84_942_979_072, bandwidth=3_352_320_000_000),
    "h200": dict(name="NVIDIA H200 141GB HBM3e", memory=151_397_597_184,
                 bandwidth=4_800_000_000_000),
}
STOP_IDS = 2  # <|im_end|>, <|endoftext|>

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "TPU 'v5p:4x4x4', 'v5e:2x2', ... (libtpu) or GPU 'h100:8', 'h200:2x8' "
    "(hosts x GPUs per host; CUDA plugin).")
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "TPU slices (multi-slice over DCN).")
_PROGRAMS = flags.DEFINE_list("programs", [], f"Subset of {ALL_PROGRAMS + UPDATE_PROGRAMS} "
                              "(default: `step_programs` of the config; `update`: both of "
                              f"{UPDATE_PROGRAMS}).")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 0, "Compile this many layers (0: the config's).")
_JSON = flags.DEFINE_string("json", "", "Also write the results to this JSON file.")
_MERGE_JSON = flags.DEFINE_bool(
    "merge_json", False, "Keep the --json file's results of programs not compiled now, where it "
    "reports the same target, model, layers, meshes and shapes (one program per command).")
_COLOCATED = flags.DEFINE_bool(
    "colocated_slots", False, "Also print the engine slots one shared mesh fits before / after "
    "offloading the update's state (experiments/colocated_slots.py; needs engine_decode, update).")
flags.mark_flags_as_required(["config", "topology"])


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices to compile for and the HBM of one of them."""

    devices: list
    hbm_bytes: int
    description: str


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Static shapes of a step's programs, bucketed the way the sampler and batcher bucket."""

    decode_batch: int
    prompt_len: int
    new_tokens: int
    micro_batch: int  # rows per micro-batch over the whole training mesh
    host_micro_batch: int  # each host's share of them
    num_micro: int
    train_len: int


@dataclasses.dataclass
class Result:
    """One program's compile result; byte counts are per device."""

    program: str
    fits: bool
    mesh: str = "shared"  # 'shared' | 'train' | 'rollout': the (sub)mesh it was compiled for
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    # Held on the device while it runs without being its argument: the optimizer state during
    # `micro_batch_gradients`, the reference parameters during `apply_gradients`.
    resident_bytes: int = 0
    flops: float | None = None  # None: the backend gives no cost analysis (deviceless GPU)
    bytes_accessed: float | None = None  # XLA's estimate of the bytes the program's ops move
    compile_s: float = 0.0
    error: str = ""

    @property
    def total_bytes(self) -> int:
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes + self.resident_bytes)


def tpu_target(topology: str, num_slices: int = 1) -> Target:
    """Compile-only devices of a TPU topology such as 'v5p:4x4x4' (through libtpu)."""
    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    devices = topologies.get_topology_desc(topology, "tpu", **kwargs).devices
    kind = devices[0].device_kind
    if kind not in TPU_HBM:
        raise ValueError(f"--topology: no HBM size known for {kind!r}; known: {sorted(TPU_HBM)}")
    return Target(list(devices), TPU_HBM[kind],
                  f"{topology} x{num_slices} slice(s): {len(devices)} x {kind}")


def gpu_target(topology: str) -> Target:
    """Compile-only devices of 'h100:8' / 'h200:2x8' (hosts x GPUs) through the CUDA plugin."""
    model, _, shape = topology.partition(":")
    hosts, _, per_host = shape.rpartition("x")
    spec = GPU_SPECS[model]
    target_config = (
        "gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 "
        "shared_memory_per_block: 49152 shared_memory_per_core: 233472 "
        "threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128 "
        "block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
        f"memory_bandwidth: {spec['bandwidth']} l2_cache_size: 52428800 clock_rate_ghz: 1.98 "
        f"device_memory_size: {spec['memory']} shared_memory_per_block_optin: 232448 "
        "cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 "
        "registers_per_block_limit: 65536 } "
        f'platform_name: "CUDA" device_description_str: "{spec["name"]}"')
    jax.devices()  # initialises the backends, which registers the CUDA plugin's topologies
    devices = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                           topology=f"1x{hosts or 1}x{per_host}").devices
    return Target(list(devices), spec["memory"], f"{topology}: {len(devices)} x {spec['name']}")


def make_target(topology: str, num_slices: int = 1) -> Target:
    if topology.split(":")[0] in GPU_SPECS:
        if num_slices != 1:
            raise ValueError("--num_slices: multi-slice applies to TPU topologies only")
        return gpu_target(topology)
    return tpu_target(topology, num_slices)


def model_config(config: ConfigDict, num_layers: int = 0, tpu: bool = True) -> Qwen3Config:
    """The architecture of `config.model` (checkpoint's config.json if present, else preset);
    for a `tpu` target MoE dispatch 'auto' becomes 'ragged', what it picks there (off TPU it
    stays 'auto', which picks at trace time as on a GPU: this process does not run on TPU)."""
    overrides = builders.model_overrides(config)
    checkpoint = config.model.get("checkpoint")
    if checkpoint and Path(checkpoint, "config.json").is_file():
        cfg = Qwen3Config.from_json_file(Path(checkpoint, "config.json"), **overrides)
    else:
        cfg = get_preset(config.model.preset, **overrides)
    if cfg.moe_impl == "auto" and tpu:
        cfg = cfg.replace(moe_impl="ragged")
    return cfg.replace(num_hidden_layers=num_layers) if num_layers else cfg


def mesh_hosts(mesh: Mesh | None) -> int:
    """The processes (hosts) owning `mesh`'s devices; 1 without a mesh."""
    return 1 if mesh is None else len({device.process_index for device in mesh.devices.flat})


def step_shapes(config: ConfigDict, mesh: Mesh | None = None) -> Shapes:
    """Shapes of one step: a decode batch of `prompts_per_step x group_size` rows (at most
    `max_decode_rows`) in the sampler's batch bucket on `mesh`, the longest prompt and output
    budget, and one mini-batch of training rows (`rl.update_fit.update_shape`: the trained
    roles' longest prompt + output), each of `mesh`'s hosts building an equal share."""
    r = config.rollout
    rows = r.prompts_per_step * r.group_size
    decode_batch = sampler.batch_bucket(
        min(rows, r.max_decode_rows) if r.get("max_decode_rows") else rows,
        sharding_multiple(mesh))
    prompt_len = sampler.prompt_bucket(r.max_prompt_tokens)
    new_tokens = sampler.new_tokens_bucket(max(r.max_new_tokens.values()))
    update = update_shape(learner_config(config), rollout_config(config), stream_settings(config))
    return Shapes(decode_batch=decode_batch, prompt_len=prompt_len, new_tokens=new_tokens,
                  micro_batch=update.micro_batch,
                  host_micro_batch=update.micro_batch // mesh_hosts(mesh),
                  num_micro=update.num_micro, train_len=update.length)


def expand_programs(programs: Sequence[str]) -> tuple[str, ...]:
    """`programs` with `update` replaced by `UPDATE_PROGRAMS`, each once, in order."""
    return tuple(dict.fromkeys(q for p in programs
                               for q in (UPDATE_PROGRAMS if p == "update" else (p,))))


def step_programs(config: ConfigDict) -> tuple[str, ...]:
    """The programs a training step of `config` runs (its decode path's, then the update's)."""
    return ENGINE_PROGRAMS if config.rollout.get("decode_engine") == "engine" else PROGRAMS


class StepPrograms:
    """Lowers the step's programs over abstract, sharded parameters of `cfg` on `mesh`."""

    def __init__(self, config: ConfigDict, cfg: Qwen3Config, mesh: Mesh):
        self.config, self.cfg, self.mesh = config, cfg, mesh
        self.shapes = step_shapes(config, mesh)
        abstract_model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
        self.abstract_model = abstract_model
        self.graphdef, state = nnx.split(abstract_model)
        self.train_graphdef, _ = nnx.split(abstract_model, nnx.Param)
        self.weights = abstract(state, sharding.state_shardings(state, mesh))
        self.num_moe = len(abstract_model.moe_layers)
        self.sampling = sampler.SamplingParams(
            greedy=False, top_k=config.rollout.top_k, top_p=config.rollout.top_p,
            record_routing=config.learner.routing_replay and self.num_moe > 0)
        self.update_config = update_program_config(config)
        self.optimizer = make_optimizer(**dict(config.optimizer))
        # Outside `use_mesh`: optax builds a placeholder state eagerly, on the default device.
        self.opt_shardings = opt_state_shardings(self.optimizer, self.weights)

    def lower(self, program: str) -> jax.stages.Lowered:
        with sharding.use_mesh(self.mesh):
            return getattr(self, f"_{program}")()

    def _prefill(self) -> jax.stages.Lowered:
        s, mesh = self.shapes, self.mesh
        b = s.decode_batch
        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), b))
        args = (sharded(mesh, (b, s.prompt_len), jnp.int32, ("batch", None)),
                sharded(mesh, (b, s.prompt_len), jnp.int32, ("batch", None)),
                sharded(mesh, (b,), jnp.int32, ("batch",)),
                sharded(mesh, (b, STOP_IDS), jnp.int32, ("batch", None)),
                sharded(mesh, (b,), keys.dtype, ("batch",)),
                scalar(mesh, jnp.float32), scalar(mesh, jnp.int32))
        return sampler.prefill_and_decode.lower(self.graphdef, self.weights, *args,
                                                num_new=s.new_tokens, params=self.sampling)

    def decode_state(self) -> sampler.DecodeState:
        """The abstract state `continue_decode` resumes, sharded by the logical rules."""
        s, mesh, cfg = self.shapes, self.mesh, self.cfg
        b, p, n = s.decode_batch, s.prompt_len, s.new_tokens
        layout = cache_layout(b, p + n, cfg.num_key_value_heads, cfg.head_dim)
        layer_cache = lambda: KVCache(*(sharded(mesh, shape, cfg.compute_dtype, names)
                                        for shape, names in layout))
        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), b))
        experts = None
        if self.sampling.record_routing:
            experts = sharded(mesh, (self.num_moe, b, p + n, cfg.num_experts_per_tok),
                               jnp.int32, (None, "batch", None, None))
        rows = lambda *tail, dtype=jnp.int32: sharded(mesh, (b, *tail), dtype,
                                                       ("batch",) + (None,) * len(tail))
        return sampler.DecodeState(
            cache=tuple(layer_cache() for _ in range(cfg.num_hidden_layers)),
            next_logits=sharded(mesh, (b, cfg.vocab_size), jnp.float32, ("batch", "act_vocab")),
            tokens=rows(n), logprobs=rows(n, dtype=jnp.float32), experts=experts,
            step=scalar(mesh, jnp.int32), lengths=rows(), done=rows(dtype=jnp.bool_),
            hit_stop=rows(dtype=jnp.bool_), keys=rows(dtype=keys.dtype),
            prompt_mask=rows(p, dtype=jnp.bool_), prompt_lengths=rows(), max_new=rows(),
            stop_ids=rows(STOP_IDS))

    def _decode(self) -> jax.stages.Lowered:
        return sampler.continue_decode.lower(
            self.graphdef, self.weights, self.decode_state(), scalar(self.mesh, jnp.float32),
            scalar(self.mesh, jnp.int32), params=self.sampling)

    @functools.cached_property
    def engine_weights(self) -> tuple[nnx.GraphDef, tuple]:
        """The engine programs' graph and abstract weights (`engine_programs.merged`): the
        model's, or with `model.scan_layers` the layers' stacked per run of alike layers
        (`engine_programs.stack_weights`), sharded as the layers with the new axis unsplit."""
        if not self.cfg.scan_layers:
            return self.graphdef, (self.weights, None)
        model, mesh = self.abstract_model, self.mesh
        graphdef, layers, rest = nnx.split(model, nnx.PathContains("layers"), ...)
        rest = abstract(rest, sharding.state_shardings(rest, mesh))
        layers = abstract(layers, sharding.state_shardings(layers, mesh))["layers"]

        def stacked(start, stop):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                (stop - start,) + x.shape, x.dtype, sharding=NamedSharding(
                    mesh, PartitionSpec(None, *x.sharding.spec))), layers[start])

        return graphdef, (rest, tuple(stacked(*run) for run in model.layer_runs()))

    def engine_state(self, slots: int = 0) -> engine.SlotState:
        """The abstract slot state of the config's engine (or of `slots` of its slots), sharded
        by the logical rules."""
        cfg, mesh = self.cfg, self.mesh
        all_slots, length = engine_shape(self.config, mesh)
        slots = slots or all_slots
        graphdef, weights = self.engine_weights
        state = jax.eval_shape(functools.partial(
            engine_programs.init_state, graphdef, num_slots=slots, max_length=length,
            max_stops=STOP_IDS, record=self.sampling.record_routing,
            paged=bool(self.pages)), weights)
        cache = ()
        if not self.pages:
            cache = self._stacked_cache(slots, length)
        like = lambda x, *names: sharded(mesh, x.shape, x.dtype, names)
        per_slot = {f.name: like(getattr(state, f.name), "batch")
                    for f in dataclasses.fields(state)
                    if f.name not in ("cache", "next_logits", "stop_ids", "experts")}
        return state.replace(
            cache=cache, next_logits=like(state.next_logits, "batch", "act_vocab"),
            stop_ids=like(state.stop_ids, "batch", None),
            experts=None if state.experts is None else like(state.experts, None, "batch", None,
                                                            None), **per_slot)

    @property
    def pages(self) -> int:
        """The engine's KV pages (`rollout.engine_kv_pages`; 0: reserved slots)."""
        return self.config.rollout.get("engine_kv_pages", 0)

    def _stacked_cache(self, rows: int, length: int) -> KVCache:
        """An abstract KV cache stacked over the layers (`qwen3.Qwen3.init_cache`)."""
        cfg = self.cfg
        layout = stacked_cache_layout(cfg.num_hidden_layers, rows, length,
                                      cfg.num_key_value_heads, cfg.head_dim)
        return KVCache(*(sharded(self.mesh, shape, cfg.compute_dtype, names)
                         for shape, names in layout))

    def engine_pool(self) -> KVCache | None:
        """The abstract page pools of a paged engine, one per batch shard, every layer's pages
        in each (None with reserved slots)."""
        if not self.pages:
            return None
        cfg, page = self.cfg, self.config.rollout.engine_page_size
        shards = sharding_multiple(self.mesh)
        shape = (shards, cfg.num_key_value_heads, cfg.num_hidden_layers * (
            self.pages // shards + 1), page, cfg.head_dim)
        return KVCache(*(sharded(self.mesh, shape, cfg.compute_dtype, POOL_AXES)
                         for _ in range(2)))

    def _engine_prompt(self):
        """Abstract prompt cache, logits and routing of one prefill of every slot's prompt."""
        cfg, mesh = self.cfg, self.mesh
        slots, _ = engine_shape(self.config, mesh)
        bucket = self.shapes.prompt_len
        cache = self._stacked_cache(slots, bucket)
        logits = sharded(mesh, (slots, cfg.vocab_size), jnp.float32, ("batch", "act_vocab"))
        experts = None
        if self.num_moe:
            experts = sharded(mesh, (self.num_moe, slots, bucket, cfg.num_experts_per_tok),
                               jnp.int32, (None, "batch", None, None))
        return slots, bucket, cache, logits, experts

    @property
    def args(self) -> plan.AbstractArgs:
        return plan.AbstractArgs(self.mesh)

    def _engine_prefill(self) -> jax.stages.Lowered:
        slots, bucket, *prompt = self._engine_prompt()
        return plan.prefill(self.args, *self.engine_weights, tuple(prompt), rows=slots,
                            bucket=bucket, width=min(bucket, engine.PREFILL_CHUNK)).lower()

    def _engine_insert(self) -> jax.stages.Lowered:
        _, _, *prompt = self._engine_prompt()
        _, length = engine_shape(self.config, self.mesh)
        pages = 0
        if self.pages:
            pages = -(-min(self.shapes.prompt_len, length) // self.config.rollout.engine_page_size)
        return plan.insert(self.args, self.engine_state(), self.engine_pool(), tuple(prompt),
                           pages=pages, shards=sharding_multiple(self.mesh),
                           max_stop_ids=STOP_IDS).lower()

    def _engine_decode(self) -> jax.stages.Lowered:
        """The decode chunk at its largest KV span (all `max_length` positions; paged: in
        whole pages)."""
        _, length = engine_shape(self.config, self.mesh)
        page = self.config.rollout.get("engine_page_size", 0)
        span = -(-length // page) * page if self.pages else length
        return plan.decode_chunk(
            self.args, *self.engine_weights, self.engine_state(), self.engine_pool(),
            steps=self.config.rollout.engine_chunk_steps, span=span, kernel=self.paged_kernel,
            page_size=page).lower()

    @property
    def paged_kernel(self) -> str:
        """`rollout.engine_paged_attention` for the target ('auto': its backend's Pallas
        kernel, as `paged_kv.default_kernel` picks at run time)."""
        kernel = self.config.rollout.get("engine_paged_attention", "auto")
        if kernel != "auto":
            return kernel
        return default_kernel(self.cfg.head_dim, self.config.rollout.engine_page_size,
                              self.mesh.devices.flat[0].platform)

    def _shrink_rows(self) -> int:
        slots, _ = engine_shape(self.config, self.mesh)
        rows = slots // 2
        if rows % sharding_multiple(self.mesh):
            raise ValueError(f"engine_shrink / engine_expand: {slots} slots cannot be halved "
                             f"on this mesh (batch shards {sharding_multiple(self.mesh)})")
        return rows

    def _engine_shrink(self) -> jax.stages.Lowered:
        """The running half of the slots gathered into a slot bucket of half the size."""
        return plan.take_slots(self.args, self.engine_state(), self._shrink_rows()).lower()

    def _engine_expand(self) -> jax.stages.Lowered:
        """Half the slots' rows written back to their slots."""
        rows = self._shrink_rows()
        taken = plan.take_slots(self.args, self.engine_state(), rows)
        part = jax.eval_shape(taken.fn, *taken.args)
        state = self.engine_state(rows)
        part = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype,
                                                              sharding=s.sharding), part, state)
        return plan.put_slots(self.args, self.engine_state(), part).lower()

    def kv_bytes(self) -> dict[str, int]:
        """The engine's KV-cache bytes per token and per slot (`Engine.kv_bytes_per_token` /
        `kv_bytes_per_slot`), and per device: its slots' caches spread over the batch and
        KV-head axes."""
        cfg = self.cfg
        slots, length = engine_shape(self.config, self.mesh)
        per_token = engine.kv_bytes_per_token(cfg)
        kv_shards = min(cfg.num_key_value_heads, int(np.prod([self.mesh.shape[a] for a in
                        sharding.spec_axes(sharding.logical_to_spec(("act_kv_heads",))[0])])))
        if self.pages:  # a pool per batch shard (each with its trash page), split over KV heads
            shards = sharding_multiple(self.mesh)
            total = per_token * (self.pages + shards) * self.config.rollout.engine_page_size
            return dict(slots=slots, positions=length, per_token=per_token, total=total,
                        per_device=total // shards // kv_shards)
        return dict(slots=slots, positions=length, per_token=per_token,
                    per_slot=per_token * length, total=per_token * length * slots,
                    per_device=per_token * length * slots // sharding_multiple(self.mesh)
                    // kv_shards)

    def kv_line(self) -> str:
        kv = self.kv_bytes()
        if self.pages:
            return (f"engine  {kv['slots']} slots of up to {kv['positions']} positions over "
                    f"{self.pages} pages (paged attention: {self.paged_kernel}); KV cache "
                    f"{kv['per_token']:,} bytes per token, "
                    f"{kv['total'] / GiB:,.2f} GiB in all, {kv['per_device'] / 2**20:,.1f} MiB "
                    "per device")
        return (f"engine  {kv['slots']} slots x {kv['positions']} positions; KV cache "
                f"{kv['per_token']:,} bytes per token, {kv['per_slot'] / 2**20:,.1f} MiB per "
                f"slot, {kv['total'] / GiB:,.2f} GiB in all, {kv['per_device'] / 2**20:,.1f} "
                f"MiB per device")

    def _train_rows(self, *lead: int, dtype=jnp.int32):
        s = self.shapes
        names = (None,) * len(lead) + ("batch", None)
        return sharded(self.mesh, (*lead, s.micro_batch, s.train_len), dtype, names)

    def _logprobs(self) -> jax.stages.Lowered:
        graphdef, config = self.train_graphdef, self.update_config

        @jax.jit
        def logprobs(params, tokens, mask):
            model = nnx.merge(graphdef, params)
            return token_logprobs(model, tokens, mask, temperature=config.temperature,
                                  chunk=config.logits_chunk)[0]

        return logprobs.lower(self.weights, self._train_rows(), self._train_rows())

    @functools.cached_property
    def update_inputs(self) -> tuple[TrainState, TrainBatch, Any]:
        """The abstract train state, one mini-batch of `num_micro` micro-batches of the global
        `micro_batch` rows (as `trainer._global_batch` builds it on any number of hosts) and the
        reference parameters (None without a KL term), as an optimizer update reads them."""
        s, mesh = self.shapes, self.mesh
        opt_shapes = jax.eval_shape(self.optimizer.init, self.weights)
        state = TrainState(params=self.weights,
                           opt_state=abstract(opt_shapes, self.opt_shardings),
                           step=scalar(mesh, jnp.int32))
        experts = ((self.num_moe, self.cfg.num_experts_per_tok)
                   if self.update_config.routing_replay else None)
        batch = abstract_batch(mesh, UpdateShape(s.micro_batch, s.num_micro, s.train_len),
                               pack=self.config.learner.pack,
                               recompute=self.config.loss.pi_old == "recompute",
                               experts=experts, spread=True)
        ref = self.weights if self.update_config.loss.needs_ref_logprobs else None
        return state, batch, ref

    def _micro_batch_gradients(self) -> jax.stages.Lowered:
        """One micro-batch's gradient added to the running sum (donated; shaped and sharded as
        the parameters, as `train_mini_batches` starts it)."""
        state, batch, ref = self.update_inputs
        return micro_batch_gradients.lower(self.weights, state.params, batch,
                                           scalar(self.mesh, jnp.int32), ref,
                                           graphdef=self.train_graphdef, config=self.update_config)

    def _apply_gradients(self) -> jax.stages.Lowered:
        """The optimizer update from the summed gradient and the micro-batches' metrics."""
        state, batch, ref = self.update_inputs
        _, metrics = jax.eval_shape(functools.partial(
            micro_batch_gradients, graphdef=self.train_graphdef, config=self.update_config),
            self.weights, state.params, batch, jax.ShapeDtypeStruct((), jnp.int32), ref)
        metrics = [{k: scalar(self.mesh, v.dtype) for k, v in metrics.items()}
                   for _ in range(self.shapes.num_micro)]
        return apply_gradients.lower(state, self.weights, metrics, batch,
                                     optimizer=self.optimizer)

    def resident_bytes(self, program: str) -> int:
        """Bytes per device the trainer holds beside `program` that are not its arguments: the
        optimizer state (and step) beside `micro_batch_gradients`, the reference parameters
        beside `apply_gradients`; 0 for the other programs."""
        if program not in UPDATE_PROGRAMS:
            return 0
        state, _, ref = self.update_inputs
        beside = ((state.opt_state, state.step) if program == "micro_batch_gradients" else ref)
        return colocated_slots.bytes_per_device(beside)


def compile_program(name: str, lower: Callable[[], jax.stages.Lowered], hbm_bytes: int,
                    mesh: str = "shared", resident_bytes: int = 0) -> Result:
    """Compiles one program; it fits when its bytes and `resident_bytes` (held beside it) fit
    `hbm_bytes`. A compile error counts as 'does not fit': on TPU, XLA rejects a program that
    overflows HBM; on GPU, shapes far beyond the chip can fail to compile at all."""
    start = time.perf_counter()
    lowered = lower()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        summary = " ".join(line.strip() for line in str(e).splitlines()[:3])
        if not OOM.search(summary):
            summary = f"compile error: {summary}"
        return Result(name, fits=False, mesh=mesh, resident_bytes=resident_bytes,
                      compile_s=time.perf_counter() - start, error=summary[:400])
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    result = Result(name, fits=True, mesh=mesh, argument_bytes=memory.argument_size_in_bytes,
                    output_bytes=memory.output_size_in_bytes,
                    alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
                    code_bytes=memory.generated_code_size_in_bytes,
                    resident_bytes=resident_bytes, flops=(cost or {}).get("flops"),
                    bytes_accessed=(cost or {}).get("bytes accessed"),
                    compile_s=time.perf_counter() - start)
    result.fits = result.total_bytes <= hbm_bytes
    return result


def format_table(results: Sequence[Result], hbm_bytes: int) -> str:
    """One line per program; `beside`: bytes held beside it (`Result.resident_bytes`)."""
    gib = lambda n: f"{n / GiB:8.2f}"
    columns = ("args", "outputs", "alias", "temps", "beside", "total", "HBM")
    lines = [f"{'program':21} {'mesh':7} " + " ".join(f"{c:>8}" for c in columns)
             + f" {'TFLOPs':>9} {'GB acc.':>8} {'fits':>4} {'compile':>8}   (GiB per device)"]
    for r in results:
        if r.error:
            lines.append(f"{r.program:21} {r.mesh:7} " + " ".join(f"{'-':>8}" for _ in columns[:-1])
                         + f" {gib(hbm_bytes)} {'-':>9} {'-':>8} {'no':>4} {r.compile_s:7.0f}s   "
                         f"{r.error}")
            continue
        tflops = "-" if r.flops is None else f"{r.flops / 1e12:.3f}"
        accessed = "-" if r.bytes_accessed is None else f"{r.bytes_accessed / 1e9:.2f}"
        lines.append(f"{r.program:21} {r.mesh:7} {gib(r.argument_bytes)} {gib(r.output_bytes)} "
                     f"{gib(r.alias_bytes)} {gib(r.temp_bytes)} {gib(r.resident_bytes)} "
                     f"{gib(r.total_bytes)} {gib(hbm_bytes)} {tflops:>9} {accessed:>8} "
                     f"{'yes' if r.fits else 'no':>4} {r.compile_s:7.0f}s")
    return "\n".join(lines)


@dataclasses.dataclass
class Report:
    """What was compiled, for which target, and the per-program results. `mesh` is the training
    (or shared) mesh; with a split, one weight copy to `rollout_mesh` writes `weight_copy_bytes`
    on its devices (`weight_copy_bytes_per_device` on the fullest one; 0 on a shared mesh)."""

    target: str
    mesh: dict[str, int]
    model: str
    layers: int
    shapes: Shapes
    hbm_bytes: int
    results: list[Result]
    kv_bytes: dict[str, int] | None = None  # the engine's, when an engine program was compiled
    rollout_mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    weight_copy_bytes: int = 0
    weight_copy_bytes_per_device: int = 0
    colocated: colocated_slots.SlotBudget | None = None  # with --colocated_slots
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run's config

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["results"] = [dict(dataclasses.asdict(r), total_bytes=r.total_bytes)
                             for r in self.results]
        return fields


# What must agree for two reports' results to be one report's (`merged_report`).
_SAME_COMPILE = ("target", "mesh", "rollout_mesh", "model", "layers", "shapes", "hbm_bytes")


def merged_report(earlier: dict[str, Any], report: Report) -> dict[str, Any]:
    """`report` as a JSON dict, after `earlier`'s results (a `Report.to_dict`) of the programs
    it did not compile, in their order; `earlier`'s engine KV bytes kept when `report` has none.
    Raises ValueError naming the fields where the two compiled something else."""
    new = report.to_dict()
    differ = [k for k in _SAME_COMPILE if earlier.get(k) != new[k]]
    if differ:
        raise ValueError(f"--merge_json: the existing report differs in {differ}")
    compiled = {r["program"] for r in new["results"]}
    new["results"] = [r for r in earlier["results"] if r["program"] not in compiled] + new[
        "results"]
    new["kv_bytes"] = new["kv_bytes"] or earlier.get("kv_bytes")
    return new


def run(config: ConfigDict, topology: str, *, num_slices: int = 1,
        programs: Sequence[str] = (), num_layers: int = 0, colocated: bool = False) -> Report:
    """Compiles `programs` (default: `step_programs(config)`; `update` stands for
    `UPDATE_PROGRAMS`) of `config` for `topology`."""
    programs = tuple(programs) or step_programs(config)
    unknown = set(programs) - set(ALL_PROGRAMS + UPDATE_PROGRAMS)
    if unknown:
        raise ValueError(f"--programs: unknown {sorted(unknown)}; choose from "
                         f"{ALL_PROGRAMS + UPDATE_PROGRAMS}")
    programs = expand_programs(programs)
    target = make_target(topology, num_slices)
    validate(config, base_config(), device_count=len(target.devices))
    train_mesh, rollout_mesh = sharding.make_meshes(config.mesh.to_dict(), target.devices)
    if problem := micro_batch_problem(config.learner.micro_batch_size, mesh_hosts(train_mesh)):
        raise ConfigError([problem])
    split = train_mesh is not rollout_mesh
    cfg = model_config(config, num_layers, tpu=topology.split(":")[0] not in GPU_SPECS)
    train = StepPrograms(config, cfg, train_mesh)
    rollout = StepPrograms(config, cfg, rollout_mesh) if split else train
    kv_bytes = None
    if any(p.startswith("engine") for p in programs):
        kv_bytes = rollout.kv_bytes()
        print(rollout.kv_line())
    copy_bytes = weight_sync.transfer_bytes(
        train.weights, jax.tree.map(lambda x: x.sharding, rollout.weights))
    results = []
    for p in programs:
        steps, where = (train, "train") if p in TRAIN_PROGRAMS else (rollout, "rollout")
        results.append(compile_program(p, lambda p=p, steps=steps: steps.lower(p),
                                       target.hbm_bytes, where if split else "shared",
                                       resident_bytes=steps.resident_bytes(p)))
    budget = None
    if colocated:
        engine_devices = set(rollout_mesh.devices.flat)
        if not engine_devices <= set(train_mesh.devices.flat):
            raise ValueError("--colocated_slots: the engine's devices must also train "
                             "(mesh.rollout.devices=0)")
        opt_state = abstract(jax.eval_shape(train.optimizer.init, train.weights),
                              train.opt_shardings)
        budget = colocated_slots.budget(
            opt_state, results, kv_bytes, sharding_multiple(rollout_mesh), target.hbm_bytes,
            copies=(train.weights, rollout.weights) if split else None,
            engines=train_mesh.devices.size // len(engine_devices))
    return Report(target.description, dict(train_mesh.shape),
                  config.model.checkpoint or config.model.preset, cfg.num_hidden_layers,
                  train.shapes, target.hbm_bytes, results, kv_bytes,
                  rollout_mesh=dict(rollout_mesh.shape), weight_copy_bytes=copy_bytes[0],
                  weight_copy_bytes_per_device=copy_bytes[1], colocated=budget,
                  config=config.to_dict())


def main(argv):
    del argv
    try:
        report = run(_CONFIG.value, _TOPOLOGY.value, num_slices=_NUM_SLICES.value,
                     programs=_PROGRAMS.value, num_layers=_NUM_LAYERS.value,
                     colocated=_COLOCATED.value)
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    print(f"target  {report.target}; mesh {report.mesh}")
    if report.weight_copy_bytes:
        print(f"split   training mesh {report.mesh}, rollout mesh {report.rollout_mesh}; one "
              f"weight copy writes {report.weight_copy_bytes / 2**20:,.1f} MiB on the rollout "
              f"devices, {report.weight_copy_bytes_per_device / 2**20:,.1f} MiB on the fullest")
    print(f"model   {report.model}: {report.layers} layers")
    print(f"shapes  {dataclasses.asdict(report.shapes)}")
    print(format_table(report.results, report.hbm_bytes))
    if report.colocated:
        print(report.colocated.lines())
    if _JSON.value:
        path = Path(_JSON.value)
        fields = report.to_dict()
        if _MERGE_JSON.value and path.exists():
            try:
                fields = merged_report(json.loads(path.read_text()), report)
            except ValueError as e:
                sys.exit(f"{path}: {e}")
        path.write_text(json.dumps(fields, indent=2, default=str))
    if not all(r.fits for r in report.results):
        print("does not fit: " + ", ".join(r.program for r in report.results if not r.fits))
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
