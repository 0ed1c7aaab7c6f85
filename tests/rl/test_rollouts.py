"""Grading, spawning and routing of `AgenticRollouts`, decoded level by level by a scripted
generator, with the real tiny tokenizer."""
import collections
import dataclasses

import numpy as np
import pytest

from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.rl.rollout import AgenticRollouts, RolloutConfig
from mars_jax.rl.streaming import auto_inflight_rows
from mars_jax.sampling import EngineOutput
from tests.rl.scripted import decode_all, decode_level

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
            outputs.append(EngineOutput(tuple(new), (-0.5,) * len(new), reason))
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


def test_rewards_follow_the_script():
    engine, problems, generate = _engine(), _problems(), ScriptedGenerator()
    groups, levels = decode_all(engine, problems, generate, count=1)
    rewards = {g[0].stage: [r.reward for r in g] for g in groups}
    # Solver wrong (0), Verifier rightly says Wrong (1), Corrector right (1); Verifier2 judges a
    # correct solution as Wrong (0), and Corrector2 fixes again (1).
    assert rewards == {0: [0.0, 0.0], 1: [1.0, 1.0], 2: [1.0, 1.0], 3: [0.0, 0.0], 4: [1.0, 1.0]}
    # One level per stage, each the stage's group of 2 (fan-out 1): a stage spawns only when the
    # one before is complete.
    assert levels == [collections.Counter({stage: 2}) for stage in range(5)]
    assert engine.pending == [] and engine.trees == {}


def test_auto_inflight_rows():
    config = RolloutConfig(group_size=8, fan_out=2, max_stages=5, max_prompt_tokens=2048,
                           max_new_tokens={"solver": 64, "verifier": 32, "corrector": 16})
    # 4 problems x (8 Solver rows + 2 x 8 rows in each of 4 later stages).
    assert auto_inflight_rows(config, 4) == 4 * (8 + 4 * 16)
    assert auto_inflight_rows(dataclasses.replace(config, max_stages=1), 4) == 4 * 8


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
            outputs.append(EngineOutput(tuple(new), (-0.5,) * len(new), reason, experts))
        return outputs


SOLVER_28 = "x = 1 + 1 = 3, so \\boxed{3}"  # 27 bytes + EOS = 28 tokens


def test_routing_is_carried_over_a_continuation_and_through_the_state_dict():
    """A rollout restored from a checkpoint mid-output (16 of its 28 tokens) keeps the routing of
    its prompt and tokens so far; its continuation adds the new positions' routing."""
    engine = _engine(max_stages=1)
    engine.add_problems([next(_problems())], ["1-0"])
    partial = engine.pending[0]
    p = len(partial.prompt_ids)
    full = TOKENIZER.encode(SOLVER_28, add_special_tokens=False) + [EOS]
    partial.response_ids, partial.logprobs = full[:16], [-0.5] * 16
    partial.expert_ids = np.full((1, p + 16, 1), 1, np.int32)  # routed by decode 1
    saved = engine.routing()
    assert set(saved) == {partial.uid}  # its sibling has decoded nothing: no routing yet

    restored = _engine(max_stages=1)
    restored.load_state_dict(engine.state_dict(), saved)
    generate = RoundRobinGenerator({"solver": [SOLVER_28]}, routing=True)
    generate.calls = 1  # the continuation is decode 2
    [group] = decode_level(restored, generate, version=1)
    first = next(r for r in group if r.uid == partial.uid)
    assert first.text == SOLVER_28 and len(first.response_ids) == 28
    expected = np.array([1] * (p + 16) + [2] * 12)
    np.testing.assert_array_equal(first.expert_ids[0, :, 0], expected)


def _one_problem(engine, generate, levels):
    """The groups each of `levels` stage levels completes, one problem added first."""
    engine.add_problems([next(_problems())], ["1-0"])
    return [decode_level(engine, generate, version) for version in range(levels)]


RIGHT_THEN_MORE = "\\boxed{2} since 1 + 1 = 2, and more"  # 16 tokens cut it after the box


@pytest.mark.parametrize("verify_truncated", [False, True])
def test_truncated_solutions_earn_truncated_reward_and_reach_a_verifier_only_if_asked(
        verify_truncated):
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_prompt_tokens=2048,
                           max_stages=2, truncated_reward=-0.5, verify_truncated=verify_truncated,
                           max_new_tokens={"solver": 16, "verifier": 128, "corrector": 64})
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    generate = RoundRobinGenerator({"solver": [RIGHT_THEN_MORE], **{k: [SCRIPT[k]] for k in
                                                                   ("verifier", "corrector")}})
    first, second = _one_problem(engine, generate, 2)
    [solver_group] = first
    assert [(r.finish_reason, r.reward) for r in solver_group] == [("length", -0.5)] * 2
    assert [r.text for r in solver_group] == [RIGHT_THEN_MORE[:16]] * 2  # the box is in the text
    if verify_truncated:
        [verifier_group] = second
        assert [r.judged_correct for r in verifier_group] == [False, False]  # never "solved"
        # The Verifier judges the stage's visible text (`stages.parse_solution`: stripped).
        assert all(r.solution == RIGHT_THEN_MORE[:16].strip() for r in verifier_group)
    else:
        assert second == [] and engine.trees == {} and engine.pending == []


