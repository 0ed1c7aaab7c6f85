"""The agent side of the simulation: a word-level tokenizer, a chat encoder that tags each
prompt with its role, synthetic problems, and `AgenticRollouts` with seeded grading.

One word is one token, so prompt lengths follow the real prompt templates (`agents.prompts`)
and the visible parts of the parents they embed (the Verifier sees the Solver's answer part,
the Corrector the answer and the Verifier's report). The simulated engine's thought tokens
decode to nothing (they are thought: `strip_thinking` drops them anyway).

Grading (`SimRollouts._grade`): an output that ended by itself is right with its role's seeded
probability (`correct_rates`; by the run seed and the rollout's uid); a Verifier's verdict is
right with probability `correct_rates['verifier']`, i.e. it says Correct exactly when the judged
solution is correct. Rewards, verdicts and truncation follow `AgenticRollouts._grade`'s rules,
so selection and the Corrector's eligibility see what they would see with real grading.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from mars_jax.rl.rollout import AgenticRollouts

SPECIAL = {0: "<pad>", 1: "<|im_end|>", 2: "<think>", 3: "</think>", 4: "", 5: "<solver>",
           6: "<verifier>", 7: "<corrector>", 8: "x"}
SKIPPED = {0, 1, 5, 6, 7}     # dropped by decode(skip_special_tokens=True)
ROLE_IDS = {5: "solver", 6: "verifier", 7: "corrector"}
FILLER = 9                    # decodes to nothing (see `SimTokenizer(byte_level=True)`)
FIRST_WORD_ID = 16


class SimTokenizer:
    """Word-level ids: fixed special ids (`SPECIAL`) and one id per new word seen. With
    `byte_level`, a word also takes one filler id per character (decoded to nothing), so an
    encoded text is as long as a byte-level tokenizer's encoding of it (the word and its space)."""

    eos_token_id = 1

    def __init__(self, byte_level: bool = False):
        self.byte_level = byte_level
        self._ids: dict[str, int] = {w: i for i, w in SPECIAL.items() if w}
        self._words: list[str] = [SPECIAL.get(i, "") for i in range(FIRST_WORD_ID)]
        self._shown = [w if i not in SKIPPED else "" for i, w in enumerate(self._words)]

    def word_ids(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            i = self._ids.get(word)
            if i is None:
                i = self._ids[word] = len(self._words)
                self._words.append(word)
                self._shown.append(word)
            ids.append(i)
            if self.byte_level:
                ids += [FILLER] * len(word)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        words = self._shown if skip_special_tokens else self._words
        return " ".join(filter(None, map(words.__getitem__, ids)))


def role_of_messages(messages: Sequence[Mapping[str, str]]) -> str:
    """Verifier prompts have a system turn, Corrector prompts an assistant turn."""
    roles = {m["role"] for m in messages}
    return "verifier" if "system" in roles else "corrector" if "assistant" in roles else "solver"


def sim_encode(tokenizer: SimTokenizer, messages, *, enable_thinking: bool = False,
               add_generation_prompt: bool = True) -> list[int]:
    """A ChatML-like rendering, word by word, led by the prompt's role id."""
    role = role_of_messages(messages)
    ids = [next(i for i, r in ROLE_IDS.items() if r == role)]
    for message in messages:
        ids += tokenizer.word_ids(f"<|im_start|> {message['role']}") + tokenizer.word_ids(
            message["content"]) + [tokenizer.eos_token_id]
    if add_generation_prompt:
        ids += tokenizer.word_ids("<|im_start|> assistant") + ([2] if enable_thinking else [])
    return ids


def role_of_prompt(prompt_ids: Sequence[int]) -> str:
    return ROLE_IDS[prompt_ids[0]]


def problems(words: int, seed: int = 0) -> Iterator[dict]:
    """Endless synthetic problems of `words` words each (answer '1': grading is stubbed)."""
    rng = np.random.default_rng(seed)
    index = 0
    while True:
        body = " ".join(f"p{int(w)}" for w in rng.integers(0, 5000, size=words))
        yield {"id": f"sim-{index}", "problem": body, "answer": "1"}
        index += 1


class SimRollouts(AgenticRollouts):
    """`AgenticRollouts` whose grading draws correctness from seeded per-role rates."""

    def __init__(self, tokenizer, config, *, seed: int, encode, correct_rates: Mapping[str, float]):
        super().__init__(tokenizer, config, seed=seed, encode=encode)
        self.correct_rates, self.grade_seed = dict(correct_rates), seed

    def _right(self, uid: str, role: str) -> bool:
        rng = np.random.default_rng([self.grade_seed, zlib.crc32(uid.encode())])
        return bool(rng.random() < self.correct_rates[role])

    def _grade(self, finished) -> None:
        for r in finished:
            done = r.finished_by_itself
            if r.role == "verifier":
                right = done and self._right(r.uid, "verifier")
                r.verdict = (bool(r.judged_correct) if right else not r.judged_correct) if done \
                    else None
                r.reward = float(done and r.verdict == bool(r.judged_correct))
            else:
                r.reward = float(self._right(r.uid, r.role)) if done else \
                    self.config.truncated_reward
