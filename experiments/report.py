r"""Tables 1–2 in miniature, with 95% bootstrap intervals: base / MarsRL-S / MarsRL-VC / MarsRL,
the target checks, the selection-policy table and the plots.

  python experiments/report.py --root=/tmp/mars_study --out=experiments/results/study
  python experiments/report.py --root=/tmp/mars_study --out=... --skip_eval   # records on disk only

Layout under `--root`:
  sft/model                         the base (the SFT warm start); sft/metrics.jsonl its curve
  <variant>[_<selection>][_seed<N>] one RL run (`experiments/run.py --workdir=...`): variant
                                    marsrl | marsrl_s | marsrl_vc; selection adaptive | balanced |
                                    random (absent: the config's `rollout.selection`); N the run's
                                    `--config.seed` (absent: one run of that row).
                                    E.g. marsrl_seed0, marsrl_seed1, marsrl_s_seed0,
                                    marsrl_balanced_seed0, marsrl_random_seed0. The name
                                    is trusted: train the run with the seed and selection it
                                    names. Other selections are reported for marsrl only.
  eval/<base | run name>/eval/records.jsonl   the evaluation records (`mars_jax.eval_job`)

Without `--skip_eval`, the newest checkpoint of each finished run (one with the `done` file that
`study.sh` writes when the run ends) is exported once to `<run>/final_model` (HF format) and every
model is evaluated with the `eval` section of `--config_module`'s config (resumable with the same
settings; delete `eval/<name>` to evaluate with other ones). With it, only existing records are
read (a run without records is left out).

A row pools the runs of one (variant, selection) over their seeds. Intervals (`eval_stats`):
percentile bootstrap, `--resamples` replicates, each drawing the row's seeds and, crossed with
them, the held-out problems with replacement; differences between rows draw the problems once
for both (paired) and each row's seeds independently; System − Solver within a row draws its
runs and problems jointly. Verifier metrics pool the row's verifications (positive class: an
actually wrong solution); the first verification's balanced accuracy, and its gain over the
base, get intervals by the same draws (confusion counts summed over the drawn runs x problems).

Writes to `--out`: `tables.md` (the main table, MarsRL minus MarsRL-S and minus MarsRL-VC
(paired differences, when those rows exist), the Verifier / outcome table, the targets as
met / not met with their numbers, the selection-policy table when MarsRL runs of several
selections exist, with each selection's System minus the config's selection's, paired),
`summary.json` and the plots `rewards.png`, `verifier.png` (accuracy,
balanced accuracy, recall, pass rate), `training_lengths.png`, `held_out_probe.png` (over
training, from each run's metrics.jsonl), `system_vs_solver.png`, `selection.png` (avg@k bars
with interval whiskers), `lengths.png` (tokens per role at evaluation) and `sft_loss.png`.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import ConfigDict  # noqa: E402

from mars_jax import console, eval_job  # noqa: E402
from mars_jax.agents import eval_stats  # noqa: E402
from mars_jax.types import ROLES  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from experiments import export_hf  # noqa: E402

_ROOT = flags.DEFINE_string("root", "/tmp/mars_study", "Directory holding sft/ and the RL runs.")
_OUT = flags.DEFINE_string("out", "experiments/results", "Where tables and plots are written.")
_CONFIG = flags.DEFINE_string("config_module", "study",
                              "Module in experiments/configs whose get_config(variant) trained "
                              "the runs; its eval section evaluates them.")
_SKIP_EVAL = flags.DEFINE_bool("skip_eval", False, "Read existing records; evaluate nothing.")
_NUM_PROBLEMS = flags.DEFINE_integer("num_problems", None, "Override eval.num_problems.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", None, "Override eval.num_samples (k).")
_RESAMPLES = flags.DEFINE_integer("resamples", eval_stats.RESAMPLES, "Bootstrap replicates.")
_BOOTSTRAP_SEED = flags.DEFINE_integer("bootstrap_seed", 0, "Seed of the bootstrap draws.")

VARIANTS = {"base": "SFT warm start", "marsrl_s": "MarsRL-S", "marsrl_vc": "MarsRL-VC",
            "marsrl": "MarsRL"}
SELECTIONS = ("adaptive", "balanced", "random")
RUN_NAME = re.compile(r"^(marsrl_vc|marsrl_s|marsrl)(?:_(adaptive|balanced|random))?"
                      r"(?:_seed(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Run:
    """One evaluated model: the base, or an RL run of `variant` with `selection` and `seed`."""

    name: str
    variant: str
    selection: str | None = None
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """Where the runs are, how they are evaluated and how intervals are drawn."""

    root: Path
    config_module: str = "study"
    num_problems: int | None = None
    num_samples: int | None = None
    resamples: int = eval_stats.RESAMPLES
    bootstrap_seed: int = 0

    def train_config(self, variant: str) -> ConfigDict:
        return importlib.import_module(self.config_module).get_config(variant)

    def eval_config(self, variant: str, model_dir: Path) -> ConfigDict:
        config = self.train_config("marsrl" if variant == "base" else variant)
        config.job, config.model.checkpoint = "eval_system", str(model_dir)
        if self.num_problems is not None:
            config.eval.num_problems = self.num_problems
        if self.num_samples is not None:
            config.eval.num_samples = self.num_samples
        return config


def records_path(root: Path, name: str) -> Path:
    return root / "eval" / name / "eval" / "records.jsonl"


def discover_runs(settings: Settings, *, evaluated_only: bool) -> list[Run]:
    """The base and every RL run directory under the root named as in the module docstring that
    has records (or, unless `evaluated_only`, checkpoints and the `done` file `study.sh` writes when
    the run ends: a run still training is left out); selection filled in from the config."""
    root, runs = settings.root, [Run("base", "base")]
    for path in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else ():
        match = RUN_NAME.match(path.name)
        ready = records_path(root, path.name).exists() or (
            not evaluated_only and (path / "checkpoints").is_dir() and (path / "done").is_file())
        if match and ready:
            variant, selection, seed = match.groups()
            selection = selection or settings.train_config(variant).rollout.selection
            runs.append(Run(path.name, variant, selection, None if seed is None else int(seed)))
    return runs


def export_final(run_dir: Path) -> tuple[Path, int]:
    """Writes the newest checkpoint of `run_dir` to `run_dir/final_model` (once, by
    `export_hf.export`); returns the directory and the step it holds."""
    out, step_file = run_dir / "final_model", run_dir / "final_model" / "step.txt"
    if step_file.exists():
        return out, int(step_file.read_text())
    step = export_hf.export(run_dir, out)
    step_file.write_text(str(step))
    return out, step


def evaluate(run: Run, settings: Settings) -> None:
    """Exports (RL runs) and evaluates one model into `records_path(root, run.name)`; nothing
    when those records already number num_problems x num_samples (the run's checkpoints may be
    gone; `check_complete` checks them later)."""
    root = settings.root
    e = settings.eval_config(run.variant, Path()).eval
    path = records_path(root, run.name)
    if path.exists() and len(load_records(path)) == e.num_problems * e.num_samples:
        return
    model_dir = root / "sft" / "model"
    if run.variant != "base":
        model_dir, _ = export_final(root / run.name)
    summary = eval_job.run(settings.eval_config(run.variant, model_dir),
                           str(root / "eval" / run.name))
    if len(load_records(path)) != summary["num_records"]:
        raise ValueError(f"{path} holds other runs than the "
                         f"{summary['num_records']} asked: it was written with other eval "
                         "settings; delete it")


def load_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_complete(name: str, records: Sequence[dict], samples: int) -> None:
    """Raises ValueError unless each problem of `records` has `samples` distinct samples."""
    seen = Counter((r["problem_id"], r["sample"]) for r in records)
    doubled = sorted(key for key, count in seen.items() if count > 1)
    per_problem = Counter(problem for problem, _ in seen)
    short = sorted(p for p, count in per_problem.items() if count != samples)
    if doubled or short:
        raise ValueError(f"{name}: records incomplete or doubled (problem, sample) "
                         f"{doubled[:3]}; problems without {samples} samples: {short[:3]}")


def rl_steps(run_dir: Path) -> int | None:
    """The step of the exported model, else the last step in metrics.jsonl; None if neither."""
    step_file = run_dir / "final_model" / "step.txt"
    if step_file.exists():
        return int(step_file.read_text())
    steps = [m["step"] for m in console.read_metrics(run_dir)]
    return max(steps) if steps else None


def row_scores(runs: Sequence[list[dict]], problems: Sequence[str]) -> dict:
    """A row's `[runs, problems]` Solver and System avg@k, `[runs, problems, 6]` confusion
    counts of the first verifications, `[runs, problems, 3]` counts of the Corrector's revisions
    of wrong candidates (`eval_stats.correction_counts`) and, under `outcomes`, the `[runs,
    problems]` share of each Solver -> System outcome (`eval_stats.outcome_matrices`), columns
    in the order of `problems`."""
    return {"solver": eval_stats.score_matrix(runs, "solver_correct", problems),
            "system": eval_stats.score_matrix(runs, "correct", problems),
            "verdicts": eval_stats.confusion_counts(runs, problems, first_only=True),
            "corrections": eval_stats.correction_counts(runs, problems),
            "outcomes": eval_stats.outcome_matrices(runs, problems)}


def row_summary(runs: Sequence[list[dict]], scores: dict[str, np.ndarray],
                settings: Settings) -> dict:
    """avg@k of Solver and System with intervals, System − Solver, Verifier metrics (first and
    all verifications), outcome rates, iterations and tokens per role, pooled over `runs`."""
    solver, system, verdicts = scores["solver"], scores["system"], scores["verdicts"]
    draws = dict(resamples=settings.resamples, seed=settings.bootstrap_seed)
    pooled = [r for records in runs for r in records]
    return {
        "runs": len(runs), "num_problems": system.shape[1], "num_records": len(pooled),
        "solver_avg_at_k": eval_stats.bootstrap(solver, **draws).to_json(),
        "system_avg_at_k": eval_stats.bootstrap(system, **draws).to_json(),
        "system_minus_solver": eval_stats.bootstrap(system - solver, **draws).to_json(),
        "system_avg_at_k_per_run": system.mean(axis=1).tolist(),
        "verifier_first": eval_stats.confusion(
            eval_stats.verification_pairs(pooled, first_only=True)).to_json(),
        "verifier_first_balanced_accuracy": eval_stats.bootstrap_statistic(
            [verdicts], lambda t: eval_stats.balanced_accuracy(t[0]), **draws).to_json(),
        "verifier_all": eval_stats.confusion(
            eval_stats.verification_pairs(pooled, first_only=False)).to_json(),
        "corrector": eval_stats.correction_rates(pooled),
        "corrector_fix_rate": eval_stats.bootstrap_statistic(
            [scores["corrections"]], lambda t: eval_stats.fix_rate(t[0]), **draws).to_json(),
        **eval_stats.outcome_rates(pooled),
        "solver_to_system": eval_stats.solver_to_system(pooled),
        "outcomes": {name: eval_stats.bootstrap(m, **draws).to_json()
                     for name, m in scores["outcomes"].items()},
        "mean_iterations": float(np.mean([r["iterations"] for r in pooled])),
        "mean_tokens": eval_stats.mean_tokens(pooled),
    }


# Power 80% at a two-sided 5% level: a true difference of (1.96 + 0.84) standard errors.
DETECTABLE_SE = 2.80


def detectable(interval: dict) -> float:
    """The minimum detectable difference of a paired comparison: 2.8 standard errors, the
    standard error read off the 95% interval's width (as 2 x 1.96 of them)."""
    return DETECTABLE_SE * (interval["high"] - interval["low"]) / (2 * 1.96)


