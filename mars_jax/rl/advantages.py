"""Group-normalised (GRPO / Dr.GRPO) advantages.

Within a group of samples sharing an integer id, `A = (r - mean) / (std + eps)` (population std), or
`A = r - mean` (Dr.GRPO); groups of equal rewards get `A = 0` exactly, flagged in `zero_variance`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class GroupAdvantages(NamedTuple):
    """Per-sample advantages ``[N]`` and the zero-variance-group flag ``[N]`` (bool)."""

    advantages: np.ndarray
    zero_variance: np.ndarray


def group_advantages_np(
    rewards: np.ndarray, group_ids: np.ndarray, *, normalize_std: bool = True, eps: float = 1e-6
) -> GroupAdvantages:
    """Host-side (numpy, float64) group-normalised advantages."""
    rewards = np.asarray(rewards, dtype=np.float64)
    _, inv = np.unique(np.asarray(group_ids), return_inverse=True)
    counts = np.bincount(inv)
    mean = np.bincount(inv, weights=rewards) / counts
    centered = rewards - mean[inv]
    gmax = np.full(len(counts), -np.inf)
    gmin = np.full(len(counts), np.inf)
    np.maximum.at(gmax, inv, rewards)
    np.minimum.at(gmin, inv, rewards)
    zero_var = (gmax == gmin)[inv]
    adv = centered
    if normalize_std:
        std = np.sqrt(np.bincount(inv, weights=centered**2) / counts)
        adv = centered / np.where(zero_var, 1.0, std[inv] + eps)
    return GroupAdvantages(np.where(zero_var, 0.0, adv), zero_var)
