r"""MarsRL on Qwen3-30B-A3B-Thinking-2507 at the paper's settings, for a TPU v5p slice.

  python experiments/run.py --workdir=/mnt/shared/marsrl_30b \
      --config=experiments/configs/marsrl_qwen3_30b_a3b.py:ckpt=/data/Qwen3-30B-A3B-Thinking-2507
  # Check which programs fit the slice before paying for it (CPU machine, libtpu):
  python experiments/aot_compile.py --topology=v5p:8x8x4 \
      --config=experiments/configs/marsrl_qwen3_30b_a3b.py
  # Few-minute CPU run of the same pipeline (tiny model, short lengths):
  python experiments/run.py --workdir=/tmp/marsrl_30b_local \
      --config=experiments/configs/marsrl_qwen3_30b_a3b.py:runlocal

`get_config(arg)` takes comma-separated options: `ckpt=DIR` (the HF checkpoint directory; also the
tokenizer) and `runlocal`. `get_sweep()` is the hyper-parameter grid x seeds that
`launch/xm_launch.py` expands.

Paper settings: lr 1e-6 constant, 128 prompts x group 8, temperature 0.85, top_p 1.0, 32k input,
64k output, 5 stages (Solver, then Verifier/Corrector rounds), bf16. Update: GRPO with
seq-mean-token-mean aggregation (Eq. 2), 4 mini-batches per step, pi_old recomputed at the start
of the step (decoupled objective, behaviour weight capped at 2).

Rollouts: the rollout scheduler in pipeline mode (`mars_jax.rl.streaming`), one
continuous-batching engine per host (4 chips) on the last 2 of its chips
(`mesh.rollout.devices=2`, experts split over the 2: `mesh.rollout.expert=2`), the update on the
other 2 chips of every host (the global training mesh), overlapped with decoding. Each
agent's outputs go to training as soon as their group completes; an update runs every
128 x 8 = 1,024 trained samples over all hosts. KV cache paged (`engine_kv_pages`): outputs are
long-tailed, so slots that reserved 96k positions each would mostly sit empty.
What a "segment" is now: nothing is cut. The paper decodes a 64k output in 16k segments, each
continued under the then-latest policy; here an output keeps its slot across updates, and after
each update its KV is recomputed under the new weights (`rollout.resume='recompute'`: the same
re-prefill a new segment had, at every update instead of every 16k tokens). The paper's
staleness rule applies to the trained sample: an update to version v + 1 waits while any rollout
still to be trained (on any host) started before v + 1 - 3 (`staleness_bound=3`), so no trained
sample lags its first token by more than 3 versions. New problems are admitted while fewer than
128 x 8 x (1 + 2 x 4) = 9,216 rows are in flight (`max_inflight_rows=0`, the automatic cap),
divided evenly over the hosts. An output that reaches 64k without a stop token earns 0 and is
never verified; the template's generation prompt opens `<think>`, so text before `</think>` is
never read as answer or verdict.

Memory arithmetic (Qwen3-30B-A3B: 30.5B parameters, 48 layers, 4 KV heads x 128, vocab 151,936):
  parameters bf16                 61 GB   sharded over half the chips (fsdp = 128 on 256)
  AdamW mu + nu (param dtype)    122 GB
  gradients (accumulated)         61 GB   => train state ~244 GB: 1.9 GB/chip at fsdp = 128
  KV cache, bf16, per token       48 layers x 2 x 4 x 128 x 2 B = 98,304 B
    one row, 32k + 64k buckets    98,304 tokens x 98,304 B = 9.7 GB (allocated at full length),
                                  plus ~6 GB of decode-loop temporaries (AOT below): ~15.7 GB
    128 x 8 = 1,024 rows          16 TB: more than a v5p-128 (64 chips x 95 GiB = 6.5 TB) holds;
                                  a v5p-512 (256 chips) holds it at 4 rows per chip (4 x 15.7
                                  GB = 58.5 GiB; 60.6 GiB compiled, launch/NOTEBOOK.md)
  attention: blockwise (flash), never a [T, S] score array; one 512 x 512 tile per kv head
    group, f32: 4 rows x 4 x 8 x 512 x 512 x 4 B = 134 MB live at a time in prefill
  update, one 131,072-token row per chip: layer inputs kept for the backward (remat)
    48 x 131,072 x 2,048 x 2 B = 25.8 GB, plus one layer recomputed; MoE dispatch 16k tokens at a
    time (16,384 x 8 assignments x 2,048 x 2 B = 0.5 GB per buffer)

AOT result (`aot_compile.py`, libtpu 0.0.42.1, all 48 layers; GiB per chip, HBM 95.74):
  v5p:8x8x4  update   yes (57.9: temps 57.0)     logprobs yes (9.3)
             prefill  yes (51.9: KV cache out 36.0 + temps 14.5)
             decode   yes (60.6: args 36.2 + temps 24.0; 4 rows per chip)
  (on fsdp = 256; with data = 2, fsdp = 128 and the engine, 256 slots: update 58.7, engine_decode
  22.7, no expert gathered per step)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402


def parse_arg(arg: str | None) -> dict[str, str]:
    """'ckpt=DIR,runlocal' -> {'ckpt': 'DIR', 'runlocal': ''}."""
    options = {}
    for item in filter(None, (arg or "").split(",")):
        key, _, value = item.partition("=")
        options[key] = value
    unknown = set(options) - {"ckpt", "runlocal"}
    if unknown:
        raise ValueError(f"config arg: unknown options {sorted(unknown)}; use ckpt=DIR, runlocal")
    return options


def get_config(arg: str | None = None):
    options = parse_arg(arg)
    c = base_config()
    c.seed = 0
    c.total_steps = 300
    # Model: the HF checkpoint (weights, config.json, tokenizer); the preset gives the shapes for
    # AOT compilation when no checkpoint directory is at hand.
    c.model.preset = "qwen3_30b_a3b"
    c.model.checkpoint = options.get("ckpt", "")
    c.tokenizer = options.get("ckpt") or "qwen3"
    c.model.dtype = c.model.param_dtype = "bfloat16"
    # Blockwise attention (no [T, S] scores), per-layer rematerialisation in the update, and the
    # MoE dispatch of a chip's 131k tokens in chunks of 16k (one chunk's buffers live at a time).
    c.model.attention_impl, c.model.attention_block, c.model.remat = "flash", 512, True
    c.model.moe_chunk_tokens = 16 * 1024
    c.model.scan_layers = True  # one compiled layer: minutes instead of an hour to compile
    # FSDP over half the chips, 2-way data parallel: the batch is split over every chip, the
    # parameters and optimizer state over `fsdp`, which on v5p-512 (128) also splits the 128
    # experts, so decode runs them expert-parallel and gathers none (fsdp = 256 cannot split
    # them: 7.85 vs 1.25 GB accessed per layer per chip, benchmarks/NOTEBOOK.md).
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = 2, -1, 1, 1
    # Per host (4 chips): the engine on 2 of them with the experts split over the 2 (dense
    # weights replicated: ~32 GB of bf16 weights a chip), the training mesh on the other 2.
    c.mesh.rollout.devices = 2
    c.mesh.rollout.data, c.mesh.rollout.expert = 1, -1
    # Data: the DSR-sub RLVR training set (JSONL in the manual dir, built into TFDS).
    c.data.name, c.data.split = "dsr_sub", "train"
    # Rollouts.
    c.rollout.decode_engine, c.rollout.mode = "engine", "pipeline"
    c.rollout.resume = "recompute"
    # Per host: 32 slots over 16,384 pages of 64 positions (1,048,576 positions, 8,192 per
    # chip's pool, ~48 GiB of bf16 KV a chip beside ~30 GiB of weights). The decode writes the
    # pool in place and reads the expert weights as stored, so its temporaries stay near one
    # layer's (AOT, 48 layers, 21,504 pages: 1.3 GiB; 94.2 of 95.7 GiB: launch/README.md).
    c.rollout.engine_slots = 32
    c.rollout.engine_kv_pages, c.rollout.engine_page_size = 16384, 64
    c.rollout.engine_chunk_steps = 64
    # Hosts exchange every 512 decode steps, not every chunk: at 64 simulated hosts with
    # straggler jitter the lock-step waits for the slowest host fall from 30% to 5% of host
    # time (benchmarks/sim/exchange.py, RESULTS.md); an update or agreed stop comes up to 7
    # chunks later.
    c.rollout.exchange_chunks = 8
    c.rollout.engine_precompile = True
    c.rollout.prompts_per_step = 128
    c.rollout.group_size = 8
    c.rollout.max_stages = 5
    c.rollout.temperature, c.rollout.top_p, c.rollout.top_k = 0.85, 1.0, 0
    c.rollout.max_prompt_tokens = 32 * 1024
    for role in ("solver", "verifier", "corrector"):
        c.rollout.max_new_tokens[role] = 64 * 1024
    c.rollout.staleness_bound = 3  # a trained sample lags its first token by <= 3 versions
    c.rollout.enable_thinking = True
    # Optimizer: constant 1e-6.
    c.optimizer.learning_rate = 1e-6
    c.optimizer.schedule = "constant"
    # Rows per micro-batch over the whole training mesh (each host builds an equal share): one
    # per training chip of v5p:8x8x4 (128 chips, 2 rows a host); v5p:4x4x4 (32) needs 32.
    c.learner.micro_batch_size = 128
    c.learner.logits_chunk = 512
    # The update (the paper's Eq. 2): per-sequence token means averaged over the mini-batch;
    # 4 optimizer updates per step (verl's usual train / mini-batch ratio). Without routing
    # replay the sampler's MoE routing can differ from the trainer's, so pi_old is recomputed at
    # the start of each step and the sampler's log-probabilities weight each token
    # (decoupled PPO, cap 2), which also covers segments decoded under earlier versions.
    c.loss.aggregation = "seq-mean-token-mean"
    c.learner.mini_batches = 4
    c.loss.pi_old, c.loss.behaviour_weight_cap = "recompute", 2.0
    c.checkpoint.every_steps = 10
    if "runlocal" in options:
        c.total_steps = 2
        c.model.preset, c.model.checkpoint, c.tokenizer = "tiny", "", "tiny"
        c.model.dtype = c.model.param_dtype = ""
        c.mesh.data, c.mesh.fsdp = -1, 1
        c.mesh.rollout.devices = 0
        c.mesh.rollout.data, c.mesh.rollout.expert = -1, 1
        c.rollout.engine_slots, c.rollout.engine_kv_pages = 8, 0
        c.rollout.engine_chunk_steps, c.rollout.engine_precompile = 16, False
        c.rollout.exchange_chunks = 1  # one process: no host to wait for
        c.data.name = "arith"
        c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_stages = 2, 4, 3
        c.rollout.max_prompt_tokens = 512
        # A random tiny model earns no reward: keep its zero-variance groups (zero loss mask) so
        # that updates come every prompts_per_step x group_size samples.
        c.rollout.drop_zero_variance = False
        c.rollout.prompt_style = "compact"
        c.rollout.enable_thinking = False
        for role in ("solver", "verifier", "corrector"):
            c.rollout.max_new_tokens[role] = 48
        c.optimizer.learning_rate = 1e-4
        c.learner.micro_batch_size = 16
        c.checkpoint.every_steps = 1
    return c


def get_sweep() -> list[dict]:
    """Hyper-parameter grid x seeds, as `--config.<field>` overrides, one dict per run."""
    grid = [{"config.optimizer.learning_rate": lr, "config.rollout.temperature": t}
            for lr in (1e-6, 2e-6) for t in (0.85, 1.0)]
    return [dict(point, **{"config.seed": seed}) for point in grid for seed in (0, 1)]
