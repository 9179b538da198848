"""The verified token exchange in its decode shape: what a sharing layer would run on its reused rows.

A sharing layer reuses the rows of the scanning layer below it. The verified exchange swaps
single tokens of its own keys into those rows where their exact mass under this layer's query
beats the entry they replace (``benchmark/quality/witness_exchange.py`` states the rule; its
``verified_exchange_rows`` is the harness's version over a prefill's full logits, which this
one is tested against). Per row it reads:

* the keys of its ``W`` entries (what the sparse attention reads anyway): exact masses,
  normalised over the row per query head and summed over the heads;
* its request's per-block bounding boxes of the keys (:class:`BlockBoxes`, two tables the
  size of the drift tracker's block sums): an upper bound on every token's logit, which names
  the ``blocks`` candidate blocks;
* the keys of those blocks' tokens outside the row: exact masses.

It needs neither the drift tracker nor the witness scores: in a sharing layer it replaces
the whole witness hook (tracker update, scores, merge) by :meth:`BlockBoxes.update` and
:func:`verified_exchange_decode` (torch ops, the specification of the decode shape) or
:func:`verified_exchange_cpu` (one C++ pass per row, ``verified_exchange.cpp``, rows in
parallel; it reads each table where it lies instead of gathering a copy per row).

Shape vocabulary: ``R`` rows, ``W`` row width, ``B`` requests, ``N`` blocks, ``H`` query heads,
``Hkv`` KV heads, ``D`` head dim, ``L`` key length, ``M`` candidate blocks.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from benchmark.candidates.checked_exchange import decode_row_logits, outside_row, outsider_means
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpp_extension import CppKernel
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpu_drift import index_tensor

_KERNEL = CppKernel("topology_kv_verified_exchange_cpu",
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "verified_exchange.cpp"),
                    cflags=["-O3", "-fopenmp"], ldflags=["-fopenmp"])


class BlockBoxes:
    """Per-request, per-block bounding boxes of the attention keys: the least and the greatest
    value of each key column over the block's tokens fed so far.

    State: ``[B, N + 1, K]`` fp32 minima and maxima (column ``N`` a dump for positions past
    capacity), ``8 * B * (N + 1) * K`` bytes, twice the drift tracker's block sums. A block no
    token was fed has minima ``+inf`` and maxima ``-inf`` (its box is empty). Each position is
    fed once; :meth:`reset` a request before feeding it again."""

    def __init__(self, num_requests: int, max_blocks: int, key_dim: int, *, block_size: int,
                 device: Optional[torch.device] = None) -> None:
        for name, value in (("num_requests", num_requests), ("max_blocks", max_blocks), ("key_dim", key_dim),
                            ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        self.max_blocks = max_blocks
        self.block_size = block_size
        shape = (num_requests, max_blocks + 1, key_dim)
        self._min = torch.full(shape, float("inf"), device=device)
        self._max = torch.full(shape, float("-inf"), device=device)

    def update(self, keys: torch.Tensor, positions: torch.Tensor, request_ids: torch.Tensor) -> None:
        """Fold ``keys`` (``[T, K]``) at request-local ``positions`` (``[T]``) of requests
        ``request_ids`` (``[T]``) into their blocks' boxes; sync-free."""
        B, N1, K = self._min.shape
        if keys.shape[1:] != (K,) or positions.shape != keys.shape[:1] or request_ids.shape != keys.shape[:1]:
            raise ValueError(f"keys, positions, request_ids: expected [T, {K}], [T], [T], got "
                             f"{list(keys.shape)}, {list(positions.shape)}, {list(request_ids.shape)}")
        block = (positions.to(torch.int64) // self.block_size).clamp(max=N1 - 1)
        index = (request_ids.to(torch.int64) * N1 + block).unsqueeze(1).expand(-1, K)
        values = keys.to(self._min.dtype)
        self._min.view(B * N1, K).scatter_reduce_(0, index, values, "amin")
        self._max.view(B * N1, K).scatter_reduce_(0, index, values, "amax")

    def tables(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(minima, maxima)``, fp32 ``[B, N, K]`` views."""
        return self._min[:, : self.max_blocks], self._max[:, : self.max_blocks]

    def reset(self, request_ids: Optional[torch.Tensor] = None) -> None:
        """Forget the requests ``request_ids`` (int ``[k]``), or all."""
        if request_ids is None:
            self._min.fill_(float("inf"))
            self._max.fill_(float("-inf"))
            return
        ids = request_ids.to(device=self._min.device, dtype=torch.int64)
        self._min.index_fill_(0, ids, float("inf"))
        self._max.index_fill_(0, ids, float("-inf"))


def candidate_tokens(upper_mass: torch.Tensor, blocks: int, block_size: int) -> torch.Tensor:
    """int64 ``[R, M * block_size]``: the tokens of each row's ``M = min(blocks, N)`` blocks of
    highest ``upper_mass`` (``[R, N]``, ``-inf`` where a block has no token outside the row)."""
    R, N = upper_mass.shape
    cand = upper_mass.topk(min(blocks, N), dim=1).indices
    within = torch.arange(block_size, device=upper_mass.device)
    return (cand.unsqueeze(2) * block_size + within).reshape(R, -1)


def take_tokens(r: torch.Tensor, entry_mass: torch.Tensor, tok: torch.Tensor, tok_mass: torch.Tensor,
                lengths: torch.Tensor, margin: float, cap: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exchange's choice for rows: ``(swaps int64 [R], rows int64 [R, W])``.

    Candidate tokens, most mass first, replace the row's entries, least mass first, pair by
    pair while the token's mass exceeds ``margin`` times the entry's, at most ``cap`` pairs;
    rows no longer than ``W`` keep theirs. ``r``: int64 ``[R, W]``, ``-1`` padding;
    ``entry_mass``: ``[R, W]`` (any value at padding, which never goes); ``tok`` / ``tok_mass``:
    ``[R, C]`` candidate positions and their masses (``-inf`` for a token not to take)."""
    W = r.shape[1]
    entry_mass = torch.where(r >= 0, entry_mass, torch.full_like(entry_mass, 1e30))
    k_pairs = min(cap, tok.shape[1])
    best, best_i = tok_mass.topk(k_pairs, dim=1)  # most mass first
    order_e = entry_mass.argsort(dim=1, stable=True)[:, :k_pairs]  # least mass first
    least = entry_mass.gather(1, order_e)
    # Tokens fall and entries rise along the pairs: the swaps that gain are a prefix.
    take = (best > margin * least) & torch.isfinite(best) & (lengths > W).unsqueeze(1)
    take = take.to(torch.int64).cumprod(1).bool()
    out = r.clone()
    out.scatter_(1, order_e, torch.where(take, tok.gather(1, best_i), r.gather(1, order_e)))
    return take.sum(1), out


def verified_exchange_decode(rows: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
                             block_min: torch.Tensor, block_max: torch.Tensor, row_to_request: torch.Tensor,
                             block_size: int, margin: float, cap: int,
                             blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows int32 [R, W], swaps int64 [R])``: decode rows after the verified exchange.

    ``rows``: int ``[R, W]`` reused rows, ``-1`` padding; ``lengths``: ``[R]``; ``queries``: float
    ``[R, H, D]`` post-RoPE **times the softmax scale**; ``keys``: ``[B, L, Hkv * D]`` each
    request's attention keys (KV head-major columns); ``block_min`` / ``block_max``: ``[B, N,
    Hkv * D]`` the request's block boxes (:meth:`BlockBoxes.tables`), holding exactly the keys
    below the row's length (a decode step's); ``cap``: most entries swapped per row; ``blocks``:
    candidate blocks read per row. The inputs are not modified."""
    R, W = rows.shape
    if cap <= 0 or R == 0:
        return rows.clone().to(torch.int32), torch.zeros(R, dtype=torch.int64, device=rows.device)
    _, H, D = queries.shape
    Hkv = block_min.shape[2] // D
    req, n, r, valid, q, logit, log_z = decode_row_logits(rows, lengths, queries, keys, row_to_request, Hkv)
    entry_mass = torch.exp(logit - log_z).sum(1)  # [R, W]
    N = block_min.shape[1]
    lo = block_min[req].to(torch.float32).view(R, N, Hkv, D)
    hi = block_max[req].to(torch.float32).view(R, N, Hkv, D)
    # Per head, q . k <= q . c + |q| . h for every key in the box (c its centre, h its half-width).
    upper = (torch.einsum("rgjd,rngd->rgjn", q, (lo + hi) / 2)
             + torch.einsum("rgjd,rngd->rgjn", q.abs(), (hi - lo) / 2)).reshape(R, H, N)
    blk = torch.where(valid, r // block_size, N)  # padding into a spill column
    in_count = torch.zeros(R, N + 1, device=rows.device).scatter_add_(1, blk, valid.to(torch.float32))[:, :N]
    first = torch.arange(N, device=rows.device) * block_size
    visible = (n.unsqueeze(1) - first.unsqueeze(0)).clamp(0, block_size)
    has_out = visible > in_count  # empty boxes (NaN bounds) never have a token outside the row
    upper_mass = torch.exp((upper - log_z).clamp(max=80.0)).sum(1).masked_fill(~has_out, float("-inf"))
    return _exchange_candidates(req, n, r, q, log_z, entry_mass, upper_mass, keys, block_size, margin, cap, blocks)


def verified_exchange_mean_decode(rows: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor,
                                  keys: torch.Tensor, block_sums: torch.Tensor, block_counts: torch.Tensor,
                                  row_to_request: torch.Tensor, block_size: int, margin: float, cap: int,
                                  blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`verified_exchange_decode` with its candidate blocks named by rank ``mean``: the
    mass at the mean logit of each block's tokens outside the row, from the request's block key
    sums and counts (the drift tracker's ``block_sums``, as the checked exchange reads them)
    instead of bounding boxes. ``block_sums`` / ``block_counts``: ``[B, N, Hkv * D]`` / ``[B,
    N]``, holding exactly the keys below the row's length; the rest as
    :func:`verified_exchange_decode`'s. The inputs are not modified."""
    R, W = rows.shape
    if cap <= 0 or R == 0:
        return rows.clone().to(torch.int32), torch.zeros(R, dtype=torch.int64, device=rows.device)
    D = queries.shape[2]
    Hkv = block_sums.shape[2] // D
    req, n, r, valid, q, logit, log_z = decode_row_logits(rows, lengths, queries, keys, row_to_request, Hkv)
    entry_mass = torch.exp(logit - log_z).sum(1)  # [R, W]
    mean_out, n_out = outsider_means(req, r, valid, q, logit, block_sums, block_counts, block_size)
    mean_mass = torch.exp((mean_out - log_z).clamp(max=80.0)).sum(1).masked_fill(n_out <= 0, float("-inf"))
    return _exchange_candidates(req, n, r, q, log_z, entry_mass, mean_mass, keys, block_size, margin, cap, blocks)


