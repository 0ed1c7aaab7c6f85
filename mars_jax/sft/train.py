"""Supervised fine-tuning on generated role traces: the warm start of toy MarsRL.

Examples are packed whole into fixed-shape batches, each attending only to itself, so the step
compiles once; the loss is cross-entropy on the reply tokens, with per-role sums for held-out
reporting.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mars_jax.data.tokenizer import IM_END, encode_chat
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.models.qwen3 import Qwen3, positions_from_segments
from mars_jax.sft.traces import Example, make_examples
from mars_jax.types import ROLES


@dataclasses.dataclass(frozen=True)
class Encoded:
    """An example as token ids: prompt, reply (ending with `<|im_end|>`) and role."""

    prompt: list[int]
    reply: list[int]
    role: str

    def __len__(self) -> int:
        return len(self.prompt) + len(self.reply)


class PackedBatch(NamedTuple):
    """Packed rows. `roles[r, t]` is 1 + the role index when token t is a reply token (a target),
    else 0; `segments` numbers the examples of a row from 1 (0 = padding)."""

    tokens: np.ndarray     # [R, T] int32
    segments: np.ndarray   # [R, T] int32
    roles: np.ndarray      # [R, T] int32


# A training batch: packed parts of different row lengths, trained on as one batch.
Batch = tuple[PackedBatch, ...]


def encode(tokenizer, example: Example) -> Encoded:
    """The chat prompt (generation prompt, thinking off) and the reply closed by `<|im_end|>`."""
    prompt = encode_chat(tokenizer, example.messages, enable_thinking=False)
    reply = tokenizer.encode(example.response + IM_END, add_special_tokens=False)
    return Encoded(prompt, reply, example.role)


def encoded_examples(problems: Iterable[dict], tokenizer, rng: random.Random, *,
                     solver_error_rate: float, verifier_flawed_rate: float,
                     keep: Mapping[str, float] | None = None,
                     style: str = "compact") -> Iterator[Encoded]:
    """The encoded examples of each problem in turn (see `traces.make_examples`; prompts in
    `style`); an example of role r is kept with probability `keep[r]` (default 1: all)."""
    keep = keep or {}
    for problem in problems:
        for example in make_examples(problem["problem"], rng, solver_error_rate=solver_error_rate,
                                     verifier_flawed_rate=verifier_flawed_rate, style=style):
            rate = keep.get(example.role, 1.0)
            if rate >= 1.0 or rng.random() < rate:
                yield encode(tokenizer, example)


def example_stream(problems: Sequence[dict], tokenizer, *, seed: int, solver_error_rate: float,
                   verifier_flawed_rate: float, keep: Mapping[str, float] | None = None,
                   style: str = "compact") -> Iterator[Encoded]:
    """Encoded examples of `problems`, visited in a new random order each pass, forever."""
    rng = random.Random(seed)
    order = list(range(len(problems)))
    while True:
        rng.shuffle(order)
        yield from encoded_examples((problems[i] for i in order), tokenizer, rng,
                                    solver_error_rate=solver_error_rate,
                                    verifier_flawed_rate=verifier_flawed_rate, keep=keep,
                                    style=style)


def pack(examples: Iterable[Encoded], *, rows: int, row_tokens: int, short_rows: int = 0,
         short_row_tokens: int = 0) -> Iterator[Batch]:
    """Packs examples in stream order into batches of one `[rows, row_tokens]` part, or with
    `short_rows` a short part first for short examples (attention costs a token its row's
    length); every batch holds consecutive examples. Raises if an example exceeds `row_tokens`."""
    if short_rows and not 0 < short_row_tokens < row_tokens:
        raise ValueError(f"short_row_tokens={short_row_tokens} must be positive and below "
                         f"row_tokens={row_tokens}")
    shapes = ([(short_rows, short_row_tokens)] if short_rows else []) + [(rows, row_tokens)]
    parts = [_Part(*shape) for shape in shapes]
    for ex in examples:
        if len(ex) > row_tokens:
            raise ValueError(f"a {ex.role} example of {len(ex)} tokens exceeds row_tokens={row_tokens}")
        if not _place(parts, ex):
            yield tuple(part.batch for part in parts)
            parts = [_Part(*shape) for shape in shapes]
            _place(parts, ex)  # a fresh part of row_tokens always has room
    if any(part.used or part.row for part in parts):
        yield tuple(part.batch for part in parts)


def _place(parts: list[_Part], ex: Encoded) -> bool:
    """Adds `ex` to the first part whose rows are long enough for it and that has room."""
    return any(part.add(ex) for part in parts if len(ex) <= part.row_tokens)


class _Part:
    """One part of a batch, filled row after row (see `pack`)."""

    def __init__(self, rows: int, row_tokens: int):
        self.rows, self.row_tokens = rows, row_tokens
        self.batch = PackedBatch(*(np.zeros((rows, row_tokens), np.int32) for _ in range(3)))
        self.row = self.used = self.segment = 0

    def add(self, ex: Encoded) -> bool:
        """Places `ex` in the current row, or else the next; False when neither is left."""
        if self.used + len(ex) > self.row_tokens:
            if self.row + 1 == self.rows:
                return False
            self.row, self.used, self.segment = self.row + 1, 0, 0
        b, row, start = self.batch, self.row, self.used
        self.segment += 1
        end = start + len(ex)
        b.tokens[row, start:end] = ex.prompt + ex.reply
        b.segments[row, start:end] = self.segment
        b.roles[row, start + len(ex.prompt):end] = ROLES.index(ex.role) + 1
        self.used = end
        return True


def loss_terms(model: Qwen3, batch: Batch) -> dict[str, jax.Array]:
    """Summed reply-token NLL and token count, overall and per role, over the batch's parts."""
    parts = [_part_terms(model, part) for part in batch]
    return {key: sum(terms[key] for terms in parts) for key in parts[0]}


