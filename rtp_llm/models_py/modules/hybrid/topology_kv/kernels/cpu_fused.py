"""The topology KV policy as a fused C++ CPU kernel (one pass per row, rows in parallel).

Same semantics as :func:`topology_kv_policy_core` (its docstring is the specification),
for the three enabled modes, with or without ``learned_scores``, drift, offsets, token or
block sinks, the scaled budget and compress mode's scaffold spans, plus the hardened
coordinate contract: a *broken* row (negative offset, length ``<= 0``, ``offset + length
- 1`` past the row dtype's maximum, a valid entry outside ``[offset, offset + length)``,
padding before a valid entry, a duplicate valid entry, a drift table with fewer columns
than the row's ``ceil(length / block_size)`` blocks) is returned unchanged and counted only
in ``coordinate_mismatch_fallbacks``. Interval arithmetic is int64 whatever the dtypes.

Shapes and dtypes
-----------------
topk_indices : int32/int64 ``[R, W]`` (any strides); ``out`` the same shape and dtype
lengths, offsets, scaffold_lengths : int32/int64 ``[R]`` (any stride, e.g. expanded)
drift : float ``[R, N]``; learned_scores : float ``[R, W]``. Both are read as fp32 after
    ``.to(torch.float32)``, as the core does (fp16/bf16 exactly; fp64 rounded to fp32, so
    distinct fp64 scores may tie)
counters : int64 ``[len(COUNTER_NAMES)]`` in :data:`COUNTER_NAMES` order, *accumulated*
mismatch_rows : optional bool ``[R]``, written (True = broken row)

The kernel (``cpu_fused.cpp``) is compiled on first use and cached on disk
(:class:`~.cpp_extension.CppKernel`). :func:`can_use_cpu_kernel` never raises; a failed
build is remembered and reported when the kernel is called anyway.

Nothing is read on the host: the wrapper only checks metadata (shapes, dtypes, devices).
``out`` may be ``topk_indices`` itself (each row is read before it is written), but must not
otherwise overlap the inputs. ``TOPOLOGY_ONLY``'s learned kept / evicted / structural
injected counters are counted in the row pass, as the core counts them.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpp_extension import CppKernel
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import (  # noqa: F401 (COUNTER_NAMES: the order)
    COUNTER_NAMES,
    PolicyLayout,
    PolicyTensors,
    check_kernel_buffers,
)

_GRAIN_ENTRIES = 32768  # at least this many row entries per thread
# -fopenmp: at::parallel_for is a header template whose `omp parallel` is compiled into the
# extension (without it, rows run serially); libgomp.so.1 resolves to the one torch loaded,
# so torch.set_num_threads applies.
_KERNEL = CppKernel("topology_kv_policy_cpu", "cpu_fused.cpp", cflags=["-O3", "-fopenmp"], ldflags=["-fopenmp"])


def can_use_cpu_kernel(device: Union[torch.device, str]) -> bool:
    """Whether :func:`topology_kv_policy_cpu` can run on ``device`` (CPU, and the build works).

    Builds the extension on the first CPU query (cached); never raises: a failed build
    returns False and its error is kept for :func:`topology_kv_policy_cpu`'s message.
    """
    return _KERNEL.available(device)


def build_error() -> Optional[str]:
    """Why the extension did not build (after a failed :func:`can_use_cpu_kernel`), or None."""
    return _KERNEL.build_error()


def topology_kv_policy_cpu(
    inputs: PolicyTensors,
    *,
    layout: PolicyLayout,
    out: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    mismatch_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`topology_kv_policy_core` as one fused C++ pass per row (CPU tensors only).

    ``inputs`` and ``layout`` as in :func:`topology_kv_policy_core`; the buffers and the
    result ``(out, counters)`` as :func:`check_kernel_buffers` documents them. Rows run in
    parallel (``at::parallel_for``, torch's thread count).
    """
    x = inputs.topk_indices
    if isinstance(x, torch.Tensor) and x.device.type != "cpu":
        raise ValueError(f"topk_indices: expected a CPU tensor, got {x.device}")
    out, counters = check_kernel_buffers(layout, inputs, out, counters, mismatch_rows)
    R, W = x.shape
    if R == 0:
        return out, counters
    _, lengths, offsets, drift, scores, scaffold = inputs
    compress = layout.compress_mode and scaffold is not None
    # Scores are read as fp32, as the core reads them (schedule.witness_blocks_unchecked, score_sort_keys).
    if drift is not None and drift.dtype != torch.float32:
        drift = drift.to(torch.float32)
    scores = None if layout.only else scores
    if scores is not None and scores.dtype != torch.float32:
        scores = scores.to(torch.float32)
    _KERNEL.load().run(
        x, out, lengths, offsets, drift, scores, scaffold if compress else None, counters, mismatch_rows,
        layout.only, compress, layout.sink_blocks, layout.local_blocks, layout.witness_count(W),
        layout.block_size, layout.structural_cap(W), -1 if layout.sink_tokens is None else layout.sink_tokens,
        layout.scale_budget_by_length, max(1, _GRAIN_ENTRIES // max(W, 1)),
    )
    return out, counters


@functools.lru_cache(maxsize=512)
def layer_args(layout: PolicyLayout, width: int) -> tuple:
    """The kernel's constants for rows of width ``width`` (see :func:`run_layer`; cached)."""
    return (
        layout.only, layout.compress_mode, layout.sink_blocks, layout.local_blocks, layout.witness_count(width),
        layout.block_size, layout.structural_cap(width), -1 if layout.sink_tokens is None else layout.sink_tokens,
        layout.scale_budget_by_length, max(1, _GRAIN_ENTRIES // max(width, 1)),
    )


def run_layer(
    topk_indices: torch.Tensor,
    lengths: torch.Tensor,
    offsets: Optional[torch.Tensor],
    drift: Optional[torch.Tensor],
    row_to_request: Optional[torch.Tensor],
    scaffold_lengths: Optional[torch.Tensor],
    args: tuple,
    *,
    learned_scores: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One policy call in one C++ entry: ``(out, counters)`` as :func:`topology_kv_policy_cpu`
    returns them for :func:`~rtp_llm.models_py.modules.hybrid.topology_kv.policy.run_layout`'s
    inputs (``drift`` ``[B, N]`` read through ``row_to_request``, or ``[R, N]`` without it),
    ``args`` from :func:`layer_args` for the rows' width; ``out`` / ``counters`` as
    :func:`check_kernel_buffers` documents them (None: allocated).

    The metadata checks run in C++ (``TypeError`` / ``ValueError`` naming the argument, as
    the Python checks do) and an out-of-range ``row_to_request`` entry is a ``ValueError``
    naming the row and its value before any row runs. ``out`` may be ``topk_indices`` but
    must not otherwise overlap the inputs (not checked here).
    """
    return tuple(_KERNEL.load().run_layer(topk_indices, lengths, offsets, drift, row_to_request, scaffold_lengths,
                                          learned_scores, out, counters, *args))
