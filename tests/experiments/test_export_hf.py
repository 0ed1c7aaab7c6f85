"""`experiments/export_hf.py` on a real run: a tiny HF Qwen3-MoE (made by transformers) trained for
two RL steps by `experiments/run.py`, the first at learning rate 0 (the warm-up's first update),
the second at 1e-3 with rewards by index parity (`tests/fault/parity_reward_run.py`, so the update
has a gradient). The export of step 1 must be the input checkpoint, tensor for tensor and in
transformers' logits; that of step 2 the trained parameters (read back the trainer's way, with
the optimizer state), which moved. The export is then served by `transformers serve` and
evaluated by `eval_system.py` through the OpenAI-compatible client."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.utils.import_utils import is_serve_available

from experiments import export_hf
from mars_jax.checkpoint import Checkpointer
from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
from mars_jax.models import from_pretrained
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import init_train_state
from tests import hf_fixtures
from tests.cpu_env import cpu_env
from tests.distributed.processes import finish, free_port

REPO = Path(__file__).resolve().parents[2]
TINY_VOCAB = 261  # the tiny byte-level tokenizer's ids
LEARNING_RATE = 1e-3
SHARD_GB = 0.00005  # about 54 kB: the tiny model's export in several files
TRAIN = [
    sys.executable, str(REPO / "tests/fault/parity_reward_run.py"),
    "--config=" + str(REPO / "experiments/configs/smoke.py"),
    "--config.total_steps=2", "--config.optimizer.warmup_steps=1",
    f"--config.optimizer.learning_rate={LEARNING_RATE}",
    "--config.rollout.group_size=2", "--config.rollout.prompts_per_step=1",
    "--config.rollout.max_new_tokens.solver=8", "--config.rollout.max_new_tokens.verifier=8",
    "--config.rollout.max_new_tokens.corrector=8", "--config.rollout.max_stages=3",
    "--config.learner.micro_batch_size=8", "--config.checkpoint.async_save=False",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF checkpoint the run started from, the run's workdir)."""
    root = tmp_path_factory.mktemp("export_hf")
    hf = hf_fixtures.save_tiny_hf(root / "hf", moe=True, vocab_size=TINY_VOCAB)
    workdir = root / "run"
    subprocess.run([*TRAIN, f"--workdir={workdir}", f"--config.model.checkpoint={hf}",
                    f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}"],
                   env=cpu_env(), check=True, capture_output=True, timeout=900)
    return hf, workdir


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_learning_rate_0_step_exports_the_input_checkpoint(run, tmp_path):
    hf, workdir = run
    out = tmp_path / "export"
    assert export_hf.export(workdir, out, step=1, mesh="fsdp", max_shard_bytes=50_000) == 1
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    expected, exported = _hf_state(hf), _hf_state(out)
    assert exported.keys() == expected.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name]), name
    ids, mask = hf_fixtures.padded_batch(vocab=TINY_VOCAB)
    np.testing.assert_array_equal(hf_fixtures.hf_logits(out, ids, mask),
                                  hf_fixtures.hf_logits(hf, ids, mask))


def test_export_carries_the_runs_tokenizer_and_generation_config(run, tmp_path):
    _, workdir = run
    out = tmp_path / "export"
    export_hf.export(workdir, out, step=1)
    loaded, tiny = transformers.AutoTokenizer.from_pretrained(out), tiny_tokenizer()
    assert loaded.chat_template == tiny.chat_template
    chat = [{"role": "system", "content": "Solve."}, {"role": "user", "content": "2 × 3 = ?"}]
    for thinking in (False, True):
        assert (encode_chat(loaded, chat, enable_thinking=thinking)
                == encode_chat(tiny, chat, enable_thinking=thinking))
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == list(eos_token_ids(tiny))
    assert (generation.temperature, generation.top_p) == (0.6, 0.95)  # the run's eval settings


