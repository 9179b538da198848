"""The torch implementation of the engine's indexer ops against the per-row loop references.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid import indexer_torch_ops as ops
from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.test import indexer_ref as ref
from rtp_llm.models_py.modules.hybrid.test.indexer_cases import (
    DECODE_KV_LENS,
    DIM,
    DISABLED,
    HEADS,
    PAGE,
    WIDTH,
    assert_maps_to_own_slots,
    assert_rows_valid,
    assert_same_sets_up_to_near_ties,
    fill_cache,
    run_compute_topk,
)
from tools.device_under_test import DEVICE

# ------------------------------------------------------------------ reference ops vs per-row loops


@pytest.mark.parametrize("fp8", [False, True])
def test_ragged_op_matches_loop_reference(fp8, prefill_case):
    case, b = prefill_case, prefill_case.batch
    indexer = Indexer(HEADS, DIM, fp8_emulation=fp8, topology=DISABLED)
    out = run_compute_topk(indexer, case, kv_cache=fill_cache(Indexer(HEADS, DIM, topology=DISABLED), case))
    keys = case.keys  # ragged, request-major: the same buffer gather_ragged_keys builds
    expected, scores = ref.reference_ragged_topk(
        case.q, case.weights, keys, b.fmha_params.ks.cpu(), b.fmha_params.expanded_seq_lens.cpu(),
        b.fmha_params.topk_indices_offset.cpu(), WIDTH, fp8_emulation=fp8,
    )
    assert_rows_valid(out, b.row_lengths, b.row_offsets)
    assert_same_sets_up_to_near_ties(out, expected, scores, b.row_lengths)
    assert_maps_to_own_slots(out, b, b.row_offsets)


@pytest.mark.parametrize("rows_per_request", [None, (1, 1, 2, 1, 3, 1, 1, 2)])  # None: one row each
def test_paged_op_matches_loop_reference(rows_per_request):
    case = ref.build_decode_case(DECODE_KV_LENS, HEADS, DIM, PAGE, seed=12, rows_per_request=rows_per_request)
    b = case.batch
    cache = fill_cache(Indexer(HEADS, DIM, topology=DISABLED), case)
    out = run_compute_topk(Indexer(HEADS, DIM, fp8_emulation=True, topology=DISABLED), case, kv_cache=cache)
    expected, scores = ref.reference_paged_topk(
        case.q, case.weights, cache.k_cache.cpu(), b.block_table, b.row_lengths, b.row_to_request, WIDTH,
        fp8_emulation=True,
    )
    assert_rows_valid(out, b.row_lengths, b.row_offsets)
    assert_same_sets_up_to_near_ties(out, expected, scores, b.row_lengths)
    assert_maps_to_own_slots(out, b, b.row_offsets)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    width=st.integers(1, 24),
    offset=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_topk_transform_convention(lengths, width, offset, seed):
    gen = torch.Generator().manual_seed(seed)
    Lw = max(lengths) + 3
    # Scores on a coarse grid so ties happen; the tie rule (lower position) must hold.
    scores = torch.randint(-3, 4, (len(lengths), Lw), generator=gen).to(torch.float32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    offs = torch.full((len(lengths),), offset, dtype=torch.int32)
    out = ops.topk_from_window_scores(scores.to(DEVICE), lens.to(DEVICE), offs.to(DEVICE), width)
    expected = [ref.reference_topk_row(scores[r].tolist(), n, offset, width) for r, n in enumerate(lengths)]
    assert out.dtype == torch.int32 and out.cpu().tolist() == expected


def test_fp8_round_trip_matches_loop_and_is_idempotent():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 3, 256, generator=gen) * torch.logspace(-3, 2, 256)
    x[0, 0] = 0.0  # an all-zero token stays zero
    y = ops.fp8_e4m3_round_trip(x.to(DEVICE)).cpu()
    assert torch.equal(y, ref.reference_fp8_round_trip(x))
    assert torch.equal(ops.fp8_e4m3_round_trip(y.to(DEVICE)).cpu(), y)
    assert bool((y[0, 0] == 0).all())


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_op_row_chunks_give_the_whole_batch_rows(fp8, monkeypatch):
    """The paged op gathers keys in row chunks bounded by ``_GATHER_ELEMENT_BUDGET``; chunks
    of one and of three rows (a budget that splits the batch unevenly) return the rows of one
    chunk over the whole batch, and those match the per-row loop reference."""
    case = ref.build_decode_case(DECODE_KV_LENS, HEADS, DIM, PAGE, seed=31, rows_per_request=(1, 2, 1, 3, 1, 1, 2, 1))
    b = case.batch
    cache = fill_cache(Indexer(HEADS, DIM, topology=DISABLED), case)
    row_to_request = torch.tensor(b.row_to_request, dtype=torch.int64, device=case.q.device)
    args = (case.q, case.weights, cache.k_cache, b.block_table.to(case.q.device), b.fmha_params.expanded_seq_lens,
            row_to_request)
    R = case.q.shape[0]
    Lmax = b.block_table.shape[1] * cache.k_cache.shape[1]
    whole = ops.paged_indexer_topk(*args, WIDTH, fp8)
    assert ops._row_chunk(R, HEADS, Lmax, DIM) == R  # this case fits one chunk by default
    for rows_per_chunk in (1, 3):
        monkeypatch.setattr(ops, "_GATHER_ELEMENT_BUDGET", rows_per_chunk * Lmax * DIM)
        assert ops._row_chunk(R, HEADS, Lmax, DIM) == rows_per_chunk
        chunked = ops.paged_indexer_topk(*args, WIDTH, fp8)
        assert torch.equal(chunked, whole), rows_per_chunk
    expected, scores = ref.reference_paged_topk(
        case.q.cpu(), case.weights.cpu(), cache.k_cache.cpu(), b.block_table.cpu(), b.row_lengths,
        b.row_to_request, WIDTH, fp8_emulation=fp8,
    )
    assert_same_sets_up_to_near_ties(whole, expected, scores, b.row_lengths)