def test_a_truncated_verifier_report_has_no_verdict_earns_nothing_and_reaches_no_corrector():
    report = SCRIPT["verifier"] + "\nOn reflection, more to say."
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_prompt_tokens=2048,
                           max_stages=3, max_new_tokens={"solver": 64, "verifier": len(
                               SCRIPT["verifier"]) + 2, "corrector": 64})
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    generate = RoundRobinGenerator({"solver": [SCRIPT["solver"]], "verifier": [report],
                                    "corrector": [SCRIPT["corrector"]]})
    _, second, third = _one_problem(engine, generate, 3)
    [verifier_group] = second
    # The cut text holds "**Correctness:** Wrong", right about a wrong solution: still no verdict.
    assert all(r.text.startswith(SCRIPT["verifier"]) for r in verifier_group)
    assert [(r.finish_reason, r.verdict, r.reward) for r in verifier_group] == [
        ("length", None, 0.0)] * 2
    assert third == [] and engine.trees == {} and engine.pending == []


def test_with_a_template_that_opens_the_thought_only_text_after_think_close_is_read():
    from tests.data.test_tokenizer import thinking_2507_tokenizer
    tokenizer = thinking_2507_tokenizer()
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_prompt_tokens=2048,
                           max_stages=1, max_new_tokens={"solver": 64, "verifier": 64,
                                                         "corrector": 64})
    engine = AgenticRollouts(tokenizer, config, seed=0, encode=encode_chat)
    assert engine.thinking_open
    thought = "1 + 1 = \\boxed{2}"  # ends by itself, but inside the thought the prompt opened
    generate = RoundRobinGenerator({"solver": [thought, thought + "</think>So \\boxed{2}"]})
    [group] = _one_problem(engine, generate, 1)[0]
    assert sorted((r.finish_reason, r.reward) for r in group) == [("stop", 0.0), ("stop", 1.0)]


@pytest.mark.parametrize("verify_truncated", [False, True])
def test_truncated_corrector_outputs_reach_the_second_verifier_only_if_asked(verify_truncated):
    config = RolloutConfig(group_size=2, fan_out=1, selection="random", prompt_style="compact",
                           max_prompt_tokens=2048,
                           max_stages=4, verify_truncated=verify_truncated,
                           max_new_tokens={"solver": 64, "verifier": 128, "corrector": 10})
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    generate = RoundRobinGenerator({k: [v] for k, v in SCRIPT.items()})
    steps = _one_problem(engine, generate, 4)
    [corrector_group] = steps[2]
    # Cut before its box: reward 0 like any truncated answer (it would have earned 1).
    assert [(r.finish_reason, r.reward) for r in corrector_group] == [("length", 0.0)] * 2
    assert [g[0].stage for g in steps[3]] == ([3] if verify_truncated else [])


RIGHT = "1 + 1 = 2, so \\boxed{2}"


@pytest.mark.parametrize("verifier_selection, judged", [("", {"wrong"}),
                                                        ("balanced", {"right", "wrong"})])
def test_verifier_selection_overrides_the_policy_for_the_verifier_stage_only(
        verifier_selection, judged):
    """A Solver group of 2 right and 2 wrong solutions, fan-out 2, `adaptive` selection: the
    Verifier judges the two wrong ones, or one of each under `verifier_selection='balanced'`;
    the Corrector stage stays adaptive (both its parents rightly flagged a wrong solution)."""
    config = RolloutConfig(group_size=4, fan_out=2, selection="adaptive", max_prompt_tokens=2048,
                           verifier_selection=verifier_selection, prompt_style="compact",
                           max_stages=3, max_new_tokens={"solver": 64, "verifier": 128,
                                                         "corrector": 64})
    engine = AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)
    generate = RoundRobinGenerator({"solver": [RIGHT, SCRIPT["solver"]],
                                    "verifier": [SCRIPT["verifier"]],
                                    "corrector": [SCRIPT["corrector"]]})
    [solvers], verifiers, correctors = _one_problem(engine, generate, 3)
    assert sorted(r.reward for r in solvers) == [0.0, 0.0, 1.0, 1.0]
    name = {True: "right", False: "wrong"}
    assert {name[g[0].judged_correct] for g in verifiers} == judged and len(verifiers) == 2
    assert [g[0].solution for g in correctors] == [SCRIPT["solver"]] * 2
