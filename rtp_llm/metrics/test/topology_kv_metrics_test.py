"""The topology KV metrics: names and tags, the settings, both sinks, registration once,
and the once-per-step read (one transfer when on, nothing at all when off).

The Prometheus sink is served on loopback at a free port (port 0) and scraped over HTTP.
The same checks through the ``Indexer`` (a forced contract violation, skip reasons) are in
``rtp_llm/models_py/modules/hybrid/test/topology_kv_metrics_test.py``; the end-to-end
scrape against the decode benchmark's step counters in ``benchmark/test/test_metrics_e2e.py``.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.utils._python_dispatch import TorchDispatchMode

import rtp_llm.metrics as metrics
from rtp_llm.metrics import (
    ENV_METRICS,
    ENV_METRICS_ADDR,
    ENV_METRICS_PORT,
    METRIC_TAGS,
    OFF_REPORTER,
    AccMetrics,
    GaugeMetrics,
    MetricReporter,
    MetricsSink,
    NullSink,
    TopologyKVMetricsSettings,
    build_reporter,
    register_topology_kv_reporter,
    topology_kv_reporter,
    unregister_topology_kv_reporter,
)
from rtp_llm.metrics.prometheus_sink import PrometheusSink
from rtp_llm.metrics.topology_kv_metric_reporter import METRIC_HELP
from rtp_llm.metrics.topology_kv_step import TOTAL_NAMES, read_topology_step, report_topology_step
from rtp_llm.models_py.modules.hybrid.indexer import TopologyStepCounters
from rtp_llm.models_py.modules.hybrid.topology_kv.config import IndexerPath, TopologyKVPolicyMode
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import COUNTER_NAMES
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import TopologyKVCounters
from rtp_llm.models_py.modules.hybrid.topology_kv.step_record import PolicySkipReason, TopologyLayerCall
from tools.device_under_test import DEVICE

LOOPBACK = "127.0.0.1"
MERGE = TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE


def scrape(address: str):
    """``{(sample name, sorted label items): value}`` of one HTTP scrape of ``/metrics``."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def samples(scraped, name, **labels):
    """Values of ``name`` whose labels include ``labels``."""
    want = {k: str(v) for k, v in labels.items()}
    return [v for (n, items), v in scraped.items() if n == name and want.items() <= dict(items).items()]


@pytest.fixture
def prometheus():
    reporter = build_reporter(TopologyKVMetricsSettings(sink="prometheus", port=0, addr=LOOPBACK))
    yield reporter
    reporter.close()


@pytest.fixture
def clean_registration():
    unregister_topology_kv_reporter()
    yield
    unregister_topology_kv_reporter()


def _counters(values, hits=0):
    """A layer's counters as the policy returns them: 0-dim int64 device tensors."""
    tensors = {name: torch.tensor(values.get(name, 0), dtype=torch.int64, device=DEVICE) for name in COUNTER_NAMES}
    return TopologyKVCounters(tensors=tensors, compression_hits=hits)


def _step():
    """Two layers that ran the merge policy (decode) and one the policy skipped."""
    step = TopologyStepCounters()
    call = dict(path=IndexerPath.DECODE, mode=MERGE, rows=8)
    step.record(0, _counters({"selected_tokens": 100, "learned_kept_tokens": 60, "learned_evicted_tokens": 20,
                              "structural_injected_tokens": 20, "coordinate_mismatch_fallbacks": 1}, hits=2),
                TopologyLayerCall(**call))
    step.record(1, _counters({"selected_tokens": 90, "learned_kept_tokens": 90}), TopologyLayerCall(**call))
    step.record(2, None, TopologyLayerCall(IndexerPath.DECODE, TopologyKVPolicyMode.DISABLED, 8,
                                           PolicySkipReason.DISABLED))
    return step


# ------------------------------------------------------------------ names, tags, help


def test_every_metric_is_named_in_the_engine_style_with_tags_and_help():
    for metric in list(AccMetrics) + list(GaugeMetrics):
        assert metric.value.startswith("py_rtp_topology_kv_"), metric
        assert metric in METRIC_TAGS and metric in METRIC_HELP, metric
    assert METRIC_TAGS[AccMetrics.POLICY_SKIPS] == ("layer", "mode", "path", "profile", "reason")
    assert METRIC_TAGS[AccMetrics.COORDINATE_MISMATCH_FALLBACKS] == ("layer", "mode", "path", "profile")
    assert METRIC_TAGS[GaugeMetrics.POLICY_STEP_MS] == ("path", "profile")


