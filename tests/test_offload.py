"""The optimizer state's round trip through pinned host memory (`mars_jax.offload`), against
what never left the device: the state comes back bit for bit, so does the next update, and a
training run with `learner.offload_optimizer` writes the metrics of one without it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax import offload, sharding
from mars_jax.config_validation import validate
from mars_jax.errors import ConfigError
from mars_jax.models import create_model, get_preset
from mars_jax.rl.batching import TrainSample, make_batch
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import UpdateConfig, init_train_state, train_step
from tests.cpu_env import cpu_env

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments" / "configs"))
from common import base_config  # noqa: E402

TIMING = ("time/", "tokens_per_second", "stream/deferred_seconds", "stream/sync_seconds")


def _batch(seed):
    rng = np.random.default_rng(seed)
    samples = [TrainSample(list(rng.integers(1, 512, 5)), list(rng.integers(1, 512, 6)),
                           list(-rng.uniform(3.0, 9.0, 6)), float(rng.normal()))
               for _ in range(8)]
    return make_batch(samples, micro_batch_size=8)


def _bits(tree):
    """Every leaf's bytes (NaN-proof, exact equality)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def trained():
    """The tiny model sharded over 8 fake devices (fsdp=8) after one update: AdamW's moments
    are non-zero and shard like the parameters."""
    mesh = sharding.make_mesh(dict(data=1, fsdp=8, tensor=1, expert=1))
    with sharding.use_mesh(mesh):
        model = create_model(get_preset("tiny"), seed=0, mesh=mesh)
    optimizer = make_optimizer(1e-3)
    graphdef, _ = nnx.split(model, nnx.Param)
    step = lambda state, seed: train_step(state, _batch(seed), None, graphdef=graphdef,
                                          optimizer=optimizer, config=UpdateConfig())[0]
    with sharding.use_mesh(mesh):
        state = step(init_train_state(model, optimizer), 0)
    return mesh, state, step


def test_offload_round_trip_is_bitwise_and_the_next_update_identical(trained):
    mesh, state, step = trained
    copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)
    kept, moved = copy(state), copy(state)
    before = _bits(moved.opt_state)
    specs = [x.sharding.spec for x in jax.tree.leaves(moved.opt_state)]
    assert any(len(x.sharding.device_set) == 8 and x.addressable_shards[0].data.size < x.size
               for x in jax.tree.leaves(moved.opt_state))  # some moments are really sharded
    device_leaves = jax.tree.leaves(moved.opt_state)

    on_host = offload.to_host(moved.opt_state)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(on_host)} == {"pinned_host"}
    assert all(x.is_deleted() for x in device_leaves)  # the device copy is freed
    restored = offload.to_device(on_host)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(restored)} == {"device"}
    assert [x.sharding.spec for x in jax.tree.leaves(restored)] == specs
    assert _bits(restored) == before

    moved = moved.replace(opt_state=restored)
    with sharding.use_mesh(mesh):
        want, got = step(kept, 1), step(moved, 1)
    assert _bits(got) == _bits(want)
    assert _bits(got.opt_state) != before  # the update moved the state


def test_none_and_non_array_leaves_pass_through():
    assert offload.to_host(None) is None
    tree = {"a": None, "b": 3, "c": jax.numpy.ones(2)}
    moved = offload.to_host(tree)
    assert moved["a"] is None and moved["b"] == 3
    assert moved["c"].sharding.memory_kind == "pinned_host"


def _train(workdir, *extra):
    """Two steps of the smoke job (the tiny model on 8 fake devices, the streaming engine)."""
    subprocess.run([sys.executable, str(REPO / "experiments/run.py"),
                    "--config=" + str(REPO / "experiments/configs/smoke.py"),
                    f"--workdir={workdir}",
                    f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}",
                    *SMALL, *extra], env=cpu_env(devices=8), check=True, capture_output=True,
                   timeout=900)
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


SMALL = ["--config.total_steps=2", "--config.rollout.group_size=2",
         "--config.rollout.prompts_per_step=1", "--config.rollout.max_stages=3",
         "--config.rollout.decode_engine=engine", "--config.rollout.engine_slots=8",
         "--config.learner.micro_batch_size=8"] + [
    f"--config.rollout.max_new_tokens.{role}=16" for role in ("solver", "verifier", "corrector")]


def test_a_run_with_the_optimizer_offloaded_trains_what_the_resident_run_trains(tmp_path):
    resident = _train(tmp_path / "resident")
    offloaded = _train(tmp_path / "offloaded", "--config.learner.offload_optimizer=True")
    assert len(resident) == len(offloaded) == 2
    for a, b in zip(resident, offloaded):
        assert a.keys() == b.keys()
        assert {k: v for k, v in a.items() if not k.startswith(TIMING)} == {
            k: v for k, v in b.items() if not k.startswith(TIMING)}


def test_offloading_beside_a_rollout_submesh_is_refused():
    config = base_config()
    config.learner.offload_optimizer, config.mesh.rollout.devices = True, 4
    with pytest.raises(ConfigError, match="learner.offload_optimizer: True with mesh.rollout"):
        validate(config, base_config(), device_count=8)
