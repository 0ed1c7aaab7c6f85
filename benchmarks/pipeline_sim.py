r"""The pipeline's speed-up at the paper's scale, computed by our scheduler against a simulated
engine whose clock follows a roofline cost model (`benchmarks/sim/`).

  python benchmarks/pipeline_sim.py                       # 8 x H200 and v5p-64, Solver mean 19k and 28k
  python benchmarks/pipeline_sim.py --hardware=h200x8 --progress=0 --updates=4
  python benchmarks/pipeline_sim.py --profile=cpu         # calibration: this CPU's measured costs
  python benchmarks/pipeline_sim.py --kv=paged            # what a paged KV cache would buy
  python benchmarks/pipeline_sim.py --hardware=v5p-64 --rows="sequential, KV freed,sync"  # rows
  python benchmarks/pipeline_sim.py --hardware=h200x64,v5p-1024 --sigma=1.3   # any size

Hardware: `h200xN` (N H200s, 8 a node) or `v5p-N` (N / 2 TPU v5p chips, Google's naming).
Workload (the paper's): Qwen3-30B-A3B, 128 prompts x group 8 per update, fan-out 2, 5 stages
(Solver, V, C, V, C), 64k output budget per role, each output decoded in one go (the rollout
scheduler cuts no segments), 32k prompt cap,
`adaptive` selection, every role trained. Output lengths: `sim.lengths.LengthModel`; grading:
`sim.agents.SimRollouts` (seeded correctness per role). The scheduler:
`mars_jax.rl.streaming.StreamingRollouts` (admission, selection, stage barriers, staleness gate,
keep / recompute), driving `sim.engine.SimEngine`, which decodes in chunks of `--chunk_steps`
steps as `Engine` does (a finished request's slot is refilled at the end of its chunk).

Rows (every one on the whole machine; slots per chip = (0.9 x HBM - resident) / KV bytes of one
slot of 32k + 64k positions, reserved in full as `Engine` does):
  sequential            one mesh, stage barriers, the update waits for every trajectory of its
                        128 problems and decoding waits for the update. Resident: the train
                        state's share (8 B per parameter: bf16 weights, AdamW mu and nu,
                        gradients) + the update's temporaries from our AOT record (launch/
                        README.md: 69.3 GiB per H200, 57.0 GiB per v5p chip): the engine's slot
                        cache stays allocated through the update, as the rollout engine keeps it.
  sequential, KV freed  the same, but the slot cache is freed for each update (the engine is
                        empty then), so only the train state is resident while decoding.
  pipeline              one mesh, agent-granularity streaming; an update is due once as many
                        samples are complete as a sequential step trains; decoding stops while it
                        runs; in-flight KV stays (resident as `sequential`).
  pipeline, KV freed    the same with `resume='recompute'`: in-flight requests are re-prefilled
                        after each update anyway, so their KV need not survive it (resident as
                        `sequential, KV freed`).
  sync                  the baseline AReaL and verl compare against (`sim.sync.SyncRollouts`):
                        one mesh, one barrier per training step (a step's 128 problems admitted
                        together, the update waits for all their trajectories, nothing of the
                        next step starts before it), no stage barriers (each problem's next
                        stage submitted as its group completes, continuous batching). The
                        optimizer state is offloaded while decoding (`mars_jax.offload`) and the
                        engine is empty at the barrier, so only the bf16 weights are resident
                        while decoding (as a rollout submesh); the update needs the train state
                        + temporaries on all chips (the slot cache released for it, as the `KV
                        freed` rows assume; `Engine` keeps it allocated today). The copy of
                        AdamW's mu and nu (4 B per parameter) to the device and back is charged
                        per update at the host link's rate (`Chip.host_bandwidth`).
  pipeline, offloaded   `pipeline, KV freed` with the optimizer state offloaded as `sync`'s
                        (resident: the bf16 weights; the offload charged the same way).
  pipeline, KV to host  the same with `resume='keep'`: instead of being recomputed after the
                        update, the engine's slot cache waits in host memory while it runs
                        (the whole reserved cache, to the host and back, charged at the host
                        link's rate like the optimizer state; `Engine` does not do this yet).
  pipeline+overlap r:t  r rollout chips (resident: the bf16 weights' share) + t training chips
                        (must hold the train-state share + the update temporaries); the engine
                        keeps decoding (`decode_while`) while the update runs, then waits for the
                        weight copy at the link rate.
  bound: decode only    every chip decoding at the rollout submesh's slot density, updates free:
                        no schedule on this machine does better under the cost model.
With `--kv=paged` the same rows run on a paged cache: the free HBM (0.9 x HBM - resident) of
the rollout chips is one pool of KV positions, a request holds as many as its context, and
`sim.engine.SimEngine` admits first come, first served while the pool holds the next request,
preempting the request admitted last when it is full (vLLM's policy, and `Engine(kv_pages=...)`'s
at `--kv_reserve=0`, which takes pages a chunk ahead), with at most `--max_rows` rows decoding.
The cost model charges a paged step's KV reads as a reserved slot's (the Pallas kernel that
`Engine` runs on GPU and TPU reads the pages in place). `--kv_reserve` f admits a request only while
the contexts plus f of every admitted request's remaining segment budget fit (SGLang's
conservative admission; 1 never preempts).
Accelerator-hours per 1,000 trained samples are measured between the end of update `--warmup`
and the end of the last update (all chips of the machine, busy or not).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sim.agents import SimRollouts, SimTokenizer, problems, role_of_prompt, sim_encode  # noqa: E402
from benchmarks.sim.cost import CHIPS, GB, MeshCost, ModelCost, ProfileCost, kv_capacity  # noqa: E402
from benchmarks.pipeline import UPDATE as BENCH_UPDATE  # noqa: E402
from benchmarks.sim.engine import SimEngine  # noqa: E402
from benchmarks.sim.lengths import ROLE_SCALE, LengthModel  # noqa: E402
from benchmarks.sim.sync import SyncRollouts  # noqa: E402
from mars_jax.models import get_preset  # noqa: E402
from mars_jax.buckets import pow2_at_least  # noqa: E402
from mars_jax.rl.rollout import RolloutConfig  # noqa: E402
from mars_jax.rl.streaming import (  # noqa: E402
    StreamingRollouts, StreamSettings, auto_problems_per_update)
from mars_jax.rl.update import UpdateConfig, cut_lengths  # noqa: E402

GiB = 1 << 30
TRAIN_STATE_BYTES_PER_PARAM = 8  # bf16 weights + AdamW mu, nu (param dtype) + gradients
OFFLOADED_BYTES_PER_PARAM = 4    # AdamW mu, nu: what `mars_jax.offload` moves to the host
USABLE_HBM = 0.9                 # of each chip's HBM, for the resident bytes and the KV cache


@dataclasses.dataclass(frozen=True)
class Hardware:
    chip: str
    chips: int
    splits: tuple[tuple[int, int], ...]  # (rollout, training) chips with overlap
    update_temp_bytes: float     # update temporaries per chip (AOT record)
    hbm_bytes: float             # as aot_compile.py counts it


HARDWARE = {
    "h200x8": Hardware("h200", 8, ((4, 4),), 69.27 * GiB, 151_397_597_184),
    "v5p-64": Hardware("v5p", 32, ((24, 8), (16, 16)), 57.01 * GiB, 95.74 * GiB),
}


def hardware(name: str) -> Hardware:
    """`HARDWARE[name]`, or `h200xN` / `v5p-N` (N / 2 chips) of any size with no overlap split;
    the update's temporaries per chip as the AOT record's (one update row per chip)."""
    if name in HARDWARE:
        return HARDWARE[name]
    kind, sep, count = name.partition("x" if name.startswith("h200") else "-")
    if kind not in ("h200", "v5p") or not sep or not count.isdigit():
        raise ValueError(f"--hardware: {name!r} is not h200xN or v5p-N")
    chips = int(count) // (2 if kind == "v5p" else 1)
    if chips < 1:
        raise ValueError(f"--hardware: {name!r} has no chips")
    like = HARDWARE["h200x8" if kind == "h200" else "v5p-64"]
    return dataclasses.replace(like, chips=chips, splits=())


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts_per_step: int = 128
    group_size: int = 8
    fan_out: int = 2
    max_stages: int = 5
    max_new_tokens: int = 64 * 1024
    max_prompt_tokens: int = 32 * 1024
    problem_words: int = 150
    answer_tokens: tuple = (("solver", 1000), ("verifier", 600), ("corrector", 1000))
    correct_rates: tuple = (("solver", 0.6), ("verifier", 0.8), ("corrector", 0.5))
    prompt_style: str = "full"
    enable_thinking: bool = True
    drop_zero_variance: bool = True
    byte_level: bool = False           # prompt tokens counted as a byte-level tokenizer's
    update_micro_batch: int = 0        # > 0: the update is charged on the padded rows of
    update_min_length: int = 128       # benchmarks/pipeline.py's batches (see padded_tokens)
    update: UpdateConfig = UpdateConfig()  # the cuts those batches run at

    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig(group_size=self.group_size, fan_out=self.fan_out,
                             selection="adaptive", max_stages=self.max_stages,
                             max_new_tokens={r: self.max_new_tokens
                                             for r in ("solver", "verifier", "corrector")},
                             max_prompt_tokens=self.max_prompt_tokens,
                             enable_thinking=self.enable_thinking,
                             prompt_style=self.prompt_style)


def free_kv_bytes_per_chip(hw: Hardware, model: ModelCost, chips: int, *, resident: str) -> float:
    """0.9 x HBM - the resident bytes per chip. resident: 'train_state+update' (one mesh, KV kept
    through the update), 'train_state' (one mesh, KV freed for the update), 'weights' (a
    rollout submesh)."""
    state = model.total_params * TRAIN_STATE_BYTES_PER_PARAM / chips
    bytes_ = {"train_state+update": state + hw.update_temp_bytes, "train_state": state,
              "weights": model.weight_bytes / chips}[resident]
    return hw.hbm_bytes * USABLE_HBM - bytes_


def mesh_slots(hw: Hardware, model: ModelCost, chips: int, *, resident: str,
               positions: int) -> int:
    """Slots of `chips` chips, each slot reserving `positions` positions of KV (as `Engine`)."""
    free = free_kv_bytes_per_chip(hw, model, chips, resident=resident)
    return chips * kv_capacity(model, free, positions)


def mesh_kv_tokens(hw: Hardware, model: ModelCost, chips: int, *, resident: str) -> int:
    """KV positions a paged cache on `chips` chips holds."""
    return chips * kv_capacity(model, free_kv_bytes_per_chip(hw, model, chips, resident=resident))


def check_train_memory(hw: Hardware, model: ModelCost, chips: int) -> None:
    need = model.total_params * TRAIN_STATE_BYTES_PER_PARAM / chips + hw.update_temp_bytes
    if need > hw.hbm_bytes:
        raise ValueError(f"training submesh of {chips} x {hw.chip}: {need / GB:.0f} GB per chip "
                         f"needed, {hw.hbm_bytes / GB:.0f} GB held")


BOUND = "bound: decode only"
SYNC = "sync"
PIPELINE_OFFLOADED = "pipeline, offloaded"
PIPELINE_KV_TO_HOST = "pipeline, KV to host"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the table: a scheduling mode on a layout of the machine."""

    label: str
    mode: str                        # 'sequential' | 'pipeline' | 'sync'
    split: tuple[int, int] | None    # rollout, training chips (overlap), or None: one mesh
    resident: str                    # see `mesh_slots`
    update_free: bool = False        # the bound: updates cost nothing
    resume: str | None = None        # overrides --resume
    offload: bool = False            # optimizer state on the host while decoding
    kv_to_host: bool = False         # the slot cache on the host while the update runs


