"""Entry point of every py_pytest_test (tools/pytest.bzl): runs pytest on the test files.

Usage (the macro writes the arguments):
    pytest_runner.py TEST_FILE... -- [EXTRA_PYTEST_ARGS...]

Under `bazel test` the working directory is the runfiles root of this workspace, HOME is
unset and the source tree is read-only, so before pytest (or torch, hypothesis,
matplotlib, huggingface) is imported, every cache is pointed into $TEST_TMPDIR. The JUnit
report goes to $XML_OUTPUT_FILE, where Bazel looks for it. Exit code is pytest's: 5 (no
tests collected) fails the target, as it should.
"""

import os
import sys

# Runner lives at <root>/tools/pytest_runner.py; <root> holds rtp_llm/ and benchmark/.
_WORKSPACE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _point_caches_at_test_tmpdir() -> None:
    tmp = os.environ.get("TEST_TMPDIR")
    if not tmp:
        return  # `bazel run` or a direct call: keep the caller's environment.
    os.environ["HOME"] = tmp
    os.environ.setdefault("XDG_CACHE_HOME", os.path.join(tmp, ".cache"))
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tmp, ".hypothesis"))
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(tmp, "matplotlib"))
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tmp, "torchinductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(tmp, "triton"))
    os.environ.setdefault("HF_HOME", os.path.join(tmp, "huggingface"))
    # Tests never download: fail fast instead of waiting on the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: list[str]) -> int:
    _point_caches_at_test_tmpdir()
    if _WORKSPACE_ROOT not in sys.path:
        sys.path.insert(0, _WORKSPACE_ROOT)

    import pytest  # after the environment is set: plugins may create caches on import

    files, extra = _split_args(argv)
    if not files:
        print("pytest_runner: no test files given", file=sys.stderr)
        return 2
    args = [*files, "-p", "no:cacheprovider", "-q"]
    config = os.path.join(_WORKSPACE_ROOT, "pytest.ini")
    if os.path.exists(config):
        args += ["-c", config]
    args += ["--rootdir", _WORKSPACE_ROOT]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append("--junitxml=" + xml)
    args += extra
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
