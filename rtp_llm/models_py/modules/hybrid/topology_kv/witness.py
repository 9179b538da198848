"""Query-aware witness scores: rank blocks by each row's query, not by key drift.

``WitnessSignal.QUERY_GROUP_MASS`` is served: the ``Indexer`` computes it per row from the
caller's attention queries and a :class:`~rtp_llm.models_py.modules.hybrid.topology_kv.drift.BlockDriftTracker`
fed with the layer's attention keys (:func:`tracker_query_group_mass_scores`).
``query_mass`` (one softmax per query head) is the harness's; the harness-only signals
built on the same pieces (``query_centroid``, ``query_bound``) live in
``benchmark/candidates/witness.py``.

Shape vocabulary: ``R`` rows, ``B`` requests, ``N`` blocks, ``H`` query heads, ``Hkv`` KV
heads, ``D`` head dim. Public functions validate; ``_unchecked`` variants never sync.
"""

from __future__ import annotations

from typing import Optional

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_int,
    check_lengths,
    check_tensor,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import DEFAULT_BLOCK_SIZE
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_witness


def check_query_tables(query: torch.Tensor, tables, lengths, block_size, scale) -> None:
    """Validation shared by the query-aware witness signals (``tables``: name -> tensor)."""
    check_tensor("query", query, ndims=(3,), dtypes=FLOAT_DTYPES)
    check_int("block_size", block_size, 1)
    R, H, D = query.shape
    first_name, first = next(iter(tables.items()))
    for name, table in tables.items():
        check_tensor(name, table, ndims=(3, 4), dtypes=FLOAT_DTYPES)
        if table.shape != first.shape:
            raise ValueError(
                f"{name}: expected the shape of {first_name} {tuple(first.shape)}, got {tuple(table.shape)}"
            )
    Hkv = first.shape[-2]
    if first.shape[-1] != D or H % Hkv:
        raise ValueError(
            f"{first_name}: expected [..., Hkv, {D}] with Hkv dividing {H} query heads, got shape {tuple(first.shape)}"
        )
    if first.dim() == 4 and first.shape[0] != R:
        raise ValueError(f"{first_name}: expected {R} rows, got shape {tuple(first.shape)}")
    if lengths is not None:
        check_lengths(lengths, rows=R)
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
        raise ValueError(f"scale: expected a positive number or None, got {scale!r}")


