"""Group-normalised advantages on a hand-computed batch."""

import numpy as np
import pytest

from mars_jax.rl.advantages import group_advantages_np

S3 = np.sqrt(3.0)
# (problem, role, parent) key, reward, expected advantage with std, without std (Dr.GRPO).
# Groups are interleaved so grouping must follow keys, not positions.
ROWS = [
    # group A ("p1", "solver", None): [1, 0, 0, 1] -> mean .5, std .5 -> [1, -1, -1, 1]
    (("p1", "solver", None), 1.0, 1.0, 0.5),
    # group B ("p1", "verifier", 0): [1, 1, 1, 0] -> mean .75, std sqrt(3)/4
    #   -> [1/sqrt(3), 1/sqrt(3), 1/sqrt(3), -sqrt(3)]
    (("p1", "verifier", 0), 1.0, 1 / S3, 0.25),
    (("p1", "solver", None), 0.0, -1.0, -0.5),
    # group C ("p1", "verifier", 1), same role, other parent: [1, 1] -> zero variance -> 0
    (("p1", "verifier", 1), 1.0, 0.0, 0.0),
    (("p1", "verifier", 0), 1.0, 1 / S3, 0.25),
    (("p1", "solver", None), 0.0, -1.0, -0.5),
    # group D ("p2", "solver", None), other problem: [0, 0, 0] -> zero variance
    (("p2", "solver", None), 0.0, 0.0, 0.0),
    (("p1", "verifier", 0), 1.0, 1 / S3, 0.25),
    (("p1", "verifier", 1), 1.0, 0.0, 0.0),
    # group E ("p2", "corrector", 3): [0, 1] -> mean .5, std .5 -> [-1, 1]
    (("p2", "corrector", 3), 0.0, -1.0, -0.5),
    (("p1", "solver", None), 1.0, 1.0, 0.5),
    (("p2", "solver", None), 0.0, 0.0, 0.0),
    (("p1", "verifier", 0), 0.0, -S3, -0.75),
    (("p2", "corrector", 3), 1.0, 1.0, 0.5),
    # group F: singleton -> zero variance
    (("p3", "solver", None), 1.0, 0.0, 0.0),
    (("p2", "solver", None), 0.0, 0.0, 0.0),
]
KEYS = [r[0] for r in ROWS]
GROUP_IDS = np.array([list(dict.fromkeys(KEYS)).index(k) for k in KEYS])
REWARDS = np.array([r[1] for r in ROWS])
EXPECTED = {True: np.array([r[2] for r in ROWS]), False: np.array([r[3] for r in ROWS])}
ZERO_VAR_GROUPS = {("p1", "verifier", 1), ("p2", "solver", None), ("p3", "solver", None)}
EXPECTED_ZERO_VAR = np.array([k in ZERO_VAR_GROUPS for k in KEYS])


@pytest.mark.parametrize("normalize_std", [True, False])
def test_numpy_advantages_by_hand(normalize_std):
    out = group_advantages_np(REWARDS, GROUP_IDS, normalize_std=normalize_std, eps=0.0)
    np.testing.assert_allclose(out.advantages, EXPECTED[normalize_std], atol=1e-12)
    np.testing.assert_array_equal(out.zero_variance, EXPECTED_ZERO_VAR)


def test_numpy_advantages_arbitrary_ids_and_eps():
    ids = GROUP_IDS.astype(np.int64) * 7 - 3  # non-dense ids are fine on host
    out = group_advantages_np(REWARDS, ids, eps=1e-6)
    np.testing.assert_allclose(out.advantages, EXPECTED[True], rtol=1e-5)
    nonzero = ~EXPECTED_ZERO_VAR
    assert np.all(np.abs(out.advantages[nonzero]) < np.abs(EXPECTED[True][nonzero]))  # eps shrinks


def test_zero_variance_is_exact_for_non_binary_rewards():
    rewards = np.array([0.1, 0.1, 0.1, 0.7, 0.2])
    ids = np.array([0, 0, 0, 1, 1])
    out = group_advantages_np(rewards, ids)
    np.testing.assert_array_equal(out.zero_variance, [True, True, True, False, False])
    np.testing.assert_array_equal(out.advantages[:3], 0.0)
    np.testing.assert_allclose(out.advantages[3:], [1.0, -1.0], atol=1e-5)
