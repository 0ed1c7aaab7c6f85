"""Hugging Face checkpoint I/O: `config.json` + `*.safetensors` <-> a (sharded) `Qwen3` model.

Each device reads only the slice of a parameter it holds, so a large model is never whole on one.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.flax import save_file

from mars_jax import sharding
from mars_jax.models.config import Qwen3Config
from mars_jax.models.qwen3 import Qwen3

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_GLOB = "model-[0-9]*-of-[0-9]*.safetensors"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the file, tensor or field."""


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one of our parameters is stored in HF tensors (`names`, `to_ours`, `to_hf`)."""

    names: Callable[[int | None], tuple[str, ...]]
    to_ours: Callable[[list[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]
    num_experts: int | None = None

    def all_names(self) -> list[str]:
        if self.num_experts is None:
            return list(self.names(None))
        return [n for e in range(self.num_experts) for n in self.names(e)]


def _single(name: str, to_ours=lambda a: a, to_hf=lambda a: a) -> TensorMap:
    return TensorMap(lambda _: (name,), lambda arrays: to_ours(arrays[0]), lambda a: [to_hf(a)])


def _linear(name: str, ours_shape: Sequence[int], split_input: bool) -> TensorMap:
    """An HF `[out, in]` Linear weight that we store transposed, with the output dimension
    (`split_input=False`: ours `[in, *out]`) or the input dimension (ours `[*in, out]`) unflattened."""
    shape = tuple(ours_shape)
    flat = (lambda x: x.reshape(-1, shape[-1])) if split_input else (lambda x: x.reshape(shape[0], -1))
    return _single(name, lambda a: a.T.reshape(shape), lambda x: flat(x).T)


def tensor_maps(config: Qwen3Config) -> dict[tuple, TensorMap]:
    """Our parameter path -> how it is stored in an HF Qwen3 / Qwen3-MoE checkpoint."""
    c = config
    h, n, k, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    maps: dict[tuple, TensorMap] = {
        ("embed_tokens", "embedding"): _single("model.embed_tokens.weight"),
        ("norm", "scale"): _single("model.norm.weight"),
    }
    if not c.tie_word_embeddings:
        maps[("lm_head",)] = _single("lm_head.weight", lambda a: a.T, lambda a: a.T)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        maps[("layers", i, "input_layernorm", "scale")] = _single(f"{p}.input_layernorm.weight")
        maps[("layers", i, "post_attention_layernorm", "scale")] = _single(
            f"{p}.post_attention_layernorm.weight")
        a = ("layers", i, "self_attn")
        maps[a + ("q_proj",)] = _linear(f"{p}.self_attn.q_proj.weight", (h, n, d), False)
        maps[a + ("k_proj",)] = _linear(f"{p}.self_attn.k_proj.weight", (h, k, d), False)
        maps[a + ("v_proj",)] = _linear(f"{p}.self_attn.v_proj.weight", (h, k, d), False)
        maps[a + ("o_proj",)] = _linear(f"{p}.self_attn.o_proj.weight", (n, d, h), True)
        maps[a + ("q_norm", "scale")] = _single(f"{p}.self_attn.q_norm.weight")
        maps[a + ("k_norm", "scale")] = _single(f"{p}.self_attn.k_norm.weight")
        if c.attention_bias:
            for proj, heads in (("q", n), ("k", k), ("v", k)):
                maps[a + (f"{proj}_bias",)] = _single(
                    f"{p}.self_attn.{proj}_proj.bias", lambda x, hh=heads: x.reshape(hh, d),
                    lambda x: x.reshape(-1))
            maps[a + ("o_bias",)] = _single(f"{p}.self_attn.o_proj.bias")
        m = ("layers", i, "mlp")
        if c.is_moe_layer(i):
            maps[m + ("router",)] = _single(f"{p}.mlp.gate.weight", lambda x: x.T, lambda x: x.T)
            ex = f"{p}.mlp.experts"
            maps[m + ("wi",)] = TensorMap(
                lambda e, ex=ex: (f"{ex}.{e}.gate_proj.weight", f"{ex}.{e}.up_proj.weight"),
                lambda arrays: np.stack(arrays), lambda x: [x[0], x[1]], c.num_experts)
            maps[m + ("wo",)] = TensorMap(
                lambda e, ex=ex: (f"{ex}.{e}.down_proj.weight",),
                lambda arrays: arrays[0].T, lambda x: [x.T], c.num_experts)
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                maps[m + (proj,)] = _single(f"{p}.mlp.{proj}.weight", lambda x: x.T, lambda x: x.T)
    return maps


class _SafetensorsDir:
    """Lazy, read-only access to the tensors of a checkpoint directory by name."""

    def __init__(self, path: Path):
        self._handles: dict[Path, Any] = {}
        index = path / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e})") from e
            self.location = {name: path / file for name, file in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
            self.location = {}
            for file in files:
                for name in self._open(file).keys():
                    if name in self.location:
                        raise CheckpointError(f"{path}: tensor {name!r} is in both "
                                              f"{self.location[name].name} and {file.name}")
                    self.location[name] = file

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="flax")
            except Exception as e:  # safetensors raises several types for corrupt files
                raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from e
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self.location[name]).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        with jax.default_device(jax.devices("cpu")[0]):
            return np.asarray(self._open(self.location[name]).get_tensor(name))


def _check_names(maps: dict[tuple, TensorMap], store: _SafetensorsDir, config: Qwen3Config, path):
    wanted = {name for tmap in maps.values() for name in tmap.all_names()}
    for tmap in maps.values():
        for name in tmap.all_names():
            if name not in store.location:
                raise CheckpointError(f"{path}: missing tensor {name!r}")
    allowed_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for name in store.location:
        if name not in wanted and name not in allowed_extra and not name.endswith(IGNORED_SUFFIXES):
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for a {config.model_type} "
                                  f"model with {config.num_hidden_layers} layers")


def _loader(tmap: TensorMap, store: _SafetensorsDir, shape: tuple[int, ...], dtype):
    """A `make_array_from_callback` callback reading only the requested slice."""

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        if tmap.num_experts is None:
            full = tmap.to_ours([store.read(n) for n in tmap.names(None)])
            return full[index].astype(dtype)
        experts = range(*index[0].indices(shape[0]))
        parts = [tmap.to_ours([store.read(n) for n in tmap.names(e)]) for e in experts]
        return np.stack(parts)[(slice(None),) + tuple(index[1:])].astype(dtype)

    return callback


def _validate_shapes(maps: dict[tuple, TensorMap], store: _SafetensorsDir,
                     abstract: dict[tuple, Any]) -> None:
    """Raises before any read when a stored HF tensor's shape is not what our parameter implies."""
    for key, tmap in maps.items():
        ours = abstract[key].shape
        per = ours[1:] if tmap.num_experts is not None else ours
        expected = [tuple(t.shape) for t in
                    jax.eval_shape(tmap.to_hf, jax.ShapeDtypeStruct(per, np.float32))]
        experts = [None] if tmap.num_experts is None else range(tmap.num_experts)
        for name, want in ((n, w) for e in experts for n, w in zip(tmap.names(e), expected)):
            if store.shape(name) != want:
                raise CheckpointError(f"shape mismatch: tensor {name!r} is {store.shape(name)} in "
                                      f"the checkpoint, the config implies {want} (parameter "
                                      f"{'.'.join(map(str, key))})")


