"""The metrics exporter against the end-to-end decode: served on loopback, a few decode steps
of the benchmark through the ``Indexer``, one scrape of ``/metrics`` over HTTP; the scraped
values equal the step counters' own totals (``TopologyStepCounters.totals()``, read tensor by
tensor), the benchmark's per-variant sums and the counter table the validation report prints.
"""

from __future__ import annotations

import urllib.request
from unittest import mock

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmark.e2e import cli as e2e
from benchmark.e2e import decode as e2e_decode
from benchmark.quality.sample_text import PRIDE_AND_PREJUDICE_OPENING
from benchmark.validation import report
from rtp_llm.metrics import (
    TopologyKVMetricsSettings,
    register_topology_kv_reporter,
    unregister_topology_kv_reporter,
)
from rtp_llm.models_py.modules.hybrid.indexer import TopologyStepCounters

NUM_LAYERS = 2  # truncated model: a few seconds per step on 2 cores
CONTEXT = 160  # > 2 pages of 64: sink, local and witness blocks all exist
WIDTH = 64  # below the context: the merge injects and evicts
STEPS = 3
VARIANTS = ["dense", "learned", "learned+topology_sparse_merge", "learned+topology_compress_sparse"]
# Accumulating metric -> the step counters' total it must equal.
ACC = {
    "py_rtp_topology_kv_coordinate_mismatch_fallbacks_total": "coordinate_mismatch_fallbacks",
    "py_rtp_topology_kv_structural_injected_tokens_total": "structural_injected_tokens",
    "py_rtp_topology_kv_learned_evicted_tokens_total": "learned_evicted_tokens",
    "py_rtp_topology_kv_compression_hits_total": "compression_hits",
}


class _KeptStepCounters(TopologyStepCounters):
    """The benchmark's per-step counters, kept so the test can total them itself."""

    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _KeptStepCounters.made.append(self)


@pytest.fixture(scope="module")
def decoded():
    """Exporter up, the decode run, one scrape: ``(steps' counters, result rows, scraped samples)``."""
    unregister_topology_kv_reporter()
    reporter = register_topology_kv_reporter(TopologyKVMetricsSettings(sink="prometheus", port=0, addr="127.0.0.1"))
    try:
        loaded = e2e.load_model(None, NUM_LAYERS)
        text = loaded.tokenizer(PRIDE_AND_PREJUDICE_OPENING, add_special_tokens=False)["input_ids"]
        shape = e2e.resolve_indexer_shape("dsa-ratio", None, None, *e2e.kv_geometry(loaded.model))
        _KeptStepCounters.made = []
        with mock.patch.object(e2e_decode, "TopologyStepCounters", _KeptStepCounters):
            rows = e2e.run_one(loaded.model, text, [CONTEXT, CONTEXT - 37], VARIANTS, STEPS, 0, WIDTH, shape,
                               warmup=1)
        body = urllib.request.urlopen(f"http://{reporter.sink.address}/metrics", timeout=10).read().decode()
        scraped = [s for family in text_string_to_metric_families(body) for s in family.samples]
        yield list(_KeptStepCounters.made), rows, scraped
    finally:
        unregister_topology_kv_reporter()


def _sum(scraped, name, **labels):
    want = {k: str(v) for k, v in labels.items()}
    return sum(s.value for s in scraped if s.name == name and want.items() <= s.labels.items())


def test_the_scrape_equals_the_step_counters_totals(decoded):
    steps, rows, scraped = decoded
    assert len(steps) == STEPS * len(VARIANTS)
    expected = {}
    for step in steps:
        for name, value in step.totals().items():  # the counters read one by one, not by the reporter
            expected[name] = expected.get(name, 0) + value
    assert expected["structural_injected_tokens"] > 0 and expected["learned_evicted_tokens"] > 0
    for metric, total in ACC.items():
        assert _sum(scraped, metric) == expected[total], metric
    calls = [c for step in steps for c in step.calls.values()]
    assert _sum(scraped, "py_rtp_topology_kv_rows_total") == sum(c.rows for c in calls) > 0
    skips = sum(1 for c in calls if c.skip_reason is not None)
    assert _sum(scraped, "py_rtp_topology_kv_policy_skips_total") == skips
    assert _sum(scraped, "py_rtp_topology_kv_policy_skips_total", reason="disabled", mode="disabled") == skips
    # The learned variant: every layer of every step skipped, none fell back.
    assert skips == STEPS * NUM_LAYERS
    # Gauges (per mode tag): the compress variant's last decoded step, per layer; the
    # balanced order decides which variant runs last, so find its step.
    last = next(s for s in reversed(steps) if all(c is not None for c in s.by_layer.values()))
    for layer, counters in last.by_layer.items():
        tags = dict(layer=layer, mode="topology_compress_sparse", path="decode")
        assert _sum(scraped, "py_rtp_topology_kv_kv_tokens_read", **tags) == int(counters.selected_tokens)


def test_the_benchmark_and_the_report_print_the_scraped_totals(decoded):
    steps, rows, scraped = decoded
    table = e2e.format_counter_table(rows)
    for metric, total in ACC.items():
        assert sum(r["topology_counters"][total] for r in rows) == _sum(scraped, metric), metric
    assert sum(r["topology_counters"]["rows"] for r in rows) == _sum(scraped, "py_rtp_topology_kv_rows_total")
    for r in rows:
        mode = {"dense": None, "learned": "disabled"}.get(r["variant"], r["variant"].split("+", 1)[-1])
        if mode is not None and mode != "disabled":
            name = "py_rtp_topology_kv_structural_injected_tokens_total"
            assert r["topology_counters"]["structural_injected_tokens"] == _sum(scraped, name, mode=mode)
        c = r["topology_counters"]
        line = (f"| {r['context']} | {r['batch']} | 1 | {r['variant']} | {c['rows']} | "
                f"{c['coordinate_mismatch_fallbacks']} | {c['policy_skips']} | {c['structural_injected_tokens']} |")
        assert line in table, (line, table)
    # The validation report's end-to-end section carries the same table.
    payload = {"rows": rows, "command": "python benchmark/topology_kv_decode_e2e.py", "markdown": "",
               "targets_text": "",
               "indexer": {"preset": "dsa-ratio", "heads": 1, "dim": 64, "ratio_to_attention": 0.06},
               "counters_markdown": e2e.format_counter_table(rows)}
    env = {"machine": "cpu", "cpu_count": 2, "torch": "", "threads": 2, "device": "cpu", "date": ""}
    assert table in report.markdown({"e2e": payload}, {}, env, {})
