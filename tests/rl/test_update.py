"""The update's normalisation and PPO structure on the tiny model.

Gradient invariance is checked against the gradient of the whole batch's loss computed in one
piece (every row in one forward, `policy_loss` over the flat batch: no scan, no weight slicing).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax.models import create_model, get_preset
from mars_jax.rl.batching import TrainSample, make_batch
from mars_jax.rl.learner import LearnerConfig, mini_batch_indices, ppo_update
from mars_jax.rl.losses import LossConfig, policy_loss
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import (UpdateConfig, _length_branch, batch_gradients, cut_lengths,
                                init_train_state, policy_logprobs, token_logprobs)
from mars_jax.sampling import generate


@pytest.fixture(scope="module")
def tiny():
    model = create_model(get_preset("tiny"), seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    return model, graphdef, params


def _samples(n=5, seed=0):
    """Rows of different prompt and response lengths (one sample is out of the loss)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        p, r = int(rng.integers(2, 7)), int(rng.integers(1, 9))
        samples.append(TrainSample(list(rng.integers(1, 512, p)), list(rng.integers(1, 512, r)),
                                   list(-rng.uniform(3.0, 9.0, r)), float(rng.normal()),
                                   in_loss=i != 2))
    return samples


def _one_piece_grads(model, graphdef, params, samples, loss):
    """The whole batch's loss in one forward over every row (the independent reference)."""
    batch = make_batch(samples, micro_batch_size=len(samples))
    flat = jax.tree.map(lambda x: jnp.asarray(x)[0], batch)

    def f(p):
        m = nnx.merge(graphdef, p)
        logp, _ = token_logprobs(m, flat.tokens, flat.attention_mask, temperature=1.0, chunk=256)
        return policy_loss(logp, flat.sampler_logprobs, flat.advantages, flat.loss_mask, loss)[0]

    return jax.grad(f)(params)


# 5 samples: micro 1 -> 8 micro-batches (3 of padding), 3 -> 2 (one row of padding), 8 -> 1
# (three rows of padding; for the default aggregation only, one compile fewer for the others).
@pytest.mark.parametrize("aggregation, micros", [("seq-mean-token-mean", (1, 3, 8)),
                                                 ("token-mean", (1, 3)),
                                                 ("seq-mean-token-sum-norm", (1, 3))])
def test_gradient_does_not_depend_on_micro_batches_or_padding(tiny, aggregation, micros):
    model, graphdef, params = tiny
    loss = LossConfig(aggregation=aggregation, max_response_len=8)
    config = UpdateConfig(loss=loss)
    samples = _samples()
    want = _one_piece_grads(model, graphdef, params, samples, loss)
    grads_of = jax.jit(lambda p, b: batch_gradients(p, b, None, graphdef=graphdef,
                                                    config=config)[0])
    for micro in micros:
        batch = make_batch(samples, micro_batch_size=micro)
        assert batch.tokens.shape[0] == {1: 8, 3: 2, 8: 1}[micro]
        got = grads_of(params, batch)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            scale = float(jnp.max(jnp.abs(w)))
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=f"micro {micro}")


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean",
                                         "seq-mean-token-sum-norm"])
