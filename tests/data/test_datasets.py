"""The TFDS-built problem sets: row counts, records equal to the JSONL files, errors."""

import json
import os
import shutil

import pytest

from mars_jax.data import datasets
from mars_jax.data.jsonl import MalformedRowError
from mars_jax.data.paths import default_manual_dir

EXPECTED_ROWS = {
    ("aime2025", "test"): 30,
    ("beyond_aime", "test"): 100,
    ("dsr_sub", "train"): 1209,
    ("gsm8k", "train"): 7473,
    ("gsm8k", "test"): 1319,
    ("math500", "test"): 500,
}
FILES = {
    ("aime2025", "test"): "aime2025.jsonl",
    ("beyond_aime", "test"): "beyond_aime.jsonl",
    ("dsr_sub", "train"): "train_dsr_sub.jsonl",
    ("gsm8k", "train"): "gsm8k_train.jsonl",
    ("gsm8k", "test"): "gsm8k_test.jsonl",
    ("math500", "test"): "math500.jsonl",
}


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory, problem_data_dir):
    """One TFDS data dir for the session, with every problem set built once."""
    data_dir = tmp_path_factory.mktemp("tfds")
    for name, split in EXPECTED_ROWS:
        datasets.load(name, split, data_dir=data_dir)
    return data_dir


