"""The vectorized torch core of the topology KV policy (see docs/architecture.md).

:func:`topology_kv_policy_core` runs on every sparse-attention layer, called by
:func:`~rtp_llm.models_py.modules.hybrid.topology_kv.policy.apply_topology_kv_policy`.
It is pure tensor code with static shapes: no ``.item()``, ``.tolist()``, ``nonzero`` or
loops over rows, so it runs inside a CUDA graph and under ``torch.compile(fullgraph=True)``.

It reads top to bottom as stages, each a function below:

1. :func:`_row_checks`: which rows are broken (rules in ``row_contract``).
2. :func:`_structural_slots`: the block schedule expanded to the structural slot tokens
   (layout order ``[sinks | locals ascending | witnesses]``) and the priority order
   (:func:`_priority_permutation`: sinks ascending, locals and witness blocks newest first).
3. :func:`_slot_mapping`: each learned entry's structural slot, and which slots the row
   already holds (merge modes only).
4. :func:`_structural_target`: the priority-order prefix the row must hold (``<= W``
   tokens, ``<= cap`` of them missing), and the tokens to inject.
5. :func:`_evict`: which learned entries make room (lowest scores, or the row's last).
6. :func:`_fill`: the injected tokens beyond the evicted ones go after the valid entries.
7. :func:`_counters`: the per-call counters.

``TOPOLOGY_ONLY`` replaces stages 3-6 by :func:`_topology_only_rows`.
"""

from __future__ import annotations

import functools
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import COUNTER_NAMES, PolicyLayout, PolicyTensors
from rtp_llm.models_py.modules.hybrid.topology_kv.row_contract import violations_of_rows
from rtp_llm.models_py.modules.hybrid.topology_kv.schedule import (
    expand_blocks_unchecked,
    score_sort_keys,
    witness_blocks_unchecked,
)

__all__ = ["COUNTER_NAMES", "topology_kv_policy_core", "topology_only_learned_kept"]


# ---------------------------------------------------------------------------------------
# Small helpers.
# ---------------------------------------------------------------------------------------


def _rank_within(mask: torch.Tensor) -> torch.Tensor:
    """1-based running count of ``mask`` along the last dim (int32: 10x faster than int64 on CPU)."""
    return torch.cumsum(mask, dim=-1, dtype=torch.int32)


def _lowest_scored(scores: torch.Tensor, candidate: torch.Tensor, count: torch.Tensor, k_max: int):
    """Positions of the ``count[r]`` lowest-scored candidates, lowest first.

    Returns ``(positions [R, k_max] int64, chosen [R, k_max] bool)``. Keys are unique
    (order-preserving int view of the fp32 score, then the position reversed so the later
    entry loses a tie), so ``topk`` is deterministic; NaN counts as ``-inf``.
    """
    R, W = candidate.shape
    later_first = W - 1 - torch.arange(W, device=candidate.device, dtype=torch.int64)
    key = score_sort_keys(scores, later_first)
    key = torch.where(candidate, key, torch.iinfo(torch.int64).max)
    lowest = torch.topk(key, k_max, dim=1, largest=False, sorted=True).indices  # [R, k]
    chosen = torch.arange(k_max, device=candidate.device).unsqueeze(0) < count.unsqueeze(1)
    return lowest, chosen


def _priority_permutation(s_tok: int, l_tok: int, n_wit: int, bs: int, device) -> torch.Tensor:
    """Static ``[S]`` map from priority position to layout slot.

    Layout: ``[sink tokens | local tokens ascending | witness blocks, tokens ascending]``;
    priority: sink tokens ascending, local tokens from the most recent backwards, witness
    blocks in score order with their tokens newest first (a block the budget cuts keeps
    its newest tokens, as the local window does). Invalid slots are skipped by the
    callers' masks.
    """
    wit_base = s_tok + l_tok
    newest_first = bs - 1 - torch.arange(bs, device=device)  # [bs]
    wit = wit_base + (torch.arange(n_wit, device=device) * bs).unsqueeze(1) + newest_first  # [n_wit, bs]
    return torch.cat(
        [
            torch.arange(s_tok, device=device),
            s_tok + l_tok - 1 - torch.arange(l_tok, device=device),
            wit.flatten(),
        ]
    )


