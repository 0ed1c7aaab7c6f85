r"""Entry point of every mars_jax job: MarsRL training, V–C system evaluation or SFT warm start.

  python experiments/run.py --config=experiments/configs/smoke.py --workdir=/tmp/smoke
  python experiments/run.py --config=experiments/configs/eval_system.py --workdir=/tmp/eval
  python experiments/run.py --config=experiments/configs/study.py:sft --workdir=/tmp/mars_study/sft

`--config.<field>=value` overrides any config field (`experiments/configs/common.py`). Rerunning
a training command on the same workdir resumes it; a resume whose config changes a field of
`mars_jax.config_diff.RESUME_FIELDS` stops unless `--allow_config_change=field,...` lists it. A
config with `warm_start.sft` first builds (or reuses) its cached SFT model. Library INFO logs
appear only with `--verbosity=0`.

Exit codes: 2 invalid config (each field named with its fix, before anything is built); 65 too
many non-finite updates in a row; 74 a checkpoint could not be saved, or none could be read:
rerun to resume; 75 preempted after a final checkpoint: rerun to resume.
"""
import os
import re
import sys
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from mars_jax import config_diff, console, distributed, eval_job, preemption, xla_cpu
from mars_jax.checkpoint import CheckpointMismatch, CheckpointSaveError, CheckpointUnavailable
from mars_jax.config_validation import field_problem, field_type, validate
from mars_jax.errors import ConfigError, Problem
from mars_jax.rl import trainer
from mars_jax.sft import job as sft_job
from mars_jax.sft import warm_start

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"))
from common import base_config  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and outputs.")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_list(
    "allow_config_change", [], "Config fields (or sections) a resumed training run may change "
    "although they change what its checkpoint holds (mars_jax.config_diff.RESUME_FIELDS), e.g. "
    "rollout.group_size,rollout.mode.")
flags.mark_flags_as_required(["config", "workdir"])
_OVERRIDE = re.compile(r"--(?:no)?config\.([^=\s]+)")


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    started = time.perf_counter()
    xla_cpu.reserve_threads()  # before the backend starts
    distributed.initialize_from_flags()  # several processes: before anything starts a backend
    config = _CONFIG.value
    try:  # jax.device_count() starts the backend: keep this after any distributed init
        validate(_as_validated(config), base_config(), device_count=jax.device_count())
        config_diff.check_allowed(_ALLOW_CONFIG_CHANGE.value, config)
    except ConfigError as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
    jax.config.update("jax_default_matmul_precision", config.matmul_precision)
    if config.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(config.jax_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if config.job == "train":
        if config.warm_start.sft:
            config.model.checkpoint = str(warm_start.ensure(config))
        try:
            trainer.train(config, _WORKDIR.value, allow_config_change=_ALLOW_CONFIG_CHANGE.value)
        except ConfigError as e:  # config_diff.ConfigChanged, a micro-batch the mesh cannot split
            print(e, file=sys.stderr)
            distributed.exit_process(e.exit_code)
        except trainer.Preempted as e:
            _preempted(e)
        except (trainer.NonFiniteUpdates, CheckpointSaveError, CheckpointUnavailable,
                CheckpointMismatch) as e:
            logging.error("%s: %s", type(e).__name__, e)
            distributed.exit_process(e.exit_code)
        if jax.process_index() == 0:
            console.note(console.summary(_WORKDIR.value, ["python", *sys.argv],
                                         time.perf_counter() - started))
    elif config.job == "eval_system":
        try:
            eval_job.run(config, _WORKDIR.value)
        except preemption.Preempted as e:
            _preempted(e)
    elif config.job == "sft":
        sft_job.run(config, _WORKDIR.value)
    else:
        raise app.UsageError(f"config.job: {config.job!r} is not 'train', 'eval_system' or 'sft'")
    distributed.exit_process(0)  # everything is written: no teardown (its docstring)


def _preempted(e: preemption.Preempted) -> None:
    """Exits 75 after SIGTERM, what can be resumed from saved: within `preemption.LEAVE_S`
    even if another host never reaches the exit (the job's watchdog ended with the job)."""
    logging.error("%s: %s", type(e).__name__, e)
    distributed.exit_process(e.exit_code, within_s=preemption.LEAVE_S)


def _as_validated(config):
    """An `sft` config as validated: as 'train', since `sft` reads the train job's fields (data,
    model, optimizer)."""
    if config.job != "sft":
        return config
    checked = config.copy_and_resolve_references()
    checked.job = "train"
    return checked


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, except that `--config.<field>` overrides naming no field of
    `common.base_config()`, or whose value does not parse as the field's type, exit 2 naming
    each field (absl would print a traceback or its own error and exit 1)."""
    schema = base_config()
    overrides = {m.group(1): arg for arg in argv[1:] if (m := _OVERRIDE.match(arg))}
    problems = [p for field in overrides if (p := field_problem(field, schema))]
    unknown = {overrides[p.field] for p in problems}
    if unknown:  # parsed without them (the config flag reads its overrides from sys.argv)
        argv = sys.argv = [arg for arg in argv if arg not in unknown]
    try:
        args = flags.FLAGS(argv)
    except flags.Error as e:
        field = next((f for f, arg in overrides.items() if str(e).startswith(f"flag {arg}:")),
                     None)
        if field is None and not problems:
            return app.parse_flags_with_usage(argv)  # not an override: absl's own message
        if field is not None:
            want = field_type(schema, field).__name__
            reason = str(e).removeprefix(f"flag {overrides[field]}: ")
            problems.append(Problem(field, f"{overrides[field]} does not parse as {want} "
                                           f"({reason})", f"give it a value of type {want}"))
    if not problems:
        return args
    print(ConfigError(problems), file=sys.stderr)
    sys.exit(ConfigError.exit_code)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
