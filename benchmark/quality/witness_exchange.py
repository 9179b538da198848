"""Exchanges of witness tokens into a sharing layer's reused rows (harness only): mass-gated and checked.

The served merge (``topology_sparse_merge``) gives witnesses a fixed share of ``W``: the
reused row's lowest-ranked entries make room for the best witness blocks, whether or not
those blocks carry more of this layer's attention than the entries they displace. The
exchange swaps an entry only when the layer's own estimate says it gains:

* each token's estimated mass is its block's witness score (``query_group_mass``: the
  softmax mass of the block centroid under the row's query, summed over KV heads) split
  evenly over the block's tokens the row can see;
* the reused row's best-ranked ``protect * W`` entries are never swapped (a block centroid
  says nothing of a single spiky token, such as an attention sink the indexer found);
* the other entries, least estimated mass first, are swapped against the tokens outside the
  row, most estimated mass first, while the outsider carries more than ``margin`` times the
  entry's estimate, at most ``cap * W`` of them.

The checked block exchange (:func:`checked_exchange_rows`) needs no estimate for the row's
entries, whose logits the sparse attention computes anyway: their masses are exact, and a
block's tokens outside the row go in whole only where a lower bound on their mass (Jensen,
from the block's key sum) beats the exact mass of the entries they replace. At 8k the
mass-gated exchange swaps out spiky entries its centroid estimate undervalues; the checked
one cannot (docs/results.md, "A checked block exchange").

Rows no longer than ``W`` (every token already in them) are returned as they are. The rows
stay the engine's: int32 ``[T, W]``, request-local positions, each at most once, every
entry below the row's length.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Tuple

import torch

from benchmark.candidates.checked_exchange import take_blocks
from benchmark.candidates.verified_exchange import candidate_tokens, take_tokens
from benchmark.quality.errors import UsageError


def _check_cap_margin(cap: Fraction, margin: float) -> None:
    if not 0 < cap <= 1:
        raise ValueError(f"cap: expected a share of W in (0, 1], got {cap}")
    if not (margin >= 0 and margin < float("inf")):
        raise ValueError(f"margin: expected a finite number >= 0, got {margin}")


@dataclasses.dataclass(frozen=True)
class Exchange:
    """``cap``: most entries swapped, a share of ``W``; ``margin``: an outsider must carry more
    than ``margin`` times the estimated mass of the entry it replaces; ``protect``: the reused
    row's best-ranked share of ``W`` that is never swapped."""

    cap: Fraction
    margin: float
    protect: Fraction

    def __post_init__(self) -> None:
        _check_cap_margin(self.cap, self.margin)
        if not 0 <= self.protect < 1:
            raise ValueError(f"protect: expected a share of W in [0, 1), got {self.protect}")

    @property
    def name(self) -> str:
        return f"exchange:{self.cap}:{self.margin:g}:{self.protect}"


def parse_exchange(text: str, flag: str = "--exchange") -> Exchange:
    """``CAP,MARGIN,PROTECT`` (e.g. ``1/4,2,1/2``) -> :class:`Exchange`; :class:`UsageError` naming ``flag``."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3:
        raise UsageError(f"{flag}: expected CAP,MARGIN,PROTECT (e.g. 1/4,2,1/2), got {text!r}")
    try:
        cap, margin, protect = Fraction(parts[0]), float(parts[1]), Fraction(parts[2])
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"{flag}: expected CAP,MARGIN,PROTECT as fraction,number,fraction (e.g. 1/4,2,1/2), "
                         f"got {text!r}") from None
    try:
        return Exchange(cap, margin, protect)
    except ValueError as exc:
        raise UsageError(f"{flag} {text!r}: {exc}") from None


def parse_exchange_setting(text: str, cap: float, where: str) -> Exchange:
    """The policy setting ``witness_exchange=MARGIN:PROTECT`` (e.g. ``2:1/2``), capped at the
    mode's ``max_structural_fraction`` ``cap``; :class:`UsageError` naming ``where``."""
    parts = [p.strip() for p in text.split(":")]
    if len(parts) != 2:
        raise UsageError(f"{where}: expected MARGIN:PROTECT (e.g. 2:1/2), got {text!r}")
    try:
        margin, protect = float(parts[0]), Fraction(parts[1])
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"{where}: expected MARGIN:PROTECT as number:fraction (e.g. 2:1/2), got {text!r}") from None
    try:
        return Exchange(Fraction(cap).limit_denominator(1 << 16), margin, protect)
    except ValueError as exc:
        raise UsageError(f"{where} {text!r}: {exc}") from None


