r"""SFT warm start of the toy MarsRL study: a 1.1M-parameter Qwen3-MoE learns all three roles.

  python experiments/run.py --config=experiments/configs/toy_sft.py:all_roles --workdir=/tmp/mars_toy/sft1
  python experiments/run.py --config=experiments/configs/toy_sft.py:solver_focus --workdir=/tmp/mars_toy/sft

Traces are generated from `arith` train problems (`mars_jax.sft.traces`): Solver solutions with a
30% error rate, Verifier reports (half on flawed solutions) with right verdicts and the first wrong
step, Corrector fixes. `all_roles` trains from scratch on one example of each role per problem;
`solver_focus` continues from its model (`/tmp/mars_toy/sft1/model`) keeping only 30% of the
(long, already well fitted) Verifier and Corrector examples, so that more of the compute goes to
reading operands and computing. The final model lands in `<workdir>/model`, which
`toy_marsrl.py` loads from `/tmp/mars_toy/sft/model`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402

STAGE1_MODEL = "/tmp/mars_toy/sft1/model"


def get_config(arg: str = "all_roles"):
    if arg not in ("all_roles", "solver_focus"):
        raise ValueError(f"toy_sft config: unknown arg {arg!r} (all_roles | solver_focus)")
    c = base_config()
    c.job = "sft"
    c.tokenizer = "tiny"
    c.data.name, c.data.split = "arith", "train"
    c.sft.arch = "toy"
    c.sft.steps = 320
    c.sft.rows, c.sft.row_tokens = 8, 576  # the longest example: ~540 tokens
    c.sft.solver_error_rate, c.sft.verifier_flawed_rate = 0.3, 0.5
    c.sft.holdout_problems, c.sft.eval_every = 32, 40
    c.optimizer.learning_rate = 2e-3
    c.optimizer.schedule, c.optimizer.warmup_steps = "cosine", 20
    c.optimizer.max_grad_norm = 1.0
    if arg == "solver_focus":
        c.seed = 1  # a different problem order than stage 1
        c.model.checkpoint = STAGE1_MODEL
        c.sft.steps = 400
        c.sft.keep.verifier, c.sft.keep.corrector = 0.3, 0.3
    return c
