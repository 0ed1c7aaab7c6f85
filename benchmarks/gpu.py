"""One-GPU throughput of mars_jax in bfloat16: forward, train step, decode, engine (run by gpu.sh).

Usage: python benchmarks/gpu.py [--preset qwen3_30b_a3b] [--num-layers 12]
           [--parts forward,train,decode,engine,moe]
           [--peak-tflops 989] [--peak-hbm-tbs 4.8]

Random weights (`create_model`, bf16 weights and compute) of `preset` with `num-layers` layers
(the 30B's layer shapes; 12 of its 48 layers is the most whose AdamW train step fits one H200).
  forward   logits of 8 x 2048 random tokens
  train     loss + grads + AdamW (optax) on 4 x 1024 tokens, layers rematerialised
  decode    `generate`, greedy, 64 prompts x 256 tokens, exactly 256 new tokens
  engine    the long-tailed workload of `engine.py` (log-normal lengths, median 48, cap 512)
            on `Engine(num_slots=slots)` vs `generate` in static batches of `slots`; with
            `--paged-slots` N, also a paged `Engine` of N slots over the KV memory of the
            reserved `slots` (`--engines` picks among engine, paged, generate)
  moe       one MoE block of `preset`, forward, per dispatch backend (dense, sorted with blocks
            of 128 and of 512 rows: fewer scan iterations, more padding, ragged) at
            256 and 16,384 tokens (a decode step's and a prefill's), to pick the GPU's default
Tokens/s over the median of `--repeats` (3) timed calls after one warm-up (compile) call. MFU =
matmul FLOPs the step must do (`bench_utils.forward_flops`; x3 for a train step; per decode step
`bench_utils.decode_flops` at the mean context) / time / the chip's bf16 peak; achieved HBM
bandwidth = bytes a decode step must read (every weight but the embedding, plus the KV cache up
to the current position) / step time, against the chip's peak.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bench_utils
import engine as engine_bench

PARTS = ("forward", "train", "decode", "engine", "moe")
ENGINES = ("engine", "paged", "generate")
MOE_TOKENS = (256, 16384)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3_30b_a3b")
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--paged-slots", type=int, default=1024)
    parser.add_argument("--engines", default="engine,generate")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense (H200)")
    parser.add_argument("--peak-hbm-tbs", type=float, default=4.8, help="HBM TB/s (H200)")
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    args.engines = bench_utils.engines_list(parser, args.engines, ENGINES)
    return args


def build(args, **overrides):
    from mars_jax.models import create_model, get_preset

    config = get_preset(args.preset, num_hidden_layers=args.num_layers, dtype="bfloat16",
                        param_dtype="bfloat16", **overrides)
    return create_model(config, seed=0)


def timed(fn, repeats: int) -> float:
    fn()
    return bench_utils.median(bench_utils.time_runs(fn, repeats, warmup=0))


def weight_bytes(model) -> int:
    """Bytes of every parameter but the embedding table (what a decode step reads)."""
    cfg = model.config
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    return total - cfg.vocab_size * cfg.hidden_size * jnp.dtype(cfg.weight_dtype).itemsize


def report(name: str, tokens: int, seconds: float, flops: float, args) -> None:
    mfu = flops / seconds / (args.peak_tflops * 1e12)
    print(f"  {name:8s} {tokens / seconds:10.0f} tokens/s  {seconds * 1e3:8.1f} ms  "
          f"MFU {mfu:.1%} of {args.peak_tflops:.0f} TFLOP/s bf16", flush=True)


def bench_forward(args) -> None:
    model = build(args)
    graphdef, params = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, (8, 2048)))
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    seconds = timed(lambda: forward(params, ids).block_until_ready(), args.repeats)
    report("forward", ids.size, seconds, bench_utils.forward_flops(model.config, *ids.shape), args)


def adamw_step_seconds(model, ids: jax.Array, repeats: int) -> float:
    """Seconds of one jitted AdamW step (next-token cross-entropy on `ids`), the median of
    `repeats` timed calls after a warm-up."""
    graphdef, params = nnx.split(model)
    tx = optax.adamw(1e-5)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p)(ids)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1].astype(jnp.float32), ids[:, 1:]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, opt):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, loss

    state = {"p": params, "opt": jax.jit(tx.init)(params)}

    def run():
        state["p"], state["opt"], loss = step(state["p"], state["opt"])
        float(loss)

    return timed(run, repeats)


def bench_train(args) -> None:
    model = build(args, remat=True)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, model.config.vocab_size, (4, 1024)))
    seconds = adamw_step_seconds(model, ids, args.repeats)
    report("train", ids.size, seconds, 3 * bench_utils.forward_flops(model.config, *ids.shape),
           args)


def bench_decode(args) -> None:
    from mars_jax.sampling import generate
    from mars_jax.sampling.engine import kv_bytes_per_token

    model = build(args)
    batch, prompt_len, new = 64, 256, 256
    prompts = np.random.default_rng(0).integers(1, model.config.vocab_size,
                                                (batch, prompt_len)).tolist()
    run = lambda: generate(model, prompts, max_new_tokens=new, temperature=0.0,
                           compact_every=None)
    seconds = timed(run, args.repeats)
    cfg = model.config
    step_bytes = weight_bytes(model) + batch * kv_bytes_per_token(cfg) * (prompt_len + new / 2)
    bandwidth = step_bytes * new / seconds
    # decode steps at the mean context (attention is linear in it); prefill not counted
    flops = bench_utils.decode_flops(cfg, batch, prompt_len + new / 2) * new
    print(f"  decode   {batch * new / seconds:10.0f} tokens/s  batch {batch}, {new} new tokens "
          f"(prefill included); HBM {bandwidth / 1e12:.2f} TB/s = "
          f"{bandwidth / (args.peak_hbm_tbs * 1e12):.0%} of {args.peak_hbm_tbs} TB/s; "
          f"MFU {flops / seconds / (args.peak_tflops * 1e12):.2%}", flush=True)


def bench_engine(args) -> None:
    from mars_jax.sampling import Engine, generate

    model = build(args)
    prompt_len, max_new = 64, engine_bench.MAX_NEW
    lengths = engine_bench.output_lengths(args.requests, 0)
    prompts = np.random.default_rng(0).integers(1, model.config.vocab_size,
                                                (args.requests, prompt_len)).tolist()
    pages = engine_bench.kv_pages(args.slots, prompt_len, 64)  # the reserved slots' memory
    engines, outputs = {}, {}

    def run_engine(name: str, **options):
        engine = engines.get(name) or engines.setdefault(name, Engine(
            model, max_length=prompt_len + max_new, chunk_steps=16, **options))
        ids = [engine.submit(p, max_new_tokens=int(n), temperature=0.0)[0]
               for p, n in zip(prompts, lengths)]
        engine.stats.clear()
        done = engine.run()
        outputs[name] = [done[i].tokens for i in ids]

    def run_generate():
        for start in range(0, args.requests, args.slots):
            part = slice(start, start + args.slots)
            generate(model, prompts[part], max_new_tokens=[int(n) for n in lengths[part]],
                     temperature=0.0)

    tokens = int(lengths.sum())
    runs = {"engine": lambda: run_engine("engine", num_slots=args.slots),
            "paged": lambda: run_engine("paged", num_slots=args.paged_slots, kv_pages=pages,
                                        page_size=64),
            "generate": run_generate}
    rates = {}
    for name in args.engines:
        rates[name] = tokens / timed(runs[name], args.repeats)
        line = f"  {name:8s} {rates[name]:10.0f} tokens/s; {args.requests} requests"
        if name in engines:
            s = engines[name].stats
            line += (f", {engines[name].num_slots} slots, {s['tokens'] / s['decode_steps']:.0f} "
                     f"rows decoding on average, {s['preemptions']} preemptions, paged "
                     f"attention {engines[name].paged_attention if name == 'paged' else '-'}")
        print(line, flush=True)
    print(f"  KV memory of {args.slots} reserved slots = {pages} pages of 64; "
          + ", ".join(f"{a}/{b} {rates[a] / rates[b]:.2f}x" for a, b in
                      (("engine", "generate"), ("paged", "engine")) if a in rates and b in rates),
          flush=True)
    if {"engine", "paged"} <= outputs.keys():  # greedy, bf16: a near-tie may flip a token
        same = np.mean([a == b for a, b in zip(outputs["engine"], outputs["paged"])])
        print(f"  paged outputs equal to the reserved engine's: {same:.1%} of requests")


def bench_moe(args) -> None:
    from mars_jax.layers.moe import MoE
    from mars_jax.models import get_preset

    cfg = get_preset(args.preset)
    active = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    for impl, block_size in (("dense", 0), ("sorted", 128), ("sorted", 512), ("ragged", 0)):
        layer = MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                    cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob, impl=impl,
                    block_size=block_size or cfg.moe_block_size,
                    dense_max_tokens=cfg.moe_dense_max_tokens,
                    capacity_factor=None, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16,
                    stddev=0.02)
        graphdef, state = nnx.split(layer)
        forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[0])
        for tokens in MOE_TOKENS:
            x = jax.random.normal(jax.random.key(0), (tokens, cfg.hidden_size), jnp.bfloat16)
            seconds = timed(lambda: forward(state, x).block_until_ready(), args.repeats)
            name = f"{impl} {block_size}" if block_size else impl
            print(f"  moe {name:10s} {tokens:6d} tokens {seconds * 1e3:8.2f} ms  "
                  f"{active * tokens / seconds / 1e12:6.1f} TFLOP/s of the top-k experts' matmuls",
                  flush=True)


def main() -> None:
    args = parse_args()
    print(f"devices: {jax.devices()}; jax {jax.__version__}")
    print(f"{args.preset} shapes, {args.num_layers} layers, bfloat16 weights and compute")
    for part in args.parts:
        {"forward": bench_forward, "train": bench_train, "decode": bench_decode,
         "engine": bench_engine, "moe": bench_moe}[part](args)


if __name__ == "__main__":
    main()
