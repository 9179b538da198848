"""Argument validation for every public entry of the topology KV modules.

One helper per kind of argument, each raising ``TypeError`` (wrong type or dtype) or
``ValueError`` (wrong value, rank, shape or device) with a message that names the
argument and says what was expected and what was given::

    block_size: expected int >= 1, got 0
    lengths: expected dtype in [int32, int64], got torch.float32

These run at public entry points only: some look at tensor values (``check_lengths``)
and so synchronize with the device. Code that must run inside a CUDA graph or under
``torch.compile(fullgraph=True)`` (the ``_unchecked`` functions, the policy core) never
calls them.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


SHOWN_CHARACTERS = 120  # of a value quoted in a message: enough to recognise it, not a 200 KB echo


def shown(value, limit: int = SHOWN_CHARACTERS) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters with the full length said."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"


def check_int(name: str, value, minimum: int, maximum: Optional[int] = None) -> None:
    """``value`` is a plain ``int`` (not ``bool``) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected <= {maximum}, got {value}")


def check_fraction(name: str, value) -> None:
    """``value`` is a finite real number in ``(0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected float, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{name}: expected a value in (0, 1], got {value}")


def check_tensor(
    name: str,
    value,
    *,
    ndims: Optional[Sequence[int]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    shape: Optional[Sequence[int]] = None,
    device: Optional[torch.device] = None,
    device_of: str = "",
) -> None:
    """``value`` is a tensor with the given rank(s), dtype(s), exact shape and device.

    ``device_of`` names the argument whose device is expected (for the message).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in [{_dtype_names(dtypes)}], got {value.dtype}")
    if ndims is not None and value.dim() not in ndims:
        raise ValueError(f"{name}: expected rank in {tuple(ndims)}, got shape {tuple(value.shape)}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(value.shape)}")
    if device is not None and value.device != device:
        where = f" ({device_of}'s)" if device_of else ""
        raise ValueError(f"{name}: expected device {device}{where}, got {value.device}")


def check_lengths(lengths, *, rows: Optional[int] = None, max_length: Optional[int] = None) -> None:
    """int32/int64 ``[rows]`` causal lengths, every one > 0 (and <= ``max_length``). Syncs."""
    check_tensor("lengths", lengths, ndims=(1,), dtypes=INDEX_DTYPES)
    if rows is not None and lengths.shape[0] != rows:
        raise ValueError(f"lengths: expected shape ({rows},), got {tuple(lengths.shape)}")
    if lengths.numel():
        low = int(lengths.min())
        if low <= 0:
            raise ValueError(f"lengths: expected every length > 0, got min {low}")
        if max_length is not None and int(lengths.max()) > max_length:
            raise ValueError(
                f"lengths: expected every length <= {max_length} (the key length), "
                f"got max {int(lengths.max())}"
            )


def check_block_keys(keys, block_size, lengths) -> None:
    """Token-major keys ``[L, H, D]`` or ``[B, L, H, D]`` for the per-block key tables."""
    check_int("block_size", block_size, 1)
    check_tensor("keys", keys, ndims=(3, 4), dtypes=FLOAT_DTYPES)
    if keys.shape[-3] == 0:
        raise ValueError(f"keys: expected L > 0 tokens, got shape {tuple(keys.shape)}")
    if lengths is not None:
        if keys.dim() != 4:
            raise ValueError("lengths: only valid with batched keys [B, L, H, D]")
        check_lengths(lengths, rows=keys.shape[0], max_length=keys.shape[1])


def check_row_to_request(row_to_request: torch.Tensor, rows: int, what: str) -> None:
    """Every entry of ``row_to_request`` indexes one of ``rows`` rows of ``what``. Syncs."""
    bad = (row_to_request < 0) | (row_to_request >= rows)
    if bool(bad.any()):
        row = int(torch.argmax(bad.to(torch.int8)))
        raise ValueError(
            f"row_to_request: row {row} holds {int(row_to_request[row])}, outside [0, {rows}) ({what})"
        )


def select_request_rows(table: torch.Tensor, row_to_request: torch.Tensor, what: str) -> torch.Tensor:
    """``table[row_to_request]`` (``[B, ...] -> [R, ...]``) with an out-of-range entry a
    ``ValueError`` naming ``row_to_request``, the row, its value and ``what`` the table is.

    Reads nothing on the host when every entry is in range. On CPU the failed select is
    caught and the values read for the message; on CUDA an out-of-range entry is a
    device-side assert, which ``coordinate_mismatch_action=raise`` checks first on the host
    (:func:`check_row_to_request`).
    """
    index = row_to_request if row_to_request.dtype == torch.int64 else row_to_request.to(torch.int64)
    try:
        return table.index_select(0, index.to(table.device))
    except (IndexError, RuntimeError):
        check_row_to_request(row_to_request, table.shape[0], what)
        raise


def check_scanning_layers(layers: Sequence[int], sparse: Sequence[int], where: str) -> None:
    """``ValueError`` naming ``where`` unless ``layers`` is a valid scanning set of the sparse
    layers ``sparse`` (ascending): a non-empty, ascending subset without repeats that starts
    with ``sparse[0]`` (a layer below every scanning layer has no rows to reuse)."""
    layers, sparse = tuple(layers), tuple(sparse)
    if not layers:
        raise ValueError(f"{where}: expected at least one scanning layer, got none")
    outside = [x for x in layers if x not in sparse]
    if outside:
        raise ValueError(f"{where}: layers {shown(outside)} are not sparse layers of this model "
                         f"(expected a subset of {shown(list(sparse))})")
    if list(layers) != sorted(set(layers)):
        raise ValueError(f"{where}: expected ascending layers without repeats, got {shown(list(layers))}")
    if layers[0] != sparse[0]:
        raise ValueError(f"{where}: expected the first scanning layer to be the first sparse layer {sparse[0]} "
                         f"(a layer below every scanning layer has no rows to reuse), got {layers[0]}")
