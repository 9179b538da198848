"""The model-loss stage: every layer's indexer trained together through the frozen model's output.

The per-layer stages (:mod:`benchmark.indexer.distill`) fit each layer's index score to
that layer's own attention. What the served model loses is measured at its output: a key
one layer drops changes what every later layer reads. This stage (``--lm-steps`` of
``benchmark/topology_kv_indexer_train.py``) trains all layers' indexers at once on

    ``KL(p_dense(. | x_<t) || p_soft(. | x_<t))``

at sampled positions ``t`` of each training window: ``p_dense`` the frozen model's own
next-token distribution (computed once per window, no gradient), ``p_soft`` the same
model with every full-attention layer restricted to a *soft* top-W of its indexer's
scores. The KL to the dense model rather than the next token's loss: what the selection
can change is only the distance to dense, and this target has none of the text's own
entropy in its gradient.

The KL at a small budget is tens of times the KL at a large one (Gemma 3 270M at 2k:
about 0.03 at 1/16, 0.0008 at 1/4), so with the plain KL as the step's loss the large
budgets' steps barely move the weights. ``objective="log-kl"`` minimizes ``log KL``
instead: each step's gradient is the KL's gradient divided by that KL, every budget and
window counted by its relative change.

The soft top-W (:func:`soft_selection_bias`): each row ``t`` longer than ``W`` adds to
its attention logits

    ``log sigmoid((s[t, l] - theta_t) / tau_t)``

with ``s`` the index score, ``theta_t`` the midpoint between the row's ``W``-th and
``W+1``-th largest causal score and ``tau_t = tau * std_l(s[t, l])`` (both without
gradient): a key well inside the top-W keeps its logit, one well outside is suppressed
as by the hard mask, and a key near the boundary passes a gradient that says whether the
output wants it in or out. As ``tau -> 0`` the bias is 0 on the hard top-W and ``-inf``
elsewhere (the tests pin it). Rows of causal length ``<= W`` stay dense, as in the engine.

The model is frozen (its parameters' ``requires_grad`` is switched off for the stage and
restored after); the attention under the soft mask is recomputed in the backward
(``torch.utils.checkpoint``), so a layer keeps only its inputs for the backward. The
layers below the lowest trained layer do not depend on any indexer: their output is
computed once per window with the teacher and each step starts from it
(:func:`layers_skipped`; Gemma 3 270M: 5 of 18 layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from fractions import Fraction
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from benchmark.indexer.distill import _warmup_cosine
from benchmark.quality.metrics import soft_cap
from benchmark.quality.model import decoder_layers
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import weighted_relu_logits

DEFAULT_BUDGETS = (Fraction(1, 16), Fraction(1, 8), Fraction(1, 4))
OBJECTIVES = ("kl", "log-kl")


@dataclasses.dataclass(frozen=True)
class LMStageSettings:
    """The stage's run.

    steps : optimizer steps (one window and one budget each)
    lr : peak learning rate (warm-up, then cosine decay to ``lr * min_lr_ratio``)
    tau : the soft mask's temperature, relative to each row's score spread
    budgets : W as fractions of the window, cycled step by step
    positions : positions per window whose next-token distributions are compared
    objective : "kl" (each step's loss the KL) or "log-kl" (its log: module docstring)
    """

    steps: int = 72
    lr: float = 1e-5
    tau: float = 0.1
    budgets: Tuple[Fraction, ...] = DEFAULT_BUDGETS
    positions: int = 256
    objective: str = "kl"
    warmup_steps: int = 5
    min_lr_ratio: float = 0.05

    def __post_init__(self) -> None:
        for name in ("steps", "positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        for name in ("lr", "tau"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not self.budgets or any(not isinstance(b, Fraction) or not 0 < b < 1 for b in self.budgets):
            raise ValueError(f"budgets: expected Fractions in (0, 1), got {list(self.budgets)!r}")

    def lr_at(self, step: int) -> float:
        return _warmup_cosine(self.lr, self.steps, self.warmup_steps, self.min_lr_ratio, step)

    def to_json(self) -> Dict[str, object]:
        return {"steps": self.steps, "lr": self.lr, "tau": self.tau, "budgets": [str(b) for b in self.budgets],
                "positions": self.positions, "objective": self.objective}


def soft_selection_bias(scores: torch.Tensor, lengths: torch.Tensor, width: int, tau: float) -> torch.Tensor:
    """fp32 ``[T, L]`` additive attention bias of the soft top-``width`` (module docstring).

    scores : fp32 ``[T, L]`` index scores (gradients flow through them)
    lengths : int ``[T]`` each row's causal length (keys ``0 .. lengths[t] - 1``)
    width : W >= 1; rows with ``lengths <= W`` get 0 on every causal key
    tau : temperature relative to each row's standard deviation over its causal keys

    ``-inf`` past each row's length.
    """
    T, L = scores.shape
    if lengths.shape != (T,):
        raise ValueError(f"lengths: expected shape ({T},), got {tuple(lengths.shape)}")
    if not 1 <= width:
        raise ValueError(f"width: expected >= 1, got {width}")
    causal = torch.arange(L, device=scores.device).unsqueeze(0) < lengths.unsqueeze(1)  # [T, L]
    long = lengths > width  # [T]
    if not bool(long.any()):
        return torch.zeros_like(scores).masked_fill(~causal, float("-inf"))
    with torch.no_grad():
        s = scores.detach()
        k = min(width + 1, L)
        top = s.masked_fill(~causal, float("-inf")).topk(k, dim=-1).values  # [T, k]
        theta = 0.5 * (top[:, width - 1] + top[:, min(width, k - 1)])  # the long rows have > W causal keys
        n = causal.sum(dim=1, keepdim=True).clamp(min=1)
        mean = s.masked_fill(~causal, 0).sum(dim=1, keepdim=True) / n
        std = ((s - mean).masked_fill(~causal, 0).pow(2).sum(dim=1, keepdim=True) / n).sqrt()
        temperature = tau * std.clamp(min=torch.finfo(torch.float32).tiny)  # [T, 1]
    bias = F.logsigmoid((scores - theta.unsqueeze(1)) / temperature)
    return torch.where(long.unsqueeze(1), bias, torch.zeros_like(bias)).masked_fill(~causal, float("-inf"))


def _soft_attention(query, key, value, hidden, allowed, scaling, softcap, module: IndexerProjections, width, tau):
    """``[T, H, D]`` attention of one request under the soft top-W of ``module``'s scores."""
    H, T, _ = query.shape
    L = key.shape[1]
    kpos = torch.arange(L)
    qpos = kpos[L - T:]
    scores = weighted_relu_logits(module.queries(hidden[L - T:], qpos), module.weights(hidden[L - T:]),
                                  module.keys(hidden, kpos))  # [T, L]
    bias = soft_selection_bias(scores, qpos + 1, width, tau)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    groups = H // key.shape[0]
    k = key.repeat_interleave(groups, dim=0)
    v = value.repeat_interleave(groups, dim=0)
    logits = torch.einsum("htd,hld->htl", query, k) * scaling
    if softcap is not None:
        logits = soft_cap(logits, softcap)
    p = torch.softmax(logits + bias.unsqueeze(0), dim=-1)
    return torch.einsum("htl,hld->thd", p, v)


@dataclasses.dataclass
class SoftSelectionPlan:
    """A forward whose full-attention layers run under the soft top-W of their indexers.

    Handed to the model as the quality harness's plan keyword
    (:data:`benchmark.quality.sparse_attention.PLAN_KWARG`); the harness's attention calls
    :meth:`attend` at each of ``full_attention_layers`` and runs every other layer as the
    model defines it. ``layer_hidden`` is filled by the harness's input hook (the
    attention's input, what an indexer reads).
    """

    projections: Mapping[int, IndexerProjections]
    width: int
    tau: float
    full_attention_layers: frozenset
    layer_hidden: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def wants_hidden(self, layer_idx: int) -> bool:
        return layer_idx in self.full_attention_layers

    def attend(self, layer_idx: int, query, key, value, allowed: Optional[torch.Tensor], scaling: float,
               softcap: Optional[float]) -> torch.Tensor:
        """``[1, T, H, D]`` for query ``[1, H, T, D]``, key/value ``[1, Hkv, L, D]`` (batch 1)."""
        hidden = self.layer_hidden.pop(layer_idx, None)
        if hidden is None:
            raise RuntimeError(f"soft selection: layer {layer_idx}'s attention input was not handed to the plan "
                               "(install_hidden_capture(model) missing)")
        if query.shape[0] != 1:
            raise ValueError(f"soft selection: expected batch 1, got {query.shape[0]}")
        out = checkpoint(_soft_attention, query[0].float(), key[0].float(), value[0].float(), hidden[0].float(),
                         allowed, scaling, softcap, self.projections[layer_idx], self.width, self.tau,
                         use_reentrant=False)
        return out.unsqueeze(0).to(query.dtype)


def _final_log_probs(lm, hidden: torch.Tensor) -> torch.Tensor:
    logits = lm.model.lm_head(hidden).float()
    cap = getattr(lm.model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = soft_cap(logits, cap)
    return torch.log_softmax(logits, dim=-1)


def step_objective(kl: torch.Tensor, objective: str) -> torch.Tensor:
    """What a step minimizes: ``kl`` itself, or ``log kl`` (gradient ``grad kl / kl``)."""
    if objective == "kl":
        return kl
    if objective == "log-kl":
        return kl.clamp(min=torch.finfo(torch.float32).tiny).log()
    raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}")


class _PassThrough(torch.nn.Module):
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


@contextlib.contextmanager
def layers_skipped(model, count: int) -> Iterator[None]:
    """Within the block, ``model``'s first ``count`` decoder layers return their input unchanged
    (restored on exit): a forward given ``inputs_embeds`` = the input of layer ``count``
    computes only the layers from ``count`` on."""
    layers = decoder_layers(model)
    if not 0 <= count <= len(layers):
        raise ValueError(f"count: expected 0 .. {len(layers)}, got {count}")
    saved = [layers[i] for i in range(count)]
    try:
        for i in range(count):
            layers[i] = _PassThrough()
        yield
    finally:
        for i, layer in enumerate(saved):
            layers[i] = layer


def _layer_input(model, layer: int, run: Callable[[], object]) -> Tuple[torch.Tensor, object]:
    """``(decoder layer layer's input hidden states during run(), what run() returned)``."""
    seen: List[torch.Tensor] = []

    def hook(module, args, kwargs):
        seen.append(args[0] if args else kwargs["hidden_states"])

    handle = decoder_layers(model)[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        result = run()
    finally:
        handle.remove()
    if len(seen) != 1:
        raise RuntimeError(f"decoder layer {layer} ran {len(seen)} times in one forward")
    return seen[0], result


def sample_positions(length: int, first: int, count: int, seed: int) -> torch.Tensor:
    """``min(count, length - 1 - first)`` distinct positions of ``[first, length - 1)``, ascending, seeded."""
    span = length - 1 - first
    if span < 1:
        raise ValueError(f"sample_positions: no position in [{first}, {length - 1})")
    gen = torch.Generator().manual_seed(seed)
    return (torch.randperm(span, generator=gen)[: min(count, span)] + first).sort().values


def train_lm_stage(lm, projections: Mapping[int, IndexerProjections], windows: Sequence[Sequence[int]],
                   settings: LMStageSettings, seed: int,
                   on_step: Optional[Callable[[int, float], None]] = None) -> List[Tuple[str, int, float]]:
    """Train ``projections`` (layer -> indexer, full-attention layers; in place) on ``windows``
    (token ids); returns ``[(budget, window index, loss)]`` per step. The full-attention layers without an
    indexer in ``projections`` stay dense. The modules come back in eval mode
    without gradients; ``lm``'s parameters keep their ``requires_grad`` flags.
    """
    from benchmark.quality.sparse_attention import PLAN_KWARG

    layers = frozenset(projections)
    if not layers or not layers <= set(lm.full_attention_layers):
        raise ValueError(f"projections: expected full-attention layers of the model ({list(lm.full_attention_layers)}), "
                         f"got {sorted(projections)}")
    if not windows:
        raise ValueError("windows: expected at least one training window")
    base = lm.model.base_model
    flags = [(p, p.requires_grad) for p in lm.model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        lowest = min(layers)
        cached = []
        for i, ids in enumerate(windows):
            T = len(ids)
            first = max(int(T * b) for b in settings.budgets)  # every compared row is sparse at every budget
            positions = sample_positions(T, first, settings.positions, seed * 1000 + i)
            x = torch.tensor([list(ids)], dtype=torch.int64)
            with torch.no_grad():
                prefix, dense = _layer_input(lm.model, lowest, lambda: base(input_ids=x, use_cache=False))
                logp = _final_log_probs(lm, dense.last_hidden_state[0].index_select(0, positions))
                # bf16 keeps 2 bytes per vocabulary entry (Gemma: 262k entries per position).
                p = logp.exp().to(torch.bfloat16)
                # KL(p || q) = sum p log p - sum p log q, the first term without gradient; both
                # with the same stored p, so the difference keeps its precision.
                cached.append((prefix, positions, p, (p.float() * logp).sum(dim=-1)))
        params = [p for m in projections.values() for p in m.parameters()]
        for m in projections.values():
            m.float().train().requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
        order = torch.Generator().manual_seed(seed + 1)
        queue: List[int] = []
        losses: List[Tuple[str, int, float]] = []
        for step in range(settings.steps):
            if not queue:
                queue = torch.randperm(len(cached), generator=order).tolist()
            index = queue.pop()
            prefix, positions, p, p_log_p = cached[index]
            budget = settings.budgets[step % len(settings.budgets)]
            width = max(1, int(prefix.shape[1] * budget))
            for group in opt.param_groups:
                group["lr"] = settings.lr_at(step)
            plan = SoftSelectionPlan(projections, width, settings.tau, layers)
            with layers_skipped(lm.model, lowest):
                hidden = base(inputs_embeds=prefix, use_cache=False, **{PLAN_KWARG: plan}).last_hidden_state[0]
            logq = _final_log_probs(lm, hidden.index_select(0, positions))
            loss = (p_log_p - torch.einsum("tv,tv->t", p.float(), logq)).mean()
            opt.zero_grad(set_to_none=True)
            step_objective(loss, settings.objective).backward()
            opt.step()
            losses.append((str(budget), index, float(loss.detach())))
            if on_step is not None:
                on_step(step, losses[-1][2])
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        for m in projections.values():
            m.eval().requires_grad_(False)
    return losses


def first_and_last(losses: Sequence[Tuple[str, int, float]]) -> Dict[str, Tuple[float, float, int]]:
    """budget -> ``(mean first loss, mean last loss, windows)`` over the windows a budget met
    at least twice: each window's first and last step at that budget (the same window and
    budget, so the two means differ by the training in between, not by the windows)."""
    seen: Dict[Tuple[str, int], List[float]] = {}
    for budget, window, loss in losses:
        seen.setdefault((budget, window), []).append(loss)
    out: Dict[str, Tuple[float, float, int]] = {}
    for budget in dict.fromkeys(b for b, _, _ in losses):
        pairs = [(v[0], v[-1]) for (b, _), v in seen.items() if b == budget and len(v) > 1]
        if pairs:
            out[budget] = (sum(a for a, _ in pairs) / len(pairs), sum(z for _, z in pairs) / len(pairs), len(pairs))
    return out
