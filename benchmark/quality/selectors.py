"""Selectors: one layer's data -> which keys each query token attends to, under budget W.

A selector is called as ``selector(layer, width, stats)`` with a
:class:`~benchmark.quality.layer.LayerInputs`, the budget ``W`` and a dict it may add
counters to, and returns int32 ``[T, W]`` rows in the engine's convention
(:mod:`benchmark.quality.index_rows`): rows of causal length ``<= W`` are
``0..len-1`` then ``-1`` (dense), longer rows hold ``W`` unique causal positions. Like
the engine, one index set per query token is shared by all heads.

The policy selectors (the real ``apply_topology_kv_policy`` on the learned rows) live in
:mod:`benchmark.quality.policy_selectors`; :func:`make_selector` builds any of them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch

from benchmark.quality.errors import UsageError
from benchmark.quality.index_rows import dense_rows, rows_from_scores
from benchmark.quality.layer import LayerInputs

Selector = Callable[[LayerInputs, int, Dict[str, float]], torch.Tensor]

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


@dataclasses.dataclass(frozen=True)
class SelectorSettings:
    """Knobs of the built-in selectors.

    seed : random selector, and the projection of the weak proxy
    sink_tokens : locality keeps the first ``sink_tokens`` positions; 4 after DATA.md's
        measurement ("the first 4 tokens plus the 252 most recent")
    lowrank_dims : dimensions the weak proxy projects each head's q and k to; 4 of 64
        makes it a deliberately poor indexer
    fp8 : emulate the fp8-e4m3 indexer inputs (DSA runs its indexer in fp8)
    """

    seed: int = 0
    sink_tokens: int = 4
    lowrank_dims: int = 4
    fp8: bool = True

    def __post_init__(self) -> None:
        for name in ("sink_tokens", "lowrank_dims"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')}: expected an int >= 1, got {value!r}")


def _layer_generator(seed: int, layer_idx: int) -> torch.Generator:
    # One stream per (seed, layer): different layers draw different sets.
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + layer_idx)


def _by_chunk_with_scores(layer: LayerInputs, width: int, chunk_scores) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-W rows of ``chunk_scores(c0, c1, lc)`` (``[Tc, lc]``) over query chunks, and their scores.

    Returns int32 rows ``[T, W]`` and fp32 scores ``[T, W]`` (``-inf`` at ``-1`` padding).
    Chunks whose rows are all short (dense by convention) are not scored; their entries
    get score 0.
    """
    rows, scores = [], []
    for c0, c1, lc in layer.chunks():
        lengths = layer.lengths[c0:c1]
        if lc <= width:
            r = dense_rows(lengths, width)
            sc = torch.zeros(r.shape, dtype=torch.float32, device=r.device)
        else:
            s = chunk_scores(c0, c1, lc)
            r = rows_from_scores(s, lengths, width)
            sc = torch.gather(s.to(torch.float32), 1, r.to(torch.int64).clamp(min=0))
        rows.append(r)
        scores.append(torch.where(r >= 0, sc, float("-inf")))
    return torch.cat(rows, dim=0), torch.cat(scores, dim=0)


def _by_chunk(layer: LayerInputs, width: int, chunk_scores) -> torch.Tensor:
    """Rows only of :func:`_by_chunk_with_scores`."""
    return _by_chunk_with_scores(layer, width, chunk_scores)[0]


# ----------------------------------------------------------------------------- reference


