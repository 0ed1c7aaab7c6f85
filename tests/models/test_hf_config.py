"""Reading config.json against transformers' own reading of the same dictionary: fields left out
take its defaults, and RoPE or attention variants it would apply are refused by name."""
import pytest
import transformers

from mars_jax.models import Qwen3Config

# Only the fields we require; 64 heads fit either model type's default number of KV heads.
REQUIRED = dict(vocab_size=96, hidden_size=128, num_hidden_layers=3, num_attention_heads=64,
                intermediate_size=48)
HF_CLASSES = {"qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}


def _both(model_type: str, **fields) -> tuple[dict, transformers.PretrainedConfig]:
    hf_dict = dict(REQUIRED, model_type=model_type, **fields)
    return hf_dict, HF_CLASSES[model_type].from_dict(dict(hf_dict))


def _plain_rope(ref) -> bool:
    rope = ref.rope_parameters
    return rope.get("rope_type") == "default" and rope.get("partial_rotary_factor", 1.0) == 1.0


def _slides(ref) -> bool:
    """Whether transformers gives some layer a sliding window (modeling_qwen3 / _qwen3_moe)."""
    if ref.sliding_window is None:
        return False
    return ref.model_type == "qwen3_moe" or "sliding_attention" in ref.layer_types


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_fields_left_out_take_transformers_defaults(model_type):
    hf_dict, ref = _both(model_type)
    expected = dict(
        num_key_value_heads=ref.num_key_value_heads,
        head_dim=getattr(ref, "head_dim", ref.hidden_size // ref.num_attention_heads),
        rope_theta=ref.rope_parameters["rope_theta"], rms_norm_eps=ref.rms_norm_eps,
        tie_word_embeddings=ref.tie_word_embeddings, attention_bias=ref.attention_bias,
        max_position_embeddings=ref.max_position_embeddings)
    if model_type == "qwen3_moe":
        expected.update(num_experts=ref.num_experts, num_experts_per_tok=ref.num_experts_per_tok,
                        moe_intermediate_size=ref.moe_intermediate_size,
                        norm_topk_prob=ref.norm_topk_prob,
                        decoder_sparse_step=ref.decoder_sparse_step,
                        mlp_only_layers=tuple(ref.mlp_only_layers))
    ours = Qwen3Config.from_hf_dict(hf_dict)
    assert {name: getattr(ours, name) for name in expected} == expected


@pytest.mark.parametrize("fields", [
    dict(rope_theta=5e5),
    dict(rope_scaling=None, rope_theta=2e5),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_theta=5e5),
    dict(rope_parameters={"type": "default"}, rope_theta=5e5),
    # A non-empty rope_scaling replaces rope_parameters, theta included.
    dict(rope_scaling={"rope_type": "default"}, rope_parameters={"rope_theta": 1e6}),
])
def test_plain_rope_takes_the_theta_transformers_takes(fields):
    hf_dict, ref = _both("qwen3", **fields)
    assert _plain_rope(ref)
    assert Qwen3Config.from_hf_dict(hf_dict).rope_theta == ref.rope_parameters["rope_theta"]


@pytest.mark.parametrize("model_type, fields, field", [
    ("qwen3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                   rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    ("qwen3_moe", dict(rope_theta=1e6, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}), "rope_scaling"),
    ("qwen3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_parameters"),
    ("qwen3", dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    ("qwen3", dict(layer_types=["full_attention"] * 3,
                   rope_parameters={"full_attention": {"rope_type": "default"}}),
     "rope_parameters"),
])
def test_rope_other_than_plain_is_refused_naming_the_field(model_type, fields, field):
    hf_dict, ref = _both(model_type, **fields)
    assert not _plain_rope(ref)
    with pytest.raises(ValueError, match=f"config.json: {field}"):
        Qwen3Config.from_hf_dict(hf_dict)


@pytest.mark.parametrize("model_type, fields, field", [
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     "use_sliding_window"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16,
                   layer_types=["full_attention", "sliding_attention", "full_attention"]),
     "layer_types"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window"),  # 4096 by default
])
def test_sliding_window_attention_is_refused_naming_the_field(model_type, fields, field):
    hf_dict, ref = _both(model_type, **fields)
    assert _slides(ref)
    with pytest.raises(ValueError, match=f"config.json: {field}"):
        Qwen3Config.from_hf_dict(hf_dict)


@pytest.mark.parametrize("model_type, fields", [
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=3)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16,
                   layer_types=["full_attention"] * 3)),
    ("qwen3", dict(use_sliding_window=False, sliding_window=16, max_window_layers=0)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=None)),
])
def test_a_window_no_layer_uses_is_accepted(model_type, fields):
    hf_dict, ref = _both(model_type, **fields)
    assert not _slides(ref)
    Qwen3Config.from_hf_dict(hf_dict)


@pytest.mark.parametrize("field, value", [("num_hidden_layers", "2"), ("hidden_size", 128.0),
                                          ("num_key_value_heads", True), ("head_dim", -1)])
def test_sizes_that_are_not_whole_numbers_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"sizes must be whole numbers >= 0, got .*'{field}'"):
        Qwen3Config.from_hf_dict(dict(REQUIRED, model_type="qwen3", **{field: value}))
