"""Objects a run needs, built from its `ml_collections` config: mesh, model, tokenizer, problems."""
from __future__ import annotations

import jax
from ml_collections import ConfigDict

from mars_jax import sharding
from mars_jax.data import datasets
from mars_jax.data.iterator import ProblemIterator
from mars_jax.data.tokenizer import load_tokenizer, qwen3_tokenizer, tiny_tokenizer
from mars_jax.models import Qwen3, create_model, from_pretrained, get_preset


def build_meshes(config: ConfigDict) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
    """(training mesh, rollout mesh) of `config.mesh`: the same mesh twice unless
    `mesh.rollout.devices` > 0 splits the devices (`sharding.MeshSplit`)."""
    return sharding.make_meshes(config.mesh.to_dict())


def build_mesh(config: ConfigDict) -> jax.sharding.Mesh:
    """The training mesh: all devices unless `mesh.rollout.devices` > 0 splits them."""
    return build_meshes(config)[0]


def model_overrides(config: ConfigDict) -> dict:
    """Run-time model fields set in `config.model` (dtypes, MoE dispatch, attention, remat)."""
    keys = ("dtype", "param_dtype", "moe_impl", "moe_block_size", "moe_dense_max_tokens",
            "moe_chunk_tokens", "attention_impl", "attention_block", "remat", "scan_layers")
    return {k: config.model[k] for k in keys if config.model.get(k) not in (None, "")}


def build_model(config: ConfigDict, mesh: jax.sharding.Mesh | None) -> Qwen3:
    """`config.model.checkpoint` (an HF directory) when set, else the random `preset`."""
    overrides = model_overrides(config)
    if config.model.get("checkpoint"):
        return from_pretrained(config.model.checkpoint, mesh=mesh, **overrides)
    return create_model(get_preset(config.model.preset, **overrides), seed=config.seed, mesh=mesh)


def build_tokenizer(config: ConfigDict):
    """'tiny' (small vocabulary), 'qwen3' (the real one, offline) or a checkpoint directory."""
    name = config.tokenizer
    if name == "tiny":
        return tiny_tokenizer()
    if name == "qwen3":
        return qwen3_tokenizer()
    return load_tokenizer(name)


def load_problems(data: ConfigDict, split: str | None = None):
    knobs = data.get("arith")
    return datasets.load(data.name, split or data.split, manual_dir=data.get("manual_dir") or None,
                         data_dir=data.get("data_dir") or None,
                         arith_knobs={k: v for k, v in dict(knobs or {}).items() if v is not None})


def load_eval_records(config: ConfigDict, count: int) -> list[dict]:
    """The first `count` records (0: all) of `eval.dataset`'s `eval.split`."""
    data = ConfigDict(dict(config.data))
    data.name = config.eval.dataset
    records = load_problems(data, config.eval.split)
    return [records[i] for i in range(min(count or len(records), len(records)))]


def build_problem_iterator(config: ConfigDict) -> ProblemIterator:
    """Shuffled, repeating, resumable iterator over this host's shard of the training problems."""
    return ProblemIterator(load_problems(config.data), seed=config.seed,
                           shuffle=config.data.get("shuffle", True),
                           shard_index=jax.process_index(), shard_count=jax.process_count())

