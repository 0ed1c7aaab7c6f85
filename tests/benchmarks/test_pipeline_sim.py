"""The paper-scale simulator's parts: cost model, length fit, simulated engine, grading stub,
and the scheduler's barriers, against hand-computed cases and independent estimates."""
import dataclasses

import numpy as np
import pytest

from benchmarks.pipeline_sim import (HARDWARE, Workload, arg_parser, ceiling_line, hardware,
                                     mesh_kv_tokens, mesh_slots, padded_tokens, paper_costs,
                                     select_rows, step_grid, update_costs, variants)
from benchmarks.sim.agents import (SimRollouts, SimTokenizer, problems, role_of_prompt,
                                   sim_encode)
from benchmarks.sim.cost import CHIPS, MeshCost, ModelCost, ProfileCost
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.lengths import LengthModel, capped_lognormal_mean
from benchmarks.sim.sync import SyncRollouts
from mars_jax.models import get_preset
from mars_jax.rewards.text import strip_thinking
from mars_jax.rl.rollout import RolloutConfig, sequence_seed
from mars_jax.rl.streaming import StreamingRollouts, StreamSettings, auto_problems_per_update


@dataclasses.dataclass
class FixedLengths:
    """Lengths by sequence seed (a hand-made table)."""

    table: dict

    def draw(self, role, sequence_seed):
        return self.table[sequence_seed]


def _settings(mode: str, *, prompts_per_step: int, samples_per_update: int,
              staleness_bound: int, max_inflight_rows: int = 16) -> StreamSettings:
    """The scheduler's settings of these tests: every group trained, the rest as named."""
    return StreamSettings(
        mode=mode, prompts_per_step=prompts_per_step, samples_per_update=samples_per_update,
        max_problems_per_update=auto_problems_per_update(prompts_per_step),
        max_inflight_rows=max_inflight_rows, staleness_bound=staleness_bound, resume="keep",
        roles_trained="all", drop_zero_variance=False, mask_truncated=False, sampling={},
        chunks_per_round=1)


def test_qwen3_30b_parameter_counts_match_the_model_card():
    # Qwen3-30B-A3B model card: 30.5B parameters in all, 3.3B activated.
    cost = ModelCost.of(get_preset("qwen3_30b_a3b"))
    assert cost.total_params == pytest.approx(30.5e9, rel=0.01)
    embedding = 151_936 * 2048
    assert cost.active_matmul_params + embedding == pytest.approx(3.3e9, rel=0.03)
    assert cost.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2


def test_experts_touched_matches_sampled_routing():
    cost = ModelCost.of(get_preset("qwen3_30b_a3b"))
    rng = np.random.default_rng(0)
    for rows in (1, 4, 32):
        sampled = np.mean([len({e for _ in range(rows)
                                for e in rng.choice(128, 8, replace=False)})
                           for _ in range(400)])
        assert cost.experts_touched(rows) == pytest.approx(sampled, rel=0.03)


@pytest.mark.parametrize("chip", ["h200", "v5p", "slow_flops"])
def test_decode_seconds_is_the_sum_of_its_steps(chip):
    model = ModelCost.of(get_preset("qwen3_30b_a3b"))
    spec = CHIPS.get(chip) or dataclasses.replace(CHIPS["h200"], peak_flops=2e12)
    mesh = MeshCost(model, spec, chips=8, step_overhead_s=1e-3)
    for rows, context, steps in ((1, 100, 7), (16, 16 * 3000, 500), (64, 64 * 20000, 2000)):
        by_step = sum(mesh.decode_step_seconds(rows, context + i * rows) for i in range(steps))
        assert mesh.decode_seconds(rows, context, steps) == pytest.approx(by_step, rel=1e-9)


def test_decode_step_seconds_by_hand():
    # 1 row, no context, one H200: only the weights one token reads (dense + 8 experts per layer).
    model = ModelCost.of(get_preset("qwen3_30b_a3b"))
    mesh = MeshCost(model, CHIPS["h200"], chips=1)
    weights = model.dense_params + 48 * 8 * model.expert_params
    assert mesh.decode_step_seconds(1, 0) == pytest.approx(weights * 2 / 4.8e12)


