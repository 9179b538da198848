"""Triton kernel for the topology KV candidate policy (one launch, one program per row).

Same semantics as :func:`topology_kv_policy_core` (its docstring is the specification),
for the three enabled modes, with or without ``learned_scores``, drift, offsets, token or
block sinks, the scaled budget and compress mode's scaffold spans, plus the coordinate
contract: a *broken* row is returned unchanged and counted only in
``coordinate_mismatch_fallbacks``. A row is broken if its offset is negative, its length
is ``<= 0``, ``offset + length - 1`` exceeds the row dtype's maximum, a non-negative entry
lies outside ``[offset, offset + length)``, a padding (negative) entry precedes a valid
one, a valid entry appears twice, or (with ``drift``) the row needs more blocks,
``ceil(length / block_size)``, than ``drift`` has columns (the core's ``row_violations``).
Lengths, offsets and scaffold spans are read as int64 whatever their dtype (int32 or int64,
independently of the rows'); the checks run in int64 and never overflow (the interval
check is ``entry - offset >= length``, so a row ending at the dtype's maximum is good).

Shapes and dtypes
-----------------
topk_indices : int32/int64 ``[R, W]`` (any strides); ``out`` the same shape and dtype
lengths, offsets, scaffold_lengths : int32/int64 ``[R]`` (any stride, e.g. expanded)
drift : float ``[R, N]``; learned_scores : float ``[R, W]`` (read as fp32, like the core)
counters : int64 ``[len(COUNTER_NAMES)]`` in :data:`COUNTER_NAMES` order, *accumulated*
mismatch_rows : optional bool ``[R]``, written (True = broken row)

Design
------
One program per row (grid ``(R,)``), one launch per call. Each program loads its row
once into registers, checks the contract (duplicates by a ``tl.sort`` of the row and a
neighbour ``tl.gather``) and works on the ``S`` structural slots of the row in *priority
order* (sink tokens, local tokens newest first, witness blocks in score order with their
tokens newest first, so a block the budget cuts keeps its newest tokens):

* witness blocks: a loop of ``N_WIT`` picks, each a ``tl.max`` over the order-preserving
  int64 key of the fp32 drift score with the block index reversed in the low 32 bits
  (ties to the lower block, NaN as ``-inf``, ``-0.0`` as ``+0.0``: ``score_sort_keys``);
  without drift the most recent eligible blocks, by arithmetic;
* which structural slots the row already holds: every learned entry is mapped to its
  priority slot by arithmetic and counted with ``tl.histogram`` (``num_bins = BLOCK_S``);
* the structural target and the injected tokens: ``tl.cumsum`` ranks; the k-th injected
  token is found by compaction without a scatter: its slot is ``#{p : cum[p] <= k}``, the
  ``tl.cumsum`` of a ``tl.histogram`` of the running count, then ``tl.gather``;
* eviction without scores: the row's last ``n_evict`` non-structural entries (cumsum);
  with scores: ``tl.sort`` of unique int64 keys (fp32 score bits, then the column
  reversed: the later column loses a tie), and a second ``tl.sort`` inverts that
  permutation so every column knows its eviction rank;
* counters: ``tl.atomic_add`` into ``counters`` (8 per row), so a call allocates nothing
  when ``out`` and ``counters`` are given and reads nothing on the host: it can be
  captured in a CUDA graph. ``TOPOLOGY_ONLY``'s learned kept / evicted / injected
  counters are counted in the row program, as the core counts them.

Constexpr parameters: ``BLOCK_W`` (pow2 >= W), ``BLOCK_S`` (pow2 >= S, the structural
slots ``S = S_SINK + (LOCAL_BLOCKS + N_WIT) * BS``), ``BLOCK_N`` (pow2 >= drift's N),
``BS`` (block size, any value >= 1), ``S_SINK``, ``SINK_BLK`` (blocks wholly sink),
``SINK_TOKENS``, ``TOKEN_SINKS``, ``PARTIAL_SINK``, ``LOCAL_BLOCKS``, ``N_WIT``,
``STRUCT_CAP``, ``ONLY``, ``COMPRESS``, ``COMP_START_BLK``, ``HAS_OFF``, ``HAS_DRIFT``, ``HAS_SCORES``,
``SCALE_BUDGET``, ``IDX_MAX`` (row dtype's maximum), ``WRITE_MISMATCH``. ``W`` and
``N`` are runtime values.

Not checked (host metadata only, no values are read): argument shapes, dtypes and devices
are validated; the values of ``drift``, ``learned_scores`` and ``scaffold_lengths`` are
not (a negative scaffold span compresses nothing, as in the core). ``out`` must not
overlap the inputs (not checked). ``counters`` is added to, never zeroed.

Testing: ``rtp_llm/models_py/modules/hybrid/topology_kv/test/triton_fused_test.py`` compares indices and every
counter bit for bit with the torch core, on CPU under ``TRITON_INTERPRET=1`` (which must be
set before this module is imported: ``triton.jit`` reads it at definition time) and on
CUDA (``TOPOLOGY_KV_TEST_DEVICE=cuda``, including a CUDA-graph capture and replay). On
CPU it also compiles the kernel ahead of time for sm_90 (Triton's pipeline and ptxas).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import (  # noqa: F401 (COUNTER_NAMES: the order)
    COUNTER_NAMES,
    PolicyLayout,
    PolicyTensors,
    check_kernel_buffers,
)

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.triton_env import (  # noqa: F401 (can_use_triton: re-exported)
    can_use_triton,
    tl,
    triton,
)


if triton is not None:

    @triton.jit
    def _score_key(s):
        """Order-preserving int64 key of an fp32 score: NaN as -inf, -0.0 as +0.0."""
        s = tl.where(s != s, float("-inf"), s)
        s = tl.where(s == 0.0, 0.0, s)
        bits = s.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)

    @triton.jit
    def _topology_kv_policy_kernel(
        x_ptr, sxr, sxc,
        out_ptr, sor, soc,
        len_ptr, slen,
        off_ptr, soff,
        drift_ptr, sdr, sdc, N,
        score_ptr, ssr, ssc,
        scaf_ptr, sscaf,
        cnt_ptr, mis_ptr,
        W,
        BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
        BS: tl.constexpr, S_SINK: tl.constexpr, SINK_BLK: tl.constexpr, SINK_TOKENS: tl.constexpr,
        TOKEN_SINKS: tl.constexpr, PARTIAL_SINK: tl.constexpr, LOCAL_BLOCKS: tl.constexpr,
        N_WIT: tl.constexpr, STRUCT_CAP: tl.constexpr, ONLY: tl.constexpr, COMPRESS: tl.constexpr,
        COMP_START_BLK: tl.constexpr,
        HAS_OFF: tl.constexpr, HAS_DRIFT: tl.constexpr, HAS_SCORES: tl.constexpr,
        SCALE_BUDGET: tl.constexpr, IDX_MAX: tl.constexpr, WRITE_MISMATCH: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        L_TOK: tl.constexpr = LOCAL_BLOCKS * BS  # local slots
        S: tl.constexpr = S_SINK + (LOCAL_BLOCKS + N_WIT) * BS  # structural slots

        # ---- the row, read once; the contract checks (all in int64) ----
        c = tl.arange(0, BLOCK_W)
        cmask = c < W
        x = tl.load(x_ptr + r * sxr + c * sxc, mask=cmask, other=-1)
        x64 = x.to(tl.int64)
        length = tl.load(len_ptr + r * slen).to(tl.int64)
        if HAS_OFF:
            off = tl.load(off_ptr + r * soff).to(tl.int64)
        else:
            off = tl.zeros([], dtype=tl.int64)
        valid = (x64 >= 0) & cmask
        n_valid = tl.sum(valid.to(tl.int32), axis=0).to(tl.int64)
        off_c = tl.maximum(off, 0)
        bad = (off < 0) | (length <= 0) | (length - 1 > IDX_MAX - off_c)
        outside = valid & ((x64 < off_c) | (x64 - off_c >= length))
        late = valid & (c >= n_valid)  # a valid entry after padding
        srt = tl.sort(tl.where(valid, x64, -1 - c.to(tl.int64)))  # padding keys unique, < 0
        nxt = tl.gather(srt, tl.minimum(c + 1, BLOCK_W - 1), axis=0)
        dup = (srt == nxt) & (c + 1 < BLOCK_W)
        n_bad = tl.sum((outside | late | dup).to(tl.int32), axis=0)
        broken = bad | (n_bad > 0)

        # ---- the row's schedule (scalars); broken rows compute garbage, masked at the end ----
        L = tl.maximum(length, 1)
        nb = (L - 1) // BS + 1  # ceil(L / BS) without overflow (L >= 1)
        if HAS_DRIFT:  # the drift table must cover every block of the row
            broken = broken | (nb > N)
        sink_end = tl.minimum(nb, SINK_BLK)
        local_start = tl.maximum(nb - LOCAL_BLOCKS, sink_end)
        if TOKEN_SINKS:
            sink_tok_end = tl.minimum(L, S_SINK)
        else:
            sink_tok_end = tl.minimum(L, sink_end * BS)
        local_tok_start = local_start * BS
        if COMPRESS:
            scaf = tl.load(scaf_ptr + r * sscaf).to(tl.int64)
            comp_blk_end = tl.maximum(tl.minimum(scaf, L), 0) // BS  # blocks wholly inside
        else:
            comp_blk_end = tl.zeros([], dtype=tl.int64)

        # ---- priority-order slot layout: [sink | local newest first | witness newest first] ----
        p = tl.arange(0, BLOCK_S)
        in_sink = p < S_SINK
        in_local = (p >= S_SINK) & (p < S_SINK + L_TOK)
        in_wit = (p >= S_SINK + L_TOK) & (p < S)
        wq = tl.maximum(p - (S_SINK + L_TOK), 0)
        wj = wq // BS  # witness pick of the slot

        # Learned entries -> priority slot (S = not structural).
        rel = tl.where(valid, x64 - off_c, 0)
        slot = tl.full([BLOCK_W], S, dtype=tl.int64)
        slot = tl.where(rel < sink_tok_end, rel, slot)
        slot = tl.where(rel >= tl.maximum(local_tok_start, sink_tok_end),
                        S_SINK + L_TOK - 1 - (rel - local_tok_start), slot)
        bt = rel // BS
        wblk = tl.full([BLOCK_S], -1, dtype=tl.int64)
        n_comp = tl.zeros([], dtype=tl.int64)
        if HAS_DRIFT:
            nidx = tl.arange(0, BLOCK_N)
            nmask = nidx < N
            d = tl.load(drift_ptr + r * sdr + nidx * sdc, mask=nmask, other=0.0).to(tl.float32)
            dkey = _score_key(d) * 4294967296 + (BLOCK_N - 1 - nidx).to(tl.int64)
            eligible = nmask & (nidx >= sink_end) & (nidx < local_start)
            dkey = tl.where(eligible, dkey, -9223372036854775807)  # below every eligible key
        for j in range(N_WIT):
            if HAS_DRIFT:
                best = tl.max(dkey, axis=0)
                blk = (BLOCK_N - 1) - (best & 0xFFFFFFFF)
                wit_j = tl.where(best > -9223372036854775807, blk, -1)
                dkey = tl.where(nidx == blk, -9223372036854775807, dkey)
            else:
                wit_j = local_start - 1 - j
                wit_j = tl.where(wit_j >= sink_end, wit_j, -1)
            wblk = tl.where(in_wit & (wj == j), wit_j, wblk)
            hit = valid & (bt == wit_j)
            if PARTIAL_SINK:
                hit = hit & (rel >= sink_tok_end)  # the block's sink tokens stay sinks
            slot = tl.where(hit, S_SINK + L_TOK + j * BS + (BS - 1 - rel % BS), slot)  # newest first
            if COMPRESS:
                n_comp += ((wit_j >= COMP_START_BLK) & (wit_j < comp_blk_end)).to(tl.int64)
        if COMPRESS:  # inside compressed blocks only the first token is structural
            inside = (rel >= COMP_START_BLK * BS) & (rel < comp_blk_end * BS) & (rel % BS != 0)
            slot = tl.where(inside, S, slot)
            n_comp += tl.maximum(tl.minimum(nb, comp_blk_end) - tl.maximum(local_start, COMP_START_BLK), 0)
            if not TOKEN_SINKS:
                n_comp += tl.maximum(tl.minimum(sink_end, comp_blk_end), 0)
        slot = tl.where(valid & (slot >= 0) & (slot < S), slot, S)  # in range even in broken rows

        # Structural token of every priority slot (-1 invalid).
        q = tl.maximum(S_SINK + L_TOK - 1 - p, 0)  # local layout slot (ascending tokens)
        lblk = local_start + q // BS
        if TOKEN_SINKS:
            sblk = tl.full([BLOCK_S], -1, dtype=tl.int64)  # the sink segment is not block-based
            stok = p.to(tl.int64)
            sok = in_sink
        else:
            sblk = (p // BS).to(tl.int64)
            stok = p.to(tl.int64)
            sok = in_sink & (sblk < sink_end)
        blk = tl.where(in_sink, sblk, tl.where(in_local, lblk, wblk))
        tok = tl.where(in_sink, stok, tl.where(in_local, lblk * BS + q % BS, wblk * BS + (BS - 1 - wq % BS)))
        seg_ok = sok | (in_local & (lblk < nb)) | (in_wit & (wblk >= 0))
        valid_p = seg_ok & (tok < L)
        if PARTIAL_SINK:
            valid_p = valid_p & (in_sink | (tok >= SINK_TOKENS))
        if COMPRESS:
            comp_blk = (blk >= COMP_START_BLK) & (blk < comp_blk_end)
            if TOKEN_SINKS:
                comp_blk = comp_blk & ~in_sink
            valid_p = valid_p & ~(comp_blk & (tok % BS != 0))
        tok_p = tl.where(valid_p, tok, -1)

        # Which slots the row holds already (rows are unique: counts are 0 or 1).
        held = tl.histogram(slot.to(tl.int32), BLOCK_S, mask=slot < S)
        present_p = (held > 0) & valid_p
        rank_valid = tl.cumsum(valid_p.to(tl.int32), axis=0)

        if ONLY:
            # The first min(W, #slots) structural tokens in priority order.
            take_p = valid_p & (rank_valid <= W)
            n_sel = tl.sum(take_p.to(tl.int32), axis=0).to(tl.int64)
            # Compaction: output column k holds slot #{p : rank_valid[p] <= k}.
            hist = tl.histogram(rank_valid, BLOCK_W, mask=rank_valid < BLOCK_W)
            pos = tl.minimum(tl.cumsum(hist, axis=0), BLOCK_S - 1)
            res = tl.where(c < n_sel, tl.gather(tok_p, pos, axis=0) + off_c, -1)
            n_kept = tl.sum((present_p & take_p).to(tl.int32), axis=0).to(tl.int64)
            n_inj = n_sel - n_kept
            n_evict = n_valid - n_kept
        else:
            cap = tl.zeros([], dtype=tl.int64) + STRUCT_CAP
            if SCALE_BUDGET:
                w64 = tl.zeros([], dtype=tl.int64) + W
                cap = (STRUCT_CAP * w64) // tl.maximum(L, w64)
            new_p = valid_p & ~present_p
            new_rank = tl.cumsum(new_p.to(tl.int32), axis=0)
            take_p = valid_p & (rank_valid <= W) & (new_rank <= cap)
            inject_p = take_p & new_p
            n_inj = tl.sum(inject_p.to(tl.int32), axis=0).to(tl.int64)
            inj_cum = tl.cumsum(inject_p.to(tl.int32), axis=0)
            # Injected token k sits at slot #{p : inj_cum[p] <= k}.
            inj_slot = tl.cumsum(tl.histogram(inj_cum, BLOCK_S, mask=inj_cum < BLOCK_S), axis=0)
            is_struct = tl.gather(take_p.to(tl.int32), tl.minimum(slot, BLOCK_S - 1).to(tl.int32), axis=0)
            is_struct = (is_struct != 0) & (slot < S)
            n_evict = tl.maximum(n_valid + n_inj - W, 0)
            cand = valid & ~is_struct
            if HAS_SCORES:
                sc = tl.load(score_ptr + r * ssr + c * ssc, mask=cmask, other=0.0).to(tl.float32)
                tie = (BLOCK_W - 1 - c).to(tl.int64)  # the later column loses a tie
                key = tl.where(cand, _score_key(sc), 0x7FFFFFFF) * 4294967296 + tie
                by_score = tl.sort(key)  # lowest first: eviction order
                col = (BLOCK_W - 1) - (by_score & 0xFFFFFFFF)  # column of the e-th lowest
                inv = tl.sort(col * 4294967296 + c.to(tl.int64))  # column c at lane c
                hole = inv & 0xFFFFFFFF  # eviction rank of column c
                evict = hole < n_evict
            else:
                crank = tl.cumsum(cand.to(tl.int32), axis=0).to(tl.int64)
                first = tl.sum(cand.to(tl.int32), axis=0).to(tl.int64) - n_evict
                evict = cand & (crank > first)  # the last n_evict candidates
                hole = crank - first - 1
            extra = (c >= n_valid) & (c < n_valid + n_inj - n_evict)  # padding after the row
            k = tl.where(evict, hole, c - n_valid + n_evict)
            k = tl.minimum(tl.maximum(k, 0), BLOCK_S - 1).to(tl.int32)
            s_of_k = tl.minimum(tl.gather(inj_slot, k, axis=0), BLOCK_S - 1)
            fill = tl.gather(tok_p, s_of_k, axis=0) + off_c
            res = tl.where(evict | extra, fill, tl.where(valid, x64, -1))
            n_kept = n_valid - n_evict
            n_sel = n_kept + n_inj

        res = tl.where(broken, x64, res)
        tl.store(out_ptr + r * sor + c * soc, res.to(x.dtype), mask=cmask)
        if WRITE_MISMATCH:
            tl.store(mis_ptr + r, broken)
        good = (~broken).to(tl.int64)
        tl.atomic_add(cnt_ptr + 0, good * n_sel)
        tl.atomic_add(cnt_ptr + 1, good * n_inj)
        tl.atomic_add(cnt_ptr + 2, good * n_kept)
        tl.atomic_add(cnt_ptr + 3, good * n_evict)
        tl.atomic_add(cnt_ptr + 4, good * (L - n_sel))
        tl.atomic_add(cnt_ptr + 5, broken.to(tl.int64))
        tl.atomic_add(cnt_ptr + 6, good * n_comp)
        tl.atomic_add(cnt_ptr + 7, good * n_comp * (BS - 1))


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def topology_kv_policy_triton(
    inputs: PolicyTensors,
    *,
    layout: PolicyLayout,
    out: Optional[torch.Tensor] = None,
    counters: Optional[torch.Tensor] = None,
    mismatch_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`topology_kv_policy_core` as one Triton launch (one program per row).

    ``inputs`` and ``layout`` as in :func:`topology_kv_policy_core`; the buffers and the
    result ``(out, counters)`` as :func:`check_kernel_buffers` documents them (counters are
    added atomically). Nothing is read on the host and, with ``out`` and ``counters``
    given, nothing is allocated: the call can be captured in a CUDA graph.
    """
    out, counters, launch = _launch_spec(inputs, layout=layout, out=out, counters=counters,
                                         mismatch_rows=mismatch_rows)
    if launch is not None:  # None: no rows
        args, constexprs, num_warps = launch
        _topology_kv_policy_kernel[(inputs.topk_indices.shape[0],)](*args, **constexprs, num_warps=num_warps)
    return out, counters


