"""`fetch` from the HF Hub: each problem set's converter on hand-written rows shaped as its
upstream file is (field names, `####` answers, parquet), through a fake Hub, since this machine
cannot reach the real one. Expected rows are written out by hand."""
import hashlib
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mars_jax.data import datasets, fetch, upstream

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub(fetch.HubReader):
    """Serves `files[(repo, path)]` (bytes) at one commit, recording each call."""

    def __init__(self, files: dict[tuple[str, str], bytes]) -> None:
        self.files, self.calls = files, []

    def resolve(self, repo: str, revision: str) -> str:
        self.calls.append(("resolve", repo, revision))
        return COMMIT

    def download(self, repo: str, path: str, commit: str, dest_dir: str) -> str:
        self.calls.append(("download", repo, path, commit))
        local = os.path.join(dest_dir, path)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(local, "wb") as f:
            f.write(self.files[(repo, path)])
        return local


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(rows, tmp_path) -> bytes:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.read_bytes()


GSM8K_TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Adam earns $40 daily in his job. 10% of his money is deducted as taxes. How much money will Adam "
                 "have earned after taxes after 30 days of work? ",
     "answer": "Adam earns 40 * 30 = $<<40*30=1200>>1200.\nTaxes are 1200 * 10/100 = $<<1200*10/100=120>>120.\n"
               "He keeps 1200 - 120 = $<<1200-120=1080>>1,080.\n#### 1,080"},
]
GSM8K_TEST = [{"question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in "
                           "total does it take?",
               "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is "
                         "2+1=<<2+1=3>>3 bolts of fabric\n#### 3"}]
MATH500 = [
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
     "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$ ... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
    {"problem": "If $f(x) = \\frac{3x-2}{x-2}$, what is the value of $f(-2) +f(-1)+f(0)$?",
     "solution": "... $\\boxed{\\frac{14}{3}}.$", "answer": "\\frac{14}{3}", "subject": "Algebra", "level": 3,
     "unique_id": "test/algebra/2584.json"},
]
# 30 rows as glm-simple-evals' aime_2025.jsonl has them (question/answer, duplicated capitalised);
# row 20 (AIME II problem 5) has the upstream answer `336^\circ`.
AIME2025 = [{"question": f"Problem {n}.", "answer": "336^\\circ" if n == 20 else str(n),
             "Question": f"Problem {n}.", "Answer": "336^\\circ" if n == 20 else str(n)} for n in range(1, 31)]
DEEPSCALER = [  # deepscaler.json: a JSON list of {problem, answer, solution}
    {"problem": "Find $1+1$.", "answer": "2", "solution": "..."},
    {"problem": "The pressure  $P$ on a sail ...\nFind the wind velocity.", "answer": "12.8", "solution": "..."},
    {"problem": "Find $1+1$.", "answer": "3", "solution": "a later duplicate of the first problem"},
]


def _hub(tmp_path) -> FakeHub:
    return FakeHub({
        ("openai/gsm8k", "main/train-00000-of-00001.parquet"): _parquet(GSM8K_TRAIN, tmp_path),
        ("openai/gsm8k", "main/test-00000-of-00001.parquet"): _parquet(GSM8K_TEST, tmp_path),
        ("HuggingFaceH4/MATH-500", "test.jsonl"): _jsonl(MATH500),
        ("zai-org/glm-simple-evals-dataset", "aime/aime_2025.jsonl"): _jsonl(AIME2025),
    })