def test_packed_rows_give_the_one_piece_gradient(tiny, aggregation):
    """Eight samples packed several to a 32-token row (segments attend only to themselves,
    positions restart): the gradient of the unpacked, one-row-per-sample reference."""
    model, graphdef, params = tiny
    loss = LossConfig(aggregation=aggregation, max_response_len=8)
    samples = _samples(8, seed=3)
    want = _one_piece_grads(model, graphdef, params, samples, loss)
    batch = make_batch(samples, micro_batch_size=2, pack=True)
    assert batch.tokens.shape[-1] == 32 and int(np.asarray(batch.segments).max()) >= 3
    got = jax.jit(lambda p, b: batch_gradients(p, b, None, graphdef=graphdef,
                                               config=UpdateConfig(loss=loss))[0])(params, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_packed_pi_old_is_the_unpacked_one(tiny):
    """policy_logprobs of a packed batch, read back per sample, equal the unpacked batch's."""
    _, graphdef, params = tiny
    samples = _samples(8, seed=4)
    logprobs = lambda b: np.asarray(policy_logprobs(params, b, graphdef=graphdef,  # noqa: E731
                                                    config=UpdateConfig()))
    plain, packed = make_batch(samples, micro_batch_size=8), make_batch(samples, micro_batch_size=8,
                                                                        pack=True)
    got, want = logprobs(packed), logprobs(plain)
    np.testing.assert_allclose(np.sort(got[np.asarray(packed.loss_mask) > 0]),
                               np.sort(want[np.asarray(plain.loss_mask) > 0]), rtol=1e-5, atol=1e-6)


def test_cut_lengths_hand_checked():
    assert cut_lengths(1024, 2) == (256, 512, 1024)
    assert cut_lengths(1024, 2, fine=True) == (256, 384, 512, 768, 1024)
    assert cut_lengths(32, 2, fine=True) == (16, 24, 32)  # 8 and 12 are under 16
    assert cut_lengths(48, 3) == (24, 48)  # 48 / 4 = 12 and 48 / 8 = 6 are under 16


def test_fine_cuts_leave_the_gradient_unchanged(tiny):
    """Rows of 10-30 tokens in a 32-wide batch: micro-batches run at 16, 24 or 32 columns."""
    model, graphdef, params = tiny
    loss = LossConfig(aggregation="seq-mean-token-mean")
    rng = np.random.default_rng(1)
    samples = [TrainSample(list(rng.integers(1, 512, p)), list(rng.integers(1, 512, r)),
                           list(-rng.uniform(3.0, 9.0, r)), float(rng.normal()))
               for p, r in ((4, 6), (9, 10), (12, 18), (6, 9))]
    want = _one_piece_grads(model, graphdef, params, samples, loss)
    config = UpdateConfig(loss=loss, fine_cuts=True)
    batch = make_batch(samples, micro_batch_size=1, by_length=True)
    assert batch.tokens.shape[-1] == 32
    got = jax.jit(lambda p, b: batch_gradients(p, b, None, graphdef=graphdef,
                                               config=config)[0])(params, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_micro_batches_branch_on_their_length(tiny):
    """A micro-batch runs one branch of a conditional: zero (no loss tokens: out of the loss,
    or the padding micro-batches) or the forward/backward cut to the shortest length that holds
    its rows (16 or 32 of a 32-wide batch; the gradient test above checks the cut changes
    nothing)."""
    _, graphdef, params = tiny
    rows = [(4, 6, True), (9, 10, True), (3, 4, False), (2, 14, True), (10, 7, True)]
    samples = [TrainSample(list(range(1, p + 1)), list(range(1, r + 1)), [-1.0] * r, 1.0,
                           in_loss=in_loss) for p, r, in_loss in rows]
    batch = make_batch(samples, micro_batch_size=1)  # 8 micro-batches: 3 of padding
    cuts = cut_lengths(batch.tokens.shape[-1], UpdateConfig().length_halvings)
    assert cuts == (16, 32)
    branches = [int(_length_branch(jax.tree.map(lambda x: x[i], batch), cuts)) for i in range(8)]
    # By hand: 10 tokens fit 16 (branch 1), 19 need 32 (2), out of the loss (0), 16 fit 16 (1),
    # 17 need 32 (2), padding (0, 0, 0).
    assert branches == [1, 2, 0, 1, 2, 0, 0, 0]
    jaxpr = jax.make_jaxpr(lambda p, b: batch_gradients(p, b, None, graphdef=graphdef,
                                                        config=UpdateConfig())[0])(params, batch)
    assert "cond[" in str(jaxpr)


def test_rows_out_of_the_loss_change_nothing(tiny):
    """A sample with in_loss=False adds neither gradient nor denominator."""
    model, graphdef, params = tiny
    config = UpdateConfig(loss=LossConfig(aggregation="seq-mean-token-mean"))
    samples = _samples()
    kept = [s for i, s in enumerate(samples) if i != 2]
    grads_of = lambda ss: batch_gradients(params, make_batch(ss, micro_batch_size=2), None,  # noqa: E731
                                          graphdef=graphdef, config=config)[0]
    for g, w in zip(jax.tree.leaves(grads_of(samples)), jax.tree.leaves(grads_of(kept))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_mini_batch_indices_are_a_seeded_partition():
    parts = mini_batch_indices(10, 3, np.random.default_rng([0, 5]))
    assert [len(p) for p in parts] == [4, 3, 3]
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))
    again = mini_batch_indices(10, 3, np.random.default_rng([0, 5]))
    assert all((a == b).all() for a, b in zip(parts, again))
    assert [len(p) for p in mini_batch_indices(2, 4, np.random.default_rng(0))] == [1, 1, 0, 0]


def _on_policy_samples(model, seed=0, problems=4, group=8):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(0, 512, 6)) for _ in range(problems) for _ in range(group)]
    result = generate(model, prompts, max_new_tokens=4, temperature=1.0, seed=seed)
    rewards = np.array([float(t[0] % 2) for t in result.tokens])
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    return [TrainSample(p, t, lp, float(a))
            for p, t, lp, a in zip(prompts, result.tokens, result.logprobs, adv)]


