"""Outputs: markdown table, JSON with every figure and the run's settings, PNG plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, List, Sequence

from benchmark.quality.gate import Verdict, check_mark
from benchmark.quality.iso_quality import iso_quality, iso_quality_json, iso_quality_markdown
from benchmark.quality.runner import GridResult, cell_summary, sorted_cells, stage_breakdown
from benchmark.quality.shared_scans import scan_share

NO_POLICY_MODE = "(no policy mode in --selectors)"


def _f(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _trained_source(selector_settings) -> str:
    """Which trained indexer the run ranked with, for the report's prose."""
    source = selector_settings.get("trained_source") or ""
    return f"checkpoint `{os.path.basename(source)}`" if source else "no checkpoint file recorded"


def scan_shares(settings: Dict):
    """``name -> share of sparse layers that scan`` for this run's model and ``--profile``."""
    layers = settings.get("model", {}).get("full_attention_layers")
    profile = settings.get("profile") or {}
    return lambda name: scan_share(name, layers, profile.get("scanning_layers"))


def markdown_report(
    grid: GridResult, selector_order: Sequence[str], verdicts: Sequence[Verdict], settings: Dict
) -> str:
    out: List[str] = ["# Topology KV quality", ""]
    model = settings["model"]
    out.append(
        f"Model `{Path(model['gguf_path']).name}` (sha256 {model['gguf_sha256'][:12]}), "
        f"{model['num_hidden_layers']} layers, {model['num_attention_heads']} q / "
        f"{model['num_key_value_heads']} kv heads; sparse layers {len(model['full_attention_layers'])}. "
        f"Text: {settings['text']['novel']}"
        + (f" (file {settings['text']['file']}, sha256 {settings['text']['sha256']})"
           if settings['text'].get('file') else "")
        + f", windows {settings['text']['windows']}"
        + (" per novel" if len(settings['text'].get('novels') or ()) > 1 else "")
        + f". torch {settings['versions']['torch']}."
    )
    out += ["", "## Gate", ""]
    if verdicts:
        out += ["| mode | verdict | check | result | numbers |", "|---|---|---|---|---|"]
    else:
        out.append(NO_POLICY_MODE)
    for v in verdicts:
        for i, c in enumerate(v.checks):
            mode, status = (v.mode, v.status) if i == 0 else ("", "")
            out.append(f"| {mode} | {status} | {c.name} | {check_mark(c.passed)} | {c.detail} |")
    out += ["", *interval_table(grid, selector_order, settings)]
    iso = iso_quality_markdown(iso_quality(grid, selector_order, scans=scan_shares(settings)))
    if iso:
        out += ["", *iso]
    probe = getattr(grid, "probe", None)
    if probe is not None:
        from benchmark.quality.probe import probe_markdown

        out += ["", *probe_markdown(probe, selector_order)]
    out += [
        "",
        "## Results",
        "",
        "Perplexity over the whole window and over the positions whose causal length exceeds W "
        "(\"sparse rows\"); per-layer metrics over sparse rows against dense attention of the same "
        "layer input, averaged across full-attention layers: recall = head-averaged attention mass "
        "kept (p5: mean of per-layer 5th percentiles; worst p5: the lowest layer's); cos diff = "
        "1 - 2<a,b>/(|a|^2+|b|^2) of the layer's attention output; top-1 = share of heads whose "
        f"dense argmax key is kept; sink = share of the first {settings['selector_settings']['sink_tokens']} "
        "positions kept. `learned` is the trained indexer "
        f"({_trained_source(settings['selector_settings'])}); `proxy` (DSA's form "
        "sum_h w_h relu(q_h.k) on the model's own post-RoPE q/k, uniform w_h, fp8-e4m3 round trip), "
        "`proxy-pca` (the same on 1 x 64 principal directions) and `proxy-lowrank` (on a few "
        "random dimensions) are untrained null models whose scores are mostly clipped to zero, "
        "their rows largely decided by the engine's tie rule; policy modes run the real "
        "`apply_topology_kv_policy` on the `learned` rows.",
        "",
        "| ctx | budget | W | selector | ppl | ratio | ratio (sparse rows) | recall | recall p5 | worst p5 "
        "| cos diff | top-1 | sink | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ctx, d in sorted(grid.dense.items()):
        out.append(f"| {ctx} | dense | - | dense | {_f(d.ppl)} | 1.000 | 1.000 | | | | | | | {_f(d.seconds, 1)} |")
    for cell in sorted_cells(grid, selector_order):
        s = cell_summary(grid, cell)
        L = s["layers"]
        out.append(
            f"| {s['context']} | {s['budget']} | {s['width']} | {s['selector']} | {_f(s['ppl'])} | "
            f"{_f(s['ppl_ratio'], 4)} | {_f(s['ppl_sparse_rows_ratio'], 4)} | {_f(L.get('recall_mean'))} | "
            f"{_f(L.get('recall_p5'))} | {_f(L.get('recall_p5_min'))} | {_f(L.get('cos_diff_mean'), 4)} | "
            f"{_f(L.get('top1_mean'))} | {_f(L.get('sink_mean'))} | {_f(s['seconds'], 1)} |"
        )
    out += ["", *timing_table(grid, selector_order)]
    return "\n".join(out) + "\n"


def timing_table(grid: GridResult, selector_order: Sequence[str]) -> List[str]:
    """Seconds per forward, per cell, split by stage (``seconds_per_forward`` in results.json)."""
    out = ["## Where the time goes", "",
           "Wall seconds per forward (one text window), the sparse stages summed over the sparse "
           "layers: selector (the selector's rows), row check (the engine-convention check), "
           "attention (selection masks and sparse attention), metrics (the dense comparison at the "
           "metric stride); rest = everything else (the other layers' work, the loss). The dense "
           "forward runs the model's own attention.", "",
           "| ctx | budget | selector | total | selector | row check | attention | metrics | rest |",
           "|---|---|---|---|---|---|---|---|---|"]
    for ctx, d in sorted(grid.dense.items()):
        per = d.seconds / max(len(d.window_nll), 1)
        out.append(f"| {ctx} | - | dense | {_f(per, 1)} | | | | | |")
    for cell in sorted_cells(grid, selector_order):
        t = stage_breakdown(cell)
        out.append(f"| {cell.context} | {cell.budget} | {cell.selector} | {_f(t['total'], 1)} | "
                   f"{_f(t['selector'], 1)} | {_f(t['row_check'], 1)} | {_f(t['attention'], 1)} | "
                   f"{_f(t['metrics'], 1)} | {_f(t['rest'], 1)} |")
    return out


def interval_table(grid: GridResult, selector_order: Sequence[str], settings: Dict) -> List[str]:
    """Perplexity ratios to dense and to ``learned`` with their bootstrap intervals."""
    b = grid.bootstrap
    out = ["## Perplexity ratios with 95% intervals", "",
           f"Paired chunk bootstrap ({b.samples} replicates; resampling unit: {b.chunk} consecutive tokens "
           f"of one window; {settings['text']['windows']} window(s) per context"
           f"{' per novel' if len(settings['text'].get('novels') or ()) > 1 else ''}; docs/quality.md).", "",
           "| ctx | budget | selector | ppl / dense [95% CI] | ppl / learned [95% CI] |", "|---|---|---|---|---|"]
    for cell in sorted_cells(grid, selector_order):
        vd = grid.interval(cell.context, cell.budget, cell.selector)
        vl = grid.interval(cell.context, cell.budget, cell.selector, "learned")
        out.append(f"| {cell.context} | {cell.budget} | {cell.selector} | {vd.describe()} | "
                   f"{'-' if vl is None or cell.selector == 'learned' else vl.describe()} |")
    return out


def json_report(grid: GridResult, selector_order: Sequence[str], verdicts: Sequence[Verdict], settings: Dict) -> Dict:
    return {
        "settings": settings,
        "dense": {
            str(ctx): {
                "ppl": d.ppl,
                "tokens": d.tokens,
                "seconds": d.seconds,
                "ppl_sparse_rows": {str(w): d.sparse_ppl(w) for w in sorted(d.nll_after)},
            }
            for ctx, d in sorted(grid.dense.items())
        },
        "windows": {str(ctx): [w.describe() for w in ws] for ctx, ws in grid.windows.items()},
        "probe": None if getattr(grid, "probe", None) is None else grid.probe.to_json(),
        "cells": [cell_summary(grid, c) for c in sorted_cells(grid, selector_order)],
        "iso_quality": iso_quality_json(iso_quality(grid, selector_order, scans=scan_shares(settings))),
        "gate": [
            {"mode": v.mode, "status": v.status,
             "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in v.checks]}
            for v in verdicts
        ],
    }


def write_plots(grid: GridResult, selector_order: Sequence[str], out_dir: Path) -> List[Path]:
    """``ppl_ratio_vs_budget.png`` and ``recall_per_layer_ctx<C>.png`` (one panel per budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    contexts = sorted(grid.dense)
    # Top row: every selector (log scale); bottom row: zoom on the band the gate judges.
    fig, axes = plt.subplots(2, len(contexts), figsize=(6 * len(contexts), 8), squeeze=False)
    for col, ctx in enumerate(contexts):
        for row, ax in enumerate(axes[:, col]):
            for name in selector_order:
                cells = sorted((c for c in grid.cells if c.context == ctx and c.selector == name),
                               key=lambda c: c.budget)
                if cells:
                    ax.plot([float(c.budget) for c in cells], [c.ppl / grid.dense[ctx].ppl for c in cells],
                            marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xlabel("budget (fraction of context)")
            ax.grid(True, which="both", alpha=0.3)
            if row == 0:
                ax.set_yscale("log")
                ax.set_ylabel("perplexity / dense")
                ax.set_title(f"context {ctx}")
                ax.legend(fontsize=7)
            else:
                lowest = min((c.ppl / grid.dense[ctx].ppl for c in grid.cells if c.context == ctx), default=1.0)
                ax.set_ylim(min(0.99, lowest - 0.005), 1.10)
                ax.set_ylabel("perplexity / dense (zoom)")
    fig.tight_layout()
    path = out_dir / "ppl_ratio_vs_budget.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    for ctx in contexts:
        budgets = sorted({c.budget for c in grid.cells if c.context == ctx})
        fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 4), squeeze=False, sharey=True)
        for ax, b in zip(axes[0], budgets):
            for name in selector_order:
                cell = grid.cell(ctx, b, name)
                if cell is None:
                    continue
                per_layer = cell.metrics.layer_summary()
                layers = sorted(per_layer)
                ax.plot(layers, [per_layer[i]["recall_mean"] for i in layers], marker=".", label=name)
            ax.set_title(f"ctx {ctx}, budget {b}")
            ax.set_xlabel("layer")
            ax.set_ylim(0, 1.02)
            ax.grid(True, alpha=0.3)
        axes[0][0].set_ylabel("attention-mass recall (mean)")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"recall_per_layer_ctx{ctx}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_outputs(grid, selector_order, verdicts, settings, out_dir: Path, plots: bool = True) -> Dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "report.md", "json": out_dir / "results.json"}
    paths["markdown"].write_text(markdown_report(grid, selector_order, verdicts, settings))
    paths["json"].write_text(json.dumps(json_report(grid, selector_order, verdicts, settings), indent=2, default=str))
    if plots:
        for p in write_plots(grid, selector_order, out_dir):
            paths[p.stem] = p
    return paths
