"""Policy selectors: the real ``apply_topology_kv_policy`` applied to the learned rows.

For each full-attention layer: the proxy indexer's top-W rows and scores
(:func:`benchmark.quality.selector_base.learned_rows_and_scores`), the layer's key-centroid
drift per 64-token block (``topology_kv.drift.block_key_centroids`` on the post-RoPE
keys, then ``block_drift_scores``: block 0 scores 0), then the policy, exactly as the
serving path calls it. All rows of a forward belong to one request, so the drift is one
``[1, N]`` row shared through ``row_to_request``; blocks past a row's causal length are
the policy's business. One selector per enabled :class:`TopologyKVPolicyMode`, named by
the mode's value (e.g. ``topology_sparse_merge``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, Optional, Tuple

import torch

from benchmark.quality.errors import SetupError, UsageError
from benchmark.quality.layer import LayerInputs
from benchmark.quality.selector_base import Selector, SelectorSettings, learned_rows_and_scores
from benchmark.quality.witness_exchange import (CheckedExchange, VerifiedExchange, checked_exchange_rows,
                                                exchange_rows, parse_any_exchange_setting, verified_exchange_rows)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    SettingKind,
    WitnessSignal,
    setting_from_text,
    structural_settings,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import block_drift_scores, block_key_centroids

_POLICY_MODULE = "rtp_llm.models_py.modules.hybrid.topology_kv.policy"


def _policy():
    try:
        from rtp_llm.models_py.modules.hybrid.topology_kv import policy as topology_kv_policy
        from benchmark.candidates import witness
    except ImportError as exc:
        raise SetupError(f"the policy selectors need {_POLICY_MODULE} on the import path: {exc}") from exc
    return topology_kv_policy, witness


def policy_mode_names() -> Tuple[str, ...]:
    """Values of the enabled policy modes (every mode but ``disabled``), in enum order."""
    policy, _ = _policy()
    return tuple(m.value for m in policy.TopologyKVPolicyMode if m is not policy.TopologyKVPolicyMode.DISABLED)


# The structural settings of TopologyKVPolicyConfig, under its own names, defaults and help:
# PolicySettings' fields and the --policy-* flags are generated from them.
CONFIG_FIELDS = tuple(f.name for f in structural_settings())


# What ranks witness blocks, in the one vocabulary (``WitnessSignal``). "default" (also
# "auto") resolves per mode in :meth:`PolicySettings.for_mode`; "recency" passes no
# witness scores, so the policy takes its most-recent-eligible-blocks rule.
RECENCY = WitnessSignal.RECENCY.value
DEFAULT_SIGNAL = "default"
SHARING_LAYERS = "sharing"  # structure_layers: the mode only in the layers that reuse rows
ALL_LAYERS = "all"


def structure_layer_set(text: str) -> Tuple[str, Tuple[int, ...]]:
    """A ``structure_layers`` setting -> (``all`` / ``sharing`` / ``listed``, the listed layers),
    parsed as serving parses ``RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS``; ``UsageError`` otherwise."""
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import parse_structure_layers

    try:
        kind, layers = parse_structure_layers(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return kind.value, layers


def default_witness_signal(mode: str) -> str:
    """The harness's per-mode default witness signal: the serving ``Indexer``'s (``auto``).

    ``WitnessSignal.AUTO.resolve``: ``recency`` for ``topology_only`` (on SmolLM2
    key-centroid drift picks worse blocks than recency, docs/results.md; with recency
    witnesses the mode selects exactly plain locality, the sink tokens plus the most
    recent tokens, at any block size), ``key_drift`` for the merge modes (the engine's
    ``BlockDriftTracker``), whose witnesses only add to the indexer's rows.
    """
    return WitnessSignal.AUTO.resolve(mode).value


def _default_text(field: dataclasses.Field):
    """A config field's default as the harness writes it (enum members by their value)."""
    return field.default.value if isinstance(field.default, enum.Enum) else field.default


