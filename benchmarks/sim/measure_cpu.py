r"""Measures this machine's costs for `pipeline_sim.py --profile=cpu` and prints them as flags.

  python benchmarks/sim/measure_cpu.py [--preset=bench] [--vocab_size=512] [--slots=16]
      [--max_length=2432]    # benchmarks/pipeline.py's model and engine

Decode-step seconds on a grid of live rows (1, 2, 4, .., `slots`) x KV spans (`--spans`):
`Engine.stats` decode seconds / decode steps of a second pass (the first compiles) of that many
requests with prompts of span - `--steps` - 1 tokens decoding `--steps` tokens each (no stop ids;
nothing waits, so the engine decodes the smallest slot bucket that holds them, over the span the
longest needs). Every decode chunk of such a request takes the span it is labelled with
(`chunk_spans`; a span for which it would not is a usage error). Prefill: prefill seconds per
prompt token of the same passes (prompts of those lengths). Update: one forward and backward
over `--update_rows` rows of each of `--update_lengths` tokens (second call), per token.
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
from mars_jax.sampling.engine import MIN_SPAN, span_bucket  # noqa: E402

CHUNK_STEPS = 16


def prompt_length(span: int, steps: int) -> int:
    """The prompt length whose requests reach `span` positions at their last decode chunk
    (prompt + `steps` + the one position `Engine._span` adds)."""
    return span - steps - 1


def chunk_spans(prompt_len: int, steps: int, max_length: int,
                chunk_steps: int = CHUNK_STEPS) -> tuple[int, int]:
    """The smallest and the largest KV span the engine's decode chunks take for requests of
    `prompt_len` tokens decoding `steps` tokens (`Engine._span`: the reach by a chunk's end
    plus one, bucketed; it grows chunk by chunk, from at least `prompt_len` + a chunk)."""
    first = prompt_len + min(chunk_steps, steps) + 1
    return span_bucket(first, max_length), span_bucket(prompt_len + steps + 1, max_length)


def span_error(span: int, steps: int, max_length: int) -> str | None:
    """Why requests for `span` would not decode over `span` alone, or None."""
    prompt_len = prompt_length(span, steps)
    taken = chunk_spans(prompt_len, steps, max_length)
    if prompt_len >= 1 and taken == (span, span):
        return None
    return (f"--spans: span {span} with --steps={steps} needs a prompt of {prompt_len} tokens "
            f"and decodes over spans {taken}, not {span} alone (spans are 2^k or 3 * 2^(k-1), "
            f"at least {MIN_SPAN}, at most --max_length)")


def decode_costs(model, rows: int, *, slots: int, max_length: int, steps: int,
                 prompt_len: int) -> tuple[float, float]:
    """(seconds per decode step, prefill seconds per token) at `rows` live rows."""
    engine = Engine(model, num_slots=slots, max_length=max_length, chunk_steps=CHUNK_STEPS)
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
    spans = [int(s) for s in args.spans.split(",")]
    for error in filter(None, (span_error(span, args.steps, args.max_length) for span in spans)):
        parser.error(error)
    config = get_preset(args.preset)
    model = create_model(config.replace(vocab_size=args.vocab_size or config.vocab_size), seed=0)
    row_counts = [1 << k for k in range(args.slots.bit_length()) if 1 << k < args.slots]
    points, prefill = [], []
    for span in spans:
        for rows in row_counts + [args.slots]:
            step, per_token = decode_costs(model, rows, slots=args.slots,
                                           max_length=args.max_length, steps=args.steps,
                                           prompt_len=prompt_length(span, args.steps))
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
