"""The policy's broken-row rules, as device tensors (see docs/architecture.md).

One definition shared by the torch core (rows returned unchanged under
``coordinate_mismatch_action=fallback_disabled``), the host-side contract check (``raise``)
and, by test, the Triton kernel. Pure tensor code with static shapes, no host sync.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch


def any_per_row(mask: torch.Tensor) -> torch.Tensor:
    """``mask.any(dim=1)`` for a ``[R, W]`` bool tensor, read as bytes (much faster on CPU)."""
    return mask.contiguous().view(torch.uint8).any(dim=1) != 0


# In the order the host check names them. "duplicate" is last: with a drift table it is a
# bitmap over the table's positions, exact only for rows every other rule lets through
# (a row longer than the table may flag a duplicate it does not hold; it is broken anyway,
# and the message must name the rule it really breaks).
VIOLATIONS = ("offset", "length", "overflow", "interval", "padding", "drift", "duplicate")


def row_violations(
    x: torch.Tensor,
    lengths: torch.Tensor,
    offsets: Optional[torch.Tensor],
    drift_blocks: Optional[int] = None,
    block_size: int = 1,
) -> Dict[str, torch.Tensor]:
    """Per-row contract violations, one ``[R]`` bool tensor per name in :data:`VIOLATIONS`.

    Pure tensor code, no host sync. Interval arithmetic is int64 whatever the dtypes of
    ``x``, ``lengths`` and ``offsets`` (nothing is truncated). A row violates:

    * ``offset``: ``offset < 0``;
    * ``length``: ``length <= 0``;
    * ``overflow``: ``offset + length - 1`` exceeds the max of ``x``'s dtype (its
      structural positions would not fit);
    * ``interval``: a non-negative entry lies outside ``[offset, offset + length)``;
    * ``padding``: a non-negative entry follows a negative (padding) one;
    * ``duplicate``: a non-negative entry occurs twice (exact either way: with
      ``drift_blocks`` a bitmap of ``drift_blocks * block_size`` bits per row, ``O(W)``,
      which bounds every row the drift rule lets through; without, a sort per row);
    * ``drift`` (only when ``drift_blocks`` is given): the row needs more blocks,
      ``ceil(length / block_size)``, than the drift table's ``drift_blocks`` columns.
    """
    valid = x >= 0
    return violations_of_rows(x, valid, valid.sum(dim=1), lengths, offsets, drift_blocks, block_size)


def violations_of_rows(x, valid, n_valid, lengths, offsets, drift_blocks, block_size) -> Dict[str, torch.Tensor]:
    """:func:`row_violations` given ``valid = x >= 0`` and its row sums ``n_valid`` (the core has them)."""
    W = x.shape[1]
    imax = torch.iinfo(x.dtype).max
    sign = torch.iinfo(x.dtype).bits - 1
    L = lengths.to(torch.int64)
    off = torch.zeros_like(L) if offsets is None else offsets.to(torch.int64)
    prefix = torch.arange(W, device=x.device).unsqueeze(0) < n_valid.unsqueeze(1)
    # Every valid entry inside [off, off + L): the row max below the end, the smallest valid
    # entry (padding lifted to the dtype max: (v | v >> sign) is -1 for v < 0) at or past off.
    hi = x.amax(dim=1).to(torch.int64)
    lo = ((x | (x >> sign)) & imax).amin(dim=1).to(torch.int64)
    if drift_blocks is None:
        dup = _duplicates_by_sort(x)
    else:  # rows longer than the drift table are broken anyway: the table bounds the bitmap
        dup = _duplicates_by_bitmap(x, n_valid, off, max(drift_blocks * block_size, 1))
    out = {
        "offset": off < 0,
        "length": L <= 0,
        # Both compared without forming off + L, which overflows int64 for offsets near its
        # max (rows with off < 0 or L <= 0 are broken by the rules above whatever these say).
        "overflow": L - 1 > imax - off,
        # hi < 0: no valid entry (padding may be the dtype min: clamp before subtracting).
        "interval": (hi.clamp(min=-1) - off >= L) | (lo < off),
        "padding": any_per_row(valid ^ prefix),
        "duplicate": dup,
    }
    if drift_blocks is not None:
        out["drift"] = L > drift_blocks * block_size  # ceil(L / bs) > N, without forming L + bs - 1
    return out


def _duplicates_by_sort(x: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool: equal non-negative neighbours in the sorted row (exact, ``O(W log W)``)."""
    srt = torch.sort(x, dim=1).values  # in the row's dtype; padding sorts first
    return any_per_row((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0))


def _duplicates_by_bitmap(x, n_valid, off, bits: int) -> torch.Tensor:
    """``[R]`` bool, ``O(W + bits / 32)``: some position is set twice in a per-row bitmap.

    The bitmap has ``32 * words >= bits`` bits (``words`` a power of two, int32 words).
    Each valid entry adds ``1 << (t & 31)`` to word ``t >> 5`` (``t = entry - offset``,
    wrapped into the bitmap); the row is unique iff no addition carries, i.e. iff the
    bitmap's popcount equals the number of valid entries. Exact for every row whose
    entries lie in ``[offset, offset + bits)``; in any other row some entry is outside its
    interval or the row is longer than the drift table, and the row is broken anyway.
    """
    words = 1 << max(0, (bits - 1).bit_length() - 5)
    sign = torch.iinfo(x.dtype).bits - 1
    # An offset that does not fit the row dtype wraps here; its row breaks the overflow rule.
    t = ((x - off.to(x.dtype).unsqueeze(1)) & (32 * words - 1)).to(torch.int32)
    keep = (~(x >> sign)).to(torch.int32)  # all ones for valid entries, 0 for padding
    bit = (torch.ones_like(t) << (t & 31)) & keep
    table = torch.zeros(x.shape[0], words, dtype=torch.int32, device=x.device)
    table.scatter_add_(1, (t >> 5).to(torch.int64), bit)
    return _popcount32(table).sum(dim=1) != n_valid


def _popcount32(v: torch.Tensor) -> torch.Tensor:
    """Per-element popcount of int32 (SWAR; the masks drop what arithmetic shifts smear in)."""
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return (v * 0x01010101) >> 24
