"""Mixture-of-experts SwiGLU block: softmax router, top-k, and several dispatch backends.

All compute the same function (only `capacity` drops tokens): `dense` (every expert on every token;
`auto`'s choice for at most `dense_max_tokens` tokens and off TPU for tiny experts), `sorted`
(one-expert blocks; `auto`'s choice otherwise off TPU), `ragged` (grouped matmuls; `auto`'s on TPU,
not GPU, where XLA lowers `ragged_dot` to a dense one-hot dot), `mgpu` (Mosaic GPU kernels, when
asked and they fit) and `capacity` (GShard buffers, when `capacity_factor` is set). Under a mesh
each batch shard dispatches its own tokens: a global sort would replicate them.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from mars_jax import sharding
from mars_jax.layers.grouped_matmul import grouped_matmul, mgpu_fits
from mars_jax.layers.params import normal_param

# 'auto' on CPU computes all experts densely when a layer's experts hold at most this many
# parameters: the wasted FLOPs then cost less than sorting and block-scanning the tokens.
SMALL_EXPERT_PARAMS = 1 << 20


class MoE(nnx.Module):
    """Qwen3-MoE sparse block. Returns (output, router_logits, expert_ids)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool, impl: str, block_size: int, dense_max_tokens: int,
                 capacity_factor: float | None, rngs: nnx.Rngs, param_dtype: jnp.dtype,
                 stddev: float, chunk_tokens: int = 0):
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.impl, self.block_size, self.dense_max_tokens = impl, block_size, dense_max_tokens
        self.capacity_factor, self.chunk_tokens = capacity_factor, chunk_tokens
        self.router = normal_param(rngs, (hidden, num_experts), ("embed", None), param_dtype, stddev)
        self.wi = normal_param(rngs, (num_experts, 2, intermediate, hidden),
                               ("expert", None, "mlp", "embed"), param_dtype, stddev)
        self.wo = normal_param(rngs, (num_experts, intermediate, hidden),
                               ("expert", "mlp", "embed"), param_dtype, stddev)

    def route(self, x: jax.Array, expert_ids: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Router logits `[N, E]`, chosen expert ids `[N, k]` (or the replayed ones) and weights."""
        logits = x @ self.router[...].astype(x.dtype)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        if expert_ids is None:
            weights, expert_ids = jax.lax.top_k(probs, self.top_k)
        else:
            weights = jnp.take_along_axis(probs, expert_ids, axis=-1)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return logits, expert_ids.astype(jnp.int32), weights.astype(x.dtype)

    def backend(self, num_tokens: int, dtype: jnp.dtype = jnp.bfloat16) -> str:
        """The dispatch backend for `num_tokens` tokens in `dtype`, chosen at trace time."""
        if self.capacity_factor is not None:
            return "capacity"
        if self.impl not in ("auto", "mgpu"):
            return self.impl
        if num_tokens <= self.dense_max_tokens:
            return "dense"
        _, _, inter, hidden = self.wi.get_value().shape
        if (self.impl == "mgpu" and mgpu_fits(hidden, 2 * inter, dtype)
                and mgpu_fits(inter, hidden, dtype)):
            return "mgpu"
        if jax.default_backend() == "tpu":
            return "ragged"
        small_experts = self.wo.get_value().size * 3 <= SMALL_EXPERT_PARAMS
        return "dense" if small_experts else "sorted"

    def __call__(self, x: jax.Array, expert_ids: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x `[..., H]`; `expert_ids [..., k]` replays a recorded routing instead of top-k."""
        lead, hidden = x.shape[:-1], x.shape[-1]
        ids_in = None if expert_ids is None else expert_ids.reshape(-1, self.top_k)
        logits, ids, weights = self.route(x.reshape(-1, hidden), ids_in)
        backend = self.backend(logits.shape[0], x.dtype)
        fn = {"dense": self._dense, "sorted": self._sorted, "ragged": self._ragged,
              "mgpu": functools.partial(self._ragged, mgpu=True),
              "capacity": self._capacity}[backend]
        wi, wo = self.wi[...].astype(x.dtype), self.wo[...].astype(x.dtype)
        ids, weights = ids.reshape(*lead, self.top_k), weights.reshape(*lead, self.top_k)
        weight_axes = tuple(p.get_metadata()["logical_axes"] for p in (self.wi, self.wo))
        sort_based = backend in ("sorted", "ragged", "mgpu")
        out = _sharded(fn, x, ids, weights, wi, wo, weight_axes,
                       self.chunk_tokens if sort_based else 0, split_batch=sort_based)
        return out, logits.reshape(*lead, self.num_experts), ids

    def _dense(self, x: jax.Array, ids: jax.Array, weights: jax.Array, wi: jax.Array,
               wo: jax.Array) -> jax.Array:
        n, (e, _, inter, hidden) = x.shape[0], wi.shape
        combine = jnp.sum(jax.nn.one_hot(ids, e, dtype=x.dtype) * weights[..., None], axis=1)
        h = (x @ wi.reshape(e * 2 * inter, hidden).T).reshape(n, e, 2, inter)
        act = jax.nn.silu(h[:, :, 0]) * h[:, :, 1] * combine[:, :, None]
        return act.reshape(n, e * inter) @ wo.reshape(e * inter, hidden)

    @staticmethod
    def _sort(ids: jax.Array, weights: jax.Array, num_experts: int):
        """Assignments sorted by expert: (token, expert, weight, rank within expert, per-expert
        counts); ids equal to `num_experts` (another chip's experts) sort last, uncounted."""
        flat_e = ids.reshape(-1)
        order = jnp.argsort(flat_e, stable=True)
        sorted_e = flat_e[order]
        tokens = order // ids.shape[-1]
        counts = jnp.bincount(flat_e, length=num_experts + 1)
        starts = jnp.cumsum(counts) - counts
        rank = jnp.arange(flat_e.shape[0]) - starts[sorted_e]
        return tokens, sorted_e, weights.reshape(-1)[order], rank, counts[:num_experts]

    def _sorted(self, x: jax.Array, ids: jax.Array, weights: jax.Array, wi: jax.Array,
                wo: jax.Array) -> jax.Array:
        hidden, assignments, bs, e = x.shape[1], ids.size, self.block_size, wi.shape[0]
        tokens, sorted_e, sorted_w, rank, counts = self._sort(ids, weights, e)
        padded = (counts + bs - 1) // bs * bs
        padded_end = jnp.cumsum(padded)
        num_blocks = math.ceil(assignments / bs) + min(e, assignments)  # >= sum ceil(count/bs)
        spare = num_blocks * bs  # the row of every foreign assignment
        dest = jnp.where(sorted_e < e, (padded_end - padded)[jnp.minimum(sorted_e, e - 1)] + rank,
                         spare)
        buf = jnp.zeros((spare + 1, hidden), x.dtype).at[dest].set(x[tokens])
        block_expert = jnp.minimum(
            jnp.searchsorted(padded_end, jnp.arange(num_blocks) * bs, side="right"), e - 1)
        used = jnp.arange(num_blocks) < padded_end[-1] // bs
        ys = _expert_blocks(buf[:spare].reshape(num_blocks, bs, hidden), block_expert, used, wi, wo)
        ys = jnp.concatenate([ys.reshape(spare, hidden), jnp.zeros((1, hidden), x.dtype)])
        return jnp.zeros_like(x).at[tokens].add(ys[dest] * sorted_w[:, None])

    def _ragged(self, x: jax.Array, ids: jax.Array, weights: jax.Array, wi: jax.Array,
                wo: jax.Array, mgpu: bool = False) -> jax.Array:
        e, _, inter, hidden = wi.shape
        tokens, sorted_e, sorted_w, _, counts = self._sort(ids, weights, e)
        # Rows past the groups (foreign assignments) are masked, in and out: their values and
        # gradients are 0 whatever a grouped-matmul kernel leaves there.
        local = (sorted_e < e)[:, None]
        h = grouped_matmul(jnp.where(local, x[tokens], 0), wi.reshape(e, 2 * inter, hidden),
                           counts, transpose_rhs=True, mgpu=mgpu)
        h = jnp.where(local, h, 0).reshape(-1, 2, inter)
        ys = grouped_matmul(jax.nn.silu(h[:, 0]) * h[:, 1], wo, counts, transpose_rhs=False,
                            mgpu=mgpu)
        return jnp.zeros_like(x).at[tokens].add(jnp.where(local, ys, 0) * sorted_w[:, None])

    def _capacity(self, x: jax.Array, ids: jax.Array, weights: jax.Array, wi: jax.Array,
                  wo: jax.Array) -> jax.Array:
        hidden, e = x.shape[1], wi.shape[0]
        capacity = max(1, math.ceil(ids.size / e * self.capacity_factor))
        tokens, sorted_e, sorted_w, rank, _ = self._sort(ids, weights, e)
        keep = rank < capacity
        dest = jnp.where(keep, sorted_e * capacity + rank, e * capacity)  # dropped -> spare row
        buf = jnp.zeros((e * capacity + 1, hidden), x.dtype).at[dest].set(x[tokens])
        h = jnp.einsum("ech,ejih->ecji", buf[:-1].reshape(e, capacity, hidden), wi)
        ys = jnp.einsum("eci,eih->ech", jax.nn.silu(h[:, :, 0]) * h[:, :, 1], wo)
        ys = jnp.concatenate([ys.reshape(e * capacity, hidden), jnp.zeros((1, hidden), x.dtype)])
        return jnp.zeros_like(x).at[tokens].add(ys[dest] * (sorted_w * keep)[:, None])


def _flat(fn, x, ids, weights, wi, wo, chunk: int = 0):
    """`fn` over the tokens of `x [..., H]`: all at once, or `chunk` tokens at a time (a
    rematerialised `lax.map`, so only one chunk's dispatch buffers are live, forward or backward)."""
    hidden, k = x.shape[-1], ids.shape[-1]
    x2, ids2, w2 = x.reshape(-1, hidden), ids.reshape(-1, k), weights.reshape(-1, k)
    n = x2.shape[0]
    if not chunk or n <= chunk:
        return fn(x2, ids2, w2, wi, wo).reshape(x.shape)
    pad = -n % chunk  # padding tokens carry weight 0, so they add nothing
    blocks = [jnp.pad(a, ((0, pad), (0, 0))).reshape(-1, chunk, a.shape[1]) for a in (x2, ids2, w2)]
    one = jax.checkpoint(lambda xc, ic, wc: fn(xc, ic, wc, wi, wo))
    out = jax.lax.map(lambda args: one(*args), tuple(blocks))
    return out.reshape(-1, hidden)[:n].reshape(x.shape)


def _sharded(fn, x, ids, weights, wi, wo, weight_axes, chunk: int = 0, split_batch: bool = False):
    """`_flat` in one `shard_map` over the mesh axes of the batch (each shard dispatches its own
    tokens, expert weights gathered inside; or, where `_gathers_tokens`, tokens go to the
    experts) and of the experts' `mlp` dimension (each chip runs its slice of the hidden units,
    outputs summed). Without such axes it is `_flat`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _flat(fn, x, ids, weights, wi, wo, chunk)
    batch = (sharding.spec_axes(sharding.fitted_spec(("batch",), x.shape[:1], mesh)[0])
             if split_batch else ())
    specs = [sharding.fitted_spec(names, w.shape, mesh) for names, w in zip(weight_axes, (wi, wo))]
    # A size-1 axis splits nothing; made manual, it failed XLA's SPMD partitioning of the update
    # ("Cross-partition allreduce must be in (partial) manual partitioning mode").
    mlp = [tuple(a for a in sharding.spec_axes(spec[names.index("mlp")])
                 if a not in batch and mesh.shape[a] > 1)
           for names, spec in zip(weight_axes, specs)]
    tensor = mlp[0] if mlp[0] == mlp[1] else ()
    if not batch and not tensor:
        return _flat(fn, x, ids, weights, wi, wo, chunk)
    expert_entries = [spec[names.index("expert")] for names, spec in zip(weight_axes, specs)]
    ep = tuple(a for a in sharding.spec_axes(expert_entries[0]) if mesh.shape[a] > 1)
    if not (ep and expert_entries[0] == expert_entries[1] and set(ep) <= set(batch)
            and _gathers_tokens(x, wi, wo, mesh, batch, ep, tensor)):
        ep = ()
    weight_specs = [_only(spec, batch + tensor) for spec in specs]   # split on entry
    gathered = [_only(spec, tuple(a for a in batch if a not in ep and mesh.shape[a] > 1))
                for spec in specs]
    rows = PartitionSpec(batch or None)

    def local(x, ids, weights, wi, wo):
        wi, wo = (_all_gather(w, spec) for w, spec in zip((wi, wo), gathered))
        if ep:
            out = _tokens_to_local_experts(fn, x, ids, weights, wi, wo, ep, chunk)
        else:
            out = _flat(fn, x, ids, weights, wi, wo, chunk)
        return out[None] if tensor else out

    out = jax.shard_map(local, mesh=mesh, axis_names=set(batch + tensor),
                        in_specs=(rows, rows, rows, *weight_specs),
                        out_specs=PartitionSpec(tensor, *rows) if tensor else rows,
                        # check_vma off: the expert-block VJP starts its weight gradients
                        # from replicated zeros and adds per-shard terms.
                        check_vma=False)(x, ids, weights, wi, wo)
    # The tensor shards' partial outputs, summed outside the shard_map (XLA's all-reduce).
    return out.sum(0) if tensor else out


def _gathers_tokens(x, wi, wo, mesh, batch, ep, tensor) -> bool:
    """Whether the tokens of `ep` shards are fewer elements than one chip's share of the experts,
    so gathering them moves less."""
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    group_tokens = math.prod(x.shape[:-1]) // size(batch) * size(ep)
    return 2 * group_tokens * x.shape[-1] < (wi.size + wo.size) // (size(ep) * size(tensor))


def _tokens_to_local_experts(fn, x, ids, weights, wi, wo, ep: tuple[str, ...], chunk: int):
    """Expert parallelism over mesh axes `ep`: tokens all-gathered, this shard's experts run on
    their assignments (others carry id `len(wi)`, skipped), outputs reduce-scattered back."""
    xs, all_ids, all_weights = (jax.lax.all_gather(a, ep, axis=0, tiled=True)
                                for a in (x, ids, weights))
    num_local = wi.shape[0]
    local_ids = all_ids - jax.lax.axis_index(ep) * num_local
    mine = (local_ids >= 0) & (local_ids < num_local)
    out = _flat(fn, xs, jnp.where(mine, local_ids, num_local), jnp.where(mine, all_weights, 0),
                wi, wo, chunk)
    return jax.lax.psum_scatter(out, ep, scatter_dimension=0, tiled=True)


def _only(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
    """`spec` with only the mesh axes in `axes` kept."""
    return PartitionSpec(*(tuple(a for a in sharding.spec_axes(entry) if a in axes) or None
                           for entry in spec))


def _all_gather(w: jax.Array, spec: PartitionSpec) -> jax.Array:
    """The whole of `w` from its shards over the (manual) mesh axes named in `spec`."""
    for dim, entry in enumerate(spec):
        if entry:
            w = jax.lax.all_gather(w, entry, axis=dim, tiled=True)
    return w


def _block_forward(xb, wi_e, wo_e):
    """One block through one expert: (output, gate pre-activation, up, activation)."""
    inter, hidden = wi_e.shape[1], wi_e.shape[2]
    h = (xb @ wi_e.reshape(2 * inter, hidden).T).reshape(xb.shape[0], 2, inter)
    act = jax.nn.silu(h[:, 0]) * h[:, 1]
    return act @ wo_e, h[:, 0], h[:, 1], act


@jax.custom_vjp
def _expert_blocks(blocks, block_expert, used, wi, wo):
    """`[NB, bs, H]` token blocks, each through its expert's SwiGLU; the custom backward adds a
    block's weight gradient into its expert's slice only."""
    def block(_, inputs):
        xb, e, is_used = inputs
        out = jax.lax.cond(is_used, lambda: _block_forward(xb, wi[e], wo[e])[0],
                           lambda: jnp.zeros_like(xb))
        return None, out

    return jax.lax.scan(block, None, (blocks, block_expert, used))[1]


def _expert_blocks_fwd(blocks, block_expert, used, wi, wo):
    return _expert_blocks(blocks, block_expert, used, wi, wo), (blocks, block_expert, used, wi, wo)


def _expert_blocks_bwd(residuals, grads):
    blocks, block_expert, used, wi, wo = residuals

    def block(acc, inputs):
        dwi, dwo = acc
        xb, e, is_used, g = inputs

        def compute():
            _, gate, up, act = _block_forward(xb, wi[e], wo[e])
            d_act = g @ wo[e].T
            sig = jax.nn.sigmoid(gate)
            d_gate = d_act * up * sig * (1 + gate * (1 - sig))
            d_h = jnp.stack([d_gate, d_act * jax.nn.silu(gate)], axis=1)  # [bs, 2, I]
            d_x = d_h.reshape(xb.shape[0], -1) @ wi[e].reshape(-1, xb.shape[1])
            d_wi = jnp.einsum("bji,bh->jih", d_h, xb)
            return (d_x, jax.lax.dynamic_update_index_in_dim(dwi, dwi[e] + d_wi, e, 0),
                    jax.lax.dynamic_update_index_in_dim(dwo, dwo[e] + act.T @ g, e, 0))

        d_x, dwi, dwo = jax.lax.cond(is_used, compute, lambda: (jnp.zeros_like(xb), dwi, dwo))
        return (dwi, dwo), d_x

    (dwi, dwo), d_blocks = jax.lax.scan(block, (jnp.zeros_like(wi), jnp.zeros_like(wo)),
                                        (blocks, block_expert, used, grads))
    return d_blocks, None, None, dwi, dwo


_expert_blocks.defvjp(_expert_blocks_fwd, _expert_blocks_bwd)
