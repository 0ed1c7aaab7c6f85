"""make_batch / empty_batch layouts, training_samples and loss_config against hand-built
expectations."""
import numpy as np
import pytest

from experiments.configs import common
from mars_jax.rl.batching import TrainSample, empty_batch, make_batch
from mars_jax.rl.rollout import Rollout
from mars_jax.rl.config import loss_config
from mars_jax.rl.samples import SampleRules, training_samples


def test_make_batch_layout_by_hand():
    samples = [TrainSample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], 1.5),
               TrainSample([6], [7], [-0.7], -0.5, in_loss=False),
               TrainSample([8, 9, 10], [11, 12], [-1.1, -1.2], 0.25)]
    batch = make_batch(samples, micro_batch_size=2, min_length=8)
    # 3 samples in micro-batches of 2 -> 2 micro-batches (one padding row); length 5 -> 8.
    assert batch.tokens.shape == (2, 2, 8) and batch.advantages.shape == (2, 2)
    rows = lambda x: np.asarray(x).reshape(4, -1)  # noqa: E731
    np.testing.assert_array_equal(rows(batch.tokens), [
        [1, 2, 3, 4, 5, 0, 0, 0], [6, 7, 0, 0, 0, 0, 0, 0],
        [8, 9, 10, 11, 12, 0, 0, 0], [0] * 8])
    np.testing.assert_array_equal(rows(batch.attention_mask), [
        [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [0] * 8])
    np.testing.assert_array_equal(rows(batch.loss_mask), [  # row 1: out of the loss
        [0, 0, 1, 1, 1, 0, 0, 0], [0] * 8, [0, 0, 0, 1, 1, 0, 0, 0], [0] * 8])
    np.testing.assert_allclose(rows(batch.sampler_logprobs), [
        [0, 0, -0.1, -0.2, -0.3, 0, 0, 0], [0, -0.7, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, -1.1, -1.2, 0, 0, 0], [0] * 8], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(batch.advantages).ravel(), [1.5, -0.5, 0.25, 0.0])
    assert batch.expert_ids is None and batch.old_logprobs is None
    # At least 4 micro-batches: two more, all padding.
    padded = make_batch(samples, micro_batch_size=2, min_length=8, min_micro=4)
    assert padded.tokens.shape == (4, 2, 8)
    np.testing.assert_array_equal(np.asarray(padded.tokens)[:2], np.asarray(batch.tokens))
    assert not np.any(np.asarray(padded.attention_mask)[2:])


def test_packed_layout_by_hand():
    """Sizes 5, 2, 5, 3 into rows of 8, longest first, first fit: row 0 takes the first 5 and
    the 3, row 1 the second 5 and the 2."""
    samples = [TrainSample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], 1.5),
               TrainSample([6], [7], [-0.7], -0.5, in_loss=False),
               TrainSample([8, 9, 10], [11, 12], [-1.1, -1.2], 0.25),
               TrainSample([13, 14], [15], [-1.5], 2.0)]
    batch = make_batch(samples, micro_batch_size=1, min_length=8, pack=True, min_micro=2)
    assert batch.tokens.shape == (2, 1, 8) and batch.advantages.shape == (2, 1, 8)
    rows = lambda x: np.asarray(x).reshape(2, -1)  # noqa: E731
    np.testing.assert_array_equal(rows(batch.tokens), [[1, 2, 3, 4, 5, 13, 14, 15],
                                                       [8, 9, 10, 11, 12, 6, 7, 0]])
    np.testing.assert_array_equal(rows(batch.segments), [[1, 1, 1, 1, 1, 2, 2, 2],
                                                         [1, 1, 1, 1, 1, 2, 2, 0]])
    np.testing.assert_array_equal(rows(batch.loss_mask), [[0, 0, 1, 1, 1, 0, 0, 1],
                                                          [0, 0, 0, 1, 1, 0, 0, 0]])
    np.testing.assert_allclose(rows(batch.sampler_logprobs), [
        [0, 0, -0.1, -0.2, -0.3, 0, 0, -1.5], [0, 0, 0, -1.1, -1.2, 0, -0.7, 0]], rtol=1e-6)
    np.testing.assert_allclose(rows(batch.advantages), [
        [1.5] * 5 + [2.0] * 3, [0.25] * 5 + [-0.5] * 2 + [0.0]])
    with pytest.raises(ValueError, match="needs a prompt"):
        make_batch([TrainSample([], [1], [-1.0], 1.0)], micro_batch_size=1, pack=True)


