"""Query-aware witness signals (opt-in): rank blocks by the current query, not by drift.

The serving policy takes witness scores as a ``[R, N]`` (or ``[B, N]``) float tensor; this
module computes the alternatives to key-centroid drift that the quality harness and the
policy benchmark study (``topology_kv.config.WitnessSignal``). They need the row's query and a
per-block key table, so they cost ``R * N * H * D`` multiply-adds per call (``R * N * Hkv * D``
for ``query_group_mass``): one ``block_size``-th of a scan with the attention's shape. The serving ``Indexer`` wires only key drift
(``BlockDriftTracker``); see ``docs/results.md`` (section 6.3) for what each signal buys.

Shape vocabulary: ``R`` rows, ``N`` blocks, ``H`` query heads, ``Hkv`` KV heads, ``D``
head dim, ``L`` KV length. Public functions validate; ``_unchecked`` variants never sync.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import (
    FLOAT_DTYPES,
    check_block_keys,
    check_int,
    check_lengths,
    check_tensor,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import DEFAULT_BLOCK_SIZE


def query_centroid_scores(query: torch.Tensor, key_centroids: torch.Tensor) -> torch.Tensor:
    """Witness scores ``sum_h relu(q[r, h] . c[r, b, g(h)])`` (:attr:`WitnessSignal.QUERY_CENTROID`).

    Parameters
    ----------
    query : float ``[R, H, D]`` each row's query heads (post-RoPE)
    key_centroids : float ``[R, N, Hkv, D]`` (per row) or ``[N, Hkv, D]`` (shared), from
        :func:`block_key_centroids`; ``H`` must be a multiple of ``Hkv`` (GQA: query head
        ``h`` reads KV head ``h // (H / Hkv)``)

    Returns
    -------
    float32 ``[R, N]``. Blocks past a row's causal length are not masked here (the
    schedule ignores them). Cost ``R * N * H * D`` multiply-adds: the indexer's form at
    block granularity, ``block_size`` times cheaper than scanning every key.
    """
    _check_query_tables(query, {"key_centroids": key_centroids}, None, 1, None)
    return query_centroid_scores_unchecked(query, key_centroids)


def query_centroid_scores_unchecked(query: torch.Tensor, key_centroids: torch.Tensor) -> torch.Tensor:
    """:func:`query_centroid_scores` without validation (no host sync)."""
    R, H, D = query.shape
    Hkv = key_centroids.shape[-2]
    q = query.to(torch.float32).view(R, Hkv, H // Hkv, D)  # [R, Hkv, G, D]
    dots = _query_block_dot(q, key_centroids.to(torch.float32))  # [R, Hkv, G, N]
    return torch.relu(dots).sum(dim=(1, 2))  # [R, N]


def block_key_bounds(
    keys: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, lengths: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-channel minimum and maximum key of every block of ``block_size`` tokens.

    Parameters
    ----------
    keys : Tensor ``[L, H, D]`` or ``[B, L, H, D]``, float16/bfloat16/float32/float64
    block_size : int > 0
    lengths : optional int Tensor ``[B]`` (batched input only): tokens at or past a
        length are ignored

    Returns
    -------
    ``(key_min, key_max)``, each ``[N, H, D]`` or ``[B, N, H, D]``, float32 (float64 for
    float64 input), ``N = ceil(L / block_size)``. A block with no valid token is all zeros
    in both (its bound is then 0, like an empty centroid's dot product).
    """
    check_block_keys(keys, block_size, lengths)
    return block_key_bounds_unchecked(keys, block_size, lengths)


