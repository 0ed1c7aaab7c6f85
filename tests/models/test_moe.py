"""MoE dispatch backends against the dense all-experts reference, values and gradients."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mars_jax import sharding
from mars_jax.layers.moe import MoE


def _moe(impl, capacity_factor=None, block_size=8, norm=True, chunk_tokens=0, experts=6):
    return MoE(24, 16, experts, 2, norm_topk_prob=norm, impl=impl, block_size=block_size,
               dense_max_tokens=0, capacity_factor=capacity_factor, rngs=nnx.Rngs(0),
               param_dtype=jnp.float32, stddev=0.1, chunk_tokens=chunk_tokens)


def _loss_and_grads(moe, x):
    def loss(module, x):
        out, logits, _ = module(x)
        return jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(logits ** 2)

    return nnx.value_and_grad(loss, argnums=(0, 1))(moe, x)


def _assert_same(got, ref):
    """Loss, module gradients and input gradients of `_loss_and_grads` equal the reference's."""
    (loss, (gm, gx)), (ref_loss, (ref_gm, ref_gx)) = got, ref
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(gx, ref_gx, atol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(gm), nnx.to_flat_state(ref_gm)):
        np.testing.assert_allclose(a.get_value(), b.get_value(), atol=1e-5, err_msg=str(path))


@pytest.mark.parametrize("impl", ["sorted", "ragged"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("chunk", [0, 16])  # 16: 120 tokens in 8 chunks, the last one padded
def test_dropless_matches_dense_reference(impl, norm, chunk):
    x = jax.random.normal(jax.random.key(1), (3, 40, 24))
    ref = _loss_and_grads(_moe("dense", norm=norm), x)
    got = _loss_and_grads(_moe(impl, norm=norm, chunk_tokens=chunk), x)
    _assert_same(got, ref)


@pytest.mark.parametrize("impl", ["sorted", "ragged"])
@pytest.mark.parametrize("chunk", [0, 8])
def test_dispatch_per_batch_shard_on_a_mesh_matches_dense_reference(impl, chunk):
    """On a data x fsdp = 4 x 2 mesh each fsdp pair of batch shards sorts its own tokens
    (shard_map; the 6 experts are split over fsdp and the pair's 24 tokens are gathered, fewer
    elements than a chip's 3 experts); values and gradients equal the unsharded dense reference."""
    x = jax.random.normal(jax.random.key(2), (8, 12, 24))
    ref = _loss_and_grads(_moe("dense"), x)
    mesh = sharding.make_mesh({"data": 4, "fsdp": 2, "tensor": 1, "expert": 1})
    with sharding.use_mesh(mesh):
        xs = jax.device_put(x, sharding.named_sharding(mesh, ("batch", None, None), x.shape))
        got = nnx.jit(_loss_and_grads)(_moe(impl, chunk_tokens=chunk), xs)
    _assert_same(got, ref)


@pytest.mark.parametrize("impl", ["dense", "sorted", "ragged"])
@pytest.mark.parametrize("length", [4, 12])
def test_tensor_parallel_experts_match_dense_reference_without_gathering_them(impl, length):
    """On a data x fsdp x tensor = 2 x 2 x 2 mesh each chip runs its `mlp` slice of every expert
    and the partial outputs are summed: values and gradients equal the unsharded dense reference,
    and no chip gathers a whole expert weight over the tensor axis (the compiled program has no
    all-gather whose result holds every `mlp` unit). At length 4 the sort-based backends gather
    each fsdp pair's tokens (expert parallelism), at 12 the pair's experts."""
    x = jax.random.normal(jax.random.key(3), (8, length, 24))
    ref = _loss_and_grads(_moe("dense"), x)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2, "expert": 1})
    with sharding.use_mesh(mesh):
        moe = _moe(impl)
        xs = jax.device_put(x, sharding.named_sharding(mesh, ("batch", None, None), x.shape))
        got = nnx.jit(_loss_and_grads)(moe, xs)
        hlo = nnx.jit(lambda m, x: m(x)[0]).lower(moe, xs).compile().as_text()
    _assert_same(got, ref)
    gathers = [line for line in hlo.splitlines() if "all-gather(" in line]
    assert not [g for g in gathers if "f32[6,2,16," in g or "f32[6,16," in g], gathers


def _sharded_moe(impl: str, mesh) -> MoE:
    """An 8-expert MoE with its weights placed by the default rules on `mesh`."""
    graphdef, state = nnx.split(_moe(impl, experts=8))
    return nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))


@pytest.mark.parametrize("impl,length", [("dense", 3), ("sorted", 3), ("ragged", 3),
                                         ("sorted", 64), ("ragged", 64)])
