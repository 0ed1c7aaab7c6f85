"""Submesh split: the rollout mesh's copy of the weights against the trainer's, on 8 fake CPU
devices (4 for training, 4 for rollout, each laid out differently)."""
import jax
import numpy as np
import pytest
from flax import nnx

from experiments.configs import smoke
from mars_jax import builders, sharding, weight_sync
from mars_jax.models import create_model, get_preset
from mars_jax.rl.batching import TrainSample, make_batch
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import UpdateConfig, init_train_state, train_step
from mars_jax.sampling import Engine, generate

SPLIT = {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1,
         "rollout": {"devices": 4, "data": 2, "fsdp": 1, "tensor": 1, "expert": 2}}
PROMPTS = [[5, 17, 42, 8, 99], [7, 3], [200, 11, 64, 1, 2, 9, 30], [50]]


@pytest.fixture(scope="module")
def meshes():
    return sharding.make_meshes(SPLIT)


@pytest.fixture
def trainer(meshes):
    """The tiny model on the training mesh (fresh: a train step donates its arrays)."""
    train_mesh, _ = meshes
    with sharding.use_mesh(train_mesh):
        model = create_model(get_preset("tiny"), seed=0, mesh=train_mesh)
    graphdef, _ = nnx.split(model, nnx.Param)
    return graphdef, model


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _devices(tree):
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def test_build_meshes_splits_the_devices_6_2_with_each_submesh_s_axes():
    config = smoke.get_config()
    config.mesh.data, config.mesh.fsdp = 1, -1
    config.mesh.rollout.devices, config.mesh.rollout.expert = 2, 2
    train, rollout = builders.build_meshes(config)
    assert dict(train.shape) == {"data": 1, "fsdp": 6, "tensor": 1, "expert": 1}
    assert dict(rollout.shape) == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 2}
    assert set(train.devices.flat) | set(rollout.devices.flat) == set(jax.devices())
    assert not set(train.devices.flat) & set(rollout.devices.flat)
    assert builders.build_mesh(config) == train
    for mesh in (train, rollout):
        assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}


def test_without_a_split_both_are_the_one_shared_mesh():
    train, rollout = builders.build_meshes(smoke.get_config())
    assert train is rollout and train.devices.size == 8
    model = create_model(get_preset("tiny"), seed=0, mesh=train)
    params = nnx.state(model, nnx.Param)
    copied, transfer = weight_sync.copy_weights(
        params, weight_sync.rollout_shardings(params, rollout))
    assert transfer.bytes == 0
    assert all(a is b for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(params)))


def test_rollout_copy_equals_the_trainers_weights_after_each_update(meshes, trainer):
    train_mesh, rollout_mesh = meshes
    graphdef, model = trainer
    optimizer = make_optimizer(1e-2, max_grad_norm=None)
    with sharding.use_mesh(train_mesh):
        state = init_train_state(model, optimizer)
    shardings = weight_sync.rollout_shardings(state.params, rollout_mesh)
    rng = np.random.default_rng(0)
    samples = [TrainSample(list(rng.integers(1, 512, 4)), list(rng.integers(1, 512, 6)),
                           list(-rng.uniform(3.0, 9.0, 6)), float(rng.normal()))
               for _ in range(4)]
    batch = make_batch(samples, micro_batch_size=4)
    copies = []
    for update in range(3):
        want = _host(state.params)
        copy, transfer = weight_sync.copy_weights(state.params, shardings)
        for got, expected in zip(_host(copy), want, strict=True):
            np.testing.assert_array_equal(got, expected)
        assert _devices(copy) == set(rollout_mesh.devices.flat)
        for x, s in zip(jax.tree.leaves(copy), jax.tree.leaves(shardings)):
            assert x.sharding == s
        # Every byte lands on a rollout device; replicated parameters once per device.
        assert transfer.bytes >= sum(x.nbytes for x in jax.tree.leaves(state.params))
        assert transfer.bytes_per_device <= transfer.bytes
        copies.append((copy, want))
        with sharding.use_mesh(train_mesh):
            state, metrics = train_step(state, batch, None, graphdef=graphdef,
                                        optimizer=optimizer, config=UpdateConfig())
        assert float(metrics["finite"]) == 1.0
        assert not all(np.array_equal(a, b) for a, b in zip(_host(state.params), want))
    # Earlier copies are unaffected by later updates (the train step donates its own state).
    for copy, want in copies:
        for got, expected in zip(_host(copy), want):
            np.testing.assert_array_equal(got, expected)


def test_engine_on_the_rollout_submesh_matches_generate_on_the_shared_mesh(meshes, trainer):
    _, rollout_mesh = meshes
    graphdef, model = trainer
    params = nnx.state(model, nnx.Param)
    shared = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2, "expert": 1})
    with sharding.use_mesh(shared):
        reference = generate(
            nnx.merge(graphdef, jax.device_put(params, sharding.state_shardings(params, shared))),
            PROMPTS, max_new_tokens=6, temperature=0.0, mesh=shared)
    copy, _ = weight_sync.copy_weights(params, weight_sync.rollout_shardings(params,
                                                                             rollout_mesh))
    engine = Engine(weight_sync.rollout_model(graphdef, copy), num_slots=4, max_length=32,
                    chunk_steps=4, mesh=rollout_mesh)
    ids = [engine.submit(p, max_new_tokens=6, temperature=0.0)[0] for p in PROMPTS]
    outputs = engine.run()
    assert [outputs[i].tokens for i in ids] == reference.tokens
    assert {len(t) for t in reference.tokens} == {6}
