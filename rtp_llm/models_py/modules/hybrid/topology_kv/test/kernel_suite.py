"""The equality suite of the policy's fused kernels: a kernel equals the torch core bit for bit.

Shared by ``cpu_fused_test.py`` (the fused C++ kernel) and
``triton_fused_test.py`` (the Triton kernel; on CPU under the Triton
interpreter, which :mod:`tools.device_under_test` switches on before triton is imported).
A kernel is any callable with the signature of ``topology_kv_policy_cpu`` /
``topology_kv_policy_triton`` (one :class:`PolicyTensors`, the layout, the buffers), called
here through :func:`tensor_call`. Each test file sets ``KERNEL`` to its kernel, star-imports
this module (pytest collects the shared tests of :data:`__all__` there, under that file's
name) and binds the property test with :func:`equals_core_test`.

Every comparison is direct: the kernel's indices, counters and ``mismatch_rows`` equal the
torch core's on the whole batch (broken rows and rows at the int32/int64 limits included),
and the core's on the good rows alone, with the broken rows computed independently here
by loops (the hardened contract: negative offset, length <= 0, ``offset + length - 1``
past the row dtype's maximum, an entry outside ``[offset, offset + length)``, padding
before a valid entry, a duplicate valid entry, a drift table with fewer columns than the
row has blocks) and returned unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv.test.reference import reference_locality_row
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import (
    COUNTER_NAMES,
    TopologyKVPolicyMode,
    topology_kv_policy_core,
    topology_only_learned_kept,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import PolicyLayout, PolicyTensors
from tools.device_under_test import DEVICE

__all__ = [
    "kernel",
    "test_sparse_merge_tail_eviction",
    "test_sparse_merge_evicts_lowest_scores_ties_to_later_entry",
    "test_sparse_merge_witness_by_drift_and_offsets",
    "test_topology_only_fills_min_w_length_in_priority_order",
    "test_topology_only_engine_defaults_with_recency_is_locality",
    "test_token_sinks",
    "test_present_local_tokens_never_keep_out_missing_sinks",
    "test_scaled_budget",
    "test_compress_sparse",
    "test_rows_up_to_width_keep_every_token",
    "test_broken_rows_come_back_unchanged",
    "test_broken_rows_dtype_limits",
    "test_huge_interval_duplicates_by_sort",
    "test_int32_lengths_offsets_with_int64_rows_and_vice_versa",
    "test_no_rows",
    "test_buffers_reused_counters_accumulate",
    "test_rejects_mismatched_buffers",
    "test_strided_inputs",
]

MERGE = TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE
COMPRESS = TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE
ONLY = TopologyKVPolicyMode.TOPOLOGY_ONLY
ENABLED_MODES = [MERGE, COMPRESS, ONLY]
FALLBACK = COUNTER_NAMES.index("coordinate_mismatch_fallbacks")
I32 = 2**31 - 1
I64 = 2**63 - 1


def tensor_call(kernel):
    """``kernel`` called with the six input tensors positionally (packed into PolicyTensors)."""

    def call(x, lengths, offsets=None, drift=None, scores=None, scaffold=None, **kw):
        return kernel(PolicyTensors(x, lengths, offsets, drift, scores, scaffold), **kw)

    call.kernel = kernel
    return call


@pytest.fixture(scope="module")
def kernel(request):
    """The kernel under test: the test module's ``KERNEL``."""
    return request.module.KERNEL


def _t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _kw(mode, W, *, sink_blocks=1, local_blocks=1, witness_blocks=1, block_size=4, frac=0.5, sink_tokens=None,
        scaled=False):
    """The kernels' keyword: the layout, whose structural cap at width ``W`` is ``floor(W * frac)``."""
    layout = PolicyLayout(mode=mode, sink_blocks=sink_blocks, local_blocks=local_blocks,
                          witness_blocks=witness_blocks, block_size=block_size, sink_tokens=sink_tokens,
                          max_structural_fraction=frac, scale_budget_by_length=scaled)
    assert layout.structural_cap(W) == int(math.floor(W * frac))
    return dict(layout=layout)


# ---------------------------------------------------------------- expected values


