"""A Prometheus sink for :class:`~rtp_llm.metrics.topology_kv_metric_reporter.MetricReporter`.

The default sink of a deployment without kmonitor: every metric becomes a Prometheus
metric in this sink's own ``CollectorRegistry`` (not ``prometheus_client``'s process-wide
default one, so two sinks, e.g. two tests, never collide), served as text on
``http://<addr>:<port>/metrics`` by ``prometheus_client.start_http_server`` on a daemon
thread. Accumulating metrics are Prometheus counters, exposed with ``prometheus_client``'s
``_total`` suffix (plus its ``_created`` timestamp); gauges keep their name.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from rtp_llm.metrics.topology_kv_metric_reporter import METRIC_HELP

_HELP = {m.value: text for m, text in METRIC_HELP.items()}


class _Acc:
    def __init__(self, counter: Counter) -> None:
        self._counter = counter

    def report(self, value: float, tags: Mapping[str, str]) -> None:
        self._counter.labels(**tags).inc(value)


class _Gauge:
    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge

    def report(self, value: float, tags: Mapping[str, str]) -> None:
        self._gauge.labels(**tags).set(value)


class PrometheusSink:
    """Prometheus metrics in an own registry, served on ``addr:port`` once :meth:`start` ran.

    ``port=0`` takes a free port (:attr:`port` tells which, after :meth:`start`). Without
    :meth:`start` nothing listens (the registry can still be read, e.g. by a test).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._server = None
        self._thread = None

    def register_acc_metric(self, name: str, tag_names: Tuple[str, ...]) -> _Acc:
        return _Acc(Counter(name, _HELP.get(name, name), tag_names, registry=self.registry))

    def register_gauge_metric(self, name: str, tag_names: Tuple[str, ...]) -> _Gauge:
        return _Gauge(Gauge(name, _HELP.get(name, name), tag_names, registry=self.registry))

    def start(self, port: int, addr: str, setting: str = "port") -> "PrometheusSink":
        """Serve ``/metrics`` on ``addr:port``; ``OSError`` (port taken) becomes ``ValueError``
        naming ``setting``, the address and why."""
        if self._server is not None:
            raise RuntimeError(f"PrometheusSink: already serving on {self.address}")
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as err:
            raise ValueError(f"{setting}={port}: cannot serve Prometheus metrics on {addr}:{port}: {err}") from None
        return self

    @property
    def port(self) -> Optional[int]:
        """The port ``/metrics`` is served on, or None before :meth:`start`."""
        return None if self._server is None else self._server.server_address[1]

    @property
    def address(self) -> Optional[str]:
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None

