"""Lightning indexer with the topology KV policy hooked in after its top-k op.

Shaped like the engine's ``rtp_llm/models_py/modules/hybrid/indexer.py``:
``Indexer._compute_topk(q, weights, kv_cache, fmha_params, attention_inputs, cp_params)``
routes to one of three top-k ops and returns int32 ``[R, W]`` rows of request-local
token positions (the convention: docs/architecture.md). Here the ops are the torch references in
``indexer_torch_ops`` so the path runs on a CPU; the engine's kernels slot in by overriding
``_get_topk_paged`` / ``_get_topk_ragged`` / ``_get_topk_ragged_cp``.

How the path is chosen (:meth:`Indexer.select_path`), in this order:

* decode (``_get_topk_paged``): ``not attention_inputs.is_prefill``, or a multi-token
  decode step (``is_target_verify`` / ``is_draft_extend``), as in the engine;
* CP prefill (``_get_topk_ragged_cp``): a prefill with ``cp_params is not None`` (the
  engine asks its parallelism config; the CP parameters are what the op needs, so their
  presence is the switch here);
* ragged prefill (``_get_topk_ragged``): any other prefill.

The policy hook runs after the op with the row lengths and offsets of the path's own
parameters: decode ``expanded_seq_lens`` (offset 0), ragged ``expanded_seq_lens`` and
``topk_indices_offset``, CP ``precomputed_lengths`` and ``precomputed_topk_off``. Witness
scores (``IndexerTopologySettings.witness_signal``) come from a caller-owned
:class:`BlockDriftTracker` (live key-centroid drift; the merge modes' default), or are not
passed at all (recency: ``topology_only``'s default, which then selects plain locality), or,
with ``query_group_mass``, are computed per row from the caller's attention queries
(``witness_queries``) against the block centroids of a tracker the caller feeds with this
layer's attention keys.

Configuration: :class:`IndexerTopologySettings` (``topology_kv.config``), read from the
``RTP_LLM_TOPOLOGY_KV_*`` environment variables once, at construction, when not passed.

Shared scans (``share=``, an :class:`~rtp_llm.models_py.modules.hybrid.indexer_share.IndexerSharePlan`):
a scanning layer runs its op and leaves the op's rows in the step's caller-owned
:class:`~rtp_llm.models_py.modules.hybrid.indexer_share.SharedTopkRows`; a sharing layer runs
no op and reads no indexer key: it takes the rows of its scanning layer from there, and its
own policy (when enabled) merges its own structure into them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from rtp_llm.metrics import register_topology_kv_reporter
from rtp_llm.models_py.modules.hybrid import indexer_torch_ops
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections
from rtp_llm.models_py.modules.hybrid.indexer_share import ENV_INDEXER_SHARE, IndexerSharePlan, SharedTopkRows
from rtp_llm.models_py.modules.hybrid.indexer_params import (
    IndexerAttentionInputs,
    IndexerCPParams,
    IndexerFmhaParams,
    IndexerKeyCache,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    ENV_PATHS,
    ENV_STRUCTURE_LAYERS,
    IndexerPath,
    IndexerTopologySettings,
    StructureLayers,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import BlockDriftTracker
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_drift
from rtp_llm.models_py.modules.hybrid.topology_kv.layer import TopologyKVLayerPolicy
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import TopologyKVCounters
from rtp_llm.models_py.modules.hybrid.topology_kv.profile import (
    ModelFingerprint,
    TopologyKVProfile,
    profile_from_env,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.request import TopologyStepPlan
from rtp_llm.models_py.modules.hybrid.topology_kv.step_record import PolicySkipReason, TopologyLayerCall
from rtp_llm.models_py.modules.hybrid.topology_kv.witness import tracker_query_group_mass_scores_unchecked

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TopologyStepCounters:
    """Caller-owned record of one step's policy counters, one entry per layer called.

    The ``Indexer`` keeps no per-call state: a layer object is shared by every request
    and thread that runs it, so counters go to the object the caller passes to
    :meth:`Indexer._compute_topk` (``topology_counters=``), one per step (or per thread).
    ``by_layer[layer_idx]`` is the :class:`TopologyKVCounters` of that layer's last call
    in this step, or None when the policy did not run there (disabled, path switched off,
    or a CP rank with no local rows), so nothing stale is ever reported. ``calls[layer_idx]``
    is that call's :class:`TopologyLayerCall` (path, mode, rows, why it skipped): host
    values only, what the step's metrics tag and count (``rtp_llm.metrics.topology_kv_step``).
    """

    by_layer: Dict[int, Optional[TopologyKVCounters]] = dataclasses.field(default_factory=dict)
    calls: Dict[int, TopologyLayerCall] = dataclasses.field(default_factory=dict)

    def record(
        self, layer_idx: int, counters: Optional[TopologyKVCounters], call: Optional[TopologyLayerCall] = None
    ) -> None:
        self.by_layer[layer_idx] = counters
        if call is not None:
            self.calls[layer_idx] = call
        else:
            self.calls.pop(layer_idx, None)  # never leave an earlier call's record looking current

    def totals(self) -> Dict[str, int]:
        """Every counter summed over the layers that ran the policy (reads the device: syncs)."""
        out: Dict[str, int] = {}
        for counters in self.by_layer.values():
            if counters is not None:
                for name, value in counters.to_dict().items():
                    out[name] = out.get(name, 0) + value
        return out


@functools.lru_cache(maxsize=64)
def _row_numbers(rows: int, device: torch.device) -> torch.Tensor:
    """``arange(rows)`` on ``device``, built once per (rows, device) and shared: the policy
    and the row map only read it, and a decode step's row count repeats every layer."""
    return torch.arange(rows, device=device)


