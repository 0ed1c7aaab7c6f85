"""`global_train_batch`'s padding, in one process: hosts holding different numbers and lengths of
micro-batches agree on one shape, and every host's real data stays where it was; a global
micro-batch the batch axes cannot split over the hosts is a config problem at start-up."""
import numpy as np
import pytest

from mars_jax import sharding
from mars_jax.distributed import agreed_batch_shape, pad_train_batch
from mars_jax.rl.config import micro_batch_split_problem
from mars_jax.types import TrainBatch

ROWS, LAYERS, TOP_K = 2, 3, 2


def _host_batch(num_micro: int, length: int, seed: int, experts: bool = True) -> TrainBatch:
    """A host's own batch with nonzero values everywhere (masks all 1), so padding is visible."""
    rng = np.random.default_rng(seed)
    shape = (num_micro, ROWS, length)
    return TrainBatch(
        tokens=rng.integers(1, 100, shape).astype(np.int32),
        attention_mask=np.ones(shape, np.int32), loss_mask=np.ones(shape, np.int32),
        advantages=rng.uniform(0.5, 1.5, (num_micro, ROWS)).astype(np.float32),
        sampler_logprobs=-rng.uniform(0.1, 2.0, shape).astype(np.float32),
        expert_ids=(rng.integers(1, 8, (num_micro, LAYERS, ROWS, length, TOP_K)).astype(np.int32)
                    if experts else None))


def _token_mean_loss(b: TrainBatch) -> float:
    """A float64 reference of what the update sums over: advantage x logprob on loss tokens."""
    mask = b.loss_mask.astype(np.float64) * b.attention_mask
    return float(np.sum(mask * b.advantages[..., None] * b.sampler_logprobs) / np.sum(mask))


def test_hosts_with_different_micro_batch_counts_and_lengths_agree_on_the_maxima():
    hosts = [_host_batch(1, 48, 0), _host_batch(3, 16, 1), _host_batch(2, 32, 2)]
    shapes = np.stack([np.asarray(h.tokens.shape) for h in hosts])  # what process_allgather gives
    assert agreed_batch_shape(shapes) == (3, 48)
    padded = [pad_train_batch(h, 3, 48) for h in hosts]
    for host, out in zip(hosts, padded):
        m, _, length = host.tokens.shape
        for name in ("tokens", "attention_mask", "loss_mask", "sampler_logprobs"):
            got, own = getattr(out, name), getattr(host, name)
            assert got.shape == (3, ROWS, 48) and got.dtype == own.dtype, name
            np.testing.assert_array_equal(got[:m, :, :length], own)  # real data in place
            assert not got[m:].any() and not got[:, :, length:].any(), name  # zeros elsewhere
        assert out.advantages.shape == (3, ROWS)
        np.testing.assert_array_equal(out.advantages[:m], host.advantages)
        assert not out.advantages[m:].any()
        assert out.expert_ids.shape == (3, LAYERS, ROWS, 48, TOP_K)
        np.testing.assert_array_equal(out.expert_ids[:m, :, :, :length], host.expert_ids)
        assert not out.expert_ids[m:].any() and not out.expert_ids[:, :, :, length:].any()
        # Padding carries zero masks, so the masked loss of the host's data is unchanged.
        assert _token_mean_loss(out) == pytest.approx(_token_mean_loss(host), rel=1e-12)


def test_a_host_without_routing_and_equal_shapes_pass_through():
    host = _host_batch(2, 16, 3, experts=False)
    assert agreed_batch_shape(np.asarray([[2, ROWS, 16], [2, ROWS, 16]])) == (2, 16)
    out = pad_train_batch(host, 2, 16)
    assert out.expert_ids is None
    for name in ("tokens", "attention_mask", "loss_mask", "advantages", "sampler_logprobs"):
        np.testing.assert_array_equal(getattr(out, name), getattr(host, name))


def test_different_rows_per_micro_batch_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"learner.micro_batch_size: .* sizes \[2, 4\]"):
        agreed_batch_shape(np.asarray([[1, 2, 16], [1, 4, 16]]))


@pytest.mark.parametrize("mesh_shape, rows, fix", [
    # data=8: 6 rows are not split (8 does not divide 6), so 2 hosts cannot each own 3 of them;
    # 8 rows are the nearest that split.
    (dict(data=8), 6, "e.g. 8"),
    (dict(data=8), 16, None),
    # data=2 x fsdp=4: 4 rows are split over data only (2 parts), one per host.
    (dict(data=2, fsdp=4), 4, None),
    # tensor=8: no batch axis at all, every device holds every row, whatever their number.
    (dict(data=1, tensor=8), 8, "lay the training mesh's batch axes"),
])
def test_a_micro_batch_the_batch_axes_cannot_split_over_two_hosts_is_refused(
        mesh_shape, rows, fix):
    mesh = sharding.make_mesh(mesh_shape)  # the session's 8 CPU devices
    with sharding.use_mesh(mesh):
        problem = micro_batch_split_problem(rows, mesh, processes=2)
    if fix is None:
        assert problem is None
    else:
        assert problem.field == "learner.micro_batch_size" and f"{rows} rows" in problem.problem
        assert fix in problem.fix, problem
