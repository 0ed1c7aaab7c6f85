"""Host scheduling of continuous batching (queue, prompt groups, slots, admission, slot buckets) in
plain Python, so a simulated clock (`benchmarks/sim`) can drive it as well as `engine.Engine`.
Admission is first come, first served, once `_admission_size` slots are free; requests of one
`submit` share a `Group` whose prompt is prefilled once.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from mars_jax.buckets import pow2_at_least


@dataclasses.dataclass
class Group:
    """A prompt shared by `waiting` queued requests; `prefilled` kept until all have a slot."""

    prompt: list[int]
    waiting: int
    prefilled: Any = None


class Request(Protocol):
    """What the scheduler reads and writes of a request."""

    id: int
    group: Any     # has `prefilled`
    slot: int | None
    order: int     # admission count when it last took a slot


def bucket_rows(per_block: int, *, pools: int = 1, shards: int = 1) -> int:
    """Rows of a slot bucket: `per_block` in each of `pools` blocks, a multiple of `shards`."""
    return -(-per_block * pools // shards) * shards


def slot_bucket(rows: int, *, pools: int = 1, shards: int = 1) -> int:
    """The smallest slot bucket (a power of two per block) holding `rows` requests a block."""
    return bucket_rows(pow2_at_least(rows, 1), pools=pools, shards=shards)


def slot_buckets(num_slots: int, *, pools: int = 1, shards: int = 1) -> list[int]:
    """Every slot bucket `shrink_plan` can leave, largest (all slots) first."""
    sizes, per_block = {num_slots}, 1
    while (rows := bucket_rows(per_block, pools=pools, shards=shards)) <= num_slots // 2:
        sizes.add(rows)
        per_block *= 2
    return sorted(sizes, reverse=True)


@dataclasses.dataclass(frozen=True)
class ShrinkPlan:
    """Rows of a smaller slot bucket: `index[i]` is the current row that row i copies, `live[i]`
    whether it holds a running request (the others idle), `rows` each slot's new row."""

    index: list[int]
    live: list[bool]
    rows: dict[int, int]


def shrink_plan(slots: list[int], *, current_rows: int, row_of: Callable[[int], int],
                block_of: Callable[[int], int], pools: int = 1, shards: int = 1
                ) -> ShrinkPlan | None:
    """The smaller bucket for running `slots` if one at most half of `current_rows` holds them,
    each page pool's slots in its own block of rows; else None."""
    blocks: list[list[int]] = [[] for _ in range(pools)]
    for slot in slots:
        blocks[block_of(slot) if pools > 1 else 0].append(slot)
    target = slot_bucket(max(map(len, blocks)), pools=pools, shards=shards)
    if target > current_rows // 2:
        return None
    stride = target // pools
    index, live, rows = [row_of(min(slots))] * target, [False] * target, {}
    for b, members in enumerate(blocks):
        for j, slot in enumerate(members):
            index[b * stride + j], live[b * stride + j] = row_of(slot), True
            rows[slot] = b * stride + j
    return ShrinkPlan(index, live, rows)


class SlotScheduler:
    """Requests queued for `num_slots` decode slots; subclasses implement `_step`."""

    def __init__(self, num_slots: int, *, admit_batch: int = 1):
        self.num_slots, self.admit_batch = num_slots, max(1, admit_batch)
        self._queue: collections.deque = collections.deque()
        self._requests: dict[int, Any] = {}
        self._slots: list[int | None] = [None] * num_slots  # request id per slot
        self._running: set[int] = set()                      # ids of the requests decoding
        self._done: collections.deque[tuple[int, Any]] = collections.deque()
        self._next_id = 0
        self._admissions = 0

    def in_slots(self) -> list[int]:
        """Ids of the requests holding a slot (decoding), by slot."""
        return [i for i in self._slots if i is not None]

    def finished(self) -> list[tuple[int, Any]]:
        """Takes the outputs that finished but were not yet yielded by `stream`."""
        done = list(self._done)
        self._done.clear()
        return done

    def stream(self, stop: Callable[[], bool] | None = None) -> Iterator[tuple[int, Any]]:
        """Runs until no request decodes (or `stop()` after a chunk), yielding `(id, output)` as
        each ends."""
        while True:
            while self._done:
                yield self._done.popleft()
            if stop is not None and stop():
                return
            if not self._step():
                return

    def run(self) -> dict[int, Any]:
        """Drains everything submitted; outputs by request id."""
        return dict(self.stream())

    def _step(self) -> bool:
        """Admits what fits and decodes one chunk (or event); False when no request runs."""
        raise NotImplementedError

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _enqueue(self, request: Request) -> None:
        self._requests[request.id] = request
        self._queue.append(request)

    def _drop_prefills(self) -> None:
        """Forgets the group prompt prefills of queued requests (made under old weights)."""
        for request in self._queue:
            request.group.prefilled = None

    def _admission_size(self) -> int:
        """Free slots wanted before admitting: one if the next request's prompt is already
        prefilled, else `admit_batch`, or fewer if fewer requests wait."""
        if self._queue and self._queue[0].group.prefilled is not None:
            return 1
        return min(self.admit_batch, len(self._queue))

    def _stop_after(self) -> int:
        """Finishes after which the next chunk ends early (0: never): enough for an admission."""
        if not self._queue:
            return 0
        return max(1, self._admission_size() - self._slots.count(None))

    def _admit_queued(self, place: Callable[[Any], int | None]) -> list:
        """Once `_admission_size` slots are free (or nothing runs), seats queued requests in
        order where `place(request)` finds room, until it returns None; returns them."""
        if not self._queue or (self._running
                               and self._slots.count(None) < self._admission_size()):
            return []
        admitted = []
        while self._queue and None in self._slots:
            slot = place(self._queue[0])
            if slot is None:
                break
            request = self._queue.popleft()
            self._slots[slot], request.slot = request.id, slot
            self._admissions += 1
            request.order = self._admissions
            admitted.append(request)
        return admitted

    def _prefill_plan(self, admitted: list, ahead: int) -> tuple[list[Group], list]:
        """What admitting `admitted` prefills: the fresh requests' unprefilled groups, topped up
        to `ahead` from the queue; and the requests continuing from tokens."""
        fresh = [r for r in admitted if not r.tokens]
        continued = [r for r in admitted if r.tokens]
        groups = list({id(r.group): r.group for r in fresh
                       if r.group.prefilled is None}.values())
        if groups or continued:
            seen, count = {id(g) for g in groups}, ahead - len(groups) - len(continued)
            for request in self._queue:
                if count <= 0:
                    break
                group = request.group
                if not request.tokens and group.prefilled is None and id(group) not in seen:
                    seen.add(id(group))
                    groups.append(group)
                    count -= 1
        return groups, continued

    def _seated(self, request: Request) -> None:
        """Counts `request` as having its slot; its group's prefill goes once all have one."""
        request.group.waiting -= 1
        if request.group.waiting == 0:
            request.group.prefilled = None

    def _vacate(self, slot: int) -> None:
        """Frees `slot`."""
        self._slots[slot] = None

    def _requeue(self, request: Request) -> None:
        """Stops a running request and frees its slot; it waits at the front of the queue."""
        self._running.discard(request.id)
        self._vacate(request.slot)
        request.slot = None
        self._queue.appendleft(request)

    def _finish_request(self, request: Request, output: Any) -> None:
        """Queues `output` for `stream` and forgets `request` (its slot freed)."""
        self._done.append((request.id, output))
        if request.slot is not None:
            self._vacate(request.slot)
        del self._requests[request.id]
