"""Greedy decode throughput: mars_jax `generate` vs HF transformers (torch) `generate` vs tunix.

Usage: python benchmarks/decode.py [--repeats 3] [--batch 16] [--prompt-len 64] [--new-tokens 128]
                                   [--engines mars_jax,mars_jax_bf16,torch,tunix] [--checkpoint DIR]

`bench` preset, one set of weights: an HF model made with a fixed seed is saved to a temporary
directory (or `--checkpoint`, an HF checkpoint directory such as the toy study's SFT model,
`experiments/results/study/sft/model`, is copied there) and every engine loads it (mars_jax
`from_pretrained`; transformers; tunix's Qwen3 via
`tunix.models.qwen3.params.create_model_from_safe_tensors`). Each engine decodes `batch` random
prompts of `prompt-len` tokens for exactly `new-tokens` greedy tokens (no stop token):
  mars_jax       `mars_jax.sampling.generate(temperature=0)`, float32 weights and compute
  mars_jax_bf16  the same with bfloat16 weights and bfloat16 compute
  torch          `model.generate(do_sample=False, min_new_tokens=N, max_new_tokens=N)`
  tunix          `tunix.generate.sampler.Sampler` (greedy) on tunix's Qwen3 model, float32
Tokens/s = batch x new-tokens / wall time of one whole call (prefill + decode), median of
`--repeats` calls after one warm-up (compile) call; each engine's tokens must be `batch` x
`new-tokens` (printed: exact or WRONG).

Each engine runs in its own fresh subprocess, one after another, so the machine is not shared
between engines and each one's peak RSS is its own: `VmHWM` of that process at the end (the peak
of the whole process: interpreter, libraries, weights, compilation, caches). `+model` is that
peak minus the RSS just after the engine's imports, i.e. what loading and running the model added.
Each engine also checks its logits on a 2 x 32 batch against HF's (max abs diff), and its greedy
tokens are compared with torch's (fraction of equal tokens; float rounding can flip a near-tie).

The decode floor is the rate at which the bytes read by one decode step can stream from
memory: bandwidth / bytes-per-step x batch, with the bandwidth measured here (numpy sums over a
1 GiB array, single thread and one thread per core, median of 5) and bytes-per-step = every
parameter except the embedding table (one row per token is gathered; the CPU decode reads all
experts) + each row's KV cache at the mean context, batch x KV bytes per token x (prompt-len +
new-tokens / 2), KV bytes per token = 2 x layers x KV heads x head_dim x the dtype's bytes.
The matmul-bound floor is the same for the weights alone (KV reads not counted) at the rate at
which XLA's own float32 `[batch, H] @ [H, 8192]` products stream uncached weights (measured here),
which for small batches is far below the memory bandwidth.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark: never probe for accelerators

import argparse
import concurrent.futures
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import bench_utils

ENGINES = ("mars_jax", "mars_jax_bf16", "torch", "tunix")
CHECK_SHAPE = (2, 32)
BANDWIDTH_BYTES = 1 << 30


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated subset of {','.join(ENGINES)}")
    parser.add_argument("--moe-impl", default="auto", choices=("auto", "dense", "sorted", "ragged"),
                        help="mars_jax MoE dispatch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path,
                        help="an HF checkpoint directory to load instead of the bench preset")
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)   # child process
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)       # child process
    args = parser.parse_args()
    args.engines = bench_utils.engines_list(parser, args.engines, ENGINES)
    return args


# ----------------------------------------------------------------------------- engines (children)

def load_mars_jax(path: Path, bf16: bool, moe_impl: str):
    """Our model from the checkpoint; for bf16, its arrays cast into a bf16-compute model."""
    from flax import nnx
    import jax
    import jax.numpy as jnp

    from mars_jax.models import Qwen3, from_pretrained

    model = from_pretrained(path, moe_impl=moe_impl)
    if not bf16:
        return model
    config = model.config.replace(dtype="bfloat16", param_dtype="bfloat16")
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))


def mars_jax_engine(path: Path, args, bf16: bool):
    import jax.numpy as jnp

    from mars_jax.sampling import generate

    model = load_mars_jax(path, bf16, args.moe_impl)

    def logits(ids):
        return np.asarray(model(jnp.asarray(ids)))

    def run(prompts):
        result = generate(model, prompts.tolist(), max_new_tokens=args.new_tokens, temperature=0.0)
        return np.asarray(result.tokens)

    return logits, run


def torch_engine(path: Path, args):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logits(ids):
        with torch.inference_mode():
            return model(input_ids=torch.from_numpy(ids)).logits.numpy()

    def run(prompts):
        ids = torch.from_numpy(prompts)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 min_new_tokens=args.new_tokens, max_new_tokens=args.new_tokens,
                                 pad_token_id=0)
        return out[:, prompts.shape[1]:].numpy()

    return logits, run


class IdTokenizer:
    """tunix's tokenizer interface over text that is space-separated token ids; id 0 is padding."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0   # falsy: tunix adds no BOS

    def eos_id(self) -> int:
        return -1  # never generated

    def pad_id(self) -> int:
        return 0


