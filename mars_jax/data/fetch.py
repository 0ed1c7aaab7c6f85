r"""Write every problem set the loaders know into a data dir, from its public source on the HF Hub
or from a local mirror.

  python -m mars_jax.data.fetch [--out=DIR] [--datasets=a,b]   # each problem set from the HF Hub
  python -m mars_jax.data.fetch --source=MIRROR [--out=DIR]    # a local copy of the files

From the Hub, files are downloaded at the commit `upstream.UPSTREAMS` names, converted, and recorded
with their sha256 in `<dataset>.manifest.json`; from a mirror, copied and checked against `FILES`. A
failing dataset leaves neither its files nor its manifest in `--out`.
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

from mars_jax.data import builder, upstream
from mars_jax.data.jsonl import read_problems
from mars_jax.data.paths import MANUAL_DIR_ENV, SHARED_DATA

# sha256 of every file of the project's data dir (shared/data), which `--source` copies.
FILES: Mapping[str, str] = {
    "aime2025.jsonl": "76c53bca1440ce4fac295bdded1c107cfb4801e413040717f8dbccba016a2d56",
    "beyond_aime.jsonl": "8d8a2910ca779a98b331b52366ef4bd1cd9e5ac1f2d603659f974dde5172232c",
    "train_dsr_sub.jsonl": "80fe62bbc339ff1c061a2a46ff2d40baa739d9307969bf05beeada7b6a629b7b",
    "gsm8k_train.jsonl": "fa308b93b1a1e519ff1bd972c09485d965de4420e2fc49a0023432f888c7e2e1",
    "gsm8k_test.jsonl": "5a82dfd407e230cb737313804b0fd44992444430e7b216fba44f9c31e5453deb",
    "math500.jsonl": "ce96512460437273a0de58e5ff8a65906534e4d61e1fb1dc4c4cb730ab9028b6",
    "grader_cases.jsonl": "9c81fc26424fab49d87cec56482f5ecea4f471b06751d9410d9c7ddc10d74549",
}

# Per dataset of the project's data dir: licence and upstream (owner/repo@commit:path the rows
# were taken from; the edits made are listed in shared/data/SOURCES.md).
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


GRADER_CASES = "grader_cases"


def dataset_files() -> dict[str, tuple[str, ...]]:
    """Dataset name -> its files: every TFDS problem set's JSONL files, then grader_cases."""
    files = {config.name: tuple(config.split_files.values()) for config in builder.CONFIGS}
    return files | {GRADER_CASES: ("grader_cases.jsonl",)}


