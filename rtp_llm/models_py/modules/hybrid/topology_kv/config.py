"""Configuration of the topology KV policy: modes, the policy config, serving settings.

Everything here is read and validated once, at construction (``__post_init__`` or
:meth:`IndexerTopologySettings.from_env`), with errors that name the setting, the bad
value and the valid ones. Option names are parsed in one place
(:func:`parse_enum_member`): case-insensitive, surrounding blanks ignored.

Serving reads its environment variables once, when the ``Indexer`` is built (unset or
blank means the default). Each policy setting is a field of :class:`TopologyKVPolicyConfig`
that names its own variable, kind, default and help (``_setting``); the hook's own
settings are ``RTP_LLM_TOPOLOGY_KV_PATHS``, ``RTP_LLM_TOPOLOGY_KV_WITNESS_SIGNAL`` and
``RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS`` (:class:`IndexerTopologySettings`), the profile's ``RTP_LLM_TOPOLOGY_KV_PROFILE`` and
``..._PROFILE_BUDGET`` (``topology_kv.profile``). :func:`serving_variables` lists them all;
the README's settings table documents each (tested).

``fallback_disabled`` is the serving default because ``raise`` reads values on the host
(one sync per layer call), which the serving hot path must not do.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
from typing import FrozenSet, Mapping, Optional, Tuple, Union

from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import check_fraction, check_int, shown

DEFAULT_BLOCK_SIZE = 64  # the engine's KV page size (tokens per block)
# Most structural blocks a config may schedule (sink + local + witness) and most sink tokens
# (in blocks). The engine's rows are 2048 wide (32 pages of 64 tokens) and a merge mode
# injects at most W * max_structural_fraction <= W tokens, so 64 blocks (two full rows) is
# already more than any row can take; the policy's cost grows with the scheduled slots
# (local_blocks = 2000 made one call 400x slower), so larger values are rejected here.
MAX_STRUCTURAL_BLOCKS = 64


def parse_enum_member(cls, value, setting: str):
    """The one parser of option names: a member, or its value/name case-insensitively.

    Unknown names raise ``ValueError`` naming ``setting`` and listing the valid values.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in cls:
            if key in (member.value, member.name.lower()):
                return member
    valid = ", ".join(m.value for m in cls)
    raise ValueError(f"{setting}: expected one of [{valid}] (case-insensitive), got {shown(value)}")


class TopologyKVPolicyMode(enum.Enum):
    """What the policy does to the learned top-k rows."""

    DISABLED = "disabled"  # return the input tensor itself
    TOPOLOGY_SPARSE_MERGE = "topology_sparse_merge"  # learned rows + structural blocks
    TOPOLOGY_COMPRESS_SPARSE = "topology_compress_sparse"  # merge, scaffold blocks as 1 token each
    TOPOLOGY_ONLY = "topology_only"  # structural blocks only, full budget

    @classmethod
    def parse(cls, value: Union[str, "TopologyKVPolicyMode"]) -> "TopologyKVPolicyMode":
        """The one place a mode name is parsed: case-insensitive, surrounding blanks ignored."""
        return parse_enum_member(cls, value, "policy")


class CoordinateMismatchAction(enum.Enum):
    """What to do with a learned index outside its row's ``[offset, offset + length)``."""

    RAISE = "raise"  # check on the host (one sync) and raise naming row and value
    FALLBACK_DISABLED = "fallback_disabled"  # return such rows unchanged, count them; no sync

    @classmethod
    def parse(cls, value: Union[str, "CoordinateMismatchAction"]) -> "CoordinateMismatchAction":
        return parse_enum_member(cls, value, "coordinate_mismatch_action")


class StructuralBudget(enum.Enum):
    """How many structural tokens a merge mode may inject into a row of width ``W``."""

    FIXED = "fixed"  # floor(W * max_structural_fraction) per row
    SCALED = "scaled"  # that, times W / max(length, W): less structure as the row outgrows W

    @classmethod
    def parse(cls, value: Union[str, "StructuralBudget"]) -> "StructuralBudget":
        return parse_enum_member(cls, value, "structural_budget")


