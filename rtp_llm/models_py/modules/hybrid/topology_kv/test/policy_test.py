"""Tests of the topology KV policy: modes, contract, counters, fingerprints, compile.

CPU by default; ``TOPOLOGY_KV_TEST_DEVICE=cuda`` runs the same checks on a GPU
(``//rtp_llm/models_py/modules/hybrid/topology_kv/test:policy_cuda_manual``). Every test runs once per backend that
can run on the device (``torch`` always, ``cpu_fused`` on CPU, ``triton`` on CUDA; the
Triton kernel's CPU run under the interpreter is ``triton_fused_test.py``,
bit for bit against the torch core): the module-scoped ``backend`` fixture forces it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv.test import reference as ref
from rtp_llm.models_py.modules.hybrid.topology_kv import policy as policy_module
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    CoordinateMismatchAction,
    TopologyKVBackend,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.dispatch import can_use_backend
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import (
    apply_topology_kv_policy,
    check_topk_coordinates,
    COUNTER_NAMES,
    policy_fingerprint,
    topology_kv_policy_core,
    TopologyRequestContext,
)

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import PolicyLayout, PolicyTensors
from tools.device_under_test import DEVICE

# The interpreter runs Triton on CPU, but too slowly for this whole module (its own test
# file covers it); on CUDA the compiled kernel runs every test here.
BACKENDS = ["torch", "cpu_fused"] if DEVICE.type == "cpu" else ["torch", "triton"]


@pytest.fixture(autouse=True, scope="module", params=BACKENDS)
def backend(request):
    """Force one backend for every policy call in the module (module scope: hypothesis-safe)."""
    name = TopologyKVBackend.parse(request.param)
    if not can_use_backend(name, DEVICE):
        pytest.skip(f"backend {name.value} cannot run on {DEVICE}")
    original = policy_module.resolve_backend
    policy_module.resolve_backend = lambda _requested, _device: name
    yield name
    policy_module.resolve_backend = original

MERGE = TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE
COMPRESS = TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE
ONLY = TopologyKVPolicyMode.TOPOLOGY_ONLY
ENABLED_MODES = [MERGE, COMPRESS, ONLY]
FALLBACK = CoordinateMismatchAction.FALLBACK_DISABLED


def _t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _cfg(mode, **kw):
    # Whole sink blocks (sink_tokens=None): the hand-computed cases below use the block
    # layout; token sinks (the default) are tested with explicit values. RAISE explicitly:
    # these tests check violations by the error (the config's default is the serving
    # default, fallback_disabled).
    base = dict(sink_blocks=1, local_blocks=1, witness_blocks=1, block_size=4, max_structural_fraction=0.5,
                sink_tokens=None, coordinate_mismatch_action=CoordinateMismatchAction.RAISE)
    base.update(kw)
    return TopologyKVPolicyConfig(policy=mode, **base)


def _engine_row(length, width, chosen=None, offset=0):
    """A row in the engine's convention: all tokens when short, else ``chosen``."""
    toks = list(range(length)) if length <= width else list(chosen)
    assert len(toks) <= width
    return [t + offset for t in toks] + [-1] * (width - len(toks))


# ---------------------------------------------------------------- hand-computed rows


def test_sparse_merge_hand_computed_tail_eviction():
    # W=8, block 4, length 40 (10 blocks). Structure: sink block 0 = {0,1,2,3},
    # local block 9 = {36..39}, witness = most recent eligible (no drift) = block 8.
    # Cap = floor(8 * 0.5) = 4. Learned holds 0 and 37 already (free, protected).
    # New structural in priority order (locals most recent first): 1, 2, 3, 39, 38,
    # 36, 32, ... -> inject 1, 2, 3, 39. Overflow 4 -> evict the last 4 non-structural
    # learned entries (20, 21, 22, 23); the injected tokens take their places in order.
    x = _t([[0, 10, 37, 11, 20, 21, 22, 23]])
    res = apply_topology_kv_policy(x, _t([40]), config=_cfg(MERGE))
    assert res.indices.tolist() == [[0, 10, 37, 11, 1, 2, 3, 39]]
    c = res.counters.to_dict()
    assert c["structural_injected_tokens"] == 4
    assert c["learned_kept_tokens"] == 4 and c["learned_evicted_tokens"] == 4
    assert c["selected_tokens"] == 8 and c["unselected_tokens"] == 32
    assert c["coordinate_mismatch_fallbacks"] == 0 and c["compressed_blocks"] == 0


def test_sparse_merge_evicts_lowest_scores_ties_to_later_entry():
    x = _t([[10, 11, 12, 13, 14, 15, 16, 17]])
    scores = torch.tensor([[5.0, 1.0, 9.0, 1.0, 7.0, 0.5, 8.0, 6.0]], device=DEVICE)
    cfg = _cfg(MERGE, local_blocks=0, witness_blocks=0, max_structural_fraction=0.25)
    # Cap 2: inject sink tokens 0, 1; evict 0.5 (15) then the later of the two 1.0s (13);
    # injected tokens fill the holes in eviction order: 15 <- 0, 13 <- 1.
    res = apply_topology_kv_policy(x, _t([40]), config=cfg, learned_scores=scores)
    assert res.indices.tolist() == [[10, 11, 12, 1, 14, 0, 16, 17]]


def test_sparse_merge_witness_by_drift_and_offsets():
    # Offset 100: learned entries are 100 + t. Drift makes block 5 the witness.
    drift = torch.zeros(1, 10, device=DEVICE)
    drift[0, 5] = 3.0
    cfg = _cfg(MERGE, sink_blocks=0, local_blocks=0, witness_blocks=1, max_structural_fraction=1.0)
    x = _t([[100 + t for t in (1, 2, 3, 4)] + [-1] * 4])
    res = apply_topology_kv_policy(x, _t([40]), config=cfg, topk_indices_offset=_t([100]), block_drift_scores=drift)
    # Witness tokens newest first: a block the budget cuts keeps its newest tokens.
    assert res.indices.tolist() == [[101, 102, 103, 104, 123, 122, 121, 120]]
    assert res.counters.to_dict()["learned_evicted_tokens"] == 0  # free space, no eviction


