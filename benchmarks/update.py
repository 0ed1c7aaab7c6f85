"""The RL update on the quickstart's batch: mars_jax's `train_step` by layout vs a torch GRPO step.

Usage: python benchmarks/update.py [--workload quickstart] [--repeats 5]
                                   [--engines rows,packed,packed_full,torch]

Workloads (seeded random tokens, advantages and sampler log-probabilities; float32):
  quickstart  one RL step of the README's main job (`experiments/configs/quickstart.py`): 48
              Solver samples (56 prompt + 21 reply tokens), 48 Verifier (306 + 140..193), 36
              Corrector (239 + 21); the `mini` SFT model (0.16M parameters, dense Qwen3).
  study       a step shaped like the toy study's (`experiments/configs/study.py`): 192 Solver
              samples (60 + 60..139), 192 Verifier (330 + 150..271), 192 Corrector (280 +
              60..139); the `small` model (0.86M), dense attention (`attention_impl`) as
              study.py sets it.
One update = GRPO's clipped loss (seq-mean-token-mean) over all samples, backward, AdamW (lr 5e-4,
grad-norm clip 1).
  rows         mars_jax, one sample a row, longest first, each micro-batch cut to the shortest
               cut that holds it (quickstart: 2 micro-batches of 72 rows of 512, cuts 128 / 256 /
               512, its layout before packing; study: micro-batches of 16, the 3/4 cuts too,
               its layout).
  packed       mars_jax, `learner.pack`: samples first-fit into rows (quickstart: 16
               micro-batches of 8 rows of 512, none cut, its layout; study: micro-batches of 16
               rows of 1,024).
  packed_full  as `packed`, but attention over whole rows (no causal query blocks).
  torch        HF transformers' Qwen3 on the same weights (sdpa attention), micro-batches of the
               `rows` size padded to their longest (TRL's GRPO layout), the same loss, AdamW.
The first update's loss is printed for each (the same weights, so the same loss). Engines
alternate run by run after that first (compiling) call; medians. Achieved GFLOP/s = the
FLOPs the samples need (causal forward of each sample, x3 for the backward) over the time,
printed beside the machine's matmul ceiling.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark: never probe for accelerators

import argparse
import dataclasses
import tempfile

import jax
import numpy as np
import torch
import transformers
from flax import nnx

import bench_utils
from mars_jax.layers import attention
from mars_jax.models import create_model
from mars_jax.models.config import Qwen3Config
from mars_jax.models.hf_io import save_pretrained
from mars_jax.rl.batching import TrainSample, make_batch
from mars_jax.rl.losses import LossConfig
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import UpdateConfig, init_train_state, train_step
from mars_jax.sft.job import ARCHS

LEARNING_RATE, CLIP_LOW, CLIP_HIGH = 5e-4, 0.2, 0.28
ENGINES = ("rows", "packed", "packed_full", "torch")


@dataclasses.dataclass(frozen=True)
class Workload:
    arch: str
    roles: tuple[tuple[int, int, int, int], ...]  # (samples, prompt tokens, reply from, to)
    rows: dict    # make_batch arguments of the `rows` layout
    rows_update: dict  # its UpdateConfig fields
    packed: dict
    packed_update: dict
    model: dict = dataclasses.field(default_factory=dict)  # the job's model overrides


WORKLOADS = {
    "quickstart": Workload("mini", ((48, 56, 21, 22), (48, 306, 140, 194), (36, 239, 21, 22)),
                           dict(micro_batch_size=72, min_micro=2, by_length=True), {},
                           dict(micro_batch_size=8, min_micro=16, pack=True),
                           dict(length_halvings=0)),
    "study": Workload("small", ((192, 60, 60, 140), (192, 330, 150, 272), (192, 280, 60, 140)),
                      dict(micro_batch_size=16, by_length=True), dict(fine_cuts=True),
                      dict(micro_batch_size=16, pack=True), {},
                      dict(attention_impl="dense")),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="quickstart", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.engines = bench_utils.engines_list(parser, args.engines, ENGINES)
    return args


def workload_samples(workload: Workload, vocab: int, seed: int) -> list[TrainSample]:
    rng = np.random.default_rng(seed)

    def sample(prompt: int, reply: int) -> TrainSample:
        return TrainSample(list(rng.integers(1, vocab, prompt)), list(rng.integers(1, vocab, reply)),
                           list(-rng.uniform(0.05, 2.0, reply)), float(rng.choice([-1.0, 1.0])))

    return [sample(prompt, int(n)) for count, prompt, low, high in workload.roles
            for n in rng.integers(low, high, count)]


def sample_flops(config: Qwen3Config, samples: list[TrainSample]) -> float:
    """Matmul FLOPs of one causal forward of every sample on its own, x3 for forward + backward."""
    h, heads, kv, d = (config.hidden_size, config.num_attention_heads,
                       config.num_key_value_heads, config.head_dim)
    per_token = h * d * (2 * heads + 2 * kv) + 3 * h * config.intermediate_size
    total = 0.0
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids)
        attention_per_token = 2 * heads * d * (n + 1) / 2
        total += 2 * n * (config.num_hidden_layers * (per_token + attention_per_token)
                          + h * config.vocab_size)
    return 3 * total


def ours(model_config: Qwen3Config, samples, layout: dict, update: UpdateConfig,
         causal_blocks: bool) -> callable:
    """The library's update on `samples` laid out by `layout` (make_batch's arguments); with
    `causal_blocks=False` the dense attention runs over whole rows."""
    optimizer = make_optimizer(LEARNING_RATE)
    model = create_model(model_config, seed=0)
    graphdef = nnx.graphdef(model)
    state = {"s": init_train_state(model, optimizer)}
    batch = jax.device_put(make_batch(samples, min_length=512, **layout))
    default_blocks = attention.MAX_CAUSAL_BLOCKS

    @jax.jit  # a jit of its own: traced with this variant's attention blocks
    def step(s, b):
        attention.MAX_CAUSAL_BLOCKS = default_blocks if causal_blocks else 1
        try:
            return train_step.__wrapped__(s, b, None, graphdef=graphdef, optimizer=optimizer,
                                          config=update)
        finally:
            attention.MAX_CAUSAL_BLOCKS = default_blocks

    def run():
        state["s"], metrics = step(state["s"], batch)
        return float(metrics["loss"])

    return run


def torch_update(model, samples, micro: int) -> callable:
    """TRL-style GRPO step: micro-batches of `micro` rows (longest first) right-padded to their
    longest, log-softmax of the reply tokens, clipped ratio, seq-mean-token-mean, AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    ordered = sorted(samples, key=lambda s: -(len(s.prompt_ids) + len(s.response_ids)))
    batches = []
    for start in range(0, len(ordered), micro):
        part = ordered[start:start + micro]
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in part)
        ids = torch.zeros(len(part), width, dtype=torch.long)
        attn, mask, old = (torch.zeros(len(part), width) for _ in range(3))
        adv = torch.tensor([s.advantage for s in part])
        for i, s in enumerate(part):
            p, r = len(s.prompt_ids), len(s.response_ids)
            ids[i, :p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
            attn[i, :p + r] = 1
            mask[i, p:p + r] = 1
            old[i, p:p + r] = torch.tensor(s.sampler_logprobs)
        batches.append((ids, attn.long(), mask, old, adv))
    num_samples = len(samples)

    def run():
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for ids, attn, mask, old, adv in batches:
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            logp = torch.nn.functional.pad(logp, (1, 0))
            ratio = torch.exp(torch.clamp(logp - old, -20, 20))
            a = adv[:, None]
            per_token = torch.maximum(-a * ratio,
                                      -a * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_samples
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return total

    return run


def main() -> None:
    args = parse_args()
    torch.set_num_threads(os.cpu_count())
    workload = WORKLOADS[args.workload]
    config = Qwen3Config(**{**ARCHS[workload.arch], **workload.model})
    samples = workload_samples(workload, config.vocab_size, args.seed)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    flops = sample_flops(config, samples)
    print(f"machine: {bench_utils.machine_line()}")
    print(f"versions: {bench_utils.versions_line()}")
    print(f"workload: {len(samples)} samples, {tokens:,} tokens, {flops / 1e9:.1f} GFLOP an update "
          f"({workload.arch} model, {sum(x.size for x in jax.tree.leaves(nnx.state(create_model(config))))} "
          "parameters)")
    peak = {"XLA": bench_utils.xla_matmul_rate(4096, 512, 8192),
            "torch": bench_utils.torch_matmul_rate(4096, 512, 8192)}
    print("machine matmul ceiling, [4096, 512] @ [512, 8192] float32: " + ", ".join(
        f"{name} {rate / 1e9:.1f} GFLOP/s" for name, rate in peak.items()))
    loss = LossConfig(aggregation="seq-mean-token-mean", clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    rows, packed = workload.rows, workload.packed
    rows_update = UpdateConfig(loss=loss, **workload.rows_update)
    packed_update = UpdateConfig(loss=loss, **workload.packed_update)
    makers = {
        "rows": lambda: ours(config, samples, rows, rows_update, True),
        "packed": lambda: ours(config, samples, packed, packed_update, True),
        "packed_full": lambda: ours(config, samples, packed, packed_update, False),
    }
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(create_model(config, seed=0), tmp)
        makers["torch"] = lambda: torch_update(transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32), samples, micro=rows["micro_batch_size"])
        fns = {name: makers[name]() for name in args.engines}
        first = {name: fn() for name, fn in fns.items()}  # the same weights: the same loss
        print("first-update loss: " + ", ".join(f"{n} {v:.6f}" for n, v in first.items()))
        times = bench_utils.time_interleaved(fns, args.repeats, warmup=0)  # first: the warm-up
    base = bench_utils.median(times["torch"]) if "torch" in times else None
    for name, runs in times.items():
        mid = bench_utils.median(runs)
        ratio = f", {base / mid:.2f}x torch" if base else ""
        print(f"{name:12s} {mid:6.3f} s (runs {', '.join(f'{t:.2f}' for t in runs)}), "
              f"{tokens / mid:,.0f} tokens/s, {flops / mid / 1e9:.1f} GFLOP/s{ratio}")


if __name__ == "__main__":
    main()
