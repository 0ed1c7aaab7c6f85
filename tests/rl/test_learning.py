"""The sampler + GRPO update learn a toy verifiable task on the tiny model (seeded, CPU)."""
import numpy as np
import pytest
from flax import nnx

from mars_jax.models import create_model, get_preset
from mars_jax.rl.advantages import group_advantages_np
from mars_jax.rl.batching import TrainSample, make_batch
from mars_jax.rl.learner import LearnerConfig, ppo_update
from mars_jax.rl.losses import LossConfig
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import UpdateConfig, init_train_state
from mars_jax.sampling import generate

TARGET = np.zeros(512, bool)
TARGET[100:200] = True  # reward 1 iff the first response token is one of these 100 ids
PROBLEMS, GROUP = 8, 8


@pytest.mark.parametrize("epochs,mini_batches", [(1, 1), (2, 2)])
def test_solver_reward_rises_from_chance_to_08(epochs, mini_batches):
    model = create_model(get_preset("tiny"), seed=0)
    graphdef, _ = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(1e-2, max_grad_norm=1.0)
    state = init_train_state(model, optimizer)
    rng = np.random.default_rng(0)
    history = []
    for step in range(100):
        prompts = [list(rng.integers(0, 512, 6)) for _ in range(PROBLEMS)]
        batch_prompts = [p for p in prompts for _ in range(GROUP)]
        result = generate(nnx.merge(graphdef, state.params), batch_prompts, max_new_tokens=2,
                          temperature=1.0, seed=step)
        rewards = np.array([float(TARGET[tokens[0]]) for tokens in result.tokens])
        history.append(rewards.mean())
        if len(history) >= 5 and np.mean(history[-5:]) >= 0.8:
            break
        groups = np.repeat(np.arange(PROBLEMS), GROUP)
        advantages = group_advantages_np(rewards, groups).advantages
        samples = [TrainSample(p, t, lp, a) for p, t, lp, a in
                   zip(batch_prompts, result.tokens, result.logprobs, advantages)]
        state, updates = ppo_update(
            state, samples, build_batch=lambda ss: make_batch(ss, micro_batch_size=32),
            ref_params=None, graphdef=graphdef, optimizer=optimizer,
            update_config=UpdateConfig(loss=LossConfig(aggregation="token-mean")),
            learner=LearnerConfig(ppo_epochs=epochs, mini_batches=mini_batches),
            rng=np.random.default_rng(step))
        # The sampler and the trainer agree on the log-probabilities of the sampled tokens.
        assert updates[0]["sampler_logprob_diff"] < 1e-5
    assert history[0] <= 0.3
    assert np.mean(history[-5:]) >= 0.8, history