def from_pretrained(path: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None,
                    rules: sharding.Rules = sharding.DEFAULT_RULES,
                    **config_overrides: Any) -> Qwen3:
    """Loads an HF Qwen3 / Qwen3-MoE checkpoint directory; `config_overrides` set `Qwen3Config`
    fields; with `mesh`, parameters load into their shardings."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    config = Qwen3Config.from_json_file(path / "config.json", **config_overrides)
    store = _SafetensorsDir(path)
    maps = tensor_maps(config)
    _check_names(maps, store, config, path)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(abstract_state))
    abstract = {key: var.get_value() for key, var in flat.items()}
    if set(abstract) != set(maps):
        raise CheckpointError(f"internal: unmapped parameters {sorted(set(abstract) ^ set(maps))}")
    _validate_shapes(maps, store, abstract)
    if mesh is None:
        device = jax.devices()[0]
        shardings = {key: jax.sharding.SingleDeviceSharding(device) for key in flat}
    else:
        tree = sharding.state_shardings(abstract_state, mesh, rules)
        shardings = {key: var.get_value() for key, var in nnx.to_flat_state(tree)}
    for key, var in flat.items():
        value = abstract[key]
        callback = _loader(maps[key], store, value.shape, np.dtype(value.dtype))
        var.set_value(jax.make_array_from_callback(value.shape, shardings[key], callback))
    state = nnx.from_flat_state(flat)
    return nnx.merge(graphdef, state)


def _remove_weights(path: Path) -> None:
    """Deletes the index and the weight files `save_pretrained` writes (single or sharded)."""
    for file in [path / INDEX_FILE, path / SINGLE_FILE, *path.glob(SHARD_GLOB)]:
        file.unlink(missing_ok=True)


def _hf_shapes(tmap: TensorMap, ours: Any) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(HF name, shape, dtype) of each tensor `tmap` writes for our parameter `ours` (abstract)."""
    per = ours.shape[1:] if tmap.num_experts is not None else ours.shape
    shapes = [tuple(t.shape) for t in
              jax.eval_shape(tmap.to_hf, jax.ShapeDtypeStruct(per, ours.dtype))]
    experts = [None] if tmap.num_experts is None else range(tmap.num_experts)
    return [(name, shape, np.dtype(ours.dtype))
            for e in experts for name, shape in zip(tmap.names(e), shapes)]


