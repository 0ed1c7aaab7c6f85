"""Checks a run's config before anything is built or compiled.

`validate(config, schema, device_count=...)` compares the final ConfigDict with the defaults
schema (`experiments/configs/common.py`) and raises one `ConfigError` listing every problem as
`field: problem; fix: ...`:

  schema       unknown fields (with the closest valid name), missing fields, wrong types (an
               int field takes int, a float field int or float, a placeholder also None);
  choices      enumerated strings (`CHOICES`);
  ranges       every numeric field but the mesh's has a `Range` in `RANGES` (a placeholder left
               None is not checked);
  rules        cross-field rules (`_rule`): fan_out <= group_size, the mesh fits the devices, the
               job's dataset can be found, an HTTP evaluation has a server, a warm start has a
               cache directory, the optimizer state is offloaded only on one shared mesh, ...

A rule that reads a field with a schema or range problem is skipped, so one wrong value yields
one message. `field_problem` and `field_type` check a `--config.<field>` override
(experiments/run.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Iterator

import jax
from ml_collections import ConfigDict, FieldReference

from mars_jax import sharding
from mars_jax.agents.prompts import STYLES
from mars_jax.agents.system import FALLBACKS
from mars_jax.errors import ConfigError, Problem
from mars_jax.layers.paged_kv import KERNELS
from mars_jax.models.config import ATTENTION_IMPLS, DTYPES, MOE_IMPLS
from mars_jax.models.presets import PRESETS
from mars_jax.rl.learner import PI_OLD
from mars_jax.rl.config import micro_batch_problem
from mars_jax.rl.losses import AGGREGATIONS, KL_ESTIMATORS
from mars_jax.rl.rollout import STAGE_ROLES
from mars_jax.rl.selection import POLICIES
from mars_jax.rl.streaming import MODES, RESUME_MODES, ROLES_TRAINED
from mars_jax.sampling.decode import ENGINE_KINDS
from mars_jax.types import ROLES


CHOICES: dict[str, tuple[str, ...]] = {
    "job": ("train", "eval_system", "sft"),
    "matmul_precision": ("default", "float32", "tensorfloat32", "bfloat16"),
    "rollout.mode": MODES,
    "rollout.decode_engine": ENGINE_KINDS,
    "rollout.resume": RESUME_MODES,
    "rollout.selection": POLICIES,
    "rollout.verifier_selection": ("", *POLICIES),
    "rollout.roles_trained": tuple(ROLES_TRAINED),
    "rollout.prompt_style": tuple(STYLES),
    "optimizer.schedule": ("constant", "cosine"),
    "warm_start.schedule": ("constant", "cosine"),
    "loss.kl_estimator": KL_ESTIMATORS,
    "loss.aggregation": AGGREGATIONS,
    "loss.pi_old": PI_OLD,
    "eval.policy": ("sampler", "http"),
    "eval.fallback": FALLBACKS,
    "rollout.engine_paged_attention": ("auto",) + KERNELS,
    "model.preset": tuple(PRESETS),
    "model.dtype": ("",) + DTYPES, "model.param_dtype": ("",) + DTYPES,
    "model.moe_impl": ("",) + MOE_IMPLS, "model.attention_impl": ("",) + ATTENTION_IMPLS,
}
@dataclasses.dataclass(frozen=True)
class Range:
    """The finite values a numeric field takes (each element, for a tuple): from `low` to
    `high`, each end included unless open; with `off`, also 0 (the term switched off)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    off: bool = False
    why: str = ""  # what the bound protects, shown with the problem

    def holds(self, value) -> bool:
        values = value if isinstance(value, (tuple, list)) else (value,)
        return all(isinstance(v, (int, float)) and math.isfinite(v)
                   and ((self.off and v == 0) or self._within(v)) for v in values)

    def _within(self, v: float) -> bool:
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            bound = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            bound = (f"in {'(' if self.low_open else '['}{_number(self.low)}, "
                     f"{_number(self.high)}{')' if self.high_open else ']'}")
        return f"0 (off) or {bound}" if self.off else bound

    @property
    def fix(self) -> str:
        if self.high == math.inf and not self.off:
            return (f"set it above {_number(self.low)}" if self.low_open
                    else f"set it to {_number(self.low)} or more")
        bound = dataclasses.replace(self, off=False)
        return f"set it to {'0 (off) or ' if self.off else ''}a number {bound}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


