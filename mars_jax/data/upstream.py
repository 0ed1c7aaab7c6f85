r"""Each problem set's public source on the HF Hub, and the converter from its rows to the rows the
loaders read (`jsonl.read_problems`: `id`, `problem`, `answer`, `source`, and `answer_as_in_source`
where the answer was changed).

| dataset | HF Hub dataset @ revision : file | upstream fields | licence |
| --- | --- | --- | --- |
| aime2025 | zai-org/glm-simple-evals-dataset @ main : aime/aime_2025.jsonl | question, answer | none stated; problems (c) MAA |
| beyond_aime | zai-org/glm-simple-evals-dataset @ main : aime/beyond_aime.jsonl | question, answer | none stated; from ByteDance-Seed/BeyondAIME |
| dsr_sub | agentica-org/DeepScaleR-Preview-Dataset @ main : deepscaler.json | problem, answer, solution | MIT |
| gsm8k | openai/gsm8k @ e53f0488 : main/{train,test}-00000-of-00001.parquet | question, answer | MIT |
| math500 | HuggingFaceH4/MATH-500 @ ff5b2025 : test.jsonl | problem, solution, answer, subject, level, unique_id | none stated; MATH and PRM800K are MIT |

Conversions (shared/data/SOURCES.md): ids by position (AIME 2025: rows 1-15 AIME I, 16-30 AIME II),
text stripped, AIME answers reduced to their integer (`336^\circ` -> `336`), GSM8K's answer taken
after `####` without thousands separators, MATH-500's id `math500-<unique_id>` with its `subject`
and `level`. DSR-sub, a 1209-problem subset of DeepScaleR whose seed is not published, is named by
`dsr_sub_ids.txt` (`problem_fingerprint` of each problem, in order); each id takes the first
DeepScaleR row with that text. Every row's `source` is `hf://datasets/<repo>@<commit>/<file>`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence

Rows = list[dict]
# (upstream rows of each of the dataset's files, by our file name; source label by our file name)
Converter = Callable[[Mapping[str, Rows], Mapping[str, str]], dict[str, Rows]]

DSR_SUB_IDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dsr_sub_ids.txt")


@dataclasses.dataclass(frozen=True)
class Upstream:
    """One problem set's HF Hub dataset: each of our files' upstream file, and its converter."""

    repo: str
    revision: str
    files: Mapping[str, str]  # our file name -> path in the Hub repository
    license: str
    convert: Converter


def read_rows(path: str) -> Rows:
    """Rows of a `.parquet` or JSON(L) file; ValueError names the file and line of a non-object."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            whole = json.loads(text)
        except ValueError:
            whole = None  # not one JSON value: read as JSON lines
        if whole is not None:
            if not isinstance(whole, list) or not all(isinstance(r, dict) for r in whole):
                raise ValueError(f"{path}: expected a JSON list of objects")
            return whole
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{number}: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            rows.append(row)
    return rows


def _field(row: dict, names: Sequence[str], where: str) -> str:
    for name in names:
        if isinstance(row.get(name), str):
            return row[name]
    raise ValueError(f"{where}: no string field {' or '.join(repr(n) for n in names)}")


def _problem_row(row_id: str, problem: str, answer: str, source: str, original: str) -> dict:
    row = {"id": row_id, "problem": problem.strip(), "answer": answer, "source": source}
    if original != answer:
        row["answer_as_in_source"] = original
    return row


_DEGREES = re.compile(r"\^\s*\{?\\circ\}?$")


def integer_answer(answer: str, where: str) -> str:
    """An AIME-style answer as its integer: stripped, a trailing `^\\circ` dropped; ValueError
    naming `where` when what is left is not an integer."""
    value = _DEGREES.sub("", answer.strip()).strip()
    if not re.fullmatch(r"-?\d+", value):
        raise ValueError(f"{where}: answer {answer!r} is not an integer")
    return value


def gsm8k_final_answer(solution: str, where: str) -> str:
    """The text after GSM8K's `####` marker, stripped; ValueError naming `where` without one."""
    if "####" not in solution:
        raise ValueError(f"{where}: answer has no '####' final-answer marker")
    return solution.rsplit("####", 1)[1].strip()


def _integer_answer_rows(rows: Rows, source: str, ids: Sequence[str]) -> Rows:
    out = []
    for row_id, row in zip(ids, rows, strict=True):
        where = f"{source} row {row_id}"
        original = _field(row, ("answer", "Answer"), where).strip()
        problem = _field(row, ("question", "Question"), where)
        out.append(_problem_row(row_id, problem, integer_answer(original, where), source, original))
    return out


def convert_aime2025(rows: Mapping[str, Rows], sources: Mapping[str, str]) -> dict[str, Rows]:
    (file_name, upstream), = rows.items()
    if len(upstream) != 30:
        raise ValueError(f"{sources[file_name]}: {len(upstream)} rows, expected 30 (AIME 2025 I and II)")
    ids = [f"aime2025-{part}-{n:02d}" for part in ("I", "II") for n in range(1, 16)]
    return {file_name: _integer_answer_rows(upstream, sources[file_name], ids)}


