"""Tests of the topology schedule library (centroids, drift, block schedules, expansion).

Run on CPU by ``//benchmark:topology_kv_candidate_schedule_test``; the same file runs on
CUDA in ``..._cuda_manual`` when ``TOPOLOGY_KV_TEST_DEVICE=cuda``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv.test import reference as ref
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import (
    DriftMetric,
    block_drift_scores,
    block_key_centroids,
)
from benchmark.candidates.block_schedule import (
    TopologyScheduleConfig,
    build_block_schedule,
    build_topology_token_indices,
    expand_block_schedule,
    prioritized_block_schedule_unchecked,
)
from tools.device_under_test import DEVICE

# Lengths that land on partly filled 64-token pages: 1 (one token), 63/64/65 (around
# one page), 2047/2049 (around the engine's top-k width 2048).
EDGE_LENGTHS = [1, 63, 64, 65, 2047, 2049]

# The reference averages the very same 16-bit values in float64, so only the sum's
# rounding differs: fp32 accumulation of 64 values near 100 is off by ~1e-5, while a
# 16-bit accumulator would be off by ~0.06 (fp16 spacing is 4 at 6400) and fail.
CENTROID_TOL = {torch.float16: (1e-6, 1e-4), torch.bfloat16: (1e-6, 1e-4), torch.float32: (1e-6, 1e-4)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _lengths(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


# ---------------------------------------------------------------- hand-computed schedules


def test_sink_local_witness_by_drift_hand_computed():
    # 10 blocks of 4 tokens, length 40: sink {0}, local {9, 8}, witnesses = top-2 drift
    # among blocks 1..7: drift[3] = 5 and drift[6] = 4 win.
    cfg = TopologyScheduleConfig(sink_blocks=1, local_blocks=2, witness_blocks=2, block_size=4)
    drift = torch.tensor([[0, 1, 2, 5, 0, 3, 4, 0, 9, 9]], dtype=torch.float32, device=DEVICE)
    blocks = build_block_schedule(_lengths(40), cfg, drift)
    assert blocks.tolist() == [[0, 3, 6, 8, 9]]
    prio = prioritized_block_schedule_unchecked(_lengths(40), 1, 2, 2, 4, drift)
    assert prio.tolist() == [[0, 9, 8, 3, 6]], "priority order: sinks, locals newest first, witnesses by drift"


def test_drift_ties_go_to_lower_block():
    cfg = TopologyScheduleConfig(sink_blocks=0, local_blocks=0, witness_blocks=2, block_size=2)
    drift = torch.tensor([[1.0, 7.0, 7.0, 7.0, 1.0]], device=DEVICE)
    assert build_block_schedule(_lengths(10), cfg, drift).tolist() == [[1, 2]]


def test_witness_fallback_without_drift_is_most_recent_eligible():
    cfg = TopologyScheduleConfig(sink_blocks=1, local_blocks=2, witness_blocks=2, block_size=4)
    assert build_block_schedule(_lengths(40), cfg).tolist() == [[0, 6, 7, 8, 9]]


def test_overlap_short_row_never_double_counts():
    # 3 blocks: sink 0; locals want {2, 1} (0 is taken by the sink); no witness left.
    cfg = TopologyScheduleConfig(sink_blocks=1, local_blocks=3, witness_blocks=2, block_size=4)
    assert build_block_schedule(_lengths(9), cfg).tolist() == [[0, 1, 2, -1, -1, -1]]


def test_single_block_and_partial_last_block():
    cfg = TopologyScheduleConfig(sink_blocks=1, local_blocks=1, witness_blocks=1, block_size=64)
    toks = build_topology_token_indices(_lengths(1, 63, 64, 65), cfg)
    assert toks.shape == (4, 3 * 64)
    assert toks[0].tolist() == [0] + [-1] * 191
    assert toks[1].tolist() == list(range(63)) + [-1] * 129
    assert toks[2].tolist() == list(range(64)) + [-1] * 128
    # 65 tokens: block 0 (sink) + block 1 holding token 64 (local, partial).
    assert toks[3].tolist() == list(range(65)) + [-1] * 127


def test_budget_larger_than_sequence_keeps_everything_once():
    cfg = TopologyScheduleConfig.from_token_budget(4096, block_size=64)
    toks = build_topology_token_indices(_lengths(2047, 2049), cfg)
    assert toks[0, :2047].tolist() == list(range(2047)) and (toks[0, 2047:] == -1).all()
    assert toks[1, :2049].tolist() == list(range(2049)) and (toks[1, 2049:] == -1).all()


def test_from_token_budget_splits_and_fits():
    for budget, split in [(64, (1, 0, 0)), (128, (1, 1, 0)), (256, (1, 2, 1)), (1024, (1, 8, 7)), (1000, (1, 7, 7))]:
        cfg = TopologyScheduleConfig.from_token_budget(budget)
        assert (cfg.sink_blocks, cfg.local_blocks, cfg.witness_blocks) == split, budget
        assert cfg.max_tokens <= budget


def test_expand_block_schedule_hand_computed():
    blocks = torch.tensor([[0, 2, -1], [1, -1, -1]], device=DEVICE)
    toks = expand_block_schedule(blocks, _lengths(10, 7), 4)
    assert toks.tolist() == [[0, 1, 2, 3, 8, 9] + [-1] * 6, [4, 5, 6] + [-1] * 9]


@pytest.mark.parametrize("length", EDGE_LENGTHS)
def test_edge_lengths_match_reference_and_are_causal(length):
    cfg = TopologyScheduleConfig(sink_blocks=1, local_blocks=2, witness_blocks=3, block_size=64)
    n = (length + 63) // 64
    drift = torch.rand(1, n, generator=_gen(length)).to(DEVICE)
    toks = build_topology_token_indices(_lengths(length), cfg, drift)
    blocks = ref.reference_prioritized_blocks(length, 1, 2, 3, 64, drift[0].tolist())
    expected = ref.reference_token_indices(length, blocks, 64)
    got = [t for t in toks[0].tolist() if t >= 0]
    assert got == expected
    assert max(got) < length


# ---------------------------------------------------------------- centroids and drift


def test_centroids_partial_block_and_lengths_hand_computed():
    keys = torch.arange(10, dtype=torch.float32, device=DEVICE).view(10, 1, 1)
    cents = block_key_centroids(keys, block_size=4)
    assert cents.flatten().tolist() == [1.5, 5.5, 8.5]  # last block = mean(8, 9)
    batched = torch.stack([keys, keys])  # [2, 10, 1, 1]
    cents_b = block_key_centroids(batched, block_size=4, lengths=_lengths(10, 5))
    assert cents_b[1].flatten().tolist() == [1.5, 4.0, 0.0]  # only token 4 in block 1


def test_drift_l2_and_cosine_hand_computed():
    cents = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[0.0, 3.0]]], device=DEVICE)  # [3, 1, 2]
    l2 = block_drift_scores(cents, DriftMetric.L2)
    torch.testing.assert_close(l2.cpu(), torch.tensor([0.0, 2**0.5, 2.0]))
    cos = block_drift_scores(cents, "COSINE")
    torch.testing.assert_close(cos.cpu(), torch.tensor([0.0, 1.0, 0.0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_centroid_accumulation_accuracy_16bit(dtype):
    # 2049 tokens: many fp16 additions would drift without fp32 accumulation.
    keys = (torch.randn(2049, 2, 8, generator=_gen(3)) + 100.0).to(dtype)
    got = block_key_centroids(keys.to(DEVICE), 64)
    assert got.dtype == torch.float32
    want = ref.reference_block_key_centroids(keys, 64).to(torch.float32)
    rtol, atol = CENTROID_TOL[dtype]
    torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=atol, msg=f"centroids {dtype}")
    drift = block_drift_scores(got)
    torch.testing.assert_close(
        drift.cpu().double(), torch.tensor(ref.reference_drift_l2(want), dtype=torch.float64), rtol=1e-4, atol=1e-4
    )


# ---------------------------------------------------------------- batched, determinism, RNG


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=6),
    sink=st.integers(0, 3),
    local=st.integers(0, 4),
    witness=st.integers(0, 5),
    block_size=st.sampled_from([1, 4, 16, 64]),
    use_drift=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_batched_equals_per_request_reference(lengths, sink, local, witness, block_size, use_drift, seed):
    if sink + local + witness == 0:
        witness = 1
    cfg = TopologyScheduleConfig(sink, local, witness, block_size)
    n = (max(lengths) + block_size - 1) // block_size
    # Integer-valued drift makes ties frequent, so the tie rule is exercised.
    drift = torch.randint(0, 4, (len(lengths), n), generator=_gen(seed)).float() if use_drift else None
    L = _lengths(*lengths)
    toks = build_topology_token_indices(L, cfg, None if drift is None else drift.to(DEVICE)).cpu()
    assert toks.shape == (len(lengths), cfg.max_tokens)
    for r, length in enumerate(lengths):
        blocks = ref.reference_prioritized_blocks(
            length, sink, local, witness, block_size, None if drift is None else drift[r].tolist()
        )
        expected = ref.reference_token_indices(length, blocks, block_size)
        row = toks[r].tolist()
        assert row[: len(expected)] == expected, f"row {r} length {length}"
        assert all(t == -1 for t in row[len(expected) :]), f"row {r}: -1 tail"
        one = build_topology_token_indices(
            _lengths(length), cfg, None if drift is None else drift[r : r + 1].to(DEVICE)
        ).cpu()
        assert one[0].tolist() == row, "batched == per-request"


def test_deterministic_and_global_rng_untouched():
    state = torch.random.get_rng_state()
    cfg = TopologyScheduleConfig(1, 2, 3, 16)
    keys = torch.randn(300, 2, 4, generator=_gen(0)).to(DEVICE)
    drift = block_drift_scores(block_key_centroids(keys, 16)).unsqueeze(0)
    a = build_topology_token_indices(_lengths(300), cfg, drift)
    b = build_topology_token_indices(_lengths(300), cfg, drift)
    assert torch.equal(a, b)
    assert torch.equal(state, torch.random.get_rng_state())


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=-64), "block_size"),
        (dict(sink_blocks=-1), "sink_blocks"),
        (dict(local_blocks=-2), "local_blocks"),
        (dict(witness_blocks=-1), "witness_blocks"),
        (dict(sink_blocks=0, local_blocks=0, witness_blocks=0), "sink_blocks \\+ local_blocks"),
    ],
)
def test_bad_config_raises_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TopologyScheduleConfig(**kwargs)


def test_bad_config_types():
    with pytest.raises(TypeError, match="block_size"):
        TopologyScheduleConfig(block_size=64.0)
    with pytest.raises(ValueError, match="token_budget"):
        TopologyScheduleConfig.from_token_budget(0)
    with pytest.raises(ValueError, match="token_budget"):
        TopologyScheduleConfig.from_token_budget(63, block_size=64)


def test_bad_tensors_raise_naming_the_argument():
    cfg = TopologyScheduleConfig()
    for bad, match in [(_lengths(0), "lengths"), (_lengths(5, -1), "lengths")]:
        with pytest.raises(ValueError, match=match):
            build_block_schedule(bad, cfg)
    with pytest.raises(TypeError, match="lengths"):
        build_block_schedule(torch.tensor([3.0], device=DEVICE), cfg)
    with pytest.raises(ValueError, match="lengths"):
        build_block_schedule(torch.tensor([[3]], device=DEVICE), cfg)
    with pytest.raises(ValueError, match="drift_scores"):
        build_block_schedule(_lengths(200), cfg, torch.zeros(1, 2, device=DEVICE))  # needs 4 blocks
    with pytest.raises(ValueError, match="keys"):
        block_key_centroids(torch.zeros(4, 4, device=DEVICE))
    with pytest.raises(TypeError, match="keys"):
        block_key_centroids(torch.zeros(4, 1, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="block_size"):
        block_key_centroids(torch.zeros(4, 1, 4, device=DEVICE), block_size=0)
    with pytest.raises(ValueError, match="drift metric"):
        block_drift_scores(torch.zeros(2, 1, 4, device=DEVICE), "manhattan")
    with pytest.raises(ValueError, match="block_size"):
        expand_block_schedule(torch.zeros(1, 1, dtype=torch.int64, device=DEVICE), _lengths(3), 0)


def test_inputs_not_mutated():
    lengths = _lengths(100, 37)
    drift = torch.rand(2, 2, generator=_gen(1)).to(DEVICE)
    before = (lengths.clone(), drift.clone())
    build_topology_token_indices(lengths, TopologyScheduleConfig(1, 1, 1, 64), drift)
    assert torch.equal(lengths, before[0]) and torch.equal(drift, before[1])


# ---------------------------------------------------------------- witness signals


def test_witness_signal_parsing():
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import WitnessSignal

    assert WitnessSignal.parse("Query_Centroid") is WitnessSignal.QUERY_CENTROID
    assert WitnessSignal.parse(" Default ") is WitnessSignal.AUTO  # the harness's spelling of auto
    # One vocabulary: the error lists every signal, served and harness-only.
    with pytest.raises(ValueError, match="witness_signal: expected one of \\[auto, key_drift, recency, value_drift, "
                                         "query_centroid, query_mass, query_bound, query_group_mass\\]"):
        WitnessSignal.parse("attention")


def test_query_centroid_scores_hand_computed_and_vs_loop():
    from benchmark.candidates.witness import query_centroid_scores

    # 2 query heads share 1 KV head; centroids of 3 blocks in D=2.
    q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]], device=DEVICE)  # [R=1, H=2, D=2]
    c = torch.tensor([[[1.0, 1.0]], [[-1.0, 0.0]], [[0.0, -3.0]]], device=DEVICE)  # [N=3, Hkv=1, D=2]
    # block 0: relu(1) + relu(2) = 3; block 1: relu(-1) + relu(0) = 0; block 2: 0 + relu(-6) = 0
    assert query_centroid_scores(q, c).tolist() == [[3.0, 0.0, 0.0]]
    gen = _gen(5)
    q = torch.randn(4, 6, 8, generator=gen)
    c = torch.randn(4, 5, 3, 8, generator=gen)
    got = query_centroid_scores(q.to(DEVICE), c.to(DEVICE)).cpu()
    for r in range(4):
        for b in range(5):
            want = sum(max(0.0, float(q[r, h] @ c[r, b, h // 2])) for h in range(6))
            assert abs(float(got[r, b]) - want) < 1e-4
    with pytest.raises(ValueError, match="key_centroids"):
        query_centroid_scores(q.to(DEVICE), torch.zeros(5, 4, 8, device=DEVICE))  # 4 does not divide 6


def test_block_key_bounds_hand_computed_and_lengths():
    from benchmark.candidates.witness import block_key_bounds

    # L=3, H=1, D=2, block 2: block 0 = tokens 0-1, block 1 = token 2.
    keys = torch.tensor([[[1.0, -2.0]], [[3.0, 5.0]], [[-4.0, 0.5]]], device=DEVICE)
    kmin, kmax = block_key_bounds(keys, block_size=2)
    assert kmin.squeeze(1).tolist() == [[1.0, -2.0], [-4.0, 0.5]]
    assert kmax.squeeze(1).tolist() == [[3.0, 5.0], [-4.0, 0.5]]
    # Batched with lengths: the second request holds 1 token, so its block 1 is empty (zeros)
    # and its block 0 is token 0 alone.
    kmin, kmax = block_key_bounds(torch.stack([keys, keys]), block_size=2, lengths=torch.tensor([3, 1], device=DEVICE))
    assert kmin[1].squeeze(1).tolist() == [[1.0, -2.0], [0.0, 0.0]]
    assert kmax[1].squeeze(1).tolist() == [[1.0, -2.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="lengths: only valid with batched keys"):
        block_key_bounds(keys, block_size=2, lengths=torch.tensor([1]))


@settings(max_examples=25, deadline=None)
@given(
    L=st.integers(1, 40),
    bs=st.sampled_from([1, 3, 8, 16]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_block_key_bounds_vs_reference(L, bs, dtype, seed):
    from benchmark.candidates.witness import block_key_bounds

    keys = (torch.randn(2, L, 2, 3, generator=_gen(seed)) * 10).to(dtype)
    lengths = torch.randint(1, L + 1, (2,), generator=_gen(seed + 1))
    kmin, kmax = block_key_bounds(keys.to(DEVICE), block_size=bs, lengths=lengths.to(DEVICE))
    for b in range(2):
        want_min, want_max = ref.reference_block_key_bounds(keys[b], bs, int(lengths[b]))
        # min/max pick one of the inputs: exact after the fp32 cast.
        assert torch.equal(kmin[b].cpu().to(torch.float64), want_min)
        assert torch.equal(kmax[b].cpu().to(torch.float64), want_max)


def test_query_bound_scores_hand_computed():
    from benchmark.candidates.witness import query_bound_scores

    # One head, D=2, scale 1: q = (1, -1). Block 0 keys in [0,2] x [-1,1]: u = 1*2 + (-1)(-1) = 3.
    # Block 1 keys in [-1,0] x [0,3]: u = 1*0 + (-1)*0 = 0. Softmax: e^3/(e^3+1), 1/(e^3+1).
    q = torch.tensor([[[1.0, -1.0]]], device=DEVICE)
    kmin = torch.tensor([[[0.0, -1.0]], [[-1.0, 0.0]]], device=DEVICE)
    kmax = torch.tensor([[[2.0, 1.0]], [[0.0, 3.0]]], device=DEVICE)
    got = query_bound_scores(q, kmin, kmax, scale=1.0).cpu()
    e3 = torch.tensor(3.0).exp()
    assert torch.allclose(got, torch.stack([e3 / (e3 + 1), 1 / (e3 + 1)]).unsqueeze(0))
    # With length 1 (block size 64) only block 0 is eligible: it takes the head's whole mass.
    got = query_bound_scores(q, kmin, kmax, lengths=torch.tensor([1], device=DEVICE), scale=1.0).cpu()
    assert got.tolist() == [[1.0, 0.0]]
    # The bound holds: no key inside the box beats u (block 0: the corner (2, -1) reaches 3).
    corners = torch.tensor([[0.0, -1.0], [0.0, 1.0], [2.0, -1.0], [2.0, 1.0]])
    assert float((corners @ torch.tensor([1.0, -1.0])).max()) == 3.0


@settings(max_examples=20, deadline=None)
@given(
    R=st.integers(1, 4),
    N=st.integers(1, 6),
    groups=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
    per_row=st.booleans(),
    with_lengths=st.booleans(),
    signal=st.sampled_from(["query_bound", "query_mass", "query_group_mass"]),
    seed=st.integers(0, 2**16),
)
def test_query_mass_and_bound_scores_vs_reference(R, N, groups, per_row, with_lengths, signal, seed):
    from benchmark.candidates.witness import query_bound_scores, query_group_mass_scores, query_mass_scores

    H, Hkv = groups
    D, bs = 5, 4
    gen = _gen(seed)
    q = torch.randn(R, H, D, generator=gen) * 3
    shape = (R, N, Hkv, D) if per_row else (N, Hkv, D)
    a, b = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    lengths = torch.randint(1, N * bs + 1, (R,), generator=gen) if with_lengths else None
    dev_lengths = None if lengths is None else lengths.to(DEVICE)
    if signal == "query_bound":
        got = query_bound_scores(q.to(DEVICE), kmin.to(DEVICE), kmax.to(DEVICE), dev_lengths, bs).cpu()
    elif signal == "query_group_mass":
        got = query_group_mass_scores(q.to(DEVICE), a.to(DEVICE), dev_lengths, bs).cpu()
    else:
        got = query_mass_scores(q.to(DEVICE), a.to(DEVICE), dev_lengths, bs).cpu()
    for r in range(R):
        length = None if lengths is None else int(lengths[r])
        row = (lambda t: t[r]) if per_row else (lambda t: t)
        if signal == "query_bound":
            want = ref.reference_query_bound_scores(q[r], row(kmin), row(kmax), length, bs, D ** -0.5)
        elif signal == "query_group_mass":
            want = ref.reference_query_group_mass_scores(q[r], row(a), length, bs, D ** -0.5)
        else:
            want = ref.reference_query_mass_scores(q[r], row(a), length, bs, D ** -0.5)
        assert torch.allclose(got[r].to(torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-5)
        # each head (each KV head's group, for query_group_mass) contributes mass 1
        assert abs(float(got[r].sum()) - (Hkv if signal == "query_group_mass" else H)) < 1e-4
        if length is not None:
            assert not got[r, (length + bs - 1) // bs :].any()  # blocks past the row score 0


def test_query_mass_scores_hand_computed():
    from benchmark.candidates.witness import query_mass_scores

    # Two heads share one KV head, D=2, scale 1. Centroids: block 0 (1, 0), block 1 (0, 1).
    # Head 0 q=(2, 0): logits 2, 0 -> e^2/(e^2+1), 1/(e^2+1). Head 1 q=(0, 0): 1/2, 1/2.
    q = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]], device=DEVICE)
    c = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], device=DEVICE)
    e2 = torch.tensor(2.0).exp()
    want = torch.stack([e2 / (e2 + 1) + 0.5, 1 / (e2 + 1) + 0.5]).unsqueeze(0)
    assert torch.allclose(query_mass_scores(q, c, scale=1.0).cpu(), want)
    # The default scale is D ** -0.5: logits 2/sqrt(2) = sqrt(2).
    s2 = torch.tensor(2.0).sqrt().exp()
    want = torch.stack([s2 / (s2 + 1) + 0.5, 1 / (s2 + 1) + 0.5]).unsqueeze(0)
    assert torch.allclose(query_mass_scores(q, c).cpu(), want)
    # Length 3 with block size 4: one eligible block takes both heads' mass.
    assert query_mass_scores(q, c, lengths=torch.tensor([3], device=DEVICE), block_size=4).cpu().tolist() == [[2.0, 0.0]]


def test_query_group_mass_scores_hand_computed():
    from benchmark.candidates.witness import query_group_mass_scores, query_mass_scores

    # Two heads share one KV head, D=2, scale 1: their mean query (1, 0) against centroids
    # (1, 0) and (0, 1) gives logits 1, 0 -> e/(e+1), 1/(e+1); one softmax, the row sums to 1.
    q = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]], device=DEVICE)
    c = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], device=DEVICE)
    e1 = torch.tensor(1.0).exp()
    want = torch.stack([e1 / (e1 + 1), 1 / (e1 + 1)]).unsqueeze(0)
    assert torch.allclose(query_group_mass_scores(q, c, scale=1.0).cpu(), want)
    # Length 3 with block size 4: one eligible block takes the group's mass.
    got = query_group_mass_scores(q, c, lengths=torch.tensor([3], device=DEVICE), block_size=4).cpu()
    assert got.tolist() == [[1.0, 0.0]]
    # One query head per KV head: the same as query_mass.
    gen = _gen(3)
    q2, c2 = torch.randn(3, 2, 4, generator=gen).to(DEVICE), torch.randn(5, 2, 4, generator=gen).to(DEVICE)
    lengths = torch.tensor([1, 9, 20], device=DEVICE)
    assert torch.equal(query_group_mass_scores(q2, c2, lengths, 4), query_mass_scores(q2, c2, lengths, 4))
    with pytest.raises(ValueError, match="key_centroids: expected \\[..., Hkv, 4\\]"):
        query_group_mass_scores(q2, torch.zeros(5, 3, 4, device=DEVICE))


def test_query_bound_scores_bad_input_names_argument():
    from benchmark.candidates.witness import query_bound_scores

    q = torch.randn(2, 4, 8, device=DEVICE)
    k = torch.zeros(3, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="key_max: expected the shape of key_min"):
        query_bound_scores(q, k, torch.zeros(3, 2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="key_min: expected \\[..., Hkv, 8\\]"):
        query_bound_scores(q, torch.zeros(3, 3, 8, device=DEVICE), torch.zeros(3, 3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="lengths: expected shape \\(2,\\)"):
        query_bound_scores(q, k, k, lengths=torch.tensor([1], device=DEVICE))
    with pytest.raises(ValueError, match="scale: expected a positive number"):
        query_bound_scores(q, k, k, scale=0.0)
    from benchmark.candidates.witness import query_mass_scores

    with pytest.raises(ValueError, match="key_centroids: expected 2 rows"):
        query_mass_scores(q, torch.zeros(3, 3, 2, 8, device=DEVICE))
    with pytest.raises(TypeError, match="query: expected dtype"):
        query_mass_scores(q.to(torch.int64), k)


def test_query_aware_witness_signals_compile_fullgraph():
    from rtp_llm.models_py.modules.hybrid.topology_kv.drift import block_key_centroids_unchecked
    from benchmark.candidates.witness import (
        block_key_bounds_unchecked,
        query_bound_scores_unchecked,
        query_mass_scores_unchecked,
    )

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 37, 2, 8, generator=gen).to(DEVICE)
    q = torch.randn(2, 4, 8, generator=gen).to(DEVICE)
    lengths = torch.tensor([37, 20], device=DEVICE)

    def fn(keys, q, lengths):
        kmin, kmax = block_key_bounds_unchecked(keys, 8, lengths)
        cents = block_key_centroids_unchecked(keys, 8, lengths)
        return query_mass_scores_unchecked(q, cents, lengths, 8), query_bound_scores_unchecked(q, kmin, kmax, lengths, 8)

    explain = torch._dynamo.explain(fn)(keys, q, lengths)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="eager")(keys, q, lengths)
    want = fn(keys, q, lengths)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
