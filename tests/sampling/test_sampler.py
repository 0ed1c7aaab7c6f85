"""The sampler against HF generate, the full-sequence forward, and itself across layouts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from mars_jax import sharding
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.models import from_pretrained
from mars_jax.sampling import generate, sampler

PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42]]


@pytest.fixture(scope="module")
def model(hf_moe_dir):
    return from_pretrained(hf_moe_dir)


@pytest.mark.parametrize("attention", ["dense", "flash"])
def test_greedy_matches_transformers_generate(model, hf_moe_dir, attention):
    if attention == "flash":  # blockwise prefill: 16-token prompt bucket in 4 x 4 tiles
        model = from_pretrained(hf_moe_dir, attention_impl="flash", attention_block=4)
    ours = generate(model, PROMPTS, max_new_tokens=32, temperature=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_moe_dir).eval()
    for prompt, tokens, reason in zip(PROMPTS, ours.tokens, ours.finish_reasons):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == expected
        assert reason == "length"


def _forward_logprobs(model, prompt, tokens, expert_ids=None):
    ids = jnp.asarray([prompt + tokens], jnp.int32)
    length = ids.shape[1]
    out = model.forward(ids, positions=jnp.arange(length)[None],
                        mask=AttentionMask.causal(jnp.ones((1, length), jnp.int32)),
                        expert_ids=None if expert_ids is None else jnp.asarray(expert_ids)[:, None])
    logprobs = jax.nn.log_softmax(model.logits(out.hidden)[0], axis=-1)
    positions = np.arange(len(prompt) - 1, length - 1)
    return np.asarray(logprobs[positions, np.asarray(tokens)])


@pytest.mark.parametrize("replay", [False, True])
def test_logprobs_equal_full_forward(model, replay):
    result = generate(model, PROMPTS, max_new_tokens=20, temperature=1.0, seed=3,
                      record_routing=replay)
    for i, prompt in enumerate(PROMPTS):
        experts = result.expert_ids[i] if replay else None
        expected = _forward_logprobs(model, prompt, result.tokens[i], experts)
        np.testing.assert_allclose(result.logprobs[i], expected, atol=1e-5)


def test_stop_tokens_per_sequence(model):
    free = generate(model, PROMPTS[:2], max_new_tokens=12, temperature=0)
    stop = [free.tokens[0][3], free.tokens[1][5]]
    result = generate(model, PROMPTS[:2], max_new_tokens=12, temperature=0,
                      eos_token_ids=[(stop[0],), (stop[1],)])
    for i in range(2):
        first = free.tokens[i].index(stop[i])
        assert result.tokens[i] == free.tokens[i][:first + 1]
        assert result.finish_reasons[i] == "stop"


def test_sequence_alone_equals_sequence_in_batch_of_8(model):
    batch = [PROMPTS[i % 4] for i in range(8)]
    together = generate(model, batch, max_new_tokens=24, temperature=1.0, seed=11,
                        sequence_seeds=list(range(100, 108)))
    for i in (0, 5):
        alone = generate(model, [batch[i]], max_new_tokens=24, temperature=1.0, seed=11,
                         sequence_seeds=[100 + i])
        assert alone.tokens[0] == together.tokens[i]
    assert together.tokens[0] != together.tokens[4]  # same prompt, different sequence seed


def test_8_device_mesh_gives_same_tokens(hf_moe_dir, model):
    expected = generate(model, PROMPTS * 2, max_new_tokens=16, temperature=1.0, seed=5)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "expert": 2})
    sharded = from_pretrained(hf_moe_dir, mesh=mesh)
    result = generate(sharded, PROMPTS * 2, max_new_tokens=16, temperature=1.0, seed=5, mesh=mesh)
    assert result.tokens == expected.tokens


@pytest.mark.parametrize("mesh_axes", [None, {"data": 2, "fsdp": 2, "tensor": 1, "expert": 2}])
def test_dropping_finished_rows_changes_nothing(hf_moe_dir, model, mesh_axes, monkeypatch):
    """Long-tailed budgets: the batch shrinks 16 -> 8 -> 4 -> 2 -> 1 rows between 4-step chunks (16 -> 8
    on the mesh, whose batch axes span 8 devices); every row's tokens, log-probabilities and
    recorded routing equal the one-loop decode's."""
    shapes = []
    take_rows = sampler._take_rows
    monkeypatch.setattr(sampler, "_take_rows",
                        lambda state, index: shapes.append(len(index)) or take_rows(state, index))
    mesh = None if mesh_axes is None else sharding.make_mesh(mesh_axes)
    if mesh is not None:
        model = from_pretrained(hf_moe_dir, mesh=mesh)
    prompts = [PROMPTS[i % 4] for i in range(10)]
    budgets = [3, 5, 40, 2, 7, 33, 4, 1, 9, 12]
    kwargs = dict(max_new_tokens=budgets, temperature=1.0, seed=3, record_routing=True,
                  mesh=mesh)
    one_loop = generate(model, prompts, compact_every=None, **kwargs)
    compacted = generate(model, prompts, compact_every=4, **kwargs)
    assert [len(t) for t in one_loop.tokens] == budgets  # no stop token: every row runs out
    assert shapes == ([8, 4, 2, 1] if mesh is None else [8])
    assert compacted.tokens == one_loop.tokens
    assert compacted.finish_reasons == one_loop.finish_reasons == ["length"] * 10
    for a, b in zip(compacted.logprobs, one_loop.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(compacted.expert_ids, one_loop.expert_ids):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "at least one prompt"),
    (dict(prompts=[[]]), "at least one token"),
    (dict(prompts=[[1000]]), "token ids must be in"),
    (dict(prompts=[[1]], top_p=0.0), "0 < top_p"),
    (dict(prompts=[[1]], temperature=float("nan")), "temperature >= 0"),
    (dict(prompts=[[1]], top_k=10_000), "top_k <= vocab"),
    (dict(prompts=[[1]], max_new_tokens=-1), "max_new_tokens: must be >= 0"),
    (dict(prompts=[[1], [2]], max_new_tokens=[3]), "max_new_tokens: expected one entry"),
    (dict(prompts=[[1]], compact_every=0), "compact_every"),
])
def test_bad_arguments_name_the_field(model, kwargs, message):
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=message):
        generate(model, **kwargs)
