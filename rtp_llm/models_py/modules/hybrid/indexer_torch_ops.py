"""Torch reference of the lightning-indexer ops: logits, top-k, paged and ragged key reads.

Stands in for the engine's compiled kernels (DeepGEMM ``fp8_mqa_logits`` /
``fp8_paged_mqa_logits``, ``fast_topk_transform_*``, ``cp_gather_indexer_k_quant_cache``)
so the whole indexer path runs on a CPU. Shape vocabulary (shared with the policy):

    R  query rows (one causal length each)    W  top-k width (2048 in DeepSeek-V3.2)
    B  requests                               L  KV length (tokens)
    H  indexer heads, D indexer head dim      MB block-table columns (blocks per request)

Math (DeepSeek-V3.2 lightning indexer): for row ``t`` and visible token ``s``
``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])``, accumulated in fp32. Row ``t`` sees
tokens ``0 .. length[t] - 1`` of its request (causal length, ``expanded_seq_lens``).

Top-k output convention (the engine's; docs/architecture.md): int32 ``[R, W]``. A row with
``length <= W`` holds ``offset + 0 .. offset + length - 1`` ascending, then ``-1``. A
longer row holds the ``W`` highest-scoring positions plus ``offset``, in descending score
order, ties to the lower position (the engine promises no order; this one is fixed so
tests can compare exactly).

Everything is vectorized over rows; the only Python loop walks fixed-size row *chunks*
that bound the ``[chunk, H, L]`` logits buffer (and, in the paged op, the ``[chunk, L, D]``
keys gathered block by block from the pool). No value is read on the host (no
``.item()``, ``nonzero``), so the ops also run under a CUDA sync-debug guard. Per-row
results do not depend on which other rows share a call (CP rank subsets give the same
rows as the whole batch; pinned by the CP test).
"""

from __future__ import annotations

from typing import Optional

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.schedule import score_sort_keys

DEFAULT_TOPK_WIDTH = 2048  # DeepSeek-V3.2 index_topk
DEFAULT_PAGE_SIZE = 64  # the engine's KV page (kernel_tokens_per_block)
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_GROUP_SIZE = 128  # the engine quantizes q and k per token in groups of 128 channels
# Elements of the per-chunk [chunk, H, L] logits buffer: 2**24 fp32 = 64 MiB.
_LOGITS_ELEMENT_BUDGET = 1 << 24
# Elements of the paged op's per-chunk [chunk, L, D] gathered keys: 2**21 fp32 = 8 MiB
# (the chunk is read back by the matmul right after the gather; measured in
# docs/results.md, "The indexer op's key gather").
_GATHER_ELEMENT_BUDGET = 1 << 21


