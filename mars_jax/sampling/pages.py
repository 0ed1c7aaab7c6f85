"""The page allocator of a paged KV cache (host side): one pool per batch shard of the slots, a slot
taking pages of its shard's pool only, page 0 of each pool its trash page. A slot owns the pages its
request has filled or fills in the next chunk. Admission takes a slot whose pool holds the request's
first chunk beside the running requests' next chunks (`first_fit`); a pool that cannot hold those
preempts its last admitted request (`make_room`).
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import numpy as np


class PageTable:
    """Pages of `pools` pools of `pages // pools` pages each for `num_slots` slots of up to
    `max_length` positions (module docstring). `table[slot]` lists its pages, 0 past them."""

    def __init__(self, *, num_slots: int, pools: int, pages: int, page_size: int,
                 max_length: int):
        self.page_size, self.pools = page_size, pools
        self.pool_pages = pages // pools
        self.pages_per_slot = -(-max_length // page_size)
        self.table = np.zeros((num_slots, self.pages_per_slot), np.int32)
        self.owned: list[list[int]] = [[] for _ in range(num_slots)]
        self.free = [list(range(self.pool_pages, 0, -1)) for _ in range(pools)]
        self._slots_per_pool = num_slots // pools

    def pool(self, slot: int) -> int:
        """The pool (batch shard) of `slot`."""
        return slot // self._slots_per_pool

    def pages_for(self, positions: int) -> int:
        """Pages that hold `positions` cache positions (at most a slot's table)."""
        return min(-(-positions // self.page_size), self.pages_per_slot)

    def grow(self, slot: int, positions: int) -> bool:
        """Extends `slot`'s pages to hold `positions`; False, taking none, if its pool is short."""
        owned, free = self.owned[slot], self.free[self.pool(slot)]
        need = self.pages_for(positions) - len(owned)
        if need > len(free):
            return False
        for _ in range(need):
            self.table[slot, len(owned)] = free[-1]
            owned.append(free.pop())
        return True

    def release(self, slot: int) -> None:
        """Frees the pages `slot` owns (its table row back to the trash page)."""
        self.free[self.pool(slot)] += self.owned[slot][::-1]
        self.owned[slot] = []
        self.table[slot] = 0

    def first_fit(self, free_slots: Iterable[int], positions: int,
                  running: dict[int, int]) -> int | None:
        """The first of `free_slots` whose pool holds `positions` beside what the `running`
        slots (slot -> positions their next chunk fills) still take, or None."""
        growth = collections.Counter()
        for slot, filled in running.items():
            growth[self.pool(slot)] += max(0, self.pages_for(filled) - len(self.owned[slot]))
        need = self.pages_for(positions)
        return next((slot for slot in free_slots
                     if need + growth[self.pool(slot)] <= len(self.free[self.pool(slot)])),
                    None)

    def make_room(self, running: dict[int, tuple[int, int]],
                  preempt: Callable[[int], None]) -> None:
        """Grows every `running` slot (slot -> (next chunk's positions, admission order)) to its
        next chunk, oldest first; when its pool runs out, calls `preempt` (which must `release`)
        on the pool's newest running slot, until it fits or was itself preempted."""
        live = dict(running)
        for slot in sorted(running, key=lambda s: running[s][1]):
            if slot not in live:  # preempted for an older one
                continue
            while not self.grow(slot, live[slot][0]):
                victim = max((s for s in live if self.pool(s) == self.pool(slot)),
                             key=lambda s: live[s][1])
                del live[victim]
                preempt(victim)
                if victim == slot:
                    break

    def insert_ids(self, slot: int, positions: int, bucket: int) -> np.ndarray:
        """Grows `slot`'s pages to `positions`; returns the `[pools, pages]` ids a `bucket`-long
        prompt cache is written to: `slot`'s in its pool, the trash page elsewhere."""
        if not self.grow(slot, positions):
            raise RuntimeError("kv_pages: no free page for a request's prefill")
        pages = self.pages_for(bucket)
        ids = np.zeros((self.pools, pages), np.int32)
        ids[self.pool(slot)] = self.table[slot, :pages]
        return ids

    def chunk_table(self, slot_of_row: dict[int, int], rows: int, span: int) -> np.ndarray:
        """A decode chunk's page table `[rows, pages]` over `span`: each row's slot's pages, else
        trash."""
        pages = span // self.page_size
        table = np.zeros((rows, pages), np.int32)
        for row, slot in slot_of_row.items():
            table[row] = self.table[slot, :pages]
        return table