def broken_rows(x, lengths, offsets, drift=None, block_size=1) -> torch.Tensor:
    """``[R]`` bool (cpu): the hardened contract's broken rows, by loops (Python ints: no overflow)."""
    imax = torch.iinfo(x.dtype).max
    offs = [0] * x.shape[0] if offsets is None else offsets.tolist()
    out = []
    for row, length, off in zip(x.tolist(), lengths.tolist(), offs):
        valid = [v for v in row if v >= 0]
        out.append(
            off < 0
            or length <= 0
            or off + length - 1 > imax
            or any(not (off <= v < off + length) for v in valid)
            or any(v >= 0 for v in row[len(valid):])  # a valid entry after padding
            or len(set(valid)) != len(valid)
            or (drift is not None and -(-length // block_size) > drift.shape[1])  # drift too short
        )
    return torch.tensor(out, dtype=torch.bool)


def core_counts(x, lengths, offsets, drift, scores, scaffold, **kw):
    """The torch core's rows and counters, its TOPOLOGY_ONLY learned counters checked by sets.

    Returns ``(indices, counters list, mismatch [R] cpu)``. For TOPOLOGY_ONLY the core's
    learned counters must count, over the good rows, the learned entries the output kept
    (``|learned & out|``, by sets here), the others (evicted) and the selected ones not
    learned (injected).
    """
    out, counters = topology_kv_policy_core(PolicyTensors(x, lengths, offsets, drift, scores, scaffold), **kw)
    mismatch = counters["mismatch_rows"]
    if kw["layout"].only:
        kept = learned = 0
        for row, new, bad in zip(x.tolist(), out.tolist(), mismatch.tolist()):
            if not bad:
                mine = {v for v in row if v >= 0}
                kept += len(mine & {v for v in new if v >= 0})
                learned += len(mine)
        assert int(topology_only_learned_kept(x, out, mismatch).sum()) == kept
        assert int(counters["learned_kept_tokens"]) == kept
        assert int(counters["learned_evicted_tokens"]) == learned - kept
        assert int(counters["structural_injected_tokens"]) == int(counters["selected_tokens"]) - kept
    return out, [int(counters[name]) for name in COUNTER_NAMES], mismatch.cpu()


def _rows(t, keep):
    return None if t is None else t[keep]


def expected(x, lengths, offsets, drift, scores, scaffold, **kw):
    """(indices [R, W] cpu, counters list, broken [R] cpu): the core, checked against the contract.

    The core runs on the whole batch and on the good rows alone; both must agree, flag
    exactly the broken rows of :func:`broken_rows`, return those unchanged and count
    them only in ``coordinate_mismatch_fallbacks``.
    """
    broken = broken_rows(x, lengths, offsets, drift, kw["layout"].block_size)
    want, counters, mismatch = core_counts(x, lengths, offsets, drift, scores, scaffold, **kw)
    want = want.cpu()
    assert torch.equal(mismatch, broken), f"core flags {mismatch}, the contract {broken}"
    assert torch.equal(want[broken], x.cpu()[broken]), "the core changed a broken row"
    assert counters[FALLBACK] == int(broken.sum())
    good = [0] * len(COUNTER_NAMES)
    keep = (~broken).nonzero().flatten().to(x.device)
    if keep.numel():
        sub = [_rows(t, keep) for t in (x, lengths, offsets, drift, scores, scaffold)]
        sub_out, good, sub_mismatch = core_counts(*sub, **kw)
        assert not sub_mismatch.any(), "the core flags a row the hardened contract accepts"
        assert torch.equal(want[keep.cpu()], sub_out.cpu()), "a good row's output depends on the other rows"
    good[FALLBACK] = int(broken.sum())
    assert counters == good, dict(zip(COUNTER_NAMES, zip(counters, good)))
    return want, counters, broken


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN payloads and -0.0 included)."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def run(kernel, x, lengths, offsets, drift, scores, scaffold, **kw):
    """``(out, counters, mismatch_rows)`` of the kernel (a fresh ``mismatch_rows`` buffer)."""
    mismatch = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    out, counters = kernel(x, lengths, offsets, drift, scores, scaffold, mismatch_rows=mismatch, **kw)
    return out, counters, mismatch


def check_equal(kernel, x, lengths, offsets=None, drift=None, scores=None, scaffold=None, **kw):
    """Assert the kernel equals the core bit for bit; returns the kernel's output (cpu)."""
    args = (x, lengths, offsets, drift, scores, scaffold)
    before = [t if t is None else t.clone() for t in args]
    out, counters, mismatch = run(kernel, *args, **kw)
    for b, a in zip(before, args):  # inputs never mutated
        assert b is None or _same_bits(b, a)
    assert out.dtype == x.dtype and out.shape == x.shape and out.device == x.device and out.is_contiguous()
    want, want_counters, broken = expected(*args, **kw)
    got = out.cpu()
    assert torch.equal(got, want), f"kernel != core\n{got}\n{want}\nbroken {broken}"
    assert counters.tolist() == want_counters, dict(zip(COUNTER_NAMES, zip(counters.tolist(), want_counters)))
    assert torch.equal(mismatch.cpu(), broken)
    return got


# ---------------------------------------------------------------- hand-computed cases
# Inputs of rtp_llm/models_py/modules/hybrid/topology_kv/test/policy_test.py (whole sink blocks unless stated); the
# expected rows there are asserted here too, so every implementation meets the hand values.


def test_sparse_merge_tail_eviction(kernel):
    got = check_equal(kernel, _t([[0, 10, 37, 11, 20, 21, 22, 23]]), _t([40]), **_kw(MERGE, 8))
    assert got.tolist() == [[0, 10, 37, 11, 1, 2, 3, 39]]


def test_sparse_merge_evicts_lowest_scores_ties_to_later_entry(kernel):
    scores = torch.tensor([[5.0, 1.0, 9.0, 1.0, 7.0, 0.5, 8.0, 6.0]], device=DEVICE)
    got = check_equal(kernel, _t([[10, 11, 12, 13, 14, 15, 16, 17]]), _t([40]), scores=scores,
                      **_kw(MERGE, 8, local_blocks=0, witness_blocks=0, frac=0.25))
    assert got.tolist() == [[10, 11, 12, 1, 14, 0, 16, 17]]


def test_sparse_merge_witness_by_drift_and_offsets(kernel):
    drift = torch.zeros(1, 10, device=DEVICE)
    drift[0, 5] = 3.0
    got = check_equal(kernel, _t([[101, 102, 103, 104, -1, -1, -1, -1]]), _t([40]), offsets=_t([100]), drift=drift,
                      **_kw(MERGE, 8, sink_blocks=0, local_blocks=0, witness_blocks=1, frac=1.0))
    assert got.tolist() == [[101, 102, 103, 104, 123, 122, 121, 120]]  # witness tokens newest first


def test_topology_only_fills_min_w_length_in_priority_order(kernel):
    drift = torch.zeros(2, 10, device=DEVICE)
    drift[:, 4] = 2.0
    drift[:, 2] = 1.0
    x = _t([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [0, 1, 2, 3, 4, 5, 6, -1, -1, -1]])
    kw = _kw(ONLY, 10, local_blocks=1, witness_blocks=0)
    got = check_equal(kernel, x, _t([40, 7]), drift=drift, **kw)
    # The cut witness block 4 (16..19) keeps its newest tokens.
    assert got.tolist() == [[0, 1, 2, 3, 39, 38, 37, 36, 19, 18], [0, 1, 2, 3, 6, 5, 4, -1, -1, -1]]
    _, counters, _ = run(kernel, x, _t([40, 7]), None, drift, None, None, **kw)
    c = dict(zip(COUNTER_NAMES, counters.tolist()))
    assert c["selected_tokens"] == 17 and c["learned_kept_tokens"] == 7
    assert c["structural_injected_tokens"] == 10 and c["learned_evicted_tokens"] == 10


@pytest.mark.parametrize("W", [3, 64, 100, 2048])
def test_topology_only_engine_defaults_with_recency_is_locality(kernel, W):
    # Engine defaults (4 token sinks, 2 local blocks, 64-token blocks), no drift: the rows
    # are sinks + the most recent tokens (the partly fitting block keeps its newest tokens).
    # Lengths on partly filled blocks (27, 61, 1541, 2047), on block edges and below W.
    lengths = [1, 27, 61, 64, 200, 1541, 2047, 2049]
    x = _t([list(range(min(n, W))) + [-1] * (W - min(n, W)) for n in lengths], torch.int32)
    got = check_equal(kernel, x, _t(lengths), **_kw(ONLY, W, local_blocks=2, block_size=64, sink_tokens=4))
    assert got.tolist() == [reference_locality_row(n, W, 4) for n in lengths]


def test_token_sinks(kernel):
    kw = _kw(MERGE, 8, sink_tokens=2)
    assert check_equal(kernel, _t([[10, 11, 12, 13, 14, 15, 16, 17]]), _t([40]), **kw).tolist() == [
        [10, 11, 12, 13, 0, 1, 39, 38]]
    assert check_equal(kernel, _t([[5, -1, -1, -1, -1, -1, -1, -1]]), _t([6]), **kw).tolist() == [
        [5, 0, 1, 4, 3, -1, -1, -1]]  # the cut witness block 0 keeps its newest token (was 2)


def test_present_local_tokens_never_keep_out_missing_sinks(kernel):
    kw = _kw(MERGE, 8, sink_tokens=2, local_blocks=3, witness_blocks=0)
    x = _t([[6, 7, 8, 9, 10, 11, 12, 13]])
    assert check_equal(kernel, x, _t([14]), **kw).tolist() == [[0, 1, 8, 9, 10, 11, 12, 13]]
    scores = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]], device=DEVICE)
    got = check_equal(kernel, x, _t([14]), scores=scores, **kw)
    assert sorted(got.tolist()[0]) == [0, 1, 8, 9, 10, 11, 12, 13]


