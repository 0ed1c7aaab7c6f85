"""Roofline cost model of a MarsRL step's programs on a mesh of accelerators.

decode step   max(bytes / (chips x HBM bandwidth), FLOPs / (chips x peak)) + a fixed per-step
              overhead. Bytes: the weights one step reads (attention, norms, routers and the
              output head in full; of the experts only those some live row routes to: per MoE
              layer E (1 - (1 - k/E)^rows) of them in expectation, routing taken as uniform) plus
              the KV cache of every live row's context (`engine.kv_bytes_per_token` per token).
              FLOPs: 2 x matmul parameters active per token x rows, plus attention
              4 x layers x heads x head_dim per context token.
prefill       FLOPs / (chips x peak x prefill MFU): 2 x active matmul parameters per token plus
              causal attention over the prompt.
update        FLOPs / (chips x peak x update MFU) per trained sample: forward (1) + backward (2)
              + per-layer remat forward (1) + the pi_old forward at the start of the step (1) =
              5 forwards of the sample's prompt + response.
weight copy   bf16 weights / (sending chips x link rate per direction).
offload       bytes per chip / the chip's host link rate per direction (`Chip.host_bandwidth`).

The cost of every program is spread evenly over the mesh's chips (an expert- / tensor-parallel
decode that reads each weight once per step across the mesh; the batch split evenly).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from mars_jax.models.config import Qwen3Config
from mars_jax.sampling.engine import kv_bytes_per_token

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: dense bf16 peak, HBM bandwidth and capacity, chip-to-chip link rate and
    host link rate, each per direction."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    link_bandwidth: float
    host_bandwidth: float


# Sources: NVIDIA H200 datasheet (989 TFLOP/s dense BF16 = 1,979 with sparsity; 141 GB HBM3e at
# 4.8 TB/s; NVLink 4 900 GB/s bidirectional = 450 GB/s per direction; PCIe Gen5 128 GB/s
# bidirectional = 64 GB/s per direction to the host); Google Cloud "TPU v5p" page (459 TFLOP/s
# bf16, 95 GB HBM2e at 2,765 GB/s, ICI 1,200 GB/s bidirectional per chip). The v5p host link
# is not published: taken as PCIe Gen4 x16, 32 GB/s per direction (an assumption).
CHIPS = {
    "h200": Chip("H200", 989e12, 4.8e12, 141 * GB, 450 * GB, 64 * GB),
    "v5p": Chip("TPU v5p", 459e12, 2.765e12, 95 * GB, 600 * GB, 32 * GB),
}


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Per-token weights, FLOPs and KV bytes of a Qwen3 (MoE) configuration."""

    dense_params: int        # read every step: attention, norms, routers, output head
    expert_params: int       # one expert of one layer
    moe_layers: int
    num_experts: int
    experts_per_token: int
    active_matmul_params: int  # matmul parameters one token uses (embedding lookup excluded)
    total_params: int
    attention_width: int     # layers x q heads x head_dim
    kv_bytes_per_token: int
    param_bytes: int         # bytes per parameter (bf16: 2)

    @classmethod
    def of(cls, cfg: Qwen3Config) -> "ModelCost":
        h, layers = cfg.hidden_size, cfg.num_hidden_layers
        attn = (h * cfg.num_attention_heads * cfg.head_dim * 2
                + h * cfg.num_key_value_heads * cfg.head_dim * 2 + 2 * cfg.head_dim + 2 * h)
        embed = cfg.vocab_size * h
        head = 0 if cfg.tie_word_embeddings else embed
        if cfg.num_experts:
            expert = 3 * h * cfg.moe_intermediate_size
            router = h * cfg.num_experts
            dense_per_layer, moe_layers = attn + router, layers
            active_ffn = cfg.num_experts_per_tok * expert
        else:
            expert, moe_layers = 0, 0
            dense_per_layer = attn + 3 * h * cfg.intermediate_size
            active_ffn = 0
        dense = layers * dense_per_layer + (embed if head == 0 else head) + h
        total = layers * dense_per_layer + moe_layers * cfg.num_experts * expert + embed + head + h
        active = layers * (dense_per_layer + active_ffn) + (head or embed)
        return cls(dense_params=dense, expert_params=expert, moe_layers=moe_layers,
                   num_experts=cfg.num_experts or 0,
                   experts_per_token=cfg.num_experts_per_tok or 0,
                   active_matmul_params=active, total_params=total,
                   attention_width=layers * cfg.num_attention_heads * cfg.head_dim,
                   kv_bytes_per_token=kv_bytes_per_token(cfg),
                   param_bytes=2)

    def experts_touched(self, rows: int) -> float:
        """Expected distinct experts per MoE layer that `rows` tokens route to (uniform
        routing, k distinct experts per token)."""
        if not self.num_experts or rows <= 0:
            return 0.0
        return self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** rows)

    def decode_step_bytes(self, rows: int, context_tokens: int) -> float:
        """HBM bytes read by one decode step of `rows` live rows whose contexts add up to
        `context_tokens` (summed over the rows)."""
        weights = self.dense_params + self.moe_layers * self.experts_touched(rows) * self.expert_params
        return weights * self.param_bytes + context_tokens * self.kv_bytes_per_token

    def decode_step_flops(self, rows: int, context_tokens: int) -> float:
        return 2.0 * self.active_matmul_params * rows + 4.0 * self.attention_width * context_tokens

    def forward_flops(self, tokens: int, context_before: int = 0) -> float:
        """FLOPs of a forward over `tokens` new positions after `context_before` cached ones
        (causal attention: position i sees context_before + i + 1 positions)."""
        attended = tokens * context_before + tokens * (tokens + 1) / 2
        return 2.0 * self.active_matmul_params * tokens + 4.0 * self.attention_width * attended

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.param_bytes


