"""What a complete group contributes to an update: the one rule that both the scheduler's count
(when an update is due, `rl.streaming`) and the update's batch (`training_samples`) follow, so
the two never disagree."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mars_jax.rl.advantages import group_advantages_np
from mars_jax.rl.batching import TrainSample
from mars_jax.rl.rollout import Rollout
from mars_jax.types import ROLES


@dataclasses.dataclass(frozen=True)
class SampleRules:
    """`roles`: the roles whose groups are trained. `drop_zero_variance`: a group with equal
    rewards trains nothing (else it stays, masked). `mask_truncated`: an output that ended by
    length leaves the batch (DAPO's overlong filtering) after taking part in its group's
    advantages."""

    roles: tuple[str, ...] = ROLES
    drop_zero_variance: bool = True
    mask_truncated: bool = False

    def trained(self, group: Sequence[Rollout]) -> list[tuple[int, bool]]:
        """(index in `group`, in the loss) of each member of a complete group that is trained."""
        if not group or group[0].role not in self.roles:
            return []
        zero_variance = len({r.reward for r in group}) == 1
        if self.drop_zero_variance and zero_variance:
            return []
        return [(i, not zero_variance) for i, r in enumerate(group)
                if not (self.mask_truncated and r.finish_reason == "length")]


def training_samples(groups: Sequence[list[Rollout]], *, rules: SampleRules,
                     normalize_std: bool) -> list[TrainSample]:
    """The `TrainSample`s of complete `groups` by `rules`, with GRPO advantages per group."""
    if not groups:
        return []
    members = [r for g in groups for r in g]
    ids = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
    advantages = group_advantages_np(np.array([r.reward for r in members], np.float32), ids,
                                     normalize_std=normalize_std).advantages
    samples, start = [], 0
    for group in groups:
        for i, in_loss in rules.trained(group):
            r = group[i]
            samples.append(TrainSample(r.prompt_ids, r.response_ids, r.logprobs,
                                       float(advantages[start + i]), r.expert_ids,
                                       in_loss=in_loss))
        start += len(group)
    return samples
