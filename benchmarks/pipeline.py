r"""Agentic pipeline vs sequential training on the streaming scheduler: trained samples per
second at a generation-dominated, long-tailed setting.

  python -m benchmarks.pipeline [--updates=3] [--warmup=1] [--slots=16] [--median=256]
                                [--sigma=1.0] [--cap=2048] [--group=4] [--problems=1]
                                [--fan_out=2] [--visible=32] [--min_span=128] [--precompile]

Both modes run the real `StreamingRollouts` on one `Engine` (bench preset, float32, random
weights) and the real PPO update (`learner.ppo_update`) on the same number of trained samples per
update (times net of tracing, lowering and XLA compilation, which the warm-up updates cannot
all absorb: batch shapes vary). Output lengths are log-normal (median `--median`, `--sigma`,
cut at `--cap`), drawn per rollout from its sequence seed and forced on the engine
(`pipeline_workload.ForcedLengths`), so both modes decode the same lengths; grades are drawn
at seeded rates (`SeededGrades`). As in
long-CoT RL, an output is mostly thought: the next stage's prompt embeds only its last
`--visible` characters (`SeededGrades.visible`; 0: all of it). The
sequential mode decodes `--problems` problems stage by stage with barriers and trains only when
every trajectory is done; the pipeline streams and updates on as many samples as a sequential
batch had on average. Prints per mode the time split into rollout and
update, slot occupancy and staleness, and the ratio; the first `--warmup` updates of each mode
(compilation) are not counted. `--min_span` is the engine's shortest decode span (a larger one
compiles fewer decode programs: on a GPU, XLA compilation dominates a short run), and
`--precompile` compiles the engine's programs ahead on a thread pool and gives every update one
row length and micro-batch count (one update program, compiled beside them; micro-batches are
still cut as short).
The bound printed
beside it: sequential time per sample over the pipeline's update time per sample (one mesh: the
update cannot overlap decoding).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time

import jax
import numpy as np
from flax import nnx

from benchmarks import bench_utils
from benchmarks.pipeline_workload import ForcedLengths, LengthModel, SeededGrades
from mars_jax.data import datasets
from mars_jax.data.iterator import ProblemIterator
from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.models import create_model, get_preset
from mars_jax.buckets import pow2_at_least
from mars_jax.rl.batching import TrainSample, make_batch
from mars_jax.rl.learner import LearnerConfig, ppo_update
from mars_jax.rl.rollout import RolloutConfig
from mars_jax.rl.samples import training_samples
from mars_jax.rl.streaming import StreamingRollouts, StreamSettings, auto_problems_per_update
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import UpdateConfig, init_train_state, train_step
from mars_jax.sampling import Engine
from mars_jax.sampling.precompile import compile_ahead

MAX_PROMPT = 384
# Micro-batches cut to the shortest of L, 3L/4, L/2, .. L/8 that holds them (L up to 4096 at
# the 2048-token cap): above L/8 at most 1.5x a micro-batch's longest row.
UPDATE = UpdateConfig(length_halvings=3, fine_cuts=True)
OPTIMIZER = make_optimizer(1e-5)  # one object: the update program is compiled once per shape


def update_shapes(args) -> tuple[int, int, UpdateConfig]:
    """Rows' minimum length, the minimum number of micro-batches of 4 and the update's cuts.
    With `--precompile` every batch takes the longest length and the micro-batches of a
    sequential batch's most samples (one update program for both modes; micro-batches without
    samples cost nothing), with one more halving, so that micro-batches are cut as short as
    at half that length; else the fewest that hold a batch."""
    if not args.precompile:
        return 128, 1, UPDATE
    most = args.problems * args.group * (1 + 4 * args.fan_out)  # S, then V, C, V, C
    return (pow2_at_least(MAX_PROMPT + args.cap, 128), pow2_at_least(-(-most // 4), 1),
            dataclasses.replace(UPDATE, length_halvings=UPDATE.length_halvings + 1))


def compile_update(state, graphdef, min_length: int, min_micro: int,
                   update_config: UpdateConfig) -> None:
    """Compiles the update at the one shape `--precompile` gives every batch (`update_shapes`)."""
    batch = make_batch([TrainSample([1], [1], [0.0], 0.0)], micro_batch_size=4,
                       min_length=min_length, min_micro=min_micro, by_length=True)
    train_step.lower(state, batch, None, graphdef=graphdef, optimizer=OPTIMIZER,
                     config=update_config).compile()


def run(mode: str, args, samples_per_update: int) -> dict:
    tokenizer = tiny_tokenizer()
    config = get_preset("bench").replace(vocab_size=512)  # the byte-level tokenizer's ids
    model = create_model(config, seed=0)
    graphdef, _ = nnx.split(model, nnx.Param)
    state = init_train_state(model, OPTIMIZER)
    budgets = {"solver": args.cap, "verifier": args.cap, "corrector": args.cap}
    rollouts = SeededGrades(tokenizer, RolloutConfig(
        group_size=args.group, fan_out=args.fan_out, selection="random", prompt_style="compact",
        max_new_tokens=budgets, max_prompt_tokens=MAX_PROMPT), seed=0, encode=encode_chat)
    rollouts.visible = args.visible
    engine = Engine(model, num_slots=args.slots, max_length=MAX_PROMPT + args.cap,
                    chunk_steps=16, seed=0, min_span=args.min_span)
    min_length, min_micro, update_config = update_shapes(args)
    if args.precompile:
        began = time.perf_counter()
        update = threading.Thread(target=compile_update, args=(
            state, graphdef, min_length, min_micro, update_config))
        update.start()
        count = compile_ahead(engine, range(1, MAX_PROMPT + args.cap + 1))  # (+ tokens: recompute)
        update.join()
        print(f"  {mode}: {count} engine programs and the update compiled ahead in "
              f"{time.perf_counter() - began:.1f} s", flush=True)
    stream = StreamingRollouts(
        rollouts, ForcedLengths(engine, LengthModel(args.median, args.sigma, args.cap)),
        ProblemIterator(datasets.load("arith", "train"), seed=0), StreamSettings(
            mode=mode, prompts_per_step=args.problems, samples_per_update=samples_per_update,
            max_problems_per_update=auto_problems_per_update(args.problems),
            max_inflight_rows=2 * args.slots, staleness_bound=4, resume="recompute",
            roles_trained="all", drop_zero_variance=False,
            mask_truncated=False,
            sampling=dict(temperature=1.0, top_p=1.0, top_k=0), chunks_per_round=1),
        stop_ids=eos_token_ids(tokenizer))
    learner = LearnerConfig(ppo_epochs=1, mini_batches=1, pi_old="sampler")
    rows = []
    for version in range(args.warmup + args.updates):
        began, compiled = time.perf_counter(), COMPILE_SECONDS[0]
        batch = stream.collect(version)
        rolled, compiled_rollout = time.perf_counter(), COMPILE_SECONDS[0]
        samples = training_samples(batch.groups, rules=stream.rules, normalize_std=True)
        state, _ = ppo_update(state, samples, build_batch=lambda part: make_batch(
            part, micro_batch_size=4, min_length=min_length, min_micro=min_micro,
            by_length=True), ref_params=None,
            graphdef=graphdef, optimizer=OPTIMIZER, update_config=update_config,
            learner=learner, rng=np.random.default_rng(version))
        jax.block_until_ready(state.params)
        updated = time.perf_counter()
        stream.weights_updated(nnx.merge(graphdef, state.params), version + 1)
        rows.append(dict(rollout=rolled - began - (compiled_rollout - compiled),
                         update=updated - rolled - (COMPILE_SECONDS[0] - compiled_rollout),
                         compile=COMPILE_SECONDS[0] - compiled, samples=len(samples),
                         tokens=batch.generated_tokens, occupancy=batch.occupancy,
                         staleness=max(batch.staleness, default=0)))
        print(f"  {mode} update {version + 1}/{args.warmup + args.updates}: "
              f"{rows[-1]['samples']} samples, rollout {rows[-1]['rollout']:.1f} s, update "
              f"{rows[-1]['update']:.1f} s, compile {rows[-1]['compile']:.1f} s", flush=True)
    rows = rows[args.warmup:]
    total = lambda key: sum(r[key] for r in rows)
    seconds = total("rollout") + total("update")
    return dict(samples_per_s=total("samples") / seconds, samples=total("samples"),
                rollout_s=total("rollout"), update_s=total("update"), seconds=seconds,
                tokens=total("tokens"), compile_s=total("compile"),
                occupancy=statistics.mean(r["occupancy"] for r in rows),
                staleness=max(r["staleness"] for r in rows))


# Tracing, lowering and XLA compilation so far; subtracted from the phase it fell in.
COMPILE_SECONDS = [0.0]
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def _count_compiles(event: str, seconds: float, **_) -> None:
    if event in COMPILE_EVENTS:
        COMPILE_SECONDS[0] += seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--median", type=float, default=256)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--cap", type=int, default=2048)
    parser.add_argument("--min_span", type=int, default=128)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--problems", type=int, default=1)
    parser.add_argument("--fan_out", type=int, default=2)
    parser.add_argument("--precompile", action="store_true",
                        help="compile the engine's programs ahead (`precompile.compile_ahead`, a "
                             "thread per CPU up to 16) and give every update one shape")
    parser.add_argument("--visible", type=int, default=32,
                        help="characters of an output the next prompt embeds (0: all of it; "
                             "else the rest reads as thought, as a thinking model's)")
    args = parser.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    print(bench_utils.machine_line())
    print(f"bench preset (vocab 512), float32, {args.slots} slots; lengths log-normal median "
          f"{args.median:g}, sigma {args.sigma:g}, cap {args.cap}; groups of {args.group}, "
          f"fan-out {args.fan_out}, 5 stages; {args.problems} problems per sequential batch; "
          f"next prompts embed {args.visible or 'all'} characters of an output")
    results = {"sequential": run("sequential", args, samples_per_update=1)}
    # The pipeline updates on as many samples as a sequential batch trained on average.
    per_update = round(results["sequential"]["samples"] / args.updates)
    results["pipeline"] = run("pipeline", args, samples_per_update=per_update)
    print(f"samples per update: {per_update} (the sequential mean)")
    for mode, r in results.items():
        print(f"{mode:10s} {r['samples_per_s']:6.3f} samples/s  ({r['samples']} samples in "
              f"{r['seconds']:.1f} s: rollout {r['rollout_s']:.1f} s "
              f"({100 * r['rollout_s'] / r['seconds']:.0f}%), update {r['update_s']:.1f} s; "
              f"{r['tokens']} tokens; occupancy {r['occupancy']:.2f}; max staleness "
              f"{r['staleness']}; {r['compile_s']:.1f} s of compilation left out)")
    seq, pipe = results["sequential"], results["pipeline"]
    bound = (seq["seconds"] / seq["samples"]) / (pipe["update_s"] / pipe["samples"])
    print(f"pipeline / sequential trained samples/s: "
          f"{pipe['samples_per_s'] / seq['samples_per_s']:.2f}x  (one-mesh bound, pipeline "
          f"rollout free: {bound:.2f}x)")


if __name__ == "__main__":
    main()
