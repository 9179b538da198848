"""Shared cases and checks of the indexer tests: engine-shaped batches, contract checks.

Test support only (never imported by production code). The per-row loop references of the
indexer ops are in ``indexer_ref.py``; the policy's loop reference is
``rtp_llm/models_py/modules/hybrid/topology_kv/test/reference.py``.
"""

from __future__ import annotations

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.test import reference as policy_ref
from rtp_llm.models_py.modules.hybrid.indexer_params import (
    IndexerKeyCache,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    ALL_PATHS,
    CoordinateMismatchAction,
    IndexerTopologySettings,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import (
    BlockDriftTracker,
    DriftMetric,
)
from tools.device_under_test import DEVICE

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


def policy_settings(mode=MERGE, paths=ALL_PATHS, witness_signal="key_drift", structure_layers="all", **kw):
    # key_drift for every mode: these cases plant drift witnesses and check they reach the
    # policy (the serving default, auto, gives topology_only recency: tested on its own).
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
    return IndexerTopologySettings(
        policy=TopologyKVPolicyConfig(policy=mode, **base), paths=frozenset(paths), witness_signal=witness_signal,
        structure_layers=structure_layers,
    )


DISABLED = IndexerTopologySettings()


def to_device(obj):
    """Move every tensor field of a parameter dataclass to DEVICE."""
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(DEVICE))
    return obj



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



def run_compute_topk(indexer, case, cp_params=None, *, kv_cache, **kw):
    return indexer._compute_topk(
        case.q.to(DEVICE),
        case.weights.to(DEVICE),
        kv_cache,
        to_device(case.batch.fmha_params),
        to_device(case.batch.attention_inputs),
        cp_params,
        **kw,
    )


