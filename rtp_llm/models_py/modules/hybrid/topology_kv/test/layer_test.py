"""The per-layer policy object (``topology_kv.layer``): built once, same rows as the entry.

:class:`TopologyKVLayerPolicy` derives its layout and resolves its backend at build time;
per call it takes tensors only. Its rows and counters must equal
:func:`apply_topology_kv_policy` with the same settings on every mode and backend the
device has, and a call must not rebuild the layout, re-resolve the backend or re-parse
the config.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv import layer as layer_module
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    IndexerTopologySettings,
    TopologyKVBackend,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
    WitnessSignal,
)
from rtp_llm.models_py.modules.hybrid.topology_kv import policy as policy_module
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_fused as cpu_fused_module
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import layout as layout_module
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.dispatch import can_use_backend
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import PolicyLayout
from rtp_llm.models_py.modules.hybrid.topology_kv.layer import TopologyKVLayerPolicy
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import apply_topology_kv_policy
from tools.device_under_test import DEVICE

ENABLED = [m for m in TopologyKVPolicyMode if m is not TopologyKVPolicyMode.DISABLED]
# Backends that run here without compiling a graph (compiled is covered by backends_test).
BACKENDS = [b for b in (TopologyKVBackend.TORCH, TopologyKVBackend.CPU_FUSED, TopologyKVBackend.TRITON)
            if can_use_backend(b, DEVICE)]


def _settings(mode, backend=TopologyKVBackend.TORCH, **kw):
    return IndexerTopologySettings(policy=TopologyKVPolicyConfig(policy=mode, backend=backend, block_size=8, **kw))


def test_build_derives_layout_backend_and_drift_once():
    layer = TopologyKVLayerPolicy.build(_settings(TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE), layer_idx=3,
                                        width=64, device=DEVICE)
    assert layer.backend is TopologyKVBackend.TORCH and layer.reads_drift and layer.enabled
    assert layer.layout == PolicyLayout.from_config(layer.settings.policy)
    assert (layer.layout.sink_slots, layer.layout.partial_sink, layer.layout.compress_start) == (4, True, 8)
    only = TopologyKVLayerPolicy.build(_settings(TopologyKVPolicyMode.TOPOLOGY_ONLY), layer_idx=0, width=64)
    assert not only.reads_drift and only.backend is None  # no device given: resolved at the first call
    assert only.settings.resolved_witness_signal is WitnessSignal.RECENCY
    off = TopologyKVLayerPolicy.build(IndexerTopologySettings(), layer_idx=0, width=64, device=DEVICE)
    x = torch.zeros(2, 64, dtype=torch.int32, device=DEVICE)
    assert not off.enabled and off.layout is None and off.run(x, torch.ones(2, dtype=torch.int32)).indices is x


def test_build_rejects_a_merge_mode_that_cannot_inject():
    with pytest.raises(ValueError, match=r"max_structural_fraction .*expected >= 1 / index_topk \(1/2\)"):
        TopologyKVLayerPolicy.build(_settings(TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE), layer_idx=0, width=2)
    with pytest.raises(TypeError, match="topology: expected IndexerTopologySettings"):
        TopologyKVLayerPolicy.build(TopologyKVPolicyConfig(), layer_idx=0, width=8)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(ENABLED),
    backend=st.sampled_from(BACKENDS),
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=4),
    width=st.integers(1, 40),
    use_drift=st.booleans(),
    use_scores=st.booleans(),
    requests=st.integers(1, 3),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_layer_rows_and_counters_equal_the_public_entry(mode, backend, lengths, width, use_drift, use_scores,
                                                        requests, index_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    R = len(lengths)
    rows = torch.full((R, width), -1, dtype=index_dtype)
    for r, length in enumerate(lengths):
        keep = torch.randperm(length, generator=gen)[: min(width, length)]
        rows[r, : keep.numel()] = keep.to(index_dtype)
    rows, L = rows.to(DEVICE), torch.tensor(lengths, dtype=index_dtype, device=DEVICE)
    # Drift of `requests` requests (fp16 too: read as fp32), rows mapped to them at random.
    drift = (torch.rand(requests, -(-max(lengths) // 8), generator=gen).to(
        torch.float16 if seed % 3 == 0 else torch.float32).to(DEVICE) if use_drift else None)
    r2r = torch.randint(0, requests, (R,), generator=gen).to(index_dtype).to(DEVICE)
    # Learned scores with ties (a coarse grid), so the eviction's tie rule is exercised too.
    scores = (torch.randint(0, 4, (R, width), generator=gen).float() / 4).to(DEVICE) if use_scores else None
    settings_ = _settings(mode, backend, max_structural_fraction=1.0)
    layer = TopologyKVLayerPolicy.build(settings_, layer_idx=0, width=width, device=DEVICE)
    got = layer.run(rows, L, None, drift, r2r, learned_scores=scores)
    want = apply_topology_kv_policy(rows, L, config=settings_.policy, block_drift_scores=drift, row_to_request=r2r,
                                    learned_scores=scores)
    assert torch.equal(got.indices, want.indices)
    assert got.counters.to_dict() == want.counters.to_dict()


def test_a_call_does_not_rebuild_what_the_layer_holds():
    layer = TopologyKVLayerPolicy.build(_settings(TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE), layer_idx=0,
                                        width=16, device=DEVICE)
    rows = torch.arange(16, dtype=torch.int32, device=DEVICE).unsqueeze(0)
    L = torch.tensor([100], dtype=torch.int32, device=DEVICE)
    want = layer.run(rows, L).indices
    fail = {"side_effect": AssertionError("per-call work")}
    with mock.patch.object(layer_module, "resolve_backend", **fail), \
            mock.patch.object(layout_module, "_layout_of", **fail), \
            mock.patch.object(TopologyKVPolicyConfig, "__post_init__", **fail), \
            mock.patch.object(PolicyLayout, "__post_init__", **fail):
        assert torch.equal(layer.run(rows, L).indices, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ENABLED)
def test_counters_read_after_out_is_reused_are_the_calls_own(mode, backend):
    # A serving loop reuses out=; the counters of the first call, read after the second
    # call has overwritten the buffer, must still be the first call's.
    cfg = TopologyKVPolicyConfig(policy=mode, backend=backend, block_size=4, max_structural_fraction=1.0)
    L = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    first = torch.tensor([[10, 11, 39, -1, -1, -1]], dtype=torch.int32, device=DEVICE)
    second = torch.tensor([[20, 21, 22, 23, 24, 25]], dtype=torch.int32, device=DEVICE)
    want = apply_topology_kv_policy(first, L, config=cfg).counters.to_dict()
    buf = torch.empty_like(first)
    got = apply_topology_kv_policy(first, L, config=cfg, out=buf)
    apply_topology_kv_policy(second, L, config=cfg, out=buf)
    first.fill_(-1)  # and the caller reuses its input buffer too
    assert got.counters.to_dict() == want
    assert want["learned_kept_tokens"] + want["learned_evicted_tokens"] == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_row_to_request_names_the_row(backend):
    layer = TopologyKVLayerPolicy.build(_settings(TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE, backend), layer_idx=0,
                                        width=8, device=DEVICE)
    rows = torch.arange(16, dtype=torch.int32, device=DEVICE).view(2, 8)
    L = torch.tensor([40, 40], dtype=torch.int32, device=DEVICE)
    drift = torch.rand(2, 5, device=DEVICE)
    before = rows.clone()
    if DEVICE.type != "cpu":
        pytest.skip("an out-of-range index on CUDA is a device-side assert (coordinate_mismatch_action=raise checks)")
    with pytest.raises(ValueError, match=r"row_to_request: row 1 holds 2, outside \[0, 2\) \(the rows of block_drift_scores\)"):
        layer.run(rows, L, None, drift, torch.tensor([0, 2], device=DEVICE))
    assert torch.equal(rows, before)


@pytest.mark.skipif(DEVICE.type != "cpu" or TopologyKVBackend.CPU_FUSED not in BACKENDS, reason="the fused CPU kernel")
def test_cpu_layer_call_is_one_cpp_entry_with_checks_in_cpp():
    """On CPU with cpu_fused, a call reaches the C++ entry without the Python buffer check or
    the drift row select, and that entry still refuses bad metadata, naming the argument."""
    layer = TopologyKVLayerPolicy.build(_settings(TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE, TopologyKVBackend.CPU_FUSED),
                                        layer_idx=0, width=8, device=DEVICE)
    assert layer.backend is TopologyKVBackend.CPU_FUSED
    rows = torch.arange(16, dtype=torch.int32).view(2, 8)
    L = torch.tensor([40, 40], dtype=torch.int32)
    fail = {"side_effect": AssertionError("per-call Python check")}
    with mock.patch.object(cpu_fused_module, "check_kernel_buffers", **fail), \
            mock.patch.object(policy_module, "select_request_rows", **fail):
        got = layer.run(rows, L, None, torch.rand(3, 5), torch.tensor([2, 0]))
    assert got.indices.shape == (2, 8) and got.counters.to_dict()["selected_tokens"] == 16
    with pytest.raises(ValueError, match=r"lengths: expected shape \(2,\) on cpu, got \[3\] on cpu"):
        layer.run(rows, torch.tensor([40, 40, 40], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"lengths: expected an int32/int64 tensor, got Float"):
        layer.run(rows, torch.tensor([40.0, 40.0]))
    with pytest.raises(ValueError, match=r"drift: expected a float tensor \[2, N\] on cpu, got \[3, 5\]"):
        layer.run(rows, L, None, torch.rand(3, 5))


@pytest.mark.skipif(not can_use_backend(TopologyKVBackend.CPU_FUSED, DEVICE), reason="the fused CPU kernel")
@pytest.mark.parametrize("mode", ENABLED)
def test_the_direct_kernel_call_equals_the_public_entry(mode):
    """With the fused CPU kernel a call on rows of the layer's width is one direct call of the
    compiled op (run_layout is not reached): offsets, drift through the row map, scores, a
    step plan (compress mode's scaffold spans, its fingerprints) and caller buffers."""
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import CoordinateMismatchAction
    from rtp_llm.models_py.modules.hybrid.topology_kv.request import TopologyRequestContext, TopologyStepPlan

    W = 24
    settings_ = _settings(mode, TopologyKVBackend.CPU_FUSED, max_structural_fraction=0.5)
    layer = TopologyKVLayerPolicy.build(settings_, layer_idx=0, width=W, device=DEVICE)
    assert layer.kernel is not None
    raising = _settings(mode, TopologyKVBackend.CPU_FUSED,
                        coordinate_mismatch_action=CoordinateMismatchAction.RAISE)
    assert TopologyKVLayerPolicy.build(raising, layer_idx=0, width=W, device=DEVICE).kernel is None
    gen = torch.Generator().manual_seed(5)
    lengths, offsets = torch.tensor([60, 90, 33]), torch.tensor([0, 100, 7])
    rows = torch.stack([torch.randperm(int(n), generator=gen)[:W] + int(o) for n, o in zip(lengths, offsets)])
    rows, lengths, offsets = rows.to(torch.int32).to(DEVICE), lengths.to(DEVICE), offsets.to(DEVICE)
    r2r = torch.tensor([1, 0, 1], device=DEVICE)
    drift = torch.rand(2, 12, generator=gen).to(DEVICE)
    scores = torch.rand(3, W, generator=gen).to(DEVICE)
    contexts = [TopologyRequestContext(scaffold_token_ids=tuple(range(n))) for n in (40, 17)]
    plan = TopologyStepPlan.build(settings_.policy, W, contexts, num_rows=3, row_to_request=r2r, device=DEVICE)
    out, counters = torch.empty_like(rows), torch.zeros(8, dtype=torch.int64, device=DEVICE)
    with mock.patch.object(layer_module, "run_layout", side_effect=AssertionError("not the direct call")):
        got = layer.run(rows, lengths, offsets, drift, r2r, learned_scores=scores, plan=plan, out=out,
                        counters_out=counters)
    want = apply_topology_kv_policy(rows, lengths, config=settings_.policy, topk_indices_offset=offsets,
                                    block_drift_scores=drift, row_to_request=r2r, learned_scores=scores, plan=plan)
    assert got.indices is out and torch.equal(out, want.indices) and not torch.equal(out, rows)
    assert got.counters.to_dict() == want.counters.to_dict()
    assert got.fingerprints == want.fingerprints and len(got.fingerprints) == 2
    assert counters.tolist() == [want.counters.to_dict()[n] for n in layout_module.COUNTER_NAMES]
