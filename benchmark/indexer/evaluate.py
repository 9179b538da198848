"""Attention-mass recall of a layer's top-W under each indexer, on held-out windows.

For a sampled row ``t`` and budget ``W``: the rows each method keeps are the engine's
top-W of its scores (:func:`~rtp_llm.models_py.modules.hybrid.indexer_torch_ops.topk_from_window_scores`:
descending score, ties to the lower position; a row of length ``<= W`` keeps every key),
and recall is the dense attention mass (averaged over heads) on them. Methods:

* ``oracle``: the dense attention itself (the upper bound at ``W``);
* ``trained``: the trained indexer, q and k fp8-e4m3 round-tripped in 128-value groups as
  the engine stores them;
* ``proxy``: the harness's untrained null model, ``sum_h relu(q_h . k_h) / H`` of the
  model's own post-RoPE q/k (fp8 per vector), 1/2 of the attention's cost per key;
* ``proxy-pca``: the end-to-end benchmark's untrained null model, one head over the KV
  heads' keys projected on their 64 principal directions (``benchmark.quality.proxy_indexers``);
* ``locality``: the first 4 positions and the most recent ones;
* ``trained, newest ties``: the trained indexer's scores with ties broken to the *newest*
  position instead of the top-k op's oldest-first rule. With one head, ``relu`` scores
  part of a row's keys exactly 0; a budget wider than the keys scored above that tie is
  filled with the oldest tied keys. This column is what the same indexer keeps with
  recency deciding the ties.

:func:`tie_decided_share` measures how much of a row the tie rule decides.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Callable, Dict, Optional, Sequence

import torch

from benchmark.indexer.capture import LayerSample
from benchmark.quality.selector_base import fp8_per_vector_round_trip
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections
from rtp_llm.models_py.modules.hybrid.topology_kv.schedule import score_sort_keys
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import (
    fp8_e4m3_round_trip,
    topk_from_window_scores,
    weighted_relu_logits,
)

BUDGETS = (Fraction(1, 16), Fraction(1, 8), Fraction(1, 4))
REUSE_BELOW = "reuse below"  # the layer below's trained rows on this layer (train_cli's shared-scan cost)
TIE_DECIDED = "tie-decided slots"  # tie_decided_share of the trained rows (a share of W, not a recall)
LOCALITY_SINKS = 4
NEWEST_TIES = "trained, newest ties"
METHODS = ("oracle", "trained", NEWEST_TIES, "proxy", "proxy-pca", "locality")

Scores = Callable[[LayerSample], torch.Tensor]


def trained_scores(module: IndexerProjections, fp8: bool = True) -> Scores:
    def scores(sample: LayerSample) -> torch.Tensor:
        L = sample.hidden.shape[0]
        with torch.no_grad():
            keys = module.keys(sample.hidden, torch.arange(L))  # [L, D]
            x_rows = sample.hidden.index_select(0, sample.rows)
            q = module.queries(x_rows, sample.rows)  # [R, H, D]
            if fp8:
                q, keys = fp8_e4m3_round_trip(q), fp8_e4m3_round_trip(keys)
            return weighted_relu_logits(q, module.weights(x_rows), keys)

    return scores


def newest_ties(scores: Scores) -> Scores:
    """``scores`` with every tie broken to the newer position: fp32 ``[R, L]`` ranks.

    Each row's keys are ranked by (score, position), so distinct scores keep their order
    and equal ones order newest first; the ranks are integers below ``2**24``, exact in
    fp32, and unique, so the engine's tie rule never applies to them.
    """
    def ranked(sample: LayerSample) -> torch.Tensor:
        s = scores(sample)
        R, L = s.shape
        keys = score_sort_keys(s, torch.arange(L).expand(R, L))  # a larger position wins ties
        return keys.argsort(dim=1).argsort(dim=1).to(torch.float32)

    return ranked


def tie_decided_share(scores: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """fp64 ``[R]``: the share of each row's ``width`` slots that the tie rule fills.

    A row's top-``width`` is decided by ties where the ``width``-th best score is shared by
    keys inside and outside the row: its slots holding that score are chosen by position,
    not by score. Only the causal keys ``0 .. lengths[r] - 1`` count; a row with
    ``lengths[r] <= width`` keeps every key and has no tie-decided slot.
    """
    R, L = scores.shape
    causal = torch.arange(L).unsqueeze(0) < lengths.to(torch.int64).unsqueeze(1)
    s = scores.to(torch.float32).masked_fill(~causal, float("-inf"))
    k = min(width, L)
    kth = torch.topk(s, k, dim=1).values[:, -1:]  # [R, 1] the width-th best causal score
    above = ((s > kth) & causal).sum(dim=1)
    tied = ((s == kth) & causal).sum(dim=1)
    straddles = (above + tied > width) & (lengths.to(torch.int64) > width)
    return torch.where(straddles, (width - above).to(torch.float64) / width, torch.zeros(R, dtype=torch.float64))


def proxy_scores(sample: LayerSample) -> torch.Tensor:
    """``sum_h relu(q_h . k_{h // G}) / H`` on fp8 per-vector q and k: ``[R, L]``."""
    q, k = fp8_per_vector_round_trip(sample.query), fp8_per_vector_round_trip(sample.key)  # [H, R, D], [Hkv, L, D]
    H, Hkv = q.shape[0], k.shape[0]
    k_rep = k.repeat_interleave(H // Hkv, dim=0)  # [H, L, D]
    return torch.relu(torch.bmm(q, k_rep.transpose(1, 2))).sum(dim=0) / H


def pca_proxy_scores(sample: LayerSample) -> torch.Tensor:
    """The e2e's ``dsa-ratio`` proxy, fitted on this window's keys: ``[R, L]``."""
    from benchmark.quality.proxy_indexers import ProxyIndexer, resolve_indexer_shape

    H, R, D = sample.query.shape
    Hkv, L, _ = sample.key.shape
    shape = resolve_indexer_shape("dsa-ratio", None, None, H, Hkv, D)
    keys_tld = sample.key.transpose(0, 1)  # [L, Hkv, D]
    proxy = ProxyIndexer(shape, H, Hkv, D, keys_tld if shape.dim < Hkv * D else None)
    k = proxy.keys(keys_tld)  # [L, Di]
    q = proxy.queries(sample.query.transpose(0, 1))  # [R, Hi, Di]
    w = torch.full((R, shape.heads), 1.0 / shape.heads)
    return weighted_relu_logits(q, w, k)


def locality_scores(sample: LayerSample) -> torch.Tensor:
    """Position as the score, the first :data:`LOCALITY_SINKS` above everything: ``[R, L]``."""
    L = sample.hidden.shape[0]
    pos = torch.arange(L, dtype=torch.float32)
    pos[:LOCALITY_SINKS] = float(L)  # sinks outrank every recent token
    return pos.unsqueeze(0).expand(sample.rows.shape[0], L)


def recall_at(scores: torch.Tensor, sample: LayerSample, width: int) -> torch.Tensor:
    """fp64 ``[R]``: mass of ``sample.target`` on the engine's top-``width`` of ``scores``."""
    rows = topk_from_window_scores(scores.to(torch.float32), sample.lengths, None, width).to(torch.int64)  # [R, W]
    mass = torch.gather(sample.target, 1, rows.clamp(min=0)).masked_fill(rows < 0, 0.0)
    return mass.sum(dim=1).to(torch.float64)


def layer_recall(samples: Sequence[LayerSample], methods: Dict[str, Scores], context: int,
                 budgets: Sequence[Fraction] = BUDGETS) -> Dict[str, Dict[str, float]]:
    """method -> budget (``"1/16"``) -> recall averaged over the samples' rows."""
    out: Dict[str, Dict[str, float]] = {m: {} for m in methods}
    for name, fn in methods.items():
        sums = {b: 0.0 for b in budgets}
        count = 0
        for sample in samples:
            s = sample.target if name == "oracle" else fn(sample)
            for b in budgets:
                sums[b] += float(recall_at(s, sample, max(1, int(context * b))).sum())
            count += sample.rows.shape[0]
        for b in budgets:
            out[name][str(b)] = sums[b] / max(1, count)
    return out


def default_methods(trained: Optional[IndexerProjections], with_attention_qk: bool) -> Dict[str, Scores]:
    methods: Dict[str, Scores] = {"oracle": lambda s: s.target}
    if trained is not None:
        methods["trained"] = trained_scores(trained)
        methods[NEWEST_TIES] = newest_ties(methods["trained"])
    if with_attention_qk:
        methods["proxy"] = proxy_scores
        methods["proxy-pca"] = pca_proxy_scores
    methods["locality"] = locality_scores
    return methods
