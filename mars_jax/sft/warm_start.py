"""A cached SFT warm start for a training run (`warm_start.sft`): built on first use, then reused.

`ensure(config)` returns the HF directory of the model that the `sft` job (`mars_jax.sft.job`)
trains from the run's tokenizer, seed, `data`, `model` and `sft` sections, with the optimizer
fields of `warm_start` (`sft_config`). It lives in `warm_start.cache_dir/<fingerprint>/model`;
the fingerprint hashes that SFT config and the source files of the code that generates the traces
and trains on them (`SOURCES`), so a change to either builds a new one. A build is written to a
temporary directory and renamed into place once complete: an interrupted build leaves nothing a
later run reads. Every process of a multi-process job builds (or finds) its own copy.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ml_collections import ConfigDict

import mars_jax
from mars_jax import console
from mars_jax.sft import job as sft_job

# Sources (relative to the mars_jax package) whose code decides the warm start's weights.
SOURCES = ("sft/*.py", "data/arith.py", "data/tokenizer.py", "agents/prompts.py", "models/*.py",
           "layers/*.py", "rl/update.py")
_SFT_SECTIONS = ("data", "model", "sft", "optimizer")


def sft_config(config: ConfigDict) -> ConfigDict:
    """The `sft` job config that builds `config`'s warm start: `config` with job 'sft', no
    `model.checkpoint` and the optimizer's learning rate, schedule and warm-up from `warm_start`."""
    c = config.copy_and_resolve_references()
    c.job, c.model.checkpoint = "sft", ""
    w = config.warm_start
    c.optimizer.learning_rate = w.learning_rate
    c.optimizer.schedule, c.optimizer.warmup_steps = w.schedule, w.warmup_steps
    return c


def fingerprint(config: ConfigDict) -> str:
    """16 hex digits of SHA-256 over the SFT config's fields that train it and `SOURCES`."""
    sft = sft_config(config)
    fields = {"tokenizer": sft.tokenizer, "seed": sft.seed,
              **{name: sft[name].to_dict() for name in _SFT_SECTIONS}}
    del fields["data"]["shuffle"]  # the RL problem order; SFT draws its own
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=list).encode())
    root = Path(mars_jax.__file__).parent
    for path in sorted(p for pattern in SOURCES for p in root.glob(pattern)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_path(config: ConfigDict) -> Path:
    """Where `config`'s warm start is (or will be) cached: `<cache_dir>/<fingerprint>`."""
    return Path(os.path.expanduser(config.warm_start.cache_dir)) / fingerprint(config)


def ensure(config: ConfigDict) -> Path:
    """The warm start's model directory, trained now (`sft.steps` steps) if not cached yet."""
    target = cache_path(config)
    if (target / "model" / "config.json").exists():
        console.note(f"warm start: reusing {target / 'model'}")
        return target / "model"
    console.note(f"warm start: {config.sft.steps} SFT steps on generated traces, cached in "
                 f"{target} (first run only)")
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    summary = sft_job.run(sft_config(config), str(tmp))
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same build first: keep its copy
        if not (target / "model" / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    console.note("warm start: held-out loss per reply token " + ", ".join(
        f"{k.removeprefix('loss/')} {v:.3f}" for k, v in sorted(summary.items()) if "/" in k))
    return target / "model"
