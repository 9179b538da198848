"""One step's topology KV counters, read once after the step and reported as metrics.

The policy's counters are device tensors in the caller's ``TopologyStepCounters``
(``Indexer._compute_topk(..., topology_counters=step)``), one entry per layer call, with
a host-only :class:`TopologyLayerCall` beside each (``step.calls``). After the step (never
inside a layer call, never while a CUDA graph is being captured) the caller hands the step
to :func:`report_topology_step`:

* metrics off (the registered reporter, or the one passed, has no sink): it returns None
  at once, reading nothing (zero cost; tested);
* on: :func:`read_topology_step` reads every layer's counters in one host transfer (one
  ``torch.stack`` of the 0-dim counter tensors per device, then one copy to the host) and
  :func:`report_reading` reports them, tagged ``layer``, ``mode``, ``path``, ``profile``
  (docs/metrics.md).

:meth:`TopologyStepReading.totals` sums a reading over layers in the names of
``TopologyStepCounters.totals()``, plus ``rows`` and ``policy_skips``; the end-to-end
benchmark prints these sums, so its table and the exporter show the same numbers.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from rtp_llm.metrics import topology_kv_reporter
from rtp_llm.metrics.topology_kv_metric_reporter import AccMetrics, GaugeMetrics, MetricReporter
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import COUNTER_NAMES
from rtp_llm.models_py.modules.hybrid.topology_kv.step_record import TopologyLayerCall

if TYPE_CHECKING:  # indexer.py imports this package: no import at run time
    from rtp_llm.models_py.modules.hybrid.indexer import TopologyStepCounters

# The keys of TopologyStepReading.totals(): the policy's counters as TopologyStepCounters.totals()
# names them, then the host-side counts of the calls.
TOTAL_NAMES = COUNTER_NAMES + ("compression_hits", "rows", "policy_skips")


@dataclasses.dataclass(frozen=True)
class LayerReading:
    """One layer call of a step, on the host.

    layer : the layer index
    call : its :class:`TopologyLayerCall`, or None when the caller recorded none
    counters : ``{name: int}`` (``COUNTER_NAMES`` and ``compression_hits``), or None when
        the policy did not run there
    """

    layer: int
    call: Optional[TopologyLayerCall]
    counters: Optional[Dict[str, int]]


@dataclasses.dataclass(frozen=True)
class TopologyStepReading:
    """A step's counters on the host, one :class:`LayerReading` per layer call, by layer."""

    layers: Tuple[LayerReading, ...]

    def totals(self) -> Dict[str, int]:
        """Every counter summed over layers (:data:`TOTAL_NAMES`; zeros included)."""
        out = dict.fromkeys(TOTAL_NAMES, 0)
        for layer in self.layers:
            if layer.counters is not None:
                for name, value in layer.counters.items():
                    out[name] += value
            if layer.call is not None:
                out["rows"] += layer.call.rows
                out["policy_skips"] += layer.call.skip_reason is not None
        return out


def read_topology_step(step: "TopologyStepCounters") -> TopologyStepReading:
    """The step's counters on the host: one stack and one device-to-host copy per device.

    Call after the step. Reads the device (a sync), so never inside a layer call or a
    captured CUDA graph (``RuntimeError`` while a capture is under way).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("read_topology_step: called during CUDA-graph capture; read the step after it")
    ran = [(layer, c) for layer, c in sorted(step.by_layer.items()) if c is not None]
    by_device: Dict[torch.device, List[Tuple[int, torch.Tensor]]] = {}
    for i, (_, counters) in enumerate(ran):
        for j, name in enumerate(COUNTER_NAMES):
            tensor = getattr(counters, name)
            by_device.setdefault(tensor.device, []).append((i * len(COUNTER_NAMES) + j, tensor))
    values = [0] * (len(ran) * len(COUNTER_NAMES))
    for entries in by_device.values():
        host = torch.stack([t.reshape(()).to(torch.int64) for _, t in entries]).cpu().tolist()  # the one read
        for (slot, _), value in zip(entries, host):
            values[slot] = value
    read: Dict[int, Dict[str, int]] = {}
    for i, (layer, counters) in enumerate(ran):
        row = values[i * len(COUNTER_NAMES) : (i + 1) * len(COUNTER_NAMES)]
        read[layer] = {**dict(zip(COUNTER_NAMES, row)), "compression_hits": counters.compression_hits}
    calls = getattr(step, "calls", {})
    return TopologyStepReading(tuple(
        LayerReading(layer, calls.get(layer), read.get(layer)) for layer in sorted(step.by_layer)
    ))


def _layer_tags(layer: LayerReading) -> Dict[str, object]:
    call = layer.call
    if call is None:
        return {"layer": layer.layer, "mode": None, "path": None, "profile": None}
    return {"layer": layer.layer, "mode": call.mode.value, "path": call.path.value, "profile": call.profile}


def report_reading(
    reading: TopologyStepReading, reporter: MetricReporter, *, policy_ms: Optional[float] = None
) -> None:
    """Report a step's reading: the accumulating metrics per layer call, the gauges per
    layer that ran the policy, and ``policy_ms`` (the step's policy time, where the caller
    measured it) as the step gauge."""
    for layer in reading.layers:
        tags = _layer_tags(layer)
        rows = 0 if layer.call is None else layer.call.rows
        reporter.report(AccMetrics.ROWS, rows, tags)
        if layer.call is not None and layer.call.skip_reason is not None:
            reporter.report(AccMetrics.POLICY_SKIPS, 1, {**tags, "reason": layer.call.skip_reason.value})
        c = layer.counters
        if c is None:
            continue
        reporter.report(AccMetrics.COORDINATE_MISMATCH_FALLBACKS, c["coordinate_mismatch_fallbacks"], tags)
        reporter.report(AccMetrics.STRUCTURAL_INJECTED_TOKENS, c["structural_injected_tokens"], tags)
        reporter.report(AccMetrics.LEARNED_EVICTED_TOKENS, c["learned_evicted_tokens"], tags)
        reporter.report(AccMetrics.COMPRESSION_HITS, c["compression_hits"], tags)
        reporter.report(GaugeMetrics.KV_TOKENS_READ, c["selected_tokens"], tags)
        learned = c["learned_kept_tokens"] + c["learned_evicted_tokens"]
        if learned > 0:  # no learned tokens (topology_only without a scan): no share to report
            reporter.report(GaugeMetrics.LEARNED_KEPT_SHARE, c["learned_kept_tokens"] / learned, tags)
    # A forward step takes one path; the first call's path and profile tag its policy time
    # (a step without any layer call, e.g. a dense model's, has none to report).
    first = next((layer.call for layer in reading.layers if layer.call is not None), None)
    if policy_ms is not None and first is not None:
        reporter.report(GaugeMetrics.POLICY_STEP_MS, policy_ms, {"path": first.path.value, "profile": first.profile})


def report_topology_step(
    step: "TopologyStepCounters", reporter: Optional[MetricReporter] = None, *, policy_ms: Optional[float] = None
) -> Optional[TopologyStepReading]:
    """Read ``step`` once and report it; None, reading nothing, when metrics are off.

    ``reporter``: the registered one (:func:`rtp_llm.metrics.topology_kv_reporter`) when None.
    """
    reporter = topology_kv_reporter() if reporter is None else reporter
    if not reporter.enabled:
        return None
    reading = read_topology_step(step)
    report_reading(reading, reporter, policy_ms=policy_ms)
    return reading
