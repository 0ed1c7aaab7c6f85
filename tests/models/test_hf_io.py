"""Loading and saving HF checkpoints: run-time dtypes, and saving over an earlier save."""
import jax
import pytest
import torch
import transformers
from flax import nnx

from mars_jax.models import from_pretrained, save_pretrained
from tests import hf_fixtures


def _param_dtypes(model) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("dtype, param_dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_compute_and_parameter_dtypes_come_from_their_own_fields(hf_moe_dir, dtype, param_dtype):
    model = from_pretrained(hf_moe_dir, dtype=dtype, param_dtype=param_dtype)
    assert (model.config.dtype, model.config.param_dtype) == (dtype, param_dtype)
    assert _param_dtypes(model) == {param_dtype}


def test_build_model_passes_model_dtypes_through(hf_moe_dir):
    from experiments.configs import common
    from mars_jax import builders
    config = common.base_config()
    config.model.checkpoint = str(hf_moe_dir)
    config.model.dtype, config.model.param_dtype = "bfloat16", "float32"
    model = builders.build_model(config, mesh=None)
    assert (model.config.dtype, model.config.param_dtype) == ("bfloat16", "float32")
    assert _param_dtypes(model) == {"float32"}


def _hf_state(path) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.parametrize("first_shard_bytes, second_shard_bytes",
                         [(20_000, 2**30), (2**30, 20_000)])
def test_saving_over_an_earlier_save_leaves_only_the_new_weights(hf_moe_dir, tmp_path,
                                                                 first_shard_bytes,
                                                                 second_shard_bytes):
    """Sharded then single file, and single file then sharded: ours and transformers both load
    the second model."""
    new_dir = hf_fixtures.save_tiny_hf(tmp_path / "seed1", moe=True, seed=1)
    out = tmp_path / "out"
    save_pretrained(from_pretrained(hf_moe_dir), out, max_shard_bytes=first_shard_bytes)
    save_pretrained(from_pretrained(new_dir), out, max_shard_bytes=second_shard_bytes)
    sharded = second_shard_bytes < 2**30
    assert (out / "model.safetensors.index.json").exists() == sharded
    assert (out / "model.safetensors").exists() == (not sharded)
    expected, saved = _hf_state(new_dir), _hf_state(out)
    assert saved.keys() == expected.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name
    reloaded = dict(nnx.to_flat_state(nnx.state(from_pretrained(out), nnx.Param)))
    for key, var in nnx.to_flat_state(nnx.state(from_pretrained(new_dir), nnx.Param)):
        assert (reloaded[key].get_value() == var.get_value()).all(), key
