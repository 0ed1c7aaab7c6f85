"""A policy that samples from the in-process JAX model.

By default one `complete` call is one `generate` call on the whole batch, so a system round
is one batched generation. Requests may carry different `max_new_tokens`: each
row of the batch stops at its own budget (`generate` takes per-row budgets).
Seeds: call i uses `seed + i`, so repeated calls differ while a whole run is
reproducible from `seed`.

With `engine_slots > 0` the calls run on one continuous-batching `mars_jax.sampling.Engine`
(slots refilled as requests finish; identical prompts in a call prefilled once); request j of
the run draws from sequence seed j under the engine seed `seed`.
"""

from __future__ import annotations

from typing import Any, Sequence

from mars_jax.agents.policy import ChatRequest, Completion


class SamplerPolicy:
    """In-process policy over a model and its tokenizer.

    Args:
      model: the model passed to `mars_jax.sampling.generate`.
      tokenizer: a Hugging Face tokenizer with the model's chat template.
      temperature, top_p, top_k: sampling parameters (top_k=0: no top-k filter).
      seed: base seed of the run.
      enable_thinking: render the chat template in thinking mode.
      engine_slots, max_length: with engine_slots > 0, decode on an `Engine` of that many slots
        of `max_length` positions (prompt + new tokens).
    """

    def __init__(self, model: Any, tokenizer: Any, *, temperature: float, top_p: float, top_k: int = 0,
                 seed: int, enable_thinking: bool = False, engine_slots: int = 0,
                 max_length: int = 0):
        self._model = model
        self._tokenizer = tokenizer
        self._temperature = temperature
        self._top_p = top_p
        self._top_k = top_k
        self._seed = seed
        self._enable_thinking = enable_thinking
        self._thinking_open: bool | None = None  # read from the template on the first call
        self._calls = 0
        self._engine_slots, self._max_length = engine_slots, max_length
        self._engine = None
        self._submitted = 0

    def complete(self, requests: Sequence[ChatRequest]) -> list[Completion]:
        # Imported here so that the agents package does not pull in JAX and the model code.
        from mars_jax.data.tokenizer import encode_chat, eos_token_ids, generation_opens_thinking
        from mars_jax.sampling import generate

        if not requests:
            return []
        if self._thinking_open is None:
            self._thinking_open = generation_opens_thinking(
                self._tokenizer, enable_thinking=self._enable_thinking)
        prompts = [
            encode_chat(self._tokenizer, list(r.messages), enable_thinking=self._enable_thinking,
                        add_generation_prompt=True)
            for r in requests
        ]
        eos = tuple(eos_token_ids(self._tokenizer))
        budgets = [r.max_new_tokens for r in requests]
        if self._engine_slots:
            tokens, logprobs, reasons = self._engine_decode(prompts, budgets, eos)
        else:
            output = generate(
                self._model, prompts, max_new_tokens=budgets,
                temperature=self._temperature, top_p=self._top_p, top_k=self._top_k,
                eos_token_ids=eos, seed=self._seed + self._calls,
            )
            tokens, logprobs, reasons = output.tokens, output.logprobs, output.finish_reasons
        self._calls += 1
        completions = []
        for request, prompt, ids, logprobs, reason in zip(
                requests, prompts, tokens, logprobs, reasons, strict=True):
            completions.append(Completion(
                text=self._tokenizer.decode(ids, skip_special_tokens=True),
                finish_reason=reason,
                num_tokens=len(ids),
                prompt_ids=tuple(prompt),
                token_ids=tuple(ids),
                logprobs=tuple(float(x) for x in logprobs),
                thinking_open=self._thinking_open,
            ))
        return completions

    def _engine_decode(self, prompts, budgets, eos):
        from mars_jax.sampling import Engine

        if self._engine is None:
            self._engine = Engine(self._model, num_slots=self._engine_slots,
                                  max_length=self._max_length, seed=self._seed,
                                  max_stop_ids=max(8, len(eos)))
        groups: dict[tuple, list[int]] = {}
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            groups.setdefault((tuple(prompt), budget), []).append(i)
        ids = {}
        for (prompt, budget), rows in groups.items():
            submitted = self._engine.submit(prompt, max_new_tokens=budget, stop_ids=eos,
                                            temperature=self._temperature, top_p=self._top_p,
                                            top_k=self._top_k, seed=self._submitted, n=len(rows))
            self._submitted += len(rows)
            ids.update(zip(rows, submitted))
        outputs = self._engine.run()
        ordered = [outputs[ids[i]] for i in range(len(prompts))]
        return ([o.tokens for o in ordered], [o.logprobs for o in ordered],
                [o.finish_reason for o in ordered])
