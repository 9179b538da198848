"""The Triton policy kernel equals the torch core bit for bit (indices and every counter).

CPU by default: the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1`` is set
here, before triton is imported). ``TOPOLOGY_KV_TEST_DEVICE=cuda`` runs the same checks
compiled on a GPU (``//benchmark:topology_kv_policy_triton_cuda_manual``), plus a CUDA
graph capture and replay.

Broken rows (the coordinate contract): the kernel implements the hardened rules (negative
offset, length <= 0, ``offset + length - 1`` past the row dtype's maximum, an entry outside
``[offset, offset + length)``, padding before a valid entry, a duplicate valid entry, a
drift table with fewer columns than the row has blocks). A
core that does not flag all of these yet is compared on the good rows only, and the broken
rows must come back unchanged; once the core flags them (probed below), the full direct
comparison is asserted as well.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("TOPOLOGY_KV_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("TOPOLOGY_KV_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton (and the kernel module) is imported

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rtp_llm.models_py.modules.hybrid.topology_kv_policy import (  # noqa: E402
    COUNTER_NAMES,
    TopologyKVPolicyMode,
    topology_kv_policy_core,
    topology_only_learned_kept,
)
from rtp_llm.models_py.modules.hybrid.topology_kv_policy_triton import (  # noqa: E402
    can_use_triton,
    topology_kv_policy_triton,
)

MERGE = TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE
COMPRESS = TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE
ONLY = TopologyKVPolicyMode.TOPOLOGY_ONLY
ENABLED_MODES = [MERGE, COMPRESS, ONLY]
FALLBACK = COUNTER_NAMES.index("coordinate_mismatch_fallbacks")


def _t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


# ---------------------------------------------------------------- expected values


def broken_rows(x: torch.Tensor, lengths: torch.Tensor, offsets, drift=None, block_size=1) -> torch.Tensor:
    """``[R]`` bool: the hardened contract's broken rows, by loops (Python ints: no overflow)."""
    imax = torch.iinfo(x.dtype).max
    out = []
    for r, row in enumerate(x.cpu().tolist()):
        length = int(lengths[r])
        off = 0 if offsets is None else int(offsets[r])
        n_valid = sum(1 for v in row if v >= 0)
        valid = [v for v in row if v >= 0]
        out.append(
            off < 0
            or length <= 0
            or off + length - 1 > imax
            or any(not (off <= v < off + length) for v in valid)
            or any(v >= 0 for v in row[n_valid:])
            or len(set(valid)) != len(valid)
            or (drift is not None and -(-length // block_size) > drift.shape[1])  # drift too short
        )
    return torch.tensor(out, dtype=torch.bool)


def core_safe(x, lengths, offsets, drift=None, block_size=1) -> bool:
    """Every row good, and ``offset + length`` representable in the core's arithmetic.

    An unhardened core computes ``offset + length`` in the row dtype; the hardened one in
    int64, where ``offset + length = 2**63`` (a good int64 row ending at the dtype's max)
    still wraps. Such rows are compared with the core on relative positions instead (see
    :func:`expected`): the spec's answer, not that arithmetic's.
    """
    if broken_rows(x, lengths, offsets, drift, block_size).any():
        return False
    imax = torch.iinfo(torch.int64 if CORE_HARDENED else x.dtype).max
    offs = [0] * x.shape[0] if offsets is None else offsets.cpu().tolist()
    return all(o + n <= imax for o, n in zip(offs, lengths.cpu().tolist()))


def core_with_lazy(x, lengths, offsets, drift, scores, scaffold, **kw):
    """The torch core plus ``apply_topology_kv_policy``'s lazy TOPOLOGY_ONLY counters."""
    out, counters = topology_kv_policy_core(x, lengths, offsets, drift, scores, scaffold, **kw)
    mismatch = counters["mismatch_rows"]
    if kw["mode"] is ONLY:
        kept = topology_only_learned_kept(x, out, mismatch)
        learned = torch.where(mismatch, 0, (x >= 0).sum(dim=1))
        counters["learned_kept_tokens"] = kept.sum()
        counters["learned_evicted_tokens"] = (learned - kept).sum()
        counters["structural_injected_tokens"] = counters["selected_tokens"] - kept.sum()
    return out, [int(counters[name]) for name in COUNTER_NAMES], mismatch.cpu()


def _probe_core_hardened() -> bool:
    """Whether the tree's core flags every hardened broken-row kind (else: good rows only)."""
    kw = dict(mode=MERGE, sink_blocks=1, local_blocks=1, witness_blocks=0, block_size=4, structural_cap=2)
    cases = [
        (_t([[2, 1, 2, -1]]), _t([5]), None),  # duplicate
        (_t([[1, -1, -1, -1]]), _t([0]), None),  # length 0
        (_t([[1, -1, -1, -1]]), _t([5]), _t([-1])),  # negative offset
        (_t([[0, 2, -1, -1]], torch.int32), _t([5]), _t([2**31 - 2])),  # past int32
    ]
    try:
        return all(bool(topology_kv_policy_core(x, L, o, None, None, None, **kw)[1]["mismatch_rows"][0])
                   for x, L, o in cases)
    except Exception:  # an unhardened core may fail on such input: it is not hardened
        return False


CORE_HARDENED = _probe_core_hardened()


def _rows(t, keep):
    return None if t is None else t[keep]


def expected(x, lengths, offsets, drift, scores, scaffold, **kw):
    """(indices [R, W] cpu, counters list, broken [R] cpu) per the hardened contract.

    The core runs on the good rows only (so it never sees a broken row); broken rows are
    the input, counted only in ``coordinate_mismatch_fallbacks``.
    """
    broken = broken_rows(x, lengths, offsets, drift, kw["block_size"])
    want = x.cpu().clone()
    counters = [0] * len(COUNTER_NAMES)
    keep = (~broken).nonzero().flatten().to(x.device)
    if keep.numel():
        sx, sL, soff, *rest = [_rows(t, keep) for t in (x, lengths, offsets, drift, scores, scaffold)]
        if core_safe(sx, sL, soff):
            out, sub_counters, sub_mismatch = core_with_lazy(sx, sL, soff, *rest, **kw)
        else:
            # Good rows at the dtype's limit, where the core's own arithmetic (offset +
            # length) overflows: the policy works on relative positions, so run the core
            # on them (int64, offset 0) and add the offset back.
            off64 = torch.zeros_like(sL, dtype=torch.int64) if soff is None else soff.to(torch.int64)
            rel = torch.where(sx >= 0, sx.to(torch.int64) - off64.unsqueeze(1), -1)
            out, sub_counters, sub_mismatch = core_with_lazy(rel, sL, None, *rest, **kw)
            out = torch.where(out >= 0, out + off64.unsqueeze(1), out).to(x.dtype)
        assert not sub_mismatch.any(), "the core flags a row the hardened contract accepts"
        want[keep.cpu()] = out.cpu()
        counters = sub_counters
    counters[FALLBACK] = int(broken.sum())
    return want, counters, broken


def run_triton(x, lengths, offsets, drift, scores, scaffold, **kw):
    mismatch = torch.zeros(x.shape[0], dtype=torch.bool, device=DEVICE)
    out, counters = topology_kv_policy_triton(x, lengths, offsets, drift, scores, scaffold,
                                              mismatch_rows=mismatch, **kw)
    return out, counters, mismatch


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN payloads and -0.0 included)."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_equal(x, lengths, offsets=None, drift=None, scores=None, scaffold=None, **kw):
    """Assert the kernel equals the core bit for bit; returns the kernel's output (cpu)."""
    inputs = [t if t is None else t.clone() for t in (x, lengths, offsets, drift, scores, scaffold)]
    out, counters, mismatch = run_triton(x, lengths, offsets, drift, scores, scaffold, **kw)
    for before, after in zip(inputs, (x, lengths, offsets, drift, scores, scaffold)):  # never mutated
        assert before is None or _same_bits(before, after)
    want, want_counters, broken = expected(x, lengths, offsets, drift, scores, scaffold, **kw)
    got = out.cpu()
    assert got.dtype == x.dtype and got.shape == x.shape and out.device == x.device
    assert torch.equal(got, want), f"triton != core\n{got}\n{want}\nbroken {broken}"
    assert counters.cpu().tolist() == want_counters, dict(zip(COUNTER_NAMES, zip(counters.tolist(), want_counters)))
    assert torch.equal(mismatch.cpu(), broken)
    # The direct comparison on every row: always once the core is hardened, except rows where
    # its int64 offset + length wraps; before that, when no row is broken or at the limit.
    if core_safe(x, lengths, offsets, drift, kw["block_size"]) or (CORE_HARDENED and core_safe(
            *[t[~broken.to(t.device)] if t is not None else None for t in (x, lengths, offsets)])):
        core_out, core_counters, core_mismatch = core_with_lazy(x, lengths, offsets, drift, scores, scaffold, **kw)
        assert torch.equal(got, core_out.cpu())
        assert counters.cpu().tolist() == core_counters
        assert torch.equal(mismatch.cpu(), core_mismatch)
    return got


def _kw(mode, W, *, sink_blocks=1, local_blocks=1, witness_blocks=1, block_size=4, frac=0.5, sink_tokens=None,
        scaled=False):
    """Core keywords as ``apply_topology_kv_policy`` derives them from a config."""
    return dict(mode=mode, sink_blocks=sink_blocks, local_blocks=local_blocks, witness_blocks=witness_blocks,
                block_size=block_size, structural_cap=int(math.floor(W * frac)), sink_tokens=sink_tokens,
                scale_budget_by_length=scaled)


# ---------------------------------------------------------------- hand-computed cases
# Inputs of benchmark/test_topology_kv_policy.py (whole sink blocks unless stated); the
# expected rows there are asserted here too, so both implementations meet the hand values.


def test_can_use_triton():
    assert can_use_triton(DEVICE)
    assert not can_use_triton(torch.device("meta"))


def test_sparse_merge_tail_eviction():
    got = check_equal(_t([[0, 10, 37, 11, 20, 21, 22, 23]]), _t([40]), **_kw(MERGE, 8))
    assert got.tolist() == [[0, 10, 37, 11, 1, 2, 3, 39]]


def test_sparse_merge_evicts_lowest_scores_ties_to_later_entry():
    scores = torch.tensor([[5.0, 1.0, 9.0, 1.0, 7.0, 0.5, 8.0, 6.0]], device=DEVICE)
    got = check_equal(_t([[10, 11, 12, 13, 14, 15, 16, 17]]), _t([40]), scores=scores,
                      **_kw(MERGE, 8, local_blocks=0, witness_blocks=0, frac=0.25))
    assert got.tolist() == [[10, 11, 12, 1, 14, 0, 16, 17]]


def test_sparse_merge_witness_by_drift_and_offsets():
    drift = torch.zeros(1, 10, device=DEVICE)
    drift[0, 5] = 3.0
    got = check_equal(_t([[101, 102, 103, 104, -1, -1, -1, -1]]), _t([40]), offsets=_t([100]), drift=drift,
                      **_kw(MERGE, 8, sink_blocks=0, local_blocks=0, witness_blocks=1, frac=1.0))
    assert got.tolist() == [[101, 102, 103, 104, 120, 121, 122, 123]]


def test_topology_only_fills_min_w_length_in_priority_order():
    drift = torch.zeros(2, 10, device=DEVICE)
    drift[:, 4] = 2.0
    drift[:, 2] = 1.0
    x = _t([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 1, 2, 3, 4, 5, 6, -1, -1, -1]])
    got = check_equal(x, _t([40, 7]), drift=drift, **_kw(ONLY, 10, local_blocks=1, witness_blocks=0))
    assert got.tolist() == [[0, 1, 2, 3, 39, 38, 37, 36, 16, 17], [0, 1, 2, 3, 6, 5, 4, -1, -1, -1]]
    _, counters, _ = run_triton(x, _t([40, 7]), None, drift, None, None,
                                **_kw(ONLY, 10, local_blocks=1, witness_blocks=0))
    c = dict(zip(COUNTER_NAMES, counters.tolist()))
    assert c["selected_tokens"] == 17 and c["learned_kept_tokens"] == 7
    assert c["structural_injected_tokens"] == 10 and c["learned_evicted_tokens"] == 10


