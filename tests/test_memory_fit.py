"""The start-up memory check: resident bytes per chip counted by hand on the tiny model, and the
refusal that names the fields to change."""
import jax
import numpy as np
import pytest
from flax import nnx

from experiments.configs import smoke
from mars_jax import memory_fit, sharding, weight_sync
from mars_jax.errors import ConfigError
from mars_jax.models import create_model, get_preset
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import init_train_state
from mars_jax.sampling.config import engine_settings


def test_resident_bytes_count_the_state_the_copy_and_the_kv_cache_by_hand():
    train, rollout = sharding.make_meshes({"data": -1, "rollout": {"devices": 4, "data": 4}})
    with sharding.use_mesh(train):
        state = init_train_state(create_model(get_preset("tiny"), seed=0, mesh=train),
                                 make_optimizer(1e-4))
    params = sum(x.nbytes for x in jax.tree.leaves(state.params))
    # Replicated over data=4: every training chip holds the parameters, Adam's two moments of
    # the same dtype and the step counters.
    counters = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim == 0)
    config = smoke.get_config()
    config.rollout.engine_kv_pages, config.rollout.engine_page_size = 60, 16
    config.rollout.engine_slots, config.rollout.decode_engine = 8, "engine"
    cfg = get_preset("tiny")
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    kv = memory_fit.engine_kv_bytes(engine_settings(config), cfg, shards=4)
    assert kv == per_token * 16 * (60 + 4)  # a trash page per pool
    copy = (state.params, weight_sync.rollout_shardings(state.params, rollout))
    parts = memory_fit.resident(state, copy, kv, rollout)
    assert parts.train_state == 3 * params + counters
    assert parts.engine_weights == params  # replicated on each of the 4 rollout chips
    assert parts.kv_cache == kv // 4
    # Offloaded: Adam's moments and count leave for the decode; the KV cache leaves for the
    # update unless it stays ('keep').
    opt_counters = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)
    for through in (False, True):
        decoding, updating = memory_fit.offloaded_phases(state, copy, kv, rollout,
                                                         kv_through_update=through)
        assert decoding.train_state == params + counters - opt_counters
        assert decoding.kv_cache == kv // 4 and decoding.engine_weights == params
        assert updating.train_state == parts.train_state
        assert updating.kv_cache == (kv // 4 if through else 0)


@pytest.mark.parametrize("shared, limit, fits", [
    (True, 60, True), (True, 59, False), (False, 40, True), (False, 39, False)])
def test_check_refuses_what_does_not_fit_naming_the_fields(shared, limit, fits):
    parts = memory_fit.Resident(train_state=20, engine_weights=10, kv_cache=30)
    if fits:
        memory_fit.check(parts, limit, shared=shared)
        return
    with pytest.raises(ConfigError) as raised:
        memory_fit.check(parts, limit, shared=shared)
    message = str(raised.value)
    assert "rollout.engine_kv_pages" in message and "mesh.rollout.devices" in message
    assert raised.value.exit_code == 2


def test_an_unknown_memory_limit_checks_nothing():
    memory_fit.check(memory_fit.Resident(1 << 50, 1 << 50, 1 << 50), None, shared=True)
