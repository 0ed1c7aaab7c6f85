r"""A training run's policy as a Hugging Face checkpoint that transformers, vLLM or SGLang serve.

  python experiments/export_hf.py --workdir=/tmp/marsrl_smoke --output=/tmp/marsrl_hf [--step=N]
  vllm serve /tmp/marsrl_hf        # or: transformers serve /tmp/marsrl_hf

Reads the run's config (`WORKDIR/config.json` when the run wrote one, else the copy in the
checkpoint's meta), builds the model abstractly (no weights allocated) and restores only the
`params` of checkpoint `--step` (default: the newest committed one) straight into their
shardings on a mesh: the run's training mesh (`--mesh=run`), or FSDP over every device
(`--mesh=fsdp`, where the run's mesh does not fit the devices here). The optimizer state is
neither read nor built, so a model exports on the chips that trained it. A run of several
processes exports with one process per host, started with the same distributed flags as the run
(`--coordinator_address`, `--num_processes`, `--process_id`, or a detected cluster); process 0
writes.

Writes to `--output`: `config.json`, safetensors in the parameters' dtype (one file, or files of
at most `--max_shard_gb` with `model.safetensors.index.json`), `generation_config.json` (the
turn-ending ids, the run's evaluation temperature and top-p) and the run's tokenizer with its chat
template (`tokenizer.save_tokenizer`: Qwen3's or a directory's files as they are; the tiny
byte-level one as a `PreTrainedTokenizerFast` that `AutoTokenizer` loads). The run's
directory is only read: a run still training may be exported.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
from absl import app, flags, logging
from etils import epath
from flax import nnx
from ml_collections import ConfigDict
from transformers import GenerationConfig

from mars_jax import builders, distributed, sharding
from mars_jax.checkpoint import (CONFIG_KEY, CheckpointMismatch, committed_steps, read_meta,
                                 restore_params)
from mars_jax.data.tokenizer import eos_token_ids, save_tokenizer
from mars_jax.models import Qwen3, Qwen3Config, get_preset, save_pretrained

RUN_CONFIG_FILE = "config.json"  # the resolved config a run writes into its workdir
MESHES = ("run", "fsdp")


class ExportError(ValueError):
    """A run that cannot be exported: names the directory, step or field."""


def choose_step(checkpoints: epath.Path, step: int | None) -> int:
    """`step`, or the newest committed step under `checkpoints`."""
    try:
        steps = committed_steps(checkpoints)
    except FileNotFoundError as e:
        raise ExportError(f"{e}: is --workdir a training run's workdir?") from e
    if not steps:
        raise ExportError(f"{checkpoints} holds no committed checkpoint")
    if step is None:
        return steps[0]
    if step not in steps:
        raise ExportError(f"--step={step}: {checkpoints} holds steps {sorted(steps)}")
    return step


def run_config(workdir: epath.Path, meta: dict) -> ConfigDict:
    """The run's config: `workdir/config.json` when present, else the checkpoint's copy."""
    path = workdir / RUN_CONFIG_FILE
    if path.exists():
        try:
            return ConfigDict(json.loads(path.read_text()))
        except ValueError as e:
            raise ExportError(f"{path}: not a JSON config ({e})") from e
    if meta.get(CONFIG_KEY) is None:
        raise ExportError(f"{workdir}: neither {RUN_CONFIG_FILE} nor a config in the checkpoint's "
                          "meta (written by a mars_jax from before checkpoints held it)")
    return ConfigDict(meta[CONFIG_KEY])


def model_config(config: ConfigDict) -> Qwen3Config:
    """The architecture the run trained: `model.checkpoint`'s `config.json` (its weights are not
    read), else the `model.preset`, with the run's dtype and other run-time fields."""
    overrides = builders.model_overrides(config)
    if config.model.get("checkpoint"):
        path = Path(config.model.checkpoint) / "config.json"
        if not path.exists():
            raise ExportError(f"model.checkpoint: the run started from {config.model.checkpoint}, "
                              f"whose {path.name} (the architecture) is not here")
        return Qwen3Config.from_json_file(path, **overrides)
    return get_preset(config.model.preset, **overrides)