def test_token_sinks():
    kw = _kw(MERGE, 8, sink_tokens=2)
    assert check_equal(_t([[10, 11, 12, 13, 14, 15, 16, 17]]), _t([40]), **kw).tolist() == [
        [10, 11, 12, 13, 0, 1, 39, 38]]
    assert check_equal(_t([[5, -1, -1, -1, -1, -1, -1, -1]]), _t([6]), **kw).tolist() == [
        [5, 0, 1, 4, 2, -1, -1, -1]]


def test_present_local_tokens_never_keep_out_missing_sinks():
    kw = _kw(MERGE, 8, sink_tokens=2, local_blocks=3, witness_blocks=0)
    x = _t([[6, 7, 8, 9, 10, 11, 12, 13]])
    assert check_equal(x, _t([14]), **kw).tolist() == [[0, 1, 8, 9, 10, 11, 12, 13]]
    scores = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]], device=DEVICE)
    assert sorted(check_equal(x, _t([14]), scores=scores, **kw).tolist()[0]) == [0, 1, 8, 9, 10, 11, 12, 13]


def test_scaled_budget():
    got = check_equal(_t([[8, 9, 10, 11, 4, 5, 6, 7]]), _t([16]), **_kw(MERGE, 8, scaled=True))
    assert got.tolist() == [[8, 9, 10, 11, 4, 5, 0, 1]]


