"""TFDS builder `mars_problems`: the problem sets of shared/data as array_record files, one config
per set, read back with `tfds.data_source` in file order.

The metadata records each split's source sha256 and the malformed rows skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from mars_jax.data.jsonl import OPTIONAL_FIELDS, REQUIRED_FIELDS, read_problems

NAME = "mars_problems"
_FEATURE_OF_TYPE = {str: tfds.features.Text(), int: tfds.features.Scalar(dtype=np.int32)}


@dataclasses.dataclass(eq=False)
class ProblemsConfig(tfds.core.BuilderConfig):
    """One problem set: the JSONL file of each split and its extra typed fields."""

    files: tuple[tuple[str, str], ...] = ()  # (split, file name in the manual dir)
    extra_fields: tuple[tuple[str, type], ...] = ()

    @property
    def split_files(self) -> Mapping[str, str]:
        return dict(self.files)


CONFIGS = (
    ProblemsConfig(
        name="aime2025", description="AIME 2025 I and II, integer answers.", files=(("test", "aime2025.jsonl"),)
    ),
    ProblemsConfig(
        name="beyond_aime", description="BeyondAIME, integer answers.", files=(("test", "beyond_aime.jsonl"),)
    ),
    ProblemsConfig(
        name="dsr_sub",
        description="DSR-sub RLVR training set, LaTeX answers.",
        files=(("train", "train_dsr_sub.jsonl"),),
    ),
    ProblemsConfig(
        name="gsm8k",
        description="GSM8K, final numeric answers.",
        files=(("train", "gsm8k_train.jsonl"), ("test", "gsm8k_test.jsonl")),
    ),
    ProblemsConfig(
        name="math500",
        description="MATH-500 (PRM800K test split of MATH).",
        files=(("test", "math500.jsonl"),),
        extra_fields=(("subject", str), ("level", int)),
    ),
)


def sha256_of(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class MarsProblems(tfds.core.GeneratorBasedBuilder):
    """Math problems with reference answers, from the JSONL files of shared/data."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First release."}
    BUILDER_CONFIGS = list(CONFIGS)
    MANUAL_DOWNLOAD_INSTRUCTIONS = "The manual dir must hold the JSONL files of shared/data; see its SOURCES.md."

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        """This file. (TFDS's own lookup imports `importlib_resources`, which it does not declare.)"""
        return epath.Path(__file__)

    def __init__(self, *, skip_malformed: bool = False, **kwargs) -> None:
        """`skip_malformed`: when building, skip (and count) bad rows instead of failing."""
        self._skip_malformed = skip_malformed
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        config = self.builder_config
        fields = {name: str for name in REQUIRED_FIELDS} | dict(OPTIONAL_FIELDS) | dict(config.extra_fields)
        return tfds.core.DatasetInfo(
            builder=self,
            description=config.description,
            features=tfds.features.FeaturesDict({name: _FEATURE_OF_TYPE[kind] for name, kind in fields.items()}),
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        manual_dir = dl_manager.manual_dir
        generators = {}
        for split, file_name in self.builder_config.split_files.items():
            path = manual_dir / file_name
            result = read_problems(
                path, extra_fields=dict(self.builder_config.extra_fields), skip_malformed=self._skip_malformed
            )
            self.info.metadata[split] = {
                "file": file_name,
                "sha256": sha256_of(path),
                "rows": len(result.rows),
                "skipped": len(result.skipped),
            }
            generators[split] = self._generate_examples(result.rows)
        return generators

    def _generate_examples(self, rows: list[dict]):
        yield from enumerate(rows)
