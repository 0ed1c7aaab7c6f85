"""Sweep expansion, the 30B configs and the TPU-VM launcher's commands (no xmanager, no cloud)."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "configs" / "marsrl_qwen3_30b_a3b.py"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(f"_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sweep = _module(ROOT / "launch" / "sweep.py")
tpu_vm = _module(ROOT / "launch" / "tpu_vm.py")


def test_config_sweep_is_grid_times_seeds():
    points = sweep.load_sweep(f"{CONFIG}:runlocal")
    assert len(points) == 8  # 2 learning rates x 2 temperatures x 2 seeds
    assert {p["config.seed"] for p in points} == {0, 1}
    assert len({sweep.run_name(p) for p in points}) == 8


def test_grid_sweep_and_run_args():
    points = sweep.grid_sweep(["config.optimizer.learning_rate=1e-4,3e-4"], [0, 1])
    assert points[1] == {"config.optimizer.learning_rate": 1e-4, "config.seed": 1}
    assert sweep.run_name(points[1]) == "learning_rate=0.0001_seed=1"
    args = sweep.run_args("c.py", "/w/r", points[1], ["--config.total_steps=2"])
    assert args == ["--config=c.py", "--workdir=/w/r", "--config.optimizer.learning_rate=0.0001",
                    "--config.seed=1", "--config.total_steps=2"]


@pytest.mark.parametrize("grid", [["learning_rate=1"], ["config.x"], ["config.x="]])
def test_grid_errors_name_the_flag(grid):
    with pytest.raises(ValueError, match="--grid"):
        sweep.grid_sweep(grid, [0])


def test_paper_and_runlocal_configs():
    sys.path.insert(0, str(CONFIG.parent))
    module = _module(CONFIG)
    paper = module.get_config("ckpt=/data/qwen")
    assert paper.model.checkpoint == paper.tokenizer == "/data/qwen"
    assert (paper.rollout.prompts_per_step, paper.rollout.group_size) == (128, 8)
    assert paper.rollout.max_new_tokens.solver == 65536
    # Pipeline mode on per-host engines: the paper's staleness of a 4-segment output (3
    # versions) bounds every trained sample.
    assert (paper.rollout.decode_engine, paper.rollout.mode) == ("engine", "pipeline")
    assert paper.rollout.staleness_bound == 3
    assert paper.rollout.max_prompt_tokens == 32768 and paper.rollout.max_stages == 5
    assert (paper.rollout.temperature, paper.rollout.top_p) == (0.85, 1.0)
    assert paper.optimizer.learning_rate == 1e-6 and paper.model.param_dtype == "bfloat16"
    local = module.get_config("runlocal")
    assert local.model.preset == "tiny" and local.total_steps == 2
    gpu = _module(CONFIG.with_name("marsrl_qwen3_30b_a3b_gpu.py")).get_config()
    assert gpu.learner.micro_batch_size == 8 and gpu.rollout.max_prompt_tokens == 32768
    with pytest.raises(ValueError, match="unknown options"):
        module.get_config("ckpt=/x,fast")


QUICKSTART = "--config=experiments/configs/quickstart.py"  # generated arith problems only


def test_tpu_vm_commands(monkeypatch):
    monkeypatch.delenv("MARS_JAX_DATA_DIR", raising=False)
    tpu = tpu_vm.Slice("marsrl", "us-east5-a", "v5p-512", project="p", max_restarts=4)
    [create] = tpu.commands("create")
    assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "marsrl"]
    assert "--accelerator-type=v5p-512" in create and "--project=p" in create
    everything = tpu.commands("all", [f"--config={CONFIG}:ckpt=/mnt/qwen", "--workdir=/mnt/w"])
    assert [c[4] if c[0] == "gcloud" else c[0] for c in everything] == [
        "create", "tar", "tar", "scp", "ssh", "ssh", "ssh"]
    data_archive, unpack = everything[2], everything[4][-3]
    assert data_archive[-3:] == ["-C", str(ROOT.parent / "shared" / "data"), "."]
    assert "tar -xzf /tmp/mars_jax_data.tgz -C ~/shared/data" in unpack  # ~/mars_jax/../shared
    setup, run = everything[-2][-3], everything[-1][-3]
    assert "uv venv --python 3.11 ~/mars_jax_venv" in setup
    assert "-c constraints.txt -e '.[tpu]'" in setup
    assert "--worker=all" in everything[-1]
    assert run.startswith("--command=cd ~/mars_jax && ~/mars_jax_venv/bin/python launch/restart.py "
                          "--max_restarts=4 --backoff_s=30 -- ~/mars_jax_venv/bin/python "
                          f"experiments/run.py --distributed=on --config={CONFIG}:ckpt=/mnt/qwen "
                          "--workdir=/mnt/w")
    for action in ("run", "all"):
        with pytest.raises(ValueError, match=f"{action}: pass experiments/run.py arguments"):
            tpu.commands(action)
    with pytest.raises(ValueError, match="action: 'start'"):
        tpu.commands("start")
    monkeypatch.setenv("MARS_JAX_DATA_DIR", "/nonexistent/data")
    with pytest.raises(ValueError, match="copy: the run reads problem files, and there is no "
                                         "problem data at /nonexistent/data"):
        tpu.commands("copy", ["--config=experiments/configs/eval_system.py:aime2025"])


@pytest.mark.parametrize("run_args, reads", [
    ([QUICKSTART, "--workdir=/w"], False),
    (["--config=experiments/configs/smoke.py", "--config.data.name=gsm8k"], True),
    (["--config=experiments/configs/smoke.py", "--config.data.name=gsm8k",
      "--config.data.manual_dir=/mnt/data"], False),  # the run names its own data dir
    (["--config=experiments/configs/eval_system.py:aime2025"], True),
    (["--config=experiments/configs/eval_system.py"], False),  # arith
])
def test_tpu_vm_copies_data_only_for_runs_that_read_it(monkeypatch, run_args, reads):
    monkeypatch.setenv("MARS_JAX_DATA_DIR", "/nonexistent/data")  # no data here: fine if unread
    assert tpu_vm.reads_problem_files(run_args) is reads
    if not reads:
        tpu = tpu_vm.Slice("marsrl", "us-east5-a")
        everything = tpu.commands("all", run_args)
        assert [c[4] if c[0] == "gcloud" else c[0] for c in everything] == [
            "create", "tar", "scp", "ssh", "ssh", "ssh"]
        assert "mars_jax_data" not in " ".join(" ".join(c) for c in everything)
        assert [c[0] for c in tpu.commands("copy")] == ["tar", "gcloud", "gcloud"]


def test_tpu_vm_config_errors_are_named():
    with pytest.raises(ValueError, match="no --config="):
        tpu_vm.reads_problem_files(["--workdir=/w"])
    with pytest.raises(ValueError, match="run.py arguments: .*nope"):
        tpu_vm.reads_problem_files([QUICKSTART, "--config.nope=1"])


def test_xm_launch_seeds_without_a_grid_is_refused():
    import subprocess
    base = [sys.executable, str(ROOT / "launch" / "xm_launch.py"), "--dry_run",
            "--workdir=/tmp/sweep", f"--config={CONFIG}:runlocal"]
    refused = subprocess.run(base + ["--seeds=3"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode != 0 and "--seeds applies to --grid" in refused.stderr
    gridded = subprocess.run(base + ["--grid=config.optimizer.learning_rate=1e-4", "--seeds=3,4"],
                             capture_output=True, text=True, cwd=ROOT, check=True)
    assert [line.endswith("--config.seed=3") or line.endswith("--config.seed=4")
            for line in gridded.stdout.splitlines()] == [True, True]


def test_xm_launch_runs_each_job_under_the_restart_loop_in_a_3_11_venv(tmp_path):
    import subprocess
    python_env = _module(ROOT / "launch" / "python_env.py")
    venv = tmp_path / "venv"
    dry = subprocess.run([sys.executable, str(ROOT / "launch" / "xm_launch.py"), "--dry_run",
                          "--workdir=/tmp/sweep", "--config=experiments/configs/smoke.py",
                          "--grid=config.seed=1", "--seeds=0", f"--venv={venv}", "--max_restarts=2"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout.splitlines()
    python = f"{venv}/bin/python"
    assert dry[0].endswith(f"venv --python 3.11 {venv}")
    assert f"pip install --python {python} -c {ROOT}/constraints.txt -e {ROOT}" in dry[1]
    assert dry[2].startswith(f"{python} {ROOT}/launch/restart.py --max_restarts=2 --backoff_s=10 -- "
                             f"{python} {ROOT}/experiments/run.py --config=experiments/configs/smoke.py")
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\necho 3 10\n")
    old.chmod(0o755)
    with pytest.raises(ValueError, match="is Python 3.10; the project needs 3.11 or newer"):
        python_env.check_python(str(old))
    python_env.check_python(sys.executable)
