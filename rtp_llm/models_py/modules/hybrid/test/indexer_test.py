"""Tests of the indexer's top-k paths with the topology KV policy hooked in.

CPU by default; ``TOPOLOGY_KV_TEST_DEVICE=cuda`` runs the same checks on a GPU
(``//rtp_llm/models_py/modules/hybrid/test:indexer_cuda_manual``). The context-parallel run
across real processes is in ``indexer_cp_test.py``; the environment settings in
``topology_kv_config_test.py``; the torch ops against loops in ``indexer_torch_ops_test.py``;
the live drift tracker in ``topology_kv_drift_test.py``.
"""

from __future__ import annotations

import logging
from unittest import mock

import pytest
import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.test import reference as policy_ref
from rtp_llm.models_py.modules.hybrid.indexer import Indexer, TopologyStepCounters
from rtp_llm.models_py.modules.hybrid.indexer_params import (
    IndexerAttentionInputs,
    IndexerCPParams,
    IndexerFmhaParams,
    IndexerKeyCache,
)
from rtp_llm.models_py.modules.hybrid.test import indexer_ref as ref
from rtp_llm.models_py.modules.hybrid.test.indexer_cases import (
    COMPRESS,
    DIM,
    DISABLED,
    HEADS,
    MERGE,
    ONLY,
    PAGE,
    PLANTED_BLOCKS,
    PREFILL_NEW,
    PREFILL_PREFIX,
    WIDTH,
    assert_maps_to_own_slots,
    assert_rows_valid,
    assert_structural_present,
    engine_rows,
    fill_cache,
    make_tracker,
    policy_settings,
    run_compute_topk,
    to_device,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    ENV_PATHS,
    IndexerPath,
    IndexerTopologySettings,
    WitnessSignal,
    TopologyKVPolicyConfig,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import BlockDriftTracker
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import TopologyRequestContext, TopologyStepPlan
from tools.device_under_test import DEVICE

# ------------------------------------------------------------------ routing, with mocked ops


def _attn(is_prefill, **kw):
    table = torch.zeros(1, 1, dtype=torch.int32)
    return IndexerAttentionInputs(is_prefill=is_prefill, kv_cache_kernel_block_id_device=table, **kw)


@pytest.mark.parametrize(
    "attn,has_cp,path",
    [
        (_attn(False), False, IndexerPath.DECODE),
        (_attn(False), True, IndexerPath.DECODE),  # decode never takes the CP prefill op
        (_attn(True, is_target_verify=True), False, IndexerPath.DECODE),  # multi-token decode
        (_attn(True, is_draft_extend=True), True, IndexerPath.DECODE),
        (_attn(True), True, IndexerPath.CP),
        (_attn(True), False, IndexerPath.PREFILL),
    ],
)
def test_select_path(attn, has_cp, path):
    assert Indexer(HEADS, DIM, topology=DISABLED).select_path(attn, object() if has_cp else None) is path


OPS = {
    IndexerPath.DECODE: "_get_topk_paged",
    IndexerPath.PREFILL: "_get_topk_ragged",
    IndexerPath.CP: "_get_topk_ragged_cp",
}


def _mock_step(path, prefill_case, decode_case, gen):
    """(case, cp_params, row lengths, row offsets, row_to_request, batch) for a path.

    CP takes the rank-1 rows of a two-rank zigzag split."""
    if path is IndexerPath.DECODE:
        case = decode_case
        b = case.batch
        return case, None, b.row_lengths, b.row_offsets, b.row_to_request, b
    case = prefill_case
    b = case.batch
    if path is IndexerPath.PREFILL:
        return case, None, b.row_lengths, b.row_offsets, b.row_to_request, b
    rows = ref.zigzag_cp_rows(PREFILL_NEW, cp_size=2, cp_rank=1)
    cp, _ = ref.build_cp_params(b, rows, cp_size=2, cp_rank=1)
    sub = ref.Batch(
        b.kv_lens, b.block_table, b.num_blocks, b.slot_owner, b.fmha_params, b.attention_inputs,
        [b.row_to_request[g] for g in rows], [b.row_lengths[g] for g in rows], [b.row_offsets[g] for g in rows],
    )
    return case, to_device(cp), sub.row_lengths, sub.row_offsets, sub.row_to_request, sub


@pytest.mark.parametrize("path", list(IndexerPath))
def test_disabled_returns_the_op_output_itself(path, prefill_case, decode_case):
    gen = torch.Generator().manual_seed(1)
    case, cp, lengths, offsets, _, _ = _mock_step(path, prefill_case, decode_case, gen)
    known = engine_rows(lengths, offsets, gen)
    indexer = Indexer(HEADS, DIM, topology=DISABLED)
    cache = IndexerKeyCache(torch.zeros(1, PAGE, DIM))
    with mock.patch.object(Indexer, OPS[path], autospec=True, return_value=known) as op:
        step = TopologyStepCounters()
        out = run_compute_topk(
            indexer, case, cp, kv_cache=cache, drift_tracker=make_tracker(prefill_case), topology_counters=step
        )
    assert out is known
    op.assert_called_once()
    args = op.call_args.args
    assert args[0] is indexer and args[3] is cache
    assert args[4] is case.batch.fmha_params and args[5] is case.batch.attention_inputs
    if path is IndexerPath.CP:  # the CP op gets the rank's CP fields, in the engine's order
        assert args[6] is cp.total_local_ids and args[7] is cp.cu_kv_seqlens_global and args[8] == cp.total_kv_len
        assert args[9:] == (cp.precomputed_ks, cp.precomputed_ke, cp.precomputed_lengths, cp.precomputed_topk_off)
    assert step.by_layer == {0: None}


@pytest.mark.parametrize("path", list(IndexerPath))
@pytest.mark.parametrize("mode", [MERGE, ONLY])
def test_policy_hook_on_mocked_paths(path, mode, prefill_case, decode_case):
    gen = torch.Generator().manual_seed(2)
    case, cp, lengths, offsets, r2r, batch = _mock_step(path, prefill_case, decode_case, gen)
    known = engine_rows(lengths, offsets, gen)
    before = known.clone()
    indexer = Indexer(HEADS, DIM, topology=policy_settings(mode))
    tracker = make_tracker(case)
    fill_cache(indexer, case, tracker)
    with mock.patch.object(Indexer, OPS[path], autospec=True, return_value=known):
        step = TopologyStepCounters()
        out = run_compute_topk(
            indexer, case, cp, kv_cache=IndexerKeyCache(torch.zeros(1, PAGE, DIM)), drift_tracker=tracker,
            topology_counters=step,
        )
    assert torch.equal(known, before), "the op's rows were modified in place"
    assert out.shape == known.shape and out.dtype == known.dtype and out.device == known.device
    drift_rows = tracker.drift_scores().cpu()[torch.tensor(r2r)]
    expected, counters, mismatches = policy_ref.reference_topology_policy(
        known.cpu(), torch.tensor(lengths), mode=mode.value, sink_blocks=1, local_blocks=2, witness_blocks=2,
        block_size=PAGE, max_structural_fraction=0.25, offsets=torch.tensor(offsets), drift=drift_rows,
    )
    assert torch.equal(out.cpu(), expected), "hook did not pass the path's lengths / offsets / drift rows"
    assert not mismatches and int(step.by_layer[0].coordinate_mismatch_fallbacks) == 0
    assert_rows_valid(out, lengths, offsets)
    assert_structural_present(out, lengths, offsets, drift_rows.tolist(), indexer.topology.policy)
    assert_maps_to_own_slots(out, batch, offsets)
    # The planted content shifts are the witnesses of every row long enough to see them.
    for r, length in enumerate(lengths):
        if length > WIDTH:
            row = set(out[r].tolist())
            for b in PLANTED_BLOCKS:
                assert set(range(b * PAGE, (b + 1) * PAGE)) <= row, f"row {r}: witness block {b} missing"


def test_policy_hook_passes_nonzero_offsets():
    # Offsets are 0 in the engine's prefill; the hook must still use the row's own ones.
    gen = torch.Generator().manual_seed(3)
    batch = ref.build_prefill_batch([2030, 0], [30, 8], PAGE, gen, offsets=[1000, 7])
    case = ref.IndexerCase(batch, None, None, None, None, None, torch.zeros(38, HEADS, DIM), torch.zeros(38, HEADS, 1))
    known = engine_rows(batch.row_lengths, batch.row_offsets, gen)
    indexer = Indexer(HEADS, DIM, topology=policy_settings(MERGE))
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        out = run_compute_topk(indexer, case, kv_cache=None)
    assert_rows_valid(out, batch.row_lengths, batch.row_offsets)
    assert_structural_present(out, batch.row_lengths, batch.row_offsets, None, indexer.topology.policy)


def test_compress_mode_gets_contexts_per_request(prefill_case):
    gen = torch.Generator().manual_seed(4)
    b = prefill_case.batch
    known = engine_rows(b.row_lengths, b.row_offsets, gen)
    indexer = Indexer(HEADS, DIM, topology=policy_settings(COMPRESS))
    contexts = [TopologyRequestContext(scaffold_token_ids=tuple(range(n))) for n in (0, 700, 300, 1300)]
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        step = TopologyStepCounters()
        out = run_compute_topk(indexer, prefill_case, kv_cache=None, topology_context=contexts, topology_counters=step)
    scaffold = [contexts[r].scaffold_length for r in b.row_to_request]
    expected, counters, _ = policy_ref.reference_topology_policy(
        known.cpu(), torch.tensor(b.row_lengths), mode=COMPRESS.value, sink_blocks=1, local_blocks=2,
        witness_blocks=2, block_size=PAGE, max_structural_fraction=0.25, scaffold_lengths=scaffold,
    )
    assert torch.equal(out.cpu(), expected)
    assert int(step.by_layer[0].compressed_blocks) == counters["compressed_blocks"] > 0
    # The same through a per-step plan built once from the contexts (what serving passes to
    # every layer): identical rows, counters recorded per layer.
    r2r = torch.tensor(b.row_to_request, device=DEVICE)
    plan = TopologyStepPlan.build(indexer.topology.policy, WIDTH, contexts, num_rows=known.shape[0],
                                  row_to_request=r2r, device=DEVICE)
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        step = TopologyStepCounters()
        out = run_compute_topk(indexer, prefill_case, kv_cache=None, topology_plan=plan, topology_counters=step)
    assert torch.equal(out.cpu(), expected)
    assert int(step.by_layer[0].compressed_blocks) == counters["compressed_blocks"]


def test_switched_off_path_passes_through_and_logs_once(prefill_case, decode_case, caplog):
    gen = torch.Generator().manual_seed(5)
    indexer = Indexer(HEADS, DIM, topology=policy_settings(MERGE, paths={IndexerPath.DECODE}))
    known = engine_rows(prefill_case.batch.row_lengths, prefill_case.batch.row_offsets, gen)
    patch = mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known)
    with caplog.at_level(logging.WARNING), patch:
        for _ in range(3):
            assert run_compute_topk(indexer, prefill_case, kv_cache=None) is known
    records = [r for r in caplog.records if "prefill path" in r.getMessage()]
    assert len(records) == 1 and ENV_PATHS in records[0].getMessage()
    # Another Indexer logs its own skip once too (no shared state).
    other = Indexer(HEADS, DIM, topology=policy_settings(MERGE, paths={IndexerPath.DECODE}))
    with caplog.at_level(logging.WARNING), mock.patch.object(Indexer, "_get_topk_ragged", return_value=known):
        run_compute_topk(other, prefill_case, kv_cache=None)
    assert len([r for r in caplog.records if "prefill path" in r.getMessage()]) == 2


