"""Served query-aware witnesses: ``tracker_query_group_mass_scores`` against the loop reference.

Each row's scores are ``query_group_mass`` of its queries against its own request's block
centroids (a tracker's sums over counts), masked to the row's eligible blocks; chunking the
rows (to bound the gathered table) changes nothing. The C++ kernel that CPU calls run is
tested against the torch reference over random shapes, strided tables and index dtypes.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv import witness
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_witness
from rtp_llm.models_py.modules.hybrid.topology_kv.test import reference as ref
from tools.device_under_test import DEVICE


def _inputs(seed, R, B, N, Hkv, G, D, bs):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(R, Hkv * G, D, generator=gen) * 2
    counts = torch.randint(0, bs + 1, (B, N), generator=gen).to(torch.float32)  # empty blocks too
    sums = torch.randn(B, N, Hkv * D, generator=gen) * counts.unsqueeze(-1)
    rows = torch.randint(0, B, (R,), generator=gen)
    lengths = torch.randint(1, N * bs + 1, (R,), generator=gen)
    return queries, sums, counts, rows, lengths


@settings(max_examples=25, deadline=None)
@given(
    R=st.integers(1, 6),
    B=st.integers(1, 3),
    N=st.integers(1, 5),
    groups=st.sampled_from([(1, 1), (1, 3), (2, 2), (3, 1)]),
    chunk=st.sampled_from([1, 7, 1 << 22]),
    seed=st.integers(0, 2**16),
    served=st.booleans(),
)
def test_scores_match_the_row_by_row_reference(R, B, N, groups, chunk, seed, served):
    """``served``: the public function (the C++ kernel on CPU); else the torch reference,
    whose row chunking is varied."""
    Hkv, G = groups
    D, bs = 3, 4
    queries, sums, counts, rows, lengths = _inputs(seed, R, B, N, Hkv, G, D, bs)
    args = (queries.to(DEVICE), sums.to(DEVICE), counts.to(DEVICE), rows.to(DEVICE), lengths.to(DEVICE), bs)
    if served:
        got = witness.tracker_query_group_mass_scores(*args).cpu()
    else:
        with mock.patch.object(witness, "_TABLE_CHUNK_ELEMENTS", chunk):
            got = witness.tracker_query_group_mass_scores_reference(*args).cpu()
    cents = sums / counts.clamp(min=1).unsqueeze(-1)
    for r in range(R):
        want = ref.reference_query_group_mass_scores(
            queries[r], cents[rows[r]].view(N, Hkv, D), int(lengths[r]), bs, 1.0)
        assert torch.allclose(got[r].to(torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-5)
        assert abs(float(got[r].sum()) - Hkv) < 1e-4
        assert not got[r, (int(lengths[r]) + bs - 1) // bs:].any()  # past the row: 0


def test_the_harness_signal_on_one_request_is_the_same_number():
    # One request, every row over it: the per-row table is the harness's shared centroid table.
    queries, sums, counts, _, lengths = _inputs(5, 4, 1, 6, 2, 2, 8, 8)
    rows = torch.zeros(4, dtype=torch.int64)
    got = witness.tracker_query_group_mass_scores(queries, sums, counts, rows, lengths, 8)
    cents = (sums / counts.clamp(min=1).unsqueeze(-1))[0].view(6, 2, 8)
    want = witness.query_group_mass_scores(queries, cents, lengths, 8, scale=1.0)
    assert torch.allclose(got, want, atol=1e-6)


def test_bad_inputs_name_the_argument():
    queries, sums, counts, rows, lengths = _inputs(0, 3, 2, 4, 2, 2, 4, 4)
    with pytest.raises(ValueError, match=r"block_sums: expected \[B, N, Hkv \* 4\] with Hkv dividing 4 query heads"):
        witness.tracker_query_group_mass_scores(queries, sums[..., :6], counts, rows, lengths, 4)
    with pytest.raises(ValueError, match=r"block_counts: expected shape \(2, 4\)"):
        witness.tracker_query_group_mass_scores(queries, sums, counts[:1], rows, lengths, 4)
    with pytest.raises(ValueError, match=r"row_to_request: expected shape \(3,\)"):
        witness.tracker_query_group_mass_scores(queries, sums, counts, rows[:2], lengths, 4)
    with pytest.raises(TypeError, match=r"queries: expected dtype"):
        witness.tracker_query_group_mass_scores(queries.to(torch.int64), sums, counts, rows, lengths, 4)
    with pytest.raises(ValueError, match=r"block_size: expected >= 1, got 0"):
        witness.tracker_query_group_mass_scores(queries, sums, counts, rows, lengths, 0)


needs_kernel = pytest.mark.skipif(not cpu_witness.can_use_witness_kernel("cpu"),
                                  reason=f"the C++ witness kernel did not build: {cpu_witness.build_error()}")


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    R=st.integers(0, 9),
    B=st.integers(1, 4),
    N=st.integers(1, 40),
    groups=st.sampled_from([(1, 1), (1, 9), (3, 3), (2, 1), (4, 2)]),
    D=st.sampled_from([1, 5, 8, 17, 64]),
    bs=st.sampled_from([1, 8, 64]),
    strided=st.sampled_from(["dump_column", "transposed", "contiguous"]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    query_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_the_cpu_kernel_matches_the_reference(R, B, N, groups, D, bs, strided, index_dtype, query_dtype, seed):
    """Strided tables as a tracker hands them (``[:, :N]`` of ``[B, N + 1, K]``) or any other
    strides, int32 / int64 indices, bf16 queries: the reference's numbers to fp32 rounding,
    each row summing to ``Hkv`` over its eligible blocks and 0 past them."""
    Hkv, G = groups
    queries, sums, counts, rows, lengths = _inputs(seed, R, B, N, Hkv, G, D, bs)
    queries = queries.to(query_dtype)
    if strided == "dump_column":
        full = torch.zeros(B, N + 1, Hkv * D)
        full[:, :N] = sums
        counts_full = torch.zeros(B, N + 1)
        counts_full[:, :N] = counts
        sums, counts = full[:, :N], counts_full[:, :N]
    elif strided == "transposed":
        sums = sums.transpose(1, 2).contiguous().transpose(1, 2)  # unit stride along blocks, not along K
        counts = counts.t().contiguous().t()  # stride B along blocks
    before = [t.clone() for t in (queries, sums, counts, rows, lengths)]
    args = (queries, sums, counts, rows.to(index_dtype), lengths.to(index_dtype), bs)
    got = cpu_witness.query_group_mass_cpu(*args)
    want = witness.tracker_query_group_mass_scores_reference(*args)
    assert got.dtype == torch.float32 and got.shape == (R, N)
    assert torch.allclose(got, want, atol=2e-6 * Hkv, rtol=1e-5)
    for r in range(R):
        eligible = min(N, (int(lengths[r]) + bs - 1) // bs)
        assert abs(float(got[r, :eligible].sum()) - Hkv) < 1e-4 and not got[r, eligible:].any()
    assert all(torch.equal(a, b) for a, b in zip(before, (queries, sums, counts, rows, lengths)))


@needs_kernel
def test_a_hand_computed_row():
    """One KV head of D = 2, two query heads (mean query (1, 0)), block size 2, length 3: two
    eligible blocks with centroids (1, 0) and (0, 0) (sums over 2 keys), a third ignored.
    Logits 1 and 0: softmax e / (e + 1) and 1 / (e + 1)."""
    queries = torch.tensor([[[2.0, 1.0], [0.0, -1.0]]])
    sums = torch.tensor([[[2.0, 0.0], [0.0, 0.0], [100.0, 100.0]]])
    counts = torch.tensor([[2.0, 2.0, 2.0]])
    got = cpu_witness.query_group_mass_cpu(queries, sums, counts, torch.tensor([0]), torch.tensor([3]), 2)
    e = torch.e
    assert torch.allclose(got, torch.tensor([[e / (e + 1), 1 / (e + 1), 0.0]]))


@needs_kernel
def test_the_kernel_refuses_bad_indices_naming_the_argument():
    queries, sums, counts, rows, lengths = _inputs(0, 3, 2, 4, 2, 2, 4, 4)
    with pytest.raises(RuntimeError, match=r"row_to_request: expected values in \[0, 2\), got 2 at row 1"):
        cpu_witness.query_group_mass_cpu(queries, sums, counts, torch.tensor([0, 2, 1]), lengths, 4)
    with pytest.raises(RuntimeError, match=r"lengths: expected > 0, got 0 at row 2"):
        cpu_witness.query_group_mass_cpu(queries, sums, counts, rows, torch.tensor([1, 2, 0]), 4)
    with pytest.raises(RuntimeError, match=r"block_counts: expected float32 \[2, 4\]"):
        cpu_witness.query_group_mass_cpu(queries, sums, counts[:1], rows, lengths, 4)
    with pytest.raises(RuntimeError, match=r"block_size: expected > 0, got 0"):
        cpu_witness.query_group_mass_cpu(queries, sums, counts, rows, lengths, 0)


def test_cpu_calls_run_the_kernel_when_it_builds_else_the_reference():
    queries, sums, counts, rows, lengths = _inputs(3, 4, 2, 5, 2, 2, 4, 4)
    with mock.patch.object(cpu_witness, "query_group_mass_cpu", return_value="kernel"), \
            mock.patch.object(cpu_witness, "can_use_witness_kernel", return_value=True):
        assert witness.tracker_query_group_mass_scores(queries, sums, counts, rows, lengths, 4) == "kernel"
        # a table the kernel does not take (fp64 sums) runs the reference
        got = witness.tracker_query_group_mass_scores(queries, sums.double(), counts, rows, lengths, 4)
        assert torch.is_tensor(got)
    with mock.patch.object(cpu_witness, "can_use_witness_kernel", return_value=False):
        got = witness.tracker_query_group_mass_scores(queries, sums, counts, rows, lengths, 4)
    want = witness.tracker_query_group_mass_scores_reference(queries, sums, counts, rows, lengths, 4)
    assert torch.equal(got, want)
