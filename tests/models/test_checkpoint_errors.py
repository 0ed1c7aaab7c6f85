"""Each malformed checkpoint gives an error naming the tensor, field or file."""
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mars_jax.models import CheckpointError, from_pretrained


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(hf_moe_dir, tmp_path):
    path = _copy(hf_moe_dir, tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.2.mlp.experts.3.up_proj.weight'"):
        from_pretrained(path)


def test_unexpected_tensor(hf_dense_dir, tmp_path):
    path = _copy(hf_dense_dir, tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.9.extra.weight'"):
        from_pretrained(path)


def test_shape_mismatch(hf_dense_dir, tmp_path):
    path = _copy(hf_dense_dir, tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)}))
    with pytest.raises(CheckpointError, match=r"shape mismatch.*k_proj"):
        from_pretrained(path)


@pytest.mark.parametrize("fixture, name", [
    ("hf_dense_dir", "model.layers.0.self_attn.k_proj.weight"),  # [16, 32]: same element count
    ("hf_moe_dir", "model.layers.2.mlp.experts.5.up_proj.weight"),  # [16, 32], not expert 0
])
def test_transposed_tensor(fixture, name, request, tmp_path):
    path = _copy(request.getfixturevalue(fixture), tmp_path / "ckpt")
    _edit_tensors(path, lambda t: t.update({name: t[name].T.contiguous()}))
    with pytest.raises(CheckpointError, match=rf"shape mismatch: tensor '{re.escape(name)}' is "
                                              r"\(32, 16\) in the checkpoint, the config implies "
                                              r"\(16, 32\)"):
        from_pretrained(path)


def test_a_tensor_in_two_files_without_an_index(hf_dense_dir, tmp_path):
    path = _copy(hf_dense_dir, tmp_path / "ckpt")
    norm = load_file(path / "model.safetensors")["model.norm.weight"]
    save_file({"model.norm.weight": norm + 1}, path / "extra.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight' is in both "
                                              "extra.safetensors and model.safetensors"):
        from_pretrained(path)


def test_unsupported_model_type(hf_dense_dir, tmp_path):
    path = _copy(hf_dense_dir, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        from_pretrained(path)


def test_unreadable_file(hf_dense_dir, tmp_path):
    path = _copy(hf_dense_dir, tmp_path / "ckpt")
    (path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read"):
        from_pretrained(path)


def test_unreadable_config(hf_dense_dir, tmp_path):
    path = _copy(hf_dense_dir, tmp_path / "ckpt")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: cannot read"):
        from_pretrained(path)
