"""The shared-scan gate: can structure let most layers skip the indexer scan?

Checks, each printed PASS/FAIL/n/a with its numbers (perplexity over the whole window):

1. *Sharing with structure costs little*: at the budgets ``>= judged_from`` (1/8), the best
   merge mode on top of ``learned-shared:K`` (``learned-shared:K+<mode>``) is within
   ``max_regression[K]`` of per-layer ``learned``: +0.3% for ``K = 2``, +1.0% for
   ``K = 4``, judged on the upper bound of the bootstrap interval of
   ``ppl(shared + mode) / ppl(learned)``. Other budgets are printed, not judged.
2. *Structure recovers what sharing loses*: at every budget where sharing alone
   (``learned-shared:K``) measurably loses (the interval of ``ppl(shared) / ppl(learned)``
   lies above 1), the best merge on top recovers at least ``min_recovery`` (half) of it,
   ``(ppl_shared - ppl_shared_merged) / (ppl_shared - ppl_learned)``. A loss inside the
   interval's noise is printed, not judged: the fraction of it recovered is noise too
   (with a loss of +0.06% [-0.10%, +0.25%] it can be anything from far below 0 to far
   above 1).

``--shared-gate`` adds the selectors it needs (:func:`shared_gate_selectors`); the merge
modes it judges are those of the run (``topology_sparse_merge`` by default, plus
``topology_compress_sparse`` or the profile's entries, ``+profile``, when ``--selectors``
names their shared variants). A calibrated scanning set (``learned-shared:profile``, with
``--profile FILE`` and those selectors named) is judged the same way, against the bound of
the every-``K`` pattern with as many scanning layers or fewer: a set scanning at least half
the layers against +0.3%, one scanning at least a quarter against +1.0%.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, List, Optional, Sequence

from benchmark.quality.gate import Check
from benchmark.quality.runner import GridResult
from benchmark.quality.shared_scans import MERGE_MODES, PROFILE_MODE, PROFILE_SCAN, SHARED_PREFIX

SHARES = (2, 4)


@dataclasses.dataclass(frozen=True)
class SharedGateThresholds:
    max_regression: Dict[int, float] = dataclasses.field(default_factory=lambda: {2: 0.003, 4: 0.010})
    judged_from: Fraction = Fraction(1, 8)
    min_recovery: float = 0.5


def shared_gate_selectors(selectors: Sequence[str]) -> List[str]:
    """``selectors`` plus what the gate needs, in a stable order."""
    out = list(selectors)
    need = ["learned"]
    for k in SHARES:
        need += [f"{SHARED_PREFIX}{k}", f"{SHARED_PREFIX}{k}+{MERGE_MODES[0]}"]
    for name in need:
        if name not in out:
            out.append(name)
    return out


def _best_shared_merge(grid: GridResult, ctx: int, budget: Fraction, k):
    cells = [grid.cell(ctx, budget, f"{SHARED_PREFIX}{k}+{m}") for m in MERGE_MODES + (PROFILE_MODE,)]
    cells = [c for c in cells if c is not None]
    return min(cells, key=lambda c: c.ppl) if cells else None


def _configurations(grid: GridResult, thresholds: SharedGateThresholds, profile_scan_fraction: Optional[float]):
    """``(scan name, label, bound)`` of each judged pattern: every ``K``, and the profile's set
    when its cells are in the grid (its bound: the smallest ``K`` with ``1/K`` <= its share;
    a set scanning under a quarter of the layers is not judged)."""
    out = [(k, f"every {k}", thresholds.max_regression[k]) for k in SHARES]
    if profile_scan_fraction is not None and any(c.selector.startswith(f"{SHARED_PREFIX}{PROFILE_SCAN}")
                                                 for c in grid.cells):
        fitting = [k for k in SHARES if 1.0 / k <= profile_scan_fraction + 1e-9]
        if fitting:
            k = min(fitting)
            out.append((PROFILE_SCAN, f"by the profile ({profile_scan_fraction:.2f} of the layers scan)",
                        thresholds.max_regression[k]))
    return out


def evaluate_shared_gate(
    grid: GridResult, thresholds: SharedGateThresholds = SharedGateThresholds(),
    profile_scan_fraction: Optional[float] = None,
) -> List[Check]:
    """The checks above per context; ``profile_scan_fraction``: the ``--profile``'s scanning
    layers / sparse layers (None: no profile scanning set)."""
    checks: List[Check] = []
    budgets = sorted({c.budget for c in grid.cells})
    configs = _configurations(grid, thresholds, profile_scan_fraction)
    for ctx in sorted(grid.dense):
        for k, label, bound in configs:
            parts, ok, measured = [], True, False
            for b in budgets:
                best, learned = _best_shared_merge(grid, ctx, b, k), grid.cell(ctx, b, "learned")
                if best is None or learned is None:
                    continue
                iv = grid.interval(ctx, b, best.selector, "learned")
                judged = b >= thresholds.judged_from
                if judged:
                    measured = True
                    ok &= iv.hi - 1.0 <= bound
                parts.append(f"{b}{'' if judged else ' (not judged)'}: {best.selector} {best.ppl:.3f} vs learned "
                             f"{learned.ppl:.3f} ({iv.describe_pct()})")
            name = (f"shared {label} + best merge vs learned at >= {thresholds.judged_from} (ctx {ctx}): "
                    f"95% CI upper bound <= +{bound * 100:g}%")
            checks.append(Check(name, ok if measured else None, "; ".join(parts) or "not measured"))
        for k, label, _ in configs:
            parts, ok, measured = [], True, False
            for b in budgets:
                shared, learned = grid.cell(ctx, b, f"{SHARED_PREFIX}{k}"), grid.cell(ctx, b, "learned")
                best = _best_shared_merge(grid, ctx, b, k)
                if shared is None or learned is None or best is None:
                    continue
                lost = shared.ppl - learned.ppl
                iv = grid.interval(ctx, b, shared.selector, "learned")
                if lost <= 0:
                    parts.append(f"{b}: sharing alone loses nothing ({shared.ppl:.3f} vs learned {learned.ppl:.3f})")
                    continue
                if iv.lo <= 1.0:
                    parts.append(f"{b}: sharing alone loses nothing measurable ({iv.describe_pct()} vs learned)")
                    continue
                measured = True
                rec = (shared.ppl - best.ppl) / lost
                ok &= rec >= thresholds.min_recovery
                parts.append(f"{b}: shared {shared.ppl:.3f} ({iv.describe_pct()} vs learned) -> {best.ppl:.3f} "
                             f"(learned {learned.ppl:.3f}), recovers {rec * 100:.0f}%")
            name = (f"shared {label}: merge recovers >= {thresholds.min_recovery * 100:.0f}% of what sharing "
                    f"loses (ctx {ctx})")
            checks.append(Check(name, ok if measured else (True if parts else None), "; ".join(parts) or "not measured"))
    return checks


def format_shared_gate(checks: Sequence[Check]) -> str:
    mark = {True: "PASS", False: "FAIL", None: "n/a"}
    return "\n".join(f"{mark[c.passed]:4s}  {c.name}: {c.detail}" for c in checks)
