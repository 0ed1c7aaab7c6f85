"""Qwen3 and Qwen3-MoE decoder in Flax NNX: one class serves both, as in HF transformers."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mars_jax import sharding
from mars_jax.layers.attention import (Attention, KVCache, LayerKVCache, cache_layout,
                                       stacked_cache_layout)
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.layers.embeddings import Embed, rope_cos_sin
from mars_jax.layers.mlp import MLP
from mars_jax.layers.moe import MoE
from mars_jax.layers.normalization import RMSNorm
from mars_jax.layers.paged_kv import PagedKVCache
from mars_jax.layers.params import normal_param
from mars_jax.models.config import Qwen3Config


@struct.dataclass
class ModelOutput:
    """Final hidden states `[B,T,H]`, per-MoE-layer router logits `[L_moe,B,T,E]` and chosen expert
    ids `[L_moe,B,T,k]` (None for dense models), and the updated KV cache (None without one)."""

    hidden: jax.Array
    router_logits: jax.Array | None
    expert_ids: jax.Array | None
    cache: tuple[KVCache, ...] | KVCache | PagedKVCache | None


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Position ids that count only real tokens, so left and right padding give the same result."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def positions_from_segments(segments: jax.Array) -> jax.Array:
    """Position ids of packed rows `[B, T]`, restarting at 0 where the segment id changes."""
    index = jnp.broadcast_to(jnp.arange(segments.shape[-1]), segments.shape)
    changed = jnp.concatenate([jnp.ones_like(segments[..., :1], bool),
                               segments[..., 1:] != segments[..., :-1]], axis=-1)
    return index - jax.lax.cummax(jnp.where(changed, index, 0), axis=segments.ndim - 1)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) with a dense or MoE MLP."""

    def __init__(self, config: Qwen3Config, layer: int, *, rngs: nnx.Rngs):
        pd, std, eps = config.weight_dtype, config.initializer_range, config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, param_dtype=pd)
        self.self_attn = Attention(
            hidden=config.hidden_size, heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            bias=config.attention_bias, eps=eps, rngs=rngs, param_dtype=pd, stddev=std,
            impl=config.attention_impl, block=config.attention_block)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, param_dtype=pd)
        self.is_moe = config.is_moe_layer(layer)
        if self.is_moe:
            self.mlp = MoE(
                config.hidden_size, config.moe_intermediate_size, config.num_experts,
                config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                impl=config.moe_impl, block_size=config.moe_block_size,
                dense_max_tokens=config.moe_dense_max_tokens,
                capacity_factor=config.capacity_factor, rngs=rngs, param_dtype=pd, stddev=std,
                chunk_tokens=config.moe_chunk_tokens)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, rngs=rngs, param_dtype=pd,
                           stddev=std)

    def __call__(self, x, cos, sin, mask, cache, cache_index, expert_ids):
        h, cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_index)
        x = sharding.constrain(x + h, ("batch", "length", "act_embed"))
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            h, logits, expert_ids = self.mlp(h, expert_ids)
        else:
            h, logits, expert_ids = self.mlp(h), None, None
        x = sharding.constrain(x + h, ("batch", "length", "act_embed"))
        return x, cache, logits, expert_ids


def _call(layer: DecoderLayer, *args):
    return layer(*args)


_remat_call = nnx.remat(_call)