def test_scaled_budget(kernel):
    got = check_equal(kernel, _t([[8, 9, 10, 11, 4, 5, 6, 7]]), _t([16]), **_kw(MERGE, 8, scaled=True))
    assert got.tolist() == [[8, 9, 10, 11, 4, 5, 0, 1]]


def test_compress_sparse(kernel):
    kw = _kw(COMPRESS, 8, sink_blocks=2, local_blocks=1, witness_blocks=0, frac=1.0)
    x = _t([[20, 21, 22, 23, 24, 25, -1, -1]])
    assert check_equal(kernel, x, _t([40]), scaffold=_t([10]), **kw).tolist() == [[20, 21, 0, 4, 39, 38, 37, 36]]
    _, counters, _ = run(kernel, x, _t([40]), None, None, None, _t([10]), **kw)
    c = dict(zip(COUNTER_NAMES, counters.tolist()))
    assert c["compressed_blocks"] == 2 and c["compression_saved_tokens"] == 6
    assert c["structural_injected_tokens"] == 6 and c["learned_evicted_tokens"] == 4


@pytest.mark.parametrize("mode", ENABLED_MODES)
@pytest.mark.parametrize("length", [1, 3, 4, 5, 8])
def test_rows_up_to_width_keep_every_token(kernel, mode, length):
    x = _t([list(range(length)) + [-1] * (8 - length)])
    got = check_equal(kernel, x, _t([length]), scaffold=_t([6]), **_kw(mode, 8))
    assert sorted(v for v in got[0].tolist() if v >= 0) == list(range(length))


