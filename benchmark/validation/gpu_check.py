"""``bash scripts/gpu_check.sh [--smoke] [OUTDIR]``: the repository's GPU claims in one command.

Made for a CUDA machine that has only this checkout and a Python with torch, Triton,
pytest and hypothesis (no Bazel, no venv, no network). Parts, each timed:

1. ``preflight``: the Python, torch, CUDA device, Triton, pytest and hypothesis there;
   anything lacking stops the run before it starts (exit 2, naming what is missing).
2. ``suites``: every ``*_cuda_manual`` test suite, read from the ``BUILD`` files'
   ``cpu_and_cuda_pytest`` calls (so the list cannot go stale), through plain pytest with
   ``TOPOLOGY_KV_TEST_DEVICE=cuda``: the Triton kernel against the torch core, the CUDA
   graph capture and replay tests, the no-sync checks, the policy suites on the GPU
   backends. ``--jobs`` suites run at once. A suite that cannot import a module says which.
3. ``bench``: the validation report's attention microbenchmark (cold caches) and policy
   overhead grids with ``--device cuda``, each through its own command
   (``topology_kv_candidate_schedule.py``, ``topology_kv_policy_bench.py``), JSON beside.
4. ``e2e``: the end-to-end decode on the GPU (:func:`e2e_argv`): the real model with the
   trained indexer shipped for it (``--indexer trained``), ``--device cuda``, context 8192,
   batches 1 and 8, 8 decode steps of which 2 are warm-up (about 2-3 minutes on an H200),
   JSON beside. It passes when the command exits 0 and its JSON holds the rows and the
   targets; the targets (PASS / FAIL / NOT RUN, measurements the e2e never asserts) are
   listed in the report, and a failed one is named in the verdict line without failing
   the part.

Writes ``gpu_check.json`` and ``gpu_check.md`` (and one log per suite and part, the
benches' and the e2e's JSON) into OUTDIR [``report/gpu_check``]. ``--budget-s`` [460, under
the 8 minutes a GPU check may take] bounds the whole run: suites start until all but
:data:`BENCH_RESERVE_S` + :data:`E2E_RESERVE_S` of it is spent (the ones not started are
listed as not covered) and each is stopped at that point; the bench runs until all but
:data:`E2E_RESERVE_S` is spent, and the e2e part gets the rest (at least its reserve). The
smoke mode's e2e runs under its own limit (:data:`SMOKE_E2E_TIMEOUT_S`). Exit 0 when every
part that ran passed, 1 when one failed, 2 when the preflight failed.

``--smoke`` runs the same machinery on the CPU in about two minutes (one suite, the
benches' ``--quick`` grids, the e2e's ``--quick`` run on the CPU), so that it keeps working
while no GPU is at hand; ``scripts/test.sh`` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ("torch", "pytest", "hypothesis")
REQUIRED_GPU = ("triton",)
SMOKE_SUITES = ("//rtp_llm/models_py/modules/hybrid/test:topology_kv_config_cuda_manual",)
BENCH_RESERVE_S = 120.0  # of --budget-s, kept for the bench part
E2E_RESERVE_S = 150.0  # of --budget-s, kept for the e2e part on the GPU
SMOKE_E2E_TIMEOUT_S = 600.0  # the CPU smoke's e2e (--quick) limit, outside --budget-s
E2E_SCRIPT = "benchmark/topology_kv_decode_e2e.py"
MACRO_RE = re.compile(r"cpu_and_cuda_pytest\((.*?)\n\)", re.S)
MISSING_RE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
SUMMARY_RE = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str  # the Bazel label of the GPU twin, //package:cuda_name
    package: str  # the folder of its BUILD file, relative to the root
    files: tuple  # its test files, relative to the root

    @property
    def log_name(self) -> str:
        return self.name.strip("/").replace("/", "_").replace(":", "__") + ".log"


def cuda_suites(root: Path = ROOT) -> List[Suite]:
    """Every ``cpu_and_cuda_pytest`` call's GPU twin, in file order; ValueError on a call it cannot read."""
    out: List[Suite] = []
    for build in sorted(root.rglob("BUILD")):
        rel = build.parent.relative_to(root)
        if rel.parts and (rel.parts[0].startswith((".", "bazel-")) or rel.parts[0] == "third_party"):
            continue
        for m in MACRO_RE.finditer(build.read_text()):
            body = m.group(1)
            name = re.search(r'cuda_name\s*=\s*"([^"]+)"', body)
            srcs = re.search(r"srcs\s*=\s*\[(.*?)\]", body, re.S)
            if name is None or srcs is None:
                raise ValueError(f"{build}: a cpu_and_cuda_pytest call without a literal cuda_name and srcs list")
            files = tuple(str(rel / f) for f in re.findall(r'"([^"]+)"', srcs.group(1)) if f.endswith("_test.py")
                          or Path(f).name.startswith("test_"))
            out.append(Suite(f"//{rel.as_posix()}:{name.group(1)}", rel.as_posix(), files))
    return out


