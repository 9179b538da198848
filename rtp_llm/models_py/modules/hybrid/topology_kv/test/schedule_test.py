"""The serving schedule (``topology_kv.schedule``): witness blocks and block expansion.

The policy core schedules sink and local blocks itself and asks
:func:`witness_blocks_unchecked` only for the witness columns; these tests pin that
function and :func:`expand_blocks_unchecked` against the plain references, by hand and
over random lengths, block sizes and score tables with ties.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv.schedule import (
    expand_blocks_unchecked,
    score_sort_keys,
    witness_blocks_unchecked,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.test.reference import (
    reference_prioritized_blocks,
    reference_token_indices,
)
from tools.device_under_test import DEVICE


def _t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _bounds(lengths, sink_blocks, local_blocks, block_size):
    """``(sink_end, local_start)`` as the policy core derives them (int64 ``[R]`` each)."""
    nb = (lengths.clamp(min=1) - 1) // block_size + 1
    sink_end = torch.clamp(nb, max=sink_blocks)
    return sink_end, torch.maximum(torch.clamp(nb - local_blocks, min=0), sink_end)


def test_witnesses_by_score_ties_to_lower_block_hand_computed():
    # Length 40, blocks of 4: 10 blocks; sink block 0, locals 8 and 9; eligible 1..7.
    drift = _t([[0.0, 5.0, 1.0, 5.0, 2.0, 9.0, 0.0, 3.0, 99.0, 99.0]], torch.float32)
    sink_end, local_start = _bounds(_t([40]), 1, 2, 4)
    assert witness_blocks_unchecked(sink_end, local_start, 3, drift).tolist() == [[5, 1, 3]]


def test_witnesses_without_scores_are_the_most_recent_eligible_blocks():
    sink_end, local_start = _bounds(_t([40, 9]), 1, 2, 4)
    # Row 2 (length 9: blocks 0..2) has no eligible block between sink 0 and locals 1, 2.
    assert witness_blocks_unchecked(sink_end, local_start, 3).tolist() == [[7, 6, 5], [-1, -1, -1]]


def test_score_keys_order_nan_as_minus_inf_and_signed_zero_as_equal():
    scores = _t([float("nan"), -0.0, 0.0, -1.0, float("inf")], torch.float32)
    keys = score_sort_keys(scores, _t([0, 1, 2, 3, 4]))
    assert torch.argsort(keys).tolist() == [0, 3, 1, 2, 4]


def test_expand_blocks_hand_computed():
    # Blocks of 4, length 10: block 2 holds tokens 8, 9 only; -1 columns stay empty.
    toks = expand_blocks_unchecked(_t([[2, -1, 0]]), _t([10]), 4)
    assert toks.tolist() == [[8, 9, -1, -1, -1, -1, -1, -1, 0, 1, 2, 3]]


@settings(max_examples=120, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    sink_blocks=st.integers(0, 3),
    local_blocks=st.integers(0, 3),
    witness_blocks=st.integers(0, 5),
    block_size=st.sampled_from([1, 3, 16, 64]),
    use_drift=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_witnesses_and_expansion_equal_the_reference(lengths, sink_blocks, local_blocks, witness_blocks,
                                                     block_size, use_drift, seed):
    L = _t(lengths)
    n = -(-max(lengths) // block_size)
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values: ties are common, and must go to the lower block.
    drift = torch.randint(0, 4, (len(lengths), n), generator=gen).float().to(DEVICE) if use_drift else None
    sink_end, local_start = _bounds(L, sink_blocks, local_blocks, block_size)
    wit = witness_blocks_unchecked(sink_end, local_start, witness_blocks, drift).cpu().tolist()
    for r, length in enumerate(lengths):
        want = reference_prioritized_blocks(length, sink_blocks, local_blocks, witness_blocks, block_size,
                                            None if drift is None else drift[r].tolist())
        # The reference lists the sinks and locals it found; a short row has fewer.
        n_sink = min(sink_blocks, -(-length // block_size))
        n_local = min(local_blocks, -(-length // block_size) - n_sink)
        want_wit = want[n_sink + n_local:]
        assert [b for b in wit[r] if b >= 0] == want_wit, (r, length)
        assert all(b == -1 for b in wit[r][len(want_wit):])
        toks = expand_blocks_unchecked(_t([wit[r]]), _t([length]), block_size)[0].tolist()
        assert sorted(t for t in toks if t >= 0) == reference_token_indices(length, want_wit, block_size)


def test_no_witness_columns():
    sink_end, local_start = _bounds(_t([100]), 1, 1, 4)
    assert witness_blocks_unchecked(sink_end, local_start, 0, _t([[1.0] * 25], torch.float32)).shape == (1, 0)
    assert witness_blocks_unchecked(sink_end, local_start, 0).shape == (1, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_scores_of_any_float_dtype_rank_as_fp32(dtype):
    drift = _t([[0.0, 1.0, 3.0, 2.0, 0.0, 0.0]], torch.float32)
    sink_end, local_start = _bounds(_t([24]), 1, 1, 4)
    want = witness_blocks_unchecked(sink_end, local_start, 2, drift)
    assert torch.equal(witness_blocks_unchecked(sink_end, local_start, 2, drift.to(dtype)), want)
    assert want.tolist() == [[2, 3]]