_PROBABILITY = Range(0, 1)
_ADAM_BETA = Range(0, 1, high_open=True)
# Every numeric field of common.py, except the mesh's (the mesh rule checks those).
RANGES: dict[str, Range] = {
    "seed": Range(0), "total_steps": Range(1), "max_nonfinite_updates": Range(1),
    "profile_steps": Range(1),
    "preemption_grace_s": Range(0, low_open=True),
    "data.arith.num_ops": Range(1), "data.arith.max_operand": Range(0),
    "data.arith.sizes": Range(1),
    "rollout.prompts_per_step": Range(1),
    "rollout.group_size": Range(2, why="a GRPO advantage compares samples within a group, so "
                                       "one sample has none"),
    "rollout.fan_out": Range(1), "rollout.max_stages": Range(1),
    **{f"rollout.max_new_tokens.{role}": Range(1) for role in ROLES},
    "rollout.max_decode_rows": Range(0),
    "rollout.staleness_bound": Range(0),
    "rollout.engine_slots": Range(0), "rollout.engine_chunk_steps": Range(1),
    "rollout.exchange_chunks": Range(1),
    "rollout.engine_admit_batch": Range(1), "rollout.engine_prefill_ahead": Range(0),
    "rollout.engine_kv_pages": Range(0), "rollout.engine_page_size": Range(1),
    "rollout.max_prompt_tokens": Range(1), "rollout.max_inflight_rows": Range(0),
    "rollout.max_problems_per_update": Range(0),
    "rollout.samples_per_update": Range(0), "rollout.truncated_reward": Range(-1, 1),
    "rollout.temperature": Range(0, low_open=True, why="log-probabilities are computed at "
                                                       "logits / T"),
    "rollout.top_p": Range(0, 1, low_open=True), "rollout.top_k": Range(0),
    "loss.clip_low": Range(0, 1, high_open=True), "loss.clip_high": Range(0),
    "loss.clip_c": Range(1, low_open=True, off=True), "loss.kl_coef": Range(0),
    "loss.max_response_len": Range(0), "loss.behaviour_weight_cap": Range(0),
    "loss.mastered_mask_prob": Range(0, 1, high_open=True), "loss.target_entropy": Range(0),
    "loss.entropy_coef": Range(0),
    "optimizer.learning_rate": Range(0), "optimizer.warmup_steps": Range(0),
    "optimizer.decay_steps": Range(0), "optimizer.b1": _ADAM_BETA, "optimizer.b2": _ADAM_BETA,
    "optimizer.eps": Range(0, low_open=True), "optimizer.weight_decay": Range(0),
    "optimizer.max_grad_norm": Range(0),
    "learner.micro_batch_size": Range(1), "learner.min_length": Range(1),
    "learner.min_micro_batches": Range(1), "learner.logits_chunk": Range(1),
    "learner.ppo_epochs": Range(1), "learner.mini_batches": Range(1),
    "learner.length_halvings": Range(0),
    "checkpoint.every_steps": Range(1), "checkpoint.keep": Range(1),
    "eval.num_problems": Range(0), "eval.num_samples": Range(1), "eval.k_accept": Range(1),
    "eval.max_iterations": Range(0), "eval.max_retries": Range(0),
    **{f"eval.max_new_tokens.{role}": Range(1) for role in ROLES},
    "eval.temperature": Range(0), "eval.top_p": Range(0, 1, low_open=True),
    "eval.timeout_s": Range(0, low_open=True), "eval.max_concurrency": Range(1),
    "eval.engine_slots": Range(0), "eval.probe_every": Range(0), "eval.probe_problems": Range(1),
    "warm_start.learning_rate": Range(0), "warm_start.warmup_steps": Range(0),
    "sft.steps": Range(1), "sft.stop_at": Range(0), "sft.rows": Range(1),
    "sft.row_tokens": Range(1),
    "sft.short_rows": Range(0), "sft.short_row_tokens": Range(0),
    "sft.solver_error_rate": _PROBABILITY, "sft.verifier_flawed_rate": _PROBABILITY,
    **{f"sft.keep.{role}": _PROBABILITY for role in ROLES},
    "sft.holdout_problems": Range(1), "sft.eval_every": Range(1), "sft.probe_every": Range(0),
    "sft.probe_slots": Range(1),
    "model.moe_block_size": Range(1), "model.moe_dense_max_tokens": Range(0),
    "model.moe_chunk_tokens": Range(0), "model.attention_block": Range(1),
}
RULE_CHECKED = ("mesh",)  # numeric fields whose values a rule checks instead of RANGES