class Indexer(nn.Module):
    """DeepSeek-V3.2 lightning-indexer top-k with the topology KV policy after it.

    Parameters
    ----------
    index_n_heads, index_head_dim : ``H``, ``D`` of the indexer queries and keys
    index_topk : ``W``, the top-k width (2048 in DeepSeek-V3.2)
    blocksize : KV page size in tokens (the engine's ``kernel_tokens_per_block``, 64)
    layer_idx : the layer's index: required with a profile (its entry; a layer of the profile's
        model), else for log messages only (None: 0)
    fp8_emulation : emulate the engine's fp8-e4m3 q/k (reference ops and :meth:`write_keys`)
    topology : settings; None reads them from ``os.environ`` once, here
    device : the device the layer runs on, or None. When given and the policy is enabled,
        its backend is resolved here (``auto`` picks, a forced one that cannot run there
        raises now, and the fused CPU kernel is built now rather than at the first call)
    topology_profile : a :class:`TopologyKVProfile` (per-layer structural budgets,
        docs/profile.md), or None. With ``topology=None`` it is read from
        ``RTP_LLM_TOPOLOGY_KV_PROFILE`` when set (checked against ``model_fingerprint``).
        This layer's entry replaces the structural settings once, here: a skipped layer
        gets the policy disabled (the op's rows returned as they are)
    topology_profile_budget : the profile budget to use (e.g. ``"1/16"``), or None to pick
        the one nearest ``index_topk / reference context`` (``RTP_LLM_TOPOLOGY_KV_PROFILE_BUDGET``
        with ``topology=None``)
    model_fingerprint : :class:`ModelFingerprint` of the served model; needed when
        ``RTP_LLM_TOPOLOGY_KV_PROFILE`` is read
    projections : the layer's trained :class:`IndexerProjections` (DSA's ``wq_b``, ``wk``,
        ``k_norm``, ``weights_proj``), or None. With them :meth:`index_inputs` computes the
        indexer's q, k and weights from the layer's hidden states, as the engine's does;
        their shape must match ``index_n_heads`` / ``index_head_dim``
    share : the model's :class:`IndexerSharePlan` (``IndexerSharePlan.from_env`` reads
        ``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE`` once per model), or None: this layer scans.
        Needs ``layer_idx`` (one of the plan's sparse layers). A sharing layer's
        :attr:`shares_rows_of` names the scanning layer whose rows it takes
    """

    def __init__(
        self,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int = indexer_torch_ops.DEFAULT_TOPK_WIDTH,
        blocksize: int = indexer_torch_ops.DEFAULT_PAGE_SIZE,
        *,
        layer_idx: Optional[int] = None,
        fp8_emulation: bool = False,
        topology: Optional[IndexerTopologySettings] = None,
        device: Optional[torch.device] = None,
        topology_profile: Optional[TopologyKVProfile] = None,
        topology_profile_budget: Optional[str] = None,
        model_fingerprint: Optional[ModelFingerprint] = None,
        projections: Optional[IndexerProjections] = None,
        share: Optional[IndexerSharePlan] = None,
    ) -> None:
        super().__init__()
        # Which layer's op rows this layer takes (None: it scans), fixed here.
        self.shares_rows_of: Optional[int] = None
        if share is not None:
            if layer_idx is None:
                raise ValueError("layer_idx: expected the layer's index with share= (which layer scans is per layer)")
            source = share.source(layer_idx)
            self.shares_rows_of = None if source == layer_idx else source
        self.share_spec = None if share is None else share.spec
        if projections is not None and (projections.shape.heads, projections.shape.head_dim) != (
                index_n_heads, index_head_dim):
            raise ValueError(f"projections: expected {index_n_heads} heads x {index_head_dim} dims (index_n_heads, "
                             f"index_head_dim), got {projections.shape.heads} x {projections.shape.head_dim}")
        self.projections = projections
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.blocksize = blocksize
        self.layer_idx = 0 if layer_idx is None else layer_idx
        self.fp8_emulation = fp8_emulation
        if topology is None:
            topology = IndexerTopologySettings.from_env(os.environ, block_size=blocksize)
            # The process's one metrics reporter (RTP_LLM_TOPOLOGY_KV_METRICS*), read and
            # validated once; the first layer built registers it, the others get the same.
            register_topology_kv_reporter(environ=os.environ)
            if topology_profile is None:
                topology_profile, env_budget = profile_from_env(os.environ, model_fingerprint=model_fingerprint)
                topology_profile_budget = topology_profile_budget or env_budget
        # Once, here: the layer's immutable policy (its profile entry applied, the layout
        # derived, the backend resolved when the device is known); per call only tensors.
        self.topology_layer = TopologyKVLayerPolicy.build(
            topology, layer_idx=layer_idx, width=index_topk, device=device, profile=topology_profile,
            profile_budget=topology_profile_budget,
        )
        structure_off = self._structure_off_reason(topology, share)
        if structure_off is not None:  # not a structure layer: the rows it has, as they are
            self.topology_layer = TopologyKVLayerPolicy.build(
                dataclasses.replace(topology, policy=TopologyKVPolicyConfig()), layer_idx=layer_idx,
                width=index_topk, device=device,
            )
        self.topology = self.topology_layer.settings
        if device is not None and self.topology_layer.reads_drift:
            # The tracker's one-call update (CPU) builds here too, not in the first request.
            cpu_drift.can_use_drift_kernel(device)
        self._logged_skip_reasons = set()  # (reason, path) pairs already logged
        # Host values the step's metrics tag each call with, fixed here.
        self.topology_profile_name = (
            None if topology_profile is None else os.path.splitext(os.path.basename(topology_profile.path))[0]
        )
        self._disabled_reason = None
        if structure_off is not None:
            self._disabled_reason = structure_off
        elif not self.topology.enabled:
            self._disabled_reason = (
                PolicySkipReason.DISABLED if topology_profile is None else PolicySkipReason.PROFILE_SKIPPED_LAYER
            )

    def _structure_off_reason(
        self, topology: IndexerTopologySettings, share: Optional[IndexerSharePlan]
    ) -> Optional[PolicySkipReason]:
        """Why ``structure_layers`` switches this layer's (enabled) policy off, or None when it
        runs here: ``sharing`` and the layer scans (``SCANNING_LAYER``), or a list without
        it (``UNLISTED_LAYER``). Raises for ``sharing`` without a plan that shares, and for a
        list naming a layer that is not one of the plan's sparse layers."""
        if not self.topology_layer.settings.enabled or topology.structure_layers is StructureLayers.ALL:
            return None
        if topology.structure_layers is StructureLayers.LISTED:
            listed = topology.structure_layer_list
            if share is not None:
                unknown = sorted(set(listed) - set(share.sparse_layers))
                if unknown:
                    raise ValueError(
                        f"structure_layers ({ENV_STRUCTURE_LAYERS}): expected sparse layers of the model "
                        f"{list(share.sparse_layers)}, got {unknown} in {','.join(map(str, listed))}"
                    )
            return None if self.layer_idx in listed else PolicySkipReason.UNLISTED_LAYER
        if share is None or not share.shares:
            plan = "no plan was given" if share is None else f"the plan {share.spec!r} shares no layer"
            raise ValueError(
                f"structure_layers ({ENV_STRUCTURE_LAYERS}): expected shared indexer scans ({ENV_INDEXER_SHARE}): "
                f"'sharing' runs the policy only on layers that reuse another layer's rows, but {plan}"
            )
        return PolicySkipReason.SCANNING_LAYER if self.shares_rows_of is None else None

    @property
    def reads_drift(self) -> bool:
        """Whether ``_compute_topk`` reads the caller's ``BlockDriftTracker`` for key drift (the
        policy is on and its witnesses rank by key drift; the tracker holds the indexer keys,
        or a sharing layer's attention keys). False: the tracker may be skipped, and a
        ``topology_only`` deployment without an indexer scan needs no indexer keys at all
        (:attr:`reads_queries` reads a tracker of attention keys for another signal)."""
        return self.topology_layer.reads_drift

    @property
    def reads_queries(self) -> bool:
        """Whether ``_compute_topk`` ranks witnesses by ``query_group_mass``: it then reads the
        caller's ``witness_queries`` and a ``drift_tracker`` fed with this layer's attention
        keys (``key_dim = Hkv * D``, KV head-major) at the policy's block size."""
        return self.topology_layer.reads_queries

    # ------------------------------------------------------------------ routing

    @staticmethod
    def _is_multi_token_decode(attention_inputs: Any) -> bool:
        return bool(getattr(attention_inputs, "is_target_verify", False)) or bool(
            getattr(attention_inputs, "is_draft_extend", False)
        )

    def select_path(self, attention_inputs: Any, cp_params: Optional[Any]) -> IndexerPath:
        """Decode, CP prefill or ragged prefill (module docstring)."""
        if not attention_inputs.is_prefill or self._is_multi_token_decode(attention_inputs):
            return IndexerPath.DECODE
        if cp_params is not None:
            return IndexerPath.CP
        return IndexerPath.PREFILL

    def _compute_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: IndexerKeyCache,
        fmha_params: IndexerFmhaParams,
        attention_inputs: IndexerAttentionInputs,
        cp_params: Optional[IndexerCPParams],
        *,
        drift_tracker: Optional[BlockDriftTracker] = None,
        topology_context=None,
        topology_counters: Optional[TopologyStepCounters] = None,
        topology_plan: Optional[TopologyStepPlan] = None,
        shared_rows: Optional[SharedTopkRows] = None,
        witness_queries: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        """Top-k rows of the step, then the topology policy when enabled for the path.

        Parameters
        ----------
        q : ``[T, H, D]`` indexer queries (this rank's tokens under CP)
        weights : ``[T, H]`` or ``[T, H, 1]`` per-head gates
        kv_cache, fmha_params, attention_inputs, cp_params : see the parameter classes
        drift_tracker : this layer's :class:`BlockDriftTracker` for the batch, or None
            (witnesses then fall back to the most recent blocks; logged once). Read only
            when the settings' witness signal resolves to ``key_drift`` (``auto``: the
            merge modes) or is ``query_group_mass`` (:attr:`reads_queries`; the tracker then
            holds this layer's attention keys); with ``recency`` (``auto`` for
            ``topology_only``) it is ignored
        topology_context : TopologyRequestContext or one per request (compress mode)
        topology_counters : caller-owned :class:`TopologyStepCounters`, or None; when given,
            this layer's counters (or None if the policy did not run) are recorded there
        topology_plan : the step's :class:`TopologyStepPlan` (built once per forward from the
            contexts, shared by every layer), or None; exclusive with ``topology_context``
        shared_rows : the step's caller-owned :class:`SharedTopkRows`, or None. A scanning
            layer records its op's rows there (before its policy); a sharing layer
            (:attr:`shares_rows_of`) needs it and takes its scanning layer's rows from it
            instead of running the op (``q``, ``weights`` and ``kv_cache`` are then not read)
        witness_queries : float ``[R, H, D]``, one per row of the result (the path's rows):
            this layer's post-RoPE attention queries times the attention's softmax scale.
            Read only when :attr:`reads_queries`; None there: witnesses fall back to the
            most recent blocks (logged once)

        Returns
        -------
        int32 ``[R, W]`` request-local positions (``R = T`` except under CP, where it is
        ``len(total_local_ids)``), ``-1`` padding; None for a CP rank with no local row.
        With the policy disabled (default) it is the op's output tensor itself (on a sharing
        layer: the scanning layer's).
        """
        path = self.select_path(attention_inputs, cp_params)
        if self.shares_rows_of is not None:
            topk = self._shared_topk(shared_rows)
        elif path is IndexerPath.DECODE:
            topk = self._get_topk_paged(q, weights, kv_cache, fmha_params, attention_inputs)
        elif path is IndexerPath.CP:
            topk = self._get_topk_ragged_cp(
                q,
                weights,
                kv_cache,
                fmha_params,
                attention_inputs,
                cp_params.total_local_ids,
                cp_params.cu_kv_seqlens_global,
                cp_params.total_kv_len,
                cp_params.precomputed_ks,
                cp_params.precomputed_ke,
                cp_params.precomputed_lengths,
                cp_params.precomputed_topk_off,
            )
        else:
            topk = self._get_topk_ragged(q, weights, kv_cache, fmha_params, attention_inputs)
        if shared_rows is not None and self.shares_rows_of is None:
            shared_rows.by_layer[self.layer_idx] = topk
        if not self.topology.enabled or topk is None:
            if topology_counters is not None:
                reason = self._disabled_reason or PolicySkipReason.NO_LOCAL_ROWS
                topology_counters.record(self.layer_idx, None, self._layer_call(path, topk, reason))
            return topk
        out, counters = self._apply_topology(
            path, topk, fmha_params, attention_inputs, cp_params, drift_tracker, topology_context, topology_plan,
            witness_queries,
        )
        if topology_counters is not None:
            reason = PolicySkipReason.PATH_OFF if counters is None else None
            topology_counters.record(self.layer_idx, counters, self._layer_call(path, topk, reason))
        return out

    def _shared_topk(self, shared_rows: Optional[SharedTopkRows]) -> Optional[torch.Tensor]:
        """A sharing layer's rows: its scanning layer's op rows of this step."""
        source = self.shares_rows_of
        if shared_rows is None:
            raise ValueError(f"shared_rows: layer {self.layer_idx} reuses the rows of layer {source} (indexer share "
                             f"{self.share_spec!r}): expected the step's SharedTopkRows, got None")
        try:
            return shared_rows.by_layer[source]
        except KeyError:
            raise ValueError(f"shared_rows: layer {self.layer_idx} reuses the rows of layer {source}, which has not "
                             f"run in this step (layers with rows: {sorted(shared_rows.by_layer)})") from None

    def _layer_call(
        self, path: IndexerPath, topk: Optional[torch.Tensor], reason: Optional[PolicySkipReason]
    ) -> TopologyLayerCall:
        """This call's record for the step's metrics: host values only (a shape, no device read)."""
        rows = 0 if topk is None else topk.shape[0]
        return TopologyLayerCall(path, self.topology.policy.policy, rows, reason, self.topology_profile_name)

    def forward(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: IndexerKeyCache,
        fmha_params: IndexerFmhaParams,
        attention_inputs: IndexerAttentionInputs,
        cp_params: Optional[IndexerCPParams] = None,
        *,
        drift_tracker: Optional[BlockDriftTracker] = None,
        topology_context=None,
        topology_counters: Optional[TopologyStepCounters] = None,
        topology_plan: Optional[TopologyStepPlan] = None,
        shared_rows: Optional[SharedTopkRows] = None,
        witness_queries: Optional[torch.Tensor] = None,
    ) -> Optional[torch.Tensor]:
        return self._compute_topk(
            q,
            weights,
            kv_cache,
            fmha_params,
            attention_inputs,
            cp_params,
            drift_tracker=drift_tracker,
            topology_context=topology_context,
            topology_counters=topology_counters,
            topology_plan=topology_plan,
            shared_rows=shared_rows,
            witness_queries=witness_queries,
        )

    # ------------------------------------------------------------------ q, k and weights

    def index_inputs(
        self, hidden_states: torch.Tensor, positions: torch.Tensor, q_input: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's ``(q [T, H, D], k [T, D], weights [T, H])`` for this step's tokens.

        hidden_states : ``[T, C]`` the layer's attention input; positions : int ``[T]``
        absolute (request-local) positions, for RoPE; q_input : ``[T, Cq]`` the q-LoRA
        latent, or None (a model without one: ``hidden_states``). ``k`` is what
        :meth:`write_keys` stores; ``q`` and ``weights`` are what :meth:`_compute_topk` reads.
        """
        if self.projections is None:
            raise ValueError(f"Indexer layer {self.layer_idx}: index_inputs needs trained projections "
                             "(Indexer(..., projections=...))")
        return self.projections(hidden_states, positions, q_input)

    # ------------------------------------------------------------------ cache writes

    def write_keys(
        self,
        keys: torch.Tensor,
        kv_cache: IndexerKeyCache,
        slot_mapping: torch.Tensor,
        *,
        drift_tracker: Optional[BlockDriftTracker] = None,
        positions: Optional[torch.Tensor] = None,
        request_ids: Optional[torch.Tensor] = None,
    ) -> None:
        """Store this step's keys ``[T, D]`` at ``slot_mapping`` (int ``[T]``, every slot
        valid) and feed them, as stored, to ``drift_tracker`` (needs ``positions`` and,
        for a batch, ``request_ids``). Reference of the engine's ``quant_k_only``. With a
        tracker, the store and the tracker's update are one call
        (:meth:`BlockDriftTracker.update`: one C++ pass over the keys on CPU)."""
        stored = indexer_torch_ops.fp8_e4m3_round_trip(keys) if self.fp8_emulation else keys
        pool = kv_cache.k_cache.view(-1, kv_cache.k_cache.shape[-1])
        if drift_tracker is None:
            pool[slot_mapping.to(torch.int64)] = stored.to(pool.dtype)
            return
        if positions is None:
            raise ValueError("positions: expected the keys' request-local positions to feed drift_tracker")
        drift_tracker.update(stored, positions, request_ids, pool=pool, slots=slot_mapping)

    # ------------------------------------------------------------------ the three ops

    def _get_topk_paged(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: IndexerKeyCache,
        fmha_params: IndexerFmhaParams,
        attention_inputs: IndexerAttentionInputs,
    ) -> torch.Tensor:
        """Decode: logits over each row's request read through the block table; int32 ``[R, W]``."""
        return indexer_torch_ops.paged_indexer_topk(
            q,
            weights,
            kv_cache.k_cache,
            attention_inputs.kv_cache_kernel_block_id_device,
            fmha_params.expanded_seq_lens,
            self._decode_row_to_request(q.shape[0], attention_inputs),
            self.index_topk,
            self.fp8_emulation,
        )

    def _get_topk_ragged(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: IndexerKeyCache,
        fmha_params: IndexerFmhaParams,
        attention_inputs: IndexerAttentionInputs,
    ) -> torch.Tensor:
        """Prefill: keys gathered into a ragged buffer by ``cu_kv_seqlens``; int32 ``[R, W]``."""
        keys = indexer_torch_ops.gather_ragged_keys(
            kv_cache.k_cache,
            attention_inputs.kv_cache_kernel_block_id_device,
            attention_inputs.cu_kv_seqlens_device,
            attention_inputs.total_kv_len,
        )
        return indexer_torch_ops.ragged_indexer_topk(
            q,
            weights,
            keys,
            fmha_params.ks,
            fmha_params.expanded_seq_lens,
            fmha_params.topk_indices_offset,
            self.index_topk,
            self.fp8_emulation,
        )

    def _get_topk_ragged_cp(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        kv_cache: IndexerKeyCache,
        fmha_params: IndexerFmhaParams,
        attention_inputs: IndexerAttentionInputs,
        total_local_ids: torch.Tensor,
        cu_kv_seqlens_global: torch.Tensor,
        total_kv_len: int,
        precomputed_ks: torch.Tensor,
        precomputed_ke: torch.Tensor,
        precomputed_lengths: torch.Tensor,
        precomputed_topk_off: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """CP prefill: this rank's rows against the full key buffer; ``[R_local, W]`` or None."""
        return indexer_torch_ops.cp_indexer_topk(
            q,
            weights,
            kv_cache.k_cache,
            attention_inputs.kv_cache_kernel_block_id_device,
            total_local_ids,
            cu_kv_seqlens_global,
            total_kv_len,
            precomputed_ks,
            precomputed_lengths,
            precomputed_topk_off,
            self.index_topk,
            self.fp8_emulation,
        )

    # ------------------------------------------------------------------ the policy hook

    @staticmethod
    def _decode_row_to_request(rows: int, attention_inputs: IndexerAttentionInputs) -> torch.Tensor:
        block_table = attention_inputs.kv_cache_kernel_block_id_device
        cu = getattr(attention_inputs, "decode_cu_seqlens_device", None)
        row = _row_numbers(rows, block_table.device)
        if cu is None:
            return row  # one decode row per request
        return torch.searchsorted(cu[1:].to(torch.int64).contiguous(), row, right=True)

    @staticmethod
    def _prefill_row_to_request(row_starts: torch.Tensor, cu_kv_seqlens: torch.Tensor) -> torch.Tensor:
        # Row of request b starts at cu[b]; the requests after b start later (b has rows,
        # so kv_len > 0), hence #{cu[1:] <= ks} = b.
        return torch.searchsorted(
            cu_kv_seqlens[1:].to(torch.int64).contiguous(), row_starts.to(torch.int64), right=True
        )

    def _log_skip_once(self, reason: str, path: IndexerPath, message: str, *args) -> None:
        key = (reason, path)
        if key in self._logged_skip_reasons:
            return
        self._logged_skip_reasons.add(key)
        logger.warning("Indexer layer %d, %s path: " + message + " (logged once)", self.layer_idx, path.value, *args)

    def _policy_inputs(
        self, path: IndexerPath, topk: torch.Tensor, fmha_params, attention_inputs, cp_params
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, int]:
        """(lengths, offsets, row_to_request, batch size) from the path's own parameters."""
        if path is IndexerPath.DECODE:
            return (
                fmha_params.expanded_seq_lens,
                None,
                self._decode_row_to_request(topk.shape[0], attention_inputs),
                attention_inputs.kv_cache_kernel_block_id_device.shape[0],
            )
        if path is IndexerPath.PREFILL:
            cu = attention_inputs.cu_kv_seqlens_device
            return (
                fmha_params.expanded_seq_lens,
                fmha_params.topk_indices_offset,
                self._prefill_row_to_request(fmha_params.ks, cu),
                cu.shape[0] - 1,
            )
        cu = cp_params.cu_kv_seqlens_global
        return (
            cp_params.precomputed_lengths,
            cp_params.precomputed_topk_off,
            self._prefill_row_to_request(cp_params.precomputed_ks, cu),
            cu.shape[0] - 1,
        )

    def _apply_topology(
        self,
        path: IndexerPath,
        topk: torch.Tensor,
        fmha_params,
        attention_inputs,
        cp_params,
        drift_tracker: Optional[BlockDriftTracker],
        topology_context,
        topology_plan: Optional[TopologyStepPlan] = None,
        witness_queries: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[TopologyKVCounters]]:
        """The policy on the op's rows: ``(rows, counters)``; counters None when skipped."""
        config = self.topology.policy
        if path not in self.topology.paths:
            self._log_skip_once(
                "path_off",
                path,
                "topology KV policy %s skipped: the path is not in %s; top-k rows pass through unchanged",
                config.policy.value,
                ENV_PATHS,
            )
            return topk, None
        lengths, offsets, row_to_request, batch = self._policy_inputs(
            path, topk, fmha_params, attention_inputs, cp_params
        )
        # Witness scores: key drift from the tracker, per-row query_group_mass, or none with
        # recency (witness_signal), where the policy takes the most recent eligible blocks itself.
        if self.topology_layer.reads_queries:
            scores = self._query_witness_scores(
                path, topk, drift_tracker, witness_queries, lengths, row_to_request, batch
            )
            if scores is not None:
                # Per-row scores go to the policy without row_to_request, which then only
                # places each request's context: the step plan is built from them here.
                if topology_plan is None and topology_context is not None:
                    topology_plan = TopologyStepPlan.build(
                        config, topk.shape[1], topology_context, num_rows=topk.shape[0],
                        row_to_request=row_to_request, device=topk.device,
                    )
                result = self.topology_layer.run(topk, lengths, offsets, scores, None, plan=topology_plan)
                return result.indices, result.counters
        drift = None
        if self.topology_layer.reads_drift and drift_tracker is not None:
            self._check_tracker(drift_tracker, batch)
            drift = drift_tracker.drift_scores()
        elif self.topology_layer.reads_drift and (
            config.witness_blocks > 0 or config.policy is TopologyKVPolicyMode.TOPOLOGY_ONLY
        ):
            self._log_skip_once(
                "no_drift",
                path,
                "no drift tracker: witness blocks fall back to the most recent eligible blocks",
            )
        result = self.topology_layer.run(
            topk, lengths, offsets, drift, row_to_request, context=topology_context, plan=topology_plan
        )
        return result.indices, result.counters

    def _check_tracker(self, tracker: BlockDriftTracker, batch: int) -> None:
        block_size = self.topology.policy.block_size
        if tracker.block_size != block_size:
            raise ValueError(
                f"drift_tracker.block_size: expected {block_size} (the policy's block), got {tracker.block_size}"
            )
        if tracker.num_requests < batch:
            raise ValueError(
                f"drift_tracker.num_requests: expected >= {batch} (requests in the batch), got {tracker.num_requests}"
            )

    def _query_witness_scores(
        self,
        path: IndexerPath,
        topk: torch.Tensor,
        tracker: Optional[BlockDriftTracker],
        queries: Optional[torch.Tensor],
        lengths: torch.Tensor,
        row_to_request: torch.Tensor,
        batch: int,
    ) -> Optional[torch.Tensor]:
        """float32 ``[R, N]`` ``query_group_mass`` scores per row, or None (recency, logged once)
        when the caller passed no queries or no tracker."""
        if tracker is None or queries is None:
            missing = " and ".join(n for n, v in (("witness_queries", queries), ("drift_tracker", tracker)) if v is None)
            self._log_skip_once(
                "no_queries",
                path,
                "query_group_mass witnesses without %s: witness blocks fall back to the most recent eligible blocks",
                missing,
            )
            return None
        self._check_tracker(tracker, batch)
        R = topk.shape[0]
        if queries.dim() != 3 or queries.shape[0] != R or not queries.is_floating_point():
            raise ValueError(
                f"witness_queries: expected float [{R}, H, D] (the layer's attention queries of the path's {R} rows, "
                f"times the softmax scale), got {queries.dtype} of shape {tuple(queries.shape)}"
            )
        H, D = queries.shape[1], queries.shape[2]
        K = tracker.key_dim
        if K % D or H % (K // D):
            raise ValueError(
                f"drift_tracker.key_dim: expected Hkv * {D} (the attention keys, Hkv dividing witness_queries' "
                f"{H} heads), got {K}"
            )
        return tracker_query_group_mass_scores_unchecked(
            queries, tracker.block_sums(), tracker.block_counts(), row_to_request, lengths,
            self.topology.policy.block_size,
        )
