"""The gate: PASS / FAIL per policy mode, with the numbers behind each check.

Checks for a policy mode (perplexity over the whole text window, every context run):

1. quality at the gate budget: ``ppl(mode) / ppl(dense) <= max_ppl_ratio`` (1.01 at 1/4;
   the point estimate, with its interval printed);
2. no harm to the indexer: the upper bound of the bootstrap interval of
   ``ppl(mode) / ppl(learned)`` is ``<= 1 + max_regression_vs_learned`` (0.2 %) at every
   budget;
3. better than the null models: the upper bound of the interval of
   ``ppl(mode) / ppl(locality)`` (and ``random``) is ``< 1`` at every budget. For
   ``topology_only`` against ``locality`` the check is *never worse* (upper bound ``<= 1``):
   at the engine's defaults (recency witnesses) its rows are plain locality by construction
   (tested bit for bit), so "strictly better" cannot hold; the gate requires that it never lose.
   The same holds for the ``profile`` selector of a ``topology_only`` profile (locality with
   a calibrated sink count per layer): the harness adds that pair (:func:`never_worse_pairs`).

Intervals: :mod:`benchmark.quality.intervals` (paired chunk bootstrap over the text
windows); without per-token losses they collapse to the point estimates.

A check whose inputs were not run (budget or selector left out) is *not measured*; a
mode with no failing check but an unmeasured one is INCOMPLETE. A FAIL is a finding.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

from benchmark.quality.runner import GridResult

NULL_MODELS = ("locality", "random")
# (mode, null model) pairs checked as "never worse" (upper bound <= 1) instead of "better".
NEVER_WORSE = (("topology_only", "locality"),)


def never_worse_pairs(topology_only_selectors: Sequence[str] = ()):
    """:data:`NEVER_WORSE`, plus ``(selector, locality)`` for each selector serving ``topology_only``
    with a profile (locality with a calibrated sink count per layer)."""
    return NEVER_WORSE + tuple((s, "locality") for s in topology_only_selectors)


@dataclasses.dataclass(frozen=True)
class GateThresholds:
    max_ppl_ratio: float = 1.01
    gate_budget: Fraction = Fraction(1, 4)
    max_regression_vs_learned: float = 0.002


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    passed: Optional[bool]  # None = not measured
    detail: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    mode: str
    checks: Tuple[Check, ...]

    @property
    def status(self) -> str:
        if any(c.passed is False for c in self.checks):
            return "FAIL"
        if any(c.passed is None for c in self.checks):
            return "INCOMPLETE"
        return "PASS"


def check_mark(ok: Optional[bool]) -> str:
    return {True: "ok", False: "FAIL", None: "n/a"}[ok]


def evaluate_gate(
    grid: GridResult, modes: Sequence[str], thresholds: GateThresholds, never_worse=NEVER_WORSE
) -> List[Verdict]:
    """One :class:`Verdict` per policy mode that was run.

    ``never_worse``: (mode, null model) pairs checked as "never worse" instead of "better".
    """
    contexts = sorted(grid.dense)
    budgets = sorted({c.budget for c in grid.cells})
    verdicts = []
    for mode in modes:
        checks = []
        # 1. perplexity ratio at the gate budget.
        for ctx in contexts:
            iv = grid.interval(ctx, thresholds.gate_budget, mode)
            name = f"ppl/dense <= {thresholds.max_ppl_ratio:g} at budget {thresholds.gate_budget} (ctx {ctx})"
            if iv is None:
                checks.append(Check(name, None, "not measured (budget or mode not in the grid)"))
            else:
                checks.append(Check(name, iv.point <= thresholds.max_ppl_ratio, f"{iv.describe()} (95% CI)"))
        # 2. never worse than learned alone by more than the allowed regression.
        for ctx in contexts:
            worst, parts, missing = None, [], False
            for b in budgets:
                iv = grid.interval(ctx, b, mode, "learned")
                if iv is None:
                    missing = True
                    continue
                reg = iv.hi - 1.0
                parts.append(f"{b}: {iv.describe_pct()}")
                worst = reg if worst is None else max(worst, reg)
            name = (f"ppl/learned - 1 <= {thresholds.max_regression_vs_learned * 100:g}% at every budget "
                    f"(upper bound of the 95% CI; ctx {ctx})")
            if worst is None:
                checks.append(Check(name, None, "not measured (learned not in the grid)"))
            else:
                ok = worst <= thresholds.max_regression_vs_learned
                checks.append(Check(name, None if (ok and missing) else ok, ", ".join(parts)))
        # 3. better than each null model at every budget.
        for null in NULL_MODELS:
            tie_allowed = (mode, null) in never_worse
            for ctx in contexts:
                parts, ok, measured = [], True, False
                for b in budgets:
                    mine, base = grid.cell(ctx, b, mode), grid.cell(ctx, b, null)
                    if mine is None or base is None:
                        continue
                    measured = True
                    iv = grid.interval(ctx, b, mode, null)
                    ok &= iv.hi <= 1.0 if tie_allowed else iv.hi < 1.0
                    parts.append(f"{b}: {mine.ppl:.3f} vs {base.ppl:.3f}, ratio {iv.describe()}")
                name = (f"ppl <= {null} at every budget (95% CI of ppl/{null} at most 1; ctx {ctx})" if tie_allowed
                        else f"ppl < {null} at every budget (95% CI of ppl/{null} below 1; ctx {ctx})")
                detail = ", ".join(parts) or f"not measured ({null} not run)"
                checks.append(Check(name, ok if measured else None, detail))
        verdicts.append(Verdict(mode, tuple(checks)))
    return verdicts


def format_gate(verdicts: Sequence[Verdict]) -> str:
    """Plain-text gate report: one block per mode, one line per check."""
    lines = []
    for v in verdicts:
        lines.append(f"{v.status:10s} {v.mode}")
        for c in v.checks:
            lines.append(f"    [{check_mark(c.passed):4s}] {c.name}: {c.detail}")
    return "\n".join(lines)