def _launch_spec(inputs, *, layout, out, counters, mismatch_rows):
    """Check the tensors (metadata only), allocate missing buffers, build the kernel's arguments.

    Returns ``(out, counters, launch)``; ``launch`` is ``(args, constexprs, num_warps)`` for
    ``_topology_kv_policy_kernel`` with grid ``(R,)``, or None when ``R == 0``. Also used
    by the tests to compile the kernel for a GPU target ahead of time (no GPU needed).
    """
    if triton is None:
        raise RuntimeError("topology_kv_policy_triton: triton is not installed")
    out, counters = check_kernel_buffers(layout, inputs, out, counters, mismatch_rows)
    x, lengths, offsets, drift, learned_scores, scaffold_lengths = inputs
    R, W = x.shape
    if W == 0:
        raise ValueError(f"topk_indices: expected W > 0 columns, got shape {tuple(x.shape)}")
    if R == 0:
        return out, counters, None

    bs = layout.block_size
    only = layout.only
    compress = layout.compress_mode and scaffold_lengths is not None
    n_wit = layout.witness_count(W)
    S = layout.slot_count(W)
    N = 0 if drift is None else drift.shape[1]
    dummy = lengths  # any tensor on the device, for pointers that are never read
    scores = None if only else learned_scores
    block_w = _pow2(W)
    block_s = _pow2(S)
    args = (
        x, x.stride(0), x.stride(1),
        out, out.stride(0), out.stride(1),
        lengths, lengths.stride(0),
        dummy if offsets is None else offsets, 0 if offsets is None else offsets.stride(0),
        dummy if drift is None else drift, 0 if drift is None else drift.stride(0),
        0 if drift is None else drift.stride(1), N,
        dummy if scores is None else scores, 0 if scores is None else scores.stride(0),
        0 if scores is None else scores.stride(1),
        scaffold_lengths if compress else dummy, scaffold_lengths.stride(0) if compress else 0,
        counters, dummy if mismatch_rows is None else mismatch_rows,
        W,
    )
    constexprs = dict(
        BLOCK_W=block_w, BLOCK_S=block_s, BLOCK_N=_pow2(N),
        BS=bs, S_SINK=layout.sink_slots, SINK_BLK=layout.sink_full_blocks,
        SINK_TOKENS=layout.sink_tokens if layout.token_sinks else 0, TOKEN_SINKS=layout.token_sinks,
        PARTIAL_SINK=layout.partial_sink, LOCAL_BLOCKS=layout.local_blocks,
        N_WIT=n_wit, STRUCT_CAP=layout.structural_cap(W), ONLY=only, COMPRESS=compress,
        COMP_START_BLK=layout.compress_start_block,
        HAS_OFF=offsets is not None, HAS_DRIFT=drift is not None, HAS_SCORES=scores is not None,
        SCALE_BUDGET=layout.scale_budget_by_length, IDX_MAX=torch.iinfo(x.dtype).max,
        WRITE_MISMATCH=mismatch_rows is not None,
    )
    return out, counters, (args, constexprs, 4 if max(block_w, block_s) <= 1024 else 8)
