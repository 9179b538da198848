"""The metrics settings: off by default, on with one variable.

``RTP_LLM_TOPOLOGY_KV_METRICS`` chooses the sink: ``off`` (default: nothing is read or
reported, zero cost), ``null`` (the step is read and reported into a sink that keeps
nothing) or ``prometheus`` (``/metrics`` on ``RTP_LLM_TOPOLOGY_KV_METRICS_ADDR``:
``RTP_LLM_TOPOLOGY_KV_METRICS_PORT``). They are read once, when the process's reporter is
registered (``rtp_llm.metrics.register_topology_kv_reporter``, which the first ``Indexer``
built from the environment calls); unset or blank means the default, and a bad value
raises ``ValueError`` naming the variable and the value. These are process settings, not
policy settings, so they live here and not in ``topology_kv.config``'s policy fields;
:func:`metrics_variables` lists them for the README's settings table (tested).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
import re
from typing import Mapping, Tuple, Union

from rtp_llm.models_py.modules.hybrid.topology_kv.config import parse_enum_member

ENV_METRICS = "RTP_LLM_TOPOLOGY_KV_METRICS"
ENV_METRICS_PORT = "RTP_LLM_TOPOLOGY_KV_METRICS_PORT"
ENV_METRICS_ADDR = "RTP_LLM_TOPOLOGY_KV_METRICS_ADDR"

# A fixed default so that a scrape config can name it; set another where it is taken,
# or 0 for any free port (the port is then logged).
DEFAULT_PORT = 9470
# Loopback: the endpoint is local unless the operator opens it (e.g. 0.0.0.0 in a pod).
DEFAULT_ADDR = "127.0.0.1"

_PORT_DIGITS = re.compile(r"[0-9]{1,5}")  # ASCII only: int() would take "+80", "8_0", non-ASCII digits


class MetricsSink(enum.Enum):
    """Where the topology KV metrics go."""

    OFF = "off"  # nothing read, nothing reported
    NULL = "null"  # read and reported, kept nowhere
    PROMETHEUS = "prometheus"  # served on /metrics

    @classmethod
    def parse(cls, value: Union[str, "MetricsSink"], setting: str = "sink") -> "MetricsSink":
        return parse_enum_member(cls, value, setting)


@dataclasses.dataclass(frozen=True)
class TopologyKVMetricsSettings:
    """Validated, immutable metrics settings.

    sink : MetricsSink or its name (case-insensitive)
    port : int in 0..65535 (0: any free port); used by the Prometheus sink
    addr : an IPv4 or IPv6 address to listen on; used by the Prometheus sink
    """

    sink: MetricsSink = MetricsSink.OFF
    port: int = DEFAULT_PORT
    addr: str = DEFAULT_ADDR

    def __post_init__(self) -> None:
        object.__setattr__(self, "sink", MetricsSink.parse(self.sink))
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected an int in 0..65535 (0: any free port), got {self.port!r}")
        try:
            ipaddress.ip_address(self.addr)
        except ValueError:
            raise ValueError(f"addr: expected an IPv4 or IPv6 address, got {self.addr!r}") from None

    @property
    def enabled(self) -> bool:
        return self.sink is not MetricsSink.OFF

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "TopologyKVMetricsSettings":
        """Read the ``RTP_LLM_TOPOLOGY_KV_METRICS*`` variables; ``ValueError`` naming the
        variable and its value on anything invalid."""
        values = {}
        raw = environ.get(ENV_METRICS)
        if raw is not None and raw.strip():
            try:
                values["sink"] = MetricsSink.parse(raw)
            except ValueError:
                valid = ", ".join(m.value for m in MetricsSink)
                raise ValueError(
                    f"{ENV_METRICS}={raw!r}: expected one of [{valid}] (case-insensitive), got {raw!r}"
                ) from None
        raw = environ.get(ENV_METRICS_PORT)
        if raw is not None and raw.strip():
            text = raw.strip()
            if not _PORT_DIGITS.fullmatch(text) or int(text) > 65535:
                raise ValueError(
                    f"{ENV_METRICS_PORT}={raw!r}: expected a decimal port in 0..65535 (0: any free port), got {raw!r}"
                )
            values["port"] = int(text)
        raw = environ.get(ENV_METRICS_ADDR)
        if raw is not None and raw.strip():
            try:
                ipaddress.ip_address(raw.strip())
            except ValueError:
                raise ValueError(f"{ENV_METRICS_ADDR}={raw!r}: expected an IPv4 or IPv6 address, got {raw!r}") from None
            values["addr"] = raw.strip()
        return cls(**values)


def metrics_variables() -> Tuple[str, ...]:
    """Every ``RTP_LLM_TOPOLOGY_KV_METRICS*`` variable."""
    return (ENV_METRICS, ENV_METRICS_PORT, ENV_METRICS_ADDR)