def test_report_rejects_a_wrong_tag_set_and_a_negative_count():
    reporter = MetricReporter(NullSink())
    tags = {"layer": 0, "mode": "disabled", "path": "decode", "profile": None}
    reporter.report(AccMetrics.ROWS, 3, tags)
    with pytest.raises(ValueError, match=r"py_rtp_topology_kv_rows: expected tags \['layer', 'mode', 'path', "
                                         r"'profile'\], got \['layer'\]"):
        reporter.report(AccMetrics.ROWS, 3, {"layer": 0})
    with pytest.raises(ValueError, match="py_rtp_topology_kv_rows: expected a finite value >= 0"):
        reporter.report(AccMetrics.ROWS, -1, tags)
    with pytest.raises(ValueError, match="py_rtp_topology_kv_kv_tokens_read: expected a finite value, got nan"):
        reporter.report(GaugeMetrics.KV_TOKENS_READ, float("nan"), tags)
    with pytest.raises(TypeError, match="metric: expected an AccMetrics or GaugeMetrics member"):
        reporter.report("py_rtp_topology_kv_rows", 1, tags)


# ------------------------------------------------------------------ settings


def test_settings_default_to_off_on_loopback():
    s = TopologyKVMetricsSettings.from_env({})
    assert (s.sink, s.port, s.addr, s.enabled) == (MetricsSink.OFF, 9470, "127.0.0.1", False)
    assert TopologyKVMetricsSettings.from_env({ENV_METRICS: "  ", ENV_METRICS_PORT: ""}) == s


def test_settings_read_each_variable():
    s = TopologyKVMetricsSettings.from_env({ENV_METRICS: " Prometheus ", ENV_METRICS_PORT: "0",
                                            ENV_METRICS_ADDR: "::1"})
    assert (s.sink, s.port, s.addr, s.enabled) == (MetricsSink.PROMETHEUS, 0, "::1", True)
    assert TopologyKVMetricsSettings.from_env({ENV_METRICS: "NULL"}).sink is MetricsSink.NULL


@pytest.mark.parametrize("env,message", [
    ({ENV_METRICS: "prom"}, f"{ENV_METRICS}='prom': expected one of [off, null, prometheus] (case-insensitive), "
                            "got 'prom'"),
    ({ENV_METRICS_PORT: "65536"}, f"{ENV_METRICS_PORT}='65536': expected a decimal port in 0..65535"),
    ({ENV_METRICS_PORT: "+80"}, f"{ENV_METRICS_PORT}='+80': expected a decimal port"),  # int() would take it
    ({ENV_METRICS_PORT: "٨٠"}, f"{ENV_METRICS_PORT}='٨٠': expected a decimal port"),  # non-ASCII digits
    ({ENV_METRICS_ADDR: "localhost"}, f"{ENV_METRICS_ADDR}='localhost': expected an IPv4 or IPv6 address"),
])
def test_bad_settings_name_the_variable_and_the_value(env, message):
    with pytest.raises(ValueError) as err:
        TopologyKVMetricsSettings.from_env(env)
    assert str(err.value).startswith(message), str(err.value)


def test_settings_built_in_python_are_validated_too():
    with pytest.raises(ValueError, match="port: expected an int in 0..65535"):
        TopologyKVMetricsSettings(port=70000)
    with pytest.raises(ValueError, match="addr: expected an IPv4 or IPv6 address, got 'nowhere'"):
        TopologyKVMetricsSettings(addr="nowhere")
    with pytest.raises(ValueError, match=r"sink: expected one of \[off, null, prometheus\]"):
        TopologyKVMetricsSettings(sink="kmon")


# ------------------------------------------------------------------ sinks


def test_off_builds_no_sink_and_null_keeps_nothing():
    assert not build_reporter(TopologyKVMetricsSettings()).enabled
    null = build_reporter(TopologyKVMetricsSettings(sink="null"))
    assert null.enabled and isinstance(null.sink, NullSink)
    assert report_topology_step(_step(), null).totals()["rows"] == 24


def test_prometheus_sink_serves_reported_values_on_loopback(prometheus):
    assert prometheus.sink.port > 0 and prometheus.sink.address.startswith(LOOPBACK)
    tags = {"layer": 3, "mode": "topology_sparse_merge", "path": "decode", "profile": None}
    prometheus.report(AccMetrics.COORDINATE_MISMATCH_FALLBACKS, 2, tags)
    prometheus.report(AccMetrics.COORDINATE_MISMATCH_FALLBACKS, 3, tags)
    prometheus.report(GaugeMetrics.KV_TOKENS_READ, 7, tags)
    prometheus.report(GaugeMetrics.KV_TOKENS_READ, 5, tags)
    got = scrape(prometheus.sink.address)
    labels = (("layer", "3"), ("mode", "topology_sparse_merge"), ("path", "decode"), ("profile", ""))
    assert got[("py_rtp_topology_kv_coordinate_mismatch_fallbacks_total", labels)] == 5  # accumulates
    assert got[("py_rtp_topology_kv_kv_tokens_read", labels)] == 5  # the last value
    address = prometheus.sink.address
    prometheus.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{address}/metrics", timeout=5)