def test_topology_only_fills_min_w_length_in_priority_order():
    drift = torch.zeros(2, 10, device=DEVICE)
    drift[:, 4] = 2.0
    drift[:, 2] = 1.0
    cfg = _cfg(ONLY, local_blocks=1, witness_blocks=0)
    x = _t([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], _engine_row(7, 10)])
    res = apply_topology_kv_policy(x, _t([40, 7]), config=cfg, block_drift_scores=drift)
    # Long row: sink 0..3, local 39..36 (most recent first), then witness block 4
    # (16..19) truncated to its newest 2.
    assert res.indices[0].tolist() == [0, 1, 2, 3, 39, 38, 37, 36, 19, 18]
    # Short row (7 <= W): every token, in priority order (sink 0..3, local 6..4).
    assert res.indices[1].tolist() == [0, 1, 2, 3, 6, 5, 4, -1, -1, -1]
    c = res.counters.to_dict()
    assert c["selected_tokens"] == 17 and c["learned_kept_tokens"] == 7
    assert c["structural_injected_tokens"] == 10 and c["learned_evicted_tokens"] == 10


def test_topology_only_engine_defaults_with_recency_is_locality_hand_computed():
    # Engine defaults: 4 token sinks, 2 local blocks, 64-token blocks; no drift scores, so
    # the witnesses are the most recent blocks. Length 200 = blocks 0..3, the last holding
    # 192..199. W = 100: sinks 0..3; locals = blocks 2, 3 = 199..128 (72 tokens); 24 more
    # from witness block 1 (64..127), which does not fit whole: its *newest* 24 tokens,
    # 127..104, so the row is plain locality.
    cfg = TopologyKVPolicyConfig(policy=ONLY)
    x = _t([_engine_row(200, 100, chosen=range(100))])
    res = apply_topology_kv_policy(x, _t([200]), config=cfg)
    assert res.indices.tolist() == [[0, 1, 2, 3] + list(range(199, 103, -1))]
    assert res.indices.tolist() == [ref.reference_locality_row(200, 100, 4)]


# Lengths that land on partly filled 64-token blocks (27, 61, 1541, 2047: Quest's page
# tests), on block edges (64, 128, 2048) and below the 4 sink tokens (1, 3).
LOCALITY_LENGTHS = [1, 3, 4, 5, 27, 61, 63, 64, 65, 127, 128, 129, 1541, 2047, 2048, 2049]
# Widths below the sinks (1, 3), at one block (64) and at the engine's 2048.
LOCALITY_WIDTHS = [1, 3, 4, 5, 63, 64, 65, 100, 256, 2048]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.sampled_from(LOCALITY_LENGTHS), st.integers(1, 5000)), min_size=1, max_size=4),
    width=st.one_of(st.sampled_from(LOCALITY_WIDTHS), st.integers(1, 2100)),
    wide=st.booleans(),  # W >= every length: the rows keep every token
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_topology_only_engine_defaults_with_recency_is_locality(lengths, width, wide, dtype):
    """``topology_only`` at the engine defaults without drift scores == sinks + most recent tokens."""
    if wide:
        width = max(lengths) + width % 7
    cfg = TopologyKVPolicyConfig(policy=ONLY)
    x = _t([_engine_row(n, width, chosen=range(width)) for n in lengths], dtype)
    res = apply_topology_kv_policy(x, _t(lengths), config=cfg)
    want = [ref.reference_locality_row(n, width, cfg.sink_tokens) for n in lengths]
    assert res.indices.cpu().tolist() == want, (lengths, width)
    assert res.counters.to_dict()["selected_tokens"] == sum(min(n, width) for n in lengths)
    ref_out, _, _ = ref.reference_topology_policy(
        x.cpu(), _t(lengths).cpu(), mode=ONLY.value, sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks,
        witness_blocks=cfg.witness_blocks, block_size=cfg.block_size,
        max_structural_fraction=cfg.max_structural_fraction, sink_tokens=cfg.sink_tokens,
    )
    assert ref_out.tolist() == want, "the plain reference must select locality too"


def test_token_sinks_hand_computed():
    # sink_tokens=2: sinks are tokens 0, 1; local block 9 = 39..36; witness = most recent
    # eligible block (8). Cap 8 * 0.5 = 4.
    cfg = _cfg(MERGE, sink_tokens=2)
    x = _t([[10, 11, 12, 13, 14, 15, 16, 17]])
    res = apply_topology_kv_policy(x, _t([40]), config=cfg)
    assert res.indices.tolist() == [[10, 11, 12, 13, 0, 1, 39, 38]]
    # Block 0 holds the sinks in part; its other tokens (2, 3) may still be a witness.
    # Length 6: sinks 0, 1; local block 1 = 5, 4 (5 present); witness block 0 = 3, 2
    # (newest first).
    res = apply_topology_kv_policy(_t([[5, -1, -1, -1, -1, -1, -1, -1]]), _t([6]), config=cfg)
    assert res.indices.tolist() == [[5, 0, 1, 4, 3, -1, -1, -1]]  # cap 4 stops before 2


def test_present_local_tokens_never_keep_out_missing_sinks():
    # W=8, block 4, sinks = tokens 0, 1, 3 local blocks; length 14: local = blocks 1..3 =
    # tokens 4..13 (10 tokens). The learned row holds 6..13, all local: with "every present
    # structural token is free" there would be no room left and the sinks would never get
    # in (the indexer's sink-dropping failure, uncorrected). The target is the priority
    # prefix 0, 1, 13, 12, ..., 8 (8 tokens, 2 missing <= cap 4): 6 and 7 fall outside it,
    # become plain learned entries and make room for the sinks.
    cfg = _cfg(MERGE, sink_tokens=2, local_blocks=3, witness_blocks=0, max_structural_fraction=0.5)
    x = _t([[6, 7, 8, 9, 10, 11, 12, 13]])
    res = apply_topology_kv_policy(x, _t([14]), config=cfg)
    assert res.indices.cpu().tolist() == [[0, 1, 8, 9, 10, 11, 12, 13]]
    counters = res.counters.to_dict()
    assert counters["structural_injected_tokens"] == 2 and counters["learned_evicted_tokens"] == 2
    # With scores: 8 scores lowest of all (0.0) but is in the target, so it stays; the
    # two evicted entries are the only non-target ones, 6 and 7.
    scores = torch.tensor([[0.9, 0.1, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]], device=DEVICE)
    res = apply_topology_kv_policy(x, _t([14]), config=cfg, learned_scores=scores)
    assert sorted(res.indices.cpu().tolist()[0]) == [0, 1, 8, 9, 10, 11, 12, 13]
    want, _, _ = ref.reference_topology_policy(
        x.cpu(), _t([14]).cpu(), mode=MERGE.value, sink_blocks=1, local_blocks=3, witness_blocks=0, block_size=4,
        max_structural_fraction=0.5, sink_tokens=2, learned_scores=scores.cpu(),
    )
    assert torch.equal(res.indices.cpu(), want)


