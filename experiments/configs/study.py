r"""The toy study of experiments/RESULTS.md: its SFT warm start and the three RL variants (CPU).

  python experiments/run.py --config=experiments/configs/study.py:sft    --workdir=/tmp/mars_study/sft
  python experiments/run.py --config=experiments/configs/study.py:marsrl --workdir=/tmp/mars_study/marsrl_seed0
  bash experiments/study.sh /tmp/mars_study   # the whole study: warm start, RL runs, report

Problems: `arith` with 3 operations over `+ -` on one-digit operands (`What is 0 + 5 - 7 - 5?`),
5,500 to train on, 500 held out (`data.arith.sizes`). Every role thinks in one-fact steps
(`mars_jax.sft.traces`) and thinking is stripped before the next agent reads a reply, so a
solution reaches the Verifier as one line (`0 + 5 - 7 - 5 = -7`); the Verifier casts out tens:
it subtracts the claim's units digit from the expression and reduces that modulo 10 (one-digit
facts, easier than the Solver's), passing the claim when it reaches 0. The warm start (`sft`)
continues a committed dense 0.86M Qwen3 on exact traces of all three roles
(`sft.solver_error_rate` 0: the Solver's errors are its own); half the Verifier's examples judge
a flawed solution. `sft.probe_every` samples each role's decisions on held-out problems while it
trains and saves the model at each probe.

RL: pipeline mode, 32 new problems a step, groups of 8, one parent per later stage, sampled at
the evaluation's temperature (0.6); `balanced`
selection, so the Verifier judges right and wrong solutions equally often whenever a group holds
both (`adaptive` would give it a wrong one whenever one exists).

Every RL run probes each role's decisions on 256 held-out problems before step 1 and every 50
steps (`eval.probe_every`, `probe/*` in metrics.jsonl), so learning shows apart from the mix of
the training problems.

`marsrl` trains on the samples of all three agents, `marsrl_s` on Solver samples only (its
rollouts stop after the Solver), `marsrl_vc` on Verifier and Corrector samples only; all start
from `<root>/sft/model` (`ROOT` below; `--config.model.checkpoint=...` to move it). The `eval`
section is the held-out evaluation `experiments/report.py --config_module=study` runs.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402

VARIANTS = {"marsrl": "all", "marsrl_s": "solver", "marsrl_vc": "vc"}
ROOT = "/tmp/mars_study"
RESULTS = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "results", "study"))
WARM_START = os.path.join(RESULTS, "warm_start")
ARITH = dict(num_ops=(3, 3), max_operand=9, operators="+-", sizes=(5_500, 500))
# Longest replies: Solver / Corrector 109 tokens (thinking, then the one-line solution), a
# Verifier's check modulo 10 and Wrong report 269.
MAX_NEW_TOKENS = dict(solver=120, verifier=272, corrector=120)


def get_config(arg: str = "marsrl"):
    if arg != "sft" and arg not in VARIANTS:
        raise ValueError(f"study config: unknown arg {arg!r} (sft | {' | '.join(VARIANTS)})")
    c = base_config()
    c.seed = 0
    c.tokenizer = "tiny"
    c.data.name, c.data.split = "arith", "train"
    c.data.arith.update(ARITH)
    c.rollout.max_prompt_tokens = 512
    # Dense attention for every role's rows (up to 1,024 columns; 'auto' now picks it too): the
    # blockwise kernel was 2.4x slower an SFT step and 2.2x slower an RL update here (`python
    # benchmarks/update.py --workload=study`).
    c.model.attention_impl = "dense"
    c.rollout.prompt_style = "compact"
    c.eval.max_new_tokens.update(MAX_NEW_TOKENS)
    c.eval.temperature, c.eval.top_p = 0.6, 0.95
    return sft_config(c) if arg == "sft" else rl_config(c, arg)


def sft_config(c):
    c.job = "sft"
    # Continues the committed warm start (experiments/results/study/warm_start: 3,250 steps on
    # Study 4's traces, whose Verifier recomputed the value) on the current traces. The study's
    # SFT model, experiments/results/study/sft, came from this recipe in four phases (Studies 5
    # and 6 of experiments/NOTEBOOK.md). It is the `small` arch (0.86M; the 3.3M `medium` learnt
    # no faster per wall-clock minute here).
    c.model.checkpoint = WARM_START
    c.sft.steps = 1000
    # The longest example (a Wrong Verifier reply) is 602 tokens.
    c.sft.rows, c.sft.row_tokens = 8, 608
    # Exact traces: the Solver's errors are its own (slip-injected traces taught near-miss
    # arithmetic that the Verifier then shared); half the Verifier's examples judge a flawed one.
    c.sft.solver_error_rate, c.sft.verifier_flawed_rate = 0.0, 0.5
    c.sft.keep.verifier, c.sft.keep.corrector = 1.0, 0.5
    # Held-out loss and each role's sampled decisions (mars_jax.sft.probe) every 250 steps.
    c.sft.holdout_problems, c.sft.eval_every, c.sft.probe_every = 128, 250, 250
    c.optimizer.learning_rate = 2e-3
    c.optimizer.schedule, c.optimizer.warmup_steps = "cosine", 20
    c.optimizer.max_grad_norm = 1.0
    return c


def rl_config(c, variant: str):
    # 600 steps: MarsRL-S's held-out Solver rose ~1 point a 100 steps from step 200 (probe 65.6
    # -> 70.7 at step 600; experiments/NOTEBOOK.md, "MarsRL-S at T=0.6 to 600+ steps").
    c.total_steps = 600
    c.model.checkpoint = f"{ROOT}/sft/model"
    c.rollout.roles_trained = VARIANTS[variant]
    c.rollout.mode = "pipeline"
    # 32 problems a step, one update of lr 3e-5 a step: the fastest setting measured whose update
    # raises the policy's reward against a no-update control (+1.3 +-0.4 points over 100 MarsRL-S
    # steps); 8 problems and two updates of 1e-4 a step lowered it (experiments/NOTEBOOK.md, "RL
    # against a no-update control").
    c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.fan_out = 32, 8, 1
    c.rollout.max_stages = 3
    c.rollout.selection = "balanced"
    c.rollout.max_new_tokens.update(MAX_NEW_TOKENS)
    # A step's ~700 requests on one continuous-batching engine of 256 slots, 32 admitted at a time
    # (one prefill call, which also prefills the next 64 queued prompts): rollout 27-39 s a step
    # against `generate`'s 35-57 s (steps 2-4 of a MarsRL run, benchmarks/RESULTS.md).
    c.rollout.decode_engine, c.rollout.engine_slots = "engine", 256
    c.rollout.engine_admit_batch, c.rollout.engine_prefill_ahead = 32, 64
    # Rollouts at the evaluation's temperature (RL sharpens the policy that is evaluated); top_p
    # 1.0 so that the PPO ratio is of the distribution sampled.
    c.rollout.temperature, c.rollout.top_p = 0.6, 1.0
    c.optimizer.learning_rate = 3e-5
    # Micro-batches of 16 rows, longest first, are each cut to their own length
    # (Solver rows ~160 tokens, Verifier rows ~500 in the SFT traces), so Solver rows are not
    # padded to a Verifier row's length.
    c.learner.mini_batches, c.learner.micro_batch_size = 1, 16
    # Verifier rows (~330-token prompts, up to 602 tokens in all) pad to 1,024 columns: the 3/4
    # cuts run them at 768 instead. One sample a row: packed into rows of 1,024, a step of this
    # shape took 59.5 s against 48.1 s this way (`python benchmarks/update.py
    # --workload=study`, benchmarks/RESULTS.md).
    c.learner.fine_cuts, c.learner.pack = True, False
    c.checkpoint.every_steps, c.checkpoint.keep = 10, 2
    # Held-out evaluation: avg@2 on the 500 test problems at the paper's sampling settings.
    c.eval.dataset, c.eval.split = "arith", "test"
    c.eval.num_problems, c.eval.num_samples = 500, 2
    c.eval.k_accept, c.eval.max_iterations, c.eval.max_retries = 2, 4, 1
    # 64 engine slots: a static `generate` prefills all 1,000 runs of a round at once (the
    # Verifier round's temporaries: 28.6 GB for `medium`, out of memory here).
    c.eval.engine_slots = 64
    # Each role's decisions on the first 256 held-out problems (mars_jax.sft.probe) before step 1
    # and every 50 steps: learning told apart from the training problems' mix.
    c.eval.probe_every, c.eval.probe_problems = 50, 256
    return c