class Qwen3(nnx.Module):
    """Qwen3 / Qwen3-MoE causal LM. `model(input_ids, attention_mask=mask)` returns logits."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        self.config = config
        pd, std = config.weight_dtype, config.initializer_range
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, rngs=rngs, param_dtype=pd,
                                  stddev=std)
        self.layers = nnx.List([DecoderLayer(config, i, rngs=rngs)
                                for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pd)
        if not config.tie_word_embeddings:
            self.lm_head = normal_param(rngs, (config.hidden_size, config.vocab_size),
                                        ("embed", "vocab"), pd, std)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.is_moe)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Logits `[B, T, vocab]` for int `[B, T]` ids and a 0/1 mask (left or right padding)."""
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        out = self.forward(input_ids, positions=positions_from_mask(attention_mask),
                           mask=AttentionMask.causal(attention_mask))
        return self.logits(out.hidden)

    def forward(self, input_ids: jax.Array, *, positions: jax.Array, mask: AttentionMask,
                cache: tuple[KVCache, ...] | KVCache | PagedKVCache | None = None,
                cache_index: jax.Array | int = 0, expert_ids: jax.Array | None = None,
                layer_stacks: tuple[nnx.State, ...] | None = None) -> ModelOutput:
        """The decoder stack; `expert_ids [L_moe,B,T,k]` replays recorded routing. Without a
        cache, `config.remat` and `config.scan_layers` apply. `cache` is one `KVCache` per layer
        or one stacked over the layers (written in place; with `layer_stacks`, scanned per run of
        alike layers)."""
        cfg = self.config
        x = sharding.constrain(self.embed_tokens(input_ids, cfg.compute_dtype),
                               ("batch", "length", "act_embed"))
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        if isinstance(cache, (KVCache, PagedKVCache)):
            args = (x, cos, sin, mask, cache, cache_index, expert_ids)
            x, cache, logits, ids = (self._stacked_cache_layers(*args) if layer_stacks is None
                                     else self._scan_cached_layers(*args, layer_stacks))
            return ModelOutput(hidden=self.norm(x), router_logits=logits, expert_ids=ids,
                               cache=cache)
        if cfg.scan_layers and cache is None and len({l.is_moe for l in self.layers}) == 1:
            x, logits, ids = self._scan_layers(x, cos, sin, mask, expert_ids)
            return ModelOutput(hidden=self.norm(x), router_logits=logits, expert_ids=ids,
                               cache=None)
        new_cache, all_logits, all_ids = [], [], []
        moe_index = 0
        for i, layer in enumerate(self.layers):
            replay = None
            if layer.is_moe and expert_ids is not None:
                replay = expert_ids[moe_index]
            run = _remat_call if cfg.remat and cache is None else _call
            x, layer_cache, logits, ids = run(layer, x, cos, sin, mask,
                                              None if cache is None else cache[i], cache_index,
                                              replay)
            new_cache.append(layer_cache)
            if layer.is_moe:
                all_logits.append(logits)
                all_ids.append(ids)
                moe_index += 1
        return ModelOutput(
            hidden=self.norm(x),
            router_logits=jnp.stack(all_logits) if all_logits else None,
            expert_ids=jnp.stack(all_ids) if all_ids else None,
            cache=None if cache is None else tuple(new_cache))

    def _scan_layers(self, x, cos, sin, mask, expert_ids):
        """All layers as one `lax.scan` over their stacked parameters, so XLA compiles one layer."""
        graphdef = nnx.graphdef(self.layers[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                               *[nnx.state(layer) for layer in self.layers])
        is_moe = self.layers[0].is_moe

        def body(x, inputs):
            state, replay = inputs
            x, _, logits, ids = nnx.merge(graphdef, state)(x, cos, sin, mask, None, 0, replay)
            return x, (logits, ids) if is_moe else None

        if self.config.remat:
            body = jax.checkpoint(body)
        x, routing = jax.lax.scan(body, x, (stacked, expert_ids))
        logits, ids = routing if is_moe else (None, None)
        return x, logits, ids

    def layer_runs(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) of each run of consecutive alike layers (dense or MoE)."""
        runs, start = [], 0
        for i in range(1, len(self.layers) + 1):
            if i == len(self.layers) or self.layers[i].is_moe != self.layers[start].is_moe:
                runs.append((start, i))
                start = i
        return tuple(runs)

    def _moe_before(self, layer: int) -> int:
        return sum(l.is_moe for l in self.layers[:layer])

    def _stacked_cache_layers(self, x, cos, sin, mask, cache, cache_index, expert_ids):
        """The layer loop over a cache stacked over layers (`forward`), unrolled."""
        all_logits, all_ids = [], []
        for i, layer in enumerate(self.layers):
            replay = None
            if layer.is_moe and expert_ids is not None:
                replay = expert_ids[self._moe_before(i)]
            x, view, logits, ids = layer(x, cos, sin, mask, _layer_view(cache, i), cache_index,
                                         replay)
            cache = _stack_of(view)
            if layer.is_moe:
                all_logits.append(logits)
                all_ids.append(ids)
        return (x, cache, jnp.stack(all_logits) if all_logits else None,
                jnp.stack(all_ids) if all_ids else None)

    def _scan_cached_layers(self, x, cos, sin, mask, cache, cache_index, expert_ids,
                            layer_stacks):
        """`_stacked_cache_layers` as one `lax.scan` per run of alike layers over the run's
        stacked weights (`layer_stacks`), the cache carried and written in place."""
        all_logits, all_ids = [], []
        for (start, stop), stacked in zip(self.layer_runs(), layer_stacks, strict=True):
            graphdef, is_moe = nnx.graphdef(self.layers[start]), self.layers[start].is_moe
            replay = None
            if is_moe and expert_ids is not None:
                first = self._moe_before(start)
                replay = expert_ids[first:first + stop - start]

            def body(carry, inputs, graphdef=graphdef, is_moe=is_moe):
                x, cache = carry
                state, i, replay = inputs
                x, view, logits, ids = nnx.merge(graphdef, state)(
                    x, cos, sin, mask, _layer_view(cache, i), cache_index, replay)
                return (x, _stack_of(view)), ((logits, ids) if is_moe else None)

            (x, cache), routing = jax.lax.scan(
                body, (x, cache), (stacked, jnp.arange(start, stop), replay))
            if is_moe:
                all_logits.append(routing[0])
                all_ids.append(routing[1])
        join = lambda parts: jnp.concatenate(parts) if parts else None
        return x, cache, join(all_logits), join(all_ids)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Output projection of final hidden states (tied or untied), in float32."""
        if self.config.tie_word_embeddings:
            out = self.embed_tokens.attend(hidden)
        else:
            out = hidden @ self.lm_head[...].astype(hidden.dtype)
        return sharding.constrain(out.astype(jnp.float32), ("batch", "length", "act_vocab"))

    def init_cache(self, batch: int, length: int, dtype: jnp.dtype | None = None, *,
                   stacked: bool = False) -> tuple[KVCache, ...] | KVCache:
        """Zeroed KV cache of `length` positions per layer (layouts: `KVCache`): one per layer,
        or with `stacked` one `KVCache` stacked over the layers (`stacked_cache_layout`)."""
        cfg = self.config
        dtype = dtype or cfg.compute_dtype
        zeros = lambda layout: KVCache(*(sharding.constrain(jnp.zeros(shape, dtype), names)
                                         for shape, names in layout))
        if stacked:
            return zeros(stacked_cache_layout(len(self.layers), batch, length,
                                              cfg.num_key_value_heads, cfg.head_dim))
        layout = cache_layout(batch, length, cfg.num_key_value_heads, cfg.head_dim)
        return tuple(zeros(layout) for _ in self.layers)


def _layer_view(cache: KVCache | PagedKVCache, layer: jax.Array | int
                ) -> LayerKVCache | PagedKVCache:
    """Layer `layer`'s view of a cache stacked over layers (read and written in place)."""
    if isinstance(cache, PagedKVCache):
        return cache.replace(layer=layer)
    return LayerKVCache(cache.k, cache.v, layer)


def _stack_of(view: LayerKVCache | PagedKVCache) -> KVCache | PagedKVCache:
    """The stacked cache a layer's view wrote."""
    if isinstance(view, PagedKVCache):
        return view.replace(layer=0)
    return KVCache(view.k, view.v)


def merge_stacked(graphdef: nnx.GraphDef, rest: nnx.State, stacks: tuple[nnx.State, ...]
                  ) -> Qwen3:
    """The model of `graphdef`, from the weights outside its layers and its layers' weights
    stacked per `Qwen3.layer_runs` run; each layer's weights are slices of the stacks."""
    layers, run = {}, 0
    for stacked in stacks:
        count = jax.tree.leaves(stacked)[0].shape[0]
        for j in range(count):
            layers[run + j] = jax.tree.map(lambda x, j=j: x[j], stacked)
        run += count
    return nnx.merge(graphdef, nnx.State({"layers": layers}), rest)


def create_model(config: Qwen3Config, *, seed: int = 0, mesh: jax.sharding.Mesh | None = None,
                 rules: sharding.Rules = sharding.DEFAULT_RULES) -> Qwen3:
    """A randomly initialised model; with `mesh`, every parameter is created in its sharding."""
    if mesh is None:
        return Qwen3(config, rngs=nnx.Rngs(seed))
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(seed))))
    shardings = sharding.state_shardings(abstract_state, mesh, rules)

    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        return nnx.state(Qwen3(config, rngs=nnx.Rngs(seed)))

    return nnx.merge(graphdef, init())
