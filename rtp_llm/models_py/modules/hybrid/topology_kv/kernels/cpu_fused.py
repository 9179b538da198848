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

Nothing is read on the host: the one C++ entry (:func:`run_layer`; :func:`topology_kv_policy_cpu`
is a call of it) checks metadata only (shapes, dtypes, devices) before any row runs.
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
    check_kernel_buffers,  # noqa: F401 (the buffer contract the C++ checks follow)
)

# Rows per parallel chunk: at least this many row entries per thread, so that a row of
# W >= 1,024 entries (15-40 us over 8k tokens) gets a thread of its own: splitting a
# decode batch's rows over the threads outweighs waking them (docs/results.md, section 2).
_GRAIN_ENTRIES = 1024
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
    parallel (``at::parallel_for``, torch's thread count). The call is :func:`run_layer`
    (drift per row): the metadata checks run in C++, with the same argument names.
    """
    if not isinstance(layout, PolicyLayout):
        raise TypeError(f"layout: expected PolicyLayout, got {type(layout).__name__}")
    x, lengths, offsets, drift, scores, scaffold = inputs
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"topk_indices: expected an int32/int64 tensor [R, W], got {type(x).__name__}")
    return run_layer(x, lengths, offsets, drift, None, scaffold, layer_args(layout, x.shape[1] if x.dim() == 2 else 0),
                     learned_scores=scores, out=out, counters=counters, mismatch_rows=mismatch_rows)


@functools.lru_cache(maxsize=512, typed=True)  # typed: grain_rows=True is an error, not 1
def layer_args(layout: PolicyLayout, width: int, grain_rows: Optional[int] = None) -> tuple:
    """The kernel's constants for rows of width ``width`` (see :func:`run_layer`; cached).

    ``grain_rows``: rows per parallel chunk (a call of ``R <= grain_rows`` rows runs on one
    thread); None: ``max(1, _GRAIN_ENTRIES // width)``, the serving rule.
    """
    if grain_rows is None:
        grain_rows = max(1, _GRAIN_ENTRIES // max(width, 1))
    elif isinstance(grain_rows, bool) or not isinstance(grain_rows, int) or grain_rows < 1:
        raise ValueError(f"grain_rows: expected an int >= 1 or None, got {grain_rows!r}")
    return (
        layout.only, layout.compress_mode, layout.sink_blocks, layout.local_blocks, layout.witness_count(width),
        layout.block_size, layout.structural_cap(width), -1 if layout.sink_tokens is None else layout.sink_tokens,
        layout.scale_budget_by_length, grain_rows,
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
    mismatch_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One policy call in the kernel's one C++ entry: ``(out, counters)`` for
    :func:`~rtp_llm.models_py.modules.hybrid.topology_kv.policy.run_layout`'s inputs
    (``drift`` ``[B, N]`` read through ``row_to_request``, or ``[R, N]`` without it),
    ``args`` from :func:`layer_args` for the rows' width; ``out`` / ``counters`` /
    ``mismatch_rows`` as :func:`check_kernel_buffers` documents them (None: allocated / not written).

    The metadata checks run in C++ (``TypeError`` / ``ValueError`` naming the argument, as
    the Python checks do) and an out-of-range ``row_to_request`` entry is a ``ValueError``
    naming the row and its value before any row runs. ``out`` may be ``topk_indices`` but
    must not otherwise overlap the inputs (not checked here).
    """
    return tuple(compiled_entry()(topk_indices, lengths, offsets, drift, row_to_request, scaffold_lengths,
                                  learned_scores, out, counters, mismatch_rows, *args))


def compiled_entry():
    """The compiled ``run_layer`` itself (builds the extension on first use): positional
    ``(topk_indices, lengths, offsets, drift, row_to_request, scaffold_lengths, learned_scores,
    out, counters, mismatch_rows, *layer_args(...))``, returns ``[out, counters]``. For a
    caller that fixes ``args`` once and calls per step (a layer object)."""
    return _KERNEL.load().run_layer