def fp8_e4m3_round_trip(x: torch.Tensor, group_size: int = FP8_GROUP_SIZE) -> torch.Tensor:
    """Emulate per-token, per-group fp8-e4m3 quantization: quantize and dequantize.

    Parameters
    ----------
    x : float Tensor ``[..., D]``; ``D`` a multiple of ``min(group_size, D)``
    group_size : channels sharing one scale (128 in the engine; ``D`` when ``D < 128``)

    Returns
    -------
    float32 Tensor like ``x``: each group scaled so its absolute max maps to 448, cast to
    ``torch.float8_e4m3fn`` and back, and rescaled. Idempotent (the absolute max survives
    the round trip exactly, so the second pass uses the same scale). All-zero groups
    stay zero.
    """
    D = x.shape[-1]
    g = min(group_size, D)
    assert D % g == 0, f"fp8 group: head dim {D} is not a multiple of {g}"
    xf = x.to(torch.float32).reshape(*x.shape[:-1], D // g, g)  # [..., D/g, g]
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (xf / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return q.reshape(x.shape)


def _row_chunk(rows: int, heads: int, length: int, dim: int = 0) -> int:
    per_row = heads * max(length, 1) + max(length, 1) * dim
    step = _LOGITS_ELEMENT_BUDGET // per_row
    if dim:
        step = min(step, _GATHER_ELEMENT_BUDGET // (max(length, 1) * dim))
    return max(1, min(rows, step))


def topk_from_window_scores(
    window_scores: torch.Tensor, lengths: torch.Tensor, offsets: Optional[torch.Tensor], width: int
) -> torch.Tensor:
    """The engine's top-k transform on scores already in request-local coordinates.

    Parameters
    ----------
    window_scores : float32 ``[R, Lw]``; column ``j`` scores position ``j`` of the row's
        request. Columns at or past ``lengths[r]`` are ignored (may hold anything).
    lengths : int ``[R]``, every value in ``[1, Lw]`` (not checked)
    offsets : int ``[R]`` or None (zeros)
    width : int ``W``

    Returns
    -------
    int32 ``[R, W]`` in the output convention of the module docstring.
    """
    R, Lw = window_scores.shape
    device = window_scores.device
    lengths64 = lengths.to(torch.int64).unsqueeze(1)  # [R, 1]
    off = torch.zeros_like(lengths64) if offsets is None else offsets.to(torch.int64).unsqueeze(1)
    pos = torch.arange(Lw, device=device).unsqueeze(0)  # [1, Lw]
    # Unique int64 keys (order-preserving bits of the score, then the position reversed):
    # topk is deterministic and ties go to the lower position.
    keys = score_sort_keys(window_scores, Lw - 1 - pos.expand(R, Lw))
    keys = torch.where(pos < lengths64, keys, torch.iinfo(torch.int64).min)
    k = min(width, Lw)
    top = torch.topk(keys, k, dim=1, largest=True, sorted=True).indices  # [R, k] positions
    if k < width:
        top = torch.nn.functional.pad(top, (0, width - k), value=-1)
    ar = torch.arange(width, device=device).unsqueeze(0)  # [1, W]
    short = torch.where(ar < lengths64, ar, -1)  # [R, W] the whole causal range
    chosen = torch.where(lengths64 <= width, short, top)
    return torch.where(chosen >= 0, chosen + off, -1).to(torch.int32)


def weighted_relu_logits(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The index score ``sum_h w[r, h] * relu(q[r, h] . k[l])`` for shared keys ``[L, D]`` -> ``[r, L]`` fp32."""
    dots = torch.einsum("rhd,ld->rhl", q, keys)  # (r, H, D) x (L, D) -> (r, H, L)
    return (torch.relu(dots) * weights.unsqueeze(-1)).sum(dim=1)  # [r, L]


def ragged_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    row_starts: torch.Tensor,
    lengths: torch.Tensor,
    offsets: Optional[torch.Tensor] = None,
    width: int = DEFAULT_TOPK_WIDTH,
    fp8_emulation: bool = False,
) -> torch.Tensor:
    """Prefill (ragged) indexer: logits over a ragged key buffer, then the top-k transform.

    Parameters
    ----------
    q : float ``[R, H, D]`` query rows
    weights : float ``[R, H]`` or ``[R, H, 1]`` per-head gate (softmax and q scales folded in)
    keys : float ``[L, D]`` ragged key buffer, requests back to back (``cu_kv_seqlens``)
    row_starts : int ``[R]`` (``ks``) start of the row's request in ``keys``
    lengths : int ``[R]`` (``expanded_seq_lens``) causal length, ``1 <= length`` and
        ``row_starts + length <= L`` (not checked)
    offsets : int ``[R]`` (``topk_indices_offset``) or None (zeros)
    width : ``W``
    fp8_emulation : round-trip q and keys through fp8-e4m3 first (:func:`fp8_e4m3_round_trip`)

    Returns
    -------
    int32 ``[R, W]``: request-local positions ``+ offset``, ``-1`` padding (module doc).
    """
    R, H, D = q.shape
    L = keys.shape[0]
    w = weights.reshape(R, H).to(torch.float32)
    qf = fp8_e4m3_round_trip(q) if fp8_emulation else q.to(torch.float32)
    kf = fp8_e4m3_round_trip(keys) if fp8_emulation else keys.to(torch.float32)
    out = torch.empty(R, width, dtype=torch.int32, device=q.device)
    pos = torch.arange(L, device=q.device).unsqueeze(0)  # [1, L]
    step = _row_chunk(R, H, L)
    for start in range(0, R, step):
        rows = slice(start, min(start + step, R))
        logits = weighted_relu_logits(qf[rows], w[rows], kf)  # [c, L] over the whole buffer
        # Shift into request-local coordinates: column j <- buffer position ks + j.
        src = torch.clamp(row_starts[rows].to(torch.int64).unsqueeze(1) + pos, max=L - 1)  # [c, L]
        window = torch.gather(logits, 1, src)
        off = None if offsets is None else offsets[rows]
        out[rows] = topk_from_window_scores(window, lengths[rows], off, width)
    return out


def paged_request_keys(k_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Every request's keys read through its block table.

    Parameters
    ----------
    k_cache : ``[num_blocks, page, D]`` paged key pool
    block_table : int ``[B, MB]``; negative entries (unused columns) read block 0

    Returns
    -------
    ``[B, MB * page, D]`` (dtype of ``k_cache``): position ``p`` of request ``b`` is
    ``k_cache.view(-1, D)[block_table[b, p // page] * page + p % page]``.
    """
    num_blocks, page, D = k_cache.shape
    B, MB = block_table.shape
    slot = block_table.to(torch.int64).clamp(min=0).unsqueeze(-1) * page + torch.arange(
        page, device=block_table.device
    )  # [B, MB, page]
    return k_cache.reshape(num_blocks * page, D)[slot.reshape(B, MB * page)]  # [B, MB*page, D]


def paged_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    row_to_request: torch.Tensor,
    width: int = DEFAULT_TOPK_WIDTH,
    fp8_emulation: bool = False,
) -> torch.Tensor:
    """Decode (paged) indexer: keys read through the block table, then the top-k transform.

    Parameters
    ----------
    q : float ``[R, H, D]`` decode rows (several per request for multi-token decode)
    weights : float ``[R, H]`` or ``[R, H, 1]``
    k_cache : ``[num_blocks, page, D]`` paged key pool
    block_table : int ``[B, MB]``
    lengths : int ``[R]`` (``expanded_seq_lens``) KV length of each row, ``1 <= length <= MB * page``
    row_to_request : int ``[R]`` request of each row (row of ``block_table``)
    width, fp8_emulation : as :func:`ragged_indexer_topk`

    Returns
    -------
    int32 ``[R, W]`` request-local positions (offset 0), ``-1`` padding.
    """
    R, H, D = q.shape
    Lmax = block_table.shape[1] * k_cache.shape[1]
    w = weights.reshape(R, H).to(torch.float32)
    qf = fp8_e4m3_round_trip(q) if fp8_emulation else q.to(torch.float32)
    # Each row's blocks (its request's row of the table; negative entries read block 0):
    # the keys are gathered block by block, once per row chunk, straight from the pool.
    row_blocks = block_table.to(torch.int64).clamp(min=0).index_select(0, row_to_request.to(torch.int64))
    out = torch.empty(R, width, dtype=torch.int32, device=q.device)
    step = _row_chunk(R, H, Lmax, D)
    for start in range(0, R, step):
        rows = slice(start, min(start + step, R))
        c = rows.stop - start
        k_rows = k_cache.index_select(0, row_blocks[rows].reshape(-1)).view(c, Lmax, D)  # [c, Lmax, D]
        k_rows = fp8_e4m3_round_trip(k_rows) if fp8_emulation else k_rows.to(torch.float32)
        dots = torch.einsum("chd,cld->chl", qf[rows], k_rows)  # (c, H, D) x (c, L, D) -> (c, H, L)
        logits = (torch.relu(dots) * w[rows].unsqueeze(-1)).sum(dim=1)  # [c, Lmax]
        out[rows] = topk_from_window_scores(logits, lengths[rows], None, width)
    return out


def gather_ragged_keys(
    k_cache: torch.Tensor, block_table: torch.Tensor, cu_kv_seqlens: torch.Tensor, total_kv_len: int
) -> torch.Tensor:
    """Reference of ``cp_gather_indexer_k_quant_cache``: the ragged key buffer from the pool.

    Parameters
    ----------
    k_cache : ``[num_blocks, page, D]``
    block_table : int ``[B, MB]``
    cu_kv_seqlens : int ``[B + 1]`` cumulative KV lengths (request ``b`` owns buffer rows
        ``cu[b] .. cu[b+1] - 1``, positions ``0 .. kv_len - 1``)
    total_kv_len : host int ``cu_kv_seqlens[-1]`` (known at plan time; passed to avoid a sync)

    Returns
    -------
    ``[total_kv_len, D]`` (dtype of ``k_cache``).
    """
    num_blocks, page, D = k_cache.shape
    cu = cu_kv_seqlens.to(torch.int64)
    t = torch.arange(total_kv_len, device=cu.device)  # [L]
    req = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp(max=block_table.shape[0] - 1)
    pos = t - cu[req]
    block = block_table.to(torch.int64)[req, torch.div(pos, page, rounding_mode="floor")]
    slot = block.clamp(min=0) * page + pos % page
    return k_cache.reshape(num_blocks * page, D)[slot]


def cp_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    total_local_ids: torch.Tensor,
    cu_kv_seqlens_global: torch.Tensor,
    total_kv_len: int,
    row_starts: torch.Tensor,
    lengths: torch.Tensor,
    offsets: Optional[torch.Tensor],
    width: int = DEFAULT_TOPK_WIDTH,
    fp8_emulation: bool = False,
) -> Optional[torch.Tensor]:
    """Context-parallel prefill: this rank's rows against the full (gathered) key buffer.

    Parameters
    ----------
    q, weights : this rank's query rows ``[T_local, H, D]`` / ``[T_local, H(, 1)]``
    total_local_ids : int64 ``[R_local]`` rows of ``q`` that take part
    cu_kv_seqlens_global, total_kv_len : the whole batch's KV layout (see :func:`gather_ragged_keys`)
    row_starts, lengths, offsets : int ``[R_local]``, i.e. ``fmha_params.{ks,
        expanded_seq_lens, topk_indices_offset}[total_global_ids]``

    Returns
    -------
    int32 ``[R_local, W]``, or None when the rank has no local row (the engine's contract).
    """
    if total_local_ids.numel() == 0:  # a shape, not a value: no sync
        return None
    ids = total_local_ids.to(torch.int64)
    keys = gather_ragged_keys(k_cache, block_table, cu_kv_seqlens_global, total_kv_len)
    q_local = q.index_select(0, ids)
    w_local = weights.reshape(q.shape[0], -1).index_select(0, ids)
    return ragged_indexer_topk(q_local, w_local, keys, row_starts, lengths, offsets, width, fp8_emulation)
