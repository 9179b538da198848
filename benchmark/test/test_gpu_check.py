"""scripts/gpu_check.sh's machinery (benchmark/validation/gpu_check.py) without a GPU.

The CPU smoke run itself is a step of scripts/test.sh; these tests pin the parts it relies
on. Plain pytest only (not a Bazel target): the suite list is read from the checkout's
BUILD files, which Bazel's sandbox does not hold.
"""

from __future__ import annotations

import json
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


def test_the_e2e_part_runs_the_gpu_e2e_and_the_quick_cpu_one_in_smoke(monkeypatch, tmp_path):
    import torch

    from benchmark.e2e import cli as e2e

    quick = gpu_check.e2e_argv(True, tmp_path / "e2e.json")
    assert quick == ["--quick", "--no-progress", "--json", str(tmp_path / "e2e.json")]  # the CPU, as before
    gpu = gpu_check.e2e_argv(False, tmp_path / "e2e.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = e2e.parse_args(gpu)  # flags the e2e takes, its trained indexer found
    assert (args.device, args.contexts, args.batches, args.indexer) == ("cuda", [8192], [1, 8], "trained")
    assert (args.new_tokens, args.warmup, args.no_progress, args.json) == (8, 2, True, str(tmp_path / "e2e.json"))


def _fake_e2e(monkeypatch, rc, payload):
    """``gpu_check._run`` replaced: the e2e "writes" ``payload`` (None: nothing) and exits ``rc``."""
    seen = {}

    def fake_run(cmd, log, timeout_s, env=None):
        seen.update(cmd=cmd, timeout_s=timeout_s, env=env)
        if payload is not None:
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(payload))
        return {"command": " ".join(cmd[1:]), "rc": rc, "ok": rc == 0, "seconds": 1.0, "missing_modules": [],
                "tail": ""}, ""

    monkeypatch.setattr(gpu_check, "_run", fake_run)
    return seen


TARGETS = [{"target": "topology_only_noscan >= 1.3x dense at context 8192, batch 8", "context": 8192, "batch": 8,
            "indexer_preset": "trained", "value": 1.6, "passed": True},
           {"target": "learned+topology_sparse_merge within 3% of learned step time, batch 1", "context": 8192,
            "batch": 1, "indexer_preset": "trained", "value": 1.05, "passed": False},
           {"target": "learned+topology_compress_sparse policy <= 3% of its step, batch 1", "context": 8192,
            "batch": 1, "indexer_preset": None, "value": None, "passed": None}]


def test_the_e2e_part_passes_on_exit_0_and_lists_its_targets(monkeypatch, tmp_path):
    (tmp_path / "e2e.json").write_text(json.dumps({"rows": [{}], "targets": []}))  # an earlier run's file
    seen = _fake_e2e(monkeypatch, 0, {"rows": [{"variant": "dense"}], "targets": TARGETS})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    r = gpu_check.run_e2e(False, "python", tmp_path, tmp_path, 123.0)
    assert r["ok"] and [t["passed"] for t in r["targets"]] == [True, False, None]
    assert seen["cmd"][:4] == ["python", gpu_check.E2E_SCRIPT, "--device", "cuda"]
    assert seen["timeout_s"] == 123.0 and "TRITON_INTERPRET" not in seen["env"]
    result = {"mode": "gpu", "date": "d", "preflight": {"python": "3", "device": "NVIDIA H200"}, "suites": [],
              "bench": None, "e2e": r, "seconds": {"total": 1.0, "e2e": 1.0}, "not_covered": [], "ok": True}
    md = gpu_check.markdown(result)
    assert "**e2e**: ok, 1.0 s: `benchmark/topology_kv_decode_e2e.py --device cuda" in md
    assert "| topology_only_noscan >= 1.3x dense at context 8192, batch 8 | 8192 | 8 | 1.600 | PASS |" in md
    assert "| learned+topology_compress_sparse policy <= 3% of its step, batch 1 | 8192 | 1 | - | NOT RUN |" in md
    assert md.rstrip().endswith("**Verdict**: every part that ran passed; e2e targets not met (measured, not "
                                "asserted): learned+topology_sparse_merge within 3% of learned step time, batch 1 "
                                "(context 8192)")


@pytest.mark.parametrize("rc, payload, reason", [
    (1, None, None),  # the run failed
    (0, None, "is not an e2e --json file"),  # exit 0 without its JSON (the earlier one was removed)
    (0, {"rows": [], "targets": TARGETS}, "holds no rows"),
])
def test_the_e2e_part_fails_without_exit_0_and_its_rows(monkeypatch, tmp_path, rc, payload, reason):
    (tmp_path / "e2e.json").write_text(json.dumps({"rows": [{"variant": "dense"}], "targets": TARGETS}))
    _fake_e2e(monkeypatch, rc, payload)
    r = gpu_check.run_e2e(True, "python", tmp_path, tmp_path, gpu_check.SMOKE_E2E_TIMEOUT_S)
    assert not r["ok"]
    assert reason is None or reason in r["reason"]


def test_the_gpu_run_fits_its_budget_with_the_e2e_inside(monkeypatch, tmp_path):
    """On the GPU the suites, the bench and the e2e share one --budget-s (the check must end
    within 8 minutes): the suites' deadline leaves both reserves, the e2e gets the rest."""
    assert gpu_check.build_parser().parse_args([]).budget_s < 8 * 60
    monkeypatch.setattr(gpu_check, "preflight", lambda smoke: {"python": "3", "executable": "python", "missing": []})
    monkeypatch.setattr(gpu_check, "cuda_suites", lambda: [gpu_check.Suite("//a:b_cuda_manual", "a", ("a/b_test.py",))])
    timeouts = {}

    def fake_suite(suite, device, python, log_dir, timeout_s):
        timeouts["suite"] = timeout_s
        return {"suite": suite.name, "files": [], "counts": {}, "rc": 0, "ok": True, "seconds": 0.0,
                "missing_modules": []}

    def fake_run(cmd, log, timeout_s, env=None):
        timeouts.setdefault("bench", timeout_s)
        return {"rc": 0, "ok": True, "seconds": 0.0, "command": " ".join(cmd)}, ""

    def fake_e2e(smoke, python, out, logs, timeout_s):
        timeouts["e2e"] = timeout_s
        return {"rc": 0, "ok": True, "seconds": 0.0, "command": "e2e", "targets": []}

    monkeypatch.setattr(gpu_check, "run_suite", fake_suite)
    monkeypatch.setattr(gpu_check, "_run", fake_run)
    monkeypatch.setattr(gpu_check, "run_e2e", fake_e2e)
    assert gpu_check.main(["--budget-s", "400", str(tmp_path)]) == 0
    reserves = gpu_check.BENCH_RESERVE_S + gpu_check.E2E_RESERVE_S
    assert 400 - reserves - 5 < timeouts["suite"] <= 400 - reserves
    assert 400 - gpu_check.E2E_RESERVE_S - 5 < timeouts["bench"] <= 400 - gpu_check.E2E_RESERVE_S
    assert 400 - 5 < timeouts["e2e"] <= 400  # nothing else took time: the e2e gets the whole rest
