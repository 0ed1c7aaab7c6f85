r"""Agentic pipeline parallelism vs the sequential mode: samples trained per second, time to the
first update.

  python benchmarks/pipeline.py [--steps=8] [--seeds=2] [--segment_tokens=32] [--warmup_steps=8]

Both modes run the same tiny Qwen3-MoE policy (real sampler, real GRPO update) on the same `arith`
problems. Generation lengths are made long-tailed: each rollout gets a target length drawn from a
log-normal distribution (median 12 tokens, capped at the role's budget) and is stopped there as if
it had emitted its stop token, so both modes decode exactly the same lengths. The pipeline decodes
in segments of `--segment_tokens` (the long tail resumes next step, re-prefilled) and trains each
step on whatever groups completed; the sequential mode finishes every
trajectory of its problems before its single update. Prints medians over seeds and the ratio,
each mode's time split into generation (rollouts, sampler included) and update, the XLA
compilation within them, and the bound Amdahl's law puts on the ratio on one device: sequential
time per sample over the pipeline's update time per sample alone.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import jax
import numpy as np
from flax import nnx

from mars_jax.data import datasets
from mars_jax.data.iterator import ProblemIterator
from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.models import create_model, get_preset
from mars_jax.rl.pipeline import rollout_step
from mars_jax.rl.rollout import AgenticRollouts, GenerationOutput, RolloutConfig
from mars_jax.rl.generator import SamplerGenerator
from mars_jax.rl.trainer import training_samples
from mars_jax.rl.batching import make_batch
from mars_jax.rl.update import UpdateConfig, init_train_state, make_optimizer, train_step

BUDGET = 64


def target_length(prompt_ids: tuple[int, ...], budget: int) -> int:
    """A deterministic long-tailed length for a rollout (hash of its prompt)."""
    digest = hashlib.sha256(np.asarray(prompt_ids, np.int32).tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return int(min(budget, max(2, rng.lognormal(np.log(12), 0.9))))


class LongTailGenerator:
    """Wraps the real sampler; each rollout stops at its target length with reason 'stop'."""

    def __init__(self, inner: SamplerGenerator, prompt_of: dict):
        self.inner, self.prompt_of = inner, prompt_of

    def __call__(self, requests):
        limits = []
        for r in requests:
            base = self.prompt_of.setdefault(r.prompt_ids, r.prompt_ids)
            done = len(r.prompt_ids) - len(base)
            limits.append(target_length(base, BUDGET) - done)
        capped = [type(r)(r.prompt_ids, max(1, min(r.max_new_tokens, lim)), r.role)
                  for r, lim in zip(requests, limits)]
        outputs = self.inner(capped)
        result = []
        for r, out, lim in zip(requests, outputs, limits):
            reason = "stop" if len(out.token_ids) >= lim else out.finish_reason
            result.append(GenerationOutput(out.token_ids, out.logprobs, reason, out.expert_ids))
            if reason != "stop":
                self.prompt_of[r.prompt_ids + out.token_ids] = self.prompt_of[r.prompt_ids]
        return result


def run(mode: str, steps: int, seed: int, segment_tokens: int) -> dict:
    tokenizer = tiny_tokenizer()
    model = create_model(get_preset("tiny"), seed=seed)
    graphdef, _ = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(1e-4)
    state = init_train_state(model, optimizer)
    config = RolloutConfig(group_size=4, fan_out=2, selection="random", prompt_style="compact",
                           max_new_tokens={"solver": BUDGET, "verifier": BUDGET,
                                           "corrector": BUDGET},
                           segment_tokens=segment_tokens if mode == "pipeline" else None,
                           max_prompt_tokens=512)
    engine = AgenticRollouts(tokenizer, config, seed=seed, encode=encode_chat)
    problems = ProblemIterator(datasets.load("arith", "train"), seed=seed)
    prompt_of: dict = {}
    trained, first_update, start = 0, None, time.perf_counter()
    generating = updating = 0.0
    compiling_before = COMPILE_SECONDS[0]
    for step in range(1, steps + 1):
        version = int(state.step)
        inner = SamplerGenerator(nnx.merge(graphdef, state.params), eos_token_ids(tokenizer),
                                 temperature=1.0, top_p=1.0, top_k=0, seed=seed * 1000 + step,
                                 record_routing=False)
        began = time.perf_counter()
        out = rollout_step(engine, problems, LongTailGenerator(inner, prompt_of), mode=mode,
                           prompts_per_step=2, step=step, version=version)
        samples = training_samples(out.groups, drop_zero_variance=False, normalize_std=True)
        generating += time.perf_counter() - began
        if samples:
            began = time.perf_counter()
            batch = make_batch(samples, micro_batch_size=32, min_length=512)
            state, _ = train_step(state, batch, None, graphdef=graphdef, optimizer=optimizer,
                                  config=UpdateConfig())
            state.step.block_until_ready()
            updating += time.perf_counter() - began
            trained += len(samples)
            first_update = first_update or time.perf_counter() - start
    elapsed = time.perf_counter() - start
    return {"samples_per_s": trained / elapsed, "first_update_s": first_update, "trained": trained,
            "elapsed_s": elapsed, "generate_s": generating, "update_s": updating,
            "compile_s": COMPILE_SECONDS[0] - compiling_before}


COMPILE_SECONDS = [0.0]  # XLA compilation time so far (it falls in both generation and update)


def _count_compiles(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILE_SECONDS[0] += seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--segment_tokens", type=int, default=32)
    parser.add_argument("--warmup_steps", type=int, default=8,
                        help="steps per mode run first (another seed) to compile most shapes")
    args = parser.parse_args()
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    for mode in ("pipeline", "sequential"):  # warm-up: compile the shapes both modes use
        run(mode, args.warmup_steps, seed=99, segment_tokens=args.segment_tokens)
    results = {mode: [run(mode, args.steps, seed, args.segment_tokens)
                      for seed in range(args.seeds)] for mode in ("pipeline", "sequential")}
    median = lambda mode, key: statistics.median(r[key] for r in results[mode])
    for mode in results:
        print(f"{mode:10s} samples/s {median(mode, 'samples_per_s'):7.2f}   "
              f"first update {median(mode, 'first_update_s'):6.1f} s   "
              f"trained {median(mode, 'trained'):.0f}   of {median(mode, 'elapsed_s'):.1f} s: "
              f"generation {median(mode, 'generate_s'):.1f}, update {median(mode, 'update_s'):.1f}"
              f" (compilation {median(mode, 'compile_s'):.1f} s of those)")
    print(f"pipeline / sequential samples/s: "
          f"{median('pipeline', 'samples_per_s') / median('sequential', 'samples_per_s'):.2f}x; "
          f"time to first update: "
          f"{median('sequential', 'first_update_s') / median('pipeline', 'first_update_s'):.2f}x "
          f"sooner")
    # On one device generation and update run one after the other. Both modes train the same
    # samples, so even a pipeline whose generation cost nothing would only save its generation.
    bound = (median("sequential", "elapsed_s") / median("sequential", "trained")) / (
        median("pipeline", "update_s") / median("pipeline", "trained"))
    print(f"bound on one device (pipeline generation free, same update): {bound:.2f}x")


if __name__ == "__main__":
    main()
