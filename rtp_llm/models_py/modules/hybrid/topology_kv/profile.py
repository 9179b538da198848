"""Per-layer structural budgets from an offline calibration (docs/profile.md).

A profile is a JSON file written by ``benchmark/topology_kv_calibrate.py``: for each
full-attention layer of one model and each calibrated budget (``W / context``, e.g.
``"1/16"``), the structural settings of its policy mode that measured the least
attention-output error against dense. A merge-mode profile may give share 0: the layer then
skips the policy (the learned rows are returned as they are, at zero cost). A
``topology_only`` profile gives every layer share 1 (the structure is the whole row; there
are no learned rows to fall back on) and varies the sink tokens per layer.

Serving reads it once, when each ``Indexer`` is built (``RTP_LLM_TOPOLOGY_KV_PROFILE``),
checks it against the model it serves (:class:`ModelFingerprint`, given by the caller),
picks one budget entry (:meth:`TopologyKVProfile.pick_budget`) and turns the layer's entry
into that layer's own immutable :class:`IndexerTopologySettings`
(:func:`layer_topology_settings`). Nothing of it runs per call.

Every error is a ``ValueError`` naming the file and the field, expected vs got.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import stat
from fractions import Fraction
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import check_scanning_layers, shown
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    ENV_WITNESS_SIGNAL,
    IndexerTopologySettings,
    SERVED_WITNESS_SIGNALS,
    WitnessSignal,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)

PROFILE_FORMAT = "rtp_llm.topology_kv_profile"
PROFILE_VERSION = 1
ENV_PROFILE = "RTP_LLM_TOPOLOGY_KV_PROFILE"
ENV_PROFILE_BUDGET = "RTP_LLM_TOPOLOGY_KV_PROFILE_BUDGET"
# The largest calibrated profiles are 0.7 MB (benchmark/profiles/smollm2_135m_merge.json and
# smollm2_135m_trained_merge.json, 30 layers x 3 budgets: about 7.5 KB per (layer, budget)
# entry with 29 candidates); 16 MiB holds about 2,200 such entries (DeepSeek-V3.2's 61
# layers x 30 budgets, or 700 layers x 3) and bounds the read. A scanning set's pairwise
# reuse costs add N(N-1) numbers for N sparse layers: 27 KB at 30, about 0.12 MB at 61.
MAX_PROFILE_BYTES = 16 << 20
# Integers in a profile are layer indices, counts and context lengths: 18 digits fit int64
# and are far past every one of them. Longer ones are refused by the field that holds them.
MAX_INT_DIGITS = 18

_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,8}")  # canonical ASCII decimal: no sign, space, "_" or leading 0
_BUDGET_TEXT = re.compile(r"[0-9]+/[0-9]+|[0-9]*\.?[0-9]+")  # ASCII: Fraction() also takes "١/١٦", "1_0/160"


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """What a profile was calibrated on; serving must present the same model.

    gguf_sha256 : hex sha256 of the weights file (the GGUF the calibration loaded)
    name : a human-readable name (informational: not compared, a renamed file is the same model)
    num_layers : decoder layers
    full_attention_layers : indices of the layers whose attention the policy serves
    """

    gguf_sha256: str
    name: str
    num_layers: int
    full_attention_layers: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.gguf_sha256, str) or not _SHA256.fullmatch(self.gguf_sha256.strip()):
            raise ValueError(f"gguf_sha256: expected a hex sha256 (64 hex digits), got {shown(self.gguf_sha256)}")
        if not isinstance(self.name, str):
            raise ValueError(f"name: expected a string, got {shown(self.name)}")
        layers = tuple(self.full_attention_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
            raise ValueError(f"full_attention_layers: expected integers, got {shown(list(layers))}")
        object.__setattr__(self, "gguf_sha256", self.gguf_sha256.strip().lower())
        object.__setattr__(self, "full_attention_layers", layers)
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"num_layers: expected an int >= 1, got {shown(self.num_layers)}")
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"full_attention_layers: expected indices in [0, {self.num_layers}), got {bad}")

    @classmethod
    def for_gguf_file(
        cls, path: Union[str, Path], num_layers: int, full_attention_layers, name: Optional[str] = None
    ) -> "ModelFingerprint":
        """The fingerprint of a GGUF file (reads it once: sha256 in 1 MiB chunks)."""
        path = Path(path)
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return cls(digest.hexdigest(), name or path.name, num_layers, tuple(full_attention_layers))

    def matches(self, other: "ModelFingerprint") -> bool:
        return (self.gguf_sha256, self.num_layers, self.full_attention_layers) == (
            other.gguf_sha256,
            other.num_layers,
            other.full_attention_layers,
        )

    def to_json(self) -> Dict[str, Any]:
        return {
            "gguf_sha256": self.gguf_sha256,
            "name": self.name,
            "num_layers": self.num_layers,
            "full_attention_layers": list(self.full_attention_layers),
        }

    def describe(self) -> str:
        return (
            f"{self.name} (sha256 {self.gguf_sha256[:16]}..., {self.num_layers} layers, "
            f"full attention {list(self.full_attention_layers)})"
        )


@dataclasses.dataclass(frozen=True)
class LayerBudgetSetting:
    """One layer's structural settings at one budget.

    max_structural_fraction : share of ``W`` the structure may take; 0 = skip the policy
        on this layer (the learned rows are returned unchanged). ``topology_only``: always 1
    sink_tokens, local_blocks, witness_blocks : the components (0 = off), as in
        :class:`TopologyKVPolicyConfig`
    """

    max_structural_fraction: float
    sink_tokens: int
    local_blocks: int
    witness_blocks: int

    @property
    def skipped(self) -> bool:
        return self.max_structural_fraction == 0

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def budget_key(budget: Fraction) -> str:
    """``Fraction(1, 16)`` -> ``"1/16"`` (the profile's budget keys)."""
    return f"{budget.numerator}/{budget.denominator}"


@dataclasses.dataclass(frozen=True)
class TopologyKVProfile:
    """A validated profile (:func:`load_topology_profile`).

    layers : layer index -> budget -> :class:`LayerBudgetSetting`, for every full-attention
        layer of ``model`` and every budget of ``budgets``
    reference_context : the longest calibrated context, the one :meth:`pick_budget` divides by
    witness_signal : what ranked the witness blocks during calibration (``key_drift`` or
        ``recency``); serving must resolve to the same (:func:`layer_topology_settings`).
        None: not recorded (not checked)
    scanning_layers : the full-attention layers that run the indexer scan when the others
        share it (the profile's optional ``indexer_share.scanning``, served with
        ``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=profile``); None: the profile chose none
    """

    path: str
    model: ModelFingerprint
    text: Mapping[str, str]
    policy: TopologyKVPolicyMode
    block_size: int
    contexts: Tuple[int, ...]
    budgets: Tuple[Fraction, ...]
    command: str
    layers: Mapping[int, Mapping[Fraction, LayerBudgetSetting]]
    witness_signal: Optional[WitnessSignal] = None
    scanning_layers: Optional[Tuple[int, ...]] = None

    @property
    def reference_context(self) -> int:
        return max(self.contexts)

    def pick_budget(self, width: int, override: Optional[Union[str, Fraction]] = None) -> Fraction:
        """The budget entry serving uses at top-k width ``width`` (docs/profile.md).

        ``override`` (``RTP_LLM_TOPOLOGY_KV_PROFILE_BUDGET``) must be one of the profile's
        budgets. Otherwise: the calibrated budget nearest to ``width / reference_context``
        in log scale (budgets are calibrated a factor of 2 apart), the smaller on a tie.
        """
        if override is not None:
            value = override if isinstance(override, Fraction) else None
            text = str(override).strip()
            if value is None and _BUDGET_TEXT.fullmatch(text):
                try:
                    value = Fraction(text)
                except (ValueError, ZeroDivisionError):
                    value = None
            if value not in self.budgets:
                raise ValueError(
                    f"{ENV_PROFILE_BUDGET}: expected one of the budgets (ASCII digits) of {self.path} "
                    f"[{', '.join(budget_key(b) for b in self.budgets)}], got {shown(override)}"
                )
            return value
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width: expected an int >= 1 (the top-k width W), got {width!r}")
        return self.nearest_budget(Fraction(width, self.reference_context))

    def nearest_budget(self, target: Fraction) -> Fraction:
        """The calibrated budget nearest to the fraction ``target`` in log scale, the smaller
        on a tie (:meth:`pick_budget`'s rule; the quality harness and the end-to-end
        benchmark's ``--profile-budget context`` apply it to ``W / context``)."""
        if not isinstance(target, Fraction) or target <= 0:
            raise ValueError(f"target: expected a Fraction > 0, got {target!r}")
        # max(b / t, t / b) is exp|log b - log t|, in exact arithmetic (ties are real ties).
        return min(self.budgets, key=lambda b: (max(b / target, target / b), b))

    def served_mode(self, requested: Optional[TopologyKVPolicyMode] = None) -> TopologyKVPolicyMode:
        """The mode the profile's entries run under when serving asks for ``requested``.

        None or ``disabled``: the profile's own mode. A merge-mode profile serves either merge
        mode (the entries mean the same: a share of ``W`` and its components; only the
        compression of scaffold blocks differs); a ``topology_only`` profile serves only
        ``topology_only`` (its entries are whole rows), and a merge mode cannot take it.
        """
        if requested is None or requested is TopologyKVPolicyMode.DISABLED:
            return self.policy
        requested = TopologyKVPolicyMode.parse(requested)
        merge = (TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE, TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE)
        if requested is self.policy or (requested in merge and self.policy in merge):
            return requested
        allowed = [m.value for m in merge] if self.policy in merge else [self.policy.value]
        raise ValueError(
            f"{self.path}: settings.policy: the profile calibrated {self.policy.value!r} but the policy is set "
            f"to {requested.value!r}; unset it or set it to one of {allowed}"
        )

    def setting(self, layer_idx: int, budget: Fraction) -> Optional[LayerBudgetSetting]:
        """The layer's entry, or None for a layer the profile does not cover (not full attention)."""
        entry = self.layers.get(layer_idx)
        return None if entry is None else entry[budget]

    def layer_config(
        self, layer_idx: int, budget: Fraction, base: TopologyKVPolicyConfig, mode: Optional[TopologyKVPolicyMode] = None
    ) -> TopologyKVPolicyConfig:
        """``base`` with this layer's structure; ``policy=disabled`` for a skipped or uncovered layer.

        Mode: :meth:`served_mode` of ``mode`` (default the profile's). Block size comes from
        the profile; the mismatch action, budget rule and backend from ``base`` (the environment).
        """
        mode = self.served_mode(mode)
        entry = self.setting(layer_idx, budget)
        if entry is None or entry.skipped:
            return dataclasses.replace(base, policy=TopologyKVPolicyMode.DISABLED, block_size=self.block_size)
        # The entry's four fields are TopologyKVPolicyConfig's own names.
        return dataclasses.replace(base, policy=mode, block_size=self.block_size, **entry.to_json())


# ----------------------------------------------------------------------------- loading


def _field(where: str, obj: Mapping[str, Any], name: str, kind, what: str):
    if not isinstance(obj, dict) or name not in obj:
        raise ValueError(f"{where}.{name}: expected {what}, missing")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):  # a bool is no number here
        raise ValueError(f"{where}.{name}: expected {what}, got {shown(value)}")
    return value


