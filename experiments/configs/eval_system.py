r"""Solver-only and V–C system avg@k evaluation.

  python experiments/run.py --config=experiments/configs/eval_system.py --workdir=/tmp/eval

`get_config()` evaluates the tiny model in-process on 8 `arith` test problems (CPU, minutes).
`get_config('aime2025')` is the paper's setting: AIME 2025, avg@32, T=0.6, top_p=0.95, served by an
OpenAI-compatible server (vLLM / SGLang) running Qwen3-30B-A3B-Thinking-2507:

  python experiments/run.py --config=experiments/configs/eval_system.py:aime2025 \
      --workdir=/tmp/eval_aime --config.eval.vc_base_url=http://localhost:8000/v1 \
      --config.eval.served_model=Qwen/Qwen3-30B-A3B-Thinking-2507
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import base_config  # noqa: E402


def get_config(arg: str = "tiny"):
    c = base_config()
    c.job = "eval_system"
    if arg == "tiny":
        c.model.preset, c.tokenizer = "tiny", "tiny"
        c.rollout.prompt_style = "compact"
        c.eval.dataset, c.eval.split, c.eval.num_problems, c.eval.num_samples = "arith", "test", 8, 2
        c.eval.k_accept, c.eval.max_iterations = 2, 3
        c.eval.max_new_tokens.solver = 32
        c.eval.max_new_tokens.verifier = 32
        c.eval.max_new_tokens.corrector = 32
    elif arg in ("aime2025", "beyond_aime"):
        c.tokenizer = "qwen3"
        c.rollout.enable_thinking = True
        c.eval.dataset, c.eval.split, c.eval.num_samples = arg, "test", 32
        c.eval.temperature, c.eval.top_p = 0.6, 0.95
        c.eval.policy = "http"
        c.eval.max_new_tokens.solver = 65536
        c.eval.max_new_tokens.verifier = 65536
        c.eval.max_new_tokens.corrector = 65536
    else:
        raise ValueError(f"eval_system config: unknown arg {arg!r} (tiny | aime2025 | beyond_aime)")
    return c