def test_make_batch_routing_layout_and_a_mix_is_an_error():
    experts = lambda n, v: np.full((2, n, 1), v, np.int32)  # noqa: E731  [layers, tokens, k]
    samples = [TrainSample([1], [2, 3], [-1.0, -1.0], 1.0, experts(3, 7)),
               TrainSample([4, 5], [6], [-1.0], -1.0, experts(3, 9))]
    batch = make_batch(samples, micro_batch_size=1, min_length=4)
    assert batch.expert_ids.shape == (2, 2, 1, 4, 1)  # [M, layers, b, L, k]
    np.testing.assert_array_equal(batch.expert_ids[0, :, 0, :, 0], [[7, 7, 7, 0]] * 2)
    np.testing.assert_array_equal(batch.expert_ids[1, :, 0, :, 0], [[9, 9, 9, 0]] * 2)
    with pytest.raises(ValueError, match=r"samples \[1\] have no expert_ids"):
        make_batch([samples[0], TrainSample([1], [2], [-1.0], 1.0)], micro_batch_size=1)


def test_empty_batch_is_all_padding():
    batch = empty_batch(micro_batch_size=3, length=8, experts=(2, 4))
    assert batch.tokens.shape == (1, 3, 8) and batch.expert_ids.shape == (1, 2, 3, 8, 4)
    for x in (batch.tokens, batch.attention_mask, batch.loss_mask, batch.advantages,
              batch.sampler_logprobs, batch.expert_ids):
        assert not np.any(x)
    packed = empty_batch(micro_batch_size=3, length=8, pack=True)  # laid out as packed batches
    assert packed.advantages.shape == packed.segments.shape == (1, 3, 8)
    assert not np.any(packed.segments)


def _rollout(uid, reward, finish="stop"):
    return Rollout(uid=uid, problem_uid="p", stage=0, parent_uid=None, prompt_ids=[1],
                   response_ids=[2, 3], logprobs=[-0.5, -0.5], reward=reward,
                   finish_reason=finish)


def test_training_samples_advantages_zero_variance_and_truncation_by_hand():
    mixed = [_rollout("a", 1.0), _rollout("b", 0.0), _rollout("c", 0.0, "length"),
             _rollout("d", 1.0)]
    flat = [_rollout("e", 1.0), _rollout("f", 1.0)]
    # mixed: mean .5, std .5 -> advantages [1, -1, -1, 1]; flat: zero variance.
    got = training_samples([mixed, flat], rules=SampleRules(drop_zero_variance=True),
                           normalize_std=True)
    assert [round(s.advantage, 4) for s in got] == [1.0, -1.0, -1.0, 1.0]
    assert all(s.in_loss for s in got)
    kept = training_samples([mixed, flat], rules=SampleRules(drop_zero_variance=False),
                            normalize_std=False)
    assert [s.advantage for s in kept] == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]
    assert [s.in_loss for s in kept] == [True] * 4 + [False] * 2
    # Truncated outputs take part in their group's advantages, then leave the batch.
    masked = training_samples([mixed, flat], rules=SampleRules(mask_truncated=True),
                              normalize_std=True)
    assert [round(s.advantage, 4) for s in masked] == [1.0, -1.0, 1.0]
    # Groups of roles not trained add nothing (the rollouts here are Solver outputs).
    assert training_samples([mixed], rules=SampleRules(roles=("verifier",)),
                            normalize_std=True) == []


def test_loss_config_maps_zero_to_off_and_keeps_the_rest():
    config = common.base_config()
    config.loss.clip_c, config.loss.behaviour_weight_cap = 0.0, 0.0
    config.loss.aggregation, config.loss.max_response_len = "seq-mean-token-sum-norm", 512
    loss = loss_config(config)
    assert loss.clip_c is None and loss.behaviour_weight_cap is None
    assert loss.mastered_mask_prob is None and loss.target_entropy is None
    assert loss.max_response_len == 512 and loss.clip_high == config.loss.clip_high
    config.loss.clip_c, config.loss.behaviour_weight_cap = 3.0, 2.0
    assert loss_config(config).clip_c == 3.0 and loss_config(config).behaviour_weight_cap == 2.0


def test_by_length_orders_rows_longest_first():
    samples = [TrainSample([1], [2] * n, [-1.0] * n, float(n)) for n in (2, 5, 1, 3)]
    batch = make_batch(samples, micro_batch_size=2, by_length=True)
    np.testing.assert_array_equal(np.asarray(batch.attention_mask).sum(-1), [[6, 4], [3, 2]])
    np.testing.assert_array_equal(batch.advantages, [[5.0, 3.0], [2.0, 1.0]])
