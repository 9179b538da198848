"""The validation report: every benchmark and the quality gate, in one run, into ``report/``.

Parts (each also runnable alone, see its own module):

1. ``micro``   attention microbenchmark: dense decode attention vs attention over the
               topology-selected tokens (``topology_kv_candidate_schedule.py``);
2. ``policy``  policy overhead beside the indexer's top-k and a copy of the rows
               (``topology_kv_policy_bench.py``);
3. ``e2e``     end-to-end decode on the real model, per-step breakdown
               (``topology_kv_decode_e2e.py``);
4. ``quality`` the quality gate's default run (``topology_kv_quality.py``).

Writes ``report/report.md``, ``report/report.json`` (every figure, the environment),
one JSON per part, PNG plots (cold-cache speedup vs budget with the ideal bound, decode
step time vs batch per variant, per-step latency breakdown, perplexity ratio vs budget per
selector) and prints a summary: gate verdicts, the e2e targets, the best measured
trade-off, and where a decode step's time goes. Tables are markdown with the columns a
reader decides on; every column stays in the JSON.

    python benchmark/topology_kv_report.py            # ~15 min on 2 CPU cores
    python benchmark/topology_kv_report.py --quick    # ~2 min smoke version
    python benchmark/topology_kv_report.py --parts micro policy
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence


import torch

PARTS = ("micro", "policy", "e2e", "quality")


# ---------------------------------------------------------------------------------------
# Part runners: each returns the part's JSON payload (and writes it into out_dir).
# ---------------------------------------------------------------------------------------


def _tee_stdout(fn: Callable[[], int]) -> str:
    """Run ``fn`` with stdout captured (and still echoed to stderr for the user)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = fn()
    if rc not in (0, None):
        raise RuntimeError(f"part exited with status {rc}:\n{buf.getvalue()}")
    return buf.getvalue()


def _run_json_part(main: Callable[[Sequence[str]], int], script: str, argv: List[str], path: Path) -> Dict:
    """Run a benchmark's ``main(argv + --json path)``; its JSON plus the printed table and command."""
    table = _tee_stdout(lambda: main(argv + ["--json", str(path)]))
    payload = json.loads(path.read_text())
    payload["table"] = table
    payload["command"] = f"python benchmark/{script} " + " ".join(argv)
    return payload


def micro_argv(quick: bool) -> List[str]:
    """The attention microbenchmark's grid (``topology_kv_candidate_schedule.py``), without device and cache."""
    if quick:
        return ["--seq-len", "4096", "--selected-tokens", "128", "256", "--rounds", "10", "--warmup", "3"]
    # the screening command line (16k context, 4 budgets)
    return ["--seq-len", "16384", "--selected-tokens", "128", "256", "512", "1024", "--heads", "16",
            "--head-dim", "64", "--rounds", "60", "--warmup", "20"]


def policy_argv(quick: bool) -> List[str]:
    """The policy overhead bench's grid (``topology_kv_policy_bench.py``), without the device."""
    if quick:
        return ["--quick"]
    return ["--rows", "1", "8", "64", "1024", "--lengths", "8192", "131072", "--rounds", "5", "--warmup", "1"]


def run_micro(out_dir: Path, quick: bool, device: str) -> Dict:
    """Cold caches are the headline (serving never finds the KV in the last-level cache);
    the warm run (a hot loop) is a side column."""
    from benchmark.candidates import schedule_bench as micro

    argv = micro_argv(quick)
    cold = _run_json_part(micro.main, "topology_kv_candidate_schedule.py", argv + ["--device", device,
                          "--cache", "cold"], out_dir / "micro.json")
    warm = _run_json_part(micro.main, "topology_kv_candidate_schedule.py", argv + ["--device", device,
                          "--cache", "warm"], out_dir / "micro_warm.json")
    cold["warm"] = warm
    cold["markdown"] = micro_markdown(cold["rows"], warm["rows"])
    (out_dir / "micro.json").write_text(json.dumps(cold, indent=2, default=str))
    return cold


