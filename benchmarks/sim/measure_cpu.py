r"""Measures this machine's costs for `pipeline_sim.py --profile=cpu` and prints them as flags.

  python benchmarks/sim/measure_cpu.py [--preset=bench] [--vocab_size=512] [--slots=16]
      [--max_length=2432]    # benchmarks/pipeline.py's model and engine

Decode-step seconds on a grid of live rows (1, 2, 4, .., `slots`) x KV spans (`--spans`):
`Engine.stats` decode seconds / decode steps of a second pass (the first compiles) of that many
requests with prompts of half the span decoding `--steps` tokens each (no stop ids; nothing
waits, so the engine decodes the smallest slot bucket that holds them, over the span the
longest needs). Prefill: prefill seconds per prompt token of the same passes. Update: one
forward and backward over `--update_rows` rows of each of `--update_lengths` tokens (second
call), per token.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mars_jax.models import create_model, get_preset  # noqa: E402
from mars_jax.rl.batching import TrainSample, make_batch  # noqa: E402
from mars_jax.rl.update import UpdateConfig, batch_gradients  # noqa: E402
from mars_jax.sampling import Engine  # noqa: E402


def decode_costs(model, rows: int, *, slots: int, max_length: int, steps: int,
                 prompt_len: int) -> tuple[float, float]:
    """(seconds per decode step, prefill seconds per token) at `rows` live rows."""
    engine = Engine(model, num_slots=slots, max_length=max_length, chunk_steps=16)
    rng = np.random.default_rng(0)
    for _ in range(2):  # the first pass compiles
        engine.stats.clear()
        for i in range(rows):
            engine.submit(rng.integers(1, engine.vocab_size, size=prompt_len).tolist(),
                          max_new_tokens=steps, seed=i)
        engine.run()
    stats = engine.stats
    return (stats["decode_seconds"] / stats["decode_steps"],
            stats["prefill_seconds"] / stats["prefill_tokens"])


def update_cost(model, *, rows: int, length: int) -> float:
    """Seconds per token of the update's forward and backward over one micro-batch of `rows`
    rows of `length` tokens (`update.batch_gradients`, second call; the optimizer's step, once
    per update, is left out)."""
    graphdef, params = nnx.split(model, nnx.Param)
    half = length // 2
    samples = [TrainSample(list(range(1, half + 1)), list(range(1, length - half + 1)),
                           [-1.0] * (length - half), 1.0 if i % 2 else -1.0) for i in range(rows)]
    batch = make_batch(samples, micro_batch_size=rows, min_length=length)
    gradients = jax.jit(lambda p, b: batch_gradients(p, b, None, graphdef=graphdef,
                                                     config=UpdateConfig())[0])
    seconds = []
    for _ in range(2):
        began = time.perf_counter()
        jax.block_until_ready(gradients(params, batch))
        seconds.append(time.perf_counter() - began)
    return seconds[-1] / (rows * length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--vocab_size", type=int, default=512, help="0: the preset's")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=2432)
    parser.add_argument("--spans", default="128,512,2048")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--update_rows", type=int, default=4,
                        help="rows of the update's micro-batch (benchmarks/pipeline.py: 4)")
    parser.add_argument("--update_lengths", default="256,512,1024,2048,4096")
    args = parser.parse_args()
    config = get_preset(args.preset)
    model = create_model(config.replace(vocab_size=args.vocab_size or config.vocab_size), seed=0)
    row_counts = [1 << k for k in range(args.slots.bit_length()) if 1 << k < args.slots]
    points, prefill = [], []
    for span in (int(s) for s in args.spans.split(",")):
        for rows in row_counts + [args.slots]:
            step, per_token = decode_costs(model, rows, slots=args.slots,
                                           max_length=args.max_length, steps=args.steps,
                                           prompt_len=span // 2)
            points.append(f"{rows}@{span}:{step * 1e3:.1f}")
            prefill.append(per_token)
            print(f"rows {rows:3d}, span {span:5d}: decode step {step * 1e3:.1f} ms, prefill "
                  f"{per_token * 1e3:.3f} ms/token", flush=True)
    updates = []
    for length in (int(n) for n in args.update_lengths.split(",")):
        update = update_cost(model, rows=args.update_rows, length=length)
        updates.append(f"{length}:{update * 1e3:.3f}")
        print(f"update, {args.update_rows} rows of {length}: {update * 1e3:.3f} ms/token",
              flush=True)
    print(f"--cpu_step_ms={','.join(points)} --cpu_prefill_ms_per_token="
          f"{np.median(prefill) * 1e3:.3f} --cpu_update_ms_per_token={','.join(updates)} "
          f"--cpu_slots={args.slots}")


if __name__ == "__main__":
    main()