class TopologyKVBackend(enum.Enum):
    """Which implementation of the policy core runs (``kernels.dispatch``).

    All produce the same rows and counters bit for bit (tested); they differ in cost and
    where they run.
    """

    AUTO = "auto"  # CUDA: triton; CPU: the fused C++ kernel; else (or unavailable): torch
    TORCH = "torch"  # eager torch ops (~30 per call): the readable, always-available path
    COMPILED = "compiled"  # torch.compile(fullgraph, dynamic rows) of the torch core
    TRITON = "triton"  # one fused Triton launch per call (CUDA; CPU only under TRITON_INTERPRET=1)
    CPU_FUSED = "cpu_fused"  # one fused C++ pass per row, rows in parallel (CPU; built at first use)

    @classmethod
    def parse(cls, value: Union[str, "TopologyKVBackend"]) -> "TopologyKVBackend":
        return parse_enum_member(cls, value, "backend")


class WitnessSignal(enum.Enum):
    """What ranks the witness blocks: the one vocabulary of serving, the harness and profiles.

    The policy ranks witness blocks by whatever scores it is given, and by recency (the
    most recent eligible blocks) when given none; the signal decides what is given.
    Serving computes :attr:`served` signals only: key drift, recency and
    ``query_group_mass`` (``topology_kv/witness.py``); the other query-aware ones only the
    quality harness computes (``benchmark/candidates/witness.py``).

    AUTO           recency for ``topology_only``, key drift for the merge modes (:meth:`resolve`);
                   also spelled ``default``
    KEY_DRIFT      ``||c_k[b] - c_k[b-1]||`` of key centroids (the ``BlockDriftTracker``)
    RECENCY        no scores: witnesses are the most recent eligible blocks
    VALUE_DRIFT    the same drift on value centroids (harness only)
    QUERY_CENTROID ``sum_h relu(q_h . c_k[b, g(h)])``: DSA's indexer form at block granularity
                   (harness only)
    QUERY_MASS     the row's query against block key centroids, softmax-normalised per head
                   and summed over heads: the estimated attention mass (harness only)
    QUERY_BOUND    as QUERY_MASS with ``sum_d max(q_d kmin_d, q_d kmax_d)``, an upper bound on
                   ``q . k`` over the block as in Quest (harness only)
    QUERY_GROUP_MASS as QUERY_MASS with each KV head's group of query heads pooled to its
                   mean query: one softmax per KV head, ``H / Hkv`` times cheaper; served
                   (the caller hands the ``Indexer`` the attention queries and a tracker of
                   the layer's attention keys, ``topology_kv/witness.py``)
    """

    AUTO = "auto"
    KEY_DRIFT = "key_drift"
    RECENCY = "recency"
    VALUE_DRIFT = "value_drift"
    QUERY_CENTROID = "query_centroid"
    QUERY_MASS = "query_mass"
    QUERY_BOUND = "query_bound"
    QUERY_GROUP_MASS = "query_group_mass"

    @classmethod
    def parse(cls, value: Union[str, "WitnessSignal"], setting: str = "witness_signal") -> "WitnessSignal":
        if isinstance(value, str) and value.strip().lower() == "default":
            return cls.AUTO
        return parse_enum_member(cls, value, setting)

    @property
    def served(self) -> bool:
        """Whether the serving ``Indexer`` computes this signal."""
        return self in (WitnessSignal.AUTO, WitnessSignal.KEY_DRIFT, WitnessSignal.RECENCY,
                        WitnessSignal.QUERY_GROUP_MASS)

    def resolve(self, mode: "TopologyKVPolicyMode") -> "WitnessSignal":
        """This signal with ``AUTO`` resolved for ``mode`` (any other signal is itself).

        ``topology_only`` gets recency: with key-drift witnesses at 64-token blocks it lost
        to plain locality (sinks + most recent tokens) at every budget (W = L/16..L/4):
        +4.3..+30.9% perplexity at ctx 1024, beating it in only 4-5 of 30 layers by
        attention recall, and +3.7..+11.0% at ctx 2048 (docs/results.md); with recency it
        selects exactly locality. The merge modes keep key drift: their witnesses only add
        to the indexer's rows.
        """
        if self is not WitnessSignal.AUTO:
            return self
        if TopologyKVPolicyMode.parse(mode) is TopologyKVPolicyMode.TOPOLOGY_ONLY:
            return WitnessSignal.RECENCY
        return WitnessSignal.KEY_DRIFT


