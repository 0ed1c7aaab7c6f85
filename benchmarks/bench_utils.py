"""Shared helpers of the model benchmarks (`forward.py`, `decode.py`): checkpoints, timing, machine."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def make_hf_checkpoint(config, path: Path, seed: int = 0) -> Path:
    """Writes a randomly initialised HF transformers (torch) model of `config` to `path`.

    The same files then load into every engine, so all of them run identical weights."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.Qwen3MoeConfig(**config.to_hf_dict())
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def time_runs(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of `repeats` calls of `fn` (which must block until done), after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
                     ) -> dict[str, list[float]]:
    """Like `time_runs` for several engines, alternating them run by run after `warmup` calls
    each, so that a change in the machine's load over time hits every engine alike."""
    for fn in fns.values():
        time_runs(fn, 0, warmup)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name] += time_runs(fn, 1, warmup=0)
    return times


def xla_matmul_rate(m: int, k: int, n: int, weight_bytes: int = 0, repeats: int = 5,
                    dtype: str = "float32") -> float:
    """FLOP/s of XLA (jitted) `[m, k] @ [k, n]` products in `dtype`, best of `repeats`. With
    `weight_bytes`, each call multiplies by as many distinct `[k, n]` matrices as fill that many
    bytes, so the weights stream from memory instead of the cache (as in a decode step)."""
    import jax
    import jax.numpy as jnp

    count = max(1, weight_bytes // (k * n * jnp.dtype(dtype).itemsize))
    x = jnp.ones((m, k), dtype)
    w = [jax.random.normal(jax.random.key(i), (k, n), dtype) for i in range(count)]
    run = jax.jit(lambda x, w: [x @ wi for wi in w])
    times = time_runs(lambda: jax.block_until_ready(run(x, w)), repeats)
    return 2 * m * k * n * count / min(times)


def torch_matmul_rate(m: int, k: int, n: int, repeats: int = 5) -> float:
    """FLOP/s of torch's float32 `[m, k] @ [k, n]` (its BLAS, all threads), best of `repeats`."""
    import torch

    a, b = torch.ones(m, k), torch.ones(k, n)
    return 2 * m * k * n / min(time_runs(lambda: a @ b, repeats))


def matmul_flops(config, tokens: int, keys_per_token: float) -> float:
    """Matmul FLOPs of `tokens` tokens through the model, computing only what they must: q/k/v/o
    projections, the router and the top-k experts of every token, attention scores and values
    against `keys_per_token` keys each (a mean) and the output projection."""
    h, heads, kv, d = (config.hidden_size, config.num_attention_heads,
                       config.num_key_value_heads, config.head_dim)
    per_token = (h * d * (2 * heads + 2 * kv) + h * config.num_experts
                 + config.num_experts_per_tok * 3 * h * config.moe_intermediate_size)
    attention = 2 * heads * d * keys_per_token  # q.k and p.v
    layers = config.num_hidden_layers * (per_token + attention)
    return 2 * tokens * (layers + h * config.vocab_size)


def forward_flops(config, batch: int, length: int) -> float:
    """`matmul_flops` of one causal forward of `batch` x `length` tokens (each query against the
    keys up to it)."""
    return matmul_flops(config, batch * length, (length + 1) / 2)


def decode_flops(config, batch: int, context: float) -> float:
    """`matmul_flops` of one decode step of `batch` rows, each attending to `context` keys."""
    return matmul_flops(config, batch, context)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def equal_tokens(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]
                 ) -> tuple[int, int]:
    """(tokens equal position by position, tokens compared): per request, the positions of the
    longer of the two outputs, a position one of them lacks counting as unequal."""
    equal = compared = 0
    for a, b in zip(outputs, reference, strict=True):
        equal += sum(x == y for x, y in zip(a, b))
        compared += max(len(a), len(b))
    return equal, compared


def _proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def peak_rss_mib() -> float:
    """This process's peak resident set size so far: `VmHWM`, the high-water mark of its own
    address space. (`ru_maxrss` is not used: a process started by fork + exec inherits there the
    peak of its parent's address space.)"""
    return _proc_status_mib("VmHWM")


def current_rss_mib() -> float:
    return _proc_status_mib("VmRSS")


def cpu_model() -> str:
    """`lscpu`'s model name, or the platform's processor string when lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def machine_line() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start"


def versions_line() -> str:
    import flax
    import jax
    import torch
    import transformers

    return (f"jax {jax.__version__}, flax {flax.__version__}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def child_json(cmd: Sequence[str]) -> dict:
    """Runs a benchmark child process; its last stdout line, parsed as JSON. Raises
    `RuntimeError` with the end of its stderr when it fails."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engines_list(parser, value: str, known: Sequence[str]) -> list[str]:
    """`--engines a,b` as a list; an unknown name is a usage error naming the choices."""
    engines = value.split(",")
    unknown = set(engines) - set(known)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; choose from {tuple(known)}")
    return engines