def test_broken_rows_come_back_unchanged(kernel):
    kw = _kw(MERGE, 4)
    # 5 >= length 4; good; 7 >= length 7 and padding first; duplicate; padding first.
    x = _t([[0, 5, -1, -1], [1, 2, 3, 4], [7, -5, 6, -1], [2, 1, 2, -1], [1, -1, 3, -1]])
    got = check_equal(kernel, x, _t([4, 5, 7, 5, 9]), **kw)
    assert got[[0, 2, 3, 4]].tolist() == x[[0, 2, 3, 4]].tolist()
    # Offsets: negative; fine; length 0; length < 0.
    x = _t([[1, -1, -1, -1], [11, 12, -1, -1], [1, -1, -1, -1], [-1, -1, -1, -1]])
    check_equal(kernel, x, _t([5, 5, 0, -3]), offsets=_t([-1, 10, 0, 0]), **kw)
    # A drift table shorter than the row's blocks (length 9, block 4: 3 blocks > 2 columns).
    x = _t([[0, 1, -1, -1], [0, 8, -1, -1]])
    got = check_equal(kernel, x, _t([8, 9]), drift=torch.ones(2, 2, device=DEVICE), **kw)
    assert got[1].tolist() == [0, 8, -1, -1]


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_broken_rows_dtype_limits(kernel, mode):
    # int32 rows with int64 offsets / lengths: offset + length - 1 past int32 max breaks the
    # row (no truncation); exactly at the max is fine. Offsets >= 2**31 are widened, not cut.
    x = _t([[I32 - 3, I32 - 1, -1, -1], [I32 - 2, -1, -1, -1], [5, 6, -1, -1], [2**33 % 2**31, -1, -1, -1]],
           torch.int32)
    check_equal(kernel, x, _t([4, 3, 40, 1]), offsets=_t([I32 - 3, I32 - 3, 0, 2**33]), **_kw(mode, 4))
    # int64 rows: offset + length - 1 must not overflow in the check; the last row is good and
    # ends at int64's max (offset + length = 2**63).
    x = _t([[I64 - 1, -1], [3, -1], [I64, -1]])
    check_equal(kernel, x, _t([I64, 10, 1]), offsets=_t([I64 - 1, 0, I64]), **_kw(mode, 2))
    # A drift table too short for a row near int64's max length: ceil(length / bs) must not
    # overflow (it did: (length + bs - 1) // bs wrapped negative and the row passed).
    x = _t([[0, -1], [0, 1]])
    got = check_equal(kernel, x, _t([I64, 8]), drift=torch.rand(2, 2, generator=torch.Generator().manual_seed(0)),
                      **_kw(mode, 2))
    assert got[0].tolist() == [0, -1]


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_huge_interval_duplicates_by_sort(kernel, mode):
    # Lengths past the bitmap's range (2**24): duplicates are found by sorting.
    big = 2**40
    x = _t([[5, big - 1, 77, 2**30, -1, -1], [5, big - 1, 77, 5, -1, -1], [big - 3, 3, 2**35, 9, 1, 0]])
    L = _t([big, big, big])
    check_equal(kernel, x, L, **_kw(mode, 6, block_size=64))
    check_equal(kernel, x, L, scores=torch.rand(3, 6, device=DEVICE), scaffold=_t([2**36] * 3),
                **_kw(mode, 6, block_size=64, sink_tokens=3, witness_blocks=3))
    # With a drift table too short for such rows: broken.
    check_equal(kernel, x, L, drift=torch.rand(3, 4, device=DEVICE), **_kw(mode, 6, block_size=64))


