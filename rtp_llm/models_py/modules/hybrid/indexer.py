"""Lightning indexer with the topology KV policy hooked in after its top-k op.

Shaped like the engine's ``rtp_llm/models_py/modules/hybrid/indexer.py``:
``Indexer._compute_topk(q, weights, kv_cache, fmha_params, attention_inputs, cp_params)``
routes to one of three top-k ops and returns int32 ``[R, W]`` rows of request-local
token positions (DESIGN.md has the convention). Here the ops are the torch references in
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
scores come from a caller-owned :class:`BlockDriftTracker` (live key-centroid drift).

Configuration (read and validated once, at construction, by
:meth:`IndexerTopologySettings.from_env`; unset or blank means the default):

=========================================== ============================ ==================
variable                                    valid values                 default
=========================================== ============================ ==================
``RTP_LLM_TOPOLOGY_KV_POLICY``              disabled, topology_sparse_   disabled
                                            merge, topology_compress_
                                            sparse, topology_only
``RTP_LLM_TOPOLOGY_KV_SINK_BLOCKS``         integer >= 0                 1
``RTP_LLM_TOPOLOGY_KV_LOCAL_BLOCKS``        integer >= 0                 2
``RTP_LLM_TOPOLOGY_KV_WITNESS_BLOCKS``      integer >= 0                 2
``RTP_LLM_TOPOLOGY_KV_MAX_STRUCTURAL_       float in (0, 1]              0.25
FRACTION``
``RTP_LLM_TOPOLOGY_KV_MISMATCH_ACTION``     raise, fallback_disabled     fallback_disabled
``RTP_LLM_TOPOLOGY_KV_PATHS``               comma list of decode,        all
                                            prefill, cp; or all
``RTP_LLM_TOPOLOGY_KV_SINK_TOKENS``         integer >= 0, or "blocks"    4 (the policy config's
                                            (whole sink blocks)          ``sink_tokens``)
``RTP_LLM_TOPOLOGY_KV_STRUCTURAL_BUDGET``   fixed, scaled                the policy config's
=========================================== ============================ ==================

Names are case-insensitive. ``fallback_disabled`` is the default because ``raise`` reads
values on the host (one sync per layer call), which the serving hot path must not do.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
from typing import Any, FrozenSet, Mapping, Optional, Tuple

import torch
from torch import nn

from rtp_llm.models_py.modules.hybrid import indexer_torch_ops
from rtp_llm.models_py.modules.hybrid.topology_kv_policy import (
    CoordinateMismatchAction,
    StructuralBudget,
    TopologyKVCounters,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
    apply_topology_kv_policy,
)
from rtp_llm.models_py.modules.hybrid.topology_kv_schedule import (
    DEFAULT_BLOCK_SIZE,
    DriftMetric,
    block_drift_scores_unchecked,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Settings from the environment.
# ---------------------------------------------------------------------------------------

ENV_POLICY = "RTP_LLM_TOPOLOGY_KV_POLICY"
ENV_SINK_BLOCKS = "RTP_LLM_TOPOLOGY_KV_SINK_BLOCKS"
ENV_LOCAL_BLOCKS = "RTP_LLM_TOPOLOGY_KV_LOCAL_BLOCKS"
ENV_WITNESS_BLOCKS = "RTP_LLM_TOPOLOGY_KV_WITNESS_BLOCKS"
ENV_MAX_STRUCTURAL_FRACTION = "RTP_LLM_TOPOLOGY_KV_MAX_STRUCTURAL_FRACTION"
ENV_MISMATCH_ACTION = "RTP_LLM_TOPOLOGY_KV_MISMATCH_ACTION"
ENV_PATHS = "RTP_LLM_TOPOLOGY_KV_PATHS"
ENV_SINK_TOKENS = "RTP_LLM_TOPOLOGY_KV_SINK_TOKENS"
ENV_STRUCTURAL_BUDGET = "RTP_LLM_TOPOLOGY_KV_STRUCTURAL_BUDGET"


class IndexerPath(enum.Enum):
    """The three top-k paths of :meth:`Indexer._compute_topk`."""

    DECODE = "decode"  # _get_topk_paged
    PREFILL = "prefill"  # _get_topk_ragged
    CP = "cp"  # _get_topk_ragged_cp


ALL_PATHS: FrozenSet[IndexerPath] = frozenset(IndexerPath)


def _default_policy() -> TopologyKVPolicyConfig:
    return TopologyKVPolicyConfig(coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED)


def _env_value(environ: Mapping[str, str], name: str) -> Optional[str]:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    return raw


def _env_count(environ: Mapping[str, str], name: str, default: Optional[int]) -> Optional[int]:
    raw = _env_value(environ, name)
    if raw is None:
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a non-negative integer, got {value}")
    return value


def _env_fraction(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = _env_value(environ, name)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number in (0, 1], got {raw!r}") from None
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{name}={raw!r}: expected a number in (0, 1], got {value}")
    return value


def _env_enum(environ: Mapping[str, str], name: str, cls, default):
    raw = _env_value(environ, name)
    if raw is None:
        return default
    try:
        return cls.parse(raw)
    except ValueError:
        valid = ", ".join(m.value for m in cls)
        raise ValueError(f"{name}={raw!r}: expected one of [{valid}] (case-insensitive), got {raw!r}") from None


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
                f"{name}={raw!r}: expected a comma-separated list of [{valid}] or 'all', "
                f"got unknown path {item.strip()!r}"
            )
        paths.add(match[0])
    return frozenset(paths)


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
    """

    policy: TopologyKVPolicyConfig = dataclasses.field(default_factory=_default_policy)
    paths: FrozenSet[IndexerPath] = ALL_PATHS

    def __post_init__(self) -> None:
        if not isinstance(self.policy, TopologyKVPolicyConfig):
            raise TypeError(f"policy: expected TopologyKVPolicyConfig, got {type(self.policy).__name__}")
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

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] = os.environ, *, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> "IndexerTopologySettings":
        """Read the ``RTP_LLM_TOPOLOGY_KV_*`` variables (module docstring); ``ValueError``
        naming the variable and its value on anything invalid."""
        mode = _env_enum(environ, ENV_POLICY, TopologyKVPolicyMode, TopologyKVPolicyMode.DISABLED)
        sink = _env_count(environ, ENV_SINK_BLOCKS, 1)
        local = _env_count(environ, ENV_LOCAL_BLOCKS, 2)
        witness = _env_count(environ, ENV_WITNESS_BLOCKS, 2)
        fraction = _env_fraction(environ, ENV_MAX_STRUCTURAL_FRACTION, 0.25)
        action = _env_enum(
            environ, ENV_MISMATCH_ACTION, CoordinateMismatchAction, CoordinateMismatchAction.FALLBACK_DISABLED
        )
        paths = _env_paths(environ, ENV_PATHS)
        defaults = TopologyKVPolicyConfig()
        raw_sink_tokens = _env_value(environ, ENV_SINK_TOKENS)
        if raw_sink_tokens is not None and raw_sink_tokens.strip().lower() == "blocks":
            sink_tokens = None
        else:
            sink_tokens = _env_count(environ, ENV_SINK_TOKENS, defaults.sink_tokens)
        budget = _env_enum(environ, ENV_STRUCTURAL_BUDGET, StructuralBudget, defaults.structural_budget)
        try:
            policy = TopologyKVPolicyConfig(
                policy=mode,
                sink_blocks=sink,
                local_blocks=local,
                witness_blocks=witness,
                block_size=block_size,
                max_structural_fraction=fraction,
                coordinate_mismatch_action=action,
                sink_tokens=sink_tokens,
                structural_budget=budget,
            )
        except ValueError as err:
            raise ValueError(
                f"{ENV_POLICY}={mode.value!r} with {ENV_SINK_BLOCKS}={sink}, {ENV_SINK_TOKENS}="
                f"{'blocks' if sink_tokens is None else sink_tokens}, {ENV_LOCAL_BLOCKS}={local}, "
                f"{ENV_WITNESS_BLOCKS}={witness}: {err}"
            ) from None
        return cls(policy=policy, paths=paths)


