"""The checked block exchange in its decode shape: what a sharing layer would run on its reused rows.

A sharing layer reuses the rows of the scanning layer below it. The checked exchange swaps
whole blocks of its own keys into those rows where a bound says they carry more of this
layer's attention than the entries they replace (``benchmark/quality/witness_exchange.py``
states the rule; its ``checked_exchange_rows`` is the harness's version over a prefill's
full logits, which this one is tested against). Per row it reads:

* the logits of its ``W`` entries (the keys the sparse attention reads anyway): exact masses,
  normalised over the row per query head and summed over the heads;
* its request's table of block key sums (what the ``query_group_mass`` witness scores read,
  ``BlockDriftTracker.block_sums``): ``q . (sum of a block's keys)`` less the in-row tokens'
  logits is the sum of the logits of the block's tokens outside the row, so by Jensen they
  carry at least ``n_out * exp(mean)``.

Shape vocabulary: ``R`` rows, ``W`` row width, ``B`` requests, ``N`` blocks, ``H`` query heads,
``Hkv`` KV heads, ``D`` head dim, ``L`` key length.
"""

from __future__ import annotations

from typing import Tuple

import torch


def take_blocks(r: torch.Tensor, entry_mass: torch.Tensor, bound: torch.Tensor, n_out: torch.Tensor,
                outs: torch.Tensor, lengths: torch.Tensor, margin: float, cap: int,
                block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exchange's choice for rows: ``(swaps int64 [R], rows int64 [R, W])``.

    Blocks go in whole, the densest bound per token first, each for the row's least-mass
    entries, while the block's bound exceeds ``margin`` times the mass of the entries it
    replaces and at most ``cap`` entries are swapped; rows no longer than ``W`` keep theirs.

    ``r``: int64 rows ``[R, W]``, ``-1`` padding; ``entry_mass``: ``[R, W]`` each entry's mass
    (any value at padding); ``bound`` / ``n_out``: ``[R, N]`` each block's mass bound and count
    of tokens outside the row; ``outs``: bool ``[R, L]`` the tokens outside the row below its
    length; ``lengths``: int64 ``[R]``."""
    R, W = r.shape
    L = outs.shape[1]
    device = r.device
    pos = torch.arange(L, device=device)
    density = torch.where(n_out > 0, bound / n_out.clamp(min=1), torch.tensor(float("-inf"), device=device))
    order_b = density.argsort(dim=1, descending=True, stable=True)
    n_sorted = n_out.gather(1, order_b).to(torch.int64)
    bound_sorted = bound.gather(1, order_b)
    used = n_sorted.cumsum(1)  # entries taken after each block
    # The row's entries, least mass first; padding never goes (finite, above any mass).
    m_in = torch.where(r >= 0, entry_mass, torch.full_like(entry_mass, 1e30))
    order_e = m_in.argsort(dim=1, stable=True)
    m_cum = torch.cat([torch.zeros(R, 1, device=device), m_in.gather(1, order_e).cumsum(1)], dim=1)
    evicted = m_cum.gather(1, used.clamp(max=W)) - m_cum.gather(1, (used - n_sorted).clamp(max=W))
    gains = (bound_sorted > margin * evicted) & (n_sorted > 0) & (used <= cap)
    # Densities fall and evicted masses rise along the blocks: take the prefix that gains.
    take = gains.to(torch.int64).cumprod(1).bool() & (lengths > W).unsqueeze(1)
    k = (take.to(torch.int64) * n_sorted).sum(1)
    taken = torch.zeros_like(take).scatter_(1, order_b, take)
    new = outs & taken[:, pos // block_size]
    new_pos = torch.where(new, pos.unsqueeze(0), L).sort(dim=1).values[:, :cap]
    if new_pos.shape[1] < cap:
        new_pos = torch.cat([new_pos, torch.full((R, cap - new_pos.shape[1]), L, device=device)], dim=1)
    slots = order_e[:, :cap]
    j = torch.arange(cap, device=device).unsqueeze(0)
    out = r.clone()
    out.scatter_(1, slots, torch.where(j < k.unsqueeze(1), new_pos, r.gather(1, slots)))
    return k, out


def checked_exchange_decode(rows: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
                            block_sums: torch.Tensor, block_counts: torch.Tensor, row_to_request: torch.Tensor,
                            block_size: int, margin: float, cap: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows int32 [R, W], swaps int64 [R])``: decode rows after the checked exchange.

    ``rows``: int ``[R, W]`` reused rows, ``-1`` padding; ``lengths``: ``[R]``; ``queries``: float
    ``[R, H, D]`` post-RoPE **times the softmax scale**; ``keys``: ``[B, L, Hkv * D]`` each
    request's attention keys (KV head-major columns, as ``block_sums``); ``block_sums`` /
    ``block_counts``: ``[B, N, Hkv * D]`` / ``[B, N]`` the request's block key sums and counts,
    holding exactly the keys below the row's length (a decode step's tracker); ``cap``: most
    entries swapped per row. The inputs are not modified."""
    R, W = rows.shape
    if cap <= 0 or R == 0:
        return rows.clone().to(torch.int32), torch.zeros(R, dtype=torch.int64, device=rows.device)
    _, H, D = queries.shape
    Hkv = block_sums.shape[2] // D
    req, n, r, valid, q, logit, log_z = decode_row_logits(rows, lengths, queries, keys, row_to_request, Hkv)
    entry_mass = torch.exp(logit - log_z).sum(1)  # [R, W]; 0 at padding
    mean_out, n_out = outsider_means(req, r, valid, q, logit, block_sums, block_counts, block_size)
    bound = (n_out.unsqueeze(1) * torch.exp((mean_out - log_z).clamp(max=80.0))).sum(1)  # [R, N]
    outs = outside_row(r, n)
    swaps, out = take_blocks(r, entry_mass, bound, n_out, outs, n, margin, cap, block_size)
    return out.to(torch.int32), swaps


def decode_row_logits(rows: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
                      row_to_request: torch.Tensor, kv_heads: int):
    """The logits of each decode row's own entries, which the sparse attention computes anyway:
    ``(request int64 [R], lengths int64 [R], rows int64 [R, W], valid bool [R, W], queries fp32
    [R, Hkv, H / Hkv, D], logit fp32 [R, H, W] (-inf at padding), log_z fp32 [R, H, 1])``, the
    last the log-normaliser over the row per query head. Arguments as
    :func:`checked_exchange_decode`'s."""
    R, W = rows.shape
    _, H, D = queries.shape
    req = row_to_request.to(torch.int64)
    r = rows.to(torch.int64)
    valid = r >= 0
    q = queries.to(torch.float32).view(R, kv_heads, H // kv_heads, D)
    k_row = keys[req.unsqueeze(1), r.clamp(min=0)].to(torch.float32).view(R, W, kv_heads, D)
    logit = torch.einsum("rgjd,rwgd->rgjw", q, k_row).reshape(R, H, W)
    logit = logit.masked_fill(~valid.unsqueeze(1), float("-inf"))
    return req, lengths.to(torch.int64), r, valid, q, logit, torch.logsumexp(logit, dim=2, keepdim=True)


def outsider_means(req: torch.Tensor, r: torch.Tensor, valid: torch.Tensor, q: torch.Tensor, logit: torch.Tensor,
                   block_sums: torch.Tensor, block_counts: torch.Tensor,
                   block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean_out fp32 [R, H, N], n_out fp32 [R, N])``: per row, query head and block, the mean
    logit of the block's tokens outside the row (0 where there are none) and their count, from
    the request's block key sums and counts (``q . sum`` less the in-row entries' logits).
    ``req`` ... ``logit``: :func:`decode_row_logits`' outputs; the tables as
    :func:`checked_exchange_decode`'s."""
    R, H, W = logit.shape
    Hkv, D = q.shape[1], q.shape[3]
    sums = block_sums[req].to(torch.float32)
    N = sums.shape[1]
    block_logit = torch.einsum("rgjd,rngd->rgjn", q, sums.view(R, N, Hkv, D)).reshape(R, H, N)
    blk = torch.where(valid, r // block_size, N)  # padding into a spill column
    in_sum = torch.zeros(R, H, N + 1, device=r.device).scatter_add_(
        2, blk.unsqueeze(1).expand(R, H, W), logit.masked_fill(~valid.unsqueeze(1), 0.0))[:, :, :N]
    in_count = torch.zeros(R, N + 1, device=r.device).scatter_add_(1, blk, valid.to(torch.float32))[:, :N]
    n_out = (block_counts[req].to(torch.float32) - in_count).clamp(min=0)
    return (block_logit - in_sum) / n_out.clamp(min=1).unsqueeze(1), n_out


def outside_row(r: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """bool ``[R, L]`` (``L`` the longest length): the positions below each row's length that
    are not among its entries (``r`` int64 ``[R, W]``, ``-1`` padding)."""
    R = r.shape[0]
    L = int(lengths.max()) if R else 0
    in_row = torch.zeros(R, L + 1, dtype=torch.bool, device=r.device)
    in_row.scatter_(1, torch.where(r >= 0, r, L), True)
    return (torch.arange(L, device=r.device).unsqueeze(0) < lengths.unsqueeze(1)) & ~in_row[:, :L]
