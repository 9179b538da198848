"""Offline calibration of per-layer structural budgets (``benchmark/topology_kv_calibrate.py``).

For each full-attention layer, each budget ``W = context * b`` and each candidate, how far
that layer's attention output lies from dense attention of the *same* layer input. Inputs
are teacher-forced: one dense forward per text window, every layer measured on the dense
model's own inputs, so one forward serves every candidate (no sparse forward at all).

Candidates, per policy mode (:attr:`CalibrationSettings.policy`):

* ``topology_sparse_merge``: a structural share of ``W`` and a set of components (sink
  tokens, local blocks, witness blocks) over the proxy indexer's rows; the baseline is
  share 0 (the learned rows as they are).
* ``topology_only``: the whole row is structure (share 1); the candidates are sink-token
  counts (:attr:`CalibrationSettings.sink_options`), the rest of the row the newest tokens
  (local blocks and, with the serving default ``recency``, witnesses newest first). The
  baseline is the engine's default sink count, which is plain ``locality`` (the harness's
  null model, bit for bit).

Error: the harness's output error (``cos_diff``, :func:`~benchmark.quality.sparse_attention.
sparse_layer_attention`), averaged over the measured rows (rows longer than ``W``, every
``metric_stride``-th), then over windows and contexts (each context weighs the same).
Recall is recorded beside it. :func:`candidate_errors` computes the dense logits of a
chunk once and reuses them for every candidate; the tests pin it to
``sparse_layer_attention``'s metrics.

Choice: per layer and budget the candidate of least error, kept only if it beats the
baseline by ``margin`` (relative; default 5%): a change must earn its place, so a layer is
never calibrated worse than the learned indexer (merge) or than locality (topology_only).

Guard (:func:`guard_profile`): the per-layer error is a proxy for the model's loss (on
SmolLM2, 64 sink tokens cut ``topology_only``'s output error by half in layers 3-10 and
still raised perplexity on another text). So, per budget, the chosen entries run together
inside the model's forward on the calibration windows, against the baseline selector
(``learned`` or ``locality``); they are kept only if the upper bound of the 95% interval of
``ppl(profile) / ppl(baseline)`` is below 1 in every calibrated context. Otherwise that
budget's entries all return to the baseline. The verdicts go into ``settings.guard``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmark.quality.index_rows import dense_rows, rows_to_mask
from benchmark.quality.layer import DEFAULT_QUERY_CHUNK, LayerInputs, masked_softmax
from benchmark.quality.metrics import attention_recall, measured_rows, output_cos_diff
from benchmark.quality.model import LoadedModel
from benchmark.quality.paths import shown_path
from benchmark.quality.policy_selectors import PolicySettings, make_policy_selector
from benchmark.quality.scan_choice import pick_scanning
from benchmark.quality.selector_base import SelectorSettings, learned_rows_and_scores
from benchmark.quality.sparse_attention import PLAN_KWARG, SparsePlan
from benchmark.quality.text import TextWindow
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    SERVED_WITNESS_SIGNALS,
    TopologyKVPolicyConfig,
    WitnessSignal,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.profile import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    LayerBudgetSetting,
    ModelFingerprint,
    budget_key,
)

MODE = "topology_sparse_merge"
ONLY = "topology_only"
POLICIES = (MODE, ONLY)
# topology_only: sink-token counts tried per layer (the engine's default 4 is the baseline).
DEFAULT_SINK_OPTIONS = (0, 1, 4, 16, 64)
COMPONENTS = ("sinks", "local", "witnesses")
DEFAULT_SHARES = (Fraction(1, 32), Fraction(1, 16), Fraction(1, 8), Fraction(1, 4))
# Every non-empty set of components: 7 sets, so 1 + 4 x 7 = 29 candidates per layer and budget.
DEFAULT_COMPONENT_SETS = tuple(
    frozenset(c) for n in range(1, len(COMPONENTS) + 1) for c in itertools.combinations(COMPONENTS, n)
)
# Structure must cut the layer's mean output error by 5% to be kept: below that, window
# to window noise of the measurement (a few windows of 2k tokens) could pick it by chance.
DEFAULT_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One structural choice: ``share`` of ``W`` (0: the learned rows as they are) and components.

    ``only_sinks``: a ``topology_only`` candidate with that many sink tokens (share 1, local
    blocks, witnesses fill the rest); None for the merge mode's candidates.
    """

    share: Fraction
    components: frozenset = frozenset()
    only_sinks: Optional[int] = None

    @property
    def name(self) -> str:
        if self.only_sinks is not None:
            return f"sinks={self.only_sinks}"
        if self.share == 0:
            return "learned"
        return f"{budget_key(self.share)}:{'+'.join(c for c in COMPONENTS if c in self.components)}"

    def setting(self, sink_tokens: int, local_blocks: int, witness_blocks: int) -> LayerBudgetSetting:
        if self.only_sinks is not None:  # witness_blocks: topology_only fills the row with witnesses anyway
            return LayerBudgetSetting(1.0, self.only_sinks, local_blocks, 0)
        if self.share == 0:
            return LayerBudgetSetting(0.0, 0, 0, 0)
        on = self.components
        return LayerBudgetSetting(
            float(self.share),
            sink_tokens if "sinks" in on else 0,
            local_blocks if "local" in on else 0,
            witness_blocks if "witnesses" in on else 0,
        )


