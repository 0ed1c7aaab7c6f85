"""The Flax model against HF transformers' torch model on the same checkpoints.

Logits of these random models are small (|logit| < 0.5), so errors are measured relative to the
largest reference logit: CPU float32 gives ~3e-7 of it; the tolerance is 1e-5 of it. A long
sequence (positions up to 383) makes RoPE errors visible: a rope_theta 1% off already misses the
tolerance (`test_a_wrong_rope_theta_fails_the_tolerance`)."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from mars_jax.models import from_pretrained, get_preset, save_pretrained
from tests import hf_fixtures

TOLERANCE = 1e-5  # of the largest reference logit


def _ours(path, ids, mask, **overrides):
    model = from_pretrained(path, **overrides)
    return np.asarray(model(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask, jnp.int32)))


def _relative_error(ours, ref, mask) -> float:
    """Largest |ours - ref| over real tokens, as a fraction of the largest |ref| there."""
    valid = mask.astype(bool)
    return float(np.abs(ours - ref)[valid].max() / np.abs(ref)[valid].max())


def _long_batch(length: int = 384):
    """Two rows of `length` tokens, the second left-padded by 100 (positions up to length - 1)."""
    ids = np.random.default_rng(5).integers(0, 96, (2, length))
    mask = np.ones((2, length), np.int64)
    mask[1, :100] = 0
    return ids, mask


@pytest.mark.parametrize("fixture", ["hf_dense_dir", "hf_moe_dir"])
def test_golden_logits_padded_batch(fixture, request):
    path = request.getfixturevalue(fixture)
    ids, mask = hf_fixtures.padded_batch(vocab=96)
    ref = hf_fixtures.hf_logits(path, ids, mask)
    assert _relative_error(_ours(path, ids, mask), ref, mask) <= TOLERANCE


@pytest.mark.parametrize("fixture", ["hf_dense_dir", "hf_moe_dir"])
def test_long_sequence_matches_hf(fixture, request):
    """Far positions: RoPE's slow frequencies and q/k norm act on every attention score."""
    path = request.getfixturevalue(fixture)
    ids, mask = _long_batch()
    ref = hf_fixtures.hf_logits(path, ids, mask)
    assert _relative_error(_ours(path, ids, mask), ref, mask) <= TOLERANCE


@pytest.mark.parametrize("fixture, theta", [("hf_dense_dir", 1e6), ("hf_moe_dir", 1e4)])
def test_a_wrong_rope_theta_fails_the_tolerance(fixture, theta, request):
    """The parity check can catch a RoPE error: theta 1% off gives several times the tolerance."""
    path = request.getfixturevalue(fixture)
    ids, mask = _long_batch()
    ref = hf_fixtures.hf_logits(path, ids, mask)
    assert _relative_error(_ours(path, ids, mask, rope_theta=theta * 1.01), ref, mask) > 3 * TOLERANCE


def test_fields_left_out_of_config_json_take_transformers_defaults(tmp_path):
    """A Qwen3-MoE config.json without norm_topk_prob or any RoPE field: transformers then uses
    norm_topk_prob=False and rope_theta=10000 (the values this checkpoint was made with)."""
    path = hf_fixtures.save_tiny_hf(tmp_path, moe=True, norm_topk_prob=False)
    config = json.loads((path / "config.json").read_text())
    for field in ("norm_topk_prob", "rope_parameters", "rope_theta", "rope_scaling"):
        config.pop(field, None)
    (path / "config.json").write_text(json.dumps(config))
    ids, mask = _long_batch()
    ref = hf_fixtures.hf_logits(path, ids, mask)
    assert _relative_error(_ours(path, ids, mask), ref, mask) <= TOLERANCE


@pytest.mark.parametrize("impl", ["dense", "sorted", "ragged"])
def test_moe_backends_match_hf(hf_moe_dir, impl):
    ids, mask = hf_fixtures.padded_batch(vocab=96, seed=1)
    ref = hf_fixtures.hf_logits(hf_moe_dir, ids, mask)
    ours = _ours(hf_moe_dir, ids, mask, moe_impl=impl, moe_block_size=4)
    assert _relative_error(ours, ref, mask) <= TOLERANCE


@pytest.mark.parametrize("fixture", ["hf_dense_dir", "hf_moe_dir"])
def test_flash_attention_matches_hf(fixture, request):
    """Blockwise attention with 4-token blocks (3 x 3 tiles per row, padding on both sides)."""
    path = request.getfixturevalue(fixture)
    ids, mask = hf_fixtures.padded_batch(vocab=96, seed=2)
    ref = hf_fixtures.hf_logits(path, ids, mask)
    ours = _ours(path, ids, mask, attention_impl="flash", attention_block=4)
    assert _relative_error(ours, ref, mask) <= TOLERANCE


def test_bench_preset_matches_hf(tmp_path):
    config = get_preset("bench")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3MoeConfig(**config.to_hf_dict())).eval()
    hf.save_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 16))
    mask = np.ones_like(ids)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.numpy()
    assert _relative_error(_ours(tmp_path, ids, mask), ref, mask) <= TOLERANCE


@pytest.mark.parametrize("fixture", ["hf_dense_dir", "hf_moe_dir"])
def test_round_trip_gives_identical_tensors(fixture, request, tmp_path):
    path = request.getfixturevalue(fixture)
    save_pretrained(from_pretrained(path), tmp_path / "out")
    original = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert original.keys() == reloaded.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, reloaded[name]), name


def test_sharded_checkpoint_with_index_loads(hf_moe_dir, tmp_path):
    model = from_pretrained(hf_moe_dir)
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids, mask = hf_fixtures.padded_batch(vocab=96)
    np.testing.assert_array_equal(_ours(tmp_path, ids, mask), _ours(hf_moe_dir, ids, mask))
