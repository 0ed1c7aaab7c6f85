"""SamplerPolicy: requests through `decode_batch` on a recording fake engine (no model, no JAX),
then on the real tiny model, where both engines must decode what `generate` decodes."""

import sys
import types

import pytest

import mars_jax.data
import mars_jax.sampling
from mars_jax.agents.policy import ChatRequest
from mars_jax.agents.sampler_policy import SamplerPolicy
from mars_jax.sampling import EngineOutput, EngineSettings

EOS = 99


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens
        return " ".join(f"t{i}" for i in ids if i != EOS)


class FakeEngine:
    """Request k (in submission order) writes k + 1 tokens then EOS, unless its budget cuts it."""

    def __init__(self, model, *, seed):
        self.model, self.seed, self.submits, self._queue = model, seed, [], []
        self._next = 0

    def submit(self, prompt, *, max_new_tokens, stop_ids, seed, n, temperature, top_p, top_k):
        self.submits.append(dict(prompt=prompt, budget=max_new_tokens, stop_ids=stop_ids,
                                 seed=seed, n=n, sampling=(temperature, top_p, top_k)))
        self._queue += [max_new_tokens] * n
        self._next += n
        return list(range(self._next - n, self._next))

    def run(self):
        outputs = {}
        for k, budget in enumerate(self._queue, start=self._next - len(self._queue)):
            row = [*range(k + 1), EOS]
            outputs[k] = EngineOutput(row[:budget], [-0.5] * min(budget, len(row)),
                                      "stop" if len(row) <= budget else "length")
        self._queue = []
        return outputs


@pytest.fixture
def engines(monkeypatch):
    """Installs fake encode_chat / eos_token_ids and the fake engine; returns the engines made."""
    made = []

    def encode_chat(tokenizer, messages, *, enable_thinking, add_generation_prompt):
        assert add_generation_prompt and enable_thinking is True
        return [len(m["content"]) for m in messages]

    tokenizer_module = types.ModuleType("mars_jax.data.tokenizer")
    tokenizer_module.encode_chat = encode_chat
    tokenizer_module.eos_token_ids = lambda tokenizer: [EOS]
    # As if the template's generation prompt opened `<think>` (Qwen3-Thinking-2507).
    tokenizer_module.generation_opens_thinking = lambda tokenizer, *, enable_thinking: enable_thinking
    monkeypatch.setitem(sys.modules, "mars_jax.data.tokenizer", tokenizer_module)
    monkeypatch.setattr(mars_jax.data, "tokenizer", tokenizer_module, raising=False)
    monkeypatch.setattr(mars_jax.sampling, "make_engine",
                        lambda settings, model, stop_ids: made.append(
                            FakeEngine(model, seed=settings.seed)) or made[-1])
    return made


def req(content, max_new_tokens, role="solver"):
    return ChatRequest(({"role": "user", "content": content},), role, max_new_tokens)


def test_requests_grouped_with_their_budgets_and_seeds(engines):
    policy = SamplerPolicy("model", FakeTokenizer(), temperature=0.7, top_p=0.9, top_k=5,
                           engine=EngineSettings(seed=10), enable_thinking=True)
    out = policy.complete([req("abc", 8), req("hello", 3, "verifier"), req("abc", 8),
                           req("z", 1, "corrector")])
    [engine] = engines
    assert (engine.model, engine.seed) == ("model", 10)
    assert engine.submits == [  # the repeated prompt is one group of 2, seeds in first-seen order
        dict(prompt=(3,), budget=8, stop_ids=(EOS,), seed=0, n=2, sampling=(0.7, 0.9, 5)),
        dict(prompt=(5,), budget=3, stop_ids=(EOS,), seed=2, n=1, sampling=(0.7, 0.9, 5)),
        dict(prompt=(1,), budget=1, stop_ids=(EOS,), seed=3, n=1, sampling=(0.7, 0.9, 5))]
    # outputs in request order: requests 0 and 2 are the engine's requests 0 and 1, request 1
    # its request 2 (cut by its budget of 3)
    assert [(c.text, c.finish_reason, c.num_tokens) for c in out] == [
        ("t0", "stop", 2), ("t0 t1 t2", "length", 3), ("t0 t1", "stop", 3), ("t0", "length", 1)]
    assert out[0].token_ids == (0, EOS) and out[0].prompt_ids == (3,) and out[0].logprobs == (-0.5, -0.5)
    assert all(c.thinking_open for c in out)  # the parsers then read no text before </think>


def test_sequence_seeds_continue_over_calls_and_reproduce(engines):
    def seeds(policy):
        for n in (2, 1, 3):
            policy.complete([req("a" * (i + 1), 4) for i in range(n)])
        return [s["seed"] for s in engines[-1].submits]

    make = lambda: SamplerPolicy("m", FakeTokenizer(), temperature=1.0, top_p=1.0,
                                 engine=EngineSettings(seed=3), enable_thinking=True)
    assert seeds(make()) == [0, 1, 2, 3, 4, 5]
    assert seeds(make()) == [0, 1, 2, 3, 4, 5]
    assert make().complete([]) == []


def test_both_engines_decode_what_generate_decodes():
    """Real tiny model: with an Engine (slots) and with static batches, each completion is its
    request's own `generate` decode under sequence seed = its index in the run; sampled at
    T=1, so the seeds matter; a repeated prompt is prefilled once on the engine."""
    from mars_jax.data.tokenizer import encode_chat, eos_token_ids, tiny_tokenizer
    from mars_jax.models import create_model, get_preset
    from mars_jax.sampling import generate

    model, tokenizer = create_model(get_preset("tiny"), seed=0), tiny_tokenizer()
    requests = [req("2+2?", 12), req("Check: 2+2=5", 7, "verifier"), req("2+2?", 12)]
    on_slots = SamplerPolicy(model, tokenizer, temperature=1.0, top_p=1.0, engine=EngineSettings(
        kind="engine", seed=5, slots=2, max_length=160))
    static = SamplerPolicy(model, tokenizer, temperature=1.0, top_p=1.0,
                           engine=EngineSettings(kind="generate", seed=5))
    first, second = on_slots.complete(requests), static.complete(requests)
    assert on_slots._engine.stats["prefills"] == 2
    seeds = [0, 2, 1]  # the repeated prompt's group takes seeds 0, 1; the other prompt 2
    for request, seed, a, b in zip(requests, seeds, first, second):
        prompt = encode_chat(tokenizer, list(request.messages), enable_thinking=False,
                             add_generation_prompt=True)
        alone = generate(model, [prompt], max_new_tokens=request.max_new_tokens, temperature=1.0,
                         eos_token_ids=eos_token_ids(tokenizer), seed=5, sequence_seeds=[seed])
        assert list(a.token_ids) == list(b.token_ids) == alone.tokens[0]
        assert a.finish_reason == b.finish_reason == alone.finish_reasons[0]
