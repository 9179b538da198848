"""The indexer-key write and the drift tracker's update as one C++ call (CPU tensors).

:func:`track_keys_cpu` is :meth:`BlockDriftTracker.update_reference
<rtp_llm.models_py.modules.hybrid.topology_kv.drift.BlockDriftTracker.update_reference>`
(the specification), optionally with the pool write ``pool[slots] = keys.to(pool.dtype)``,
bit for bit: the same sums in the same order, the same fp32 centroids and drift.py's
distance rule (fp64 accumulation in index order). The C++ source is ``cpu_drift.cpp``,
compiled on first use and cached (:class:`~.cpp_extension.CppKernel`).

Every index is checked before the first write (``RuntimeError`` naming the argument), so
a bad request id or slot leaves the pool and the tracker as they were.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpp_extension import CppKernel

# -ffp-contract=off: no FMA contraction anywhere (the distance's products are exact in fp64
# anyway; the centroid divisions and differences must round as torch rounds them).
_KERNEL = CppKernel("topology_kv_drift_cpu", "cpu_drift.cpp", cflags=["-O3", "-ffp-contract=off"], ldflags=[])

_INDEX_DTYPES = (torch.int32, torch.int64)
POOL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Key dtypes the kernel stores through fp32 without a second rounding (others: the torch path).
EXACT_IN_FP32 = (torch.float32, torch.float16, torch.bfloat16)


def can_use_drift_kernel(device: Union[torch.device, str]) -> bool:
    """Whether :func:`track_keys_cpu` can run on ``device`` (CPU and a working build); never raises."""
    return _KERNEL.available(device)


def build_error() -> Optional[str]:
    """Why the extension did not build (after a failed :func:`can_use_drift_kernel`), or None."""
    return _KERNEL.build_error()


def index_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read indices: int32 or int64 as it is, any other dtype as int64."""
    return t if t.dtype in _INDEX_DTYPES else t.to(torch.int64)


def track_keys_cpu(
    keys: torch.Tensor,
    positions: torch.Tensor,
    request_ids: Optional[torch.Tensor],
    sums: torch.Tensor,
    counts: torch.Tensor,
    drift_flat: torch.Tensor,
    *,
    block_size: int,
    cosine: bool,
    pool: Optional[torch.Tensor] = None,
    slots: Optional[torch.Tensor] = None,
) -> None:
    """Store ``keys`` ``[T, K]`` (or ``[T, ..., K]``: read flat, ``K`` values per token) at
    ``pool[slots]`` (when ``pool`` ``[S, K]`` is given) and add
    them to the tracker state ``sums`` ``[B, N + 1, K]`` / ``counts`` ``[B, N + 1]`` /
    ``drift_flat`` ``[B * N + 1]`` (fp32, contiguous, CPU), in place.

    The caller (the tracker) has checked the shapes; ``keys`` may be any float dtype (read
    as fp32, as the tracker reads them; with a pool, one of :data:`EXACT_IN_FP32`), the
    index tensors any integer dtype, and ``pool`` one of :data:`POOL_DTYPES` with unit
    stride along ``K``.
    """
    flat = keys if keys.dtype == torch.float32 and keys.is_contiguous() else keys.to(torch.float32).contiguous()
    _KERNEL.load().track(
        flat, index_tensor(positions), None if request_ids is None else index_tensor(request_ids),
        sums, counts, drift_flat, block_size, cosine, pool, None if slots is None else index_tensor(slots),
    )