def preflight(smoke: bool) -> Dict[str, object]:
    """What the Python here has; ``missing`` lists what a run needs and lacks."""
    info: Dict[str, object] = {"python": platform.python_version(), "executable": sys.executable, "missing": []}
    for mod in REQUIRED + (() if smoke else REQUIRED_GPU):
        try:
            info[mod] = getattr(importlib.import_module(mod), "__version__", "?")
        except Exception as err:  # noqa: BLE001 - any import failure is a missing module here
            info["missing"].append(f"{mod} ({type(err).__name__}: {err})")
    if not smoke and "torch" in info:
        import torch

        if not torch.cuda.is_available():
            info["missing"].append("a CUDA device (torch.cuda.is_available() is False)")
        else:
            info["device"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    return info


def _pytest_counts(text: str) -> Dict[str, int]:
    last = [line for line in text.strip().splitlines() if " in " in line and SUMMARY_RE.search(line)]
    counts: Dict[str, int] = {}
    if last:
        for n, kind in SUMMARY_RE.findall(last[-1]):
            counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    return counts


def _run(cmd: List[str], log: Path, timeout_s: float,
         env: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, object], str]:
    """Run ``cmd`` from the root with the checkout importable: ``(result, output)``; the output also goes to ``log``."""
    env = dict(os.environ if env is None else env, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, timeout_s))
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        text, rc = partial + f"\n[gpu_check] timed out after {timeout_s:.0f} s", 124
    log.write_text(text)
    return {"command": " ".join(cmd[1:]), "rc": rc, "ok": rc == 0, "seconds": round(time.perf_counter() - start, 1),
            "missing_modules": sorted(set(MISSING_RE.findall(text))),
            "tail": "\n".join(text.strip().splitlines()[-15:]) if rc != 0 else ""}, text


def run_suite(suite: Suite, device: str, python: str, log_dir: Path, timeout_s: float) -> Dict[str, object]:
    env = dict(os.environ, TOPOLOGY_KV_TEST_DEVICE=device)
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)
    r, text = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suite.files], log_dir / suite.log_name,
                   timeout_s, env)
    return {"suite": suite.name, "files": list(suite.files), "counts": _pytest_counts(text), **r}


def e2e_argv(smoke: bool, json_path: Path) -> List[str]:
    """The e2e part's flags: the ``--quick`` run on the CPU (smoke), else the GPU run at
    context 8192, batches 1 and 8, with the trained indexer (module docstring)."""
    if smoke:
        return ["--quick", "--no-progress", "--json", str(json_path)]
    return ["--device", "cuda", "--indexer", "trained", "--contexts", "8192", "--batches", "1", "8",
            "--new-tokens", "8", "--warmup", "2", "--no-progress", "--json", str(json_path)]