@dataclasses.dataclass(frozen=True)
class MeshCost:
    """A program's seconds on `chips` accelerators of one kind."""

    model: ModelCost
    chip: Chip
    chips: int
    step_overhead_s: float = 0.0   # fixed per decode step (kernel launches, collectives)
    prefill_mfu: float = 0.5
    update_mfu: float = 0.3
    update_forwards: float = 5.0    # fwd + bwd (2) + remat fwd + pi_old fwd

    def decode_step_seconds(self, rows: int, context_tokens: int) -> float:
        memory = self.model.decode_step_bytes(rows, context_tokens) / (
            self.chips * self.chip.hbm_bandwidth)
        compute = self.model.decode_step_flops(rows, context_tokens) / (
            self.chips * self.chip.peak_flops)
        return max(memory, compute) + self.step_overhead_s

    def decode_seconds(self, rows: int, context_tokens: int, steps: int, *,
                       bucket: int | None = None, span: int | None = None) -> float:
        """`steps` consecutive decode steps of `rows` rows starting at `context_tokens` (each
        step adds one token per row): the step times summed exactly (the memory and compute
        terms are linear in the step index; their max is split where they cross). The roofline
        charges live rows and their contexts: `bucket` and `span` are not read."""
        del bucket, span
        if steps <= 0 or rows <= 0:
            return 0.0
        model, n = self.model, self.chips
        w = model.dense_params + model.moe_layers * model.experts_touched(rows) * model.expert_params
        # memory(i) = a_m + b_m i, compute(i) = a_c + b_c i for step i = 0..steps-1
        a_m = (w * model.param_bytes + context_tokens * model.kv_bytes_per_token) / (
            n * self.chip.hbm_bandwidth)
        b_m = rows * model.kv_bytes_per_token / (n * self.chip.hbm_bandwidth)
        a_c = model.decode_step_flops(rows, context_tokens) / (n * self.chip.peak_flops)
        b_c = 4.0 * model.attention_width * rows / (n * self.chip.peak_flops)
        line_sum = lambda a, b, lo, hi: (hi - lo) * a + b * (hi - lo) * (lo + hi - 1) / 2
        if b_m == b_c:
            cross = steps if a_c > a_m else 0
        else:
            cross = min(max(math.ceil((a_c - a_m) / (b_m - b_c)), 0), steps) if b_m > b_c \
                else min(max(math.floor((a_m - a_c) / (b_c - b_m)) + 1, 0), steps)
        if b_m >= b_c:   # compute first (if at all), memory from `cross` on
            total = line_sum(a_c, b_c, 0, cross) + line_sum(a_m, b_m, cross, steps)
        else:            # memory first, compute from `cross` on
            total = line_sum(a_m, b_m, 0, cross) + line_sum(a_c, b_c, cross, steps)
        return total + steps * self.step_overhead_s

    def prefill_seconds(self, tokens: int, context_before: int = 0) -> float:
        return self.model.forward_flops(tokens, context_before) / (
            self.chips * self.chip.peak_flops * self.prefill_mfu)

    def update_seconds(self, sample_tokens: int) -> float:
        """One trained sample of `sample_tokens` (prompt + response) tokens."""
        return self.update_forwards * self.model.forward_flops(sample_tokens) / (
            self.chips * self.chip.peak_flops * self.update_mfu)

    def weight_copy_seconds(self, receiving_chips: int) -> float:
        """The bf16 weights from this mesh to another of `receiving_chips` chips: the slower of
        sending (this mesh's links) and receiving (theirs), one direction."""
        links = min(self.chips, receiving_chips)
        return self.model.weight_bytes / (links * self.chip.link_bandwidth)

    def host_copy_seconds(self, total_bytes: float) -> float:
        """`total_bytes` spread evenly over the chips, each chip's share over its host link
        (one direction)."""
        return total_bytes / (self.chips * self.chip.host_bandwidth)