def convert_beyond_aime(rows: Mapping[str, Rows], sources: Mapping[str, str]) -> dict[str, Rows]:
    (file_name, upstream), = rows.items()
    ids = [f"beyond_aime-{n:03d}" for n in range(len(upstream))]
    return {file_name: _integer_answer_rows(upstream, sources[file_name], ids)}


def convert_gsm8k(rows: Mapping[str, Rows], sources: Mapping[str, str]) -> dict[str, Rows]:
    out = {}
    for file_name, upstream in rows.items():
        split = file_name.removeprefix("gsm8k_").removesuffix(".jsonl")
        converted = []
        for n, row in enumerate(upstream):
            row_id, where = f"gsm8k-{split}-{n:04d}", f"{sources[file_name]} row {n}"
            original = gsm8k_final_answer(_field(row, ("answer",), where), where)
            converted.append(_problem_row(row_id, _field(row, ("question",), where),
                                          original.replace(",", ""), sources[file_name], original))
        out[file_name] = converted
    return out


def convert_math500(rows: Mapping[str, Rows], sources: Mapping[str, str]) -> dict[str, Rows]:
    (file_name, upstream), = rows.items()
    converted = []
    for n, row in enumerate(upstream):
        where = f"{sources[file_name]} row {n}"
        level = row.get("level")
        if type(level) is not int:
            raise ValueError(f"{where}: field 'level' must be an integer, got {level!r}")
        answer = _field(row, ("answer",), where)
        converted.append(_problem_row(f"math500-{_field(row, ('unique_id',), where)}",
                                      _field(row, ("problem",), where), answer, sources[file_name], answer)
                         | {"subject": _field(row, ("subject",), where), "level": level})
    return {file_name: converted}


def problem_fingerprint(problem: str) -> str:
    """First 16 hex digits of the sha256 of `problem` with its whitespace runs made one space."""
    return hashlib.sha256(" ".join(problem.split()).encode("utf-8")).hexdigest()[:16]


def read_ids(path: str = DSR_SUB_IDS) -> list[str]:
    with open(path, encoding="ascii") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def convert_dsr_sub(rows: Mapping[str, Rows], sources: Mapping[str, str],
                    ids: Sequence[str] | None = None) -> dict[str, Rows]:
    """The rows of DeepScaleR named by `ids` (default: `dsr_sub_ids.txt`), in that order."""
    (file_name, upstream), = rows.items()
    ids = read_ids() if ids is None else ids
    first: dict[str, dict] = {}
    for n, row in enumerate(upstream):
        first.setdefault(problem_fingerprint(_field(row, ("problem",), f"{sources[file_name]} row {n}")), row)
    missing = [fingerprint for fingerprint in ids if fingerprint not in first]
    if missing:
        raise ValueError(f"{sources[file_name]}: {len(missing)} of the {len(ids)} DSR-sub problems "
                         f"are not in it (first: {missing[0]} in {DSR_SUB_IDS})")
    converted = []
    for n, fingerprint in enumerate(ids):
        row = first[fingerprint]
        answer = _field(row, ("answer",), f"{sources[file_name]} problem {fingerprint}").strip()
        converted.append(_problem_row(f"dsr_sub-{n:04d}", row["problem"], answer, sources[file_name], answer))
    return {file_name: converted}


_GLM = "zai-org/glm-simple-evals-dataset"
UPSTREAMS: Mapping[str, Upstream] = {
    "aime2025": Upstream(
        _GLM, "main", {"aime2025.jsonl": "aime/aime_2025.jsonl"},
        "none stated on the dataset card; the problems are (c) MAA, widely redistributed for "
        "evaluation: treat as eval-only", convert_aime2025),
    "beyond_aime": Upstream(
        _GLM, "main", {"beyond_aime.jsonl": "aime/beyond_aime.jsonl"},
        "none stated on the dataset card; the problems are ByteDance-Seed/BeyondAIME's: treat as "
        "eval-only", convert_beyond_aime),
    "dsr_sub": Upstream(
        "agentica-org/DeepScaleR-Preview-Dataset", "main", {"train_dsr_sub.jsonl": "deepscaler.json"},
        "MIT (DeepScaleR-Preview-Dataset's card)", convert_dsr_sub),
    "gsm8k": Upstream(
        "openai/gsm8k", "e53f048856ff4f594e959d75785d2c2d37b678ee",
        {"gsm8k_train.jsonl": "main/train-00000-of-00001.parquet",
         "gsm8k_test.jsonl": "main/test-00000-of-00001.parquet"},
        "MIT", convert_gsm8k),
    "math500": Upstream(
        "HuggingFaceH4/MATH-500", "ff5b20257d8185524591543f8ff5993951537bb8", {"math500.jsonl": "test.jsonl"},
        "none stated on the dataset card; MATH (Hendrycks et al.) and the PRM800K split are MIT",
        convert_math500),
}
