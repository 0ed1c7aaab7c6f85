"""Pipeline and sequential scheduling with a scripted generator and the real tiny tokenizer."""
import collections
import dataclasses

import numpy as np
import pytest

from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.rl.pipeline import auto_inflight_rows, max_staleness, rollout_step, trainable
from mars_jax.rl.rollout import AgenticRollouts, GenerationOutput, RolloutConfig

TOKENIZER = tiny_tokenizer()
EOS = eos_token_ids(TOKENIZER)[0]
# Canned outputs: the Solver is wrong, the Verifier finds the error, the Corrector fixes it.
SCRIPT = {
    "solver": "x = 1 + 1 = 3, so \\boxed{3}",
    "verifier": "**Final Verdict:** wrong sum.\n**List of Findings:** none\n**Correctness:** Wrong",
    "corrector": "1 + 1 = 2, so \\boxed{2}",
}


class ScriptedGenerator:
    """Returns each role's canned text, `max_new_tokens` at a time, continuing partial outputs
    (the part already decoded is the longest prefix of the text that ends the prompt)."""

    def __init__(self):
        self.calls = []

    def __call__(self, requests):
        self.calls.append(collections.Counter(r.role for r in requests))
        outputs = []
        for r in requests:
            full = TOKENIZER.encode(SCRIPT[r.role], add_special_tokens=False) + [EOS]
            done = next(k for k in range(len(full), -1, -1)
                        if k == 0 or tuple(r.prompt_ids[-k:]) == tuple(full[:k]))
            new = full[done:done + r.max_new_tokens]
            reason = "stop" if done + len(new) == len(full) else "length"
            outputs.append(GenerationOutput(tuple(new), (-0.5,) * len(new), reason))
        return outputs


def _engine(**overrides):
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_new_tokens={"solver": 64, "verifier": 128, "corrector": 64},
                           max_prompt_tokens=1024, **overrides)
    return AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)


def _problems():
    i = 0
    while True:
        yield {"id": f"p{i}", "problem": "What is 1 + 1?", "answer": "2"}
        i += 1


def test_pipeline_batches_mix_new_problems_with_later_stages():
    engine, problems, generate = _engine(), _problems(), ScriptedGenerator()
    mixes, trained_stages = [], []
    for step in range(1, 7):
        out = rollout_step(engine, problems, generate, mode="pipeline", prompts_per_step=1,
                           step=step, version=step - 1)
        assert len(out.decode_batches) == 1
        mixes.append(dict(out.decode_batches[0]))
        trained_stages.append(sorted(g[0].stage for g in out.groups))
    # Step s decodes the Solver group of problem s and stage k of problem s - k.
    assert mixes == [{0: 2}, {0: 2, 1: 2}, {0: 2, 1: 2, 2: 2}, {0: 2, 1: 2, 2: 2, 3: 2},
                     {0: 2, 1: 2, 2: 2, 3: 2, 4: 2}, {0: 2, 1: 2, 2: 2, 3: 2, 4: 2}]
    assert trained_stages[-1] == [0, 1, 2, 3, 4]  # every stage's outputs train in the same step


def test_rewards_follow_the_script():
    engine, problems, generate = _engine(), _problems(), ScriptedGenerator()
    groups = rollout_step(engine, problems, generate, mode="sequential", prompts_per_step=1,
                          step=1, version=0).groups
    rewards = {g[0].stage: [r.reward for r in g] for g in groups}
    # Solver wrong (0), Verifier rightly says Wrong (1), Corrector right (1); Verifier2 judges a
    # correct solution as Wrong (0), and Corrector2 fixes again (1).
    assert rewards == {0: [0.0, 0.0], 1: [1.0, 1.0], 2: [1.0, 1.0], 3: [0.0, 0.0], 4: [1.0, 1.0]}


def test_segments_resume_and_staleness_is_segments_minus_one():
    # The Verifier's text needs 3 segments of 32 tokens; the others fit in one.
    engine, problems, generate = _engine(segment_tokens=32), _problems(), ScriptedGenerator()
    worst, trained = 0, collections.Counter()
    for step in range(1, 25):
        version = step - 1
        out = rollout_step(engine, problems, generate, mode="pipeline", prompts_per_step=1,
                           step=step, version=version)
        for group in out.groups:
            for r in group:
                worst = max(worst, version - r.first_version)
                trained[r.role] += 1
                assert r.text == SCRIPT[r.role]  # segments joined exactly
    assert trained["verifier"] and trained["corrector"]
    assert worst == 2


