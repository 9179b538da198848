"""Long-range retrieval probe: can the model still copy a segment it saw far back?

A window of real text gets ``K`` random token segments (``segment`` tokens each, drawn
with a seeded generator from the token ids the source text uses, so every token is an
ordinary one). Segment ``k`` is written twice: its second copy sits near the window's end
(the copies back to back, the last one ending at the window's last token) and its first
copy ``d_k`` tokens earlier, ``d_k = round(f_k * context)`` for the fractions
``distances`` (default 1/8, 1/2, 7/8 of the context). Each selector and budget then runs
the window once; on the second copy's tokens ``1 .. S-1`` (the first token of a random
segment cannot be predicted) the probe scores the mean loss and top-1 accuracy (argmax
of the logits equals the segment's next token). A pretrained model with induction heads
copies almost perfectly under dense attention; a selector that drops the first copy does
not, whatever its perplexity says.

The probe runs without per-layer metrics (one forward per cell) and reports per
distance, plus the mean over distances; :func:`probe_summary` says which selectors keep
at least ``keep`` (90 %) of dense's accuracy at each budget.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmark.quality.errors import UsageError
from benchmark.quality.metrics import soft_cap
from benchmark.quality.text import TextWindow

DEFAULT_DISTANCES = (Fraction(1, 8), Fraction(1, 2), Fraction(7, 8))
DEFAULT_SEGMENT = 32
KEEP_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    segment: int = DEFAULT_SEGMENT
    distances: Tuple[Fraction, ...] = DEFAULT_DISTANCES
    seed: int = 0
    keep: float = KEEP_FRACTION


@dataclasses.dataclass(frozen=True)
class ProbeWindow:
    """A text window with the segments written in: where each copy starts, and the segments."""

    window: TextWindow
    first: Tuple[int, ...]  # start of each segment's first copy
    second: Tuple[int, ...]  # start of each segment's second copy
    distances: Tuple[int, ...]  # second - first, in tokens
    segments: Tuple[Tuple[int, ...], ...]

    def copy_rows(self) -> List[int]:
        """Ascending positions that predict a second copy's tokens ``1 .. S-1``: ``s .. s+S-2`` per copy."""
        return sorted(p for s, seg in zip(self.second, self.segments) for p in range(s, s + len(seg) - 1))


def probe_layout(context: int, settings: ProbeSettings) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(first starts, second starts, distances) for ``context``; UsageError when they cannot fit.

    Distances ascending; second copies back to back at the window's end, the copy of the
    shortest distance first. Every copy must start at or after token 8 (clear of the
    sink tokens), no two copies may overlap, and each distance must be at least the
    segment length.
    """
    S, K = settings.segment, len(settings.distances)
    fracs = sorted(settings.distances)
    dists = [max(1, round(float(f) * context)) for f in fracs]
    second = [context - (K - k) * S for k in range(K)]
    first = [s - d for s, d in zip(second, dists)]
    spans = sorted([(f, f + S) for f in first] + [(s, s + S) for s in second])
    ok = all(d >= S for d in dists) and min(first) >= 8 and second[0] >= 8
    ok &= all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    if not ok:
        raise UsageError(
            f"--probe-distances: copies of {S} tokens at distances {dists} do not fit a context of {context} "
            "(each distance >= the segment, first copies from token 8 on, no overlaps); "
            "use a longer context, fewer or other distances, or --no-probe")
    return tuple(first), tuple(second), tuple(dists)


def make_probe_window(base: TextWindow, vocabulary: Sequence[int], settings: ProbeSettings) -> ProbeWindow:
    """``base`` with the probe's segments written in (seeded by ``settings.seed`` only)."""
    context = len(base.token_ids)
    first, second, dists = probe_layout(context, settings)
    vocab = torch.tensor(sorted(set(int(v) for v in vocabulary)), dtype=torch.int64)
    if vocab.numel() < 2:
        raise UsageError("probe: the text has fewer than 2 distinct tokens to draw segments from")
    gen = torch.Generator(device="cpu").manual_seed(settings.seed)
    ids = list(base.token_ids)
    segments = []
    for f, s in zip(first, second):
        seg = vocab[torch.randint(0, vocab.numel(), (settings.segment,), generator=gen)].tolist()
        ids[f : f + settings.segment] = seg
        ids[s : s + settings.segment] = seg
        segments.append(tuple(seg))
    window = TextWindow(f"{base.novel}+probe", base.token_start, tuple(ids))
    return ProbeWindow(window, first, second, dists, tuple(segments))


@torch.no_grad()
def probe_scores(hidden: torch.Tensor, lm_head: torch.nn.Module, probe: ProbeWindow,
                 softcap: Optional[float] = None) -> List[Tuple[float, int, int]]:
    """Per segment ``(sum of NLL, correct top-1, scored tokens)`` on its second copy.

    hidden : ``[T, C]`` final hidden states of the probe window. Position ``s + j - 1``
    predicts segment token ``j`` (``j = 1 .. S-1``).
    """
    out = []
    for s, seg in zip(probe.second, probe.segments):
        rows = hidden[s : s + len(seg) - 1]  # [S-1, C]
        targets = torch.tensor(seg[1:], dtype=torch.int64, device=hidden.device)
        logits = lm_head(rows).to(torch.float32)
        if softcap is not None:
            logits = soft_cap(logits, softcap)
        nll = -torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        correct = int((logits.argmax(dim=-1) == targets).sum())
        out.append((float(nll.to(torch.float64).sum()), correct, int(targets.numel())))
    return out


