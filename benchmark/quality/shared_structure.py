"""What structure can recover for a layer that shares an indexer scan (``topology_kv_calibrate.py --shared-structure``).

A sharing layer attends over the rows of the nearest scanning layer below it
(``rtp_llm/models_py/modules/hybrid/indexer_share.py``); its own policy hook may merge its
own structure into them. This measures, on the calibration's teacher-forced windows (one
dense forward each, every layer on the dense model's own inputs, as
:func:`~benchmark.quality.calibration.measure`), each sharing layer's output error
(``cos_diff``) with

* ``learned``: its own trained-indexer rows (what it would attend over if it scanned),
* ``reuse``: its scanning layer's rows as they are (sharing alone),
* every structural candidate of the calibration (shares x component sets, the engine's
  component sizes) merged into the reused rows, with the layer's own witness scores,
* each ``--exchange`` (:mod:`benchmark.quality.witness_exchange`): the same witness scores
  swapping tokens into the reused rows only where they estimate a gain (harness only, so
  reported in every sharing layer and never the per-layer choice, which serving must run).

Per layer and budget the best candidate is *chosen on the same windows it is scored on*
and kept only if it beats ``reuse`` by the calibration's margin, so the recovered share
printed, ``(reuse - chosen) / (reuse - learned)`` summed over the sharing layers, is an
optimistic bound on what any per-layer structure entry can give back of what sharing
loses, in output error at that layer. Beside it, each candidate's sum when it runs in every
sharing layer (what ``structure_layers=sharing`` serves), which is not chosen on the windows.
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence

import torch

from benchmark.quality.calibration import (
    CalibrationSettings,
    Measurements,
    candidate_errors,
    reuse_name,
    teacher_forced_passes,
)
from benchmark.quality.layer import LayerInputs
from benchmark.quality.model import LoadedModel
from benchmark.quality.policy_selectors import layer_witness_scores, make_policy_selector
from benchmark.quality.selector_base import learned_rows_and_scores
from benchmark.quality.text import TextWindow
from benchmark.quality.witness_exchange import Exchange, exchange_rows
from rtp_llm.models_py.modules.hybrid.indexer_share import IndexerSharePlan
from rtp_llm.models_py.modules.hybrid.topology_kv.profile import budget_key

OWN = "learned"
REUSE = "reuse"


def merged_name(source: int, candidate: str) -> str:
    """The measured rows of ``candidate`` merged into the learned rows of sparse layer ``source``.

    A candidate's rows depend only on the layer, the rows it merges into and the candidate,
    so every scanning set in which a layer reuses ``source`` shares one measurement.
    """
    return f"{reuse_name(source)}|{candidate}"


def measure_shared_structure(
    lm: LoadedModel,
    windows: Dict[int, List[TextWindow]],
    settings: CalibrationSettings,
    plans: Sequence[IndexerSharePlan],
    progress: bool = True,
    exchanges: Sequence[Exchange] = (),
) -> Measurements:
    """``Measurements`` of every layer that shares under some plan: ``learned`` (its own rows),
    ``reuse:<j>`` (the rows of each sparse layer ``j`` it reuses under some plan) and
    :func:`merged_name` ``(j, candidate)`` (each structural candidate merged into them, then
    each of ``exchanges`` applied to them)."""
    if settings.policy != "topology_sparse_merge":
        raise ValueError(f"policy: expected topology_sparse_merge (a merge into the reused rows), got {settings.policy!r}")
    structural = settings.candidates()[1:]
    out = Measurements()

    def start_window(context: int, wi: int, bar):
        own_rows: Dict[int, Dict[int, tuple]] = {}  # budget index -> layer -> (rows, scores)

        def visit(layer: LayerInputs) -> None:
            idx = layer.layer_idx
            scores = None  # the layer's witness scores, for the exchanges: the same at every budget
            for bi, budget in enumerate(settings.budgets):
                w = max(1, int(context * budget))
                bar.set_postfix_str(f"ctx {context} win {wi} layer {idx} W {w}")
                own = learned_rows_and_scores(layer, w, settings.selector_settings)
                own_rows.setdefault(bi, {})[idx] = own
                rows: Dict[str, torch.Tensor] = {}
                for source in sorted({plan.source(idx) for plan in plans if not plan.scans(idx)}):
                    base = own_rows[bi][source]
                    rows[OWN] = own[0]
                    rows[reuse_name(source)] = base[0]
                    for cand in structural:
                        select = make_policy_selector(settings.policy, settings.selector_settings,
                                                      settings.policy_settings(cand), lambda _l, _w, b=base: b)
                        rows[merged_name(source, cand.name)] = select(layer, w, {})
                    if exchanges and scores is None:
                        scores, _ = layer_witness_scores(layer, settings.block_size,
                                                         settings.resolved_witness_signal)
                    for ex in exchanges:
                        rows[merged_name(source, ex.name)] = exchange_rows(
                            base[0], layer.lengths, scores, settings.block_size, ex)[0]
                if rows:
                    for name, values in candidate_errors(layer, rows, w, settings.metric_stride).items():
                        out.add(idx, budget, context, name, values)
                bar.update()

        return visit

    teacher_forced_passes(lm, windows, settings, start_window, "shared structure", progress)
    return out


def candidate_names(settings: CalibrationSettings, exchanges: Sequence[Exchange] = ()) -> List[str]:
    """The measured structural candidates: the calibration's, then the exchanges."""
    return [c.name for c in settings.candidates()[1:]] + [ex.name for ex in exchanges]


