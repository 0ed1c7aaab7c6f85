r"""Engine slots a colocated run (rollout and update on one mesh) fits per device, before and
after the update's state leaves device memory while the engine decodes (`mars_jax.offload`),
from the programs `aot_compile.py` compiled (`--colocated_slots`; needs `engine_decode` and
the update's two programs, `micro_batch_gradients` and `apply_gradients`: `update`):

  python experiments/aot_compile.py --config=experiments/configs/marsrl_qwen3_30b_a3b.py \
      --topology=v5p:4x4x4 --config.rollout.decode_engine=engine \
      --config.rollout.engine_slots=512 --config.learner.micro_batch_size=64 \
      --programs=engine_decode,update --colocated_slots

Per device, from the compiled programs' memory (arguments + outputs - donated + temporaries +
what the trainer holds beside them, `aot_compile.Result.total_bytes`; the update program is the
larger of its two) and the engine's KV bytes (`StepPrograms.kv_bytes`):
  before  the run as it is: the optimizer state stays on the device and the engine's slot cache
          stays allocated through the update (the rollout engine keeps
          it), so KV + max(update program, decode program without its KV + optimizer state)
          must fit.
  after   the optimizer state on the host while decoding and the slot cache out of device
          memory while the update runs (`Engine.free_kv`, called by the trainer where nothing is
          lost: the engine is empty at a synchronous step's barrier, or
          `rollout.resume='recompute'` re-prefills it after the update): KV +
          decode program without its KV must fit, and the update program alone.
On several hosts each host's engine decodes its own copy of the weights on its own chips
(`sharding.make_meshes`), which are also training chips: then the engine's weights sit beside
the update and the trainer's parameters beside the decode, in both columns, and the slots are
per engine (`engines` of them). The decode program's memory beside its KV cache (weights,
per-slot state, temporaries) is taken at the slot count compiled, so compile at about the count
reported. A slot is `max_length` positions of KV (with a paged cache, `rollout.engine_kv_pages`:
that many positions of its pools; the room is also given in GiB). Slots come in multiples of
the engine mesh's batch shards. Both phases are compared with the whole HBM, as
`aot_compile.py`'s "fits" is.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mars_jax.rl.learner import UPDATE_PROGRAMS

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class SlotBudget:
    """Bytes per device and the slots that fit (module docstring)."""

    hbm: int
    optimizer: int          # the optimizer state
    update: int             # the larger update program (parameters, optimizer state, batch,
    # temps)
    decode_without_kv: int  # the decode program less its slots' KV cache
    engine_copy: int        # the engine's own weights, beside the update (0: the same arrays)
    trainer_copy: int       # the trainer's parameters, beside the decode (0: the same arrays)
    slot: float             # KV bytes one slot adds per device, on average over the engine
    shards: int             # batch shards: slots come in multiples of them
    engines: int            # engines of the machine (one per host on several hosts)
    compiled_slots: int
    room_before: int        # bytes per device the KV cache may take
    room_after: int
    before: int             # slots per engine
    after: int

    def lines(self) -> str:
        gib = lambda n: f"{n / GiB:.2f} GiB"
        ratio = f"{self.after / self.before:.2f}x" if self.before else "no slot before"
        engines = f" per engine, x {self.engines} engines" if self.engines > 1 else ""
        copies = (f", engine weights {gib(self.engine_copy)} beside the update, trainer "
                  f"parameters {gib(self.trainer_copy)} beside the decode"
                  if self.engine_copy or self.trainer_copy else "")
        return (f"colocated slots (per device: HBM {gib(self.hbm)}, update {gib(self.update)}, "
                f"decode without KV {gib(self.decode_without_kv)} at {self.compiled_slots} "
                f"slots, optimizer state {gib(self.optimizer)}{copies}, a slot "
                f"{gib(self.slot)})\n"
                f"  before (optimizer state and slot cache resident through the update): "
                f"{self.before} slots{engines} (KV room {gib(self.room_before)})\n"
                f"  after (optimizer state on the host while decoding, slot cache freed for the "
                f"update): {self.after} slots{engines} (KV room {gib(self.room_after)}; {ratio})")


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of `tree`'s sharded abstract (or concrete) arrays."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def slots_fitting(free: float, slot: float, shards: int) -> int:
    """Whole multiples of `shards` slots of `slot` bytes a device each in `free` bytes."""
    return max(0, int(free // slot) // shards * shards) if free > 0 else 0


def budget(optimizer_state: Any, results: Sequence, kv: dict[str, int], shards: int,
           hbm: int, *, copies: tuple[Any, Any] | None = None, engines: int = 1
           ) -> SlotBudget | None:
    """The slot budget from `optimizer_state` (abstract, sharded), the compiled `results` of
    `engine_decode` and the `UPDATE_PROGRAMS`, the engine's `kv` bytes (`StepPrograms.kv_bytes`) and its
    mesh's batch `shards`; `copies` = (trainer's parameters, engine's weights), abstract and
    sharded, when the engine decodes a copy of its own (module docstring). None when either
    program failed to compile."""
    by_name = {r.program: r for r in results}
    needed = ("engine_decode",) + UPDATE_PROGRAMS
    missing = set(needed) - set(by_name)
    if missing or kv is None:
        raise ValueError(f"--colocated_slots: needs engine_decode and update compiled; "
                         f"missing {sorted(missing) or ['the engine KV bytes']}")
    if any(by_name[p].error for p in needed):
        return None  # a compile error: the table shows it
    # A device holds per_device of the cache's total bytes: a slot's positions cost it that share.
    slot = kv["per_device"] * kv["positions"] * kv["per_token"] / kv["total"]
    trainer, engine = (bytes_per_device(c) for c in copies) if copies else (0, 0)
    update = max(by_name[p].total_bytes for p in UPDATE_PROGRAMS)
    decode = by_name["engine_decode"].total_bytes - kv["per_device"]
    optimizer = bytes_per_device(optimizer_state)
    room_before = hbm - max(update + engine, decode + trainer + optimizer)
    room_after = hbm - (decode + trainer) if update + engine <= hbm else 0
    return SlotBudget(hbm=hbm, optimizer=optimizer, update=update, decode_without_kv=decode,
                      engine_copy=engine, trainer_copy=trainer, slot=slot, shards=shards,
                      engines=engines, compiled_slots=kv["slots"], room_before=room_before,
                      room_after=room_after, before=slots_fitting(room_before, slot, shards),
                      after=slots_fitting(room_after, slot, shards))