def test_scaled_budget_hand_computed():
    # W=8, fixed cap 4; scaled at length 16: 4 * 8 // 16 = 2 injected tokens.
    cfg = _cfg(MERGE, structural_budget="scaled")
    x = _t([[8, 9, 10, 11, 4, 5, 6, 7]])
    res = apply_topology_kv_policy(x, _t([16]), config=cfg)
    assert res.indices.tolist() == [[8, 9, 10, 11, 4, 5, 0, 1]]
    assert res.counters.to_dict()["structural_injected_tokens"] == 2


def test_compress_sparse_hand_computed():
    # Scaffold = first 10 tokens: block 0 ([0, 4)) and block 1 ([4, 8)) lie wholly in
    # it, block 2 does not. Sinks = blocks 0, 1 -> one token each (0 and 4).
    cfg = _cfg(COMPRESS, sink_blocks=2, local_blocks=1, witness_blocks=0, max_structural_fraction=1.0)
    ctx = TopologyRequestContext(scaffold_token_ids=tuple(range(10)))
    x = _t([[20, 21, 22, 23, 24, 25, -1, -1]])
    res = apply_topology_kv_policy(x, _t([40]), config=cfg, context=ctx)
    # Structural: 0, 4 (compressed sinks), local block 9 = 39..36 -> 6 new tokens,
    # 6 learned + 6 new = 12 > 8: evict the last 4 learned entries (22..25, filled with
    # 0, 4, 39, 38); the 2 extra injected tokens go to the padding after the 6 valid.
    assert res.indices.tolist() == [[20, 21, 0, 4, 39, 38, 37, 36]]
    c = res.counters.to_dict()
    assert c["compressed_blocks"] == 2 and c["compression_saved_tokens"] == 6
    assert c["structural_injected_tokens"] == 6 and c["learned_evicted_tokens"] == 4


@pytest.mark.parametrize("mode", ENABLED_MODES)
@pytest.mark.parametrize("length", [1, 3, 4, 5, 8])
def test_rows_up_to_width_keep_every_token(mode, length):
    x = _t([_engine_row(length, 8)])
    res = apply_topology_kv_policy(x, _t([length]), config=_cfg(mode))
    assert sorted(v for v in res.indices[0].tolist() if v >= 0) == list(range(length))


# ---------------------------------------------------------------- contract and fallback


def test_raise_names_row_and_value():
    x = _t([[0, 1, -1], [5, 9, 2]])
    with pytest.raises(ValueError, match=r"row 1 holds 9.*\[0, 9\)"):
        apply_topology_kv_policy(x, _t([3, 9]), config=_cfg(MERGE))
    with pytest.raises(ValueError, match="row 0 holds 3"):
        check_topk_coordinates(_t([[5, 3]]), _t([4]), _t([4]))  # 3 < offset 4


def test_padding_before_valid_entries_is_a_violation():
    with pytest.raises(ValueError, match="row 0 holds 7 at column 2 after padding"):
        check_topk_coordinates(_t([[1, -1, 7, -1]]), _t([9]))
    res = apply_topology_kv_policy(_t([[1, -1, 7, -1]]), _t([9]), config=_cfg(MERGE, coordinate_mismatch_action=FALLBACK))
    assert res.indices.tolist() == [[1, -1, 7, -1]]
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 1


def test_check_finds_duplicates():
    with pytest.raises(ValueError, match="row 0 holds 2 twice"):
        check_topk_coordinates(_t([[2, 1, 2, -1]]), _t([5]))


def test_fallback_returns_bad_rows_unchanged_and_counts_them():
    x = _t([[0, 1, 2, 3, 4, 5, 6, 7], [30, 31, 99, 33, 34, 35, 36, 37]])
    cfg = _cfg(MERGE, coordinate_mismatch_action="FALLBACK_DISABLED")
    res = apply_topology_kv_policy(x, _t([40, 40]), config=cfg)
    assert res.indices[1].tolist() == x[1].tolist()
    assert res.indices[0].tolist() != x[0].tolist()  # the good row was processed
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float16])
def test_rejected_dtypes(dtype):
    with pytest.raises(TypeError, match="topk_indices"):
        apply_topology_kv_policy(torch.zeros(2, 4, dtype=dtype, device=DEVICE), _t([4, 4]), config=_cfg(MERGE))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_output_dtype_shape_device_preserved(dtype):
    x = _t([_engine_row(40, 8, chosen=range(10, 18))], dtype=dtype)
    res = apply_topology_kv_policy(x, _t([40], dtype=dtype), config=_cfg(MERGE))
    assert res.indices.dtype == dtype and res.indices.shape == x.shape and res.indices.device == x.device


def test_disabled_returns_the_same_tensor():
    x = _t([[3, 1, -1]])
    res = apply_topology_kv_policy(x, _t([4]), config=TopologyKVPolicyConfig())
    assert res.indices is x and res.counters is None


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_inputs_never_mutated(mode):
    x = _t([[9, 3, 30, 31, 12, 13, 14, 15]])
    scores = torch.arange(8, dtype=torch.float32, device=DEVICE).unsqueeze(0)
    drift = torch.ones(1, 10, device=DEVICE)
    lengths, offsets = _t([40]), _t([0])
    before = [a.clone() for a in (x, scores, drift, lengths, offsets)]
    apply_topology_kv_policy(
        x, lengths, config=_cfg(mode), topk_indices_offset=offsets, block_drift_scores=drift, learned_scores=scores
    )
    for a, b in zip((x, scores, drift, lengths, offsets), before):
        assert torch.equal(a, b)