def variants(hw: Hardware) -> list[Variant]:
    rows = [Variant("sequential", "sequential", None, "train_state+update"),
            Variant("sequential, KV freed", "sequential", None, "train_state"),
            Variant("pipeline", "pipeline", None, "train_state+update"),
            Variant("pipeline, KV freed", "pipeline", None, "train_state", resume="recompute"),
            Variant(SYNC, "sync", None, "weights", offload=True),
            Variant(PIPELINE_OFFLOADED, "pipeline", None, "weights", resume="recompute",
                    offload=True),
            Variant(PIPELINE_KV_TO_HOST, "pipeline", None, "weights", resume="keep",
                    offload=True, kv_to_host=True)]
    rows += [Variant(f"pipeline+overlap {r}:{t}", "pipeline", (r, t), "weights")
             for r, t in hw.splits]
    rows.append(Variant(BOUND, "pipeline", None, "weights", update_free=True))
    return rows


@dataclasses.dataclass
class Costs:
    decode: object      # MeshCost / ProfileCost of the rollout chips
    train: object       # of the training chips
    slots: int
    chips_total: int
    copy_seconds: float
    overlap: bool
    kv_tokens: int | None = None   # paged KV: positions the rollout chips' cache holds
    kv_reserve: float = 0.0        # paged KV: see `SimEngine`
    train_chips: int = 1
    offload_seconds: float = 0.0   # per update: the optimizer state to the device and back
    chunk_steps: int | None = None # the engine decodes in chunks of this many steps (`SimEngine`)