# ---------------------------------------------------------------------------------------
# Stage 1: broken rows.
# ---------------------------------------------------------------------------------------


def _row_checks(x, lengths, offsets, drift_blocks, block_size):
    """Which rows break the coordinate contract (see ``row_contract.row_violations``).

    Returns ``(valid [R, W] bool, n_valid [R] int64, mismatch [R] bool)``.
    """
    valid = x >= 0  # [R, W]
    n_valid = valid.sum(dim=1)  # [R] int64
    flags = violations_of_rows(x, valid, n_valid, lengths, offsets, drift_blocks, block_size)
    return valid, n_valid, functools.reduce(torch.logical_or, flags.values())


# ---------------------------------------------------------------------------------------
# Stage 2: structural slots.
# ---------------------------------------------------------------------------------------


class _Slots(NamedTuple):
    """The structural slots of every row (stage 2's result)."""

    tok: torch.Tensor  # [R, S] int64 request-local token of each layout slot, -1 unused
    S_sink: int  # sink slots (the layout's first segment)
    sink_end: torch.Tensor  # [R] sink blocks the row has
    local_start: torch.Tensor  # [R] first local block
    wit: torch.Tensor  # [R, n_wit] witness blocks in score order, -1 missing
    comp_start: int  # compress mode: first token a compressed block may start at
    comp_end: Optional[torch.Tensor]  # [R] compress mode: end of the whole scaffold blocks
    n_compressed: Optional[torch.Tensor]  # [R] compressed blocks (None: not compressing)


def _structural_slots(
    lengths64: torch.Tensor,
    drift: Optional[torch.Tensor],
    scaffold_lengths: Optional[torch.Tensor],
    *,
    compress: bool,
    layout: PolicyLayout,
    n_wit: int,
) -> _Slots:
    """Schedule the blocks of every row and expand them to slot tokens (layout order).

    Token sinks are the first ``sink_tokens`` tokens: blocks they cover wholly are neither
    local nor witness, and a block they cover in part contributes only its other tokens.
    Block sinks are whole blocks ``0 .. sink_blocks - 1``.
    """
    device = lengths64.device
    R = lengths64.shape[0]
    bs, local_blocks = layout.block_size, layout.local_blocks
    sink_blk, S_sink = layout.sink_full_blocks, layout.sink_slots
    nb = (lengths64.clamp(min=1) - 1) // bs + 1  # [R] ceil(length / bs) without overflow near 2**63
    sink_end = torch.clamp(nb, max=sink_blk)
    local_start = torch.maximum(torch.clamp(nb - local_blocks, min=0), sink_end)
    wit = witness_blocks_unchecked(sink_end, local_start, n_wit, drift)  # [R, n_wit] best first, -1 missing

    # Scheduled blocks in layout order: [sinks | locals ascending | witnesses].
    local_cols = local_start.unsqueeze(1) + torch.arange(local_blocks, device=device).unsqueeze(0)
    rest = [torch.where(local_cols < nb.unsqueeze(1), local_cols, -1), wit]
    if layout.token_sinks:
        blocks = torch.cat(rest, dim=1)  # [R, l + n_wit]: the sink segment is not block-based
        ar = torch.arange(S_sink, device=device).unsqueeze(0)
        sink_seg = torch.where(ar < lengths64.unsqueeze(1), ar, -1).expand(R, S_sink)
    else:
        sink_cols = torch.arange(layout.sink_blocks, device=device).unsqueeze(0)
        blocks = torch.cat([torch.where(sink_cols < sink_end.unsqueeze(1), sink_cols, -1)] + rest, dim=1)
        sink_seg = None
    slot_tok = expand_blocks_unchecked(blocks, lengths64, bs)  # [R, *] int64 token or -1
    if layout.partial_sink:
        slot_tok = torch.where(slot_tok < layout.sink_tokens, -1, slot_tok)  # those are sink slots
    comp_start, comp_end, n_compressed = 0, None, None
    if compress:
        # Scheduled blocks wholly inside min(scaffold, length) keep their first token only.
        span = torch.minimum(scaffold_lengths.to(torch.int64), lengths64)
        comp_end = torch.div(span, bs, rounding_mode="floor") * bs  # [R] tokens of whole blocks
        comp_start = layout.compress_start  # token sinks, and blocks holding some, stay whole
        compressed = (blocks * bs >= comp_start) & ((blocks + 1) * bs <= span.unsqueeze(1))  # [R, Kb]
        non_first = (torch.arange(slot_tok.shape[1], device=device) % bs) != 0
        slot_tok = torch.where(compressed.repeat_interleave(bs, dim=1) & non_first, -1, slot_tok)
        n_compressed = compressed.sum(dim=1)
    if sink_seg is not None:
        slot_tok = torch.cat([sink_seg, slot_tok], dim=1)  # [R, S]
    return _Slots(slot_tok, S_sink, sink_end, local_start, wit, comp_start, comp_end, n_compressed)


