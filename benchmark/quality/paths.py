"""Where things live: repository root, the git-ignored data folder, output paths; file digests.

``bazel run`` starts binaries inside the runfiles tree; it exports
``BUILD_WORKSPACE_DIRECTORY`` (the source checkout) and ``BUILD_WORKING_DIRECTORY``
(the user's shell directory). Data is cached in the checkout, and relative output paths
mean what the user typed them relative to.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def repo_root() -> Path:
    """The source checkout: ``$BUILD_WORKSPACE_DIRECTORY`` under ``bazel run``, else by file.

    ``os.path.abspath`` rather than ``resolve()``: under Bazel the file is a runfiles
    symlink and the runfiles tree, not the symlink target, is the import root.
    """
    workspace = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    if workspace:
        return Path(workspace)
    return Path(os.path.abspath(__file__)).parents[2]


def default_data_dir() -> Path:
    """``<repo>/data``: the cache for downloaded and extracted inputs (ignored by git)."""
    return repo_root() / "data"


def user_path(path: str | os.PathLike) -> Path:
    """Resolve a path the user typed: relative to ``$BUILD_WORKING_DIRECTORY`` under ``bazel run``."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    base = os.environ.get("BUILD_WORKING_DIRECTORY")
    return (Path(base) / p) if base else (Path.cwd() / p)


def shown_path(path: str | os.PathLike) -> str:
    """``path`` relative to the repository when inside it (files written for others to read), else as given."""
    try:
        return str(Path(path).resolve().relative_to(repo_root().resolve()))
    except ValueError:
        return str(path)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read 4 MiB at a time (model files are hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
