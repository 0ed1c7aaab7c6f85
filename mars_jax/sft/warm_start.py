"""A cached SFT warm start for a training run (`warm_start.sft`): built on first use, then reused.

The cache key hashes everything that changes the weights, the trace and training code (`SOURCES`)
included; a build is renamed into place once complete, so an interrupted one is never read. A
`gs://` cache_dir is shared through a local mirror.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

from ml_collections import ConfigDict

import mars_jax
from mars_jax import builders, console, storage
from mars_jax.sft import job as sft_job

# Sources (relative to the mars_jax package) whose code decides the warm start's weights.
SOURCES = ("sft/*.py", "data/arith.py", "data/datasets.py", "data/tokenizer.py",
           "agents/prompts.py", "rewards/text.py", "rewards/agent_rewards.py", "builders.py",
           "models/*.py", "layers/*.py", "optimizer.py")
_SFT_SECTIONS = ("data", "model", "sft", "optimizer")
MIRROR = "~/.cache/mars_jax/warm_start_mirror"  # local copies of a gs:// cache's builds
COMPLETE = "complete"  # in a gs:// cache, written after the rest of a build
# Fields that do not change the weights: what the job logs and probes, the RL problem order,
# the decay length (the job decays over sft.steps).
_NOT_WEIGHTS = {"data": ("shuffle",), "sft": ("eval_every", "probe_every", "probe_slots"),
                "optimizer": ("decay_steps",)}


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
    """16 hex digits of SHA-256 over what trains the SFT model, its chat template and `SOURCES`."""
    sft = sft_config(config)
    fields = {"tokenizer": sft.tokenizer, "seed": sft.seed,
              "prompt_style": sft.rollout.prompt_style,
              **{name: sft[name].to_dict() for name in _SFT_SECTIONS}}
    for section, names in _NOT_WEIGHTS.items():
        for name in names:
            fields[section].pop(name, None)
    if sft.sft.arch:
        del fields["model"]["preset"]  # the architecture is sft.arch's
    template = getattr(builders.build_tokenizer(sft), "chat_template", None) or ""
    fields["chat_template"] = hashlib.sha256(template.encode()).hexdigest()
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=list).encode())
    root = Path(mars_jax.__file__).parent
    for path in sorted(p for pattern in SOURCES for p in root.glob(pattern)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_path(config: ConfigDict) -> Path:
    """Where `config`'s warm start is (or will be) cached locally: `<cache_dir>/<fingerprint>`
    (for a `gs://` cache_dir, `MIRROR/<fingerprint>`)."""
    root = MIRROR if storage.is_remote(config.warm_start.cache_dir) else config.warm_start.cache_dir
    return Path(os.path.expanduser(root)) / fingerprint(config)


def ensure(config: ConfigDict) -> Path:
    """The warm start's model directory, trained now (`sft.steps` steps) if not cached yet."""
    if not storage.is_remote(config.warm_start.cache_dir):
        return _ensure_local(config)
    shared = storage.path(config.warm_start.cache_dir) / fingerprint(config)
    target = cache_path(config)
    if not (target / "model" / "config.json").exists() and (shared / COMPLETE).exists():
        console.note(f"warm start: copying {shared} to {target}")
        tmp = target.with_name(f"{target.name}.tmp.{socket.gethostname()}.{os.getpid()}")
        storage.copy_tree(shared, tmp)
        (tmp / COMPLETE).unlink()
        _move_into_place(tmp, target)
        return target / "model"
    model = _ensure_local(config)
    if not (shared / COMPLETE).exists():
        storage.copy_tree(target, shared)
        storage.write_text(shared / COMPLETE, "")
    return model


def _ensure_local(config: ConfigDict) -> Path:
    target = cache_path(config)
    if (target / "model" / "config.json").exists():
        console.note(f"warm start: reusing {target / 'model'}")
        return target / "model"
    console.note(f"warm start: {config.sft.steps} SFT steps on generated traces, cached in "
                 f"{target} (first run only)")
    prefix = f"{target.name}.tmp.{socket.gethostname()}."
    for stale in target.parent.glob(prefix + "*"):  # this host's builds killed part-way
        if not _alive(stale.name.removeprefix(prefix)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = target.with_name(f"{prefix}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    summary = sft_job.run(sft_config(config), str(tmp))
    _move_into_place(tmp, target)
    console.note("warm start: held-out loss per reply token " + ", ".join(
        f"{k.removeprefix('loss/')} {v:.3f}" for k, v in sorted(summary.items())
        if k.startswith("loss/")))
    return target / "model"


def _move_into_place(tmp: Path, target: Path) -> None:
    """Renames build `tmp` to `target`, or drops it when another process finished first."""
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same build first: keep its copy
        if not (target / "model" / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: str) -> bool:
    """Whether process `pid` of this host runs (a build of it may be under way)."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
