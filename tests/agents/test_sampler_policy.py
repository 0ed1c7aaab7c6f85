"""SamplerPolicy with fake tokenizer helpers and a fake `generate` (no model, no JAX)."""

import sys
import types

import pytest

import mars_jax.data
import mars_jax.sampling
from mars_jax.agents.policy import ChatRequest
from mars_jax.agents.sampler_policy import SamplerPolicy

EOS = 99


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens
        return " ".join(f"t{i}" for i in ids if i != EOS)


@pytest.fixture
def fakes(monkeypatch):
    """Installs fake encode_chat / eos_token_ids / generate; returns the list of generate calls."""
    calls = []

    def encode_chat(tokenizer, messages, *, enable_thinking, add_generation_prompt):
        assert add_generation_prompt and enable_thinking is True
        return [len(m["content"]) for m in messages]

    def generate(model, prompts, *, max_new_tokens, temperature, top_p, top_k, eos_token_ids, seed):
        calls.append(dict(model=model, prompts=prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, top_k=top_k, eos_token_ids=eos_token_ids, seed=seed))
        # Row i writes i + 1 tokens then EOS, unless its own budget cuts it first.
        tokens, reasons = [], []
        for i, budget in enumerate(max_new_tokens):
            row = [*range(i + 1), EOS]
            tokens.append(row[:budget])
            reasons.append("stop" if len(row) <= budget else "length")
        return types.SimpleNamespace(tokens=tokens, logprobs=[[-0.5] * len(t) for t in tokens],
                                     finish_reasons=reasons)

    tokenizer_module = types.ModuleType("mars_jax.data.tokenizer")
    tokenizer_module.encode_chat = encode_chat
    tokenizer_module.eos_token_ids = lambda tokenizer: [EOS]
    # As if the template's generation prompt opened `<think>` (Qwen3-Thinking-2507).
    tokenizer_module.generation_opens_thinking = lambda tokenizer, *, enable_thinking: enable_thinking
    monkeypatch.setitem(sys.modules, "mars_jax.data.tokenizer", tokenizer_module)
    monkeypatch.setattr(mars_jax.data, "tokenizer", tokenizer_module, raising=False)
    monkeypatch.setattr(mars_jax.sampling, "generate", generate, raising=False)
    return calls


def req(content, max_new_tokens, role="solver"):
    return ChatRequest(({"role": "user", "content": content},), role, max_new_tokens)


def test_one_generate_per_call_with_per_request_budgets(fakes):
    policy = SamplerPolicy("model", FakeTokenizer(), temperature=0.7, top_p=0.9, top_k=5, seed=10,
                           enable_thinking=True)
    out = policy.complete([req("abc", 8), req("hello", 3, "verifier"), req("z", 1, "corrector")])
    [call] = fakes
    assert call == dict(model="model", prompts=[[3], [5], [1]], max_new_tokens=[8, 3, 1],
                        temperature=0.7, top_p=0.9, top_k=5, eos_token_ids=(EOS,), seed=10)
    assert [(c.text, c.finish_reason, c.num_tokens) for c in out] == [
        ("t0", "stop", 2), ("t0 t1", "stop", 3), ("t0", "length", 1)]
    assert out[0].token_ids == (0, EOS) and out[0].prompt_ids == (3,) and out[0].logprobs == (-0.5, -0.5)
    assert out[1].token_ids == (0, 1, EOS) and len(out[1].logprobs) == 3
    assert all(c.thinking_open for c in out)  # the parsers then read no text before </think>


def test_seed_advances_per_call_and_is_reproducible(fakes):
    def seeds(policy, n):
        for _ in range(n):
            policy.complete([req("a", 4)])
        return [c["seed"] for c in fakes[-n:]]

    make = lambda: SamplerPolicy("m", FakeTokenizer(), temperature=1.0, top_p=1.0, seed=3, enable_thinking=True)
    assert seeds(make(), 3) == [3, 4, 5]
    assert seeds(make(), 3) == [3, 4, 5]
    assert make().complete([]) == []


def test_engine_backed_policy_equals_generate_per_request():
    """On the engine (real tiny model and tokenizer), each completion is its request's own
    greedy `generate` decode; a repeated prompt is prefilled once."""
    from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
    from mars_jax.models import create_model, get_preset
    from mars_jax.sampling import generate

    model, tokenizer = create_model(get_preset("tiny"), seed=0), tiny_tokenizer()
    policy = SamplerPolicy(model, tokenizer, temperature=0.0, top_p=1.0, seed=0,
                           engine_slots=2, max_length=160)
    requests = [req("2+2?", 12), req("Check: 2+2=5", 7, "verifier"), req("2+2?", 12)]
    out = policy.complete(requests)
    assert policy._engine.stats["prefills"] == 2
    for request, completion in zip(requests, out):
        prompt = encode_chat(tokenizer, list(request.messages), enable_thinking=False,
                             add_generation_prompt=True)
        alone = generate(model, [prompt], max_new_tokens=request.max_new_tokens, temperature=0,
                         eos_token_ids=eos_token_ids(tokenizer))
        assert list(completion.token_ids) == alone.tokens[0]
        assert completion.finish_reason == alone.finish_reasons[0]
