"""The grid: per context and text window, one dense forward, then one sparse forward per
(budget, selector), with perplexity and per-layer metrics.

Cost is one forward per grid cell (SmolLM2 at 2k tokens on 2 cores: 5 s dense through
SDPA, 10-16 s sparse with the selector and the metric pass), so the grid size sets the
run time.
"""

from __future__ import annotations

import dataclasses
import time
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmark.quality.intervals import BootstrapSettings, Interval, ratio_interval
from benchmark.quality.layer import DEFAULT_QUERY_CHUNK
from benchmark.quality.metrics import LayerMetrics, perplexity, summarize_layers, token_nll
from benchmark.quality.model import LoadedModel
from benchmark.quality.policy_selectors import PolicySettings
from benchmark.quality.selector_base import SelectorSettings
from benchmark.quality.selectors import make_selector, select_all
from benchmark.quality.sparse_attention import PLAN_KWARG, SparsePlan
from benchmark.quality.text import TextWindow


@dataclasses.dataclass(frozen=True)
class GridSettings:
    """What to run. ``budgets`` are fractions of the context; ``W = floor(context * f)``."""

    contexts: Tuple[int, ...]
    budgets: Tuple[Fraction, ...]
    selectors: Tuple[str, ...]
    selector_settings: SelectorSettings = SelectorSettings()
    policy_settings: PolicySettings = PolicySettings()
    query_chunk: int = DEFAULT_QUERY_CHUNK
    logits_chunk: int = 1024
    metric_sink_tokens: int = 4  # sink retention counts the first 4 positions (docs/quality.md)
    # Measure per-layer metrics on every n-th query row; None = :func:`auto_metric_stride`.
    metric_stride: Optional[int] = 1
    bootstrap: BootstrapSettings = BootstrapSettings()
    # A loaded TopologyKVProfile for the "profile" selector (docs/profile.md), or None.
    profile: Optional[object] = None

    def stride_for(self, context: int) -> int:
        """The metric stride at ``context`` tokens."""
        return auto_metric_stride(context) if self.metric_stride is None else self.metric_stride


# Rows measured per window under the automatic metric stride: 512 (every 4th row at 2k, the
# default before it scaled; every 16th at 8k), so the metric pass costs the same share of a
# forward at every context instead of growing with it (docs/quality.md, "Cost of a sparse forward").
AUTO_METRIC_ROWS = 512