def paper_costs(hw: Hardware, variant: Variant, args, workload: "Workload") -> Costs:
    model = ModelCost.of(get_preset("qwen3_30b_a3b"))
    chip = CHIPS[hw.chip]
    rollout_chips, train_chips = variant.split or (hw.chips, hw.chips)
    if variant.split or variant.offload:
        check_train_memory(hw, model, train_chips)
    make = lambda n, mfu=args.update_mfu: MeshCost(
        model, chip, n, step_overhead_s=args.step_overhead_ms / 1e3,
        prefill_mfu=args.prefill_mfu, update_mfu=mfu)
    positions = args.slot_positions or workload.max_prompt_tokens + workload.max_new_tokens
    kv_tokens = None
    if args.kv == "paged":
        kv_tokens = mesh_kv_tokens(hw, model, rollout_chips, resident=variant.resident)
        slots = args.max_rows
    else:
        slots = mesh_slots(hw, model, rollout_chips, resident=variant.resident,
                           positions=positions)
    copy = make(train_chips).weight_copy_seconds(rollout_chips) if variant.split else 0.0
    train = make(train_chips, float("inf")) if variant.update_free else make(train_chips)
    offload = (2 * train.host_copy_seconds(model.total_params * OFFLOADED_BYTES_PER_PARAM)
               if variant.offload else 0.0)
    if variant.kv_to_host:  # the whole cache, as offloading the engine's slot state moves it
        offload += 2 * train.host_copy_seconds((kv_tokens or slots * positions)
                                               * model.kv_bytes_per_token)
    return Costs(make(rollout_chips), train, slots, hw.chips, copy, bool(variant.split),
                 kv_tokens, args.kv_reserve, train_chips, offload,
                 None if args.kv == "paged" else args.chunk_steps or None)


