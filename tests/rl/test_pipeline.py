"""Pipeline and sequential scheduling with a scripted generator and the real tiny tokenizer."""
import collections

import pytest

from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.rl.pipeline import rollout_step, trainable
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


def test_segments_resume_and_staleness_stays_within_bound():
    # The Verifier's text needs 3 segments of 32 tokens; the others fit in one.
    engine, problems, generate = _engine(segment_tokens=32, staleness_bound=2), _problems(), \
        ScriptedGenerator()
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


def test_stale_partial_rollouts_restart():
    engine, problems, generate = _engine(segment_tokens=4, staleness_bound=0), _problems(), \
        ScriptedGenerator()
    for step in range(1, 4):
        out = rollout_step(engine, problems, generate, mode="pipeline", prompts_per_step=1,
                           step=step, version=step - 1)
        assert out.groups == []  # with bound 0, nothing longer than one segment ever finishes
    assert engine.restarts > 0


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
