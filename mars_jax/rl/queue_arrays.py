"""Rollout queues in a checkpoint: token ids and log-probabilities as arrays (each distinct prompt
once), the rest as JSON.

`unpack(pack(state))` rebuilds the records exactly, a finished rollout's text re-derived from its
ids.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

RECORD_KEYS = {"uid", "prompt_ids", "response_ids", "logprobs"}  # what marks a rollout record
ARRAYS = {"prompt_ids": np.int32, "response_ids": np.int32, "logprobs": np.float32}
PACKED = "queue_arrays"  # key of a packed state's tables


def _is_record(value) -> bool:
    return isinstance(value, dict) and RECORD_KEYS <= value.keys()


def pack(state) -> tuple[dict, dict[str, np.ndarray]]:
    """(`state` with its records' ids, log-probabilities and texts as references, the arrays)."""
    prompts: dict[tuple[int, ...], int] = {}
    solutions: dict[str, int] = {}
    prompt_ids: list[list[int]] = []
    response_ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    responses = 0

    def walk(value):
        nonlocal responses
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        if not _is_record(value):
            return {k: walk(v) for k, v in value.items()}
        record = {k: v for k, v in value.items()
                  if k not in ("prompt_ids", "response_ids", "logprobs", "text", "solution")}
        prompt = tuple(value["prompt_ids"])
        if prompt not in prompts:
            prompts[prompt] = len(prompts)
            prompt_ids.append(list(prompt))
        record["prompt"] = prompts[prompt]
        if len(value["logprobs"]) != len(value["response_ids"]):
            raise ValueError(f"rollout {value['uid']}: {len(value['response_ids'])} response "
                             f"ids but {len(value['logprobs'])} log-probabilities")
        record["response"] = [responses, responses + len(value["response_ids"])]
        responses += len(value["response_ids"])
        response_ids.append(list(value["response_ids"]))
        logprobs.append(list(value["logprobs"]))
        solution = value.get("solution")
        if solution is not None and solution not in solutions:
            solutions[solution] = len(solutions)
        record["solution"] = None if solution is None else solutions[solution]
        return record

    packed = walk(state)
    starts = np.cumsum([0] + [len(p) for p in prompt_ids]).tolist()
    tables = {"prompts": [starts[i:i + 2] for i in range(len(prompt_ids))],
              "solutions": list(solutions)}
    arrays = {name: np.fromiter((x for part in parts for x in part), ARRAYS[name])
              for name, parts in (("prompt_ids", prompt_ids), ("response_ids", response_ids),
                                  ("logprobs", logprobs))}
    return {"state": packed, PACKED: tables}, arrays


def unpack(packed: dict, arrays: dict[str, np.ndarray],
           decode: Callable[[list[int]], str]) -> dict:
    """`pack`'s input back from its output; `decode(response_ids)` is a finished rollout's
    text. A state that `pack` did not make (an older checkpoint's) comes back as it is."""
    if PACKED not in packed:
        return packed
    tables = packed[PACKED]
    prompt_ids, response_ids, logprobs = (np.asarray(arrays[name]).astype(ARRAYS[name])
                                          for name in ARRAYS)

    def walk(value):
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "prompt" not in value or "response" not in value or "uid" not in value:
            return {k: walk(v) for k, v in value.items()}
        record = dict(value)
        start, stop = tables["prompts"][record.pop("prompt")]
        record["prompt_ids"] = prompt_ids[start:stop].tolist()
        start, stop = record.pop("response")
        record["response_ids"] = response_ids[start:stop].tolist()
        record["logprobs"] = logprobs[start:stop].tolist()
        solution = record.pop("solution")
        record["solution"] = None if solution is None else tables["solutions"][solution]
        finished = record.get("finish_reason") is not None
        record["text"] = decode(record["response_ids"]) if finished else ""
        return record

    return walk(packed["state"])


def host_blocks(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`pack`'s arrays as `distributed.host_arrays` takes them: uint32 words, `[1, n, 1]`."""
    return {name: np.ascontiguousarray(x, ARRAYS[name]).view(np.uint32)[None, :, None]
            for name, x in arrays.items()}


def from_host_blocks(blocks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`host_blocks`' input back from its output (read back through `unpack_host_arrays`)."""
    return {name: np.ascontiguousarray(x, np.uint32).reshape(-1).view(ARRAYS[name])
            for name, x in blocks.items()}