def _jsonl(directory, file_name):
    with open(os.path.join(directory, file_name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name, split", list(EXPECTED_ROWS))
def test_rows_equal_the_source_file(tfds_dir, problem_data_dir, name, split):
    records = datasets.load(name, split, data_dir=tfds_dir)
    assert len(records) == EXPECTED_ROWS[(name, split)]
    source = _jsonl(problem_data_dir, FILES[(name, split)])
    assert len(source) == len(records)
    for record, row in zip(records, source):  # same order as the file
        assert (record["id"], record["problem"], record["answer"]) == (row["id"], row["problem"], row["answer"])
        assert all(isinstance(record[key], str) for key in ("id", "problem", "answer"))


@pytest.mark.parametrize(
    "name, split, index, expected",
    [
        ("aime2025", "test", 0, {"id": "aime2025-I-01", "answer": "70"}),
        ("aime2025", "test", 19, {"id": "aime2025-II-05", "answer": "336", "answer_as_in_source": "336^\\circ"}),
        ("beyond_aime", "test", 0, {"id": "beyond_aime-000", "answer": "3"}),
        ("dsr_sub", "train", 0, {"id": "dsr_sub-0000", "answer": "\\frac{3}{7}"}),
        ("gsm8k", "train", 0, {"id": "gsm8k-train-0000", "answer": "72"}),
        ("gsm8k", "test", 0, {"id": "gsm8k-test-0000", "answer": "18"}),
        (
            "math500",
            "test",
            0,
            {
                "id": "math500-test/precalculus/807.json",
                "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                "subject": "Precalculus",
                "level": 2,
            },
        ),
    ],
)
def test_spot_checked_record(tfds_dir, name, split, index, expected):
    record = datasets.load(name, split, data_dir=tfds_dir)[index]
    assert {key: record[key] for key in expected} == expected


def test_problem_text_spot_check(tfds_dir):
    record = datasets.load("gsm8k", "train", data_dir=tfds_dir)[0]
    assert record["problem"].startswith("Natalia sold clips to 48 of her friends in April")
    assert datasets.load("gsm8k", "train", data_dir=tfds_dir)[-1]["id"] == "gsm8k-train-7472"


def test_index_errors(tfds_dir):
    records = datasets.load("aime2025", "test", data_dir=tfds_dir)
    assert records[-1]["id"] == "aime2025-II-15"
    assert [r["id"] for r in records[:2]] == ["aime2025-I-01", "aime2025-I-02"]
    with pytest.raises(IndexError, match="aime2025/test: index 30 out of range"):
        records[30]


def test_unknown_name_or_split():
    with pytest.raises(ValueError, match="unknown dataset 'nope'.*aime2025.*arith"):
        datasets.load("nope", "test")
    with pytest.raises(ValueError, match="unknown split 'train' of 'math500'; valid splits: test"):
        datasets.load("math500", "train")


def test_missing_manual_file(tmp_path):
    empty = tmp_path / "manual"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"{empty}/aime2025.jsonl"):
        datasets.load("aime2025", "test", manual_dir=empty, data_dir=tmp_path / "tfds")


def _write_aime(directory, lines):
    directory.mkdir(exist_ok=True)
    (directory / "aime2025.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


GOOD = [json.dumps({"id": f"p{i}", "problem": f"What is {i}+1?", "answer": str(i + 1)}) for i in range(3)]


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ("{not json", "Expecting property name"),
        ('["a list"]', "expected a JSON object"),
        (json.dumps({"id": "q", "problem": "P"}), "field 'answer' must be a string \\(missing\\)"),
        (json.dumps({"id": "q", "problem": "P", "answer": 3}), "field 'answer' must be a string \\(int\\)"),
        (json.dumps({"id": "q", "problem": " ", "answer": "3"}), "field 'problem' is empty"),
        (json.dumps({"id": "p0", "problem": "P", "answer": "3"}), "duplicate id 'p0'"),
        (json.dumps({"id": "q", "problem": "P", "answer": "3", "source": 7}), "field 'source' must be str"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, bad_line, reason):
    manual = tmp_path / "manual"
    _write_aime(manual, [GOOD[0], GOOD[1], bad_line, GOOD[2]])
    with pytest.raises(MalformedRowError, match=f"{manual}/aime2025.jsonl:3: {reason}"):
        datasets.load("aime2025", "test", manual_dir=manual, data_dir=tmp_path / "tfds")


def test_malformed_rows_skipped_and_counted(tmp_path):
    manual = tmp_path / "manual"
    _write_aime(manual, [GOOD[0], "{not json", GOOD[1], '"just a string"', GOOD[2]])
    records = datasets.load("aime2025", "test", manual_dir=manual, data_dir=tmp_path / "tfds", skip_malformed=True)
    assert [r["id"] for r in records] == ["p0", "p1", "p2"]
    assert records.skipped == 2
    again = datasets.load("aime2025", "test", manual_dir=manual, data_dir=tmp_path / "tfds",
                          skip_malformed=True)
    assert again.skipped == 2  # recorded in the built dataset's metadata
    with pytest.raises(ValueError, match="2 malformed row"):  # a strict load of that build
        datasets.load("aime2025", "test", manual_dir=manual, data_dir=tmp_path / "tfds")


def test_changed_source_file_is_detected(tmp_path):
    manual = tmp_path / "manual"
    _write_aime(manual, GOOD)
    data_dir = tmp_path / "tfds"
    assert len(datasets.load("aime2025", "test", manual_dir=manual, data_dir=data_dir)) == 3
    _write_aime(manual, GOOD[:2])
    with pytest.raises(ValueError, match="was built from another version of .*aime2025.jsonl"):
        datasets.load("aime2025", "test", manual_dir=manual, data_dir=data_dir)


def test_built_data_loads_without_manual_dir(tmp_path, monkeypatch):
    manual = tmp_path / "manual"
    _write_aime(manual, GOOD)
    data_dir = tmp_path / "tfds"
    datasets.load("aime2025", "test", manual_dir=manual, data_dir=data_dir)
    shutil.rmtree(manual)
    monkeypatch.setenv("MARS_JAX_DATA_DIR", str(manual))
    assert len(datasets.load("aime2025", "test", data_dir=data_dir)) == 3


def test_manual_dir_from_environment(tmp_path, monkeypatch):
    manual = tmp_path / "elsewhere"
    _write_aime(manual, GOOD[:1])
    monkeypatch.setenv("MARS_JAX_DATA_DIR", str(manual))
    assert default_manual_dir() == str(manual)
    assert [r["id"] for r in datasets.load("aime2025", "test", data_dir=tmp_path / "tfds")] == ["p0"]