def test_experts_split_over_fsdp_match_reference_and_gather_the_cheaper_operand(impl, length):
    """On a data x fsdp = 2 x 4 mesh the default rules split the 8 experts over `fsdp` (2 a
    chip). Values and gradients equal the unsharded reference. With 24 tokens every backend
    gathers tokens, never an expert weight: `dense` as XLA partitions it, `sorted` and `ragged`
    because each fsdp group's 12 tokens in and out (2 x 12 x 24 elements) are fewer than one
    chip's experts (9,216 / 4); each chip runs its own experts and the outputs are
    reduce-scattered. With 512 tokens (256 a group) the sort-based backends gather the experts,
    as FSDP does in the update."""
    x = jax.random.normal(jax.random.key(4), (8, length, 24))
    ref = _loss_and_grads(_moe("dense", experts=8), x)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4, "tensor": 1, "expert": 1})
    with sharding.use_mesh(mesh):
        moe = _sharded_moe(impl, mesh)
        assert moe.wi[...].sharding.spec == P(("expert", "fsdp"), None, "tensor", None)
        xs = jax.device_put(x, sharding.named_sharding(mesh, ("batch", None, None), x.shape))
        got = nnx.jit(_loss_and_grads)(moe, xs)
        hlo = nnx.jit(lambda m, x: m(x)[0]).lower(moe, xs).compile().as_text()
    _assert_same(got, ref)
    gathered = [tuple(map(int, m.group(1).split(","))) for line in hlo.splitlines()
                if (m := re.search(r"= f32\[([\d,]+)\]\S* all-gather\(", line))]
    # An expert weight has the mlp dimension (16), or 8 x 2 x 16 / 8 x 16 rows when flattened.
    weight_gathers = [shape for shape in gathered if {16, 256, 128} & set(shape)]
    assert gathered, hlo
    if length == 3:
        assert not weight_gathers, gathered
        assert impl == "dense" or "reduce-scatter(" in hlo
    else:
        assert weight_gathers, gathered


def test_capacity_drops_exactly_the_overflow():
    """With capacity C per expert, an assignment survives iff fewer than C earlier tokens (in
    token order) chose the same expert; checked against a numpy loop over tokens."""
    moe = _moe("dense", capacity_factor=0.5)
    x = jax.random.normal(jax.random.key(2), (30, 24))
    out, _, ids = moe(x)
    _, ids, weights = moe.route(x)
    capacity = int(np.ceil(30 * 2 / 6 * 0.5))
    seen = np.zeros(6, int)
    keep = np.zeros((30, 2), bool)
    for t in range(30):          # sorted stably by expert = token order within each expert
        for j in range(2):
            e = int(ids[t, j])
            keep[t, j] = seen[e] < capacity
            seen[e] += 1
    dense = _moe("dense")
    expected, _, _ = dense(x, ids)  # replay routing; then remove dropped contributions
    wi, wo = np.asarray(dense.wi[...]), np.asarray(dense.wo[...])
    xs = np.asarray(x)
    for t, j in zip(*np.nonzero(~keep)):
        e = int(ids[t, j])
        h = wi[e] @ xs[t]
        expert_out = (h[0] / (1 + np.exp(-h[0])) * h[1]) @ wo[e]
        expected = expected.at[t].add(-float(weights[t, j]) * expert_out)
    assert (~keep).any()
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_routing_replay_reproduces_and_overrides():
    moe = _moe("sorted")
    x = jax.random.normal(jax.random.key(3), (10, 24))
    out, _, ids = moe(x)
    replayed, _, replay_ids = moe(x, ids)
    np.testing.assert_array_equal(replay_ids, ids)
    np.testing.assert_allclose(replayed, out, atol=1e-6)
    other = (ids + 1) % 6
    changed, _, _ = moe(x, other)
    assert np.abs(np.asarray(changed - out)).max() > 1e-3


@pytest.mark.parametrize("platform,few,many", [("tpu", "dense", "ragged"),
                                               ("gpu", "dense", "sorted"),
                                               ("cpu", "dense", "sorted")])
def test_auto_uses_ragged_dot_only_on_tpu(monkeypatch, platform, few, many):
    """XLA:GPU rewrites `ragged_dot` into a dense dot E times larger (benchmarks/RESULTS.md);
    decode-sized calls (64 tokens here) run `dense` everywhere."""
    moe = MoE(2048, 768, 128, 8, norm_topk_prob=True, impl="auto", block_size=128,
              dense_max_tokens=64, capacity_factor=None, rngs=nnx.Rngs(0),
              param_dtype=jnp.bfloat16, stddev=0.02)
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    assert (moe.backend(64), moe.backend(65)) == (few, many)
