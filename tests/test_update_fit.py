"""The start-up check that one micro-batch's update program fits a chip: compiled on the tiny
model over a 2-device mesh, accepted under a limit above what it counts, refused (naming
learner.micro_batch_size) under one below, and counting more for more rows; the trainer runs
it at start-up off CPU, before anything is collected."""
import jax
import pytest
from flax import nnx

from experiments.configs import smoke
from mars_jax import memory_fit, sharding
from mars_jax.errors import ConfigError
from mars_jax.models import create_model, get_preset
from mars_jax.optimizer import make_optimizer
from mars_jax.rl import trainer, update_fit
from mars_jax.rl.config import train_settings
from mars_jax.rl.update import init_train_state


@pytest.fixture(scope="module")
def run():
    """The tiny model's train state (parameters replicated over data=2) and its graph."""
    mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
    with sharding.use_mesh(mesh):
        model = create_model(get_preset("tiny"), seed=0, mesh=mesh)
        state = init_train_state(model, make_optimizer(1e-4))
    return mesh, state, nnx.split(model, nnx.Param)[0]


def _config(micro_batch_size: int):
    config = smoke.get_config()
    config.rollout.max_prompt_tokens = 64
    for role in ("solver", "verifier", "corrector"):
        config.rollout.max_new_tokens[role] = 32 if role == "solver" else 1000
    config.rollout.roles_trained = "solver"  # the verifier's longer outputs are not trained
    config.learner.micro_batch_size = micro_batch_size
    return config


def _shape(micro_batch_size: int) -> update_fit.UpdateShape:
    settings = train_settings(_config(micro_batch_size))
    return update_fit.update_shape(settings.learner, settings.rollout, settings.stream)


def _check(run, micro_batch_size: int, limit: int) -> update_fit.UpdateBytes:
    mesh, state, graphdef = run
    settings = train_settings(_config(micro_batch_size))
    return update_fit.check(_shape(micro_batch_size), settings.learner, state, None, mesh,
                            graphdef=graphdef, update_config=settings.update, experts=None,
                            limit=limit)


def test_the_shape_is_the_trained_roles_longest_row_bucketed():
    shape = _shape(8)
    # 64 + 32 tokens -> 128 columns; 2 x 4 rows of one mini-batch in micro-batches of 8: one.
    assert (shape.micro_batch, shape.num_micro, shape.length) == (8, 1, 128)
    assert _shape(2).num_micro == 4


def test_the_update_fits_a_large_chip_and_is_refused_on_a_smaller_one(run):
    used = _check(run, 8, limit=1 << 40)
    _, state, _ = run
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))
    # Replicated over data=2: the parameters and the donated gradient sum are arguments, Adam's
    # two moments (and the counters) stay beside the program.
    assert used.beside == memory_fit.largest_shard((state.opt_state, state.step))
    assert 2 * params <= used.beside <= 2 * params + 64
    assert used.program >= 2 * params and used.temp > 0
    _check(run, 8, limit=used.total)  # exactly what it needs
    with pytest.raises(ConfigError) as refused:
        _check(run, 8, limit=used.total - 1)
    message = str(refused.value)
    assert "learner.micro_batch_size" in message and "halve" in message
    assert f"{used.total / (1 << 30):.1f} GiB a chip" in message
    assert refused.value.exit_code == 2


def test_more_rows_need_more_temporaries(run):
    small, large = _check(run, 8, limit=1 << 40), _check(run, 16, limit=1 << 40)
    assert large.temp > small.temp and large.total > small.total


def test_no_known_limit_compiles_nothing(run):
    assert _check(run, 8, limit=None) is None


def test_the_trainer_refuses_an_update_that_does_not_fit_before_collecting(tmp_path, monkeypatch):
    """On an accelerator of 8 MiB: the tiny model's train state and KV cache fit (the resident
    check passes), one micro-batch's update (tens of MiB of logits and activations) does not."""
    config = _config(8)
    config.rollout.group_size, config.rollout.prompts_per_step = 2, 1
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(memory_fit, "device_memory", lambda: 8 << 20)
    monkeypatch.setattr(trainer._Run, "train", lambda self, start: pytest.fail("collected"))
    with pytest.raises(ConfigError, match=r"learner.micro_batch_size: one micro-batch's update "
                       r"\(8 rows x 128 tokens"):
        trainer.train(config, str(tmp_path))