def test_bad_arguments_name_the_argument():
    x = _t([[0, 1]])
    cfg = _cfg(MERGE)
    with pytest.raises(ValueError, match="topk_indices"):
        apply_topology_kv_policy(_t([0, 1]), _t([2]), config=cfg)
    with pytest.raises(ValueError, match="lengths"):
        apply_topology_kv_policy(x, _t([2, 2]), config=cfg)
    with pytest.raises(TypeError, match="lengths"):
        apply_topology_kv_policy(x, torch.tensor([2.0], device=DEVICE), config=cfg)
    with pytest.raises(ValueError, match="topk_indices_offset"):
        apply_topology_kv_policy(x, _t([2]), config=cfg, topk_indices_offset=_t([0, 0]))
    with pytest.raises(ValueError, match="learned_scores"):
        apply_topology_kv_policy(x, _t([2]), config=cfg, learned_scores=torch.zeros(1, 3, device=DEVICE))
    with pytest.raises(ValueError, match="block_drift_scores"):
        apply_topology_kv_policy(x, _t([2]), config=cfg, block_drift_scores=torch.zeros(2, 3, device=DEVICE))
    with pytest.raises(TypeError, match="config"):
        apply_topology_kv_policy(x, _t([2]), config={"policy": "topology_only"})


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("name", ["TOPOLOGY_ONLY", "topology_only", " Topology_Only "])
def test_mode_parsing_case_insensitive(name):
    assert TopologyKVPolicyConfig(policy=name).policy is ONLY


def test_default_sinks_are_four_tokens():
    cfg = TopologyKVPolicyConfig(policy="topology_sparse_merge")
    assert cfg.sink_tokens == 4 and cfg.sink_blocks == 1  # sink_blocks only counts with sink_tokens=None
    # Whole sink blocks stay reachable (sink_tokens=None): rows of length 100, W 8, block 4
    # -> sinks 0..3, as with 4 token sinks.
    x = _t([[50, 60, 70, 80, -1, -1, -1, -1]])
    blocks = apply_topology_kv_policy(x, _t([100]), config=_cfg(MERGE)).indices.cpu().tolist()[0]
    tokens = apply_topology_kv_policy(x, _t([100]), config=_cfg(MERGE, sink_tokens=4)).indices.cpu().tolist()[0]
    assert {0, 1, 2, 3} <= set(blocks) and {0, 1, 2, 3} <= set(tokens)
    two = apply_topology_kv_policy(x, _t([100]), config=_cfg(MERGE, sink_tokens=2)).indices.cpu().tolist()[0]
    assert {0, 1} <= set(two) and not {2, 3} & set(two)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(policy="sparse"), ValueError, "policy: expected one of \\[disabled, topology_sparse_merge"),
        (dict(sink_blocks=-1), ValueError, "sink_blocks"),
        (dict(local_blocks=1.5), TypeError, "local_blocks"),
        (dict(witness_blocks=-3), ValueError, "witness_blocks"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(max_structural_fraction=0.0), ValueError, "max_structural_fraction"),
        (dict(max_structural_fraction=1.5), ValueError, "max_structural_fraction"),
        (dict(max_structural_fraction=float("nan")), ValueError, "max_structural_fraction"),
        (dict(max_structural_fraction="0.5"), TypeError, "max_structural_fraction"),
        (dict(coordinate_mismatch_action="ignore"), ValueError, "coordinate_mismatch_action"),
        (
            dict(policy="topology_sparse_merge", sink_blocks=0, local_blocks=0, witness_blocks=0, sink_tokens=None),
            ValueError,
            "sink_blocks \\(or sink_tokens\\) \\+ local_blocks",
        ),
        (
            dict(policy="topology_sparse_merge", sink_blocks=3, local_blocks=0, witness_blocks=0, sink_tokens=0),
            ValueError,
            "sink_blocks \\(or sink_tokens\\) \\+ local_blocks",
        ),
        (dict(sink_tokens=-1), ValueError, "sink_tokens"),
        (dict(sink_tokens=2.0), TypeError, "sink_tokens"),
        (dict(structural_budget="elastic"), ValueError, "structural_budget: expected one of \\[fixed, scaled\\]"),
    ],
)
def test_bad_config_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        TopologyKVPolicyConfig(**kwargs)


# ---------------------------------------------------------------- fingerprints and contexts


def test_fingerprint_stable_and_compression_hits():
    cfg = _cfg(COMPRESS)
    ctx = TopologyRequestContext(scaffold_token_ids=(1, 2, 3))
    x, L = _t([[0, 1, 2, 3]]), _t([4])
    r1 = apply_topology_kv_policy(x, L, config=cfg, context=ctx)
    r2 = apply_topology_kv_policy(x, L, config=cfg, context=ctx)
    assert r1.fingerprints == r2.fingerprints == (policy_fingerprint(cfg, 4, (1, 2, 3)),)
    assert r1.counters.compression_hits == 0 and r2.counters.compression_hits == 1
    assert ctx.compression_hits == 1
    assert policy_fingerprint(cfg, 4, (1, 2, 4)) != policy_fingerprint(cfg, 4, (1, 2, 3))
    assert policy_fingerprint(cfg, 8, (1, 2, 3)) != policy_fingerprint(cfg, 4, (1, 2, 3))


