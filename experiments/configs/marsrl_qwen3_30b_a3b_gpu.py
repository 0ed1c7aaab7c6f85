r"""MarsRL on Qwen3-30B-A3B-Thinking-2507 at the paper's settings, on one host of 8 x H200.

  python experiments/run.py --workdir=/data/runs/marsrl_30b \
      --config=experiments/configs/marsrl_qwen3_30b_a3b_gpu.py:ckpt=/data/Qwen3-30B-A3B
  # AOT check without a GPU (CUDA PJRT plugin installed, e.g. pip install "jax[cuda12]"):
  python experiments/aot_compile.py --topology=h200:8 \
      --config=experiments/configs/marsrl_qwen3_30b_a3b_gpu.py
  # 8 x H100 (80 GB): the update at 64k outputs does not fit (AOT below); halve the outputs
  #   --config.rollout.max_new_tokens.solver=32768 \
  #   --config.rollout.max_new_tokens.verifier=32768 --config.rollout.max_new_tokens.corrector=32768

Same run as `marsrl_qwen3_30b_a3b.py` (paper settings, the rollout scheduler in pipeline mode,
`get_config(arg)` options and `get_sweep()`), with the mesh and micro-batch of 8 GPUs: one process,
one engine on all 8 GPUs decoding with the trainer's own parameter arrays (no copy; the rollout
pauses while the update runs), its KV cache paged: 48 slots over 49,152 pages of 32 positions
(8 pools of 6,144 pages, 196k positions, 19.3 GB a GPU; the Pallas GPU paged-attention kernel
needs 282,624 B of shared memory a block at 64-position pages, over the H200's 232,448).
AOT (`--topology=h200:8`, 48 layers, 2026-12-06): engine_decode 25.8 GiB (weights 7.6 + KV 18.0,
temporaries 0.7), update 84.5 GiB, each of 141; the KV cache stays through the update: 102.5.
Memory arithmetic per GPU (H100: 80 GB, H200: 141 GB), from the per-step decoder's AOT record
below:
  train state: bf16 parameters 61 GB + AdamW mu, nu 122 GB + gradients 61 GB = 244 GB / 8
                                                       = 30.5 GB, resident through the rollouts
  KV cache: 9.7 GB per row at the 32k + 64k buckets, ~19.3 GB with the decode loop's copy
                                                       => H100: 2 rows, H200: 4 rows per GPU,
                                                          i.e. 16 / 32 rows per decode call
  the paper's 128 x 8 = 1,024 rows per step            => 64 / 32 decode calls per step
  attention is blockwise (flash) and the update rematerialises each layer, as on TPU.

AOT result (`--topology=h200:8`, deviceless CUDA plugin, all 48 layers; GiB per GPU of 141;
MoE `auto` with 512-row blocks and the experts split over `fsdp`, 2026-12-06):
  prefill  yes (117.6: KV cache out 36.0 + temps 74.5)     logprobs yes (19.6)
  decode   yes (61.8: args 43.1 + temps 18.7)              update   yes (84.4)
  (with moe_impl 'ragged': update 275.5 and prefill 209.0 at 40 rows: no.)
`--topology=h100:8` (79.1 GiB), 16 decode rows: prefill 63.7, decode 34.8, logprobs 19.4 fit;
  update 82.3 (temps 60.8) does not. With the 32k outputs above (65,536-token update rows):
  update 66.3, prefill 57.8, decode 25.8, logprobs 17.5: all fit.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import marsrl_qwen3_30b_a3b  # noqa: E402

get_sweep = marsrl_qwen3_30b_a3b.get_sweep


def get_config(arg: str | None = None):
    c = marsrl_qwen3_30b_a3b.get_config(arg)
    if "runlocal" not in marsrl_qwen3_30b_a3b.parse_arg(arg):
        c.mesh.data = 1  # FSDP over all 8 GPUs (8 divides the 128 experts; 2 x 4 would double
        # each GPU's 30 GB share of the training state)
        c.learner.micro_batch_size = 8  # one row per GPU per micro-batch
        c.mesh.rollout.devices = 0  # one shared mesh: the engine decodes on the trainer's arrays
        c.mesh.rollout.data, c.mesh.rollout.expert = -1, 1
        c.rollout.engine_slots = 48
        c.rollout.engine_kv_pages, c.rollout.engine_page_size = 49152, 32
        # MoE dispatch: 'auto', i.e. `dense` for decode (<= 256 tokens a call; expert-parallel
        # over `fsdp`, no expert weight gathered) and, off TPU, `sorted` for prefill and the
        # update, never `ragged` (XLA:GPU lowers it with far larger
        # temporaries: update 275 vs 91 GiB per GPU, see the AOT result above). One 30B MoE block
        # on an H100 (benchmarks/NOTEBOOK.md, "One H100"): dense 1.3 ms vs sorted 6.4 ms at 256
        # tokens; sorted 21.4 ms with 512-row blocks vs 47.7 ms with 128 at 16,384 tokens.
        c.model.moe_impl = ""
        c.model.moe_dense_max_tokens = 256
        c.model.moe_block_size = 512
    return c