def test_missing_tracker_falls_back_to_recency_and_logs_once(decode_case, caplog):
    gen = torch.Generator().manual_seed(6)
    b = decode_case.batch
    known = engine_rows(b.row_lengths, b.row_offsets, gen)
    indexer = Indexer(HEADS, DIM, topology=policy_settings(MERGE))
    with caplog.at_level(logging.WARNING), mock.patch.object(Indexer, "_get_topk_paged", return_value=known):
        outs = [run_compute_topk(indexer, decode_case, kv_cache=None) for _ in range(2)]
    assert len([r for r in caplog.records if "no drift tracker" in r.getMessage()]) == 1
    assert torch.equal(outs[0], outs[1])
    assert_structural_present(outs[0], b.row_lengths, b.row_offsets, None, indexer.topology.policy)


def test_topology_only_default_serves_recency_without_reading_the_tracker(decode_case, caplog):
    """At the serving defaults (witness_signal auto) topology_only gets no drift
    scores: a passed tracker is not read, nothing is logged, and the rows are plain
    locality (4 sink tokens + the most recent tokens). Explicit key_drift reads it again."""
    b = decode_case.batch
    known = engine_rows(b.row_lengths, b.row_offsets, torch.Generator().manual_seed(8))
    indexer = Indexer(HEADS, DIM, topology=IndexerTopologySettings(policy=TopologyKVPolicyConfig(policy=ONLY)))
    assert indexer.topology.resolved_witness_signal is WitnessSignal.RECENCY
    assert not indexer.reads_drift
    assert not Indexer(HEADS, DIM).reads_drift  # policy disabled: nothing read either
    tracker = make_tracker(decode_case)
    fill_cache(indexer, decode_case, tracker)
    unread = mock.patch.object(BlockDriftTracker, "drift_scores", side_effect=AssertionError("tracker read"))
    with caplog.at_level(logging.WARNING), unread, mock.patch.object(Indexer, "_get_topk_paged", return_value=known):
        with_tracker = run_compute_topk(indexer, decode_case, kv_cache=None, drift_tracker=tracker)
        without = run_compute_topk(indexer, decode_case, kv_cache=None)
    assert not [r for r in caplog.records if "no drift tracker" in r.getMessage()]
    want = [policy_ref.reference_locality_row(n, WIDTH, 4) for n in b.row_lengths]
    assert with_tracker.cpu().tolist() == want and without.cpu().tolist() == want
    # The merge modes' auto and an explicit key_drift read the tracker once per call.
    reads = []
    original = BlockDriftTracker.drift_scores

    def counted(self):
        reads.append(self)
        return original(self)

    for settings in (
        IndexerTopologySettings(policy=TopologyKVPolicyConfig(policy=MERGE)),
        IndexerTopologySettings(policy=TopologyKVPolicyConfig(policy=ONLY), witness_signal="key_drift"),
    ):
        drift_indexer = Indexer(HEADS, DIM, topology=settings)
        assert drift_indexer.topology.resolved_witness_signal is WitnessSignal.KEY_DRIFT
        assert drift_indexer.reads_drift
        reads.clear()
        with mock.patch.object(BlockDriftTracker, "drift_scores", counted), \
                mock.patch.object(Indexer, "_get_topk_paged", return_value=known):
            run_compute_topk(drift_indexer, decode_case, kv_cache=None, drift_tracker=tracker)
        assert reads == [tracker], settings


