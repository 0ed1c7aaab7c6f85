r"""What the agentic pipeline buys over the synchronous baseline peers use, by machine size and
length tail: `pipeline_sim.py`'s rows at the paper's batch (128 problems x 8, fan-out 2, 5
stages, Solver mean 19k) on H200 nodes and TPU v5p, 8 to 512 chips, log-normal sigma 0.7 / 1.0 /
1.3.

  nice -n 19 python benchmarks/pipeline_curve.py --chips=512,256,128,64,8  # what the JSON lacks
  python benchmarks/pipeline_curve.py --table_only    # the table and plot from the JSON

Per point the rows `--rows` of `pipeline_sim.py` (each `--updates` updates, the first
`--warmup` not measured): `sequential` (the mode as the project runs it), `sync` (the peers'
baseline: one barrier per step, optimizer offloaded), `pipeline, offloaded` (the pipeline of the
ratios) and `bound: decode only`; other rows asked for count only towards "best".
Ratios are of accelerator-hours per 1,000 trained samples: pipeline / X = X's hours over the
pipeline's. A row's ceiling is its own update's hours (the same FLOPs on any schedule) plus the
decode-only row's hours, a floor on any schedule's hours for those samples under the cost model;
"best" is the schedule of fewest hours. Each row is written to `--json` as it completes; the
plot goes to `--plot`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import pipeline_sim  # noqa: E402
from benchmarks.sim.lengths import LengthModel  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = {"h200": lambda chips: f"h200x{chips}", "v5p": lambda chips: f"v5p-{2 * chips}"}
ROWS = ("sequential", pipeline_sim.SYNC, pipeline_sim.PIPELINE_OFFLOADED, pipeline_sim.BOUND)
PIPELINE = pipeline_sim.PIPELINE_OFFLOADED
KEPT = ("hours_per_1k", "update_hours_per_1k", "slots", "wall_h_per_update", "decode_occupancy",
        "occupancy", "staleness", "deferred_share", "truncated_share", "sim_seconds",
        "samples_per_update", "prefill_share", "decode_share")


def point_key(kind: str, chips: int, sigma: float) -> str:
    return f"{kind} {chips} {sigma:g}"


def simulate_row(kind: str, chips: int, sigma: float, label: str, args, have: dict
                 ) -> dict | None:
    """One row of one point (None: it does not fit); pipeline rows update on the sync row's
    trained samples per step (`have`: the point's rows simulated before)."""
    flags = [f"--sigma={sigma}", f"--updates={args.updates}", f"--warmup={args.warmup}",
             f"--rows={label}", "--rows_only", f"--seed={args.seed}",
             f"--chunk_steps={args.chunk_steps}"]
    if have.get(pipeline_sim.SYNC):
        flags.append(f"--samples_per_update={round(have[pipeline_sim.SYNC]['samples_per_update'])}")
    results = pipeline_sim.run_hardware(KINDS[kind](chips), args.progress,
                                        pipeline_sim.arg_parser().parse_args(flags))
    return {k: results[0][k] for k in KEPT} if results else None


def ratios(rows: dict) -> dict:
    """pipeline / sync, / sequential and / ceiling, best / ceiling (module docstring); None
    where a row is missing."""
    hours = {label: r["hours_per_1k"] for label, r in rows.items() if r}
    fewest = lambda labels: min((label for label in labels if label in hours), default=None,
                                key=hours.get)
    pipe = PIPELINE if PIPELINE in hours else None
    best = fewest([label for label in hours if label != pipeline_sim.BOUND])
    over = lambda a, b: hours[a] / hours[b] if a in hours and b in hours else None

    def of_ceiling(label):  # the row's own update (its samples) + decoding at the bound's cost
        if label is None or pipeline_sim.BOUND not in hours:
            return None
        return (rows[label]["update_hours_per_1k"] + hours[pipeline_sim.BOUND]) / hours[label]

    return {"pipeline/sync": over(pipeline_sim.SYNC, pipe) if pipe else None,
            "pipeline/sequential": over("sequential", pipe) if pipe else None,
            "pipeline/ceiling": of_ceiling(pipe), "best/ceiling": of_ceiling(best), "best": best}


def cap_share(sigma: float, progress: float) -> str:
    lengths = LengthModel(sigma=sigma, progress=progress)
    return "/".join(f"{lengths.truncated_fraction(role):.1%}"
                    for role in ("solver", "verifier", "corrector"))


def table(points: dict, args) -> str:
    fmt = lambda x: f"{x:.2f}x" if x else "-"
    share = lambda x: f"{x:.1%}" if x else "-"
    lines = ["| machine | chips | sigma | at the 64k cap (S/V/C) | slots seq / offloaded | "
             "pipeline / sync | pipeline / sequential | pipeline: share of its ceiling | "
             "best row: share of its ceiling |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        for chips in sorted(args.chips):
            for sigma in sorted(args.sigmas):
                rows = points.get(point_key(kind, chips, sigma))
                if rows is None:
                    continue
                r = ratios(rows)
                slots = (f"{rows['sequential']['slots'] if rows.get('sequential') else 'none'} / "
                         f"{rows[pipeline_sim.SYNC]['slots']}")
                lines.append(f"| {kind} | {chips} | {sigma:g} | {cap_share(sigma, args.progress)} "
                             f"| {slots} | {fmt(r['pipeline/sync'])} | "
                             f"{fmt(r['pipeline/sequential'])} | {share(r['pipeline/ceiling'])} "
                             f"| {r['best']}: {share(r['best/ceiling'])} |")
    return "\n".join(lines)


def plot(points: dict, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ("pipeline/sync", "pipeline/sequential", "pipeline/ceiling")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key in zip(axes, keys):
        for kind, style in zip(KINDS, ("-", "--")):
            for sigma, marker in zip(args.sigmas, "osd^v"):
                xs, ys = [], []
                for chips in sorted(args.chips):
                    rows = points.get(point_key(kind, chips, sigma))
                    value = ratios(rows)[key] if rows else None
                    if value:
                        xs.append(chips)
                        ys.append(value)
                ax.plot(xs, ys, style, marker=marker, label=f"{kind}, sigma {sigma:g}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(args.chips), [str(c) for c in sorted(args.chips)])
        ax.set_xlabel("chips")
        ax.set_title(key + (": share of its ceiling" if key.endswith("ceiling") else ""))
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].axhline(1.5, color="red", lw=0.8, ls=":")
    axes[2].axhline(0.95, color="red", lw=0.8, ls=":")
    axes[0].legend(fontsize=7)
    fig.suptitle("The pipeline (one mesh, optimizer offloaded) against the baselines, in "
                 "accelerator-hours per trained sample; the paper's batch, 128 x 8 (simulated)")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chips", type=lambda s: [int(c) for c in s.split(",")],
                        default=[8, 64, 128, 256, 512])
    parser.add_argument("--sigmas", type=lambda s: [float(c) for c in s.split(",")],
                        default=[0.7, 1.0, 1.3])
    parser.add_argument("--kinds", default="h200,v5p")
    parser.add_argument("--progress", type=float, default=0.0)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk_steps", type=int, default=64,
                        help="decode steps per engine chunk (the 30B configs' "
                             "rollout.engine_chunk_steps)")
    parser.add_argument("--json", type=Path, default=RESULTS / "pipeline_curve.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "pipeline_curve.png")
    parser.add_argument("--rows", type=lambda s: pipeline_sim.select_rows(
        s, [v.label for v in pipeline_sim.variants(pipeline_sim.HARDWARE["h200x8"])]),
                        default=list(ROWS), help="rows per point, in order (the sync row before "
                                                 "the pipeline rows)")
    parser.add_argument("--table_only", action="store_true")
    args = parser.parse_args()
    settings = dict(updates=args.updates, warmup=args.warmup, progress=args.progress,
                    seed=args.seed, chunk_steps=args.chunk_steps)
    saved = json.loads(args.json.read_text()) if args.json.exists() else {}
    if saved and saved["settings"] != settings:
        raise SystemExit(f"--json {args.json} holds points of {saved['settings']}, not "
                         f"{settings}: pass those settings or another --json")
    points = saved.get("points", {})
    if not args.table_only:
        for sigma in args.sigmas:
            for chips in args.chips:
                for kind in args.kinds.split(","):
                    key = point_key(kind, chips, sigma)
                    point = points.setdefault(key, {})
                    missing = [label for label in args.rows if label not in point]
                    if missing:
                        print(f"\n{key}\n{pipeline_sim.HEADER}", flush=True)
                    for label in missing:
                        began = time.perf_counter()
                        point[label] = simulate_row(kind, chips, sigma, label, args, point)
                        print(f"{key}, {label}: {time.perf_counter() - began:.0f} s", flush=True)
                        args.json.parent.mkdir(parents=True, exist_ok=True)
                        args.json.write_text(json.dumps(dict(settings=settings, points=points),
                                                        indent=1, sort_keys=True))
    print(f"\nsettings: {settings}\n" + table(points, args))
    plot(points, args)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