def token_mass_estimates(block_scores: torch.Tensor, lengths: torch.Tensor, key_length: int,
                         block_size: int) -> torch.Tensor:
    """fp32 ``[T, L]``: each row's block score split evenly over the block's tokens below the
    row's length; 0 at and past the length. ``block_scores``: ``[T, N]`` or ``[1, N]`` (shared),
    ``N >= ceil(L / block_size)``."""
    T = lengths.shape[0]
    pos = torch.arange(key_length, device=lengths.device)
    block = pos // block_size
    scores = block_scores.to(torch.float32).expand(T, -1)[:, block]  # [T, L]
    lengths = lengths.to(torch.int64).unsqueeze(1)
    visible = (lengths - (block * block_size).unsqueeze(0)).clamp(0, block_size)  # [T, L]
    seen = pos.unsqueeze(0) < lengths
    return torch.where(seen, scores / visible.clamp(min=1), torch.zeros((), device=scores.device))


def exchange_rows(rows: torch.Tensor, lengths: torch.Tensor, block_scores: torch.Tensor, block_size: int,
                  exchange: Exchange) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows, swaps)``: int32 ``[T, W]`` rows after the exchange (module doc) and int64 ``[T]``
    entries swapped per row. ``rows``: int32 ``[T, W]`` reused rows, best-ranked first, ``-1``
    padding; ``lengths``: ``[T]`` causal lengths; ``block_scores``: ``[T, N]`` or ``[1, N]``.
    The inputs are not modified."""
    T, W = rows.shape
    if lengths.shape != (T,):
        raise ValueError(f"lengths: expected shape ({T},) like rows' first dim, got {tuple(lengths.shape)}")
    key_length = int(lengths.max()) if T else 0
    lengths = lengths.to(torch.int64)
    est = token_mass_estimates(block_scores, lengths, key_length, block_size)  # [T, L]
    r = rows.to(torch.int64)
    valid = r >= 0
    in_row = torch.zeros(T, key_length + 1, dtype=torch.bool, device=rows.device)
    in_row.scatter_(1, torch.where(valid, r, key_length), True)
    in_row = in_row[:, :key_length]
    protect = int(exchange.protect * W)
    cap = min(int(exchange.cap * W), W - protect)
    inf = torch.tensor(float("inf"), device=rows.device)
    est_in = torch.where(valid, est.gather(1, r.clamp(min=0)), inf)
    est_in[:, :protect] = inf  # the best-ranked entries stay
    order = est_in.argsort(dim=1, stable=True)[:, :cap]  # the least estimated mass first
    lowest = est_in.gather(1, order)
    outside = (torch.arange(key_length, device=rows.device).unsqueeze(0) < lengths.unsqueeze(1)) & ~in_row
    out_est = torch.where(outside, est, -inf)
    best, best_pos = out_est.topk(min(cap, key_length), dim=1)  # the most estimated mass first
    if best.shape[1] < cap:  # fewer tokens than the cap: nothing past them to swap in
        pad = cap - best.shape[1]
        best = torch.cat([best, torch.full((T, pad), -float("inf"), device=rows.device)], dim=1)
        best_pos = torch.cat([best_pos, torch.zeros((T, pad), dtype=torch.int64, device=rows.device)], dim=1)
    # Outsiders fall and entries rise along the pairs, so the swaps that gain are a prefix.
    take = (best > exchange.margin * lowest) & torch.isfinite(best) & torch.isfinite(lowest)
    take &= (lengths > W).unsqueeze(1)
    out = r.clone()
    out.scatter_(1, order, torch.where(take, best_pos, r.gather(1, order)))
    return out.to(torch.int32), take.sum(dim=1)


@dataclasses.dataclass(frozen=True)
class CheckedExchange:
    """The checked block exchange (:func:`checked_exchange_rows`): ``cap``, most entries
    swapped, a share of ``W``; ``margin``: a block goes in only when a lower bound on its mass
    exceeds ``margin`` times the exact mass of the entries it replaces."""

    cap: Fraction
    margin: float

    def __post_init__(self) -> None:
        _check_cap_margin(self.cap, self.margin)

    @property
    def name(self) -> str:
        return f"checked:{self.cap}:{self.margin:g}"


CHECKED = "checked"


def parse_any_exchange_setting(text: str, cap: float, where: str):
    """``witness_exchange``: ``MARGIN:PROTECT`` (:class:`Exchange`), ``checked:MARGIN``
    (:class:`CheckedExchange`) or ``verified:MARGIN:BLOCKS[:RANK]`` (:class:`VerifiedExchange`),
    capped at ``cap``; :class:`UsageError` naming ``where``."""
    head, _, rest = text.partition(":")
    if head.strip() == VERIFIED:
        parts = rest.split(":")
        try:
            margin, blocks = float(parts[0]), int(parts[1])
            if len(parts) not in (2, 3):
                raise ValueError
        except (ValueError, IndexError):
            raise UsageError(f"{where}: expected verified:MARGIN:BLOCKS[:RANK] (e.g. verified:1:64 or "
                             f"verified:1:64:mean), got {text!r}") from None
        try:
            return VerifiedExchange(Fraction(cap).limit_denominator(1 << 16), margin, blocks,
                                    parts[2].strip() if len(parts) == 3 else BOX)
        except ValueError as exc:
            raise UsageError(f"{where} {text!r}: {exc}") from None
    if head.strip() != CHECKED:
        return parse_exchange_setting(text, cap, where)
    try:
        margin = float(rest)
    except ValueError:
        raise UsageError(f"{where}: expected checked:MARGIN (e.g. checked:1), got {text!r}") from None
    try:
        return CheckedExchange(Fraction(cap).limit_denominator(1 << 16), margin)
    except ValueError as exc:
        raise UsageError(f"{where} {text!r}: {exc}") from None


def checked_exchange_rows(rows: torch.Tensor, lengths: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                          scaling: float, block_size: int, exchange: CheckedExchange,
                          query_chunk: int = 256) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows, swaps)``: the reused rows after whole blocks are swapped in where a bound says
    they gain, and int64 ``[T]`` entries swapped per row. The inputs are not modified.

    Per row and query head ``h``, masses are normalised over the row's own entries
    (``exp(l - logsumexp_row(l))``, ``l`` the scaled logit) and summed over the heads:

    * an entry's mass is exact: its logit is what the sparse attention computes anyway;
    * a block's outsiders (its tokens below the row's length, not in the row) have the mean
      logit ``(q . sum of the block's keys - the in-row tokens' logits) / n_out`` (the first
      term is what a centroid table gives), and by Jensen at least ``n_out * exp(mean)`` mass.

    Blocks go in whole, the densest bound per token first, each for the row's least-mass
    entries, while the block's bound exceeds ``margin`` times the mass of the entries it
    replaces and at most ``cap * W`` entries are swapped. With ``margin >= 1`` the row's mass
    (so normalised) never falls. Rows no longer than ``W`` are returned as they are.

    ``rows``: int32 ``[T, W]``, ``-1`` padding; ``lengths``: ``[T]``; ``query``: fp32 ``[H, T, D]``
    post-RoPE; ``key``: ``[Hkv, L, D]`` (query head ``h`` reads KV head ``h // (H // Hkv)``).
    """
    T, W = rows.shape
    keys = _head_keys(rows, lengths, query, key)  # [H, L, D]
    cap = int(exchange.cap * W)
    out = rows.clone()
    swaps = torch.zeros(T, dtype=torch.int64, device=rows.device)
    if T == 0 or cap == 0:
        return out, swaps
    key_sums = _block_key_sums(keys, block_size)  # [H, N, D]
    for t0 in range(0, T, query_chunk):
        t1 = min(T, t0 + query_chunk)
        n = lengths[t0:t1].to(torch.int64)
        r = rows[t0:t1].to(torch.int64)
        q = query[:, t0:t1].to(torch.float32)
        logit, entry, log_z, outs = _row_logits(q, keys, scaling, r, n)
        mass = torch.exp(entry - log_z).sum(0)  # [Tc, W]; 0 at padding
        mean_out, n_out = _outsider_means(q, key_sums, logit, entry, r, n, scaling, block_size)
        bound = (n_out * torch.exp((mean_out - log_z).clamp(max=80.0))).sum(0)  # [Tc, N]
        k, chunk = take_blocks(r, mass, bound, n_out, outs, n, exchange.margin, cap, block_size)
        out[t0:t1] = chunk.to(rows.dtype)
        swaps[t0:t1] = k
    return out, swaps


