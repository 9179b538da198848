"""The serving block schedule: witness blocks by score, and block-to-token expansion.

Pure tensor functions with static shapes, no validation and no host sync: the policy
core (``kernels.torch_core``) calls them on every layer, so they run inside a CUDA graph
and under ``torch.compile(fullgraph=True)``. Shape vocabulary: ``R`` rows, ``N`` blocks
(``ceil(length / block_size)``), ``K`` scheduled blocks per row.

A row with causal length ``length`` has ``N = ceil(length / block_size)`` blocks; the
policy's layout (``layer.PolicyLayout``) fixes the sink blocks ``[0, sink_end)`` and the
local blocks ``[local_start, N)``. The witness blocks are the highest-scoring blocks in
between (key-centroid drift, or whatever the caller passes), ties to the lower block;
without scores they are the most recent such blocks (recency, the strongest prior
without data). Only blocks holding a token ``< length`` are ever scheduled.
"""

from __future__ import annotations

from typing import Optional

import torch


def score_sort_keys(scores: torch.Tensor, tiebreak: torch.Tensor) -> torch.Tensor:
    """Unique int64 sort keys: the fp32 score's order-preserving bits, then ``tiebreak``.

    ``tiebreak`` must be in ``[0, 2**32)`` and unique per row; a larger one wins ties.
    NaN counts as ``-inf`` and ``-0.0`` as ``+0.0``.
    """
    s = scores.to(torch.float32)
    s = torch.where(torch.isnan(s), float("-inf"), s) + 0.0
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float
    return ordered * (1 << 32) + tiebreak


def witness_blocks_unchecked(
    sink_end: torch.Tensor,
    local_start: torch.Tensor,
    witness_blocks: int,
    drift_scores: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The ``witness_blocks`` witness blocks of every row, best first; no validation.

    Parameters
    ----------
    sink_end, local_start : int64 ``[R]``: the eligible blocks are ``[sink_end, local_start)``
    drift_scores : float ``[R, N]`` or None (recency: the blocks right below ``local_start``)

    Returns
    -------
    int64 ``[R, witness_blocks]``: block ids by descending score (ties: lower block), or
    newest first without scores; ``-1`` where the row has fewer eligible blocks.
    """
    device = sink_end.device
    if drift_scores is None:
        cols = torch.arange(witness_blocks, device=device)
        wit = local_start.unsqueeze(1) - 1 - cols.unsqueeze(0)  # [R, w]
        return torch.where(wit >= sink_end.unsqueeze(1), wit, -1)
    scores = drift_scores.to(torch.float32)
    n_max = scores.shape[-1]
    block = torch.arange(n_max, device=device).unsqueeze(0)  # [1, N]
    eligible = (block >= sink_end.unsqueeze(1)) & (block < local_start.unsqueeze(1))  # [R, N]
    k = min(witness_blocks, n_max)
    # Unique int64 keys (order-preserving int view of the score, then the block index
    # reversed) make topk deterministic: ties go to the lower block. O(N) per row, unlike
    # a full sort.
    key = score_sort_keys(scores, n_max - 1 - block)
    key = torch.where(eligible, key, torch.iinfo(torch.int64).min)
    top = torch.topk(key, k, dim=1, largest=True, sorted=True).indices  # [R, k]
    wit = torch.where(torch.gather(eligible, 1, top), top, -1)
    if k < witness_blocks:
        wit = torch.nn.functional.pad(wit, (0, witness_blocks - k), value=-1)
    return wit


def expand_blocks_unchecked(block_ids: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token ids of each block, block by block in the given column order, no compaction.

    Returns int64 ``[R, S * block_size]``: column ``j * block_size + t`` holds token
    ``block_ids[r, j] * block_size + t`` or ``-1`` when the block is ``-1`` or the
    token is at or past ``lengths[r]``. No validation, no host sync.
    """
    offs = torch.arange(block_size, device=block_ids.device)
    tok = block_ids.to(torch.int64).unsqueeze(-1) * block_size + offs  # [R, S, bs]
    ok = (block_ids.unsqueeze(-1) >= 0) & (tok < lengths.to(torch.int64).view(-1, 1, 1))
    return torch.where(ok, tok, -1).flatten(1)  # [R, S*bs]
