"""`load(name, split)`: problem sets as random-access sequences of dicts with at least `id`,
`problem` and `answer` (str).

File-backed sets are built once into a TFDS data dir from the JSONL files of a manual dir
(`manual_dir`, else `$MARS_JAX_DATA_DIR`, else `<repo root>/../shared/data`); `arith` is generated
in memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds

from mars_jax.data import arith, builder
from mars_jax.data.paths import default_manual_dir

SPLITS: Mapping[str, tuple[str, ...]] = {
    **{config.name: tuple(config.split_files) for config in builder.CONFIGS},
    "arith": tuple(arith.SPLITS),
}


class ProblemSource(Sequence[dict]):
    """Random access to one split of a TFDS-built problem set; `skipped` counts malformed rows."""

    def __init__(self, data_source: Sequence[dict], name: str, split: str, skipped: int) -> None:
        self._source = data_source
        self.name, self.split, self.skipped = name, split, skipped
        self._len = len(data_source)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        position = index + self._len if index < 0 else index
        if not 0 <= position < self._len:
            raise IndexError(f"{self.name}/{self.split}: index {index} out of range for {self._len} records")
        return {key: _decode(value) for key, value in self._source[position].items()}

    def __repr__(self) -> str:
        return f"ProblemSource({self.name!r}, {self.split!r}, {self._len} records)"


def _decode(value: object) -> object:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    return value


def _check_name_split(name: str, split: str) -> None:
    if name not in SPLITS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(SPLITS)}")
    if split not in SPLITS[name]:
        raise ValueError(f"unknown split {split!r} of {name!r}; valid splits: {', '.join(SPLITS[name])}")


def _check_sources(tfds_builder: builder.MarsProblems, manual_dir: str | None) -> None:
    """Raise if a prepared dataset was built from other files than those in the manual dir."""
    if manual_dir is None:
        return
    for split, info in tfds_builder.info.metadata.items():
        path = os.path.join(manual_dir, info["file"])
        if os.path.isfile(path) and builder.sha256_of(path) != info["sha256"]:
            raise ValueError(
                f"{tfds_builder.data_dir} ({split}) was built from another version of {path}; "
                "delete that directory to rebuild, or pass another data_dir"
            )


def load(
    name: str,
    split: str,
    *,
    manual_dir: str | os.PathLike | None = None,
    data_dir: str | os.PathLike | None = None,
    skip_malformed: bool = False,
    arith_knobs: dict | None = None,
) -> Sequence[dict]:
    """Records of problem set `name`, split `split` (`SPLITS`), built into TFDS on first use.
    With `skip_malformed`, malformed rows are skipped and counted (`ProblemSource.skipped`);
    without, they raise. `arith` takes its difficulty from `arith_knobs` (`arith.load_split`)."""
    _check_name_split(name, split)
    if name == "arith":
        return arith.load_split(split, **(arith_knobs or {}))
    tfds_name = f"{builder.NAME}/{name}"
    tfds_builder = builder.MarsProblems(config=name, data_dir=data_dir, skip_malformed=skip_malformed)
    if manual_dir is None:
        try:
            manual_dir = default_manual_dir()
        except FileNotFoundError:
            if not tfds_builder.is_prepared():
                raise
    manual_dir = None if manual_dir is None else os.fspath(manual_dir)
    if tfds_builder.is_prepared():
        _check_sources(tfds_builder, manual_dir)
    else:
        for file_name in tfds_builder.builder_config.split_files.values():
            path = os.path.join(manual_dir, file_name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{name}: source file not found: {path}")
        tfds_builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    skipped = tfds_builder.info.metadata[split]["skipped"]
    if skipped and not skip_malformed:
        raise ValueError(f"{tfds_builder.data_dir} ({split}) was built with skip_malformed: "
                         f"{skipped} malformed row(s) left out; pass skip_malformed=True to "
                         "accept that, or fix the file and delete that directory to rebuild")
    data_source = tfds.data_source(tfds_name, split=split, data_dir=data_dir, download=False)
    return ProblemSource(data_source, name, split, skipped=skipped)
