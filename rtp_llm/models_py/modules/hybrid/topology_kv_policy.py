"""Topology KV candidate policy: merge structural KV blocks into the learned top-k rows.

The serving path calls :func:`apply_topology_kv_policy` after the indexer's top-k op on
every sparse-attention layer. It takes the top-k rows in the engine's convention and
returns rows of the same shape, dtype and device that the sparse attention consumes
unchanged. Shape vocabulary: ``R`` rows, ``W`` top-k width, ``B`` requests, ``N`` blocks,
``S`` structural slots (``scheduled blocks * block_size``).

Coordinate contract (DESIGN.md): row ``r`` holds request-local token positions in
``[offset[r], offset[r] + lengths[r])``; negative entries are padding. The output keeps
that interval, is unique per row, has valid entries first and ``-1`` after them, and
never reaches past the causal length. Input rows are assumed unique (the engine's top-k
guarantees it); :func:`check_topk_coordinates` checks that too, off the hot path.

Hot-path rule: :func:`topology_kv_policy_core` (and everything it calls) is pure tensor
code with static shapes: no ``.item()``, ``.tolist()``, ``nonzero`` or loops over rows,
so it runs inside a CUDA graph and under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import time
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv_schedule import (
    DEFAULT_BLOCK_SIZE,
    score_sort_keys,
    expand_blocks_unchecked,
    prioritized_block_schedule_unchecked,
)


class TopologyKVPolicyMode(enum.Enum):
    """What the policy does to the learned top-k rows."""

    DISABLED = "disabled"  # return the input tensor itself
    TOPOLOGY_SPARSE_MERGE = "topology_sparse_merge"  # learned rows + structural blocks
    TOPOLOGY_COMPRESS_SPARSE = "topology_compress_sparse"  # merge, scaffold blocks as 1 token each
    TOPOLOGY_ONLY = "topology_only"  # structural blocks only, full budget

    @classmethod
    def parse(cls, value: Union[str, "TopologyKVPolicyMode"]) -> "TopologyKVPolicyMode":
        """The one place a mode name is parsed: case-insensitive, surrounding blanks ignored."""
        return _parse_enum(cls, value, "policy")


class CoordinateMismatchAction(enum.Enum):
    """What to do with a learned index outside its row's ``[offset, offset + length)``."""

    RAISE = "raise"  # check on the host (one sync) and raise naming row and value
    FALLBACK_DISABLED = "fallback_disabled"  # return such rows unchanged, count them; no sync

    @classmethod
    def parse(cls, value: Union[str, "CoordinateMismatchAction"]) -> "CoordinateMismatchAction":
        return _parse_enum(cls, value, "coordinate_mismatch_action")


