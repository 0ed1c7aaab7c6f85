r"""XLA's cost of each compiled TPU program next to the analytic one, and the roofline they imply.

  python benchmarks/aot_costs.py                       # every benchmarks/results/aot/v5p-*.json
  python benchmarks/aot_costs.py benchmarks/results/aot/v5p-8x8x4.json

Reads the reports `experiments/aot_compile.py --json` writes and prints, per program and chip:
XLA's FLOPs and bytes accessed (`cost_analysis()`), the analytic FLOPs and bytes of the whole
program, the time each takes at the chip's peak (`CHIPS`) and the larger of the two (the
roofline), and for the update its projected MFU (model FLOPs over the roofline time of the
FLOPs it executes), for the decode the share of its HBM traffic that is KV cache and its tokens
per second per chip at the roofline.

XLA counts a loop body once (a `while` of n trips costs one trip): the layer scan
(`model.scan_layers`), the decode chunk's token steps, the blockwise attention's key blocks and
the MoE's token chunks are all loops, so its figures are lower bounds, often far below the
program's; the ratio column shows by how much. The analytic model (per chip, the work split
evenly over the program's mesh):
  N      active matmul parameters per token: per layer q/k/v/o + router + top-k experts x 3
         projections, and the LM head (the embedding is a lookup)
  A      causal attention FLOPs of a forward: 4 x heads x head_dim per query and key pair
  logprobs              2 N tokens + A
  micro_batch_gradients model 6 N tokens + 3 A; executed adds the per-layer remat forward
                        (2 N_layers tokens + A) and the blockwise backward's recomputed scores
                        (+ A / 2: 5 matmuls against the 4 of a plain backward)
  apply_gradients       12 FLOPs a parameter; bytes: parameters, gradient and both moments read,
                        parameters and moments written
  engine_prefill        one prefill piece of every slot at the prompt bucket's full span
  engine_insert         a prompt's KV read and written once
  engine_decode         per token step: every weight a chip holds read once (all experts: 32
                        slots x 8 of 128 experts touch ~87% of them), every KV position of the
                        pool read once; x the chunk's steps. XLA's bytes beyond one step of one
                        layer (and the LM head) ran outside the loops: the HBM share is the
                        analytic bytes over the analytic bytes plus those
Bytes for the full-sequence programs are a lower bound: weights read per pass (FSDP gathers a
layer's whole weights onto every chip) and the layer inputs written and read.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mars_jax.models import get_preset  # noqa: E402
from mars_jax.sampling.engine import PREFILL_CHUNK  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Chip:
    """Peak bf16 FLOP/s and HBM bytes/s of one chip."""

    flops: float
    hbm: float
    source: str


# Cloud TPU v5p: "Peak compute per chip (bf16) 459 TFLOPs; HBM2e capacity and bandwidth 95GB,
# 2765 GBps" (https://cloud.google.com/tpu/docs/v5p-training, key specifications).
CHIPS = {"TPU v5": Chip(459e12, 2765e9, "cloud.google.com/tpu/docs/v5p-training")}
ADAMW_FLOPS = 12  # per parameter: two moment updates, bias corrections, the step, weight decay


@dataclasses.dataclass(frozen=True)
class Cost:
    """Analytic work of one program on one chip: `model_flops` (what MFU counts), the FLOPs it
    executes and the bytes it must move; `kv_bytes` of them KV cache; `once_bytes`: the bytes
    XLA's count should hold, which takes one trip of each loop (the decode's)."""

    model_flops: float
    flops: float
    bytes: float
    kv_bytes: float = 0.0
    once_bytes: float = 0.0


class Model:
    """Parameter and attention counts of a Qwen3 (MoE) configuration."""

    def __init__(self, preset: str, layers: int):
        c = self.cfg = get_preset(preset, num_hidden_layers=layers)
        self.layers = layers
        self.attention = c.hidden_size * c.head_dim * (2 * c.num_attention_heads
                                                       + 2 * c.num_key_value_heads)
        expert = 3 * c.hidden_size * c.moe_intermediate_size
        self.active_layer = (self.attention + c.hidden_size * c.num_experts
                             + c.num_experts_per_tok * expert)
        self.experts_layer = c.num_experts * expert
        self.head = c.hidden_size * c.vocab_size
        self.active = layers * self.active_layer + self.head  # matmul parameters per token
        self.total = layers * (self.attention + c.hidden_size * c.num_experts
                               + self.experts_layer) + 2 * self.head
        self.param_bytes = 2 if c.param_dtype == "bfloat16" else 4

    def attention_flops(self, queries: float, keys_per_query: float) -> float:
        """Forward attention FLOPs (scores and values) over every layer."""
        c = self.cfg
        return self.layers * 4 * c.num_attention_heads * c.head_dim * queries * keys_per_query


def _devices(mesh: dict[str, int]) -> int:
    return math.prod(mesh.values())


def analytic(program: str, report: dict, model: Model) -> Cost | None:
    """The program's analytic cost per chip (module docstring); None for one not modelled."""
    s, config = report["shapes"], report["config"]
    train = _devices(report["mesh"])
    engine = _devices(report["rollout_mesh"] or report["mesh"])
    d = model.cfg.hidden_size
    weights = model.total * model.param_bytes
    if program in ("logprobs", "micro_batch_gradients"):
        rows, length = s["micro_batch"], s["train_len"]
        tokens = rows * length
        attention = model.attention_flops(tokens, length / 2)  # causal: half the keys
        activations = 2 * model.layers * tokens * d * 2  # bf16 layer inputs written and read
        if program == "logprobs":
            flops = 2 * model.active * tokens + attention
            return Cost(flops / train, flops / train, weights + activations / train)
        model_flops = 6 * model.active * tokens + 3 * attention
        executed = model_flops + 2 * model.layers * model.active_layer * tokens + 1.5 * attention
        return Cost(model_flops / train, executed / train,
                    3 * weights + weights / train + 2 * activations / train)
    if program == "apply_gradients":
        params = model.total / train
        moments = next((r["resident_bytes"] for r in report["results"]
                        if r["program"] == "micro_batch_gradients"), 8 * params)
        grads = params * model.param_bytes
        return Cost(ADAMW_FLOPS * params, ADAMW_FLOPS * params,
                    2 * (params * model.param_bytes + moments) + grads)
    kv = report.get("kv_bytes") or {}
    slots, per_token = kv.get("slots", 0), kv.get("per_token", 0)
    # A chip's weights: everything but the experts whole, the experts split over the engine mesh.
    engine_weights = (weights - model.layers * model.experts_layer * model.param_bytes
                      + model.layers * model.experts_layer * model.param_bytes / engine)
    if program == "engine_prefill":
        bucket = s["prompt_len"]
        piece = min(bucket, PREFILL_CHUNK)
        tokens = slots * piece
        flops = 2 * model.active * tokens + model.attention_flops(tokens, bucket)
        cache = slots * bucket * per_token
        return Cost(flops / engine, flops / engine, engine_weights + cache / engine,
                    cache / engine)
    if program == "engine_insert":
        cache = 2 * s["prompt_len"] * per_token / engine
        return Cost(0.0, 0.0, cache, cache)
    if program == "engine_decode":
        steps = config["rollout"]["engine_chunk_steps"]
        c = model.cfg
        touched = 1 - (1 - c.num_experts_per_tok / c.num_experts) ** slots
        step_weights = (engine_weights - model.layers * model.experts_layer * model.param_bytes
                        / engine * (1 - touched))
        positions = kv["total"] / per_token  # the pool's positions, all read at the full span
        flops = steps * (2 * model.active * slots + model.attention_flops(positions, 1)) / engine
        step_kv = kv["per_device"]
        layer_weights = (model.attention + d * c.num_experts + model.experts_layer * (
            touched / engine)) * model.param_bytes
        once = model.head * model.param_bytes + layer_weights + step_kv / model.layers
        return Cost(flops, flops, steps * (step_weights + step_kv), steps * step_kv, once)
    return None


