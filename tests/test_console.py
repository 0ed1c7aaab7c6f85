"""The console summary of a run, against hand-computed numbers from a hand-written metrics.jsonl."""
import json

from mars_jax import console


def _write(workdir, rows):
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_reports_steps_samples_rewards_and_paths(tmp_path):
    solver = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9]  # 8 steps: windows of 2
    rows = [{"step": i + 1, "reward/solver": r, "samples/solver": 8, "samples/verifier": 4,
             "samples/corrector": 0, "samples/trained": 10, "policy_version": i + 1,
             "reward/verifier": 0.5 if i else None, "reward/corrector": None,
             "truncated/solver": 0.0, "truncated/verifier": 0.25 * (i > 5),
             "verifier/no_verdict": 0.5 if i else None}
            for i, r in enumerate(solver)]
    probe = {"step": 0, "probe/solver_accuracy": 0.5}  # before training: not a step
    _write(tmp_path, rows[::-1] + [probe])  # read back in step order whatever the file order
    text = console.summary(tmp_path, ["python", "experiments/run.py", "--workdir=/a b"], 12.0)
    assert "8 steps to step 8 (policy version 8)" in text
    assert "solver 64 · verifier 32 · corrector 0 (80 in the loss)" in text
    assert "first 2 steps -> last 2 steps" in text
    assert "solver          0.150 -> 0.800 (+0.650)" in text  # (0.1+0.2)/2, (0.7+0.9)/2
    assert "verifier        0.500 -> 0.500 (+0.000)" in text  # step 1 has no Verifier reward
    assert "    corrector" not in text  # no Corrector reward at any step: no line
    assert "cut off by the token budget (no reward), first 2 -> last 2 steps" in text
    assert "    solver          0% -> 0%" in text
    assert "    verifier        0% -> 25%" in text  # steps 7 and 8 cut a quarter off
    assert "Verifier replies without a readable verdict, cut off or not (no reward)\n" \
           "    verifier        50% -> 50%" in text  # step 1 had no Verifier: left out
    assert f"metrics      {tmp_path / 'metrics.jsonl'}" in text
    assert f"tensorboard --logdir {tmp_path / 'tensorboard'}" in text
    assert f"checkpoints  {tmp_path / 'checkpoints'}" in text
    assert "resume       python experiments/run.py '--workdir=/a b'" in text


def test_summary_without_metrics_says_so(tmp_path):
    assert "no steps recorded" in console.summary(tmp_path, ["python"], 0.0)


def test_postfix_shows_the_roles_that_had_samples():
    metrics = {"reward/solver": 0.25, "reward/verifier": float("nan"), "reward/corrector": 1.0,
               "truncated/solver": 0.0, "truncated/corrector": 0.75}
    assert console.postfix(metrics) == {"solver": "0.25", "corrector": "1.00 cut 75%"}
    verifier = {"reward/verifier": 0.25, "truncated/verifier": 0.1, "verifier/no_verdict": 0.4}
    assert console.postfix(verifier) == {"verifier": "0.25 cut 10% no verdict 40%"}
    assert console.postfix({**verifier, "verifier/no_verdict": 0.0}) == {"verifier": "0.25 cut 10%"}


def test_a_line_cut_short_by_a_crash_ends_what_is_read(tmp_path):
    _write(tmp_path, [{"step": 1, "reward/solver": 0.5}, {"step": 2, "reward/solver": 0.25}])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/sol')
    assert [row["step"] for row in console.read_metrics(tmp_path)] == [1, 2]


def test_metrics_writer_keeps_the_checkpointed_steps_and_starts_over_without_one(tmp_path):
    from mars_jax.metrics import MetricsWriter
    _write(tmp_path, [{"step": 0, "probe": 0.5}, {"step": 1, "a": 1}, {"step": 2, "a": 2}])
    MetricsWriter(tmp_path, resume_step=1, tensorboard=False)
    assert [row["step"] for row in console.read_metrics(tmp_path)] == [0, 1]
    writer = MetricsWriter(tmp_path, resume_step=-1, tensorboard=False)  # nothing restored
    writer.write(0, {"probe": 0.5})
    assert console.read_metrics(tmp_path) == [{"step": 0, "probe": 0.5}]  # one step-0 row