def test_mesh_slots_and_paged_positions_by_hand():
    # 4 chips of 10 slots' worth of HBM (a slot: 100,000 positions, 9.8 GB); a rollout submesh
    # keeps the bf16 weights' quarter (15.3 GB) per chip, the rest of 0.9 x HBM holds KV.
    model = ModelCost.of(get_preset("qwen3_30b_a3b"))
    slot = 98_304 * 100_000
    hw = dataclasses.replace(HARDWARE["h200x8"], hbm_bytes=10 * slot)
    free = 9 * slot - model.weight_bytes / 4
    assert 8 * slot > free > 7 * slot
    assert mesh_slots(hw, model, 4, resident="weights", positions=100_000) == 4 * 7
    assert mesh_kv_tokens(hw, model, 4, resident="weights") == 4 * int(free // 98_304)


def test_ceiling_by_hand():
    # Sequential 6 acc-h per 1k samples, 1 of them its update at 30% MFU; decode alone 2:
    # 6 / (1 + 2) = 2x; at 100% MFU the update is 0.3, sequential 5.3: 5.3 / 2.3 = 2.30x.
    line = ceiling_line(dict(hours_per_1k=6.0, update_hours_per_1k=1.0),
                        dict(hours_per_1k=2.0), update_mfu=0.3)
    assert line.endswith("= 2.00x sequential; with the update at 100% MFU 2.30x")


def test_capped_mean_matches_sampling_and_the_fit_hits_the_target():
    rng = np.random.default_rng(1)
    x = rng.lognormal(9.6, 0.7, size=400_000)
    assert capped_lognormal_mean(9.6, 0.7, 65536) == pytest.approx(
        np.minimum(x, 65536).mean(), rel=0.005)
    for progress, target in ((0.0, 19_000), (1.0, 28_000)):
        model = LengthModel(progress=progress)
        draws = np.array([model.draw("solver", s) for s in range(40_000)])
        assert np.minimum(draws, model.cap).mean() == pytest.approx(target, rel=0.02)
        assert (draws > model.cap).mean() == pytest.approx(model.truncated_fraction("solver"),
                                                           abs=0.005)


def test_lengths_are_reproducible_by_seed_not_by_order():
    a, b = LengthModel(seed=3), LengthModel(seed=3)
    forward = [a.draw("verifier", s) for s in range(50)]
    backward = [b.draw("verifier", s) for s in reversed(range(50))][::-1]
    assert forward == backward
    assert forward != [LengthModel(seed=4).draw("verifier", s) for s in range(50)]
    assert forward != [a.draw("corrector", s) for s in range(50)]


def _engine(lengths, slots, cost=None, answer=2):
    cost = cost or ProfileCost(step_rows=(1, 2), step_seconds=(1.0, 1.5),
                               prefill_per_token_s=0.01, update_per_token_s=0.0)
    return SimEngine(cost, lengths, num_slots=slots, max_length=100,
                     role_of=lambda ids: "solver", answer_tokens={"solver": answer})


def test_event_clock_against_a_hand_computed_schedule():
    # 2 slots; A (4 tokens), B (2), C (3); prompts of 5 tokens (prefill 0.05 s each); a step
    # takes 1 s with one live row, 1.5 s with two.
    engine = _engine(FixedLengths({0: 4, 1: 2, 2: 3}), slots=2)
    ids = [engine.submit([7] * 5, max_new_tokens=10, seed=s, stop_ids=(1,))[0] for s in range(3)]
    events = [(i, out.finish_reason, len(out.tokens), round(engine.now, 6))
              for i, out in engine.stream()]
    # A, B prefilled (0.1); 2 steps of 2 rows (3.0): B ends at 3.1; C prefilled (3.15); 2 steps
    # of 2 rows: A ends at 6.15; 1 step of 1 row: C ends at 7.15.
    assert events == [(ids[1], "stop", 2, 3.1), (ids[0], "stop", 4, 6.15),
                      (ids[2], "stop", 3, 7.15)]
    assert engine.stats["row_steps"] == 2 * 2 + 2 * 2 + 1
    assert engine.stats["decode_steps"] == 5


def test_chunked_clock_against_a_hand_computed_schedule():
    # The schedule above in chunks of 3 steps. A, B prefilled (0.1); B ends after 2 steps of 2
    # rows (3.0), A decodes the chunk's third step alone (1.0): B out at 4.1, A at 3 tokens. C
    # prefilled (4.15); A's last step beside C (1.5), C's next 2 alone (2.0): both out at 7.65.
    engine = SimEngine(ProfileCost(step_rows=(1, 2), step_seconds=(1.0, 1.5),
                                   prefill_per_token_s=0.01, update_per_token_s=0.0),
                       FixedLengths({0: 4, 1: 2, 2: 3}), num_slots=2, max_length=100,
                       role_of=lambda ids: "solver", answer_tokens={"solver": 2}, chunk_steps=3)
    ids = [engine.submit([7] * 5, max_new_tokens=10, seed=s, stop_ids=(1,))[0] for s in range(3)]
    events = [(i, out.finish_reason, len(out.tokens), round(engine.now, 6))
              for i, out in engine.stream()]
    assert events == [(ids[1], "stop", 2, 4.1), (ids[0], "stop", 4, 7.65),
                      (ids[2], "stop", 3, 7.65)]
    assert (engine.stats["decode_steps"], engine.stats["tokens"]) == (6, 4 + 2 + 3)
    assert engine.stats["live_slot_seconds"] == pytest.approx(3.0 * 2 + 1.0 + 1.5 * 2 + 2.0)
    with pytest.raises(ValueError, match="chunk_steps"):
        SimEngine(None, FixedLengths({}), num_slots=2, max_length=20, role_of=lambda ids: "s",
                  answer_tokens={}, kv_tokens=20, chunk_steps=3)


def test_group_prompt_prefilled_once_and_requests_submitted_mid_stream_run():
    engine = _engine(FixedLengths({0: 3, 1: 3, 2: 1}), slots=2)
    engine.submit([7] * 10, max_new_tokens=10, seed=0, n=2, stop_ids=(1,))
    seen = []
    for request_id, out in engine.stream():
        seen.append(request_id)
        if len(seen) == 1:
            engine.submit([7] * 10, max_new_tokens=10, seed=2, stop_ids=(1,))
    assert sorted(seen) == [0, 1, 2]
    assert engine.stats["prefill_calls"] == 2          # the group's prompt once, then request 2
    assert engine.now == pytest.approx(0.1 + 3 * 1.5 + 0.1 + 1.0)


def test_outputs_budget_and_restored_tokens():
    engine = _engine(FixedLengths({0: 30, 1: 12}), slots=2, answer=3)
    cut, = engine.submit([7] * 5, max_new_tokens=20, seed=0, stop_ids=(1,))
    ends, = engine.submit([7] * 5, max_new_tokens=20, seed=1, stop_ids=(1,))
    outputs = dict(engine.stream())
    assert outputs[cut].finish_reason == "length"
    assert 1 not in outputs[cut].tokens and len(outputs[cut].tokens) == 20
    assert (outputs[ends].finish_reason, len(outputs[ends].tokens)) == ("stop", 12)
    final = outputs[ends].tokens
    assert final[-1] == 1
    text = SimTokenizer().decode(final, skip_special_tokens=True)
    assert strip_thinking(text, thinking_open=True).split() == ["x"] * 3
    # A restored partial output continues: its tokens come first and count against the budget.
    engine = _engine(FixedLengths({5: 12}), slots=1)
    rid, = engine.submit([7] * 5, max_new_tokens=20, seed=5, stop_ids=(1,),
                         generated=([9] * 4, [-0.5] * 4))
    (_, out), = list(engine.stream())
    assert out.tokens[:4] == [9] * 4 and out.logprobs[:4] == [-0.5] * 4 and len(out.tokens) == 12
    assert engine.stats["prefill_tokens"] == 5 + 4


def _rollouts(rates, seed=0, group=8):
    config = RolloutConfig(group_size=group, fan_out=2, max_stages=5,
                           max_new_tokens={r: 64 for r in ("solver", "verifier", "corrector")},
                           max_prompt_tokens=2048, enable_thinking=True)
    return SimRollouts(SimTokenizer(), config, seed=seed, encode=sim_encode, correct_rates=rates)


def test_grading_stub_rates_and_consistent_verifier_rewards():
    rollouts = _rollouts({"solver": 0.6, "verifier": 0.8, "corrector": 0.5})
    assert rollouts.thinking_open
    rights = [rollouts._right(f"p{i}/s0/{j}", "solver") for i in range(300) for j in range(8)]
    assert np.mean(rights) == pytest.approx(0.6, abs=0.03)
    from mars_jax.rl.rollout import Rollout
    finished = [Rollout(uid=f"p/s1/{i}", problem_uid="p", stage=1, parent_uid="x", prompt_ids=[6],
                        judged_correct=bool(i % 2), finish_reason="stop") for i in range(2000)]
    finished.append(Rollout(uid="p/s1/t", problem_uid="p", stage=1, parent_uid="x",
                            prompt_ids=[6], judged_correct=True, finish_reason="length"))
    rollouts._grade(finished)
    done = finished[:-1]
    assert all(r.reward == float(r.verdict == r.judged_correct) for r in done)
    assert np.mean([r.reward for r in done]) == pytest.approx(0.8, abs=0.03)
    assert finished[-1].verdict is None and finished[-1].reward == 0.0


def test_prompts_carry_their_role_and_the_visible_parent_text():
    tokenizer = SimTokenizer()
    from mars_jax.agents import prompts
    solver = sim_encode(tokenizer, prompts.solver_messages("a b c", "full"), enable_thinking=True)
    verifier = sim_encode(tokenizer, prompts.verifier_messages("a b c", "x x x", "full"))
    assert role_of_prompt(solver) == "solver" and role_of_prompt(verifier) == "verifier"
    assert solver[-1] == 2  # the generation prompt opens <think>


def _schedule(mode):
    """A small run of the streaming scheduler on the simulated engine; records the role of each submission and whether
    a Solver was still in flight then."""
    rollouts = _rollouts({"solver": 0.6, "verifier": 0.8, "corrector": 0.5}, group=4)
    lengths = LengthModel(cap=64, solver_mean_start=20, solver_mean_end=20, sigma=0.7)
    cost = ProfileCost(step_rows=(1, 8), step_seconds=(1.0, 2.0), prefill_per_token_s=0.0,
                       update_per_token_s=0.0)
    engine = SimEngine(cost, lengths, num_slots=8, max_length=4096, role_of=role_of_prompt,
                       answer_tokens={"solver": 3, "verifier": 2, "corrector": 3})
    log = []
    submit = engine.submit

    def logged(prompt_ids, **kwargs):
        solvers_running = sum(r.role == "solver" for r in engine._requests.values())
        log.append((role_of_prompt(prompt_ids), solvers_running))
        return submit(prompt_ids, **kwargs)

    engine.submit = logged
    scheduler = StreamingRollouts(
        rollouts, engine, problems(5), _settings(
            mode, prompts_per_step=3, samples_per_update=60, staleness_bound=4), stop_ids=(1,), clock=engine.clock)
    keys = []
    for version in range(4):
        batch = scheduler.collect(version)
        keys += [g[0].group_key for g in batch.groups]
        scheduler.weights_updated(None, version + 1)
    return log, keys


def test_pipeline_streams_stages_and_sequential_keeps_the_barrier():
    log, keys = _schedule("pipeline")
    assert any(role != "solver" and solvers for role, solvers in log)
    log, keys = _schedule("sequential")
    assert keys and all(not solvers for role, solvers in log if role != "solver")
    assert len(set(keys)) == len(keys)  # every group trained once


def test_padded_tokens_by_hand():
    """Rows longest first in micro-batches of 2, each cut to 128 / 256 / 512 (width 512)."""
    assert padded_tokens([90, 300, 10, 100, 20], 2, 128) == [512, 512, 128, 128, 128, 128]
    assert padded_tokens([200, 60], 4, 128) == [256] * 4


def test_byte_level_sim_tokens_count_bytes():
    tokenizer = SimTokenizer(byte_level=True)
    ids = tokenizer.word_ids("What is 7 + 3?")
    assert len(ids) == len("What is 7 + 3? ")  # each word and its space
    assert tokenizer.decode(ids, skip_special_tokens=True) == "What is 7 + 3?"


def test_step_grid_parses_both_forms_and_needs_every_pair():
    assert step_grid("1:12,4:20") == ((1, 4), (), (0.012, 0.02))
    assert step_grid("1@128:10,4@128:20,1@512:14,4@512:40") == (
        (1, 4), (128, 512), (0.01, 0.014, 0.02, 0.04))
    with pytest.raises(ValueError, match="missing"):
        step_grid("1@128:10,4@128:20,1@512:14")
    with pytest.raises(ValueError, match="or none"):
        step_grid("1@128:10,4:20")


def test_profile_cost_grid_interpolates_in_log2_rows_and_span():
    cost = ProfileCost(step_rows=(1, 4), step_seconds=(0.01, 0.014, 0.02, 0.04),
                       step_spans=(128, 512), engine_buckets=True,
                       prefill_per_token_s=0.0, update_per_token_s=0.0)
    assert cost.decode_step_seconds(1, bucket=1, span=128) == pytest.approx(0.01)
    # 2 rows: halfway in log2 between 1 and 4 -> 0.015 at span 128, 0.027 at 512; span 256 is
    # halfway in log2 between those: 0.021.
    assert cost.decode_step_seconds(3, bucket=2, span=256) == pytest.approx(0.021)
    assert cost.decode_step_seconds(3, bucket=4, span=4096) == pytest.approx(0.04)  # flat beyond
    assert cost.decode_seconds(3, 0, 10, bucket=2, span=128) == pytest.approx(0.15)


def test_update_cost_per_token_by_row_length():
    assert update_costs("1.5") == [(0, 0.0015)]
    by_length = update_costs("1024:3,256:1")
    assert by_length == [(256, 0.001), (1024, 0.003)]
    cost = ProfileCost(step_rows=(1,), step_seconds=(0.01,), prefill_per_token_s=0.0,
                       update_per_token_s=0.003, update_lengths=(256, 1024),
                       update_per_token_by_length=(0.001, 0.003))
    # 512 is halfway in log2: 2 ms per token; beyond the ends the end values hold.
    assert cost.update_seconds(512) == pytest.approx(512 * 0.002)
    assert cost.update_seconds(128) == pytest.approx(128 * 0.001)
    assert cost.update_seconds(4096) == pytest.approx(4096 * 0.003)


class _Recorder:
    """A cost model that records what each decode interval is charged for."""

    def __init__(self):
        self.calls = []

    def decode_seconds(self, rows, context_tokens, steps, *, bucket=None, span=None):
        self.calls.append((rows, bucket, span, steps))
        return float(steps)

    def prefill_seconds(self, tokens, context_before=0):
        return 0.0


def test_paged_kv_admits_by_context_and_preempts_the_last_admitted():
    # A pool of 20 positions, 2 rows at most; A and B of 8 tokens on 5-token prompts (own
    # groups, prefill 0.05 s each); a step takes 1 s with one row, 1.5 s with two.
    cost = ProfileCost(step_rows=(1, 2), step_seconds=(1.0, 1.5), prefill_per_token_s=0.01,
                       update_per_token_s=0.0)
    engine = SimEngine(cost, FixedLengths({0: 8, 1: 8}), num_slots=2, max_length=20,
                       role_of=lambda ids: "solver", answer_tokens={"solver": 2}, kv_tokens=20)
    a, b = (engine.submit([7] * 5, max_new_tokens=10, seed=s, stop_ids=(1,))[0] for s in (0, 1))
    events = [(i, out.finish_reason, len(out.tokens), round(engine.now, 6))
              for i, out in engine.stream()]
    # Both admitted (5 + 5 positions); 5 steps of 2 rows fill the pool (20) at 7.6 s; B, admitted
    # last, is preempted; A's last 3 steps alone end it at 10.6; B comes back with its 10
    # positions re-prefilled (0.1 s) and ends 3 steps later.
    assert events == [(a, "stop", 8, 10.6), (b, "stop", 8, 13.7)]
    assert engine.stats["preemptions"] == 1
    assert engine.stats["prefill_tokens"] == 5 + 5 + 10


def test_paged_kv_reserving_the_budget_admits_later_and_never_preempts():
    # The pool and requests above, with kv_reserve=1: A claims 5 + 10 = 15 positions, so B (15
    # more) waits; A alone ends at 0.05 + 8 x 1 s; B is then prefilled (0.05) and runs 8 steps.
    cost = ProfileCost(step_rows=(1, 2), step_seconds=(1.0, 1.5), prefill_per_token_s=0.01,
                       update_per_token_s=0.0)
    engine = SimEngine(cost, FixedLengths({0: 8, 1: 8}), num_slots=2, max_length=20,
                       role_of=lambda ids: "solver", answer_tokens={"solver": 2}, kv_tokens=20,
                       kv_reserve=1.0)
    a, b = (engine.submit([7] * 5, max_new_tokens=10, seed=s, stop_ids=(1,))[0] for s in (0, 1))
    events = [(i, out.finish_reason, len(out.tokens), round(engine.now, 6))
              for i, out in engine.stream()]
    assert events == [(a, "stop", 8, 8.05), (b, "stop", 8, 16.1)]
    assert engine.stats["preemptions"] == 0


def test_paged_kv_needs_room_for_one_request():
    with pytest.raises(ValueError, match="kv_tokens"):
        SimEngine(None, FixedLengths({}), num_slots=2, max_length=20, role_of=lambda ids: "s",
                  answer_tokens={}, kv_tokens=19)
    with pytest.raises(ValueError, match="kv_reserve"):
        SimEngine(None, FixedLengths({}), num_slots=2, max_length=20, role_of=lambda ids: "s",
                  answer_tokens={}, kv_tokens=20, kv_reserve=1.5)


def test_sim_engine_charges_the_slot_bucket_and_span_the_engine_decodes():
    # 4 slots, 5 requests of 2, 4, 6, 8, 3 tokens with 300-token prompts (span 384 = 3 * 2^7).
    # Request 4 waits until request 0 ends; then 4, 3, 2, 1 rows run in buckets 4, 4, 2, 1.
    cost = _Recorder()
    engine = SimEngine(cost, FixedLengths({0: 2, 1: 4, 2: 6, 3: 8, 4: 3}), num_slots=4,
                       max_length=1024, role_of=lambda ids: "solver", answer_tokens={})
    for s in range(5):
        engine.submit([7] * 300, max_new_tokens=10, seed=s, stop_ids=(1,))
    list(engine.stream())
    assert cost.calls == [(4, 4, 384, 2), (4, 4, 384, 2), (3, 4, 384, 1), (2, 2, 384, 1),
                          (1, 1, 384, 2)]


class ScriptedLengths:
    """Output lengths by (problem, stage) of a run seeded 0 whose stages spawn one group each
    (fan-out 1): the sequence seeds of `rl.rollout.sequence_seed` mapped back."""

    def __init__(self, table: dict):
        self.by_seed = {sequence_seed(0, f"{problem}/s{stage}/0") + member: length
                        for (problem, stage), length in table.items() for member in range(2)}

    def draw(self, role, sequence_seed):
        return self.by_seed[sequence_seed]


def _barrier_log(schedule, mode):
    """Two steps of two problems, groups of 2, fan-out 1, 3 stages (S, V, C: every Solver wrong,
    every verdict right, so each problem runs all three). Problem A (p0, p2) outputs 10 tokens at
    every stage, B (p1, p3) 4. A decode step takes 1 s whatever the rows, prefill nothing, 8
    slots (never full); the update takes 5 s. Returns (submission time, problem, stage) per
    request group and the clock when each collect returned."""
    config = RolloutConfig(group_size=2, fan_out=1, max_stages=3,
                           max_new_tokens={r: 64 for r in ("solver", "verifier", "corrector")},
                           max_prompt_tokens=2048, enable_thinking=True)
    rollouts = SimRollouts(SimTokenizer(), config, seed=0, encode=sim_encode,
                           correct_rates={"solver": 0.0, "verifier": 1.0, "corrector": 0.5})
    lengths = ScriptedLengths({(f"p{n}", stage): 10 if n % 2 == 0 else 4
                               for n in range(4) for stage in range(3)})
    cost = ProfileCost(step_rows=(1, 8), step_seconds=(1.0, 1.0), prefill_per_token_s=0.0,
                       update_per_token_s=0.0)
    engine = SimEngine(cost, lengths, num_slots=8, max_length=4096, role_of=role_of_prompt,
                       answer_tokens={"solver": 2, "verifier": 2, "corrector": 2})
    scheduler = schedule(
        rollouts, engine, problems(5), _settings(
            mode, prompts_per_step=2, samples_per_update=1, staleness_bound=1), stop_ids=(1,), clock=engine.clock)
    log, returned = [], []
    submit = scheduler._submit

    def logged(version, **kwargs):
        for r in scheduler.rollouts.pending[::2]:  # one entry per group of 2
            log.append((engine.now, r.problem_uid, r.stage))
        submit(version, **kwargs)

    scheduler._submit = logged
    for version in range(2):
        scheduler.collect(version)
        returned.append(engine.now)
        engine.advance(5.0)
        scheduler.weights_updated(None, version + 1)
    return log, returned


def test_sync_has_one_barrier_per_step_and_none_between_stages():
    # By hand, step 1: both Solver groups start at 0; B's ends at 4 and its Verifier starts at
    # once (before A's Solver ends at 10, A's Corrector at 30), ends at 8, its Corrector runs
    # 8-12; A's Verifier runs 10-20, its Corrector 20-30. The update runs 30-35; step 2
    # repeats the pattern from 35 and nothing of it starts earlier.
    log, returned = _barrier_log(SyncRollouts, "sequential")
    assert log == [(0.0, "p0", 0), (0.0, "p1", 0), (4.0, "p1", 1), (8.0, "p1", 2),
                   (10.0, "p0", 1), (20.0, "p0", 2),
                   (35.0, "p2", 0), (35.0, "p3", 0), (39.0, "p3", 1), (43.0, "p3", 2),
                   (45.0, "p2", 1), (55.0, "p2", 2)]
    assert returned == [30.0, 65.0]
    # The sequential mode holds B's Verifier until every Solver ended (10), B's Corrector until
    # every Verifier ended (20; B's groups spawned first, so submitted first): the same step
    # length here, other start times.
    log, returned = _barrier_log(StreamingRollouts, "sequential")
    assert log[:6] == [(0.0, "p0", 0), (0.0, "p1", 0), (10.0, "p1", 1), (10.0, "p0", 1),
                       (20.0, "p1", 2), (20.0, "p0", 2)]
    assert returned == [30.0, 65.0]


def test_sync_refuses_pipeline_mode():
    with pytest.raises(ValueError, match="sequential"):
        SyncRollouts(_rollouts({"solver": 0.5, "verifier": 0.5, "corrector": 0.5}), None,
                     problems(5), _settings("pipeline", prompts_per_step=1, samples_per_update=1,
                                            max_inflight_rows=1, staleness_bound=1),
                     stop_ids=(1,))


def test_every_row_can_be_selected_though_labels_hold_commas():
    labels = [v.label for v in variants(HARDWARE["v5p-64"])]
    assert "sequential, KV freed" in labels and "sync" in labels
    for label in labels:
        assert select_rows(label, labels) == [label]
    assert select_rows(",".join(labels), labels) == labels
    assert select_rows("sequential, KV freed,sync", labels) == ["sequential, KV freed", "sync"]
    with pytest.raises(ValueError, match="KV kept"):
        select_rows("sequential,KV kept", labels)


def test_hardware_names_and_the_offload_charged_at_the_host_link():
    assert hardware("h200x64").chips == 64 and hardware("v5p-1024").chips == 512
    assert hardware("h200x8") == HARDWARE["h200x8"]
    with pytest.raises(ValueError, match="h200xN"):
        hardware("a100x8")
    # 8 x H200: AdamW's mu and nu (4 B x 30.53B parameters) over 8 PCIe Gen5 links at 64 GB/s,
    # to the device and back: 2 x 122.1 GB / 512 GB/s = 0.477 s per update.
    args = arg_parser().parse_args([])
    rows = {v.label: v for v in variants(HARDWARE["h200x8"])}
    model = ModelCost.of(get_preset("qwen3_30b_a3b"))
    sync = paper_costs(HARDWARE["h200x8"], rows["sync"], args, Workload())
    assert sync.offload_seconds == pytest.approx(2 * 4 * model.total_params / (8 * 64e9))
    assert sync.offload_seconds == pytest.approx(0.477, abs=0.001)
    sequential = paper_costs(HARDWARE["h200x8"], rows["sequential"], args, Workload())
    assert sequential.offload_seconds == 0
    # Slots: 0.9 x 141 GiB less the bf16 weights' eighth, in slots of 9.66 GB: 13 a GPU, against
    # 3 a GPU beside the train state and the update's temporaries.
    assert (sync.slots, sequential.slots) == (104, 24)
    # With the slot cache to the host and back as well: 104 slots x 98,304 positions x 98,304 B
    # over the same links, 2 x 1.005 TB / 512 GB/s = 3.93 s more.
    kv_to_host = paper_costs(HARDWARE["h200x8"], rows["pipeline, KV to host"], args, Workload())
    assert kv_to_host.offload_seconds - sync.offload_seconds == pytest.approx(
        2 * 104 * 98_304 * 98_304 / (8 * 64e9))