def padded_tokens(lengths: Sequence[int], micro_batch: int, min_length: int,
                  config: UpdateConfig = UpdateConfig()) -> list[int]:
    """Tokens the update computes per micro-batch row for samples of `lengths` tokens, batched
    as `rl.batching.make_batch(by_length=True)` does and cut as `rl.update` cuts them: rows
    longest first, micro-batches of `micro_batch`, each as long as the shortest of
    `update.cut_lengths` holding its longest row (micro-batches of padding rows cost nothing)."""
    longest = sorted(lengths, reverse=True)
    width = pow2_at_least(longest[0], min_length)
    cuts = cut_lengths(width, config.length_halvings, config.fine_cuts)
    out = []
    for start in range(0, len(longest), micro_batch):
        cut = next(c for c in cuts if c >= longest[start])
        out += [cut] * micro_batch
    return out


class _SizeMemo:
    """`StreamingRollouts._size` remembered per group (by its first member's uid: a complete
    group's rewards no longer change) and `_ready_samples` counted on from the last count while
    the ready list only grows (it is extended in place, or replaced): the scheduler sizes every
    ready group after each output, the simulation's hottest loop. Same results, less time."""

    def _size(self, group):
        sizes = self.__dict__.setdefault("_sizes", {})
        key = group[0].uid
        if key not in sizes:
            sizes[key] = super()._size(group)
        return sizes[key]

    def _ready_samples(self):
        ready = self._ready
        counted_list, counted, total = self.__dict__.get("_ready_count", (None, 0, 0))
        if counted_list is not ready or counted > len(ready):  # (holding the list: no id reuse)
            counted, total = 0, 0
        total += sum(self._size(g) for g in ready[counted:])
        self._ready_count = (ready, len(ready), total)
        return total


class MemoStreaming(_SizeMemo, StreamingRollouts):
    pass


class MemoSync(_SizeMemo, SyncRollouts):
    pass


