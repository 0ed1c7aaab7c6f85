"""What changed in a run's config since the checkpoint it resumes from.

A changed `RESUME_FIELDS` field (or one in a listed section) changes what the restored state means
and is refused with `ConfigChanged` (exit 2) unless `allowed` lists it; other changes pass with a
console note.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ml_collections import ConfigDict

from mars_jax import console, storage
from mars_jax.errors import ConfigError, Problem

RESUME_FIELDS = (
    "job", "seed", "tokenizer",
    "model.preset", "model.checkpoint", "model.param_dtype",
    "data.name", "data.split", "data.shuffle", "data.arith",
    "rollout.mode", "rollout.group_size", "rollout.fan_out",
    "rollout.max_stages", "rollout.roles_trained", "rollout.prompt_style",
    "rollout.enable_thinking", "learner.routing_replay",
)
ALLOW_FLAG = "--allow_config_change"
RECORD_FILE = "config.json"  # the run's resolved config, in its workdir
_ABSENT = object()


class ConfigChanged(ConfigError):
    """Resuming would change what the restored state means; the message names each field."""

    def __init__(self, problems: list[Problem], step: int):
        super().__init__(problems)
        lines = "\n".join(f"  {p}" for p in problems)
        fields = ",".join(p.field for p in problems)
        self.args = (f"the config differs from the one checkpoint {step} was saved with, in "
                     f"{len(problems)} field(s) that change what the restored state means:\n"
                     f"{lines}\nrerun with the checkpoint's values, use another workdir to "
                     f"start afresh, or pass {ALLOW_FLAG}={fields} to resume anyway",)


def record(config: ConfigDict) -> dict:
    """`config` as plain JSON data (tuples as lists), the form a checkpoint holds."""
    return json.loads(json.dumps(config.to_dict()))


def write_record(workdir: str | os.PathLike, config: ConfigDict) -> None:
    """Writes `config` (`record`) to `workdir/config.json`, replacing it whole."""
    storage.write_text(storage.path(workdir) / RECORD_FILE,
                       json.dumps(record(config), indent=2, sort_keys=True) + "\n")


def read_record(workdir: str | os.PathLike) -> dict | None:
    """The config `workdir/config.json` records, or None where the workdir has none."""
    path = storage.path(workdir) / RECORD_FILE
    return json.loads(path.read_text()) if path.exists() else None


def check_allowed(allowed: Iterable[str], config: ConfigDict) -> None:
    """Raises `ConfigError` for a name in `allowed` that is no field or section of `config`."""
    fields = _flat(record(config))
    unknown = [name for name in allowed if not any(_within(f, name) for f in fields)]
    if unknown:
        raise ConfigError([Problem(ALLOW_FLAG, f"{name!r} is not a config field or section",
                                   "name fields as in --config.<field>, e.g. rollout.group_size")
                           for name in unknown])


def check_resume(saved: Mapping[str, Any] | None, config: ConfigDict, *, step: int,
                 allowed: Iterable[str] = ()) -> None:
    """Compares checkpoint `step`'s config `saved` (None: nothing to compare) with `config`:
    raises `ConfigChanged` for changed `RESUME_FIELDS` not in `allowed`, notes the rest."""
    if saved is None:
        console.note(f"checkpoint {step} holds no config (written by an older version): "
                     "resuming without comparing it")
        return
    old, new = _flat(saved), _flat(record(config))
    changed = [f for f in sorted(old.keys() | new.keys())
               if old.get(f, _ABSENT) != new.get(f, _ABSENT)]
    allowed = tuple(allowed)
    refused = [f for f in changed if f in old and f in new and _resume_field(f)
               and not any(_within(f, a) for a in allowed)]
    if refused:
        raise ConfigChanged([Problem(f, f"{old[f]!r} in the checkpoint, {new[f]!r} now",
                                     f"set it back to {old[f]!r}") for f in refused], step)
    if changed:
        console.note(f"config changed since checkpoint {step}: " + "; ".join(
            f"{f} {_show(old.get(f, _ABSENT))} -> {_show(new.get(f, _ABSENT))}"
            for f in changed))


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _within(field: str, section: str) -> bool:
    return field == section or field.startswith(section + ".")


def _resume_field(field: str) -> bool:
    return any(_within(field, f) for f in RESUME_FIELDS)


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(value)
