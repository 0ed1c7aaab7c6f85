"""An update stopped between mini-batches (a preemption notice) hands back the state it started
from, bit for bit, although its updates donated that state; redone from it, the update ends where
the uninterrupted one ends. Same shapes and settings as test_update's ratio test (its compiled
programs are reused)."""
import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax.models import create_model, get_preset
from mars_jax.rl.batching import make_batch
from mars_jax.rl.learner import LearnerConfig, UpdateStopped, ppo_update
from mars_jax.rl.losses import LossConfig
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import UpdateConfig, init_train_state
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
            update_config=UpdateConfig(loss=LossConfig(behaviour_weight_cap=2.0)),
            learner=LearnerConfig(ppo_epochs=2, mini_batches=2, pi_old=pi_old),
            rng=np.random.default_rng(0), should_stop=should_stop)

    whole, history = update(_fresh_state(start, template))
    asked = []
    stop_after = 2 + (2 if pi_old == "recompute" else 0)  # two updates (after two forwards)

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
