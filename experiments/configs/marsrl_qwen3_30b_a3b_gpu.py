r"""MarsRL on Qwen3-30B-A3B-Thinking-2507 at the paper's settings, on one host of 8 x H100 / H200.

  python experiments/run.py --workdir=/data/runs/marsrl_30b \
      --config=experiments/configs/marsrl_qwen3_30b_a3b_gpu.py:ckpt=/data/Qwen3-30B-A3B
  # AOT check without a GPU (CUDA PJRT plugin installed, e.g. pip install "jax[cuda12]"):
  python experiments/aot_compile.py --topology=h200:8 \
      --config=experiments/configs/marsrl_qwen3_30b_a3b_gpu.py

Same run as `marsrl_qwen3_30b_a3b.py` (paper settings, `get_config(arg)` options and `get_sweep()`),
with the mesh and micro-batch of 8 GPUs. Memory arithmetic per GPU (H100: 80 GB, H200: 141 GB):
  train state: bf16 parameters 61 GB + AdamW mu, nu 122 GB + gradients 61 GB = 244 GB / 8
                                                       = 30.5 GB, resident through the rollouts
  KV cache: 9.7 GB per row at the 32k + 64k buckets, ~19.3 GB with the decode loop's copy
                                                       => H100: 2 rows, H200: 5 rows per GPU,
                                                          i.e. 16 / 40 rows per decode call
  the paper's 128 x 8 = 1,024 rows per step            => 64 / 26 decode calls per step
  dense attention scores (f32): 412 GB per prefill row and layer at 32k x 96k
So this config runs only once attention is blockwise (cuDNN flash via
`jax.nn.dot_product_attention`) and rollouts are split into decode calls of at most 16 (H100) or
40 (H200) rows.

AOT result (`--topology=h200:8`, deviceless CUDA plugin, all 48 layers; GiB per GPU of 141):
  prefill  no  (XLA:GPU cannot tile the f32[512, 98304, 262144] attention-score dot)
  decode   no  (args 1,159 + temps 576: 128 rows per GPU)
  logprobs no  (args 7.1 + temps 3,073)
  update   no  (cannot tile the bf16[4, 1048576, 131072] score dot)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import marsrl_qwen3_30b_a3b  # noqa: E402

get_sweep = marsrl_qwen3_30b_a3b.get_sweep


def get_config(arg: str | None = None):
    c = marsrl_qwen3_30b_a3b.get_config(arg)
    if "runlocal" not in marsrl_qwen3_30b_a3b.parse_arg(arg):
        c.learner.micro_batch_size = 8  # one row per GPU per micro-batch
        c.rollout.max_decode_rows = 40  # 5 rows per H200 (H100: --config.rollout.max_decode_rows=16)
    return c