def _parse_budget(where: str, text: Any) -> Fraction:
    """A budget written the one canonical way, ``n/d`` in lowest terms (``"1/16"``): ``"2/32"``,
    ``"0.0625"`` or ``" 1/16"`` would name the same budget as another key, the last one winning."""
    value = None
    if isinstance(text, str) and _BUDGET_TEXT.fullmatch(text):
        try:
            value = Fraction(text)
        except (ValueError, ZeroDivisionError):
            value = None
    if value is None or not 0 < value <= 1:
        raise ValueError(f"{where}: expected a budget in (0, 1] such as \"1/16\", got {shown(text)}")
    if budget_key(value) != text:
        raise ValueError(
            f"{where}: expected the budget written n/d in lowest terms, got {shown(text)} "
            f"(its canonical form {budget_key(value)!r})"
        )
    return value


class _LongInteger:
    """A JSON integer of more than :data:`MAX_INT_DIGITS` digits, kept for the field's error
    (``int()`` of 5000 digits raises Python's digit-limit error, naming no file or field)."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


class _DuplicateKeys(dict):
    """A JSON object that named a key twice (``duplicates``), refused with its path."""

    duplicates: Tuple[str, ...] = ()


def _object_pairs(pairs):
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen, dups = set(), []
    for key, _ in pairs:
        if key in seen:
            dups.append(key)
        seen.add(key)
    obj = _DuplicateKeys(obj)
    obj.duplicates = tuple(dups)
    return obj


def _parse_int(text: str):
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else _LongInteger(text)


def _refuse_duplicates(source: str, data: Any) -> None:
    """The first object with a key given twice, named by its path (iterative: any depth)."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _DuplicateKeys):
            where = path or "the top-level object"
            raise ValueError(f"{source}: {where}: duplicate key {shown(value.duplicates[0])} (each key once)")
        if isinstance(value, dict):
            stack.extend((f"{path}.{_key(k)}" if path else _key(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def _key(key: str, limit: int = 40) -> str:
    """A JSON key as a path component in a message, cut when long."""
    return key if len(key) <= limit else f"{key[:limit]}... ({len(key)} characters)"


def _display_path(path: str, limit: int = 200) -> str:
    return path if len(path) <= limit else f"{path[:limit]}... ({len(path)} characters)"


def _parse_setting(where: str, raw: Any, policy: TopologyKVPolicyMode, block_size: int) -> LayerBudgetSetting:
    share = _field(where, raw, "max_structural_fraction", (int, float), "a number in [0, 1] (0 = skip the layer)")
    counts = {
        name: _field(where, raw, name, int, "an integer >= 0") for name in ("sink_tokens", "local_blocks", "witness_blocks")
    }
    unknown = sorted(set(raw) - {"max_structural_fraction", *counts})
    if unknown:
        raise ValueError(
            f"{where}: unknown fields {unknown}; expected max_structural_fraction, sink_tokens, "
            "local_blocks, witness_blocks"
        )
    if not (math.isfinite(share) and 0 <= share <= 1):
        raise ValueError(f"{where}.max_structural_fraction: expected a number in [0, 1], got {share!r}")
    if policy is TopologyKVPolicyMode.TOPOLOGY_ONLY and share != 1:
        raise ValueError(
            f"{where}.max_structural_fraction: expected 1 for a topology_only profile (the structure is "
            f"the whole row; a layer cannot skip to learned rows it does not have), got {share!r}"
        )
    setting = LayerBudgetSetting(float(share), **counts)
    if not setting.skipped:
        try:  # the same validation as every other config
            TopologyKVPolicyConfig(policy=policy, block_size=block_size, **setting.to_json())
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: invalid settings: {err}") from None
    else:
        bad = {k: v for k, v in counts.items() if v < 0}
        if bad:
            raise ValueError(f"{where}: expected integers >= 0, got {bad}")
    return setting


def _parse_witness_signal(
    where: str, settings: Mapping[str, Any], policy: TopologyKVPolicyMode
) -> Optional[WitnessSignal]:
    """``settings.witness_signal`` resolved for ``policy``; absent = None (not checked).

    ``default`` (the harness's name) and ``auto`` resolve as serving's ``auto`` does; a signal
    serving cannot compute (the harness's query-aware ones) is refused.
    """
    if "witness_signal" not in settings:
        return None
    raw = settings["witness_signal"]
    try:
        signal = WitnessSignal.parse(raw)
    except (TypeError, ValueError):
        signal = None
    if signal is None or not signal.served:
        valid = ", ".join(s.value for s in SERVED_WITNESS_SIGNALS)
        raise ValueError(
            f"{where}.witness_signal: expected a signal serving computes ({valid}, or default), got {shown(raw)}"
        )
    return signal.resolve(policy)


def parse_topology_profile(
    data: Any, *, model_fingerprint: ModelFingerprint, source: str = "<profile>"
) -> TopologyKVProfile:
    """Validate decoded profile JSON (:func:`load_topology_profile` without the file)."""
    if not isinstance(model_fingerprint, ModelFingerprint):
        raise TypeError(f"model_fingerprint: expected ModelFingerprint, got {type(model_fingerprint).__name__}")
    return _parse_profile(data, model_fingerprint, source)


def read_profile_file(path: Union[str, Path]) -> Tuple[Dict[str, Any], TopologyKVProfile]:
    """The decoded JSON of a profile file and the profile, validated for the model it names.

    For tools that rewrite a profile without loading its model; serving loads a profile
    for its own model with :func:`load_topology_profile`.
    """
    data, source = read_profile_json(path)
    return data, _parse_profile(data, None, source)


def _parse_profile(data: Any, model_fingerprint: Optional[ModelFingerprint], source: str) -> TopologyKVProfile:
    """:func:`parse_topology_profile`; ``model_fingerprint`` None accepts the profile's own model."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != PROFILE_FORMAT:
        raise ValueError(f"{source}: format: expected {PROFILE_FORMAT!r}, got {shown(fmt)}")
    version = data.get("version")
    if isinstance(version, bool) or version != PROFILE_VERSION:  # True == 1 in Python
        raise ValueError(f"{source}: version: expected {PROFILE_VERSION}, got {shown(version)}")
    raw_model = _field(source, data, "model", dict, "the model's fingerprint object")
    where = f"{source}: model"
    raw_layer_list = _field(where, raw_model, "full_attention_layers", list, "a list of layer indices")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in raw_layer_list):
        raise ValueError(f"{where}.full_attention_layers: expected a list of integers (layer indices), "
                         f"got {shown(raw_layer_list)}")
    try:
        model = ModelFingerprint(
            gguf_sha256=_field(where, raw_model, "gguf_sha256", str, "a hex sha256"),
            name=_field(where, raw_model, "name", str, "a string"),
            num_layers=_field(where, raw_model, "num_layers", int, "an integer >= 1"),
            full_attention_layers=tuple(_field(where, raw_model, "full_attention_layers", list, "a list of layer indices")),
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None
    if model_fingerprint is not None and not model.matches(model_fingerprint):
        raise ValueError(
            f"{source}: model: the profile was made for {model.describe()}, but this model is "
            f"{model_fingerprint.describe()}; calibrate this model (benchmark/topology_kv_calibrate.py)"
        )
    text = _field(source, data, "text", dict, "an object with name and sha256")
    for name in ("name", "sha256"):
        _field(f"{source}: text", text, name, str, "a string")
    command = _field(source, data, "command", str, "the command line that made the profile")
    settings = _field(source, data, "settings", dict, "the calibration settings object")
    where = f"{source}: settings"
    try:
        policy = TopologyKVPolicyMode.parse(_field(where, settings, "policy", str, "a policy mode name"))
    except ValueError as err:
        raise ValueError(f"{where}.policy: {err}") from None
    if policy is TopologyKVPolicyMode.DISABLED:
        raise ValueError(f"{where}.policy: expected an enabled mode, got {policy.value!r}")
    witness_signal = _parse_witness_signal(where, settings, policy)
    block_size = _field(where, settings, "block_size", int, "an integer >= 1")
    if block_size < 1:
        raise ValueError(f"{where}.block_size: expected an integer >= 1, got {block_size}")
    contexts = tuple(_field(where, settings, "contexts", list, "a list of context lengths"))
    if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in contexts):
        raise ValueError(f"{where}.contexts: expected a non-empty list of integers >= 1, got {shown(list(contexts))}")
    raw_budgets = _field(where, settings, "budgets", list, "a list of budgets such as \"1/16\"")
    if not raw_budgets:
        raise ValueError(f"{where}.budgets: expected a non-empty list, got []")
    parsed = [_parse_budget(f"{where}.budgets", b) for b in raw_budgets]
    for i, b in enumerate(parsed):
        if b in parsed[:i]:
            raise ValueError(f"{where}.budgets: duplicate budget {budget_key(b)!r} (each budget once)")
    budgets = tuple(sorted(parsed))
    raw_layers = _field(source, data, "layers", dict, "an object: layer index -> budget -> settings")
    layers: Dict[int, Dict[Fraction, LayerBudgetSetting]] = {}
    for key, per_budget in raw_layers.items():
        # One spelling per layer: int() would also read "011", "+11", " 11 ", "1_1" and
        # non-ASCII digits as 11, and the last of them would silently win.
        if not _LAYER_KEY.fullmatch(key):
            raise ValueError(
                f"{source}: layers.{_key(key)}: expected a layer index in canonical decimal (digits 0-9, "
                f"no sign, space, underscore or leading zero), got {shown(key)}"
            )
        layer = int(key, 10)
        if layer not in model.full_attention_layers:
            raise ValueError(
                f"{source}: layers.{key}: expected a full-attention layer of the model "
                f"{list(model.full_attention_layers)}, got {layer}"
            )
        if not isinstance(per_budget, dict):
            raise ValueError(f"{source}: layers.{key}: expected an object budget -> settings, got {shown(per_budget)}")
        entry: Dict[Fraction, LayerBudgetSetting] = {}
        for bkey, raw in per_budget.items():
            bkey_shown = _key(bkey)
            budget = _parse_budget(f"{source}: layers.{key}.{bkey_shown}", bkey)
            if budget not in budgets:
                raise ValueError(
                    f"{source}: layers.{key}.{bkey}: unknown budget key; expected one of settings.budgets "
                    f"[{', '.join(budget_key(b) for b in budgets)}]"
                )
            entry[budget] = _parse_setting(f"{source}: layers.{key}.{bkey}", raw, policy, block_size)
        missing = [budget_key(b) for b in budgets if b not in entry]
        if missing:
            raise ValueError(f"{source}: layers.{key}: missing budgets {missing}")
        layers[layer] = entry
    missing_layers = [i for i in model.full_attention_layers if i not in layers]
    if missing_layers:
        raise ValueError(
            f"{source}: layers: missing full-attention layers {missing_layers} "
            f"(expected all of {list(model.full_attention_layers)})"
        )
    scanning = _parse_indexer_share(source, data, model, policy)
    return TopologyKVProfile(
        path=source,
        model=model,
        text=dict(text),
        policy=policy,
        block_size=block_size,
        contexts=tuple(sorted(contexts)),
        budgets=budgets,
        command=command,
        layers=layers,
        witness_signal=witness_signal,
        scanning_layers=scanning,
    )


def _parse_indexer_share(
    source: str, data: Mapping[str, Any], model: ModelFingerprint, policy: TopologyKVPolicyMode
) -> Optional[Tuple[int, ...]]:
    """The optional ``indexer_share`` object's ``scanning`` list, validated; None when absent."""
    if "indexer_share" not in data:
        return None
    where = f"{source}: indexer_share"
    raw = _field(source, data, "indexer_share", dict, "an object with the scanning layers")
    if policy is TopologyKVPolicyMode.TOPOLOGY_ONLY:
        raise ValueError(f"{where}: expected no scanning set in a topology_only profile (that mode replaces the "
                         f"rows a sharing layer would reuse), got {shown(raw.get('scanning'))}")
    layers = _field(where, raw, "scanning", list, "a list of layer indices")
    if any(isinstance(x, bool) or not isinstance(x, int) for x in layers):
        raise ValueError(f"{where}.scanning: expected a list of integers (layer indices), got {shown(layers)}")
    check_scanning_layers(layers, model.full_attention_layers, f"{where}.scanning")
    return tuple(layers)


def load_topology_profile(path: Union[str, Path], *, model_fingerprint: ModelFingerprint) -> TopologyKVProfile:
    """Read and validate the profile at ``path`` for the model ``model_fingerprint``.

    Raises ``ValueError`` naming the file and the field: unreadable file or bad JSON,
    wrong format/version, a profile made for another model (both fingerprints given),
    missing layers or budgets, unknown budget keys, settings the policy config rejects.
    """
    data, source = read_profile_json(path)
    return parse_topology_profile(data, model_fingerprint=model_fingerprint, source=source)


def read_profile_json(path: Union[str, Path]) -> Tuple[Any, str]:
    """The decoded JSON of the file at ``path`` and its display name, not yet validated.

    The read is bounded and never blocks (:func:`_read_profile_text`); a duplicate key or
    bad JSON is a ``ValueError`` naming the file.
    """
    source = _display_path(str(path))
    text = _read_profile_text(path, source)
    try:
        data = json.loads(text, object_pairs_hook=_object_pairs, parse_int=_parse_int)
    except RecursionError:
        raise ValueError(f"{source}: not valid JSON: nested too deeply (a profile is 4 levels deep)") from None
    except ValueError as err:  # json.JSONDecodeError and every other decoding error
        raise ValueError(f"{source}: not valid JSON: {shown(str(err))}") from None
    _refuse_duplicates(source, data)
    return data, source


def _read_profile_text(path: Union[str, Path], source: str) -> str:
    """The file's text: a regular file of at most :data:`MAX_PROFILE_BYTES`, UTF-8.

    Opened with ``O_NONBLOCK`` and checked with ``fstat`` before any read, so a FIFO (which
    would block the ``Indexer`` constructor until a writer came), a device such as
    ``/dev/zero`` (endless) or a directory is refused at once; the read is bounded too, in
    case the file grows after the check.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ValueError(f"{source}: cannot read the topology KV profile: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode)
                    else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "a socket")
            raise ValueError(f"{source}: not a regular file ({kind}); expected a profile JSON file")
        if info.st_size > MAX_PROFILE_BYTES:
            raise ValueError(
                f"{source}: {info.st_size} bytes, more than the {MAX_PROFILE_BYTES} byte cap of a profile"
            )
        chunks, size = [], 0
        while size <= MAX_PROFILE_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_PROFILE_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise ValueError(f"{source}: cannot read the topology KV profile: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if size > MAX_PROFILE_BYTES:
        raise ValueError(f"{source}: more than the {MAX_PROFILE_BYTES} byte cap of a profile (it grew while read)")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{source}: cannot read the topology KV profile: not UTF-8 ({err.reason} at byte "
                         f"{err.start})") from None


@functools.lru_cache(maxsize=8)
def _cached_profile(path: str, mtime_ns: int, size: int, fingerprint: ModelFingerprint) -> TopologyKVProfile:
    return load_topology_profile(path, model_fingerprint=fingerprint)


def profile_from_env(
    environ: Mapping[str, str] = os.environ, *, model_fingerprint: Optional[ModelFingerprint]
) -> Tuple[Optional[TopologyKVProfile], Optional[str]]:
    """``(profile, budget override)`` from ``RTP_LLM_TOPOLOGY_KV_PROFILE[_BUDGET]``; (None, None) when unset.

    The file is parsed once per (path, modification time, size, model), not once per
    layer: every ``Indexer`` of a model gets the same object.
    """
    raw = environ.get(ENV_PROFILE)
    override = environ.get(ENV_PROFILE_BUDGET)
    override = override.strip() if override and override.strip() else None
    if raw is None or not raw.strip():
        if override is not None:
            raise ValueError(f"{ENV_PROFILE_BUDGET}={shown(override)}: expected {ENV_PROFILE} to be set too")
        return None, None
    if model_fingerprint is None:
        raise ValueError(
            f"{ENV_PROFILE}={shown(raw)}: expected the Indexer to be built with model_fingerprint= "
            "(ModelFingerprint of the served model) so the profile can be checked against it, got None"
        )
    path = raw.strip()
    try:
        stat = os.stat(path)
    except OSError as err:
        raise ValueError(
            f"{ENV_PROFILE}={shown(raw)}: cannot read the topology KV profile: {err.strerror or err}"
        ) from None
    try:
        return _cached_profile(path, stat.st_mtime_ns, stat.st_size, model_fingerprint), override
    except ValueError as err:
        raise ValueError(f"{ENV_PROFILE}: {err}") from None


def layer_topology_settings(
    settings: IndexerTopologySettings,
    profile: TopologyKVProfile,
    layer_idx: Optional[int],
    width: int,
    budget_override: Optional[Union[str, Fraction]] = None,
) -> IndexerTopologySettings:
    """One layer's settings: ``settings`` with the profile's entry for this layer at the picked budget.

    ``width`` is the layer's top-k width ``W``; the block size of ``settings`` must equal the
    profile's (the KV page the calibration used). ``layer_idx`` is required and must be a
    layer of the profile's model (:func:`check_profile_layer`).
    """
    if settings.policy.block_size != profile.block_size:
        raise ValueError(
            f"{profile.path}: settings.block_size: expected {settings.policy.block_size} (the indexer's KV "
            f"page), got {profile.block_size}"
        )
    mode = profile.served_mode(settings.policy.policy)
    served = settings.witness_signal.resolve(mode)
    if profile.witness_signal is not None and served is not profile.witness_signal:
        raise ValueError(
            f"{profile.path}: settings.witness_signal: the profile was calibrated with "
            f"{profile.witness_signal.value!r} witnesses, but serving resolves to {served.value!r}; "
            f"set {ENV_WITNESS_SIGNAL} to {profile.witness_signal.value!r} or calibrate with "
            f"--witness-signal {served.value}"
        )
    check_profile_layer(profile, layer_idx)
    budget = profile.pick_budget(width, budget_override)
    config = profile.layer_config(layer_idx, budget, settings.policy, mode)
    return dataclasses.replace(settings, policy=config)


def check_profile_layer(profile: TopologyKVProfile, layer_idx: Any) -> None:
    """``layer_idx`` is a layer of the profile's model, ``[0, num_layers)``.

    Without it every layer would take layer 0's entry; past the model (or negative) it would
    silently find no entry and serve the layer without the policy.
    """
    if layer_idx is None:
        raise ValueError(
            f"layer_idx: expected the layer's index with a profile, got None ({profile.path} gives each "
            "layer its own entry)"
        )
    n = profile.model.num_layers
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < n:
        raise ValueError(
            f"layer_idx: expected a layer of the profile's model [0, {n}) ({profile.path}), got {shown(layer_idx)}"
        )
