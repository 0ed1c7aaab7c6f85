"""`mars_jax.storage` on local paths and on `gs://` URLs served by a local fake GCS server."""
import json
import os

import pytest

from mars_jax import storage
from tests import fake_gcs


@pytest.fixture
def gcs(monkeypatch):
    with fake_gcs.bucket(monkeypatch) as root:
        yield root


def test_local_paths_are_made_absolute_and_urls_kept(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert os.fspath(storage.path("run")) == str(tmp_path / "run")
    assert os.fspath(storage.path("gs://b/run/x")) == "gs://b/run/x"
    assert storage.is_remote("gs://b/run") and not storage.is_remote(tmp_path)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_write_append_copy_and_move_trees(where, tmp_path, request):
    root = request.getfixturevalue("gcs") + "/run" if where == "gcs" else str(tmp_path / "run")
    storage.write_text(f"{root}/config.json", json.dumps({"a": 1}))
    storage.write_text(f"{root}/config.json", json.dumps({"a": 2}))  # replaced whole
    assert json.loads(storage.path(f"{root}/config.json").read_text()) == {"a": 2}
    for line in ("one\n", "two\n"):
        storage.append_text(f"{root}/sub/log.txt", line)
    assert storage.path(f"{root}/sub/log.txt").read_text() == "one\ntwo\n"
    source = tmp_path / "source"
    (source / "plugins" / "profile").mkdir(parents=True)
    (source / "plugins" / "profile" / "trace.pb").write_bytes(b"\x00\x01")
    (source / "top.txt").write_text("top")
    storage.copy_tree(source, f"{root}/copied")
    assert storage.path(f"{root}/copied/plugins/profile/trace.pb").read_bytes() == b"\x00\x01"
    assert storage.path(f"{root}/copied/top.txt").read_text() == "top"
    assert storage.files(root) == ["config.json", "copied/plugins/profile/trace.pb",
                                   "copied/top.txt", "sub/log.txt"]
    assert storage.files(f"{root}/absent") == []
    storage.move_tree(f"{root}/copied", f"{root}/aside/copied")
    assert storage.files(f"{root}/aside") == ["copied/plugins/profile/trace.pb", "copied/top.txt"]
    assert not storage.path(f"{root}/copied").exists()