def run_e2e(smoke: bool, python: str, out: Path, logs: Path, timeout_s: float) -> Dict[str, object]:
    """Run the e2e command, stopped after ``timeout_s``: ``ok`` when it exits 0 and writes its
    JSON's rows and targets; ``targets`` are the JSON's (``passed`` None: not run), never
    part of ``ok``."""
    json_path = out / "e2e.json"
    if json_path.exists():
        json_path.unlink()  # a file from an earlier run must not pass for this one's
    env = dict(os.environ)
    if not smoke:
        env.pop("TRITON_INTERPRET", None)  # compiled Triton kernels on the GPU, as the suites run them
    r, _ = _run([python, E2E_SCRIPT, *e2e_argv(smoke, json_path)], logs / "e2e.log", timeout_s, env)
    r["targets"] = []
    if r["rc"] == 0:
        try:
            payload = json.loads(json_path.read_text())
            rows, targets = payload["rows"], payload["targets"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            r.update(ok=False, reason=f"exit 0, but {json_path} is not an e2e --json file with rows and targets "
                                      f"({type(err).__name__}: {err})")
        else:
            if not rows:
                r.update(ok=False, reason=f"exit 0, but {json_path} holds no rows")
            r["targets"] = [{k: t.get(k) for k in ("target", "context", "batch", "value", "passed")} for t in targets]
    return r


def _verdict(passed: Optional[bool]) -> str:
    return "NOT RUN" if passed is None else ("PASS" if passed else "FAIL")


def markdown(result: Dict[str, object]) -> str:
    pre = result["preflight"]
    lines = [f"# GPU check ({result['mode']})", "",
             f"{result['date']}; Python {pre['python']}, torch {pre.get('torch', '-')}, triton {pre.get('triton', '-')}, "
             f"device {pre.get('device', 'cpu')}; {result['seconds']['total']:.0f} s in all "
             f"(suites {result['seconds'].get('suites', 0):.0f} s, bench {result['seconds'].get('bench', 0):.0f} s, "
             f"e2e {result['seconds'].get('e2e', 0):.0f} s).", "",
             "| suite | result | passed | skipped | failed | s | missing modules |", "|---|---|---|---|---|---|---|"]
    for s in result["suites"]:
        c = s.get("counts", {})
        state = "not run" if s.get("rc") is None else ("ok" if s["ok"] else f"FAIL (rc {s['rc']})")
        lines.append(f"| {s['suite']} | {state} | {c.get('passed', 0)} | {c.get('skipped', 0)} | "
                     f"{c.get('failed', 0) + c.get('error', 0)} | {s.get('seconds', '-')} | "
                     f"{', '.join(s.get('missing_modules', [])) or '-'} |")
    for part in ("bench", "e2e"):
        p = result.get(part)
        if p:
            state = "not covered" if p.get("rc") is None else ("ok" if p["ok"] else f"FAIL (rc {p['rc']})")
            lines += ["", f"**{part}**: {state}, {p.get('seconds', 0)} s: `{p.get('command', p.get('reason', ''))}`"]
            if p.get("reason") and p.get("rc") is not None:
                lines.append(p["reason"])
            if p.get("targets"):
                lines += ["", "| target | context | batch | value | verdict |", "|---|---|---|---|---|"]
                lines += [f"| {t['target']} | {t['context']} | {t['batch']} | "
                          f"{'-' if t['value'] is None else format(t['value'], '.3f')} | {_verdict(t['passed'])} |"
                          for t in p["targets"]]
    failed = [f"{t['target']} (context {t['context']})" for t in (result.get("e2e") or {}).get("targets", [])
              if t["passed"] is False]
    lines += ["", f"**Verdict**: {'every part that ran passed' if result['ok'] else 'FAILED'}"
              + (f"; not covered: {'; '.join(result['not_covered'])}" if result["not_covered"] else "")
              + (f"; e2e targets not met (measured, not asserted): {'; '.join(failed)}" if failed else "")]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", nargs="?", default="report/gpu_check", help="output folder (default report/gpu_check)")
    p.add_argument("--smoke", action="store_true", help="the CPU smoke mode (CI): one suite, the quick benches")
    p.add_argument("--jobs", type=int, default=None, help="suites run at once (default 4; 1 with --smoke)")
    p.add_argument("--budget-s", type=float, default=460.0,
                   help=f"seconds for the whole run (default 460; suites stop {BENCH_RESERVE_S + E2E_RESERVE_S:.0f} s "
                        f"before it, the bench {E2E_RESERVE_S:.0f} s before it, the e2e gets the rest)")
    p.add_argument("--suites", default=None,
                   help="comma list of suite labels, //package:name (default: every *_cuda_manual suite)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        build_parser().error(f"--jobs: expected >= 1, got {args.jobs}")
    if not args.budget_s > BENCH_RESERVE_S + E2E_RESERVE_S:
        build_parser().error(f"--budget-s: expected > {BENCH_RESERVE_S + E2E_RESERVE_S:.0f} (the bench's and the "
                             f"e2e's reserves), got {args.budget_s}")
    started = time.perf_counter()
    mode = "cpu smoke" if args.smoke else "gpu"
    device = "cpu" if args.smoke else "cuda"
    out = Path(args.out_dir)
    if not out.is_absolute():
        out = Path.cwd() / out
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pre = preflight(args.smoke)
    print(f"[gpu_check] {mode}: Python {pre['python']} ({pre['executable']}), " +
          ", ".join(f"{k} {pre[k]}" for k in ("torch", "triton", "device", "cuda") if k in pre), flush=True)
    if pre["missing"]:
        print("[gpu_check] error: this Python lacks what the check needs: " + "; ".join(pre["missing"]), file=sys.stderr)
        return 2
    suites = cuda_suites()
    if args.suites is not None or args.smoke:
        wanted = args.suites.split(",") if args.suites is not None else list(SMOKE_SUITES)
        known = {s.name for s in suites}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            build_parser().error(f"--suites: expected labels of *_cuda_manual suites, got {unknown} "
                                f"(known: {sorted(known)})")
        suites = [s for s in suites if s.name in wanted]
    jobs = args.jobs or (1 if args.smoke else 4)
    e2e_reserve = 0.0 if args.smoke else E2E_RESERVE_S  # the smoke's e2e has its own limit
    deadline = started + args.budget_s - BENCH_RESERVE_S - e2e_reserve  # no suite runs past this
    seconds: Dict[str, float] = {}

    def one(suite: Suite) -> Dict[str, object]:
        left = deadline - time.perf_counter()
        if left <= 0:
            return {"suite": suite.name, "files": list(suite.files), "rc": None, "ok": False,
                    "reason": f"not started: the {args.budget_s:.0f} s budget was spent"}
        r = run_suite(suite, device, sys.executable, logs, left)
        c = r["counts"]
        print(f"[gpu_check] {suite.name}: {'ok' if r['ok'] else 'FAIL'} in {r['seconds']} s "
              f"({c.get('passed', 0)} passed, {c.get('skipped', 0)} skipped, {c.get('failed', 0)} failed)"
              + (f"; cannot import {', '.join(r['missing_modules'])}" if r["missing_modules"] else ""), flush=True)
        return r

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(one, suites))
    seconds["suites"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    from benchmark.validation.report import micro_argv, policy_argv

    bench = {"parts": []}
    for name, script, argv in (
            ("micro", "benchmark/topology_kv_candidate_schedule.py",
             micro_argv(args.smoke) + ["--device", device, "--cache", "cold", "--json", str(out / "micro.json")]),
            ("policy", "benchmark/topology_kv_policy_bench.py",
             policy_argv(args.smoke) + ["--device", device, "--json", str(out / "policy.json")])):
        r, _ = _run([sys.executable, script, *argv], logs / f"{name}.log",
                    max(60.0, started + args.budget_s - e2e_reserve - time.perf_counter()))
        bench["parts"].append({"part": name, **r})
        print(f"[gpu_check] {name} bench: {'ok' if r['ok'] else 'FAIL'} in {r['seconds']} s", flush=True)
    bench.update(rc=max(p["rc"] for p in bench["parts"]), ok=all(p["ok"] for p in bench["parts"]),
                 seconds=round(sum(p["seconds"] for p in bench["parts"]), 1),
                 command="; ".join(p["command"] for p in bench["parts"]))
    seconds["bench"] = time.perf_counter() - t0

    not_covered = [f"{r['suite']} ({r['reason']})" for r in results if r.get("rc") is None]
    t0 = time.perf_counter()
    e2e = run_e2e(args.smoke, sys.executable, out, logs, SMOKE_E2E_TIMEOUT_S if args.smoke else
                  max(E2E_RESERVE_S, started + args.budget_s - time.perf_counter()))
    verdicts = [_verdict(t["passed"]) for t in e2e["targets"]]
    print(f"[gpu_check] e2e ({'quick, cpu' if args.smoke else 'cuda'}): {'ok' if e2e['ok'] else 'FAIL'} in "
          f"{e2e['seconds']} s; targets: " + ", ".join(f"{verdicts.count(v)} {v}" for v in ("PASS", "FAIL", "NOT RUN")),
          flush=True)
    seconds["e2e"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - started
    ran = [r for r in results if r.get("rc") is not None] + [bench, e2e]
    result = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "preflight": pre,
              "suites": results, "bench": bench, "e2e": e2e, "seconds": {k: round(v, 1) for k, v in seconds.items()},
              "not_covered": not_covered, "ok": all(r["ok"] for r in ran)}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2))
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    print(f"[gpu_check] wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