def tunix_model(path: Path):
    """tunix's Qwen3 (float32) loaded from the shared checkpoint."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params

    from mars_jax.models import Qwen3Config

    c = Qwen3Config.from_json_file(path / "config.json")
    config = qwen3_model.ModelConfig(
        num_layers=c.num_hidden_layers, vocab_size=c.vocab_size, embed_dim=c.hidden_size,
        hidden_dim=c.moe_intermediate_size, num_heads=c.num_attention_heads, head_dim=c.head_dim,
        num_kv_heads=c.num_key_value_heads, rope_theta=int(c.rope_theta), norm_eps=c.rms_norm_eps,
        use_tied_embedding=c.tie_word_embeddings, num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok, dtype=jnp.float32, param_dtype=jnp.float32)
    return qwen3_params.create_model_from_safe_tensors(str(path), config, dtype=jnp.float32), c


def tunix_sampler(model, c, cache_size: int):
    """`tunix.generate.sampler.Sampler` over `model` with a KV cache of `cache_size` tokens."""
    from tunix.generate import sampler as sampler_lib

    cache = sampler_lib.CacheConfig(cache_size=cache_size, num_layers=c.num_hidden_layers,
                                    num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
    return sampler_lib.Sampler(model, IdTokenizer(), cache)


def tunix_engine(path: Path, args):
    import jax.numpy as jnp

    model, c = tunix_model(path)
    sampler = tunix_sampler(model, c, args.prompt_len + args.new_tokens)

    def logits(ids):
        b, t = ids.shape
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        return np.asarray(model(jnp.asarray(ids), positions, None, causal)[0])

    def run(prompts):
        out = sampler([" ".join(map(str, p)) for p in prompts],
                      max_generation_steps=args.new_tokens, max_prompt_length=prompts.shape[1],
                      temperature=0.0, eos_tokens=[IdTokenizer().eos_id()])
        return np.stack(out.tokens)

    return logits, run


def run_engine(args) -> None:
    """Child process: loads one engine, checks its logits, times it, prints one JSON line."""
    work = args.workdir
    path = work / "checkpoint"
    builders = {
        "mars_jax": lambda: mars_jax_engine(path, args, bf16=False),
        "mars_jax_bf16": lambda: mars_jax_engine(path, args, bf16=True),
        "torch": lambda: torch_engine(path, args),
        "tunix": lambda: tunix_engine(path, args),
    }
    imports = {"mars_jax": ["mars_jax.sampling"], "mars_jax_bf16": ["mars_jax.sampling"],
               "torch": ["torch", "transformers"],
               "tunix": ["tunix.generate.sampler", "tunix.models.qwen3.params"]}[args.engine]
    for module in imports:
        __import__(module)
    rss_after_imports = bench_utils.current_rss_mib()
    logits_fn, run = builders[args.engine]()
    check = np.load(work / "check_ids.npy")
    logits_diff = float(np.abs(logits_fn(check) - np.load(work / "ref_logits.npy")).max())
    prompts = np.load(work / "prompts.npy")
    tokens = run(prompts)                                          # compile + warm-up
    times = bench_utils.time_runs(lambda: run(prompts), args.repeats, warmup=0)
    np.save(work / f"tokens_{args.engine}.npy", tokens)
    print(json.dumps({"times": times, "logits_diff": logits_diff, "shape": list(tokens.shape),
                      "rss_after_imports_mib": rss_after_imports,
                      "peak_rss_mib": bench_utils.peak_rss_mib()}))


# ----------------------------------------------------------------------------- parent

def memory_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes/s of numpy sums over a 1 GiB float32 array split among `threads` (numpy releases the
    GIL in reductions), median of `repeats`."""
    data = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    parts = np.array_split(data, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))                              # touch pages, warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            times.append(time.perf_counter() - start)
    return BANDWIDTH_BYTES / bench_utils.median(times)