# ---------------------------------------------------------------------------------------
# Parameter objects (the engine's field names and dtypes).
# ---------------------------------------------------------------------------------------


def _check_param(owner: str, name: str, value, dtype, ndim: int) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}.{name}: expected torch.Tensor, got {type(value).__name__}")
    if value.dtype != dtype or value.dim() != ndim:
        raise TypeError(
            f"{owner}.{name}: expected {str(dtype).replace('torch.', '')} rank {ndim}, "
            f"got {str(value.dtype).replace('torch.', '')} shape {tuple(value.shape)}"
        )


@dataclasses.dataclass
class IndexerFmhaParams:
    """The indexer's share of the engine's ``fmha_params`` (int32 device tensors).

    Prefill (one entry per query token ``j`` of request ``i``):
    ``expanded_seq_lens = prefix_len + j + 1`` (causal length), ``topk_indices_offset = 0``,
    ``ks`` = the request's start in the ragged key buffer, ``ke = ks + kv_len``.
    Decode: ``expanded_seq_lens`` is the KV length of each decode row; the other three
    are empty. ``slot_mapping`` (int64 ``[T]``, optional) is where this step's keys go in
    the paged pool: ``block_table[req, pos // page] * page + pos % page``.
    """

    expanded_seq_lens: torch.Tensor
    topk_indices_offset: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor
    slot_mapping: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for name in ("expanded_seq_lens", "topk_indices_offset", "ks", "ke"):
            _check_param("fmha_params", name, getattr(self, name), torch.int32, 1)