def _parse_enum(cls, value, setting: str):
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in cls:
            if key in (member.value, member.name.lower()):
                return member
    valid = ", ".join(m.value for m in cls)
    raise ValueError(f"{setting}: expected one of [{valid}] (case-insensitive), got {value!r}")


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class TopologyKVPolicyConfig:
    """Validated, immutable policy configuration (read once, at construction).

    Attributes
    ----------
    policy : TopologyKVPolicyMode or its name (parsed case-insensitively)
    sink_blocks, local_blocks, witness_blocks : int >= 0
        Structural blocks per row (see ``topology_kv_schedule``). ``TOPOLOGY_ONLY``
        ignores ``witness_blocks``: witnesses fill whatever budget remains.
    block_size : int > 0
        Tokens per block; 64 is the engine's KV page size.
    max_structural_fraction : float in (0, 1]
        Merge modes: at most ``floor(W * max_structural_fraction)`` structural tokens are
        *injected* per row (structural tokens the learned row already holds are free).
        0.25 keeps three quarters of the learned budget for the indexer.
    coordinate_mismatch_action : CoordinateMismatchAction or its name
    """

    policy: TopologyKVPolicyMode = TopologyKVPolicyMode.DISABLED
    sink_blocks: int = 1
    local_blocks: int = 2
    witness_blocks: int = 2
    block_size: int = DEFAULT_BLOCK_SIZE
    max_structural_fraction: float = 0.25
    coordinate_mismatch_action: CoordinateMismatchAction = CoordinateMismatchAction.RAISE

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", TopologyKVPolicyMode.parse(self.policy))
        object.__setattr__(
            self, "coordinate_mismatch_action", CoordinateMismatchAction.parse(self.coordinate_mismatch_action)
        )
        _check_count("sink_blocks", self.sink_blocks, 0)
        _check_count("local_blocks", self.local_blocks, 0)
        _check_count("witness_blocks", self.witness_blocks, 0)
        _check_count("block_size", self.block_size, 1)
        frac = self.max_structural_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)):
            raise TypeError(f"max_structural_fraction: expected float, got {type(frac).__name__} {frac!r}")
        if not (math.isfinite(frac) and 0.0 < frac <= 1.0):
            raise ValueError(f"max_structural_fraction: expected a value in (0, 1], got {frac}")
        if self.enabled and self.sink_blocks + self.local_blocks + self.witness_blocks == 0:
            if self.policy is not TopologyKVPolicyMode.TOPOLOGY_ONLY:
                raise ValueError(
                    "sink_blocks + local_blocks + witness_blocks: expected > 0 for "
                    f"{self.policy.value}, got 0 (the policy would inject nothing)"
                )

    @property
    def enabled(self) -> bool:
        return self.policy is not TopologyKVPolicyMode.DISABLED

    def structural_cap(self, width: int) -> int:
        """Most structural tokens a merge mode injects into a row of width ``width``."""
        return int(math.floor(width * self.max_structural_fraction))


# ---------------------------------------------------------------------------------------
# Per-request context and fingerprints (host side; owned by the caller, never shared).
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class TopologyRequestContext:
    """Per-request state the caller owns and passes in; the policy keeps none of its own.

    Attributes
    ----------
    scaffold_token_ids : tuple of int
        The request's stable scaffold (e.g. a shared system prompt), a prefix of the
        request. ``TOPOLOGY_COMPRESS_SPARSE`` represents structural blocks that lie
        wholly inside it by one token each.
    last_fingerprint : str or None
        Fingerprint of the previous call with this context.
    compression_hits : int
        Calls whose fingerprint equalled the previous one (the scaffold and output
        contract were unchanged, so a cached scaffold layout could be reused).
    """

    scaffold_token_ids: Tuple[int, ...] = ()
    last_fingerprint: Optional[str] = None
    compression_hits: int = 0

    def __post_init__(self) -> None:
        ids = tuple(self.scaffold_token_ids)
        for i, tok in enumerate(ids):
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise TypeError(f"scaffold_token_ids[{i}]: expected int, got {type(tok).__name__}")
        self.scaffold_token_ids = ids

    @property
    def scaffold_length(self) -> int:
        return len(self.scaffold_token_ids)


def policy_fingerprint(config: TopologyKVPolicyConfig, width: int, scaffold_token_ids: Sequence[int]) -> str:
    """Stable hex digest of the scaffold tokens and the output contract.

    Covers the mode, width ``W``, block size, block counts, structural fraction and
    the scaffold token ids: equal fingerprints mean equal structural layouts for the
    scaffold span. Stable across processes (sha256 of a canonical string).
    """
    contract = (
        f"mode={config.policy.value};W={width};bs={config.block_size};sink={config.sink_blocks};"
        f"local={config.local_blocks};witness={config.witness_blocks};"
        f"frac={config.max_structural_fraction!r};scaffold="
    )
    digest = hashlib.sha256(contract.encode())
    digest.update(",".join(str(int(t)) for t in scaffold_token_ids).encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# Counters and result.
# ---------------------------------------------------------------------------------------

COUNTER_NAMES = (
    "selected_tokens",  # valid output entries (rows the policy processed)
    "structural_injected_tokens",  # output tokens that were not in the learned row
    "learned_kept_tokens",  # learned tokens present in the output
    "learned_evicted_tokens",  # learned tokens absent from the output
    "unselected_tokens",  # causal tokens (sum of lengths) not selected
    "coordinate_mismatch_fallbacks",  # rows returned unchanged for a contract violation
    "compressed_blocks",  # compress mode: scaffold blocks represented by one token
    "compression_saved_tokens",  # compress mode: tokens those blocks did not spend
)


@dataclasses.dataclass(frozen=True)
class TopologyKVCounters:
    """Counters as 0-dim int64 device tensors; :meth:`to_dict` materializes them (syncs).

    Token counters cover the rows the policy processed; rows returned unchanged after a
    coordinate mismatch are counted only in ``coordinate_mismatch_fallbacks``.
    ``compression_hits`` is a host int: the number of contexts in this call whose
    fingerprint equalled their previous one.
    """

    tensors: Dict[str, torch.Tensor]
    compression_hits: int = 0

    def to_dict(self) -> Dict[str, int]:
        out = {name: int(self.tensors[name]) for name in COUNTER_NAMES}
        out["compression_hits"] = self.compression_hits
        return out

    def __getattr__(self, name: str):
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)