VERIFIED = "verified"
# How the verified exchange names its candidate blocks: ``box``, by each block's upper bound on
# a token's mass (its keys' bounding box); ``mean``, by the mean mass of its tokens outside the
# row (its key sum less the in-row tokens' logits, what the checked exchange's bound reads).
BOX, MEAN = "box", "mean"
RANKS = (BOX, MEAN)


@dataclasses.dataclass(frozen=True)
class VerifiedExchange:
    """The verified token exchange (:func:`verified_exchange_rows`): ``cap``, most entries
    swapped, a share of ``W``; ``margin``: a token goes in only when its exact mass exceeds
    ``margin`` times that of the entry it replaces; ``blocks``: candidate blocks read per row;
    ``rank``: how they are named (:data:`RANKS`)."""

    cap: Fraction
    margin: float
    blocks: int
    rank: str = BOX

    def __post_init__(self) -> None:
        _check_cap_margin(self.cap, self.margin)
        if self.blocks < 1:
            raise ValueError(f"blocks: expected an integer >= 1, got {self.blocks}")
        if self.rank not in RANKS:
            raise ValueError(f"rank: expected one of {', '.join(RANKS)}, got {self.rank!r}")

    @property
    def name(self) -> str:
        return f"verified:{self.cap}:{self.margin:g}:{self.blocks}" + ("" if self.rank == BOX else f":{self.rank}")