SERVED_WITNESS_SIGNALS = tuple(s for s in WitnessSignal if s.served)


class StructureLayers(enum.Enum):
    """Which sparse layers run the policy.

    ALL      every sparse layer (the default)
    SHARING  only the layers that reuse another layer's rows (``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE``);
             a scanning layer serves its own op rows unchanged. Query-aware witnesses
             repair reused rows but cost quality on a trained indexer's own rows
             (docs/results.md, "One query per KV head").
    LISTED   only the layers listed (``IndexerTopologySettings.structure_layer_list``), written
             as a comma list of layer indices: structure where it pays for its time (the
             ranking ``benchmark/topology_kv_calibrate.py --shared-structure`` prints); every
             other layer serves the rows it has (its op's, or the reused ones) unchanged.
    """

    ALL = "all"
    SHARING = "sharing"
    LISTED = "listed"  # parsed with its layers by parse_structure_layers


STRUCTURE_LAYERS_FORMS = "all, sharing or a comma list of layer indices (e.g. 1,17,24)"


def parse_structure_layers(
    value, setting: str = "structure_layers"
) -> Tuple["StructureLayers", Tuple[int, ...]]:
    """``all`` / ``sharing`` (any case), a comma list of layer indices (text, or a sequence of
    ints) -> ``(StructureLayers, layers)``: the layers ascending for ``LISTED``, else ``()``.
    ``ValueError`` naming ``setting``, the forms and the value."""
    if isinstance(value, StructureLayers):
        if value is StructureLayers.LISTED:
            raise ValueError(f"{setting}: 'listed' is written as the layers themselves ({STRUCTURE_LAYERS_FORMS})")
        return value, ()
    if isinstance(value, str):
        key = value.strip().lower()
        for member in (StructureLayers.ALL, StructureLayers.SHARING):
            if key in (member.value, member.name.lower()):
                return member, ()
        items = [x.strip() for x in key.split(",")]
        if not key or not all(re.fullmatch(r"[0-9]+", x) for x in items):
            raise ValueError(f"{setting}: expected one of [all, sharing] or a comma list of layer indices "
                             f"(e.g. 1,17,24), got {shown(value)}")
        layers = [int(x) for x in items]
    elif isinstance(value, (tuple, list, frozenset, set)) and value:
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in value):
            raise ValueError(f"{setting}: expected layer indices >= 0, got {shown(tuple(value))}")
        layers = list(value)
    else:
        raise ValueError(f"{setting}: expected {STRUCTURE_LAYERS_FORMS}, got {shown(value)}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{setting}: expected each layer once, got {shown(value)}")
    return StructureLayers.LISTED, tuple(sorted(layers))


