"""Non-finite guard: a NaN/Inf gradient skips its update (logged); n in a row stop the run."""
import re
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax.models import create_model, get_preset
from mars_jax.rl.batching import TrainSample, make_batch
from mars_jax.rl.trainer import NonFiniteUpdates
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import UpdateConfig, init_train_state, train_step
from tests.fault import harness


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_a_non_finite_gradient_leaves_params_and_optimizer_untouched(poison):
    model = create_model(get_preset("tiny"), seed=0)
    graphdef, _ = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(1e-3)
    state = init_train_state(model, optimizer)
    samples = [TrainSample([1, 2, 3], [4, 5], [-1.0, -1.0], a) for a in (1.0, -1.0)]
    step = lambda s, batch: train_step(s, batch, None, graphdef=graphdef, optimizer=optimizer,
                                       config=UpdateConfig())
    state, metrics = step(state, make_batch(samples, micro_batch_size=2))  # one good update
    assert float(metrics["finite"]) == 1.0
    before = jax.tree.map(np.array, (state.params, state.opt_state, state.step))

    poisoned = make_batch(samples, micro_batch_size=2)
    poisoned = poisoned.replace(advantages=np.array(poisoned.advantages).copy())
    poisoned.advantages[0, 0] = poison  # one sample: NaN/Inf flows into the loss and gradient
    state, metrics = step(state, poisoned)
    assert float(metrics["finite"]) == 0.0 and not np.isfinite(float(metrics["grad_norm"]))
    after = jax.tree.map(np.array, (state.params, state.opt_state, state.step))
    jax.tree.map(np.testing.assert_array_equal, before, after)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", [
    ("--config.rollout.decode_engine=generate",), ("--config.rollout.decode_engine=engine",
         "--config.rollout.engine_slots=4")])
def test_skipped_updates_are_logged_and_a_streak_stops_the_run_at_the_last_good_checkpoint(
        tmp_path, scheduler):
    """Also with the streaming engine on the training mesh, which decodes on after a skipped
    update with the arrays the update returned (it donated the ones the engine had)."""
    # Step 3 is poisoned alone (skipped, training goes on); steps 5 and 6 in a row stop the run.
    workdir = tmp_path / "run"
    result = subprocess.run(
        harness.command(workdir, "--config.max_nonfinite_updates=2", *scheduler,
                        script=harness.REPO / "tests/fault/poisoned_run.py"),
        env=harness.env(POISON_STEPS="3,5,6"), capture_output=True, text=True, timeout=900)
    assert result.returncode == NonFiniteUpdates.exit_code, result.stderr[-3000:]
    assert re.search(r"step 3: non-finite loss or gradient in (\d+) of \1 updates, those "
                     r"skipped \(1 such steps in a row\)", result.stderr)
    assert re.search(r"step 6: non-finite .* \(2 such steps in a row\)", result.stderr)
    assert "NonFiniteUpdates: 2 steps with non-finite updates in a row at step 6" in result.stderr

    rows = {row["step"]: row for row in harness.metrics(workdir)}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert [rows[s]["update/finite"] for s in (2, 3, 4, 5, 6)] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert [rows[s]["update/nonfinite_streak"] for s in (2, 3, 4, 5, 6)] == [0, 1, 0, 1, 2]
    version = {s: rows[s]["policy_version"] for s in rows}
    assert version[3] == version[2] and version[6] == version[5] == version[4] == version[2] + 1

    # No checkpoint is written during a streak: the newest is step 4, intact and restorable.
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [1, 2, 4]
    step, _, restored_version = harness.latest_checkpoint(workdir)
    assert (step, restored_version) == (4, version[4])
