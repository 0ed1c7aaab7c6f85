"""The streaming scheduler on two processes (one engine per host) run through `experiments/run.py`
with rewards that vary within groups (`recorded_stream_run.py`), the same config as one process
runs (`learner.micro_batch_size` counts the rows of all hosts):

* sequential mode on 2 processes of 2 devices (and, slow tier, 4 of one device) trains what one
  process on 8 devices trains (token ids and rewards per rollout uid), its parameters after 3
  updates agree within float32 summation order, and it saves a checkpoint every step;
* pipeline mode with a rollout submesh per host (2 of each host's 4 devices) decodes while the
  update runs, keeps every trained sample within the staleness bound, each copy of the weights
  reaches every host's engine equal to the trainer's, and the update's thread launches no
  program on a rollout device;
* 2 processes of 2 devices each (the smallest pool of XLA:CPU threads, `mars_jax.xla_cpu`) finish
  in either mode with a checkpoint every step, and so do 4 of one device in pipeline mode (slow
  tier);
* in pipeline mode, both processes SIGKILLed mid-run and restarted end with the metrics of the
  uninterrupted run;
* in every run, each host runs the same sequence of global device programs, host exchanges and
  checkpoints (`program_recorder.py`), and the engine and the rollout scheduler only run programs
  on their host's own devices (its rollout submesh where it has one).
"""
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.cpu_env import cpu_env
from tests.distributed.processes import finish, free_port
from tests.fault import harness

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("recorded_stream_run.py")
OVERRIDES = [
    "--config.total_steps=3", "--config.rollout.decode_engine=engine",
    "--config.rollout.group_size=2", "--config.rollout.prompts_per_step=2",
    "--config.rollout.max_new_tokens.solver=16", "--config.rollout.max_new_tokens.verifier=16",
    "--config.rollout.max_new_tokens.corrector=16", "--config.rollout.max_stages=3",
    "--config.rollout.engine_slots=8", "--config.data.shuffle=False",
    "--config.checkpoint.every_steps=1",
    "--config.learner.micro_batch_size=8",  # rows per micro-batch over all hosts
]
SEQUENTIAL = ("--config.rollout.mode=sequential",)
TIMING = ("time/", "tokens_per_second", "stream/deferred_seconds", "stream/sync_seconds",
          "sync/seconds")


def _command(workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--config=experiments/configs/smoke.py",
            f"--workdir={workdir}",
            f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}",
            *OVERRIDES, *extra]


def _start(workdir: Path, processes: int, *extra: str, devices: int = 0
           ) -> list[subprocess.Popen]:
    """The run on `processes` processes of `devices` fake CPU devices each (0: 8 in all)."""
    env = cpu_env(devices=devices or 8 // processes, PYTHONPATH=str(ROOT))
    hosts = [] if processes == 1 else [f"--coordinator_address=localhost:{free_port()}",
                                       f"--num_processes={processes}"]
    return [subprocess.Popen(
        _command(workdir, *extra, *hosts, *([f"--process_id={pid}"] if hosts else [])),
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pid in range(processes)]


def _records(workdir: Path, process: int, key: str) -> list:
    lines = (workdir / f"record{process}.jsonl").read_text().splitlines()
    return [entry[key] for entry in map(json.loads, lines) if key in entry]


def _trained(workdir: Path, processes: int) -> list[dict[str, tuple]]:
    """Per update: uid -> (response ids, reward) over every host."""
    per_host = [_records(workdir, p, "trained") for p in range(processes)]
    assert len({len(updates) for updates in per_host}) == 1
    return [{uid: (tuple(ids), reward) for host in update for uid, ids, reward in host}
            for update in zip(*per_host)]


def _programs(workdir: Path, process: int) -> list[dict]:
    return list(map(json.loads, (workdir / f"programs{process}.jsonl").read_text().splitlines()))


def _check_programs(workdir: Path, processes: int, engine_devices: int) -> None:
    """Every host ran the same global programs, exchanges and checkpoints in the same order, and
    the engine and the scheduler ran programs on `engine_devices` of the host's own devices
    only (all of them, or its rollout submesh)."""
    recorded = [_programs(workdir, p) for p in range(processes)]
    sequences = [[tuple(e["global"]) for e in host if "global" in e] for host in recorded]
    kinds = {kind for kind, _ in sequences[0]}
    assert kinds == {"program", "exchange", "checkpoint"}, kinds
    for process, sequence in enumerate(sequences[1:], 1):
        first = next((i for i, (a, b) in enumerate(itertools.zip_longest(sequence, sequences[0]))
                      if a != b), None)
        assert first is None, (f"host {process} departs from host 0 at {first}: "
                               f"{sequence[first:first + 3]} != {sequences[0][first:first + 3]}")
    for process, host in enumerate(recorded):
        assert not [e for e in host if "decode_global" in e]
        decode = {tuple(d) for e in host if e.get("decode") for d in e["devices"]}
        assert {p for p, _ in decode} == {process} and len(decode) == engine_devices, decode


def _metrics(workdir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)}
            for row in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())]