@dataclasses.dataclass
class IndexerAttentionInputs:
    """The indexer's share of the engine's ``attention_inputs``.

    Attributes
    ----------
    is_prefill : bool
    kv_cache_kernel_block_id_device : int32 ``[B, MB]`` block table of the batch
    cu_kv_seqlens_device : int32 ``[B + 1]`` cumulative KV lengths (prefill), or None
    total_kv_len : host int, ``cu_kv_seqlens_device[-1]`` (prefill; known at plan time)
    decode_cu_seqlens_device : int32 ``[B + 1]`` cumulative decode rows per request, or
        None (one row per request)
    is_target_verify, is_draft_extend : multi-token decode steps (routed to decode)
    """

    is_prefill: bool
    kv_cache_kernel_block_id_device: torch.Tensor
    cu_kv_seqlens_device: Optional[torch.Tensor] = None
    total_kv_len: int = 0
    decode_cu_seqlens_device: Optional[torch.Tensor] = None
    is_target_verify: bool = False
    is_draft_extend: bool = False

    def __post_init__(self) -> None:
        table = self.kv_cache_kernel_block_id_device
        _check_param("attention_inputs", "kv_cache_kernel_block_id_device", table, torch.int32, 2)
        for name in ("cu_kv_seqlens_device", "decode_cu_seqlens_device"):
            if getattr(self, name) is not None:
                _check_param("attention_inputs", name, getattr(self, name), torch.int32, 1)

    @property
    def batch_size(self) -> int:
        return self.kv_cache_kernel_block_id_device.shape[0]


@dataclasses.dataclass
class IndexerCPParams:
    """The engine's context-parallel prefill parameters, for this rank.

    Attributes
    ----------
    total_local_ids : int64 ``[R_local]`` rows of this rank's query buffer that take part
    total_global_ids : int64 ``[R_local]`` the same rows' index in the whole batch's ragged
        token order (the index into ``fmha_params`` tensors)
    cu_kv_seqlens_global : int32 ``[B + 1]`` cumulative KV lengths of the whole batch
    total_kv_len : host int, ``cu_kv_seqlens_global[-1]``
    precomputed_ks, precomputed_ke, precomputed_lengths, precomputed_topk_off : int32
        ``[R_local]`` = ``fmha_params.{ks, ke, expanded_seq_lens,
        topk_indices_offset}[total_global_ids]`` (see :meth:`plan`)
    cp_size, cp_rank : host ints
    """

    total_local_ids: torch.Tensor
    total_global_ids: torch.Tensor
    cu_kv_seqlens_global: torch.Tensor
    total_kv_len: int
    precomputed_ks: torch.Tensor
    precomputed_ke: torch.Tensor
    precomputed_lengths: torch.Tensor
    precomputed_topk_off: torch.Tensor
    cp_size: int = 1
    cp_rank: int = 0

    def __post_init__(self) -> None:
        _check_param("cp_params", "total_local_ids", self.total_local_ids, torch.int64, 1)
        _check_param("cp_params", "total_global_ids", self.total_global_ids, torch.int64, 1)
        _check_param("cp_params", "cu_kv_seqlens_global", self.cu_kv_seqlens_global, torch.int32, 1)
        for name in ("precomputed_ks", "precomputed_ke", "precomputed_lengths", "precomputed_topk_off"):
            _check_param("cp_params", name, getattr(self, name), torch.int32, 1)

    @classmethod
    def plan(
        cls,
        fmha_params: IndexerFmhaParams,
        total_local_ids: torch.Tensor,
        total_global_ids: torch.Tensor,
        cu_kv_seqlens_global: torch.Tensor,
        total_kv_len: int,
        cp_size: int = 1,
        cp_rank: int = 0,
    ) -> "IndexerCPParams":
        """Index the whole batch's ``fmha_params`` by ``total_global_ids`` (as the engine's plan())."""
        ids = total_global_ids.to(torch.int64)
        return cls(
            total_local_ids=total_local_ids.to(torch.int64),
            total_global_ids=ids,
            cu_kv_seqlens_global=cu_kv_seqlens_global,
            total_kv_len=total_kv_len,
            precomputed_ks=fmha_params.ks.index_select(0, ids),
            precomputed_ke=fmha_params.ke.index_select(0, ids),
            precomputed_lengths=fmha_params.expanded_seq_lens.index_select(0, ids),
            precomputed_topk_off=fmha_params.topk_indices_offset.index_select(0, ids),
            cp_size=cp_size,
            cp_rank=cp_rank,
        )


