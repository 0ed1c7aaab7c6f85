"""`trainer.role_metrics` and `trainer.rollout_config`, against hand-computed expectations."""
import math

from experiments.configs import smoke
from mars_jax.rl.rollout import Rollout
from mars_jax.rl.trainer import role_metrics
from mars_jax.rl.config import rollout_config

CORRECT = "**Final Verdict:** fine.\n**List of Findings:** None\n**Correctness:** Correct"
WRONG = "**Final Verdict:** bad.\n**List of Findings:** Critical Error\n**Correctness:** Wrong"
CUT = "**Final Verdict:** let me"  # truncated: no verdict


VERDICTS = {CORRECT: True, WRONG: False, CUT: None}  # what grading records for each text


def _rollout(stage: int, reward: float, text: str = "", judged_correct: bool | None = None,
             length: int = 3, finish_reason: str = "stop"):
    return Rollout(uid=f"u{stage}-{reward}-{text[:5]}", problem_uid="p", stage=stage,
                   parent_uid=None, prompt_ids=[1], text=text, reward=reward,
                   judged_correct=judged_correct, verdict=VERDICTS.get(text),
                   response_ids=[7] * length, finish_reason=finish_reason)


def test_role_metrics_by_hand():
    solvers = [_rollout(0, r, length=n) for r, n in zip((1.0, 0.0, 0.0, 1.0), (2, 4, 6, 8))]
    # (judged solution correct?, verdict text, reward = verdict matches): stages 1 and 3 both count.
    verifiers = [_rollout(1, 1.0, CORRECT, True), _rollout(1, 1.0, CORRECT, True),
                 _rollout(1, 0.0, WRONG, True), _rollout(3, 1.0, WRONG, False),
                 _rollout(3, 1.0, WRONG, False), _rollout(3, 0.0, CORRECT, False),
                 _rollout(3, 0.0, CUT, False)]
    correctors = [_rollout(2, 1.0, length=1), _rollout(4, 1.0, length=2), _rollout(4, 0.0, length=6)]
    groups = [solvers, verifiers[:3], verifiers[3:], correctors[:1], correctors[1:]]
    metrics = role_metrics(groups)
    assert metrics == {
        "reward/solver": 0.5, "samples/solver": 4,
        "reward/verifier": 4 / 7, "samples/verifier": 7,
        "reward/corrector": 2 / 3, "samples/corrector": 3,
        "length/solver": 5.0, "length/verifier": 3.0, "length/corrector": 3.0,
        # 4 of the 7 verdicts are right.
        "verifier/accuracy": 4 / 7,
        # Positive = a wrong solution. Confusion matrix: TP 2 (Wrong on wrong), FN 2 (one Correct,
        # one cut output that found nothing), TN 2 (Correct on correct), FP 1 (Wrong on correct).
        # Over all 7 Verifiers the Wrong verdicts would be 3 / 7.
        "verifier/recall": 2 / 4,
        "verifier/specificity": 2 / 3,
        "verifier/balanced_accuracy": (2 / 4 + 2 / 3) / 2,
        "verifier/precision": 2 / 3,  # 3 Wrong verdicts, 2 on wrong solutions
        "verifier/pass_rate": 3 / 7,  # 3 Correct verdicts
        "verifier/no_verdict": 1 / 7,  # the cut output (finished by itself here)
        # Nothing cut off; of the 5 groups only the one-Corrector group [1.0] is all right.
        "truncated/solver": 0.0, "truncated/verifier": 0.0, "truncated/corrector": 0.0,
        "groups_all_wrong/solver": 0.0, "groups_all_wrong/verifier": 0.0,
        "groups_all_wrong/corrector": 0.0,
        "groups_all_right/solver": 0.0, "groups_all_right/verifier": 0.0,
        "groups_all_right/corrector": 1 / 2,
    }


def test_role_metrics_truncation_and_groups_without_gradient():
    cut = dict(finish_reason="length")
    groups = [[_rollout(0, 0.0, **cut), _rollout(0, 0.0)],                  # all wrong
              [_rollout(0, 1.0), _rollout(0, 1.0)],                         # all right
              [_rollout(0, 0.0, **cut), _rollout(0, 1.0)],                  # mixed
              [_rollout(1, 0.0, CUT, False, **cut), _rollout(1, 0.0, CUT, False, **cut)],
              [_rollout(1, 1.0, CORRECT, True), _rollout(1, 0.0, WRONG, True)]]
    metrics = role_metrics(groups)
    assert metrics["truncated/solver"] == 2 / 6
    assert metrics["truncated/verifier"] == 2 / 4
    assert metrics["verifier/no_verdict"] == 2 / 4  # the two cut replies
    assert (metrics["groups_all_wrong/solver"], metrics["groups_all_right/solver"]) == (1 / 3, 1 / 3)
    assert (metrics["groups_all_wrong/verifier"], metrics["groups_all_right/verifier"]) == (1 / 2, 0.0)
    assert math.isnan(metrics["truncated/corrector"])
    assert math.isnan(metrics["groups_all_wrong/corrector"])


def test_role_metrics_without_verifiers_or_wrong_solutions_are_nan():
    metrics = role_metrics([[_rollout(0, 1.0), _rollout(0, 0.0)]])
    assert (metrics["reward/solver"], metrics["samples/verifier"]) == (0.5, 0)
    for key in ("reward/verifier", "reward/corrector", "verifier/accuracy", "verifier/recall",
                "verifier/balanced_accuracy", "verifier/pass_rate", "verifier/no_verdict",
                "length/verifier"):
        assert math.isnan(metrics[key]), key
    only_correct = role_metrics([[_rollout(1, 1.0, CORRECT, True), _rollout(1, 0.0, WRONG, True)]])
    assert only_correct["verifier/accuracy"] == 0.5
    assert math.isnan(only_correct["verifier/recall"])  # no wrong solution to find
    assert all(math.isnan(v) for k, v in role_metrics([]).items() if not k.startswith("samples/"))


def test_rollout_config_maps_every_field():
    config = smoke.get_config()
    r = config.rollout
    r.group_size, r.fan_out, r.selection, r.max_stages = 6, 3, "balanced", 4
    r.max_prompt_tokens = 300
    r.truncated_reward, r.verify_truncated = 0.25, False
    r.enable_thinking, r.prompt_style = True, "full"
    r.max_new_tokens.solver, r.max_new_tokens.verifier, r.max_new_tokens.corrector = 11, 22, 33
    out = rollout_config(config)
    assert (out.group_size, out.fan_out, out.selection, out.max_stages) == (6, 3, "balanced", 4)
    assert (out.max_prompt_tokens, out.enable_thinking, out.prompt_style) == (300, True, "full")
    assert (out.truncated_reward, out.verify_truncated) == (0.25, False)
    assert out.max_new_tokens == {"solver": 11, "verifier": 22, "corrector": 33}


def test_rollout_config_solver_only_grows_no_tree_beyond_the_solver():
    config = smoke.get_config()
    config.rollout.max_stages = 5
    for roles, stages in (("solver", 1), ("all", 5), ("vc", 5)):
        config.rollout.roles_trained = roles
        assert rollout_config(config).max_stages == stages, roles