def parse_components(text: str) -> Tuple[frozenset, ...]:
    """``"sinks,local+witnesses"`` -> component sets; ``"all"`` = :data:`DEFAULT_COMPONENT_SETS`."""
    if text.strip().lower() == "all":
        return DEFAULT_COMPONENT_SETS
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = frozenset(p.strip().lower() for p in item.split("+"))
        unknown = sorted(parts - set(COMPONENTS))
        if unknown or not parts:
            raise ValueError(f"--components: expected sets of {list(COMPONENTS)} joined by '+', got {item!r}")
        out.append(parts)
    if not out:
        raise ValueError(f"--components: expected at least one set, got {text!r}")
    return tuple(dict.fromkeys(out))


_ENGINE = TopologyKVPolicyConfig()  # the engine's defaults, the components' sizes


def _served_signal_names() -> str:
    """``key_drift, recency or query_group_mass``: the served signals besides ``auto``."""
    names = [sig.value for sig in SERVED_WITNESS_SIGNALS if sig is not WitnessSignal.AUTO]
    return ", ".join(names[:-1]) + " or " + names[-1]


@dataclasses.dataclass(frozen=True)
class CalibrationSettings:
    """What to try. Component sizes default to the engine's (``TopologyKVPolicyConfig``'s).

    policy : ``topology_sparse_merge`` (shares x component sets) or ``topology_only``
        (``sink_options``; baseline ``sink_tokens``, i.e. locality)
    witness_signal : ``default`` (serving's ``auto``: key drift for the merge mode, recency
        for topology_only), ``key_drift`` or ``recency``: what serving can compute
    scan : how many sparse layers run the indexer when the others share it (the model-level
        budget "scan K of N"; None: no scanning set). The calibration then also measures what
        each layer loses by reusing the learned rows of every sparse layer below it and writes
        the scanning set into the profile's ``indexer_share`` (merge modes only;
        :func:`choose_scanning`)
    harness_signals : also accept the witness signals only the harness computes (the
        query-aware ones): for measurements that write no profile (``--shared-structure``)
    """

    contexts: Tuple[int, ...]
    budgets: Tuple[Fraction, ...]
    shares: Tuple[Fraction, ...] = DEFAULT_SHARES
    component_sets: Tuple[frozenset, ...] = DEFAULT_COMPONENT_SETS
    block_size: int = _ENGINE.block_size
    sink_tokens: int = _ENGINE.sink_tokens
    local_blocks: int = _ENGINE.local_blocks
    witness_blocks: int = _ENGINE.witness_blocks
    margin: float = DEFAULT_MARGIN
    metric_stride: int = 4
    query_chunk: int = DEFAULT_QUERY_CHUNK
    selector_settings: SelectorSettings = SelectorSettings()
    witness_signal: str = "default"
    policy: str = MODE
    sink_options: Tuple[int, ...] = DEFAULT_SINK_OPTIONS
    scan: Optional[int] = None
    harness_signals: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {list(POLICIES)}, got {self.policy!r}")
        if self.scan is not None:
            if isinstance(self.scan, bool) or not isinstance(self.scan, int) or self.scan < 1:
                raise ValueError(f"scan: expected an int >= 1 (scanning layers), got {self.scan!r}")
            if self.policy == ONLY:
                raise ValueError("scan: expected no scanning set for topology_only (it replaces the rows a sharing "
                                 "layer would reuse)")
        try:
            signal = WitnessSignal.parse(self.witness_signal)
        except ValueError:
            signal = None
        if signal is None or not (signal.served or self.harness_signals):
            raise ValueError(
                f"witness_signal: expected default, {_served_signal_names()} (what serving computes"
                f"{'; or a harness-only signal' if self.harness_signals else ''}), got {self.witness_signal!r}"
            )
        if not self.sink_options or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                        for n in self.sink_options):
            raise ValueError(f"sink_options: expected a non-empty list of integers >= 0, got {list(self.sink_options)}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin: expected a number in [0, 1), got {self.margin}")
        if self.metric_stride < 1:
            raise ValueError(f"metric_stride: expected >= 1, got {self.metric_stride}")
        for s in self.shares:
            if not 0 < s <= 1:
                raise ValueError(f"shares: expected fractions in (0, 1], got {s}")
        for c in self.contexts:
            for b in self.budgets:
                if int(c * b) < 1:
                    raise ValueError(f"budgets: {budget_key(b)} of context {c} is less than one token")

    def candidates(self) -> List[Candidate]:
        """The baseline first (share 0, or locality's sink count for topology_only), then the rest."""
        if self.policy == ONLY:
            counts = [self.sink_tokens] + sorted(set(self.sink_options) - {self.sink_tokens})
            return [Candidate(Fraction(1), only_sinks=n) for n in counts]
        out = [Candidate(Fraction(0))]
        out += [Candidate(s, c) for s in sorted(set(self.shares)) for c in self.component_sets]
        return out

    @property
    def resolved_witness_signal(self) -> str:
        """``key_drift`` or ``recency``: what the profile records and serving must match."""
        return WitnessSignal.parse(self.witness_signal).resolve(self.policy).value

    def policy_settings(self, cand: Candidate) -> PolicySettings:
        s = cand.setting(self.sink_tokens, self.local_blocks, self.witness_blocks)
        return PolicySettings(
            sink_blocks=0,
            local_blocks=s.local_blocks,
            witness_blocks=s.witness_blocks,
            block_size=self.block_size,
            max_structural_fraction=s.max_structural_fraction,
            sink_tokens=s.sink_tokens,
            witness_signal=self.resolved_witness_signal,
        )


