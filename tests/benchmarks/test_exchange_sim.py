"""`benchmarks/sim/exchange.py`'s parts: hosts meeting on the simulated clock (hand-computed
waits) and `SimEngine(one_chunk=True)` stepping one chunk at a time on the same clock."""
import threading

import pytest

from benchmarks.sim.cost import ProfileCost
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.exchange import Clocks


class FixedLengths:
    def __init__(self, table):
        self.table = table

    def draw(self, role, sequence_seed):
        return self.table[sequence_seed]


def _engine(one_chunk: bool) -> SimEngine:
    """One slot, 1 s a step, 0.01 s a prefilled token, chunks of 3 steps."""
    return SimEngine(ProfileCost(step_rows=(1,), step_seconds=(1.0,), prefill_per_token_s=0.01,
                                 update_per_token_s=0.0),
                     FixedLengths({0: 7}), num_slots=1, max_length=100,
                     role_of=lambda ids: "solver", answer_tokens={"solver": 2}, chunk_steps=3,
                     one_chunk=one_chunk)


@pytest.mark.parametrize("one_chunk, asks", [(False, 2), (True, 4)])
def test_one_chunk_steps_each_chunk_on_the_same_clock(one_chunk, asks):
    # 7 tokens in chunks of 3: out at the end of the third chunk, whose last 2 steps have no live
    # row (charged nothing): 7 steps after the 5-token prefill (0.05 s). Stepped chunk by chunk,
    # `stream` asks whether to stop before each chunk, else before the one step of all three.
    engine, asked = _engine(one_chunk), []
    engine.submit([7] * 5, max_new_tokens=10, seed=0, stop_ids=(1,))
    events = [(len(out.tokens), round(engine.now, 6))
              for _, out in engine.stream(stop=lambda: asked.append(1) and False)]
    assert events == [(7, 7.05)]
    assert len(asked) == asks


def test_hosts_meet_at_the_latest_clock_and_count_their_waits():
    engines = [_engine(True) for _ in range(3)]
    for engine, now in zip(engines, (1.0, 3.0, 2.5)):
        engine.now = now
    clocks, got = Clocks(engines, exchange_s=0.25), [None] * 3

    def meet(h, exchange):
        got[h] = clocks.meet(h, f"v{h}", exchange=exchange)

    for exchange, at in ((True, 3.25), (False, 3.25)):
        threads = [threading.Thread(target=meet, args=(h, exchange)) for h in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert got == [["v0", "v1", "v2"]] * 3
        assert [engine.now for engine in engines] == [at] * 3
    assert clocks.waited == [2.0, 0.0, 0.5]  # the second meeting (an update's) is not counted
    assert clocks.rounds == 1
