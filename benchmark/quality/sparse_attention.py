"""Sparse attention inside the model's own forward, through transformers' attention interface.

:func:`register` adds one attention implementation, ``topology_kv_quality``, to
``AttentionInterface`` *and* the same name to ``AttentionMaskInterface`` (with
``sdpa_mask``): without the mask registration transformers silently builds no mask and a
model with sliding-window layers loses its windows (docs/quality.md; the tiny qwen2 and
gemma2 models in ``test_topology_kv_quality.py`` pin it). Load the model with
``attn_implementation=ATTENTION_NAME``.

The hook keeps no state. What a forward should do travels with the call, as a keyword
argument that transformers passes down to every attention call::

    plan = SparsePlan(selector, width, full_attention_layers, metrics=LayerMetrics())
    model.model(input_ids, topology_kv_plan=plan, use_cache=False)

* no plan, or a layer that is not full attention (sliding window, ...): the model's
  attention as it defines it (torch SDPA; a chunked eager fallback for soft-capping);
* a full-attention layer under a plan: the selector gives ``[T, W]`` rows (one index set
  per query token, shared by all heads), checked against the engine's convention; the
  rows become a boolean ``[T, L]`` mask (scatter) combined with the causal/model mask;
  attention runs in query chunks with that mask. Rows of causal length ``<= W`` are
  dense by the convention itself. With ``metrics``, the same chunks also compute dense
  attention of the *same layer input* and record per-row recall, cosine difference,
  top-1 hit and sink retention for rows longer than ``W``;
* a selector that returns ``None`` (it only observes the layer: the indexer's training
  capture) leaves the layer dense: the model's own attention runs, as with no plan.
* a plan with an ``attend(layer_idx, query, key, value, allowed, scaling, softcap)``
  method computes each full-attention layer's ``[1, T, H, D]`` output itself (the
  indexer's model-loss stage, :class:`benchmark.indexer.lm_stage.SoftSelectionPlan`);
  ``allowed`` is the model's mask as bool ``[T, L]`` or None (causal).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Dict, FrozenSet, Optional

import torch

from benchmark.quality.index_rows import check_engine_rows, rows_to_mask
from benchmark.quality.layer import DEFAULT_QUERY_CHUNK, LayerInputs, masked_softmax
from benchmark.quality.metrics import (
    LayerMetrics,
    attention_recall,
    measured_rows,
    output_cos_diff,
    sink_retention,
    soft_cap,
    top1_hit,
)

ATTENTION_NAME = "topology_kv_quality"
# A chunk whose rows together select fewer than 1/COMPACT_BELOW of its reachable keys runs
# attention over those key columns only (gathered once per chunk) instead of a full mask.
COMPACT_BELOW = 2
PLAN_KWARG = "topology_kv_plan"
# The stages of a sparse layer that SparsePlan.stage_seconds times, in order.
STAGES = ("selector", "row_check", "attention", "metrics")


@dataclasses.dataclass
class SparsePlan:
    """What one forward does at its full-attention layers; the caller owns it.

    Attributes
    ----------
    selector : ``(LayerInputs, W, stats) -> [T, W]`` rows (:mod:`benchmark.quality.selector_base`),
        or ``None`` for "every causal key": the model's own attention (no ``metrics`` then)
    width : the budget W (tokens per query row)
    full_attention_layers : layer indices to make sparse; others run as the model defines
    metrics : per-layer metric accumulator, or None to skip the dense comparison
    query_chunk : query rows per attention chunk
    sink_tokens : first positions counted by the sink-retention metric
    check_rows : validate every selector output against the engine's convention
    metric_stride : measure metrics on every ``metric_stride``-th query row only (1 = all);
        the metric pass costs about twice the sparse attention itself
    selector_stats : layer -> counters the selector reported (policy counters)
    sparse_layers : layers that actually ran sparse in this forward, in call order
    stage_seconds : wall seconds per stage, summed over the sparse layers:
        ``selector`` (the selector's rows), ``row_check`` (the convention check),
        ``attention`` (selection masks and sparse attention), ``metrics`` (the dense
        comparison); see :data:`STAGES`
    on_layer : called with the layer index after each sparse layer (progress output), or None
    layer_hidden : layer -> the attention input ``[L, C]`` of this forward, filled by the
        hook :func:`install_hidden_capture` puts on the model and taken by the attention
        call of the same layer (what a trained indexer reads)
    """

    selector: object
    width: int
    full_attention_layers: FrozenSet[int]
    metrics: Optional[LayerMetrics] = None
    query_chunk: int = DEFAULT_QUERY_CHUNK
    sink_tokens: int = 4
    check_rows: bool = True
    metric_stride: int = 1
    selector_stats: Dict[int, Dict[str, float]] = dataclasses.field(default_factory=dict)
    sparse_layers: list = dataclasses.field(default_factory=list)
    stage_seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    on_layer: Optional[Callable[[int], None]] = None
    layer_hidden: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def wants_hidden(self, layer_idx: int) -> bool:
        return layer_idx in self.full_attention_layers


def register() -> None:
    """Register the hook and its mask function under :data:`ATTENTION_NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, topology_kv_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def install_hidden_capture(model, plan_kwarg: str = PLAN_KWARG) -> int:
    """Give every attention module of ``model`` a pre-hook that hands its input to the plan.

    The trained indexer reads the attention's input ``x`` (after the layer's input norm),
    which the attention function itself never sees: a forward pre-hook on each module
    that has a ``layer_idx`` and an attention ``forward(hidden_states, ...)`` stores a
    reference to ``hidden_states`` (``[B, T, C]``) in ``plan.layer_hidden[layer_idx]``
    when the call carries a plan under the keyword ``plan_kwarg`` that has a
    ``layer_hidden`` dict (and, if it has one, whose ``wants_hidden(layer_idx)`` is true).
    No plan: nothing happens; no copy is ever made. Idempotent per keyword; returns the
    number of modules hooked.
    """
    count = 0
    for module in model.modules():
        if not hasattr(module, "layer_idx") or not type(module).__name__.endswith("Attention"):
            continue
        hooks = module.__dict__.setdefault("_topology_kv_hidden_hooks", {})
        if plan_kwarg not in hooks:
            hooks[plan_kwarg] = module.register_forward_pre_hook(
                functools.partial(_stash_hidden, plan_kwarg), with_kwargs=True)
        count += 1
    return count


def _stash_hidden(plan_kwarg, module, args, kwargs):
    plan = kwargs.get(plan_kwarg)
    store = getattr(plan, "layer_hidden", None)
    if store is None:
        return None
    wants = getattr(plan, "wants_hidden", None)
    if wants is not None and not wants(module.layer_idx):
        return None
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if hidden is not None:
        store[module.layer_idx] = hidden
    return None


def _allowed_from_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The model's ``[B, 1, T, L]`` mask (bool, or additive float) as bool ``[T, L]``; None = causal."""
    if attention_mask is None:
        return None
    m = attention_mask[0, 0]
    return m if m.dtype == torch.bool else m == 0


def _layer_inputs(module, query, key, value, attention_mask, scaling, softcap, query_chunk, hidden=None) -> LayerInputs:
    if query.shape[0] != 1:
        raise ValueError(f"topology_kv_quality attention: expected batch 1 (one request), got {query.shape[0]}")
    D = query.shape[-1]
    return LayerInputs.build(
        layer_idx=getattr(module, "layer_idx", -1),
        query=query[0].to(torch.float32),  # [H, T, D]
        key=key[0].to(torch.float32),  # [Hkv, L, D]
        value=value[0].to(torch.float32),
        scaling=D**-0.5 if scaling is None else scaling,
        softcap=softcap,
        allowed=_allowed_from_mask(attention_mask),
        query_chunk=query_chunk,
        hidden=None if hidden is None else hidden.to(torch.float32),
    )


def _first_request(hidden: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if hidden is None else hidden[0]  # [1, T, C] -> [T, C] (the harness runs batch 1)


def chunked_dense_attention(layer: LayerInputs) -> torch.Tensor:
    """Dense attention, chunked over queries: fp32 ``[H, T, D]`` (the soft-capping fallback)."""
    out = torch.empty(layer.query.shape[0], layer.num_queries, layer.value.shape[-1], device=layer.query.device)
    for c0, c1, lc in layer.chunks():
        out[:, c0:c1] = layer.masked_attention(c0, c1, lc, layer.allowed_chunk(c0, c1, lc))
    return out


def selection_mask(layer: LayerInputs, rows: torch.Tensor) -> torch.Tensor:
    """bool ``[T, L]``: the keys each row selects, within the allowed (causal, model) mask.

    rows : int ``[T, W]``, engine convention (``-1`` padding). One scatter and one ``tril``
    per layer: rows are causal by the convention, and ``tril`` enforces it anyway.
    """
    T, L = layer.num_queries, layer.key_length
    sel = rows_to_mask(rows, L).tril(L - T)  # [T, L]: key s <= L - T + t, i.e. s < lengths[t]
    return sel if layer.allowed is None else sel.logical_and_(layer.allowed)


def sparse_layer_attention(
    layer: LayerInputs,
    rows: torch.Tensor,
    width: int,
    metrics: Optional[LayerMetrics],
    sink_tokens: int,
    metric_stride: int = 1,
    stage_seconds: Optional[Dict[str, float]] = None,
) -> torch.Tensor:
    """Attention restricted to ``rows`` (int ``[T, W]``, engine convention): fp32 ``[H, T, D]``.

    With ``metrics``, rows longer than ``W`` also get, against dense attention of the same
    inputs (``p_h`` head ``h``'s dense probabilities, ``S`` the selected set):
    recall ``mean_h sum_{s in S} p_h[s]``; cosine difference ``1 - 2<a,b>/(|a|^2+|b|^2)``
    of the ``[H*D]`` dense and sparse outputs; top-1 hit (share of heads whose dense
    argmax key is in ``S``); sink retention (share of the first ``sink_tokens`` positions
    in ``S``). Only every ``metric_stride``-th query row is measured. The measured rows'
    logits are computed once and give every metric and the dense output (one matmul,
    one softmax and one ``p @ v`` per block of measured rows).

    stage_seconds : adds the seconds spent on ``attention`` (mask and attention) and
        ``metrics`` (the dense comparison) to this dict, or None.

    Few ops per layer, not per chunk: the mask and each chunk's count of selected keys are
    built once per layer, and the metrics run over blocks of up to ``query_chunk`` measured
    rows (2 blocks per layer at 8k and stride 16, not 32 chunks). On 2 cores shared with
    other jobs every op costs milliseconds of thread synchronisation, whatever its size.
    """
    H, T, _ = layer.query.shape
    start = time.perf_counter()
    out = torch.empty(H, T, layer.value.shape[-1], device=layer.query.device)
    sel = selection_mask(layer, rows)  # [T, L]
    chunks = list(layer.chunks())
    Tc = layer.query_chunk
    full = T // Tc
    used = sel[: full * Tc].view(full, Tc, sel.shape[1]).any(dim=1)  # [full chunks, L]: keys a row of the chunk selected
    if full * Tc < T:
        used = torch.cat([used, sel[full * Tc:].any(dim=0, keepdim=True)])  # the partly filled last chunk
    n_used = used.sum(dim=1).tolist()  # harness code: one host sync per layer
    for i, (c0, c1, lc) in enumerate(chunks):
        if n_used[i] * COMPACT_BELOW < lc:
            # Few distinct keys (locality-like rows, long contexts): attend over those columns only.
            cols = torch.nonzero(used[i, :lc]).squeeze(1)
            out[:, c0:c1] = layer.column_attention(c0, c1, cols, sel[c0:c1].index_select(1, cols))
        else:
            out[:, c0:c1] = layer.masked_attention(c0, c1, lc, sel[c0:c1, :lc])
    t_attention = time.perf_counter() - start
    if metrics is not None:
        start = time.perf_counter()
        _layer_metrics(layer, out, sel, width, metrics, sink_tokens, metric_stride)
        if stage_seconds is not None:
            stage_seconds["metrics"] = stage_seconds.get("metrics", 0.0) + time.perf_counter() - start
    if stage_seconds is not None:
        stage_seconds["attention"] = stage_seconds.get("attention", 0.0) + t_attention
        stage_seconds.setdefault("metrics", 0.0)
    return out


def _layer_metrics(layer: LayerInputs, out: torch.Tensor, sel: torch.Tensor, width: int, metrics: LayerMetrics,
                   sink_tokens: int, metric_stride: int) -> None:
    """Record the metrics of the measured rows (see :func:`sparse_layer_attention`).

    out : fp32 ``[H, T, D]`` sparse output; sel : bool ``[T, L]`` selection mask. Measured
    rows: longer than ``W``, at ``t % metric_stride == 0``; in blocks of up to
    ``query_chunk`` rows, each against the keys its last row can reach.
    """
    T, L = layer.num_queries, layer.key_length
    measured = measured_rows(layer.lengths, width, metric_stride)  # [T]
    keep_all = torch.nonzero(measured).squeeze(1)  # [M] harness code: a host sync is fine here
    for b0 in range(0, keep_all.numel(), layer.query_chunk):
        keep = keep_all[b0:b0 + layer.query_chunk]  # [Tk]
        lc = L - T + int(keep[-1]) + 1  # the keys the block's last (longest) row can reach
        sel_k = sel.index_select(0, keep)[:, :lc]  # [Tk, lc]
        allowed_k = torch.arange(lc, device=sel.device).unsqueeze(0) < layer.lengths[keep].unsqueeze(1)
        if layer.allowed is not None:
            allowed_k &= layer.allowed.index_select(0, keep)[:, :lc]
        q = layer.query.index_select(1, keep)  # [H, Tk, D]
        # One logits block serves every metric: dense probabilities p (softmax over the
        # allowed keys), recall = mass of p on the selected keys, top-1 = p's argmax kept,
        # and the dense output p @ v for the cosine difference against the sparse output.
        # Keys and values repeated per head once per layer (expanded_key_t, expanded_value):
        # one bmm each, not a matmul that copies the broadcast keys/values of every block.
        logits = layer.query_logits_into(q, lc, "metric_logits")  # [H, Tk, lc]
        p = masked_softmax(logits, allowed_k, in_place=True)
        a = torch.bmm(p, layer.expanded_value[:, :lc]).transpose(0, 1).flatten(1)  # [H, Tk, D] -> [Tk, H*D]
        b = out.index_select(1, keep).transpose(0, 1).flatten(1)
        metrics.add(layer.layer_idx, recall=attention_recall(p, sel_k), cos_diff=output_cos_diff(a, b),
                    top1=top1_hit(p, sel_k), sink=sink_retention(sel_k, sink_tokens))


def gather_sparse_attention(layer: LayerInputs, rows: torch.Tensor) -> torch.Tensor:
    """Reference path: attention over the gathered ``W`` keys of each row: fp32 ``[H, T, D]``.

    What a sparse kernel does (gather ``K[rows]``, ``V[rows]``, softmax over the ``W``
    entries, ``-1`` padding masked). :func:`sparse_layer_attention` runs masked dense
    attention per query chunk instead (a boolean ``[Tc, L]`` mask from the rows, one fused
    SDPA call), which on CPU costs about a dense forward; the tests pin that both give the
    same output within fp32 noise. Cost here: ``[H, Tc, W, D]`` gathered keys per chunk.
    """
    H, T, D = layer.query.shape
    out = torch.empty(H, T, layer.value.shape[-1], device=layer.query.device)
    k_all, v_all = layer.expanded_key, layer.expanded_value  # [H, L, D]
    for c0, c1, lc in layer.chunks():
        r = rows[c0:c1].to(torch.int64)  # [Tc, W]
        valid = r >= 0
        if layer.allowed is not None:
            valid &= torch.gather(layer.allowed[c0:c1], 1, r.clamp(min=0))
        idx = r.clamp(min=0)
        k = k_all[:, idx]  # [H, Tc, W, D]
        v = v_all[:, idx]
        s = torch.einsum("htd,htwd->htw", layer.query[:, c0:c1], k) * layer.scaling
        if layer.softcap is not None:
            s = soft_cap(s, layer.softcap)
        p = masked_softmax(s, valid)
        out[:, c0:c1] = torch.einsum("htw,htwd->htd", p, v)
    return out


def _model_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """The layer's attention as the model defines it."""
    if kwargs.get("softcap") is not None:
        softcap = kwargs["softcap"]
        layer = _layer_inputs(module, query, key, value, attention_mask, scaling, softcap, DEFAULT_QUERY_CHUNK)
        if kwargs.get("sliding_window") is not None and attention_mask is None:
            raise ValueError("topology_kv_quality attention: a sliding-window layer came without its mask")
        out = chunked_dense_attention(layer)  # [H, T, D]
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def topology_kv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function (see module doc).

    query ``[1, H, T, D]``, key/value ``[1, Hkv, L, D]`` post-RoPE; returns
    ``([1, T, H, D], None)`` like transformers' SDPA path.
    """
    plan: Optional[SparsePlan] = kwargs.pop(PLAN_KWARG, None)
    for unsupported in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"topology_kv_quality attention: models whose attention takes {unsupported!r}")
    layer_idx = getattr(module, "layer_idx", None)
    sparse = (
        plan is not None
        and layer_idx in plan.full_attention_layers
        and kwargs.get("sliding_window") is None
    )
    if not sparse:
        return _model_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    attend = getattr(plan, "attend", None)
    if attend is not None:  # the plan computes the layer itself (the indexer's model-loss stage)
        return attend(layer_idx, query, key, value, _allowed_from_mask(attention_mask),
                      query.shape[-1] ** -0.5 if scaling is None else scaling, kwargs.get("softcap")), None
    layer = _layer_inputs(module, query, key, value, attention_mask, scaling, kwargs.get("softcap"), plan.query_chunk,
                          hidden=_first_request(plan.layer_hidden.pop(layer_idx, None)))
    stats = plan.selector_stats.setdefault(layer_idx, {})
    timed = plan.stage_seconds
    start = time.perf_counter()
    rows = plan.selector(layer, plan.width, stats)
    timed["selector"] = timed.get("selector", 0.0) + time.perf_counter() - start
    if rows is None:
        if plan.metrics is not None:
            raise ValueError(f"topology_kv_quality attention: the selector returned no rows at layer {layer_idx} "
                             "under a plan with metrics (metrics compare selected rows against dense)")
        return _model_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if plan.check_rows:
        start = time.perf_counter()
        # Order inside a row does not matter to attention; the policy may permute short rows.
        check_engine_rows(rows, layer.lengths, plan.width, name=f"selector rows at layer {layer_idx}",
                          ascending_short_rows=False)
        timed["row_check"] = timed.get("row_check", 0.0) + time.perf_counter() - start
    out = sparse_layer_attention(layer, rows, plan.width, plan.metrics, plan.sink_tokens, plan.metric_stride,
                                 stage_seconds=timed)
    plan.sparse_layers.append(layer_idx)
    if plan.on_layer is not None:
        plan.on_layer(layer_idx)
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None