def micro_markdown(cold: List[Dict], warm: List[Dict]) -> str:
    """Cold-cache figures, warm speedup beside them (every column stays in the JSON)."""
    by_budget = {r["selected_tokens"]: r for r in warm}
    lines = ["| seq_len | selected | dense ms (cold) | selected ms (cold) | speedup (cold) | ideal | "
             "fraction of ideal (cold) | speedup (warm) |", "|---|---|---|---|---|---|---|---|"]
    for r in cold:
        w = by_budget.get(r["selected_tokens"])
        dense_ms = min(r["dense_sdpa_ms"], r["dense_matmul_ms"])
        lines.append(f"| {r['seq_len']} | {r['selected_tokens']} | {dense_ms:.2f} | {r['sparse_selected_ms']:.3f} | "
                     f"{r['speedup']:.1f} | {r['ideal_speedup']:.0f} | {r['fraction_of_ideal']:.2f} | "
                     f"{'-' if w is None else format(w['speedup'], '.1f')} |")
    return "\n".join(lines)


def run_policy(out_dir: Path, quick: bool, device: str) -> Dict:
    from benchmark.candidates import policy_bench as bench

    payload = _run_json_part(bench.main, "topology_kv_policy_bench.py", policy_argv(quick) + ["--device", device],
                             out_dir / "policy.json")
    payload["markdown"] = policy_markdown(payload["rows"])
    return payload


