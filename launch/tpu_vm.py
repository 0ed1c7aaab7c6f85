r"""TPU-VM launcher: create a slice, copy this repository to every worker, install, run, delete.

  python launch/tpu_vm.py all --name=marsrl --zone=us-east5-a --accelerator=v5p-512 --dry_run \
      -- --config=experiments/configs/marsrl_qwen3_30b_a3b.py:ckpt=/mnt/ckpt/Qwen3-30B-A3B \
         --workdir=/mnt/shared/marsrl_30b

Actions: create, copy, setup, run, delete, or all (create, copy, setup, run). `copy` sends the
working tree to ~/mars_jax and the problem data (the default of `mars_jax.data.paths`:
`$MARS_JAX_DATA_DIR`, else ../shared/data) to ~/shared/data, where the workers' code finds it.
Arguments after `--` go to `experiments/run.py`, which runs on every worker at once with
`--distributed=on` (jax finds the other workers itself). `--dry_run` prints the commands instead of
running them. The workdir must be one directory every worker sees (e.g. a gcsfuse or Filestore
mount).
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

from mars_jax.data.paths import default_manual_dir

REPO = Path(__file__).resolve().parents[1]
ACTIONS = ("create", "copy", "setup", "run", "delete", "all")
REMOTE_DIR = "mars_jax"
REMOTE_DATA_DIR = "shared/data"  # <REMOTE_DIR>/../shared/data: default_manual_dir() there
ARCHIVE = "/tmp/mars_jax_src.tgz"
DATA_ARCHIVE = "/tmp/mars_jax_data.tgz"

_NAME = flags.DEFINE_string("name", None, "TPU VM (slice) name.")
_ZONE = flags.DEFINE_string("zone", None, "GCP zone, e.g. us-east5-a.")
_PROJECT = flags.DEFINE_string("project", "", "GCP project (default: gcloud's).")
_ACCELERATOR = flags.DEFINE_string("accelerator", "v5p-8", "Accelerator type, e.g. v5p-512.")
_RUNTIME = flags.DEFINE_string("runtime", "v2-alpha-tpuv5", "TPU VM software version.")
_SPOT = flags.DEFINE_bool("spot", False, "Create a Spot slice.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands without running them.")
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

    def _gcloud(self, *args: str) -> list[str]:
        cmd = ["gcloud", "compute", "tpus", "tpu-vm", *args, f"--zone={self.zone}"]
        return cmd + ([f"--project={self.project}"] if self.project else [])

    def _on_all_workers(self, command: str) -> list[str]:
        return self._gcloud("ssh", self.name, "--worker=all", f"--command={command}")

    def create(self) -> list[list[str]]:
        cmd = self._gcloud("create", self.name, f"--accelerator-type={self.accelerator}",
                           f"--version={self.runtime}")
        return [cmd + (["--spot"] if self.spot else [])]

    def copy(self, repo: Path = REPO, data: str | None = None) -> list[list[str]]:
        """Archive the working tree (no .git, caches or build outputs) and the problem data
        (default: `mars_jax.data.paths.default_manual_dir()`), and unpack them everywhere."""
        try:
            data = data or default_manual_dir()
        except FileNotFoundError as e:
            raise ValueError(f"copy: {e}") from e
        if not os.path.isdir(data):
            raise ValueError(f"copy: no problem data at {data} (set MARS_JAX_DATA_DIR)")
        unpack = " && ".join(
            f"rm -rf ~/{remote} && mkdir -p ~/{remote} && tar -xzf {archive} -C ~/{remote}"
            for archive, remote in ((ARCHIVE, REMOTE_DIR), (DATA_ARCHIVE, REMOTE_DATA_DIR)))
        return [["tar", "-czf", ARCHIVE, "--exclude=.git", "--exclude=__pycache__",
                 "--exclude=*.egg-info", "-C", str(repo), "."],
                ["tar", "-czf", DATA_ARCHIVE, "-C", data, "."],
                self._gcloud("scp", ARCHIVE, DATA_ARCHIVE, f"{self.name}:/tmp/", "--worker=all"),
                self._on_all_workers(unpack)]

    def setup(self) -> list[list[str]]:
        return [self._on_all_workers(f"cd ~/{REMOTE_DIR} && python3 -m pip install -q -e '.[tpu]'")]

    def run(self, run_args: Sequence[str]) -> list[list[str]]:
        command = shlex.join(["python3", "experiments/run.py", "--distributed=on", *run_args])
        return [self._on_all_workers(f"cd ~/{REMOTE_DIR} && {command}")]

    def delete(self) -> list[list[str]]:
        return [self._gcloud("delete", self.name, "--quiet")]

    def commands(self, action: str, run_args: Sequence[str] = ()) -> list[list[str]]:
        """The command lines of `action` (one of ACTIONS), in order."""
        if action not in ACTIONS:
            raise ValueError(f"action: {action!r} is not one of {ACTIONS}")
        if action in ("run", "all") and not run_args:
            raise ValueError(f"{action}: pass experiments/run.py arguments after '--'")
        if action == "all":
            return self.create() + self.copy() + self.setup() + self.run(run_args)
        if action == "run":
            return self.run(run_args)
        return getattr(self, action)()


def main(argv: Sequence[str]) -> None:
    if len(argv) < 2:
        raise app.UsageError(f"usage: tpu_vm.py {{{','.join(ACTIONS)}}} [flags] [-- run.py args]")
    tpu = Slice(_NAME.value, _ZONE.value, _ACCELERATOR.value, _RUNTIME.value, _PROJECT.value,
                _SPOT.value)
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
