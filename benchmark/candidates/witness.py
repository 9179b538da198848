"""Query-aware witness signals of the harness: rank blocks by the current query, not by drift.

The serving policy takes witness scores as a ``[R, N]`` (or ``[B, N]``) float tensor; this
module computes the alternatives to key-centroid drift that the quality harness and the
policy benchmark study (``topology_kv.config.WitnessSignal``). They need the row's query and a
per-block key table, so they cost ``R * N * H * D`` multiply-adds per call (``R * N * Hkv * D``
for ``query_group_mass``): one ``block_size``-th of a scan with the attention's shape.
``query_mass`` and ``query_group_mass`` live in the serving package
(``topology_kv/witness.py``, re-exported here); the serving ``Indexer`` computes key drift
(``BlockDriftTracker``) and ``query_group_mass``. ``docs/results.md`` (section 6.3, and
"One query per KV head") says what each signal buys.

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
from rtp_llm.models_py.modules.hybrid.topology_kv.witness import (  # noqa: F401 (re-exported)
    check_query_tables,
    query_block_dot,
    query_group_mass_scores,
    query_group_mass_scores_unchecked,
    query_mass_scores,
    query_mass_scores_unchecked,
    softmax_block_mass,
)


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
    check_query_tables(query, {"key_centroids": key_centroids}, None, 1, None)
    return query_centroid_scores_unchecked(query, key_centroids)


def query_centroid_scores_unchecked(query: torch.Tensor, key_centroids: torch.Tensor) -> torch.Tensor:
    """:func:`query_centroid_scores` without validation (no host sync)."""
    R, H, D = query.shape
    Hkv = key_centroids.shape[-2]
    q = query.to(torch.float32).view(R, Hkv, H // Hkv, D)  # [R, Hkv, G, D]
    dots = query_block_dot(q, key_centroids.to(torch.float32))  # [R, Hkv, G, N]
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
    check_query_tables(query, {"key_min": key_min, "key_max": key_max}, lengths, block_size, scale)
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
    logits = query_block_dot(torch.relu(q), key_max.to(torch.float32)) - query_block_dot(
        torch.relu(-q), key_min.to(torch.float32)
    )
    return softmax_block_mass(logits, lengths, block_size, D ** -0.5 if scale is None else scale)

