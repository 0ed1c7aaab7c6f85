"""Config validation: every problem of a config in one message, before anything is built."""
import subprocess
import sys
import time

import jax
import pytest
from ml_collections import ConfigDict, FieldReference

from experiments.configs import common, eval_system, quickstart, smoke
from mars_jax.config_validation import RANGES, RULE_CHECKED, validate
from mars_jax.errors import ConfigError
from tests.fault import harness


def _problems(config, device_count=1) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        validate(config, common.base_config(), device_count=device_count)
    return {p.field: str(p) for p in info.value.problems}


def test_shipped_configs_are_valid():
    validate(smoke.get_config(), common.base_config(), device_count=1)
    validate(common.base_config(), common.base_config(), device_count=8)
    validate(eval_system.get_config(), common.base_config(), device_count=8)
    validate(quickstart.get_config(), common.base_config(), device_count=1)


def test_a_warm_start_with_a_checkpoint_or_no_cache_is_named_with_the_fix():
    config = quickstart.get_config()
    config.model.checkpoint = "/some/model"
    config.warm_start.cache_dir = ""
    config.warm_start.schedule = "linear"
    problems = _problems(config)
    assert set(problems) == {"model.checkpoint", "warm_start.cache_dir", "warm_start.schedule"}
    assert "warm_start.sft builds the model" in problems["model.checkpoint"]
    config = quickstart.get_config()
    config.model.checkpoint, config.warm_start.sft = "/some/model", False
    validate(config, common.base_config(), device_count=1)  # no warm start: the checkpoint is used


def test_sft_short_rows_not_below_the_row_length_are_named():
    config = quickstart.get_config()
    config.sft.short_row_tokens = config.sft.row_tokens
    assert "not between 0 and sft.row_tokens" in _problems(config)["sft.short_row_tokens"]


def test_model_sizes_out_of_range_are_named():
    config = smoke.get_config()
    config.model.moe_block_size, config.model.moe_chunk_tokens = 0, -1
    problems = _problems(config)
    assert set(problems) == {"model.moe_block_size", "model.moe_chunk_tokens"}
    assert "0 is not a finite number >= 1" in problems["model.moe_block_size"]
    assert "-1 is not a finite number >= 0" in problems["model.moe_chunk_tokens"]


def test_unknown_missing_and_mistyped_fields_are_named_with_the_fix():
    config = smoke.get_config()
    config.rollout.groupsize = 4                      # typo in a config file
    del config.learner.logits_chunk
    config.rollout.max_new_tokens = ConfigDict(dict(solver="48", verifier=48, corrector=48))
    config.checkpoint = ConfigDict(dict(every_steps=1.5, keep=3, async_save="yes"))
    problems = _problems(config)
    assert set(problems) == {"rollout.groupsize", "learner.logits_chunk",
                             "rollout.max_new_tokens.solver", "checkpoint.every_steps",
                             "checkpoint.async_save"}
    assert "did you mean rollout.group_size?" in problems["rollout.groupsize"]
    assert "add it (default 256)" in problems["learner.logits_chunk"]
    assert "expected int, got str '48'" in problems["rollout.max_new_tokens.solver"]
    assert "expected bool" in problems["checkpoint.async_save"]


def test_an_unknown_eval_fallback_is_named_with_the_choices():
    config = eval_system.get_config()
    config.eval.fallback = "most_verifed"
    problems = _problems(config)
    assert set(problems) == {"eval.fallback"}
    assert "('most_passed', 'most_verified')" in problems["eval.fallback"]
    assert "set it to 'most_verified'" in problems["eval.fallback"]


def test_inconsistent_values_are_all_reported_at_once(tmp_path):
    config = smoke.get_config()
    config.rollout.group_size = 2
    config.rollout.fan_out = 3
    config.sft.keep.solver = 7.0
    config.mesh.data, config.mesh.tensor = 2, 2
    config.data.manual_dir = str(tmp_path / "missing")
    config.rollout.mode = "pipelined"
    config.optimizer.learning_rate = float("nan")
    problems = _problems(config, device_count=8)
    assert set(problems) == {"sft.keep.solver", "rollout.fan_out", "mesh",
                             "data.manual_dir", "rollout.mode",
                             "optimizer.learning_rate"}
    assert "fix: set it to a number in [0, 1]" in problems["sft.keep.solver"]
    assert "set rollout.fan_out <= 2" in problems["rollout.fan_out"]
    assert "product of axis sizes" in problems["mesh"] and "8" in problems["mesh"]
    assert "does not exist" in problems["data.manual_dir"]
    assert "set it to 'pipeline'" in problems["rollout.mode"]


