"""The streaming scheduler: agent-granularity admission on a scripted continuous-batching engine
(pipeline vs sequential barriers, the same groups trained), the staleness bound, and an exact
restore of requests in flight on the real `Engine`."""
import collections
import dataclasses
import itertools
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.models import create_model, get_preset
from mars_jax.rl.batching import make_batch
from mars_jax.rl.rollout import AgenticRollouts, RolloutConfig
from mars_jax.rl.samples import training_samples
from mars_jax.rl.streaming import StreamingRollouts, StreamSettings
from mars_jax.sampling import Engine

TOKENIZER = tiny_tokenizer()
EOS = eos_token_ids(TOKENIZER)[0]


def _role(prompt_ids) -> str:
    text = TOKENIZER.decode(list(prompt_ids))
    return ("verifier" if "Check the solution" in text
            else "corrector" if "Fix it using the report" in text else "solver")


def _script(role: str, seed: int) -> list[int]:
    """A role's output for a sequence seed: right or wrong by the seed, padded to a long-tailed
    length by the seed, then the stop token."""
    text = {"solver": ("1 + 1 = 2, so \\boxed{2}" if seed % 3 == 0 else "1 + 1 = 3, so \\boxed{3}"),
            "verifier": ("**Final Verdict:** ok.\n**List of Findings:** none\n**Correctness:** "
                         + ("Correct" if seed % 2 else "Wrong")),
            "corrector": "so \\boxed{2}"}[role]
    pad = [4, 6, 9, 14, 40][zlib.crc32(str(seed).encode()) % 5]
    return TOKENIZER.encode(text + " " * pad, add_special_tokens=False) + [EOS]


@dataclasses.dataclass
class _Out:
    tokens: list
    logprobs: list
    finish_reason: str
    expert_ids: None = None


class ScriptedEngine:
    """Continuous batching over `num_slots` slots, one token per slot per step, `chunk_steps` steps
    per chunk, FIFO admission, outputs of a chunk streamed in submission order. Logs every
    submission and finish with the roles unfinished at that moment."""

    def __init__(self, num_slots: int = 4, chunk_steps: int = 4):
        self.num_slots, self.chunk_steps = num_slots, chunk_steps
        self.stats = collections.Counter()
        self.queue, self.running, self.requests, self.done = [], [], {}, []
        self.events, self.next_id = [], 0

    def submit(self, prompt_ids, *, max_new_tokens, seed, n=1, generated=None, **_):
        ids = []
        for i in range(n):
            role = _role(prompt_ids)
            script = _script(role, seed + i)[:max_new_tokens]
            made = list(generated[0]) if generated else []
            self.requests[self.next_id] = dict(role=role, script=script, made=made)
            self.events.append(("submit", role, self._unfinished_roles()))
            self.queue.append(self.next_id)
            ids.append(self.next_id)
            self.next_id += 1
        return ids

    def _unfinished_roles(self):
        return {self.requests[i]["role"] for i in self.queue + self.running}

    def stream(self, stop=None):
        while True:
            while self.done:
                yield self.done.pop(0)
            if stop is not None and stop():
                return
            while self.queue and len(self.running) < self.num_slots:
                self.running.append(self.queue.pop(0))
            if not self.running:
                return
            for _ in range(self.chunk_steps):
                self.stats["slot_steps"] += self.num_slots
                for i in self.running:
                    r = self.requests[i]
                    if len(r["made"]) < len(r["script"]):
                        r["made"].append(r["script"][len(r["made"])])
                        self.stats["tokens"] += 1
            for i in sorted(self.running):
                r = self.requests[i]
                if len(r["made"]) == len(r["script"]):
                    self.running.remove(i)
                    reason = "stop" if r["made"][-1] == EOS else "length"
                    self.events.append(("finish", r["role"], self._unfinished_roles()))
                    self.done.append((i, _Out(list(r["made"]), [-0.5] * len(r["made"]), reason)))

    def finished(self):
        done, self.done = self.done, []
        return done

    def in_slots(self):
        return list(self.running)

    def partial(self, request_id):
        made = self.requests[request_id]["made"]
        return list(made), [-0.5] * len(made)

    def recompute(self, request_ids):
        self.stats["recomputes"] += len(request_ids)

    def update_weights(self, model):
        pass

    def free_kv(self):
        self.stats["kv_frees"] += 1


def _problems():
    for i in itertools.count():
        yield {"id": f"q{i}", "problem": f"What is 1 + 1? ({i})", "answer": "2"}


