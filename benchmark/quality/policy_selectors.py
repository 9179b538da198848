"""Policy selectors: the real ``apply_topology_kv_policy`` applied to the learned rows.

For each full-attention layer: the proxy indexer's top-W rows and scores
(:func:`benchmark.quality.selector_base.learned_rows_and_scores`), the layer's key-centroid
drift per 64-token block (``topology_kv_drift.block_key_centroids`` on the post-RoPE
keys, then ``block_drift_scores``: block 0 scores 0), then the policy, exactly as the
serving path calls it. All rows of a forward belong to one request, so the drift is one
``[1, N]`` row shared through ``row_to_request``; blocks past a row's causal length are
the policy's business. One selector per enabled :class:`TopologyKVPolicyMode`, named by
the mode's value (e.g. ``topology_sparse_merge``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from benchmark.quality.errors import SetupError, UsageError
from benchmark.quality.layer import LayerInputs
from benchmark.quality.selector_base import Selector, SelectorSettings, learned_rows_and_scores
from rtp_llm.models_py.modules.hybrid.topology_kv.config import ServingWitnessSignal
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import block_drift_scores, block_key_centroids

_POLICY_MODULE = "rtp_llm.models_py.modules.hybrid.topology_kv.policy"


def _policy():
    try:
        from rtp_llm.models_py.modules.hybrid.topology_kv import policy as topology_kv_policy
        from benchmark.candidates import witness as topology_kv_witness
    except ImportError as exc:
        raise SetupError(f"the policy selectors need {_POLICY_MODULE} on the import path: {exc}") from exc
    return topology_kv_policy, topology_kv_witness


def policy_mode_names() -> Tuple[str, ...]:
    """Values of the enabled policy modes (every mode but ``disabled``), in enum order."""
    policy, _ = _policy()
    return tuple(m.value for m in policy.TopologyKVPolicyMode if m is not policy.TopologyKVPolicyMode.DISABLED)


# PolicySettings fields that TopologyKVPolicyConfig takes under the same names; the
# others (scaffold_tokens, witness_signal, mode_overrides) are the harness's own.
CONFIG_FIELDS = (
    "sink_blocks",
    "local_blocks",
    "witness_blocks",
    "block_size",
    "max_structural_fraction",
    "sink_tokens",
    "structural_budget",
)


# Witness signals the harness adds to the engine's ``WitnessSignal``: "recency" passes no
# witness scores, so the policy takes its documented fallback (the most recent eligible
# blocks); "default" resolves per mode in :meth:`PolicySettings.for_mode`.
RECENCY = ServingWitnessSignal.RECENCY.value
DEFAULT_SIGNAL = "default"


def default_witness_signal(mode: str) -> str:
    """The harness's per-mode default witness signal: the serving ``Indexer``'s (``auto``).

    ``ServingWitnessSignal.AUTO.resolve``: ``recency`` for ``topology_only`` (on SmolLM2
    key-centroid drift picks worse blocks than recency, docs/topology_vs_learned_runs.md;
    with recency witnesses the mode selects exactly plain locality, the sink tokens plus
    the most recent tokens, at any block size), ``key_drift`` for the merge modes (the
    engine's ``BlockDriftTracker``), whose witnesses only add to the indexer's rows.
    """
    return ServingWitnessSignal.AUTO.resolve(mode).value


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """Policy configuration used by every policy selector (the engine's defaults).

    scaffold_tokens : ``topology_compress_sparse`` only: the first ``scaffold_tokens``
        of each window stand in for a stable scaffold (a shared system prompt), whose
        structural blocks the mode represents by one token each. 0: no scaffold, and the
        mode then selects exactly what ``topology_sparse_merge`` does.
    sink_tokens, structural_budget : the policy's token-granular sinks (default 4, as the
        engine; None: the seed's whole sink blocks) and budget rule ("fixed": the seed's)
    mode_overrides : ``((mode, ((field, value), ...)), ...)``: settings that differ for one
        mode (e.g. ``topology_only`` with smaller blocks), applied by :meth:`for_mode`
    witness_signal : what ranks witness blocks: ``default`` (the engine's ``auto``, per mode,
        :func:`default_witness_signal`: ``recency`` for ``topology_only``, ``key_drift``
        otherwise), ``recency`` (no scores: the policy's most-recent-blocks fallback), or a
        ``WitnessSignal``: ``key_drift`` (seed),
        ``value_drift``, ``query_centroid`` (each row's query against block key centroids)
        ``query_mass`` (the same, softmax-normalized per head: estimated attention mass) or
        ``query_bound`` (as ``query_mass`` with a per-block upper bound from key min/max)
    """

    sink_blocks: int = 1
    local_blocks: int = 2
    witness_blocks: int = 2
    block_size: int = 64
    max_structural_fraction: float = 0.25
    scaffold_tokens: int = 0
    sink_tokens: Optional[int] = 4
    structural_budget: str = "fixed"
    witness_signal: str = DEFAULT_SIGNAL
    mode_overrides: Tuple[Tuple[str, Tuple[Tuple[str, object], ...]], ...] = ()

    def __post_init__(self) -> None:
        _, witness = _policy()
        if self.witness_signal not in (DEFAULT_SIGNAL, RECENCY):
            try:
                witness.WitnessSignal.parse(self.witness_signal)
            except ValueError as exc:
                raise UsageError(f"--policy-witness-signal: {exc}") from exc
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
        if out.witness_signal == DEFAULT_SIGNAL:
            out = dataclasses.replace(out, witness_signal=default_witness_signal(mode))
        return out

    def config(self, mode: str):
        """A validated ``TopologyKVPolicyConfig``; its errors become ``UsageError``."""
        policy, _ = _policy()
        try:
            return policy.TopologyKVPolicyConfig(policy=mode, **{name: getattr(self, name) for name in CONFIG_FIELDS})
        except (TypeError, ValueError) as exc:
            raise UsageError(f"policy settings: {exc}") from exc


def layer_block_drift(layer: LayerInputs, block_size: int) -> torch.Tensor:
    """fp32 ``[1, N]`` L2 drift of the layer's post-RoPE key centroids, ``N = ceil(L / bs)``."""
    keys = layer.key.transpose(0, 1)  # [Hkv, L, D] -> [L, Hkv, D], token-major like the cache
    centroids = block_key_centroids(keys, block_size=block_size)  # [N, Hkv, D]
    return block_drift_scores(centroids).unsqueeze(0)  # [1, N]


def layer_witness_scores(layer: LayerInputs, block_size: int, signal: str) -> Tuple[Optional[torch.Tensor], bool]:
    """Witness scores for the layer's rows: (``[1, N]`` shared or ``[T, N]`` per row, shared?).

    ``recency``: (None, False): the policy then ranks witness blocks by recency itself.
    """
    if signal == RECENCY:
        return None, False
    _, witness = _policy()
    try:
        signal = witness.WitnessSignal.parse(signal)
    except ValueError as exc:
        raise UsageError(f"--policy-witness-signal: {exc}") from exc
    if signal is witness.WitnessSignal.KEY_DRIFT:
        return layer_block_drift(layer, block_size), True
    if signal is witness.WitnessSignal.VALUE_DRIFT:
        values = layer.value.transpose(0, 1)  # [L, Hkv, D]
        cents = block_key_centroids(values, block_size=block_size)
        return block_drift_scores(cents).unsqueeze(0), True
    keys = layer.key.transpose(0, 1)  # [L, Hkv, D]
    query = layer.query.transpose(0, 1)  # [H, T, D] -> [T, H, D]
    if signal is witness.WitnessSignal.QUERY_BOUND:
        kmin, kmax = witness.block_key_bounds(keys, block_size=block_size)  # [N, Hkv, D] each
        scores = witness.query_bound_scores(query, kmin, kmax, layer.lengths, block_size, scale=layer.scaling)
        return scores, False  # [T, N]
    cents = block_key_centroids(keys, block_size=block_size)  # [N, Hkv, D]
    if signal is witness.WitnessSignal.QUERY_MASS:
        return witness.query_mass_scores(query, cents, layer.lengths, block_size, scale=layer.scaling), False
    return witness.query_centroid_scores(query, cents), False  # [T, N]


def make_policy_selector(
    mode: str, settings: SelectorSettings, policy_settings: PolicySettings = None, base_rows=None
) -> Selector:
    """Selector applying policy ``mode`` to the proxy indexer's rows (see module doc).

    ``base_rows(layer, width) -> (rows, scores)`` replaces the proxy (a degraded indexer,
    :mod:`benchmark.quality.failure_modes`); None = the proxy itself.
    """
    policy, _ = _policy()
    policy_settings = (policy_settings or PolicySettings()).for_mode(mode)
    config = policy_settings.config(mode)
    if base_rows is None:
        base_rows = lambda layer, width: learned_rows_and_scores(layer, width, settings)  # noqa: E731
    if not config.enabled:
        raise UsageError(f"--selectors: policy mode {mode!r} is disabled (it returns the learned rows: use 'learned')")

    def select_policy(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        rows, scores = base_rows(layer, width)
        T = rows.shape[0]
        witness, shared = layer_witness_scores(layer, config.block_size, policy_settings.witness_signal)
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
