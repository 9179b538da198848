"""Metrics of the topology KV policy, reported as the engine reports its own (docs/metrics.md).

The engine's ``rtp_llm.metrics`` holds one process-wide reporter (``kmonitor``) that every
module reports through. This package keeps the same pattern for the topology KV metrics,
and that reporter is its only module-level mutable state: :func:`register_topology_kv_reporter`
builds it once per process from :class:`TopologyKVMetricsSettings` (the
``RTP_LLM_TOPOLOGY_KV_METRICS*`` variables; the first ``Indexer`` built from the
environment calls it) and every later call returns the same object;
:func:`topology_kv_reporter` returns it, or the switched-off reporter before registration.
Per-step values never live here: the caller owns the step's counters and hands them to
``topology_kv_step.report_topology_step`` after the step.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Mapping, Optional

from rtp_llm.metrics.topology_kv_metric_reporter import (  # noqa: F401 (re-exported)
    METRIC_TAGS,
    AccMetrics,
    GaugeMetrics,
    MetricReporter,
    NullSink,
)
from rtp_llm.metrics.topology_kv_metrics_settings import (  # noqa: F401 (re-exported)
    ENV_METRICS,
    ENV_METRICS_ADDR,
    ENV_METRICS_PORT,
    MetricsSink,
    TopologyKVMetricsSettings,
    metrics_variables,
)

logger = logging.getLogger(__name__)

OFF_REPORTER = MetricReporter(None, TopologyKVMetricsSettings())  # immutable: no sink, reports nothing

_registered: Optional[MetricReporter] = None  # the process's one reporter (module docstring)
_registering = threading.Lock()  # layers may be built on several threads


def build_reporter(settings: TopologyKVMetricsSettings) -> MetricReporter:
    """A reporter for ``settings`` (not registered): the Prometheus sink starts serving here."""
    if not isinstance(settings, TopologyKVMetricsSettings):
        raise TypeError(f"settings: expected TopologyKVMetricsSettings, got {type(settings).__name__}")
    if settings.sink is MetricsSink.OFF:
        return MetricReporter(None, settings)
    if settings.sink is MetricsSink.NULL:
        return MetricReporter(NullSink(), settings)
    from rtp_llm.metrics.prometheus_sink import PrometheusSink  # imported only when chosen

    sink = PrometheusSink()
    reporter = MetricReporter(sink, settings)  # registers every metric before the first scrape
    sink.start(settings.port, settings.addr, setting=ENV_METRICS_PORT)
    logger.info("topology KV metrics: Prometheus /metrics on %s", sink.address)
    return reporter


def register_topology_kv_reporter(
    settings: Optional[TopologyKVMetricsSettings] = None, *, environ: Mapping[str, str] = os.environ
) -> MetricReporter:
    """The process's reporter, built on the first call (from ``settings``, else ``environ``).

    Later calls return the same reporter; one that passes ``settings`` different from the
    registered ones raises ``ValueError`` (a process has one endpoint).
    """
    global _registered
    with _registering:
        if _registered is None:
            if settings is None:
                settings = TopologyKVMetricsSettings.from_env(environ)
            _registered = build_reporter(settings)
        elif settings is not None and settings != _registered.settings:
            raise ValueError(
                f"settings: the topology KV reporter is already registered with {_registered.settings}, got {settings}"
            )
        return _registered


def topology_kv_reporter() -> MetricReporter:
    """The registered reporter, or :data:`OFF_REPORTER` when none is."""
    return _registered if _registered is not None else OFF_REPORTER


def unregister_topology_kv_reporter() -> None:
    """Close and forget the registered reporter (process shutdown, tests)."""
    global _registered
    with _registering:
        if _registered is not None:
            _registered.close()
            _registered = None
