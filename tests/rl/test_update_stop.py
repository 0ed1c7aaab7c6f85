"""An update stopped between two micro-batches (a preemption notice) hands back the state it
started from, bit for bit, although its updates donated that state; redone from it, the update
ends where the uninterrupted one ends. The update one program per micro-batch (what lets it stop
there) is the one-program `train_step`. Same shapes and settings as test_update's ratio test (its
compiled programs are reused)."""
import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax.models import create_model, get_preset
from mars_jax.rl.batching import make_batch
from mars_jax.rl.learner import LearnerConfig, UpdateStopped, ppo_update
from mars_jax.rl.losses import LossConfig
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import (UpdateConfig, apply_gradients, init_train_state,
                                micro_batch_gradients, train_step)
from tests.rl.test_update import _on_policy_samples

OPTIMIZER = make_optimizer(3e-2, max_grad_norm=0.0)


def _leaves(state) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(state)]


def _fresh_state(leaves, like):
    """A train state holding new arrays with the values `leaves` (the updates donate theirs)."""
    return jax.tree.unflatten(jax.tree.structure(like), [jax.numpy.array(x) for x in leaves])


@pytest.mark.parametrize("pi_old", ["sampler", "recompute"])
def test_a_stopped_update_returns_its_starting_state_and_redoing_it_ends_the_same(pi_old):
    model = create_model(get_preset("tiny"), seed=1)
    graphdef, _ = nnx.split(model, nnx.Param)
    samples = _on_policy_samples(model)
    template = init_train_state(model, OPTIMIZER)
    start = _leaves(template)

    def update(state, should_stop=None):
        return ppo_update(
            state, samples, build_batch=lambda ss: make_batch(ss, micro_batch_size=8),
            ref_params=None, graphdef=graphdef, optimizer=OPTIMIZER,
            update_config=UpdateConfig(loss=LossConfig(aggregation="token-mean",
                                                       behaviour_weight_cap=2.0)),
            learner=LearnerConfig(ppo_epochs=2, mini_batches=2, pi_old=pi_old),
            rng=np.random.default_rng(0), should_stop=should_stop)

    whole, history = update(_fresh_state(start, template))
    asked = []
    # 2 micro-batches an update: stopped in the second update, after its first micro-batch
    # (after two forwards of pi_old).
    stop_after = 3 + (2 if pi_old == "recompute" else 0)

    def should_stop():
        asked.append(True)
        return len(asked) > stop_after

    with pytest.raises(UpdateStopped) as stopped:
        update(_fresh_state(start, template), should_stop)
    assert len(asked) == stop_after + 1
    for a, b in zip(_leaves(stopped.value.state), start, strict=True):
        np.testing.assert_array_equal(a, b)
    redone, history_again = update(stopped.value.state)
    assert history_again == history
    for a, b in zip(_leaves(redone), _leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_update_by_micro_batch_programs_is_train_step():
    model = create_model(get_preset("tiny"), seed=1)
    graphdef, _ = nnx.split(model, nnx.Param)
    batch = jax.tree.map(jax.numpy.asarray,
                         make_batch(_on_policy_samples(model)[:16], micro_batch_size=8))
    assert batch.tokens.shape[0] == 2
    config = UpdateConfig(loss=LossConfig(aggregation="token-mean", behaviour_weight_cap=2.0))
    template = init_train_state(model, OPTIMIZER)
    start = _leaves(template)
    whole, expected = train_step(_fresh_state(start, template), batch, None, graphdef=graphdef,
                                 optimizer=OPTIMIZER, config=config)
    state = _fresh_state(start, template)
    grads, metrics = jax.tree.map(jax.numpy.zeros_like, state.params), []
    for index in range(2):
        grads, micro = micro_batch_gradients(grads, state.params, batch, np.int32(index), None,
                                             graphdef=graphdef, config=config)
        metrics.append(micro)
    by_micro, got = apply_gradients(state, grads, metrics, batch, optimizer=OPTIMIZER)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(float(got[key]), float(expected[key]), rtol=1e-5, atol=1e-7,
                                   err_msg=key)
    for a, b in zip(_leaves(by_micro), _leaves(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
