"""Single-process behaviour of `mars_jax.distributed` (the 2-process run is test_multiprocess)."""
import jax
import numpy as np
import pytest

from mars_jax import distributed, sharding
from mars_jax.types import TrainBatch


@pytest.mark.parametrize("env, expected", [
    ({}, False),
    ({"SLURM_NTASKS": "1"}, False),
    ({"SLURM_NTASKS": "4"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}, True),
    ({"TPU_WORKER_HOSTNAMES": "t1k-w-0"}, False),
    ({"TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1"}, True),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2"}, True),
])
def test_cluster_detection(env, expected):
    assert distributed.cluster_detected(env) is expected


def test_single_process_starts_nothing(monkeypatch):
    for key in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    assert distributed.initialize() is False
    assert distributed.initialize(mode="off") is False


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="sometimes"), "distributed: 'sometimes' is not one of"),
    (dict(num_processes=0), "num_processes: must be positive"),
    (dict(num_processes=2, process_id=2), r"process_id: 2 is not in \[0, num_processes=2\)"),
])
def test_initialize_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        distributed.initialize(**kwargs)


def test_global_train_batch_shards_rows_over_batch_axes():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2, "expert": 1})
    rng = np.random.default_rng(0)
    shape = (2, 8, 16)
    batch = TrainBatch(tokens=rng.integers(0, 9, shape).astype(np.int32),
                       attention_mask=np.ones(shape, np.int32),
                       loss_mask=np.ones(shape, np.float32),
                       advantages=rng.normal(size=shape[:2]).astype(np.float32),
                       sampler_logprobs=np.zeros(shape, np.float32))
    result = distributed.global_train_batch(batch, mesh)
    rows = ("data", "fsdp", "expert")
    assert result.tokens.sharding.spec == jax.sharding.PartitionSpec(None, rows, None)
    assert result.advantages.sharding.spec == jax.sharding.PartitionSpec(None, rows)
    for got, want in zip(jax.tree.leaves(result), jax.tree.leaves(batch)):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_process_meta_round_trip():
    saved = distributed.gather_process_meta({"data": {"next_index": 3}})
    assert saved == {"process_count": 1, "processes": [{"data": {"next_index": 3}}]}
    assert distributed.local_process_meta(saved) == {"data": {"next_index": 3}}
    with pytest.raises(ValueError, match="written by 2 processes, this run has 1"):
        distributed.local_process_meta({"process_count": 2, "processes": [{}, {}]})


def test_any_process_single():
    assert distributed.any_process(True) and not distributed.any_process(False)
