r"""TPU-VM launcher: create a slice, copy this repository to every worker, install, run, delete.

  python launch/tpu_vm.py all --name=marsrl --zone=us-east5-a --accelerator=v5p-512 --dry_run \
      -- --config=experiments/configs/marsrl_qwen3_30b_a3b.py:ckpt=/mnt/ckpt/Qwen3-30B-A3B \
         --workdir=/mnt/shared/marsrl_30b

Actions: create, copy, setup, run, delete, or all (create, copy, setup, run). `copy` sends the
working tree to ~/mars_jax and, when the run's config reads problem files (a dataset other than
the generated `arith`, and no `data.manual_dir` of its own), the problem data (the default of
`mars_jax.data.paths`: `$MARS_JAX_DATA_DIR`, else ../shared/data) to ~/shared/data, where the
workers' code finds it. `setup` makes a Python 3.11 venv on every worker (~/mars_jax_venv, with
uv, whatever Python the image has) and installs the project with the tested versions
(constraints.txt). Arguments after `--` go to `experiments/run.py`, which runs on every worker
at once with `--distributed=on` (jax finds the other workers itself), under launch/restart.py:
each worker reruns it on exit 75 (preempted) or 74 (storage unavailable), up to
`--max_restarts` times. `--dry_run` prints the commands instead of running them. The workdir
must be one directory every worker sees (e.g. a gcsfuse or Filestore mount).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

from mars_jax.data.paths import default_manual_dir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import python_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ACTIONS = ("create", "copy", "setup", "run", "delete", "all")
REMOTE_DIR = "mars_jax"
REMOTE_DATA_DIR = "shared/data"  # <REMOTE_DIR>/../shared/data: default_manual_dir() there
VENV = "~/mars_jax_venv"  # the workers' environment: Python PYTHON_VERSION, made by uv
PYTHON_VERSION = ".".join(map(str, python_env.PYTHON_VERSION))
ARCHIVE = "/tmp/mars_jax_src.tgz"
DATA_ARCHIVE = "/tmp/mars_jax_data.tgz"

_NAME = flags.DEFINE_string("name", None, "TPU VM (slice) name.")
_ZONE = flags.DEFINE_string("zone", None, "GCP zone, e.g. us-east5-a.")
_PROJECT = flags.DEFINE_string("project", "", "GCP project (default: gcloud's).")
_ACCELERATOR = flags.DEFINE_string("accelerator", "v5p-8", "Accelerator type, e.g. v5p-512.")
_RUNTIME = flags.DEFINE_string("runtime", "v2-alpha-tpuv5", "TPU VM software version.")
_SPOT = flags.DEFINE_bool("spot", False, "Create a Spot slice.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands without running them.")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 10,
                                     "Reruns of run.py per worker on exit 75 / 74.")
_BACKOFF_S = flags.DEFINE_float("backoff_s", 30.0, "First wait before a rerun (doubles).")
flags.mark_flags_as_required(["name", "zone"])


@dataclasses.dataclass(frozen=True)
class Slice:
    """Where the TPU VM lives and what it is."""

    name: str
    zone: str
    accelerator: str = "v5p-8"
    runtime: str = "v2-alpha-tpuv5"
    project: str = ""
    spot: bool = False
    max_restarts: int = 10
    backoff_s: float = 30.0

    def _gcloud(self, *args: str) -> list[str]:
        cmd = ["gcloud", "compute", "tpus", "tpu-vm", *args, f"--zone={self.zone}"]
        return cmd + ([f"--project={self.project}"] if self.project else [])

    def _on_all_workers(self, command: str) -> list[str]:
        return self._gcloud("ssh", self.name, "--worker=all", f"--command={command}")

    def create(self) -> list[list[str]]:
        cmd = self._gcloud("create", self.name, f"--accelerator-type={self.accelerator}",
                           f"--version={self.runtime}")
        return [cmd + (["--spot"] if self.spot else [])]

    def copy(self, repo: Path = REPO, data: str | None = None,
             with_data: bool = True) -> list[list[str]]:
        """Archive the working tree (no .git, caches or build outputs) and, `with_data`, the
        problem data (default: `mars_jax.data.paths.default_manual_dir()`), and unpack them
        everywhere."""
        parts = [(ARCHIVE, REMOTE_DIR)]
        commands = [["tar", "-czf", ARCHIVE, "--exclude=.git", "--exclude=__pycache__",
                     "--exclude=*.egg-info", "-C", str(repo), "."]]
        if with_data:
            try:
                data = data or default_manual_dir()
            except FileNotFoundError as e:
                raise ValueError(f"copy: the run reads problem files, and {e}") from e
            if not os.path.isdir(data):
                raise ValueError(f"copy: the run reads problem files, and there is no problem "
                                 f"data at {data} (python -m mars_jax.data.fetch, or set "
                                 "MARS_JAX_DATA_DIR)")
            parts.append((DATA_ARCHIVE, REMOTE_DATA_DIR))
            commands.append(["tar", "-czf", DATA_ARCHIVE, "-C", data, "."])
        unpack = " && ".join(
            f"rm -rf ~/{remote} && mkdir -p ~/{remote} && tar -xzf {archive} -C ~/{remote}"
            for archive, remote in parts)
        return commands + [
            self._gcloud("scp", *(archive for archive, _ in parts), f"{self.name}:/tmp/",
                         "--worker=all"),
            self._on_all_workers(unpack)]

    def setup(self) -> list[list[str]]:
        """A Python PYTHON_VERSION venv on every worker (uv fetches that Python when the image
        lacks it) with the project and the tested versions installed."""
        uv = "~/.local/bin/uv"
        return [self._on_all_workers(
            f"(test -x {uv} || curl -LsSf https://astral.sh/uv/install.sh | sh) && "
            f"rm -rf {VENV} && {uv} venv --python {PYTHON_VERSION} {VENV} && "
            f"cd ~/{REMOTE_DIR} && {uv} pip install -q --python {VENV}/bin/python "
            "-c constraints.txt -e '.[tpu]'")]

    def run(self, run_args: Sequence[str]) -> list[list[str]]:
        python = f"{VENV}/bin/python"  # unquoted: the remote shell expands ~
        supervisor = shlex.join(["launch/restart.py", f"--max_restarts={self.max_restarts}",
                                 f"--backoff_s={self.backoff_s:g}", "--"])
        command = shlex.join(["experiments/run.py", "--distributed=on", *run_args])
        return [self._on_all_workers(
            f"cd ~/{REMOTE_DIR} && {python} {supervisor} {python} {command}")]

    def delete(self) -> list[list[str]]:
        return [self._gcloud("delete", self.name, "--quiet")]

    def commands(self, action: str, run_args: Sequence[str] = ()) -> list[list[str]]:
        """The command lines of `action` (one of ACTIONS), in order."""
        if action not in ACTIONS:
            raise ValueError(f"action: {action!r} is not one of {ACTIONS}")
        if action in ("run", "all") and not run_args:
            raise ValueError(f"{action}: pass experiments/run.py arguments after '--'")
        if action == "all":
            return (self.create() + self.copy(with_data=reads_problem_files(run_args))
                    + self.setup() + self.run(run_args))
        if action == "run":
            return self.run(run_args)
        if action == "copy":  # the problem data only for a run (arguments after '--') that reads it
            return self.copy(with_data=bool(run_args) and reads_problem_files(run_args))
        return getattr(self, action)()


def load_run_config(run_args: Sequence[str]):
    """The ConfigDict that `experiments/run.py run_args` would run (its --config, overrides
    applied); a relative config path is read from the working directory, else the repository."""
    from ml_collections import config_flags
    config_args = [a for a in run_args if re.match(r"--(no)?config[.=]", a)]
    if not any(a.startswith("--config=") for a in config_args):
        raise ValueError("run.py arguments: no --config=")
    configs = str(REPO / "experiments" / "configs")
    if configs not in sys.path:
        sys.path.insert(0, configs)  # the config files import `common`
    resolved = []
    for arg in config_args:
        if arg.startswith("--config="):
            path, sep, option = arg.removeprefix("--config=").partition(":")
            if not os.path.exists(path) and (REPO / path).exists():
                path = str(REPO / path)
            arg = f"--config={path}{sep}{option}"
        resolved.append(arg)
    argv, values = ["tpu_vm.py", *resolved], flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "run.py's config", flag_values=values,
                                    sys_argv=argv)  # which --config.* overrides to define
    try:
        values(argv)
    except (flags.Error, AttributeError, KeyError) as e:  # a bad flag, an unknown field
        raise ValueError(f"run.py arguments: {e}") from e
    return values.config


def reads_problem_files(run_args: Sequence[str]) -> bool:
    """Whether the run reads problem JSONL files from the default data dir: it names a dataset
    other than the generated `arith` (data.name; eval.dataset for eval_system or a probe) and
    sets no `data.manual_dir` of its own."""
    config = load_run_config(run_args)
    if config.job == "eval_system":
        names = {config.eval.dataset}
    else:
        names = {config.data.name} | ({config.eval.dataset} if config.eval.probe_every else set())
    return names != {"arith"} and not config.data.manual_dir


def main(argv: Sequence[str]) -> None:
    if len(argv) < 2:
        raise app.UsageError(f"usage: tpu_vm.py {{{','.join(ACTIONS)}}} [flags] [-- run.py args]")
    tpu = Slice(_NAME.value, _ZONE.value, _ACCELERATOR.value, _RUNTIME.value, _PROJECT.value,
                _SPOT.value, _MAX_RESTARTS.value, _BACKOFF_S.value)
    try:
        commands = tpu.commands(argv[1], argv[2:])
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    for cmd in commands:
        print(shlex.join(cmd), flush=True)
        if not _DRY_RUN.value:
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    sys.exit(app.run(main))
