"""Forward and train-step throughput of mars_jax vs HF transformers (torch), `bench` preset, CPU.

Usage: python benchmarks/forward.py [--quick] [--repeats 3] [--moe-impl auto] [--engines mars_jax,torch]

Both engines load the same weights: an HF model made with a fixed seed is saved to a temporary
directory and read back by `transformers` and by `mars_jax.models.from_pretrained`.
  forward     logits of batch x forward-len random tokens (default 8 x 512); the two engines'
              logits are compared (max abs diff).
  train step  causal-LM cross-entropy, backward and an AdamW update over batch x train-len tokens
              (default 8 x 256); ours is one `jax.jit` (value_and_grad + optax.adamw, donated
              state), torch is `loss.backward()` + `torch.optim.AdamW.step()`.
Each timed run is one call; engines alternate run by run after a warm-up (compile) call, and the
median of `--repeats` runs gives tokens/s. `--quick` uses batch 2 and lengths 128 / 64.
Achieved GFLOP/s = the FLOPs the step must do (`forward_flops`; a train step counts 3x a forward)
over its time, printed next to the machine's ceiling: the rate of one large float32 matmul in XLA
and in torch. An engine cannot beat another by more than ceiling / the other's achieved rate.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark: never probe for accelerators

import argparse
import functools
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers
from flax import nnx

import bench_utils
from mars_jax.models import from_pretrained, get_preset

ENGINES = ("mars_jax", "torch")
LEARNING_RATE, WEIGHT_DECAY = 1e-4, 0.01


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 2, lengths 128 / 64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--forward-len", type=int, default=512)
    parser.add_argument("--train-len", type=int, default=256)
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {','.join(ENGINES)}")
    parser.add_argument("--moe-impl", default="auto", choices=("auto", "dense", "sorted", "ragged"))
    parser.add_argument("--moe-block-size", type=int, default=None)
    parser.add_argument("--moe-dense-max-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.forward_len, args.train_len = 2, 128, 64
    args.engines = bench_utils.engines_list(parser, args.engines, ENGINES)
    return args


def moe_overrides(args: argparse.Namespace) -> dict:
    overrides = {"moe_impl": args.moe_impl}
    if args.moe_block_size is not None:
        overrides["moe_block_size"] = args.moe_block_size
    if args.moe_dense_max_tokens is not None:
        overrides["moe_dense_max_tokens"] = args.moe_dense_max_tokens
    return overrides


def lm_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, as HF computes it with `labels=input_ids`."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), ids[:, 1:]).mean()


def ours_forward(model) -> callable:
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, ids: nnx.merge(graphdef, p)(ids))
    return lambda ids: forward(params, ids).block_until_ready()


def ours_train_step(model) -> callable:
    """One jitted step (loss, grads, AdamW update) on donated parameters and optimizer state;
    the returned function runs it on a batch and returns the loss."""
    graphdef, params = nnx.split(model)
    tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)

    @jax.jit
    def init(p):
        return tx.init(p)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, opt_state, ids):
        loss, grads = jax.value_and_grad(lambda q: lm_loss(nnx.merge(graphdef, q)(ids), ids))(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    state = {"params": jax.tree.map(jnp.copy, params)}
    state["opt"] = init(state["params"])

    def run(ids):
        state["params"], state["opt"], loss = step(state["params"], state["opt"], ids)
        return float(loss)

    return run


def torch_forward(model) -> callable:
    def run(ids):
        with torch.inference_mode():
            return model(input_ids=ids).logits
    return run


def torch_train_step(model) -> callable:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)

    def run(ids):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.item()

    return run


def report(title: str, tokens: int, flops: float, times: dict[str, list[float]]
           ) -> dict[str, float]:
    """Prints per-engine runs, median, tokens/s and achieved GFLOP/s; returns tokens/s by engine."""
    rates = {}
    for name, runs in times.items():
        med = bench_utils.median(runs)
        rates[name] = tokens / med
        print(f"  {title:10s} {name:9s} median {med:7.3f} s  {rates[name]:8.0f} tokens/s  "
              f"{flops / med / 1e9:6.1f} GFLOP/s  runs [{', '.join(f'{t:.3f}' for t in runs)}]")
    if {"mars_jax", "torch"} <= set(rates):
        print(f"  {title:10s} ratio mars_jax/torch = {rates['mars_jax'] / rates['torch']:.2f}x")
    return rates


def bench_forward(args, models, ids_np) -> None:
    runners = {"mars_jax": ours_forward, "torch": torch_forward}
    inputs = {"mars_jax": jnp.asarray(ids_np, jnp.int32), "torch": torch.from_numpy(ids_np)}
    fns = {name: (lambda r=runners[name](m), x=inputs[name]: r(x)) for name, m in models.items()}
    outputs = {name: fn() for name, fn in fns.items()}  # compile + warm-up, kept for the check
    if len(outputs) == 2:
        diff = np.abs(np.asarray(outputs["mars_jax"]) - outputs["torch"].numpy()).max()
        print(f"  logits max abs diff mars_jax vs torch: {diff:.2e}")
    del outputs
    flops = bench_utils.forward_flops(get_preset("bench"), *ids_np.shape)
    report("forward", ids_np.size, flops, bench_utils.time_interleaved(fns, args.repeats, warmup=0))


def bench_train(args, models, ids_np) -> None:
    runners = {"mars_jax": ours_train_step, "torch": torch_train_step}
    inputs = {"mars_jax": jnp.asarray(ids_np, jnp.int32), "torch": torch.from_numpy(ids_np)}
    steps = {name: runners[name](m) for name, m in models.items()}
    losses = {name: steps[name](inputs[name]) for name in steps}  # compile + warm-up
    print("  first-step loss: " + ", ".join(f"{n} {v:.6f}" for n, v in losses.items()))
    # A second warm-up step: ours compiles again for the state arrays the first step returns.
    for name in steps:
        steps[name](inputs[name])
    fns = {name: (lambda s=steps[name], x=inputs[name]: s(x)) for name in steps}
    # forward + 2x for backward
    flops = 3 * bench_utils.forward_flops(get_preset("bench"), *ids_np.shape)
    report("train step", ids_np.size, flops,
           bench_utils.time_interleaved(fns, args.repeats, warmup=0))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(os.cpu_count())
    config = get_preset("bench")
    print(f"machine: {bench_utils.machine_line()}")
    print(f"versions: {bench_utils.versions_line()}")
    print(f"bench preset, float32; mars_jax {moe_overrides(args)}; torch threads "
          f"{torch.get_num_threads()}")
    peak = {"mars_jax (XLA)": bench_utils.xla_matmul_rate(4096, 512, 8192),
            "torch": bench_utils.torch_matmul_rate(4096, 512, 8192)}
    print("machine matmul ceiling, [4096, 512] @ [512, 8192] float32: " + ", ".join(
        f"{name} {rate / 1e9:.1f} GFLOP/s" for name, rate in peak.items()))
    rng = np.random.default_rng(args.seed)
    forward_ids = rng.integers(0, config.vocab_size, (args.batch, args.forward_len))
    train_ids = rng.integers(0, config.vocab_size, (args.batch, args.train_len))
    with tempfile.TemporaryDirectory() as tmp:
        path = bench_utils.make_hf_checkpoint(config, Path(tmp), seed=args.seed)
        loaders = {
            "mars_jax": lambda: from_pretrained(path, **moe_overrides(args)),
            "torch": lambda: transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32),
        }
        models = {name: loaders[name]() for name in args.engines}
        if "torch" in models:
            hf_config = models["torch"].config
            print(f"torch: attention {hf_config._attn_implementation}, "
                  f"experts {hf_config._experts_implementation}")
        print(f"forward: batch {args.batch} x {args.forward_len} tokens")
        bench_forward(args, models, forward_ids)
        print(f"train step: batch {args.batch} x {args.train_len} tokens")
        bench_train(args, models, train_ids)


if __name__ == "__main__":
    main()
