"""`python -m mars_jax.data.fetch`: every dataset the loaders know, in their layout, with a
manifest per dataset. From a local mirror (the data dir the tests read), checked against the
recorded sha256; from the HF Hub (unreachable here, so read through a fake Hub that serves
hand-written rows shaped as each upstream file is), converted by `upstream`'s converters."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from mars_jax.data import builder, datasets, fetch
from mars_jax.data.jsonl import read_problems

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_loader_file_is_fetched_with_a_licence():
    files = fetch.dataset_files()
    for config in builder.CONFIGS:  # every problem set a config can name
        assert set(config.split_files.values()) <= set(files[config.name]), config.name
    assert sorted(f for group in files.values() for f in group) == sorted(fetch.FILES)
    assert set(fetch.PROVENANCE) == set(files)
    assert all(p["license"] and p["upstream"] for p in fetch.PROVENANCE.values())


def test_fetch_from_a_mirror_gives_the_loaders_the_same_problems(data_mirror, tmp_path):
    out = tmp_path / "data"
    done = subprocess.run([sys.executable, "-m", "mars_jax.data.fetch", f"--source={data_mirror}",
                           f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr
    assert f"export MARS_JAX_DATA_DIR={out}" in done.stdout
    for name, files in fetch.dataset_files().items():
        manifest = json.loads((out / f"{name}.manifest.json").read_text())
        assert manifest["dataset"] == name and manifest["license"] and manifest["upstream"]
        assert manifest["fetched_from"] == os.path.abspath(data_mirror)
        for entry, file_name in zip(manifest["files"], files, strict=True):
            data = (out / file_name).read_bytes()
            assert data == (open(os.path.join(data_mirror, file_name), "rb").read())
            assert entry == {"file": file_name, "sha256": hashlib.sha256(data).hexdigest(),
                             "bytes": len(data), "rows": data.count(b"\n")}
    # The loaders build from the fetched dir and read back the mirror's problems, in order.
    for config in builder.CONFIGS:
        for split, file_name in config.split_files.items():
            records = datasets.load(config.name, split, manual_dir=out, data_dir=tmp_path / "tfds")
            expected = read_problems(os.path.join(data_mirror, file_name),
                                     extra_fields=dict(config.extra_fields)).rows
            assert [(r["id"], r["problem"], r["answer"]) for r in records] == [
                (r["id"], r["problem"], r["answer"]) for r in expected], (config.name, split)


def test_a_changed_file_is_refused_and_not_written(data_mirror, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(data_mirror, mirror, ignore=shutil.ignore_patterns("*.manifest.json"))
    with open(mirror / "aime2025.jsonl", "ab") as f:
        f.write(b"\n")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="aime2025.jsonl from .*mirror: sha256 [0-9a-f]{64}, expected "
                                         + fetch.FILES["aime2025.jsonl"]):
        fetch.fetch_all(str(out), fetch.copy_from_mirror(str(mirror)), str(mirror), ["aime2025"])
    assert os.listdir(out) == []  # neither the file nor a manifest, nor the staging dir


def test_missing_mirror_file_and_unknown_dataset_are_named(tmp_path, capsys):
    assert fetch.main([f"--source={tmp_path}", f"--out={tmp_path / 'out'}", "--datasets=gsm8k"]) == 1
    assert f"--source: {tmp_path}/gsm8k_train.jsonl does not exist" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown dataset\(s\) \['gsm9k'\]"):
        fetch.fetch_all(str(tmp_path), fetch.copy_from_mirror(str(tmp_path)), "x", ["gsm9k"])