def rows(report: dict) -> list[dict]:
    """One row per compiled program of `report` with XLA's and the analytic cost per chip."""
    chip = next((v for k, v in CHIPS.items() if k in report["target"]), None)
    if chip is None:
        raise ValueError(f"{report['target']}: no peak figures for this chip; known: {sorted(CHIPS)}")
    model = Model(report["config"]["model"]["preset"], report["layers"])
    out = []
    for result in report["results"]:
        cost = analytic(result["program"], report, model)
        if cost is None or result["error"]:
            continue
        compute_s, memory_s = cost.flops / chip.flops, cost.bytes / chip.hbm
        roofline = max(compute_s, memory_s)
        row = dict(program=result["program"], xla_flops=result["flops"],
                   xla_bytes=result["bytes_accessed"], flops=cost.flops, bytes=cost.bytes,
                   compute_s=compute_s, memory_s=memory_s, roofline_s=roofline,
                   bound="FLOPs" if compute_s >= memory_s else "HBM", note="")
        if result["program"] == "micro_batch_gradients":
            row["note"] = f"MFU {cost.model_flops / chip.flops / roofline:.0%}"
        if result["program"] == "engine_decode":
            steps = report["config"]["rollout"]["engine_chunk_steps"]
            slots = report["kv_bytes"]["slots"]
            engine = _devices(report["rollout_mesh"] or report["mesh"])
            # What XLA counts beyond one trip of the loops runs outside them, once per chunk:
            # traffic the analytic decode does not need (e.g. weights re-laid out ahead of the
            # layer scan), shared by the chunk's steps.
            extra = max(0.0, (result["bytes_accessed"] or 0.0) - cost.once_bytes)
            share = cost.bytes / (cost.bytes + extra)
            row["note"] = (f"KV {cost.kv_bytes / cost.bytes:.0%} of bytes; outside the loops "
                           f"{extra / 1e9:.1f} GB a chunk: HBM share {share:.0%}; "
                           f"{steps * slots / roofline / engine:,.0f} tok/s/chip at the roofline")
        out.append(row)
    return out