# The serving variables (module docstring); each policy setting names its own in its field.
ENV_POLICY = "RTP_LLM_TOPOLOGY_KV_POLICY"
ENV_SINK_BLOCKS = "RTP_LLM_TOPOLOGY_KV_SINK_BLOCKS"
ENV_LOCAL_BLOCKS = "RTP_LLM_TOPOLOGY_KV_LOCAL_BLOCKS"
ENV_WITNESS_BLOCKS = "RTP_LLM_TOPOLOGY_KV_WITNESS_BLOCKS"
ENV_MAX_STRUCTURAL_FRACTION = "RTP_LLM_TOPOLOGY_KV_MAX_STRUCTURAL_FRACTION"
ENV_MISMATCH_ACTION = "RTP_LLM_TOPOLOGY_KV_MISMATCH_ACTION"
ENV_PATHS = "RTP_LLM_TOPOLOGY_KV_PATHS"
ENV_SINK_TOKENS = "RTP_LLM_TOPOLOGY_KV_SINK_TOKENS"
ENV_STRUCTURAL_BUDGET = "RTP_LLM_TOPOLOGY_KV_STRUCTURAL_BUDGET"
ENV_BACKEND = "RTP_LLM_TOPOLOGY_KV_BACKEND"
ENV_WITNESS_SIGNAL = "RTP_LLM_TOPOLOGY_KV_WITNESS_SIGNAL"
ENV_STRUCTURE_LAYERS = "RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS"


class SettingKind(enum.Enum):
    """How a policy setting is written as text (an environment variable or a flag)."""

    CHOICE = "choice"  # a member of the field's enum, case-insensitive
    COUNT = "count"  # a non-negative decimal integer, at most MAX_STRUCTURAL_BLOCKS
    SIZE = "size"  # a positive integer (not read from the environment)
    FRACTION = "fraction"  # a number in (0, 1]
    SINK_TOKENS = "sink_tokens"  # a non-negative integer, or "blocks" (None: whole sink blocks)


