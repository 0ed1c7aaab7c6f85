"""The colocated slot budget (`experiments/colocated_slots.py`) on hand-made program sizes."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "experiments" / "configs"))
import colocated_slots  # noqa: E402
from aot_compile import Result  # noqa: E402

GiB = 1 << 30


def test_slots_before_and_after_by_hand():
    # Per device (GiB): HBM 100; the update 60, its larger program (a micro-batch's gradient:
    # parameters, gradient, batch, temporaries, the optimizer state beside it); the decode chunk 30, 8 of it the KV of its 16 slots over 8 batch shards
    # (0.5 a slot); the optimizer state, mu and nu of 5 each split 8 ways, 1.25.
    # Before: 100 - max(60, 22 + 1.25) = 40 -> 80 slots (a multiple of 8).
    # After: 100 - 22 = 78 -> 156 -> 152 slots; the update alone fits.
    results = [Result("micro_batch_gradients", True, argument_bytes=15 * GiB, temp_bytes=40 * GiB,
                      resident_bytes=5 * GiB),
               Result("apply_gradients", True, argument_bytes=25 * GiB, temp_bytes=5 * GiB),
               Result("engine_decode", True, argument_bytes=30 * GiB, output_bytes=8 * GiB,
                      alias_bytes=8 * GiB)]
    kv = dict(slots=16, positions=1024, per_token=4 * 2**20, total=64 * GiB,
              per_device=8 * GiB)
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8])
    optimizer = {"mu": jax.ShapeDtypeStruct((8, 5 * GiB // 8 // 4), jnp.float32,
                                            sharding=NamedSharding(mesh, PartitionSpec("fsdp")))}
    optimizer["nu"] = optimizer["mu"]
    budget = colocated_slots.budget(optimizer, results, kv, shards=8, hbm=100 * GiB)
    assert budget.optimizer == 10 * GiB // 8  # each device holds an eighth of 2 x 5 GiB
    assert (budget.update, budget.decode_without_kv, budget.slot) == (60 * GiB, 22 * GiB,
                                                                      0.5 * GiB)
    assert (budget.before, budget.after) == (80, 152)
    assert (budget.room_before, budget.room_after) == (40 * GiB, 78 * GiB)
    assert "80 slots" in budget.lines() and "152 slots (KV room 78.00 GiB; 1.90x)" in budget.lines()
    # A paged cache of the same bytes (4 pools of 4,096 positions, 8 GiB on each device) holds
    # 16 slots' worth of positions: the same budget.
    paged = dict(slots=4, positions=1024, per_token=4 * 2**20, total=64 * GiB,
                 per_device=8 * GiB)
    paged_budget = colocated_slots.budget(optimizer, results, paged, shards=8, hbm=100 * GiB)
    assert (paged_budget.slot, paged_budget.before, paged_budget.after) == (0.5 * GiB, 80, 152)
    # Each host's engine decoding a weight copy of its own (2 GiB a device) beside the trainer's
    # parameters (0.5): before = 100 - max(60 + 2, 22 + 0.5 + 1.25) = 38 -> 76 -> 72; after = 100 -
    # 22.5 = 77.5 -> 152 (the update and the engine's copy, 62, fit).
    weights = lambda gib: {"w": jax.ShapeDtypeStruct((8, gib * GiB // 8 // 4), jnp.float32,
                                                     sharding=optimizer["mu"].sharding)}
    hosts = colocated_slots.budget(optimizer, results, kv, shards=8, hbm=100 * GiB,
                                   copies=(weights(4), weights(16)), engines=16)
    assert (hosts.trainer_copy, hosts.engine_copy) == (GiB // 2, 2 * GiB)
    assert (hosts.before, hosts.after) == (72, 152)
    assert "72 slots per engine, x 16 engines" in hosts.lines()
    # An update that does not fit the HBM leaves no slot after (it must run alone).
    big = [Result("micro_batch_gradients", True), Result("apply_gradients", True,
                                                          temp_bytes=101 * GiB), results[2]]
    assert colocated_slots.budget(optimizer, big, kv, shards=8, hbm=100 * GiB).after == 0


def test_the_budget_needs_both_programs_compiled():
    kv = dict(slots=16, positions=1024, per_token=4 * 2**20, total=64 * GiB, per_device=8 * GiB)
    with pytest.raises(ValueError, match="engine_decode"):
        colocated_slots.budget({}, [Result("micro_batch_gradients", True),
                                    Result("apply_gradients", True)], kv, shards=8, hbm=GiB)
    with pytest.raises(ValueError, match="apply_gradients"):
        colocated_slots.budget({}, [Result("micro_batch_gradients", True),
                                    Result("engine_decode", True)], kv, shards=8, hbm=GiB)
    failed = [Result("micro_batch_gradients", True), Result("apply_gradients", True),
              Result("engine_decode", False, error="compile error")]
    assert colocated_slots.budget({}, failed, kv, shards=8, hbm=GiB) is None
