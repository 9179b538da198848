"""The policy's counters of each decode step, read as serving reads them, and their table.

Every step is read once, after the step, by the serving metrics' own functions
(``rtp_llm.metrics.topology_kv_step``): reported as well when the process's reporter is on
(``RTP_LLM_TOPOLOGY_KV_METRICS``), so the exporter and this benchmark's table show the same
numbers (tested by scraping the exporter). A variant's sums cover every decode step,
warm-up included, as the exporter's do.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from rtp_llm.metrics.topology_kv_step import TOTAL_NAMES, read_topology_step, report_topology_step
from rtp_llm.models_py.modules.hybrid.indexer import TopologyStepCounters

KEY = "topology_counters"  # the step record's and the table row's field
# (column, TOTAL_NAMES key): what a reader decides on; every total stays in the JSON.
COLUMNS = (
    ("rows seen", "rows"),
    ("fallbacks", "coordinate_mismatch_fallbacks"),
    ("skips", "policy_skips"),
    ("injected", "structural_injected_tokens"),
    ("evicted", "learned_evicted_tokens"),
    ("kept", "learned_kept_tokens"),
    ("selected", "selected_tokens"),
    ("compression hits", "compression_hits"),
)


def step_totals(counters: TopologyStepCounters, policy_ms: Optional[float]) -> Dict[str, int]:
    """One step's totals (one host read), reported first when metrics are on."""
    reading = report_topology_step(counters, policy_ms=policy_ms)
    if reading is None:  # metrics off: the benchmark still reads the step, once
        reading = read_topology_step(counters)
    return reading.totals()


def sum_totals(steps: Sequence[Dict[str, object]]) -> Dict[str, int]:
    """The totals of every step record (``steps``: the decode's step dicts)."""
    out = dict.fromkeys(TOTAL_NAMES, 0)
    for step in steps:
        for name, value in step[KEY].items():
            out[name] += value
    return out


def format_counter_table(rows: List[Dict[str, object]]) -> str:
    """Markdown: one line per result row that carries counters (older ``--json`` runs do not)."""
    lines = ["| context | B | rows | variant | " + " | ".join(c for c, _ in COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        totals = r.get(KEY)
        if totals is None:
            continue
        cells = " | ".join(str(totals[k]) for _, k in COLUMNS)
        lines.append(f"| {r['context']} | {r['batch']} | {r['rows_per_request']} | {r['variant']} | {cells} |")
    return "\n".join(lines)