def test_sequential_mode_trains_only_complete_trajectories():
    engine, problems, generate = _engine(segment_tokens=16), _problems(), ScriptedGenerator()
    out = rollout_step(engine, problems, generate, mode="sequential", prompts_per_step=2, step=1,
                       version=0)
    assert engine.pending == [] and engine.trees == {}
    stages = collections.Counter(g[0].stage for g in out.groups)
    assert stages == {0: 2, 1: 2, 2: 2, 3: 2, 4: 2}
    # Each decode holds one stage level of both problems (2 problems x group 2 = 4 rollouts), and
    # a stage takes one decode per 16-token segment of its text (+ EOS): no level is skipped or
    # mixed with the next, none is decoded again once complete.
    segments = {role: -(-(len(TOKENIZER.encode(text, add_special_tokens=False)) + 1) // 16)
                for role, text in SCRIPT.items()}
    assert segments == {"solver": 2, "verifier": 5, "corrector": 2}  # byte-level: 27, 79, 23 bytes + EOS
    expected = [collections.Counter({stage: 4}) for stage, role in enumerate(
        ("solver", "verifier", "corrector", "verifier", "corrector")) for _ in range(segments[role])]
    assert out.decode_batches == expected


@pytest.mark.parametrize("roles, stages", [("all", {0, 1, 2, 3, 4}), ("solver", {0}),
                                           ("vc", {1, 2, 3, 4})])
def test_roles_trained(roles, stages):
    engine, problems, generate = _engine(), _problems(), ScriptedGenerator()
    groups = rollout_step(engine, problems, generate, mode="sequential", prompts_per_step=1,
                          step=1, version=0).groups
    assert {g[0].stage for g in trainable(groups, roles)} == stages


def test_state_dict_round_trip_continues_identically():
    a, problems_a, gen_a = _engine(segment_tokens=8), _problems(), ScriptedGenerator()
    for step in (1, 2):
        rollout_step(a, problems_a, gen_a, mode="pipeline", prompts_per_step=1, step=step,
                     version=step - 1)
    b = _engine(segment_tokens=8)
    b.load_state_dict(a.state_dict())
    problems_b = _problems()
    for _ in range(2):
        next(problems_b)
    out_a = rollout_step(a, problems_a, gen_a, mode="pipeline", prompts_per_step=1, step=3, version=2)
    out_b = rollout_step(b, problems_b, ScriptedGenerator(), mode="pipeline", prompts_per_step=1,
                         step=3, version=2)
    assert out_a.decode_batches == out_b.decode_batches
    assert [[r.uid for r in g] for g in out_a.groups] == [[r.uid for r in g] for g in out_b.groups]


class RoundRobinGenerator:
    """Like `ScriptedGenerator`, with several canned texts per role: a new request takes the
    role's next text in turn; a partial one continues the text its prompt ends with. With
    `routing`, each output carries expert ids [1, prompt + new tokens, 1] all equal to the
    number of the decode call (1, 2, ...)."""

    def __init__(self, texts: dict[str, list[str]], routing: bool = False):
        self.texts, self.routing, self.calls, self.turn = texts, routing, 0, collections.Counter()

    def __call__(self, requests):
        self.calls += 1
        outputs = []
        for r in requests:
            fulls = [TOKENIZER.encode(t, add_special_tokens=False) + [EOS]
                     for t in self.texts[r.role]]
            done, full = max(((k, f) for f in fulls for k in range(len(f), 0, -1)
                              if tuple(r.prompt_ids[-k:]) == tuple(f[:k])),
                             default=(0, None), key=lambda kf: kf[0])
            if full is None:
                full = fulls[self.turn[r.role] % len(fulls)]
                self.turn[r.role] += 1
            new = full[done:done + r.max_new_tokens]
            reason = "stop" if done + len(new) == len(full) else "length"
            experts = (np.full((1, len(r.prompt_ids) + len(new), 1), self.calls, np.int32)
                       if self.routing else None)
            outputs.append(GenerationOutput(tuple(new), (-0.5,) * len(new), reason, experts))
        return outputs


SOLVER_28 = "x = 1 + 1 = 3, so \\boxed{3}"  # 27 bytes + EOS = 28 tokens: 4 segments of 8
SOLVER_8 = "\\boxed{2}"                      # 9 + EOS = 10 tokens: 2 segments of 8


def test_long_outputs_finish_and_train_within_their_segments_and_staleness_counts_siblings():
    # 4 segments of 8 tokens; the pipeline trains each group 3 versions after its first segment,
    # the sibling that finished after 2 segments included (rule: K - 1 = 3 <= staleness_bound).
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_stages=1, segment_tokens=8,
                           max_new_tokens={"solver": 32, "verifier": 32, "corrector": 32})
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    generate, problems = RoundRobinGenerator({"solver": [SOLVER_28, SOLVER_8]}), _problems()
    trained_at = {}
    for step in range(1, 11):
        version = step - 1  # one update a step
        out = rollout_step(engine, problems, generate, mode="pipeline", prompts_per_step=1,
                           step=step, version=version)
        for group in out.groups:
            assert sorted(r.text for r in group) == sorted([SOLVER_28, SOLVER_8])
            assert max_staleness([group], version) == 3
            assert [version - r.first_version for r in group] == [3, 3]
            trained_at[group[0].problem_uid] = step
        assert len(engine.pending) <= 4 * config.group_size  # 4 problems in flight at most
    # Problem started at step s trains at step s + 3: every group completes, none waits longer.
    assert trained_at == {f"{s}-0": s + 3 for s in range(1, 8)}