def simulate(costs: Costs, mode: str, *, workload: Workload, lengths: LengthModel, updates: int,
             warmup: int, samples_per_update: int, max_inflight_rows: int, resume: str = "keep",
             staleness_bound: int = 3, seed: int = 0) -> dict:
    """Runs `updates` updates of `mode` ('sync': `SyncRollouts`); returns the measured window's
    figures."""
    tokenizer = SimTokenizer(byte_level=workload.byte_level)
    rollouts = SimRollouts(tokenizer, workload.rollout_config(), seed=seed, encode=sim_encode,
                           correct_rates=dict(workload.correct_rates))
    max_length = workload.max_prompt_tokens + workload.max_new_tokens
    engine = SimEngine(costs.decode, lengths, num_slots=costs.slots, max_length=max_length,
                       role_of=role_of_prompt, answer_tokens=dict(workload.answer_tokens),
                       kv_tokens=costs.kv_tokens, kv_reserve=costs.kv_reserve,
                       chunk_steps=costs.chunk_steps)
    overlap = costs.overlap
    schedule = MemoSync if mode == "sync" else MemoStreaming
    scheduler = schedule(
        rollouts, engine, problems(workload.problem_words, seed), StreamSettings(
            mode="sequential" if mode == "sync" else mode,
            prompts_per_step=workload.prompts_per_step, samples_per_update=samples_per_update,
            max_problems_per_update=auto_problems_per_update(workload.prompts_per_step),
            max_inflight_rows=max_inflight_rows, staleness_bound=staleness_bound, resume=resume,
            roles_trained="all", drop_zero_variance=workload.drop_zero_variance,
            mask_truncated=False,
            sampling=dict(temperature=0.85, top_p=1.0, top_k=0), chunks_per_round=1),
        stop_ids=(tokenizer.eos_token_id,), clock=engine.clock)
    version, train_free = 0, 0.0
    ends, trained, staleness, update_s = [], [], collections.Counter(), []
    lengths_seen = collections.defaultdict(list)
    window_stats, deferred, truncated = None, 0.0, 0
    for _ in range(updates):
        batch = scheduler.collect(version)
        samples = [g[i] for g in batch.groups for i, _ in scheduler.rules.trained(g)]
        sample_tokens = [len(r.prompt_ids) + len(r.response_ids) for r in samples]
        if workload.update_micro_batch:
            sample_tokens = padded_tokens(sample_tokens, workload.update_micro_batch,
                                          workload.update_min_length, workload.update)
        seconds = sum(costs.train.update_seconds(n) for n in sample_tokens)
        if len(ends) >= warmup:
            staleness.update(batch.staleness)
            deferred += batch.deferred_seconds
            for r in samples:
                lengths_seen[r.role].append(len(r.response_ids))
                truncated += r.finish_reason == "length"
        if overlap:
            end = max(engine.now, train_free) + seconds
            scheduler.decode_while(lambda: engine.now < end, version)
            if engine.now < end:
                engine.advance(end - engine.now)
            train_free = end
            engine.advance(costs.copy_seconds)
        else:
            engine.advance(seconds + costs.offload_seconds)
        version += 1
        scheduler.weights_updated(None, version)
        ends.append(engine.now)
        trained.append(len(samples))
        update_s.append(seconds)
        if len(ends) == warmup:
            window_stats = collections.Counter(engine.stats)
    if len(ends) <= warmup:
        raise RuntimeError(f"{mode}: only {len(ends)} updates ran; need more than {warmup}")
    window = ends[-1] - ends[warmup - 1] if warmup else ends[-1]
    samples = sum(trained[warmup:])
    stats = collections.Counter(engine.stats)
    stats.subtract(window_stats or {})
    return dict(
        mode=mode, slots=costs.slots, updates=len(ends), samples=samples,
        samples_per_update=statistics.mean(trained[warmup:]),
        hours_per_1k=costs.chips_total * window / 3600 / (samples / 1000),
        wall_h_per_update=window / 3600 / (len(ends) - warmup),
        update_h_per_update=statistics.mean(update_s[warmup:]) / 3600,
        update_hours_per_1k=costs.train_chips * sum(update_s[warmup:]) / 3600 / (samples / 1000),
        occupancy=stats["live_slot_seconds"] / (costs.slots * window),
        decode_occupancy=stats["live_slot_seconds"] / max(stats["decode_seconds"], 1e-12) / costs.slots,
        decode_rows=stats["live_slot_seconds"] / max(stats["decode_seconds"], 1e-12),
        preemptions=stats["preemptions"],
        decode_share=stats["decode_seconds"] / window,
        prefill_share=stats["prefill_seconds"] / window,
        staleness=dict(sorted(staleness.items())),
        deferred_share=deferred / window,
        mean_length={role: statistics.mean(v) for role, v in sorted(lengths_seen.items())},
        truncated_share=truncated / samples)


def select_rows(text: str, labels: Sequence[str]) -> list[str]:
    """The labels named in the comma-separated `text`, where a label may itself hold commas
    ('sequential, KV freed'): at each point the longest run of comma-separated parts that is a
    label is taken."""
    parts, chosen, i = text.split(","), [], 0
    while i < len(parts):
        end = next((j for j in range(len(parts), i, -1)
                    if ",".join(parts[i:j]).strip() in labels), None)
        if end is None:
            raise ValueError(f"--rows: no row {parts[i].strip()!r}; rows: {list(labels)}")
        chosen.append(",".join(parts[i:end]).strip())
        i = end
    return chosen


