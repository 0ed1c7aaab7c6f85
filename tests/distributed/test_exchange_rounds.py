"""`StreamSettings(chunks_per_round=k)` in pipeline mode exchanges with the other hosts once
every k engine chunks (`benchmarks/sim/exchange.py` measures what that saves), and trains the
groups that exchanging every chunk trains (one host, the scripted engine of test_streaming)."""
import pytest

from tests.rl.test_streaming import ScriptedEngine, _stream, _trained_keys

UPDATES = 12


class CountedHosts:
    """One host's `distributed.HostGroup` that counts its exchanges."""

    count, index, seconds = 1, 0, 0.0

    def __init__(self):
        self.rounds = 0

    def gather(self, value) -> list:
        self.rounds += 1
        return [value]


def _run(chunks_per_round: int) -> tuple[set, set, int, int]:
    engine, hosts = ScriptedEngine(), CountedHosts()
    keys, done = _trained_keys(_stream("pipeline", engine, hosts=hosts,
                                       chunks_per_round=chunks_per_round), UPDATES)
    chunks = engine.stats["slot_steps"] // (engine.num_slots * engine.chunk_steps)
    return keys, done, chunks, hosts.rounds


@pytest.mark.parametrize("k", [3, 8])
def test_pipeline_exchanges_once_every_k_chunks_and_trains_the_same_groups(k):
    keys, done, chunks, rounds = _run(k)
    decoding_rounds = rounds - UPDATES  # each collect ends on an exchange that decodes nothing
    assert k * (decoding_rounds - UPDATES) < chunks <= k * decoding_rounds
    every_chunk_keys, every_chunk_done, every_chunk, _ = _run(1)
    both = done & every_chunk_done
    assert len(both) >= 4
    assert ({key for key in keys if key[0] in both}
            == {key for key in every_chunk_keys if key[0] in both})


def test_chunks_per_round_must_be_positive():
    with pytest.raises(ValueError, match="chunks_per_round: must be >= 1, got 0"):
        _stream("pipeline", ScriptedEngine(), chunks_per_round=0)