def test_cp_rank_without_rows_returns_none(prefill_case):
    cp, _ = ref.build_cp_params(prefill_case.batch, [], cp_size=2, cp_rank=0)
    indexer = Indexer(HEADS, DIM, topology=policy_settings(MERGE))
    cache = fill_cache(indexer, prefill_case)
    # A step object holding an earlier layer call's counters: this rank's call must not
    # leave them looking current (the old per-layer attribute went stale exactly here).
    step = TopologyStepCounters()
    run_compute_topk(indexer, prefill_case, kv_cache=cache, topology_counters=step)
    assert step.by_layer[0] is not None
    assert run_compute_topk(indexer, prefill_case, to_device(cp), kv_cache=cache, topology_counters=step) is None
    assert step.by_layer == {0: None}


def test_counters_go_to_the_callers_object_never_to_the_shared_layer(prefill_case, decode_case):
    """Two callers (two threads, two steps) sharing one layer each get their own counters."""
    indexer = Indexer(HEADS, DIM, topology=policy_settings(MERGE))
    assert not hasattr(indexer, "last_topology_counters")
    cache = fill_cache(indexer, prefill_case)
    first, second = TopologyStepCounters(), TopologyStepCounters()
    run_compute_topk(indexer, prefill_case, kv_cache=cache, topology_counters=first)
    short = ref.build_decode_case((5,), HEADS, DIM, PAGE, seed=3)  # one short row: nothing injected
    run_compute_topk(indexer, short, kv_cache=fill_cache(indexer, short), topology_counters=second)
    a, b = first.totals(), second.totals()
    assert a["selected_tokens"] == sum(min(n, WIDTH) for n in prefill_case.batch.row_lengths)
    assert b["selected_tokens"] == 5 and b["structural_injected_tokens"] == 0
    assert first.by_layer[0] is not second.by_layer[0]


