"""The engine's parameter objects as the indexer reads them (field names and dtypes).

Shaped like RTP-LLM's ``fmha_params``, ``attention_inputs`` and context-parallel
parameters, reduced to the fields :class:`~rtp_llm.models_py.modules.hybrid.indexer.Indexer`
uses. Each validates its tensors' dtype and rank once, at construction, naming the field.
Shape vocabulary: ``R`` query rows, ``T`` tokens, ``B`` requests, ``MB`` block-table
columns, ``D`` indexer head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


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