def test_int32_lengths_offsets_with_int64_rows_and_vice_versa(kernel):
    x = _t([[100 + t for t in (3, 9, 17, 30)] + [-1] * 4, [7, 8, 9, 10, 11, 12, 13, 14]], torch.int64)
    check_equal(kernel, x, _t([40, 15], torch.int32), offsets=_t([100, 0], torch.int32), **_kw(MERGE, 8))
    check_equal(kernel, x.to(torch.int32), _t([40, 15]), offsets=_t([100, 0]), scaffold=_t([9, 30]),
                **_kw(COMPRESS, 8))


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_no_rows(kernel, mode):
    x = torch.empty(0, 5, dtype=torch.int32, device=DEVICE)
    out, counters = kernel(x, _t([]), _t([]), torch.rand(0, 3, device=DEVICE), torch.rand(0, 5, device=DEVICE),
                           _t([]), **_kw(mode, 5))
    assert out.shape == (0, 5) and out.dtype == torch.int32 and counters.tolist() == [0] * len(COUNTER_NAMES)
    check_equal(kernel, x, _t([]), **_kw(mode, 5))


# ---------------------------------------------------------------- buffers


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_buffers_reused_counters_accumulate(kernel, mode):
    gen = torch.Generator().manual_seed(3)
    W, R = 12, 4
    L = _t([5, 40, 100, 17])
    x = torch.stack([torch.randperm(100, generator=gen)[:W] for _ in range(R)]).to(DEVICE)
    x = torch.where(x < L.unsqueeze(1), x, -1)
    x = torch.sort(torch.where(x < 0, 10**6, x), dim=1).values
    x = torch.where(x == 10**6, -1, x)
    x[3, 0] = 99  # a broken row (outside its interval)
    scores = torch.rand(R, W, generator=gen).to(DEVICE)
    drift = torch.rand(R, 30, generator=gen).to(DEVICE)
    kw = _kw(mode, W, sink_tokens=3, local_blocks=2, witness_blocks=2)
    out = torch.full_like(x, 12345)  # stale content is overwritten
    counters = torch.full((len(COUNTER_NAMES),), 7, dtype=torch.int64, device=DEVICE)
    want, want_counters, _ = expected(x, L, None, drift, scores, _t([8] * R), **kw)
    assert want_counters[FALLBACK] == 1
    for call in range(1, 4):
        got, got_counters = kernel(x, L, None, drift, scores, _t([8] * R), out=out, counters=counters, **kw)
        assert got is out and got_counters is counters
        assert torch.equal(out.cpu(), want)
        assert counters.tolist() == [7 + call * v for v in want_counters]