def _rollouts(group_size=4, max_stages=5, seed=0, cls=AgenticRollouts):
    config = RolloutConfig(group_size=group_size, fan_out=2, selection="balanced",
                           prompt_style="compact", max_stages=max_stages,
                           max_new_tokens={"solver": 96, "verifier": 160, "corrector": 96},
                           max_prompt_tokens=1024)
    return cls(TOKENIZER, config, seed=seed, encode=encode_chat)


def _stream(mode, engine, rollouts=None, problems=None, **overrides):
    """A scheduler; `overrides` set `StreamSettings` fields or `StreamingRollouts` keywords."""
    fields = {f.name for f in dataclasses.fields(StreamSettings)}
    settings = StreamSettings(**{
        **dict(mode=mode, prompts_per_step=2, samples_per_update=8, max_problems_per_update=8,
               max_inflight_rows=48,
               staleness_bound=2, resume="recompute", roles_trained="all",
               drop_zero_variance=False, mask_truncated=False,
               sampling=dict(temperature=1.0, top_p=1.0, top_k=0),
               chunks_per_round=1),
        **{k: v for k, v in overrides.items() if k in fields}})
    keywords = {k: v for k, v in overrides.items() if k not in fields}
    return StreamingRollouts(rollouts or _rollouts(), engine, problems or _problems(), settings,
                             **{"stop_ids": (EOS,), **keywords})


def _trained_keys(stream, updates):
    keys, problems = set(), set()
    for version in range(updates):
        batch = stream.collect(version)
        keys |= {g[0].group_key for g in batch.groups}
        stream.weights_updated(None, version + 1)
    live = {r.problem_uid for r in stream._untrained()} | set(stream.rollouts.trees)
    done = {f"p{i}" for i in range(stream.problems_admitted)} - live
    return {k for k in keys if k[0] in done}, done


def test_pipeline_submits_a_verifier_while_another_problems_solver_runs_and_sequential_never():
    pipeline_engine, sequential_engine = ScriptedEngine(), ScriptedEngine()
    _trained_keys(_stream("pipeline", pipeline_engine), 6)
    _trained_keys(_stream("sequential", sequential_engine), 3)
    early = [unfinished for kind, role, unfinished in pipeline_engine.events
             if kind == "submit" and role == "verifier" and "solver" in unfinished]
    assert early, "pipeline mode never overlapped a Verifier with another problem's Solver"
    for kind, role, unfinished in sequential_engine.events:
        if kind == "submit":
            assert unfinished <= {role}, (role, unfinished)


def test_both_modes_train_the_same_groups_of_the_problems_both_finished():
    pipeline_keys, pipeline_done = _trained_keys(_stream("pipeline", ScriptedEngine()), 12)
    sequential_keys, sequential_done = _trained_keys(_stream("sequential", ScriptedEngine()), 6)
    both = pipeline_done & sequential_done
    assert len(both) >= 4
    stages = collections.Counter(k[1] for k in pipeline_keys if k[0] in both)
    assert set(stages) == {0, 1, 2, 3, 4}  # the script reaches every stage
    assert ({k for k in pipeline_keys if k[0] in both}
            == {k for k in sequential_keys if k[0] in both})


def test_an_update_waits_until_no_rollout_to_train_lags_beyond_the_staleness_bound():
    for bound in (0, 1):
        stream = _stream("pipeline", ScriptedEngine(), staleness_bound=bound)
        seen = []
        for version in range(8):
            seen += stream.collect(version).staleness
            stream.weights_updated(None, version + 1)
        assert max(seen) == bound  # reached, never passed


def test_a_restored_stream_holds_the_update_for_a_stale_request_as_the_uninterrupted_one_does():
    """The checkpoint falls where groups completed during an overlapped update already fill the
    next one while a request submitted before it is still decoding: with bound 1 the next update
    must wait for it, whether it is in the engine or restored and not yet resubmitted."""
    def advance(stream, version):
        stream.collect(version)
        chunks = iter(range(40))
        stream.decode_while(lambda: next(chunks, None) is not None, version)
        stream.weights_updated(None, version + 1)

    def trained(stream, versions):
        return [[(r.uid, version - r.first_version) for g in stream.collect(version).groups
                 for r in g] for version in versions]

    uninterrupted = _stream("pipeline", ScriptedEngine(), staleness_bound=1)
    first = _stream("pipeline", ScriptedEngine(), staleness_bound=1)
    for version in range(3):
        advance(uninterrupted, version)
        advance(first, version)
    assert first._ready_samples() >= first.samples_per_update
    assert not first._due_here(3)  # the state this test is about
    problems = _problems()
    for _ in range(first.problems_admitted):
        next(problems)
    restored = _stream("pipeline", ScriptedEngine(), problems=problems, staleness_bound=1)
    restored.load_state_dict(first.state_dict())

    whole = trained(uninterrupted, range(3, 6))
    assert trained(restored, range(3, 6)) == whole
    assert max(s for batch in whole for _, s in batch) == 1


