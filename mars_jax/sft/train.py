"""Supervised fine-tuning on generated role traces: the warm start of toy MarsRL.

Examples (`traces.make_examples` over `arith` train problems) are packed whole into fixed
`[rows, row_tokens]` batches. Each example is a segment that attends only to itself (block-diagonal
causal visibility; positions restart at 0), so no compute goes to padding and the step compiles
once. The loss is next-token cross-entropy on the reply tokens (reply + `<|im_end|>`), averaged
over them; per-role sums are kept so that held-out losses can be reported per role.
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
from mars_jax.models.qwen3 import Qwen3
from mars_jax.sft.traces import Example, make_examples

ROLES = ("solver", "verifier", "corrector")


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
    positions: np.ndarray  # [R, T] int32
    roles: np.ndarray      # [R, T] int32


def encode(tokenizer, example: Example) -> Encoded:
    """The chat prompt (generation prompt, thinking off) and the reply closed by `<|im_end|>`."""
    prompt = encode_chat(tokenizer, example.messages, enable_thinking=False)
    reply = tokenizer.encode(example.response + IM_END, add_special_tokens=False)
    return Encoded(prompt, reply, example.role)


def encoded_examples(problems: Iterable[dict], tokenizer, rng: random.Random, *,
                     solver_error_rate: float, verifier_flawed_rate: float,
                     keep: Mapping[str, float] | None = None) -> Iterator[Encoded]:
    """The encoded examples of each problem in turn (see `traces.make_examples`); an example of
    role r is kept with probability `keep[r]` (default 1: all)."""
    keep = keep or {}
    for problem in problems:
        for example in make_examples(problem["problem"], rng, solver_error_rate=solver_error_rate,
                                     verifier_flawed_rate=verifier_flawed_rate):
            rate = keep.get(example.role, 1.0)
            if rate >= 1.0 or rng.random() < rate:
                yield encode(tokenizer, example)


def example_stream(problems: Sequence[dict], tokenizer, *, seed: int, solver_error_rate: float,
                   verifier_flawed_rate: float, keep: Mapping[str, float] | None = None
                   ) -> Iterator[Encoded]:
    """Encoded examples of `problems`, visited in a new random order each pass, forever."""
    rng = random.Random(seed)
    order = list(range(len(problems)))
    while True:
        rng.shuffle(order)
        yield from encoded_examples((problems[i] for i in order), tokenizer, rng,
                                    solver_error_rate=solver_error_rate,
                                    verifier_flawed_rate=verifier_flawed_rate, keep=keep)


def pack(examples: Iterable[Encoded], *, rows: int, row_tokens: int) -> Iterator[PackedBatch]:
    """Fills rows in order, an example going to the next row when it does not fit; yields a batch
    every `rows` rows (a last, partly filled batch too). Raises if one example exceeds a row."""
    batch = _empty(rows, row_tokens)
    row = used = segment = 0
    for ex in examples:
        if len(ex) > row_tokens:
            raise ValueError(f"a {ex.role} example of {len(ex)} tokens exceeds row_tokens={row_tokens}")
        if used + len(ex) > row_tokens:
            row, used, segment = row + 1, 0, 0
            if row == rows:
                yield batch
                batch, row = _empty(rows, row_tokens), 0
        segment += 1
        end = used + len(ex)
        batch.tokens[row, used:end] = ex.prompt + ex.reply
        batch.segments[row, used:end] = segment
        batch.positions[row, used:end] = np.arange(len(ex))
        batch.roles[row, used + len(ex.prompt):end] = ROLES.index(ex.role) + 1
        used = end
    if used or row:
        yield batch


def _empty(rows: int, row_tokens: int) -> PackedBatch:
    return PackedBatch(*(np.zeros((rows, row_tokens), np.int32) for _ in range(4)))


def loss_terms(model: Qwen3, batch: PackedBatch) -> dict[str, jax.Array]:
    """Summed reply-token negative log-likelihood and token count, overall and per role."""
    tokens, segments = jnp.asarray(batch.tokens), jnp.asarray(batch.segments)
    hidden = model.forward(tokens, positions=jnp.asarray(batch.positions),
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


def _loss(params, graphdef: nnx.GraphDef, batch: PackedBatch):
    terms = loss_terms(nnx.merge(graphdef, params), batch)
    return terms["nll"] / jnp.maximum(terms["tokens"], 1.0), terms


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer"),
                   donate_argnames=("params", "opt_state"))
def sft_step(params, opt_state, batch: PackedBatch, *, graphdef: nnx.GraphDef,
             optimizer: optax.GradientTransformation):
    """One AdamW step on the mean reply-token loss; returns new params, opt state, metrics."""
    (loss, terms), grads = jax.value_and_grad(_loss, has_aux=True)(params, graphdef, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": terms["tokens"]}
    return optax.apply_updates(params, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef",))
def eval_terms(params, batch: PackedBatch, *, graphdef: nnx.GraphDef) -> dict[str, jax.Array]:
    return loss_terms(nnx.merge(graphdef, params), batch)


def heldout_loss(params, batches: Sequence[PackedBatch], graphdef: nnx.GraphDef) -> dict[str, float]:
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