@dataclasses.dataclass(frozen=True)
class TopologyKVPolicyResult:
    """What :func:`apply_topology_kv_policy` returns.

    indices : the output rows (the input tensor itself when disabled)
    counters : TopologyKVCounters, or None when disabled (nothing was computed)
    fingerprints : one per context passed in (empty when no context)
    schedule_ms : wall time of the policy in ms when ``measure_time=True`` (syncs), else None
    """

    indices: torch.Tensor
    counters: Optional[TopologyKVCounters]
    fingerprints: Tuple[str, ...] = ()
    schedule_ms: Optional[float] = None


# ---------------------------------------------------------------------------------------
# Validation (public entry; may sync) and the contract check.
# ---------------------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int32, torch.int64)


def _validate_inputs(topk_indices, lengths, offsets, drift, row_to_request, learned_scores) -> None:
    if not isinstance(topk_indices, torch.Tensor):
        raise TypeError(f"topk_indices: expected torch.Tensor, got {type(topk_indices).__name__}")
    if topk_indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"topk_indices: expected dtype int32 or int64, got {topk_indices.dtype}")
    if topk_indices.dim() != 2:
        raise ValueError(f"topk_indices: expected rank 2 [R, W], got shape {tuple(topk_indices.shape)}")
    R, W = topk_indices.shape
    dev = topk_indices.device

    def vec(name, t, n, dtypes=_INDEX_DTYPES):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
        if t.device != dev:
            raise ValueError(f"{name}: expected device {dev} (topk_indices'), got {t.device}")

    vec("lengths", lengths, R)
    if offsets is not None:
        vec("topk_indices_offset", offsets, R)
    if learned_scores is not None:
        if not isinstance(learned_scores, torch.Tensor) or not learned_scores.is_floating_point():
            raise TypeError("learned_scores: expected a floating-point torch.Tensor")
        if tuple(learned_scores.shape) != (R, W):
            raise ValueError(f"learned_scores: expected shape ({R}, {W}), got {tuple(learned_scores.shape)}")
        if learned_scores.device != dev:
            raise ValueError(f"learned_scores: expected device {dev}, got {learned_scores.device}")
    if drift is not None:
        if not isinstance(drift, torch.Tensor) or not drift.is_floating_point():
            raise TypeError("block_drift_scores: expected a floating-point torch.Tensor")
        if drift.dim() != 2:
            raise ValueError(f"block_drift_scores: expected rank 2 [R or B, N], got shape {tuple(drift.shape)}")
        if drift.device != dev:
            raise ValueError(f"block_drift_scores: expected device {dev}, got {drift.device}")
        if row_to_request is None and drift.shape[0] != R:
            raise ValueError(
                f"block_drift_scores: expected {R} rows (one per top-k row) without row_to_request, "
                f"got shape {tuple(drift.shape)}"
            )
    if row_to_request is not None:
        vec("row_to_request", row_to_request, R)