def test_sequential_batches_complete_every_trajectory_before_an_update():
    stream = _stream("sequential", ScriptedEngine())
    for version in range(3):
        batch = stream.collect(version)
        assert not stream._inflight and not stream.rollouts.trees and batch.staleness
        assert set(batch.staleness) == {0}


class _SeededGrades(AgenticRollouts):
    """Rewards by uid (the real model's text is noise): 0/1 per rollout, a verdict per report."""

    def _grade(self, finished):
        for r in finished:
            r.reward = float(zlib.crc32(r.uid.encode()) % 2)
            if r.role == "verifier":
                r.verdict = bool(zlib.crc32(r.uid.encode()) % 3)


def _perturbed(model, version):
    graphdef, params = nnx.split(model)
    noise = jax.tree.map(lambda p: 0.02 * jax.random.normal(jax.random.key(version), p.shape,
                                                            p.dtype), params)
    return nnx.merge(graphdef, jax.tree.map(lambda p, n: p + n, params, noise))


def _real_stream(model, problems, **paging):
    engine = Engine(model, num_slots=4, max_length=512, chunk_steps=4, seed=7, **paging)
    rollouts = _rollouts(group_size=2, max_stages=3, cls=_SeededGrades)
    config = dataclasses.replace(rollouts.config,
                                 max_new_tokens={"solver": 22, "verifier": 30, "corrector": 26},
                                 max_prompt_tokens=480, verify_truncated=True)
    rollouts.config = config
    return _stream("pipeline", engine, rollouts, problems, samples_per_update=4,
                   max_inflight_rows=6, staleness_bound=3)


def _trained(batch):
    return [(r.uid, tuple(r.response_ids), np.asarray(r.logprobs)) for g in batch.groups
            for r in g]