def format_rows(name: str, table: list[dict]) -> str:
    def ratio(xla, ours):
        return "-" if xla is None or not ours else f"{xla / ours:.3f}"

    lines = [f"{name}: per chip; XLA counts a loop body once (module docstring)",
             f"{'program':22} {'XLA TFLOP':>10} {'TFLOP':>9} {'ratio':>6} {'XLA GB':>8} "
             f"{'GB':>8} {'ratio':>6} {'roofline':>10} {'bound':>5}  note"]
    for r in table:
        xla_tf = "-" if r["xla_flops"] is None else f"{r['xla_flops'] / 1e12:.3f}"
        xla_gb = "-" if r["xla_bytes"] is None else f"{r['xla_bytes'] / 1e9:.2f}"
        lines.append(f"{r['program']:22} {xla_tf:>10} {r['flops'] / 1e12:9.3f} "
                     f"{ratio(r['xla_flops'], r['flops']):>6} {xla_gb:>8} {r['bytes'] / 1e9:8.2f} "
                     f"{ratio(r['xla_bytes'], r['bytes']):>6} {r['roofline_s'] * 1e3:8.1f}ms "
                     f"{r['bound']:>5}  {r['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", nargs="*", type=Path,
                        default=sorted((ROOT / "benchmarks/results/aot").glob("v5p-*.json")))
    args = parser.parse_args(argv)
    for path in args.reports:
        report = json.loads(path.read_text())
        print(format_rows(path.stem, rows(report)))
        print()
    print("peaks: " + "; ".join(f"{k} {c.flops / 1e12:.0f} TFLOP/s bf16, {c.hbm / 1e9:,.0f} GB/s "
                                f"HBM ({c.source})" for k, c in CHIPS.items()))


if __name__ == "__main__":
    main()