def test_max_staleness_is_training_version_minus_the_oldest_first_segment():
    from mars_jax.rl.rollout import Rollout
    group = [Rollout(uid=f"u{i}", problem_uid="p", stage=0, parent_uid=None, prompt_ids=[1],
                     first_version=v) for i, v in enumerate((4, 2, 5))]
    assert max_staleness([group[:1], group[1:]], version=7) == 5
    assert max_staleness([], version=7) == 0


def test_max_inflight_rows_caps_admission():
    generate, problems = ScriptedGenerator(), _problems()
    engine = _engine(segment_tokens=8)
    admitted = []
    for step in range(1, 7):
        pending = len(engine.pending)
        rollout_step(engine, problems, generate, mode="pipeline", prompts_per_step=3, step=step,
                     version=step - 1, max_inflight_rows=5)
        admitted.append((pending, sum(uid.startswith(f"{step}-") for uid in engine.trees)))
    # Each problem adds a Solver group of 2 rows, admitted while fewer than 5 rows are pending:
    # from 0, 2 or 4 pending rows, 3, 2 or 1 problems; from 5 or more, none.
    assert all(started == {0: 3, 2: 2, 4: 1}.get(pending, 0) for pending, started in admitted)
    assert admitted[0] == (0, 3) and any(pending >= 5 for pending, _ in admitted)
    # The data iterator only gave away the admitted problems.
    assert next(problems)["id"] == f"p{sum(started for _, started in admitted)}"


def test_auto_inflight_rows():
    config = RolloutConfig(group_size=8, fan_out=2, max_stages=5, segment_tokens=16,
                           max_new_tokens={"solver": 64, "verifier": 32, "corrector": 16})
    # 4 problems x (8 Solver rows + 2 x 8 rows in each of 4 later stages) x 4 segments.
    assert auto_inflight_rows(config, 4) == 4 * (8 + 4 * 16) * 4
    # Solver only (16 tokens, 1 segment): the longer Verifier and Corrector budgets never decode.
    solver_only = dataclasses.replace(config, max_stages=1,
                                      max_new_tokens={"solver": 16, "verifier": 64, "corrector": 64})
    assert auto_inflight_rows(solver_only, 4) == 4 * 8


def test_routing_is_carried_across_segments_and_through_the_state_dict():
    engine = _engine(segment_tokens=8, max_stages=1)
    generate, problems = RoundRobinGenerator({"solver": [SOLVER_28]}, routing=True), _problems()
    rollout_step(engine, problems, generate, mode="pipeline", prompts_per_step=1, step=1, version=0)
    rollout_step(engine, problems, generate, mode="pipeline", prompts_per_step=1, step=2, version=1)
    partial = engine.pending[0]  # problem 1-0 after two segments (16 of its 28 tokens)
    p = len(partial.prompt_ids)
    expected = np.array([1] * (p + 8) + [2] * 8)  # the prompt and segment 1 keep decode 1's ids
    np.testing.assert_array_equal(partial.expert_ids[0, :, 0], expected)
    saved = engine.routing()
    assert set(saved) == {r.uid for r in engine.pending}  # nothing finished is waiting yet

    restored = _engine(segment_tokens=8, max_stages=1)
    restored.load_state_dict(engine.state_dict(), saved)
    for r in (engine, restored):
        rollout_step(r, _problems(), generate if r is engine else RoundRobinGenerator(
            {"solver": [SOLVER_28]}, routing=True), mode="pipeline", prompts_per_step=0, step=3,
            version=2)
    a = {r.uid: r.expert_ids for r in engine.pending}
    b = {r.uid: r.expert_ids for r in restored.pending}
    assert a.keys() == b.keys() and a
    first = next(r for r in restored.pending if r.uid == partial.uid)
    np.testing.assert_array_equal(first.expert_ids[0, :p + 16, 0], expected)
    assert len(first.expert_ids[0]) == p + 24


