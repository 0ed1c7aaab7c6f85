r"""The README's main job: a warm start built on first use, then MarsRL that visibly learns (CPU).

  python experiments/run.py --config=experiments/configs/quickstart.py --workdir=/tmp/marsrl_quickstart

The first run trains the warm start (`warm_start.sft`): 300 SFT steps of a 0.16M-parameter dense
Qwen3 (`sft.arch = "mini"`) on generated traces of all three roles (mostly the Solver's) for the
one-digit additions (`What is 7 + 5?`); half of the Solver traces have a wrong result. It is
cached under `~/.cache/mars_jax/warm_start/<fingerprint>` and reused by later runs. MarsRL then
trains the Solver -> Verifier -> Corrector pipeline (pipeline mode, 3 stages, 6 problems a step,
groups of 8) on the same problems. The warm start's Solver is right on about a quarter of its
samples at T=1, so most groups have reward variance; RL raises it (the Verifier's and Corrector's
rewards move too). Problems come in order and steps 16-20 revisit those of steps 1-5, so the
summary's first and last quarters compare the same problems.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402


def get_config():
    c = base_config()
    c.total_steps = 20
    c.tokenizer = "tiny"
    # Data: the 100 one-digit additions, 90 to train on (RL; the warm start trains on the first
    # 90 - sft.holdout_problems of them), 10 held out.
    c.data.name, c.data.split = "arith", "train"
    c.data.arith.update(dict(num_ops=(1, 1), max_operand=9, operators="+", sizes=(90, 10)))
    # In order, 6 a step: steps 16-20 revisit the problems of steps 1-5, so the summary's first
    # and last quarters (5 steps each) compare the Solver on the same 30 problems.
    c.data.shuffle = False
    # Warm start: SFT on generated role traces, mostly the Solver's (short, cheap) examples.
    c.warm_start.sft = True
    c.warm_start.learning_rate, c.warm_start.schedule, c.warm_start.warmup_steps = 1e-2, "cosine", 10
    c.sft.arch, c.sft.steps = "mini", 300
    # 5632 tokens a step: 6 rows of 512 for the long Verifier (~476 tokens with its prompt) and
    # Corrector (~259) traces, 10 of 256 for the short Solver ones (~77), whose attention then
    # spans 256 positions, not 512. A step trains ~30 Solver, ~4.4 Verifier and ~1.4 Corrector
    # examples. With 3 long rows, 8 short ones and 5% of the Verifier traces (~26 / 1.4 / 1.3),
    # 67-80% of the Verifier's replies in RL held no readable verdict; with these, 30-58%
    # (experiments/NOTEBOOK.md, "The main job's Verifier").
    c.sft.rows, c.sft.row_tokens = 6, 512
    c.sft.short_rows, c.sft.short_row_tokens = 10, 256
    c.sft.solver_error_rate, c.sft.verifier_flawed_rate = 0.5, 0.5
    c.sft.keep.verifier, c.sft.keep.corrector = 0.15, 0.05
    c.sft.holdout_problems, c.sft.eval_every = 16, 100
    # Rollouts: 6 new problems a step, groups of 8, one parent per later stage, 3 stages.
    c.rollout.mode = "pipeline"
    c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.fan_out = 6, 8, 1
    c.rollout.max_stages = 3
    # The longest Verifier trace (check modulo 10, then a Wrong report) is 193 tokens, but the
    # warm start's sampled replies run longer (T=1.0: median 186, 90th percentile 215 tokens) and
    # RL lengthens them (mean ~180 at step 2 -> 210-250 by steps 12-17 with room to 512): at 200
    # most were cut off by the end of the run. 320 leaves them room (`truncated/verifier`).
    c.rollout.max_new_tokens.update(dict(solver=32, verifier=320, corrector=32))
    c.rollout.max_prompt_tokens = 512
    c.rollout.prompt_style = "compact"
    c.rollout.temperature = 1.0
    # Update.
    c.optimizer.learning_rate = 5e-4
    # A step trains at most 144 samples, packed into rows of 1,024 (a Verifier sample, a ~306-token
    # prompt and up to 320 generated, fits; so do two of ~480 tokens, or a Corrector's, ~300,
    # with Solver ones, ~77): ~40-50 rows, which 16 micro-batches of 4 rows hold (empty ones
    # skipped, none cut), so the update compiles once.
    c.learner.micro_batch_size, c.learner.min_micro_batches, c.learner.min_length = 4, 16, 1024
    c.learner.length_halvings = 0
    c.checkpoint.every_steps, c.checkpoint.keep = 10, 2
    return c