def run_hardware(name: str, progress: float, args) -> list[dict]:
    """The rows of `name` (`--rows`; the first, sequential row too unless `--rows_only`) at
    `progress`; a row
    whose memory does not fit is printed as such and left out. Pipeline rows update on
    `--samples_per_update` trained samples, or as many as the first barrier row (sequential or
    sync) trained per step."""
    hw = hardware(name)
    lengths = LengthModel(sigma=args.sigma, progress=progress, seed=args.seed)
    workload = Workload()
    results = []
    samples_per_update = args.samples_per_update
    chosen = variants(hw)
    if args.rows:
        wanted = set(select_rows(args.rows, [v.label for v in chosen]))
        chosen = [v for i, v in enumerate(chosen)
                  if (i == 0 and not args.rows_only) or v.label in wanted]
    base = None
    for variant in chosen:
        try:
            costs = paper_costs(hw, variant, args, workload)
        except ValueError as e:
            print(f"{variant.label:24} does not fit: {e}")
            continue
        if costs.slots < 1:
            print(f"{variant.label:24} does not fit: no slot beside the resident bytes")
            continue
        if variant.mode == "pipeline" and not samples_per_update:
            raise ValueError(f"{name}: pipeline rows need a sequential or sync row first")
        cap = args.max_inflight_rows or 2 * costs.slots
        began = time.perf_counter()
        result = simulate(costs, variant.mode, workload=workload, lengths=lengths,
                          updates=args.updates, warmup=args.warmup,
                          samples_per_update=samples_per_update
                          if variant.mode == "pipeline" else 1, max_inflight_rows=cap,
                          resume=variant.resume or args.resume, seed=args.seed)
        result["label"], result["sim_seconds"] = variant.label, time.perf_counter() - began
        if not samples_per_update:
            samples_per_update = round(result["samples_per_update"])
        if variant.label == "sequential":
            base = result["hours_per_1k"]
        results.append(result)
        print_row(result, base)
    bound = next((r for r in results if r["label"] == BOUND), None)
    if bound and base is not None:
        print(ceiling_line(next(r for r in results if r["label"] == "sequential"), bound,
                           args.update_mfu))
    return results


def ceiling_line(sequential: dict, bound: dict, update_mfu: float) -> str:
    """A ceiling on any schedule's gain over `sequential` under the cost model, taking the
    decode-only row as the least decoding can cost: sequential's accelerator-hours over its
    update's (the same FLOPs at the same MFU on any chips) plus the decode-only row's; then the
    same with the update at 100% MFU in both."""
    update, decode_only = sequential["update_hours_per_1k"], bound["hours_per_1k"]
    at_peak = update * update_mfu
    return (f"ceiling: update {update:.2f} + decode only {decode_only:.2f} acc-h/1k = "
            f"{sequential['hours_per_1k'] / (update + decode_only):.2f}x sequential; with the "
            f"update at 100% MFU "
            f"{(sequential['hours_per_1k'] - update + at_peak) / (at_peak + decode_only):.2f}x")


HEADER = (f"{'mode':24} {'slots':>5} {'acc-h/1k':>9} {'vs seq':>7} {'h/update':>9} "
          f"{'update h':>9} {'occupancy':>9} {'decode occ':>10} {'rows':>6} {'preempt':>7} "
          f"{'samples/upd':>11} {'held':>5} staleness (versions: samples)")


def print_row(r: dict, base: float | None) -> None:
    """One row; `vs seq` against `base` acc-h / 1k (None: the sequential row did not fit)."""
    versus = f"{base / r['hours_per_1k']:6.2f}x" if base else f"{'-':>7}"
    print(f"{r['label']:24} {r['slots']:5d} {r['hours_per_1k']:9.2f} "
          f"{versus} {r['wall_h_per_update']:9.2f} "
          f"{r['update_h_per_update']:9.2f} {r['occupancy']:9.1%} "
          f"{r['decode_occupancy']:10.1%} {r['decode_rows']:6.0f} {r['preemptions']:7d} "
          f"{r['samples_per_update']:11.0f} {r['deferred_share']:5.1%} {r['staleness']}",
          flush=True)