def _exchange_candidates(req, n, r, q, log_z, entry_mass, rank_mass, keys, block_size, margin, cap, blocks):
    """The decode exchange after its ranking: the tokens outside the row of the ``blocks``
    blocks of highest ``rank_mass`` (``[R, N]``), their exact masses, and :func:`take_tokens`'
    choice, as ``(rows int32 [R, W], swaps int64 [R])``."""
    R, Hkv, G, D = q.shape
    tok = candidate_tokens(rank_mass, blocks, block_size)
    outs = torch.nn.functional.pad(outside_row(r, n), (0, 1))  # a False column for tokens past every length
    tok_ok = outs.gather(1, tok.clamp(max=outs.shape[1] - 1))
    k_tok = keys[req.unsqueeze(1), tok.clamp(max=keys.shape[1] - 1)].to(torch.float32)
    k_tok = k_tok.view(R, tok.shape[1], Hkv, D)
    tok_logit = torch.einsum("rgjd,rcgd->rgjc", q, k_tok).reshape(R, Hkv * G, -1)
    tok_mass = torch.exp(tok_logit - log_z).sum(1).masked_fill(~tok_ok, float("-inf"))
    swaps, out = take_tokens(r, entry_mass, tok, tok_mass, n, margin, cap)
    return out.to(torch.int32), swaps