def candidate_errors(
    layer: LayerInputs, rows_by_candidate: Dict[str, torch.Tensor], width: int, metric_stride: int = 1
) -> Dict[str, Tuple[float, float, int]]:
    """Per candidate: (sum of ``cos_diff``, sum of recall, rows measured) over the layer's measured rows.

    rows_by_candidate : name -> int ``[T, W]`` rows (engine convention). Measured rows are
    :func:`~benchmark.quality.metrics.measured_rows` (as ``sparse_layer_attention``
    measures them); their dense logits are computed once per query chunk and shared by
    every candidate. The metrics are :mod:`benchmark.quality.metrics`' (the harness's).
    """
    sums = {name: [0.0, 0.0, 0] for name in rows_by_candidate}
    masks = {name: rows_to_mask(rows, layer.key_length) for name, rows in rows_by_candidate.items()}  # [T, L]
    for c0, c1, lc in layer.chunks():
        measured = measured_rows(layer.lengths[c0:c1], width, metric_stride, start=c0)
        if not bool(measured.any()):
            continue
        keep = torch.nonzero(measured).squeeze(1)  # harness code: a host sync is fine here
        allowed = layer.allowed_chunk(c0, c1, lc)[keep]  # [Tk, lc]
        q = layer.query[:, c0:c1][:, keep]  # [H, Tk, D]
        logits = layer.query_logits(q, layer.key[:, :lc])  # [H, Tk, lc], kept for every candidate
        p = masked_softmax(logits, allowed)  # [H, Tk, lc]
        a = layer.weighted_values(p).transpose(0, 1).flatten(1)  # [Tk, H*D] dense output
        for name, mask in masks.items():
            sel = mask[c0:c1, :lc][keep] & allowed  # [Tk, lc]
            recall = attention_recall(p, sel)  # [Tk]
            b = layer.weighted_values(masked_softmax(logits, sel)).transpose(0, 1).flatten(1)  # [Tk, H*D] sparse
            cos_diff = output_cos_diff(a, b)
            s = sums[name]
            s[0] += float(cos_diff.sum())
            s[1] += float(recall.sum())
            s[2] += int(keep.numel())
    return {name: (s[0], s[1], s[2]) for name, s in sums.items()}