def test_compress_sparse():
    kw = _kw(COMPRESS, 8, sink_blocks=2, local_blocks=1, witness_blocks=0, frac=1.0)
    x = _t([[20, 21, 22, 23, 24, 25, -1, -1]])
    assert check_equal(x, _t([40]), scaffold=_t([10]), **kw).tolist() == [[20, 21, 0, 4, 39, 38, 37, 36]]
    _, counters, _ = run_triton(x, _t([40]), None, None, None, _t([10]), **kw)
    c = dict(zip(COUNTER_NAMES, counters.tolist()))
    assert c["compressed_blocks"] == 2 and c["compression_saved_tokens"] == 6
    assert c["structural_injected_tokens"] == 6 and c["learned_evicted_tokens"] == 4


@pytest.mark.parametrize("mode", ENABLED_MODES)
@pytest.mark.parametrize("length", [1, 3, 4, 5, 8])
def test_rows_up_to_width_keep_every_token(mode, length):
    x = _t([list(range(length)) + [-1] * (8 - length)])
    got = check_equal(x, _t([length]), scaffold=_t([6]), **_kw(mode, 8))
    assert sorted(v for v in got[0].tolist() if v >= 0) == list(range(length))


def test_broken_rows_come_back_unchanged():
    kw = _kw(MERGE, 4)
    # 5 >= length 4; good; 7 >= length 7 and padding first; duplicate; padding first.
    x = _t([[0, 5, -1, -1], [1, 2, 3, 4], [7, -5, 6, -1], [2, 1, 2, -1], [1, -1, 3, -1]])
    got = check_equal(x, _t([4, 5, 7, 5, 9]), **kw)
    assert got[[0, 2, 3, 4]].tolist() == x[[0, 2, 3, 4]].cpu().tolist()
    # Offsets: negative; fine; length 0; length < 0.
    x = _t([[1, -1, -1, -1], [11, 12, -1, -1], [1, -1, -1, -1], [-1, -1, -1, -1]])
    check_equal(x, _t([5, 5, 0, -3]), offsets=_t([-1, 10, 0, 0]), **kw)


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_broken_rows_dtype_limits(mode):
    # int32 rows with int64 offsets / lengths: offset + length - 1 past int32 max breaks the
    # row (no truncation); exactly at the max is fine. Offsets >= 2**31 are widened, not cut.
    big = 2**31 - 1
    x = _t([[big - 3, big - 1, -1, -1], [big - 2, -1, -1, -1], [5, 6, -1, -1], [2**33 % 2**31, -1, -1, -1]],
           torch.int32)
    L = _t([4, 3, 40, 1], torch.int64)
    off = _t([big - 3, big - 3, 0, 2**33], torch.int64)
    check_equal(x, L, offsets=off, **_kw(mode, 4))
    # int64 rows: offset + length - 1 must not overflow in the check.
    imax = torch.iinfo(torch.int64).max
    x = _t([[imax - 1, -1], [3, -1], [imax, -1]])
    check_equal(x, _t([imax, 10, 1]), offsets=_t([imax - 1, 0, imax]), **_kw(mode, 2))