class _PolicySettingsMethods:
    def __post_init__(self) -> None:
        try:
            WitnessSignal.parse(self.witness_signal, "witness signal")
        except ValueError as exc:
            raise UsageError(f"--policy-witness-signal: {exc}") from exc
        structure_layer_set(self.structure_layers)
        if self.witness_exchange:
            parse_any_exchange_setting(self.witness_exchange, self.max_structural_fraction, "witness_exchange")
        fields = {f.name for f in dataclasses.fields(self)} - {"mode_overrides"}
        for mode, pairs in self.mode_overrides:
            for key, _ in pairs:
                if key not in fields:
                    raise UsageError(
                        f"--policy-mode-settings {mode}: unknown setting {key!r}; valid: {', '.join(sorted(fields))}"
                    )
            self.for_mode(mode)  # the overridden settings must be valid too

    def for_mode(self, mode: str) -> "PolicySettings":
        """These settings with ``mode``'s overrides applied (and no overrides left)."""
        changes = dict(pair for m, pairs in self.mode_overrides if m == mode for pair in pairs)
        out = dataclasses.replace(self, mode_overrides=(), **changes)
        if WitnessSignal.parse(out.witness_signal) is WitnessSignal.AUTO:
            out = dataclasses.replace(out, witness_signal=default_witness_signal(mode))
        return out

    def config(self, mode: str):
        """A validated ``TopologyKVPolicyConfig``; its errors become ``UsageError``."""
        policy, _ = _policy()
        try:
            return policy.TopologyKVPolicyConfig(policy=mode, **{name: getattr(self, name) for name in CONFIG_FIELDS})
        except (TypeError, ValueError) as exc:
            raise UsageError(f"policy settings: {exc}") from exc


PolicySettings = dataclasses.make_dataclass(
    "PolicySettings",
    [(f.name, f.type, dataclasses.field(default=_default_text(f))) for f in structural_settings()]
    + [
        ("scaffold_tokens", int, dataclasses.field(default=0)),
        ("witness_signal", str, dataclasses.field(default=DEFAULT_SIGNAL)),
        ("structure_layers", str, dataclasses.field(default="all")),
        ("witness_exchange", str, dataclasses.field(default="")),
        ("mode_overrides", Tuple[Tuple[str, Tuple[Tuple[str, object], ...]], ...], dataclasses.field(default=())),
    ],
    bases=(_PolicySettingsMethods,),
    frozen=True,
)
PolicySettings.__module__ = __name__
PolicySettings.__doc__ = """Policy configuration used by every policy selector (the engine's defaults).

    The structural fields (:data:`CONFIG_FIELDS`) are ``TopologyKVPolicyConfig``'s, with its
    names and defaults (enum settings by their value). The harness's own:

    scaffold_tokens : ``topology_compress_sparse`` only: the first ``scaffold_tokens``
        of each window stand in for a stable scaffold (a shared system prompt), whose
        structural blocks the mode represents by one token each. 0: no scaffold, and the
        mode then selects exactly what ``topology_sparse_merge`` does.
    witness_signal : a ``WitnessSignal`` value: ``default`` / ``auto`` (the engine's, per mode,
        :func:`default_witness_signal`), ``recency``, ``key_drift``, or a harness-only one
        (``value_drift``, ``query_centroid``, ``query_mass``, ``query_bound``,
        ``query_group_mass``)
    structure_layers : ``learned-shared:<scan>+<mode>`` only: ``all`` (default) runs the mode
        in every sparse layer, ``sharing`` only in the layers that reuse another layer's
        rows (a scanning layer keeps its own rows: ``RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS=sharing``),
        a comma list of layer indices only in those layers (the others keep the rows they
        have, scanned or reused); in ``--policy-mode-settings`` the list's commas continue
        the value (``MODE:structure_layers=1,17,witness_blocks=64``)
    witness_exchange : ``MARGIN:PROTECT`` (e.g. ``2:1/2``), ``checked:MARGIN`` (e.g.
        ``checked:1``), ``verified:MARGIN:BLOCKS[:RANK]`` (e.g. ``verified:1:64``), or empty
        (default): instead of the mode's merge, an exchange of
        :mod:`benchmark.quality.witness_exchange` into the base rows, at most
        ``max_structural_fraction`` of ``W`` swapped; witnesses only (``sink_tokens=0``,
        ``local_blocks=0``). ``MARGIN:PROTECT``: the mass-gated exchange, ranked by the witness
        signal (not ``recency``); ``checked:MARGIN``: the checked block exchange (exact
        in-row masses, a Jensen bound for whole blocks; plain causal logits only);
        ``verified:MARGIN:BLOCKS[:RANK]``: the verified token exchange (exact masses on both
        sides, for the tokens of the ``BLOCKS`` blocks ranked highest: ``box`` (default), by an
        upper bound from their keys' bounding box; ``mean``, by their outsiders' mean logit). Harness
        only: serving has no exchange
    mode_overrides : ``((mode, ((field, value), ...)), ...)``: settings that differ for one
        mode (e.g. ``topology_only`` with smaller blocks), applied by :meth:`for_mode`
    """