@dataclasses.dataclass
class ProbeCell:
    """Sums over probe windows, per distance index."""

    nll: List[float]
    correct: List[int]
    tokens: List[int]
    seconds: float = 0.0

    @classmethod
    def empty(cls, k: int) -> "ProbeCell":
        return cls([0.0] * k, [0] * k, [0] * k)

    def add(self, scores: Sequence[Tuple[float, int, int]]) -> None:
        for i, (n, c, t) in enumerate(scores):
            self.nll[i] += n
            self.correct[i] += c
            self.tokens[i] += t

    def accuracy(self) -> List[float]:
        return [c / t if t else float("nan") for c, t in zip(self.correct, self.tokens)]

    def loss(self) -> List[float]:
        return [n / t if t else float("nan") for n, t in zip(self.nll, self.tokens)]

    def mean_accuracy(self) -> float:
        return sum(self.correct) / max(sum(self.tokens), 1)

    def mean_loss(self) -> float:
        return sum(self.nll) / max(sum(self.tokens), 1)


@dataclasses.dataclass
class ProbeResult:
    settings: ProbeSettings
    distances: Dict[int, Tuple[int, ...]]  # context -> distances in tokens
    dense: Dict[int, ProbeCell]
    cells: Dict[Tuple[int, Fraction, str], ProbeCell]
    windows: Dict[int, List[ProbeWindow]]

    def keepers(self, context: int, budget: Fraction) -> Tuple[List[str], List[str]]:
        """(selectors whose mean accuracy >= keep x dense's, the others) at one cell of the grid."""
        ref = self.dense[context].mean_accuracy()
        keep, lose = [], []
        for (ctx, b, name), cell in self.cells.items():
            if ctx == context and b == budget:
                (keep if cell.mean_accuracy() >= self.settings.keep * ref else lose).append(name)
        return keep, lose

    def to_json(self) -> Dict[str, object]:
        def cell_json(c: ProbeCell):
            return {"accuracy": c.accuracy(), "loss": c.loss(), "mean_accuracy": c.mean_accuracy(),
                    "mean_loss": c.mean_loss(), "tokens": c.tokens, "seconds": c.seconds}

        return {
            "segment": self.settings.segment,
            "distance_fractions": [str(f) for f in sorted(self.settings.distances)],
            "seed": self.settings.seed,
            "keep_fraction": self.settings.keep,
            "distances": {str(c): list(d) for c, d in self.distances.items()},
            "windows": {str(c): [{"token_start": p.window.token_start, "first": list(p.first),
                                  "second": list(p.second)} for p in ws] for c, ws in self.windows.items()},
            "dense": {str(c): cell_json(d) for c, d in self.dense.items()},
            "cells": [{"context": c, "budget": str(b), "selector": n, **cell_json(cell)}
                      for (c, b, n), cell in self.cells.items()],
            "keepers": [{"context": c, "budget": str(b), "keep": self.keepers(c, b)[0], "lose": self.keepers(c, b)[1]}
                        for c, b in sorted({(c, b) for c, b, _ in self.cells})],
        }


def _order(names: Sequence[str], selector_order: Sequence[str]) -> List[str]:
    rank = {n: i for i, n in enumerate(selector_order)}
    return sorted(names, key=lambda n: rank.get(n, len(rank)))


def probe_summary(result: ProbeResult, selector_order: Sequence[str] = ()) -> str:
    """One line per (context, budget): which selectors keep >= 90% of dense's copy accuracy."""
    lines = []
    for ctx, b in sorted({(c, b) for c, b, _ in result.cells}):
        keep, lose = result.keepers(ctx, b)
        ref = result.dense[ctx].mean_accuracy()
        note = " (dense itself does not copy: the probe says nothing here)" if ref < 0.5 else ""
        lines.append(f"copy probe ctx {ctx} budget {b}: keep >= {result.settings.keep * 100:.0f}% of dense's copy "
                     f"accuracy ({ref:.3f}): {', '.join(_order(keep, selector_order)) or 'none'}; below: "
                     f"{', '.join(_order(lose, selector_order)) or 'none'}{note}")
    return "\n".join(lines)


def probe_markdown(result: ProbeResult, selector_order: Sequence[str]) -> List[str]:
    s = result.settings
    out = ["## Copy probe (long-range retrieval)", "",
           f"{len(s.distances)} random segments of {s.segment} tokens (seed {s.seed}) written into a text window "
           "and repeated near its end; top-1 accuracy and mean loss on tokens 2..S of the second copy, per copy "
           "distance d (tokens).", ""]
    for ctx in sorted(result.dense):
        dists = result.distances[ctx]
        head = " | ".join(f"acc d={d}" for d in dists) + " | " + " | ".join(f"loss d={d}" for d in dists)
        out += [f"Context {ctx}:", "", f"| budget | selector | {head} | mean acc | acc / dense |",
                "|---|---|" + "---|" * (2 * len(dists) + 2)]
        dense = result.dense[ctx]
        ref = dense.mean_accuracy()

        def row(budget, name, cell):
            acc = " | ".join(f"{a:.3f}" for a in cell.accuracy())
            loss = " | ".join(f"{x:.3f}" for x in cell.loss())
            rel = cell.mean_accuracy() / ref if ref else float("nan")
            return f"| {budget} | {name} | {acc} | {loss} | {cell.mean_accuracy():.3f} | {rel:.3f} |"

        out.append(row("-", "dense", dense))
        budgets = sorted({b for c, b, _ in result.cells if c == ctx})
        for b in budgets:
            names = _order([n for c, bb, n in result.cells if c == ctx and bb == b], selector_order)
            for n in names:
                out.append(row(b, n, result.cells[(ctx, b, n)]))
        out.append("")
        out += [line for line in probe_summary(result, selector_order).splitlines() if f"ctx {ctx} " in line]
        out.append("")
    return out
