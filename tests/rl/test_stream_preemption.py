"""A streaming scheduler stopped by a preemption notice between decode rounds, its queues saved
as arrays (`queue_arrays`) and restored, trains what the uninterrupted one trains: in pipeline and
sequential mode on the scripted engine, mid-collect on the real `Engine`, and from a `collect`
whose groups are put back (an update stopped half-way). The queues' round trip through a
checkpoint is exact."""
import json

import numpy as np
import pytest

from mars_jax import distributed
from mars_jax.checkpoint import Checkpointer
from mars_jax.models import create_model, get_preset
from mars_jax.preemption import Stopped
from mars_jax.rl import queue_arrays
from tests.rl.test_streaming import (TOKENIZER, ScriptedEngine, _perturbed, _problems, _rollouts,
                                     _real_stream, _stream)


def _decode(ids):
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def _through_json(state: dict) -> dict:
    """`state` packed, its JSON part through text and its arrays through `host_blocks`, then
    unpacked: what a checkpoint of one process stores and reads back."""
    packed, arrays = queue_arrays.pack(state)
    blocks = {name: x.copy() for name, x in queue_arrays.host_blocks(arrays).items()}
    return queue_arrays.unpack(json.loads(json.dumps(packed)),
                               queue_arrays.from_host_blocks(blocks), _decode)


class _StopAt:
    """should_stop: True from its `at`-th call on."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.at


def _collect(stream, versions, record: list, model=None) -> None:
    """One list per update of (uid, response ids, reward, logprobs) trained; with `model`, the
    weights perturbed after each update (the real engine)."""
    for version in versions:
        batch = stream.collect(version)
        record.append([(r.uid, tuple(r.response_ids), r.reward, np.asarray(r.logprobs))
                       for g in batch.groups for r in g])
        if model is not None:
            model = _perturbed(model, version)
        stream.weights_updated(model, version + 1)


def _problems_after(taken: int):
    problems = _problems()
    for _ in range(taken):
        next(problems)
    return problems


def _same(a: list, b: list, atol: float = 0.0) -> None:
    assert [[t[:3] for t in update] for update in a] == [[t[:3] for t in update] for update in b]
    for x, y in zip(sum(a, []), sum(b, [])):
        np.testing.assert_allclose(x[3], y[3], atol=atol, rtol=0)


@pytest.mark.parametrize("mode, stop_at", [("pipeline", 200), ("sequential", 700)])
def test_a_stream_stopped_between_rounds_and_restored_trains_what_the_uninterrupted_one_trains(
        mode, stop_at):
    whole = []
    _collect(_stream(mode, ScriptedEngine()), range(6), whole)

    first = []
    stream = _stream(mode, ScriptedEngine(), should_stop=_StopAt(stop_at))
    with pytest.raises(Stopped):
        _collect(stream, range(6), first)
    assert 0 < len(first) < 6  # stopped mid-run, inside a collect
    assert any(stream.engine.partial(i)[0] for i in stream._inflight)  # mid-output
    state = _through_json(stream.state_dict())
    assert state == stream.state_dict()
    restored = _stream(mode, ScriptedEngine(), problems=_problems_after(stream.problems_admitted))
    restored.load_state_dict(state)
    _collect(restored, range(len(first), 6), first)
    _same(first, whole)
    if mode == "sequential":  # the restored requests finish before the next level starts
        for kind, role, unfinished in restored.engine.events:
            if kind == "submit":
                assert unfinished <= {role}, (role, unfinished)


def test_groups_put_back_after_a_collect_are_handed_out_again():
    """The state an update stopped half-way saves: the restored scheduler's next collect hands
    out the same groups, and what follows is the uninterrupted run's."""
    whole = []
    _collect(_stream("pipeline", ScriptedEngine()), range(5), whole)

    first = []
    stream = _stream("pipeline", ScriptedEngine())
    _collect(stream, range(2), first)
    stream.collect(2)  # its update is stopped: nothing recorded, nothing trained
    state = _through_json(stream.state_dict(put_back=True))
    with pytest.raises(ValueError, match="put_back"):
        stream.weights_updated(None, 3)
        stream.state_dict(put_back=True)
    restored = _stream("pipeline", ScriptedEngine(),
                       problems=_problems_after(stream.problems_admitted))
    restored.load_state_dict(state)
    _collect(restored, range(2, 5), first)
    _same(first, whole)


def test_a_real_engine_stream_stopped_mid_collect_and_restored_decodes_the_same_tokens():
    """On the real engine a request in flight is re-prefilled on restore, where the uninterrupted
    run goes on from the KV its decode wrote: the same tokens, log-probabilities to 1e-5."""
    model = create_model(get_preset("tiny"), seed=0)
    problem_list = [{"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}
                    for i in range(64)]
    whole = []
    _collect(_real_stream(model, iter(problem_list)), range(5), whole, model)

    first, moved = [], model
    stream = _real_stream(model, iter(problem_list))
    _collect(stream, range(3), first, model)
    for version in range(3):
        moved = _perturbed(moved, version)
    stream.should_stop = _StopAt(3)
    with pytest.raises(Stopped):
        stream.collect(3)
    assert any(stream.engine.partial(i)[0] for i in stream._inflight)
    state = _through_json(stream.state_dict())
    restored = _real_stream(moved, iter(problem_list[stream.problems_admitted:]))
    restored.load_state_dict(state)
    _collect(restored, range(3, 5), first, moved)
    _same(first, whole, atol=1e-5)


def test_queues_round_trip_exactly_through_a_checkpoint(tmp_path):
    """A stream's state mid-run (requests in flight, ready groups, trees) and the per-step
    rollouts' (`AgenticRollouts`) through `host_arrays`, orbax and back: equal, texts
    re-derived from the ids."""
    stream = _stream("pipeline", ScriptedEngine())
    _collect(stream, range(2), [])
    stream.collect(2)
    rollouts = _rollouts()
    rollouts.add_problems([next(_problems())], ["p0"])
    requests = rollouts.pending[:2]
    for r in requests:
        r.response_ids, r.logprobs = [5, 6, 7], [-0.25, -1.5, -3.125]
    rollouts.pending = requests
    states = {"stream": stream.state_dict(put_back=True), "rollouts": rollouts.state_dict()}
    assert states["stream"]["ready"] and states["stream"]["rollouts"]["trees"]

    checkpointer = Checkpointer(tmp_path / "checkpoints", async_save=False)
    meta, arrays = {}, {}
    for key, state in states.items():
        meta[key], packed = queue_arrays.pack(state)
        assert {n: x.dtype for n, x in packed.items()} == {
            "prompt_ids": np.int32, "response_ids": np.int32, "logprobs": np.float32}
        meta[f"{key}_index"], arrays[key] = distributed.host_arrays(
            queue_arrays.host_blocks(packed))
    checkpointer.save(1, {"x": np.zeros(2)}, meta, arrays=arrays)
    _, _, saved, read = checkpointer.restore_latest(
        {"x": np.zeros(2)}, arrays_target=lambda saved: {
            key: distributed.host_arrays_target(saved[f"{key}_index"]) for key in states})
    checkpointer.close()
    for key, state in states.items():
        blocks = distributed.unpack_host_arrays(saved[f"{key}_index"], read[key])
        assert queue_arrays.unpack(saved[key], queue_arrays.from_host_blocks(blocks),
                                   _decode) == state, key