def test_int32_lengths_offsets_with_int64_rows_and_vice_versa():
    x = _t([[100 + t for t in (3, 9, 17, 30)] + [-1] * 4, [7, 8, 9, 10, 11, 12, 13, 14]], torch.int64)
    check_equal(x, _t([40, 15], torch.int32), offsets=_t([100, 0], torch.int32), **_kw(MERGE, 8))
    check_equal(x.to(torch.int32), _t([40, 15]), offsets=_t([100, 0]), **_kw(COMPRESS, 8), scaffold=_t([9, 30]))


# ---------------------------------------------------------------- buffers


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_buffers_reused_counters_accumulate(mode):
    gen = torch.Generator().manual_seed(3)
    W, R = 12, 4
    L = _t([5, 40, 100, 17])
    x = torch.stack([torch.randperm(100, generator=gen)[:W] for _ in range(R)]).to(DEVICE)
    x = torch.where(x < L.unsqueeze(1), x, -1)
    x = torch.sort(torch.where(x < 0, 10**6, x), dim=1).values
    x = torch.where(x == 10**6, -1, x)
    scores = torch.rand(R, W, generator=gen).to(DEVICE)
    drift = torch.rand(R, 30, generator=gen).to(DEVICE)
    kw = _kw(mode, W, sink_tokens=3, local_blocks=2, witness_blocks=2)
    out = torch.full_like(x, 12345)  # stale content is overwritten
    counters = torch.full((len(COUNTER_NAMES),), 7, dtype=torch.int64, device=DEVICE)
    want, want_counters, _ = expected(x, L, None, drift, scores, _t([8] * R), **kw)
    for call in range(1, 4):
        got, got_counters = topology_kv_policy_triton(x, L, None, drift, scores, _t([8] * R), out=out,
                                                      counters=counters, **kw)
        assert got is out and got_counters is counters
        assert torch.equal(out.cpu(), want)
        assert counters.cpu().tolist() == [7 + call * v for v in want_counters]


