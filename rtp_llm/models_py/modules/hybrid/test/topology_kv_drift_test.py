"""The live BlockDriftTracker against the whole-cache centroid/drift functions.
"""

from __future__ import annotations

import pytest
import torch

from rtp_llm.models_py.modules.hybrid.test import indexer_ref as ref
from rtp_llm.models_py.modules.hybrid.test.indexer_cases import (
    DIM,
    PAGE,
    make_tracker,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import (
    BlockDriftTracker,
    DriftMetric,
    block_drift_scores,
    block_key_centroids,
)
from tools.device_under_test import DEVICE

# ------------------------------------------------------------------ live drift


def _keys_for(case, request):
    sel = case.request_ids == request
    return case.keys[sel]


def test_tracker_drift_matches_complete_block_reference(prefill_case):
    case = prefill_case
    tracker = make_tracker(case)
    # Fill out of order: new tokens first, then the prefix in two halves.
    order = [~case.is_prefix, case.is_prefix & (case.positions % 2 == 0), case.is_prefix & (case.positions % 2 == 1)]
    for part in order:
        tracker.update(case.keys[part].to(DEVICE), case.positions[part].to(DEVICE), case.request_ids[part].to(DEVICE))
    drift = tracker.drift_scores().cpu()
    MB = tracker.max_blocks
    for i, n in enumerate(case.batch.kv_lens):
        expected = ref.reference_complete_block_drift(_keys_for(case, i), n, PAGE, MB)
        expected = torch.tensor(expected, dtype=torch.float32)
        torch.testing.assert_close(drift[i], expected, rtol=1e-4, atol=1e-4, msg=f"request {i}")
    # Centroids of every block equal the schedule library's (partial blocks too).
    cents = tracker.centroids().cpu()
    k = _keys_for(case, 3)
    n_blocks = (k.shape[0] + PAGE - 1) // PAGE
    torch.testing.assert_close(cents[3, :n_blocks], block_key_centroids(k.unsqueeze(1), PAGE).squeeze(1))


def test_tracker_decode_token_by_token_and_cosine():
    gen = torch.Generator().manual_seed(10)
    L = 5 * PAGE + 7
    keys = torch.randn(L, 2, DIM // 2, generator=gen)  # [T, H, D] keys are flattened
    tracker = BlockDriftTracker(1, 8, DIM, metric=DriftMetric.COSINE, device=DEVICE)
    tracker.update(keys[:100].to(DEVICE), torch.arange(100, device=DEVICE))
    for t in range(100, L):  # one decode token at a time
        tracker.update(keys[t : t + 1].to(DEVICE), torch.tensor([t], device=DEVICE))
    want = block_drift_scores(block_key_centroids(keys[: 5 * PAGE], PAGE), DriftMetric.COSINE)  # 5 complete blocks
    got = tracker.drift_scores().cpu()[0]
    torch.testing.assert_close(got[:5], want.to(torch.float32), rtol=1e-5, atol=1e-5)
    assert bool((got[5:] == 0).all()), "the partial block (and beyond) must score 0"


def test_tracker_ignores_out_of_range_positions_and_resets():
    tracker = BlockDriftTracker(2, 2, 4, block_size=4, device=DEVICE)
    keys = torch.arange(40, dtype=torch.float32).view(10, 4).to(DEVICE)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, -1], device=DEVICE)  # 8: past 2 blocks of 4; -1: padding
    tracker.update(keys, pos, torch.ones(10, dtype=torch.int64, device=DEVICE))
    assert tracker.block_counts().cpu().tolist() == [[0, 0], [4, 4]]
    assert float(tracker.drift_scores()[1, 1]) == pytest.approx(float((keys[4:8].mean(0) - keys[0:4].mean(0)).norm()))
    tracker.reset(torch.tensor([1], device=DEVICE))
    assert float(tracker.block_counts().sum()) == 0 and float(tracker.drift_scores().abs().sum()) == 0
    with pytest.raises(ValueError, match="positions / request_ids"):
        tracker.update(keys, pos[:3])
    with pytest.raises(ValueError, match="max_blocks"):
        BlockDriftTracker(1, 0, 4)




def test_clone_is_an_independent_copy(prefill_case):
    case = prefill_case
    tracker = make_tracker(case)
    part = case.request_ids == 1
    tracker.update(case.keys[part].to(DEVICE), case.positions[part].to(DEVICE), case.request_ids[part].to(DEVICE))
    copy = tracker.clone()
    assert torch.equal(copy.drift_scores(), tracker.drift_scores())
    assert torch.equal(copy.centroids(), tracker.centroids())
    assert (copy.block_size, copy.metric, copy.max_blocks) == (tracker.block_size, tracker.metric, tracker.max_blocks)
    before = tracker.drift_scores().clone()
    copy.reset()
    assert torch.equal(tracker.drift_scores(), before), "resetting the clone changed the original"
    assert not bool(copy.block_counts().any())
