r"""Tables 1–2 in miniature: Solver and V–C system avg@k of base / MarsRL-S / MarsRL-VC / MarsRL.

  python experiments/report.py --root=/tmp/mars_toy --out=experiments/results

Reads `<root>/sft/model` (the base: the SFT warm start) and the runs `<root>/{marsrl_s, marsrl_vc,
marsrl}` of `experiments/configs/toy_marsrl.py`. Each run's newest checkpoint is exported once to
`<root>/<run>/final_model` (HF format); every model is then evaluated with that config's `eval`
section (held-out `arith` test problems) into `<root>/eval/<variant>/` (resumable with the same
settings; delete that directory to evaluate with other ones). Writes to
`--out`: `tables.md` (the tables), `summary.json`, and the plots `rewards.png` (per-role reward
over training), `verifier.png` (Verifier accuracy and recall over training), `sft_loss.png` (the
SFT stages `<root>/sft1`, `sft2`, `sft`) and `lengths.png` (output tokens per role at evaluation).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import ConfigDict  # noqa: E402

from mars_jax import builders, eval_job  # noqa: E402
from mars_jax.checkpoint import Checkpointer  # noqa: E402
from mars_jax.models import save_pretrained  # noqa: E402
from mars_jax.rl.update import init_train_state, make_optimizer  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"))
import toy_marsrl  # noqa: E402

_ROOT = flags.DEFINE_string("root", "/tmp/mars_toy", "Directory holding sft/ and the RL runs.")
_OUT = flags.DEFINE_string("out", "experiments/results", "Where tables and plots are written.")
_NUM_PROBLEMS = flags.DEFINE_integer("num_problems", None, "Override eval.num_problems.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", None, "Override eval.num_samples (k).")

VARIANTS = {"base": "SFT warm start", "marsrl_s": "MarsRL-S", "marsrl_vc": "MarsRL-VC",
            "marsrl": "MarsRL"}
ROLES = ("solver", "verifier", "corrector")


def export_final(config: ConfigDict, run_dir: Path) -> tuple[Path, int]:
    """Writes the newest checkpoint's parameters of `run_dir` to `run_dir/final_model` (once);
    returns the directory and the step it holds."""
    out, step_file = run_dir / "final_model", run_dir / "final_model" / "step.txt"
    if step_file.exists():
        return out, int(step_file.read_text())
    model = builders.build_model(config, mesh=None)
    state = init_train_state(model, make_optimizer(**dict(config.optimizer)))
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=config.checkpoint.keep,
                                async_save=False)
    try:
        restored = checkpointer.restore_latest(state)
    finally:
        checkpointer.close()
    if restored is None:
        raise FileNotFoundError(f"no readable checkpoint under {run_dir / 'checkpoints'}")
    step, state = restored.step, restored.state
    graphdef, _ = nnx.split(model, nnx.Param)
    save_pretrained(nnx.merge(graphdef, state.params), out)
    step_file.write_text(str(step))
    return out, step


def eval_config(variant: str, model_dir: Path) -> ConfigDict:
    config = toy_marsrl.get_config("marsrl" if variant == "base" else variant)
    config.job, config.model.checkpoint = "eval_system", str(model_dir)
    if _NUM_PROBLEMS.value is not None:
        config.eval.num_problems = _NUM_PROBLEMS.value
    if _NUM_SAMPLES.value is not None:
        config.eval.num_samples = _NUM_SAMPLES.value
    return config


def first_verification(records: list[dict]) -> dict[str, float]:
    """Verifier accuracy and recall on the Solver's candidate, from the first verdict of each run."""
    judged = [(c["correct"], c["verdicts"][0]) for r in records for c in r["candidates"][:1]
              if c["verdicts"]]
    accuracy = np.mean([verdict is correct for correct, verdict in judged]) if judged else np.nan
    flawed = [verdict for correct, verdict in judged if not correct]
    recall = np.mean([verdict is False for verdict in flawed]) if flawed else np.nan
    return {"verifier_accuracy": float(accuracy), "verifier_recall": float(recall)}