def _one_problem(engine, generate, steps):
    """Pipeline steps 1..steps with one problem, admitted at step 1."""
    problems = _problems()
    return [rollout_step(engine, problems, generate, mode="pipeline", prompts_per_step=int(
        step == 1), step=step, version=step - 1) for step in range(1, steps + 1)]


RIGHT_THEN_MORE = "\\boxed{2} since 1 + 1 = 2, and more"  # 16 tokens cut it after the box


@pytest.mark.parametrize("verify_truncated", [False, True])
def test_truncated_solutions_earn_truncated_reward_and_reach_a_verifier_only_if_asked(
        verify_truncated):
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_stages=2, truncated_reward=-0.5, verify_truncated=verify_truncated,
                           max_new_tokens={"solver": 16, "verifier": 128, "corrector": 64})
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    generate = RoundRobinGenerator({"solver": [RIGHT_THEN_MORE], **{k: [SCRIPT[k]] for k in
                                                                   ("verifier", "corrector")}})
    first, second = _one_problem(engine, generate, 2)
    [solver_group] = first.groups
    assert [(r.finish_reason, r.reward) for r in solver_group] == [("length", -0.5)] * 2
    assert [r.text for r in solver_group] == [RIGHT_THEN_MORE[:16]] * 2  # the box is in the text
    if verify_truncated:
        [verifier_group] = second.groups
        assert [r.judged_correct for r in verifier_group] == [False, False]  # never "solved"
        # The Verifier judges the stage's visible text (`stages.parse_solution`: stripped).
        assert all(r.solution == RIGHT_THEN_MORE[:16].strip() for r in verifier_group)
    else:
        assert second.groups == [] and engine.trees == {} and engine.pending == []


def test_a_truncated_verifier_report_has_no_verdict_earns_nothing_and_reaches_no_corrector():
    report = SCRIPT["verifier"] + "\nOn reflection, more to say."
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_stages=3, max_new_tokens={"solver": 64, "verifier": len(
                               SCRIPT["verifier"]) + 2, "corrector": 64})
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    generate = RoundRobinGenerator({"solver": [SCRIPT["solver"]], "verifier": [report],
                                    "corrector": [SCRIPT["corrector"]]})
    _, second, third = _one_problem(engine, generate, 3)
    [verifier_group] = second.groups
    # The cut text holds "**Correctness:** Wrong", right about a wrong solution: still no verdict.
    assert all(r.text.startswith(SCRIPT["verifier"]) for r in verifier_group)
    assert [(r.finish_reason, r.verdict, r.reward) for r in verifier_group] == [
        ("length", None, 0.0)] * 2
    assert third.groups == [] and engine.trees == {} and engine.pending == []


def test_with_a_template_that_opens_the_thought_only_text_after_think_close_is_read():
    from tests.data.test_tokenizer import thinking_2507_tokenizer
    tokenizer = thinking_2507_tokenizer()
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_stages=1, max_new_tokens={"solver": 64, "verifier": 64,
                                                         "corrector": 64})
    engine = AgenticRollouts(tokenizer, config, seed=0, encode=encode_chat)
    assert engine.thinking_open
    thought = "1 + 1 = \\boxed{2}"  # ends by itself, but inside the thought the prompt opened
    generate = RoundRobinGenerator({"solver": [thought, thought + "</think>So \\boxed{2}"]})
    [group] = _one_problem(engine, generate, 1)[0].groups
    assert sorted((r.finish_reason, r.reward) for r in group) == [("stop", 0.0), ("stop", 1.0)]


@pytest.mark.parametrize("verify_truncated", [False, True])
def test_truncated_corrector_outputs_reach_the_second_verifier_only_if_asked(verify_truncated):
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_stages=4, verify_truncated=verify_truncated,
                           max_new_tokens={"solver": 64, "verifier": 128, "corrector": 10})
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    generate = RoundRobinGenerator({k: [v] for k, v in SCRIPT.items()})
    steps = _one_problem(engine, generate, 4)
    [corrector_group] = steps[2].groups
    # Cut before its box: reward 0 like any truncated answer (it would have earned 1).
    assert [(r.finish_reason, r.reward) for r in corrector_group] == [("length", 0.0)] * 2
    assert [g[0].stage for g in steps[3].groups] == ([3] if verify_truncated else [])
