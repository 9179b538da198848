"""The gate: PASS / FAIL per policy mode, with the numbers behind each check.

Checks for a policy mode (perplexity over the whole text window, every context run):

1. quality at the gate budget: ``ppl(mode) / ppl(dense) <= max_ppl_ratio`` (1.01 at 1/4);
2. no harm to the indexer: ``ppl(mode) / ppl(learned) - 1 <= max_regression_vs_learned``
   (0.2 %) at every budget;
3. better than the null models: ``ppl(mode) < ppl(locality)`` and ``< ppl(random)`` at
   every budget.

A check whose inputs were not run (budget or selector left out) is *not measured*; a
mode with no failing check but an unmeasured one is INCOMPLETE. A FAIL is a finding.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

from benchmark.quality.runner import GridResult

NULL_MODELS = ("locality", "random")


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


def evaluate_gate(grid: GridResult, modes: Sequence[str], thresholds: GateThresholds) -> List[Verdict]:
    """One :class:`Verdict` per policy mode that was run."""
    contexts = sorted(grid.dense)
    budgets = sorted({c.budget for c in grid.cells})
    verdicts = []
    for mode in modes:
        checks = []
        # 1. perplexity ratio at the gate budget.
        for ctx in contexts:
            ratio = grid.ppl_ratio(ctx, thresholds.gate_budget, mode)
            name = f"ppl/dense <= {thresholds.max_ppl_ratio:g} at budget {thresholds.gate_budget} (ctx {ctx})"
            if ratio is None:
                checks.append(Check(name, None, "not measured (budget or mode not in the grid)"))
            else:
                checks.append(Check(name, ratio <= thresholds.max_ppl_ratio, f"{ratio:.4f}"))
        # 2. never worse than learned alone by more than the allowed regression.
        for ctx in contexts:
            worst, parts, missing = None, [], False
            for b in budgets:
                mine, learned = grid.cell(ctx, b, mode), grid.cell(ctx, b, "learned")
                if mine is None or learned is None:
                    missing = True
                    continue
                reg = mine.ppl / learned.ppl - 1.0
                parts.append(f"{b}: {reg * 100:+.2f}%")
                worst = reg if worst is None else max(worst, reg)
            name = f"ppl/learned - 1 <= {thresholds.max_regression_vs_learned * 100:g}% at every budget (ctx {ctx})"
            if worst is None:
                checks.append(Check(name, None, "not measured (learned not in the grid)"))
            else:
                ok = worst <= thresholds.max_regression_vs_learned
                checks.append(Check(name, None if (ok and missing) else ok, ", ".join(parts)))
        # 3. better than each null model at every budget.
        for null in NULL_MODELS:
            for ctx in contexts:
                parts, ok, measured = [], True, False
                for b in budgets:
                    mine, base = grid.cell(ctx, b, mode), grid.cell(ctx, b, null)
                    if mine is None or base is None:
                        continue
                    measured = True
                    better = mine.ppl < base.ppl
                    ok &= better
                    parts.append(f"{b}: {mine.ppl:.3f} vs {base.ppl:.3f}")
                name = f"ppl < {null} at every budget (ctx {ctx})"
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