def check_topk_coordinates(
    topk_indices: torch.Tensor, lengths: torch.Tensor, topk_indices_offset: Optional[torch.Tensor] = None
) -> None:
    """Raise ``ValueError`` naming the first row and value that break the contract.

    Checks ``lengths > 0``, every non-negative entry inside ``[offset, offset + length)``,
    and no duplicate entries in a row. Looks at values, so it synchronizes with the
    device: run it once (e.g. in tests or at warm-up), not inside a CUDA graph.
    """
    _validate_inputs(topk_indices, lengths, topk_indices_offset, None, None, None)
    if lengths.numel() and int(lengths.min()) <= 0:
        row = int(torch.argmin(lengths))
        raise ValueError(f"lengths: expected every length > 0, got {int(lengths[row])} at row {row}")
    bad = _mismatch_rows(topk_indices.to(torch.int64), lengths.to(torch.int64), _offsets(topk_indices_offset, lengths))
    if bool(bad.any()):
        row = int(torch.argmax(bad.to(torch.int8)))
        off = 0 if topk_indices_offset is None else int(topk_indices_offset[row])
        length = int(lengths[row])
        vals = topk_indices[row]
        out = vals[(vals >= 0) & ((vals < off) | (vals >= off + length))]
        raise ValueError(
            f"topk_indices: row {row} holds {int(out[0])}, outside its interval "
            f"[{off}, {off + length}) (offset {off}, length {length})"
        )
    srt = torch.sort(topk_indices, dim=-1).values
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(dup.any()):
        row = int(torch.argmax(dup.any(dim=1).to(torch.int8)))
        val = int(srt[row, 1:][dup[row]][0])
        raise ValueError(f"topk_indices: row {row} holds {val} twice (rows must be unique)")


def _offsets(offsets: Optional[torch.Tensor], lengths: torch.Tensor) -> torch.Tensor:
    if offsets is None:
        return torch.zeros_like(lengths, dtype=torch.int64)
    return offsets.to(torch.int64)


