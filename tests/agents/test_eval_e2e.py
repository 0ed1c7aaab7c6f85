"""End to end: the V–C system on the tiny model with the real sampler, through the eval job."""
import json

import numpy as np

from experiments.configs import eval_system
from mars_jax import eval_job


def test_eval_job_on_tiny_model(tmp_path):
    config = eval_system.get_config("tiny")
    config.eval.num_problems, config.eval.num_samples = 3, 2
    config.eval.k_accept, config.eval.max_iterations, config.eval.max_retries = 1, 2, 1
    for role in ("solver", "verifier", "corrector"):
        config.eval.max_new_tokens[role] = 16
    summary = eval_job.run(config, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "eval/records.jsonl").read_text().splitlines()]
    assert len(records) == 6
    assert {(r["problem_id"], r["sample"]) for r in records} == {
        (f"arith-test-{i:05d}", s) for i in range(3) for s in range(2)}
    for r in records:
        # Every pair ends with a chosen answer or an explicit failure.
        assert r["status"] in ("accepted", "fallback", "failed")
        assert (r["status"] == "failed") == (r["failure"] is not None)
        assert r["tokens"]["solver"] > 0
    assert summary == json.loads((tmp_path / "eval/summary.json").read_text())
    by_problem = {}
    for r in records:
        by_problem.setdefault(r["problem_id"], []).append(r)
    assert summary["system_avg_at_k"] == np.mean(
        [np.mean([r["correct"] for r in rs]) for rs in by_problem.values()])
    assert summary["solver_avg_at_k"] == np.mean(
        [np.mean([r["solver_correct"] for r in rs]) for rs in by_problem.values()])
    assert summary["failed_rate"] == np.mean([r["status"] == "failed" for r in records])
