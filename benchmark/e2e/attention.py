"""The registered attention hook: chunked dense prefill, and one decode step of a batch.

Per layer of a decode step: ``dense`` reads the pools in place (padded batch + masks, no
copy of the KV); an indexer variant writes the proxy keys (``Indexer.write_keys``), runs
``Indexer._compute_topk`` over the block table, then attends over the selected rows. The
hook's inputs for one forward are a :class:`StepPlan`, passed as a model keyword; its
timers split the step into indexer / policy / attention (the rest of the model is the
step's total minus these), read on the plan's clock (:mod:`benchmark.e2e.clock`:
synchronized at every phase boundary on CUDA). Every tensor made here is made on the
device of the tensors it is made for.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Tuple

import torch

from benchmark.e2e.clock import Clock
from benchmark.e2e.layout import LayerPools, VariantState, rows_to_slots
from rtp_llm.models_py.modules.hybrid.indexer import TopologyStepCounters
from rtp_llm.models_py.modules.hybrid.indexer_params import IndexerAttentionInputs, IndexerFmhaParams
from rtp_llm.models_py.modules.hybrid.indexer_share import SharedTopkRows

ATTENTION_NAME = "topology_kv_decode"
PLAN_KWARG = "topology_kv_decode_plan"
PARTS = ("indexer", "policy", "attention", "rest")


@dataclasses.dataclass
class StepPlan:
    """One forward's inputs to the attention hook; timers accumulate over layers.

    Shapes: ``B`` requests, ``T`` rows per request, ``R = B * T`` rows (request-major).
    """

    mode: str  # "prefill" or "decode"
    pools: Dict[int, LayerPools]
    state: Optional[VariantState] = None
    # decode
    slots: Optional[torch.Tensor] = None  # int64 [R] where this step's K/V go
    positions: Optional[torch.Tensor] = None  # int64 [R]
    request_ids: Optional[torch.Tensor] = None  # int64 [R]
    row_lengths: Optional[torch.Tensor] = None  # int64 [B, T] causal KV length of each row
    shared_lens: Optional[torch.Tensor] = None  # int64 [B]
    fmha: Optional[IndexerFmhaParams] = None
    attn: Optional[IndexerAttentionInputs] = None
    weights: Optional[torch.Tensor] = None  # [R, Hi] fp32
    counters: Optional[TopologyStepCounters] = None
    shared_rows: Optional[SharedTopkRows] = None  # the scanning layers' op rows (shared-scan variants)
    dense_mask: Optional[torch.Tensor] = None  # bool [B, 1, T, P + Tc], built once per step
    # prefill
    prefill_k: Optional[Dict[int, torch.Tensor]] = None  # layer -> [C, Hkv, D]
    prefill_v: Optional[Dict[int, torch.Tensor]] = None
    prefill_h: Optional[Dict[int, torch.Tensor]] = None  # layer -> [C, hidden] attention inputs (trained indexer)
    position: int = 0
    # layer -> this forward's attention input [B, T, hidden], handed over by the pre-hook
    # benchmark.quality.sparse_attention.install_hidden_capture puts on the model
    layer_hidden: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    timers: Dict[str, float] = dataclasses.field(default_factory=lambda: {p: 0.0 for p in PARTS})
    clock: Clock = time.perf_counter  # the timers' clock: the layout's (its device's phase clock)
    attended: List[torch.Tensor] = dataclasses.field(default_factory=list)  # tokens attended, per layer
    sparse_attended: List[torch.Tensor] = dataclasses.field(default_factory=list)  # sparse layers only


def dense_mask(shared_lens: torch.Tensor, row_lengths: torch.Tensor, P: int, Tc: int,
               window: Optional[int] = None) -> torch.Tensor:
    """bool ``[B, 1, T, P + Tc]``: shared column ``p`` is position ``p`` (valid below
    ``shared_lens[b]``), tail column ``j`` is position ``shared_lens[b] + j``; a row sees
    positions below its causal length (and, with a window, the last ``window`` of them)."""
    dev = shared_lens.device
    pos = torch.cat([
        torch.arange(P, device=dev).unsqueeze(0).expand(shared_lens.shape[0], P),
        shared_lens.unsqueeze(1) + torch.arange(Tc, device=dev).unsqueeze(0),
    ], dim=1)  # [B, P + Tc]
    in_shared = torch.cat([torch.arange(P, device=dev).unsqueeze(0) < shared_lens.unsqueeze(1),
                           torch.ones(shared_lens.shape[0], Tc, dtype=torch.bool, device=dev)], dim=1)
    ok = in_shared.unsqueeze(1) & (pos.unsqueeze(1) < row_lengths.unsqueeze(2))  # [B, T, P + Tc]
    if window is not None:
        ok &= pos.unsqueeze(1) >= row_lengths.unsqueeze(2) - window
    return ok.unsqueeze(1)


def dense_decode_attention(q: torch.Tensor, shared_k, shared_v, tail_k, tail_v, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Padded-batch dense attention reading the pools in place.

    q ``[B, T, H, D]``; shared_k/v ``[B, P, Hkv, D]`` and tail_k/v ``[B, Tc, Hkv, D]``
    (strided views of the pool: no copy); mask bool ``[B, 1, T, P + Tc]``
    (:func:`dense_mask`). Returns ``[B, T, H, D]``. One batched matmul per KV head and
    region: the per-head slices keep BLAS-compatible strides, so nothing is copied.
    """
    B, T, H, D = q.shape
    Hkv = shared_k.shape[2]
    G = H // Hkv
    P = shared_k.shape[1]
    qh = (q * scale).view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    out = torch.empty(B, Hkv, G, T, D, dtype=q.dtype, device=q.device)
    for k in range(Hkv):
        qk = qh[:, k].reshape(B, G * T, D)
        logits = torch.cat([torch.matmul(qk, shared_k[:, :, k].transpose(1, 2)),
                            torch.matmul(qk, tail_k[:, :, k].transpose(1, 2))], dim=-1)  # [B, G*T, P+Tc]
        logits = logits.view(B, G, T, -1).masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(logits, dim=-1).view(B, G * T, -1)
        o = torch.matmul(probs[..., :P], shared_v[:, :, k]) + torch.matmul(probs[..., P:], tail_v[:, :, k])
        out[:, k] = o.view(B, G, T, D)
    return out.permute(0, 3, 1, 2, 4).reshape(B, T, H, D)