def candidate_rows(
    layer: LayerInputs, width: int, settings: CalibrationSettings, candidates: Sequence[Candidate]
) -> Dict[str, torch.Tensor]:
    """Rows of every candidate: the proxy's top-W once, then the real policy per candidate.

    ``topology_only`` ignores the learned rows (it replaces them), so it is given the first
    ``W`` causal positions (valid rows by contract) instead of paying for the proxy.
    """
    if settings.policy == ONLY:
        learned = (dense_rows(layer.lengths, width), None)
    else:
        learned = learned_rows_and_scores(layer, width, settings.selector_settings)

    def base_rows(_layer, _width):
        return learned

    out = {}
    for cand in candidates:
        if cand.share == 0:
            out[cand.name] = learned[0]
            continue
        selector = make_policy_selector(settings.policy, settings.selector_settings, settings.policy_settings(cand),
                                        base_rows)
        out[cand.name] = selector(layer, width, {})
    return out


def reuse_name(source: int) -> str:
    """The measured rows of a layer reusing the learned rows of sparse layer ``source`` (a shared scan)."""
    return f"reuse:{source}"


def top_k_overlap(own: torch.Tensor, other: torch.Tensor, layer: LayerInputs) -> Tuple[float, int]:
    """(sum over query rows of ``|own & other| / |own|``, rows): how much of a row's own
    top-k the other layer's rows keep (valid entries only; rows with none are skipped)."""
    mine = rows_to_mask(own, layer.key_length)  # [T, L]
    kept = (mine & rows_to_mask(other, layer.key_length)).sum(1).to(torch.float64)
    size = mine.sum(1).to(torch.float64)
    has = size > 0
    return float((kept[has] / size[has]).sum()), int(has.sum())


@dataclasses.dataclass
class Measurements:
    """``sums[(layer, budget, context, candidate)] = [cos_diff sum, recall sum, rows]``;
    ``overlap[(layer, source, budget, context)] = [top-k overlap sum with the learned rows of
    sparse layer ``source`` below, rows]``."""

    sums: Dict[Tuple[int, Fraction, int, str], List[float]] = dataclasses.field(default_factory=dict)
    overlap: Dict[Tuple[int, int, Fraction, int], List[float]] = dataclasses.field(default_factory=dict)

    def add_overlap(self, layer: int, source: int, budget: Fraction, context: int,
                    values: Tuple[float, int]) -> None:
        s = self.overlap.setdefault((layer, source, budget, context), [0.0, 0])
        s[0] += values[0]
        s[1] += values[1]

    def mean_overlap(self, layer: int, source: int, budget: Fraction, contexts: Sequence[int]) -> float:
        """Each context's mean top-k overlap, then the mean over contexts (NaN: not measured)."""
        per = [self.overlap.get((layer, source, budget, c)) for c in contexts]
        per = [s for s in per if s and s[1]]
        return sum(s[0] / s[1] for s in per) / len(per) if per else float("nan")

    def add(self, layer: int, budget: Fraction, context: int, name: str, values: Tuple[float, float, int]) -> None:
        s = self.sums.setdefault((layer, budget, context, name), [0.0, 0.0, 0])
        for i, v in enumerate(values):
            s[i] += v

    def mean(self, layer: int, budget: Fraction, name: str, contexts: Sequence[int]) -> Tuple[float, float, int]:
        """(mean cos_diff, mean recall, rows): each context's mean, then the mean over contexts."""
        per = [self.sums.get((layer, budget, c, name)) for c in contexts]
        per = [s for s in per if s and s[2]]
        if not per:
            return float("nan"), float("nan"), 0
        return (
            sum(s[0] / s[2] for s in per) / len(per),
            sum(s[1] / s[2] for s in per) / len(per),
            int(sum(s[2] for s in per)),
        )


def teacher_forced_passes(
    lm: LoadedModel,
    windows: Dict[int, List[TextWindow]],
    settings: CalibrationSettings,
    start_window,
    desc: str,
    progress: bool = True,
) -> None:
    """One dense forward per window, every full-attention layer visited on its own dense inputs.

    ``start_window(context, window_index, bar) -> visit(layer)``: called before each window's
    forward; ``visit`` sees each full-attention layer in ascending order (and updates
    ``bar``, sized layers x budgets x windows). The forward itself stays dense.
    """
    from benchmark.progress import progress_bar

    full_layers = frozenset(lm.full_attention_layers)
    total = sum(len(w) for w in windows.values()) * len(full_layers) * len(settings.budgets)
    bar = progress_bar(total, desc, "layer-budget", progress)
    for context in settings.contexts:
        for wi, window in enumerate(windows[context]):
            visit = start_window(context, wi, bar)

            def spy(layer: LayerInputs, width: int, stats) -> torch.Tensor:
                visit(layer)
                return dense_rows(layer.lengths, width)

            plan = SparsePlan(spy, context, full_layers, query_chunk=settings.query_chunk, check_rows=False)
            ids = torch.tensor([window.token_ids], dtype=torch.int64)  # [1, T]
            with torch.inference_mode():
                lm.model.base_model(input_ids=ids, use_cache=False, **{PLAN_KWARG: plan})
    bar.close()


