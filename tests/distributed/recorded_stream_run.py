"""experiments/run.py with parity rewards (`tests/fault/parity_reward_run.py`) that records, on
each host, what it trains, whether each weight copy reached its engine intact and what it decoded
while an update ran, as lines of `{workdir}/record{process}.jsonl`: {"trained": [[uid, response
ids, reward], ...]} per update, {"copy_equal": bool, "bytes": int} per copy of the weights to
this host's engine, {"overlap_tokens": int} per update overlapped with decoding (pipeline mode
on a rollout submesh), {"update_thread_program": [name, runs on a rollout device]} per device
program the thread of an overlapped update launches (`program_recorder`); and its device
programs and host exchanges (`program_recorder`). Test helper."""
import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from mars_jax import builders, weight_sync
from mars_jax.rl import trainer
from mars_jax.rl.streaming import StreamingRollouts
from tests.distributed import program_recorder
from tests.fault import parity_reward_run


def _record(entry: dict) -> None:
    workdir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--workdir="))
    with open(Path(workdir) / f"record{jax.process_index()}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def install() -> None:
    training_samples = trainer.training_samples

    def recorded_samples(groups, **kwargs):
        _record({"trained": [[r.uid, list(map(int, r.response_ids)), r.reward]
                             for g in groups for r in g]})
        return training_samples(groups, **kwargs)

    copy = weight_sync.HostCopies.copy

    def checked_copy(self, params):
        copied, transfer = copy(self, params)
        whole = multihost_utils.process_allgather(params, tiled=True)  # the trainer's, gathered
        equal = all(np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(whole), strict=True))
        _record({"copy_equal": equal, "bytes": transfer.bytes})
        return copied, transfer

    decode_while = StreamingRollouts.decode_while

    def counted_decode_while(self, busy, version):
        tokens = self.engine.stats["tokens"]
        decode_while(self, busy, version)
        _record({"overlap_tokens": self.engine.stats["tokens"] - tokens})

    trainer.training_samples = recorded_samples
    weight_sync.HostCopies.copy = checked_copy
    StreamingRollouts.decode_while = counted_decode_while

    rollout_devices: set[int] = set()  # this host's, when the devices are split
    build_meshes = builders.build_meshes

    def recorded_meshes(config):
        mesh, rollout_mesh = build_meshes(config)
        if rollout_mesh is not mesh:
            rollout_devices.update(device.id for device in rollout_mesh.devices.flat)
        return mesh, rollout_mesh

    def on_launch(thread: str, program: str, devices: frozenset[int]) -> None:
        if thread.startswith(trainer.UPDATE_THREAD):
            _record({"update_thread_program": [program, bool(devices & rollout_devices)]})

    builders.build_meshes = recorded_meshes
    program_recorder.install(on_launch)


if __name__ == "__main__":
    parity_reward_run.install()
    install()
    parity_reward_run.run()