def _setting(default, kind: SettingKind, help: str, *, env: Optional[str] = None, structural: bool = True,
             choices=None):
    """A policy setting: its default, how it is written, its help, its serving variable.

    ``structural``: a structural setting the quality harness and the calibration vary
    (their ``--policy-*`` flags and ``PolicySettings`` fields are generated from these).
    """
    metadata = dict(kind=kind, help=help, env=env, structural=structural, choices=choices)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class TopologyKVPolicyConfig:
    """Validated, immutable policy configuration (read once, at construction).

    Attributes
    ----------
    policy : TopologyKVPolicyMode or its name (parsed case-insensitively)
    sink_blocks, local_blocks, witness_blocks : int >= 0
        Structural blocks per row (see ``schedule``). ``TOPOLOGY_ONLY``
        ignores ``witness_blocks``: witnesses fill whatever budget remains. Together (with
        token sinks counted as ``ceil(sink_tokens / block_size)`` blocks) at most
        :data:`MAX_STRUCTURAL_BLOCKS`.
    block_size : int > 0
        Tokens per block; 64 is the engine's KV page size.
    max_structural_fraction : float in (0, 1]
        Merge modes: at most ``floor(W * max_structural_fraction)`` structural tokens are
        *injected* per row (structural tokens the learned row already holds are free).
        0.25 keeps three quarters of the learned budget for the indexer.
    coordinate_mismatch_action : CoordinateMismatchAction or its name
        Default ``fallback_disabled``, the serving default too: ``raise`` reads values on
        the host (one sync per call) and so breaks CUDA-graph capture; a config built in
        Python must not get the slow, graph-breaking behaviour by default.
    sink_tokens : int >= 0 or None
        Token-granular sinks: the first ``sink_tokens`` tokens replace the ``sink_blocks``
        whole blocks, and the blocks they touch are never local or witness blocks. None
        keeps whole sink blocks. Default 4: in the quality runs (docs/results.md,
        section 6.1) 4 token sinks took ``topology_sparse_merge``
        from +8.4% to -0.3% perplexity vs the learned indexer at W = 64 (ctx 1024), left
        ``topology_compress_sparse`` unchanged within noise, and kept ``topology_only``
        from spending a tight budget on one block (perplexity 464 -> 32.6 at W = 64).
    structural_budget : StructuralBudget or its name
        ``fixed``: ``floor(W * max_structural_fraction)`` per row; ``scaled``: that
        cap times ``W / max(length, W)``, rounded down.
    backend : TopologyKVBackend or its name
        Which implementation runs (same results): ``auto`` picks the fused kernel the
        device can run (Triton on CUDA, C++ on CPU) and falls back to eager torch.
    """

    policy: TopologyKVPolicyMode = _setting(
        TopologyKVPolicyMode.DISABLED, SettingKind.CHOICE, "what the policy does to the learned rows",
        env=ENV_POLICY, structural=False, choices=TopologyKVPolicyMode)
    sink_blocks: int = _setting(
        1, SettingKind.COUNT, "whole sink blocks per row (used when sink_tokens is 'blocks')", env=ENV_SINK_BLOCKS)
    local_blocks: int = _setting(
        2, SettingKind.COUNT, "blocks ending at the row's last token (the recent window)", env=ENV_LOCAL_BLOCKS)
    witness_blocks: int = _setting(
        2, SettingKind.COUNT, "highest-scoring remaining blocks (merge modes)", env=ENV_WITNESS_BLOCKS)
    block_size: int = _setting(
        DEFAULT_BLOCK_SIZE, SettingKind.SIZE, "tokens per block (serving: the engine's KV page, 64)")
    max_structural_fraction: float = _setting(
        0.25, SettingKind.FRACTION, "merge modes: at most floor(W * fraction) structural tokens injected per row",
        env=ENV_MAX_STRUCTURAL_FRACTION)
    coordinate_mismatch_action: CoordinateMismatchAction = _setting(
        CoordinateMismatchAction.FALLBACK_DISABLED, SettingKind.CHOICE,
        "a row breaking the coordinate contract: returned unchanged and counted, or raise (one host sync)",
        env=ENV_MISMATCH_ACTION, structural=False, choices=CoordinateMismatchAction)
    sink_tokens: Optional[int] = _setting(
        4, SettingKind.SINK_TOKENS, "token-granular sinks: the first N tokens, or 'blocks' for whole sink blocks",
        env=ENV_SINK_TOKENS)
    structural_budget: StructuralBudget = _setting(
        StructuralBudget.FIXED, SettingKind.CHOICE,
        "merge modes' injection cap: fixed, or scaled by W / max(length, W)", env=ENV_STRUCTURAL_BUDGET,
        choices=StructuralBudget)
    backend: TopologyKVBackend = _setting(
        TopologyKVBackend.AUTO, SettingKind.CHOICE, "which implementation of the policy core runs",
        env=ENV_BACKEND, structural=False, choices=TopologyKVBackend)

    def __post_init__(self) -> None:
        object.__setattr__(self, "structural_budget", StructuralBudget.parse(self.structural_budget))
        object.__setattr__(self, "backend", TopologyKVBackend.parse(self.backend))
        if self.sink_tokens is not None:
            check_int("sink_tokens", self.sink_tokens, 0)
        object.__setattr__(self, "policy", TopologyKVPolicyMode.parse(self.policy))
        object.__setattr__(
            self, "coordinate_mismatch_action", CoordinateMismatchAction.parse(self.coordinate_mismatch_action)
        )
        check_int("sink_blocks", self.sink_blocks, 0, MAX_STRUCTURAL_BLOCKS)
        check_int("local_blocks", self.local_blocks, 0, MAX_STRUCTURAL_BLOCKS)
        check_int("witness_blocks", self.witness_blocks, 0, MAX_STRUCTURAL_BLOCKS)
        check_int("block_size", self.block_size, 1)
        sink_blocks = self.sink_blocks if self.sink_tokens is None else -(-self.sink_tokens // self.block_size)
        total = sink_blocks + self.local_blocks + self.witness_blocks
        if total > MAX_STRUCTURAL_BLOCKS:
            raise ValueError(
                f"sink_blocks (or sink_tokens / block_size) + local_blocks + witness_blocks: expected <= "
                f"{MAX_STRUCTURAL_BLOCKS} scheduled blocks (MAX_STRUCTURAL_BLOCKS), got {sink_blocks} + "
                f"{self.local_blocks} + {self.witness_blocks} = {total}"
            )
        check_fraction("max_structural_fraction", self.max_structural_fraction)
        sinks = self.sink_blocks if self.sink_tokens is None else self.sink_tokens
        if self.enabled and sinks + self.local_blocks + self.witness_blocks == 0:
            if self.policy is not TopologyKVPolicyMode.TOPOLOGY_ONLY:
                raise ValueError(
                    "sink_blocks (or sink_tokens) + local_blocks + witness_blocks: expected > 0 for "
                    f"{self.policy.value}, got 0 (the policy would inject nothing)"
                )

    @property
    def enabled(self) -> bool:
        return self.policy is not TopologyKVPolicyMode.DISABLED

    def structural_cap(self, width: int) -> int:
        """Most structural tokens a merge mode injects into a row of width ``width``."""
        return int(math.floor(width * self.max_structural_fraction))




class IndexerPath(enum.Enum):
    """The three top-k paths of :meth:`Indexer._compute_topk`."""

    DECODE = "decode"  # _get_topk_paged
    PREFILL = "prefill"  # _get_topk_ragged
    CP = "cp"  # _get_topk_ragged_cp


ALL_PATHS: FrozenSet[IndexerPath] = frozenset(IndexerPath)


_DECIMAL_INT = re.compile(r"[0-9]{1,9}")  # ASCII only; 9 digits is far past every cap
_DECIMAL_FRACTION = re.compile(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]{1,3})?")