Rule = Callable[[ConfigDict, int], Iterator[Problem]]
_RULES: list[tuple[tuple[str, ...], Rule]] = []


def validate(config: ConfigDict, schema: ConfigDict, *, device_count: int) -> None:
    """Raises `ConfigError` listing every problem of `config`; returns None when it can run."""
    problems = list(_schema_problems(config, schema))
    problems += _range_problems(config, {p.field for p in problems})
    bad = {p.field for p in problems}
    for fields, rule in _RULES:
        if not any(_overlap(f, b) for f in fields for b in bad):
            problems += rule(config, device_count)
    if problems:
        raise ConfigError(problems)


def _schema_problems(config: ConfigDict, schema: ConfigDict, prefix: str = ""
                     ) -> Iterator[Problem]:
    expected = dict(schema.items(preserve_field_references=True))
    for key in config.keys():
        if key not in expected:
            close = difflib.get_close_matches(key, list(expected), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            yield Problem(prefix + key, "unknown field", f"remove it{hint}")
    for key, default in expected.items():
        name = prefix + key
        if key not in config:
            yield Problem(name, "missing", f"add it (default {_plain(default)!r})")
            continue
        value = config[key]
        if isinstance(default, ConfigDict):
            if isinstance(value, ConfigDict):
                yield from _schema_problems(value, default, name + ".")
            else:
                yield Problem(name, f"expected a section, got {value!r}", "give it the "
                              "sub-fields of the defaults in experiments/configs/common.py")
        elif not _type_ok(value, default):
            want = _field_type(default)
            yield Problem(name, f"expected {want.__name__}, got {type(value).__name__} {value!r}",
                          f"give it a {want.__name__} value, like the default {_plain(default)!r}")


def _range_problems(config: ConfigDict, bad: set[str]) -> Iterator[Problem]:
    for field, allowed in RANGES.items():
        if any(_overlap(field, b) for b in bad):
            continue
        value = _get(config, field)
        if value is not None and not allowed.holds(value):
            why = f" ({allowed.why})" if allowed.why else ""
            what = "has an element that is" if isinstance(value, tuple) else "is"
            yield Problem(field, f"{value!r} {what} not a finite number {allowed}{why}",
                          allowed.fix)


def field_problem(field: str, schema: ConfigDict) -> Problem | None:
    """A `Problem` when the dotted `field` names no field of `schema`, else None."""
    node, prefix = schema, ""
    for part in field.split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            names = list(node.keys()) if isinstance(node, ConfigDict) else []
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            return Problem(field, "unknown field", f"remove it{hint}")
        node, prefix = node[part], f"{prefix}{part}."
    return None


def field_type(schema: ConfigDict, field: str) -> type:
    """The type of the dotted `field` of `schema` (a field `field_problem` accepts)."""
    *sections, name = field.split(".")
    for part in sections:
        schema = schema[part]
    return _field_type(dict(schema.items(preserve_field_references=True))[name])


def _plain(default):
    return default.get() if isinstance(default, FieldReference) else default


def _field_type(default) -> type:
    return default.get_type() if isinstance(default, FieldReference) else type(default)


def _type_ok(value, default) -> bool:
    if value is None:
        return isinstance(default, FieldReference) or default is None
    if default is None:
        return True
    want = _field_type(default)
    if isinstance(value, bool) or want is bool:
        return isinstance(value, bool) and want is bool
    if want is float:
        return isinstance(value, (int, float))
    return isinstance(value, want)


def _overlap(a: str, b: str) -> bool:
    """Whether field `a` is `b`, inside it, or holds it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _get(config: ConfigDict, field: str):
    for part in field.split("."):
        config = config[part]
    return config


def _rule(*fields: str) -> Callable[[Rule], Rule]:
    """Registers a rule that reads `fields`; it is skipped when one of them has a schema problem."""
    def register(rule: Rule) -> Rule:
        _RULES.append((fields, rule))
        return rule
    return register


def _choice(field: str, allowed: tuple[str, ...]) -> Rule:
    def rule(config: ConfigDict, device_count: int) -> Iterator[Problem]:
        value = _get(config, field)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), allowed, n=1)
            yield Problem(field, f"{value!r} is not one of {allowed}",
                          f"set it to {close[0] if close else allowed[0]!r}")
    return rule


_RULES += [((field,), _choice(field, allowed)) for field, allowed in CHOICES.items()]


@_rule("profile_steps", "total_steps")
def _profile_steps(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    steps = tuple(config.profile_steps)
    if steps and (len(steps) != 2 or steps[0] > steps[1] or steps[1] > config.total_steps):
        yield Problem("profile_steps", f"{steps!r} is not (first, last) with first <= last <= "
                      f"total_steps={config.total_steps}",
                      "set it to two steps, e.g. --config.profile_steps=3,4, or () for none")


@_rule("rollout.group_size", "rollout.fan_out", "rollout.max_stages")
def _groups(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    r = config.rollout
    if r.fan_out > r.group_size:
        yield Problem("rollout.fan_out", f"{r.fan_out} > rollout.group_size={r.group_size}: the "
                      "first Verifier stage picks its parents among the Solver's group",
                      f"set rollout.fan_out <= {r.group_size} or raise rollout.group_size")
    if r.max_stages > len(STAGE_ROLES):
        yield Problem("rollout.max_stages", f"{r.max_stages} > {len(STAGE_ROLES)} stages "
                      f"{STAGE_ROLES}", f"set it to {len(STAGE_ROLES)} or less")


@_rule("sft.steps", "sft.stop_at")
def _sft_stop(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    if config.sft.stop_at > config.sft.steps:
        yield Problem("sft.stop_at", f"{config.sft.stop_at} > sft.steps={config.sft.steps}: the "
                      "job would end after its schedule", f"set it to {config.sft.steps} or less")


@_rule("loss.aggregation", "loss.max_response_len")
def _sum_norm(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    if config.loss.aggregation == "seq-mean-token-sum-norm" and not config.loss.max_response_len:
        yield Problem("loss.max_response_len", "0 with loss.aggregation='seq-mean-token-sum-norm', "
                      "which divides each sequence's token sum by this constant",
                      "set it to the longest response budget (e.g. the largest "
                      "rollout.max_new_tokens)")


_MESH_FIXES = {
    "mesh": "make the product of mesh.data/fsdp/tensor/expert equal the device count (less "
            "mesh.rollout.devices when split), or set one axis to -1",
    "mesh.rollout": "make the product of mesh.rollout.data/fsdp/tensor/expert equal "
                    "mesh.rollout.devices, or set one axis to -1",
    "mesh.rollout.devices": "set it to fewer than the device count, or 0 for one shared mesh",
    "mesh.dcn": "set mesh.dcn sizes whose product divides the device count; a split mesh "
                "(mesh.rollout.devices > 0) needs them all 1",
}


@_rule("mesh")
def _mesh(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    try:
        sharding.MeshSplit.from_mapping(config.mesh.to_dict()).resolve(device_count,
                                                                       jax.process_count())
    except (ValueError, TypeError) as e:
        field, _, problem = str(e).partition(": ")
        section = next((f for f in sorted(_MESH_FIXES, key=len, reverse=True)
                        if field == f or field.startswith(f + ".")), "mesh")
        if not problem:
            field, problem = "mesh", str(e)
        yield Problem(field, f"{problem} ({device_count} device(s) available)",
                      _MESH_FIXES[section])


@_rule("job", "data", "eval.dataset", "eval.split")
def _data(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    from mars_jax.data import builder, datasets
    from mars_jax.data.paths import MANUAL_DIR_ENV, default_manual_dir
    data = config.data
    if config.job != "eval_system":  # 'train' and 'sft' read data.name / data.split
        name_field, name, split_field, split = "data.name", data.name, "data.split", data.split
    else:
        name_field, name = "eval.dataset", config.eval.dataset
        split_field, split = "eval.split", config.eval.split
    if name not in datasets.SPLITS:
        yield Problem(name_field, f"unknown dataset {name!r}",
                      f"set it to one of {tuple(datasets.SPLITS)}")
        return
    if split not in datasets.SPLITS[name]:
        yield Problem(split_field, f"{name!r} has no split {split!r}",
                      f"set it to one of {datasets.SPLITS[name]}")
        return
    if data.manual_dir and not os.path.isdir(data.manual_dir):
        yield Problem("data.manual_dir", f"{data.manual_dir} does not exist",
                      f"point it at the directory holding the problem JSONL files, or leave it "
                      f"empty to use ${MANUAL_DIR_ENV} or ../shared/data")
        return
    if name == "arith":
        return
    file_name = {c.name: dict(c.split_files) for c in builder.CONFIGS}[name][split]
    try:
        manual_dir = data.manual_dir or default_manual_dir()
    except FileNotFoundError:
        manual_dir = None
    if manual_dir and os.path.isfile(os.path.join(manual_dir, file_name)):
        return
    if builder.MarsProblems(config=name, data_dir=data.data_dir or None).is_prepared():
        return
    yield Problem("data.manual_dir", f"no {file_name} for {name}/{split} in "
                  f"{manual_dir or '(no data dir found)'} and the dataset is not prepared in "
                  f"{data.data_dir or 'the TFDS data dir'}",
                  f"set data.manual_dir (or ${MANUAL_DIR_ENV}) to a directory holding {file_name} "
                  "(`python -m mars_jax.data.fetch --out=DIR` writes one)")


@_rule("job", "eval.probe_every", "eval.dataset")
def _probe(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    if config.job == "train" and config.eval.probe_every and config.eval.dataset != "arith":
        yield Problem("eval.probe_every",
                      f"the probe grades toy arithmetic traces, not {config.eval.dataset!r}",
                      "set eval.dataset='arith', or eval.probe_every=0")


@_rule("job", "eval.policy", "eval.vc_base_url", "eval.solver_base_url", "eval.served_model")
def _http_eval(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    e = config.eval
    if config.job != "eval_system" or e.policy != "http":
        return
    if not e.vc_base_url.startswith(("http://", "https://")):
        yield Problem("eval.vc_base_url", f"{e.vc_base_url!r} is not an http(s) URL, but "
                      "eval.policy is 'http'", "set it to the server root with its API prefix, "
                      "e.g. http://localhost:8000/v1")
    if e.solver_base_url and not e.solver_base_url.startswith(("http://", "https://")):
        yield Problem("eval.solver_base_url", f"{e.solver_base_url!r} is not an http(s) URL",
                      "set it to the Solver server's root, or leave it empty to use vc_base_url")
    if not e.served_model:
        yield Problem("eval.served_model", "empty, but eval.policy is 'http'",
                      "set it to the model name the server serves")


@_rule("job", "warm_start.sft", "warm_start.cache_dir", "model.checkpoint")
def _warm_start(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    w = config.warm_start
    if config.job != "train" or not w.sft:
        return
    if config.model.checkpoint:
        yield Problem("model.checkpoint", f"{config.model.checkpoint!r} is set, but warm_start.sft "
                      "builds the model to start from", "leave it empty, or set warm_start.sft "
                      "to False to train from the checkpoint")
    if not w.cache_dir:
        yield Problem("warm_start.cache_dir", "empty, but warm_start.sft is on",
                      "set it to a directory for cached warm starts, e.g. "
                      "~/.cache/mars_jax/warm_start")


@_rule("sft.row_tokens", "sft.short_rows", "sft.short_row_tokens")
def _sft_rows(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    s = config.sft
    if s.short_rows and not 0 < s.short_row_tokens < s.row_tokens:
        yield Problem("sft.short_row_tokens", f"{s.short_row_tokens} is not between 0 and "
                      f"sft.row_tokens ({s.row_tokens}), but sft.short_rows is {s.short_rows}",
                      "set it below row_tokens, or short_rows to 0 for one row length")


@_rule("learner.offload_optimizer", "mesh.rollout.devices")
def _offload(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    """Offloading makes room for the engine beside the update's state: on one shared mesh only."""
    if config.learner.offload_optimizer and config.mesh.rollout.devices:
        yield Problem("learner.offload_optimizer",
                      f"True with mesh.rollout.devices={config.mesh.rollout.devices}: the "
                      "training devices never decode, so offloading frees nothing the engine uses",
                      "set it to False, or mesh.rollout.devices=0 for one shared mesh")


@_rule("learner.micro_batch_size")
def _micro_batch(config: ConfigDict, device_count: int) -> Iterator[Problem]:
    if problem := micro_batch_problem(config.learner.micro_batch_size, jax.process_count()):
        yield problem
