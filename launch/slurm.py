r"""One task of a multi-node Slurm job: `experiments/run.py` with this node's place in the job,
under the restart loop (launch/restart.py).

  srun --ntasks-per-node=1 python launch/slurm.py [--port=12355] [--dry_run] \
      -- --config=experiments/configs/marsrl_qwen3_30b_a3b_gpu.py --workdir=/shared/marsrl

From Slurm's environment: the coordinator is the first node of `SLURM_STEP_NODELIST` (else
`SLURM_JOB_NODELIST`) at `--port`, the process count `SLURM_NTASKS`, this process's id
`SLURM_PROCID`. One task per node: each process drives all of its node's GPUs. `--dry_run`
prints the command instead of running it. `launch/slurm.sh` is a batch script that runs this.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import restart  # noqa: E402

RUN_PY = Path(__file__).resolve().parents[1] / "experiments" / "run.py"


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`gpu-[01-03,07],login1`) as host names, in order."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            hosts.append(item)
            continue
        prefix, ranges, rest = match.groups()
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            if not first.isdigit() or (last and not last.isdigit()):
                raise ValueError(f"node list {nodelist!r}: bad range {part!r}")
            for number in range(int(first), int(last or first) + 1):
                tails = expand_nodelist(rest) if rest else [""]
                hosts += [f"{prefix}{number:0{len(first)}d}{tail}" for tail in tails]
    return hosts


def run_command(environ: Mapping[str, str], port: int, run_args: Sequence[str],
                python: str = sys.executable) -> list[str]:
    """`experiments/run.py` with the coordinator, process count and id of this Slurm task."""
    missing = [k for k in ("SLURM_NTASKS", "SLURM_PROCID") if k not in environ]
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if missing or not nodelist:
        raise ValueError(f"not inside a Slurm job step: {', '.join(missing) or 'SLURM_JOB_NODELIST'} "
                         "unset (run under srun)")
    nodes, tasks = expand_nodelist(nodelist), int(environ["SLURM_NTASKS"])
    if tasks != len(nodes):
        raise ValueError(f"{tasks} tasks on {len(nodes)} nodes: run one task per node "
                         "(srun --ntasks-per-node=1)")
    return [python, str(RUN_PY), f"--coordinator_address={nodes[0]}:{port}",
            f"--num_processes={tasks}", f"--process_id={int(environ['SLURM_PROCID'])}", *run_args]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/slurm.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=12355, help="coordinator port on the first node")
    parser.add_argument("--max_restarts", type=int, default=10)
    parser.add_argument("--backoff_s", type=float, default=10.0)
    parser.add_argument("--dry_run", action="store_true", help="print the command, run nothing")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then experiments/run.py flags")
    args = parser.parse_args(argv)
    run_args = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    try:
        command = run_command(os.environ, args.port, run_args)
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        print(shlex.join(command), flush=True)
        return 0
    return restart.run_with_restarts(command, args.max_restarts, args.backoff_s, max_backoff_s=600.0)


if __name__ == "__main__":
    sys.exit(main())