def auto_metric_stride(context: int) -> int:
    """``max(1, context // 512)``: 4 at 2048 tokens, 16 at 8192."""
    return max(1, context // AUTO_METRIC_ROWS)


def budget_width(context: int, fraction: Fraction) -> int:
    return max(1, int(context * fraction))


@dataclasses.dataclass
class CellResult:
    """One (context, budget, selector) cell, summed over its text windows."""

    context: int
    budget: Fraction
    width: int
    selector: str
    nll_sum: float = 0.0
    tokens: int = 0
    sparse_nll_sum: float = 0.0  # positions whose causal length exceeds W
    sparse_tokens: int = 0
    seconds: float = 0.0
    # Wall seconds per sparse-layer stage (sparse_attention.STAGES), summed over the windows.
    stage_seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    metrics: LayerMetrics = dataclasses.field(default_factory=LayerMetrics)
    selector_stats: Dict[str, float] = dataclasses.field(default_factory=dict)
    sparse_layers: Tuple[int, ...] = ()
    # fp64 per-token NLL of each window, in window order (for the bootstrap intervals)
    window_nll: List[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def ppl(self) -> float:
        return perplexity(torch.tensor([self.nll_sum / max(self.tokens, 1)]))

    @property
    def sparse_ppl(self) -> float:
        if self.sparse_tokens == 0:
            return float("nan")
        return perplexity(torch.tensor([self.sparse_nll_sum / self.sparse_tokens]))


@dataclasses.dataclass
class DenseResult:
    """The dense reference of one context, with per-budget sparse-row sums."""

    context: int
    nll_sum: float = 0.0
    tokens: int = 0
    nll_after: Dict[int, Tuple[float, int]] = dataclasses.field(default_factory=dict)  # W -> (sum, count)
    seconds: float = 0.0
    window_nll: List[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def ppl(self) -> float:
        return perplexity(torch.tensor([self.nll_sum / max(self.tokens, 1)]))

    def sparse_ppl(self, width: int) -> float:
        total, count = self.nll_after.get(width, (0.0, 0))
        return float("nan") if count == 0 else perplexity(torch.tensor([total / count]))


@dataclasses.dataclass
class GridResult:
    dense: Dict[int, DenseResult]
    cells: List[CellResult]
    windows: Dict[int, List[TextWindow]]
    bootstrap: BootstrapSettings = BootstrapSettings()
    probe: Optional[object] = None  # benchmark.quality.probe.ProbeResult when the copy probe ran

    def cell(self, context: int, budget: Fraction, selector: str) -> Optional[CellResult]:
        for c in self.cells:
            if c.context == context and c.budget == budget and c.selector == selector:
                return c
        return None

    def ppl_ratio(self, context: int, budget: Fraction, selector: str) -> Optional[float]:
        c = self.cell(context, budget, selector)
        return None if c is None else c.ppl / self.dense[context].ppl

    def interval(self, context: int, budget: Fraction, selector: str, reference: str = "dense") -> Optional[Interval]:
        """``ppl(selector) / ppl(reference)`` with its bootstrap interval (:mod:`benchmark.quality.intervals`).

        reference : ``"dense"`` or another selector's name. None when either was not run.
        """
        c = self.cell(context, budget, selector)
        ref = self.dense.get(context) if reference == "dense" else self.cell(context, budget, reference)
        if c is None or ref is None:
            return None
        return ratio_interval(c.window_nll, ref.window_nll, self.bootstrap, point=c.ppl / ref.ppl)


# At most this many fp32 logits per lm_head call (256 MB): a 262k vocabulary gets 256-row
# chunks whatever --logits-chunk says; SmolLM2's 49k keeps the 1024 default.
MAX_LOGITS_ELEMENTS = 1 << 26


def logits_rows(logits_chunk: int, vocab_size: int) -> int:
    """Rows per ``lm_head`` call: ``logits_chunk``, capped so one call holds <= 256 MB of logits."""
    return max(1, min(logits_chunk, MAX_LOGITS_ELEMENTS // max(vocab_size, 1)))


def window_nll(lm: LoadedModel, window: TextWindow, plan: Optional[SparsePlan], logits_chunk: int) -> torch.Tensor:
    """fp64 ``[T - 1]``: NLL of token ``t + 1`` given tokens ``0..t``, under ``plan`` (None = dense)."""
    ids = torch.tensor([window.token_ids], dtype=torch.int64)  # [1, T]
    kwargs = {} if plan is None else {PLAN_KWARG: plan}
    with torch.inference_mode():
        hidden = lm.model.base_model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state[0]  # [T, C]
        softcap = getattr(lm.model.config, "final_logit_softcapping", None)
        head = lm.model.get_output_embeddings()
        rows = logits_rows(logits_chunk, head.weight.shape[0])
        return token_nll(hidden[:-1], head, ids[0, 1:], rows, softcap)


# Select-all runs query chunks with a scattered boolean mask, dense runs SDPA's causal path;
# on SmolLM2 (30 layers, fp32, 512 tokens) their logits differ by 5e-5.
SELF_CHECK_TOL = dict(atol=2e-4, rtol=1e-4)


def select_all_self_check(lm: LoadedModel, window: TextWindow, tokens: int = 512) -> float:
    """Assert that selecting every causal key reproduces the dense logits; return max |diff|.

    Runs on the first ``tokens`` tokens of ``window`` before the grid: if the hook ever
    stopped matching the model's own attention, every number after it would be wrong.
    """
    ids = torch.tensor([window.token_ids[:tokens]], dtype=torch.int64)  # [1, T]
    plan = SparsePlan(select_all, ids.shape[1], frozenset(lm.full_attention_layers))
    with torch.inference_mode():
        dense = lm.model(input_ids=ids, use_cache=False).logits[0]
        sparse = lm.model(input_ids=ids, use_cache=False, **{PLAN_KWARG: plan}).logits[0]
    if sorted(set(plan.sparse_layers)) != sorted(lm.full_attention_layers):
        raise RuntimeError(f"self-check: sparse path ran on layers {sorted(set(plan.sparse_layers))}, "
                           f"expected {list(lm.full_attention_layers)}")
    torch.testing.assert_close(sparse, dense, **SELF_CHECK_TOL, msg="self-check: select-all != dense logits")
    return float((sparse - dense).abs().max())


def window_hidden(lm: LoadedModel, window: TextWindow, plan: Optional[SparsePlan]) -> torch.Tensor:
    """``[T, C]`` final hidden states of ``window`` under ``plan`` (None = dense)."""
    ids = torch.tensor([window.token_ids], dtype=torch.int64)
    kwargs = {} if plan is None else {PLAN_KWARG: plan}
    with torch.inference_mode():
        return lm.model.base_model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state[0]


def _probe_forward(lm: LoadedModel, probe, plan: Optional[SparsePlan]):
    from benchmark.quality.probe import probe_scores

    hidden = window_hidden(lm, probe.window, plan)
    softcap = getattr(lm.model.config, "final_logit_softcapping", None)
    with torch.inference_mode():
        return probe_scores(hidden, lm.model.get_output_embeddings(), probe, softcap)


def _layer_progress(bar, label: str, layers: int):
    """``on_layer`` callback: the bar's postfix names the layer a long forward is at."""
    done = []

    def on_layer(layer_idx: int) -> None:
        done.append(layer_idx)
        bar.set_postfix_str(f"{label} layer {len(done)}/{layers}")

    return on_layer


def run_grid(
    lm: LoadedModel,
    windows: Dict[int, List[TextWindow]],
    settings: GridSettings,
    progress: bool = True,
    probes: Optional[Dict[int, list]] = None,
    probe_settings=None,
) -> GridResult:
    """Run every cell; ``windows`` maps each context to its text windows.

    probes : context -> :class:`~benchmark.quality.probe.ProbeWindow` list: the copy probe
        runs each of them dense and under every (budget, selector), without metrics.
    """
    from benchmark.progress import progress_bar

    selectors = {
        n: make_selector(n, settings.selector_settings, settings.policy_settings, profile=settings.profile)
        for n in settings.selectors
    }
    full_layers = frozenset(lm.full_attention_layers)
    probes = probes or {}
    total = sum(len(w) * (1 + len(settings.budgets) * len(selectors)) for w in windows.values())
    total += sum(len(probes.get(c, ())) * (1 + len(settings.budgets) * len(selectors)) for c in windows)
    bar = progress_bar(total, "quality grid", "fwd", progress)
    dense: Dict[int, DenseResult] = {}
    cells: Dict[Tuple[int, Fraction, str], CellResult] = {}
    for context in settings.contexts:
        d = dense[context] = DenseResult(context)
        for window in windows[context]:
            bar.set_postfix_str(f"ctx {context} dense")
            start = time.perf_counter()
            nll = window_nll(lm, window, None, settings.logits_chunk)
            d.seconds += time.perf_counter() - start
            d.nll_sum += float(nll.sum())
            d.tokens += nll.numel()
            d.window_nll.append(nll.detach().to(torch.float64).cpu())
            bar.update()
            for budget in settings.budgets:
                width = budget_width(context, budget)
                s, n = d.nll_after.get(width, (0.0, 0))
                d.nll_after[width] = (s + float(nll[width:].sum()), n + nll[width:].numel())
                for name, selector in selectors.items():
                    bar.set_postfix_str(f"ctx {context} W {width} {name}")
                    cell = cells.setdefault((context, budget, name), CellResult(context, budget, width, name))
                    plan = SparsePlan(
                        selector=selector,
                        width=width,
                        full_attention_layers=full_layers,
                        metrics=cell.metrics,
                        query_chunk=settings.query_chunk,
                        sink_tokens=settings.metric_sink_tokens,
                        metric_stride=settings.stride_for(context),
                        on_layer=_layer_progress(bar, f"ctx {context} W {width} {name}", len(full_layers)),
                    )
                    start = time.perf_counter()
                    nll_sparse = window_nll(lm, window, plan, settings.logits_chunk)
                    cell.seconds += time.perf_counter() - start
                    cell.nll_sum += float(nll_sparse.sum())
                    cell.tokens += nll_sparse.numel()
                    cell.sparse_nll_sum += float(nll_sparse[width:].sum())
                    cell.sparse_tokens += nll_sparse[width:].numel()
                    cell.window_nll.append(nll_sparse.detach().to(torch.float64).cpu())
                    cell.sparse_layers = tuple(sorted(set(plan.sparse_layers)))
                    for stage, value in plan.stage_seconds.items():
                        cell.stage_seconds[stage] = cell.stage_seconds.get(stage, 0.0) + value
                    for stats in plan.selector_stats.values():
                        for key, value in stats.items():
                            cell.selector_stats[key] = cell.selector_stats.get(key, 0) + value
                    bar.update()
    probe_result = None
    if probes:
        from benchmark.quality.probe import ProbeCell, ProbeResult, ProbeSettings

        probe_result = ProbeResult(probe_settings or ProbeSettings(), {}, {}, {}, {})
        for context in settings.contexts:
            for pw in probes.get(context, ()):
                k = len(pw.segments)
                probe_result.distances[context] = pw.distances
                probe_result.windows.setdefault(context, []).append(pw)
                bar.set_postfix_str(f"ctx {context} probe dense")
                d = probe_result.dense.setdefault(context, ProbeCell.empty(k))
                start = time.perf_counter()
                d.add(_probe_forward(lm, pw, None))
                d.seconds += time.perf_counter() - start
                bar.update()
                for budget in settings.budgets:
                    width = budget_width(context, budget)
                    for name, selector in selectors.items():
                        bar.set_postfix_str(f"ctx {context} probe W {width} {name}")
                        cell = probe_result.cells.setdefault((context, budget, name), ProbeCell.empty(k))
                        plan = SparsePlan(selector=selector, width=width, full_attention_layers=full_layers,
                                          query_chunk=settings.query_chunk)
                        start = time.perf_counter()
                        cell.add(_probe_forward(lm, pw, plan))
                        cell.seconds += time.perf_counter() - start
                        bar.update()
    bar.close()
    return GridResult(dense=dense, cells=list(cells.values()), windows=windows, bootstrap=settings.bootstrap,
                      probe=probe_result)


def cell_summary(grid: GridResult, cell: CellResult) -> Dict[str, object]:
    """Every figure of one cell, JSON-ready."""
    d = grid.dense[cell.context]
    per_layer = cell.metrics.layer_summary()
    vs_dense = grid.interval(cell.context, cell.budget, cell.selector)
    vs_learned = grid.interval(cell.context, cell.budget, cell.selector, "learned")
    return {
        "context": cell.context,
        "budget": str(cell.budget),
        "budget_fraction": float(cell.budget),
        "width": cell.width,
        "selector": cell.selector,
        "ppl": cell.ppl,
        "ppl_dense": d.ppl,
        "ppl_ratio": cell.ppl / d.ppl,
        "ppl_ratio_ci": [vs_dense.lo, vs_dense.hi],
        "ppl_ratio_vs_learned": None if vs_learned is None else vs_learned.to_json(),
        "windows": len(cell.window_nll),
        "ppl_sparse_rows": cell.sparse_ppl,
        "ppl_sparse_rows_dense": d.sparse_ppl(cell.width),
        "ppl_sparse_rows_ratio": cell.sparse_ppl / d.sparse_ppl(cell.width),
        "tokens": cell.tokens,
        "sparse_row_tokens": cell.sparse_tokens,
        "seconds": cell.seconds,
        "seconds_per_forward": stage_breakdown(cell),
        "layers": summarize_layers(per_layer),
        "per_layer": {str(k): v for k, v in per_layer.items()},
        "sparse_layers": list(cell.sparse_layers),
        "selector_stats": cell.selector_stats,
    }


def stage_breakdown(cell: CellResult) -> Dict[str, float]:
    """Seconds per sparse forward: ``total``, each stage of :data:`~benchmark.quality.sparse_attention.STAGES`
    (summed over the sparse layers), and ``rest`` (everything else: the model's other
    layers and projections, the loss)."""
    from benchmark.quality.sparse_attention import STAGES

    forwards = max(len(cell.window_nll), 1)
    out = {"total": cell.seconds / forwards}
    out.update({stage: cell.stage_seconds.get(stage, 0.0) / forwards for stage in STAGES})
    out["rest"] = out["total"] - sum(out[stage] for stage in STAGES)
    return out


def sorted_cells(grid: GridResult, selector_order: Sequence[str]) -> List[CellResult]:
    order = {n: i for i, n in enumerate(selector_order)}
    return sorted(grid.cells, key=lambda c: (c.context, c.budget, order.get(c.selector, len(order))))
