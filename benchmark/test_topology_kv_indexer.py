"""Tests of the indexer's top-k paths with the topology KV policy hooked in.

CPU by default; ``TOPOLOGY_KV_TEST_DEVICE=cuda`` runs the same checks on a GPU
(``//benchmark:topology_kv_indexer_cuda_manual``). The context-parallel run across real
processes is in ``test_topology_kv_indexer_cp.py``.
"""

from __future__ import annotations

import logging
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmark import indexer_reference as ref
from benchmark import topology_kv_reference as policy_ref
from rtp_llm.models_py.modules.hybrid import indexer_torch_ops as ops
from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.indexer_params import (
    IndexerAttentionInputs,
    IndexerCPParams,
    IndexerFmhaParams,
    IndexerKeyCache,
)
from rtp_llm.models_py.modules.hybrid.topology_kv_config import (
    ALL_PATHS,
    ENV_LOCAL_BLOCKS,
    ENV_MAX_STRUCTURAL_FRACTION,
    ENV_MISMATCH_ACTION,
    ENV_PATHS,
    ENV_POLICY,
    ENV_SINK_BLOCKS,
    ENV_SINK_TOKENS,
    ENV_WITNESS_BLOCKS,
    IndexerPath,
    IndexerTopologySettings,
)
from rtp_llm.models_py.modules.hybrid.topology_kv_drift import BlockDriftTracker
from rtp_llm.models_py.modules.hybrid.topology_kv_config import (
    CoordinateMismatchAction,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv_policy import TopologyRequestContext
from rtp_llm.models_py.modules.hybrid.topology_kv_drift import (
    block_drift_scores,
    block_key_centroids,
    DriftMetric,
)

DEVICE = torch.device(os.environ.get("TOPOLOGY_KV_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("TOPOLOGY_KV_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

PAGE = 64  # the engine's KV page
WIDTH = 2048  # DeepSeek-V3.2 index_topk
HEADS, DIM = 4, 32  # small indexer (the real one is 64 x 128) keeps the CPU run fast
# Prefill requests (prefix, new tokens): causal lengths 1..40 (short); 2001..2060 and
# 2041..2050 cross the width (2047 and 2048 are the last short rows, 2049 the first long
# one); 4951..5000 are far beyond it.
PREFILL_PREFIX = (0, 2000, 2040, 4950)
PREFILL_NEW = (40, 60, 10, 50)
# Decode KV lengths: a one-token request, partly filled / exactly full / just-spilled
# pages (63, 64, 65), the width edges and a long context.
DECODE_KV_LENS = (1, 63, 64, 65, 2047, 2048, 2049, 5000)
# High-drift blocks planted in every request long enough to hold them (content shifts).
PLANTED_BLOCKS = (10, 20)

MERGE = TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE
COMPRESS = TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE
ONLY = TopologyKVPolicyMode.TOPOLOGY_ONLY


def _settings(mode=MERGE, paths=ALL_PATHS, **kw):
    base = dict(
        sink_blocks=1,
        local_blocks=2,
        witness_blocks=2,
        block_size=PAGE,
        max_structural_fraction=0.25,
        coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED,
        sink_tokens=None,  # whole sink blocks: the layout these cases were written for
    )
    base.update(kw)
    return IndexerTopologySettings(policy=TopologyKVPolicyConfig(policy=mode, **base), paths=frozenset(paths))


DISABLED = IndexerTopologySettings()


def _to(obj):
    """Move every tensor field of a parameter dataclass to DEVICE."""
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(DEVICE))
    return obj


# ------------------------------------------------------------------ shared checks


def physical_slots(indices: torch.Tensor, row_to_request: torch.Tensor, block_table: torch.Tensor, page: int):
    """The sparse-attention mapping: ``block_table[req, tok // page] * page + tok % page``; -1 stays -1."""
    tok = indices.to(torch.int64)
    valid = tok >= 0
    col = torch.where(valid, torch.div(tok, page, rounding_mode="floor"), 0)
    phys = block_table.to(torch.int64)[row_to_request.to(torch.int64).unsqueeze(1), col]  # [R, W]
    return torch.where(valid, phys * page + tok % page, -1), torch.where(valid, phys, 0)


def assert_rows_valid(out, lengths, offsets, width=WIDTH):
    """Contract: int32 [R, W]; entries in [off, off + len) or -1; unique; -1 tail."""
    assert out.dtype == torch.int32 and out.shape == (len(lengths), width), (out.dtype, out.shape)
    for r, row in enumerate(out.cpu().tolist()):
        n = sum(1 for v in row if v >= 0)
        assert all(v >= 0 for v in row[:n]) and all(v == -1 for v in row[n:]), f"row {r}: -1 not a tail"
        valid = row[:n]
        assert len(set(valid)) == n, f"row {r}: duplicate entries"
        lo, hi = offsets[r], offsets[r] + lengths[r]
        bad = [v for v in valid if not lo <= v < hi]
        assert not bad, f"row {r}: {bad[:5]} outside [{lo}, {hi})"
        assert n == min(lengths[r], width), f"row {r}: {n} valid entries, expected {min(lengths[r], width)}"


def assert_structural_present(out, lengths, offsets, drift_rows, config):
    """Every configured sink/local/witness token (< length) is in its row."""
    for r, row in enumerate(out.cpu().tolist()):
        blocks = policy_ref.reference_prioritized_blocks(
            lengths[r], config.sink_blocks, config.local_blocks, config.witness_blocks, config.block_size,
            None if drift_rows is None else drift_rows[r],
        )
        want = {t + offsets[r] for t in policy_ref.reference_token_indices(lengths[r], blocks, config.block_size)}
        missing = want - set(row)
        assert not missing, f"row {r} (length {lengths[r]}): structural tokens missing, e.g. {sorted(missing)[:5]}"


def assert_maps_to_own_slots(out, batch, offsets):
    """Every entry maps to a physical slot that holds that very token of the row's request."""
    r2r = torch.tensor(batch.row_to_request)
    rel = torch.where(out.cpu() >= 0, out.cpu().to(torch.int64) - torch.tensor(offsets).unsqueeze(1), -1)
    slots, phys = physical_slots(rel, r2r, batch.block_table, PAGE)
    assert bool(((slots >= 0) == (rel >= 0)).all()), "a valid entry mapped to -1 (or -1 to a slot)"
    assert bool((phys[rel >= 0] >= 0).all()), "a valid entry maps to an unallocated block"
    for r, (row_slots, row_tok) in enumerate(zip(slots.tolist(), rel.tolist())):
        req = batch.row_to_request[r]
        for s, t in zip(row_slots, row_tok):
            if t >= 0:
                owner = batch.slot_owner.get(s)
                assert owner == (req, t), f"row {r}: token {t} of request {req} -> slot {s} owned by {owner}"


def assert_same_sets_up_to_near_ties(out, expected, score_rows, lengths, rel_tol=1e-4):
    """Short rows exactly equal; long rows equal as sets, except swaps of near-equal scores
    (fp32 logits against the float64 loop). Offsets are 0 here."""
    for r, (got, want) in enumerate(zip(out.cpu().tolist(), expected.tolist())):
        if lengths[r] <= WIDTH:
            assert got == want, f"row {r}: short row differs"
            continue
        if set(got) == set(want):
            continue
        scores = score_rows[r]
        cutoff = min(float(scores[v]) for v in want if v >= 0)
        tol = rel_tol * float(scores.abs().max())
        for v in set(got) ^ set(want):
            assert abs(float(scores[v]) - cutoff) <= tol, f"row {r}: {v} differs and is not a near tie"


def engine_rows(lengths, offsets, gen, width=WIDTH):
    """Learned rows with known coordinates in the engine's convention: a short row is its
    whole range ascending; a long row ``width`` random distinct positions, shuffled."""
    rows = []
    for length, off in zip(lengths, offsets):
        toks = list(range(length)) if length <= width else torch.randperm(length, generator=gen)[:width].tolist()
        rows.append([t + off for t in toks] + [-1] * (width - len(toks)))
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def make_tracker(case, *, max_blocks=None, metric=DriftMetric.L2):
    B, MB = case.batch.block_table.shape
    return BlockDriftTracker(B, max_blocks or MB, DIM, block_size=PAGE, metric=metric, device=DEVICE)


def fill_cache(indexer, case, tracker=None):
    """Write the prefix keys, then this step's keys, as the engine fills the pool."""
    pool = IndexerKeyCache(torch.zeros(case.batch.num_blocks, PAGE, DIM, device=DEVICE))
    for part in (case.is_prefix, ~case.is_prefix):
        indexer.write_keys(
            case.keys[part].to(DEVICE),
            pool,
            case.slots[part].to(DEVICE),
            drift_tracker=tracker,
            positions=case.positions[part].to(DEVICE),
            request_ids=case.request_ids[part].to(DEVICE),
        )
    return pool


@pytest.fixture(scope="module")
def prefill_case():
    return ref.build_prefill_case(
        PREFILL_PREFIX, PREFILL_NEW, HEADS, DIM, PAGE, seed=11, planted_shift_blocks=PLANTED_BLOCKS
    )


@pytest.fixture(scope="module")
def decode_case():
    return ref.build_decode_case(DECODE_KV_LENS, HEADS, DIM, PAGE, seed=12, planted_shift_blocks=PLANTED_BLOCKS)


def _run(indexer, case, cp_params=None, *, kv_cache, **kw):
    return indexer._compute_topk(
        case.q.to(DEVICE),
        case.weights.to(DEVICE),
        kv_cache,
        _to(case.batch.fmha_params),
        _to(case.batch.attention_inputs),
        cp_params,
        **kw,
    )


# ------------------------------------------------------------------ settings from the environment


def test_env_defaults():
    s = IndexerTopologySettings.from_env({})
    assert s.policy.policy is TopologyKVPolicyMode.DISABLED and not s.enabled
    assert (s.policy.sink_blocks, s.policy.local_blocks, s.policy.witness_blocks) == (1, 2, 2)
    assert s.policy.max_structural_fraction == 0.25 and s.policy.block_size == PAGE
    assert s.policy.coordinate_mismatch_action is CoordinateMismatchAction.FALLBACK_DISABLED
    assert s.paths == ALL_PATHS
    blank = {name: "  " for name in (ENV_POLICY, ENV_SINK_BLOCKS, ENV_PATHS, ENV_MAX_STRUCTURAL_FRACTION)}
    assert IndexerTopologySettings.from_env(blank) == s  # blank = unset


def test_env_all_variables_parsed_case_insensitively():
    env = {
        ENV_POLICY: " Topology_Only ",
        ENV_SINK_BLOCKS: "3",
        ENV_LOCAL_BLOCKS: "0",
        ENV_WITNESS_BLOCKS: "5",
        ENV_MAX_STRUCTURAL_FRACTION: "1",
        ENV_MISMATCH_ACTION: "RAISE",
        ENV_PATHS: " Decode , CP ",
    }
    s = IndexerTopologySettings.from_env(env, block_size=32)
    assert s.policy.policy is ONLY
    assert (s.policy.sink_blocks, s.policy.local_blocks, s.policy.witness_blocks, s.policy.block_size) == (3, 0, 5, 32)
    assert s.policy.max_structural_fraction == 1.0
    assert s.policy.coordinate_mismatch_action is CoordinateMismatchAction.RAISE
    assert s.paths == {IndexerPath.DECODE, IndexerPath.CP}
    assert IndexerTopologySettings.from_env({ENV_PATHS: "all"}).paths == ALL_PATHS


# (variable, bad value): every variable, every kind of bad value.
BAD_ENV = [
    (ENV_POLICY, "merge"),  # unknown mode
    (ENV_POLICY, "on"),
    (ENV_SINK_BLOCKS, "one"),  # not an integer
    (ENV_SINK_BLOCKS, "1.5"),
    (ENV_SINK_BLOCKS, "-1"),  # negative
    (ENV_LOCAL_BLOCKS, "2x"),
    (ENV_LOCAL_BLOCKS, "-2"),
    (ENV_WITNESS_BLOCKS, "many"),
    (ENV_WITNESS_BLOCKS, "-3"),
    (ENV_MAX_STRUCTURAL_FRACTION, "0"),  # out of (0, 1]
    (ENV_MAX_STRUCTURAL_FRACTION, "1.5"),
    (ENV_MAX_STRUCTURAL_FRACTION, "-0.1"),
    (ENV_MAX_STRUCTURAL_FRACTION, "nan"),
    (ENV_MAX_STRUCTURAL_FRACTION, "quarter"),  # not a number
    (ENV_MISMATCH_ACTION, "ignore"),  # unknown action
    (ENV_PATHS, "decode,verify"),  # unknown path name
    (ENV_PATHS, "decode,,cp"),  # empty item
]


@pytest.mark.parametrize("name,value", BAD_ENV)
def test_env_bad_value_names_variable_and_value(name, value):
    with pytest.raises(ValueError) as err:
        IndexerTopologySettings.from_env({ENV_POLICY: "topology_sparse_merge", name: value})
    assert name in str(err.value) and repr(value) in str(err.value), str(err.value)


def test_env_inconsistent_block_counts_name_the_variables():
    env = {ENV_POLICY: "topology_sparse_merge", ENV_SINK_BLOCKS: "0", ENV_LOCAL_BLOCKS: "0", ENV_WITNESS_BLOCKS: "0"}
    # The default sinks are 4 tokens, so zero blocks of every kind still inject something...
    assert IndexerTopologySettings.from_env(env).policy.sink_tokens == 4
    # ...but with no sink tokens either the policy would inject nothing.
    for tokens in ("0", "blocks"):
        with pytest.raises(ValueError, match=f"{ENV_SINK_BLOCKS}=0, {ENV_SINK_TOKENS}={tokens}, "
                                             f"{ENV_LOCAL_BLOCKS}=0, {ENV_WITNESS_BLOCKS}=0"):
            IndexerTopologySettings.from_env({**env, ENV_SINK_TOKENS: tokens})


def test_indexer_reads_environment_once_at_construction():
    with mock.patch.dict(os.environ, {ENV_SINK_BLOCKS: "-1"}):
        with pytest.raises(ValueError, match=ENV_SINK_BLOCKS):
            Indexer(HEADS, DIM)
    with mock.patch.dict(os.environ, {ENV_POLICY: "topology_sparse_merge", ENV_PATHS: "decode"}):
        indexer = Indexer(HEADS, DIM)
    with mock.patch.dict(os.environ, {ENV_POLICY: "bogus"}):
        assert indexer.topology.policy.policy is MERGE  # later changes are not read
        assert indexer.topology.paths == {IndexerPath.DECODE}


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
    return case, _to(cp), sub.row_lengths, sub.row_offsets, sub.row_to_request, sub


@pytest.mark.parametrize("path", list(IndexerPath))
def test_disabled_returns_the_op_output_itself(path, prefill_case, decode_case):
    gen = torch.Generator().manual_seed(1)
    case, cp, lengths, offsets, _, _ = _mock_step(path, prefill_case, decode_case, gen)
    known = engine_rows(lengths, offsets, gen)
    indexer = Indexer(HEADS, DIM, topology=DISABLED)
    cache = IndexerKeyCache(torch.zeros(1, PAGE, DIM))
    with mock.patch.object(Indexer, OPS[path], autospec=True, return_value=known) as op:
        out = _run(indexer, case, cp, kv_cache=cache, drift_tracker=make_tracker(prefill_case))
    assert out is known
    op.assert_called_once()
    args = op.call_args.args
    assert args[0] is indexer and args[3] is cache
    assert args[4] is case.batch.fmha_params and args[5] is case.batch.attention_inputs
    if path is IndexerPath.CP:  # the CP op gets the rank's CP fields, in the engine's order
        assert args[6] is cp.total_local_ids and args[7] is cp.cu_kv_seqlens_global and args[8] == cp.total_kv_len
        assert args[9:] == (cp.precomputed_ks, cp.precomputed_ke, cp.precomputed_lengths, cp.precomputed_topk_off)
    assert indexer.last_topology_counters is None


@pytest.mark.parametrize("path", list(IndexerPath))
@pytest.mark.parametrize("mode", [MERGE, ONLY])
def test_policy_hook_on_mocked_paths(path, mode, prefill_case, decode_case):
    gen = torch.Generator().manual_seed(2)
    case, cp, lengths, offsets, r2r, batch = _mock_step(path, prefill_case, decode_case, gen)
    known = engine_rows(lengths, offsets, gen)
    before = known.clone()
    indexer = Indexer(HEADS, DIM, topology=_settings(mode))
    tracker = make_tracker(case)
    fill_cache(indexer, case, tracker)
    with mock.patch.object(Indexer, OPS[path], autospec=True, return_value=known):
        out = _run(indexer, case, cp, kv_cache=IndexerKeyCache(torch.zeros(1, PAGE, DIM)), drift_tracker=tracker)
    assert torch.equal(known, before), "the op's rows were modified in place"
    assert out.shape == known.shape and out.dtype == known.dtype and out.device == known.device
    drift_rows = tracker.drift_scores().cpu()[torch.tensor(r2r)]
    expected, counters, mismatches = policy_ref.reference_topology_policy(
        known.cpu(), torch.tensor(lengths), mode=mode.value, sink_blocks=1, local_blocks=2, witness_blocks=2,
        block_size=PAGE, max_structural_fraction=0.25, offsets=torch.tensor(offsets), drift=drift_rows,
    )
    assert torch.equal(out.cpu(), expected), "hook did not pass the path's lengths / offsets / drift rows"
    assert not mismatches and int(indexer.last_topology_counters.coordinate_mismatch_fallbacks) == 0
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
    indexer = Indexer(HEADS, DIM, topology=_settings(MERGE))
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        out = _run(indexer, case, kv_cache=None)
    assert_rows_valid(out, batch.row_lengths, batch.row_offsets)
    assert_structural_present(out, batch.row_lengths, batch.row_offsets, None, indexer.topology.policy)


def test_compress_mode_gets_contexts_per_request(prefill_case):
    gen = torch.Generator().manual_seed(4)
    b = prefill_case.batch
    known = engine_rows(b.row_lengths, b.row_offsets, gen)
    indexer = Indexer(HEADS, DIM, topology=_settings(COMPRESS))
    contexts = [TopologyRequestContext(scaffold_token_ids=tuple(range(n))) for n in (0, 700, 300, 1300)]
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        out = _run(indexer, prefill_case, kv_cache=None, topology_context=contexts)
    scaffold = [contexts[r].scaffold_length for r in b.row_to_request]
    expected, counters, _ = policy_ref.reference_topology_policy(
        known.cpu(), torch.tensor(b.row_lengths), mode=COMPRESS.value, sink_blocks=1, local_blocks=2,
        witness_blocks=2, block_size=PAGE, max_structural_fraction=0.25, scaffold_lengths=scaffold,
    )
    assert torch.equal(out.cpu(), expected)
    assert int(indexer.last_topology_counters.compressed_blocks) == counters["compressed_blocks"] > 0


def test_switched_off_path_passes_through_and_logs_once(prefill_case, decode_case, caplog):
    gen = torch.Generator().manual_seed(5)
    indexer = Indexer(HEADS, DIM, topology=_settings(MERGE, paths={IndexerPath.DECODE}))
    known = engine_rows(prefill_case.batch.row_lengths, prefill_case.batch.row_offsets, gen)
    patch = mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known)
    with caplog.at_level(logging.WARNING), patch:
        for _ in range(3):
            assert _run(indexer, prefill_case, kv_cache=None) is known
    records = [r for r in caplog.records if "prefill path" in r.getMessage()]
    assert len(records) == 1 and ENV_PATHS in records[0].getMessage()
    # Another Indexer logs its own skip once too (no shared state).
    other = Indexer(HEADS, DIM, topology=_settings(MERGE, paths={IndexerPath.DECODE}))
    with caplog.at_level(logging.WARNING), mock.patch.object(Indexer, "_get_topk_ragged", return_value=known):
        _run(other, prefill_case, kv_cache=None)
    assert len([r for r in caplog.records if "prefill path" in r.getMessage()]) == 2


def test_missing_tracker_falls_back_to_recency_and_logs_once(decode_case, caplog):
    gen = torch.Generator().manual_seed(6)
    b = decode_case.batch
    known = engine_rows(b.row_lengths, b.row_offsets, gen)
    indexer = Indexer(HEADS, DIM, topology=_settings(MERGE))
    with caplog.at_level(logging.WARNING), mock.patch.object(Indexer, "_get_topk_paged", return_value=known):
        outs = [_run(indexer, decode_case, kv_cache=None) for _ in range(2)]
    assert len([r for r in caplog.records if "no drift tracker" in r.getMessage()]) == 1
    assert torch.equal(outs[0], outs[1])
    assert_structural_present(outs[0], b.row_lengths, b.row_offsets, None, indexer.topology.policy)


def test_cp_rank_without_rows_returns_none(prefill_case):
    cp, _ = ref.build_cp_params(prefill_case.batch, [], cp_size=2, cp_rank=0)
    indexer = Indexer(HEADS, DIM, topology=_settings(MERGE))
    cache = fill_cache(indexer, prefill_case)
    assert _run(indexer, prefill_case, _to(cp), kv_cache=cache) is None


def test_tracker_too_small_for_batch_is_an_error(prefill_case):
    indexer = Indexer(HEADS, DIM, topology=_settings(MERGE))
    b = prefill_case.batch
    known = engine_rows(b.row_lengths, b.row_offsets, torch.Generator().manual_seed(7))
    small = BlockDriftTracker(2, 8, DIM, device=DEVICE)
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        with pytest.raises(ValueError, match="drift_tracker.num_requests: expected >= 4"):
            _run(indexer, prefill_case, kv_cache=None, drift_tracker=small)


# ------------------------------------------------------------------ reference ops vs per-row loops


@pytest.mark.parametrize("fp8", [False, True])
def test_ragged_op_matches_loop_reference(fp8, prefill_case):
    case, b = prefill_case, prefill_case.batch
    indexer = Indexer(HEADS, DIM, fp8_emulation=fp8, topology=DISABLED)
    out = _run(indexer, case, kv_cache=fill_cache(Indexer(HEADS, DIM, topology=DISABLED), case))
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
    out = _run(Indexer(HEADS, DIM, fp8_emulation=True, topology=DISABLED), case, kv_cache=cache)
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


# ------------------------------------------------------------------ the whole path with real ops


@pytest.mark.parametrize("mode", [MERGE, ONLY])
def test_real_ops_with_policy_on_prefill_and_decode(mode, prefill_case, decode_case):
    for case in (prefill_case, decode_case):
        b = case.batch
        indexer = Indexer(HEADS, DIM, topology=_settings(mode))
        tracker = make_tracker(case)
        cache = fill_cache(indexer, case, tracker)
        learned = _run(Indexer(HEADS, DIM, topology=DISABLED), case, kv_cache=cache)
        out = _run(indexer, case, kv_cache=cache, drift_tracker=tracker)
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
    for settings_ in (DISABLED, _settings(MERGE)):
        indexer = Indexer(HEADS, DIM, topology=settings_)
        tracker = make_tracker(case)
        cache = fill_cache(indexer, case, tracker)
        whole = _run(indexer, case, kv_cache=cache, drift_tracker=tracker)
        gathered = torch.full_like(whole, -7)
        for rank in range(2):
            rows = ref.zigzag_cp_rows(PREFILL_NEW, cp_size=2, cp_rank=rank)
            cp, local_rows = ref.build_cp_params(b, rows, cp_size=2, cp_rank=rank, pad_rows=2)
            take = torch.tensor([max(g, 0) for g in local_rows])
            local = ref.IndexerCase(b, None, None, None, None, None, case.q[take], case.weights[take])
            out = _run(indexer, local, _to(cp), kv_cache=cache, drift_tracker=tracker)
            assert out.shape == (len(rows), WIDTH)
            gathered[torch.tensor(rows, device=DEVICE)] = out
        assert torch.equal(gathered, whole)


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


def test_parameter_objects_check_engine_dtypes():
    i32, i64 = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"fmha_params.ks: expected int32"):
        IndexerFmhaParams(expanded_seq_lens=i32, topk_indices_offset=i32, ks=i64, ke=i32)
    with pytest.raises(TypeError, match=r"cp_params.total_local_ids: expected int64"):
        IndexerCPParams(i32, i64, torch.zeros(2, dtype=torch.int32), 0, i32, i32, i32, i32)


