"""Per-layer rematerialisation and scanned layers: the same results as the plain layer loop."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.models import create_model, get_preset

LAYERS, BATCH, LENGTH = 4, 4, 256


def _loss_and_params(remat: bool):
    config = get_preset("tiny").replace(remat=remat, num_hidden_layers=LAYERS)
    graphdef, params = nnx.split(create_model(config, seed=0))

    def loss(params, ids):
        logits = nnx.merge(graphdef, params)(ids)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    return loss, params


def _residual_bytes(loss, params, ids) -> int:
    """Bytes the backward pass keeps from the forward: the leaves of the VJP closure."""
    _, backward = jax.vjp(lambda p: loss(p, ids), params)
    return sum(x.nbytes for x in jax.tree.leaves(backward))


def test_remat_gives_the_same_gradients_keeping_only_layer_inputs():
    ids = jax.random.randint(jax.random.key(0), (BATCH, LENGTH), 0, get_preset("tiny").vocab_size)
    (plain, params), (remat, _) = _loss_and_params(False), _loss_and_params(True)
    expected, got = jax.jit(jax.grad(plain))(params, ids), jax.jit(jax.grad(remat))(params, ids)
    for (path, e), (_, g) in zip(nnx.to_flat_state(expected), nnx.to_flat_state(got)):
        np.testing.assert_allclose(g.get_value(), e.get_value(), atol=1e-6, err_msg=str(path))
    # Without remat every layer keeps its attention probabilities ([B, heads, T, T] f32 alone is
    # 4 MiB a layer); with it, a layer keeps its [B, T, hidden] input (256 KiB) and parameters.
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    probs_bytes = BATCH * 4 * LENGTH * LENGTH * 4
    assert _residual_bytes(plain, params, ids) > LAYERS * probs_bytes
    assert _residual_bytes(remat, params, ids) < params_bytes + 2 * probs_bytes


def _equations(jaxpr) -> list:
    """Every equation of `jaxpr`, those of its sub-jaxprs (scan bodies, jit, remat) included."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _equations(sub)
    return found


def test_scanned_layers_equal_the_layer_loop():
    """`scan_layers`: one `lax.scan` over stacked layer weights gives the loop's logits, routing
    and gradients (with and without remat)."""
    ids = jax.random.randint(jax.random.key(1), (2, 64), 0, get_preset("tiny").vocab_size)
    results = []
    for scan, remat in [(False, False), (True, False), (True, True)]:
        config = get_preset("tiny").replace(scan_layers=scan, remat=remat, num_hidden_layers=3)
        graphdef, params = nnx.split(create_model(config, seed=0))

        def loss(params):
            model = nnx.merge(graphdef, params)
            out = model.forward(ids, positions=jnp.broadcast_to(jnp.arange(64), ids.shape),
                                mask=AttentionMask.causal(jnp.ones(ids.shape, jnp.int32)))
            return jnp.mean(jax.nn.logsumexp(model.logits(out.hidden), -1)), out

        # Which path ran: the scan traces one layer body and loops it 3 times (one router top_k);
        # the loop traces 3 layers and has no scan. Remat wraps the scanned body.
        eqns = _equations(jax.make_jaxpr(lambda p: loss(p)[0])(params).jaxpr)
        names = [e.primitive.name for e in eqns]
        assert [e.params["length"] for e in eqns if e.primitive.name == "scan"] == ([3] if scan else [])
        assert names.count("top_k") == (1 if scan else 3)
        assert any("remat" in n or n == "checkpoint" for n in names) == remat
        (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        results.append((value, out, grads))
    (value, out, grads), others = results[0], results[1:]
    for other_value, other_out, other_grads in others:
        np.testing.assert_allclose(other_value, value, rtol=1e-6)
        np.testing.assert_array_equal(other_out.expert_ids, out.expert_ids)
        np.testing.assert_allclose(other_out.router_logits, out.router_logits, atol=1e-6)
        for (path, e), (_, g) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(other_grads)):
            np.testing.assert_allclose(g.get_value(), e.get_value(), atol=1e-6, err_msg=str(path))
