"""Shared indexer scans: the share plan's parsing and errors, and sharing layers in the
``Indexer`` on the decode, ragged and CP paths (rows of the scanning layer, the sharing
layer's own policy and drift tracker, nothing of the layer's own keys read)."""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch

from rtp_llm.models_py.modules.hybrid.indexer import Indexer, TopologyStepCounters
from rtp_llm.models_py.modules.hybrid.indexer_share import ENV_INDEXER_SHARE, IndexerSharePlan, SharedTopkRows
from rtp_llm.models_py.modules.hybrid.test import indexer_ref as ref
from rtp_llm.models_py.modules.hybrid.test.indexer_cases import (
    DEVICE,
    DIM,
    DISABLED,
    HEADS,
    MERGE,
    ONLY,
    PAGE,
    PREFILL_NEW,
    fill_cache,
    make_tracker,
    policy_settings,
    run_compute_topk,
    to_device,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import IndexerTopologySettings
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import BlockDriftTracker
from rtp_llm.models_py.modules.hybrid.topology_kv.test import reference as policy_ref

SPARSE = (0, 1, 2, 3, 4, 5)


# ------------------------------------------------------------------ the plan


@pytest.mark.parametrize("text, scanning", [
    ("none", SPARSE), ("", SPARSE), ("  NONE ", SPARSE), ("every:1", SPARSE), ("every:2", (0, 2, 4)),
    ("every:4", (0, 4)), ("every:6", (0,)), ("every:99", (0,)), ("0,3", (0, 3)), (" 0, 1 ,5", (0, 1, 5)),
])
def test_the_plan_as_written(text, scanning):
    plan = IndexerSharePlan.parse(text, SPARSE)
    assert plan.scanning == scanning
    assert plan.shares == (scanning != SPARSE)


def test_each_layer_takes_the_nearest_scanning_layer_below_it():
    plan = IndexerSharePlan.parse("0,3", SPARSE)
    assert [plan.source(x) for x in SPARSE] == [0, 0, 0, 3, 3, 3]
    assert [plan.scans(x) for x in SPARSE] == [True, False, False, True, False, False]
    assert plan.scan_fraction() == 2 / 6
    # every:K counts sparse layers, not layer indices (Gemma 3: only 5, 11 and 17 are sparse).
    gemma = IndexerSharePlan.parse("every:2", (5, 11, 17))
    assert gemma.scanning == (5, 17) and [gemma.source(x) for x in (5, 11, 17)] == [5, 5, 17]
    with pytest.raises(ValueError, match=r"layer_idx: expected one of the sparse layers \[5, 11, 17\], got 6"):
        gemma.source(6)


@pytest.mark.parametrize("text, message", [
    ("every:0", "expected every:K with K >= 1, got K = 0"),
    ("every:-1", "expected 'none', 'every:K' (K >= 1), 'profile' or a comma list"),
    ("every2", "expected 'none', 'every:K' (K >= 1), 'profile' or a comma list"),
    ("1,3", "expected the first scanning layer to be the first sparse layer 0"),
    ("0,7", "layers [7] are not sparse layers of this model"),
    ("0,3,2", "expected ascending layers without repeats"),
    ("0,3,3", "expected ascending layers without repeats"),
    ("0,,3", "expected 'none', 'every:K'"),
    ("all", "expected 'none', 'every:K'"),
])
def test_a_bad_plan_names_the_variable_and_the_value(text, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        IndexerSharePlan.from_env({ENV_INDEXER_SHARE: text}, SPARSE)
    assert str(err.value).startswith(ENV_INDEXER_SHARE)
    assert repr(text) in str(err.value)


def test_the_variable_is_read_and_unset_means_none():
    assert IndexerSharePlan.from_env({}, SPARSE) == IndexerSharePlan.none(SPARSE)
    assert IndexerSharePlan.from_env({ENV_INDEXER_SHARE: "every:3"}, SPARSE).scanning == (0, 3)
    long = "0," + "1," * 50_000 + "2"
    with pytest.raises(ValueError) as err:
        IndexerSharePlan.from_env({ENV_INDEXER_SHARE: long}, SPARSE)
    assert len(str(err.value)) < 1000


@pytest.mark.parametrize("sparse, message", [((), "non-empty"), ((3, 1), "ascending"), ((1, 1), "ascending"),
                                             ((-1, 2), "layer indices >= 0")])
def test_the_sparse_layers_are_checked(sparse, message):
    with pytest.raises(ValueError, match=f"sparse_layers: expected .*{message}"):
        IndexerSharePlan.none(sparse)


def test_an_indexer_with_a_plan_needs_its_layer():
    plan = IndexerSharePlan.parse("every:2", SPARSE)
    with pytest.raises(ValueError, match="layer_idx: expected the layer's index with share="):
        Indexer(HEADS, DIM, topology=DISABLED, share=plan)
    with pytest.raises(ValueError, match="layer_idx: expected one of the sparse layers"):
        Indexer(HEADS, DIM, topology=DISABLED, share=plan, layer_idx=9)
    assert Indexer(HEADS, DIM, topology=DISABLED, share=plan, layer_idx=3).shares_rows_of == 2
    assert Indexer(HEADS, DIM, topology=DISABLED, share=plan, layer_idx=2).shares_rows_of is None
    assert Indexer(HEADS, DIM, topology=DISABLED).shares_rows_of is None


# ------------------------------------------------------------------ sharing layers in a step

PLAN = IndexerSharePlan.parse("0", (0, 1))  # layer 0 scans, layer 1 reuses its rows


def _cp_rank(case, rank):
    """(cp params, the rank's case) of CP rank ``rank`` of 2 over ``case``'s prefill rows."""
    b = case.batch
    rows = ref.zigzag_cp_rows(PREFILL_NEW, cp_size=2, cp_rank=rank)
    cp, local_rows = ref.build_cp_params(b, rows, cp_size=2, cp_rank=rank, pad_rows=1)
    take = torch.tensor([max(g, 0) for g in local_rows])
    local = ref.IndexerCase(b, None, None, None, None, None, case.q[take], case.weights[take])
    sub = ref.Batch(
        b.kv_lens, b.block_table, b.num_blocks, b.slot_owner, b.fmha_params, b.attention_inputs,
        [b.row_to_request[g] for g in rows], [b.row_lengths[g] for g in rows], [b.row_offsets[g] for g in rows],
    )
    return to_device(cp), local, sub


def _steps(prefill_case, decode_case):
    """(name, case for the scanning layer's op, cp params, batch of its rows) per path."""
    cp, local, sub = _cp_rank(prefill_case, 1)
    return [("decode", decode_case, None, decode_case.batch), ("prefill", prefill_case, None, prefill_case.batch),
            ("cp", local, cp, sub)]


def _share_call(indexer, case, cp, holder, **kw):
    """A sharing layer's call: no q, weights or key cache (it reads none of them)."""
    return indexer._compute_topk(None, None, None, to_device(case.batch.fmha_params),
                                 to_device(case.batch.attention_inputs), cp, shared_rows=holder, **kw)


@pytest.mark.parametrize("path", ["decode", "prefill", "cp"])
def test_a_sharing_layer_with_the_policy_off_returns_the_scanning_layers_rows(path, prefill_case, decode_case):
    name, case, cp, _ = next(s for s in _steps(prefill_case, decode_case) if s[0] == path)
    full = prefill_case if path == "cp" else case
    scanning = Indexer(HEADS, DIM, topology=DISABLED, layer_idx=0, share=PLAN)
    sharing = Indexer(HEADS, DIM, topology=DISABLED, layer_idx=1, share=PLAN)
    cache = fill_cache(scanning, full)
    holder = SharedTopkRows()
    rows = run_compute_topk(scanning, case, cp, kv_cache=cache, shared_rows=holder)
    assert holder.by_layer == {0: rows}
    ops = ("_get_topk_paged", "_get_topk_ragged", "_get_topk_ragged_cp")
    with mock.patch.multiple(Indexer, **{op: mock.DEFAULT for op in ops}) as mocked:
        step = TopologyStepCounters()
        out = _share_call(sharing, case, cp, holder, topology_counters=step)
    assert out is rows
    assert not any(m.called for m in mocked.values()), "a sharing layer ran the indexer op"
    assert step.by_layer == {1: None} and holder.by_layer == {0: rows}


@pytest.mark.parametrize("path", ["decode", "prefill", "cp"])
@pytest.mark.parametrize("mode", [MERGE, ONLY])
def test_a_sharing_layer_merges_its_own_structure_into_the_scanning_layers_op_rows(
        path, mode, prefill_case, decode_case):
    name, case, cp, batch = next(s for s in _steps(prefill_case, decode_case) if s[0] == path)
    full = prefill_case if path == "cp" else case
    # The scanning layer runs a policy too: what it leaves for the sharing layer is its op's rows.
    scanning = Indexer(HEADS, DIM, topology=policy_settings(MERGE), layer_idx=0, share=PLAN)
    sharing = Indexer(HEADS, DIM, topology=policy_settings(mode, local_blocks=3, witness_blocks=1),
                      layer_idx=1, share=PLAN)
    own_tracker, other_tracker = make_tracker(full), make_tracker(full)
    cache = fill_cache(scanning, full, other_tracker)
    # The sharing layer's own tracker: fed other keys (its own layer's), so its drift differs.
    layer_keys = torch.flip(full.keys, dims=[0]).contiguous()
    own_tracker.update(layer_keys.to(DEVICE), full.positions.to(DEVICE), full.request_ids.to(DEVICE))
    assert not torch.equal(own_tracker.drift_scores(), other_tracker.drift_scores())
    learned = run_compute_topk(Indexer(HEADS, DIM, topology=DISABLED), case, cp, kv_cache=cache)
    holder = SharedTopkRows()
    merged = run_compute_topk(scanning, case, cp, kv_cache=cache, drift_tracker=other_tracker, shared_rows=holder)
    assert torch.equal(holder.by_layer[0], learned) and not torch.equal(merged, learned)
    before = holder.by_layer[0].clone()
    out = _share_call(sharing, case, cp, holder, drift_tracker=own_tracker)
    assert torch.equal(holder.by_layer[0], before), "the sharing layer changed the shared rows in place"
    drift_rows = own_tracker.drift_scores().cpu()[torch.tensor(batch.row_to_request)]
    expected, _, mismatches = policy_ref.reference_topology_policy(
        learned.cpu(), torch.tensor(batch.row_lengths), mode=mode.value, sink_blocks=1, local_blocks=3,
        witness_blocks=1, block_size=PAGE, max_structural_fraction=0.25, offsets=torch.tensor(batch.row_offsets),
        drift=drift_rows,
    )
    assert not mismatches
    assert torch.equal(out.cpu(), expected)


def test_a_cp_rank_without_rows_shares_none(prefill_case):
    cp, _ = ref.build_cp_params(prefill_case.batch, [], cp_size=2, cp_rank=0)
    cp = to_device(cp)
    scanning = Indexer(HEADS, DIM, topology=policy_settings(MERGE), layer_idx=0, share=PLAN)
    sharing = Indexer(HEADS, DIM, topology=policy_settings(MERGE), layer_idx=1, share=PLAN)
    cache = fill_cache(scanning, prefill_case)
    holder = SharedTopkRows()
    assert run_compute_topk(scanning, prefill_case, cp, kv_cache=cache, shared_rows=holder) is None
    assert holder.by_layer == {0: None}
    step = TopologyStepCounters()
    assert _share_call(sharing, prefill_case, cp, holder, topology_counters=step) is None
    assert step.by_layer == {1: None}


def test_a_sharing_layer_without_the_steps_rows_is_an_error(decode_case):
    sharing = Indexer(HEADS, DIM, topology=DISABLED, layer_idx=3, share=IndexerSharePlan.parse("every:2", SPARSE))
    with pytest.raises(ValueError, match=r"shared_rows: layer 3 reuses the rows of layer 2 \(indexer share "
                                         r"'every:2'\): expected the step's SharedTopkRows, got None"):
        _share_call(sharing, decode_case, None, None)
    holder = SharedTopkRows({0: torch.zeros(1, 1, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"layer 2, which has not run in this step \(layers with rows: \[0\]\)"):
        _share_call(sharing, decode_case, None, holder)
    holder.clear()
    assert holder.by_layer == {}


def test_without_a_plan_nothing_changes(decode_case):
    # share=None (and the plan 'none'): every layer scans, and a holder only collects rows.
    for share in (None, IndexerSharePlan.none((0, 1))):
        indexer = Indexer(HEADS, DIM, topology=DISABLED, layer_idx=1, share=share)
        cache = fill_cache(indexer, decode_case)
        plain = run_compute_topk(Indexer(HEADS, DIM, topology=DISABLED), decode_case, kv_cache=cache)
        holder = SharedTopkRows()
        out = run_compute_topk(indexer, decode_case, kv_cache=cache, shared_rows=holder)
        assert torch.equal(out, plain) and holder.by_layer[1] is out
        assert torch.equal(run_compute_topk(indexer, decode_case, kv_cache=cache), plain)


# ------------------------------------------------------------------ query_group_mass witnesses

QH, QKV, QD = 4, 2, 4  # attention query heads, KV heads, head dim of the query-aware cases


def _attention_tracker(case, seed=0):
    """A tracker fed with random stand-ins for the layer's attention keys ``[tokens, Hkv * D]``."""
    B, MB = case.batch.block_table.shape
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(case.keys.shape[0], QKV * QD, generator=gen)
    tracker = BlockDriftTracker(B, MB, QKV * QD, block_size=PAGE, device=DEVICE)
    tracker.update(keys.to(DEVICE), case.positions.to(DEVICE), case.request_ids.to(DEVICE))
    return tracker


def _reference_query_scores(tracker, queries, batch):
    """Per row: query_group_mass against its request's centroids, by the loop reference."""
    cents = tracker.centroids().cpu()
    B, N, _ = cents.shape
    return torch.tensor([
        policy_ref.reference_query_group_mass_scores(
            queries[r], cents[batch.row_to_request[r]].view(N, QKV, QD), batch.row_lengths[r], PAGE, 1.0)
        for r in range(queries.shape[0])
    ], dtype=torch.float64)


@pytest.mark.parametrize("path", ["decode", "prefill", "cp"])
def test_a_sharing_layer_ranks_its_witnesses_by_its_own_queries(path, prefill_case, decode_case):
    name, case, cp, batch = next(s for s in _steps(prefill_case, decode_case) if s[0] == path)
    full = prefill_case if path == "cp" else case
    structure = dict(local_blocks=1, witness_blocks=2, max_structural_fraction=0.5)
    scanning = Indexer(HEADS, DIM, topology=DISABLED, layer_idx=0, share=PLAN)
    sharing = Indexer(HEADS, DIM, topology=policy_settings(MERGE, witness_signal="query_group_mass", **structure),
                      layer_idx=1, share=PLAN)
    assert sharing.reads_queries and not sharing.reads_drift and not scanning.reads_queries
    cache = fill_cache(scanning, full)
    holder = SharedTopkRows()
    learned = run_compute_topk(scanning, case, cp, kv_cache=cache, shared_rows=holder)
    tracker = _attention_tracker(full)
    R = learned.shape[0]
    queries = torch.randn(R, QH, QD, generator=torch.Generator().manual_seed(1)) * 2
    out = _share_call(sharing, case, cp, holder, drift_tracker=tracker, witness_queries=queries.to(DEVICE))
    scores = _reference_query_scores(tracker, queries, batch)

    def expected(drift):
        rows, _, mismatches = policy_ref.reference_topology_policy(
            learned.cpu(), torch.tensor(batch.row_lengths), mode=MERGE.value, sink_blocks=1, block_size=PAGE,
            offsets=torch.tensor(batch.row_offsets), drift=drift, **structure)
        assert not mismatches
        return rows

    want = expected(scores)
    assert torch.equal(out.cpu(), want)
    # The scores decide: the tracker's key drift (or recency) would select other rows.
    drift_rows = tracker.drift_scores().cpu()[torch.tensor(batch.row_to_request)]
    assert not torch.equal(want, expected(drift_rows)) and not torch.equal(want, expected(None))


def test_query_witnesses_without_queries_fall_back_to_recency_once(decode_case, caplog):
    structure = dict(local_blocks=1, witness_blocks=2, max_structural_fraction=0.5)
    scanning = Indexer(HEADS, DIM, topology=DISABLED, layer_idx=0, share=PLAN)
    sharing = Indexer(HEADS, DIM, topology=policy_settings(MERGE, witness_signal="query_group_mass", **structure),
                      layer_idx=1, share=PLAN)
    holder = SharedTopkRows()
    learned = run_compute_topk(scanning, decode_case, kv_cache=fill_cache(scanning, decode_case), shared_rows=holder)
    b = decode_case.batch
    want, _, _ = policy_ref.reference_topology_policy(
        learned.cpu(), torch.tensor(b.row_lengths), mode=MERGE.value, sink_blocks=1, block_size=PAGE,
        offsets=torch.tensor(b.row_offsets), drift=None, **structure)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            out = _share_call(sharing, decode_case, None, holder, drift_tracker=_attention_tracker(decode_case))
            assert torch.equal(out.cpu(), want)
    logged = [r.getMessage() for r in caplog.records if "query_group_mass" in r.getMessage()]
    assert len(logged) == 1 and "without witness_queries" in logged[0]


def test_query_witnesses_name_a_bad_argument(decode_case):
    sharing = Indexer(HEADS, DIM, topology=policy_settings(MERGE, witness_signal="query_group_mass"),
                      layer_idx=1, share=PLAN)
    scanning = Indexer(HEADS, DIM, topology=DISABLED, layer_idx=0, share=PLAN)
    holder = SharedTopkRows()
    learned = run_compute_topk(scanning, decode_case, kv_cache=fill_cache(scanning, decode_case), shared_rows=holder)
    R = learned.shape[0]
    tracker = _attention_tracker(decode_case)
    queries = torch.randn(R, QH, QD, device=DEVICE)
    before = queries.clone()
    with pytest.raises(ValueError, match=rf"witness_queries: expected float \[{R}, H, D\].*got torch.float32 of "
                                         rf"shape \({R + 1}, {QH}, {QD}\)"):
        _share_call(sharing, decode_case, None, holder, drift_tracker=tracker,
                    witness_queries=torch.randn(R + 1, QH, QD, device=DEVICE))
    with pytest.raises(ValueError, match=r"drift_tracker.key_dim: expected Hkv \* 3 .*got 8"):
        _share_call(sharing, decode_case, None, holder, drift_tracker=tracker,
                    witness_queries=torch.randn(R, QH, 3, device=DEVICE))
    small = BlockDriftTracker(tracker.num_requests, tracker.max_blocks, QKV * QD, block_size=PAGE // 2, device=DEVICE)
    with pytest.raises(ValueError, match=rf"drift_tracker.block_size: expected {PAGE} \(the policy's block\), got"):
        _share_call(sharing, decode_case, None, holder, drift_tracker=small, witness_queries=queries)
    assert torch.equal(queries, before)


def test_query_witnesses_in_compress_mode_keep_each_requests_context(prefill_case):
    from rtp_llm.models_py.modules.hybrid.test.indexer_cases import COMPRESS, engine_rows
    from rtp_llm.models_py.modules.hybrid.topology_kv.policy import TopologyRequestContext

    b = prefill_case.batch
    known = engine_rows(b.row_lengths, b.row_offsets, torch.Generator().manual_seed(4))
    indexer = Indexer(HEADS, DIM, topology=policy_settings(COMPRESS, witness_signal="query_group_mass"))
    contexts = [TopologyRequestContext(scaffold_token_ids=tuple(range(n))) for n in (0, 700, 300, 1300)]
    tracker = _attention_tracker(prefill_case)
    queries = torch.randn(known.shape[0], QH, QD, generator=torch.Generator().manual_seed(2)) * 2
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        out = run_compute_topk(indexer, prefill_case, kv_cache=None, topology_context=contexts,
                               drift_tracker=tracker, witness_queries=queries.to(DEVICE))
    expected, counters, _ = policy_ref.reference_topology_policy(
        known.cpu(), torch.tensor(b.row_lengths), mode=COMPRESS.value, sink_blocks=1, local_blocks=2,
        witness_blocks=2, block_size=PAGE, max_structural_fraction=0.25,
        scaffold_lengths=[contexts[r].scaffold_length for r in b.row_to_request],
        drift=_reference_query_scores(tracker, queries, b),
    )
    assert counters["compressed_blocks"] > 0
    assert torch.equal(out.cpu(), expected)


# ------------------------------------------------------------------ structure on the sharing layers only


def test_structure_layers_sharing_leaves_a_scanning_layer_its_op_rows(decode_case):
    from rtp_llm.models_py.modules.hybrid.topology_kv.step_record import PolicySkipReason

    structure = dict(local_blocks=1, witness_blocks=2, max_structural_fraction=0.5)
    settings = policy_settings(MERGE, witness_signal="query_group_mass", structure_layers="sharing", **structure)
    scanning = Indexer(HEADS, DIM, topology=settings, layer_idx=0, share=PLAN)
    sharing = Indexer(HEADS, DIM, topology=settings, layer_idx=1, share=PLAN)
    assert not scanning.topology.enabled and not scanning.reads_queries
    assert sharing.topology.enabled and sharing.reads_queries
    tracker = _attention_tracker(decode_case)
    holder, step = SharedTopkRows(), TopologyStepCounters()
    R = len(decode_case.batch.row_lengths)
    queries = torch.randn(R, QH, QD, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows = run_compute_topk(scanning, decode_case, kv_cache=fill_cache(scanning, decode_case), shared_rows=holder,
                            drift_tracker=tracker, witness_queries=queries, topology_counters=step)
    assert rows is holder.by_layer[0]  # the op's rows themselves: no policy ran
    assert step.by_layer[0] is None and step.calls[0].skip_reason is PolicySkipReason.SCANNING_LAYER
    out = _share_call(sharing, decode_case, None, holder, drift_tracker=tracker, witness_queries=queries,
                      topology_counters=step)
    assert not torch.equal(out, rows) and step.calls[1].skip_reason is None


@pytest.mark.parametrize("share, what", [(None, "no plan was given"),
                                         (IndexerSharePlan.none((0, 1)), "the plan 'none' shares no layer")])
def test_structure_layers_sharing_without_sharing_layers_is_an_error(share, what):
    settings = policy_settings(MERGE, structure_layers="sharing")
    with pytest.raises(ValueError, match=re.escape(
            "structure_layers (RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS): expected shared indexer scans "
            f"(RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE): 'sharing' runs the policy only on layers that reuse another "
            f"layer's rows, but {what}")):
        Indexer(HEADS, DIM, topology=settings, layer_idx=0, share=share)
    # With the policy off the setting changes nothing and needs no plan.
    off = IndexerTopologySettings(structure_layers="sharing")
    assert not Indexer(HEADS, DIM, topology=off, layer_idx=0, share=share).topology.enabled


# ------------------------------------------------------------------ structure on listed layers only


def test_structure_layers_listed_runs_the_policy_only_there(decode_case):
    from rtp_llm.models_py.modules.hybrid.topology_kv.step_record import PolicySkipReason

    plan = IndexerSharePlan.parse("0", (0, 1, 2))  # layer 0 scans, layers 1 and 2 reuse its rows
    structure = dict(local_blocks=1, witness_blocks=2, max_structural_fraction=0.5)
    settings = policy_settings(MERGE, witness_signal="query_group_mass", structure_layers="2", **structure)
    layers = [Indexer(HEADS, DIM, topology=settings, layer_idx=i, share=plan) for i in range(3)]
    assert [x.topology.enabled for x in layers] == [False, False, True]
    assert [x.reads_queries for x in layers] == [False, False, True]
    tracker = _attention_tracker(decode_case)
    holder, step = SharedTopkRows(), TopologyStepCounters()
    R = len(decode_case.batch.row_lengths)
    queries = torch.randn(R, QH, QD, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kw = dict(drift_tracker=tracker, witness_queries=queries, topology_counters=step)
    rows = run_compute_topk(layers[0], decode_case, kv_cache=fill_cache(layers[0], decode_case), shared_rows=holder,
                            **kw)
    assert rows is holder.by_layer[0]  # the op's rows themselves: no policy ran
    unlisted = _share_call(layers[1], decode_case, None, holder, **kw)
    assert torch.equal(unlisted, rows)  # a sharing layer not listed serves the reused rows as they are
    listed = _share_call(layers[2], decode_case, None, holder, **kw)
    assert not torch.equal(listed, rows)
    assert [step.calls[i].skip_reason for i in range(3)] == [PolicySkipReason.UNLISTED_LAYER,
                                                             PolicySkipReason.UNLISTED_LAYER,
                                                             None]
    # The same list with a scanning layer listed: it merges its own op rows.
    scanning_listed = policy_settings(MERGE, witness_signal="query_group_mass", structure_layers="0,2", **structure)
    assert Indexer(HEADS, DIM, topology=scanning_listed, layer_idx=0, share=plan).topology.enabled


def test_structure_layers_listed_needs_no_sharing_but_checks_the_plans_layers():
    settings = policy_settings(MERGE, structure_layers="1")
    assert not Indexer(HEADS, DIM, topology=settings, layer_idx=0).topology.enabled
    assert Indexer(HEADS, DIM, topology=settings, layer_idx=1).topology.enabled
    assert Indexer(HEADS, DIM, topology=settings, layer_idx=1, share=IndexerSharePlan.none((0, 1))).topology.enabled
    with pytest.raises(ValueError, match=re.escape(
            "structure_layers (RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS): expected sparse layers of the model [0, 1], "
            "got [5, 7] in 1,5,7")):
        Indexer(HEADS, DIM, topology=policy_settings(MERGE, structure_layers="7,1,5"), layer_idx=0, share=PLAN)