def _mismatch_rows(idx: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool: the row holds a non-negative entry outside its interval."""
    rel = idx - offsets.unsqueeze(1)
    return ((idx >= 0) & ((rel < 0) | (rel >= lengths.unsqueeze(1)))).any(dim=1)


# ---------------------------------------------------------------------------------------
# The vectorized core.
# ---------------------------------------------------------------------------------------


def _rank_within(mask: torch.Tensor) -> torch.Tensor:
    """1-based running count of ``mask`` along the last dim (int64)."""
    return torch.cumsum(mask.to(torch.int64), dim=-1)


def _scatter_compact(values: torch.Tensor, keep: torch.Tensor, position: torch.Tensor, width: int) -> torch.Tensor:
    """Place ``values[keep]`` at ``position`` of a ``[R, width]`` row filled with -1."""
    R = values.shape[0]
    out = torch.full((R, width + 1), -1, dtype=torch.int64, device=values.device)
    target = torch.where(keep, position, torch.full_like(position, width))  # dump column
    out.scatter_(1, target, torch.where(keep, values, torch.full_like(values, -1)))
    return out[:, :width]


def _lowest_scored(scores: torch.Tensor, candidate: torch.Tensor, count: torch.Tensor, k_max: int) -> torch.Tensor:
    """``[R, W]`` bool: the ``count[r]`` candidates with the lowest score (ties: later entry).

    Keys are made unique (order-preserving int view of the fp32 score, then the entry
    position reversed), so ``topk`` is deterministic; NaN counts as ``-inf``. ``k_max``
    is a static bound on ``count``.
    """
    R, W = candidate.shape
    if k_max <= 0:
        return torch.zeros_like(candidate)
    later_first = W - 1 - torch.arange(W, device=candidate.device, dtype=torch.int64)
    key = score_sort_keys(scores, later_first)  # ties: the later entry has the lower key
    key = torch.where(candidate, key, torch.iinfo(torch.int64).max)
    lowest = torch.topk(key, k_max, dim=1, largest=False, sorted=True).indices  # [R, k]
    chosen = torch.arange(k_max, device=candidate.device).unsqueeze(0) < count.unsqueeze(1)
    evict = torch.zeros(R, W + 1, dtype=torch.bool, device=candidate.device)
    evict.scatter_(1, torch.where(chosen, lowest, W), chosen)
    return evict[:, :W]


def topology_kv_policy_core(
    topk_indices: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    drift: Optional[torch.Tensor],
    learned_scores: Optional[torch.Tensor],
    scaffold_lengths: Optional[torch.Tensor],
    *,
    mode: TopologyKVPolicyMode,
    sink_blocks: int,
    local_blocks: int,
    witness_blocks: int,
    block_size: int,
    structural_cap: int,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Vectorized policy over all rows; pure tensor ops with static shapes, no host sync.

    Parameters
    ----------
    topk_indices : int32/int64 ``[R, W]`` learned rows (request-local, ``-1`` padding)
    lengths, offsets : int ``[R]`` causal lengths (> 0, not checked) and row offsets
    drift : float ``[R, N]`` witness scores per row, or None (most recent blocks win)
    learned_scores : float ``[R, W]`` aligned with ``topk_indices``, or None
    scaffold_lengths : int ``[R]`` scaffold span per row (compress mode), or None
    mode : an enabled :class:`TopologyKVPolicyMode`

    Returns
    -------
    (indices, counters): indices like ``topk_indices`` (same dtype, device); rows with a
    coordinate mismatch are returned unchanged and flagged in ``mismatch_rows``; counters
    are 0-dim int64 tensors keyed by :data:`COUNTER_NAMES` plus ``mismatch_rows`` ``[R]``.

    Semantics (row ``r``, relative coordinates ``t = index - offset``; see module doc):

    * Structural *slots* in priority order: sink blocks ascending, local blocks from the
      row's last block backwards, witness blocks by descending score (ties: lower block);
      tokens of a block ascending; only tokens ``< length``. Compress mode keeps only the
      first token of a block lying wholly inside ``[0, min(scaffold, length))``.
    * Merge modes: a slot whose token the learned row already holds is *present* (free
      and protected from eviction). New slots are injected in priority order, at most
      ``min(structural_cap, W - present)``. When the row overflows, the learned tokens
      that are not present-structural with the lowest ``learned_scores`` are evicted
      (ties: the later entry first); without scores the row's last such entries.
      Output: kept learned entries in input order, then injected tokens in priority
      order, then ``-1``.
    * ``TOPOLOGY_ONLY``: rows with ``length <= W`` become ``0 .. length-1`` ascending;
      longer rows take the first ``W`` valid slots in priority order (witnesses fill
      the budget, ``witness_blocks`` is ignored).
    """
    device = topk_indices.device
    R, W = topk_indices.shape
    bs = block_size
    # [R, W] work stays in the input's integer dtype (int32 halves the traffic); per-row
    # scalars are cast to it once. Positions fit: they are < offset + length.
    idt = topk_indices.dtype
    x = topk_indices
    L = lengths.to(idt)
    off = offsets.to(idt).unsqueeze(1)  # [R, 1]
    rel = x - off  # [R, W]
    valid = x >= 0
    learned = valid & (rel >= 0) & (rel < L.unsqueeze(1))  # [R, W]
    mismatch = (valid ^ learned).any(dim=1)  # [R] a valid entry outside the interval

    only = mode is TopologyKVPolicyMode.TOPOLOGY_ONLY
    n_wit = (W + bs - 1) // bs + 1 if only else witness_blocks
    blocks = prioritized_block_schedule_unchecked(
        lengths, sink_blocks, local_blocks, n_wit, bs, drift
    )  # [R, Kb] int64 priority order, -1 missing
    Kb = blocks.shape[1]
    S = Kb * bs
    slot_tok = expand_blocks_unchecked(blocks, lengths, bs)  # [R, S] int64 token or -1

    compress = mode is TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE and scaffold_lengths is not None
    if compress:
        # Blocks wholly inside the scaffold span and the causal length keep one token.
        span = torch.minimum(scaffold_lengths.to(torch.int64), lengths.to(torch.int64))  # [R]
        compressed = (blocks >= 0) & ((blocks + 1) * bs <= span.unsqueeze(1))  # [R, Kb]
        first_in_block = (torch.arange(S, device=device) % bs) == 0  # [S]
        keep_slot = ~compressed.repeat_interleave(bs, dim=1) | first_in_block
        slot_tok = torch.where(keep_slot, slot_tok, -1)
    else:
        compressed = None
    slot_valid = slot_tok >= 0  # [R, S]

    # Column of the scheduled block that holds each learned token: arithmetic for sinks
    # and locals (contiguous ranges), comparisons (or a search) for the witnesses.
    nb = (lengths.to(torch.int64) + bs - 1) // bs
    sink_end = torch.clamp(nb, max=sink_blocks)
    local_start = torch.maximum(torch.clamp(nb - local_blocks, min=0), sink_end)
    bt = torch.div(rel, bs, rounding_mode="floor")  # [R, W] block of each entry
    col = torch.where(bt < sink_end.to(idt).unsqueeze(1), bt, -1)
    local_col = (sink_blocks - 1) + nb.to(idt).unsqueeze(1) - bt  # = sink + (nb - 1 - bt)
    col = torch.where(bt >= local_start.to(idt).unsqueeze(1), local_col, col)
    wit = blocks[:, sink_blocks + local_blocks :].to(idt)  # [R, n_wit]
    if 0 < n_wit <= 8:
        for j in range(n_wit):
            col = torch.where(bt == wit[:, j : j + 1], sink_blocks + local_blocks + j, col)
    elif n_wit > 8:
        big = torch.iinfo(idt).max
        wit_sorted, wit_order = torch.sort(torch.where(wit >= 0, wit, big), dim=1)
        pos = torch.searchsorted(wit_sorted, bt).clamp(max=n_wit - 1)  # [R, W]
        hit = torch.gather(wit_sorted, 1, pos) == bt
        col = torch.where(hit, sink_blocks + local_blocks + torch.gather(wit_order, 1, pos).to(idt), col)
    is_struct = learned & (col >= 0)  # [R, W] learned entry inside a scheduled block
    slot = torch.where(is_struct, col * bs + (rel - bt * bs), S).to(torch.int64)  # S = dump slot
    if compress:
        is_struct = is_struct & torch.gather(torch.nn.functional.pad(slot_valid, (0, 1)), 1, slot)
        slot = torch.where(is_struct, slot, S)
    present = torch.zeros(R, S + 1, dtype=torch.bool, device=device)
    present.scatter_(1, slot, True)
    new = slot_valid & ~present[:, :S]  # [R, S] structural tokens the row lacks
    new_rank = _rank_within(new)  # [R, S] 1-based, priority order
    n_learned = learned.sum(dim=1)  # [R]

    if only:
        short = lengths.to(torch.int64) <= W  # [R]
        take = slot_valid & (_rank_within(slot_valid) <= W)  # [R, S] first W valid slots
        out_long = _scatter_compact(slot_tok, take, _rank_within(take) - 1, W)
        ar = torch.arange(W, device=device).unsqueeze(0)
        out_short = torch.where(ar < lengths.to(torch.int64).unsqueeze(1), ar, -1)
        out_rel = torch.where(short.unsqueeze(1), out_short, out_long)  # [R, W] int64
        # A learned entry is kept iff its slot was taken (long rows); short rows keep all.
        taken_slot = torch.gather(torch.nn.functional.pad(take, (0, 1)), 1, slot)
        n_kept = (learned & (short.unsqueeze(1) | taken_slot)).sum(dim=1)
        n_selected = (out_rel >= 0).sum(dim=1)
        n_injected = n_selected - n_kept
        out = torch.where(out_rel >= 0, out_rel.to(idt) + off, -1)
    else:
        n_present = is_struct.sum(dim=1)
        n_inject = torch.minimum(new.sum(dim=1), torch.clamp(W - n_present, max=structural_cap))  # [R]
        inject = new & (new_rank <= n_inject.unsqueeze(1))  # [R, S]
        n_evict = torch.clamp(n_learned + n_inject - W, min=0)  # [R]
        candidate = learned & ~is_struct  # [R, W] evictable learned entries
        if learned_scores is None:
            # Evict the row's last n_evict candidates: 1-based rank > count - n_evict.
            cand_rank = _rank_within(candidate)
            n_cand = cand_rank[:, -1:]
            evict = candidate & (cand_rank > n_cand - n_evict.unsqueeze(1))
        else:
            evict = _lowest_scored(learned_scores, candidate, n_evict, min(W, max(structural_cap, 0)))
        kept = learned & ~evict  # [R, W]
        kept_rank = _rank_within(kept)  # [R, W] 1-based
        n_kept = kept_rank[:, -1]
        target = torch.where(kept, kept_rank - 1, W)  # [R, W] int64, W = dump column
        out = torch.full((R, W + 1), -1, dtype=idt, device=device)
        out.scatter_(1, target, x)  # kept learned entries, input order (already absolute)
        inj_target = torch.where(inject, n_kept.unsqueeze(1) + new_rank - 1, W)  # [R, S]
        out.scatter_(1, inj_target, (slot_tok.to(idt) + off))
        out = out[:, :W]
        n_injected = n_inject
        n_selected = n_kept + n_inject

    out = torch.where(mismatch.unsqueeze(1), x, out)  # contract violations: row unchanged

    ok = ~mismatch

    def total(per_row: torch.Tensor) -> torch.Tensor:
        return torch.where(ok, per_row.to(torch.int64), 0).sum()

    n_compressed = compressed.sum(dim=1) if compressed is not None else torch.zeros_like(n_learned)
    counters = {
        "selected_tokens": total(n_selected),
        "structural_injected_tokens": total(n_injected),
        "learned_kept_tokens": total(n_kept),
        "learned_evicted_tokens": total(n_learned - n_kept),
        "unselected_tokens": total(lengths.to(torch.int64) - n_selected),
        "coordinate_mismatch_fallbacks": mismatch.sum().to(torch.int64),
        "compressed_blocks": total(n_compressed),
        "compression_saved_tokens": total(n_compressed * (bs - 1)),
        "mismatch_rows": mismatch,
    }
    return out, counters


# ---------------------------------------------------------------------------------------
# Public entry point.
# ---------------------------------------------------------------------------------------

ContextArg = Union[None, TopologyRequestContext, Sequence[TopologyRequestContext]]


def apply_topology_kv_policy(
    topk_indices: torch.Tensor,
    lengths: torch.Tensor,
    *,
    config: TopologyKVPolicyConfig,
    topk_indices_offset: Optional[torch.Tensor] = None,
    block_drift_scores: Optional[torch.Tensor] = None,
    row_to_request: Optional[torch.Tensor] = None,
    learned_scores: Optional[torch.Tensor] = None,
    context: ContextArg = None,
    measure_time: bool = False,
    validate: bool = True,
) -> TopologyKVPolicyResult:
    """Apply the topology policy to learned top-k rows.

    Parameters
    ----------
    topk_indices : int32 or int64 Tensor ``[R, W]`` (any other dtype: ``TypeError``)
        Learned rows in the engine's convention: request-local positions inside
        ``[offset, offset + length)``, negative = padding. Never modified.
    lengths : int32/int64 ``[R]``
        Causal length of each row (``expanded_seq_lens``), > 0.
    config : TopologyKVPolicyConfig
    topk_indices_offset : int32/int64 ``[R]`` or None (zeros)
    block_drift_scores : float ``[R, N]``, or ``[B, N]`` with ``row_to_request``
        Witness score of each block of the row's request (e.g. key-centroid drift).
        Blocks past a row's causal length are ignored. None: witnesses are the most
        recent eligible blocks (documented fallback).
    row_to_request : int ``[R]`` or None
        Request index of each row into ``block_drift_scores`` and ``context``.
    learned_scores : float ``[R, W]`` or None
        Indexer scores aligned with ``topk_indices``; merge modes evict the lowest.
    context : TopologyRequestContext, a sequence of them (one per request), or None
        Per-request state owned by the caller: scaffold tokens for compress mode and the
        fingerprint history. Updated in place (each context by its own caller only).
    measure_time : bool
        Synchronize and report the policy's wall time in ``schedule_ms``.
    validate : bool
        Check argument shapes, dtypes and devices (no value is read; no sync).

    Returns
    -------
    TopologyKVPolicyResult. ``DISABLED`` returns ``topk_indices`` itself and no counters.

    Coordinate mismatch (a non-negative learned entry outside its interval):
    ``RAISE`` checks on the host (one device sync; not for CUDA-graph capture) and raises
    ``ValueError`` naming row and value. ``FALLBACK_DISABLED`` returns each such row
    unchanged and counts it in ``coordinate_mismatch_fallbacks``, with no sync.
    """
    if not isinstance(config, TopologyKVPolicyConfig):
        raise TypeError(f"config: expected TopologyKVPolicyConfig, got {type(config).__name__}")
    if validate:
        _validate_inputs(topk_indices, lengths, topk_indices_offset, block_drift_scores, row_to_request, learned_scores)
    if not config.enabled:
        return TopologyKVPolicyResult(indices=topk_indices, counters=None)

    start = None
    if measure_time:
        _synchronize(topk_indices.device)
        start = time.perf_counter()
    if config.coordinate_mismatch_action is CoordinateMismatchAction.RAISE:
        check_topk_coordinates(topk_indices, lengths, topk_indices_offset)

    W = topk_indices.shape[1]
    contexts = _as_context_list(context)
    fingerprints = tuple(policy_fingerprint(config, W, c.scaffold_token_ids) for c in contexts)
    hits = 0
    for ctx, fp in zip(contexts, fingerprints):
        if ctx.last_fingerprint == fp:
            ctx.compression_hits += 1
            hits += 1
        ctx.last_fingerprint = fp

    drift = block_drift_scores
    if drift is not None and row_to_request is not None:
        drift = drift.index_select(0, row_to_request.to(torch.int64))  # [R, N]
    scaffold = None
    if config.policy is TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE and contexts:
        per_request = torch.tensor(
            [c.scaffold_length for c in contexts], dtype=torch.int64, device=topk_indices.device
        )
        if len(contexts) == 1:
            scaffold = per_request.expand(topk_indices.shape[0])
        elif row_to_request is not None:
            scaffold = per_request.index_select(0, row_to_request.to(torch.int64))
        else:
            if len(contexts) != topk_indices.shape[0]:
                raise ValueError(
                    f"context: expected 1 context, one per row ({topk_indices.shape[0]}), or "
                    f"row_to_request, got {len(contexts)} contexts"
                )
            scaffold = per_request
    out, counters = topology_kv_policy_core(
        topk_indices,
        lengths,
        _offsets(topk_indices_offset, lengths),
        drift,
        learned_scores,
        scaffold,
        mode=config.policy,
        sink_blocks=config.sink_blocks,
        local_blocks=config.local_blocks,
        witness_blocks=config.witness_blocks,
        block_size=config.block_size,
        structural_cap=config.structural_cap(W),
    )
    counters.pop("mismatch_rows")
    elapsed = None
    if measure_time:
        _synchronize(topk_indices.device)
        elapsed = (time.perf_counter() - start) * 1e3
    return TopologyKVPolicyResult(
        indices=out,
        counters=TopologyKVCounters(tensors=counters, compression_hits=hits),
        fingerprints=fingerprints,
        schedule_ms=elapsed,
    )


def _as_context_list(context: ContextArg):
    if context is None:
        return []
    if isinstance(context, TopologyRequestContext):
        return [context]
    contexts = list(context)
    for i, c in enumerate(contexts):
        if not isinstance(c, TopologyRequestContext):
            raise TypeError(f"context[{i}]: expected TopologyRequestContext, got {type(c).__name__}")
    return contexts


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