def decomposition_differences(row: dict, base: dict, draws: dict) -> dict:
    """`row` minus `base` (`row_scores`), paired over problems: each Solver -> System outcome's
    share (`outcome/<name>`), the in-loop Corrector fix rate and the first verification's
    balanced accuracy."""
    out = {f"outcome/{name}": eval_stats.bootstrap_difference(
        row["outcomes"][name], base["outcomes"][name], **draws).to_json()
        for name in eval_stats.OUTCOMES}
    fix = eval_stats.fix_rate
    out["corrector_fix_rate"] = eval_stats.bootstrap_statistic(
        [row["corrections"], base["corrections"]], lambda t: fix(t[0]) - fix(t[1]),
        **draws).to_json()
    balanced = eval_stats.balanced_accuracy
    out["verifier_balanced_accuracy"] = eval_stats.bootstrap_statistic(
        [row["verdicts"], base["verdicts"]], lambda t: balanced(t[0]) - balanced(t[1]),
        **draws).to_json()
    return out


def check_targets(summaries: dict, differences: dict, ablations: dict) -> list[dict]:
    """Issue 55's targets, each {'target', 'met' (None: a row is missing), 'detail'}, from the
    rows' summaries and the paired differences `build_report` drew (vs the base; MarsRL minus
    each ablation)."""
    pts = lambda x: f"{100 * x:+.1f}"
    interval = lambda i: f"{pts(i.estimate)} [{pts(i.low)}, {pts(i.high)}]"
    base, marsrl, marsrl_s = ("base", None), ("marsrl", "default"), ("marsrl_s", "default")
    out = []

    def target(name: str, rows: Sequence, check) -> None:
        missing = [r[0] for r in rows if r not in summaries]
        if missing:
            out.append({"target": name, "met": None, "detail": f"no runs of {', '.join(missing)}"})
        else:
            met, detail = check()
            out.append({"target": name, "met": bool(met), "detail": detail})

    def gain(difference: dict, points: float):
        d = eval_stats.Interval(**difference["system"])
        return (d.estimate >= points and d.low > 0,
                f"System difference {interval(d)} points (95% interval; detectable "
                f"{100 * detectable(difference['system']):.1f})")

    target("MarsRL System >= base System + 10 points, interval excluding 0", (marsrl, base),
           lambda: gain(differences[marsrl], 0.10))
    target("MarsRL System - MarsRL-S System >= +5 points, interval excluding 0",
           (marsrl, marsrl_s), lambda: gain(ablations[marsrl_s], 0.05))

    def system_over_solver():
        d = eval_stats.Interval(**summaries[marsrl]["system_minus_solver"])
        return d.estimate > 0, (f"MarsRL System - Solver {interval(d)} points; interval "
                                f"{'excludes' if d.excludes_zero else 'includes'} 0")

    target("After MarsRL, System > Solver", (marsrl,), system_over_solver)

    def verifier():
        after, before = summaries[marsrl], summaries[base]
        gained = eval_stats.Interval(**differences[marsrl]["verifier_balanced_accuracy"])
        return (gained.estimate >= 0.10,
                f"balanced accuracy (1st verification) "
                f"{100 * before['verifier_first']['balanced_accuracy']:.1f} -> "
                f"{100 * after['verifier_first']['balanced_accuracy']:.1f} ({interval(gained)}); "
                f"acceptance {100 * after['accepted_rate']:.1f}%")

    target("Verifier balanced accuracy >= +10 points over the warm start", (marsrl, base),
           verifier)

    def corrector():
        after, before = summaries[marsrl], summaries[base]
        gained = eval_stats.Interval(**differences[marsrl]["corrector_fix_rate"])
        return (gained.low > 0,
                f"in-loop fix rate {100 * before['corrector']['fixed']:.1f} -> "
                f"{100 * after['corrector']['fixed']:.1f}% ({interval(gained)}); wrong "
                f"candidates left unchanged {100 * before['corrector']['unchanged']:.1f} -> "
                f"{100 * after['corrector']['unchanged']:.1f}%")

    target("In-loop Corrector fix rate up over the warm start, interval excluding 0",
           (marsrl, base), corrector)
    return out