def export_mesh(config: ConfigDict, kind: str) -> jax.sharding.Mesh:
    """The run's training mesh ('run') or one FSDP axis over every device ('fsdp')."""
    if kind == "fsdp":
        return sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1, "expert": 1})
    try:
        return builders.build_mesh(config)
    except ValueError as e:
        raise ExportError(f"the run's mesh does not fit the {jax.device_count()} devices here "
                          f"({e}); rerun with --mesh=fsdp") from e


def restore_model(checkpoints: epath.Path, step: int, config: Qwen3Config,
                  mesh: jax.sharding.Mesh) -> Qwen3:
    """The model with checkpoint `step`'s parameters, each restored into its sharding on `mesh`
    (from the parameters' logical axes and the default rules)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))),
                                   nnx.Param)
    shardings = sharding.state_shardings(abstract, mesh)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
    return nnx.merge(graphdef, restore_params(checkpoints, step, target))


def save_generation_config(config: ConfigDict, output: Path) -> None:
    """The turn-ending ids of the run's tokenizer and the run's evaluation temperature and top-p."""
    tokenizer = builders.build_tokenizer(config)
    GenerationConfig(eos_token_id=list(eos_token_ids(tokenizer)),
                     pad_token_id=tokenizer.pad_token_id, do_sample=True,
                     temperature=config.eval.temperature, top_p=config.eval.top_p
                     ).save_pretrained(output)


def export(workdir: str | os.PathLike, output: str | os.PathLike, *, step: int | None = None,
           mesh: str = "run", max_shard_bytes: int = 5 * 1024 ** 3) -> int:
    """Writes checkpoint `step` (default: the newest) of the run in `workdir` (a local path or a
    `gs://` URL) to the local directory `output` as an HF checkpoint (module docstring); returns
    the step written. Every process calls it."""
    workdir, output = epath.Path(workdir), Path(output)
    checkpoints = workdir / "checkpoints"
    step = choose_step(checkpoints, step)
    config = run_config(workdir, read_meta(checkpoints, step))
    model = restore_model(checkpoints, step, model_config(config), export_mesh(config, mesh))
    save_pretrained(model, output, max_shard_bytes=max_shard_bytes)
    if jax.process_index() == 0:
        save_tokenizer(config.tokenizer, output)
        save_generation_config(config, output)
    return step


def define_flags() -> dict[str, flags.FlagHolder]:
    """The command's flags, defined when it runs (importing this module defines none)."""
    return dict(
        workdir=flags.DEFINE_string("workdir", None, "The training run's --workdir."),
        output=flags.DEFINE_string("output", None, "Directory the HF checkpoint is written to."),
        step=flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the newest)."),
        mesh=flags.DEFINE_enum("mesh", "run", MESHES, "'run': the run's training mesh; 'fsdp': "
                               "parameters sharded over every device here."),
        max_shard_gb=flags.DEFINE_float("max_shard_gb", 5.0, "Largest safetensors file, in GiB."))


def main(args: dict[str, flags.FlagHolder]) -> None:
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    distributed.initialize_from_flags()  # several processes: before anything starts a backend
    try:
        step = export(args["workdir"].value, args["output"].value, step=args["step"].value,
                      mesh=args["mesh"].value,
                      max_shard_bytes=int(args["max_shard_gb"].value * 1024 ** 3))
    except (ExportError, CheckpointMismatch) as e:
        print(f"export_hf: {e}", file=sys.stderr)
        sys.exit(2)
    if jax.process_index() == 0:
        print(f"exported step {step} of {args['workdir'].value} to {args['output'].value}")


if __name__ == "__main__":
    _ARGS = define_flags()
    flags.mark_flags_as_required(["workdir", "output"])
    app.run(lambda argv: main(_ARGS))