def evaluate(variant: str, root: Path) -> dict:
    """Exports (RL runs) and evaluates one variant; returns its summary plus run facts."""
    model_dir, step = root / "sft" / "model", 0
    if variant != "base":
        train_config = toy_marsrl.get_config(variant)
        train_config.model.checkpoint = str(model_dir)  # the warm start the run began from
        model_dir, step = export_final(train_config, root / variant)
    config = eval_config(variant, model_dir)
    summary = eval_job.run(config, str(root / "eval" / variant))
    path = root / "eval" / variant / "eval" / "records.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    if len(records) != summary["num_records"]:
        raise ValueError(f"{path} holds {len(records)} runs, not the {summary['num_records']} "
                         "asked: it was written with other eval settings; delete it")
    return {**summary, **first_verification(records), "rl_steps": step, "model": str(model_dir)}


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def curve(lines: list[dict], key: str, window: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(steps, moving average over `window` logged values) of `key`, skipping missing values."""
    points = [(m["step"], m[key]) for m in lines if m.get(key) is not None]
    if not points:
        return np.array([]), np.array([])
    steps, values = map(np.array, zip(*points))
    kernel = np.ones(min(window, len(values)))
    smooth = np.convolve(values, kernel, "valid") / kernel.sum()
    return steps[len(steps) - len(smooth):], smooth


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _plot_runs(ax, runs: dict[str, list[dict]], key: str) -> None:
    """One moving-average curve of metric `key` per run, on a [0, 1] axis."""
    for variant, lines in runs.items():
        steps, values = curve(lines, key)
        if len(steps):
            ax.plot(steps, values, label=VARIANTS[variant])
    ax.set(title=f"{key} (moving avg of 5)", xlabel="RL step", ylim=(-0.02, 1.02))
    _legend(ax)


def plot_training(runs: dict[str, list[dict]], out: Path) -> None:
    for name, keys in (("rewards", [f"reward/{role}" for role in ROLES]),
                       ("verifier", ["verifier/accuracy", "verifier/recall"])):
        fig, axes = plt.subplots(1, len(keys), figsize=(4.4 * len(keys), 3.6))
        for ax, key in zip(axes, keys):
            _plot_runs(ax, runs, key)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
    plt.close("all")


def sft_metrics(root: Path) -> list[dict]:
    """The SFT stages' metrics (`toy_sft.py`: sft1, sft2, then sft), steps counted across stages."""
    lines, offset = [], 0
    for stage in ("sft1", "sft2", "sft"):
        stage_lines = read_metrics(root / stage / "metrics.jsonl")
        lines += [{**m, "step": m["step"] + offset} for m in stage_lines]
        offset += max((m["step"] for m in stage_lines), default=0)
    return lines


def plot_sft(lines: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.8))
    steps, values = curve(lines, "loss", window=10)
    ax.plot(steps, values, label="train (moving avg of 10)")
    for key in ("heldout/loss", *(f"heldout/loss/{r}" for r in ROLES)):
        steps, values = curve(lines, key, window=1)
        ax.plot(steps, values, marker="o", markersize=3, label=key)
    ax.set(title="SFT loss per reply token (stages 1-3)", xlabel="SFT step", yscale="log")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(out / "sft_loss.png", dpi=110)
    plt.close(fig)


def plot_lengths(results: dict[str, dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(results)
    for i, (variant, summary) in enumerate(results.items()):
        ax.bar(np.arange(len(ROLES)) + i * width, [summary["mean_tokens"][r] for r in ROLES],
               width, label=VARIANTS[variant])
    ax.set_xticks(np.arange(len(ROLES)) + width * (len(results) - 1) / 2, ROLES)
    ax.set(title="generated tokens per evaluated run, by role", ylabel="tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lengths.png", dpi=110)
    plt.close(fig)


def tables(results: dict[str, dict]) -> str:
    base = results["base"]
    pct = lambda x: f"{100 * x:.1f}"
    delta = lambda x, y: f"{100 * (x - y):+.1f}"
    config = eval_config("base", Path(""))
    k, n = config.eval.num_samples, config.eval.num_problems
    rows = [f"Held-out `arith` test, {n} problems, avg@{k}, T={config.eval.temperature}, "
            f"top_p={config.eval.top_p}, k_accept={config.eval.k_accept}, "
            f"max_iterations={config.eval.max_iterations}.", "",
            "| Model | RL steps | Solver avg@k | System avg@k | System − Solver | System vs base |",
            "|---|---|---|---|---|---|"]
    for variant, s in results.items():
        rows.append(f"| {VARIANTS[variant]} | {s['rl_steps']} | {pct(s['solver_avg_at_k'])} | "
                    f"{pct(s['system_avg_at_k'])} | "
                    f"{delta(s['system_avg_at_k'], s['solver_avg_at_k'])} | "
                    f"{delta(s['system_avg_at_k'], base['system_avg_at_k'])} |")
    rows += ["", "| Model | accepted | fallback | failed | mean iterations | Verifier acc (1st) | "
             "Verifier recall (1st) | tokens S / V / C |", "|---|---|---|---|---|---|---|---|"]
    for variant, s in results.items():
        tokens = " / ".join(f"{s['mean_tokens'][r]:.0f}" for r in ROLES)
        rows.append(f"| {VARIANTS[variant]} | {pct(s['accepted_rate'])} | "
                    f"{pct(s['fallback_rate'])} | {pct(s['failed_rate'])} | "
                    f"{s['mean_iterations']:.2f} | {pct(s['verifier_accuracy'])} | "
                    f"{pct(s['verifier_recall'])} | {tokens} |")
    return "\n".join(rows) + "\n"


def main(argv) -> None:
    del argv
    root, out = Path(_ROOT.value), Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    runs = {v: read_metrics(root / v / "metrics.jsonl") for v in VARIANTS if v != "base"}
    plot_training({v: lines for v, lines in runs.items() if lines}, out)
    plot_sft(sft_metrics(root), out)
    results = {v: evaluate(v, root) for v in VARIANTS
               if v == "base" or (root / v / "checkpoints").is_dir()}
    plot_lengths(results, out)
    (out / "tables.md").write_text(tables(results))
    (out / "summary.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    print(tables(results))


if __name__ == "__main__":
    app.run(main)
