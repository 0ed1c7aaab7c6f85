"""A deterministic, shuffling, resumable iterator over problem records (grain MapDataset)."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Sequence

import grain

FINGERPRINT_RECORDS = 64  # records read to fingerprint a source, evenly spaced


class ProblemIterator(Iterator[dict]):
    """Yields the records of `source`, shard `shard_index` of `shard_count`, each epoch a new
    permutation of `seed` with `shuffle` (`num_epochs=None`: forever). `set_state(get_state())`
    on an iterator built alike continues exactly; a state from a source of another length or
    other fingerprinted records (`FINGERPRINT_RECORDS`) raises."""

    def __init__(
        self,
        source: Sequence[dict],
        *,
        seed: int,
        shuffle: bool = True,
        num_epochs: int | None = None,
        shard_index: int = 0,
        shard_count: int = 1,
    ) -> None:
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
        dataset = grain.MapDataset.source(source)[shard_index::shard_count]
        self.epoch_size = len(dataset)
        if self.epoch_size == 0:
            raise ValueError(f"shard {shard_index} of {shard_count} of a {len(source)}-record source is empty")
        if shuffle:
            dataset = dataset.seed(seed).shuffle()
        self._dataset = dataset.repeat(num_epochs)
        self._config = {
            "seed": seed,
            "shuffle": shuffle,
            "num_epochs": num_epochs,
            "shard_index": shard_index,
            "shard_count": shard_count,
            "source_len": len(source),
            "source_fingerprint": source_fingerprint(source),
        }
        self._next_index = 0

    def __next__(self) -> dict:
        if self._next_index >= len(self._dataset):
            raise StopIteration
        record = self._dataset[self._next_index]
        self._next_index += 1
        return record

    @property
    def epoch(self) -> int:
        """The epoch the next record belongs to (0-based)."""
        return self._next_index // self.epoch_size

    def get_state(self) -> dict:
        """Position and the arguments it is valid for, as plain JSON types."""
        return {"next_index": self._next_index, **self._config}

    def set_state(self, state: dict) -> None:
        """Resume from `get_state()` output; ValueError if it was saved with other arguments."""
        for key, value in self._config.items():
            if key == "source_fingerprint" and key not in state:
                continue  # saved before states carried it
            if state.get(key) != value:
                raise ValueError(f"iterator state has {key}={state.get(key)!r}, this iterator has {value!r}")
        next_index = state.get("next_index")
        if not isinstance(next_index, int) or next_index < 0:
            raise ValueError(f"iterator state has invalid next_index={next_index!r}")
        self._next_index = next_index


def source_fingerprint(source: Sequence[dict]) -> int:
    """CRC32 of up to `FINGERPRINT_RECORDS` evenly spaced records (as sorted-key JSON)."""
    step = max(1, len(source) // FINGERPRINT_RECORDS)
    crc = 0
    for index in range(0, len(source), step)[:FINGERPRINT_RECORDS]:
        record = json.dumps(source[index], sort_keys=True, default=str)
        crc = zlib.crc32(record.encode(), crc)
    return crc
