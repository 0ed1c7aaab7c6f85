"""A policy that samples from the in-process JAX model, through `sampling.decode_batch` on one
engine that lives as long as the policy (`sampling.make_engine`).

Request j of the run draws from sequence seed j under the engine's seed, so repeated calls differ
while a run is reproducible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from mars_jax.agents.policy import ChatRequest, Completion

if TYPE_CHECKING:  # the agents package does not pull in JAX and the model code at import
    from mars_jax.sampling import EngineSettings


class SamplerPolicy:
    """In-process policy over `model` and its `tokenizer`, decoding on `engine`
    (`sampling.EngineSettings`)."""

    def __init__(self, model: Any, tokenizer: Any, *, temperature: float, top_p: float,
                 top_k: int = 0, engine: "EngineSettings", enable_thinking: bool = False):
        self._model, self._tokenizer = model, tokenizer
        self._sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self._settings, self._enable_thinking = engine, enable_thinking
        self._thinking_open: bool | None = None  # read from the template on the first call
        self._engine = None
        self._submitted = 0

    def complete(self, requests: Sequence[ChatRequest]) -> list[Completion]:
        # Imported here so that the agents package does not pull in JAX and the model code.
        from mars_jax.data.tokenizer import encode_chat, eos_token_ids, generation_opens_thinking
        from mars_jax.sampling import decode_batch

        if not requests:
            return []
        if self._thinking_open is None:
            self._thinking_open = generation_opens_thinking(
                self._tokenizer, enable_thinking=self._enable_thinking)
        prompts = [encode_chat(self._tokenizer, list(r.messages),
                               enable_thinking=self._enable_thinking, add_generation_prompt=True)
                   for r in requests]
        eos = tuple(eos_token_ids(self._tokenizer))
        outputs = decode_batch(self._engine_for(eos), prompts,
                               [r.max_new_tokens for r in requests], stop_ids=eos,
                               first_seed=self._submitted, **self._sampling)
        self._submitted += len(requests)
        return [Completion(text=self._tokenizer.decode(out.tokens, skip_special_tokens=True),
                           finish_reason=out.finish_reason, num_tokens=len(out.tokens),
                           prompt_ids=tuple(prompt), token_ids=tuple(out.tokens),
                           logprobs=tuple(float(x) for x in out.logprobs),
                           thinking_open=self._thinking_open)
                for prompt, out in zip(prompts, outputs, strict=True)]

    def _engine_for(self, eos: tuple[int, ...]):
        from mars_jax.sampling import make_engine

        if self._engine is None:
            self._engine = make_engine(self._settings, self._model, eos)
        return self._engine
