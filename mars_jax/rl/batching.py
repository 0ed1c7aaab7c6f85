"""Finished samples -> a padded (optionally packed), micro-batched `TrainBatch` with bucketed
shapes: lengths and micro-batch counts round up to powers of two, so the update recompiles only when
a bucket changes. Padding rows and samples left out of the loss have an all-zero loss mask and add
nothing to the loss or its normalisation.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mars_jax.buckets import pow2_at_least
from mars_jax.types import TrainBatch


@dataclasses.dataclass(frozen=True)
class TrainSample:
    """One response to train on. `in_loss=False` keeps the row in the batch with a zero loss mask.
    `expert_ids [L_moe, len(prompt) + len(response), k]` optional (routing replay)."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    sampler_logprobs: Sequence[float]
    advantage: float
    expert_ids: np.ndarray | None = None
    in_loss: bool = True


def make_batch(samples: Sequence[TrainSample], *, micro_batch_size: int, min_length: int = 32,
               min_micro: int = 1, max_length: int | None = None, by_length: bool = False,
               pack: bool = False) -> TrainBatch:
    """Right-padded `[prompt, response]` rows in micro-batches of `micro_batch_size`, in the
    samples' order, or longest first with `by_length` (so the update can cut a micro-batch
    short). With `pack`, rows hold several samples each (first fit; `segments` numbers them) and
    advantages are per token: the same loss and gradient from fewer rows."""
    if not samples:
        raise ValueError("make_batch: no samples")
    if pack and not all(s.prompt_ids for s in samples):
        raise ValueError("make_batch: a packed sample needs a prompt (its first token is "
                         "predicted from the row's previous sample)")
    if by_length or pack:
        samples = sorted(samples, key=lambda s: -(len(s.prompt_ids) + len(s.response_ids)))
    sizes = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    if max_length is not None and max(sizes) > max_length:
        raise ValueError(f"make_batch: a sample of {max(sizes)} tokens exceeds max_length {max_length}")
    length = pow2_at_least(max(sizes), min_length)
    places = _first_fit(sizes, length) if pack else [(i, 0) for i in range(len(samples))]
    num_rows = 1 + max(row for row, _ in places)
    num_micro = pow2_at_least(-(-num_rows // micro_batch_size), min_micro)
    rows = num_micro * micro_batch_size
    tokens = np.zeros((rows, length), np.int32)
    attention = np.zeros((rows, length), np.int32)
    loss_mask = np.zeros((rows, length), np.float32)
    logprobs = np.zeros((rows, length), np.float32)
    advantages = np.zeros((rows, length) if pack else (rows,), np.float32)
    segments = np.zeros((rows, length), np.int32)
    samples_in_row = np.zeros(rows, np.int32)
    with_experts = _all_or_none(samples, "expert_ids")
    experts = None
    if with_experts:
        layers, _, k = samples[0].expert_ids.shape
        experts = np.zeros((layers, rows, length, k), np.int32)
    for i, (s, (row, start)) in enumerate(zip(samples, places)):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if len(s.sampler_logprobs) != r:
            raise ValueError(f"sample {i}: {len(s.sampler_logprobs)} logprobs for {r} tokens")
        end = start + p + r
        tokens[row, start:end] = list(s.prompt_ids) + list(s.response_ids)
        attention[row, start:end] = 1
        samples_in_row[row] += 1
        segments[row, start:end] = samples_in_row[row]
        loss_mask[row, start + p:end] = float(s.in_loss)
        logprobs[row, start + p:end] = s.sampler_logprobs
        if pack:
            advantages[row, start:end] = s.advantage
        else:
            advantages[row] = s.advantage
        if with_experts:
            n = min(s.expert_ids.shape[1], p + r)
            experts[:, row, start:start + n] = s.expert_ids[:, :n]
    split = lambda x: x.reshape(num_micro, micro_batch_size, *x.shape[1:])
    return TrainBatch(
        tokens=split(tokens), attention_mask=split(attention), loss_mask=split(loss_mask),
        advantages=split(advantages), sampler_logprobs=split(logprobs),
        expert_ids=None if experts is None else
        experts.reshape(experts.shape[0], num_micro, micro_batch_size, length, -1).swapaxes(0, 1),
        segments=split(segments) if pack else None)


def _first_fit(sizes: Sequence[int], length: int) -> list[tuple[int, int]]:
    """(row, start column) of each item of `sizes` in rows of `length`: the first row with room."""
    free = np.full(len(sizes), length)
    places = []
    for size in sizes:
        row = int(np.argmax(free >= size))
        places.append((row, length - int(free[row])))
        free[row] -= size
    return places


def _all_or_none(samples: Sequence[TrainSample], field: str) -> bool:
    """Whether every sample has `field` (True) or none has (False); a mix is an error."""
    missing = [i for i, s in enumerate(samples) if getattr(s, field) is None]
    if missing and len(missing) < len(samples):
        raise ValueError(f"make_batch: samples {missing[:8]} have no {field} while others do "
                         f"({len(missing)} of {len(samples)}); every sample of a batch needs it")
    return not missing


def empty_batch(*, micro_batch_size: int, length: int,
                experts: tuple[int, int] | None = None, pack: bool = False) -> TrainBatch:
    """One micro-batch of padding rows (every mask zero), laid out as `make_batch` lays out the
    others: what a host without samples contributes to a multi-host update."""
    zeros = lambda dtype, *shape: np.zeros((1, micro_batch_size, *shape), dtype)
    expert_ids = None
    if experts is not None:
        layers, k = experts
        expert_ids = np.zeros((1, layers, micro_batch_size, length, k), np.int32)
    return TrainBatch(tokens=zeros(np.int32, length), attention_mask=zeros(np.int32, length),
                      loss_mask=zeros(np.float32, length),
                      advantages=zeros(np.float32, length) if pack else zeros(np.float32),
                      sampler_logprobs=zeros(np.float32, length), expert_ids=expert_ids,
                      segments=zeros(np.int32, length) if pack else None)