def test_trained_step_exports_the_trained_parameters(run, tmp_path):
    hf, workdir = run
    out = tmp_path / "export"
    assert export_hf.export(workdir, out) == 2  # the newest step, on the run's mesh
    model = from_pretrained(hf)
    checkpointer = Checkpointer(workdir / "checkpoints", async_save=False)
    restored = checkpointer.restore_latest(init_train_state(model, make_optimizer(LEARNING_RATE)))
    checkpointer.close()
    assert restored.step == 2
    trained = dict(nnx.to_flat_state(restored.state.params))
    exported = dict(nnx.to_flat_state(nnx.state(from_pretrained(out), nnx.Param)))
    initial = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert exported.keys() == trained.keys()
    moved = []
    for key, variable in exported.items():
        np.testing.assert_array_equal(variable.get_value(), trained[key].get_value(),
                                      err_msg=str(key))
        if not np.array_equal(variable.get_value(), initial[key].get_value()):
            moved.append(key)
    assert ("lm_head",) in moved and ("embed_tokens", "embedding") in moved, moved


def test_bad_step_and_workdir_are_named(run, tmp_path):
    _, workdir = run
    with pytest.raises(export_hf.ExportError, match=r"--step=7: .* holds steps \[1, 2\]"):
        export_hf.export(workdir, tmp_path / "out", step=7)
    with pytest.raises(export_hf.ExportError, match="training run's workdir"):
        export_hf.export(tmp_path / "nothing", tmp_path / "out")


def test_two_processes_export_what_one_process_does(run, tmp_path):
    """The command on 2 processes of 2 devices each (parameters sharded across them, gathered
    for writing, process 0 writing) writes the tensors of the in-process export."""
    _, workdir = run
    single, multi = tmp_path / "single", tmp_path / "multi"
    export_hf.export(workdir, single, mesh="fsdp", max_shard_bytes=int(SHARD_GB * 1024 ** 3))
    port = free_port()
    runs = [subprocess.Popen(
        [sys.executable, str(REPO / "experiments/export_hf.py"), f"--workdir={workdir}",
         f"--output={multi}", "--mesh=fsdp", f"--max_shard_gb={SHARD_GB}",
         f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"],
        env=cpu_env(devices=2, PYTHONPATH=str(REPO)), cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = finish(runs, timeout=300)
    assert "exported step 2" in outputs[0] and "exported" not in outputs[1]
    assert sorted(p.name for p in multi.iterdir()) == sorted(p.name for p in single.iterdir())
    expected, exported = _hf_state(single), _hf_state(multi)
    assert exported.keys() == expected.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name]), name


def _wait_healthy(server: subprocess.Popen, url: str, log: Path, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"transformers serve exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"transformers serve not healthy within {limit_s} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow  # transformers serve takes about a minute to start on 2 cores
@pytest.mark.skipif(not is_serve_available(),
                    reason="`transformers serve` needs transformers[serving] (fastapi, uvicorn, "
                           "openai, ...): pip install 'transformers[serving]'")
def test_export_served_by_transformers_serve_is_evaluated(run, tmp_path):
    _, workdir = run
    model_dir = tmp_path / "export"
    export_hf.export(workdir, model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
            stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        _wait_healthy(server, url, log)
        problems, stages = 2, ("solver", "verifier", "corrector")
        subprocess.run(
            [sys.executable, str(REPO / "experiments/run.py"),
             "--config=" + str(REPO / "experiments/configs/eval_system.py"),
             f"--workdir={tmp_path / 'eval'}", "--config.eval.policy=http",
             f"--config.eval.vc_base_url={url}/v1", f"--config.eval.served_model={model_dir}",
             f"--config.eval.num_problems={problems}", "--config.eval.num_samples=1",
             "--config.eval.max_iterations=1", "--config.eval.timeout_s=120",
             *(f"--config.eval.max_new_tokens.{stage}=8" for stage in stages)],
            env=cpu_env(), check=True, capture_output=True, timeout=600)
    finally:
        server.terminate()
        server.wait(timeout=60)
    records = [json.loads(line) for line in
               (tmp_path / "eval/eval/records.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "eval/eval/summary.json").read_text())
    assert len(records) == problems and summary["num_records"] == problems
    served = [line for line in log.read_text().splitlines() if "/v1/chat/completions" in line]
    assert served and all("200 OK" in line for line in served), served
    steps = [step for r in records for step in r["steps"]]
    assert steps and all(s["finish_reason"] != "error" and s["num_tokens"] > 0
                         for s in steps), steps