def sparse_decode_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                            scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row over its selected tokens: q ``[R, H, D]``, pools flat ``[S, Hkv, D]``,
    slots int64 ``[R, W]`` (``-1``: no token). Returns (``[R, H, D]``, attended ``[R]``)."""
    R, H, D = q.shape
    Hkv = k_flat.shape[1]
    G = H // Hkv
    valid = slots >= 0
    safe = slots.clamp(min=0)  # static shape: -1 entries read slot 0 and are masked out
    k_sel, v_sel = k_flat[safe], v_flat[safe]  # [R, W, Hkv, D] (the gather is inherent)
    qs = q * scale
    out = torch.empty(R, H, D, dtype=q.dtype, device=q.device)
    neg = ~valid.unsqueeze(1)
    for k in range(Hkv):
        logits = torch.matmul(qs[:, k * G : (k + 1) * G], k_sel[:, :, k].transpose(1, 2))  # [R, G, W]
        probs = torch.softmax(logits.masked_fill_(neg, float("-inf")), dim=-1)
        out[:, k * G : (k + 1) * G] = torch.matmul(probs, v_sel[:, :, k])
    return out, valid.sum(dim=1)


def _prefill_attention(plan: StepPlan, layer: int, query, key, value, scale, window):
    """Chunked dense causal prefill of one text (batch 1): store K/V, SDPA over the prefix."""
    H, T, D = query.shape[1:]
    start = plan.position
    length = start + T
    plan.prefill_k[layer][start:length] = key[0].transpose(0, 1).to(torch.float32)
    plan.prefill_v[layer][start:length] = value[0].transpose(0, 1).to(torch.float32)
    hidden = plan.layer_hidden.pop(layer, None)
    if plan.prefill_h is not None and hidden is not None:
        plan.prefill_h[layer][start:length] = hidden[0].to(torch.float32)
    k_all = plan.prefill_k[layer][:length].transpose(0, 1)  # [Hkv, L, D]
    v_all = plan.prefill_v[layer][:length].transpose(0, 1)
    pos_q = torch.arange(start, length, device=query.device).unsqueeze(1)
    pos_k = torch.arange(length, device=query.device).unsqueeze(0)
    allowed = pos_k <= pos_q
    if window is not None:
        allowed &= pos_k > pos_q - window
    out = torch.nn.functional.scaled_dot_product_attention(
        query[0].to(torch.float32), k_all, v_all, attn_mask=allowed, scale=scale, enable_gqa=True
    )  # [H, T, D]
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype)


def _decode_attention(plan: StepPlan, layer: int, query, key, value, scale, window):
    st, pools = plan.state, plan.pools[layer]
    B, H, T, D = query.shape
    Hkv = key.shape[1]
    R = B * T
    q = query.transpose(1, 2).to(torch.float32)  # [B, T, H, D]
    k_new = key.transpose(1, 2).reshape(R, Hkv, D).to(torch.float32)
    v_new = value.transpose(1, 2).reshape(R, Hkv, D).to(torch.float32)
    indexer = st.indexers.get(layer)
    clock = plan.clock
    if indexer is None or window is not None:  # dense (sliding-window layers stay dense in their window)
        t0 = clock()
        pools.flat(pools.k)[plan.slots] = k_new
        pools.flat(pools.v)[plan.slots] = v_new
        mask = plan.dense_mask if window is None else dense_mask(
            plan.shared_lens, plan.row_lengths, pools.layout.shared_tokens, pools.layout.tail_tokens, window)
        out = dense_decode_attention(q, pools.shared(pools.k), pools.shared(pools.v), pools.tail(pools.k, st.index),
                                     pools.tail(pools.v, st.index), mask, scale)
        plan.timers["attention"] += clock() - t0
        plan.attended.append(mask.sum())
        return out
    t0 = clock()
    q_rows = q.reshape(R, H, D)
    tracker = st.trackers[layer] if indexer.reads_drift or indexer.reads_queries else None
    # query_group_mass witnesses: the rows' attention queries, scaled as the attention scales them.
    witness_queries = q_rows * scale if indexer.reads_queries else None
    hidden = plan.layer_hidden.pop(layer, None)
    if indexer.shares_rows_of is not None:  # the scanning layer's rows: no indexer key written or read
        if tracker is not None:  # its tracker reads this layer's attention keys
            tracker.update(k_new, plan.positions, plan.request_ids)
        rows = indexer._compute_topk(None, None, None, plan.fmha, plan.attn, None, drift_tracker=tracker,
                                     topology_counters=plan.counters, shared_rows=plan.shared_rows,
                                     witness_queries=witness_queries)
        plan.timers["policy"] += clock() - t0
        return _sparse_attention(plan, st, pools, layer, q_rows, k_new, v_new, rows, scale).view(B, T, H, D)
    if pools.proxy.reads_hidden:  # the trained indexer: q, k and weights from the attention input
        h = hidden.reshape(R, hidden.shape[-1])  # [B, T, C] -> [R, C], request-major like the rows
        q_index, index_keys, weights = pools.proxy.from_hidden(indexer, h, plan.positions)
    else:
        index_keys, q_index, weights = pools.proxy.keys(k_new), pools.proxy.queries(q_rows), plan.weights
    drift = tracker if indexer.reads_drift else None  # key drift reads the indexer keys
    if indexer.scan or drift is not None:  # no scan and no drift (recency): no indexer key is read
        indexer.write_keys(index_keys, pools.index_cache, plan.slots, drift_tracker=drift,
                           positions=plan.positions, request_ids=plan.request_ids)
    t1 = clock()
    if indexer.reads_queries:  # the attention keys, timed with the policy
        tracker.update(k_new, plan.positions, plan.request_ids)
    rows = indexer._compute_topk(q_index, weights, pools.index_cache, plan.fmha, plan.attn, None,
                                 drift_tracker=tracker, topology_counters=plan.counters,
                                 shared_rows=plan.shared_rows, witness_queries=witness_queries)
    t2 = clock()
    scan_s = (t1 - t0) + indexer.last_op_s
    if indexer.scan:
        plan.timers["indexer"] += scan_s
        plan.timers["policy"] += (t2 - t1) - indexer.last_op_s
    else:  # no scan: the key write only feeds the drift the policy reads
        plan.timers["policy"] += t2 - t0
    return _sparse_attention(plan, st, pools, layer, q_rows, k_new, v_new, rows, scale).view(B, T, H, D)


def _sparse_attention(plan: StepPlan, st: VariantState, pools: LayerPools, layer: int, q_rows, k_new, v_new,
                      rows, scale) -> torch.Tensor:
    """Store the step's K/V, then each row over its selected tokens (``[R, H, D]``); timed."""
    t0 = plan.clock()
    pools.flat(pools.k)[plan.slots] = k_new
    pools.flat(pools.v)[plan.slots] = v_new
    slots = rows_to_slots(rows, st.block_table, plan.request_ids)
    out, attended = sparse_decode_attention(q_rows, pools.flat(pools.k), pools.flat(pools.v), slots, scale)
    plan.timers["attention"] += plan.clock() - t0
    plan.attended.append(attended.sum())
    plan.sparse_attended.append(plan.attended[-1])
    return out


def decode_attention_hook(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered attention: prefill (one text, chunked) or a decode step of a batch.

    query ``[B, H, T, D]``, key/value ``[B, Hkv, T, D]`` for this forward's T new tokens
    per request. Returns ``([B, T, H, D], None)``. Layers with a ``sliding_window`` kwarg
    stay dense inside their window.
    """
    plan: Optional[StepPlan] = kwargs.get(PLAN_KWARG)
    if plan is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs a {PLAN_KWARG}= keyword (see StepPlan)")
    D = query.shape[-1]
    scale = D**-0.5 if scaling is None else scaling
    window = kwargs.get("sliding_window")
    if plan.mode == "prefill":
        if query.shape[0] != 1:
            raise ValueError(f"{ATTENTION_NAME}: prefill expects one text (batch 1), got {query.shape[0]}")
        return _prefill_attention(plan, module.layer_idx, query, key, value, scale, window), None
    return _decode_attention(plan, module.layer_idx, query, key, value, scale, window).to(query.dtype), None


def register() -> None:
    """Register the hook and a mask function under :data:`ATTENTION_NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, decode_attention_hook)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

