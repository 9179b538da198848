"""The Python that tests run with is this checkout's venv, and the venv matches the lock.

Under Bazel it also checks what tools/python_toolchain.bzl and tools/pytest_runner.py
promise: the toolchain interpreter runs the test, HOME points into TEST_TMPDIR, and torch
sees the OMP_NUM_THREADS from .bazelrc.
"""

import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

_UNDER_BAZEL = "TEST_SRCDIR" in os.environ
_REPO_ROOT = Path(__file__).resolve().parent.parent


def _toolchain_header() -> dict[str, str]:
    """The `# key: value` lines tools/python_toolchain.bzl wrote (Bazel runs only)."""
    packages = Path(os.environ["TEST_SRCDIR"], "rtp_llm_python", "installed_packages.txt")
    lines = packages.read_text().splitlines()
    return dict(line[2:].split(": ", 1) for line in lines if line.startswith("# "))


def _running_the_checkouts_venv() -> bool:
    if _UNDER_BAZEL:
        return _toolchain_header()["source"] == ".venv"
    return Path(sys.prefix).resolve() == _REPO_ROOT / ".venv"


# With RTP_LLM_PYTHON (e.g. a CUDA Python on a GPU machine) the lock does not apply.
_needs_venv = pytest.mark.skipif(
    not _running_the_checkouts_venv(), reason="not the checkout's .venv (RTP_LLM_PYTHON?)"
)


def _locked_versions() -> dict[str, str]:
    """{normalized name: version} from requirements.txt (`name==version --hash=sha256:...  # comment`)."""
    root = Path.cwd() if _UNDER_BAZEL else _REPO_ROOT  # Bazel: cwd is the runfiles root
    pins = {}
    for line in (root / "requirements.txt").read_text().splitlines():
        line = line.split(" #", 1)[0].split("--hash=", 1)[0].strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_every_pin_carries_a_sha256_hash():
    """The lock is installed with --require-hashes: every pin names the bytes it means."""
    root = Path.cwd() if _UNDER_BAZEL else _REPO_ROOT
    pins = [l for l in (root / "requirements.txt").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert pins, "requirements.txt has no pins"
    unhashed = [l for l in pins if not re.search(r"--hash=sha256:[0-9a-f]{64}\b", l)]
    assert not unhashed, f"pins without a sha256 hash: {unhashed}"


@_needs_venv
def test_venv_matches_requirements_lock():
    mismatched = {}
    for name, version in _locked_versions().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            mismatched[name] = f"locked {version}, installed {installed}"
    assert not mismatched, f"{sys.prefix} differs from requirements.txt (run scripts/setup.sh): {mismatched}"


@_needs_venv
def test_torch_is_the_cpu_build():
    # A CUDA build from PyPI is several GB; requirements.txt pins the local '+cpu' wheel.
    assert torch.__version__.endswith("+cpu"), torch.__version__
    assert torch.version.cuda is None, torch.version.cuda


@pytest.mark.skipif(not _UNDER_BAZEL, reason="checks the Bazel toolchain and test env")
def test_bazel_runs_the_toolchain_interpreter_in_a_clean_env():
    header = _toolchain_header()
    assert sys.executable == header["interpreter"], (sys.executable, header)
    assert os.environ["HOME"] == os.environ["TEST_TMPDIR"]
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=1, max_value=4096))
def test_hypothesis_drives_torch(n):
    assert int(torch.arange(n, dtype=torch.int64).sum()) == n * (n - 1) // 2