def select_all(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
    """Every causal position (needs ``W >= L``): sparse attention must then equal dense."""
    if width < layer.key_length:
        raise UsageError(f"selector 'all': needs a budget >= the context ({layer.key_length}), got {width}")
    return dense_rows(layer.lengths, width)


def select_oracle(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
    """The true top-W keys by dense attention probability summed over heads (upper bound).

    Maximizes the head-averaged attention-mass recall at this layer by construction.
    """
    return _by_chunk(layer, width, lambda c0, c1, lc: layer.dense_probabilities(c0, c1, lc).sum(dim=0))


# ------------------------------------------------------------------------ learned proxies


def fp8_e4m3_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Quantize to float8_e4m3fn and back with one scale per vector (last dim).

    ``scale = amax / 448`` per vector, as an fp8 indexer keeps per-token scales; values
    then carry e4m3's 3 mantissa bits. Returns ``x``'s dtype and shape.
    """
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


def _indexer_inputs(layer: LayerInputs, settings: SelectorSettings, lowrank: bool):
    """(q ``[H, T, D']``, k ``[Hkv, L, D']``) as the proxy indexer sees them."""
    q, k = layer.query, layer.key
    if lowrank:
        D = q.shape[-1]
        gen = _layer_generator(settings.seed, layer.layer_idx)
        # Gaussian projection with E[P P^T] = I, so (qP).(kP) estimates q.k, noisily.
        proj = torch.randn(D, settings.lowrank_dims, generator=gen) / settings.lowrank_dims**0.5
        proj = proj.to(q.device)
        q, k = q @ proj, k @ proj  # [H, T, r], [Hkv, L, r]
    if settings.fp8:
        q, k = fp8_e4m3_round_trip(q), fp8_e4m3_round_trip(k)
    return q, k


def learned_rows_and_scores(
    layer: LayerInputs, width: int, settings: SelectorSettings, lowrank: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The proxy indexer's top-W rows and their scores.

    **A proxy, not a trained indexer.** It keeps DSA's lightning-indexer functional form,
    ``I[t, s] = sum_h w_h * relu(q_h[t] . k_h[s])``, but feeds it the model's own post-RoPE
    attention q/k (fp8-e4m3 round trip per vector) with uniform weights ``w_h = 1 / H``,
    because no trained indexer exists for these models. With ``lowrank=True`` q and k
    are first projected to ``settings.lowrank_dims`` random dimensions per head: a
    deliberately weak indexer. Cost: one ``[H, Tc, lc]`` product per query chunk.

    Returns
    -------
    rows : int32 ``[T, W]``, engine convention (long rows by descending score)
    scores : fp32 ``[T, W]``, the index score of each entry; ``-inf`` at ``-1`` padding
    """
    q, k = _indexer_inputs(layer, settings, lowrank)
    H = q.shape[0]

    def chunk_scores(c0, c1, lc):
        return torch.relu(layer.head_dot(q[:, c0:c1], k[:, :lc])).sum(dim=0) / H  # [Tc, lc]

    return _by_chunk_with_scores(layer, width, chunk_scores)


def make_learned(settings: SelectorSettings, lowrank: bool = False) -> Selector:
    def select_learned(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        return learned_rows_and_scores(layer, width, settings, lowrank)[0]

    select_learned.__doc__ = learned_rows_and_scores.__doc__
    return select_learned


# ----------------------------------------------------------------------------- null models


def make_locality(settings: SelectorSettings) -> Selector:
    def select_locality(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        """First ``sink_tokens`` positions plus the most recent ``W - sink_tokens`` (null model)."""
        sinks = min(settings.sink_tokens, width)
        col = torch.arange(width, device=layer.lengths.device).unsqueeze(0)  # [1, W]
        recent = layer.lengths.unsqueeze(1) - width + col  # cols sinks..W-1 -> len-W+sinks..len-1
        long_rows = torch.where(col < sinks, col, recent).to(torch.int32)
        return torch.where((layer.lengths > width).unsqueeze(1), long_rows, dense_rows(layer.lengths, width))

    return select_locality


def make_random(settings: SelectorSettings) -> Selector:
    def select_random(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        """W causal positions uniformly at random (null model).

        Seeded per (seed, layer): the same seed, shapes and query chunk give the same
        rows; budgets are nested (a smaller W keeps a subset of a larger W's set).
        """
        gen = _layer_generator(settings.seed, layer.layer_idx)

        def chunk_scores(c0, c1, lc):
            return torch.rand(c1 - c0, lc, generator=gen).to(layer.query.device)

        return _by_chunk(layer, width, chunk_scores)

    return select_random


# ----------------------------------------------------------------------------- registry

BUILTIN_SELECTORS = ("oracle", "learned", "learned-lowrank", "locality", "random")
TEST_ONLY_SELECTORS = ("all",)


def available_selectors() -> Tuple[str, ...]:
    """Built-in selector names, then one per enabled policy mode (when the policy imports)."""
    from benchmark.quality.policy_selectors import policy_mode_names

    return BUILTIN_SELECTORS + policy_mode_names()


def make_selector(name: str, settings: SelectorSettings, policy_settings=None, failure_settings=None) -> Selector:
    """The selector called ``name`` (case-insensitive); unknown names list the valid ones."""
    key = name.strip().lower()
    if key == "oracle":
        return select_oracle
    if key == "learned":
        return make_learned(settings)
    if key == "learned-lowrank":
        return make_learned(settings, lowrank=True)
    if key == "locality":
        return make_locality(settings)
    if key == "random":
        return make_random(settings)
    if key == "all":
        return select_all
    from benchmark.quality import policy_selectors

    if key in policy_selectors.policy_mode_names():
        return policy_selectors.make_policy_selector(key, settings, policy_settings)
    from benchmark.quality import failure_modes

    kind, mode = failure_modes.split_selector_name(key)
    if kind:
        failure = failure_settings or failure_modes.FailureSettings()
        if mode is None:
            return failure_modes.make_degraded_learned(kind, settings, failure)
        if mode in policy_selectors.policy_mode_names():
            stale = failure_modes.StaleKeys()
            base = lambda layer, width: failure_modes.degraded_rows_and_scores(  # noqa: E731
                kind, layer, width, settings, failure, stale
            )
            return policy_selectors.make_policy_selector(mode, settings, policy_settings, base_rows=base)
    valid = ", ".join(available_selectors() + TEST_ONLY_SELECTORS)
    raise UsageError(f"--selectors: unknown selector {name!r}; expected one of [{valid}]")


def _is_failure_selector(key: str) -> bool:
    """``learned-<failure>`` or ``learned-<failure>+<policy mode>`` (opt-in selectors)."""
    from benchmark.quality import failure_modes, policy_selectors

    kind, mode = failure_modes.split_selector_name(key)
    return bool(kind) and (mode is None or mode in policy_selectors.policy_mode_names())


def resolve_selector_names(names: Optional[str]) -> Tuple[str, ...]:
    """Parse ``--selectors`` (comma list, or None/"default" for all available)."""
    if names is None or names.strip().lower() in ("", "default", "all-selectors"):
        return available_selectors()
    out = []
    valid = available_selectors() + TEST_ONLY_SELECTORS
    for raw in names.split(","):
        key = raw.strip().lower()
        if not key:
            continue
        if key not in valid and not _is_failure_selector(key):
            raise UsageError(f"--selectors: unknown selector {raw.strip()!r}; expected one of [{', '.join(valid)}]")
        if key not in out:
            out.append(key)
    if not out:
        raise UsageError(f"--selectors: expected at least one of [{', '.join(valid)}], got {names!r}")
    return tuple(out)