def test_tracker_too_small_for_batch_is_an_error(prefill_case):
    indexer = Indexer(HEADS, DIM, topology=policy_settings(MERGE))
    b = prefill_case.batch
    known = engine_rows(b.row_lengths, b.row_offsets, torch.Generator().manual_seed(7))
    small = BlockDriftTracker(2, 8, DIM, device=DEVICE)
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        with pytest.raises(ValueError, match="drift_tracker.num_requests: expected >= 4"):
            run_compute_topk(indexer, prefill_case, kv_cache=None, drift_tracker=small)



# ------------------------------------------------------------------ the whole path with real ops


@pytest.mark.parametrize("mode", [MERGE, ONLY])
def test_real_ops_with_policy_on_prefill_and_decode(mode, prefill_case, decode_case):
    for case in (prefill_case, decode_case):
        b = case.batch
        indexer = Indexer(HEADS, DIM, topology=policy_settings(mode))
        tracker = make_tracker(case)
        cache = fill_cache(indexer, case, tracker)
        learned = run_compute_topk(Indexer(HEADS, DIM, topology=DISABLED), case, kv_cache=cache)
        out = run_compute_topk(indexer, case, kv_cache=cache, drift_tracker=tracker)
        drift_rows = tracker.drift_scores().cpu()[torch.tensor(b.row_to_request)]
        expected, _, _ = policy_ref.reference_topology_policy(
            learned.cpu(), torch.tensor(b.row_lengths), mode=mode.value, sink_blocks=1, local_blocks=2,
            witness_blocks=2, block_size=PAGE, max_structural_fraction=0.25,
            offsets=torch.tensor(b.row_offsets), drift=drift_rows,
        )
        assert torch.equal(out.cpu(), expected)
        assert_rows_valid(out, b.row_lengths, b.row_offsets)
        assert_structural_present(out, b.row_lengths, b.row_offsets, drift_rows.tolist(), indexer.topology.policy)
        assert_maps_to_own_slots(out, b, b.row_offsets)
        for r, length in enumerate(b.row_lengths):
            if length > WIDTH:  # the real high-drift blocks are the witnesses
                n_blocks = (length + PAGE - 1) // PAGE
                # Eligible witnesses: past the sink block, before the two local blocks.
                top = torch.topk(drift_rows[r, 1 : n_blocks - 2], 2).indices + 1
                assert sorted(top.tolist()) == list(PLANTED_BLOCKS)
                for blk in PLANTED_BLOCKS:
                    assert set(range(blk * PAGE, (blk + 1) * PAGE)) <= set(out[r].tolist())