def kv_capacity(model: ModelCost, free_bytes: float, positions: int = 1) -> int:
    """Whole KV caches of `positions` positions (a reserved slot; 1: single positions, a paged
    cache's unit) that `free_bytes` hold."""
    return max(0, int(free_bytes // (model.kv_bytes_per_token * positions)))


@dataclasses.dataclass(frozen=True)
class ProfileCost:
    """Measured costs of one machine (the calibration path): decode-step seconds on a grid of
    row counts x KV spans (`step_seconds[i][j]` at `step_rows[i]` rows and `step_spans[j]`
    positions; no spans: one column, the span not modelled), interpolated linearly in log2 of
    both and flat beyond the ends (no span given: the longest span measured); prefill seconds
    per token and update seconds per trained token (of a row that long, with `update_lengths`).
    With `engine_buckets` a step is charged at the slot bucket and span the real `Engine`
    decodes (as `SimEngine` reports them), else at the live rows."""

    step_rows: tuple[int, ...]
    step_seconds: tuple
    prefill_per_token_s: float
    update_per_token_s: float
    update_per_sample_s: float = 0.0
    step_spans: tuple[int, ...] = ()
    engine_buckets: bool = False
    # Update seconds per token measured at these row lengths (interpolated in log2 of the
    # length, flat beyond the ends); () : update_per_token_s at every length.
    update_lengths: tuple[int, ...] = ()
    update_per_token_by_length: tuple[float, ...] = ()

    def decode_step_seconds(self, rows: int, context_tokens: int = 0, *,
                            bucket: int | None = None, span: int | None = None) -> float:
        del context_tokens
        rows = bucket if self.engine_buckets and bucket else rows
        grid = np.asarray(self.step_seconds, float).reshape(len(self.step_rows), -1)
        log_rows = np.log2(self.step_rows)
        by_span = [np.interp(np.log2(rows), log_rows, column) for column in grid.T]
        if not self.step_spans or span is None:
            return float(by_span[-1])
        return float(np.interp(np.log2(span), np.log2(self.step_spans), by_span))

    def decode_seconds(self, rows: int, context_tokens: int, steps: int, *,
                       bucket: int | None = None, span: int | None = None) -> float:
        if steps <= 0 or rows <= 0:
            return 0.0
        return steps * self.decode_step_seconds(rows, bucket=bucket, span=span)

    def prefill_seconds(self, tokens: int, context_before: int = 0) -> float:
        del context_before
        return tokens * self.prefill_per_token_s

    def update_seconds(self, sample_tokens: int) -> float:
        per_token = self.update_per_token_s if not self.update_lengths else float(np.interp(
            np.log2(sample_tokens), np.log2(self.update_lengths), self.update_per_token_by_length))
        return self.update_per_sample_s + sample_tokens * per_token

    def weight_copy_seconds(self, receiving_chips: int) -> float:
        del receiving_chips
        return 0.0
