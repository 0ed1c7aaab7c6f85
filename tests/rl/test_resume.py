"""Exact resume: 6 steps straight == 3 steps, SIGKILL, restart, 3 more (bitwise, on CPU), with
static batches (`rollout.decode_engine='generate'`) and on the engine (requests in flight in the
engine at the checkpoint are resubmitted as continuations). Rewards are the parity of each
rollout's index in its group (`tests/fault/parity_reward_run.py`), so every update moves the parameters."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from mars_jax.checkpoint import Checkpointer
from tests.cpu_env import cpu_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests/fault/parity_reward_run.py"  # experiments/run.py with parity rewards
OVERRIDES = [
    "--config.total_steps=6", "--config.rollout.group_size=2", "--config.rollout.prompts_per_step=1",
    "--config.rollout.max_new_tokens.solver=16", "--config.rollout.max_new_tokens.verifier=16",
    "--config.rollout.max_new_tokens.corrector=16", "--config.rollout.max_stages=3",
    "--config.learner.micro_batch_size=8",
    "--config.learner.min_length=512",
]
STREAM = ["--config.rollout.decode_engine=engine",
          "--config.rollout.engine_slots=4"]
TIMING_KEYS = ("time/", "tokens_per_second", "stream/deferred_seconds")


def _command(workdir, extra=()):
    return [sys.executable, str(SCRIPT),
            "--config=" + str(REPO / "experiments/configs/smoke.py"), f"--workdir={workdir}",
            f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}", *OVERRIDES,
            *extra]


def _env():
    return cpu_env()  # one CPU device


def _final_params(workdir):
    from mars_jax.models import create_model, get_preset
    from mars_jax.optimizer import make_optimizer
    from mars_jax.rl.update import init_train_state
    model = create_model(get_preset("tiny"))
    abstract = init_train_state(model, make_optimizer(1e-4))
    checkpointer = Checkpointer(Path(workdir) / "checkpoints")
    step, state, _, _ = checkpointer.restore_latest(abstract)
    checkpointer.close()
    return step, jax.tree.leaves(jax.tree.map(np.asarray, state.params))


def _metrics(workdir):
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)} for row in rows]


# Static batches' kill runs with the slow tests (its resume path is also the engine's: the
# checkpoint, the data iterator and the queues; the engine's adds requests in flight).
@pytest.mark.parametrize("extra", [pytest.param(("--config.rollout.decode_engine=generate",),
                                                marks=pytest.mark.slow), STREAM],
                         ids=["generate", "engine"])
def test_sigkill_and_resume_is_bitwise_identical(tmp_path, extra):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(_command(straight, extra), env=_env(), check=True, capture_output=True,
                   timeout=900)

    process = subprocess.Popen(_command(killed, extra), env=_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.time() < deadline, "run ended before step 3"
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(metrics.read_text().splitlines()) < 6
    subprocess.run(_command(killed, extra), env=_env(), check=True, capture_output=True,
                   timeout=900)

    step_a, params_a = _final_params(straight)
    step_b, params_b = _final_params(killed)
    assert step_a == step_b == 6
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    rows = _metrics(straight)
    assert rows == _metrics(killed)
    assert all(row["update/grad_norm"] > 0 for row in rows)  # every update moved the weights