def _part_terms(model: Qwen3, batch: PackedBatch) -> dict[str, jax.Array]:
    tokens, segments = jnp.asarray(batch.tokens), jnp.asarray(batch.segments)
    hidden = model.forward(tokens, positions=positions_from_segments(segments),
                           mask=AttentionMask.packed(segments)).hidden
    logp = jax.nn.log_softmax(model.logits(hidden[:, :-1]), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    roles = jnp.asarray(batch.roles)[:, 1:]
    terms = {"nll": jnp.sum(nll * (roles > 0)), "tokens": jnp.sum(roles > 0).astype(jnp.float32)}
    for i, role in enumerate(ROLES):
        mask = roles == i + 1
        terms[f"nll/{role}"] = jnp.sum(nll * mask)
        terms[f"tokens/{role}"] = jnp.sum(mask).astype(jnp.float32)
    return terms


def _loss(params, graphdef: nnx.GraphDef, batch: Batch):
    terms = loss_terms(nnx.merge(graphdef, params), batch)
    return terms["nll"] / jnp.maximum(terms["tokens"], 1.0), terms


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer"),
                   donate_argnames=("params", "opt_state"))
def sft_step(params, opt_state, batch: Batch, *, graphdef: nnx.GraphDef,
             optimizer: optax.GradientTransformation):
    """One AdamW step on the mean reply-token loss; returns new params, opt state, metrics."""
    (loss, terms), grads = jax.value_and_grad(_loss, has_aux=True)(params, graphdef, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": terms["tokens"]}
    return optax.apply_updates(params, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef",))
def eval_terms(params, batch: Batch, *, graphdef: nnx.GraphDef) -> dict[str, jax.Array]:
    return loss_terms(nnx.merge(graphdef, params), batch)


def heldout_loss(params, batches: Sequence[Batch], graphdef: nnx.GraphDef) -> dict[str, float]:
    """Mean reply-token loss over `batches`, overall (`loss`) and per role (`loss/<role>`)."""
    totals: dict[str, float] = {}
    for batch in batches:
        for key, value in eval_terms(params, batch, graphdef=graphdef).items():
            totals[key] = totals.get(key, 0.0) + float(value)
    out = {"loss": totals["nll"] / max(totals["tokens"], 1.0)}
    for role in ROLES:
        if totals[f"tokens/{role}"]:
            out[f"loss/{role}"] = totals[f"nll/{role}"] / totals[f"tokens/{role}"]
    return out
