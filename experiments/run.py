r"""Entry point of every mars_jax job: MarsRL training or V–C system evaluation.

  python experiments/run.py --config=experiments/configs/smoke.py --workdir=/tmp/smoke
  python experiments/run.py --config=experiments/configs/eval_system.py --workdir=/tmp/eval

`--config.<field>=value` overrides any config field. Rerunning a training command on the same
workdir resumes it; exit code 75 means it was preempted (SIGTERM) after a final checkpoint.
"""
import os
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from mars_jax import eval_job
from mars_jax.rl import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and outputs.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    config = _CONFIG.value
    if config.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(config.jax_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if config.job == "train":
        try:
            trainer.train(config, _WORKDIR.value)
        except trainer.Preempted as e:
            logging.warning("%s", e)
            sys.exit(trainer.PREEMPTED_EXIT_CODE)
    elif config.job == "eval_system":
        eval_job.run(config, _WORKDIR.value)
    else:
        raise app.UsageError(f"config.job: {config.job!r} is not 'train' or 'eval_system'")


if __name__ == "__main__":
    app.run(main)