def test_rejects_mismatched_buffers():
    x, L = _t([[0, 1]]), _t([2])
    with pytest.raises(ValueError, match="out"):
        topology_kv_policy_triton(x, L, None, None, None, None, out=torch.empty(1, 2, dtype=torch.int32,
                                  device=DEVICE), **_kw(MERGE, 2))
    with pytest.raises(ValueError, match="counters"):
        topology_kv_policy_triton(x, L, None, None, None, None, counters=torch.zeros(3, dtype=torch.int64,
                                  device=DEVICE), **_kw(MERGE, 2))
    with pytest.raises(ValueError, match="W > 0"):
        topology_kv_policy_triton(_t([[]]), L, None, None, None, None, **_kw(MERGE, 0))
    with pytest.raises(ValueError, match="mode"):
        topology_kv_policy_triton(x, L, None, None, None, None, **_kw(TopologyKVPolicyMode.DISABLED, 2))


# ---------------------------------------------------------------- property test vs the core

_FLOATS = [0.0, -0.0, 1.0, 1.0, 2.0, -1.0, float("nan"), float("inf"), float("-inf"), 0.5, 1.0 + 2**-30]


@st.composite
def cases(draw):
    W = draw(st.sampled_from([1, 3, 4, 8, 13, 20, 33]))
    bs = draw(st.sampled_from([1, 2, 3, 4, 5, 8]))
    R = draw(st.integers(1, 4))
    mode = draw(st.sampled_from(ENABLED_MODES))
    sink, local, wit = draw(st.integers(0, 2)), draw(st.integers(0, 3)), draw(st.integers(0, 3))
    sink_tokens = draw(st.one_of(st.none(), st.integers(0, 9)))
    lengths = [draw(st.one_of(st.integers(1, W), st.integers(W + 1, 6 * W + 8))) for _ in range(R)]
    return dict(
        W=W, bs=bs, mode=mode, sink=sink, local=local, wit=wit, sink_tokens=sink_tokens, lengths=lengths,
        frac=draw(st.sampled_from([0.1, 0.25, 0.5, 1.0])), seed=draw(st.integers(0, 2**20)),
        offsets=[draw(st.sampled_from([0, 0, 7, 1000])) for _ in range(R)],
        use_offsets=draw(st.booleans()), engine_style=draw(st.booleans()), scores=draw(st.booleans()),
        score_dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64])),
        drift_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        drift=draw(st.booleans()), drift_extra=draw(st.integers(-2, 2)), scaffold=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        len_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        off_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        scaled=draw(st.booleans()),
        breaks=[draw(st.sampled_from(["none"] * 6 + ["outside", "below", "order", "dup", "neg_off", "len0"]))
                for _ in range(R)],
    )


