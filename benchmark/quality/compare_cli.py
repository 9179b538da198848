"""Compare topology_kv_quality runs of the same grid: before/after tables, JSON and a plot.

    python benchmark/topology_kv_quality_compare.py --run before=DIR_A/results.json \
        --run after=DIR_B/results.json --out-dir report/compare

Prints a markdown table (per context, budget and selector: perplexity in each run, against
``learned``, ``locality`` and ``oracle`` of the same run, mean recall, layers where the
recall beats ``locality``) and, for runs made with ``--raised-gate``, the raised gate's
checks side by side; writes them to ``compare.md``, every figure to ``compare.json`` and
per-layer recall to ``layer_recall.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional


from benchmark.cli_checks import FlagError, check_output_dir
from benchmark.quality.compare import compare_rows, load_runs, markdown_table, plot_layer_recall, raised_gate_table
from benchmark.quality.errors import UsageError

PLOT_SELECTORS = ("learned", "locality", "topology_only")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", default=[], metavar="NAME=PATH",
                   help="a run: its name and results.json (repeat; the last is drawn solid)")
    p.add_argument("--selectors", default=None, help="comma list to show (default: every selector, grid order)")
    p.add_argument("--out-dir", default="report/topology_kv_quality_compare")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    runs = []
    for item in args.run:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--run: expected NAME=PATH, got {item!r}")
        runs.append((name, path))
    args.runs = runs
    try:
        check_output_dir("--out-dir", Path(args.out_dir))
    except FlagError as err:
        p.error(str(err))
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        runs = load_runs(args.runs)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    selectors = args.selectors.split(",") if args.selectors else None
    rows = compare_rows(runs, selectors)
    table = markdown_table(rows)
    raised = raised_gate_table(runs)
    if raised:
        table += "\n\nRaised gate:\n\n" + raised
    print(table)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(table + "\n")
    raised_json = {n: d.get("raised_gate") for n, d in runs}
    (out / "compare.json").write_text(json.dumps({"runs": [n for n, _ in runs], "rows": rows,
                                                  "raised_gate": raised_json}, indent=1))
    written = [out / "compare.md", out / "compare.json"]
    if not args.no_plots:
        png = plot_layer_recall(runs, PLOT_SELECTORS, out / "layer_recall.png")
        if png is not None:
            written.append(png)
    print("outputs: " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0
