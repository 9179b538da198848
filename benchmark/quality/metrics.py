"""Metrics: chunked perplexity and per-layer attention metrics.

Perplexity never materializes the full ``[T, vocab]`` logits: hidden states go through
``lm_head`` ``chunk`` rows at a time (at 16k tokens the fp32 logits alone take
``16384 x vocab x 4 B``: 9.8 GB for a 150k vocabulary, 17 GB for 262k).

The per-row attention metrics (:func:`attention_recall`, :func:`output_cos_diff`,
:func:`top1_hit`, :func:`sink_retention`) are defined here once: the harness's sparse
layers (``sparse_attention``), the calibration (``calibration.candidate_errors``) and the
fp64 reference of the tests (``attention_reference``) all call them. They take whatever
block of rows the caller measured, in the caller's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import torch

METRIC_NAMES = ("recall", "cos_diff", "top1", "sink")


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(z / cap) * cap`` (Gemma-2 style soft-capping), out of place."""
    return torch.tanh(logits / cap) * cap


def soft_cap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """:func:`soft_cap` in place (the same elementwise ops, so the same bits)."""
    return logits.div_(cap).tanh_().mul_(cap)


def measured_rows(lengths: torch.Tensor, width: int, metric_stride: int = 1, start: int = 0) -> torch.Tensor:
    """bool ``[R]``: the rows a metric pass measures, rows ``start .. start + R - 1`` of a layer.

    Rows longer than the budget ``width`` (shorter rows are dense by the convention and
    would read as perfect), and of those every ``metric_stride``-th query row
    (``t % metric_stride == 0``). lengths : int ``[R]`` causal lengths of those rows.
    """
    t = torch.arange(start, start + lengths.shape[0], device=lengths.device)
    return (lengths > width) & (t % metric_stride == 0)


def attention_recall(probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``[R]``: head-averaged attention mass on the selected keys, ``mean_h sum_{s in S} p_h[s]``.

    probs : ``[H, R, L]`` dense attention probabilities; selected : bool ``[R, L]``.
    """
    return (probs * selected.unsqueeze(0)).sum(dim=-1).mean(dim=0)


def output_cos_diff(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """``[R]``: ``1 - 2<a,b>/(|a|^2+|b|^2)`` of the ``[R, H*D]`` dense and sparse outputs.

    0 for equal outputs; the denominator is clamped at ``1e-30`` (two zero outputs give 1).
    """
    a, b = dense, sparse
    return 1.0 - 2.0 * (a * b).sum(-1) / ((a * a).sum(-1) + (b * b).sum(-1)).clamp(min=1e-30)


def top1_hit(probs: torch.Tensor, selected: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[R]``: share of heads whose dense argmax key is selected (``probs [H, R, L]``, ``selected [R, L]``)."""
    return torch.gather(selected, 1, probs.argmax(dim=-1).transpose(0, 1)).to(dtype).mean(dim=1)


def sink_retention(selected: torch.Tensor, sink_tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[R]``: share of the first ``sink_tokens`` positions that ``selected [R, L]`` keeps."""
    return selected[:, :sink_tokens].to(dtype).mean(dim=1)


@torch.no_grad()
def token_nll(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    chunk: Optional[int] = 1024,
    final_logit_softcap: Optional[float] = None,
) -> torch.Tensor:
    """Per-token negative log-likelihood, computed ``chunk`` positions at a time.

    Parameters
    ----------
    hidden : float ``[T, C]`` final hidden states (after the model's last norm)
    lm_head : the output projection ``C -> vocab``
    targets : int64 ``[T]``; position ``t`` is scored on ``targets[t]`` (the next token)
    chunk : rows per ``lm_head`` call; None = all at once (the one-shot reference)
    final_logit_softcap : ``tanh(z / c) * c`` on the logits (Gemma-2 style), or None

    Returns
    -------
    fp64 ``[T]`` NLL in nats (log-softmax in fp32, accumulated in fp64).
    """
    T = hidden.shape[0]
    step = T if chunk is None else chunk
    out = torch.empty(T, dtype=torch.float64, device=hidden.device)
    for c0 in range(0, T, step):
        logits = lm_head(hidden[c0 : c0 + step]).to(torch.float32)  # [Tc, vocab]
        if final_logit_softcap is not None:
            logits = soft_cap(logits, final_logit_softcap)
        logp = torch.log_softmax(logits, dim=-1)
        out[c0 : c0 + step] = -logp.gather(1, targets[c0 : c0 + step].unsqueeze(1)).squeeze(1).to(torch.float64)
    return out


def perplexity(nll: torch.Tensor) -> float:
    """``exp(mean NLL)``; NaN for an empty selection."""
    if nll.numel() == 0:
        return float("nan")
    return math.exp(float(nll.mean()))


@dataclasses.dataclass
class LayerMetrics:
    """Per-layer, per-row metric values accumulated over the chunks of one or more forwards.

    ``values[layer][name]`` is a list of fp32 ``[rows]`` tensors, ``name`` in
    :data:`METRIC_NAMES`. Only rows longer than the budget are recorded (shorter rows are
    dense and would read as perfect).
    """

    values: Dict[int, Dict[str, List[torch.Tensor]]] = dataclasses.field(default_factory=dict)

    def add(self, layer_idx: int, **per_row: torch.Tensor) -> None:
        slot = self.values.setdefault(layer_idx, {n: [] for n in METRIC_NAMES})
        for name, value in per_row.items():
            slot[name].append(value.detach().to(torch.float32).cpu())

    def merge(self, other: "LayerMetrics") -> None:
        for layer, names in other.values.items():
            slot = self.values.setdefault(layer, {n: [] for n in METRIC_NAMES})
            for name, chunks in names.items():
                slot[name].extend(chunks)

    def layer_summary(self) -> Dict[int, Dict[str, float]]:
        """layer -> {recall_mean, recall_p5, cos_diff_mean, top1_mean, sink_mean, rows}."""
        out = {}
        for layer in sorted(self.values):
            v = {n: torch.cat(c) if c else torch.empty(0) for n, c in self.values[layer].items()}
            rows = int(v["recall"].numel())
            if rows == 0:
                continue
            out[layer] = {
                "recall_mean": float(v["recall"].mean()),
                "recall_p5": float(torch.quantile(v["recall"].to(torch.float64), 0.05)),
                "cos_diff_mean": float(v["cos_diff"].mean()),
                "top1_mean": float(v["top1"].mean()),
                "sink_mean": float(v["sink"].mean()),
                "rows": rows,
            }
        return out


def summarize_layers(per_layer: Dict[int, Dict[str, float]]) -> Dict[str, float]:
    """Across layers: mean of each per-layer figure; ``recall_p5_min`` = the worst layer's p5."""
    if not per_layer:
        return {}
    keys = ("recall_mean", "recall_p5", "cos_diff_mean", "top1_mean", "sink_mean")
    out = {k: sum(d[k] for d in per_layer.values()) / len(per_layer) for k in keys}
    out["recall_p5_min"] = min(d["recall_p5"] for d in per_layer.values())
    return out
