"""ProblemIterator: deterministic shuffling, epochs, sharding, checkpointable state."""

import json

import pytest

from mars_jax.data.iterator import ProblemIterator

SOURCE = [{"id": f"p{i}"} for i in range(23)]


def _ids(iterator, n=None):
    out = []
    for record in iterator:
        out.append(record["id"])
        if n is not None and len(out) == n:
            break
    return out


def test_each_epoch_is_a_new_permutation():
    ids = _ids(ProblemIterator(SOURCE, seed=0, num_epochs=3))
    epochs = [ids[i * 23 : (i + 1) * 23] for i in range(3)]
    assert len(ids) == 69
    for epoch in epochs:
        assert sorted(epoch) == sorted(r["id"] for r in SOURCE)
    assert len({tuple(epoch) for epoch in epochs}) == 3  # pairwise different, epoch 0 vs 2 too
    assert epochs[0] != [r["id"] for r in SOURCE]


def test_same_seed_same_order_other_seed_other_order():
    assert _ids(ProblemIterator(SOURCE, seed=5), 50) == _ids(ProblemIterator(SOURCE, seed=5), 50)
    assert _ids(ProblemIterator(SOURCE, seed=5), 50) != _ids(ProblemIterator(SOURCE, seed=6), 50)


def test_no_shuffle_keeps_order():
    assert _ids(ProblemIterator(SOURCE, seed=0, shuffle=False, num_epochs=2)) == [r["id"] for r in SOURCE] * 2


@pytest.mark.parametrize("position", [0, 1, 22, 23, 40])
def test_restored_state_reproduces_the_rest(position):
    reference = ProblemIterator(SOURCE, seed=1, num_epochs=3)
    for _ in range(position):
        next(reference)
    state = json.loads(json.dumps(reference.get_state()))  # as stored in a checkpoint
    expected = _ids(reference)
    restored = ProblemIterator(SOURCE, seed=1, num_epochs=3)
    restored.set_state(state)
    assert _ids(restored) == expected
    assert len(expected) == 69 - position


def test_epoch_counter():
    iterator = ProblemIterator(SOURCE, seed=0)
    _ids(iterator, 30)
    assert iterator.epoch == 1


def test_shards_partition_the_source():
    shards = [_ids(ProblemIterator(SOURCE, seed=2, num_epochs=1, shard_index=i, shard_count=4)) for i in range(4)]
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == sorted(r["id"] for r in SOURCE)
    assert [len(s) for s in shards] == [6, 6, 6, 5]


def test_state_from_another_configuration_is_rejected():
    state = ProblemIterator(SOURCE, seed=1).get_state()
    with pytest.raises(ValueError, match="seed=1.*this iterator has 2"):
        ProblemIterator(SOURCE, seed=2).set_state(state)
    with pytest.raises(ValueError, match="source_len"):
        ProblemIterator(SOURCE[:-1], seed=1).set_state(state)
    with pytest.raises(ValueError, match="next_index"):
        ProblemIterator(SOURCE, seed=1).set_state({**state, "next_index": -1})


def test_a_changed_source_of_the_same_length_is_rejected():
    state = ProblemIterator(SOURCE, seed=1).get_state()
    changed = [{**r, "problem": "other"} if i == 11 else r for i, r in enumerate(SOURCE)]
    with pytest.raises(ValueError, match="source_fingerprint"):
        ProblemIterator(changed, seed=1).set_state(state)
    saved = ProblemIterator(SOURCE, seed=1)
    first = _ids(saved, 7)
    older = {k: v for k, v in saved.get_state().items() if k != "source_fingerprint"}
    resumed = ProblemIterator(SOURCE, seed=1)  # a state saved before states carried it
    resumed.set_state(older)
    assert _ids(resumed, 5) == _ids(ProblemIterator(SOURCE, seed=1), 12)[7:] != first[:5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="shard_index"):
        ProblemIterator(SOURCE, seed=0, shard_index=4, shard_count=4)
    with pytest.raises(ValueError, match="num_epochs"):
        ProblemIterator(SOURCE, seed=0, num_epochs=0)
    with pytest.raises(ValueError, match="empty"):
        ProblemIterator(SOURCE[:2], seed=0, shard_index=2, shard_count=3)