def bytes_per_step(config, bytes_per_param: int) -> int:
    """Weights one decode step reads: every parameter but the embedding table."""
    import jax
    from flax import nnx

    from mars_jax.models import Qwen3

    state = nnx.state(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    return (total - config.vocab_size * config.hidden_size) * bytes_per_param


def prepare(work: Path, args, config) -> None:
    """Checkpoint, prompts, logits-check ids and HF reference logits, shared by the children."""
    import torch
    import transformers

    path = work / "checkpoint"
    if args.checkpoint:
        shutil.copytree(args.checkpoint, path)
    else:
        bench_utils.make_hf_checkpoint(config, path, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    # Ids from 1 up: tunix treats id 0 as padding.
    np.save(work / "prompts.npy", rng.integers(1, config.vocab_size, (args.batch, args.prompt_len)))
    check = rng.integers(1, config.vocab_size, CHECK_SHAPE)
    np.save(work / "check_ids.npy", check)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        np.save(work / "ref_logits.npy", model(input_ids=torch.from_numpy(check)).logits.numpy())


def spawn(engine: str, work: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--engine", engine, "--workdir", str(work),
           "--repeats", str(args.repeats), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--moe-impl", args.moe_impl]
    return bench_utils.child_json(cmd)


def main() -> None:
    args = parse_args()
    if args.engine:
        run_engine(args)
        return
    from mars_jax.models import Qwen3Config, get_preset
    from mars_jax.sampling.engine import kv_bytes_per_token

    config = (Qwen3Config.from_json_file(args.checkpoint / "config.json") if args.checkpoint
              else get_preset("bench"))
    print(f"machine: {bench_utils.machine_line()}")
    print(f"versions: {bench_utils.versions_line()}")
    print(f"{args.checkpoint or 'bench preset'}: batch {args.batch}, prompt {args.prompt_len} "
          f"random tokens, "
          f"{args.new_tokens} new tokens, greedy, no stop token; mars_jax moe_impl={args.moe_impl}")
    bandwidth = {n: memory_bandwidth(n) for n in sorted({1, os.cpu_count()})}
    for n, bw in bandwidth.items():
        print(f"memory read bandwidth ({n} thread{'s' * (n > 1)}): {bw / 1e9:.1f} GB/s")
    best_bw = max(bandwidth.values())
    context = args.prompt_len + args.new_tokens / 2
    for name, size in (("float32", 4), ("bfloat16", 2)):
        weights = bytes_per_step(config, size)
        kv = args.batch * kv_bytes_per_token(config.replace(dtype=name)) * context
        step = weights + kv
        print(f"decode floor {name}: {best_bw / 1e9:.1f} GB/s / {step / 1e6:.0f} MB per step "
              f"({weights / 1e6:.0f} MB of weights + {kv / 1e6:.1f} MB of KV: {args.batch} rows "
              f"x {context:.0f} positions, the mean context) x batch {args.batch} = "
              f"{best_bw / step * args.batch:.0f} tokens/s")

    # What XLA:CPU's matmuls allow: the rate at which `[batch, H] @ [H, 8192]` products stream
    # weights that do not fit the cache (the shapes of a decode step's projections and experts).
    h = config.hidden_size
    gemm = bench_utils.xla_matmul_rate(args.batch, h, 8192, weight_bytes=256 << 20)
    gemm_bytes = 4 * gemm / (2 * args.batch)  # a 4-byte weight is read per 2 x batch FLOPs
    step = bytes_per_step(config, 4)
    print(f"XLA float32 [{args.batch}, {h}] @ [{h}, 8192] over 256 MB of weights: "
          f"{gemm / 1e9:.1f} GFLOP/s = {gemm_bytes / 1e9:.1f} GB/s of weights; matmul-bound "
          f"float32 floor (all weights once per step, KV reads not counted): "
          f"{gemm_bytes / step * args.batch:.0f} tokens/s")

    tokens = args.batch * args.new_tokens
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare(work, args, config)
        for engine in args.engines:
            r = spawn(engine, work, args)
            med = bench_utils.median(r["times"])
            rates[engine] = tokens / med
            print(f"  {engine:14s} median {med:7.3f} s  {rates[engine]:7.0f} tokens/s  "
                  f"peak RSS {r['peak_rss_mib']:6.0f} MiB "
                  f"(+model {r['peak_rss_mib'] - r['rss_after_imports_mib']:5.0f})  "
                  f"logits diff vs HF {r['logits_diff']:.1e}  tokens "
                  f"{'exact' if r['shape'] == [args.batch, args.new_tokens] else 'WRONG'}  "
                  f"runs [{', '.join(f'{t:.2f}' for t in r['times'])}]", flush=True)
        if "torch" in rates:
            reference = np.load(work / "tokens_torch.npy")
            for engine in rates:
                same = float(np.mean(np.load(work / f"tokens_{engine}.npy") == reference))
                print(f"  {engine:14s} greedy tokens equal to torch's: {same:.1%}")
    for base in ("torch", "tunix"):
        if base in rates:
            for engine in rates:
                if engine.startswith("mars_jax"):
                    print(f"  ratio {engine}/{base} = {rates[engine] / rates[base]:.2f}x")


if __name__ == "__main__":
    main()