def add_policy_flags(group) -> None:
    """The ``--policy-*`` flags of the structural settings and the witness signal, generated
    from ``TopologyKVPolicyConfig`` (names, defaults, help) and ``WitnessSignal``."""
    for f in structural_settings():
        kind = f.metadata["kind"]
        flag = "--policy-" + f.name.replace("_", "-")
        default = _default_text(f)
        help_text = f"{f.metadata['help']} (default %(default)s)"
        if kind is SettingKind.CHOICE:
            group.add_argument(flag, default=default, choices=tuple(m.value for m in f.metadata["choices"]),
                               help=help_text)
        elif kind is SettingKind.SINK_TOKENS:
            group.add_argument(flag, default="blocks" if default is None else str(default), help=help_text)
        else:
            group.add_argument(flag, type=float if kind is SettingKind.FRACTION else int, default=default,
                               help=help_text)
    signals = (DEFAULT_SIGNAL,) + tuple(s.value for s in WitnessSignal if s is not WitnessSignal.AUTO)
    group.add_argument("--policy-witness-signal", default=DEFAULT_SIGNAL, choices=signals,
                       help="what ranks witness blocks; default: recency for topology_only (the policy's "
                            "most-recent-blocks rule), key_drift for the merge modes")


def policy_settings_from_flags(args, **harness) -> "PolicySettings":
    """:class:`PolicySettings` from the flags of :func:`add_policy_flags` (plus ``harness``
    fields such as ``scaffold_tokens`` and ``mode_overrides``); errors name the flag."""
    values = {}
    for f in structural_settings():
        flag = "--policy-" + f.name.replace("_", "-")
        value = getattr(args, "policy_" + f.name)
        if f.metadata["kind"] is SettingKind.SINK_TOKENS:
            value = parse_setting(f.name, value, flag)
        values[f.name] = value
    return PolicySettings(witness_signal=args.policy_witness_signal, **values, **harness)


def parse_setting(name: str, text: str, where: str):
    """A structural setting (or ``scaffold_tokens``) written as text; ``UsageError`` naming ``where``."""
    if name == "scaffold_tokens":
        try:
            return int(text)
        except ValueError:
            raise UsageError(f"{where}: not a number: {text!r}") from None
    fields = {f.name: f for f in structural_settings()}
    if name not in fields:
        return text
    try:
        return setting_from_text(fields[name], text, where)
    except ValueError as exc:
        if name == "sink_tokens":
            raise UsageError(f"{where}: expected an integer >= 0 or 'blocks', got {text!r}") from None
        raise UsageError(str(exc)) from None


def layer_block_drift(layer: LayerInputs, block_size: int) -> torch.Tensor:
    """fp32 ``[1, N]`` L2 drift of the layer's post-RoPE key centroids, ``N = ceil(L / bs)``."""
    keys = layer.key.transpose(0, 1)  # [Hkv, L, D] -> [L, Hkv, D], token-major like the cache
    centroids = block_key_centroids(keys, block_size=block_size)  # [N, Hkv, D]
    return block_drift_scores(centroids).unsqueeze(0)  # [1, N]


def layer_witness_scores(layer: LayerInputs, block_size: int, signal: str) -> Tuple[Optional[torch.Tensor], bool]:
    """Witness scores for the layer's rows: (``[1, N]`` shared or ``[T, N]`` per row, shared?).

    ``recency``: (None, False): the policy then ranks witness blocks by recency itself.
    """
    try:
        signal = WitnessSignal.parse(signal, "witness signal")
    except ValueError as exc:
        raise UsageError(f"--policy-witness-signal: {exc}") from exc
    if signal is WitnessSignal.RECENCY:
        return None, False
    if signal is WitnessSignal.AUTO:
        raise UsageError(f"--policy-witness-signal: {signal.value!r} resolves per mode (PolicySettings.for_mode) first")
    _, witness = _policy()
    if signal is WitnessSignal.KEY_DRIFT:
        return layer_block_drift(layer, block_size), True
    if signal is WitnessSignal.VALUE_DRIFT:
        values = layer.value.transpose(0, 1)  # [L, Hkv, D]
        cents = block_key_centroids(values, block_size=block_size)
        return block_drift_scores(cents).unsqueeze(0), True
    keys = layer.key.transpose(0, 1)  # [L, Hkv, D]
    query = layer.query.transpose(0, 1)  # [H, T, D] -> [T, H, D]
    if signal is WitnessSignal.QUERY_BOUND:
        kmin, kmax = witness.block_key_bounds(keys, block_size=block_size)  # [N, Hkv, D] each
        scores = witness.query_bound_scores(query, kmin, kmax, layer.lengths, block_size, scale=layer.scaling)
        return scores, False  # [T, N]
    cents = block_key_centroids(keys, block_size=block_size)  # [N, Hkv, D]
    if signal is WitnessSignal.QUERY_MASS:
        return witness.query_mass_scores(query, cents, layer.lengths, block_size, scale=layer.scaling), False
    if signal is WitnessSignal.QUERY_GROUP_MASS:
        return witness.query_group_mass_scores(query, cents, layer.lengths, block_size, scale=layer.scaling), False
    return witness.query_centroid_scores(query, cents), False  # [T, N]