def test_file_backed_dataset_without_a_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MARS_JAX_DATA_DIR", str(tmp_path))  # exists, but has no gsm8k files
    config = smoke.get_config()
    config.data.name, config.data.data_dir = "gsm8k", str(tmp_path / "tfds")
    problem = _problems(config)["data.manual_dir"]
    assert "no gsm8k_train.jsonl" in problem and "fix: set data.manual_dir" in problem

    config = eval_system.get_config("aime2025")
    config.eval.split = "train"
    assert set(_problems(config)) == {"eval.split", "eval.vc_base_url", "eval.served_model"}


def test_a_held_out_probe_outside_the_toy_task_is_named():
    config = smoke.get_config()
    config.eval.probe_every, config.eval.dataset, config.eval.split = 5, "gsm8k", "test"
    assert "toy arithmetic" in _problems(config)["eval.probe_every"]
    config.eval.dataset, config.eval.split = "arith", "test"
    validate(config, common.base_config(), device_count=1)


def test_run_py_exits_2_with_the_message_before_building_anything(tmp_path):
    config_file = tmp_path / "typo.py"
    config_file.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(harness.REPO / 'experiments/configs')!r})\n"
        "from smoke import get_config as smoke_config\n\n"
        "def get_config():\n"
        "    c = smoke_config()\n"
        "    c.rollout.fanout = 2\n"
        "    return c\n")
    workdir = tmp_path / "run"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(harness.RUN), f"--config={config_file}", f"--workdir={workdir}",
         "--config.rollout.group_size=1", "--config.loss.clip_low=-5",
         "--config.model.preset=qwen3_30b"],
        env=harness.env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("rollout.fanout: unknown field; fix: remove it (did you mean rollout.fan_out?)"
            in result.stderr)
    assert "rollout.group_size: 1 is not a finite number >= 2 (a GRPO advantage" in result.stderr
    assert "loss.clip_low: -5.0 is not a finite number in [0, 1)" in result.stderr
    assert "model.preset: 'qwen3_30b' is not one of" in result.stderr
    assert "Traceback" not in result.stderr
    assert not workdir.exists()  # nothing was built
    print(f"run.py rejected the config in {time.monotonic() - start:.1f}s")


