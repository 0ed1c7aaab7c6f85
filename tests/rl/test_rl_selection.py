"""Parent selection policies for the Verifier and Corrector stages."""

import numpy as np
import pytest

from mars_jax.rl.selection import POLICIES, Candidate, select_parents

SEEDS = range(40)


def _sol(*correct):
    return [Candidate(is_correct=c) for c in correct]


def _pick(cands, stage, policy, fan_out=2, seed=0):
    return select_parents(cands, stage=stage, fan_out=fan_out, policy=policy,
                          rng=np.random.default_rng(seed))


def _n_wrong(cands, idx):
    return sum(not cands[i].is_correct for i in idx)


# Verifier reports: (judged solution correct?, verdict)
REPORTS = [
    Candidate(True, True),    # 0 correctly passed        -> not eligible
    Candidate(False, False),  # 1 rightly found error     -> preferred
    Candidate(True, False),   # 2 wrongly flagged         -> eligible
    Candidate(False, None),   # 3 unparseable             -> not eligible
    Candidate(False, True),   # 4 missed error            -> not eligible
    Candidate(True, False),   # 5 wrongly flagged
    Candidate(False, False),  # 6 rightly found error
    Candidate(True, None),    # 7 unparseable
    Candidate(True, False),   # 8 wrongly flagged
]
RIGHTLY, WRONGLY = {1, 6}, {2, 5, 8}


@pytest.mark.parametrize("seed", SEEDS)
def test_verifier_balanced_equal_counts(seed):
    cands = _sol(True, False, True, True, False, False, True)
    for fan_out in (2, 4, 6):
        idx = _pick(cands, "verifier", "balanced", fan_out, seed)
        assert len(idx) == len(set(idx)) == fan_out
        assert _n_wrong(cands, idx) == fan_out // 2


@pytest.mark.parametrize("seed", SEEDS)
def test_verifier_balanced_fills_from_other_side(seed):
    one_wrong = _sol(True, True, False, True, True)
    idx = _pick(one_wrong, "verifier", "balanced", 4, seed)
    assert len(idx) == 4 and 2 in idx
    all_correct = _sol(True, True, True)
    assert len(_pick(all_correct, "verifier", "balanced", 2, seed)) == 2
    assert _pick(_sol(False), "verifier", "balanced", 2, seed) == [0]


def test_verifier_balanced_odd_fan_out_splits_extra_randomly():
    cands = _sol(True, False, True, False, True, False, True, False)
    wrong_counts = {_n_wrong(cands, _pick(cands, "verifier", "balanced", 3, s)) for s in SEEDS}
    assert wrong_counts == {1, 2}


@pytest.mark.parametrize("seed", SEEDS)
def test_verifier_adaptive_prefers_wrong(seed):
    cands = _sol(True, False, True, True, False, True)
    assert _pick(cands, "verifier", "adaptive", 2, seed) == [1, 4]
    idx = _pick(cands, "verifier", "adaptive", 3, seed)
    assert {1, 4} <= set(idx) and len(idx) == 3
    assert len(_pick(_sol(True, True, True), "verifier", "adaptive", 2, seed)) == 2


def test_random_policy_uniform_over_all_solutions():
    cands = _sol(True, False, True, True, False, True)
    picks = [_pick(cands, "verifier", "random", 2, s) for s in SEEDS]
    assert all(len(p) == len(set(p)) == 2 for p in picks)
    assert set().union(*picks) == set(range(6))
    assert {_n_wrong(cands, p) for p in picks} == {0, 1, 2}  # not balanced, not adaptive


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fan_out", [1, 2, 3, 5, 10])
def test_corrector_only_error_found_reports(policy, fan_out):
    for seed in SEEDS:
        idx = _pick(REPORTS, "corrector", policy, fan_out, seed)
        assert all(REPORTS[i].verdict is False for i in idx)
        assert len(idx) == len(set(idx)) == min(fan_out, 5)
    assert _pick([Candidate(True, True), Candidate(False, None)], "corrector", policy, 2) == []


@pytest.mark.parametrize("seed", SEEDS)
def test_corrector_adaptive_prefers_rightly_flagged(seed):
    assert set(_pick(REPORTS, "corrector", "adaptive", 2, seed)) == RIGHTLY
    idx = set(_pick(REPORTS, "corrector", "adaptive", 3, seed))
    assert RIGHTLY <= idx and len(idx & WRONGLY) == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_corrector_balanced_equal_rightly_and_wrongly_flagged(seed):
    for fan_out in (2, 4):
        idx = set(_pick(REPORTS, "corrector", "balanced", fan_out, seed))
        assert len(idx & RIGHTLY) == len(idx & WRONGLY) == fan_out // 2


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("stage", ["verifier", "corrector"])
def test_reproducible_given_rng(policy, stage):
    cands = REPORTS * 3
    runs = [[_pick(cands, stage, policy, 3, s) for s in SEEDS] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(p) for p in runs[0]}) > 1  # the rng actually matters


def test_default_fan_out_and_errors():
    cands = _sol(True, False, True, False)
    assert len(select_parents(cands, stage="verifier", policy="random", rng=np.random.default_rng(0))) == 2
    with pytest.raises(ValueError, match="random.*balanced.*adaptive"):
        _pick(cands, "verifier", "greedy")
    with pytest.raises(ValueError, match="verifier"):
        _pick(cands, "solver", "random")
    with pytest.raises(ValueError, match="fan_out"):
        _pick(cands, "verifier", "random", -1)
