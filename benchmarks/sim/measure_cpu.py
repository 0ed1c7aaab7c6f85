r"""Measures this machine's costs for `pipeline_sim.py --profile=cpu` and prints them as flags.

  python benchmarks/sim/measure_cpu.py [--preset=bench] [--vocab_size=512] [--slots=16]
      [--max_length=896]     # benchmarks/pipeline.py's model and engine

Decode-step seconds at 1, 4, 16 and `slots` live rows: `Engine.stats` decode seconds / decode
steps of a second pass (the first compiles) of that many requests decoding `--steps` tokens each
(no stop ids; once nothing waits the engine gathers the live rows into the smallest slot bucket
that holds them). Prefill: prefill seconds per prompt token of the same pass. Update: one
`train_step` over `--update_rows` rows of `--update_length` tokens (second call), per token.
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
from mars_jax.rl.update import UpdateConfig, init_train_state, make_optimizer, train_step  # noqa: E402
from mars_jax.sampling import Engine  # noqa: E402


def decode_costs(model, rows: int, *, slots: int, max_length: int, steps: int,
                 prompt_len: int) -> tuple[float, float]:
    """(seconds per decode step, prefill seconds per token) at `rows` live rows."""
    engine = Engine(model, num_slots=slots, max_length=max_length, chunk_steps=8)
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
    """Seconds per token of one `train_step` over `rows` rows of `length` tokens."""
    graphdef, _ = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(1e-4)
    state = init_train_state(model, optimizer)
    half = length // 2
    samples = [TrainSample(list(range(1, half + 1)), list(range(1, length - half + 1)),
                           [-1.0] * (length - half), 1.0 if i % 2 else -1.0) for i in range(rows)]
    batch = make_batch(samples, micro_batch_size=rows, min_length=length)
    seconds = []
    for _ in range(2):
        began = time.perf_counter()
        state, _ = train_step(state, batch, None, graphdef=graphdef, optimizer=optimizer,
                              config=UpdateConfig())
        jax.block_until_ready(state.step)
        seconds.append(time.perf_counter() - began)
    return seconds[-1] / (rows * length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--vocab_size", type=int, default=512, help="0: the preset's")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=896)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--update_rows", type=int, default=8)
    parser.add_argument("--update_length", type=int, default=512)
    args = parser.parse_args()
    config = get_preset(args.preset)
    model = create_model(config.replace(vocab_size=args.vocab_size or config.vocab_size), seed=0)
    points, prefill = [], []
    for rows in sorted({1, 4, 16, args.slots}):
        step, per_token = decode_costs(model, rows, slots=args.slots, max_length=args.max_length,
                                       steps=args.steps, prompt_len=args.prompt_len)
        points.append(f"{rows}:{step * 1e3:.1f}")
        prefill.append(per_token)
        print(f"rows {rows:3d}: decode step {step * 1e3:.1f} ms, prefill {per_token * 1e3:.3f} "
              f"ms/token", flush=True)
    update = update_cost(model, rows=args.update_rows, length=args.update_length)
    print(f"update: {update * 1e3:.3f} ms/token")
    print(f"--cpu_step_ms={','.join(points)} --cpu_prefill_ms_per_token="
          f"{np.median(prefill) * 1e3:.3f} --cpu_update_ms_per_token={update * 1e3:.3f} "
          f"--cpu_slots={args.slots}")


if __name__ == "__main__":
    main()