def _env_value(environ: Mapping[str, str], name: str) -> Optional[str]:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    return raw


def _env_count(
    environ: Mapping[str, str], name: str, default: Optional[int], maximum: Optional[int] = None
) -> Optional[int]:
    raw = _env_value(environ, name)
    if raw is None:
        return default
    text = raw.strip()
    # Plain ASCII decimal digits only: int() would also take "+2", "3_000", non-ASCII
    # digits and 20-digit numbers, none of which a user means as a block count.
    if not _DECIMAL_INT.fullmatch(text):
        raise ValueError(
            f"{name}={shown(raw)}: expected a non-negative decimal integer (digits 0-9 only), got {shown(raw)}"
        )
    value = int(text, 10)
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={shown(raw)}: expected an integer <= {maximum}, got {value}")
    return value


def _env_fraction(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = _env_value(environ, name)
    if raw is None:
        return default
    text = raw.strip()
    if not _DECIMAL_FRACTION.fullmatch(text):  # float() would take "0_5", "nan", "١"
        raise ValueError(f"{name}={shown(raw)}: expected a number in (0, 1], got {shown(raw)}")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={shown(raw)}: expected a number in (0, 1], got {shown(raw)}") from None
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{name}={shown(raw)}: expected a number in (0, 1], got {value}")
    return value


def _env_enum(environ: Mapping[str, str], name: str, cls, default, members=None):
    """``cls.parse`` of the variable, restricted to ``members`` (default: every member)."""
    raw = _env_value(environ, name)
    if raw is None:
        return default
    members = tuple(cls) if members is None else members
    valid = ", ".join(m.value for m in members)
    try:
        value = cls.parse(raw)
    except ValueError:
        value = None
    if value not in members:
        raise ValueError(f"{name}={shown(raw)}: expected one of [{valid}] (case-insensitive), got {shown(raw)}")
    return value


def _env_paths(environ: Mapping[str, str], name: str) -> FrozenSet[IndexerPath]:
    raw = _env_value(environ, name)
    if raw is None:
        return ALL_PATHS
    valid = ", ".join(p.value for p in IndexerPath)
    paths = set()
    for item in raw.split(","):
        key = item.strip().lower()
        if key == "all":
            paths.update(IndexerPath)
            continue
        match = [p for p in IndexerPath if key == p.value]
        if not match:
            raise ValueError(
                f"{name}={shown(raw)}: expected a comma-separated list of [{valid}] or 'all', "
                f"got unknown path {shown(item.strip())}"
            )
        paths.add(match[0])
    return frozenset(paths)


def _env_setting(environ: Mapping[str, str], field: dataclasses.Field, block_size: int):
    """One policy setting from its serving variable (unset or blank: the field's default)."""
    name, kind, default = field.metadata["env"], field.metadata["kind"], field.default
    if kind is SettingKind.CHOICE:
        return _env_enum(environ, name, field.metadata["choices"], default)
    if kind is SettingKind.COUNT:
        return _env_count(environ, name, default, MAX_STRUCTURAL_BLOCKS)
    if kind is SettingKind.FRACTION:
        return _env_fraction(environ, name, default)
    if kind is SettingKind.SINK_TOKENS:
        raw = _env_value(environ, name)
        if raw is not None and raw.strip().lower() == "blocks":
            return None
        return _env_count(environ, name, default, MAX_STRUCTURAL_BLOCKS * block_size)
    raise AssertionError(f"{field.name}: a {kind.value} setting has no serving variable")


def serving_variables() -> Tuple[str, ...]:
    """Every ``RTP_LLM_TOPOLOGY_KV_*`` variable of the policy and its hook (the profile's
    two are ``topology_kv.profile``'s)."""
    fields = tuple(f.metadata["env"] for f in dataclasses.fields(TopologyKVPolicyConfig) if f.metadata.get("env"))
    return fields + (ENV_PATHS, ENV_WITNESS_SIGNAL, ENV_STRUCTURE_LAYERS)


def structural_settings() -> Tuple[dataclasses.Field, ...]:
    """The structural settings of :class:`TopologyKVPolicyConfig` (the harness and the
    calibration vary these; their flags and fields are generated from these fields)."""
    return tuple(f for f in dataclasses.fields(TopologyKVPolicyConfig) if f.metadata.get("structural"))


def setting_from_text(field: dataclasses.Field, text: str, where: str):
    """A structural setting written as text (a flag or ``KEY=VALUE``); ``ValueError`` naming ``where``."""
    kind = field.metadata["kind"]
    raw = text.strip()
    if kind is SettingKind.SINK_TOKENS and raw.lower() == "blocks":
        return None
    try:
        if kind in (SettingKind.COUNT, SettingKind.SIZE, SettingKind.SINK_TOKENS):
            return int(raw)
        if kind is SettingKind.FRACTION:
            return float(raw)
    except ValueError:
        raise ValueError(f"{where}: not a number: {shown(text)}") from None
    return field.metadata["choices"].parse(raw).value


@dataclasses.dataclass(frozen=True)
class IndexerTopologySettings:
    """What the indexer's policy hook does; immutable, validated once.

    Attributes
    ----------
    policy : TopologyKVPolicyConfig
        Mode, block counts, structural fraction, mismatch action. Its ``block_size`` is
        the drift block (the KV page, 64 tokens).
    paths : frozenset of IndexerPath
        Paths the policy runs on when enabled; the others return the op's rows unchanged.
    witness_signal : WitnessSignal (a served one) or its name
        What the ``Indexer`` passes as witness scores: ``auto`` (default; recency for
        ``topology_only``, key drift for the merge modes), ``key_drift`` (the caller's
        ``BlockDriftTracker``), ``recency`` (no scores, no tracker needed) or
        ``query_group_mass`` (each row's attention queries, handed in by the caller, against
        the block centroids of a tracker the caller feeds with the layer's attention keys).
    structure_layers : StructureLayers, its name, or the layers themselves
        ``all`` (default); ``sharing``: with shared indexer scans, the policy only in the
        layers that reuse another layer's rows (the ``Indexer`` of a scanning layer then
        serves its op rows, skip reason ``scanning_layer``); or a comma list of layer
        indices (text or ints): the policy only in those layers (``LISTED``; the others
        serve their rows unchanged, skip reason ``unlisted_layer``).
    structure_layer_list : the listed layers, ascending (set from ``structure_layers``;
        empty unless it is ``LISTED``)
    """

    policy: TopologyKVPolicyConfig = dataclasses.field(default_factory=TopologyKVPolicyConfig)
    paths: FrozenSet[IndexerPath] = ALL_PATHS
    witness_signal: WitnessSignal = WitnessSignal.AUTO
    structure_layers: StructureLayers = StructureLayers.ALL
    structure_layer_list: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.policy, TopologyKVPolicyConfig):
            raise TypeError(f"policy: expected TopologyKVPolicyConfig, got {type(self.policy).__name__}")
        try:
            signal = WitnessSignal.parse(self.witness_signal)
        except ValueError:
            signal = None
        if signal is None or not signal.served:
            valid = ", ".join(s.value for s in SERVED_WITNESS_SIGNALS)
            raise ValueError(
                f"witness_signal: expected one of [{valid}] (case-insensitive; what serving computes), "
                f"got {self.witness_signal!r}"
            )
        object.__setattr__(self, "witness_signal", signal)
        if self.structure_layers is StructureLayers.LISTED and self.structure_layer_list:
            kind, listed = parse_structure_layers(tuple(self.structure_layer_list))
        else:
            kind, listed = parse_structure_layers(self.structure_layers)
            if self.structure_layer_list and tuple(self.structure_layer_list) != listed:
                raise ValueError(f"structure_layer_list: expected it only with structure_layers listed, "
                                 f"got {shown(self.structure_layer_list)} with {shown(self.structure_layers)}")
        object.__setattr__(self, "structure_layers", kind)
        object.__setattr__(self, "structure_layer_list", listed)
        paths = frozenset(self.paths)
        for p in paths:
            if not isinstance(p, IndexerPath):
                raise TypeError(f"paths: expected IndexerPath members, got {p!r}")
        object.__setattr__(self, "paths", paths)

    @property
    def enabled(self) -> bool:
        return self.policy.enabled

    def applies_to(self, path: IndexerPath) -> bool:
        return self.enabled and path in self.paths

    @property
    def resolved_witness_signal(self) -> WitnessSignal:
        """``KEY_DRIFT``, ``RECENCY`` or ``QUERY_GROUP_MASS``: :attr:`witness_signal` with ``auto``
        resolved for the mode."""
        return self.witness_signal.resolve(self.policy.policy)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] = os.environ, *, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> "IndexerTopologySettings":
        """Read the ``RTP_LLM_TOPOLOGY_KV_*`` variables (module docstring); ``ValueError``
        naming the variable and its value on anything invalid."""
        values = {
            f.name: _env_setting(environ, f, block_size)
            for f in dataclasses.fields(TopologyKVPolicyConfig)
            if f.metadata.get("env") is not None
        }
        paths = _env_paths(environ, ENV_PATHS)
        witness_signal = _env_enum(environ, ENV_WITNESS_SIGNAL, WitnessSignal, WitnessSignal.AUTO, SERVED_WITNESS_SIGNALS)
        structure_layers = _env_value(environ, ENV_STRUCTURE_LAYERS)
        if structure_layers is None:
            structure_layers = StructureLayers.ALL
        else:
            try:
                parse_structure_layers(structure_layers)
            except ValueError:
                raise ValueError(f"{ENV_STRUCTURE_LAYERS}={shown(structure_layers)}: expected "
                                 f"{STRUCTURE_LAYERS_FORMS}, got {shown(structure_layers)}") from None
        try:
            policy = TopologyKVPolicyConfig(block_size=block_size, **values)
        except ValueError as err:
            sink_tokens = values["sink_tokens"]
            raise ValueError(
                f"{ENV_POLICY}={values['policy'].value!r} with {ENV_SINK_BLOCKS}={values['sink_blocks']}, "
                f"{ENV_SINK_TOKENS}={'blocks' if sink_tokens is None else sink_tokens}, "
                f"{ENV_LOCAL_BLOCKS}={values['local_blocks']}, {ENV_WITNESS_BLOCKS}={values['witness_blocks']}: {err}"
            ) from None
        return cls(policy=policy, paths=paths, witness_signal=witness_signal, structure_layers=structure_layers)

