"""The policy interface every agent talks to: a batch of chat requests in, completions out, in one
`complete` call.

`RoutedPolicy` runs the Solver and the V-C agents on different models.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

from mars_jax.types import ROLES


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One chat to complete: `messages`, the asking agent's `role`, its `max_new_tokens`."""

    messages: tuple[dict[str, str], ...]
    role: str
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class Completion:
    """A policy's answer to one `ChatRequest`: `text` (thinking included, special tokens
    removed), `finish_reason` ('stop', 'length' or 'error'), `num_tokens` (0 where a server
    reports none); ids and log-probabilities from `SamplerPolicy` only; `thinking_open` when the
    prompt opened a `<think>` that `text` continues."""

    text: str
    finish_reason: str
    num_tokens: int
    prompt_ids: tuple[int, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    thinking_open: bool = False


class Policy(Protocol):
    """Anything that completes a batch of chat requests, in order."""

    def complete(self, requests: Sequence[ChatRequest]) -> list[Completion]:
        ...


class RoutedPolicy:
    """Sends each request to the policy registered for its role, keeping request order."""

    def __init__(self, default: Policy, by_role: Mapping[str, Policy]):
        unknown = set(by_role) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}; expected a subset of {ROLES}")
        self._default = default
        self._by_role = dict(by_role)

    def complete(self, requests: Sequence[ChatRequest]) -> list[Completion]:
        groups: dict[int, tuple[Policy, list[int]]] = {}
        for i, request in enumerate(requests):
            policy = self._by_role.get(request.role, self._default)
            groups.setdefault(id(policy), (policy, []))[1].append(i)
        merged: list[Completion | None] = [None] * len(requests)
        for policy, indices in groups.values():
            completions = policy.complete([requests[i] for i in indices])
            check_batch(indices, completions)
            for i, completion in zip(indices, completions):
                merged[i] = completion
        return merged  # type: ignore[return-value]  # every slot is filled above


def check_batch(requests: Sequence[object], completions: Sequence[Completion]) -> None:
    """Raises if a policy returned a different number of completions than requests."""
    if len(completions) != len(requests):
        raise RuntimeError(
            f"policy returned {len(completions)} completions for {len(requests)} requests")
