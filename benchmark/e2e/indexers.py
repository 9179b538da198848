"""The variants' ``Indexer``: the trained indexer (default) or the untrained proxy, and the variants.

The learned variants rank with the trained indexer (``--indexer trained``: a checkpoint
of ``benchmark/trained_indexers/``, :class:`TrainedIndexerInputs`), or with the untrained
proxy (``--indexer proxy``, a null model: :mod:`benchmark.quality.proxy_indexers`). Its
shape presets (``--indexer-preset``: ``dsa-ratio``, ``model``) are described there.
``--indexer-heads`` / ``--indexer-dim`` override the proxy preset's shape.

Variants, one budget ``W`` (``--budget``):

* ``dense``              attention over every cached token (no ``Indexer``);
* ``learned``            ``Indexer._compute_topk`` (paged decode op over the block table,
                         top-``W``, policy disabled);
* ``learned+<mode>``     the same ``Indexer`` with the topology policy enabled for ``mode``;
* ``topology_only_noscan`` an ``Indexer`` whose decode op does no scan (it returns the
                         engine's short-row convention and ``-1`` rows), policy
                         ``topology_only``: sink/local/witness tokens only;
* ``learned-shared:K``   shared indexer scans (``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=every:K``):
                         the first sparse layer and every ``K``-th after it scan, the
                         others reuse the nearest scanning layer's rows (no indexer key
                         written or read there), policy disabled;
* ``learned-shared:L0,L1,...`` the same with these scanning layers
                         (``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=L0,L1,...``, e.g. a profile's
                         ``indexer_share.scanning``);
* ``learned-shared:<K | list>+<merge mode>`` the same with every layer's own structure
                         merged in (a sharing layer's drift tracker reads its attention keys).

With ``--profile FILE`` (a calibrated per-layer profile, docs/profile.md), ``profile`` may
stand for the mode and for the scanning set, as in serving:

* ``learned+profile``    every layer scans; each runs its own profile entry
                         (``RTP_LLM_TOPOLOGY_KV_PROFILE``; a layer the profile skips
                         returns the op's rows as they are);
* ``learned-shared:<K | list | profile>+profile`` shared scans (``profile``: the profile's
                         ``indexer_share.scanning``, ``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=profile``)
                         with each layer's own entry on the rows it gets;
* ``learned-shared:profile[+<merge mode>]`` the profile's scanning set alone, or with one
                         mode's default structure on every layer.

Which budget entry a profile variant runs is :class:`E2EProfile`'s rule (``--profile-budget``).
``--policy-mode-settings MODE:KEY=VALUE,...`` replaces the engine defaults of one mode in
every variant that runs it (not the profile's), its witness signal and ``structure_layers``
(``RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS``) included: with ``witness_signal=query_group_mass``
each layer's tracker reads that layer's attention keys at the policy's block size and the
``Indexer`` gets the step's attention queries.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Mapping, Optional, Sequence, Tuple

from benchmark.quality.shared_scans import PROFILE_MODE, SHARED_PREFIX, SharedName, parse_shared_name

import torch

from benchmark.e2e.clock import phase_clock
from benchmark.quality.proxy_indexers import (  # noqa: F401 (names the CLI and tests import from here)
    DSA_ATTENTION_MACS,
    DSA_INDEXER_MACS,
    DSA_RATIO,
    PRESETS,
    TRAINED,
    IndexerShape,
    ProxyIndexer,
    resolve_indexer_shape,
    trained_indexer_shape,
)
from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.indexer_share import IndexerSharePlan
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    DEFAULT_BLOCK_SIZE,
    CoordinateMismatchAction,
    IndexerTopologySettings,
    TopologyKVPolicyConfig,
)

POLICY_MODES = ("topology_sparse_merge", "topology_compress_sparse", "topology_only")
VARIANTS = ("dense", "learned") + tuple(f"learned+{m}" for m in POLICY_MODES) + ("topology_only_noscan",)
SHARED_MODES = POLICY_MODES[:2]  # the merge modes: topology_only ignores the learned rows it would share
PROFILE_VARIANT = f"learned+{PROFILE_MODE}"  # every layer scans and runs its own profile entry
# --profile-budget: serving's rule (W / the profile's reference context), the harness's
# (W / the run's context), or one of the profile's budgets for every W.
PROFILE_BUDGET_RULES = ("serving", "context")
# mode -> {TopologyKVPolicyConfig field, "witness_signal" or "structure_layers": value} (--policy-mode-settings)
ModeSettings = Mapping[str, Mapping[str, object]]
HOOK_KEYS = ("witness_signal", "structure_layers")  # IndexerTopologySettings fields, not TopologyKVPolicyConfig's
_BUDGET_TEXT = re.compile(r"[0-9]{1,9}/[0-9]{1,9}")


@dataclasses.dataclass(frozen=True)
class E2EProfile:
    """The run's profile (a loaded ``TopologyKVProfile``) and its budget rule.

    ``budget``: ``serving`` picks the entry nearest ``W / reference context`` (the
    profile's longest calibrated context), as the ``Indexer`` does without
    ``RTP_LLM_TOPOLOGY_KV_PROFILE_BUDGET``; ``context`` the one nearest ``W / C`` (``C``
    the run's context: the quality harness's rule, the entry calibrated for this share of
    the row); a budget such as ``1/8`` that entry at every ``W`` (the override).
    """

    profile: object
    budget: str = "serving"

    def __post_init__(self) -> None:
        check_profile_budget(self.budget)
        if self.budget not in PROFILE_BUDGET_RULES and Fraction(self.budget) not in self.profile.budgets:
            raise ValueError(f"--profile-budget: expected serving, context or one of the budgets of "
                             f"{self.profile.path} [{', '.join(str(b) for b in self.profile.budgets)}], "
                             f"got {self.budget!r}")

    def entry(self, width: int, context: int) -> Fraction:
        """The budget entry a profile variant runs at top-k width ``width`` and context ``context``."""
        if self.budget == "serving":
            return self.profile.pick_budget(width)
        if self.budget == "context":
            return self.profile.nearest_budget(Fraction(width, context))
        return self.profile.pick_budget(width, Fraction(self.budget))


def check_profile_budget(text: str) -> None:
    """``ValueError`` unless ``text`` is ``serving``, ``context`` or a fraction ``N/M`` (M > 0)."""
    if text in PROFILE_BUDGET_RULES:
        return
    if not isinstance(text, str) or not _BUDGET_TEXT.fullmatch(text) or int(text.split("/")[1]) == 0 or \
            int(text.split("/")[0]) == 0:
        raise ValueError(f"--profile-budget: expected serving, context or a budget N/M (e.g. 1/8), got {text!r}")


def parse_shared(variant: str) -> Optional[SharedName]:
    """The :class:`SharedName` of a ``learned-shared:<K | layer list>[+mode]`` variant; None
    for any other name; ``ValueError`` for a malformed shared one (naming what is expected)."""
    if not variant.startswith(SHARED_PREFIX):
        return None
    return parse_shared_name(variant, modes=SHARED_MODES + (PROFILE_MODE,), lists=True, where=variant)


def check_variant(variant: str) -> None:
    """``ValueError`` unless ``variant`` is one of :data:`VARIANTS`, :data:`PROFILE_VARIANT`
    or a shared variant."""
    if variant not in VARIANTS and variant != PROFILE_VARIANT and parse_shared(variant) is None:
        raise ValueError(f"unknown variant {variant!r}; expected one of {list(VARIANTS) + [PROFILE_VARIANT]} or "
                         f"{SHARED_PREFIX}<K | L0,L1,... | profile>[+mode] (mode one of "
                         f"{list(SHARED_MODES) + [PROFILE_MODE]})")


def needs_profile(variant: str) -> bool:
    """Whether the variant reads ``--profile`` (its mode or its scanning set is ``profile``)."""
    shared = parse_shared(variant)
    return variant == PROFILE_VARIANT or (shared is not None and shared.needs_profile)


def runs_profile_entries(variant: str) -> bool:
    """Whether each layer of the variant runs its own profile entry (mode ``profile``)."""
    shared = parse_shared(variant)
    return variant == PROFILE_VARIANT or (shared is not None and shared.mode == PROFILE_MODE)


def has_structure(variant: str) -> bool:
    """Whether the variant runs the topology policy (every variant but dense, learned and
    the shared ones without a mode; a ``profile`` mode counts, even where its entries keep
    no structure at the budget run)."""
    return runs_profile_entries(variant) or variant_policy(variant) is not None


def share_plan(variant: str, sparse_layers: Sequence[int], profile=None) -> Optional[IndexerSharePlan]:
    """The variant's :class:`IndexerSharePlan` over the model's sparse layers, or None;
    ``profile``: the run's ``TopologyKVProfile`` (read for the ``profile`` scanning set)."""
    shared = parse_shared(variant)
    if shared is None:
        return None
    return IndexerSharePlan.parse(shared.scan, sparse_layers, where=variant,
                                  profile_scanning=None if profile is None else profile.scanning_layers,
                                  profile_path=None if profile is None else str(profile.path))


def layer_indexer_shape(projections, H: int, D: int) -> IndexerShape:
    """The shape record of one layer's trained ``IndexerProjections`` (a file may give layers
    different shapes of the same cost per key)."""
    return trained_indexer_shape(projections.shape.heads, projections.shape.head_dim, H, D)


class TrainedIndexerInputs:
    """One layer's trained indexer (``IndexerProjections``) behind the proxy's place in the pools.

    The variant's ``Indexer`` holds the projections and computes q, k and weights from the
    layer's attention input (``Indexer.index_inputs``); q and k are then fp8-e4m3
    round-tripped in 128-value groups once (keys on write), as the proxy's are.
    """

    reads_hidden = True

    def __init__(self, projections) -> None:
        self.projections = projections

    def prefill_keys(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden [C, hidden]`` at ``positions [C]`` -> fp32 ``[C, Di]`` (fp8 round-tripped)."""
        with torch.no_grad():
            return fp8_e4m3_round_trip(self.projections.keys(hidden, positions))

    def from_hidden(self, indexer: Indexer, hidden: torch.Tensor, positions: torch.Tensor):
        """``(q [R, Hi, Di], keys [R, Di], weights [R, Hi])`` of the step's rows, through ``indexer``."""
        q, k, w = indexer.index_inputs(hidden, positions)
        return fp8_e4m3_round_trip(q), fp8_e4m3_round_trip(k), w


class TimedIndexer(Indexer):
    """The serving ``Indexer`` with its decode op timed (``last_op_s``, on the phase clock
    of its ``device``: :func:`benchmark.e2e.clock.phase_clock`), where the engine's
    kernels slot in; ``scan=False`` replaces the op by one that reads no key: the
    engine's short-row convention (``0 .. length - 1`` when ``length <= W``) and ``-1``
    rows otherwise, for ``topology_only`` without an indexer."""

    def __init__(self, *args, device: torch.device, scan: bool = True, **kwargs) -> None:
        super().__init__(*args, device=device, **kwargs)
        self.clock = phase_clock(device)
        self.scan = scan
        self.last_op_s = 0.0

    def _get_topk_paged(self, q, weights, kv_cache, fmha_params, attention_inputs):
        t0 = self.clock()
        if self.scan:
            out = super()._get_topk_paged(q, weights, kv_cache, fmha_params, attention_inputs)
        else:
            lengths = fmha_params.expanded_seq_lens.to(torch.int64).unsqueeze(1)
            ar = torch.arange(self.index_topk, device=q.device).unsqueeze(0)
            out = torch.where((ar < lengths) & (lengths <= self.index_topk), ar, -1).to(torch.int32)
        self.last_op_s = self.clock() - t0
        return out


def variant_policy(variant: str, profile=None, mode_settings: Optional[ModeSettings] = None
                   ) -> Optional[TopologyKVPolicyConfig]:
    """The policy config a variant applies after (or instead of) the indexer; a variant
    of mode ``profile`` runs the ``profile``'s mode (its layers' entries applied by the
    ``Indexer``) and needs it. ``mode_settings``: mode -> structural fields that replace the
    engine defaults for that mode (``--policy-mode-settings``; not for ``profile`` variants)."""
    if variant in ("dense", "learned"):
        return None
    shared = parse_shared(variant)
    if shared is not None:
        if shared.mode is None:
            return None
        mode = shared.mode
    else:
        mode = "topology_only" if variant == "topology_only_noscan" else variant.split("+", 1)[1]
    fields = {}
    if mode == PROFILE_MODE:
        if profile is None:
            raise ValueError(f"{variant}: expected a profile (--profile FILE), got none")
        mode = profile.policy.value
    else:
        fields = {k: v for k, v in (mode_settings or {}).get(mode, {}).items() if k not in HOOK_KEYS}
    # FALLBACK_DISABLED: no host sync, as a CUDA-graph serving path would run it.
    return TopologyKVPolicyConfig(policy=mode, coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED,
                                  **fields)


def make_indexer(variant: str, shape: IndexerShape, width: int, layer: int,
                 device: torch.device, projections=None,
                 share: Optional[IndexerSharePlan] = None, profile: Optional[E2EProfile] = None,
                 context: Optional[int] = None, mode_settings: Optional[ModeSettings] = None
                 ) -> Optional[TimedIndexer]:
    """The variant's ``Indexer`` for one layer (None for dense); ``share``: the variant's
    :func:`share_plan` (a sharing layer then reuses its scanning layer's rows); ``profile``
    and ``context`` (the run's longest row): the profile a mode-``profile`` variant runs,
    at the entry :meth:`E2EProfile.entry` picks; ``mode_settings``: :func:`variant_policy`'s.

    Built with ``device=`` (the run's): the policy backend is resolved at construction
    (``auto``: the fused C++ kernel on the CPU, Triton on CUDA), so the CPU kernel compiles
    here, before timing starts, not inside the first timed step.
    """
    if variant == "dense":
        return None
    policy = variant_policy(variant, None if profile is None else profile.profile, mode_settings)
    entries = runs_profile_entries(variant)
    # The hook's own settings of the mode, where its structural ones apply (not a profile's mode).
    hook = {} if policy is None or entries else {
        k: v for k, v in (mode_settings or {}).get(policy.policy.value, {}).items() if k in HOOK_KEYS}
    settings = IndexerTopologySettings() if policy is None else IndexerTopologySettings(policy=policy, **hook)
    if entries and context is None:
        raise ValueError(f"{variant}: expected the run's context with a profile, got none")
    return TimedIndexer(shape.heads, shape.dim, width, DEFAULT_BLOCK_SIZE, layer_idx=layer, fp8_emulation=False,
                        topology=settings, device=device, scan=variant != "topology_only_noscan",
                        projections=projections, share=share,
                        topology_profile=profile.profile if entries else None,
                        topology_profile_budget=profile.entry(width, context) if entries else None)

