"""Plain fp64 attention of one layer: what the chunked fp32 paths are tested against.

Whole ``[H, T, L]`` blocks at once: no query chunks, no SDPA, no scratch buffers, no
in-place ops; keys and values repeated per query head. The maths is the harness's, in
fp64: soft-capping (:func:`~benchmark.quality.metrics.soft_cap`), the softmax over the
keys a mask allows (:func:`~benchmark.quality.layer.masked_softmax`) and the per-row
metrics of :mod:`benchmark.quality.metrics`, over every row longer than ``W``.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from benchmark.quality.index_rows import rows_to_mask
from benchmark.quality.layer import LayerInputs, masked_softmax
from benchmark.quality.metrics import attention_recall, measured_rows, output_cos_diff, soft_cap
from benchmark.quality.metrics import sink_retention, top1_hit


def reference_logits(layer: LayerInputs) -> torch.Tensor:
    """fp64 ``[H, T, L]`` scaled (and soft-capped) logits, unmasked."""
    q, k = layer.query.double(), layer.key.double().repeat_interleave(layer.groups, dim=0)
    s = q @ k.transpose(1, 2) * layer.scaling  # [H, T, L]
    return s if layer.softcap is None else soft_cap(s, layer.softcap)


def reference_allowed(layer: LayerInputs) -> torch.Tensor:
    """bool ``[T, L]``: key ``s`` is causal for row ``t`` (``s < lengths[t]``) and the model's mask allows it."""
    allowed = torch.arange(layer.key_length, device=layer.lengths.device)[None, :] < layer.lengths[:, None]
    return allowed if layer.allowed is None else allowed & layer.allowed


def reference_selection(layer: LayerInputs, rows: torch.Tensor) -> torch.Tensor:
    """bool ``[T, L]``: the keys each row selects (int ``[T, W]`` rows, ``-1`` padding), within the allowed ones."""
    return rows_to_mask(rows, layer.key_length) & reference_allowed(layer)


def reference_dense_probabilities(layer: LayerInputs) -> torch.Tensor:
    """fp64 ``[H, T, L]`` dense attention probabilities (zero outside the allowed keys)."""
    return masked_softmax(reference_logits(layer), reference_allowed(layer))


def _values(layer: LayerInputs) -> torch.Tensor:
    return layer.value.double().repeat_interleave(layer.groups, dim=0)  # [H, L, D]


def reference_sparse_attention(layer: LayerInputs, rows: torch.Tensor) -> torch.Tensor:
    """fp64 ``[H, T, D]``: softmax over each row's selected keys only, times the values."""
    return masked_softmax(reference_logits(layer), reference_selection(layer, rows)) @ _values(layer)


def reference_recall(layer: LayerInputs, rows: torch.Tensor, width: int) -> torch.Tensor:
    """fp64 ``[rows longer than W]``: head-averaged dense attention mass on the selected keys."""
    measured = measured_rows(layer.lengths, width)
    p = reference_dense_probabilities(layer)[:, measured]
    return attention_recall(p, reference_selection(layer, rows)[measured])


def reference_layer_attention(
    layer: LayerInputs, rows: torch.Tensor, width: int, sink_tokens: int
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """What ``sparse_attention.sparse_layer_attention`` computes, plainly, in fp64.

    Returns the sparse output ``[H, T, D]`` and, per name in ``metrics.METRIC_NAMES``,
    the fp64 values of every row longer than ``width`` (metric stride 1).
    """
    s = reference_logits(layer)
    v = _values(layer)
    sel = reference_selection(layer, rows)  # [T, L]
    p_dense = masked_softmax(s, reference_allowed(layer))
    out_dense, out_sparse = p_dense @ v, masked_softmax(s, sel) @ v  # [H, T, D]
    measured = measured_rows(layer.lengths, width)
    a = out_dense.transpose(0, 1).flatten(1)[measured]  # [M, H*D]
    b = out_sparse.transpose(0, 1).flatten(1)[measured]
    p, sel_m = p_dense[:, measured], sel[measured]
    metrics = {
        "recall": attention_recall(p, sel_m),
        "cos_diff": output_cos_diff(a, b),
        "top1": top1_hit(p, sel_m, dtype=torch.float64),
        "sink": sink_retention(sel_m, sink_tokens, dtype=torch.float64),
    }
    return out_sparse, metrics