def policy_markdown(rows: List[Dict]) -> str:
    """The policy bench's rows: cold-cache figures (the serving-like headline), warm ones
    beside where the JSON has them."""
    lines = ["| mode | backend | rows | L | learned scores | layer call us | public entry us | topk us | "
             "layer / topk | public / topk | warm: layer us / topk us / ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    def us(r, key):
        return None if r.get(key) is None else r[key] * 1e3

    for r in rows:
        warm = (f"{fmt(r.get('layer_warm_us'), '.0f')} / {fmt(us(r, 'topk_warm_ms'), '.0f')} / "
                f"{fmt(r.get('layer_over_topk_warm'), '.3f')}")
        lines.append(f"| {r['mode']} | {r.get('backend', 'torch')} | {r['rows']} | {r['seq_len']} | "
                     f"{'yes' if r['learned_scores'] else 'no'} | {fmt(us(r, 'layer_ms'), '.0f')} | "
                     f"{r['policy_ms'] * 1e3:.0f} | {fmt(us(r, 'topk_ms'), '.0f')} | "
                     f"{fmt(r.get('layer_over_topk'), '.3f')} | {fmt(r.get('policy_over_topk'), '.3f')} | {warm} |")
    return "\n".join(lines)


def run_e2e(out_dir: Path, quick: bool, device: str) -> Dict:
    from benchmark.e2e import cli as e2e

    argv = ["--quick"] if quick else ["--contexts", "2048", "8192", "--batches", "1", "8", "--new-tokens", "8",
                                      "--warmup", "2"]
    argv += ["--device", device]
    payload = _run_json_part(e2e.main, "topology_kv_decode_e2e.py", argv, out_dir / "e2e.json")
    payload["markdown"] = e2e.format_table(payload["rows"])
    payload["targets_text"] = e2e.format_targets(payload["targets"])
    payload["counters_markdown"] = e2e.format_counter_table(payload["rows"])
    return payload


def run_quality(out_dir: Path, quick: bool, device: str) -> Dict:
    from benchmark.quality import cli

    qdir = out_dir / "quality"
    argv = ["--contexts", "512", "--budgets", "1/4", "--num-layers", "4"] if quick else []
    argv += ["--out-dir", str(qdir)]
    text = _tee_stdout(lambda: cli.main(argv))
    payload = json.loads((qdir / "results.json").read_text())
    payload["printed"] = text
    payload["command"] = "python benchmark/topology_kv_quality.py " + " ".join(argv[:-2])
    return payload


RUNNERS = {"micro": run_micro, "policy": run_policy, "e2e": run_e2e, "quality": run_quality}


# ---------------------------------------------------------------------------------------
# Plots.
# ---------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_micro(payload: Dict, path: Path) -> Path:
    plt = _plt()
    rows = payload["rows"]
    budgets = [r["selected_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, [r["speedup"] for r in rows], "o-", label="measured speedup")
    ax.plot(budgets, [r["ideal_speedup"] for r in rows], "k--", label="ideal (seq_len / selected)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("selected tokens")
    ax.set_ylabel("dense time / selected time")
    ax.set_title(f"Decode attention, seq_len {rows[0]['seq_len']} ({payload.get('environment', {}).get('device', '')})")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_e2e(payload: Dict, path: Path) -> Path:
    """Step breakdown per variant, one panel per (context, batch)."""
    plt = _plt()
    rows = payload["rows"]
    keys = sorted({(r["context"], r["batch"], r["rows_per_request"]) for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    parts = ("indexer_ms", "policy_ms", "attention_ms", "rest_ms")
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        bottom = [0.0] * len(variants)
        by_v = {r["variant"]: r for r in rows if (r["context"], r["batch"], r["rows_per_request"]) == key}
        for part in parts:
            vals = [by_v[v][part] if v in by_v else 0.0 for v in variants]
            ax.bar(range(len(variants)), vals, bottom=bottom, label=part.replace("_ms", ""))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(variants)))
        ax.set_xticklabels([v.replace("learned+topology_", "+") for v in variants], rotation=45, ha="right",
                           fontsize=8)
        ax.set_title(f"context {key[0]}, batch {key[1]}" + (f", {key[2]} rows" if key[2] > 1 else ""))
    axes[0][0].set_ylabel("ms per decode step (median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("End-to-end decode step breakdown")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_e2e_batch(payload: Dict, path: Path) -> Path:
    """Median step time vs batch size per variant (the e2e benchmark's own plot)."""
    from benchmark.e2e.report import plot_step_vs_batch

    return plot_step_vs_batch(payload["rows"], path)


# ---------------------------------------------------------------------------------------
# Summary and markdown.
# ---------------------------------------------------------------------------------------


def summarize(results: Dict[str, Dict]) -> Dict[str, object]:
    """Gate verdicts, best trade-off and where the time goes, from the parts' payloads."""
    summary: Dict[str, object] = {}
    q = results.get("quality")
    if q:
        summary["gate"] = {g["mode"]: g["status"] for g in q.get("gate", [])}
    e = results.get("e2e")
    if e:
        rows = [r for r in e["rows"] if r["rows_per_request"] == 1] or e["rows"]
        top = max(r["context"] for r in rows)
        big = max(r["batch"] for r in rows if r["context"] == top)
        at = [r for r in rows if r["context"] == top and r["batch"] == big]
        dense = next(r for r in at if r["variant"] == "dense")
        best = max((r for r in at if r["variant"] != "dense"), key=lambda r: r["speedup_vs_dense"], default=None)
        learned = next((r for r in at if r["variant"] == "learned"), None)
        focus = learned or dense
        total = sum(focus[f"{p}_ms"] for p in ("indexer", "policy", "attention", "rest"))
        summary["where_time_goes"] = {
            "context": top,
            "batch": big,
            "variant": focus["variant"],
            **{p: focus[f"{p}_ms"] / total for p in ("indexer", "policy", "attention", "rest")},
        }
        if best is not None:
            summary["best_e2e_tradeoff"] = {
                "context": top,
                "batch": big,
                "variant": best["variant"],
                "speedup_vs_dense": best["speedup_vs_dense"],
                "kv_bytes_vs_dense": best["kv_bytes_vs_dense"],
                "top1_agreement": best["top1_agreement"],
                "mean_kl": best["mean_kl"],
                "dense_step_ms": dense["step_ms_median"],
            }
        summary["e2e_targets"] = {t["target"] + f" (context {t['context']})": t["passed"] for t in e["targets"]}
    m = results.get("micro")
    if m:
        summary["micro_fraction_of_ideal"] = {str(r["selected_tokens"]): r["fraction_of_ideal"] for r in m["rows"]}
        summary["micro_cache"] = "cold"
    p = results.get("policy")
    if p:
        summary["policy_targets"] = {t["target"]: t["passed"] for t in p.get("targets", [])}
    return summary


def _fence(text: str) -> str:
    return "```\n" + text.strip() + "\n```\n"


def markdown(results: Dict[str, Dict], summary: Dict, env: Dict, plots: Dict[str, str]) -> str:
    lines = ["# Topology KV candidate policy: validation report", ""]
    lines += [f"Machine: {env['machine']} ({env['cpu_count']} CPUs), torch {env['torch']}, "
              f"{env['threads']} threads, device {env['device']}. Generated {env['date']}.", ""]
    lines += ["## Summary", "", _fence(format_summary(summary))]
    if "micro" in results:
        m = results["micro"]
        lines += ["## 1. Attention microbenchmark (not a serving speedup)", "",
                  "Decode attention of one query over `seq_len` cached tokens vs over the selected tokens "
                  "only, synthetic K/V. Includes the gather of the selected rows; excludes the indexer, the "
                  "policy, the rest of the model. `schedule_ms` (building the candidate set) is timed apart.",
                  "Headline: cold caches (a 256 MiB buffer rewritten before every call; serving never "
                  "finds the KV in the last-level cache); the warm speedup (hot loop) is the side column.",
                  "", f"Command: `{m['command']}` (and `--cache warm`)", "", m["markdown"], ""]
        if "micro" in plots:
            lines += [f"![speedup vs budget]({plots['micro']})", ""]
    if "policy" in results:
        p = results["policy"]
        lines += ["## 2. Policy overhead", "",
                  "The layer call (`TopologyKVLayerPolicy.run`, what the `Indexer` runs) and the public "
                  "entry `apply_topology_kv_policy` (no host sync, caller buffers) per backend, timed "
                  "interleaved, on synthetic index rows beside "
                  "`torch.topk` over the indexer logits it follows and a plain copy of the rows. "
                  "Each call is timed cold, right after the caches were evicted (as after a model layer, "
                  "serving's case; the targets read these), and warm straight after (last column). "
                  "Excludes the indexer's logits and the attention.", "", f"Command: `{p['command']}`", "",
                  p["markdown"], ""]
    if "e2e" in results:
        e = results["e2e"]
        lines += ["## 3. End-to-end decode step", "",
                  "The real model decoding greedily after a dense prefill, every variant from the same "
                  "prefilled state, ratios measured side by side in this run. Includes everything in a "
                  "decode step (indexer scan, policy, attention, MLPs, lm_head).", "",
                  f"Command: `{e['command']}`", "",
                  f"Proxy indexer: `{e['indexer']['preset']}` ({e['indexer']['heads']} heads x "
                  f"{e['indexer']['dim']} dims, {e['indexer']['ratio_to_attention']:.3f} of attention's "
                  "multiply-adds per key). Peak memory: the step's transient peak (VmHWM - VmRSS around "
                  "step 0 after malloc_trim) plus the counted shared and per-variant tensors.", "",
                  e["markdown"], "", _fence(e["targets_text"]),
                  "Policy counters, every decode step summed over layers: the totals the metrics "
                  "exporter reports for the same steps (docs/metrics.md).", "", e["counters_markdown"], ""]
        for key, title in (("e2e_batch", "step time vs batch"), ("e2e", "decode breakdown")):
            if key in plots:
                lines += [f"![{title}]({plots[key]})", ""]
    if "quality" in results:
        q = results["quality"]
        lines += ["## 4. Quality gate", "", f"Command: `{q['command']}` (full report: `quality/report.md`)", "",
                  _fence(q["printed"].split("\nmodel load")[0])]
        for name in ("ppl_ratio_vs_budget.png",):
            if (Path(plots.get("_dir", ".")) / "quality" / name).exists():
                lines += [f"![perplexity ratio](quality/{name})", ""]
    return "\n".join(lines)


def format_summary(summary: Dict) -> str:
    out = []
    gate = summary.get("gate")
    if gate:
        out.append("Quality gate: " + ", ".join(f"{m} {s}" for m, s in gate.items()))
    best = summary.get("best_e2e_tradeoff")
    if best:
        out.append(
            f"Best end-to-end trade-off at context {best['context']}, batch {best['batch']}: {best['variant']} "
            f"speedup {best['speedup_vs_dense']:.2f}x over dense ({best['dense_step_ms']:.1f} ms per dense step), "
            f"KV bytes {best['kv_bytes_vs_dense']:.2f}x dense, top-1 agreement with dense "
            f"{best['top1_agreement']:.3f}, mean KL {best['mean_kl']:.4f}"
        )
    where = summary.get("where_time_goes")
    if where:
        out.append(
            f"Where a decode step goes ({where['variant']}, context {where['context']}, batch {where['batch']}): "
            + ", ".join(f"{p} {where[p] * 100:.0f}%" for p in ("indexer", "policy", "attention", "rest"))
        )
    e2e_targets = summary.get("e2e_targets")
    if e2e_targets:
        for name, passed in e2e_targets.items():
            out.append(f"E2E target {'NOT RUN' if passed is None else ('PASS' if passed else 'FAIL')}: {name}")
    micro = summary.get("micro_fraction_of_ideal")
    if micro:
        out.append("Microbenchmark fraction of ideal (cold caches): " + ", ".join(f"{k}: {v:.2f}" for k, v in micro.items()))
    targets = summary.get("policy_targets")
    if targets:
        passed = sum(1 for v in targets.values() if v)
        out.append(f"Policy overhead targets: {passed}/{len(targets)} PASS")
    return "\n".join(out)


def environment(device: str) -> Dict[str, object]:
    return {
        "machine": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="report", help="output folder (default report/)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), help=f"subset of {list(PARTS)}")
    p.add_argument("--quick", action="store_true", help="~2 minute smoke version of every part")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (the micro, policy and e2e parts; the quality gate runs on the CPU)")
    args = p.parse_args(argv)
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown {unknown}; expected a subset of {list(PARTS)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu, cuda or auto, got {args.device!r}")
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    from benchmark.cli_checks import FlagError, check_output_dir
    from benchmark.quality.paths import user_path

    try:  # before hours of parts, not when the report is written
        check_output_dir("--out-dir", user_path(args.out_dir))
    except FlagError as err:
        p.error(str(err))
    return args


# Everything the report writes into --out-dir, and nothing else: a rerun replaces these and
# leaves every other entry of the folder alone (report/ also holds other commands' outputs).
REPORT_OUTPUTS = ("report.md", "report.json", "micro.json", "micro_warm.json", "policy.json", "e2e.json",
                  "quality", "speedup_vs_budget.png", "e2e_breakdown.png", "e2e_step_vs_batch.png")


def clear_previous_report(out_dir: Path) -> None:
    """Make ``out_dir`` (with its parents) and remove a previous report's :data:`REPORT_OUTPUTS`
    from it, so no stale part survives a run that skips it; other entries stay."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in REPORT_OUTPUTS:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from benchmark.quality.paths import user_path

    out_dir = user_path(args.out_dir)
    clear_previous_report(out_dir)
    results: Dict[str, Dict] = {}
    timing: Dict[str, float] = {}
    for i, part in enumerate(args.parts):
        print(f"[report] part {i + 1}/{len(args.parts)}: {part} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        results[part] = RUNNERS[part](out_dir, args.quick, args.device)
        timing[part] = time.perf_counter() - t0
        print(f"[report] {part} done in {timing[part]:.0f} s", file=sys.stderr, flush=True)
    plots: Dict[str, str] = {"_dir": str(out_dir)}
    if "micro" in results:
        plots["micro"] = plot_micro(results["micro"], out_dir / "speedup_vs_budget.png").name
    if "e2e" in results:
        plots["e2e"] = plot_e2e(results["e2e"], out_dir / "e2e_breakdown.png").name
        plots["e2e_batch"] = plot_e2e_batch(results["e2e"], out_dir / "e2e_step_vs_batch.png").name
    env = environment(args.device)
    summary = summarize(results)
    (out_dir / "report.md").write_text(markdown(results, summary, env, plots))
    report = {"environment": env, "settings": {"quick": args.quick, "parts": args.parts, "device": args.device},
              "timing_s": timing, "summary": summary, "parts": results,
              "plots": {k: v for k, v in plots.items() if not k.startswith("_")}}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print(format_summary(summary))
    print(f"report: {out_dir / 'report.md'}")
    return 0