def test_rejects_mismatched_buffers(kernel):
    x, L = _t([[0, 1]]), _t([2])
    with pytest.raises(ValueError, match="out"):
        kernel(x, L, None, None, None, None, out=torch.empty(1, 2, dtype=torch.int32, device=DEVICE),
               **_kw(MERGE, 2))
    with pytest.raises(ValueError, match="counters"):
        kernel(x, L, None, None, None, None, counters=torch.zeros(3, dtype=torch.int64, device=DEVICE),
               **_kw(MERGE, 2))
    with pytest.raises(ValueError, match="mode"):
        kernel(x, L, None, None, None, None, **_kw(TopologyKVPolicyMode.DISABLED, 2))
    with pytest.raises(TypeError, match="lengths"):
        kernel(x, L.float(), None, None, None, None, **_kw(MERGE, 2))
    with pytest.raises(ValueError, match="learned_scores"):
        kernel(x, L, None, None, torch.rand(1, 3, device=DEVICE), None, **_kw(MERGE, 2))
    with pytest.raises(ValueError, match="drift"):
        kernel(x, L, None, torch.ones(2, 3, device=DEVICE), None, None, **_kw(MERGE, 2))


def test_strided_inputs(kernel):
    # Non-contiguous rows, scores and drift (a [1, N] drift expanded to every row), expanded
    # lengths and scaffold spans.
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
        kw = _kw(mode, W, sink_tokens=4)
        check_equal(kernel, x, L, drift=drift, scores=scores, scaffold=_t([12]).expand(R), **kw)
        check_equal(kernel, x, _t([90]).expand(R), drift=drift, **kw)


# ---------------------------------------------------------------- property test vs the core

_FLOATS = [0.0, -0.0, 1.0, 1.0, 2.0, -1.0, float("nan"), float("inf"), float("-inf"), 0.5, 1.0 + 2**-30]
_FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@st.composite
def cases(draw):
    W = draw(st.sampled_from([1, 2, 3, 4, 8, 13, 20, 33, 100]))
    bs = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 64]))
    R = draw(st.integers(0, 5))
    mode = draw(st.sampled_from(ENABLED_MODES))
    sink, local, wit = draw(st.integers(0, 2)), draw(st.integers(0, 3)), draw(st.integers(0, 3))
    sink_tokens = draw(st.one_of(st.none(), st.integers(0, 9)))
    lengths = [draw(st.one_of(st.integers(1, W), st.integers(W + 1, 6 * W + 8), st.integers(W + 1, 40 * W)))
               for _ in range(R)]
    return dict(
        W=W, bs=bs, mode=mode, sink=sink, local=local, wit=wit, sink_tokens=sink_tokens, lengths=lengths,
        frac=draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0])), seed=draw(st.integers(0, 2**20)),
        offsets=[draw(st.sampled_from(["0", "0", "7", "1000", "limit", "limit", "past"])) for _ in range(R)],
        use_offsets=draw(st.booleans()), engine_style=draw(st.booleans()), scores=draw(st.booleans()),
        score_dtype=draw(st.sampled_from(_FLOAT_DTYPES)), drift_dtype=draw(st.sampled_from(_FLOAT_DTYPES)),
        drift=draw(st.booleans()), drift_extra=draw(st.integers(-2, 2)), scaffold=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        len_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        off_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        scaled=draw(st.booleans()), transposed=draw(st.booleans()),
        breaks=[draw(st.sampled_from(["none"] * 6 + ["outside", "below", "order", "dup", "neg_off", "len0"]))
                for _ in range(R)],
    )