def verified_exchange_rows(rows: torch.Tensor, lengths: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                           scaling: float, block_size: int, exchange: VerifiedExchange,
                           query_chunk: int = 256) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows, swaps)``: the reused rows after single tokens are swapped in where their exact
    mass beats the entry they replace, and int64 ``[T]`` entries swapped per row. The inputs
    are not modified.

    Masses are the checked exchange's (:func:`checked_exchange_rows`: normalised over the
    row's own entries per query head, summed over the heads), exact on both sides:

    * ``rank`` ``box``: each block's upper bound on a token's mass, from its keys' bounding box
      (per head ``q . c + |q| . r``, ``c`` / ``r`` the box's centre and half-width; what the
      ``query_bound`` witness signal reads), names the ``blocks`` candidate blocks with a
      token outside the row, the highest first; ``mean``: the mass at the mean logit of the
      block's tokens outside the row (from the block key-sum table, as the checked exchange)
      names them instead;
    * their tokens outside the row are read: exact masses;
    * those tokens, most mass first, replace the row's entries, least mass first, pair by
      pair while the token's mass exceeds ``margin`` times the entry's, at most ``cap * W``.

    With ``margin >= 1`` every swap gains, so the row's mass never falls. Rows no longer than
    ``W`` are returned as they are. Shapes as :func:`checked_exchange_rows`.
    """
    T, W = rows.shape
    H, _, D = query.shape
    keys = _head_keys(rows, lengths, query, key)  # [H, L, D]
    L = keys.shape[1]
    cap = int(exchange.cap * W)
    out = rows.clone()
    swaps = torch.zeros(T, dtype=torch.int64, device=rows.device)
    if T == 0 or cap == 0:
        return out, swaps
    N = -(-L // block_size)
    if exchange.rank == BOX:
        lo = torch.full((H, N * block_size, D), float("inf"), device=key.device)
        hi = torch.full((H, N * block_size, D), float("-inf"), device=key.device)
        lo[:, :L], hi[:, :L] = keys, keys
        kmin, kmax = lo.view(H, N, block_size, D).amin(2), hi.view(H, N, block_size, D).amax(2)  # [H, N, D]
        centre, half = (kmin + kmax) / 2, (kmax - kmin) / 2
    else:
        key_sums = _block_key_sums(keys, block_size)
    pos = torch.arange(L, device=rows.device)
    for t0 in range(0, T, query_chunk):
        t1 = min(T, t0 + query_chunk)
        n = lengths[t0:t1].to(torch.int64)
        r = rows[t0:t1].to(torch.int64)
        Tc = t1 - t0
        q = query[:, t0:t1].to(torch.float32)
        logit, entry, log_z, outs = _row_logits(q, keys, scaling, r, n)
        entry_mass = torch.exp(entry - log_z).sum(0)  # [Tc, W]
        has_out = torch.zeros(Tc, N, device=rows.device).index_add_(1, pos // block_size, outs.float()) > 0
        if exchange.rank == BOX:
            rank = (torch.matmul(q, centre.transpose(1, 2)) + torch.matmul(q.abs(), half.transpose(1, 2))) * scaling
        else:
            rank = _outsider_means(q, key_sums, logit, entry, r, n, scaling, block_size)[0]
        rank_mass = torch.exp((rank - log_z).clamp(max=80.0)).sum(0).masked_fill(~has_out, float("-inf"))  # [Tc, N]
        tok = candidate_tokens(rank_mass, exchange.blocks, block_size)  # [Tc, M * bs]
        tok_ok = (tok < L) & outs.gather(1, tok.clamp(max=L - 1))
        tok_mass = torch.exp(logit.gather(2, tok.clamp(max=L - 1).unsqueeze(0).expand(H, -1, -1)) - log_z).sum(0)
        tok_mass = tok_mass.masked_fill(~tok_ok, float("-inf"))
        k, chunk = take_tokens(r, entry_mass, tok, tok_mass, n, exchange.margin, cap)
        out[t0:t1] = chunk.to(rows.dtype)
        swaps[t0:t1] = k
    return out, swaps


def _block_key_sums(keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 ``[H, N, D]``: the block key-sum table of ``keys`` (``[H, L, D]``), the last block
    summed over the tokens it has."""
    H, L, D = keys.shape
    N = -(-L // block_size)
    padded = torch.zeros(H, N * block_size, D, device=keys.device)
    padded[:, :L] = keys
    return padded.view(H, N, block_size, D).sum(2)


def _outsider_means(q: torch.Tensor, key_sums: torch.Tensor, logit: torch.Tensor, entry: torch.Tensor,
                    r: torch.Tensor, n: torch.Tensor, scaling: float,
                    block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For a chunk of rows (:func:`_row_logits`' outputs): ``(mean_out [H, Tc, N], n_out [Tc, N])``,
    the mean scaled logit of each block's tokens below the row's length and not in the row
    (0 where there are none) and their count: ``(q . key sum - the in-row tokens' logits) /
    n_out``, the key sum less the tokens of the row's last block at and past its length."""
    H, Tc, _ = q.shape
    N = key_sums.shape[1]
    L = logit.shape[2]
    valid = r >= 0
    block_logit = torch.matmul(q, key_sums.transpose(1, 2)) * scaling  # [H, Tc, N]
    tail = torch.arange(1, block_size, device=r.device)
    past = n.unsqueeze(1) - 1 + tail.unsqueeze(0)  # [Tc, bs - 1]
    past_ok = (past < L) & (past // block_size == ((n - 1) // block_size).unsqueeze(1))
    past_logit = logit.gather(2, past.clamp(max=L - 1).unsqueeze(0).expand(H, -1, -1)).masked_fill(~past_ok, 0.0)
    last = ((n - 1) // block_size).unsqueeze(0).unsqueeze(2).expand(H, -1, 1)
    block_logit = block_logit.scatter_add(2, last, -past_logit.sum(2, keepdim=True))
    blk = torch.where(valid, r.clamp(min=0) // block_size, N)  # padding into a spill column
    in_sum = torch.zeros(H, Tc, N + 1, device=r.device).scatter_add_(
        2, blk.unsqueeze(0).expand(H, -1, -1), entry.masked_fill(~valid, 0.0))[:, :, :N]
    in_count = torch.zeros(Tc, N + 1, device=r.device).scatter_add_(1, blk, valid.to(torch.float32))[:, :N]
    first = torch.arange(N, device=r.device) * block_size
    visible = (n.unsqueeze(1) - first.unsqueeze(0)).clamp(0, block_size).to(torch.float32)  # [Tc, N]
    n_out = (visible - in_count).clamp(min=0)
    return (block_logit - in_sum) / n_out.clamp(min=1), n_out


def _head_keys(rows: torch.Tensor, lengths: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """fp32 ``[H, L, D]``: ``key`` repeated for the query heads that read it, after checking the
    exchanges' shapes (``rows [T, W]``, ``lengths [T]``, ``query [H, T, D]``, ``key [Hkv, L, D]``)."""
    T = rows.shape[0]
    H, Tq, _ = query.shape
    Hkv = key.shape[0]
    if lengths.shape != (T,) or Tq != T:
        raise ValueError(f"lengths, query: expected {T} rows like rows, got {tuple(lengths.shape)}, {Tq}")
    if H % Hkv:
        raise ValueError(f"query heads {H} is not a multiple of key heads {Hkv}")
    return key.to(torch.float32).repeat_interleave(H // Hkv, dim=0)


def _row_logits(q: torch.Tensor, keys: torch.Tensor, scaling: float, r: torch.Tensor, n: torch.Tensor):
    """For a chunk of rows: ``(logit [H, Tc, L], entry [H, Tc, W], log_z [H, Tc, 1], outs [Tc, L])``:
    the scaled logits, the row entries' (``-inf`` at padding), their log-normaliser per head,
    and the tokens below the row's length that are not in it."""
    H, Tc, _ = q.shape
    L = keys.shape[1]
    valid = r >= 0
    logit = torch.matmul(q, keys.transpose(1, 2)) * scaling
    entry = logit.gather(2, r.clamp(min=0).unsqueeze(0).expand(H, -1, -1)).masked_fill(~valid, float("-inf"))
    log_z = torch.logsumexp(entry, dim=2, keepdim=True)
    in_row = torch.zeros(Tc, L + 1, dtype=torch.bool, device=r.device)
    in_row.scatter_(1, torch.where(valid, r, L), True)
    outs = (torch.arange(L, device=r.device).unsqueeze(0) < n.unsqueeze(1)) & ~in_row[:, :L]
    return logit, entry, log_z, outs