# ---------------------------------------------------------------------------------------
# Stage 3: learned entries -> structural slots (merge modes).
# ---------------------------------------------------------------------------------------


def _slot_mapping(
    rel: torch.Tensor,
    lengths64: torch.Tensor,
    slots: _Slots,
    layout: PolicyLayout,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Layout slot of every learned entry (``S`` = not structural), and the present bits.

    Returns ``(slot [R, W] row dtype, present [R, S] bool)``: ``present[r, s]`` when slot
    ``s`` is a structural token the row already holds. Uses sign-bit masks rather than
    ``torch.where``: integer add/and/shift run ~10x faster than where on CPU. Sinks and
    locals are contiguous token ranges, so their slot is the position plus a shift.
    """
    R = rel.shape[0]
    idt = rel.dtype
    sign = torch.iinfo(idt).bits - 1  # v >> sign is -1 where v < 0, else 0
    S_sink, S = slots.S_sink, slots.tok.shape[1]
    bs, local_blocks = layout.block_size, layout.local_blocks
    sink_span = torch.full_like(slots.sink_end, S_sink) if layout.token_sinks else slots.sink_end * bs
    sink_tok_end = torch.minimum(sink_span, lengths64)
    sink_tok_end = sink_tok_end.to(idt).unsqueeze(1)  # [R, 1]
    in_sink = (rel - sink_tok_end) >> sign  # -1 where rel < sink end
    # delta = slot - rel - S: 0 for entries that are not structural, so rel + delta never
    # overflows (rel may reach the dtype max).
    delta = in_sink & -S  # [R, W]
    if local_blocks > 0:  # (then the local start is below the length: it fits the dtype)
        local_tok_start = (slots.local_start * bs).to(idt).unsqueeze(1)
        local_shift = S_sink - local_tok_start  # [R, 1]
        in_local = ~((rel - torch.maximum(local_tok_start, sink_tok_end)) >> sign)  # -1 where local
        delta = delta + (in_local & (local_shift - S))
    n_wit = slots.wit.shape[1]
    if n_wit > 0:
        bt = torch.div(rel, bs, rounding_mode="floor") if bs & (bs - 1) else rel >> (bs.bit_length() - 1)
        wit_i = slots.wit.to(idt)
        for j in range(n_wit):
            shift_j = S_sink + (local_blocks + j) * bs - wit_i[:, j : j + 1] * bs  # [R, 1]
            hit = bt == wit_i[:, j : j + 1]
            if layout.partial_sink:
                hit = hit & (rel >= sink_tok_end)  # the block's sink tokens stay sinks
            delta = delta + hit * (shift_j - S)
    if slots.comp_end is not None:
        # Inside compressed blocks only the block's first token is structural.
        within = rel % bs if bs & (bs - 1) else rel & (bs - 1)
        last = (slots.comp_end - 1).to(idt).unsqueeze(1)  # (comp_end itself may not fit)
        inside = (rel >= slots.comp_start) & (rel <= last) & (within != 0)
        delta = torch.where(inside, 0, delta)
    # Padding (rel < 0) -> S; everything past the slots -> S.
    slot = torch.maximum(torch.clamp(rel + delta, max=0) + S, (rel >> sign) & S)  # [R, W]
    present = torch.zeros(R, S + 1, dtype=torch.bool, device=rel.device)
    present.scatter_(1, slot.to(torch.int64), True)
    present = present[:, :S] & (slots.tok >= 0)  # [R, S] structural tokens the row holds
    return slot, present


# ---------------------------------------------------------------------------------------
# Stage 4: the structural target (merge modes).
# ---------------------------------------------------------------------------------------


def _structural_target(
    valid_p: torch.Tensor,
    present_p: torch.Tensor,
    ok: torch.Tensor,
    lengths64: torch.Tensor,
    W: int,
    structural_cap: int,
    scale_budget_by_length: bool,
):
    """The longest priority-order prefix with at most ``W`` tokens, at most cap missing.

    Both counts grow along the priority order, so each condition holds on a prefix.
    Structural tokens past it are plain learned entries: a present local token must not
    keep out a missing sink token. Returns ``(take_p, inject_p, new_rank)``, all ``[R, S]``
    in priority order; broken rows take nothing.
    """
    new_p = valid_p & ~present_p  # [R, S] missing structural tokens, priority order
    cap = structural_cap
    if scale_budget_by_length:  # the cap shrinks as the row outgrows the width W
        cap = torch.div(structural_cap * W, torch.clamp(lengths64, min=W), rounding_mode="floor").unsqueeze(1)
    new_rank = _rank_within(new_p)
    take_p = valid_p & (_rank_within(valid_p) <= W) & (new_rank <= cap)
    take_p = take_p & ok.unsqueeze(1)  # a broken row is left exactly as it came
    return take_p, take_p & new_p, new_rank


# ---------------------------------------------------------------------------------------
# Stages 5-6: eviction and fill (merge modes; both write into ``out`` in place).
# ---------------------------------------------------------------------------------------


def _evict(
    out: torch.Tensor,
    valid: torch.Tensor,
    is_struct: torch.Tensor,
    inj: torch.Tensor,
    n_evict: torch.Tensor,
    learned_scores: Optional[torch.Tensor],
    S: int,
    structural_cap: int,
) -> None:
    """Replace the ``n_evict[r]`` evicted learned entries by the first injected tokens."""
    W = out.shape[1]
    k = min(W, S)
    if learned_scores is None:
        # Evict the last n_evict non-structural entries. They all lie in the last
        # k = min(W, S) columns: that window holds at most n_taken_present protected and
        # p padding entries, and n_evict <= n_inject - p <= S - n_taken_present - p
        # (the taken prefix holds n_taken_present + n_inject <= S tokens).
        lo = W - k
        cand = valid[:, lo:] & ~is_struct[:, lo:]  # [R, k] (broken rows evict nothing)
        crank = _rank_within(cand)
        first = crank[:, -1:] - n_evict.unsqueeze(1).to(torch.int32)  # evict ranks > first
        evict = cand & (crank > first)
        hole = torch.clamp(crank - first - 1, min=0).to(torch.int64)  # 0-based fill order
        out[:, lo:] = torch.where(evict, torch.gather(inj, 1, hole), out[:, lo:])
    elif k > 0:
        idt = out.dtype
        cand = valid & ~is_struct
        lowest, chosen = _lowest_scored(learned_scores, cand, n_evict, min(k, max(structural_cap, 1)))
        # Clear the evicted entries (amin with -1), then write the injected tokens
        # (amax): unchosen lanes write neutral values, so the scatters are deterministic.
        big = torch.iinfo(idt).max
        out.scatter_reduce_(1, lowest, torch.where(chosen, -1, big).to(idt), reduce="amin")
        fill = torch.where(chosen, inj[:, : lowest.shape[1]], torch.iinfo(idt).min)
        out.scatter_reduce_(1, lowest, fill, reduce="amax")


def _fill(out: torch.Tensor, inj: torch.Tensor, n_valid, n_evict, n_inject) -> None:
    """Injected tokens beyond the evicted ones go to the padding after the valid entries."""
    W, S = out.shape[1], inj.shape[1]
    j = torch.arange(S, device=out.device).unsqueeze(0)
    extra = (j >= n_evict.unsqueeze(1)) & (j < n_inject.unsqueeze(1))
    target = torch.clamp(n_valid.unsqueeze(1) + j - n_evict.unsqueeze(1), 0, W - 1)
    neutral = torch.iinfo(out.dtype).min
    out.scatter_reduce_(1, torch.where(extra, target, 0), torch.where(extra, inj, neutral), reduce="amax")


def _merge_rows(x, valid, n_valid, mismatch, ok, rel, off, lengths64, slots, perm, tok_p, valid_p, *,
                learned_scores, layout: PolicyLayout):
    """Merge modes: stages 3-6. Returns ``(out, n_learned, n_kept, n_inject)``."""
    R, W = x.shape
    idt, device = x.dtype, x.device
    S = slots.tok.shape[1]
    structural_cap = layout.structural_cap(W)
    slot, present = _slot_mapping(rel, lengths64, slots, layout)
    present_p = present.index_select(1, perm)
    take_p, inject_p, new_rank = _structural_target(
        valid_p, present_p, ok, lengths64, W, structural_cap, layout.scale_budget_by_length
    )
    n_inject = inject_p.sum(dim=1)
    # Which layout slots are protected: the taken ones, back in layout order (+ slot S: none).
    taken = torch.zeros(R, S + 1, dtype=torch.bool, device=device).index_copy_(1, perm, take_p)
    inj = torch.full((R, S + 1), -1, dtype=idt, device=device)  # injected tokens, in order
    inj.scatter_(1, torch.where(inject_p, new_rank.to(torch.int64) - 1, S), tok_p.to(idt))
    inj = inj[:, :S] if off is None else torch.where(inj[:, :S] >= 0, inj[:, :S] + off, -1)
    n_learned = torch.where(ok, n_valid, 0)
    n_evict = torch.clamp(n_learned + n_inject - W, min=0)  # [R]
    is_struct = torch.gather(taken, 1, slot.to(torch.int64))  # [R, W] protected structural entries
    # The copy writes padding as -1, except in broken rows (returned as they came).
    floor = torch.where(mismatch, torch.iinfo(idt).min, -1).to(idt).unsqueeze(1)  # [R, 1]
    out = torch.maximum(x, floor)  # [R, W]
    _evict(out, valid, is_struct, inj, n_evict, learned_scores, S, structural_cap)
    _fill(out, inj, n_valid, n_evict, n_inject)
    return out, n_learned, n_learned - n_evict, n_inject


def _topology_only_rows(x, tok_p, valid_p, off, mismatch):
    """``TOPOLOGY_ONLY``: the first ``W`` valid structural tokens in priority order.

    Returns ``(out, n_selected)``; broken rows come back unchanged.
    """
    R, W = x.shape
    idt = x.dtype
    sign = torch.iinfo(idt).bits - 1
    take = valid_p & (_rank_within(valid_p) <= W)  # [R, S] the first W valid slots
    buf = torch.full((R, W + 1), -1, dtype=idt, device=x.device)
    target = torch.where(take, _rank_within(take).to(torch.int64) - 1, W)
    buf.scatter_(1, target, tok_p.to(idt))
    out = buf[:, :W]
    if off is not None:
        out = out + (off & ~(out >> sign))  # add the offset to valid entries only
    out = out + mismatch.to(idt).unsqueeze(1) * (x - out)  # broken rows come back unchanged
    return out, take.sum(dim=1)


def topology_only_learned_kept(
    topk_indices: torch.Tensor, out: torch.Tensor, mismatch_rows: torch.Tensor
) -> torch.Tensor:
    """Per row, how many learned entries ``TOPOLOGY_ONLY`` kept (``|learned & out|``).

    A sort of the output per row (``O(W log W)``); the fused kernels count it in their row
    pass. Broken rows count 0. Returns int64 ``[R]``.
    """
    big = torch.iinfo(torch.int64).max
    srt = torch.sort(torch.where(out >= 0, out.to(torch.int64), big), dim=1).values  # [R, W]
    x = topk_indices.to(torch.int64)
    pos = torch.searchsorted(srt, x).clamp(max=srt.shape[1] - 1)
    hit = (torch.gather(srt, 1, pos) == x) & (x >= 0)
    return torch.where(mismatch_rows, 0, hit.sum(dim=1))


# ---------------------------------------------------------------------------------------
# Stage 7: counters.
# ---------------------------------------------------------------------------------------


def _counters(ok, mismatch, lengths64, n_selected, n_learned, n_kept, n_injected, n_compressed, bs):
    """0-dim int64 counters over the processed rows, plus ``mismatch_rows`` ``[R]`` bool."""

    def total(per_row: torch.Tensor) -> torch.Tensor:
        return torch.where(ok, per_row.to(torch.int64), 0).sum()

    counters = {
        "selected_tokens": total(n_selected),
        "structural_injected_tokens": total(n_injected),
        "learned_kept_tokens": total(n_kept),
        "learned_evicted_tokens": total(n_learned - n_kept),
    }
    counters.update({
        "unselected_tokens": total(lengths64 - n_selected),
        "coordinate_mismatch_fallbacks": mismatch.sum().to(torch.int64),
        "compressed_blocks": total(n_compressed),
        "compression_saved_tokens": total(n_compressed * (bs - 1)),
        "mismatch_rows": mismatch,
    })
    return counters


# ---------------------------------------------------------------------------------------
# The core.
# ---------------------------------------------------------------------------------------


def topology_kv_policy_core(
    inputs: PolicyTensors,
    *,
    layout: PolicyLayout,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Vectorized policy over all rows; pure tensor ops with static shapes, no host sync.

    Parameters
    ----------
    inputs : :class:`PolicyTensors` (``drift`` ``[R, N]``; rows longer than ``N`` blocks
        are broken)
    layout : :class:`PolicyLayout`: the mode, block counts and derived constants; the
        structural cap is ``layout.structural_cap(W)``

    Returns
    -------
    (indices, counters): indices like ``topk_indices`` (same shape, dtype, device,
    contiguous); counters are 0-dim int64 tensors keyed by :data:`COUNTER_NAMES` plus
    ``mismatch_rows`` ``[R]`` bool.

    Semantics (row ``r``, relative positions ``t = index - offset``):

    * A row is *broken* if ANY of: ``offset < 0``; ``length <= 0``;
      ``offset + length - 1`` exceeds the max of ``topk_indices``' dtype; a non-negative
      entry lies outside ``[offset, offset + length)``; a non-negative entry follows a
      negative one (padding); a non-negative entry occurs twice; with ``drift``
      ``[R, N]``, the row needs more than ``N`` blocks (``ceil(length / block_size)``).
      A broken row is returned unchanged and flagged in ``mismatch_rows``. Interval
      arithmetic is int64 whatever the dtypes: int64 lengths/offsets with int32 rows are
      compared as int64, never truncated (see ``row_contract.row_violations``).
    * Structural tokens in priority order: sink tokens (blocks ``0..sink_blocks-1``, or
      the first ``sink_tokens`` tokens, whose blocks are then neither local nor witness)
      ascending; local tokens (the ``local_blocks`` blocks ending at the row's last
      block) from the most recent backwards; witness blocks by descending score (ties:
      lower block), tokens newest first; only tokens ``< length``. So wherever the budget
      cuts a local or witness block, the block keeps its newest tokens (the ones next to
      the newer blocks already taken); a cut sink block keeps its first tokens. Without
      drift, ``TOPOLOGY_ONLY`` with token sinks is therefore plain locality: the sink
      tokens, then the most recent tokens newest first. Compress mode keeps only the first
      token of a scheduled block lying wholly inside ``[0, min(scaffold, length))``.
    * Merge modes: the row's structural *target* is the longest prefix of the structural
      tokens in priority order that holds at most ``W`` tokens, at most ``cap`` of them
      missing from the row (``cap = structural_cap``, times ``W / max(length, W)``,
      rounded down, when ``scale_budget_by_length``). Target tokens the row already holds
      are free and never evicted; the missing ones are injected. Structural tokens past
      the target are plain learned entries (so a present local token never keeps out a
      higher-priority sink token). When the row overflows by ``n``, the ``n``
      evicted entries are the non-structural entries with the lowest ``learned_scores``
      (ties: later entry first), or without scores the row's last ``n`` such entries.
      Injected tokens take the evicted positions (in row order without scores, in
      eviction order with scores), then the padding positions right after the valid
      entries. Everything else stays where it was.
    * ``TOPOLOGY_ONLY``: the first ``min(W, length)`` structural tokens in priority order
      (witnesses fill the budget; ``witness_blocks`` is ignored), so a row with
      ``length <= W`` holds every token.

    Cost: ``O(W)`` elementwise passes per row plus one scatter, ``O(S)`` for the
    structural slots (``S`` = scheduled blocks x block size) and ``O(N)`` for witness
    selection. The duplicate rule costs a ``N * block_size``-bit bitmap per row with a
    drift table, else one sort per row (``O(W log W)``). Without learned scores the
    eviction only scans the row's last
    ``min(W, S)`` entries, which always hold enough candidates (see :func:`_evict`).
    """
    topk_indices, lengths, offsets, drift, learned_scores, scaffold_lengths = inputs
    device = topk_indices.device
    W = topk_indices.shape[1]
    bs = layout.block_size
    idt = topk_indices.dtype  # [R, W] work stays in the input dtype: int32 halves traffic
    x = topk_indices
    lengths64 = lengths.to(torch.int64)

    sign = torch.iinfo(idt).bits - 1

    # 1. Broken rows; the others' lengths and offsets fit the row dtype. Broken rows are
    # processed as length 1, offset 0 (sanitized, so nothing below can misbehave) and
    # then restored.
    valid, n_valid, mismatch = _row_checks(x, lengths, offsets, None if drift is None else drift.shape[1], bs)
    ok = ~mismatch
    lengths64 = torch.where(ok, lengths64, 1)
    off = None if offsets is None else torch.where(ok, offsets.to(torch.int64), 0).to(idt).unsqueeze(1)  # [R, 1]
    rel = (x if off is None else x - off) | (x >> sign)  # request-local position; padding -> -1

    # 2. Structural slots, and their priority order.
    only = layout.only
    compress = layout.compress_mode and scaffold_lengths is not None
    slots = _structural_slots(
        lengths64, drift, scaffold_lengths, compress=compress, layout=layout, n_wit=layout.witness_count(W)
    )
    n_compressed = slots.n_compressed if slots.n_compressed is not None else torch.zeros_like(n_valid)
    perm = _priority_permutation(slots.S_sink, layout.local_blocks * bs, slots.wit.shape[1], bs, device)
    tok_p = slots.tok.index_select(1, perm)  # [R, S] priority order
    valid_p = tok_p >= 0

    # 3-6. Merge into the learned rows, or replace them.
    if only:
        out, n_selected = _topology_only_rows(x, tok_p, valid_p, off, mismatch)
        n_learned = n_valid
        n_kept = topology_only_learned_kept(x, out, mismatch)
        n_injected = n_selected - n_kept
    else:
        out, n_learned, n_kept, n_injected = _merge_rows(
            x, valid, n_valid, mismatch, ok, rel, off, lengths64, slots, perm, tok_p, valid_p,
            learned_scores=learned_scores, layout=layout,
        )
        n_selected = n_kept + n_injected

    # 7. Counters.
    counters = _counters(ok, mismatch, lengths64, n_selected, n_learned, n_kept, n_injected, n_compressed, bs)
    return out, counters
