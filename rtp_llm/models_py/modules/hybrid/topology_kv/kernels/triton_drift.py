"""The indexer-key write and the drift tracker's update as two Triton launches (GPU tensors).

:func:`track_keys_triton` is :meth:`BlockDriftTracker.update_reference
<rtp_llm.models_py.modules.hybrid.topology_kv.drift.BlockDriftTracker.update_reference>`
(the specification), optionally with the pool write ``pool[slots] = keys.to(pool.dtype)``,
and the GPU twin of :func:`~.cpu_drift.track_keys_cpu`. Nothing is read on the host and
nothing is allocated, so a decode step's call can be captured in a CUDA graph.

Design
------
1. ``_store_and_add_kernel``, one program per new key (grid ``(T,)``): the key's row is
   loaded once, stored at its pool slot (converted to the pool's dtype, rounding to
   nearest even as ``Tensor.to`` does; bf16 by integer ops, ``_bf16_rtne``) and added
   to its block's running sum and count with atomics (column ``N``, the dump, for a
   position ``< 0`` or past capacity).
2. ``_drift_kernel``, one program per (new key, block offset 0 or 1) (grid ``(T, 2)``),
   launched after the first so it reads the final sums: the drift of the key's block and
   of the next one (``1 <= block < N``) once that block and its predecessor hold
   ``block_size`` keys, else 0. The distance is drift.py's rule: fp32 centroids
   (``sum / count``, IEEE division), their differences (cosine: the values) squared and
   accumulated in fp64 in index order (a sequential loop over ``K``; products of fp32
   values are exact in fp64), ``sqrt`` and division in fp64 with IEEE rounding, one
   rounding to fp32. Both kernels are launched with ``enable_fp_fusion=False`` (no FMA
   contraction), so every operation rounds as the CPU kernel's does.

Bit for bit: when no (request, block) receives two keys in one call (a decode step: one
new key per request), the result equals :meth:`update_reference` on CPU bit for bit.
When a block receives several keys in one call (a prefill chunk), their fp32 additions run
in the atomics' order, as ``index_add_`` on CUDA runs them: equal to the CPU reference
whenever those sums are exact (the tests use keys on a dyadic grid), else within fp32
rounding of it.

Out-of-range indices: a sync-free kernel cannot raise, so a key whose request id is
outside ``[0, B)`` or whose slot is outside ``[-S, S)`` is skipped entirely (no pool row,
no sum, no drift); the CPU kernel raises for the same input. The caller (the indexer)
computes both, so neither happens in serving.

Testing: ``topology_kv/test/drift_kernel_test.py`` runs both kernels on CPU tensors under
``TRITON_INTERPRET=1`` against the reference (hypothesis over shapes, block sizes, pool and
index dtypes, multi-key steps), compiles them ahead of time for sm_90 and checks the
generated PTX for IEEE division and square root and the absence of fused multiply-adds;
``TOPOLOGY_KV_TEST_DEVICE=cuda`` runs the same checks on a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpu_drift import (  # noqa: F401 (the same contract)
    EXACT_IN_FP32,
    POOL_DTYPES,
    index_tensor,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.triton_env import (  # noqa: F401 (can_use_triton: re-exported)
    can_use_triton,
    tl,
    triton,
)

# Options of both launches: no FMA contraction, so every float operation rounds on its own.
COMPILE_OPTIONS = dict(enable_fp_fusion=False)


if triton is not None:

    @triton.jit
    def _bf16_rtne(x):
        """fp32 -> bf16 rounding to nearest even, NaN -> 0x7FC0: torch's conversion, in
        integer ops (the same bits compiled and under the interpreter, whose own bf16 cast
        truncates)."""
        bits = x.to(tl.int32, bitcast=True)
        up = ((bits >> 16) & 1) + 0x7FFF
        rounded = ((bits + up) >> 16) & 0xFFFF  # + wraps like uint32; the shift keeps 16 bits
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _store_and_add_kernel(
        keys_ptr, sk,
        pos_ptr, spos,
        req_ptr, sreq,
        slot_ptr, sslot,
        pool_ptr, spool,
        sums_ptr, counts_ptr,
        K, B, N, S,
        BS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_REQ: tl.constexpr, HAS_POOL: tl.constexpr,
        POOL_BF16: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        kmask = cols < K
        pos = tl.load(pos_ptr + t * spos).to(tl.int64)
        req = tl.load(req_ptr + t * sreq).to(tl.int64) if HAS_REQ else tl.zeros((), tl.int64)
        good = (req >= 0) & (req < B)
        if HAS_POOL:
            slot = tl.load(slot_ptr + t * sslot).to(tl.int64)
            slot = tl.where(slot < 0, slot + S, slot)  # as tensor indexing reads a negative index
            good = good & (slot >= 0) & (slot < S)
        if good:
            key = tl.load(keys_ptr + t * sk + cols, mask=kmask, other=0.0).to(tl.float32)  # exact
            if HAS_POOL:
                if POOL_BF16:
                    row = _bf16_rtne(key)
                else:  # fp16: the conversion rounds to nearest even; fp32 / fp64: exact
                    row = key.to(pool_ptr.dtype.element_ty)
                tl.store(pool_ptr + slot * spool + cols, row, mask=kmask)
            blk = tl.where(pos >= 0, pos // BS, N)  # pos >= 0 here, so // is the floor
            blk = tl.where(blk < N, blk, N)
            lin = req * (N + 1) + blk
            tl.atomic_add(sums_ptr + lin * K + cols, key, mask=kmask, sem="relaxed")
            tl.atomic_add(counts_ptr + lin, 1.0, sem="relaxed")

    @triton.jit
    def _drift_kernel(
        pos_ptr, spos,
        req_ptr, sreq,
        slot_ptr, sslot,
        sums_ptr, counts_ptr, drift_ptr,
        K, B, N, S,
        BS: tl.constexpr, HAS_REQ: tl.constexpr, HAS_POOL: tl.constexpr, COSINE: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        pos = tl.load(pos_ptr + t * spos).to(tl.int64)
        req = tl.load(req_ptr + t * sreq).to(tl.int64) if HAS_REQ else tl.zeros((), tl.int64)
        good = (req >= 0) & (req < B)
        if HAS_POOL:  # the same skip rule as the first kernel
            slot = tl.load(slot_ptr + t * sslot).to(tl.int64)
            slot = tl.where(slot < 0, slot + S, slot)
            good = good & (slot >= 0) & (slot < S)
        blk = tl.where(pos >= 0, pos // BS, N)
        blk = tl.where(blk < N, blk, N)
        target = blk + j
        if good & (target >= 1) & (target < N):
            cur = req * (N + 1) + target
            prev = cur - 1
            n_prev = tl.load(counts_ptr + prev)
            n_cur = tl.load(counts_ptr + cur)
            value = tl.zeros((), tl.float32)
            if (n_prev == BS) & (n_cur == BS):
                a2 = tl.zeros((), tl.float64)
                b2 = tl.zeros((), tl.float64)
                ab = tl.zeros((), tl.float64)
                for k in range(0, K):  # index order: drift.py's rule
                    p = tl.math.fdiv(tl.load(sums_ptr + prev * K + k), n_prev, ieee_rounding=True)
                    c = tl.math.fdiv(tl.load(sums_ptr + cur * K + k), n_cur, ieee_rounding=True)
                    if COSINE:
                        c64 = c.to(tl.float64)
                        p64 = p.to(tl.float64)
                        a2 += c64 * c64
                        b2 += p64 * p64
                        ab += c64 * p64
                    else:
                        d = (c - p).to(tl.float64)
                        a2 += d * d
                if COSINE:
                    prod = a2 * b2
                    denom = tl.sqrt(tl.where(prod > 1e-24, prod, 1e-24))  # fmax (NaN -> eps); fp64 sqrt is IEEE
                    value = (1.0 - ab / denom).to(tl.float32)  # fp64 division is IEEE (div.rn.f64)
                else:
                    value = tl.sqrt(a2).to(tl.float32)
            tl.store(drift_ptr + req * N + target, value)


def track_keys_triton(
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
    """Store ``keys`` ``[T, K]`` at ``pool[slots]`` (when ``pool`` ``[S, K]`` is given) and add
    them to the tracker state ``sums`` ``[B, N + 1, K]`` / ``counts`` ``[B, N + 1]`` /
    ``drift_flat`` ``[B * N + 1]`` (fp32, contiguous), in place, in two launches.

    The caller (the tracker) has checked the shapes and that every tensor is on one device
    where :func:`can_use_triton` holds; ``keys`` are one of :data:`EXACT_IN_FP32`
    with unit stride along ``K``, the index tensors int32 or int64 (others are converted),
    ``pool`` one of :data:`POOL_DTYPES` with unit stride along ``K``.
    """
    if triton is None:
        raise RuntimeError("track_keys_triton: triton is not installed")
    T, K = keys.shape
    if T == 0:
        return
    B, N = sums.shape[0], sums.shape[1] - 1
    positions = index_tensor(positions)
    req = positions if request_ids is None else index_tensor(request_ids)  # never read without HAS_REQ
    has_pool = pool is not None
    slot = index_tensor(slots) if has_pool else positions
    pool_arg = pool if has_pool else sums
    common = dict(BS=block_size, HAS_REQ=request_ids is not None, HAS_POOL=has_pool)
    sizes = (K, B, N, pool.shape[0] if has_pool else 1)
    _store_and_add_kernel[(T,)](
        keys, keys.stride(0), positions, positions.stride(0), req, req.stride(0), slot, slot.stride(0),
        pool_arg, pool_arg.stride(0), sums, counts, *sizes,
        BLOCK_K=max(16, triton.next_power_of_2(K)), POOL_BF16=has_pool and pool.dtype == torch.bfloat16, **common,
        **COMPILE_OPTIONS,
    )
    _drift_kernel[(T, 2)](
        positions, positions.stride(0), req, req.stride(0), slot, slot.stride(0),
        sums, counts, drift_flat, *sizes, COSINE=cosine, **common, **COMPILE_OPTIONS, num_warps=1,
    )