def no_scan_rows(layer: LayerInputs, width: int):
    """``(rows, None)`` of an indexer that reads no key: ``0 .. len - 1`` for rows of length
    ``<= W``, ``-1`` for longer ones (what ``topology_only`` without a scan gets)."""
    from benchmark.quality.index_rows import dense_rows

    rows = dense_rows(layer.lengths, width)
    return torch.where((layer.lengths > width).unsqueeze(1), -1, rows).to(torch.int32), None


def make_policy_selector(
    mode: str, settings: SelectorSettings, policy_settings: PolicySettings = None, base_rows=None
) -> Selector:
    """Selector applying policy ``mode`` to the trained indexer's rows (see module doc).

    ``base_rows(layer, width) -> (rows, scores)`` replaces the trained indexer (a degraded
    one, :mod:`benchmark.quality.failure_modes`); None = the trained indexer itself, or,
    for ``topology_only`` (whose rows do not depend on the indexer's), no indexer at all:
    the engine's short-row convention and ``-1`` rows, as a deployment without a scan.
    """
    policy, _ = _policy()
    policy_settings = (policy_settings or PolicySettings()).for_mode(mode)
    config = policy_settings.config(mode)
    if base_rows is None and mode == "topology_only":
        base_rows = no_scan_rows
    elif base_rows is None:
        base_rows = lambda layer, width: learned_rows_and_scores(layer, width, settings)  # noqa: E731
    if not config.enabled:
        raise UsageError(f"--selectors: policy mode {mode!r} is disabled (it returns the learned rows: use 'learned')")
    exchange = None
    if policy_settings.witness_exchange:
        exchange = parse_any_exchange_setting(policy_settings.witness_exchange, config.max_structural_fraction,
                                              f"witness_exchange ({mode})")
        if config.sink_tokens != 0 or config.local_blocks != 0:
            raise UsageError(f"witness_exchange ({mode}): expected witnesses only (sink_tokens=0, local_blocks=0), "
                             f"got sink_tokens={config.sink_tokens}, local_blocks={config.local_blocks}")
        if (not isinstance(exchange, (CheckedExchange, VerifiedExchange))
                and WitnessSignal.parse(policy_settings.witness_signal) is WitnessSignal.RECENCY):
            raise UsageError(f"witness_exchange ({mode}): expected a witness signal that scores blocks, got recency")

    def select_policy(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        rows, scores = base_rows(layer, width)
        T = rows.shape[0]
        if isinstance(exchange, (CheckedExchange, VerifiedExchange)):
            if layer.softcap is not None or layer.allowed is not None:
                raise UsageError(f"witness_exchange ({mode}) {exchange.name.split(':')[0]}: expected plain causal "
                                 f"logits (its bounds are for them), got layer {layer.layer_idx} with "
                                 f"softcap={layer.softcap}, a mask: {layer.allowed is not None}")
            exchange_fn = checked_exchange_rows if isinstance(exchange, CheckedExchange) else verified_exchange_rows
            out, swaps = exchange_fn(rows, layer.lengths, layer.query, layer.key, layer.scaling,
                                     config.block_size, exchange, layer.query_chunk)
            stats["exchange_swaps"] = stats.get("exchange_swaps", 0) + int(swaps.sum())
            return out
        witness, shared = layer_witness_scores(layer, config.block_size, policy_settings.witness_signal)
        if exchange is not None:
            out, swaps = exchange_rows(rows, layer.lengths, witness, config.block_size, exchange)
            stats["exchange_swaps"] = stats.get("exchange_swaps", 0) + int(swaps.sum())
            return out
        context = None
        if policy_settings.scaffold_tokens:
            # Only the scaffold's length matters to the policy; the ids feed its fingerprint.
            context = policy.TopologyRequestContext(scaffold_token_ids=tuple(range(policy_settings.scaffold_tokens)))
        result = policy.apply_topology_kv_policy(
            rows,
            layer.lengths,
            config=config,
            block_drift_scores=witness,
            row_to_request=torch.zeros(T, dtype=torch.int64, device=rows.device) if shared else None,
            learned_scores=scores,
            context=context,
        )
        for name, value in result.counters.to_dict().items():
            stats[name] = stats.get(name, 0) + value
        return result.indices

    select_policy.__name__ = f"select_{mode}"
    return select_policy
