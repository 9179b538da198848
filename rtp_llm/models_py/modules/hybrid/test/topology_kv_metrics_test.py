"""The topology KV metrics through the ``Indexer``: what each layer call records, a forced
contract violation scraped as a fallback count of its own layer, every skip reason, and
metrics off at zero cost (the call records no device op; the step read reads nothing).

The reporter, settings and sinks on their own: ``rtp_llm/metrics/test``; the end-to-end
decode scraped against its step counters: ``benchmark/test/test_metrics_e2e.py``.
"""

from __future__ import annotations

import json
import urllib.request
from unittest import mock

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.utils._python_dispatch import TorchDispatchMode

from rtp_llm.metrics import (
    ENV_METRICS,
    OFF_REPORTER,
    TopologyKVMetricsSettings,
    build_reporter,
    topology_kv_reporter,
    unregister_topology_kv_reporter,
)
from rtp_llm.metrics.topology_kv_step import report_topology_step
from rtp_llm.models_py.modules.hybrid.indexer import Indexer, TopologyStepCounters
from rtp_llm.models_py.modules.hybrid.indexer_params import IndexerKeyCache
from rtp_llm.models_py.modules.hybrid.test import indexer_ref as ref
from rtp_llm.models_py.modules.hybrid.test.indexer_cases import (
    DIM,
    DISABLED,
    HEADS,
    MERGE,
    PAGE,
    WIDTH,
    engine_rows,
    fill_cache,
    policy_settings,
    run_compute_topk,
    to_device,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    IndexerPath,
    IndexerTopologySettings,
    TopologyKVPolicyConfig,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.profile import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    ModelFingerprint,
    load_topology_profile,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.step_record import PolicySkipReason, TopologyLayerCall
from tools.device_under_test import DEVICE

GOOD_LAYER, BROKEN_LAYER = 4, 5  # layer indices other than 0, so a wrong layer tag shows
BROKEN_ROWS = (1, 3)  # decode rows whose learned row gets an index at its causal length
# Every backend gives the same rows and counters (the backend tests); the eager one needs no
# compile of the fused CPU kernel inside each Bazel sandbox.
BACKEND = "torch"
SETTINGS = policy_settings(MERGE, witness_signal="recency", backend=BACKEND)  # recency: no drift tracker


def _scrape(address):
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(scraped, name, **labels):
    want = {k: str(v) for k, v in labels.items()}
    found = [s.value for s in scraped if s.name == name and want.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture
def prometheus():
    reporter = build_reporter(TopologyKVMetricsSettings(sink="prometheus", port=0, addr="127.0.0.1"))
    yield reporter
    reporter.close()


def _decode_rows(decode_case, broken=()):
    b = decode_case.batch
    rows = engine_rows(b.row_lengths, b.row_offsets, torch.Generator().manual_seed(3))
    for r in broken:  # the first entry becomes the row's length: outside [0, length)
        rows[r, 0] = b.row_lengths[r]
    return rows.to(DEVICE)


def _decode_step(layers, decode_case, rows_by_layer, step):
    """Every layer's decode call with the top-k op returning ``rows_by_layer[layer_idx]``."""
    def op(self, *args):
        return rows_by_layer[self.layer_idx]

    cache = IndexerKeyCache(torch.zeros(1, PAGE, DIM, device=DEVICE))
    with mock.patch.object(Indexer, "_get_topk_paged", autospec=True, side_effect=op):
        for layer in layers:
            run_compute_topk(layer, decode_case, kv_cache=cache, topology_counters=step)


def test_a_contract_violation_scrapes_as_a_fallback_of_its_layer(decode_case, prometheus):
    layers = [Indexer(HEADS, DIM, layer_idx=i, topology=SETTINGS)
              for i in (GOOD_LAYER, BROKEN_LAYER)]
    rows = {GOOD_LAYER: _decode_rows(decode_case), BROKEN_LAYER: _decode_rows(decode_case, BROKEN_ROWS)}
    step = TopologyStepCounters()
    _decode_step(layers, decode_case, rows, step)
    assert int(step.by_layer[BROKEN_LAYER].coordinate_mismatch_fallbacks) == len(BROKEN_ROWS)
    reading = report_topology_step(step, prometheus)
    assert reading.totals()["coordinate_mismatch_fallbacks"] == step.totals()["coordinate_mismatch_fallbacks"]
    scraped = _scrape(prometheus.sink.address)
    name = "py_rtp_topology_kv_coordinate_mismatch_fallbacks_total"
    tags = dict(mode="topology_sparse_merge", path="decode", profile="")
    assert _value(scraped, name, layer=BROKEN_LAYER, **tags) == len(BROKEN_ROWS)
    assert _value(scraped, name, layer=GOOD_LAYER, **tags) == 0
    R = len(decode_case.batch.row_lengths)
    assert _value(scraped, "py_rtp_topology_kv_rows_total", layer=BROKEN_LAYER) == R


def test_each_call_records_host_values_only(decode_case):
    layer = Indexer(HEADS, DIM, layer_idx=GOOD_LAYER, topology=SETTINGS)
    rows = {GOOD_LAYER: _decode_rows(decode_case)}
    step = TopologyStepCounters()
    _decode_step([layer], decode_case, rows, step)
    R = len(decode_case.batch.row_lengths)
    assert step.calls == {GOOD_LAYER: TopologyLayerCall(IndexerPath.DECODE, MERGE, R, None, None)}
    assert type(step.calls[GOOD_LAYER].rows) is int  # the shape, not a device value


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_recording_a_call_adds_no_device_op(decode_case):
    """The same layer call runs the same aten ops with and without a step record."""
    layer = Indexer(HEADS, DIM, layer_idx=GOOD_LAYER, topology=SETTINGS)
    rows = {GOOD_LAYER: _decode_rows(decode_case, BROKEN_ROWS)}
    cache = IndexerKeyCache(torch.zeros(1, PAGE, DIM, device=DEVICE))
    traces = []
    for step in (None, TopologyStepCounters()):
        with mock.patch.object(Indexer, "_get_topk_paged", autospec=True, return_value=rows[GOOD_LAYER]):
            with _CountOps() as mode:
                run_compute_topk(layer, decode_case, kv_cache=cache, topology_counters=step)
        traces.append(mode.ops)
    assert traces[0] == traces[1]
    assert "aten._local_scalar_dense" not in traces[1]


def test_metrics_off_reads_nothing_after_a_real_step(decode_case):
    layer = Indexer(HEADS, DIM, layer_idx=GOOD_LAYER, topology=SETTINGS)
    step = TopologyStepCounters()
    _decode_step([layer], decode_case, {GOOD_LAYER: _decode_rows(decode_case)}, step)
    with _CountOps() as mode:
        assert report_topology_step(step, OFF_REPORTER) is None
    assert mode.ops == []


# ------------------------------------------------------------------ skip reasons

FINGERPRINT = ModelFingerprint("ef" * 32, "tiny.gguf", num_layers=2, full_attention_layers=(0, 1))
SKIP = {"max_structural_fraction": 0, "sink_tokens": 0, "local_blocks": 0, "witness_blocks": 0}
SINKS = {"max_structural_fraction": 0.25, "sink_tokens": 4, "local_blocks": 0, "witness_blocks": 0}


def _profile(tmp_path):
    """Layer 0 served with sinks, layer 1 skipped (one budget)."""
    data = {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": FINGERPRINT.to_json(),
        "text": {"name": "austen", "sha256": "cd" * 32},
        "settings": {"policy": "topology_sparse_merge", "block_size": PAGE, "contexts": [8192], "budgets": ["1/4"]},
        "command": "topology_kv_calibrate.py", "layers": {"0": {"1/4": SINKS}, "1": {"1/4": SKIP}},
    }
    path = tmp_path / "tiny_merge.json"
    path.write_text(json.dumps(data))
    return load_topology_profile(path, model_fingerprint=FINGERPRINT)


def test_every_skip_reason_is_recorded_and_reported(decode_case, prefill_case, tmp_path, prometheus):
    step = TopologyStepCounters()
    rows = {i: _decode_rows(decode_case) for i in (0, 1, 2)}
    profile = _profile(tmp_path)
    base = IndexerTopologySettings(policy=TopologyKVPolicyConfig(backend=BACKEND))
    served = Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, topology=base, topology_profile=profile)
    skipped = Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=1, topology=base, topology_profile=profile)
    disabled = Indexer(HEADS, DIM, layer_idx=2, topology=DISABLED)
    _decode_step([served, skipped, disabled], decode_case, rows, step)
    prefill_only = Indexer(HEADS, DIM, layer_idx=3,
                           topology=policy_settings(MERGE, paths={IndexerPath.PREFILL}, backend=BACKEND))
    _decode_step([prefill_only], decode_case, {3: rows[0]}, step)
    cp, _ = ref.build_cp_params(prefill_case.batch, [], cp_size=2, cp_rank=0)  # a rank without local rows
    cp_layer = Indexer(HEADS, DIM, layer_idx=4, topology=policy_settings(MERGE, backend=BACKEND))
    assert run_compute_topk(cp_layer, prefill_case, to_device(cp), kv_cache=fill_cache(cp_layer, prefill_case),
                            topology_counters=step) is None
    reasons = {i: c.skip_reason for i, c in step.calls.items()}
    assert reasons == {0: None, 1: PolicySkipReason.PROFILE_SKIPPED_LAYER, 2: PolicySkipReason.DISABLED,
                       3: PolicySkipReason.PATH_OFF, 4: PolicySkipReason.NO_LOCAL_ROWS}
    assert step.calls[0].profile == step.calls[1].profile == "tiny_merge" and step.calls[2].profile is None
    assert step.calls[4].path is IndexerPath.CP and step.calls[4].rows == 0
    report_topology_step(step, prometheus)
    scraped = _scrape(prometheus.sink.address)
    name = "py_rtp_topology_kv_policy_skips_total"
    assert _value(scraped, name, layer=1, reason="profile_skipped_layer", profile="tiny_merge", mode="disabled") == 1
    assert _value(scraped, name, layer=2, reason="disabled", profile="") == 1
    assert _value(scraped, name, layer=3, reason="path_off", path="decode") == 1
    assert _value(scraped, name, layer=4, reason="no_local_rows", path="cp") == 1
    assert not [s for s in scraped if s.name == name and s.labels["layer"] == "0"]  # layer 0 ran the policy
    assert _value(scraped, "py_rtp_topology_kv_kv_tokens_read", layer=0, profile="tiny_merge") > 0


def test_an_indexer_built_from_the_environment_registers_the_reporter(monkeypatch):
    unregister_topology_kv_reporter()
    try:
        monkeypatch.setenv(ENV_METRICS, "null")
        Indexer(HEADS, DIM, layer_idx=0)
        first = topology_kv_reporter()
        assert first.enabled
        Indexer(HEADS, DIM, layer_idx=1)
        assert topology_kv_reporter() is first  # registered once per process
        unregister_topology_kv_reporter()
        monkeypatch.setenv(ENV_METRICS, "bogus")
        with pytest.raises(ValueError, match=f"{ENV_METRICS}='bogus'"):  # at construction, naming the variable
            Indexer(HEADS, DIM, layer_idx=0)
    finally:
        unregister_topology_kv_reporter()
