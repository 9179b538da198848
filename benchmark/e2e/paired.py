"""Paired comparisons of variants decoded in the same rounds: the order that balances them,
and intervals for what the targets compare.

Order. In every decode step dense runs first (the others compare with its distribution),
then every other variant once, in the order of one row of a *Williams design*
(:func:`balanced_orders`): over a full cycle each variant runs in each position equally
often and right after each other variant equally often (for ``n`` variants the cycle is
``n`` steps when ``n`` is even, ``2 n`` when odd). A variant's step time depends on what ran
just before it (caches, allocator, frequency), so an order that always puts ``learned``
right before a merge mode biases their paired ratio by position; the balanced order makes
that carry-over cancel over each whole cycle.

Step-time ratio. Step ``i`` of two variants ran in the same round, so the per-step ratios
``row_i / base_i`` divide out a slow patch of the machine; the ratio reported is their
median, with the sign test's distribution-free interval for a median
(:func:`median_interval`): order statistics ``[r_(k), r_(n+1-k)]``, ``k`` the largest with
``P(Binomial(n, 1/2) < k) <= (1 - level) / 2``. It assumes nothing about the noise's shape,
only that the rounds are exchangeable; below 6 steps even ``[min, max]`` covers less than
95 %, and the coverage actually reached is reported beside it.

KL difference. The mean over steps and rows of ``KL(dense || variant) - KL(dense || base)``
(the same teacher-forced contexts for both), with a seeded percentile bootstrap over steps
(each step's rows drawn together) (:func:`mean_difference_interval`). A run of several
prompts decodes the same number of steps from each, so the bootstrap is stratified by
prompt: each replicate draws every prompt's steps from that prompt alone. Prompts differ in
level far more than steps of one prompt do (on one novel ``learned``'s KL ranged 0.004-0.049
over four prompts), and a draw across prompts would add that spread, which the design
fixes, to the interval. Steps of one request are not independent (the context grows by one
token), so the interval is narrower than the truth by an unknown amount: it tells noise
from a clear difference, no more.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence

import torch

LEVEL = 0.95
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0


def balanced_orders(n: int) -> List[List[int]]:
    """The rows of a Williams design for ``n`` treatments ``0 .. n-1``: a Latin square whose
    rows, taken in turn, put each treatment right after each other one equally often (once
    for even ``n``; odd ``n`` adds the mirrored rows, twice). ``n`` < 1: no rows."""
    if n < 1:
        return []
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    rows = [[(t + shift) % n for t in first] for shift in range(n)]
    if n % 2 and n > 1:
        rows += [row[::-1] for row in rows]
    return rows


def cycle_length(n: int) -> int:
    """Steps in one full cycle of :func:`balanced_orders` for ``n`` variants (at least 1)."""
    return max(1, len(balanced_orders(n)))


@dataclasses.dataclass(frozen=True)
class MedianInterval:
    """A median of paired values and its sign-test interval; ``coverage`` is the level the
    order statistics reach (at least the asked level once there are enough values)."""

    point: float
    lo: float
    hi: float
    coverage: float
    n: int

    def holds(self, value: float) -> bool:
        return self.lo <= value <= self.hi

    def describe(self, digits: int = 3) -> str:
        return f"{self.point:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"

    def to_json(self):
        return {"point": self.point, "lo": self.lo, "hi": self.hi, "coverage": self.coverage, "n": self.n}


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile of ``values`` (``0 < q <= 1``; at least one value)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(math.ceil(q * len(s))) - 1))]


def _binomial_cdf_half(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, j) for j in range(0, k + 1)) / 2.0**n


def median_interval(values: Sequence[float], level: float = LEVEL) -> MedianInterval:
    """The median of ``values`` with its distribution-free (sign test) interval at ``level``.

    Raises ValueError on no values or a level outside (0, 1)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"median_interval: level: expected 0 < level < 1, got {level}")
    s = sorted(float(v) for v in values)
    n = len(s)
    if n == 0:
        raise ValueError("median_interval: values: expected at least one value, got none")
    median = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    tail = (1.0 - level) / 2
    k = 1
    while k + 1 <= (n + 1) // 2 and _binomial_cdf_half(n, k) <= tail:
        k += 1
    coverage = 1.0 - 2.0 * _binomial_cdf_half(n, k - 1)
    return MedianInterval(median, min(s[k - 1], median), max(s[n - k], median), coverage, n)


def paired_step_ratio(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Optional[MedianInterval]:
    """The median of ``a_i / b_i`` over steps decoded in the same rounds, with its interval;
    None when the two lists do not pair (missing, empty, or of different lengths)."""
    if not a or not b or len(a) != len(b):
        return None
    return median_interval([x / y for x, y in zip(a, b)], level)


@dataclasses.dataclass(frozen=True)
class DifferenceInterval:
    """A mean difference and its bootstrap percentile interval."""

    point: float
    lo: float
    hi: float

    def describe(self, digits: int = 4) -> str:
        return f"{self.point:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"

    def to_json(self):
        return {"point": self.point, "lo": self.lo, "hi": self.hi}


def strata_of(row) -> Optional[List[int]]:
    """The sizes of ``row``'s prompts in its per-step lists: ``len(prompt_offsets)`` equal
    parts of ``step_kl`` (every prompt decodes the same steps). None (one stratum) for a row of
    one prompt, a row without the fields, or steps that do not split evenly."""
    prompts = len(row.get("prompt_offsets") or ())
    steps = len(row.get("step_kl") or ())
    if prompts < 2 or steps == 0 or steps % prompts:
        return None
    return [steps // prompts] * prompts


def mean_difference_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL,
                             samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED,
                             strata: Optional[Sequence[int]] = None) -> Optional[DifferenceInterval]:
    """``mean(a - b)`` over paired units (steps) with a seeded percentile bootstrap interval
    that draws whole units; None when they do not pair. One unit: the interval is the point.

    ``strata``: the sizes of consecutive groups of units (the prompts, in order; they sum to
    the number of units). Each replicate then draws every group's units from that group alone,
    as many as it has, and averages them all; the point is unchanged. A group of one unit is
    its own value in every replicate. Raises ValueError for sizes that are not positive or do
    not sum to the number of units."""
    if not a or not b or len(a) != len(b):
        return None
    d = torch.tensor([x - y for x, y in zip(a, b)], dtype=torch.float64)
    point = float(d.mean())
    if strata is not None:
        sizes = [int(s) for s in strata]
        if any(s < 1 for s in sizes) or sum(sizes) != d.numel():
            raise ValueError(f"mean_difference_interval: strata: expected positive sizes summing to {d.numel()} "
                             f"units, got {list(strata)}")
    else:
        sizes = [d.numel()]
    if d.numel() < 2 or samples < 1:
        return DifferenceInterval(point, point, point)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx, start = [], 0
    for size in sizes:  # each group's draws index into that group only
        idx.append(start + torch.randint(0, size, (samples, size), generator=gen))
        start += size
    reps = d[torch.cat(idx, dim=1)].mean(dim=1)
    tail = (1.0 - level) / 2
    q = torch.quantile(reps, torch.tensor([tail, 1.0 - tail], dtype=torch.float64))
    return DifferenceInterval(point, min(float(q[0]), point), max(float(q[1]), point))