def _offset(kind: str, length: int, case) -> int:
    """An offset of the named kind: ``limit`` ends the row at int32's max, ``past`` one beyond."""
    if not case["use_offsets"]:
        return 0
    if kind in ("limit", "past"):
        off = I32 - length + 1 + (kind == "past")
        return min(off, I32) if case["off_dtype"] is torch.int32 else off
    return int(kind)


def _rows_for(case, offsets, gen):
    W = case["W"]
    rows = []
    for r, (length, off) in enumerate(zip(case["lengths"], offsets)):
        n = min(length, W) if case["engine_style"] else int(torch.randint(0, min(length, W) + 1, (1,), generator=gen))
        chosen = torch.randperm(length, generator=gen)[:n].tolist()
        if case["engine_style"] and length <= W:
            chosen = list(range(length))
        row = [t + off for t in chosen] + [-1] * (W - n)
        if not case["engine_style"]:  # arbitrary negative padding
            row = [v if v >= 0 else -1 - (p % 3) for p, v in enumerate(row)]
        kind = case["breaks"][r]
        if kind == "outside":
            row[int(torch.randint(0, W, (1,), generator=gen))] = off + length + int(
                torch.randint(0, 3, (1,), generator=gen))
        elif kind == "below" and off > 0 and n:
            row[n - 1] = off - 1  # under the offset (still >= 0)
        elif kind == "order" and 0 < n < W:
            row[n - 1], row[W - 1] = row[W - 1], row[n - 1]
        elif kind == "dup" and n >= 2:
            row[n - 1] = row[0]
        if case["dtype"] is torch.int32:  # past int32: such rows are left out, not wrapped
            row = [-1 if v > I32 else v for v in row]
        rows.append(row)
    return rows


def case_inputs(case):
    """``((x, lengths, offsets, drift, scores, scaffold), core keywords)`` of a drawn case, on DEVICE."""
    gen = torch.Generator().manual_seed(case["seed"])
    W, bs, R = case["W"], case["bs"], len(case["lengths"])
    lengths = list(case["lengths"])
    offsets = [_offset(k, n, case) for k, n in zip(case["offsets"], lengths)]
    x = torch.tensor(_rows_for(case, offsets, gen), dtype=case["dtype"]).reshape(R, W).to(DEVICE)
    for r, kind in enumerate(case["breaks"]):
        if kind == "neg_off" and case["use_offsets"]:
            offsets[r] = -offsets[r] - 1
        elif kind == "len0":
            lengths[r] = -int(torch.randint(0, 2, (1,), generator=gen))
    if case["transposed"]:  # non-contiguous rows
        x = x.t().contiguous().t()
    L = torch.tensor(lengths, dtype=case["len_dtype"], device=DEVICE)
    off = torch.tensor(offsets, dtype=case["off_dtype"], device=DEVICE) if case["use_offsets"] else None
    N = max(1, (max(case["lengths"], default=1) + bs - 1) // bs + case["drift_extra"])
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
        scaffold = torch.randint(-2, 3 * W + 2, (R,), generator=gen).to(DEVICE)
    kw = _kw(case["mode"], W, sink_blocks=case["sink"], local_blocks=case["local"], witness_blocks=case["wit"],
             block_size=bs, frac=case["frac"], sink_tokens=case["sink_tokens"], scaled=case["scaled"])
    return (x, L, off, drift, scores, scaffold), kw


def equals_core_test(kernel_fn, max_examples: int):
    """The property test, ``kernel_fn`` equals the core on drawn cases, as a test function.

    Bound in each test file under its own name, with its own example budget.
    """

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def test_equals_core(case):
        (x, L, off, drift, scores, scaffold), kw = case_inputs(case)
        check_equal(kernel_fn, x, L, offsets=off, drift=drift, scores=scores, scaffold=scaffold, **kw)

    return test_equals_core
