"""One process of the multi-host test: 2 update steps on a fixed global batch, then a checkpoint.

  python tests/distributed/multiprocess_worker.py --out=DIR                        # 1 process
  python tests/distributed/multiprocess_worker.py --out=DIR --coordinator=localhost:PORT \
      --num_processes=2 --process_id=I                                              # each of 2

Every process builds the same global batch (`global_batch`) and contributes the rows its devices
hold; with one process the whole batch is local. Writes `params.npz` (process 0) and
`process{I}.json` (metrics, checkpoint round trip) to `--out`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from mars_jax import distributed, sharding
from mars_jax.checkpoint import Checkpointer
from mars_jax.models import create_model, get_preset
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.losses import LossConfig
from mars_jax.rl.update import UpdateConfig, init_train_state, train_step
from mars_jax.types import TrainBatch

MICRO, ROWS, LENGTH = 2, 8, 32


def global_batch(vocab: int) -> TrainBatch:
    """A fixed `[MICRO, ROWS, LENGTH]` batch: prompts of 8-12 tokens, responses up to the end."""
    rng = np.random.default_rng(0)
    shape = (MICRO, ROWS, LENGTH)
    lengths = rng.integers(16, LENGTH + 1, size=shape[:2])
    prompts = rng.integers(8, 13, size=shape[:2])
    pos = np.arange(LENGTH)
    attention = (pos < lengths[..., None]).astype(np.int32)
    loss = ((pos >= prompts[..., None]) & (pos < lengths[..., None])).astype(np.float32)
    return TrainBatch(tokens=rng.integers(0, vocab, size=shape).astype(np.int32) * attention,
                      attention_mask=attention, loss_mask=loss,
                      advantages=rng.normal(size=shape[:2]).astype(np.float32),
                      sampler_logprobs=(-rng.random(shape) * loss).astype(np.float32))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--coordinator")
    parser.add_argument("--num_processes", type=int)
    parser.add_argument("--process_id", type=int)
    args = parser.parse_args()
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    procs, pid = jax.process_count(), jax.process_index()
    # Two processes: data 1 x fsdp 2 within each, data 2 across them (dcn); one: data 2 x fsdp 2.
    mesh_config = ({"data": 1, "fsdp": 2, "dcn": {"data": procs}} if procs > 1
                   else {"data": 2, "fsdp": 2})
    mesh = sharding.make_mesh(mesh_config)
    config = get_preset("tiny")
    model = create_model(config, seed=0, mesh=mesh)
    optimizer = make_optimizer(1e-3)
    graphdef, _ = nnx.split(model, nnx.Param)
    state = init_train_state(model, optimizer)
    state = distributed.replicate_scalars(state, mesh)
    batch = global_batch(config.vocab_size)
    rows = ROWS // procs
    local = jax.tree.map(lambda x: x[:, pid * rows:(pid + 1) * rows], batch)
    update = UpdateConfig(loss=LossConfig(aggregation="token-mean", behaviour_weight_cap=None),
                          temperature=0.85, logits_chunk=16)
    initial = multihost_utils.process_allgather(state.params, tiled=True)
    losses = []
    with sharding.use_mesh(mesh):
        batch_on_mesh = distributed.global_train_batch(local, mesh)
        for _ in range(2):
            state, metrics = train_step(state, batch_on_mesh, None, graphdef=graphdef,
                                        optimizer=optimizer, config=update)
            losses.append(float(metrics["loss"]))
    out = Path(args.out)
    final = multihost_utils.process_allgather(state.params, tiled=True)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(final)))
    if pid == 0:
        np.savez(out / "params.npz", **{"/".join(map(str, k)): np.asarray(v)
                                        for k, v in nnx.to_flat_state(final)})
    # Per-host arrays under names that collide across hosts (as rollout uids do), of different
    # lengths per host; host 0 has one more.
    routing = {"1-0/s0/0": np.full((2, 3 + pid, 2), pid + 1, np.int32)}
    if pid == 0:
        routing["1-0/s0/1"] = np.arange(20, dtype=np.int32).reshape(2, 5, 2)
    index, array = distributed.host_arrays(routing)
    checkpointer = Checkpointer(out / "checkpoints", keep=2, async_save=True)
    checkpointer.save(2, state, distributed.gather_process_meta(
        {"process": pid, "rows": rows, "routing": index}), arrays={"routing": array})
    checkpointer.wait()
    step, restored, meta, arrays = checkpointer.restore_latest(state, arrays_target=lambda saved: {
        "routing": distributed.host_arrays_target(distributed.local_process_meta(saved)["routing"])})
    checkpointer.close()
    local_meta = distributed.local_process_meta(meta)
    back = distributed.unpack_host_arrays(local_meta.pop("routing"), arrays["routing"])
    restored_params = multihost_utils.process_allgather(restored.params, tiled=True)
    report = {"losses": losses, "moved": moved, "restored_step": step,
              "restored_equal": all(np.array_equal(a, b) for a, b in
                                    zip(jax.tree.leaves(restored_params), jax.tree.leaves(final))),
              "meta": local_meta,
              "routing_equal": back.keys() == routing.keys() and all(
                  np.array_equal(back[k], routing[k]) for k in routing),
              "any_process": distributed.any_process(pid == procs - 1)}
    (out / f"process{pid}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