@pytest.mark.parametrize("paging", [{}, dict(kv_pages=40, page_size=16)])
def test_a_restored_stream_with_requests_in_flight_trains_what_the_uninterrupted_one_trains(
        paging):
    """Also on a pool of 40 pages of 16 positions, which holds fewer rows than the 4 slots:
    requests wait for pages or are preempted and re-prefilled."""
    model = create_model(get_preset("tiny"), seed=0)
    problem_list = [{"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}
                    for i in range(64)]

    def run(model, stream, versions, record):
        for version in versions:
            record += _trained(stream.collect(version))
            model = _perturbed(model, version)
            stream.weights_updated(model, version + 1)
        return model

    whole = []
    uninterrupted = _real_stream(model, iter(problem_list), **paging)
    run(model, uninterrupted, range(7), whole)

    first = []
    stream = _real_stream(model, iter(problem_list), **paging)
    moved = run(model, stream, range(5), first)
    assert stream._inflight and any(stream.engine.partial(i)[0] for i in stream._inflight)
    state = stream.state_dict()
    restored = _real_stream(moved, iter(problem_list[stream.problems_admitted:]), **paging)
    restored.load_state_dict(state)
    run(moved, restored, range(5, 7), first)

    assert [(u, t) for u, t, _ in first] == [(u, t) for u, t, _ in whole]
    if paging:
        assert uninterrupted.engine.stats["preemptions"] > 0
    for (_, _, a), (_, _, b) in zip(first, whole):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("resume", ["recompute", "keep"])
def test_after_an_update_requests_in_slots_are_recomputed_or_kept(resume):
    engine = ScriptedEngine()
    stream = _stream("pipeline", engine, resume=resume)
    seen = 0
    for version in range(4):
        stream.collect(version)
        in_slots = len(engine.in_slots())
        seen += in_slots
        before = engine.stats["recomputes"]
        stream.weights_updated(None, version + 1)
        assert engine.stats["recomputes"] - before == (in_slots if resume == "recompute" else 0)
    assert seen  # some update found requests mid-decode


@pytest.mark.parametrize("resume", ["recompute", "keep"])
def test_the_kv_cache_leaves_for_an_update_only_where_nothing_is_lost(resume):
    """'recompute': always; 'keep': only while no request holds a slot."""
    engine = ScriptedEngine()
    stream = _stream("pipeline", engine, resume=resume)
    outcomes = set()
    for version in range(4):
        stream.collect(version)
        before, held = engine.stats["kv_frees"], bool(engine.in_slots())
        stream.free_kv()
        freed = engine.stats["kv_frees"] - before == 1
        assert freed == (resume == "recompute" or not held)
        outcomes.add(held)
        stream.weights_updated(None, version + 1)
    assert True in outcomes


@pytest.mark.parametrize("paging", [{}, dict(kv_pages=40, page_size=16)])
def test_freeing_the_kv_cache_for_each_update_trains_what_keeping_it_trains(paging):
    """With requests in slots at every update: their KV deleted before it and re-prefilled
    after it (the colocated run's `free_kv`) against the cache kept through it; both recompute
    under the new weights (`resume='recompute'`)."""
    model = create_model(get_preset("tiny"), seed=0)
    problem_list = [{"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}
                    for i in range(64)]

    def run(free):
        stream = _real_stream(model, iter(problem_list), **paging)
        current, record, held = model, [], 0
        for version in range(7):  # requests hold slots at the updates from version 4 on
            record += _trained(stream.collect(version))
            held += len(stream.engine.in_slots())
            if free:
                stream.free_kv()
            current = _perturbed(current, version)
            stream.weights_updated(current, version + 1)
        return record, held

    kept, held = run(free=False)
    freed, _ = run(free=True)
    assert held and [(u, t) for u, t, _ in freed] == [(u, t) for u, t, _ in kept]
    for (_, _, a), (_, _, b) in zip(freed, kept):
        np.testing.assert_allclose(a, b, atol=1e-5)


class _GroupsEngine(ScriptedEngine):
    """ScriptedEngine whose i-th submitted group decodes `groups[i]`: per member (boxed answer,
    cut off by its budget)."""

    def __init__(self, groups):
        super().__init__(num_slots=8)
        self.groups = iter(groups)

    def submit(self, prompt_ids, *, n=1, **kwargs):
        ids = super().submit(prompt_ids, n=n, **kwargs)
        for request_id, (answer, cut) in zip(ids, next(self.groups), strict=True):
            tokens = TOKENIZER.encode(f"so \\boxed{{{answer}}}", add_special_tokens=False)
            self.requests[request_id]["script"] = tokens if cut else tokens + [EOS]
        return ids


@pytest.mark.parametrize("mode", ["pipeline", "sequential"])
def test_an_update_is_due_by_the_samples_the_batch_builder_trains(mode):
    """By hand, answer 2 right, 3 wrong, a cut output 0: group 0 (all right) trains nothing
    (zero variance), group 1 [1, 0, cut, 1] three outputs (the cut one masked), group 2
    [1, 0, 0, 1] four. With 4 samples due per update, group 1 alone (four outputs, three
    trained) is not enough: the update takes groups 0-2, seven rows, and the scheduler counts
    the rows the batch builder makes."""
    engine = _GroupsEngine([[(2, False)] * 4, [(2, False), (3, False), (2, True), (2, False)],
                            [(2, False), (3, False), (3, False), (2, False)],
                            [(2, False)] * 4])  # pipeline mode admits it before the update
    stream = _stream(mode, engine, _rollouts(max_stages=1), prompts_per_step=1,
                     samples_per_update=4, max_inflight_rows=4, roles_trained="solver",
                     drop_zero_variance=True, mask_truncated=True)
    batch = stream.collect(0)
    samples = training_samples(batch.groups, rules=stream.rules, normalize_std=True)
    rows = make_batch(samples, micro_batch_size=4).attention_mask.any(-1).sum()
    assert len(batch.staleness) == rows  # the scheduler's count of trained samples
    assert rows == len(samples) == 7
    assert [sorted(r.reward for r in g) for g in batch.groups] == [[1.0] * 4, [0, 0, 1, 1],
                                                                   [0, 0, 1, 1]]


def test_pipeline_updates_after_its_share_of_problems_though_no_group_trains():
    """Every answer right: each group's rewards are equal, so with `drop_zero_variance` no group
    trains anything and the samples due never come. The update comes after
    `max_problems_per_update` (3) problems all the same, empty, and the next 3 follow: without
    the cap the scheduler admitted problems forever (here: past the engine's 9 groups)."""
    engine = _GroupsEngine([[(2, False)] * 4] * 9)
    stream = _stream("pipeline", engine, _rollouts(max_stages=1), prompts_per_step=1,
                     samples_per_update=4, max_problems_per_update=3, max_inflight_rows=4,
                     roles_trained="solver", drop_zero_variance=True)
    for version in range(3):
        batch = stream.collect(version)
        assert (batch.problems_admitted, stream.problems_admitted) == (3, 3 * (version + 1))
        assert batch.staleness == []  # no trained sample
        assert not training_samples(batch.groups, rules=stream.rules, normalize_std=True)
        stream.weights_updated(None, version + 1)
