"""`opt_state_shardings`: AdamW moments shard like their parameters; counters are replicated."""
import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from mars_jax import sharding
from mars_jax.models import create_model, get_preset
from mars_jax.optimizer import make_optimizer
from mars_jax.rl.update import opt_state_shardings


def test_moments_shard_like_parameters_and_match_an_eager_init():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 2, "expert": 1})
    params = nnx.state(create_model(get_preset("tiny"), mesh=mesh), nnx.Param)
    optimizer = make_optimizer(1e-3, max_grad_norm=1.0)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            params)
    shardings = opt_state_shardings(optimizer, abstract)
    eager = optimizer.init(params)  # eager zeros_like keeps each parameter's sharding
    leaves, eager_leaves = jax.tree.leaves(shardings), jax.tree.leaves(eager)
    assert len(leaves) == len(eager_leaves)
    for s, x in zip(leaves, eager_leaves):
        if x.ndim:
            assert s.spec == x.sharding.spec
        else:
            assert s.spec == P()
    wi = params["layers"][0]["mlp"]["wi"].get_value()
    assert wi.sharding.spec == P(("expert", "fsdp"), None, "tensor", None)  # 8 experts, 2 a chip
    assert [s.spec for s in leaves].count(wi.sharding.spec) >= 2 * 2  # mu and nu of 2 layers
