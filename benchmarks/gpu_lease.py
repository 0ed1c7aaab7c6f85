"""What a GPU lease measures (issue 64), printed as one table: run by gpu.sh's `lease` part.

Usage: python benchmarks/gpu_lease.py [--preset qwen3_30b_a3b] [--num-layers 4]
           [--train-rows 2 --train-len 4096] [--slots 256 --requests 512]
           [--peak-tflops 989] [--peak-hbm-tbs 4.8]

Random bf16 weights of `preset` (the paper's Qwen3-30B-A3B shapes) with `num-layers` layers.
  update   loss + grads + AdamW of `train-rows` x `train-len` tokens, layers rematerialised, per
           MoE dispatch: `sorted` (`auto`'s on GPU) and `mgpu` (the Pallas Mosaic GPU grouped
           matmul). MFU = 3 x the forward's matmul FLOPs (`bench_utils.forward_flops`) / time /
           peak.
  prefill  the forward of the same tokens, per dispatch (MFU likewise, 1 x).
  decode   the paged `Engine` (`slots` slots over the KV memory of `slots / 4` reserved slots,
           `benchmarks/engine.py`'s long-tailed workload, greedy): output tokens/s per GPU, the
           slots held (rows decoding, averaged over decode steps), and the HBM share: bytes the
           decode must read (every weight but the embedding per step, and each output token's
           context of KV once) / decode seconds / peak bandwidth.
Seconds are the median of `--repeats` timed calls after one warm-up (compile) call; a row whose
program fails to compile or run says why instead. Defaults are H200's peaks (H100 SXM: 989
TFLOP/s, 3.35 TB/s).
"""
from __future__ import annotations

import argparse
import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bench_utils
import engine as engine_bench
from gpu import adamw_step_seconds, build, timed, weight_bytes

DISPATCHES = ("sorted", "mgpu")
COLUMNS = ("measure", "moe", "tokens/s", "ms", "MFU", "HBM share", "notes")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3_30b_a3b")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--train-rows", type=int, default=2)
    parser.add_argument("--train-len", type=int, default=4096)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense (H200)")
    parser.add_argument("--peak-hbm-tbs", type=float, default=4.8, help="HBM TB/s (H200)")
    return parser.parse_args()


def _tokens(config, rows: int, length: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(1, config.vocab_size, (rows, length)))


def update_row(args, moe_impl: str) -> dict:
    model = build(args, remat=True, moe_impl=moe_impl)
    ids = _tokens(model.config, args.train_rows, args.train_len)
    seconds = adamw_step_seconds(model, ids, args.repeats)
    flops = 3 * bench_utils.forward_flops(model.config, *ids.shape)
    return dict(tokens=ids.size, seconds=seconds, flops=flops,
                notes=f"{args.train_rows} x {args.train_len} tokens, remat, AdamW")


def prefill_row(args, moe_impl: str) -> dict:
    model = build(args, moe_impl=moe_impl)
    graphdef, params = nnx.split(model)
    ids = _tokens(model.config, args.train_rows, args.train_len)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    seconds = timed(lambda: forward(params, ids).block_until_ready(), args.repeats)
    return dict(tokens=ids.size, seconds=seconds,
                flops=bench_utils.forward_flops(model.config, *ids.shape),
                notes=f"{args.train_rows} x {args.train_len} tokens, logits")


def decode_row(args) -> dict:
    from mars_jax.sampling import Engine
    from mars_jax.sampling.engine import kv_bytes_per_token

    model = build(args)
    prompt_len = 64
    lengths = engine_bench.output_lengths(args.requests, 0)
    prompts = np.random.default_rng(0).integers(1, model.config.vocab_size,
                                                (args.requests, prompt_len)).tolist()
    pages = engine_bench.kv_pages(args.slots // 4, prompt_len, 64)
    engine = Engine(model, num_slots=args.slots, max_length=prompt_len + engine_bench.MAX_NEW,
                    chunk_steps=16, kv_pages=pages, page_size=64)

    def run():
        for prompt, n in zip(prompts, lengths):
            engine.submit(prompt, max_new_tokens=int(n), temperature=0.0)
        engine.stats.clear()
        engine.run()

    timed(run, args.repeats)
    s = engine.stats
    # Each output token's step reads its context once: the prompt and the tokens before it.
    context = float(np.sum(lengths * prompt_len + lengths * (lengths - 1) / 2))
    read = (s["decode_steps"] * weight_bytes(model)
            + context * kv_bytes_per_token(model.config))
    return dict(tokens=s["tokens"], seconds=s["decode_seconds"], bytes=read,
                notes=f"{engine.num_slots} slots over {pages} pages of 64, "
                      f"{s['row_steps'] / s['decode_steps']:.0f} held on average, "
                      f"{s['preemptions']} preemptions, paged attention "
                      f"{engine.paged_attention}")


def _cells(name: str, moe: str, row: dict, args) -> list[str]:
    seconds = row["seconds"]
    mfu = f"{row['flops'] / seconds / (args.peak_tflops * 1e12):.1%}" if "flops" in row else "-"
    hbm = (f"{row['bytes'] / seconds / (args.peak_hbm_tbs * 1e12):.0%}" if "bytes" in row
           else "-")
    return [name, moe, f"{row['tokens'] / seconds:,.0f}", f"{seconds * 1e3:,.1f}", mfu, hbm,
            row["notes"]]


def main() -> None:
    args = parse_args()
    print(f"devices: {jax.devices()}; jax {jax.__version__}; {args.preset} shapes, "
          f"{args.num_layers} layers, bf16; peaks {args.peak_tflops:.0f} TFLOP/s, "
          f"{args.peak_hbm_tbs} TB/s", flush=True)
    # Most wanted first: a time limit that cuts the run keeps the rows printed so far.
    measures = [("update", moe, functools.partial(update_row, args, moe)) for moe in DISPATCHES]
    measures.append(("decode", "auto", functools.partial(decode_row, args)))
    measures += [("prefill", moe, functools.partial(prefill_row, args, moe))
                 for moe in DISPATCHES]
    table = []
    for name, moe, measure in measures:
        try:
            table.append(_cells(name, moe, measure(), args))
        except Exception as error:  # a failed row is reported, the others still run
            traceback.print_exc()
            table.append([name, moe, "-", "-", "-", "-",
                          f"failed: {type(error).__name__}: {str(error)[:120]}"])
        print(" | ".join(table[-1]), flush=True)
    print("\n| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS))
    for cells in table:
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