def measure(
    lm: LoadedModel,
    windows: Dict[int, List[TextWindow]],
    settings: CalibrationSettings,
    progress: bool = True,
) -> Measurements:
    """One dense forward per window; every full-attention layer measured on its own dense inputs."""
    candidates = settings.candidates()
    out = Measurements()

    def start_window(context: int, wi: int, bar):
        # budget -> (layer, learned rows) of every sparse layer measured so far (with a scan set)
        below: Dict[Fraction, List[Tuple[int, torch.Tensor]]] = {}

        def visit(layer: LayerInputs) -> None:
            for budget in settings.budgets:
                w = max(1, int(context * budget))
                bar.set_postfix_str(f"ctx {context} win {wi} layer {layer.layer_idx} W {w}")
                rows = candidate_rows(layer, w, settings, candidates)
                own = rows[candidates[0].name]
                if settings.scan is not None:
                    for source, reused in below.get(budget, ()):
                        rows[reuse_name(source)] = reused
                        out.add_overlap(layer.layer_idx, source, budget, context,
                                        top_k_overlap(own, reused, layer))
                    below.setdefault(budget, []).append((layer.layer_idx, own))
                for name, values in candidate_errors(layer, rows, w, settings.metric_stride).items():
                    out.add(layer.layer_idx, budget, context, name, values)
                bar.update()

        return visit

    teacher_forced_passes(lm, windows, settings, start_window, "calibrate", progress)
    return out


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """The chosen candidate of one layer and budget, with the baseline's error beside it.

    The baseline is ``settings.candidates()[0]``: the learned rows (merge) or locality
    (topology_only); ``best_other`` is the least-error candidate besides it.
    """

    candidate: Candidate
    error: float
    baseline: Candidate
    baseline_error: float
    best_other: Optional[Candidate]
    best_other_error: float


def choose(measurements: Measurements, layers: Sequence[int], settings: CalibrationSettings) -> Dict[int, Dict[Fraction, LayerChoice]]:
    """Per layer and budget: the least-error candidate if it beats the baseline by ``margin``, else the baseline."""
    candidates = settings.candidates()
    baseline = candidates[0]
    out: Dict[int, Dict[Fraction, LayerChoice]] = {}
    for layer in layers:
        for budget in settings.budgets:
            base_e = measurements.mean(layer, budget, baseline.name, settings.contexts)[0]
            others = [(measurements.mean(layer, budget, c.name, settings.contexts)[0], c) for c in candidates[1:]]
            others = [(e, c) for e, c in others if e == e]  # drop unmeasured (NaN)
            best_e, best = min(others, key=lambda ec: ec[0], default=(float("nan"), None))
            # No measured row (every row dense at this budget) keeps the baseline.
            keep = best is not None and base_e == base_e and best_e < base_e * (1.0 - settings.margin)
            out.setdefault(layer, {})[budget] = LayerChoice(
                candidate=best if keep else baseline,
                error=best_e if keep else base_e,
                baseline=baseline,
                baseline_error=base_e,
                best_other=best,
                best_other_error=best_e,
            )
    return out


