"""Served query-aware witnesses: ``tracker_query_group_mass_scores`` against the loop reference.

Each row's scores are ``query_group_mass`` of its queries against its own request's block
centroids (a tracker's sums over counts), masked to the row's eligible blocks; chunking the
rows (to bound the gathered table) changes nothing.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv import witness
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
)
def test_scores_match_the_row_by_row_reference(R, B, N, groups, chunk, seed):
    Hkv, G = groups
    D, bs = 3, 4
    queries, sums, counts, rows, lengths = _inputs(seed, R, B, N, Hkv, G, D, bs)
    with mock.patch.object(witness, "_TABLE_CHUNK_ELEMENTS", chunk):
        got = witness.tracker_query_group_mass_scores(
            queries.to(DEVICE), sums.to(DEVICE), counts.to(DEVICE), rows.to(DEVICE), lengths.to(DEVICE), bs).cpu()
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
