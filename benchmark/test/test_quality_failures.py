"""Indexer failure modes, the policy flags and the raised gate (no model needed:
synthetic layer inputs and a synthetic grid)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch

from benchmark.quality.failure_modes import (
    FAILURE_MODES,
    FailureSettings,
    StaleKeys,
    degraded_rows_and_scores,
    split_selector_name,
)
from benchmark.quality.index_rows import check_engine_rows
from benchmark.quality.layer import LayerInputs
from benchmark.quality.metrics import LayerMetrics
from benchmark.quality.policy_selectors import PolicySettings
from benchmark.quality.raised_gate import evaluate_raised_gate, raised_gate_selectors
from benchmark.quality.runner import CellResult, DenseResult, GridResult
from benchmark.quality.selector_base import (
    learned_rows_and_scores,
    top_rows_by_chunk,
    trained_index_scores,
    trained_indexer_inputs,
)
from benchmark.quality.selectors import make_selector
from benchmark.quality.synthetic import synthetic_layer, synthetic_settings

# The synthetic layers' trained indexer: seeded random projections (the failure modes'
# code paths are what these tests pin).
SETTINGS = synthetic_settings(seed=3)
WIDTH = 40  # rows of length 41..150 are sparse; rows >= WIDTH + drop_tokens must skip the sinks


@pytest.mark.parametrize("kind", FAILURE_MODES)
def test_failure_rows_keep_the_engine_convention(kind):
    layer = synthetic_layer(0)
    rows, scores = degraded_rows_and_scores(kind, layer, WIDTH, SETTINGS, FailureSettings(), StaleKeys())
    check_engine_rows(rows, layer.lengths, WIDTH, name=kind)
    assert scores.shape == rows.shape


def test_nosink_never_selects_the_first_tokens_when_it_can_avoid_them():
    drop = 4
    layer = synthetic_layer(1)
    rows, _ = degraded_rows_and_scores("nosink", layer, WIDTH, SETTINGS, FailureSettings(drop_tokens=drop))
    long_enough = layer.lengths >= WIDTH + drop
    assert bool(long_enough.any())
    assert not bool(((rows[long_enough] >= 0) & (rows[long_enough] < drop)).any()), "a sink position was selected"
    learned, _ = learned_rows_and_scores(layer, WIDTH, SETTINGS)
    assert bool(((learned[long_enough] >= 0) & (learned[long_enough] < drop)).any()), "the undegraded indexer does pick sinks"


def test_noisy_is_seeded_and_degrades_with_snr():
    layer = synthetic_layer(2)
    learned, _ = learned_rows_and_scores(layer, WIDTH, SETTINGS)
    a, _ = degraded_rows_and_scores("noisy", layer, WIDTH, SETTINGS, FailureSettings(noise_snr=1.0))
    b, _ = degraded_rows_and_scores("noisy", layer, WIDTH, SETTINGS, FailureSettings(noise_snr=1.0))
    assert torch.equal(a, b), "same seed, same rows"

    def overlap(rows):
        return sum(len(set(r.tolist()) & set(l.tolist())) for r, l in zip(rows, learned)) / rows.numel()

    quiet, _ = degraded_rows_and_scores("noisy", layer, WIDTH, SETTINGS, FailureSettings(noise_snr=100.0))
    assert overlap(quiet) > overlap(a) and overlap(a) < 1.0


def test_stale_ranks_with_the_previous_layers_index_keys():
    first, second = synthetic_layer(3, layer_idx=0), synthetic_layer(4, layer_idx=1)
    stale = StaleKeys()
    r0, _ = degraded_rows_and_scores("stale", first, WIDTH, SETTINGS, FailureSettings(), stale)
    assert torch.equal(r0, learned_rows_and_scores(first, WIDTH, SETTINGS)[0]), "first layer: own keys"
    r1, _ = degraded_rows_and_scores("stale", second, WIDTH, SETTINGS, FailureSettings(), stale)
    q1, w1, _ = trained_indexer_inputs(second, SETTINGS)  # this layer's queries and weights
    _, _, k0 = trained_indexer_inputs(first, SETTINGS)  # the previous layer's index keys
    assert torch.equal(r1, top_rows_by_chunk(second, WIDTH, trained_index_scores(q1, w1, k0))[0])
    assert not torch.equal(r1, learned_rows_and_scores(second, WIDTH, SETTINGS)[0]), "stale keys change the rows"


@pytest.mark.parametrize("name", ["learned-nosink", "learned-noisy+topology_sparse_merge",
                                  "learned-stale+topology_compress_sparse"])
def test_failure_selectors_build_and_keep_the_convention(name):
    policy = PolicySettings(sink_tokens=4, witness_signal="query_centroid")
    select = make_selector(name, SETTINGS, policy)
    layer = synthetic_layer(5)
    rows = select(layer, WIDTH, {})
    check_engine_rows(rows, layer.lengths, WIDTH, name=name, ascending_short_rows=False)


def test_selector_name_splits_into_failure_mode_and_policy():
    assert split_selector_name("learned-nosink+topology_only") == ("nosink", "topology_only")
    assert split_selector_name("learned-stale") == ("stale", None)
    assert split_selector_name("learned") == ("", None)


@pytest.mark.parametrize("mode", ["topology_sparse_merge", "topology_only"])
@pytest.mark.parametrize("signal", ["key_drift", "value_drift", "query_centroid", "query_mass", "query_bound",
                                    "query_group_mass"])
def test_policy_selector_keeps_the_convention_with_each_witness_signal(signal, mode):
    policy = PolicySettings(witness_signal=signal, sink_tokens=4, block_size=8, local_blocks=2)
    select = make_selector(mode, SETTINGS, policy)
    layer = synthetic_layer(6)
    rows = select(layer, WIDTH, {})
    check_engine_rows(rows, layer.lengths, WIDTH, name=signal, ascending_short_rows=False)


def _cell(selector, budget, ppl, recall=None):
    import math

    c = CellResult(context=100, budget=budget, width=int(100 * budget), selector=selector,
                   nll_sum=math.log(ppl) * 10, tokens=10)
    if recall is not None:
        m = LayerMetrics()
        for layer, value in enumerate(recall):
            m.add(layer, recall=torch.tensor([value]), cos_diff=torch.tensor([0.0]), top1=torch.tensor([1.0]),
                  sink=torch.tensor([1.0]))
        c.metrics = m
    return c


def test_raised_gate_verdicts_on_a_hand_computed_grid():
    import math

    b1, b2 = Fraction(1, 16), Fraction(1, 4)
    dense = DenseResult(context=100, nll_sum=math.log(10.0) * 10, tokens=10)
    cells = [
        _cell("learned", b1, 12.0), _cell("learned", b2, 11.0),
        _cell("topology_sparse_merge", b1, 12.01), _cell("topology_sparse_merge", b2, 10.9),  # +0.08%, -0.9%
        _cell("topology_compress_sparse", b1, 12.5), _cell("topology_compress_sparse", b2, 11.5),
        _cell("learned-nosink", b1, 20.0), _cell("learned-nosink+topology_sparse_merge", b1, 14.0),  # 60%
        _cell("learned-nosink+topology_compress_sparse", b1, 19.0),
        _cell("learned-stale", b1, 16.0), _cell("learned-stale+topology_sparse_merge", b1, 15.0),  # 17%
        _cell("topology_only", b1, 13.0, recall=[0.5, 0.6, 0.7]), _cell("locality", b1, 13.5, recall=[0.4, 0.7, 0.6]),
    ]
    checks = {c.name.split(":")[0]: c for c in evaluate_raised_gate(GridResult({100: dense}, cells, {}))}
    assert checks["best merge vs learned at 1/16 (ctx 100)"].passed is True  # within +0.1%, not strict below 1/8
    assert checks["best merge vs learned at 1/4 (ctx 100)"].passed is True
    assert checks["failure 'nosink'"].passed is True
    assert checks["failure 'stale'"].passed is False
    assert checks["failure 'noisy'"].passed is None  # not run
    assert checks["witness signal"].passed is True  # 2 of 3 layers


def test_raised_gate_witness_ties_are_not_wins():
    import math

    b = Fraction(1, 16)
    dense = DenseResult(context=100, nll_sum=math.log(10.0) * 10, tokens=10)
    same = [0.5, 0.6, 0.7]
    noise = [v + 1e-7 for v in same]  # the same selection summed in another order
    cells = [_cell("topology_only", b, 13.0, recall=noise), _cell("locality", b, 13.0, recall=same)]
    checks = {c.name.split(":")[0]: c for c in evaluate_raised_gate(GridResult({100: dense}, cells, {}))}
    assert checks["witness signal"].passed is False and "0/3 layers" in checks["witness signal"].detail


def test_raised_gate_selectors_add_what_it_needs():
    names = raised_gate_selectors(["oracle"])
    assert names[0] == "oracle" and "learned-noisy+topology_sparse_merge" in names and "locality" in names


@pytest.mark.parametrize("signal", ["query_mass", "query_bound", "query_group_mass"])
def test_query_aware_witnesses_find_the_block_the_query_attends(signal):
    # Every query points along e0; only the keys of block 3 (tokens 24..31, block size 8)
    # do. topology_only with 4 sink tokens and 2 local blocks has room for witnesses at
    # W=32: the query-aware signals must spend it on block 3; recency would not.
    T, D = 128, 8
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(1, T, D, generator=gen) * 0.1
    key[0, 24:32, 0] = 4.0
    query = torch.zeros(2, T, D)
    query[:, :, 0] = 4.0
    layer = LayerInputs.build(layer_idx=0, query=query, key=key, value=torch.randn(1, T, D, generator=gen),
                              scaling=D ** -0.5, query_chunk=64)
    policy = PolicySettings(witness_signal=signal, sink_tokens=4, block_size=8, local_blocks=2)
    rows = make_selector("topology_only", SETTINGS, policy)(layer, 32, {})
    for t in (60, 100, T - 1):  # rows whose local window lies well past block 3
        assert set(range(24, 32)) <= set(rows[t].tolist()), (signal, t, rows[t].tolist())
    key[0, 40:48, 1] = 4.0  # a second content change, orthogonal to the queries, must not distract
    layer = dataclasses.replace(layer, key=key)
    rows = make_selector("topology_only", SETTINGS, policy)(layer, 32, {})
    assert set(range(24, 32)) <= set(rows[T - 1].tolist())
    assert not set(range(40, 48)) & set(rows[T - 1].tolist())


def test_query_group_mass_witnesses_pool_each_kv_heads_queries():
    from benchmark.candidates.witness import query_group_mass_scores
    from benchmark.quality.policy_selectors import layer_witness_scores
    from rtp_llm.models_py.modules.hybrid.topology_kv.drift import block_key_centroids

    # Four query heads over two KV heads: one softmax per KV head, so each row sums to 2
    # (query_mass would sum to 4), computed from the group's mean query.
    gen = torch.Generator().manual_seed(1)
    T, L, D = 5, 40, 8
    layer = LayerInputs.build(layer_idx=0, query=torch.randn(4, T, D, generator=gen),
                              key=torch.randn(2, L, D, generator=gen), value=torch.randn(2, L, D, generator=gen),
                              scaling=0.3, query_chunk=64)
    scores, shared = layer_witness_scores(layer, 8, "query_group_mass")
    assert not shared and scores.shape == (T, 5)
    want = query_group_mass_scores(layer.query.transpose(0, 1), block_key_centroids(layer.key.transpose(0, 1), 8),
                                   layer.lengths, 8, scale=0.3)
    assert torch.equal(scores, want)
    assert torch.allclose(scores.sum(dim=1), torch.full((T,), 2.0))


def test_mode_settings_apply_to_one_mode_only():
    from benchmark.quality.cli import parse_mode_settings
    from benchmark.quality.errors import UsageError

    overrides = parse_mode_settings(["topology_only:block_size=8,local_blocks=8,witness_signal=query_mass,sink_tokens=blocks"])
    assert overrides == (("topology_only", (("block_size", 8), ("local_blocks", 8), ("witness_signal", "query_mass"),
                                            ("sink_tokens", None))),)
    policy = PolicySettings(sink_tokens=4, mode_overrides=overrides)
    only = policy.for_mode("topology_only")
    assert (only.block_size, only.local_blocks, only.witness_signal, only.sink_tokens) == (8, 8, "query_mass", None)
    merge = policy.for_mode("topology_sparse_merge")
    assert (merge.block_size, merge.local_blocks, merge.witness_signal, merge.sink_tokens) == (64, 2, "key_drift", 4)
    # The override reaches the selector: topology_only at block size 8 keeps the 8 most recent blocks.
    layer = synthetic_layer(7)
    rows = make_selector("topology_only", SETTINGS, policy)(layer, WIDTH, {})
    check_engine_rows(rows, layer.lengths, WIDTH, name="topology_only", ascending_short_rows=False)
    for bad, msg in [
        (["bogus_mode:block_size=8"], "MODE in"),
        (["topology_only:block_size"], "expected KEY=VALUE"),
        (["topology_only:block_size=eight"], "block_size: not a number"),
        (["topology_only:"], "no KEY=VALUE given"),
    ]:
        with pytest.raises(UsageError, match=msg):
            parse_mode_settings(bad)
    with pytest.raises(UsageError, match="unknown setting 'colour'"):
        PolicySettings(mode_overrides=(("topology_only", (("colour", 1),)),))
    with pytest.raises(UsageError, match="witness signal: expected one of"):
        PolicySettings(mode_overrides=(("topology_only", (("witness_signal", "attention"),)),))