# ------------------------------------------------------------------ GPU only: no host sync


@pytest.mark.skipif(DEVICE.type != "cuda", reason="sync detection needs CUDA")
def test_decode_path_with_policy_and_tracker_update_do_not_sync(decode_case):
    indexer = Indexer(HEADS, DIM, topology=_settings(MERGE))
    tracker = make_tracker(decode_case)
    cache = fill_cache(indexer, decode_case, tracker)
    q, w = decode_case.q.to(DEVICE), decode_case.weights.to(DEVICE)
    fmha, attn = _to(decode_case.batch.fmha_params), _to(decode_case.batch.attention_inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tracker.update(decode_case.keys[:8].to(DEVICE), decode_case.positions[:8].to(DEVICE))
        indexer._compute_topk(q, w, cache, fmha, attn, None, drift_tracker=tracker)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_env_sink_tokens_and_structural_budget():
    from rtp_llm.models_py.modules.hybrid.topology_kv_config import IndexerTopologySettings
    from rtp_llm.models_py.modules.hybrid.topology_kv_config import StructuralBudget

    env = {"RTP_LLM_TOPOLOGY_KV_POLICY": "topology_sparse_merge", "RTP_LLM_TOPOLOGY_KV_SINK_TOKENS": "4",
           "RTP_LLM_TOPOLOGY_KV_STRUCTURAL_BUDGET": "Scaled"}
    settings = IndexerTopologySettings.from_env(env)
    assert settings.policy.sink_tokens == 4
    assert settings.policy.structural_budget is StructuralBudget.SCALED
    blocks = IndexerTopologySettings.from_env({**env, "RTP_LLM_TOPOLOGY_KV_SINK_TOKENS": "blocks"})
    assert blocks.policy.sink_tokens is None
    for name, bad in [("RTP_LLM_TOPOLOGY_KV_SINK_TOKENS", "-4"), ("RTP_LLM_TOPOLOGY_KV_SINK_TOKENS", "four"),
                      ("RTP_LLM_TOPOLOGY_KV_STRUCTURAL_BUDGET", "elastic")]:
        with pytest.raises(ValueError, match=name):
            IndexerTopologySettings.from_env({**env, name: bad})