def can_use_verified_kernel(device) -> bool:
    """Whether :func:`verified_exchange_cpu` can run on ``device`` (CPU and a working build); never raises."""
    return _KERNEL.available(device)


def verified_exchange_cpu(rows: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
                          block_min: torch.Tensor, block_max: torch.Tensor, row_to_request: torch.Tensor,
                          block_size: int, margin: float, cap: int,
                          blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`verified_exchange_decode`'s choice in one C++ call (CPU tensors; fp32 keys and
    boxes of any leading strides, as :meth:`BlockBoxes.tables` gives them). Equal to it up to
    fp32 rounding of the bounds and masses (another summation order). Raises RuntimeError
    naming the argument for a shape, dtype or index the kernel cannot take, before any work."""
    return _KERNEL.load().verified_exchange(
        rows.to(torch.int64).contiguous(), index_tensor(lengths).contiguous(),
        queries.to(torch.float32).contiguous(), keys, block_min, block_max,
        index_tensor(row_to_request).contiguous(), int(block_size), float(margin), int(cap), int(blocks))


def verified_exchange_mean_cpu(rows: torch.Tensor, lengths: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
                               block_sums: torch.Tensor, block_counts: torch.Tensor, row_to_request: torch.Tensor,
                               block_size: int, margin: float, cap: int,
                               blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`verified_exchange_mean_decode`'s choice in one C++ call (CPU tensors; fp32 key sums
    of any leading strides, as ``BlockDriftTracker.block_sums`` gives them). Equal to it up to
    fp32 rounding; errors as :func:`verified_exchange_cpu`'s."""
    return _KERNEL.load().verified_exchange_mean(
        rows.to(torch.int64).contiguous(), index_tensor(lengths).contiguous(),
        queries.to(torch.float32).contiguous(), keys, block_sums, block_counts.to(torch.float32).contiguous(),
        index_tensor(row_to_request).contiguous(), int(block_size), float(margin), int(cap), int(blocks))
