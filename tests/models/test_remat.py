"""Per-layer rematerialisation: the same gradients, and only layer inputs kept for the backward."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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