def _shard_plan(sizes: Sequence[int], max_shard_bytes: int) -> list[int]:
    """The file index of each tensor of `sizes` (bytes, in writing order): a file takes tensors
    until the next would carry it past `max_shard_bytes` (a larger tensor gets a file alone)."""
    plan, total = [], 0
    for nbytes in sizes:
        if total and total + nbytes > max_shard_bytes:
            plan.append(plan[-1] + 1)
            total = 0
        else:
            plan.append(plan[-1] if plan else 0)
        total += nbytes
    return plan


def save_pretrained(model: Qwen3, path: str | os.PathLike, *,
                    max_shard_bytes: int = 5 * 1024 ** 3) -> None:
    """Writes `config.json` and safetensors that `transformers` loads, in the parameters' dtype,
    replacing an earlier save's weight files. Every process must call it; process 0 writes,
    holding at most one file's tensors in host memory."""
    path = Path(path)
    writer = jax.process_index() == 0
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        _remove_weights(path)
    config = model.config
    maps = tensor_maps(config)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    layout = [t for key, tmap in maps.items() for t in _hf_shapes(tmap, flat[key].get_value())]
    plan = _shard_plan([int(np.prod(shape)) * dtype.itemsize for _, shape, dtype in layout],
                       max_shard_bytes)
    count = plan[-1] + 1
    files = [SINGLE_FILE] if count == 1 else [
        f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    file_of = {name: files[i] for (name, _, _), i in zip(layout, plan)}
    cpu = jax.devices("cpu")[0]
    current, pending = files[0], {}
    for key, tmap in maps.items():
        ours = np.asarray(sharding.fetch(flat[key].get_value()))  # a collective: every process
        if not writer:
            continue
        if tmap.num_experts is None:
            tensors = zip(tmap.names(None), tmap.to_hf(ours))
        else:
            tensors = ((name, t) for e in range(tmap.num_experts)
                       for name, t in zip(tmap.names(e), tmap.to_hf(ours[e])))
        for name, tensor in tensors:
            if file_of[name] != current:
                save_file(pending, str(path / current), metadata={"format": "pt"})
                current, pending = file_of[name], {}
            pending[name] = jax.device_put(np.ascontiguousarray(tensor), cpu)
    if not writer:
        return
    save_file(pending, str(path / current), metadata={"format": "pt"})
    if count > 1:
        total = sum(int(np.prod(shape)) * dtype.itemsize for _, shape, dtype in layout)
        index = {"metadata": {"total_size": total}, "weight_map": file_of}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2))
