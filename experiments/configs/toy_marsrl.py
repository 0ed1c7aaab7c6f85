r"""Toy MarsRL and its ablations on `arith`, warm-started from the `toy_sft.py` checkpoint (CPU).

  python experiments/run.py --config=experiments/configs/toy_marsrl.py:marsrl    --workdir=/tmp/mars_toy/marsrl
  python experiments/run.py --config=experiments/configs/toy_marsrl.py:marsrl_s  --workdir=/tmp/mars_toy/marsrl_s
  python experiments/run.py --config=experiments/configs/toy_marsrl.py:marsrl_vc --workdir=/tmp/mars_toy/marsrl_vc

Run 2 of `experiments/RESULTS.md` adds `--config.optimizer.learning_rate=5e-5
--config.loss.kl_coef=0.05 --config.rollout.selection=balanced` to each command.

`marsrl` trains on the samples of all three agents, `marsrl_s` on Solver samples only (its
rollouts stop after the Solver), `marsrl_vc` on Verifier and Corrector samples only. The SFT
model is read from `/tmp/mars_toy/sft/model` (`--config.model.checkpoint=...` to move it). The
`eval` section is the held-out evaluation `experiments/report.py` runs on every variant.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402
from toy_sft import TOY_ARITH  # noqa: E402

VARIANTS = {"marsrl": "all", "marsrl_s": "solver", "marsrl_vc": "vc"}
SFT_MODEL = "/tmp/mars_toy/sft/model"
MAX_NEW_TOKENS = 128  # longest SFT reply: 131 tokens (a Wrong report), most under 110


def get_config(arg: str = "marsrl"):
    if arg not in VARIANTS:
        raise ValueError(f"toy_marsrl config: unknown arg {arg!r} ({' | '.join(VARIANTS)})")
    c = base_config()
    c.seed = 0
    c.total_steps = 60
    c.tokenizer = "tiny"
    c.data.name, c.data.split = "arith", "train"
    c.data.arith.update(TOY_ARITH)
    c.model.checkpoint = SFT_MODEL
    # Rollouts: 3 new problems a step, groups of 4, one parent per stage, Solver -> Verifier ->
    # Corrector (3 stages; MarsRL-S stops after the Solver).
    c.rollout.roles_trained = VARIANTS[arg]
    c.rollout.mode = "pipeline"
    c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.fan_out = 3, 4, 1
    c.rollout.max_stages = 3
    for role in ("solver", "verifier", "corrector"):
        c.rollout.max_new_tokens[role] = MAX_NEW_TOKENS
        c.eval.max_new_tokens[role] = MAX_NEW_TOKENS
    c.rollout.max_prompt_tokens = 512
    c.rollout.prompt_style = "compact"
    c.optimizer.learning_rate = 3e-4
    c.learner.micro_batch_size = 12  # a step trains ~36 samples (MarsRL), 12 (-S), 24 (-VC)
    c.checkpoint.every_steps, c.checkpoint.keep = 10, 2
    # Held-out evaluation: avg@2 on 128 `arith` test problems at the paper's sampling settings
    # (train T=0.85; eval T=0.6, top_p=0.95).
    c.eval.dataset, c.eval.split = "arith", "test"
    c.eval.num_problems, c.eval.num_samples = 128, 2
    c.eval.k_accept, c.eval.max_iterations, c.eval.max_retries = 2, 4, 1
    c.rollout.temperature = 0.85
    c.eval.temperature, c.eval.top_p = 0.6, 0.95
    return c
