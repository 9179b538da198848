"""Block schedules for the benchmarks: sink/local/witness blocks as sorted token indices.

Used by the decode microbenchmark (``topology_kv_candidate_schedule``) and its tests; the
serving policy builds its own slots from ``topology_kv.schedule`` (no sorting, no
validation). Shape vocabulary:

    B  requests (or rows: one causal length each)
    L  KV length (tokens)
    N  blocks, ``N = ceil(L / block_size)``
    S  scheduled blocks per row (``sink_blocks + local_blocks + witness_blocks``)

A *schedule* picks, for each row with causal length ``length``, three disjoint
sets of KV blocks of ``block_size`` tokens (64 = the engine's page size):

* sink blocks    blocks ``0 .. sink_blocks - 1`` (attention sinks live there);
* local blocks   the ``local_blocks`` blocks ending at the block that holds the
                 row's last token ``length - 1`` (the recent window);
* witness blocks the ``witness_blocks`` remaining blocks with the highest score
                 (key-centroid drift by default), ties to the lower block index;
                 without scores, the most recent remaining blocks.

Only blocks that hold at least one token ``< length`` are eligible, so a
schedule never reaches past the causal length. Expanding a schedule gives
sorted, unique token indices ``< length`` padded with ``-1``.

Public functions validate their arguments (``ValueError`` / ``TypeError`` naming
the argument, expected and actual).
"""

from __future__ import annotations

import dataclasses
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
from rtp_llm.models_py.modules.hybrid.topology_kv.schedule import expand_blocks_unchecked, witness_blocks_unchecked