def choose_scanning(measurements: Measurements, layers: Sequence[int], settings: CalibrationSettings) -> Dict[str, object]:
    """The profile's ``indexer_share``: which ``settings.scan`` sparse layers run the indexer.

    The cost of layer ``i`` reusing sparse layer ``j`` below it is
    ``cos_diff(reuse:j) - cos_diff(own learned rows)``, the mean over the calibrated budgets
    (each the mean over contexts), as IndexCache ranks layers by their output loss; the
    set is :func:`~benchmark.quality.scan_choice.pick_scanning`'s least-cost one (each
    sharing layer priced by the scanning layer it actually reuses). The top-k overlaps are
    recorded beside the costs.
    """
    layers = sorted(layers)
    if settings.scan is None:
        raise ValueError("settings.scan: expected the number of scanning layers, got None")
    if settings.scan > len(layers):
        raise ValueError(f"scan: expected at most the {len(layers)} sparse layers, got {settings.scan}")
    baseline = settings.candidates()[0].name
    cost: Dict[int, Dict[int, float]] = {}
    overlap: Dict[int, Dict[int, float]] = {}
    for pos, layer in enumerate(layers):
        for source in layers[:pos]:
            deltas = []
            for b in settings.budgets:
                reused = measurements.mean(layer, b, reuse_name(source), settings.contexts)[0]
                own = measurements.mean(layer, b, baseline, settings.contexts)[0]
                if reused == reused and own == own:
                    deltas.append(reused - own)
            cost.setdefault(layer, {})[source] = sum(deltas) / len(deltas) if deltas else float("nan")
            per = [measurements.mean_overlap(layer, source, b, settings.contexts) for b in settings.budgets]
            per = [v for v in per if v == v]
            overlap.setdefault(layer, {})[source] = sum(per) / len(per) if per else float("nan")
    unmeasured = sorted({x for x, row in cost.items() if any(c != c for c in row.values())})
    if unmeasured:
        raise ValueError(f"scan: layers {unmeasured} have no measured row at any budget (every row dense); "
                         f"calibrate a longer context")
    return pick_scanning(cost, overlap, layers, settings.scan)


def model_fingerprint(lm: LoadedModel) -> ModelFingerprint:
    name = lm.gguf_path.name if lm.gguf_path is not None else type(lm.model).__name__
    return ModelFingerprint(lm.gguf_sha256, name, lm.model.config.num_hidden_layers, tuple(lm.full_attention_layers))


def _indexer_note(settings: CalibrationSettings) -> str:
    """The profile's ``settings.indexer``: which trained indexer the merge rows start from."""
    if settings.policy == ONLY:
        return "none (topology_only replaces the learned rows)"
    source = settings.selector_settings.trained_source
    return (f"trained ({shown_path(source) if source else 'none given'}), fp8 "
            + ("on" if settings.selector_settings.fp8 else "off"))


def build_profile(
    lm: LoadedModel,
    measurements: Measurements,
    choices: Dict[int, Dict[Fraction, LayerChoice]],
    settings: CalibrationSettings,
    *,
    text: Dict[str, str],
    command: str,
    extra_settings: Optional[Dict[str, object]] = None,
) -> Dict[str, object]:
    """The profile JSON (docs/profile.md), with every measurement under ``measurements``."""
    candidates = settings.candidates()
    layers = {}
    measured = {}
    for layer, per_budget in choices.items():
        layers[str(layer)] = {
            budget_key(b): c.candidate.setting(settings.sink_tokens, settings.local_blocks, settings.witness_blocks).to_json()
            for b, c in per_budget.items()
        }
        measured[str(layer)] = {}
        for b, c in per_budget.items():
            cells = {}
            for cand in candidates:
                err, recall, rows = measurements.mean(layer, b, cand.name, settings.contexts)
                per_context = {}
                for ctx in settings.contexts:
                    s = measurements.sums.get((layer, b, ctx, cand.name))
                    per_context[str(ctx)] = None if not s or not s[2] else s[0] / s[2]
                cells[cand.name] = {"cos_diff": err, "recall": recall, "rows": rows, "cos_diff_by_context": per_context}
            measured[str(layer)][budget_key(b)] = {
                "chosen": c.candidate.name,
                "baseline": c.baseline.name,
                "baseline_cos_diff": c.baseline_error,
                "chosen_cos_diff": c.error,
                "best_other": None if c.best_other is None else c.best_other.name,
                "candidates": cells,
            }
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": model_fingerprint(lm).to_json(),
        "text": dict(text),
        "settings": {
            "policy": settings.policy,
            "block_size": settings.block_size,
            "contexts": list(settings.contexts),
            "budgets": [budget_key(b) for b in settings.budgets],
            "candidates": [c.name for c in candidates],
            "baseline": candidates[0].name,
            **({"sink_options": [c.only_sinks for c in candidates]} if settings.policy == ONLY else {
                "shares": ["0"] + [budget_key(s) for s in sorted(set(settings.shares))],
                "components": ["+".join(c for c in COMPONENTS if c in cs) for cs in settings.component_sets]}),
            "component_sizes": {"sink_tokens": settings.sink_tokens, "local_blocks": settings.local_blocks,
                                "witness_blocks": settings.witness_blocks},
            "error": "cos_diff (1 - 2<a,b>/(|a|^2+|b|^2) of the layer's dense and sparse outputs)",
            "margin": settings.margin,
            "metric_stride": settings.metric_stride,
            "witness_signal": settings.resolved_witness_signal,
            "indexer": _indexer_note(settings),
            **(extra_settings or {}),
        },
        "command": command,
        "layers": layers,
        "measurements": measured,
    }