SOLVER_TO_SYSTEM = eval_stats.SOLVER_TO_SYSTEM


def _fmt(i: dict, signed: bool = False) -> str:
    f = (lambda x: f"{100 * x:+.1f}") if signed else (lambda x: f"{100 * x:.1f}")
    undefined = f" ({i['undefined']} resamples undefined)" if i.get("undefined") else ""
    return f"{f(i['estimate'])} [{f(i['low'])}, {f(i['high'])}]{undefined}"


def tables(summaries: dict, labels: dict, steps: dict, differences: dict, ablations: dict,
           targets: list[dict], header: str, selection_minus: dict) -> str:
    """Markdown: main table, MarsRL minus each ablation, Verifier / outcome table, targets,
    selection-policy table (with each selection's System minus the config's, paired)."""
    pct = lambda x: f"{100 * x:.1f}"
    main_rows = [r for r in summaries if r[1] in (None, "default")]
    rows = [header, "", "95% intervals: percentile bootstrap over problems (and over seeds where "
            "a row has several runs); differences paired over problems.", "",
            "| Model | runs | RL steps | Solver avg@k | System avg@k | System − Solver | "
            "Solver vs base | System vs base |", "|---|---|---|---|---|---|---|---|"]
    for row in main_rows:
        s = summaries[row]
        vs_base = {part: _fmt(differences[row][part], signed=True) if row in differences else "—"
                   for part in ("solver", "system")}
        rows.append(f"| {labels[row]} | {s['runs']} | {steps[row]} | {_fmt(s['solver_avg_at_k'])} "
                    f"| {_fmt(s['system_avg_at_k'])} | {_fmt(s['system_minus_solver'], True)} | "
                    f"{vs_base['solver']} | {vs_base['system']} |")
    if differences:
        rows += ["", "Minimum detectable System difference to the base (80% power, 5% two-sided: "
                 "2.8 standard errors, read off the interval's width): " + "; ".join(
                     f"{labels[row]} {100 * detectable(d['system']):.1f} points"
                     for row, d in differences.items() if row in main_rows) + "."]
    if ablations:
        rows += ["", "MarsRL minus each ablation (the paper's Table 2), paired over problems:", "",
                 "| MarsRL minus | Solver avg@k | System avg@k | detectable System difference |",
                 "|---|---|---|---|"]
        for row, d in ablations.items():
            rows.append(f"| {labels[row]} | {_fmt(d['solver'], True)} | "
                        f"{_fmt(d['system'], True)} | {100 * detectable(d['system']):.1f} |")
    rows += ["", "Verifier: positive = an actually wrong solution (a Wrong verdict on it is a true "
             "positive); 1st = the first verification of each run (the Solver's candidate), all = "
             "every verification. Corrector: share of the wrong candidates it revised into right "
             "ones / of the right ones it broke. Solver -> System: share of runs whose Solver "
             "answer was right and kept / right and lost / wrong and fixed / wrong and not fixed "
             "(of which no candidate was right).", "",
             "| Model | accepted | fallback | failed | mean iterations | Verifier acc 1st / all | "
             "balanced acc 1st / all | recall 1st / all | precision 1st / all | "
             "Corrector fixed / broke | Solver -> System kept / lost / fixed / unfixed "
             "(never right) | tokens S / V / C |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in main_rows:
        s = summaries[row]
        both = lambda key: f"{pct(s['verifier_first'][key])} / {pct(s['verifier_all'][key])}"
        balanced = (f"{_fmt(s['verifier_first_balanced_accuracy'])} / "
                    f"{pct(s['verifier_all']['balanced_accuracy'])}")
        tokens = " / ".join(f"{s['mean_tokens'][r]:.0f}" for r in ROLES)
        rows.append(f"| {labels[row]} | {pct(s['accepted_rate'])} | {pct(s['fallback_rate'])} | "
                    f"{pct(s['failed_rate'])} | {s['mean_iterations']:.2f} | {both('accuracy')} | "
                    f"{balanced} | {both('recall')} | {both('precision')} | "
                    f"{pct(s['corrector']['fixed'])} / {pct(s['corrector']['broken'])} | "
                    f"{' / '.join(pct(s['solver_to_system'][k]) for k in SOLVER_TO_SYSTEM)} "
                    f"({pct(s['solver_to_system']['never_right'])}) | "
                    f"{tokens} |")
    rows += decomposition_table(summaries, labels, differences, main_rows)
    rows += ["", "| Target | met | numbers |", "|---|---|---|"]
    for t in targets:
        met = {True: "met", False: "not met", None: "not evaluated"}[t["met"]]
        rows.append(f"| {t['target']} | {met} | {t['detail']} |")
    selection_rows = [r for r in summaries if r[0] == "marsrl"]
    if len(selection_rows) > 1:
        default = labels.get(("marsrl", "default"), "the config's selection")
        rows += ["", "Selection policies (MarsRL):", "",
                 "| Selection | runs | System avg@k | Solver avg@k | Verifier balanced acc (1st) | "
                 f"accepted | System minus {default} |", "|---|---|---|---|---|---|---|"]
        for row in selection_rows:
            s = summaries[row]
            minus = _fmt(selection_minus[row], True) if row in selection_minus else "—"
            rows.append(f"| {labels[row]} | {s['runs']} | {_fmt(s['system_avg_at_k'])} | "
                        f"{_fmt(s['solver_avg_at_k'])} | "
                        f"{_fmt(s['verifier_first_balanced_accuracy'])} | "
                        f"{pct(s['accepted_rate'])} | {minus} |")
    return "\n".join(rows) + "\n"


def decomposition_table(summaries: dict, labels: dict, differences: dict,
                        main_rows: Sequence) -> list[str]:
    """Markdown lines: where each row's System points come from, each share with its interval
    and, for RL rows, its paired difference to the base."""
    def cell(row, value: dict, key: str) -> str:
        d = differences.get(row, {}).get(key)
        return _fmt(value) + (f" ({_fmt(d, signed=True)})" if d else "")

    rows = ["", "Where the System's points come from: share of runs whose Solver answer was right "
            "and kept / right and lost / wrong and fixed / wrong and not fixed; some candidate "
            "right (the ceiling a perfect Verifier would reach with this Solver and Corrector); "
            "the in-loop Corrector's fix rate (wrong candidates revised into right ones) and "
            "unchanged rate (revisions keeping the wrong answer), the share of right candidates "
            "it broke; the first verification's recall (wrong solutions flagged) and specificity "
            "(right ones passed). In brackets: 95% interval; in parentheses, RL rows: minus the "
            "base, paired over problems.", "",
            "| Model | kept | lost | fixed | unfixed | some candidate right | Corrector fixed | "
            "unchanged / broke | Verifier recall / specificity (1st) |",
            "|---|---|---|---|---|---|---|---|---|"]
    pct = lambda x: f"{100 * x:.1f}"
    for row in main_rows:
        s = summaries[row]
        outcomes = [cell(row, s["outcomes"][name], f"outcome/{name}")
                    for name in (*SOLVER_TO_SYSTEM, "some_right")]
        rows.append(f"| {labels[row]} | {' | '.join(outcomes)} | "
                    f"{cell(row, s['corrector_fix_rate'], 'corrector_fix_rate')} | "
                    f"{pct(s['corrector']['unchanged'])} / {pct(s['corrector']['broken'])} | "
                    f"{pct(s['verifier_first']['recall'])} / "
                    f"{pct(s['verifier_first']['specificity'])} |")
    return rows


def curve(lines: list[dict], key: str, window: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(steps, moving average over `window` logged values) of `key`, skipping missing values."""
    points = [(m["step"], m[key]) for m in lines
              if m.get(key) is not None and np.isfinite(m[key])]
    if not points:
        return np.array([]), np.array([])
    steps, values = map(np.array, zip(*points))
    kernel = np.ones(min(window, len(values)))
    smooth = np.convolve(values, kernel, "valid") / kernel.sum()
    return steps[len(steps) - len(smooth):], smooth


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


# name -> (metrics, whether they lie in [0, 1], moving-average window in logged values)
TRAINING_PLOTS = {
    "rewards": ([f"reward/{role}" for role in ROLES], True, 5),
    "verifier": (["verifier/accuracy", "verifier/balanced_accuracy", "verifier/recall",
                  "verifier/pass_rate"], True, 5),
    "training_lengths": ([f"length/{role}" for role in ROLES], False, 5),
    "held_out_probe": (["probe/solver_accuracy", "probe/verifier_balanced_accuracy",
                        "probe/corrector_fix_rate"], True, 1),
    "groups_without_gradient": ([f"groups_all_{kind}/{role}" for kind in ("wrong", "right")
                                 for role in ROLES], True, 5),
    "truncated": ([f"truncated/{role}" for role in ROLES], True, 5),
}
TRAINING_TABLE = ("groups_all_wrong", "groups_all_right", "truncated")


def training_table(runs: dict[str, list[list[dict]]]) -> list[str]:
    """Markdown lines: per RL row and role, the mean over the first and the last quarter of each
    run's steps (pooled over seeds) of the share of groups all wrong / all right and of outputs
    cut off (`trainer.role_metrics`); rows without those metrics are left out."""
    lines = ["", "Training groups without gradient and truncated outputs, per role: mean over the "
             "first -> last quarter of the steps (seeds pooled).", "",
             "| Model | role | groups all wrong | groups all right | truncated |",
             "|---|---|---|---|---|"]
    found = False
    for label, seeds in runs.items():
        for role in ROLES:
            cells = []
            for key in TRAINING_TABLE:
                ends = []
                for part in (0, -1):
                    values = [m[f"{key}/{role}"] for run_lines in seeds
                              for m in quarters(run_lines)[part]
                              if m.get(f"{key}/{role}") is not None
                              and np.isfinite(m[f"{key}/{role}"])]
                    ends.append(f"{100 * np.mean(values):.1f}" if values else "—")
                cells.append(" -> ".join(ends))
            if any(c != "— -> —" for c in cells):
                found = True
                lines.append(f"| {label} | {role} | {' | '.join(cells)} |")
    return lines if found else []


def quarters(lines: list[dict]) -> list[list[dict]]:
    """A run's training steps (step >= 1) cut into four consecutive parts ([] each when none)."""
    steps = [m for m in lines if m["step"] >= 1]
    return [list(part) for part in np.array_split(np.array(steps, dtype=object), 4)]


TITLES = {"verifier/pass_rate": "verifier/pass_rate (~acceptance)"}


def plot_training(runs: dict[str, list[list[dict]]], out: Path) -> None:
    """Per metric, a moving-average curve of every run, one colour per row (label -> runs'
    metrics); `verifier/pass_rate` is the share of Correct verdicts, the training analogue of
    the acceptance rate; `probe/*` are held-out decisions (`eval.probe_every`), unsmoothed. A
    plot none of whose metrics any run logged is not written."""
    for name, (keys, unit_range, window) in TRAINING_PLOTS.items():
        if not any(m.get(key) is not None for seeds in runs.values() for lines in seeds
                   for m in lines for key in keys):
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(4.4 * len(keys), 3.6))
        for ax, key in zip(axes, keys):
            for color, (label, seeds) in enumerate(runs.items()):
                for i, lines in enumerate(seeds):
                    steps, values = curve(lines, key, window)
                    if len(steps):
                        ax.plot(steps, values, color=f"C{color}", alpha=0.85,
                                label=label if i == 0 else None)
            smoothing = f" (moving avg of {window})" if window > 1 else ""
            ax.set(title=f"{TITLES.get(key, key)}{smoothing}", xlabel="RL step")
            if unit_range:
                ax.set_ylim(-0.02, 1.02)
            _legend(ax)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


def plot_avg_at_k(summaries: dict, labels: dict, rows: Sequence, path: Path, title: str) -> None:
    """Solver and System avg@k bars per row with 95% interval whiskers."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(rows)), 3.8))
    x = np.arange(len(rows))
    for offset, key, name in ((-0.2, "solver_avg_at_k", "Solver"),
                              (0.2, "system_avg_at_k", "System")):
        est = np.array([summaries[r][key]["estimate"] for r in rows])
        err = np.array([[e - summaries[r][key]["low"], summaries[r][key]["high"] - e]
                        for r, e in zip(rows, est)]).T
        ax.bar(x + offset, 100 * est, 0.4, yerr=100 * err, capsize=3, label=name)
    ax.set_xticks(x, [labels[r] for r in rows], fontsize=8)
    ax.set(title=title, ylabel="avg@k (%), 95% interval")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sft_metrics(root: Path) -> list[dict]:
    """The warm start's SFT metrics (`<root>/sft/metrics.jsonl`; none when absent)."""
    return console.read_metrics(root / "sft")


def plot_sft(lines: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    steps, values = curve(lines, "loss", window=10)
    ax.plot(steps, values, label="train (moving avg of 10)")
    for key in ("heldout/loss", *(f"heldout/loss/{r}" for r in ROLES)):
        steps, values = curve(lines, key, window=1)
        ax.plot(steps, values, marker="o", markersize=3, label=key)
    ax.set(title="SFT loss per reply token", xlabel="SFT step", yscale="log")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(out / "sft_loss.png", dpi=110)
    plt.close(fig)


def plot_lengths(summaries: dict, labels: dict, rows: Sequence, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        ax.bar(np.arange(len(ROLES)) + i * width,
               [summaries[row]["mean_tokens"][r] for r in ROLES], width, label=labels[row])
    ax.set_xticks(np.arange(len(ROLES)) + width * (len(rows) - 1) / 2, ROLES)
    ax.set(title="generated tokens per evaluated run, by role", ylabel="tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lengths.png", dpi=110)
    plt.close(fig)


def build_report(settings: Settings, out: Path, *, run_eval: bool) -> str:
    """Evaluates (if `run_eval`) and reports every run under the root; writes `out` and returns
    the tables."""
    root = settings.root
    out.mkdir(parents=True, exist_ok=True)
    default_selection = settings.train_config("marsrl").rollout.selection
    runs = discover_runs(settings, evaluated_only=not run_eval)
    if run_eval:
        for run in runs:
            evaluate(run, settings)
    if not records_path(root, "base").exists():
        raise FileNotFoundError(f"no base records at {records_path(root, 'base')}")
    records = {run.name: load_records(records_path(root, run.name)) for run in runs}
    problems = eval_stats.problem_ids(records["base"])
    k = max(Counter(r["problem_id"] for r in records["base"]).values())
    for name, run_records in records.items():
        check_complete(name, run_records, k)
    grouped: dict[tuple, list[Run]] = {}
    for run in runs:
        row = (run.variant, None if run.variant == "base" else
               "default" if run.selection == default_selection else run.selection)
        grouped.setdefault(row, []).append(run)
    order = [("base", None), *((v, "default") for v in ("marsrl_s", "marsrl_vc", "marsrl")),
             *(("marsrl", s) for s in SELECTIONS if s != default_selection)]
    left_out = [run.name for row, row_runs in grouped.items() if row not in order
                for run in row_runs]
    if left_out:
        raise ValueError(f"runs {left_out}: a variant other than MarsRL with a selection other "
                         f"than the config's ({default_selection!r}) has no row in the tables")
    grouped = {row: sorted(grouped[row], key=lambda r: (r.seed is None, r.seed))
               for row in order if row in grouped}
    several_selections = len([row for row in grouped if row[0] == "marsrl"]) > 1
    labels = {row: VARIANTS[row[0]] if row[1] in (None, "default") else
              f"{VARIANTS[row[0]]} ({row[1]})" for row in grouped}
    if several_selections and ("marsrl", "default") in grouped:
        labels[("marsrl", "default")] = f"MarsRL ({default_selection})"
    summaries, scores, steps = {}, {}, {}
    for row, row_runs in grouped.items():
        row_records = [records[r.name] for r in row_runs]
        scores[row] = row_scores(row_records, problems)
        summaries[row] = row_summary(row_records, scores[row], settings)
        summaries[row]["seeds"] = [r.seed for r in row_runs]
        run_steps = [0 if r.variant == "base" else rl_steps(root / r.name) for r in row_runs]
        steps[row] = ", ".join(str(s) if s is not None else "?"
                               for s in sorted(set(run_steps), key=lambda s: (s is None, s)))
    draws = dict(resamples=settings.resamples, seed=settings.bootstrap_seed)

    def paired(row, other):
        return {part: eval_stats.bootstrap_difference(scores[row][part], scores[other][part],
                                                      **draws).to_json()
                for part in ("solver", "system")}

    differences = {row: {**paired(row, ("base", None)),
                         **decomposition_differences(scores[row], scores[("base", None)], draws)}
                   for row in grouped if row != ("base", None)}
    marsrl = ("marsrl", "default")
    ablations = {row: paired(marsrl, row) for row in (("marsrl_s", "default"),
                 ("marsrl_vc", "default")) if marsrl in grouped and row in grouped}
    selection_minus = {row: paired(row, marsrl)["system"] for row in grouped
                       if row[0] == "marsrl" and row != marsrl and marsrl in grouped}
    targets = check_targets(summaries, differences, ablations)
    config = settings.eval_config("base", Path(""))
    e = config.eval
    header = (f"Held-out `{e.dataset}` {e.split}, {len(problems)} problems, avg@{k}, "
              f"T={e.temperature}, top_p={e.top_p}, k_accept={e.k_accept}, "
              f"max_iterations={e.max_iterations} (`{settings.config_module}`'s eval section).")
    text = tables(summaries, labels, steps, differences, ablations, targets, header,
                  selection_minus)
    main_rows = [r for r in grouped if r[1] in (None, "default")]
    plot_avg_at_k(summaries, labels, main_rows, out / "system_vs_solver.png",
                  "Solver vs System avg@k")
    selection_rows = [r for r in grouped if r[0] == "marsrl"]
    if several_selections:
        plot_avg_at_k(summaries, labels, selection_rows, out / "selection.png",
                      "MarsRL by selection policy")
    plot_lengths(summaries, labels, main_rows, out)
    training = {labels[row]: [console.read_metrics(root / r.name) for r in row_runs]
                for row, row_runs in grouped.items() if row[0] != "base"}
    plot_training(training, out)
    text += "".join(line + "\n" for line in training_table(training))
    plot_sft(sft_metrics(root), out)
    key = lambda row: row[0] if row[1] in (None, "default") else f"{row[0]}_{row[1]}"
    (out / "tables.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({
        "rows": {key(row): {**s, "label": labels[row], "rl_steps": steps[row]}
                 for row, s in summaries.items()},
        "solver_vs_base": {key(row): d["solver"] for row, d in differences.items()},
        "system_vs_base": {key(row): d["system"] for row, d in differences.items()},
        "decomposition_vs_base": {key(row): {k: v for k, v in d.items()
                                             if k not in ("solver", "system")}
                                  for row, d in differences.items()},
        "marsrl_minus": {key(row): d for row, d in ablations.items()},
        "selection_system_minus_default": {key(row): d for row, d in selection_minus.items()},
        "targets": targets,
        "bootstrap": {"resamples": settings.resamples, "seed": settings.bootstrap_seed,
                      "level": eval_stats.LEVEL, "scheme": "percentile; seeds x problems "
                      "crossed; differences paired over problems"},
    }, indent=2, sort_keys=True))
    return text


def main(argv) -> None:
    del argv
    settings = Settings(Path(_ROOT.value), _CONFIG.value, _NUM_PROBLEMS.value, _NUM_SAMPLES.value,
                        _RESAMPLES.value, _BOOTSTRAP_SEED.value)
    print(build_report(settings, Path(_OUT.value), run_eval=not _SKIP_EVAL.value))


if __name__ == "__main__":
    app.run(main)