@dataclasses.dataclass(frozen=True)
class TopologyScheduleConfig:
    """Which blocks a topology schedule keeps per row.

    Attributes
    ----------
    sink_blocks : int >= 0
        Leading blocks kept (attention sinks sit in the first tokens).
    local_blocks : int >= 0
        Blocks kept ending at the block of the row's last token (recency).
    witness_blocks : int >= 0
        Highest-scoring remaining blocks (key-centroid drift by default).
    block_size : int > 0
        Tokens per block; 64 matches the engine's KV page.

    At least one of the three counts must be positive (an empty schedule
    selects nothing and is always a configuration mistake).
    """

    sink_blocks: int = 1
    local_blocks: int = 2
    witness_blocks: int = 2
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        check_int("sink_blocks", self.sink_blocks, 0)
        check_int("local_blocks", self.local_blocks, 0)
        check_int("witness_blocks", self.witness_blocks, 0)
        check_int("block_size", self.block_size, 1)
        if self.total_blocks == 0:
            raise ValueError(
                "sink_blocks + local_blocks + witness_blocks: expected > 0, got 0 "
                "(an empty schedule selects no token)"
            )

    @property
    def total_blocks(self) -> int:
        return self.sink_blocks + self.local_blocks + self.witness_blocks

    @property
    def max_tokens(self) -> int:
        """Upper bound on the tokens one row's schedule expands to."""
        return self.total_blocks * self.block_size

    @classmethod
    def from_token_budget(
        cls, token_budget: int, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> "TopologyScheduleConfig":
        """Split ``token_budget // block_size`` blocks among sink, local and witness.

        One sink block (sinks are few tokens; one page holds them), then half of the
        rest, rounded up, to the recent window (the strongest prior for decode),
        then the remainder to witnesses: 2 blocks -> 1/1/0, 4 -> 1/2/1,
        8 -> 1/4/3, 16 -> 1/8/7. The expansion never exceeds ``token_budget``.
        """
        check_int("block_size", block_size, 1)
        check_int("token_budget", token_budget, 1)
        n_blocks = token_budget // block_size
        if n_blocks == 0:
            raise ValueError(
                f"token_budget: expected >= block_size ({block_size}) so that one block "
                f"fits, got {token_budget}"
            )
        sink = 1
        local = (n_blocks - sink + 1) // 2
        witness = n_blocks - sink - local
        return cls(sink_blocks=sink, local_blocks=local, witness_blocks=witness, block_size=block_size)


def _sort_ascending_pad_last(ids: torch.Tensor) -> torch.Tensor:
    """Sort each row ascending with negative entries (padding) moved to the end as -1."""
    big = torch.iinfo(ids.dtype).max
    keyed = torch.where(ids < 0, torch.full_like(ids, big), ids)
    keyed, _ = torch.sort(keyed, dim=-1)
    return torch.where(keyed == big, torch.full_like(keyed, -1), keyed)


def prioritized_block_schedule_unchecked(
    lengths: torch.Tensor,
    sink_blocks: int,
    local_blocks: int,
    witness_blocks: int,
    block_size: int,
    drift_scores: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Scheduled block ids per row in *priority order*, no validation, no host sync.

    Parameters
    ----------
    lengths : int Tensor ``[R]``, every value > 0 (not checked)
    drift_scores : float Tensor ``[R, N]`` or None (recency witnesses)
        Only blocks ``< ceil(length / block_size)`` of a row are considered.

    Returns
    -------
    int64 Tensor ``[R, sink_blocks + local_blocks + witness_blocks]``. Columns are
    laid out ``[sink..., local..., witness...]``: sinks ascending, locals from the
    query's own block backwards, witnesses by descending score (ties: lower block
    first). Missing blocks (row too short) are ``-1`` in their column. Blocks are
    unique per row.
    """
    device = lengths.device
    lengths = lengths.to(torch.int64)
    R = lengths.shape[0]
    num_blocks = (lengths.clamp(min=1) - 1) // block_size + 1  # [R] ceil, no overflow near 2**63
    sink_cols = torch.arange(sink_blocks, device=device)  # [s]
    sinks = torch.where(sink_cols.unsqueeze(0) < num_blocks.unsqueeze(1), sink_cols.unsqueeze(0), -1)
    sink_end = torch.clamp(num_blocks, max=sink_blocks)  # [R] first block after the sinks
    local_cols = torch.arange(local_blocks, device=device)
    locals_ = num_blocks.unsqueeze(1) - 1 - local_cols.unsqueeze(0)  # [R, l]
    locals_ = torch.where(locals_ >= sink_end.unsqueeze(1), locals_, -1)
    local_start = torch.maximum(torch.clamp(num_blocks - local_blocks, min=0), sink_end)  # [R]
    parts = [sinks.expand(R, sink_blocks), locals_]
    if witness_blocks > 0:
        parts.append(witness_blocks_unchecked(sink_end, local_start, witness_blocks, drift_scores))
    return torch.cat(parts, dim=1)


def build_block_schedule(
    lengths: torch.Tensor, config: TopologyScheduleConfig, drift_scores: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Sink, local and witness block ids for every row, sorted ascending.

    Parameters
    ----------
    lengths : int32/int64 Tensor ``[B]``, every value > 0
        Causal length of each row (tokens ``0 .. length - 1`` are visible).
    config : TopologyScheduleConfig
    drift_scores : float Tensor ``[B, N]`` or ``[N]`` (shared by all rows), optional
        Witness scores per block (e.g. :func:`block_drift_scores`). ``N`` must cover
        every row's blocks: ``N >= ceil(max(lengths) / block_size)``. Without it,
        witnesses fall back to the most recent eligible blocks.

    Returns
    -------
    int64 Tensor ``[B, S]``, ``S = config.total_blocks``, on ``lengths.device``: unique
    block ids per row in ascending order, ``-1`` padding at the end when a row has
    fewer eligible blocks than ``S``. Ties between equal scores go to the lower block.
    """
    if not isinstance(config, TopologyScheduleConfig):
        raise TypeError(f"config: expected TopologyScheduleConfig, got {type(config).__name__}")
    check_lengths(lengths)
    scores = _check_drift(drift_scores, lengths, config.block_size)
    blocks = prioritized_block_schedule_unchecked(
        lengths, config.sink_blocks, config.local_blocks, config.witness_blocks, config.block_size, scores
    )
    return _sort_ascending_pad_last(blocks)


def _check_drift(drift_scores, lengths, block_size) -> Optional[torch.Tensor]:
    if drift_scores is None:
        return None
    check_tensor("drift_scores", drift_scores, ndims=(1, 2), dtypes=FLOAT_DTYPES)
    B = lengths.shape[0]
    if drift_scores.dim() == 1:
        drift_scores = drift_scores.unsqueeze(0).expand(B, -1)
    if drift_scores.shape[0] != B:
        raise ValueError(f"drift_scores: expected {B} rows (one per length), got shape {tuple(drift_scores.shape)}")
    if B:
        need = (int(lengths.max()) + block_size - 1) // block_size
        if drift_scores.shape[1] < need:
            raise ValueError(
                f"drift_scores: expected >= {need} blocks to cover max length {int(lengths.max())}, "
                f"got shape {tuple(drift_scores.shape)}"
            )
    if drift_scores.device != lengths.device:
        raise ValueError(f"drift_scores: expected device {lengths.device}, got {drift_scores.device}")
    return drift_scores


def compact_valid_first(ids: torch.Tensor) -> torch.Tensor:
    """Move the non-negative entries of each row to the front, keeping their order.

    ``ids`` int ``[R, K]``; returns the same shape and dtype with ``-1`` after the
    valid entries. Uses a stable sort on the padding flag, so the order of the valid
    entries is preserved. No host sync.
    """
    pad = (ids < 0).to(torch.int8)
    order = torch.sort(pad, dim=-1, stable=True).indices
    out = torch.gather(ids, 1, order)
    return torch.where(out < 0, torch.full_like(out, -1), out)


def expand_block_schedule(block_ids: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Expand ascending block ids to sorted, unique token indices ``< length``.

    Parameters
    ----------
    block_ids : int Tensor ``[B, S]``, ascending unique block ids per row, ``-1`` tail
        (the output of :func:`build_block_schedule`).
    lengths : int Tensor ``[B]``, every value > 0
    block_size : int > 0

    Returns
    -------
    int64 Tensor ``[B, S * block_size]``: ascending, unique token indices of the row's
    blocks that are ``< lengths[b]``, then ``-1``.
    """
    check_int("block_size", block_size, 1)
    check_tensor("block_ids", block_ids, ndims=(2,), dtypes=INDEX_DTYPES)
    check_lengths(lengths, rows=block_ids.shape[0])
    return compact_valid_first(expand_blocks_unchecked(block_ids, lengths, block_size))


def build_topology_token_indices(
    lengths: torch.Tensor, config: TopologyScheduleConfig, drift_scores: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`build_block_schedule` then :func:`expand_block_schedule` in one call.

    Returns int64 ``[B, config.max_tokens]`` ascending unique token ids, ``-1`` tail.
    """
    blocks = build_block_schedule(lengths, config, drift_scores)
    return compact_valid_first(expand_blocks_unchecked(blocks, lengths, config.block_size))