def step_grid(text: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """(rows, spans, seconds row-major) of `--cpu_step_ms`: `rows:ms,..` (no spans) or
    `rows@span:ms,..` with every rows x span pair given (`measure_cpu.py` prints it)."""
    points = {}
    for entry in text.split(","):
        where, ms = entry.split(":")
        rows, _, span = where.partition("@")
        points[int(rows), int(span or 0)] = float(ms) / 1e3
    rows = sorted({r for r, _ in points})
    spans = sorted({s for _, s in points})
    missing = [(r, s) for r in rows for s in spans if (r, s) not in points]
    if len(spans) > 1 and 0 in spans:
        raise ValueError("--cpu_step_ms: give every entry a span (rows@span:ms) or none")
    if missing:
        raise ValueError(f"--cpu_step_ms: need every rows@span pair; missing {missing}")
    grid = tuple(points[r, s] for r in rows for s in spans)
    return tuple(rows), tuple(s for s in spans if s), grid


def update_costs(text: str) -> list[tuple[int, float]]:
    """(row length, update seconds per token) of `--cpu_update_ms_per_token`: `ms` (length 0:
    every length) or `length:ms,..`, by length."""
    points = []
    for entry in text.split(","):
        length, _, ms = entry.rpartition(":")
        points.append((int(length or 0), float(ms) / 1e3))
    return sorted(points)


def profile_costs(args) -> Costs:
    """The calibration machine's measured costs (one device: nothing overlaps)."""
    rows, spans, grid = step_grid(args.cpu_step_ms)
    update_by_length = update_costs(args.cpu_update_ms_per_token)
    cost = ProfileCost(step_rows=rows, step_seconds=grid, step_spans=spans,
                       engine_buckets=bool(spans),
                       prefill_per_token_s=args.cpu_prefill_ms_per_token / 1e3,
                       update_per_token_s=update_by_length[-1][1],
                       update_lengths=tuple(n for n, _ in update_by_length if n),
                       update_per_token_by_length=tuple(t for n, t in update_by_length if n),
                       update_per_sample_s=args.cpu_update_ms_per_sample / 1e3)
    return Costs(cost, cost, args.cpu_slots, 1, 0.0, False)


def run_profile(args) -> None:
    """Predicts `benchmarks/pipeline.py`'s trained samples/s per mode from this machine's
    costs, on that benchmark's workload (its defaults: 16 slots, log-normal lengths median 256,
    sigma 1.0, cap 2048, next prompts embedding 32 characters of an output, groups of 4,
    fan-out 2, 1 problem per sequential batch, the pipeline updating on as many samples as a
    sequential batch trained on average, staleness bound 4, `recompute`, solve / verify rates
    0.5 / 0.8, compact prompts counted in byte-level tokens, the update charged on its padded
    micro-batches of 4 at the benchmark's cuts)."""
    workload = Workload(prompts_per_step=args.cpu_prompts, group_size=args.cpu_group,
                        fan_out=args.cpu_fan_out,
                        max_new_tokens=args.cpu_budget,
                        max_prompt_tokens=384, problem_words=args.cpu_problem_words,
                        prompt_style="compact", enable_thinking=False,
                        # --cpu_visible=0: an output is embedded whole in the next prompt
                        # (the simulated engine shows at most half of an output as answer
                        # words, each 2 byte-level tokens, 'x' and its space: as many prompt
                        # tokens as the output had). V > 0: an output is a thought and V
                        # visible tokens (V / 2 answer words), as benchmarks/pipeline.py's
                        # --visible.
                        answer_tokens=tuple((role, args.cpu_visible // 2 or 1 << 20)
                                            for role in ("solver", "verifier", "corrector")),
                        byte_level=True, update_micro_batch=4, update_min_length=128,
                        update=BENCH_UPDATE,
                        correct_rates=(("solver", 0.5), ("verifier", 0.8), ("corrector", 0.5)),
                        drop_zero_variance=args.cpu_drop_zero_variance)
    lengths = LengthModel(cap=args.cpu_budget, sigma=args.cpu_sigma, median=args.cpu_median,
                          role_scale=(("solver", 1.0), ("verifier", 1.0), ("corrector", 1.0)),
                          seed=args.seed)
    costs = profile_costs(args)
    samples_per_update = 1  # sequential: every trajectory of its batch; the pipeline: their mean
    results = []
    for mode in ("sequential", "pipeline"):
        if mode == "pipeline":
            samples_per_update = round(results[0]["samples_per_update"])
        r = simulate(costs, mode, workload=workload, lengths=lengths, updates=args.updates,
                     warmup=args.warmup, samples_per_update=samples_per_update,
                     max_inflight_rows=args.max_inflight_rows or 2 * costs.slots,
                     resume="recompute", staleness_bound=4, seed=args.seed)
        r["samples_per_s"] = 1000 / (r["hours_per_1k"] * 3600)
        results.append(r)
        print(f"{mode:10} predicted {r['samples_per_s']:.3f} samples/s; per update "
              f"{r['wall_h_per_update'] * 3600:.1f} s (update {r['update_h_per_update'] * 3600:.1f}"
              f" s), {r['samples_per_update']:.0f} samples; slot occupancy while decoding "
              f"{r['decode_occupancy']:.1%}; staleness {r['staleness']}")
    print(f"predicted pipeline / sequential: "
          f"{results[1]['samples_per_s'] / results[0]['samples_per_s']:.2f}x")


def arg_parser() -> argparse.ArgumentParser:
    """The command line (`pipeline_curve.py` reuses it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default="h200x8,v5p-64")
    parser.add_argument("--progress", default="0,1",
                        help="training progress points (Solver mean 19k at 0, 28k at 1)")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sigma", type=float, default=0.7)
    parser.add_argument("--step_overhead_ms", type=float, default=2.0)
    parser.add_argument("--prefill_mfu", type=float, default=0.5)
    parser.add_argument("--update_mfu", type=float, default=0.3)
    parser.add_argument("--max_inflight_rows", type=int, default=0, help="0: 2 x slots")
    parser.add_argument("--slot_positions", type=int, default=0,
                        help="KV positions reserved per slot (0: prompt cap + budget, as Engine)")
    parser.add_argument("--resume", default="keep", choices=("keep", "recompute"))
    parser.add_argument("--chunk_steps", type=int, default=16,
                        help="reserved KV: the engine decodes in chunks of this many steps, "
                             "as Engine (rollout.engine_chunk_steps); 0: every request ends "
                             "at its own step (the tables before 2026-12-07)")
    parser.add_argument("--kv", default="reserved", choices=("reserved", "paged"),
                        help="reserved: a slot holds --slot_positions of KV (as Engine); paged: "
                             "the rollout chips' free HBM is one pool of positions, each request "
                             "holding its context (vLLM's paged cache; Engine(kv_pages=...))")
    parser.add_argument("--max_rows", type=int, default=1024,
                        help="--kv=paged: the most rows decoded at once on the rollout chips")
    parser.add_argument("--kv_reserve", type=float, default=0.0,
                        help="--kv=paged: fraction of each admitted request's remaining segment "
                             "budget admission keeps free (0: vLLM's greedy admission, 1: never "
                             "preempts)")
    parser.add_argument("--rows", default="",
                        help="comma-separated row labels to run, e.g. 'sequential, KV freed,sync' "
                             "(the sequential row, the base of `vs seq`, always runs); empty: all")
    parser.add_argument("--rows_only", action="store_true",
                        help="run only the --rows named (not the sequential row)")
    parser.add_argument("--samples_per_update", type=int, default=0,
                        help="pipeline rows' update size (0: what the first barrier row trained "
                             "per step, ~8,500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="paper", choices=("paper", "cpu"),
                        help="cpu: predict benchmarks/pipeline.py from the --cpu_* costs")
    cpu = parser.add_argument_group("cpu profile (calibration; defaults: bench preset, "
                                    "measured 2026-12-01)")
    cpu.add_argument("--cpu_step_ms", default="1:18,4:44,16:87,32:140",
                     help="decode-step ms: rows:ms,.. by live rows, or rows@span:ms,.. by the "
                          "engine's slot bucket and KV span (measure_cpu.py prints it)")
    cpu.add_argument("--cpu_prefill_ms_per_token", type=float, default=0.5)
    cpu.add_argument("--cpu_update_ms_per_token", default="1.0",
                     help="update ms per trained token: `ms`, or `length:ms,..` by row length")
    cpu.add_argument("--cpu_update_ms_per_sample", type=float, default=0.0)
    cpu.add_argument("--cpu_slots", type=int, default=16)
    cpu.add_argument("--cpu_group", type=int, default=4)
    cpu.add_argument("--cpu_prompts", type=int, default=1)
    cpu.add_argument("--cpu_fan_out", type=int, default=2)
    cpu.add_argument("--cpu_budget", type=int, default=2048)
    cpu.add_argument("--cpu_problem_words", type=int, default=4,
                     help="words per problem (arith: `What is 7 + 3 * 2?` is ~20 bytes)")
    cpu.add_argument("--cpu_median", type=float, default=256)
    cpu.add_argument("--cpu_sigma", type=float, default=1.0)
    cpu.add_argument("--cpu_drop_zero_variance", action="store_true")
    cpu.add_argument("--cpu_visible", type=int, default=32,
                     help="visible tokens per output (0: all of it); the rest is thought")
    return parser


def main() -> None:
    args = arg_parser().parse_args()
    if args.profile == "cpu":
        run_profile(args)
        return
    for name in args.hardware.split(","):
        for progress in (float(p) for p in args.progress.split(",")):
            lengths = LengthModel(sigma=args.sigma, progress=progress)
            fit = ", ".join(f"{role} mean {lengths.mean(role):,.0f} "
                            f"(median {2.718281828 ** lengths.mu(role):,.0f}, "
                            f"{lengths.truncated_fraction(role):.1%} at the cap)"
                            for role in ROLE_SCALE)
            print(f"\n{name}, progress {progress:g}: {fit}\n{HEADER}")
            results = run_hardware(name, progress, args)
            print("mean trained output length: " + ", ".join(
                f"{k} {v:,.0f}" for k, v in results[0]["mean_length"].items())
                + f"; ended by length: {results[0]['truncated_share']:.1%} of trained samples"
                + f"; simulated in {sum(r['sim_seconds'] for r in results):.0f} s")


if __name__ == "__main__":
    main()