def summarize_shared_structure(
    measurements: Measurements, plan: IndexerSharePlan, settings: CalibrationSettings,
    exchanges: Sequence[Exchange] = (),
) -> Dict[str, object]:
    """Per budget: each sharing layer's ``learned``, ``reuse``, best candidate and chosen error
    (module doc), the sums with the recovered share (NaN where sharing loses nothing), and
    ``every_layer``: each candidate's sum and recovered share when it runs in every sharing layer."""
    served = candidate_names(settings)
    names = candidate_names(settings, exchanges)
    per_budget: Dict[str, object] = {}
    for budget in settings.budgets:
        layers, sums = {}, {"learned": 0.0, "reuse": 0.0, "chosen": 0.0}
        every_layer = {name: 0.0 for name in names}
        for layer in plan.sparse_layers:
            if plan.scans(layer):
                continue

            def err(name: str) -> float:
                return measurements.mean(layer, budget, name, settings.contexts)[0]

            source = plan.source(layer)
            own, reuse = err(OWN), err(reuse_name(source))
            if own != own or reuse != reuse:
                continue  # no measured row at this budget (every row dense)
            errs = {name: err(merged_name(source, name)) for name in names}
            best_err, best = min(((errs[name], name) for name in served), default=(float("nan"), None))
            for name, e in errs.items():
                every_layer[name] += e
            keep = best is not None and best_err < reuse * (1.0 - settings.margin)
            chosen = best_err if keep else reuse
            layers[str(layer)] = {
                "reuses": source, "learned": own, "reuse": reuse, "best": best, "best_cos_diff": best_err,
                "chosen": best if keep else REUSE, "chosen_cos_diff": chosen,
                "recovered": (reuse - chosen) / (reuse - own) if reuse > own else float("nan"),
            }
            sums["learned"] += own
            sums["reuse"] += reuse
            sums["chosen"] += chosen
        lost = sums["reuse"] - sums["learned"]
        sums["recovered"] = (sums["reuse"] - sums["chosen"]) / lost if lost > 0 else float("nan")
        per_budget[budget_key(budget)] = {"layers": layers, "sum": sums, "every_layer": {
            name: {"sum": total, "recovered": (sums["reuse"] - total) / lost if lost > 0 else float("nan")}
            for name, total in every_layer.items()}}
    return {"scan": plan.spec, "scanning": list(plan.scanning), "sparse_layers": len(plan.sparse_layers),
            "margin": settings.margin, "budgets": per_budget, "ranked": rank_structure_layers(per_budget)}


