"""The engine's host side without a device: the slot scheduler driven by a scripted clock, the
slot buckets and the page allocator, against hand-checked examples."""
import dataclasses
import pathlib
import subprocess
import sys

from mars_jax.sampling.pages import PageTable
from mars_jax.sampling.scheduler import (Group, SlotScheduler, shrink_plan, slot_bucket,
                                         slot_buckets)


@dataclasses.dataclass
class _Job:
    id: int
    group: Group
    left: int          # decode steps until it finishes
    slot: int | None = None
    order: int = 0
    tokens: tuple = ()


class _Scripted(SlotScheduler):
    """Each step admits into the first free slot, then every running job decodes one token;
    a job's output is the clock when it finished."""

    def __init__(self, num_slots: int, *, admit_batch: int = 1):
        super().__init__(num_slots, admit_batch=admit_batch)
        self.clock = 0
        self.admissions: list[tuple[int, int, int]] = []  # (clock, id, slot)
        self.stop_afters: list[int] = []

    def submit(self, steps: int) -> int:
        job = _Job(self._new_id(), Group([1], waiting=1), steps)
        self._enqueue(job)
        return job.id

    def _first_free(self, job: _Job) -> int:
        return self._slots.index(None)

    def _step(self) -> bool:
        for job in self._admit_queued(self._first_free):
            self._running.add(job.id)
            self._seated(job)
            self.admissions.append((self.clock, job.id, job.slot))
        if not self._running:
            return False
        self.stop_afters.append(self._stop_after())
        self.clock += 1
        for job_id in sorted(self._running):
            job = self._requests[job_id]
            job.left -= 1
            if job.left == 0:
                self._running.discard(job_id)
                self._finish_request(job, self.clock)
        return True


def test_a_freed_slot_is_refilled_at_the_next_step():
    """2 slots, jobs of 3, 1, 2, 2 steps: job 1 ends at 1 and job 2 takes its slot; jobs 0 and 2
    end at 3, job 3 takes slot 0 and ends at 5."""
    scheduler = _Scripted(2)
    for steps in (3, 1, 2, 2):
        scheduler.submit(steps)
    assert list(scheduler.stream()) == [(1, 1), (0, 3), (2, 3), (3, 5)]
    assert scheduler.admissions == [(0, 0, 0), (0, 1, 1), (1, 2, 1), (3, 3, 0)]
    assert scheduler.in_slots() == [] and scheduler.finished() == []


def test_admission_waits_for_admit_batch_free_slots():
    """3 slots, admit_batch 2, jobs of 1, 3, 3, 1, 1 steps: job 0 frees a slot at 1, but jobs 3
    and 4 wait until two are free (at 3); the chunk ends early after 2 finishes while both slots
    are still taken, then after 1."""
    scheduler = _Scripted(3, admit_batch=2)
    for steps in (1, 3, 3, 1, 1):
        scheduler.submit(steps)
    assert dict(scheduler.stream()) == {0: 1, 1: 3, 2: 3, 3: 4, 4: 4}
    assert scheduler.admissions == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (3, 3, 0), (3, 4, 1)]
    assert scheduler.stop_afters == [2, 1, 1, 0]


def test_stop_leaves_the_rest_queued_and_a_group_prefill_goes_once_all_are_seated():
    scheduler = _Scripted(2)
    group = Group([7, 8], waiting=3, prefilled="kv")
    for _ in range(3):
        scheduler._enqueue(_Job(scheduler._new_id(), group, 2))
    steps = iter([False, True])
    assert list(scheduler.stream(stop=lambda: next(steps))) == []
    assert scheduler.in_slots() == [0, 1] and group.waiting == 1 and group.prefilled == "kv"
    assert scheduler.run() == {0: 2, 1: 2, 2: 4}
    assert group.waiting == 0 and group.prefilled is None


def test_slot_buckets_and_the_shrunk_rows():
    assert [slot_bucket(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert slot_buckets(8) == [8, 4, 2, 1]
    assert slot_buckets(8, pools=2, shards=2) == [8, 4, 2]  # a row per pool at least
    assert slot_buckets(16, pools=8, shards=8) == [16, 8]
    plan = shrink_plan([1, 5, 6], current_rows=8, row_of=lambda s: s, block_of=None)
    assert (plan.index, plan.live, plan.rows) == (
        [1, 5, 6, 1], [True, True, True, False], {1: 0, 5: 1, 6: 2})
    assert shrink_plan([1, 5, 6], current_rows=4, row_of=lambda s: s, block_of=None) is None
    # Two pools of 4 slots: slot 1 in block 0 (rows 0-1), slots 5 and 6 in block 1 (rows 2-3).
    plan = shrink_plan([1, 5, 6], current_rows=8, row_of=lambda s: s, block_of=lambda s: s // 4,
                       pools=2, shards=2)
    assert (plan.index, plan.live, plan.rows) == (
        [1, 1, 5, 6], [True, False, True, True], {1: 0, 5: 2, 6: 3})


def test_pages_are_taken_admitted_and_preempted_by_hand():
    """One pool of 4 pages of 8 positions for 2 slots."""
    pages = PageTable(num_slots=2, pools=1, pages=4, page_size=8, max_length=64)
    assert pages.grow(0, 10) and pages.table[0, :3].tolist() == [1, 2, 0]
    assert not pages.grow(1, 17) and pages.owned[1] == []  # 3 pages, 2 free: none taken
    # Slot 0's next chunk reaches 20 positions (one more page): 8 positions fit beside it, 9 not.
    assert pages.first_fit([1], 8, {0: 20}) == 1
    assert pages.first_fit([1], 9, {0: 20}) is None
    assert pages.grow(1, 8) and pages.owned[1] == [3]
    preempted = []

    def preempt(slot):
        preempted.append(slot)
        pages.release(slot)

    # Slot 0 (admitted first) needs 4 pages, 1 is free: slot 1, admitted last, gives its page.
    pages.make_room({0: (32, 1), 1: (16, 2)}, preempt)
    assert preempted == [1] and pages.table[0, :4].tolist() == [1, 2, 3, 4]
    assert pages.table[1].tolist() == [0] * 8 and pages.free == [[]]


def test_the_host_modules_import_no_jax():
    root = pathlib.Path(__file__).parents[2] / "mars_jax" / "sampling"
    code = ("import importlib.util, sys\n"
            "for name in ('scheduler', 'pages'):\n"
            f"    spec = importlib.util.spec_from_file_location(name, r'{root}/' + name + '.py')\n"
            "    module = importlib.util.module_from_spec(spec)\n"
            "    sys.modules[name] = module\n"
            "    spec.loader.exec_module(module)\n"
            "assert 'jax' not in sys.modules, 'jax imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root.parents[1])
