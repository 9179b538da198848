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
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from benchmark.quality.shared_scans import PROFILE_SCAN, SHARED_PREFIX, SharedName, parse_shared_name

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


def parse_shared(variant: str) -> Optional[SharedName]:
    """The :class:`SharedName` of a ``learned-shared:<K | layer list>[+mode]`` variant; None
    for any other name; ``ValueError`` for a malformed shared one (naming what is expected)."""
    if not variant.startswith(SHARED_PREFIX):
        return None
    shared = parse_shared_name(variant, modes=SHARED_MODES, lists=True, where=variant)
    if shared.scan == PROFILE_SCAN:
        raise ValueError(f"{variant}: the e2e takes no profile; write its scanning layers as "
                         f"{SHARED_PREFIX}L0,L1,... (the profile's indexer_share.scanning)")
    return shared


def check_variant(variant: str) -> None:
    """``ValueError`` unless ``variant`` is one of :data:`VARIANTS` or a shared variant."""
    if variant not in VARIANTS and parse_shared(variant) is None:
        raise ValueError(f"unknown variant {variant!r}; expected one of {list(VARIANTS)} or "
                         f"{SHARED_PREFIX}<K | L0,L1,...>[+mode] (mode one of {list(SHARED_MODES)})")


def has_structure(variant: str) -> bool:
    """Whether the variant runs the topology policy (every variant but dense, learned and
    the shared ones without a mode)."""
    return variant_policy(variant) is not None


def share_plan(variant: str, sparse_layers: Sequence[int]) -> Optional[IndexerSharePlan]:
    """The variant's :class:`IndexerSharePlan` over the model's sparse layers, or None."""
    shared = parse_shared(variant)
    return None if shared is None else IndexerSharePlan.parse(shared.scan, sparse_layers, where=variant)


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


def variant_policy(variant: str) -> Optional[TopologyKVPolicyConfig]:
    """The policy config a variant applies after (or instead of) the indexer."""
    if variant in ("dense", "learned"):
        return None
    shared = parse_shared(variant)
    if shared is not None:
        if shared.mode is None:
            return None
        mode = shared.mode
    else:
        mode = "topology_only" if variant == "topology_only_noscan" else variant.split("+", 1)[1]
    # FALLBACK_DISABLED: no host sync, as a CUDA-graph serving path would run it.
    return TopologyKVPolicyConfig(policy=mode, coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED)


def make_indexer(variant: str, shape: IndexerShape, width: int, layer: int,
                 device: torch.device, projections=None,
                 share: Optional[IndexerSharePlan] = None) -> Optional[TimedIndexer]:
    """The variant's ``Indexer`` for one layer (None for dense); ``share``: the variant's
    :func:`share_plan` (a sharing layer then reuses its scanning layer's rows).

    Built with ``device=`` (the run's): the policy backend is resolved at construction
    (``auto``: the fused C++ kernel on the CPU, Triton on CUDA), so the CPU kernel compiles
    here, before timing starts, not inside the first timed step.
    """
    if variant == "dense":
        return None
    policy = variant_policy(variant)
    settings = IndexerTopologySettings() if policy is None else IndexerTopologySettings(policy=policy)
    return TimedIndexer(shape.heads, shape.dim, width, DEFAULT_BLOCK_SIZE, layer_idx=layer, fp8_emulation=False,
                        topology=settings, device=device, scan=variant != "topology_only_noscan",
                        projections=projections, share=share)