def block_key_bounds_unchecked(
    keys: torch.Tensor, block_size: int, lengths: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_key_bounds` without validation (no host sync)."""
    acc_dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
    squeeze = keys.dim() == 3
    k = (keys.unsqueeze(0) if squeeze else keys).to(acc_dtype)  # [B, L, H, D]
    B, L, H, D = k.shape
    N = (L + block_size - 1) // block_size
    valid = torch.arange(N * block_size, device=k.device).unsqueeze(0) < (
        torch.full((B, 1), L, device=k.device) if lengths is None else lengths.to(k.device).unsqueeze(1)
    )  # [B, N*bs]; the padding past L is invalid too
    pad = N * block_size - L
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))
    mask = valid.view(B, N, block_size, 1, 1)
    blocks = k.view(B, N, block_size, H, D)
    kmin = torch.where(mask, blocks, float("inf")).amin(dim=2)  # [B, N, H, D]
    kmax = torch.where(mask, blocks, float("-inf")).amax(dim=2)
    empty = ~valid.view(B, N, block_size).any(dim=2)  # [B, N]
    kmin = torch.where(empty[..., None, None], 0.0, kmin)
    kmax = torch.where(empty[..., None, None], 0.0, kmax)
    return (kmin.squeeze(0), kmax.squeeze(0)) if squeeze else (kmin, kmax)


def _check_query_tables(query: torch.Tensor, tables, lengths, block_size, scale) -> None:
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


def _query_block_dot(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``q [R, Hkv, G, D]`` against ``table`` ``[N, Hkv, D]`` or ``[R, N, Hkv, D]`` -> ``[R, Hkv, G, N]``."""
    if table.dim() == 3:
        return torch.einsum("rkgd,nkd->rkgn", q, table)
    return torch.einsum("rkgd,rnkd->rkgn", q, table)


def _softmax_block_mass(logits: torch.Tensor, lengths, block_size: int, scale: float) -> torch.Tensor:
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
    _check_query_tables(query, {"key_centroids": key_centroids}, lengths, block_size, scale)
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
    logits = _query_block_dot(q, key_centroids.to(torch.float32))
    return _softmax_block_mass(logits, lengths, block_size, D ** -0.5 if scale is None else scale)


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
    _check_query_tables(query, {"key_centroids": key_centroids}, lengths, block_size, scale)
    return query_group_mass_scores_unchecked(query, key_centroids, lengths, block_size, scale)


def query_group_mass_scores_unchecked(
    query: torch.Tensor,
    key_centroids: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`query_group_mass_scores` without validation (no host sync)."""
    R, H, D = query.shape
    Hkv = key_centroids.shape[-2]
    q = query.to(torch.float32).view(R, Hkv, H // Hkv, D).mean(dim=2, keepdim=True)  # [R, Hkv, 1, D]
    logits = _query_block_dot(q, key_centroids.to(torch.float32))
    return _softmax_block_mass(logits, lengths, block_size, D ** -0.5 if scale is None else scale)


def query_bound_scores(
    query: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Witness scores of :attr:`WitnessSignal.QUERY_BOUND`: :func:`query_mass_scores` with a bound.

    For row ``r``, head ``h`` (KV head ``g(h)``) and block ``b``:
    ``u = sum_d max(q_d kmin[b, g, d], q_d kmax[b, g, d])`` bounds ``q . k`` for every key
    of the block from above; ``score[r, b] = sum_h softmax_b(scale * u)`` over the row's
    eligible blocks, ineligible blocks 0, rows summing to ``H``.

    Parameters
    ----------
    query : float ``[R, H, D]``
    key_min, key_max : float ``[N, Hkv, D]`` (shared) or ``[R, N, Hkv, D]`` (per row), from
        :func:`block_key_bounds`
    lengths, block_size, scale : as in :func:`query_mass_scores`

    Returns
    -------
    float32 ``[R, N]``. Cost ``2 R N H D`` multiply-adds plus a softmax over ``[R, H, N]``.
    """
    _check_query_tables(query, {"key_min": key_min, "key_max": key_max}, lengths, block_size, scale)
    return query_bound_scores_unchecked(query, key_min, key_max, lengths, block_size, scale)


def query_bound_scores_unchecked(
    query: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`query_bound_scores` without validation (no host sync)."""
    R, H, D = query.shape
    Hkv = key_min.shape[-2]
    q = query.to(torch.float32).view(R, Hkv, H // Hkv, D)  # [R, Hkv, G, D]
    # max(q kmin, q kmax) = q+ kmax - q- kmin, summed over d.
    logits = _query_block_dot(torch.relu(q), key_max.to(torch.float32)) - _query_block_dot(
        torch.relu(-q), key_min.to(torch.float32)
    )
    return _softmax_block_mass(logits, lengths, block_size, D ** -0.5 if scale is None else scale)