def _numeric_fields(schema: ConfigDict, prefix: str = ""):
    """The dotted names of `schema`'s int and float fields (placeholders and tuples of numbers
    included)."""
    for key, value in schema.items(preserve_field_references=True):
        name = prefix + key
        if isinstance(value, ConfigDict):
            yield from _numeric_fields(value, name + ".")
            continue
        kind = value.get_type() if isinstance(value, FieldReference) else type(value)
        if kind in (int, float) or (kind is tuple and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            yield name


@pytest.mark.parametrize("steps", [(3, 2), (1, 2, 3), (5,), (2, 99)])
def test_profile_steps_other_than_first_and_last_within_the_run_are_named(steps):
    config = smoke.get_config()
    config.profile_steps = steps
    problems = _problems(config)
    assert set(problems) == {"profile_steps"}
    assert f"{steps!r} is not (first, last) with first <= last <= total_steps" in \
        problems["profile_steps"]
    config.profile_steps = (2, 3)
    validate(config, common.base_config(), device_count=1)


def test_every_numeric_field_has_a_range():
    numeric = set(_numeric_fields(common.base_config()))
    unranged = {f for f in numeric - RANGES.keys()
                if not any(f.startswith(section + ".") for section in RULE_CHECKED)}
    assert not unranged, f"give these fields a Range in config_validation.RANGES: {unranged}"
    assert not RANGES.keys() - numeric, "RANGES names fields that are not numeric fields"


@pytest.mark.parametrize("field, value, words", [
    ("eval.temperature", -1.0, "-1.0 is not a finite number >= 0; fix: set it to 0 or more"),
    ("eval.max_new_tokens.solver", -4, "-4 is not a finite number >= 1"),
    ("eval.timeout_s", -1.0, "-1.0 is not a finite number > 0; fix: set it above 0"),
    ("optimizer.b2", 1.5, "1.5 is not a finite number in [0, 1); fix: set it to a number in "
                          "[0, 1)"),
    ("sft.keep.solver", 7.0, "7.0 is not a finite number in [0, 1]"),
    ("loss.kl_coef", float("nan"), "nan is not a finite number >= 0"),
    ("loss.clip_low", -5.0, "-5.0 is not a finite number in [0, 1)"),
    ("loss.clip_c", 0.5, "0.5 is not a finite number 0 (off) or > 1; fix: set it to 0 (off) or "
                         "a number > 1"),
    ("optimizer.learning_rate", float("inf"), "inf is not a finite number >= 0"),
    ("rollout.group_size", 1, "1 is not a finite number >= 2 (a GRPO advantage compares"),
    ("rollout.temperature", 0.0, "0.0 is not a finite number > 0 (log-probabilities"),
    ("data.arith.num_ops", (0, 3), "(0, 3) has an element that is not a finite number >= 1"),
    ("seed", -1, "-1 is not a finite number >= 0"),
    ("profile_steps", (0, 1), "(0, 1) has an element that is not a finite number >= 1"),
    ("model.preset", "qwen3_30b", "'qwen3_30b' is not one of ('tiny', 'bench', "
                                  "'qwen3_30b_a3b'); fix: set it to 'qwen3_30b_a3b'"),
    ("model.moe_impl", "sparse", "'sparse' is not one of ('', 'auto', 'dense'"),
])
def test_a_value_out_of_its_range_is_named_with_its_bounds(field, value, words):
    config = smoke.get_config()
    *sections, name = field.split(".")
    node = config
    for part in sections:
        node = node[part]
    node[name] = value
    problems = _problems(config)
    assert set(problems) == {field}
    assert f"{field}: {words}" in problems[field]


def test_run_py_exits_2_naming_unknown_and_mistyped_overrides(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(harness.RUN), f"--config={harness.REPO}/experiments/configs/smoke.py",
         f"--workdir={workdir}", "--config.rollout.groupsize=3", "--config.evall.temperature=1",
         "--config.rollout.group_size=2.5"],
        env=harness.env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    for line in ("rollout.groupsize: unknown field; fix: remove it (did you mean "
                 "rollout.group_size?)",
                 "evall.temperature: unknown field; fix: remove it (did you mean eval?)",
                 "rollout.group_size: --config.rollout.group_size=2.5 does not parse as int "
                 "(invalid literal for int() with base 10: '2.5'); fix: give it a value of type "
                 "int"):
        assert line in result.stderr
    assert "Traceback" not in result.stderr
    assert not workdir.exists()  # nothing was built


def _streaming_smoke():
    """The smoke config on the engine."""
    config = smoke.get_config()
    config.rollout.decode_engine = "engine"
    return config


@pytest.mark.parametrize("mesh, field, words", [
    (dict(rollout=dict(devices=8)), "mesh.rollout.devices", "leaves none of the 8 devices"),
    (dict(rollout=dict(devices=-2)), "mesh.rollout.devices", "0 (one shared mesh) or positive"),
    (dict(rollout=dict(devices=3, data=2)), "mesh.rollout", "product of axis sizes"),
    (dict(rollout=dict(devices=3, data=-1, expert=2)), "mesh.rollout",
     "3 devices cannot be split with fixed axes of product 2"),
    (dict(data=1, fsdp=4, rollout=dict(devices=2)), "mesh",
     "6 devices are available; set one axis to -1 or fix the sizes (training submesh: 8 "
     "devices less mesh.rollout.devices=2)"),
    (dict(rollout=dict(devices=0, tensor=3)), "mesh.rollout",
     "8 devices cannot be split with fixed axes of product 3"),
    (dict(dcn=dict(data=2), rollout=dict(devices=4)), "mesh.dcn", "spans one slice"),
    (dict(rollout=dict(devices=2, fsdp=0)), "mesh.rollout.fsdp", "must be positive or -1"),
])
def test_a_rollout_training_split_that_does_not_fit_names_its_field(mesh, field, words):
    config = _streaming_smoke()
    for key, value in mesh.items():
        if isinstance(value, dict):
            for sub, size in value.items():
                config.mesh[key][sub] = size
        else:
            config.mesh[key] = value
    problems = _problems(config, device_count=8)
    assert set(problems) == {field}
    assert words in problems[field]
    assert "(8 device(s) available)" in problems[field] and "fix: " in problems[field]


def test_a_split_that_fits_is_valid():
    config = _streaming_smoke()
    config.mesh.data, config.mesh.fsdp = 1, -1
    config.mesh.rollout.devices, config.mesh.rollout.expert = 2, 2
    validate(config, common.base_config(), device_count=8)


def test_a_micro_batch_the_processes_cannot_share_evenly_is_named(monkeypatch):
    config = smoke.get_config()
    config.learner.micro_batch_size = 6  # rows over all hosts: 2 processes build 3 each
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    validate(config, common.base_config(), device_count=2)
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    problem = _problems(config, device_count=4)["learner.micro_batch_size"]
    assert "6 rows per micro-batch (over the whole training mesh) do not split evenly over 4 " \
        "processes" in problem
    assert "a multiple of 4, e.g. 4" in problem
