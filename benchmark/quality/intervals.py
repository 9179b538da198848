"""Bootstrap intervals for perplexity ratios (docs/quality.md, "Intervals").

Per-token losses of one window are not independent (a hard passage raises every
selector's loss for many tokens), so the resampling unit is a *chunk*: ``chunk``
consecutive scored tokens of one window (the last chunk of a window may be shorter;
chunks never straddle windows). A ratio ``ppl(a) / ppl(b)`` over the same tokens is
``exp((sum nll_a - sum nll_b) / n)``; one bootstrap replicate draws as many chunks as
there are, with replacement, *the same chunks for a and b* (paired: the difference is
what varies, not the text's difficulty), and recomputes the ratio over the drawn
chunks. The interval is the percentile interval of ``samples`` replicates (default
95 %: 2.5th and 97.5th percentiles). Seeded: the same inputs always give the same
interval.

With no per-token losses (hand-built results in tests, old JSON), the interval is the
point estimate itself (width 0), so checks fall back to the point comparison.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

import torch

DEFAULT_CHUNK = 128
DEFAULT_SAMPLES = 2000
DEFAULT_SEED = 0


@dataclasses.dataclass(frozen=True)
class BootstrapSettings:
    """chunk: tokens per resampling unit; samples: replicates; seed; level: coverage."""

    chunk: int = DEFAULT_CHUNK
    samples: int = DEFAULT_SAMPLES
    seed: int = DEFAULT_SEED
    level: float = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
    """A ratio and its bootstrap interval ``[lo, hi]`` (``lo == hi == point`` when not resampled)."""

    point: float
    lo: float
    hi: float

    def describe(self, digits: int = 4) -> str:
        return f"{self.point:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"

    def describe_pct(self) -> str:
        """As a change in percent: ``+0.12% [-0.30%, +0.50%]``."""
        p, lo, hi = ((x - 1.0) * 100 for x in (self.point, self.lo, self.hi))
        return f"{p:+.2f}% [{lo:+.2f}%, {hi:+.2f}%]"

    def to_json(self):
        return {"ratio": self.point, "lo": self.lo, "hi": self.hi}


def chunk_sums(windows: Sequence[torch.Tensor], chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``[K]`` loss sums and ``[K]`` token counts of each window's consecutive chunks."""
    sums, counts = [], []
    for nll in windows:
        nll = nll.to(torch.float64).reshape(-1)
        for c0 in range(0, nll.numel(), chunk):
            part = nll[c0 : c0 + chunk]
            sums.append(part.sum())
            counts.append(part.numel())
    if not sums:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    return torch.stack(sums), torch.tensor(counts, dtype=torch.float64)


def ratio_interval(
    a: Optional[Sequence[torch.Tensor]],
    b: Optional[Sequence[torch.Tensor]],
    settings: BootstrapSettings = BootstrapSettings(),
    point: Optional[float] = None,
) -> Interval:
    """Paired chunk-bootstrap interval of ``ppl(a) / ppl(b)``.

    a, b : per-window per-token NLL tensors over the *same* tokens (same windows, same
        lengths). None or empty: no resampling, the interval is ``point``.
    point : the ratio to report when a or b is missing.
    """
    if not a or not b:
        if point is None:
            raise ValueError("ratio_interval: no per-token losses and no point estimate")
        return Interval(point, point, point)
    if len(a) != len(b) or any(x.numel() != y.numel() for x, y in zip(a, b)):
        raise ValueError("ratio_interval: a and b must hold the same windows and tokens")
    sa, n = chunk_sums(a, settings.chunk)
    sb, _ = chunk_sums(b, settings.chunk)
    diff = sa - sb  # [K]
    est = math.exp(float(diff.sum() / n.sum()))
    K = diff.numel()
    if K < 2 or settings.samples < 1:
        return Interval(est, est, est)
    gen = torch.Generator(device="cpu").manual_seed(settings.seed)
    idx = torch.randint(0, K, (settings.samples, K), generator=gen)  # [S, K]
    reps = torch.exp(diff[idx].sum(dim=1) / n[idx].sum(dim=1))  # [S]
    alpha = (1.0 - settings.level) / 2
    q = torch.quantile(reps, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64))
    return Interval(est, min(float(q[0]), est), max(float(q[1]), est))
