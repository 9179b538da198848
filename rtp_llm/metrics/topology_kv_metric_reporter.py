"""The topology KV policy's metrics, reported the way the engine reports its own.

Shaped like the engine's ``rtp_llm/metrics/kmonitor_metric_reporter.py``: two enums of
metric names, :class:`AccMetrics` (accumulating: each report adds its value) and
:class:`GaugeMetrics` (each report sets the current value), and a :class:`MetricReporter`
that registers every metric once with its sink and takes ``report(metric, value, tags)``.
Names follow the engine's ``py_rtp_...`` style; docs/metrics.md describes each one.

A sink is anything with ``register_acc_metric(name, tag_names)`` and
``register_gauge_metric(name, tag_names)``, each returning an object with
``report(value, tags)``, plus ``close()``: :class:`NullSink` (counts nothing, keeps
nothing), ``prometheus_sink.PrometheusSink`` (a ``/metrics`` endpoint), or, in the
engine, kmonitor. The tags of every metric are fixed (:data:`METRIC_TAGS`) because a
Prometheus metric's label names are; a tag without a value (``profile`` when no profile
is served) is reported as ``""``, which Prometheus treats as an absent label.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Dict, Mapping, Optional, Tuple, Union


class AccMetrics(enum.Enum):
    """Accumulating metrics: each report adds its value (a count since the process started)."""

    ROWS = "py_rtp_topology_kv_rows"  # top-k rows that reached the policy hook
    COORDINATE_MISMATCH_FALLBACKS = "py_rtp_topology_kv_coordinate_mismatch_fallbacks"
    POLICY_SKIPS = "py_rtp_topology_kv_policy_skips"  # layer calls the policy did not run on
    STRUCTURAL_INJECTED_TOKENS = "py_rtp_topology_kv_structural_injected_tokens"
    LEARNED_EVICTED_TOKENS = "py_rtp_topology_kv_learned_evicted_tokens"
    COMPRESSION_HITS = "py_rtp_topology_kv_compression_hits"


class GaugeMetrics(enum.Enum):
    """Gauges: each report sets the value (the last step's)."""

    POLICY_STEP_MS = "py_rtp_topology_kv_policy_step_ms"  # the step's policy time, where the caller measures it
    LEARNED_KEPT_SHARE = "py_rtp_topology_kv_learned_kept_share"  # kept / (kept + evicted) learned tokens
    KV_TOKENS_READ = "py_rtp_topology_kv_kv_tokens_read"  # tokens the sparse attention reads (selected)


Metric = Union[AccMetrics, GaugeMetrics]

LAYER_TAGS = ("layer", "mode", "path", "profile")
STEP_TAGS = ("path", "profile")  # a step-wide value: no layer, and layers may differ in mode

# The tag names of every metric, fixed at registration.
METRIC_TAGS: Dict[Metric, Tuple[str, ...]] = {
    **{m: LAYER_TAGS for m in AccMetrics},
    AccMetrics.POLICY_SKIPS: LAYER_TAGS + ("reason",),
    GaugeMetrics.POLICY_STEP_MS: STEP_TAGS,
    GaugeMetrics.LEARNED_KEPT_SHARE: LAYER_TAGS,
    GaugeMetrics.KV_TOKENS_READ: LAYER_TAGS,
}

# What each metric means, for the sinks' help text (docs/metrics.md has the full table).
METRIC_HELP: Dict[Metric, str] = {
    AccMetrics.ROWS: "top-k rows that reached the topology KV policy hook (policy run or skipped)",
    AccMetrics.COORDINATE_MISMATCH_FALLBACKS:
        "rows returned unchanged because they broke the coordinate contract (alert when > 0)",
    AccMetrics.POLICY_SKIPS: "layer calls on which the policy did not run, by reason",
    AccMetrics.STRUCTURAL_INJECTED_TOKENS: "output tokens the policy added that the learned row did not hold",
    AccMetrics.LEARNED_EVICTED_TOKENS: "learned tokens the structural tokens displaced",
    AccMetrics.COMPRESSION_HITS: "compress mode: contexts whose fingerprint equalled their previous one",
    GaugeMetrics.POLICY_STEP_MS: "the last step's policy time in ms, where the caller measures it",
    GaugeMetrics.LEARNED_KEPT_SHARE: "the last step's learned tokens kept / (kept + evicted), per layer",
    GaugeMetrics.KV_TOKENS_READ: "the last step's tokens selected for sparse attention (the KV it reads), per layer",
}


class _NullMetric:
    def report(self, value: float, tags: Mapping[str, str]) -> None:
        pass


class NullSink:
    """A sink that keeps nothing: the step is read and reported, and the values are dropped."""

    def register_acc_metric(self, name: str, tag_names: Tuple[str, ...]) -> _NullMetric:
        return _NullMetric()

    def register_gauge_metric(self, name: str, tag_names: Tuple[str, ...]) -> _NullMetric:
        return _NullMetric()

    def close(self) -> None:
        pass


class MetricReporter:
    """Every topology KV metric registered once with ``sink``; ``report`` forwards to it.

    ``sink=None`` is the reporter of metrics switched off: :attr:`enabled` is False, and a
    caller checks it before reading anything (``topology_kv_step.report_topology_step``
    reads no device value then). ``settings`` records what built the reporter (the
    ``TopologyKVMetricsSettings``), or None.
    """

    def __init__(self, sink: Optional[Any], settings: Optional[Any] = None) -> None:
        self.sink = sink
        self.settings = settings
        self._metrics: Dict[Metric, Any] = {}
        if sink is not None:
            for metric in AccMetrics:
                self._metrics[metric] = sink.register_acc_metric(metric.value, METRIC_TAGS[metric])
            for metric in GaugeMetrics:
                self._metrics[metric] = sink.register_gauge_metric(metric.value, METRIC_TAGS[metric])

    @property
    def enabled(self) -> bool:
        return self.sink is not None

    def report(self, metric: Metric, value: float = 1, tags: Optional[Mapping[str, Any]] = None) -> None:
        """Add ``value`` to an accumulating metric, or set a gauge to it.

        ``tags`` must name exactly the metric's tags (:data:`METRIC_TAGS`); values become
        strings, None becomes ``""``. ``ValueError`` naming the metric on a wrong tag set,
        a negative accumulating value or a non-finite value.
        """
        if not isinstance(metric, (AccMetrics, GaugeMetrics)):
            raise TypeError(f"metric: expected an AccMetrics or GaugeMetrics member, got {metric!r}")
        tags = dict(tags or {})
        want = METRIC_TAGS[metric]
        if set(tags) != set(want):
            raise ValueError(f"{metric.value}: expected tags {sorted(want)}, got {sorted(tags)}")
        if not math.isfinite(value) or (isinstance(metric, AccMetrics) and value < 0):
            kind = "a finite value >= 0 (it accumulates)" if isinstance(metric, AccMetrics) else "a finite value"
            raise ValueError(f"{metric.value}: expected {kind}, got {value!r}")
        if self.sink is None:
            return
        self._metrics[metric].report(value, {k: "" if v is None else str(v) for k, v in tags.items()})

    def close(self) -> None:
        """Close the sink (the Prometheus sink stops its HTTP server)."""
        if self.sink is not None:
            self.sink.close()