def query_block_dot(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``q [R, Hkv, G, D]`` against ``table`` ``[N, Hkv, D]`` or ``[R, N, Hkv, D]`` -> ``[R, Hkv, G, N]``."""
    if table.dim() == 3:
        return torch.einsum("rkgd,nkd->rkgn", q, table)
    return torch.einsum("rkgd,rnkd->rkgn", q, table)


def softmax_block_mass(logits: torch.Tensor, lengths, block_size: int, scale: float) -> torch.Tensor:
    """``sum_h softmax_b(scale * logits)`` over each row's eligible blocks -> float32 ``[R, N]``."""
    u = logits * scale  # [R, Hkv, G, N]
    if lengths is not None:
        N = u.shape[-1]
        n_blocks = (lengths.to(torch.int64) + block_size - 1) // block_size  # [R]
        eligible = torch.arange(N, device=u.device).unsqueeze(0) < n_blocks.to(u.device).unsqueeze(1)  # [R, N]
        u = u.masked_fill(~eligible[:, None, None, :], float("-inf"))
    return torch.softmax(u, dim=-1).sum(dim=(1, 2))


def query_mass_scores(
    query: torch.Tensor,
    key_centroids: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Witness scores of :attr:`WitnessSignal.QUERY_MASS`: estimated attention mass per block.

    ``score[r, b] = sum_h softmax_b(scale * q[r, h] . c[b, g(h)])`` over the row's eligible
    blocks (those holding a token ``< lengths[r]``; every block when ``lengths`` is None);
    ineligible blocks score 0 and each row sums to ``H`` (every head contributes mass 1).

    Parameters
    ----------
    query : float ``[R, H, D]`` each row's query heads (post-RoPE)
    key_centroids : float ``[N, Hkv, D]`` (shared) or ``[R, N, Hkv, D]`` (per row), from
        :func:`block_key_centroids`; ``H`` a multiple of ``Hkv`` (head ``h`` reads KV head
        ``h // (H / Hkv)``)
    lengths : optional int ``[R]`` causal lengths (> 0)
    block_size : tokens per block (only used with ``lengths``)
    scale : softmax scale; default ``D ** -0.5``

    Returns
    -------
    float32 ``[R, N]``. Cost ``R N H D`` multiply-adds plus a softmax over ``[R, H, N]``.
    """
    check_query_tables(query, {"key_centroids": key_centroids}, lengths, block_size, scale)
    return query_mass_scores_unchecked(query, key_centroids, lengths, block_size, scale)


def query_mass_scores_unchecked(
    query: torch.Tensor,
    key_centroids: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`query_mass_scores` without validation (no host sync)."""
    R, H, D = query.shape
    Hkv = key_centroids.shape[-2]
    q = query.to(torch.float32).view(R, Hkv, H // Hkv, D)  # [R, Hkv, G, D]
    logits = query_block_dot(q, key_centroids.to(torch.float32))
    return softmax_block_mass(logits, lengths, block_size, D ** -0.5 if scale is None else scale)


def query_group_mass_scores(
    query: torch.Tensor,
    key_centroids: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Witness scores of :attr:`WitnessSignal.QUERY_GROUP_MASS`: :func:`query_mass_scores` per KV head.

    The query heads that read KV head ``g`` are pooled to their mean ``qbar[r, g]``;
    ``score[r, b] = sum_g softmax_b(scale * qbar[r, g] . c[b, g])`` over the row's eligible
    blocks, ineligible blocks 0, each row summing to ``Hkv``. With ``H == Hkv`` it is
    :func:`query_mass_scores`.

    Parameters
    ----------
    query, key_centroids, lengths, block_size, scale : as in :func:`query_mass_scores`

    Returns
    -------
    float32 ``[R, N]``. Cost ``R N Hkv D`` multiply-adds (``H / Hkv`` times fewer than
    :func:`query_mass_scores`) plus a softmax over ``[R, Hkv, N]``.
    """
    check_query_tables(query, {"key_centroids": key_centroids}, lengths, block_size, scale)
    return query_group_mass_scores_unchecked(query, key_centroids, lengths, block_size, scale)


def query_group_mass_scores_unchecked(
    query: torch.Tensor,
    key_centroids: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`query_group_mass_scores` without validation (no host sync)."""
    pooled = group_mean_queries(query, key_centroids.shape[-2])  # one query head per KV head
    return query_mass_scores_unchecked(pooled, key_centroids, lengths, block_size, scale)


def group_mean_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """fp32 ``[R, Hkv, D]``: the mean of the query heads ``[R, H, D]`` that read each KV head."""
    R, H, D = query.shape
    return query.to(torch.float32).view(R, kv_heads, H // kv_heads, D).mean(dim=2)


def tracker_query_group_mass_scores(
    queries: torch.Tensor,
    block_sums: torch.Tensor,
    block_counts: torch.Tensor,
    row_to_request: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """:func:`query_group_mass_scores` of every row against its own request's block key centroids.

    What the serving ``Indexer`` computes for ``WitnessSignal.QUERY_GROUP_MASS``: the
    centroids are a :class:`~rtp_llm.models_py.modules.hybrid.topology_kv.drift.BlockDriftTracker`'s
    (``block_sums() / max(block_counts(), 1)``, fed with the layer's attention keys),
    ``score[r, b] = sum_g softmax_b(qbar[r, g] . c[req(r), b, g])`` over the row's eligible
    blocks (``b < ceil(lengths[r] / block_size)``), ineligible blocks 0, each row summing
    to ``Hkv``.
    In a prefill the tracker holds the whole chunk's keys, so the centroid of a row's own
    last block may include keys after the row (the score only: the policy still selects
    causal tokens); in decode it holds exactly the keys up to the step.

    Parameters
    ----------
    queries : float ``[R, H, D]`` each row's post-RoPE attention queries **times the
        attention's softmax scale** (the mass is ``softmax(qbar . c)``)
    block_sums : float ``[B, N, Hkv * D]`` per request and block, the sum of the keys fed
        (KV head-major: head ``g`` is columns ``g D .. (g + 1) D - 1``); ``H`` a multiple of ``Hkv``
    block_counts : float ``[B, N]`` keys fed per block
    row_to_request : int ``[R]`` each row's request, ``< B``
    lengths : int ``[R]`` causal lengths (> 0)
    block_size : tokens per block (> 0)

    Returns
    -------
    float32 ``[R, N]``. Cost ``R N Hkv D`` multiply-adds; rows are gathered in chunks of at
    most 4M table elements, so a long prefill never builds an ``[R, N, Hkv, D]`` table.
    """
    check_tensor("queries", queries, ndims=(3,), dtypes=FLOAT_DTYPES)
    check_tensor("block_sums", block_sums, ndims=(3,), dtypes=FLOAT_DTYPES)
    R, H, D = queries.shape
    B, N, K = block_sums.shape
    if K % D or H % (K // D):
        raise ValueError(f"block_sums: expected [B, N, Hkv * {D}] with Hkv dividing {H} query heads (queries "
                         f"{tuple(queries.shape)}), got shape {tuple(block_sums.shape)}")
    check_tensor("block_counts", block_counts, shape=(B, N), dtypes=FLOAT_DTYPES)
    check_tensor("row_to_request", row_to_request, shape=(R,), dtypes=INDEX_DTYPES)
    check_lengths(lengths, rows=R)
    check_int("block_size", block_size, 1)
    return tracker_query_group_mass_scores_unchecked(queries, block_sums, block_counts, row_to_request, lengths,
                                                     block_size)


_TABLE_CHUNK_ELEMENTS = 1 << 22


def tracker_query_group_mass_scores_unchecked(
    queries: torch.Tensor,
    block_sums: torch.Tensor,
    block_counts: torch.Tensor,
    row_to_request: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """:func:`tracker_query_group_mass_scores` without validation (no host sync).

    CPU tensors with float32 sums and counts (a tracker's) run the C++ kernel
    (:func:`~rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpu_witness.query_group_mass_cpu`:
    one read of each row's request table, rows in parallel) when it builds; everything else
    runs :func:`tracker_query_group_mass_scores_reference`. The two agree to fp32 rounding."""
    if (queries.device.type == "cpu" and block_sums.dtype == torch.float32 and block_counts.dtype == torch.float32
            and cpu_witness.can_use_witness_kernel(queries.device)):
        return cpu_witness.query_group_mass_cpu(queries, block_sums, block_counts, row_to_request, lengths,
                                                block_size)
    return tracker_query_group_mass_scores_reference(queries, block_sums, block_counts, row_to_request, lengths,
                                                     block_size)


def tracker_query_group_mass_scores_reference(
    queries: torch.Tensor,
    block_sums: torch.Tensor,
    block_counts: torch.Tensor,
    row_to_request: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """:func:`tracker_query_group_mass_scores` in torch ops, any device, without validation: the
    specification the C++ kernel is tested against (a gathered ``[c, N, Hkv, D]`` table per
    chunk of rows, an elementwise product and a masked softmax)."""
    R, _, D = queries.shape
    B, N, K = block_sums.shape
    Hkv = K // D
    qbar = group_mean_queries(queries, Hkv).unsqueeze(1)  # [R, 1, Hkv, D]
    sums = block_sums.to(torch.float32)
    inv = 1.0 / block_counts.to(torch.float32).clamp(min=1.0)  # [B, N]
    rows = row_to_request.to(torch.int64)
    step = max(1, _TABLE_CHUNK_ELEMENTS // max(1, N * K))
    parts = []
    for c0 in range(0, R, step):
        req = rows[c0 : c0 + step]
        table = sums.index_select(0, req).view(-1, N, Hkv, D)  # [c, N, Hkv, D]: each row's request
        dots = (table * qbar[c0 : c0 + step]).sum(dim=-1)  # [c, N, Hkv]
        logits = (dots * inv.index_select(0, req).unsqueeze(-1)).transpose(1, 2)  # [c, Hkv, N]
        parts.append(softmax_block_mass(logits.unsqueeze(2), lengths[c0 : c0 + step], block_size, 1.0))
    if not parts:
        return torch.zeros(0, N, dtype=torch.float32, device=queries.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
