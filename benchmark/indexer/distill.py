"""DSA's dense warm-up: one layer's indexer distilled from the frozen model's attention.

Loss (DeepSeek-V3.2, dense warm-up stage): for each sampled query row ``t``,
``KL(p[t, :] || softmax(I[t, :]))`` with ``p`` the layer's dense attention averaged over
heads (:class:`~benchmark.indexer.capture.LayerSample.target`) and ``I`` the index score
of the indexer's own projections (:mod:`rtp_llm.models_py.modules.hybrid.indexer_projections`),
both over the row's causal keys. The model is frozen and the indexer's inputs are
detached (they are captured tensors). AdamW with a linear warm-up and a cosine decay.

Sparse stage (DeepSeek-V3.2's second stage, optional: ``DistillSettings.sparse_steps``):
after the dense steps, more steps on ``KL(p[t, S_t] || softmax(I[t, S_t]))`` with ``S_t``
the indexer's own top ``max(1, floor(len_t * sparse_budget))`` keys of row ``t`` (chosen
again every step, without gradient, by the engine's tie rule: lower position first) and
``p[t, S_t]`` the attention renormalised over them: the model stays frozen, so its
attention is dense and the selected set is what the loss is restricted to. Its own
warm-up and cosine decay from ``sparse_lr``.

With one indexer head, ``relu`` zeroes the score of every key whose dot product is
negative, and a zero score passes no gradient: a key the dense attention weights but the
indexer scores below 0 stays at 0, tied with the keys that deserve 0, and the engine's tie
rule (lower position first) then fills the row with the oldest of them.
``DistillSettings.dead_slope > 0`` trains through that region: the forward score is
exactly DSA's, the backward of ``relu`` passes ``dead_slope`` of the gradient below 0
(a straight-through leak), so the KL can lift a weighted key back above 0. The trained
module is unchanged in form; the leak exists only in training. Measured on SmolLM2's
layer 19 at 8k, a leak of 0.1 left its rows as tie-decided as plain relu did
(docs/indexer.md, "Two ways around the ties"): 0, the default, is DSA's training.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from benchmark.indexer.capture import LayerSample
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections, IndexerProjectionShape
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import weighted_relu_logits


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """One layer's training run.

    steps : optimizer steps (each over ``batch_windows`` windows' sampled rows)
    lr : peak learning rate (DeepSeek-V3.2's warm-up: 1e-3)
    warmup_steps : linear warm-up steps before the cosine decay to ``lr * min_lr_ratio``
    batch_windows : windows per step (cycled in a seeded order)
    weight_decay : AdamW's decoupled weight decay
    dead_slope : the share of the gradient ``relu`` passes below 0 in training (0: DSA's
        plain relu; the forward score is DSA's either way)
    sparse_steps : steps of the sparse stage after the dense ones (0: none, DSA's warm-up only)
    sparse_budget : the selected set of the sparse stage, a fraction of each row's causal keys
    sparse_lr : the sparse stage's peak learning rate
    """

    steps: int = 200
    lr: float = 1e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.05
    batch_windows: int = 2
    weight_decay: float = 0.0
    dead_slope: float = 0.0
    sparse_steps: int = 0
    sparse_budget: Fraction = Fraction(1, 8)
    sparse_lr: float = 3e-4

    def __post_init__(self) -> None:
        for name in ("steps", "batch_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected in [0, 1], got {self.min_lr_ratio!r}")
        if not 0 <= self.dead_slope <= 1:
            raise ValueError(f"dead_slope: expected in [0, 1], got {self.dead_slope!r}")
        if isinstance(self.sparse_steps, bool) or not isinstance(self.sparse_steps, int) or self.sparse_steps < 0:
            raise ValueError(f"sparse_steps: expected an int >= 0, got {self.sparse_steps!r}")
        if not isinstance(self.sparse_budget, Fraction) or not 0 < self.sparse_budget <= 1:
            raise ValueError(f"sparse_budget: expected a Fraction in (0, 1], got {self.sparse_budget!r}")
        if not self.sparse_lr > 0:
            raise ValueError(f"sparse_lr: expected > 0, got {self.sparse_lr!r}")

    def lr_at(self, step: int) -> float:
        """Learning rate of dense step ``step`` (0-based): linear warm-up, then cosine decay."""
        return _warmup_cosine(self.lr, self.steps, self.warmup_steps, self.min_lr_ratio, step)

    def sparse_lr_at(self, step: int) -> float:
        """Learning rate of sparse step ``step`` (0-based, counted from the stage's start)."""
        return _warmup_cosine(self.sparse_lr, self.sparse_steps, self.warmup_steps, self.min_lr_ratio, step)


def _warmup_cosine(peak: float, steps: int, warmup: int, min_ratio: float, step: int) -> float:
    """Linear warm-up over ``warmup`` steps to ``peak``, then cosine decay to ``peak * min_ratio``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def leaky_backward_relu(x: torch.Tensor, slope: float) -> torch.Tensor:
    """``relu(x)`` in the forward (exactly); in the backward, ``slope`` of the gradient
    below 0 (1 above). ``slope == 0`` is plain ``relu``."""
    if slope == 0:
        return torch.relu(x)
    below = x.clamp(max=0)
    return torch.relu(x) + slope * (below - below.detach())


def _raw_scores(module: IndexerProjections, sample: LayerSample, dead_slope: float = 0.0) -> torch.Tensor:
    """fp32 ``[R, L]`` index scores of the sample's rows over every key (no causal mask);
    ``dead_slope``: :func:`leaky_backward_relu`'s slope (the values are DSA's either way)."""
    L = sample.hidden.shape[0]
    keys = module.keys(sample.hidden, torch.arange(L))  # [L, D]
    x_rows = sample.hidden.index_select(0, sample.rows)  # [R, C]
    q = module.queries(x_rows, sample.rows)  # [R, H, D]
    if dead_slope == 0:
        return weighted_relu_logits(q, module.weights(x_rows), keys)
    dots = torch.einsum("rhd,ld->rhl", q, keys)  # as weighted_relu_logits, relu swapped
    return (leaky_backward_relu(dots, dead_slope) * module.weights(x_rows).unsqueeze(-1)).sum(dim=1)


def _future(sample: LayerSample) -> torch.Tensor:
    """bool ``[R, L]``: True past each row's causal length."""
    return torch.arange(sample.hidden.shape[0]).unsqueeze(0) >= sample.lengths.unsqueeze(1)


def index_logits(module: IndexerProjections, sample: LayerSample) -> torch.Tensor:
    """fp32 ``[R, L]`` index scores of the sample's rows over every key, ``-inf`` past each row's length."""
    return _raw_scores(module, sample).masked_fill(_future(sample), float("-inf"))


def kl_to_target(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``KL(target || softmax(logits))``; entries with ``target == 0`` add 0."""
    logq = torch.log_softmax(logits, dim=-1)
    p = target
    terms = torch.where(p > 0, p * (torch.log(p.clamp(min=1e-30)) - logq), torch.zeros_like(p))
    return terms.sum(dim=-1).mean()


class _TrainingTarget:
    """One sample's loss terms that do not depend on the weights, computed once per layer.

    ``KL(p || q) = sum p log p - sum p log q``: the first sum is a constant; the second
    needs ``log q`` only where ``p > 0`` (never past a row's causal length), so the future
    keys are filled with a finite floor instead of ``-inf`` (``0 * floor = 0``, where
    ``0 * -inf`` is NaN) and no per-step mask over ``p`` is needed.
    """

    FLOOR = -1e30  # exp(FLOOR - max) is 0 in fp32: the softmax over the causal keys is unchanged

    def __init__(self, sample: LayerSample) -> None:
        p = sample.target
        self.sample = sample
        self.future = _future(sample)
        self.neg_entropy = float(torch.xlogy(p, p).sum(dim=-1).mean())  # 0 log 0 = 0

    def loss(self, module: IndexerProjections, dead_slope: float = 0.0) -> torch.Tensor:
        """``kl_to_target(index_logits(module, sample), sample.target)`` with fewer passes
        (the same value for any ``dead_slope``; only its gradient differs)."""
        logq = torch.log_softmax(_raw_scores(module, self.sample, dead_slope).masked_fill(self.future, self.FLOOR), dim=-1)
        return self.neg_entropy - (self.sample.target * logq).sum(dim=-1).mean()

    def sparse_loss(self, module: IndexerProjections, budget: Fraction, dead_slope: float = 0.0) -> torch.Tensor:
        """The sparse stage's loss (module docstring): mean over rows of the KL between the
        attention renormalised over the row's selected keys and the softmax of their scores."""
        scores = _raw_scores(module, self.sample, dead_slope).masked_fill(self.future, self.FLOOR)  # [R, L]
        selected = selected_keys(scores.detach(), self.sample.lengths, budget)  # [R, L]
        p = self.sample.target * selected
        p = p / p.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        logq = torch.log_softmax(scores.masked_fill(~selected, self.FLOOR), dim=-1)
        return (torch.xlogy(p, p) - p * logq).sum(dim=-1).mean()


def selected_keys(scores: torch.Tensor, lengths: torch.Tensor, budget: Fraction) -> torch.Tensor:
    """bool ``[R, L]``: each row's top ``max(1, floor(length * budget))`` causal keys by
    score, ties to the lower position (the engine's rule). ``scores`` past a row's length
    must already rank below every causal key (``-inf`` or a floor)."""
    R, L = scores.shape
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # ties: lower position first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(L).expand(R, L))
    keep = torch.clamp((lengths.to(torch.int64) * budget.numerator) // budget.denominator, min=1)  # [R]
    return (rank < keep.unsqueeze(1)) & (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1))


def held_out_kl(module: IndexerProjections, samples: Sequence[LayerSample]) -> float:
    """Mean KL over ``samples`` (no gradients)."""
    with torch.no_grad():
        return float(sum(kl_to_target(index_logits(module, s), s.target) for s in samples) / max(1, len(samples)))


def train_layer(
    shape: IndexerProjectionShape,
    samples: Sequence[LayerSample],
    settings: DistillSettings,
    seed: int,
    on_step: Optional[Callable[[int, float], None]] = None,
    init: Optional[Mapping[str, torch.Tensor]] = None,
) -> Tuple[IndexerProjections, List[float]]:
    """Train one layer's projections on ``samples``; returns the module and the loss per step
    (the dense steps', then the sparse stage's).

    init : a state dict to start from (e.g. :func:`benchmark.indexer.warm_start.attention_warm_start`),
        or None for the random start

    Seeded: the same samples, settings and seed give the same weights (the random
    initialisation and the window order come from ``torch.Generator``s seeded with
    ``seed``, never the global stream).
    """
    if not samples:
        raise ValueError("samples: expected at least one training window")
    targets = [_TrainingTarget(s) for s in samples]
    gen = torch.Generator().manual_seed(seed)
    module = IndexerProjections(shape)
    with torch.no_grad():
        for lin in (module.wq_b, module.wk, module.weights_proj):
            bound = 1.0 / math.sqrt(lin.in_features)  # nn.Linear's default range, from our generator
            lin.weight.uniform_(-bound, bound, generator=gen)
    if init is not None:
        module.load_state_dict(init)  # strict: every parameter, each of the module's shape
    opt = torch.optim.AdamW(module.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    order = torch.Generator().manual_seed(seed + 1)
    losses: List[float] = []
    queue: List[int] = []
    dense = lambda t: t.loss(module, settings.dead_slope)  # noqa: E731
    sparse = lambda t: t.sparse_loss(module, settings.sparse_budget, settings.dead_slope)  # noqa: E731
    stages = ((settings.steps, settings.lr_at, dense), (settings.sparse_steps, settings.sparse_lr_at, sparse))
    for steps, lr_at, term in stages:
        for step in range(steps):
            batch = []
            while len(batch) < min(settings.batch_windows, len(samples)):
                if not queue:
                    queue = torch.randperm(len(samples), generator=order).tolist()
                batch.append(queue.pop())
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss = sum(term(targets[i]) for i in batch) / len(batch)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(len(losses) - 1, losses[-1])
    return module.eval().requires_grad_(False), losses
