"""Rollout trees that end early, with a scripted generator: every Verifier passes the solution (no
Corrector is eligible), and `roles_trained='solver'` (the tree is the Solver group alone)."""
import collections

from experiments.configs import smoke
from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.rl.rollout import AgenticRollouts, RolloutConfig
from mars_jax.rl.config import rollout_config
from mars_jax.sampling import EngineOutput
from tests.rl.scripted import decode_all

TOKENIZER = tiny_tokenizer()
EOS = eos_token_ids(TOKENIZER)[0]
GROUP, FAN_OUT = 3, 2


class RoleScript:
    """Each role's whole canned text in one decode; counts requests per role."""

    def __init__(self, texts):
        self.texts, self.requests = texts, collections.Counter()

    def __call__(self, requests):
        self.requests.update(r.role for r in requests)
        ids = {role: tuple(TOKENIZER.encode(t, add_special_tokens=False)) + (EOS,)
               for role, t in self.texts.items()}
        return [EngineOutput(ids[r.role][:r.max_new_tokens], (-0.1,) * len(ids[r.role][:r.max_new_tokens]),
                                 "stop" if len(ids[r.role]) <= r.max_new_tokens else "length")
                for r in requests]


def _problems():
    i = 0
    while True:
        yield {"id": f"p{i}", "problem": "What is 2 + 3?", "answer": "5"}
        i += 1


def _engine(config: RolloutConfig) -> AgenticRollouts:
    return AgenticRollouts(TOKENIZER, config, seed=0, encode=encode_chat)


def test_when_every_verifier_passes_the_tree_ends_without_a_corrector():
    engine = _engine(RolloutConfig(group_size=GROUP, fan_out=FAN_OUT, selection="adaptive",
                                   prompt_style="compact", max_prompt_tokens=1024,
                                   max_new_tokens={"solver": 64, "verifier": 96, "corrector": 64}))
    generate = RoleScript({"solver": "2 + 3 = 5, so \\boxed{5}",
                           "verifier": "**Final Verdict:** fine.\n**List of Findings:** None\n"
                                       "**Correctness:** Correct",
                           "corrector": "2 + 3 = 5, so \\boxed{5}"})
    groups, levels = decode_all(engine, _problems(), generate, count=2)
    # By hand: 2 problems x G Solvers; then per problem FAN_OUT parents x G Verifiers; then no
    # Verifier output reports an error, so no Corrector is eligible and both trees end.
    assert levels == [collections.Counter({0: 2 * GROUP}),
                                  collections.Counter({1: 2 * FAN_OUT * GROUP})]
    assert generate.requests == {"solver": 2 * GROUP, "verifier": 2 * FAN_OUT * GROUP}
    assert sorted((g[0].problem_uid, g[0].stage) for g in groups) == (
        [("1-0", 0)] + [("1-0", 1)] * FAN_OUT + [("1-1", 0)] + [("1-1", 1)] * FAN_OUT)
    assert all(len(g) == GROUP for g in groups)
    # The solutions are right and the Verifiers say so: every reward is 1.
    assert {r.reward for g in groups for r in g} == {1.0}
    assert engine.pending == [] and engine.trees == {}  # nothing left in flight, nothing leaks
    _, levels = decode_all(engine, _problems(), generate, count=1, prefix="2")
    assert levels[0] == collections.Counter({0: GROUP})  # only the new problem's Solver


def test_roles_trained_solver_decodes_the_solver_group_only():
    config = smoke.get_config()
    config.rollout.group_size, config.rollout.roles_trained = GROUP, "solver"
    engine = _engine(rollout_config(config))
    generate = RoleScript({"solver": "2 + 3 = 6, so \\boxed{6}"})  # wrong: a Verifier would be due
    groups, _ = decode_all(engine, _problems(), generate, count=2)
    assert generate.requests == {"solver": 2 * GROUP}
    assert [g[0].stage for g in groups] == [0, 0]
    assert {r.reward for g in groups for r in g} == {0.0}
    assert engine.pending == [] and engine.trees == {}


class MixedSolvers(RoleScript):
    """Solver members in turn: right, wrong, cut by length, and one whose visible text is empty
    (all of it thinking); every Verifier reports an error; Correctors answer right."""

    SOLVERS = ["2 + 3 = 5, so \\boxed{5}", "2 + 3 = 6, so \\boxed{6}", None,
               "<think>2 + 3 = 5</think>"]

    def __call__(self, requests):
        outputs = super().__call__(requests)
        solvers = iter(self.SOLVERS * len(requests))
        for i, request in enumerate(requests):
            if request.role == "solver":
                text = next(solvers)
                if text is None:  # cut by length
                    ids = (7,) * request.max_new_tokens
                    outputs[i] = EngineOutput(ids, (-0.1,) * len(ids), "length")
                else:
                    ids = tuple(TOKENIZER.encode(text, add_special_tokens=False)) + (EOS,)
                    outputs[i] = EngineOutput(ids, (-0.1,) * len(ids), "stop")
        return outputs


def test_each_verifier_judges_its_own_parent_and_each_corrector_revises_it():
    engine = _engine(RolloutConfig(group_size=4, fan_out=2, selection="adaptive",
                                   prompt_style="compact", max_prompt_tokens=1024, max_stages=3,
                                   max_new_tokens={"solver": 64, "verifier": 96, "corrector": 64}))
    generate = MixedSolvers({"solver": "replaced", "verifier": "**Final Verdict:** a slip.\n**List of Findings:** 1.\n"
                                         "**Correctness:** Wrong",
                             "corrector": "2 + 3 = 5, so \\boxed{5}"})
    groups, _ = decode_all(engine, _problems(), generate, count=1)
    by_uid = {r.uid: r for g in groups for r in g}
    solvers, verifiers, correctors = ([r for r in by_uid.values() if r.stage == s]
                                      for s in range(3))
    assert [r.finish_reason for r in solvers] == ["stop", "stop", "length", "stop"]
    # Only the two solutions with visible text and an ending can be judged: adaptive (which
    # prefers wrong ones) must not take the empty one, nor the cut one.
    assert {by_uid[v.parent_uid].uid for v in verifiers} == {solvers[0].uid, solvers[1].uid}
    for v in verifiers:
        parent = by_uid[v.parent_uid]
        assert v.judged_correct == parent.solved
        assert v.solution == parent.text.split("<|")[0].strip()  # the visible text, no EOS
        assert v.reward == (0.0 if parent.solved else 1.0)  # every verdict is Wrong
    assert correctors  # verdict Wrong: every report is eligible
    for c in correctors:
        assert c.solution == by_uid[c.parent_uid].solution
