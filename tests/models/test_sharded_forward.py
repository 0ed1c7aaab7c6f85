"""The model on an 8-device fake CPU mesh equals the 1-device model, with intended shardings."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mars_jax import sharding
from mars_jax.models import Qwen3, create_model, from_pretrained, get_preset
from tests import hf_fixtures

MESH = {"data": 2, "fsdp": 2, "tensor": 1, "expert": 2}



def test_forward_on_8_devices_matches_1_device(hf_moe_dir):
    assert jax.device_count() == 8
    ids, mask = hf_fixtures.padded_batch(vocab=96)
    ids, mask = np.tile(ids, (4, 1))[:8], np.tile(mask, (4, 1))[:8]
    single = from_pretrained(hf_moe_dir)
    expected = single(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask, jnp.int32))
    mesh = sharding.make_mesh(MESH)
    model = from_pretrained(hf_moe_dir, mesh=mesh)
    state = dict(nnx.to_flat_state(nnx.state(model)))
    assert state[("layers", 0, "mlp", "wi")].get_value().sharding.spec == P("expert", None, "tensor", "fsdp")
    assert state[("layers", 0, "self_attn", "q_proj")].get_value().sharding.spec == P("fsdp", "tensor", None)
    assert state[("embed_tokens", "embedding")].get_value().sharding.spec == P("tensor", "fsdp")
    with sharding.use_mesh(mesh):
        batch_sharding = sharding.named_sharding(mesh, ("batch", None), ids.shape)
        x = jax.device_put(jnp.asarray(ids, jnp.int32), batch_sharding)
        m = jax.device_put(jnp.asarray(mask, jnp.int32), batch_sharding)
        logits = nnx.jit(lambda model, x, m: model(x, attention_mask=m))(model, x, m)
    assert len(logits.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)


def test_create_model_initialises_into_shardings():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 2})
    model = create_model(get_preset("tiny"), mesh=mesh)
    state = dict(nnx.to_flat_state(nnx.state(model)))
    wo = state[("layers", 1, "mlp", "wo")].get_value()
    # 8 experts split over expert x fsdp (2 each), so `embed` is whole on a chip.
    assert wo.sharding.spec == P(("expert", "fsdp"), "tensor", None)
    assert wo.addressable_shards[0].data.shape == (2, 16, 64)
    assert state[("lm_head",)].get_value().sharding.spec == P("fsdp", "tensor")


def _abstract_tiny() -> nnx.State:
    return nnx.state(nnx.eval_shape(lambda: Qwen3(get_preset("tiny"), rngs=nnx.Rngs(0))))


def test_a_mesh_axis_that_does_not_divide_a_parameter_is_named_once_in_a_warning(caplog):
    """fsdp=6 does not divide the tiny preset's hidden size 64: each parameter it would shard
    stays replicated along it, and one warning names the parameter, dimension and axis."""
    mesh = sharding.make_mesh({"data": 1, "fsdp": 6}, devices=jax.devices()[:6])
    with caplog.at_level(logging.WARNING):
        shardings = dict(nnx.to_flat_state(sharding.state_shardings(_abstract_tiny(), mesh)))
    assert shardings[("lm_head",)].get_value().spec == P(None, "tensor")
    lm_head = [r.getMessage() for r in caplog.records if "parameter lm_head " in r.getMessage()]
    assert lm_head == ["sharding: parameter lm_head of shape (64, 512): mesh axis 'fsdp' (size 6) "
                       "does not divide dimension 0 (size 64); it is replicated along that axis"]
    wo = [r.getMessage() for r in caplog.records if "parameter layers.1.mlp.wo " in r.getMessage()]
    assert wo == ["sharding: parameter layers.1.mlp.wo of shape (8, 32, 64): mesh axis 'fsdp' "
                  "(size 6) does not divide dimension 0 (size 8) or dimension 2 (size 64); it is "
                  "replicated along that axis"]
    assert not any("norm" in r.getMessage() for r in caplog.records)  # never sharded by fsdp


def test_fsdp_takes_the_experts_dimension_where_it_divides_it_else_embed(caplog):
    """Expert weights ask for `fsdp` on the experts dimension first: the tiny preset's 8 experts
    split 4 ways there; 6 ways they do not, and `fsdp` passes on to `embed` (hidden 96), with no
    warning since the axis is used."""
    config = dataclasses.replace(get_preset("tiny"), hidden_size=96)
    state = nnx.state(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))))
    for fsdp, spec in [(4, P(("expert", "fsdp"), None, "tensor", None)),  # size-1 axes kept
                       (6, P("expert", None, "tensor", "fsdp"))]:
        mesh = sharding.make_mesh({"data": 1, "fsdp": fsdp}, devices=jax.devices()[:fsdp])
        with caplog.at_level(logging.WARNING):
            shardings = dict(nnx.to_flat_state(sharding.state_shardings(state, mesh)))
        assert shardings[("layers", 1, "mlp", "wi")].get_value().spec == spec
    assert not [r for r in caplog.records if "mlp.w" in r.getMessage()]


def test_a_mesh_whose_axes_divide_every_parameter_logs_nothing(caplog):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 2})
    with caplog.at_level(logging.WARNING):
        sharding.state_shardings(_abstract_tiny(), mesh)
    assert not [r for r in caplog.records if r.getMessage().startswith("sharding:")]


@pytest.mark.parametrize("bad, message", [
    ({"data": 3, "fsdp": 1, "tensor": 1, "expert": 1}, "product of axis sizes"),
    ({"data": -1, "fsdp": -1}, "only one axis may be -1"),
    ({"data": -1, "fsdp": 3}, "cannot be split"),
    ({"dat": 2}, "unknown axes"),
])
def test_mesh_config_errors_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(bad)