def test_a_taken_port_names_the_setting(prometheus):
    port = prometheus.sink.port
    with pytest.raises(ValueError, match=f"{ENV_METRICS_PORT}={port}: cannot serve Prometheus metrics on "
                                         f"127.0.0.1:{port}"):
        build_reporter(TopologyKVMetricsSettings(sink="prometheus", port=port, addr=LOOPBACK))


def test_two_sinks_never_share_a_registry():
    a, b = PrometheusSink(), PrometheusSink()
    MetricReporter(a), MetricReporter(b)  # the second would raise "Duplicated timeseries" in a shared one
    assert a.registry is not b.registry


# ------------------------------------------------------------------ registration


def test_the_reporter_is_registered_once(clean_registration):
    assert topology_kv_reporter() is OFF_REPORTER
    first = register_topology_kv_reporter(environ={ENV_METRICS: "null"})
    assert topology_kv_reporter() is first and first.enabled
    assert register_topology_kv_reporter(environ={ENV_METRICS: "off"}) is first  # later layers: the same one
    assert register_topology_kv_reporter(TopologyKVMetricsSettings(sink="null")) is first
    with pytest.raises(ValueError, match="settings: the topology KV reporter is already registered"):
        register_topology_kv_reporter(TopologyKVMetricsSettings(sink="prometheus", port=0))
    unregister_topology_kv_reporter()
    assert topology_kv_reporter() is OFF_REPORTER and metrics._registered is None


def test_a_bad_variable_fails_registration_and_registers_nothing(clean_registration):
    with pytest.raises(ValueError, match=f"{ENV_METRICS}='on'"):
        register_topology_kv_reporter(environ={ENV_METRICS: "on"})
    assert topology_kv_reporter() is OFF_REPORTER


# ------------------------------------------------------------------ the step read


class _CountOps(TorchDispatchMode):
    """Every aten op run while active (a host read of a tensor value is one of them)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class _Poisoned(dict):
    def __getitem__(self, name):
        raise AssertionError(f"counter {name} was read with metrics off")


def test_off_reads_nothing():
    step = _step()
    for layer, counters in step.by_layer.items():
        if counters is not None:
            step.by_layer[layer] = TopologyKVCounters(tensors=_Poisoned(counters.tensors))
    with _CountOps() as mode:
        assert report_topology_step(step, OFF_REPORTER) is None
        assert report_topology_step(step) is None  # nothing registered: the off reporter
    assert mode.ops == []  # no op at all: no stack, no copy, no host read


def test_on_reads_the_step_in_one_transfer():
    step = _step()
    with _CountOps() as mode:
        reading = read_topology_step(step)
    assert mode.ops.count("aten.stack") == 1, mode.ops
    assert "aten._local_scalar_dense" not in mode.ops and "aten.item" not in mode.ops, mode.ops
    totals = reading.totals()
    assert set(totals) == set(TOTAL_NAMES)
    assert {k: totals[k] for k in step.totals()} == step.totals()  # the per-tensor reads agree
    assert (totals["rows"], totals["policy_skips"], totals["compression_hits"]) == (24, 1, 2)


def test_a_reported_step_scrapes_as_its_counters(prometheus):
    step = _step()
    report_topology_step(step, prometheus, policy_ms=1.5)
    report_topology_step(step, prometheus, policy_ms=0.5)  # a second step, same counters
    got = scrape(prometheus.sink.address)
    totals = step.totals()
    assert sum(samples(got, "py_rtp_topology_kv_coordinate_mismatch_fallbacks_total")) == 2 * totals[
        "coordinate_mismatch_fallbacks"]
    assert samples(got, "py_rtp_topology_kv_coordinate_mismatch_fallbacks_total", layer=0) == [2]
    assert sum(samples(got, "py_rtp_topology_kv_learned_evicted_tokens_total")) == 2 * totals["learned_evicted_tokens"]
    assert sum(samples(got, "py_rtp_topology_kv_structural_injected_tokens_total")) == 2 * totals[
        "structural_injected_tokens"]
    assert sum(samples(got, "py_rtp_topology_kv_compression_hits_total")) == 2 * totals["compression_hits"]
    assert sum(samples(got, "py_rtp_topology_kv_rows_total")) == 2 * 24
    assert samples(got, "py_rtp_topology_kv_policy_skips_total", layer=2, reason="disabled", mode="disabled") == [2]
    assert samples(got, "py_rtp_topology_kv_learned_kept_share", layer=0) == [0.75]
    assert samples(got, "py_rtp_topology_kv_learned_kept_share", layer=1) == [1.0]
    assert samples(got, "py_rtp_topology_kv_kv_tokens_read", layer=1) == [90]
    assert samples(got, "py_rtp_topology_kv_policy_step_ms", path="decode") == [0.5]
