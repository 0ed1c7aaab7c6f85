r"""SFT warm start of the toy MarsRL study: a 1.06M-parameter Qwen3-MoE learns all three roles.

Three stages, each continuing from the previous one's model (fresh AdamW, cosine schedule):

  python experiments/run.py --config=experiments/configs/toy_sft.py:1 --workdir=/tmp/mars_toy/sft1
  python experiments/run.py --config=experiments/configs/toy_sft.py:2 --workdir=/tmp/mars_toy/sft2
  python experiments/run.py --config=experiments/configs/toy_sft.py:3 --workdir=/tmp/mars_toy/sft

Problems are `arith` with 1-2 operations on operands up to 12 (`TOY_ARITH`, shared with
`toy_marsrl.py`); at the default difficulty (1-3 operations, operands up to 20) this model
copies operands unreliably and its Solver scores about 4%, too little for RL to learn from.
Traces are generated from `arith` train problems (`mars_jax.sft.traces`): Solver solutions with a
30% error rate, Verifier reports (half on flawed solutions) with right verdicts and the first wrong
step, Corrector fixes. Stage 1 trains from scratch on one example of each role per problem;
stages 2 and 3 keep only 30% of the long, already well fitted Verifier and Corrector examples, so
that more compute goes to reading operands and computing (the Solver's loss). Copying digits
(operands from the problem, results into the box) is learnt late: after stage 1 the Solver's
digits are still at chance (about ln 10 nats each) while operators are already copied. The final model
lands in `/tmp/mars_toy/sft/model`, which `toy_marsrl.py` loads.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402

STEPS = {"1": 400, "2": 400, "3": 600}
TOY_ARITH = dict(num_ops=(1, 2), max_operand=12, operators="+-*")


def get_config(arg: str = "1"):
    if arg not in STEPS:
        raise ValueError(f"toy_sft config: unknown stage {arg!r} (1 | 2 | 3)")
    c = base_config()
    c.job = "sft"
    c.seed = int(arg) - 1  # each stage visits the problems in a new order
    c.tokenizer = "tiny"
    c.data.name, c.data.split = "arith", "train"
    c.data.arith.update(TOY_ARITH)
    c.sft.arch = "toy"
    c.sft.steps = STEPS[arg]
    c.sft.rows, c.sft.row_tokens = 8, 576  # the longest example: ~540 tokens
    c.sft.solver_error_rate, c.sft.verifier_flawed_rate = 0.3, 0.5
    c.sft.holdout_problems, c.sft.eval_every = 32, 40
    c.optimizer.learning_rate = 2e-3
    c.optimizer.schedule, c.optimizer.warmup_steps = "cosine", 20
    c.optimizer.max_grad_norm = 1.0
    if arg != "1":
        c.model.checkpoint = f"/tmp/mars_toy/sft{int(arg) - 1}/model"
        c.sft.keep.verifier, c.sft.keep.corrector = 0.3, 0.3
    return c