@pytest.mark.parametrize("pi_old", ["sampler", "recompute"])
def test_ratio_is_one_on_the_first_update_and_the_clip_acts_after(pi_old):
    model = create_model(get_preset("tiny"), seed=1)
    graphdef, _ = nnx.split(model, nnx.Param)
    samples = _on_policy_samples(model)
    optimizer = make_optimizer(3e-2, max_grad_norm=0.0)
    state = init_train_state(model, optimizer)
    learner = LearnerConfig(ppo_epochs=2, mini_batches=2, pi_old=pi_old)
    state, history = ppo_update(
        state, samples, build_batch=lambda ss: make_batch(ss, micro_batch_size=8),
        ref_params=None, graphdef=graphdef, optimizer=optimizer,
        update_config=UpdateConfig(loss=LossConfig(aggregation="token-mean",
                                                   behaviour_weight_cap=2.0)), learner=learner,
        rng=np.random.default_rng(0))
    assert len(history) == 4 and int(state.step) == 4
    first = history[0]
    assert abs(first["ratio_mean"] - 1.0) < 1e-5
    assert first["clip_frac_low"] == 0.0 and first["clip_frac_high"] == 0.0
    later = history[1:]
    assert all(abs(m["ratio_mean"] - 1.0) > 1e-3 for m in later)
    assert max(m["clip_frac_low"] + m["clip_frac_high"] for m in later) > 0
    if pi_old == "recompute":  # sampler == recomputed pi_old here: behaviour weights are 1
        assert abs(first["behaviour_weight_mean"] - 1.0) < 1e-5


def test_the_cosine_schedule_decays_over_decay_steps_after_the_warmup():
    """With a constant gradient AdamW's step is the learning rate (bias-corrected m / sqrt(v) =
    1): linear warmup over 2 updates, then 1/2 (1 + cos(pi (t - 2) / 4)) to 0 at update 6."""
    optimizer = make_optimizer(1.0, schedule="cosine", warmup_steps=2, decay_steps=6, eps=0.0,
                               max_grad_norm=None)
    params = {"w": jnp.ones((2, 2))}
    opt_state, steps = optimizer.init(params), []
    for _ in range(8):
        updates, opt_state = optimizer.update({"w": jnp.ones((2, 2))}, opt_state, params)
        steps.append(-float(updates["w"][0, 0]))
    t = np.arange(2, 7)
    expected = [0.0, 0.5, *(0.5 * (1 + np.cos(np.pi * (t - 2) / 4))), 0.0]
    np.testing.assert_allclose(steps, expected, atol=1e-5)
