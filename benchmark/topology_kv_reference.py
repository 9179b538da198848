"""Plain reference implementations (Python loops, ``.tolist()``) for tests and benchmarks.

Never imported by the serving path. Each function mirrors a vectorized function in
``rtp_llm/models_py/modules/hybrid`` and is written to be obviously correct, not fast.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def reference_block_key_centroids(keys: torch.Tensor, block_size: int, length: Optional[int] = None) -> torch.Tensor:
    """Per-block mean of ``keys[:length]`` (``[L, H, D]``) in float64, block by block."""
    L = keys.shape[0] if length is None else length
    n_blocks = (keys.shape[0] + block_size - 1) // block_size
    out = torch.zeros(n_blocks, keys.shape[1], keys.shape[2], dtype=torch.float64)
    for b in range(n_blocks):
        lo, hi = b * block_size, min((b + 1) * block_size, L)
        if hi > lo:
            out[b] = keys[lo:hi].to(torch.float64).mean(dim=0)
    return out


def reference_drift_l2(centroids: torch.Tensor) -> List[float]:
    """``[0, ||c1 - c0||, ||c2 - c1||, ...]`` over flattened ``[N, H, D]`` centroids."""
    flat = centroids.to(torch.float64).flatten(1)
    return [0.0] + [float(torch.linalg.vector_norm(flat[b] - flat[b - 1])) for b in range(1, flat.shape[0])]


def reference_prioritized_blocks(
    length: int,
    sink_blocks: int,
    local_blocks: int,
    witness_blocks: int,
    block_size: int,
    drift: Optional[Sequence[float]] = None,
) -> List[int]:
    """Scheduled blocks of one row in priority order: sinks, locals (newest first), witnesses.

    Witnesses: highest drift among blocks that are neither sink nor local and lie
    inside the causal length; ties to the lower block. Without drift: the most recent
    such blocks (the block index is the score).
    """
    n_blocks = (length + block_size - 1) // block_size
    sinks = [b for b in range(min(sink_blocks, n_blocks))]
    locals_ = []
    for b in range(n_blocks - 1, -1, -1):
        if len(locals_) == local_blocks:
            break
        if b not in sinks:
            locals_.append(b)
    taken = set(sinks) | set(locals_)
    candidates = [b for b in range(n_blocks) if b not in taken]
    score = (lambda b: float(b)) if drift is None else (lambda b: float(drift[b]))
    candidates.sort(key=lambda b: (-score(b), b))
    return sinks + locals_ + candidates[:witness_blocks]


def reference_token_indices(length: int, blocks: Sequence[int], block_size: int) -> List[int]:
    """Sorted unique token ids ``< length`` covered by ``blocks``."""
    tokens = set()
    for b in blocks:
        for t in range(b * block_size, (b + 1) * block_size):
            if t < length:
                tokens.add(t)
    return sorted(tokens)


def pad_rows(rows: Sequence[Sequence[int]], width: int, dtype=torch.int64) -> torch.Tensor:
    """Stack ragged Python rows into ``[len(rows), width]`` padded with ``-1``."""
    out = torch.full((len(rows), width), -1, dtype=dtype)
    for r, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {r}: {len(row)} entries > width {width}")
        if row:
            out[r, : len(row)] = torch.tensor(list(row), dtype=dtype)
    return out