def test_contexts_isolated_across_threads():
    cfg = _cfg(COMPRESS)
    x, L = _t([[0, 1, 2, 3]]), _t([4])
    contexts = [TopologyRequestContext(scaffold_token_ids=(i,)) for i in range(8)]
    calls = [i + 1 for i in range(8)]  # context i is used i + 1 times by its own thread
    errors = []

    def worker(i):
        try:
            for _ in range(calls[i]):
                apply_topology_kv_policy(x, L, config=cfg, context=contexts[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for i, ctx in enumerate(contexts):
        assert ctx.compression_hits == calls[i] - 1
        assert ctx.last_fingerprint == policy_fingerprint(cfg, 4, (i,))


# ---------------------------------------------------------------- property test vs reference


@st.composite
def policy_cases(draw):
    W = draw(st.sampled_from([4, 8, 16, 33]))
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    R = draw(st.integers(1, 5))
    mode = draw(st.sampled_from(ENABLED_MODES))
    sink, local, wit = draw(st.integers(0, 2)), draw(st.integers(0, 3)), draw(st.integers(0, 3))
    if sink + local + wit == 0:
        sink, local = 1, 1  # stays valid when sink_tokens=0 replaces the sink blocks
    frac = draw(st.sampled_from([0.1, 0.25, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**20))
    lengths = [draw(st.integers(1, 6 * W)) for _ in range(R)]
    offsets = [draw(st.sampled_from([0, 0, 7, 1000])) for _ in range(R)]
    engine_style = draw(st.booleans())
    use_scores = draw(st.booleans())
    use_drift = draw(st.booleans())
    scaffold = draw(st.integers(0, 3 * W))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    scramble = draw(st.integers(0, 4)) == 0
    sink_tokens = draw(st.one_of(st.none(), st.integers(0, 9)))
    if sink_tokens == 0 and local + wit == 0:
        local = 1  # a config with no structure at all is rejected (tested elsewhere)
    scaled = draw(st.booleans())
    return dict(scramble=scramble, sink_tokens=sink_tokens, scaled=scaled,
        W=W, bs=bs, mode=mode, sink=sink, local=local, wit=wit, frac=frac, seed=seed, lengths=lengths,
        offsets=offsets, engine_style=engine_style, use_scores=use_scores, use_drift=use_drift,
        scaffold=scaffold, dtype=dtype,
    )


def _random_rows(case, gen):
    W = case["W"]
    rows = []
    for length, off in zip(case["lengths"], case["offsets"]):
        n = min(length, W) if case["engine_style"] else int(torch.randint(0, min(length, W) + 1, (1,), generator=gen))
        chosen = torch.randperm(length, generator=gen)[:n].tolist()
        if case["engine_style"] and length <= W:
            chosen = list(range(length))
        row = [t + off for t in chosen] + [-1] * (W - n)
        if not case["engine_style"]:  # partly filled rows, arbitrary negative padding
            row = [v if v >= 0 else -1 - (p % 3) for p, v in enumerate(row)]
            if case["scramble"]:  # padding before valid entries: a layout violation
                perm = torch.randperm(W, generator=gen).tolist()
                row = [row[p] for p in perm]
        rows.append(row)
    return rows


@settings(max_examples=300, deadline=None)
@given(case=policy_cases())
def test_vectorized_equals_reference_and_keeps_contract(case):
    gen = torch.Generator().manual_seed(case["seed"])
    W, bs = case["W"], case["bs"]
    R = len(case["lengths"])
    x = torch.tensor(_random_rows(case, gen), dtype=case["dtype"])
    L = torch.tensor(case["lengths"], dtype=case["dtype"])
    off = torch.tensor(case["offsets"], dtype=case["dtype"])
    N = (max(case["lengths"]) + bs - 1) // bs
    drift = torch.randint(0, 3, (R, N), generator=gen).float() if case["use_drift"] else None
    # Integer-valued scores force ties, exercising the tie rule.
    scores = torch.randint(0, 4, (R, W), generator=gen).float() if case["use_scores"] else None
    cfg = TopologyKVPolicyConfig(
        policy=case["mode"], sink_blocks=case["sink"], local_blocks=case["local"], witness_blocks=case["wit"],
        block_size=bs, max_structural_fraction=case["frac"],
        coordinate_mismatch_action=FALLBACK if case["scramble"] else CoordinateMismatchAction.RAISE,
        sink_tokens=case["sink_tokens"], structural_budget="scaled" if case["scaled"] else "fixed",
    )
    ctx = TopologyRequestContext(scaffold_token_ids=tuple(range(case["scaffold"])))
    x_dev = x.to(DEVICE)
    res = apply_topology_kv_policy(
        x_dev, L.to(DEVICE), config=cfg, topk_indices_offset=off.to(DEVICE),
        block_drift_scores=None if drift is None else drift.to(DEVICE),
        learned_scores=None if scores is None else scores.to(DEVICE), context=ctx,
    )
    want, counters, bad_rows = ref.reference_topology_policy(
        x, L, mode=case["mode"].value, sink_blocks=case["sink"], local_blocks=case["local"],
        witness_blocks=case["wit"], block_size=bs, max_structural_fraction=case["frac"], offsets=off,
        drift=drift, learned_scores=scores, scaffold_lengths=[case["scaffold"]] * R,
        sink_tokens=case["sink_tokens"], scaled_budget=case["scaled"],
    )
    got = res.indices.cpu()
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, want), f"vectorized != reference\n{got}\n{want}"
    got_counters = res.counters.to_dict()
    got_counters.pop("compression_hits")
    assert got_counters == counters
    for r in range(R):  # output contract
        row = got[r].tolist()
        if r in bad_rows:  # contract violation in the input: the row comes back unchanged
            assert row == x[r].tolist()
            continue
        n = sum(1 for v in row if v >= 0)
        assert all(v >= 0 for v in row[:n]) and all(v == -1 for v in row[n:]), "valid first, -1 tail"
        vals = row[:n]
        assert len(set(vals)) == n, "unique"
        lo, hi = case["offsets"][r], case["offsets"][r] + case["lengths"][r]
        assert all(lo <= v < hi for v in vals), "inside [offset, offset + length)"
        if case["mode"] is ONLY:
            assert n == min(W, case["lengths"][r]) or n == len(
                ref.reference_token_indices(
                    case["lengths"][r],
                    ref.reference_prioritized_blocks(case["lengths"][r], case["sink"], case["local"], W, bs),
                    bs,
                )
            )


def test_mismatch_rows_match_reference():
    x = _t([[0, 5, -1, -1], [1, 2, 3, 4], [7, -5, 6, -1]])
    L = _t([4, 5, 7])
    cfg = _cfg(MERGE, coordinate_mismatch_action=FALLBACK)
    res = apply_topology_kv_policy(x, L, config=cfg)
    want, counters, bad = ref.reference_topology_policy(
        x.cpu(), L.cpu(), mode=MERGE.value, sink_blocks=1, local_blocks=1, witness_blocks=1, block_size=4,
        max_structural_fraction=0.5,
    )
    assert bad == [0, 2]  # 5 >= length 4; 7 >= length 7
    assert torch.equal(res.indices.cpu(), want)
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == counters["coordinate_mismatch_fallbacks"] == 2


# ---------------------------------------------------------------- compile and counters


@pytest.mark.parametrize("sink_tokens, scaled", [(None, False), (6, True)])
@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_core_compiles_fullgraph_without_graph_breaks(mode, sink_tokens, scaled):
    gen = torch.Generator().manual_seed(0)
    W, R = 16, 3
    L = _t([5, 40, 100])
    x = torch.stack([torch.randperm(100, generator=gen)[:W] for _ in range(R)]).to(DEVICE)
    x = torch.where(x < L.unsqueeze(1), x, torch.full_like(x, -1))
    scores = torch.rand(R, W, generator=gen).to(DEVICE)
    drift = torch.rand(R, 30, generator=gen).to(DEVICE)
    scaffold = _t([8, 8, 8])
    layout = PolicyLayout(mode=mode, sink_blocks=1, local_blocks=2, witness_blocks=2, block_size=4,
                          sink_tokens=sink_tokens, max_structural_fraction=0.5, scale_budget_by_length=scaled)

    def fn(*tensors):
        return topology_kv_policy_core(PolicyTensors(*tensors), layout=layout)

    args = (x, L, torch.zeros_like(L), drift, scores, scaffold)
    explain = torch._dynamo.explain(fn)(*args)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    out_c, _ = compiled(*args)
    out_e, _ = fn(*args)
    assert torch.equal(out_c, out_e)


def test_counter_names_cover_the_contract():
    res = apply_topology_kv_policy(_t([[0, 1]]), _t([2]), config=_cfg(MERGE))
    assert set(res.counters.to_dict()) == set(COUNTER_NAMES) | {"compression_hits"}
    assert isinstance(res.counters.selected_tokens, torch.Tensor)  # lazily materialized
    assert res.schedule_ms is None
    timed = apply_topology_kv_policy(_t([[0, 1]]), _t([2]), config=_cfg(MERGE), measure_time=True)
    assert timed.schedule_ms is not None and timed.schedule_ms >= 0.0


# ---------------------------------------------------------------- the hardened coordinate contract

I32_MAX = 2**31 - 1


def _fallback(mode=MERGE, **kw):
    return _cfg(mode, coordinate_mismatch_action=FALLBACK, **kw)


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_duplicate_entries_make_a_row_broken(mode):
    # A row holding the same valid position twice is broken: returned
    # unchanged and counted under FALLBACK_DISABLED, ValueError naming row and value under RAISE.
    x = _t([[0, 10, 37, 11, 20, 21, 22, 23], [5, 9, 5, -1, -1, -1, -1, -1]])
    res = apply_topology_kv_policy(x, _t([40, 40]), config=_fallback(mode))
    assert res.indices[1].tolist() == x[1].tolist()
    assert res.indices[0].tolist() != x[0].tolist()
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 1
    with pytest.raises(ValueError, match="row 1 holds 5 twice"):
        apply_topology_kv_policy(x, _t([40, 40]), config=_cfg(mode))


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_int32_interval_ending_at_2_pow_31_is_valid(mode):
    # offset + length is 2**31, one past the int32 range; the row is valid.
    off = 2**31 - 40
    x = _t([[off + t for t in (1, 2, 3, 30)] + [-1] * 4], dtype=torch.int32)
    L, O = _t([40], dtype=torch.int32), _t([off], dtype=torch.int32)
    res = apply_topology_kv_policy(x, L, config=_fallback(mode), topk_indices_offset=O)
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 0
    want, _, bad = ref.reference_topology_policy(
        x.cpu(), L.cpu(), mode=mode.value, sink_blocks=1, local_blocks=1, witness_blocks=1, block_size=4,
        max_structural_fraction=0.5, offsets=O.cpu(),
    )
    assert bad == [] and torch.equal(res.indices.cpu(), want)
    check_topk_coordinates(x, L, O)  # no error
    apply_topology_kv_policy(x, L, config=_cfg(mode), topk_indices_offset=O)  # RAISE: no error


@pytest.mark.parametrize("mode", ENABLED_MODES)
@pytest.mark.parametrize(
    "row, length, offset, what",
    [
        ([0, 1, 2, -1], 10, -5, "offset -5"),  # negative offset (TOPOLOGY_ONLY emitted -5)
        ([-1, -1, -1, -1], 0, 0, "length 0"),
        ([-1, -1, -1, -1], -3, 0, "length -3"),
        ([I32_MAX - 3, -1, -1, -1], 20, I32_MAX - 9, "past the int32 range"),  # offset+length-1 > max
    ],
)
def test_negative_offset_empty_and_overflowing_rows_are_broken(mode, row, length, offset, what):
    # offset < 0, length <= 0, and offset + length - 1 > dtype max break a row.
    x = _t([row, [0, 1, -1, -1]], dtype=torch.int32)
    L, O = _t([length, 4]), _t([offset, 0])  # int64 lengths/offsets with int32 rows
    res = apply_topology_kv_policy(x, L, config=_fallback(mode), topk_indices_offset=O)
    assert res.indices[0].tolist() == row
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 1
    with pytest.raises(ValueError, match=f"row 0.*{what}"):
        check_topk_coordinates(x, L, O)


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_int64_lengths_with_int32_rows_are_not_truncated(mode):
    # A length of 2**32 + 5 is read as int64, never truncated to 5 (the int32 rows' dtype).
    x = _t([[0, 1, 2, -1, -1, -1, -1, -1]], dtype=torch.int32)
    res = apply_topology_kv_policy(x, _t([2**32 + 5]), config=_fallback(mode))
    assert res.indices.tolist() == x.tolist()
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 1
    # An int64 offset past the int32 range is not truncated either (2**32 would read as 0).
    res = apply_topology_kv_policy(x, _t([8]), config=_fallback(mode), topk_indices_offset=_t([2**32]))
    assert res.indices.tolist() == x.tolist()
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 1


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_zero_width_is_rejected(mode, validate):
    # W == 0 is an argument error naming topk_indices, not a failure inside the core.
    with pytest.raises(ValueError, match="topk_indices: expected W >= 1"):
        apply_topology_kv_policy(torch.zeros(2, 0, dtype=torch.int32, device=DEVICE), _t([4, 4]),
                                 config=_fallback(mode), validate=validate)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts reads of tensor values by the host (each one a device sync on a GPU)."""

    READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.__index__, torch.Tensor.tolist}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def test_check_topk_coordinates_reads_the_host_once_on_success():
    # The success path reads one value on the host (the any-violation flag), no more.
    x = _t([_engine_row(40, 8, chosen=range(10, 18)), _engine_row(5, 8)], dtype=torch.int32)
    with _HostReads() as reads:
        check_topk_coordinates(x, _t([40, 5]), _t([0, 0]))
    assert reads.count == 1
    with _HostReads() as reads:
        apply_topology_kv_policy(x, _t([40, 5]), config=_cfg(MERGE))
    assert reads.count == 1
    with _HostReads() as reads:  # FALLBACK_DISABLED never reads
        apply_topology_kv_policy(x, _t([40, 5]), config=_fallback())
    assert reads.count == 0


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_drift_table_shorter_than_a_row_makes_the_row_broken(mode):
    # A drift table with N = 3 blocks cannot score the 10 blocks of a length-40
    # row (block 4): the row is broken, never scheduled on blocks 0..2 silently. The
    # length-12 row needs 3 blocks and is processed.
    drift = torch.ones(2, 3, device=DEVICE)
    x = _t([[20, 21, 22, -1, -1, -1, -1, -1], [4, 5, -1, -1, -1, -1, -1, -1]])
    res = apply_topology_kv_policy(x, _t([40, 12]), config=_fallback(mode), block_drift_scores=drift)
    assert res.indices[0].tolist() == x[0].tolist()
    assert res.indices[1].tolist() != x[1].tolist()
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 1
    with pytest.raises(ValueError, match="block_drift_scores: .*row 0 needs 10 blocks"):
        apply_topology_kv_policy(x, _t([40, 12]), config=_cfg(mode), block_drift_scores=drift)


def test_a_row_longer_than_the_drift_table_is_named_for_the_table_not_a_duplicate():
    # Found by hypothesis on a fresh clone: the bitmap duplicate check (sized by the drift
    # table) wrapped 32 onto 0 in this row of 40 tokens against a 2-block table, so the
    # host check named "duplicate" first and then found no duplicate to print
    # (StopIteration). The row is broken by the drift rule, which must be the one named.
    x = _t([[-1, -1, -1, -1, -1], [0, 32, 2, 3, -1]])
    drift = torch.ones(2, 2, device=DEVICE)
    cfg = TopologyKVPolicyConfig(policy="topology_sparse_merge", block_size=1, sink_tokens=None,
                                 coordinate_mismatch_action="raise")
    with pytest.raises(ValueError, match="block_drift_scores: row 1 needs 40 blocks .* the table has 2"):
        apply_topology_kv_policy(x, _t([2, 40]), config=cfg, block_drift_scores=drift)
    with pytest.raises(ValueError, match="block_drift_scores: row 1 needs 40 blocks"):
        check_topk_coordinates(x, _t([2, 40]), drift_blocks=2, block_size=1)


def _broken_row(row, length, off, dtype, table_blocks, bs):
    """The broken-row rule, written out (docs/architecture.md, "The policy's contract")."""
    if off < 0 or length <= 0 or off + length - 1 > torch.iinfo(dtype).max:
        return True
    n = sum(1 for v in row if v >= 0)
    vals = row[:n]
    if any(v >= 0 for v in row[n:]) or any(not off <= v < off + length for v in vals):
        return True
    if len(set(vals)) != n:
        return True
    return table_blocks is not None and -(-length // bs) > table_blocks


@st.composite
def adversarial_cases(draw):
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    len_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    off_dtype = draw(st.sampled_from([None, torch.int32, torch.int64]))
    W = draw(st.sampled_from([1, 2, 5, 8]))
    R = draw(st.integers(1, 4))
    big = [2**31, 2**32 + 5] if len_dtype is torch.int64 else []
    lengths = [draw(st.sampled_from([-3, 0, 1, 2, 5, 8, 17, 40] + big)) for _ in range(R)]
    big_off = [2**40] if off_dtype is torch.int64 else []
    offsets = [0] * R if off_dtype is None else [
        draw(st.sampled_from([0, 0, 7, -5, I32_MAX - 39, I32_MAX - 2] + big_off)) for _ in range(R)
    ]
    imin, imax = torch.iinfo(dtype).min, torch.iinfo(dtype).max
    rows = []
    for length, off in zip(lengths, offsets):
        span = max(0, min(length, 60))
        n = draw(st.integers(0, min(W, span)))
        vals = [off + t for t in draw(st.permutations(range(span)))[:n]]
        row = vals + [draw(st.sampled_from([-1, -1, -7, imin])) for _ in range(W - n)]
        defect = draw(st.sampled_from(["none", "none", "dup", "out", "scramble"]))
        if defect == "dup" and n >= 1:
            row[draw(st.integers(0, W - 1))] = vals[0]
        elif defect == "out":
            row[draw(st.integers(0, W - 1))] = off + length + draw(st.integers(0, 3))
        elif defect == "scramble":
            row = draw(st.permutations(row))
        rows.append([v if imin <= v <= imax else -1 for v in row])
    bs = draw(st.sampled_from([1, 4]))
    need = max(-(-max(lengths) // bs), 1)
    table = draw(st.one_of(st.none(), st.integers(1, min(need + 1, 64))))
    return dict(dtype=dtype, len_dtype=len_dtype, off_dtype=off_dtype, W=W, lengths=lengths, offsets=offsets,
                rows=rows, bs=bs, table=table, mode=draw(st.sampled_from(ENABLED_MODES)),
                action=draw(st.sampled_from(list(CoordinateMismatchAction))),
                sink_tokens=draw(st.sampled_from([None, 0, 3])), scores=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=200, deadline=None)
@given(case=adversarial_cases())
def test_adversarial_inputs_raise_fall_back_or_keep_the_contract(case):
    gen = torch.Generator().manual_seed(case["seed"])
    R, W, bs = len(case["rows"]), case["W"], case["bs"]
    x = torch.tensor(case["rows"], dtype=case["dtype"], device=DEVICE)
    L = torch.tensor(case["lengths"], dtype=case["len_dtype"], device=DEVICE)
    O = None if case["off_dtype"] is None else torch.tensor(case["offsets"], dtype=case["off_dtype"], device=DEVICE)
    drift = None if case["table"] is None else torch.rand(R, case["table"], generator=gen).to(DEVICE)
    scores = torch.randn(R, W, generator=gen).to(DEVICE) if case["scores"] else None
    cfg = TopologyKVPolicyConfig(policy=case["mode"], sink_blocks=1, local_blocks=1, witness_blocks=1, block_size=bs,
                                 max_structural_fraction=0.5, coordinate_mismatch_action=case["action"],
                                 sink_tokens=case["sink_tokens"])
    inputs = [t for t in (x, L, O, drift, scores) if t is not None]
    before = [t.clone() for t in inputs]
    broken = [r for r in range(R) if _broken_row(case["rows"][r], case["lengths"][r], case["offsets"][r],
                                                 case["dtype"], case["table"], bs)]
    try:
        res = apply_topology_kv_policy(x, L, config=cfg, topk_indices_offset=O, block_drift_scores=drift,
                                       learned_scores=scores)
    except ValueError as err:
        assert case["action"] is CoordinateMismatchAction.RAISE and broken, err
        assert str(err).split(":")[0] in ("topk_indices", "lengths", "topk_indices_offset", "block_drift_scores")
        return
    finally:
        assert all(torch.equal(a, b) for a, b in zip(inputs, before)), "inputs mutated"
    assert case["action"] is FALLBACK or not broken
    got = res.indices.cpu().tolist()
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == len(broken)
    for r in range(R):
        if r in broken:
            assert got[r] == case["rows"][r]
            continue
        n = sum(1 for v in got[r] if v >= 0)
        assert all(v == -1 for v in got[r][n:]), "valid first, -1 after"
        vals, lo = got[r][:n], case["offsets"][r]
        assert len(set(vals)) == n and all(lo <= v < lo + case["lengths"][r] for v in vals)
    if max(case["lengths"]) > 10**6:  # the loop reference walks every block of a row
        return
    want, counters, bad = ref.reference_topology_policy(
        x.cpu(), L.cpu(), mode=case["mode"].value, sink_blocks=1, local_blocks=1, witness_blocks=1, block_size=bs,
        max_structural_fraction=0.5, offsets=None if O is None else O.cpu(),
        drift=None if drift is None else drift.cpu(), learned_scores=None if scores is None else scores.cpu(),
        sink_tokens=case["sink_tokens"],
    )
    assert bad == broken and got == want.tolist()
    assert {k: v for k, v in res.counters.to_dict().items() if k != "compression_hits"} == counters


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**16), W=st.sampled_from([1, 2, 7, 64, 130]), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_duplicate_rule_is_the_same_with_and_without_a_drift_table(seed, W, dtype):
    # With a drift table the duplicate rule uses a bitmap bounded by the table, else a sort:
    # the broken rows must be the same (rows longer than the table are broken either way).
    from rtp_llm.models_py.modules.hybrid.topology_kv.row_contract import row_violations

    gen = torch.Generator().manual_seed(seed)
    R, span = 6, 3 * W + 64
    x = torch.randint(-2, span, (R, W), generator=gen).to(dtype)
    x = torch.sort(torch.where(x < 0, -1, x), dim=1, descending=True).values  # valid first
    off = torch.randint(0, 3, (R,), generator=gen)
    x = torch.where(x >= 0, x + off.unsqueeze(1).to(dtype), x).to(DEVICE)
    L, off = torch.full((R,), span, device=DEVICE), off.to(DEVICE)
    by_sort = row_violations(x, L, off)["duplicate"]
    by_bitmap = row_violations(x, L, off, drift_blocks=span, block_size=1)["duplicate"]
    want = [len(set(v for v in row if v >= 0)) != sum(1 for v in row if v >= 0) for row in x.tolist()]
    assert by_sort.tolist() == by_bitmap.tolist() == want


I64_MAX = 2**63 - 1


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_int64_interval_ending_at_2_pow_63_is_valid_and_one_past_is_broken(mode):
    # offset + length is 2**63 (one past int64): forming it overflowed, so a valid row was
    # flagged broken; one token more does not fit int64 and must be broken.
    L1 = _t([1], dtype=torch.int64)
    x = _t([[I64_MAX, -1, -1, -1]], dtype=torch.int64)
    O = _t([I64_MAX], dtype=torch.int64)
    res = apply_topology_kv_policy(x, L1, config=_fallback(mode), topk_indices_offset=O)
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 0
    assert res.indices.cpu().tolist() == [[I64_MAX, -1, -1, -1]]
    check_topk_coordinates(x, L1, O)  # no error
    L2 = _t([2], dtype=torch.int64)
    res = apply_topology_kv_policy(x, L2, config=_fallback(mode), topk_indices_offset=O)
    assert res.counters.to_dict()["coordinate_mismatch_fallbacks"] == 1
    assert torch.equal(res.indices, x)
    with pytest.raises(ValueError, match="row 0"):
        check_topk_coordinates(x, L2, O)
    # A row of int64-min padding (no valid entry) near no limit stays valid (hypothesis found
    # the first version of the overflow fix subtracting the offset from the padding).
    pad = _t([[-(2**63)]], dtype=torch.int64)
    check_topk_coordinates(pad, _t([1], dtype=torch.int32), _t([7], dtype=torch.int32))


@pytest.mark.parametrize("bad", [2, -1, 2**40])
@pytest.mark.parametrize("action", [FALLBACK, CoordinateMismatchAction.RAISE])
def test_row_to_request_out_of_range_names_the_argument_row_and_table(bad, action):
    # The error names the argument, the row, its value and the table it indexes.
    x = _t([[0, 1, -1, -1], [0, 1, 2, -1]])
    L = _t([2, 3])
    drift = torch.rand(2, 4).to(DEVICE)
    r2r = _t([0, bad])
    cfg = _cfg(MERGE, coordinate_mismatch_action=action)
    with pytest.raises(ValueError, match=rf"row_to_request: row 1 holds {bad}, outside \[0, 2\) "
                                         r"\(the rows of block_drift_scores\)"):
        apply_topology_kv_policy(x, L, config=cfg, block_drift_scores=drift, row_to_request=r2r)
    contexts = [TopologyRequestContext(scaffold_token_ids=[1, 2]), TopologyRequestContext(scaffold_token_ids=[3])]
    with pytest.raises(ValueError, match=rf"row_to_request: row 1 holds {bad}, outside \[0, 2\) \(the contexts\)"):
        apply_topology_kv_policy(x, L, config=_cfg(COMPRESS, coordinate_mismatch_action=action),
                                 row_to_request=r2r, context=contexts)
