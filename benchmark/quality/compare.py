"""Side-by-side comparison of quality runs (``results.json`` files of the same grid).

Used for before/after tables (docs/results.md, section 6): for every context and budget, each selector's
perplexity in each run, its position against ``learned``, ``locality`` and ``oracle`` of
the same run, its mean attention recall, and in how many layers its recall beats
``locality``'s. Runs must share the model, text, budgets and metric stride, and every
context two runs share must have the same dense perplexity (the same window); checked,
because comparing different grids is a mistake the table would hide.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from benchmark.quality.errors import UsageError
from benchmark.quality.raised_gate import RaisedGateThresholds

REFERENCES = ("learned", "locality", "oracle")
_SAME = ("model.gguf_sha256", "text.novel", "text.windows", "text.window_seed", "grid.budgets", "grid.metric_stride")


def _get(d: Dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def load_runs(named_paths: Sequence[Tuple[str, str]]) -> List[Tuple[str, Dict]]:
    """``[(name, results)]``; raises ``UsageError`` naming the file and the differing setting."""
    if not named_paths:
        raise UsageError("--run: expected at least one NAME=results.json")
    runs = []
    for name, path in named_paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--run {name}={path}: cannot read results.json: {exc}") from exc
        if not isinstance(data, dict) or "cells" not in data or "settings" not in data:
            raise UsageError(f"--run {name}={path}: expected a topology_kv_quality results.json (cells, settings)")
        runs.append((name, data))
    first_name, first = runs[0]
    for name, data in runs[1:]:
        for key in _SAME:
            a, b = _get(first["settings"], key), _get(data["settings"], key)
            if a != b:
                raise UsageError(f"--run {name}: {key} is {b!r}, but {first_name} has {a!r} (not the same grid)")
        # Contexts may differ (rows appear where a run has them), but a shared context must
        # be the same text window: its dense perplexity has to match.
        for ctx in set(first.get("dense", {})) & set(data.get("dense", {})):
            a, b = first["dense"][ctx]["ppl"], data["dense"][ctx]["ppl"]
            if abs(a - b) > 1e-6 * abs(a):
                raise UsageError(f"--run {name}: dense perplexity at context {ctx} is {b:.6f}, but {first_name} "
                                 f"has {a:.6f} (not the same text window)")
    return runs


def _index(data: Dict) -> Dict[Tuple[int, str, str], Dict]:
    return {(int(c["context"]), c["budget"], c["selector"]): c for c in data["cells"]}


def recall_wins(cell: Dict, against: Dict) -> Tuple[int, int]:
    """(layers where ``cell``'s mean recall beats ``against``'s, common layers), as the raised gate counts."""
    a, b = cell.get("per_layer") or {}, against.get("per_layer") or {}
    common = sorted(set(a) & set(b), key=int)
    tie = RaisedGateThresholds().recall_tie
    return sum(1 for k in common if a[k]["recall_mean"] > b[k]["recall_mean"] + tie), len(common)


def compare_rows(runs: Sequence[Tuple[str, Dict]], selectors: Optional[Sequence[str]] = None) -> List[Dict]:
    """One dict per (context, budget, selector, run) with the comparison figures."""
    rows = []
    for name, data in runs:
        idx = _index(data)
        order = list(data["settings"]["grid"]["selectors"])
        wanted = [s for s in (selectors or order)]
        for (ctx, budget, sel), cell in sorted(idx.items(), key=lambda kv: (kv[0][0], _frac(kv[0][1]))):
            if sel not in wanted:
                continue
            row = {"run": name, "context": ctx, "budget": budget, "width": cell["width"], "selector": sel,
                   "ppl": cell["ppl"], "ppl_ratio_dense": cell["ppl_ratio"],
                   "recall_mean": (cell.get("layers") or {}).get("recall_mean")}
            for ref in REFERENCES:
                other = idx.get((ctx, budget, ref))
                row[f"vs_{ref}"] = None if other is None else cell["ppl"] / other["ppl"] - 1.0
            loc = idx.get((ctx, budget, "locality"))
            row["recall_wins_vs_locality"] = None if loc is None or sel == "locality" else recall_wins(cell, loc)
            rows.append(row)
    run_order = {name: i for i, (name, _) in enumerate(runs)}
    rows.sort(key=lambda r: (r["context"], _frac(r["budget"]), _order(r["selector"], selectors or []),
                             run_order[r["run"]]))
    return rows


def _frac(budget: str) -> float:
    num, _, den = budget.partition("/")
    return float(num) / float(den or 1)


def _order(sel: str, selectors: Sequence[str]) -> int:
    return list(selectors).index(sel) if sel in selectors else len(selectors)


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.2f}%"


def markdown_table(rows: Sequence[Dict]) -> str:
    out = ["| ctx | budget | W | selector | run | ppl | vs learned | vs locality | vs oracle | recall | "
           "layers recall > locality |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        wins = r["recall_wins_vs_locality"]
        out.append(
            f"| {r['context']} | {r['budget']} | {r['width']} | {r['selector']} | {r['run']} | {r['ppl']:.3f} | "
            f"{_pct(r['vs_learned'])} | {_pct(r['vs_locality'])} | {_pct(r['vs_oracle'])} | "
            f"{'-' if r['recall_mean'] is None else format(r['recall_mean'], '.3f')} | "
            f"{'-' if wins is None else f'{wins[0]}/{wins[1]}'} |"
        )
    return "\n".join(out)


def raised_gate_table(runs: Sequence[Tuple[str, Dict]]) -> str:
    """The raised gate of every run that has one, a row per check: ``| check | run: verdict (numbers) |``."""
    have = [(name, data["raised_gate"]) for name, data in runs if data.get("raised_gate")]
    if not have:
        return ""
    mark = {True: "PASS", False: "FAIL", None: "n/a"}
    names = []
    for _, checks in have:
        for c in checks:
            if c["name"] not in names:
                names.append(c["name"])
    out = ["| check | " + " | ".join(name for name, _ in have) + " |", "|---|" + "---|" * len(have)]
    for check in names:
        cells = []
        for _, checks in have:
            c = next((c for c in checks if c["name"] == check), None)
            cells.append("-" if c is None else f"**{mark[c['passed']]}** {c['detail']}")
        out.append(f"| {check} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_layer_recall(runs: Sequence[Tuple[str, Dict]], selectors: Sequence[str], path: Path) -> Optional[Path]:
    """Per-layer mean recall: a row of panels per context, a column per budget; colour = selector,
    line style = run (dashed for the first run, solid for the second, ...)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional; the table and JSON carry every number
        return None
    contexts = sorted({int(c["context"]) for _, d in runs for c in d["cells"]})
    budgets = sorted({c["budget"] for _, d in runs for c in d["cells"]}, key=_frac)
    fig, axes = plt.subplots(len(contexts), len(budgets), figsize=(4.5 * len(budgets), 3.4 * len(contexts)),
                             squeeze=False)
    colors = {sel: f"C{i}" for i, sel in enumerate(selectors)}
    styles = ["--", "-", ":", "-."]
    for r, ctx in enumerate(contexts):
        for c, budget in enumerate(budgets):
            ax = axes[r][c]
            for i, (name, data) in enumerate(runs):
                idx = _index(data)
                for sel in selectors:
                    cell = idx.get((ctx, budget, sel))
                    if cell is None or not cell.get("per_layer"):
                        continue
                    layers = sorted(cell["per_layer"], key=int)
                    ax.plot([int(k) for k in layers], [cell["per_layer"][k]["recall_mean"] for k in layers],
                            color=colors[sel], linestyle=styles[i % len(styles)], label=f"{sel} ({name})")
            ax.set_title(f"ctx {ctx}, budget {budget}", fontsize=9)
            ax.set_xlabel("layer", fontsize=8)
            ax.set_ylabel("mean attention recall", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
