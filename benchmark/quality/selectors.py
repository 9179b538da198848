"""Selectors: one layer's data -> which keys each query token attends to, under budget W.

The selector contract, :class:`~benchmark.quality.selector_base.SelectorSettings` and the
proxy indexer live in :mod:`benchmark.quality.selector_base`. This module holds the
reference and null-model selectors and the registry: :func:`make_selector` builds any
selector by name, including the policy selectors (:mod:`benchmark.quality.policy_selectors`)
and the degraded indexers (:mod:`benchmark.quality.failure_modes`).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from benchmark.quality import failure_modes, policy_selectors, shared_scans
from benchmark.quality.profile_selectors import make_profile_selector
from benchmark.quality.errors import UsageError
from benchmark.quality.index_rows import dense_rows
from benchmark.quality.layer import LayerInputs
from benchmark.quality.selector_base import (
    Selector,
    SelectorSettings,
    layer_generator,
    learned_rows_and_scores,
    pca_proxy_rows_and_scores,
    proxy_rows_and_scores,
    top_rows_by_chunk,
)

# ----------------------------------------------------------------------------- reference


def select_all(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
    """Every causal position (needs ``W >= L``): sparse attention must then equal dense."""
    if width < layer.key_length:
        raise UsageError(f"selector 'all': needs a budget >= the context ({layer.key_length}), got {width}")
    return dense_rows(layer.lengths, width)


def select_oracle(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
    """The true top-W keys by dense attention probability summed over heads (upper bound).

    Maximizes the head-averaged attention-mass recall at this layer by construction.
    Scores per chunk: :meth:`LayerInputs.dense_probabilities_into` (in place, bit for bit
    :meth:`LayerInputs.dense_probabilities`) summed over heads into a scratch buffer.
    """

    def chunk_scores(c0: int, c1: int, lc: int) -> torch.Tensor:
        p = layer.dense_probabilities_into(c0, c1, lc, "oracle_heads")  # [H, Tc, lc]
        return torch.sum(p, dim=0, out=layer.scratch("oracle_scores", (c1 - c0, lc)))  # [Tc, lc]

    return top_rows_by_chunk(layer, width, chunk_scores)[0]


def select_oracle_reference(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
    """:func:`select_oracle` from fresh per-chunk tensors (tests and benchmarks only)."""
    return top_rows_by_chunk(layer, width, lambda c0, c1, lc: layer.dense_probabilities(c0, c1, lc).sum(dim=0))[0]


# ------------------------------------------------------------------ the trained indexer


def make_learned(settings: SelectorSettings) -> Selector:
    def select_learned(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        return learned_rows_and_scores(layer, width, settings)[0]

    select_learned.__doc__ = learned_rows_and_scores.__doc__
    return select_learned


# ----------------------------------------------------------------------------- null models


def make_proxy(settings: SelectorSettings, kind: str = "proxy") -> Selector:
    """The untrained proxies (null models): ``proxy`` (own q.k), ``proxy-lowrank``, ``proxy-pca``."""

    def select_proxy(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        if kind == "proxy-pca":
            return pca_proxy_rows_and_scores(layer, width, settings)[0]
        return proxy_rows_and_scores(layer, width, settings, lowrank=kind == "proxy-lowrank")[0]

    select_proxy.__doc__ = (pca_proxy_rows_and_scores if kind == "proxy-pca" else proxy_rows_and_scores).__doc__
    return select_proxy


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
        gen = layer_generator(settings.seed, layer.layer_idx)

        def chunk_scores(c0, c1, lc):
            return torch.rand(c1 - c0, lc, generator=gen).to(layer.query.device)

        return top_rows_by_chunk(layer, width, chunk_scores)[0]

    return select_random


# ----------------------------------------------------------------------------- registry

BUILTIN_SELECTORS = ("oracle", "learned", "proxy", "proxy-pca", "proxy-lowrank", "locality", "random")
# The untrained proxies: named null models, labelled for what they are (docs/quality.md).
PROXY_SELECTORS = ("proxy", "proxy-pca", "proxy-lowrank")
TEST_ONLY_SELECTORS = ("all",)
# The policy with a calibrated per-layer profile (docs/profile.md); only with ``--profile FILE``.
# "profile" runs the profile's own mode; "profile:<mode>" another mode it serves (a merge
# profile serves both merge modes, e.g. "profile:topology_compress_sparse").
PROFILE_SELECTOR = "profile"


def profile_selector_mode(name: str) -> Optional[str]:
    """For a profile selector name: ``""`` (the profile's own mode) or the mode after ``profile:``.

    None when ``name`` is not a profile selector (``profile:`` with an unknown mode is not one).
    """
    key = name.strip().lower()
    if key == PROFILE_SELECTOR:
        return ""
    prefix, _, mode = key.partition(":")
    if prefix == PROFILE_SELECTOR and mode in policy_selectors.policy_mode_names():
        return mode
    return None


# The default run: the trained indexer, the own-q.k proxy beside it, and the null models;
# proxy-pca and proxy-lowrank are opt-in (--selectors).
DEFAULT_BUILTIN_SELECTORS = ("oracle", "learned", "proxy", "locality", "random")
# Selectors that rank without the trained indexer (everything else starts from its rows).
INDEXER_FREE_SELECTORS = ("oracle", "locality", "random", "all", "topology_only") + PROXY_SELECTORS


def available_selectors() -> Tuple[str, ...]:
    """The default selector names, then one per enabled policy mode (when the policy imports)."""
    return DEFAULT_BUILTIN_SELECTORS + policy_selectors.policy_mode_names()


def needs_trained_indexer(names) -> bool:
    """Whether any of the selector ``names`` ranks with (or starts from) the trained indexer."""
    return any(n not in INDEXER_FREE_SELECTORS for n in names)


def make_selector(
    name: str,
    settings: SelectorSettings,
    policy_settings: Optional[policy_selectors.PolicySettings] = None,
    failure_settings: Optional[failure_modes.FailureSettings] = None,
    profile=None,
) -> Selector:
    """The selector called ``name`` (case-insensitive); unknown names list the valid ones.

    ``profile``: a loaded ``TopologyKVProfile``, needed by :data:`PROFILE_SELECTOR` only.
    """
    key = name.strip().lower()
    profile_mode = profile_selector_mode(key)
    if profile_mode is not None:
        if profile is None:
            raise UsageError(f"--selectors: {key!r} needs a profile (--profile FILE)")
        try:
            return make_profile_selector(profile, settings, policy_settings, mode=profile_mode or None)
        except ValueError as exc:
            raise UsageError(f"--selectors: {key!r}: {exc}") from None
    if key == "oracle":
        return select_oracle
    if key == "learned":
        return make_learned(settings)
    if key in PROXY_SELECTORS:
        return make_proxy(settings, key)
    if key == "locality":
        return make_locality(settings)
    if key == "random":
        return make_random(settings)
    if key == "all":
        return select_all
    if key in policy_selectors.policy_mode_names():
        return policy_selectors.make_policy_selector(key, settings, policy_settings)
    shared = shared_scans.split_shared_name(key)
    if shared is not None:
        if shared.needs_profile and profile is None:
            raise UsageError(f"--selectors: {key!r} needs a profile (--profile FILE)")
        if shared.mode is None:
            return shared_scans.make_shared_learned(shared.scan, settings, profile)
        if shared.mode != shared_scans.PROFILE_MODE:
            kind, listed = policy_selectors.structure_layer_set(
                (policy_settings or policy_selectors.PolicySettings()).for_mode(shared.mode).structure_layers)
            if kind != policy_selectors.ALL_LAYERS:
                return _on_structure_layers(shared, settings, policy_settings, profile, listed)
        base_rows = shared_scans.shared_base_rows(shared.scan, settings, profile)
        if shared.mode == shared_scans.PROFILE_MODE:
            if profile.policy.value not in shared_scans.MERGE_MODES:
                raise UsageError(f"--selectors: {key!r}: expected a merge-mode profile (one of "
                                 f"{list(shared_scans.MERGE_MODES)}), got a {profile.policy.value} profile")
            try:
                return make_profile_selector(profile, settings, policy_settings, base_rows=base_rows)
            except ValueError as exc:
                raise UsageError(f"--selectors: {key!r}: {exc}") from None
        return policy_selectors.make_policy_selector(shared.mode, settings, policy_settings, base_rows=base_rows)
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
    valid = ", ".join(BUILTIN_SELECTORS + policy_selectors.policy_mode_names() + TEST_ONLY_SELECTORS)
    raise UsageError(f"--selectors: unknown selector {name!r}; expected one of [{valid}]")


def _on_structure_layers(shared, settings: SelectorSettings, policy_settings, profile,
                         listed: Tuple[int, ...]) -> Selector:
    """``learned-shared:<scan>+<mode>`` with ``structure_layers`` other than ``all``: the mode
    runs on the rows a layer has (its own when it scans, else the reused ones) only in the
    listed layers, or with no list in the layers that reuse rows; every other layer attends
    over its rows as they are (what ``RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS`` serves)."""
    memory = shared_scans.shared_scan(shared.scan, profile)
    found_rows = {}
    merge = policy_selectors.make_policy_selector(shared.mode, settings, policy_settings,
                                                  base_rows=lambda layer, width: found_rows[width])

    def select_on_structure_layers(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        found = memory.rows(layer, width, settings)
        runs = layer.layer_idx in listed if listed else not memory.scanned(width)
        if not runs:
            return found[0]
        found_rows[width] = found
        return merge(layer, width, stats)

    return select_on_structure_layers


def _is_failure_selector(key: str) -> bool:
    """``learned-<failure>`` or ``learned-<failure>+<policy mode>`` (opt-in selectors)."""
    kind, mode = failure_modes.split_selector_name(key)
    return bool(kind) and (mode is None or mode in policy_selectors.policy_mode_names())


def resolve_selector_names(names: Optional[str]) -> Tuple[str, ...]:
    """Parse ``--selectors`` (comma list, or None/"default" for all available)."""
    if names is None or names.strip().lower() in ("", "default", "all-selectors"):
        return available_selectors()
    out = []
    valid = BUILTIN_SELECTORS + policy_selectors.policy_mode_names() + TEST_ONLY_SELECTORS + (PROFILE_SELECTOR,)
    for raw in names.split(","):
        key = raw.strip().lower()
        if not key:
            continue
        if shared_scans.split_shared_name(key) is not None:  # a malformed one raises, naming the form
            pass
        elif key not in valid and not _is_failure_selector(key) and profile_selector_mode(key) is None:
            raise UsageError(f"--selectors: unknown selector {raw.strip()!r}; expected one of [{', '.join(valid)}]")
        if key not in out:
            out.append(key)
    if not out:
        raise UsageError(f"--selectors: expected at least one of [{', '.join(valid)}], got {names!r}")
    return tuple(out)
