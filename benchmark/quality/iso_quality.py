"""Iso-quality budgets: per selector, the smallest budget as good as ``learned`` at 1/8.

For each context and selector of a grid, the smallest budget ``b`` whose perplexity is
not measurably worse than per-layer ``learned`` at the reference budget (1/8): the paired
bootstrap interval of ``ppl(selector at b) / ppl(learned at 1/8)`` (the same windows and
tokens) reaches 1 (its lower bound is <= 1). What that budget saves is the attention's KV
read per row, ``1 - b / (1/8)`` of ``learned``'s at 1/8 (sparse attention reads ``W``
tokens per row); a shared-scan selector (``learned-shared:K``) also scans the indexer keys
in only every ``K``-th sparse layer.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Dict, List, Optional, Sequence

from benchmark.quality.intervals import ratio_interval
from benchmark.quality.runner import GridResult
from benchmark.quality.shared_scans import scan_share

REFERENCE_BUDGET = Fraction(1, 8)


def iso_quality(
    grid: GridResult, selectors: Sequence[str], reference: Fraction = REFERENCE_BUDGET,
    scans: Optional[Callable[[str], float]] = None,
) -> List[Dict]:
    """One entry per (context, selector) with ``learned`` at ``reference`` in the grid:
    ``budget`` (None when no budget of the grid is as good), its ``interval``, ``kv_read``
    (the attention's KV read relative to ``learned`` at ``reference``) and ``scans`` (the
    share of sparse layers that scan: ``scans(name)``, default :func:`scan_share` without
    the model's layers, ``1/K`` for ``learned-shared:K``)."""
    scans = scan_share if scans is None else scans
    out = []
    for ctx in sorted(grid.dense):
        ref = grid.cell(ctx, reference, "learned")
        if ref is None:
            continue
        for name in selectors:
            cells = sorted((c for c in grid.cells if c.context == ctx and c.selector == name), key=lambda c: c.budget)
            if not cells:
                continue
            found: Optional[Dict] = None
            for c in cells:
                iv = ratio_interval(c.window_nll, ref.window_nll, grid.bootstrap, point=c.ppl / ref.ppl)
                if iv.lo <= 1.0:
                    found = {"budget": c.budget, "width": c.width, "interval": iv, "kv_read": float(c.budget / reference)}
                    break
            out.append({"context": ctx, "selector": name, "scans": scans(name),
                        "budgets": [str(c.budget) for c in cells], **(found or {"budget": None})})
    return out


def iso_quality_markdown(entries: Sequence[Dict], reference: Fraction = REFERENCE_BUDGET) -> List[str]:
    if not entries:
        return []
    out = [f"## Iso-quality budgets (as good as `learned` at {reference})", "",
           f"The smallest budget whose paired 95% interval of ppl / ppl(`learned` at {reference}) reaches 1; "
           "KV read: the sparse attention's tokens per row relative to `learned` at "
           f"{reference}; scans: the share of sparse layers that run the indexer.", "",
           f"| ctx | selector | budgets run | smallest budget at learned@{reference} quality | W | "
           f"ppl / learned@{reference} [95% CI] | KV read | scans |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        if e["budget"] is None:
            out.append(f"| {e['context']} | {e['selector']} | {', '.join(e['budgets'])} | none of them | - | - | - | "
                       f"{e['scans']:.2f} |")
        else:
            out.append(f"| {e['context']} | {e['selector']} | {', '.join(e['budgets'])} | {e['budget']} | "
                       f"{e['width']} | {e['interval'].describe()} | {e['kv_read']:.2f} | {e['scans']:.2f} |")
    return out


def iso_quality_json(entries: Sequence[Dict]) -> List[Dict]:
    return [{**e, "budget": None if e["budget"] is None else str(e["budget"]),
             "scans": None if math.isnan(e["scans"]) else e["scans"],
             "interval": e["interval"].to_json() if e.get("interval") is not None else None} for e in entries]
