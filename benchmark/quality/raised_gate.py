"""The raised gate: topology candidates must earn their place.

Checks, each printed PASS/FAIL/n/a with its numbers (perplexity over the whole window):

1. *No harm*: at every budget the best merge mode (``topology_sparse_merge``,
   ``topology_compress_sparse``) is within ``max_regression`` (+0.1%) of ``learned``
   alone, and strictly better than it at budgets ``>= strict_from`` (1/8). Both judged on
   the bootstrap interval of ``ppl(mode) / ppl(learned)``: "within" = its upper bound
   ``<= 1 + max_regression``, "better" = its upper bound ``< 1``.
2. *Safety net*: for each indexer failure mode (``learned-<f>``), the best merge mode on
   top of it (``learned-<f>+<mode>``) recovers at least ``min_recovery`` (half) of the
   perplexity the failure lost against dense, ``(ppl_f - ppl_merged) / (ppl_f - ppl_dense)``,
   at every budget where the failure lost anything.
3. *Witness signal*: ``topology_only`` (sink + local + witness blocks filling W) has a
   higher attention-mass recall than ``locality`` (sink + the most recent tokens, the same
   W) in more than half of the layers, at every budget (by more than ``recall_tie``).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import List, Sequence

from benchmark.quality.failure_modes import FAILURE_MODES
from benchmark.quality.gate import Check
from benchmark.quality.runner import GridResult

MERGE_MODES = ("topology_sparse_merge", "topology_compress_sparse")


@dataclasses.dataclass(frozen=True)
class RaisedGateThresholds:
    max_regression: float = 0.001
    strict_from: Fraction = Fraction(1, 8)
    min_recovery: float = 0.5
    # Recall differences below this are summation-order noise (identical selections in a
    # different order differ by ~1e-7), not a win.
    recall_tie: float = 1e-5


def raised_gate_selectors(selectors: Sequence[str]) -> List[str]:
    """``selectors`` plus what the raised gate needs, in a stable order."""
    out = list(selectors)
    need = ["learned", "locality", "topology_only", *MERGE_MODES]
    need += [f"learned-{f}" for f in FAILURE_MODES]
    need += [f"learned-{f}+{m}" for f in FAILURE_MODES for m in MERGE_MODES]
    for name in need:
        if name not in out:
            out.append(name)
    return out


def _best_merge(grid: GridResult, ctx: int, budget: Fraction, prefix: str = ""):
    cells = [grid.cell(ctx, budget, prefix + m) for m in MERGE_MODES]
    cells = [c for c in cells if c is not None]
    return min(cells, key=lambda c: c.ppl) if cells else None


def evaluate_raised_gate(grid: GridResult, thresholds: RaisedGateThresholds = RaisedGateThresholds()) -> List[Check]:
    checks: List[Check] = []
    contexts = sorted(grid.dense)
    budgets = sorted({c.budget for c in grid.cells})
    for ctx in contexts:
        for b in budgets:
            best, learned = _best_merge(grid, ctx, b), grid.cell(ctx, b, "learned")
            strict = b >= thresholds.strict_from
            name = (f"best merge vs learned at {b} (ctx {ctx}): 95% CI upper bound <= +{thresholds.max_regression * 100:g}%"
                    + (" and < 0 (strictly better)" if strict else ""))
            if best is None or learned is None:
                checks.append(Check(name, None, "not measured"))
                continue
            iv = grid.interval(ctx, b, best.selector, "learned")
            ok = iv.hi - 1.0 <= thresholds.max_regression and (not strict or iv.hi < 1.0)
            checks.append(Check(name, ok, f"{best.selector} {best.ppl:.3f} vs learned {learned.ppl:.3f} "
                                          f"({iv.describe_pct()})"))
    for f in FAILURE_MODES:
        for ctx in contexts:
            dense = grid.dense[ctx].ppl
            parts, ok, measured = [], True, False
            for b in budgets:
                failed, best = grid.cell(ctx, b, f"learned-{f}"), _best_merge(grid, ctx, b, f"learned-{f}+")
                if failed is None or best is None:
                    continue
                lost = failed.ppl - dense
                if lost <= 0:
                    parts.append(f"{b}: no loss ({failed.ppl:.3f} vs dense {dense:.3f})")
                    continue
                measured = True
                rec = (failed.ppl - best.ppl) / lost
                ok &= rec >= thresholds.min_recovery
                parts.append(f"{b}: {failed.ppl:.3f} -> {best.ppl:.3f} (dense {dense:.3f}), recovers {rec * 100:.0f}%")
            name = f"failure '{f}': merge recovers >= {thresholds.min_recovery * 100:.0f}% of the loss (ctx {ctx})"
            checks.append(Check(name, ok if measured else None, ", ".join(parts) or "not measured"))
    for ctx in contexts:
        parts, ok, measured = [], True, False
        for b in budgets:
            topo, loc = grid.cell(ctx, b, "topology_only"), grid.cell(ctx, b, "locality")
            if topo is None or loc is None:
                continue
            t_layers, l_layers = topo.metrics.layer_summary(), loc.metrics.layer_summary()
            common = sorted(set(t_layers) & set(l_layers))
            if not common:
                continue
            measured = True
            wins = sum(1 for i in common
                       if t_layers[i]["recall_mean"] > l_layers[i]["recall_mean"] + thresholds.recall_tie)
            ok &= wins * 2 > len(common)
            parts.append(f"{b}: {wins}/{len(common)} layers")
        name = f"witness signal: topology_only recall > locality in most layers (ctx {ctx})"
        checks.append(Check(name, ok if measured else None, ", ".join(parts) or "not measured"))
    return checks


def format_raised_gate(checks: Sequence[Check]) -> str:
    mark = {True: "PASS", False: "FAIL", None: "n/a"}
    return "\n".join(f"{mark[c.passed]:4s}  {c.name}: {c.detail}" for c in checks)
