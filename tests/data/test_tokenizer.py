"""Tokenizers: the tiny byte-level one, the real Qwen3 one, chat formatting, eos ids, saving."""

import json
from pathlib import Path

import pytest

from mars_jax.data import arith
from mars_jax.data.tokenizer import (encode_chat, eos_token_ids, generation_opens_thinking, load_tokenizer,
                                     qwen3_files_dir, qwen3_tokenizer, save_tokenizer, tiny_tokenizer)

MESSAGES = [
    {"role": "system", "content": "You are an exacting reviewer."},
    {"role": "user", "content": "What is 7 + 3 * (12 - 5)?\n\nWrite the final answer inside \\boxed{}."},
]
# Qwen3's chat format, written out by hand.
PROMPT = (
    "<|im_start|>system\nYou are an exacting reviewer.<|im_end|>\n"
    "<|im_start|>user\nWhat is 7 + 3 * (12 - 5)?\n\nWrite the final answer inside \\boxed{}.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
AGENT_TEXT = (
    "**Final Verdict:** The solution contains a Critical Error.\n"
    "**List of Findings:**\n* **Location:** \"$x^2 - 4 = 0 \\implies x = 2$\"\n"
    "  **Issue:** Critical Error — the root $x = -2$ is lost; naïve.\n"
    "**Correctness:** Wrong"
)


# The generation prompt of Qwen3-*-Thinking-2507's chat template (written out by hand from its
# tokenizer_config.json: `'<|im_start|>assistant\n<think>\n'`), around a minimal message loop.
THINKING_2507_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}")


def thinking_2507_tokenizer():
    """The tiny byte-level tokenizer with a chat template whose generation prompt opens `<think>`."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = THINKING_2507_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tiny():
    return tiny_tokenizer()


def test_generation_opens_thinking():
    assert generation_opens_thinking(thinking_2507_tokenizer(), enable_thinking=True)
    tokenizer = thinking_2507_tokenizer()
    assert tokenizer.decode(encode_chat(tokenizer, MESSAGES)).endswith("<|im_start|>assistant\n<think>\n")
    # Qwen3 (hybrid): thinking off pre-fills a closed `<think>\n\n</think>`; on leaves it to the model.
    for tokenizer in (tiny_tokenizer(), qwen3_tokenizer()):
        assert not generation_opens_thinking(tokenizer, enable_thinking=False)
        assert not generation_opens_thinking(tokenizer, enable_thinking=True)


def test_tiny_vocabulary(tiny):
    assert len(tiny) == 261 <= 512
    assert tiny.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        256, 257, 258, 259, 260,
    ]
    assert tiny.encode("A", add_special_tokens=False) == [ord("A")]
    assert tiny_tokenizer().get_vocab() == tiny.get_vocab()  # built deterministically


@pytest.mark.parametrize("text", [p["problem"] for p in arith.generate_problems(50, seed=0)] + ["-1234", AGENT_TEXT])
def test_tiny_round_trip(tiny, text):
    ids = tiny.encode(text, add_special_tokens=False)
    assert tiny.decode(ids) == text
    assert max(ids) < len(tiny)


def test_think_tokens_are_single_and_kept(tiny):
    text = "<think>\nhmm\n</think>\n\n\\boxed{-17}<|im_end|>"
    ids = tiny.encode(text, add_special_tokens=False)
    assert ids[0] == 259 and 260 in ids and ids[-1] == 258
    assert tiny.decode(ids, skip_special_tokens=True) == "<think>\nhmm\n</think>\n\n\\boxed{-17}"


@pytest.mark.parametrize("make", [tiny_tokenizer, qwen3_tokenizer], ids=["tiny", "qwen3"])
def test_chat_format(make):
    tokenizer = make()
    thinking = encode_chat(tokenizer, MESSAGES, enable_thinking=True)
    direct = encode_chat(tokenizer, MESSAGES, enable_thinking=False)
    assert tokenizer.decode(thinking) == PROMPT
    assert tokenizer.decode(direct) == PROMPT + "<think>\n\n</think>\n\n"
    history = [*MESSAGES, {"role": "assistant", "content": "<think>\nsum\n</think>\n\n\\boxed{28}"}]
    closed = tokenizer.decode(encode_chat(tokenizer, history, add_generation_prompt=False))
    assert closed == PROMPT + "<think>\nsum\n</think>\n\n\\boxed{28}<|im_end|>\n"


def test_qwen3_tokenizer_is_the_real_one():
    tokenizer = qwen3_tokenizer()
    assert len(tokenizer) == 151_669
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == [
        151643, 151644, 151645, 151667, 151668,
    ]
    assert tokenizer.decode(tokenizer.encode(AGENT_TEXT, add_special_tokens=False)) == AGENT_TEXT


def test_eos_token_ids(tiny):
    assert eos_token_ids(tiny) == (258, 256)
    assert eos_token_ids(qwen3_tokenizer()) == (151645, 151643)


def test_save_and_load_from_checkpoint_dir(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(AGENT_TEXT, add_special_tokens=False) == tiny.encode(AGENT_TEXT, add_special_tokens=False)
    assert encode_chat(loaded, MESSAGES) == encode_chat(tiny, MESSAGES)
    assert eos_token_ids(loaded) == (258, 256)


def test_missing_tokenizer_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found: .*nowhere"):
        load_tokenizer(tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["tiny", "qwen3", "directory"])
def test_saved_tokenizer_loads_with_its_chat_template(name, tmp_path):
    """What an export writes: Qwen3's files byte for byte (and a directory's), the tiny one as a
    class every transformers version knows; each loads with the same ids and chat prompts."""
    source = {"tiny": tiny_tokenizer, "qwen3": qwen3_tokenizer}.get(name, qwen3_tokenizer)()
    save_tokenizer(qwen3_files_dir() if name == "directory" else name, tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(AGENT_TEXT, add_special_tokens=False) == source.encode(AGENT_TEXT, add_special_tokens=False)
    for thinking in (False, True):
        assert encode_chat(loaded, MESSAGES, enable_thinking=thinking) == encode_chat(source, MESSAGES, enable_thinking=thinking)
    assert eos_token_ids(loaded) == eos_token_ids(source)
    if name == "tiny":
        assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    else:
        for file in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            assert (tmp_path / file).read_bytes() == (Path(qwen3_files_dir()) / file).read_bytes()


def test_saving_a_tokenizer_from_a_directory_without_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer_config.json in .*nowhere"):
        save_tokenizer(str(tmp_path / "nowhere"), tmp_path / "out")
