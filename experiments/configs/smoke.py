r"""Smoke run: MarsRL on the tiny Qwen3-MoE and generated `arith` problems, full pipeline, CPU.

  python experiments/run.py --config=experiments/configs/smoke.py --workdir=/tmp/marsrl_smoke

Any field can be overridden, e.g. `--config.rollout.mode=sequential --config.total_steps=4`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402


def get_config():
    c = base_config()
    c.total_steps = 6
    c.tokenizer = "tiny"
    # Data.
    c.data.name, c.data.split = "arith", "train"
    # Model.
    c.model.preset = "tiny"
    # Rollouts: 2 new problems a step, groups of 4, all 5 stages.
    c.rollout.prompts_per_step = 2
    c.rollout.group_size = 4
    c.rollout.max_new_tokens.solver = 48
    c.rollout.max_new_tokens.verifier = 48
    c.rollout.max_new_tokens.corrector = 48
    c.rollout.max_prompt_tokens = 512
    c.rollout.prompt_style = "compact"
    # A random model earns no reward, so every group has zero variance: keep those samples (with
    # a zero loss mask) so that every step still runs the update program.
    c.rollout.drop_zero_variance = False
    # A random tiny model seldom stops by itself: let its truncated Solver and Corrector outputs
    # reach the Verifier (they still earn 0), so that every stage of the pipeline runs.
    c.rollout.verify_truncated = True
    # Optimizer.
    c.optimizer.learning_rate = 1e-4
    c.learner.micro_batch_size = 16
    return c
