"""Long-tailed decode throughput: mars_jax `Engine` vs `generate`, tunix, HF continuous batching.

Usage: python benchmarks/engine.py [--requests 64] [--slots 16] [--prompt-len 64]
           [--engines engine,paged,generate,tunix,hf] [--hf-requests 16] [--dtype float32]
           [--paged-slots 64] [--page-size 64]

`bench` preset, one set of weights (an HF checkpoint made with a fixed seed, loaded by every
engine). Workload: `requests` prompts of `prompt-len` random tokens; output lengths drawn from a
log-normal (median 48, sigma 1, seeded), clipped to [1, 512]. Every engine decodes greedily and
produces exactly those lengths (no stop token):
  engine    `mars_jax.sampling.Engine(num_slots=slots)`, each request's budget = its length
  paged     the same `Engine` with a paged KV cache of the same memory (`kv_pages` = slots x
            the pages a reserved slot of prompt-len + 512 positions takes) over `paged-slots`
            slots: as many rows decode as the pool holds (preempting the newest when it is full)
  generate  `mars_jax.sampling.generate` on static batches of `slots` requests in submission
            order, per-row budgets (finished rows dropped by its compaction)
  tunix     `tunix.generate.sampler.Sampler` on static batches of `slots`, each decoded to the
            batch's longest length (it has one step budget per call); only the requested lengths
            count as tokens
  hf        transformers' continuous batching (`ContinuousBatchingManager`, paged attention),
            `max_requests_per_batch=slots`, per-request `max_new_tokens`; on the first
            `hf-requests` requests (it is slow on CPU). One manager serves every pass
            (`persistent_manager=True`: built and warmed up in the warm-up pass, as our engine is
            built once); the seconds each pass spends entering and leaving its context are printed
  engine_hf with `hf`: the engine (the same one) on hf's workload, the first `hf-requests`
            requests; engine / hf is computed on it
The engine admits queued requests `admit-batch` at a time (one batched prefill, which also
prefills the next queued prompts, `prefill-ahead` in the call; those later take freed slots one
at a time without a prefill) and gathers the running rows into a smaller slot bucket once nothing
waits (as `generate` compacts).
Tokens/s = requested tokens / wall time of the whole workload (prefill + decode), median of
`repeats` passes after one warm-up pass of the same workload (compiles). The engine and
`generate` (and tunix, also JAX) share one subprocess and alternate pass by pass (a shared
machine's load changes hit them alike); HF runs alone in a fresh subprocess. Greedy tokens are
compared with `generate`'s (engine, paged) and with HF's (engine_hf) position by position over
the requested tokens only; the count compared is printed.
The engine also prints its slot occupancy (tokens / (slots x decode steps); of computed rows:
tokens / rows the decode chunks computed, after compaction), its prefill share of the wall
time, and its KV-cache bytes per token and per slot.

Machine bound: a decode step of R rows reads every weight but the embedding once; the
matmul-bound ceiling is R x (the rate at which XLA's `[R, H] @ [H, 8192]` in `--dtype` streams
uncached weights) / weight bytes per step (KV reads not counted), a ceiling on the decode rate of
a JAX engine computing in `--dtype` at up to R rows. Printed at R = `slots` and, with the paged
engine, at R = `paged-slots` (the most rows it decodes).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import bench_utils
import decode

ENGINES = ("engine", "paged", "generate", "tunix", "hf")
HF_WORKLOAD = ("hf", "engine_hf")  # runs on the first `--hf-requests` requests
MAX_NEW = 512


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--chunk-steps", type=int, default=8)
    parser.add_argument("--admit-batch", type=int, default=4)
    parser.add_argument("--prefill-ahead", type=int, default=16)
    parser.add_argument("--paged-slots", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--with-tunix", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=("mars_jax", "tunix", "hf"),
                        help=argparse.SUPPRESS)                               # child process
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)       # child process
    args = parser.parse_args()
    args.engines = bench_utils.engines_list(parser, args.engines, ENGINES)
    return args


def output_lengths(n: int, seed: int) -> np.ndarray:
    """Long-tailed lengths: log-normal with median 48 and sigma 1, clipped to [1, 512]."""
    rng = np.random.default_rng(seed + 1)
    return np.clip(np.round(48 * np.exp(rng.normal(0.0, 1.0, n))), 1, MAX_NEW).astype(int)


# ----------------------------------------------------------------------------- engines (children)

def kv_pages(slots: int, prompt_len: int, page_size: int) -> int:
    """Pages holding as many positions as `slots` reserved slots of prompt_len + 512."""
    return slots * -(-(prompt_len + MAX_NEW) // page_size)


def engine_run(model, args, paged: bool = False):
    from mars_jax.sampling import Engine

    pages = kv_pages(args.slots, args.prompt_len, args.page_size)
    paging = dict(kv_pages=pages, page_size=args.page_size) if paged else {}
    engine = Engine(model, num_slots=args.paged_slots if paged else args.slots,
                    max_length=args.prompt_len + MAX_NEW, chunk_steps=args.chunk_steps,
                    admit_batch=args.admit_batch, prefill_ahead=args.prefill_ahead, **paging)

    def run(prompts, lengths):
        engine.stats.clear()
        ids = [engine.submit(p, max_new_tokens=int(n), temperature=0.0)[0]
               for p, n in zip(prompts.tolist(), lengths)]
        start = time.perf_counter()
        outputs = engine.run()
        wall = time.perf_counter() - start
        s = engine.stats
        info = {"occupancy": s["tokens"] / s["slot_steps"],
                "row_occupancy": s["tokens"] / s["row_steps"],
                "prefill_share": s["prefill_seconds"] / wall,
                "decode_steps": s["decode_steps"], "prefills": s["prefills"],
                "prefill_calls": s["prefill_calls"], "preemptions": s["preemptions"],
                "mean_rows": s["tokens"] / max(1, s["decode_steps"]),
                "kv_bytes_per_token": engine.kv_bytes_per_token, "kv_bytes": engine.kv_bytes}
        return [outputs[i].tokens for i in ids], info

    return run


def generate_run(model, args):
    from mars_jax.sampling import generate

    def run(prompts, lengths):
        tokens = []
        for start in range(0, len(prompts), args.slots):
            batch = slice(start, start + args.slots)
            out = generate(model, prompts[batch].tolist(),
                           max_new_tokens=[int(n) for n in lengths[batch]], temperature=0.0)
            tokens += out.tokens
        return tokens, {}

    return run


def tunix_run(path: Path, args):
    model, c = decode.tunix_model(path)
    sampler = decode.tunix_sampler(model, c, args.prompt_len + MAX_NEW)

    def run(prompts, lengths):
        tokens = []
        for start in range(0, len(prompts), args.slots):
            batch = slice(start, start + args.slots)
            out = sampler([" ".join(map(str, p)) for p in prompts[batch]],
                          max_generation_steps=int(lengths[batch].max()),
                          max_prompt_length=prompts.shape[1], temperature=0.0,
                          eos_tokens=[decode.IdTokenizer().eos_id()])
            tokens += [list(map(int, t[:n])) for t, n in zip(out.tokens, lengths[batch])]
        return tokens, {}

    return run


def hf_run(path: Path, args):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW,
                                               eos_token_id=None, pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(max_requests_per_batch=args.slots)
    start_stop = []  # seconds per pass spent entering and leaving the manager's context

    def run(prompts, lengths):
        results = {}
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            entered = time.perf_counter()
            manager = stack.enter_context(model.continuous_batching_context_manager(
                generation_config=generation, continuous_batching_config=batching, block=True,
                timeout=5, persistent_manager=True))
            started = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=int(n), eos_token_id=-1)
                   for p, n in zip(prompts.tolist(), lengths)]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped early")
            finished = time.perf_counter()
        start_stop.append(started - entered + time.perf_counter() - finished)
        return [list(results[i].generated_tokens) for i in ids], {"start_stop": start_stop}

    return run


def our_runs(path: Path, args) -> dict:
    """Ours on one loaded model (the engine, on hf's workload too with `hf`), and tunix with
    `--with-tunix`: a run per engine asked for."""
    model = decode.load_mars_jax(path, args.dtype == "bfloat16", "auto")
    builders = {"engine": lambda: engine_run(model, args),
                "paged": lambda: engine_run(model, args, paged=True),
                "generate": lambda: generate_run(model, args)}
    runs = {name: build() for name, build in builders.items() if name in args.engines}
    if "engine" in runs and "hf" in args.engines:
        runs["engine_hf"] = runs["engine"]
    if args.with_tunix:
        runs["tunix"] = tunix_run(path, args)
    return runs


def run_engine(args) -> None:
    """Child process: one peer engine, or ours (`our_runs`, alternating pass by pass); a warm-up
    pass each, then `repeats` timed passes (median), each run on its workload (`HF_WORKLOAD`:
    the first `hf-requests` requests); writes each run's tokens; prints one JSON line with a
    result per run."""
    work = args.workdir
    path = work / "checkpoint"
    if args.engine == "mars_jax":
        runs = our_runs(path, args)
    else:
        runs = {args.engine: {"tunix": tunix_run, "hf": hf_run}[args.engine](path, args)}
    prompts, lengths = np.load(work / "prompts.npy"), np.load(work / "lengths.npy")
    workloads = {name: (prompts[:n], lengths[:n]) for name in runs
                 for n in [args.hf_requests if name in HF_WORKLOAD else len(lengths)]}
    results = {}
    for name, run in runs.items():
        start = time.perf_counter()
        run(*workloads[name])
        requested = workloads[name][1]
        results[name] = {"warmup": time.perf_counter() - start, "walls": [],
                         "requests": len(requested), "tokens": int(sum(requested))}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens, info = run(*workloads[name])
            results[name]["walls"].append(time.perf_counter() - start)
            results[name].update(info, lengths_ok=[len(t) for t in tokens]
                                 == list(workloads[name][1]))
            (work / f"tokens_{name}.json").write_text(
                json.dumps([list(map(int, t)) for t in tokens]))
    print(json.dumps(results))


# ----------------------------------------------------------------------------- parent

def spawn(engine: str, work: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--engine", engine, "--workdir", str(work),
           "--slots", str(args.slots), "--prompt-len", str(args.prompt_len),
           "--chunk-steps", str(args.chunk_steps), "--admit-batch", str(args.admit_batch),
           "--prefill-ahead", str(args.prefill_ahead), "--paged-slots", str(args.paged_slots),
           "--page-size", str(args.page_size), "--engines", ",".join(args.engines),
           "--hf-requests", str(args.hf_requests), "--repeats", str(args.repeats),
           "--dtype", args.dtype, "--preset", args.preset] + ["--with-tunix"] * args.with_tunix
    try:
        return bench_utils.child_json(cmd)
    except RuntimeError as e:
        print(f"  {engine}: {e}", flush=True)
        return {}


def print_bound(config, rows: int, dtype: str) -> None:
    """Prints the matmul-bound decode ceiling at `rows` rows (module docstring), measured now."""
    itemsize = 4 if dtype == "float32" else 2
    step = decode.bytes_per_step(config, itemsize)
    h = config.hidden_size
    gemm = bench_utils.xla_matmul_rate(rows, h, 8192, weight_bytes=256 << 20, dtype=dtype)
    weights_rate = itemsize * gemm / (2 * rows)  # a weight is read per 2 x rows FLOPs
    print(f"machine bound: XLA {dtype} [{rows}, {h}] @ [{h}, 8192] streams "
          f"{weights_rate / 1e9:.1f} GB/s of weights; {step / 1e6:.0f} MB of weights per step "
          f"-> matmul-bound decode ceiling {weights_rate / step * rows:.0f} tokens/s at {rows} "
          f"rows", flush=True)


def print_equal_tokens(work: Path, name: str, base: str) -> None:
    """Prints how many of `name`'s requested tokens equal `base`'s, position by position."""
    ours, theirs = (json.loads((work / f"tokens_{n}.json").read_text()) for n in (name, base))
    equal, compared = bench_utils.equal_tokens(ours, theirs)
    print(f"  {name} tokens equal to {base}'s: {equal / compared:.1%} of {compared} tokens")


def main() -> None:
    args = parse_args()
    if args.engine:
        run_engine(args)
        return
    from mars_jax.models import get_preset

    config = get_preset(args.preset)
    lengths = output_lengths(args.requests, args.seed)
    print(f"machine: {bench_utils.machine_line()}")
    print(f"versions: {bench_utils.versions_line()}")
    print(f"{args.preset} preset, {args.dtype}: {args.requests} requests, prompt {args.prompt_len} "
          f"random tokens, output lengths log-normal (median 48, sigma 1, cap {MAX_NEW}): "
          f"mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, max {lengths.max()}, "
          f"total {lengths.sum()}; {args.slots} slots / rows; greedy, no stop token"
          + f"; hf and engine_hf: the first {args.hf_requests} requests" * ("hf" in args.engines))
    rows = [args.slots] + [args.paged_slots] * ("paged" in args.engines)
    for r in dict.fromkeys(rows):
        print_bound(config, r, args.dtype)
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bench_utils.make_hf_checkpoint(config, work / "checkpoint", seed=args.seed)
        rng = np.random.default_rng(args.seed)
        np.save(work / "prompts.npy",
                rng.integers(1, config.vocab_size, (args.requests, args.prompt_len)))
        np.save(work / "lengths.npy", lengths)
        ours = bool({"engine", "paged", "generate"} & set(args.engines))
        args.with_tunix = ours and "tunix" in args.engines  # alternates with ours, same process
        children = ["mars_jax"] * ours
        children += [e for e in args.engines if e == "hf" or (e == "tunix" and not ours)]
        for child in children:
            for engine, r in spawn(child, work, args).items():
                wall = bench_utils.median(r["walls"])
                rates[engine] = r["tokens"] / wall
                extra = ""
                if engine in ("engine", "paged"):
                    extra = (f"\n            mean rows decoding {r['mean_rows']:.1f}, "
                             f"{r['preemptions']} preemptions, "
                             f"slot occupancy {r['occupancy']:.0%} (of computed "
                             f"rows {r['row_occupancy']:.0%}), prefill share "
                             f"{r['prefill_share']:.1%}, {r['decode_steps']} decode steps, "
                             f"{r['prefills']} prefills in {r['prefill_calls']} calls, KV "
                             f"{r['kv_bytes_per_token']} B/token, "
                             f"{r['kv_bytes'] / 2**20:.1f} MiB in all")
                if engine == "hf":  # the first pass's is the warm-up's
                    extra = ("\n            entering and leaving the manager's context: "
                             f"{', '.join(f'{t:.2f}' for t in r['start_stop'])} s per pass "
                             "(manager kept between passes: persistent_manager=True)")
                print(f"  {engine:9s} {r['requests']:3d} requests, {r['tokens']:6d} tokens "
                      f"in {wall:7.2f} s = "
                      f"{rates[engine]:6.1f} tokens/s (runs "
                      f"{', '.join(f'{w:.1f}' for w in r['walls'])} s; warm-up "
                      f"{r['warmup']:.1f} s; lengths {'exact' if r['lengths_ok'] else 'WRONG'})"
                      f"{extra}", flush=True)
        for name, base in (("engine", "generate"), ("paged", "generate"), ("engine_hf", "hf")):
            if name in rates and base in rates:
                print_equal_tokens(work, name, base)
    if "paged" in rates:
        pages = kv_pages(args.slots, args.prompt_len, args.page_size)
        print(f"  paged: {args.paged_slots} slots over {pages} pages of {args.page_size} "
              f"= {pages * args.page_size} positions, the KV memory of {args.slots} reserved "
              f"slots of {args.prompt_len + MAX_NEW}")
        if "engine" in rates:
            ratio = rates["paged"] / rates["engine"]
            print(f"  ratio paged/engine (same KV memory) = {ratio:.2f}x")
    for base in ("generate", "tunix"):
        if "engine" in rates and base in rates:
            print(f"  ratio engine/{base} = {rates['engine'] / rates[base]:.2f}x")
    if "engine_hf" in rates and "hf" in rates:
        print(f"  ratio engine/hf on the same first {args.hf_requests} requests "
              f"= {rates['engine_hf'] / rates['hf']:.2f}x")


if __name__ == "__main__":
    main()
