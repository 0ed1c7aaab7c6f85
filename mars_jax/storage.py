"""Where a run's files live: a local path or a `gs://` URL, behind one `etils.epath.Path` API, so a
workdir on Cloud Storage works like a local one.

Listings are never cached: a cache would hide checkpoints that another process or tensorstore wrote.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import fsspec
from etils import epath

REMOTE_PREFIXES = ("gs://",)
# Listings must show what other processes (and tensorstore, in orbax) wrote since the last one.
fsspec.config.conf.setdefault("gs", {})["use_listings_cache"] = False


def is_remote(location: str | os.PathLike) -> bool:
    """Whether `location` names an object store (`gs://...`) rather than a local path."""
    return os.fspath(location).startswith(REMOTE_PREFIXES)


def path(location: str | os.PathLike) -> epath.Path:
    """`location` as an `epath.Path`: a `gs://` URL as given, a local path made absolute."""
    text = os.fspath(location)
    if is_remote(text):
        return epath.Path(text)
    return epath.Path(os.path.abspath(os.path.expanduser(text)))


def entries(directory: str | os.PathLike) -> list[epath.Path]:
    """The entries of `directory`; [] where it does not exist (or is empty on an object store)."""
    directory = path(directory)
    return list(directory.iterdir()) if directory.exists() else []


def write_text(target: str | os.PathLike, text: str) -> None:
    """Writes `text` to `target` whole or not at all, creating the parent directory."""
    target = path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(target):
        target.write_text(text)
        return
    tmp = target.with_name(f"{target.name}.tmp.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)


def append_text(target: str | os.PathLike, text: str) -> None:
    """Appends `text` to `target` (an object store's object is rewritten whole, atomically)."""
    target = path(target)
    if is_remote(target):
        write_text(target, (target.read_text() if target.exists() else "") + text)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        f.write(text)


def files(directory: str | os.PathLike) -> list[str]:
    """The sorted relative paths of every file under `directory` ([] if absent); epath's `walk`
    drops `gs://`."""
    found = []
    for entry in entries(directory):
        if entry.is_dir():
            found += [f"{entry.name}/{name}" for name in files(entry)]
        else:
            found.append(entry.name)
    return sorted(found)


def copy_tree(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copies every file under `source` to the same path under `target`, overwriting."""
    source, target = path(source), path(target)
    for name in files(source):
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        (source / name).copy(destination, overwrite=True)


def move_tree(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Moves directory `source` to `target` (same storage; objects copied, then deleted)."""
    source, target = path(source), path(target)
    if is_remote(source):
        copy_tree(source, target)
        source.rmtree()
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(os.fspath(source), os.fspath(target))


class LocalStaging:
    """A local directory for a tool that writes only local files, copied up by `publish()`."""

    def __init__(self, target: str | os.PathLike):
        self.target = path(target)
        self.remote = is_remote(self.target)
        self.local = (Path(tempfile.mkdtemp(prefix="mars_jax_staging.")) if self.remote
                      else Path(os.fspath(self.target)))
        self.local.mkdir(parents=True, exist_ok=True)

    def publish(self) -> None:
        """Copies the staged files to `target` (remote) and removes the local copy."""
        if self.remote:
            copy_tree(self.local, self.target)
            shutil.rmtree(self.local, ignore_errors=True)