def test_cp_rank_rows_equal_ragged_rows_in_process():
    # Integer-valued data (exact logits): equality pins the CP row bookkeeping, not GEMM
    # batch invariance (cuBLAS may accumulate differently for another row count).
    case = ref.build_prefill_case(
        PREFILL_PREFIX, PREFILL_NEW, HEADS, DIM, PAGE, seed=14, planted_shift_blocks=PLANTED_BLOCKS, integer_valued=True
    )
    b = case.batch
    for settings_ in (DISABLED, policy_settings(MERGE)):
        indexer = Indexer(HEADS, DIM, topology=settings_)
        tracker = make_tracker(case)
        cache = fill_cache(indexer, case, tracker)
        whole = run_compute_topk(indexer, case, kv_cache=cache, drift_tracker=tracker)
        gathered = torch.full_like(whole, -7)
        for rank in range(2):
            rows = ref.zigzag_cp_rows(PREFILL_NEW, cp_size=2, cp_rank=rank)
            cp, local_rows = ref.build_cp_params(b, rows, cp_size=2, cp_rank=rank, pad_rows=2)
            take = torch.tensor([max(g, 0) for g in local_rows])
            local = ref.IndexerCase(b, None, None, None, None, None, case.q[take], case.weights[take])
            out = run_compute_topk(indexer, local, to_device(cp), kv_cache=cache, drift_tracker=tracker)
            assert out.shape == (len(rows), WIDTH)
            gathered[torch.tensor(rows, device=DEVICE)] = out
        assert torch.equal(gathered, whole)



def test_parameter_objects_check_engine_dtypes():
    i32, i64 = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"fmha_params.ks: expected int32"):
        IndexerFmhaParams(expanded_seq_lens=i32, topk_indices_offset=i32, ks=i64, ke=i32)
    with pytest.raises(TypeError, match=r"cp_params.total_local_ids: expected int64"):
        IndexerCPParams(i32, i64, torch.zeros(2, dtype=torch.int32), 0, i32, i32, i32, i32)



# ------------------------------------------------------------------ GPU only: no host sync


@pytest.mark.skipif(DEVICE.type != "cuda", reason="sync detection needs CUDA")
def test_decode_path_with_policy_and_tracker_update_do_not_sync(decode_case):
    indexer = Indexer(HEADS, DIM, topology=policy_settings(MERGE))
    tracker = make_tracker(decode_case)
    cache = fill_cache(indexer, decode_case, tracker)
    q, w = decode_case.q.to(DEVICE), decode_case.weights.to(DEVICE)
    fmha, attn = to_device(decode_case.batch.fmha_params), to_device(decode_case.batch.attention_inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tracker.update(decode_case.keys[:8].to(DEVICE), decode_case.positions[:8].to(DEVICE))
        indexer._compute_topk(q, w, cache, fmha, attn, None, drift_tracker=tracker)
    finally:
        torch.cuda.set_sync_debug_mode("default")