def _kept(profile: Dict[str, object], setting: Dict[str, object]) -> bool:
    """Whether an entry differs from the baseline (structure kept / sinks changed)."""
    if profile["settings"]["policy"] == ONLY:
        return setting["sink_tokens"] != profile["settings"]["component_sizes"]["sink_tokens"]
    return setting["max_structural_fraction"] > 0


def format_table(profile: Dict[str, object]) -> str:
    """Markdown: layers x budgets, the chosen candidate and its error change vs the baseline."""
    budgets = profile["settings"]["budgets"]
    baseline = profile["settings"]["baseline"]
    lines = ["| layer | " + " | ".join(f"W = {b}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for layer in sorted(profile["measurements"], key=int):
        cells = []
        for b in budgets:
            m = profile["measurements"][layer][b]
            base, chosen = m["baseline_cos_diff"], m["chosen_cos_diff"]
            change = "" if m["chosen"] == baseline or not base else f" ({(chosen / base - 1) * 100:+.0f}%)"
            was = m.get("reverted_by_guard")
            if was is not None and was != m["chosen"]:
                change = f" (guard; measured {was})"
            cells.append(f"{m['chosen']}{change}")
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    kept = sum(1 for layer in profile["layers"].values() for s in layer.values() if _kept(profile, s))
    reverted = sorted({b for layer in profile["measurements"].values() for b, m in layer.items()
                       if "reverted_by_guard" in m})
    total = sum(len(layer) for layer in profile["layers"].values())
    what = "the sink count changed" if profile["settings"]["policy"] == ONLY else "structure kept"
    lines.append(f"\n{what} in {kept} of {total} (layer, budget) entries; the rest are the baseline ({baseline}); "
                 "% = output error change vs the baseline")
    if reverted:
        lines.append(f"budgets {', '.join(reverted)}: the guard reverted every entry to the baseline "
                     "(per layer the choice above was measured better; `reverted_by_guard` keeps it)")
    return "\n".join(lines)


def plot_shares(profile: Dict[str, object], path) -> None:
    """Heat map layers x budgets: the structural share kept (merge) or the sink tokens (topology_only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    only = profile["settings"]["policy"] == ONLY
    field = "sink_tokens" if only else "max_structural_fraction"
    budgets = profile["settings"]["budgets"]
    layers = sorted(profile["layers"], key=int)
    grid = [[profile["layers"][l][b][field] for b in budgets] for l in layers]
    vmax = max(max(r) for r in grid)
    if only:  # the scale spans the counts tried, so the baseline's 4 reads as small
        vmax = max([vmax, *profile["settings"].get("sink_options", [])])
    fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(budgets), 1.2 + 0.28 * len(layers)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=max(1 if only else 0.25, vmax))
    ax.set_xticks(range(len(budgets)), [f"W = {b}" for b in budgets])
    ax.set_yticks(range(len(layers)), layers)
    ax.set_ylabel("full-attention layer")
    for i, l in enumerate(layers):
        for j, b in enumerate(budgets):
            chosen = profile["measurements"][l][b]["chosen"]
            if only:
                label = chosen.split("=")[1]
            else:
                label = "-" if chosen == "learned" else chosen.split(":")[1].replace("witnesses", "w")
            ax.text(j, i, label, ha="center", va="center", fontsize=6, color="white")
    fig.colorbar(im, ax=ax, label="sink tokens (rest: newest)" if only else "structural share of W kept")
    ax.set_title(f"{profile['model']['name']}: calibrated {profile['settings']['policy']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _baseline_entry(settings: CalibrationSettings) -> Dict[str, object]:
    return settings.candidates()[0].setting(settings.sink_tokens, settings.local_blocks, settings.witness_blocks).to_json()


def guard_profile(
    lm: LoadedModel,
    windows: Dict[int, List[TextWindow]],
    profile: Dict[str, object],
    settings: CalibrationSettings,
    progress: bool = True,
) -> Dict[str, object]:
    """Keep a budget's chosen entries only if they beat the baseline end to end (module doc).

    Returns the profile with reverted budgets set to the baseline entry and
    ``settings.guard`` = per budget: ``kept``, and per context the interval of
    ``ppl(profile) / ppl(baseline)`` (a budget whose entries are all the baseline is not run).
    """
    from benchmark.quality.runner import GridSettings, run_grid
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import parse_topology_profile

    baseline_entry = _baseline_entry(settings)
    baseline = "locality" if settings.policy == ONLY else "learned"
    changed = [b for b in settings.budgets
               if any(layer[budget_key(b)] != baseline_entry for layer in profile["layers"].values())]
    verdicts: Dict[str, object] = {budget_key(b): {"kept": True, "run": False} for b in settings.budgets}
    if changed:
        parsed = parse_topology_profile(profile, model_fingerprint=model_fingerprint(lm), source="<calibrated profile>")
        grid_settings = GridSettings(
            contexts=settings.contexts, budgets=tuple(changed), selectors=(baseline, "profile"),
            selector_settings=dataclasses.replace(settings.selector_settings, sink_tokens=max(1, settings.sink_tokens)),
            query_chunk=settings.query_chunk, metric_stride=1 << 30,  # perplexity only: no per-layer metrics
            profile=parsed,
        )
        grid = run_grid(lm, windows, grid_settings, progress=progress)
        for b in changed:
            per_context = {}
            kept = True
            for ctx in settings.contexts:
                iv = grid.interval(ctx, b, "profile", baseline)
                per_context[str(ctx)] = {"ppl_ratio": iv.point, "lo": iv.lo, "hi": iv.hi}
                kept &= iv.hi < 1.0
            verdicts[budget_key(b)] = {"kept": kept, "run": True, "vs": baseline, "contexts": per_context}
            if not kept:
                for layer in profile["layers"].values():
                    layer[budget_key(b)] = dict(baseline_entry)
                for per_budget in profile["measurements"].values():
                    per_budget[budget_key(b)]["reverted_by_guard"] = per_budget[budget_key(b)]["chosen"]
                    per_budget[budget_key(b)]["chosen"] = settings.candidates()[0].name
                    per_budget[budget_key(b)]["chosen_cos_diff"] = per_budget[budget_key(b)]["baseline_cos_diff"]
    profile["settings"]["guard"] = {
        "rule": f"per budget: the 95% interval of ppl(profile) / ppl({baseline}) on the calibration windows "
                "has its upper bound below 1 in every context, else the budget's entries return to the baseline",
        "budgets": verdicts,
    }
    return profile


def format_guard(profile: Dict[str, object]) -> str:
    """One line per budget: kept or reverted, with the intervals behind it."""
    guard = profile["settings"].get("guard")
    if not guard:
        return "guard: not run"
    lines = []
    for b, v in guard["budgets"].items():
        if not v["run"]:
            lines.append(f"guard {b}: nothing to check (every entry is the baseline)")
            continue
        parts = ", ".join(f"ctx {c}: {x['ppl_ratio']:.4f} [{x['lo']:.4f}, {x['hi']:.4f}]" for c, x in v["contexts"].items())
        lines.append(f"guard {b}: {'kept' if v['kept'] else 'REVERTED to the baseline'} "
                     f"(ppl profile / {v['vs']}: {parts})")
    return "\n".join(lines)


def calibrate(
    lm: LoadedModel,
    windows: Dict[int, List[TextWindow]],
    settings: CalibrationSettings,
    *,
    text: Dict[str, str],
    command: str,
    progress: bool = True,
    extra_settings: Optional[Dict[str, object]] = None,
    guard: bool = True,
) -> Dict[str, object]:
    """Measure, choose, guard (unless ``guard=False``) and return the profile JSON (``seconds`` in its settings)."""
    start = time.perf_counter()
    measurements = measure(lm, windows, settings, progress=progress)
    choices = choose(measurements, lm.full_attention_layers, settings)
    extra = dict(extra_settings or {})
    profile = build_profile(lm, measurements, choices, settings, text=text, command=command, extra_settings=extra)
    if settings.scan is not None:
        profile["indexer_share"] = choose_scanning(measurements, lm.full_attention_layers, settings)
    profile["settings"]["measure_seconds"] = round(time.perf_counter() - start, 1)
    if guard:
        profile = guard_profile(lm, windows, profile, settings, progress=progress)
    profile["settings"]["seconds"] = round(time.perf_counter() - start, 1)
    return profile
