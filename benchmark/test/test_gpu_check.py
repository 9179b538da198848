"""scripts/gpu_check.sh's machinery (benchmark/validation/gpu_check.py) without a GPU.

The CPU smoke run itself is a step of scripts/test.sh; these tests pin the parts it relies
on. Plain pytest only (not a Bazel target): the suite list is read from the checkout's
BUILD files, which Bazel's sandbox does not hold.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmark.validation import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_every_cuda_manual_target_is_a_suite_with_existing_test_files():
    builds = [p for p in ROOT.rglob("BUILD") if not p.relative_to(ROOT).parts[0].startswith((".", "bazel-"))
              and p.relative_to(ROOT).parts[0] != "third_party"]
    declared = sorted(f"//{b.parent.relative_to(ROOT).as_posix()}:{n}" for b in builds
                      for n in re.findall(r'cuda_name\s*=\s*"([^"]+_cuda_manual)"', b.read_text()))
    suites = gpu_check.cuda_suites()
    assert sorted(s.name for s in suites) == declared and len(declared) >= 20
    assert len({s.log_name for s in suites}) == len(suites)
    for s in suites:
        assert s.files, s.name
        for f in s.files:
            assert (ROOT / f).is_file(), f"{s.name}: {f}"
    assert set(gpu_check.SMOKE_SUITES) <= {s.name for s in suites}


@pytest.mark.parametrize("line, counts", [
    ("12 passed, 3 skipped in 4.20s", {"passed": 12, "skipped": 3}),
    ("1 failed, 7 passed, 1 xfailed in 9.1s", {"failed": 1, "passed": 7, "xfailed": 1}),
    ("2 errors in 0.5s", {"error": 2}),
])
def test_pytest_summary_counts(line, counts):
    assert gpu_check._pytest_counts("collected ...\n....\n" + line + "\n") == counts


def test_a_python_without_what_the_check_needs_stops_before_anything_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check, "REQUIRED", gpu_check.REQUIRED + ("no_such_module_for_gpu_check",))
    assert gpu_check.main(["--smoke", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "lacks what the check needs" in err and "no_such_module_for_gpu_check" in err
    assert not (tmp_path / "out" / "gpu_check.json").exists()


def test_gpu_mode_without_a_gpu_names_the_missing_device(monkeypatch, tmp_path, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([str(tmp_path / "out")]) == 2
    assert "a CUDA device (torch.cuda.is_available() is False)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["--jobs", "0"], "--jobs"), (["--budget-s", "100"], "--budget-s"),
                                        (["--smoke", "--suites", "//nowhere:x_cuda_manual"], "--suites")])
def test_bad_flags_name_the_flag(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(argv + [str(tmp_path / "out")])
    assert exc.value.code == 2
    assert f"error: {flag}: expected" in capsys.readouterr().err