def _read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_hub_fetch_converts_and_records_licence_and_checksums(tmp_path):
    hub, out = _hub(tmp_path), tmp_path / "data"
    assert fetch.main([f"--out={out}", "--datasets=gsm8k,math500,aime2025"], hub=hub) == 0
    assert hub.calls[:3] == [
        ("resolve", "openai/gsm8k", "e53f048856ff4f594e959d75785d2c2d37b678ee"),
        ("download", "openai/gsm8k", "main/train-00000-of-00001.parquet", COMMIT),
        ("download", "openai/gsm8k", "main/test-00000-of-00001.parquet", COMMIT)]
    source = f"hf://datasets/openai/gsm8k@{COMMIT}/main/train-00000-of-00001.parquet"
    assert _read(out / "gsm8k_train.jsonl") == [
        {"id": "gsm8k-train-0000", "problem": GSM8K_TRAIN[0]["question"], "answer": "72", "source": source},
        {"id": "gsm8k-train-0001", "problem": GSM8K_TRAIN[1]["question"].strip(), "answer": "1080",
         "source": source, "answer_as_in_source": "1,080"}]
    assert [(r["id"], r["answer"]) for r in _read(out / "gsm8k_test.jsonl")] == [("gsm8k-test-0000", "3")]
    assert _read(out / "math500.jsonl")[1] == {
        "id": "math500-test/algebra/2584.json", "problem": MATH500[1]["problem"], "answer": "\\frac{14}{3}",
        "source": f"hf://datasets/HuggingFaceH4/MATH-500@{COMMIT}/test.jsonl", "subject": "Algebra", "level": 3}
    aime = _read(out / "aime2025.jsonl")
    assert [r["id"] for r in aime[13:17]] == ["aime2025-I-14", "aime2025-I-15", "aime2025-II-01", "aime2025-II-02"]
    assert (aime[19]["id"], aime[19]["answer"], aime[19]["answer_as_in_source"]) == ("aime2025-II-05", "336",
                                                                                     "336^\\circ")
    assert "answer_as_in_source" not in aime[18]

    manifest = json.loads((out / "gsm8k.manifest.json").read_text())
    assert manifest["license"] == "MIT" and manifest["fetched_from"] == f"hf://datasets/openai/gsm8k@{COMMIT}"
    assert manifest["upstream"] == {
        "repo": "openai/gsm8k", "revision": "e53f048856ff4f594e959d75785d2c2d37b678ee", "commit": COMMIT,
        "files": [{"path": path, "sha256": hashlib.sha256(hub.files[("openai/gsm8k", path)]).hexdigest(),
                   "bytes": len(hub.files[("openai/gsm8k", path)])}
                  for path in ("main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet")]}
    for entry, rows in zip(manifest["files"], (2, 1), strict=True):
        data = (out / entry["file"]).read_bytes()
        assert entry == {"file": entry["file"], "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                         "rows": rows}
    assert sorted(os.listdir(out)) == sorted(["aime2025.jsonl", "aime2025.manifest.json", "gsm8k_train.jsonl",
                                              "gsm8k_test.jsonl", "gsm8k.manifest.json", "math500.jsonl",
                                              "math500.manifest.json"])  # no staging left
    records = datasets.load("math500", "test", manual_dir=out, data_dir=tmp_path / "tfds")
    assert [(r["id"], r["level"], r["subject"]) for r in records] == [
        ("math500-test/precalculus/807.json", 2, "Precalculus"), ("math500-test/algebra/2584.json", 3, "Algebra")]


def test_a_row_the_converter_cannot_read_is_named_and_nothing_is_written(tmp_path, capsys):
    hub = _hub(tmp_path)
    hub.files[("openai/gsm8k", "main/test-00000-of-00001.parquet")] = _parquet(
        [{"question": "What is 1+1?", "answer": "1+1=2, so 2"}], tmp_path)
    assert fetch.main([f"--out={tmp_path / 'out'}", "--datasets=gsm8k"], hub=hub) == 1
    assert (f"hf://datasets/openai/gsm8k@{COMMIT}/main/test-00000-of-00001.parquet row 0: answer has no '####'"
            in capsys.readouterr().err)
    assert os.listdir(tmp_path / "out") == []


def test_grader_cases_has_no_hub_source(tmp_path, capsys):
    assert fetch.main([f"--out={tmp_path}", "--datasets=grader_cases"], hub=FakeHub({})) == 1
    err = capsys.readouterr().err
    assert "grader_cases has no Hub source" in err and "--source" in err


@pytest.mark.parametrize("answer, expected", [("70", "70"), (" 588 ", "588"), ("336^\\circ", "336"),
                                              ("336^{\\circ}", "336")])
def test_integer_answer(answer, expected):
    assert upstream.integer_answer(answer, "here") == expected


def test_a_non_integer_aime_answer_or_a_wrong_row_count_is_named():
    with pytest.raises(ValueError, match=r"f row beyond_aime-001: answer '\\\\frac\{1\}\{2\}' is not an integer"):
        upstream.convert_beyond_aime({"beyond_aime.jsonl": [{"question": "a", "answer": "3"},
                                                            {"question": "b", "answer": "\\frac{1}{2}"}]},
                                     {"beyond_aime.jsonl": "f"})
    with pytest.raises(ValueError, match="f: 29 rows, expected 30"):
        upstream.convert_aime2025({"aime2025.jsonl": AIME2025[:29]}, {"aime2025.jsonl": "f"})


def test_dsr_sub_takes_the_named_problems_in_order_from_deepscaler():
    ids = [upstream.problem_fingerprint("The pressure $P$ on a sail ... Find the wind velocity."),
           upstream.problem_fingerprint("Find $1+1$.")]
    rows = upstream.convert_dsr_sub({"train_dsr_sub.jsonl": DEEPSCALER}, {"train_dsr_sub.jsonl": "f"}, ids=ids)
    assert rows == {"train_dsr_sub.jsonl": [
        {"id": "dsr_sub-0000", "problem": DEEPSCALER[1]["problem"], "answer": "12.8", "source": "f"},
        {"id": "dsr_sub-0001", "problem": "Find $1+1$.", "answer": "2", "source": "f"}]}  # the first of the two
    with pytest.raises(ValueError, match="f: 1 of the 2 DSR-sub problems are not in it"):
        upstream.convert_dsr_sub({"train_dsr_sub.jsonl": DEEPSCALER}, {"train_dsr_sub.jsonl": "f"},
                                 ids=[ids[0], "0000000000000000"])


def test_dsr_sub_ids_name_the_projects_dsr_sub_problems(problem_data_dir):
    rows = _read(os.path.join(problem_data_dir, "train_dsr_sub.jsonl"))
    assert upstream.read_ids() == [upstream.problem_fingerprint(r["problem"]) for r in rows]
    assert len(upstream.read_ids()) == 1209


def test_the_converters_rules_give_the_projects_gsm8k_and_aime_answers_and_ids(problem_data_dir):
    """The project's files were made from the same upstream rows by another hand: given each row's
    answer as upstream has it (`answer_as_in_source`, else `answer`), the converters' answer rules
    and id numbering give that file's answers and ids."""
    for file_name in ("gsm8k_train.jsonl", "gsm8k_test.jsonl"):
        local = _read(os.path.join(problem_data_dir, file_name))
        shaped = [{"question": r["problem"], "answer": f"...\n#### {r.get('answer_as_in_source', r['answer'])}"}
                  for r in local]
        converted = upstream.convert_gsm8k({file_name: shaped}, {file_name: "x"})[file_name]
        assert [(r["id"], r["answer"]) for r in converted] == [(r["id"], r["answer"]) for r in local]
    for file_name, convert in (("aime2025.jsonl", upstream.convert_aime2025),
                               ("beyond_aime.jsonl", upstream.convert_beyond_aime)):
        local = _read(os.path.join(problem_data_dir, file_name))
        shaped = [{"question": r["problem"], "answer": r.get("answer_as_in_source", r["answer"])} for r in local]
        converted = convert({file_name: shaped}, {file_name: "x"})[file_name]
        assert [(r["id"], r["answer"], r.get("answer_as_in_source")) for r in converted] == [
            (r["id"], r["answer"], r.get("answer_as_in_source")) for r in local]


def test_read_rows_takes_a_json_list_or_json_lines_and_names_a_bad_line(tmp_path):
    listed, lines = tmp_path / "a.json", tmp_path / "b.json"
    listed.write_text(json.dumps(DEEPSCALER))
    lines.write_text(_jsonl(DEEPSCALER).decode())
    assert upstream.read_rows(str(listed)) == upstream.read_rows(str(lines)) == DEEPSCALER
    lines.write_text('{"problem": "a"}\n{"problem": \n')
    with pytest.raises(ValueError, match=f"{lines}:2: "):
        upstream.read_rows(str(lines))
