"""The toy study's configs pass the run-time validation (`sft` is checked like `train`)."""
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from mars_jax.config_validation import validate
from mars_jax.models import Qwen3, Qwen3Config
from mars_jax.sft.job import ARCHS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "configs"))
import toy_marsrl  # noqa: E402
import toy_sft  # noqa: E402
from common import base_config  # noqa: E402


@pytest.mark.parametrize("variant,roles", [("marsrl", "all"), ("marsrl_s", "solver"),
                                           ("marsrl_vc", "vc")])
def test_toy_marsrl_variants_are_valid_and_train_their_roles(variant, roles):
    config = toy_marsrl.get_config(variant)
    validate(config, base_config(), device_count=1)
    assert config.rollout.roles_trained == roles
    assert config.model.checkpoint == "/tmp/mars_toy/sft/model"


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_toy_sft_stages_are_valid_and_chain(stage):
    config = toy_sft.get_config(stage)
    checked = config.copy_and_resolve_references()
    checked.job = "train"  # as experiments/run.py checks an sft config
    validate(checked, base_config(), device_count=1)
    assert config.sft.arch in ARCHS
    assert config.model.checkpoint == ("" if stage == "1" else f"/tmp/mars_toy/sft{int(stage) - 1}/model")
    assert dict(config.data.arith) == dict(toy_marsrl.get_config("marsrl").data.arith)


def test_unknown_args_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        toy_marsrl.get_config("grpo")
    with pytest.raises(ValueError, match="unknown"):
        toy_sft.get_config("4")


def test_toy_architecture_is_a_qwen3_moe_under_20m_parameters():
    config = Qwen3Config(**ARCHS["toy"])
    model = nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0)))
    size = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert config.model_type == "qwen3_moe" and size == 1_058_176 <= 20_000_000
    assert config.vocab_size >= 261  # the tiny byte-level tokenizer
