r"""Write every problem set the loaders know, plus the grader's test cases, into a data dir.

  python -m mars_jax.data.fetch [--out=DIR]          # from the HF Hub (DATA_REPO)
  python -m mars_jax.data.fetch --source=MIRROR --out=DIR   # from a local copy of the files

`--out` defaults to the directory the loaders read by default (`$MARS_JAX_DATA_DIR`, else
`<repo root>/../shared/data`); with another `--out`, point `$MARS_JAX_DATA_DIR` (or
`data.manual_dir`) at it. The files are the JSONL files of `builder.CONFIGS` (the layout
`datasets.load` reads) and `grader_cases.jsonl`, byte for byte: each is checked against the
sha256 recorded in `FILES` before it is written, and `<dataset>.manifest.json` records, per
dataset, its files' sha256, sizes and row counts, its licence, its upstream source and where
the files were fetched from. A file whose sha256 differs stops the fetch (exit 1), naming it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence

from mars_jax.data import builder
from mars_jax.data.paths import MANUAL_DIR_ENV, SHARED_DATA

# The HF Hub dataset repository that publishes the files below as they are in the project's own
# data dir (shared/data; published with `hf upload --repo-type=dataset DATA_REPO <that dir>`).
# `--repo` / `--revision` read another copy of it, `--source` a local directory.
DATA_REPO = "mars-jax/mars-jax-data"
DATA_REVISION = "main"

# sha256 of every file the tests and loaders were checked against.
FILES: Mapping[str, str] = {
    "aime2025.jsonl": "76c53bca1440ce4fac295bdded1c107cfb4801e413040717f8dbccba016a2d56",
    "beyond_aime.jsonl": "8d8a2910ca779a98b331b52366ef4bd1cd9e5ac1f2d603659f974dde5172232c",
    "train_dsr_sub.jsonl": "80fe62bbc339ff1c061a2a46ff2d40baa739d9307969bf05beeada7b6a629b7b",
    "gsm8k_train.jsonl": "fa308b93b1a1e519ff1bd972c09485d965de4420e2fc49a0023432f888c7e2e1",
    "gsm8k_test.jsonl": "5a82dfd407e230cb737313804b0fd44992444430e7b216fba44f9c31e5453deb",
    "math500.jsonl": "ce96512460437273a0de58e5ff8a65906534e4d61e1fb1dc4c4cb730ab9028b6",
    "grader_cases.jsonl": "9c81fc26424fab49d87cec56482f5ecea4f471b06751d9410d9c7ddc10d74549",
}

# Per dataset: licence and upstream (owner/repo@commit:path the rows were taken from; the edits
# made are listed in shared/data/SOURCES.md).
PROVENANCE: Mapping[str, Mapping[str, str]] = {
    "aime2025": {
        "license": "eval-only: problems (c) MAA, widely redistributed for evaluation; the upstream "
                   "repository has no LICENSE file",
        "upstream": "zai-org/glm-simple-evals@2974f4ef150808745edd4a7aef3dc589f54b53f7:"
                    "data/aime/aime_2025.jsonl",
    },
    "beyond_aime": {
        "license": "eval-only: from the HF dataset ByteDance-Seed/BeyondAIME (licence not "
                   "checked); the upstream repository has no LICENSE file",
        "upstream": "zai-org/glm-simple-evals@2974f4ef150808745edd4a7aef3dc589f54b53f7:"
                    "data/aime/beyond_aime.jsonl",
    },
    "dsr_sub": {
        "license": "Apache-2.0 (ypwang61/One-Shot-RLVR); a subset of "
                   "agentica-org/DeepScaleR-Preview-Dataset (licence not checked)",
        "upstream": "ypwang61/One-Shot-RLVR@fa0677487c8aec63f7a87a9568de4bf2c47205b4:"
                    "data/train/one_shot_rlvr/dsr_sub.parquet",
    },
    "gsm8k": {
        "license": "MIT",
        "upstream": "openai/grade-school-math@3101c7d5072418e28b9008a6636bde82a006892c:"
                    "grade_school_math/data/{train,test}.jsonl",
    },
    "math500": {
        "license": "MIT (MATH by Hendrycks et al.; the PRM800K test split); repository Apache-2.0",
        "upstream": "ypwang61/One-Shot-RLVR@fa0677487c8aec63f7a87a9568de4bf2c47205b4:"
                    "Qwen2.5-Eval/evaluation/data/math500/test.jsonl",
    },
    "grader_cases": {
        "license": "test cases of seven grader test suites (Apache-2.0 / MIT), taken as data; "
                   "per-source licences in shared/data/grader_cases_SOURCES.md",
        "upstream": "huggingface/Math-Verify@5d148cfaaf99214c2e4ffb4bc497ab042c592a7a:tests/ "
                    "and six others (grader_cases_SOURCES.md)",
    },
}


def dataset_files() -> dict[str, tuple[str, ...]]:
    """Dataset name -> its files: every TFDS problem set's JSONL files, then grader_cases."""
    files = {config.name: tuple(config.split_files.values()) for config in builder.CONFIGS}
    return files | {"grader_cases": ("grader_cases.jsonl",)}


