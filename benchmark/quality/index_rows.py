"""Index rows in the engine's top-k convention: build them, check them, turn them into masks.

The convention (the engine's top-k output, as ``rtp_llm.models_py.modules.hybrid.
indexer_torch_ops.topk_from_window_scores`` produces it), for a row with causal length
``len`` (tokens ``0 .. len-1`` visible) and width ``W``:

* ``len <= W``: ``0, 1, .., len-1`` ascending, then ``-1`` (the row stays dense; the
  policy's output contract, docs/architecture.md "The policy's contract", only asks that
  such a row keeps every token, so it allows any order of that prefix);
* ``len > W``:  ``W`` unique positions in ``[0, len)``, in no particular order.

Here offsets are always 0 (one request per forward). Index dtype is int32, as the
engine's; selectors may return int64 and the hook accepts both.
"""

from __future__ import annotations

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.row_contract import VIOLATIONS, row_violations
from rtp_llm.models_py.modules.hybrid.topology_kv.schedule import score_sort_keys


def causal_lengths(num_queries: int, key_length: int, device=None) -> torch.Tensor:
    """int64 ``[T]``: query ``t`` of the last ``T`` positions sees ``L - T + t + 1`` keys."""
    return torch.arange(key_length - num_queries + 1, key_length + 1, dtype=torch.int64, device=device)


def dense_rows(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """int32 ``[T, W]``: ``0 .. min(len, W)-1`` then ``-1`` (the short-row form)."""
    ar = torch.arange(width, dtype=torch.int64, device=lengths.device).unsqueeze(0)  # [1, W]
    return torch.where(ar < lengths.unsqueeze(1), ar, -1).to(torch.int32)


def rows_from_scores(scores: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Top-``W`` causal positions of each row of ``scores``, in the engine's convention.

    Parameters
    ----------
    scores : float ``[T, Lc]``; column ``s`` scores key ``s``. Columns at or past a
        row's length are ignored. Values must be finite inside the causal range
        (``-inf`` there could let topk pick a masked column; not checked).
    lengths : int64 ``[T]``, ``1 <= len <= Lc``
    width : W >= 1

    Returns
    -------
    int32 ``[T, W]``: short rows (``len <= W``) dense; long rows the ``W`` highest
    scores in descending order, ties to the lower position: the engine's tie rule
    (``indexer_torch_ops.topk_from_window_scores``), which decides most of an untrained
    relu proxy's row (its relu zeroes every key no head likes).
    """
    T, Lc = scores.shape
    out = dense_rows(lengths, width)
    if width >= Lc:
        return out  # every row is short
    col = torch.arange(Lc, device=scores.device).unsqueeze(0)  # [1, Lc]
    masked = scores.masked_fill(col >= lengths.unsqueeze(1), float("-inf"))
    top = engine_topk(masked, width).to(torch.int32)  # [T, W]
    return torch.where((lengths > width).unsqueeze(1), top, out)


def engine_topk(scores: torch.Tensor, width: int) -> torch.Tensor:
    """int64 ``[T, W]`` column indices of the ``W`` highest of ``scores [T, Lc]``, descending,
    ties to the lower column (the engine's rule: unique keys of the score's bits, then the
    column reversed; ``-inf`` and NaN rank last)."""
    Lc = scores.shape[-1]
    reverse = Lc - 1 - torch.arange(Lc, device=scores.device)  # [Lc]: a lower column wins a tie
    keys = score_sort_keys(scores, reverse.unsqueeze(0).expand_as(scores))
    return torch.topk(keys, width, dim=-1).indices


def rows_to_mask(rows: torch.Tensor, key_length: int) -> torch.Tensor:
    """bool ``[T, L]``: ``True`` at each row's valid (non-negative) positions."""
    T = rows.shape[0]
    target = torch.where(rows >= 0, rows.to(torch.int64), key_length)  # -1 -> a dump column
    mask = torch.zeros(T, key_length + 1, dtype=torch.bool, device=rows.device)
    mask.scatter_(1, target, True)
    return mask[:, :key_length]


def check_engine_rows(
    rows: torch.Tensor, lengths: torch.Tensor, width: int, name: str = "rows", ascending_short_rows: bool = True
) -> None:
    """Raise ``ValueError`` naming the first row that breaks the convention.

    Checks shape ``[T, W]``, integer dtype, then per row the policy's contract rules
    (:func:`~rtp_llm.models_py.modules.hybrid.topology_kv.row_contract.row_violations`:
    entries inside ``[0, len)``, valid entries before the padding, no entry twice) and
    what the engine's convention adds to them: padding is exactly ``-1`` and a row holds
    ``min(len, W)`` valid entries, so a long row has ``W`` unique causal positions and a
    short row exactly ``0..len-1``, ascending unless ``ascending_short_rows=False`` (any
    order of that prefix: the policy's output contract, docs/architecture.md, which
    attention treats identically). Reads values (host sync): tests and harness only.
    """
    T = lengths.shape[0]
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected int32/int64, got {rows.dtype}")
    if tuple(rows.shape) != (T, width):
        raise ValueError(f"{name}: expected shape ({T}, {width}), got {tuple(rows.shape)}")
    if T == 0:
        return
    r = rows  # int32 stays int32: no [T, W] int64 copy (comparisons promote per element)
    lengths = lengths.to(torch.int64)
    short = lengths <= width
    # The contract's rules; a drift table as long as the longest row makes the duplicate
    # rule the O(W) bitmap (exact for every row inside its interval) and its own rule moot.
    flags = row_violations(r, lengths, None, drift_blocks=int(lengths.max()), block_size=1)
    valid = r >= 0
    ok = ~torch.stack([flags[v] for v in VIOLATIONS if v in flags]).any(dim=0)  # [T]
    ok &= (valid | (r == -1)).all(dim=1) & (valid.sum(dim=1) == torch.clamp(lengths, max=width))
    if ascending_short_rows:
        ok &= ~short | (r == dense_rows(lengths, width)).all(dim=1)
    bad = ~ok
    if bool(bad.any()):
        t = int(torch.argmax(bad.to(torch.int8)))
        if bool(short[t]):
            kind = "short rows must be 0..len-1" + (" ascending" if ascending_short_rows else "") + " then -1"
        else:
            kind = "long rows need W unique causal positions"
        raise ValueError(f"{name}: row {t} (length {int(lengths[t])}, W {width}) breaks the convention ({kind}): "
                         f"{r[t, :16].tolist()}{' ...' if width > 16 else ''}")