@dataclasses.dataclass
class IndexerKeyCache:
    """Paged pool of indexer keys: ``k_cache`` ``[num_blocks, page, D]`` (one KV head)."""

    k_cache: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.k_cache, torch.Tensor) or self.k_cache.dim() != 3:
            raise ValueError(f"k_cache: expected a [num_blocks, page, D] tensor, got {self.k_cache!r:.80}")

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]


# ---------------------------------------------------------------------------------------
# Live drift.
# ---------------------------------------------------------------------------------------


class BlockDriftTracker:
    """Per-request block centroids of the indexer keys, kept up to date as the cache fills.

    One tracker serves one layer and one batch of ``B`` requests (request ``b`` = row
    ``b`` of the batch's block table); the caller owns it and passes it to
    :meth:`Indexer._compute_topk`. State lives on ``device``: block sums ``[B, N + 1, K]``
    fp32, counts ``[B, N + 1]`` and drift ``[B, N]`` (column ``N`` of the first two is a
    dump for positions past capacity; ``K`` = flattened key size). Memory is
    ``4 * B * (N + 1) * (K + 2)`` bytes.

    Drift of block ``n`` is the :func:`block_drift_scores_unchecked` distance between the
    centroids of blocks ``n - 1`` and ``n`` once *both are complete* (``block_size``
    tokens fed), else 0; block 0 scores 0. A partial block's centroid would move with
    every token and a few-token mean is noisy, so it scores nothing until it completes
    (the row's own partial block is a local block anyway). Each position must be fed once
    (:meth:`reset` a request before feeding it again). :meth:`update` is sync-free with
    static shapes: it touches only the blocks of the new tokens and their successors.
    """

    def __init__(
        self,
        num_requests: int,
        max_blocks: int,
        key_dim: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        metric: DriftMetric = DriftMetric.L2,
        device: Optional[torch.device] = None,
    ) -> None:
        for name, value, low in (
            ("num_requests", num_requests, 1),
            ("max_blocks", max_blocks, 1),
            ("key_dim", key_dim, 1),
            ("block_size", block_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        self.num_requests = num_requests
        self.max_blocks = max_blocks
        self.key_dim = key_dim
        self.block_size = block_size
        self.metric = DriftMetric.parse(metric)
        B, N = num_requests, max_blocks
        self._sums = torch.zeros(B, N + 1, key_dim, dtype=torch.float32, device=device)
        self._counts = torch.zeros(B, N + 1, dtype=torch.float32, device=device)
        self._drift_flat = torch.zeros(B * N + 1, dtype=torch.float32, device=device)  # last: dump

    @property
    def device(self) -> torch.device:
        return self._sums.device

    def drift_scores(self) -> torch.Tensor:
        """float32 ``[B, N]`` live drift (a view; updated in place by :meth:`update`)."""
        return self._drift_flat[: self.num_requests * self.max_blocks].view(self.num_requests, self.max_blocks)

    def centroids(self) -> torch.Tensor:
        """float32 ``[B, N, K]`` mean key of the tokens fed so far per block (zeros if none)."""
        sums, counts = self._sums[:, : self.max_blocks], self._counts[:, : self.max_blocks]
        return sums / counts.clamp(min=1).unsqueeze(-1)

    def block_counts(self) -> torch.Tensor:
        """float32 ``[B, N]`` tokens fed per block."""
        return self._counts[:, : self.max_blocks]

    def reset(self, request_ids: Optional[torch.Tensor] = None) -> None:
        """Forget the requests ``request_ids`` (int ``[k]``), or all; no sync."""
        if request_ids is None:
            self._sums.zero_()
            self._counts.zero_()
            self._drift_flat.zero_()
            return
        ids = request_ids.to(device=self.device, dtype=torch.int64)
        self._sums.index_fill_(0, ids, 0.0)
        self._counts.index_fill_(0, ids, 0.0)
        self.drift_scores().index_fill_(0, ids, 0.0)

    def update(
        self, keys: torch.Tensor, positions: torch.Tensor, request_ids: Optional[torch.Tensor] = None
    ) -> None:
        """Add new keys to their blocks and refresh the drift they affect; no host sync.

        Parameters
        ----------
        keys : float ``[T, D]`` or ``[T, H, D]`` keys as stored in the cache
        positions : int ``[T]`` request-local token positions; ``< 0`` or past
            ``max_blocks * block_size`` are ignored
        request_ids : int ``[T]`` request (block-table row) of each key, or None (all 0)
        """
        T = keys.shape[0]
        if positions.shape != (T,) or (request_ids is not None and request_ids.shape != (T,)):
            raise ValueError(
                f"positions / request_ids: expected shape ({T},) like keys' first dim, got "
                f"{tuple(positions.shape)} / {None if request_ids is None else tuple(request_ids.shape)}"
            )
        flat = keys.reshape(T, -1).to(device=self.device, dtype=torch.float32)  # [T, K]
        if flat.shape[1] != self.key_dim:
            raise ValueError(f"keys: expected {self.key_dim} values per token, got shape {tuple(keys.shape)}")
        N, bs = self.max_blocks, self.block_size
        pos = positions.to(device=self.device, dtype=torch.int64)
        req = (
            torch.zeros_like(pos)
            if request_ids is None
            else request_ids.to(device=self.device, dtype=torch.int64)
        )
        blk = torch.div(pos, bs, rounding_mode="floor")
        blk = torch.where((pos >= 0) & (blk < N), blk, N)  # [T]; N = dump column
        lin = req * (N + 1) + blk
        self._sums.view(-1, self.key_dim).index_add_(0, lin, flat)
        self._counts.view(-1).index_add_(0, lin, torch.ones_like(flat[:, 0]))

        # Blocks whose drift may have changed: each new token's block and the next one.
        target = torch.stack([blk, blk + 1], dim=1)  # [T, 2]
        pair = torch.stack([target - 1, target], dim=2).clamp(0, N)  # [T, 2, 2] (prev, cur)
        sums = self._sums[req.view(T, 1, 1), pair]  # [T, 2, 2, K]
        counts = self._counts[req.view(T, 1, 1), pair]  # [T, 2, 2]
        cents = sums / counts.clamp(min=1).unsqueeze(-1)
        drift = block_drift_scores_unchecked(cents.unsqueeze(-1), self.metric)[..., 1]  # [T, 2]
        live = (target >= 1) & (target < N)
        complete = (counts == bs).all(dim=2) & live
        dst = torch.where(live, req.view(T, 1) * N + target, self.num_requests * N)  # dump slot
        # Duplicate destinations carry identical values (same state), so the write is exact.
        self._drift_flat.index_put_((dst.flatten(),), torch.where(complete, drift, 0.0).flatten())


# ---------------------------------------------------------------------------------------
# The indexer.
# ---------------------------------------------------------------------------------------


class Indexer(nn.Module):
    """DeepSeek-V3.2 lightning-indexer top-k with the topology KV policy after it.

    Parameters
    ----------
    index_n_heads, index_head_dim : ``H``, ``D`` of the indexer queries and keys
    index_topk : ``W``, the top-k width (2048 in DeepSeek-V3.2)
    blocksize : KV page size in tokens (the engine's ``kernel_tokens_per_block``, 64)
    layer_idx : for log messages
    fp8_emulation : emulate the engine's fp8-e4m3 q/k (reference ops and :meth:`write_keys`)
    topology : settings; None reads them from ``os.environ`` once, here
    """

    def __init__(
        self,
        index_n_heads: int,
        index_head_dim: int,
        index_topk: int = indexer_torch_ops.DEFAULT_TOPK_WIDTH,
        blocksize: int = indexer_torch_ops.DEFAULT_PAGE_SIZE,
        *,
        layer_idx: int = 0,
        fp8_emulation: bool = False,
        topology: Optional[IndexerTopologySettings] = None,
    ) -> None:
        super().__init__()
        self.index_n_heads = index_n_heads
        self.index_head_dim = index_head_dim
        self.index_topk = index_topk
        self.blocksize = blocksize
        self.layer_idx = layer_idx
        self.fp8_emulation = fp8_emulation
        if topology is None:
            topology = IndexerTopologySettings.from_env(os.environ, block_size=blocksize)
        if not isinstance(topology, IndexerTopologySettings):
            raise TypeError(f"topology: expected IndexerTopologySettings, got {type(topology).__name__}")
        self.topology = topology
        self._logged_skip_reasons = set()  # (reason, path) pairs already logged
        # Counters of the last policy call (0-dim device tensors; None when it did not run).
        self.last_topology_counters: Optional[TopologyKVCounters] = None

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
    ) -> Optional[torch.Tensor]:
        """Top-k rows of the step, then the topology policy when enabled for the path.

        Parameters
        ----------
        q : ``[T, H, D]`` indexer queries (this rank's tokens under CP)
        weights : ``[T, H]`` or ``[T, H, 1]`` per-head gates
        kv_cache, fmha_params, attention_inputs, cp_params : see the parameter classes
        drift_tracker : this layer's :class:`BlockDriftTracker` for the batch, or None
            (witnesses then fall back to the most recent blocks; logged once)
        topology_context : TopologyRequestContext or one per request (compress mode)

        Returns
        -------
        int32 ``[R, W]`` request-local positions (``R = T`` except under CP, where it is
        ``len(total_local_ids)``), ``-1`` padding; None for a CP rank with no local row.
        With the policy disabled (default) it is the op's output tensor itself.
        """
        path = self.select_path(attention_inputs, cp_params)
        if path is IndexerPath.DECODE:
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
        if not self.topology.enabled or topk is None:
            return topk
        return self._apply_topology(
            path, topk, fmha_params, attention_inputs, cp_params, drift_tracker, topology_context
        )

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
        )

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
        for a batch, ``request_ids``). Reference of the engine's ``quant_k_only``."""
        stored = indexer_torch_ops.fp8_e4m3_round_trip(keys) if self.fp8_emulation else keys
        pool = kv_cache.k_cache.view(-1, kv_cache.k_cache.shape[-1])
        pool[slot_mapping.to(torch.int64)] = stored.to(pool.dtype)
        if drift_tracker is not None:
            if positions is None:
                raise ValueError("positions: expected the keys' request-local positions to feed drift_tracker")
            drift_tracker.update(stored, positions, request_ids)

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
        row = torch.arange(rows, device=block_table.device)
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
    ) -> torch.Tensor:
        config = self.topology.policy
        if path not in self.topology.paths:
            self.last_topology_counters = None
            self._log_skip_once(
                "path_off",
                path,
                "topology KV policy %s skipped: the path is not in %s; top-k rows pass through unchanged",
                config.policy.value,
                ENV_PATHS,
            )
            return topk
        lengths, offsets, row_to_request, batch = self._policy_inputs(
            path, topk, fmha_params, attention_inputs, cp_params
        )
        drift = None
        if drift_tracker is not None:
            if drift_tracker.block_size != config.block_size:
                raise ValueError(
                    f"drift_tracker.block_size: expected {config.block_size} (the policy's block), "
                    f"got {drift_tracker.block_size}"
                )
            if drift_tracker.num_requests < batch:
                raise ValueError(
                    f"drift_tracker.num_requests: expected >= {batch} (requests in the batch), "
                    f"got {drift_tracker.num_requests}"
                )
            drift = drift_tracker.drift_scores()
        elif config.witness_blocks > 0 or config.policy is TopologyKVPolicyMode.TOPOLOGY_ONLY:
            self._log_skip_once(
                "no_drift",
                path,
                "no drift tracker: witness blocks fall back to the most recent eligible blocks",
            )
        result = apply_topology_kv_policy(
            topk,
            lengths,
            config=config,
            topk_indices_offset=offsets,
            block_drift_scores=drift,
            row_to_request=row_to_request,
            context=topology_context,
        )
        self.last_topology_counters = result.counters
        return result.indices