def _check_checkpoints(workdir: Path) -> None:
    """Both hosts logged steps 1-3, and a checkpoint was saved after every step."""
    for metrics in (workdir / "metrics.jsonl", workdir / "host1" / "metrics.jsonl"):
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    assert {p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()} >= {"3"}
    checkpoints = [e for e in _programs(workdir, 0) if e.get("global", [None])[0] == "checkpoint"]
    assert [e["global"][1] for e in checkpoints] == ["1", "2", "3"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The workdir of the sequential run on one process of 8 devices."""
    workdir = tmp_path_factory.mktemp("one")
    finish(_start(workdir, 1, *SEQUENTIAL), timeout=900)
    return workdir


PIPELINE_2X2 = ("--config.rollout.mode=pipeline", "--config.learner.micro_batch_size=4")


@pytest.fixture(scope="module")
def pipeline_2x2(tmp_path_factory) -> Path:
    """The workdir of the pipeline run on 2 processes of 2 devices (a hang fails here)."""
    workdir = tmp_path_factory.mktemp("pipeline_2x2")
    finish(_start(workdir, 2, *PIPELINE_2X2, devices=2), timeout=900)
    return workdir


@pytest.mark.parametrize("processes, devices", [
    (2, 2), pytest.param(4, 1, marks=pytest.mark.slow)])  # 4 processes: ~11 min on 2 busy cores
def test_hosts_in_sequential_mode_train_what_one_process_trains(one_process, tmp_path,
                                                                processes, devices):
    finish(_start(tmp_path, processes, *SEQUENTIAL, devices=devices), timeout=900)
    one, many = _trained(one_process, 1), _trained(tmp_path, processes)
    assert len(one) == 3 and [len(update) for update in one] == [len(u) for u in many]
    assert one == many
    rewards = [reward for update in one for _, reward in update.values()]
    assert 0 < np.mean(rewards) < 1  # rewards vary within groups: the updates move weights
    # Host h takes problems h, h + processes, ...: in the first update hosts 0 and 1 train one
    # problem each and any others contribute padding rows.
    first = [_records(tmp_path, p, "trained")[0] for p in range(processes)]
    assert [sorted({uid.split("/")[0] for uid, _, _ in host}) for host in first] == (
        [["p0"], ["p1"]] + [[]] * (processes - 2))
    assert all(row["update/grad_norm"] > 0.1 for row in _metrics(tmp_path))
    _, single, _ = harness.latest_checkpoint(one_process)
    step, multi, version = harness.latest_checkpoint(tmp_path)
    assert step == 3 and version == 3
    for a, b in zip(single, multi, strict=True):  # the same sums in another order
        assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a)
    _check_checkpoints(tmp_path)
    _check_programs(tmp_path, processes, engine_devices=devices)


def test_two_hosts_in_pipeline_mode_decode_on_their_own_submeshes(tmp_path):
    runs = _start(tmp_path, 2, "--config.rollout.mode=pipeline",
                  "--config.rollout.staleness_bound=1", "--config.mesh.rollout.devices=2")
    finish(runs, timeout=900)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    hosts = [rows] + [[json.loads(line) for line in
                       (tmp_path / "host1" / "metrics.jsonl").read_text().splitlines()]]
    for host in hosts:
        assert [r["policy_version"] for r in host] == [1, 2, 3]
        assert max(r["staleness/max"] for r in host) <= 1
        assert all(r["sync/bytes"] > 0 for r in host)
    for process in range(2):  # the initial copy and one after each update
        assert _records(tmp_path, process, "copy_equal") == [True] * 4
        # The update's thread runs programs on the training devices only (launch/README.md).
        programs = _records(tmp_path, process, "update_thread_program")
        assert {"jit(micro_batch_gradients)", "jit(apply_gradients)"} <= {
            name for name, _ in programs}
        assert [name for name, on_rollout_device in programs if on_rollout_device] == []
        overlap = _records(tmp_path, process, "overlap_tokens")  # decoded during each update
        assert len(overlap) == 3 and sum(overlap) > 0, overlap
    _check_programs(tmp_path, 2, engine_devices=2)


def test_two_hosts_of_two_devices_finish_in_pipeline_mode_with_a_checkpoint_every_step(
        pipeline_2x2):
    _check_checkpoints(pipeline_2x2)
    _check_programs(pipeline_2x2, 2, engine_devices=2)


@pytest.mark.slow  # ~10 min on 2 busy cores
def test_four_hosts_of_one_device_finish_in_pipeline_mode_with_a_checkpoint_every_step(tmp_path):
    finish(_start(tmp_path, 4, "--config.rollout.mode=pipeline", devices=1), timeout=1200)
    _check_checkpoints(tmp_path)
    _check_programs(tmp_path, 4, engine_devices=1)


def test_both_hosts_killed_and_restarted_end_as_an_uninterrupted_run(tmp_path, pipeline_2x2):
    runs = _start(tmp_path, 2, *PIPELINE_2X2, devices=2)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 1):
        assert all(run.poll() is None for run in runs) and time.time() < deadline
        time.sleep(0.2)
    for run in runs:
        run.send_signal(signal.SIGKILL)
        run.wait()
    assert len(metrics.read_text().splitlines()) < 3
    finish(_start(tmp_path, 2, *PIPELINE_2X2, devices=2), timeout=900)
    assert _metrics(tmp_path) == _metrics(pipeline_2x2)
    assert _metrics(tmp_path / "host1") == _metrics(pipeline_2x2 / "host1")