def _check_names(names: Sequence[str] | None, valid: Sequence[str]) -> list[str]:
    unknown = sorted(set(names or ()) - set(valid))
    if unknown:
        raise ValueError(f"unknown dataset(s) {unknown}; valid: {sorted(valid)}")
    return list(names or valid)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_manifest(out: str, name: str, manifest: dict) -> str:
    path = os.path.join(out, f"{name}.manifest.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return path


def _file_entry(path: str, name: str, key: str = "file") -> dict:
    return {key: name, "sha256": builder.sha256_of(path), "bytes": os.path.getsize(path)}


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
    """Fetches `names` (default: all) into `out`, each file checked against `FILES`, with a
    manifest per dataset; returns the manifests' paths."""
    every = dataset_files()
    os.makedirs(out, exist_ok=True)
    manifests = []
    for name in _check_names(names, list(every)):
        entries = []
        for file_name in every[name]:
            with tempfile.TemporaryDirectory(dir=out) as staging:
                fetched = fetch(file_name, staging)
                entry = _file_entry(fetched, file_name) | {"rows": _rows(fetched)}
                if entry["sha256"] != FILES[file_name]:
                    raise ValueError(f"{file_name} from {origin}: sha256 {entry['sha256']}, expected "
                                     f"{FILES[file_name]}; not written")
                entries.append(entry)
                os.replace(fetched, os.path.join(out, file_name))
        manifests.append(_write_manifest(out, name, dict(
            dataset=name, files=entries, **PROVENANCE[name], fetched_from=origin, fetched_at=_now())))
    return manifests


class HubReader:
    """Reads HF Hub dataset repositories through huggingface_hub."""

    def resolve(self, repo: str, revision: str) -> str:
        """The commit `revision` (branch, tag or commit) of dataset `repo` names."""
        from huggingface_hub import HfApi
        try:
            return HfApi().dataset_info(repo, revision=revision).sha
        except Exception as e:  # huggingface_hub's own errors and its HTTP client's
            raise OSError(f"HF Hub dataset {repo}@{revision}: {type(e).__name__}: {e}") from e

    def download(self, repo: str, path: str, commit: str, dest_dir: str) -> str:
        """Downloads file `path` of dataset `repo` at `commit` under `dest_dir`; returns its path."""
        from huggingface_hub import hf_hub_download
        try:
            return hf_hub_download(repo, path, repo_type="dataset", revision=commit, local_dir=dest_dir)
        except Exception as e:  # huggingface_hub's own errors and its HTTP client's
            raise OSError(f"HF Hub dataset {repo}@{commit}, file {path}: {type(e).__name__}: {e}") from e


def _write_jsonl(path: str, rows: Sequence[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def convert_from_hub(out: str, hub: HubReader, names: Sequence[str] | None = None) -> list[str]:
    """Converts `names` (default: all) from the HF Hub into `out` with a manifest each; returns
    their paths. ValueError names a row that cannot be converted or loaded; that dataset is not
    written."""
    if GRADER_CASES in (names or ()):
        raise ValueError(f"{GRADER_CASES} has no Hub source (it is compiled from grader test "
                         "suites): copy it from a mirror with --source")
    configs = {config.name: config for config in builder.CONFIGS}
    os.makedirs(out, exist_ok=True)
    manifests = []
    for name in _check_names(names, list(upstream.UPSTREAMS)):
        source = upstream.UPSTREAMS[name]
        commit = hub.resolve(source.repo, source.revision)
        with tempfile.TemporaryDirectory(dir=out) as staging:
            rows, labels, upstream_entries = {}, {}, []
            for file_name, hub_path in source.files.items():
                fetched = hub.download(source.repo, hub_path, commit, os.path.join(staging, "upstream"))
                upstream_entries.append(_file_entry(fetched, hub_path, key="path"))
                labels[file_name] = f"hf://datasets/{source.repo}@{commit}/{hub_path}"
                rows[file_name] = upstream.read_rows(fetched)
            converted = source.convert(rows, labels)
            entries = []
            for file_name, problem_rows in converted.items():
                written = os.path.join(staging, file_name)
                _write_jsonl(written, problem_rows)
                read_problems(written, extra_fields=dict(configs[name].extra_fields))
                entries.append(_file_entry(written, file_name) | {"rows": len(problem_rows)})
            for file_name in converted:
                os.replace(os.path.join(staging, file_name), os.path.join(out, file_name))
        manifests.append(_write_manifest(out, name, dict(
            dataset=name, files=entries, license=source.license,
            upstream=dict(repo=source.repo, revision=source.revision, commit=commit, files=upstream_entries),
            fetched_from=f"hf://datasets/{source.repo}@{commit}", fetched_at=_now())))
    return manifests


def main(argv: Sequence[str] | None = None, hub: HubReader | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mars_jax.data.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get(MANUAL_DIR_ENV) or SHARED_DATA,
                        help=f"data dir to write (default: ${MANUAL_DIR_ENV}, else {SHARED_DATA})")
    parser.add_argument("--source", help="copy the files from this local directory instead of converting "
                                         "them from the HF Hub")
    parser.add_argument("--datasets", default="", help=f"comma-separated subset of {sorted(dataset_files())}")
    args = parser.parse_args(argv)
    names = [n for n in args.datasets.split(",") if n] or None
    try:
        if args.source:
            manifests = fetch_all(args.out, copy_from_mirror(args.source), os.path.abspath(args.source), names)
        else:
            manifests = convert_from_hub(args.out, hub or HubReader(), names)
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