def _rows_for(case, gen):
    W = case["W"]
    rows = []
    for r, (length, off) in enumerate(zip(case["lengths"], case["offsets"])):
        off = off if case["use_offsets"] else 0
        n = min(length, W) if case["engine_style"] else int(torch.randint(0, min(length, W) + 1, (1,), generator=gen))
        chosen = torch.randperm(length, generator=gen)[:n].tolist()
        if case["engine_style"] and length <= W:
            chosen = list(range(length))
        row = [t + off for t in chosen] + [-1] * (W - n)
        if not case["engine_style"]:  # arbitrary negative padding
            row = [v if v >= 0 else -1 - (p % 3) for p, v in enumerate(row)]
        kind = case["breaks"][r]
        if kind == "outside" and W:
            row[int(torch.randint(0, W, (1,), generator=gen))] = off + length + int(torch.randint(0, 3, (1,),
                                                                                               generator=gen))
        elif kind == "below" and off > 0 and n:
            row[n - 1] = off - 1  # under the offset (still >= 0)
        elif kind == "order" and 0 < n < W:
            row[n - 1], row[W - 1] = row[W - 1], row[n - 1]
        elif kind == "dup" and n >= 2:
            row[n - 1] = row[0]
        rows.append(row)
    return rows


@settings(max_examples=int(os.environ.get("TOPOLOGY_KV_TRITON_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_triton_equals_core(case):
    gen = torch.Generator().manual_seed(case["seed"])
    W, bs, R = case["W"], case["bs"], len(case["lengths"])
    lengths = list(case["lengths"])
    offsets = [o if case["use_offsets"] else 0 for o in case["offsets"]]
    x = torch.tensor(_rows_for(case, gen), dtype=case["dtype"])
    for r, kind in enumerate(case["breaks"]):
        if kind == "neg_off" and case["use_offsets"]:
            offsets[r] = -offsets[r] - 1
        elif kind == "len0":
            lengths[r] = -int(torch.randint(0, 2, (1,), generator=gen))
    L = torch.tensor(lengths, dtype=case["len_dtype"], device=DEVICE)
    off = torch.tensor(offsets, dtype=case["off_dtype"], device=DEVICE) if case["use_offsets"] else None
    N = max(1, (max(case["lengths"]) + bs - 1) // bs + case["drift_extra"])
    drift = None
    if case["drift"]:  # few distinct values: ties; NaN, +-inf, -0.0 too
        pick = torch.randint(0, len(_FLOATS), (R, N), generator=gen)
        drift = torch.tensor(_FLOATS)[pick].to(case["drift_dtype"]).to(DEVICE)
    scores = None
    if case["scores"]:
        pick = torch.randint(0, len(_FLOATS), (R, W), generator=gen)
        scores = torch.tensor(_FLOATS)[pick].to(case["score_dtype"]).to(DEVICE)
    scaffold = None
    if case["scaffold"]:
        scaffold = torch.randint(0, 3 * W + 2, (R,), generator=gen).to(DEVICE)
    kw = _kw(case["mode"], W, sink_blocks=case["sink"], local_blocks=case["local"], witness_blocks=case["wit"],
             block_size=bs, frac=case["frac"], sink_tokens=case["sink_tokens"], scaled=case["scaled"])
    check_equal(x.to(DEVICE), L, offsets=off, drift=drift, scores=scores, scaffold=scaffold, **kw)


def test_strided_inputs():
    # Non-contiguous rows, scores and drift (a [1, N] drift expanded to every row).
    gen = torch.Generator().manual_seed(5)
    W, R = 20, 3
    L = _t([50, 19, 90])
    base = torch.stack([torch.randperm(100, generator=gen)[: 2 * W] for _ in range(R)]).to(DEVICE)
    x = torch.where(base < L.unsqueeze(1), base, -1)[:, ::2]
    x = torch.sort(torch.where(x < 0, 10**6, x), dim=1).values
    x = torch.where(x == 10**6, -1, x).t().contiguous().t()
    scores = torch.rand(W, R, generator=gen).to(DEVICE).t()
    drift = torch.rand(1, 30, generator=gen).to(DEVICE).expand(R, 30)
    for mode in ENABLED_MODES:
        check_equal(x, L, drift=drift, scores=scores, scaffold=_t([12]).expand(R), **_kw(mode, W, sink_tokens=4))


# ---------------------------------------------------------------- compiled for a GPU target

# Run in a fresh interpreter without TRITON_INTERPRET (the kernel is then a JITFunction):
# compile the kernel ahead of time for sm_90 (H200/H20) through Triton's whole pipeline and
# ptxas, with the arguments the wrapper builds. No GPU needed; catches what the interpreter
# cannot (constexpr folding, loop-carried types, the lowering of sort/gather/histogram).
_AOT_SCRIPT = r"""
import os, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rtp_llm.models_py.modules.hybrid import topology_kv_policy_triton as K
from rtp_llm.models_py.modules.hybrid.topology_kv_policy import COUNTER_NAMES, TopologyKVPolicyMode as M

PTR = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32", torch.float16: "*fp16",
       torch.bfloat16: "*bf16", torch.float64: "*fp64", torch.bool: "*i1"}
def compile_case(mode, W, bs, idt, *, scores=None, drift=False, offsets=False, scaffold=False, sink_tokens=None,
                 scaled=False, mismatch=True):
    R = 2
    x = torch.full((R, W), -1, dtype=idt)
    L = torch.full((R,), 40, dtype=torch.int32)
    _, _, (args, consts, warps) = K._launch_spec(
        x, L, torch.zeros(R, dtype=torch.int64) if offsets else None,
        torch.zeros(R, 50) if drift else None, None if scores is None else torch.zeros(R, W, dtype=scores),
        torch.zeros(R, dtype=torch.int64) if scaffold else None, mode=mode, sink_blocks=1, local_blocks=2,
        witness_blocks=2, block_size=bs, structural_cap=W // 4, sink_tokens=sink_tokens,
        scale_budget_by_length=scaled, out=None, counters=None,
        mismatch_rows=torch.zeros(R, dtype=torch.bool) if mismatch else None)
    names = K._topology_kv_policy_kernel.arg_names
    sig = dict(zip([n for n in names if n not in consts],
                   [PTR[a.dtype] if isinstance(a, torch.Tensor) else "i32" for a in args]))
    sig.update({n: "constexpr" for n in consts})
    triton.compile(ASTSource(K._topology_kv_policy_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})
    print("compiled", mode.value, W, bs, idt, flush=True)

compile_case(M.TOPOLOGY_SPARSE_MERGE, 20, 3, torch.int32, scores=torch.bfloat16, drift=True, offsets=True,
             sink_tokens=4, scaled=True)
compile_case(M.TOPOLOGY_SPARSE_MERGE, 64, 8, torch.int64, mismatch=False)
compile_case(M.TOPOLOGY_COMPRESS_SPARSE, 33, 4, torch.int64, scores=torch.float32, scaffold=True)
compile_case(M.TOPOLOGY_COMPRESS_SPARSE, 16, 4, torch.int32, drift=True, scaffold=True, sink_tokens=6)
compile_case(M.TOPOLOGY_ONLY, 33, 4, torch.int64, drift=True, offsets=True, sink_tokens=4)
compile_case(M.TOPOLOGY_ONLY, 20, 1, torch.int32)
"""


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU every test above compiles and runs the kernel")
def test_kernel_compiles_for_sm90():
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton's NVIDIA backend is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's notice; the kernel has no float math
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("compiled") == 6, proc.stdout


# ---------------------------------------------------------------- CUDA graph


def _graph_inputs(seed, W=64, R=8, N=40):
    """Rows (valid entries first), lengths, drift, scores, scaffold spans for the graph test."""
    gen = torch.Generator().manual_seed(seed)
    L = torch.randint(1, 300, (R,), generator=gen)
    x = torch.stack([torch.randperm(300, generator=gen)[:W] for _ in range(R)])
    x = torch.where(x < L.unsqueeze(1), x, 10**6)  # padding sorts last
    x = torch.sort(x, dim=1).values
    x = torch.where(x == 10**6, -1, x)
    return [t.to(DEVICE) for t in (x, L, torch.rand(R, N, generator=gen), torch.rand(R, W, generator=gen),
                                   torch.randint(0, 64, (R,), generator=gen))]


def test_graph_inputs_are_good_rows():
    # The CUDA-graph test's inputs (checked here on any device; the graph itself needs a GPU).
    x, L, drift, scores, scaffold = _graph_inputs(1, W=8, R=3)
    check_equal(x, L, drift=drift, scores=scores, scaffold=scaffold,
                **_kw(COMPRESS, 8, sink_tokens=4, local_blocks=2, witness_blocks=2, block_size=8))
    assert not broken_rows(x, L, None, drift, 8).any()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_cuda_graph_capture_and_replay(mode):
    W, R, N = 64, 8, 40
    kw = _kw(mode, W, sink_tokens=4, local_blocks=2, witness_blocks=2, block_size=8)

    inputs = _graph_inputs

    bufs = inputs(0)
    out = torch.empty_like(bufs[0])
    counters = torch.zeros(len(COUNTER_NAMES), dtype=torch.int64, device=DEVICE)
    args = lambda: (bufs[0], bufs[1], None, bufs[2], bufs[3], bufs[4])  # noqa: E731
    topology_kv_policy_triton(*args(), out=out, counters=counters, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topology_kv_policy_triton(*args(), out=out, counters=counters, **kw)
    for seed in (1, 2, 3):
        new = inputs(seed)
        for buf, val in zip(bufs, new):
            buf.copy_(val)
        counters.zero_()
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_counters = topology_kv_policy_triton(*args(), **kw)
        assert torch.equal(out, eager_out) and torch.equal(counters, eager_counters)
        want, want_counters, _ = expected(*args(), **kw)
        assert torch.equal(out.cpu(), want) and counters.cpu().tolist() == want_counters