def download_from_hub(file_name: str, dest_dir: str, repo: str = DATA_REPO,
                      revision: str = DATA_REVISION) -> str:
    """Downloads one file of the HF Hub dataset `repo` into `dest_dir`; returns its path."""
    from huggingface_hub import hf_hub_download
    return hf_hub_download(repo, file_name, repo_type="dataset", revision=revision,
                           local_dir=dest_dir)


def copy_from_mirror(mirror: str) -> Callable[[str, str], str]:
    """A fetcher that copies files from the local directory `mirror`."""
    def fetch(file_name: str, dest_dir: str) -> str:
        path = os.path.join(mirror, file_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--source: {path} does not exist")
        return shutil.copy(path, os.path.join(dest_dir, file_name))
    return fetch


def _rows(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def fetch_all(out: str, fetch: Callable[[str, str], str], origin: str,
              names: Sequence[str] | None = None) -> list[str]:
    """Fetches the files of `names` (default: every dataset) into `out`, checks each against
    `FILES`, and writes `<name>.manifest.json` per dataset; returns the manifests' paths.

    Raises ValueError naming the file when a checksum differs (that file is not written)."""
    every = dataset_files()
    unknown = sorted(set(names or ()) - set(every))
    if unknown:
        raise ValueError(f"unknown dataset(s) {unknown}; valid: {sorted(every)}")
    os.makedirs(out, exist_ok=True)
    manifests = []
    for name in names or every:
        entries = []
        for file_name in every[name]:
            with tempfile.TemporaryDirectory(dir=out) as staging:
                fetched = fetch(file_name, staging)
                digest = builder.sha256_of(fetched)
                if digest != FILES[file_name]:
                    raise ValueError(f"{file_name} from {origin}: sha256 {digest}, expected "
                                     f"{FILES[file_name]}; not written")
                entries.append({"file": file_name, "sha256": digest, "bytes": os.path.getsize(fetched),
                                "rows": _rows(fetched)})
                os.replace(fetched, os.path.join(out, file_name))
        manifest = dict(dataset=name, files=entries, **PROVENANCE[name], fetched_from=origin,
                        fetched_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        path = os.path.join(out, f"{name}.manifest.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        manifests.append(path)
    return manifests


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mars_jax.data.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get(MANUAL_DIR_ENV) or SHARED_DATA,
                        help=f"data dir to write (default: ${MANUAL_DIR_ENV}, else {SHARED_DATA})")
    parser.add_argument("--source", help="read the files from this local directory instead of the Hub")
    parser.add_argument("--repo", default=DATA_REPO, help="HF Hub dataset repository")
    parser.add_argument("--revision", default=DATA_REVISION, help="its branch, tag or commit")
    parser.add_argument("--datasets", default="", help=f"comma-separated subset of {sorted(dataset_files())}")
    args = parser.parse_args(argv)
    if args.source:
        fetch, origin = copy_from_mirror(args.source), os.path.abspath(args.source)
    else:
        def fetch(file_name: str, dest_dir: str) -> str:
            return download_from_hub(file_name, dest_dir, args.repo, args.revision)
        origin = f"hf://datasets/{args.repo}@{args.revision}"
    try:
        manifests = fetch_all(args.out, fetch, origin, [n for n in args.datasets.split(",") if n] or None)
    except (OSError, ValueError) as e:
        print(f"fetch: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(manifests)} datasets to {os.path.abspath(args.out)} (manifests: *.manifest.json)")
    if os.path.abspath(args.out) not in (os.path.abspath(SHARED_DATA),
                                         os.path.abspath(os.environ.get(MANUAL_DIR_ENV, SHARED_DATA))):
        print(f"the loaders read it with: export {MANUAL_DIR_ENV}={os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