def rank_structure_layers(per_budget: Dict[str, object]) -> List[List[object]]:
    """``[[layer, recovered], ...]``: the sharing layers whose chosen structure beats the reused
    rows, by the output error it removes summed over the budgets (``reuse - chosen``),
    largest first (ties by layer). Its first K are where ``structure_layers`` spends the
    policy's time best (``RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS``)."""
    gain: Dict[int, float] = {}
    for budget in per_budget.values():
        for layer, m in budget["layers"].items():
            gain[int(layer)] = gain.get(int(layer), 0.0) + (m["reuse"] - m["chosen_cos_diff"])
    ranked = sorted(((layer, g) for layer, g in gain.items() if g > 0), key=lambda x: (-x[1], x[0]))
    return [[layer, round(g, 6)] for layer, g in ranked]


def format_shared_structure(summary: Dict[str, object]) -> str:
    """A markdown table per scanning set: layers x budgets, ``reuse -> chosen (recovered)``."""
    budgets = list(summary["budgets"])
    scanning = summary["scanning"]
    lines = [f"### scanning {summary['scan']} ({len(scanning)} of {summary['sparse_layers']} sparse layers: "
             f"{','.join(map(str, scanning))})",
             "",
             "output error (cos_diff) of each sharing layer: own learned rows / reused rows -> best structure on "
             "them (share of the loss it recovers; `-`: no candidate beat the reused rows by the margin)",
             "",
             "| layer | reuses | " + " | ".join(f"W = {b}" for b in budgets) + " |",
             "|---|---|" + "---|" * len(budgets)]
    rows = sorted({int(x) for b in budgets for x in summary["budgets"][b]["layers"]})
    for layer in rows:
        cells, reuses = [], ""
        for b in budgets:
            m = summary["budgets"][b]["layers"].get(str(layer))
            if m is None:
                cells.append("")
                continue
            reuses = str(m["reuses"])
            rec = m["recovered"]
            what = "-" if m["chosen"] == REUSE else f"{m['chosen']} ({rec:+.0%})" if rec == rec else m["chosen"]
            cells.append(f"{m['learned']:.4f} / {m['reuse']:.4f} -> {m['chosen_cos_diff']:.4f} {what}")
        lines.append(f"| {layer} | {reuses} | " + " | ".join(cells) + " |")
    sums = [summary["budgets"][b]["sum"] for b in budgets]
    lines.append("| **sum** | | " + " | ".join(
        f"{s['learned']:.4f} / {s['reuse']:.4f} -> {s['chosen']:.4f} (**{s['recovered']:.0%}** recovered)"
        if s["recovered"] == s["recovered"] else f"{s['learned']:.4f} / {s['reuse']:.4f} (sharing loses nothing)"
        for s in sums) + " |")
    ranked = summary.get("ranked", [])
    if ranked:
        lines.append("\nsharing layers by the output error their structure removes (summed over the budgets): "
                     + ", ".join(f"{layer} ({gain:.4f})" for layer, gain in ranked)
                     + f"; structure on the first K: `RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS="
                     + ",".join(str(layer) for layer, _ in ranked[:min(4, len(ranked))]) + "` (K = 4)")
    lines.append("\nThe best candidate is chosen on the windows it is scored on: the recovered share is an "
                 "optimistic bound for per-layer structure on reused rows.")
    every = [summary["budgets"][b].get("every_layer", {}) for b in budgets]
    if any(every):
        lines += ["", "each candidate in every sharing layer (as `structure_layers=sharing` serves it): summed "
                  "output error (share of the loss it recovers; negative: it adds error)", "",
                  "| candidate | " + " | ".join(f"W = {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
        for name in every[0]:
            cells = []
            for e in every:
                m = e[name]
                cells.append(f"{m['sum']:.4f} ({m['recovered']:+.0%})" if m["recovered"] == m["recovered"]
                             else f"{m['sum']:.4f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_shared_structure(lm, windows, settings, plans, progress=True,
                         exchanges: Sequence[Exchange] = ()) -> Dict[str, object]:
    """Measure every plan in the same forwards; ``{"seconds": s, "sets": [summary, ...]}``."""
    start = time.perf_counter()
    measurements = measure_shared_structure(lm, windows, settings, plans, progress=progress, exchanges=exchanges)
    return {"seconds": round(time.perf_counter() - start, 1),
            "sets": [summarize_shared_structure(measurements, p, settings, exchanges) for p in plans]}
