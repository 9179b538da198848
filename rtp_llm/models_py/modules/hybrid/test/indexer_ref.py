"""Plain per-row references of the indexer ops, and batch builders written the engine's way.

Used by tests (and benchmarks), never by the serving path. Loops and ``.tolist()`` are
deliberate: each function is meant to be obviously correct, not fast. Mirrors
``rtp_llm/models_py/modules/hybrid/indexer_torch_ops.py`` and the parameter planning the
engine does before calling ``Indexer._compute_topk``.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

from rtp_llm.models_py.modules.hybrid.indexer_params import (
    IndexerAttentionInputs,
    IndexerCPParams,
    IndexerFmhaParams,
)

FP8_E4M3_MAX = 448.0


# ---------------------------------------------------------------------------------------
# Ops, one row at a time.
# ---------------------------------------------------------------------------------------


def reference_fp8_round_trip(x: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """fp8-e4m3 quantize/dequantize of ``[..., D]``, one scale per token and channel group."""
    flat = x.to(torch.float32).reshape(-1, x.shape[-1])
    D = flat.shape[1]
    g = min(group_size, D)
    out = torch.empty_like(flat)
    for row in range(flat.shape[0]):
        for start in range(0, D, g):
            part = flat[row, start : start + g]
            amax = part.abs().max()
            scale = amax / FP8_E4M3_MAX if float(amax) > 0 else torch.tensor(1.0)
            out[row, start : start + g] = (part / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return out.reshape(x.shape)


def reference_row_scores(q_row: torch.Tensor, w_row: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``I[s] = sum_h w[h] * relu(q[h] . k[s])`` in float64; ``q_row [H, D]``, ``keys [n, D]``."""
    keys64 = keys.to(torch.float64)
    scores = torch.zeros(keys.shape[0], dtype=torch.float64)
    for h in range(q_row.shape[0]):
        scores += float(w_row[h]) * torch.relu(keys64 @ q_row[h].to(torch.float64))
    return scores


def reference_topk_row(scores: Sequence[float], length: int, offset: int, width: int) -> List[int]:
    """The engine's convention for one row: the whole range when short, else the top ``width``
    positions by score (ties to the lower position), plus ``offset``, padded with ``-1``."""
    if length <= width:
        chosen = list(range(length))
    else:
        chosen = sorted(range(length), key=lambda s: (-float(scores[s]), s))[:width]
    return [c + offset for c in chosen] + [-1] * (width - len(chosen))


def reference_request_keys(k_cache: torch.Tensor, block_table_row: Sequence[int], length: int) -> torch.Tensor:
    """Keys ``0 .. length - 1`` of one request, token by token through its block table."""
    page = k_cache.shape[1]
    return torch.stack([k_cache[block_table_row[p // page], p % page] for p in range(length)])


def reference_ragged_topk(q, weights, keys, row_starts, lengths, offsets, width, fp8_emulation=False):
    """Per-row loop; returns ``(int32 [R, W], list of float64 score rows)``."""
    R, H, _ = q.shape
    w = weights.reshape(R, H)
    if fp8_emulation:
        q, keys = reference_fp8_round_trip(q), reference_fp8_round_trip(keys)
    rows, all_scores = [], []
    for r in range(R):
        ks, length = int(row_starts[r]), int(lengths[r])
        off = 0 if offsets is None else int(offsets[r])
        scores = reference_row_scores(q[r], w[r], keys[ks : ks + length])
        rows.append(reference_topk_row(scores.tolist(), length, off, width))
        all_scores.append(scores)
    return torch.tensor(rows, dtype=torch.int32), all_scores


def reference_paged_topk(q, weights, k_cache, block_table, lengths, row_to_request, width, fp8_emulation=False):
    """Per-row loop reading keys through the block table; ``(int32 [R, W], score rows)``."""
    R, H, _ = q.shape
    w = weights.reshape(R, H)
    if fp8_emulation:
        q = reference_fp8_round_trip(q)
    table = block_table.tolist()
    rows, all_scores = [], []
    for r in range(R):
        length, req = int(lengths[r]), int(row_to_request[r])
        keys = reference_request_keys(k_cache, table[req], length)
        if fp8_emulation:
            keys = reference_fp8_round_trip(keys)
        scores = reference_row_scores(q[r], w[r], keys)
        rows.append(reference_topk_row(scores.tolist(), length, 0, width))
        all_scores.append(scores)
    return torch.tensor(rows, dtype=torch.int32), all_scores


def reference_complete_block_drift(keys: torch.Tensor, length: int, block_size: int, max_blocks: int) -> List[float]:
    """L2 drift of each block from the previous one when both are complete, else 0."""
    out = [0.0] * max_blocks
    full = length // block_size
    cents = [keys[b * block_size : (b + 1) * block_size].to(torch.float64).mean(dim=0).flatten() for b in range(full)]
    for b in range(1, min(full, max_blocks)):
        out[b] = float(torch.linalg.vector_norm(cents[b] - cents[b - 1]))
    return out


# ---------------------------------------------------------------------------------------
# Batches, planned the way the engine plans them.
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    """One step's parameters plus the allocation behind them (host lists for checks)."""

    kv_lens: List[int]
    block_table: torch.Tensor  # int32 [B, MB], unused columns -1
    num_blocks: int  # physical blocks in the pool
    slot_owner: dict  # physical slot -> (request, position)
    fmha_params: IndexerFmhaParams
    attention_inputs: IndexerAttentionInputs
    row_to_request: List[int]
    row_lengths: List[int]
    row_offsets: List[int]


def allocate_block_table(kv_lens: Sequence[int], page: int, generator: torch.Generator, spare_blocks: int = 3):
    """Random physical blocks per request; returns ``(block_table int32 [B, MB], num_blocks, slot_owner)``."""
    need = [(n + page - 1) // page for n in kv_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.full((len(kv_lens), max(need)), -1, dtype=torch.int32)
    owner, cursor = {}, 0
    for b, n_blocks in enumerate(need):
        for j in range(n_blocks):
            table[b, j] = perm[cursor]
            cursor += 1
        for p in range(kv_lens[b]):
            owner[int(table[b, p // page]) * page + p % page] = (b, p)
    return table, num_blocks, owner


def build_prefill_batch(
    prefix_lens: Sequence[int],
    new_lens: Sequence[int],
    page: int,
    generator: torch.Generator,
    offsets: Optional[Sequence[int]] = None,
) -> Batch:
    """Ragged prefill: request ``i`` has ``prefix_lens[i]`` cached tokens and ``new_lens[i]``
    query tokens; rows are request-major. ``offsets`` (one per request) defaults to 0."""
    kv_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    table, num_blocks, owner = allocate_block_table(kv_lens, page, generator)
    cu = [0]
    for n in kv_lens:
        cu.append(cu[-1] + n)
    esl, off, ks, ke, r2r = [], [], [], [], []
    for i, (prefix, new) in enumerate(zip(prefix_lens, new_lens)):
        for j in range(new):
            esl.append(prefix + j + 1)
            off.append(0 if offsets is None else offsets[i])
            ks.append(cu[i])
            ke.append(cu[i] + kv_lens[i])
            r2r.append(i)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    fmha = IndexerFmhaParams(expanded_seq_lens=i32(esl), topk_indices_offset=i32(off), ks=i32(ks), ke=i32(ke))
    attn = IndexerAttentionInputs(
        is_prefill=True, kv_cache_kernel_block_id_device=table, cu_kv_seqlens_device=i32(cu), total_kv_len=cu[-1]
    )
    return Batch(kv_lens, table, num_blocks, owner, fmha, attn, r2r, esl, off)


def build_decode_batch(
    kv_lens: Sequence[int], page: int, generator: torch.Generator, rows_per_request: Optional[Sequence[int]] = None
) -> Batch:
    """Decode: request ``b`` has ``kv_lens[b]`` tokens (this step's included) and
    ``rows_per_request[b]`` decode rows (default 1; more = multi-token decode), whose
    causal lengths end at ``kv_lens[b]``."""
    rows_per_request = [1] * len(kv_lens) if rows_per_request is None else list(rows_per_request)
    table, num_blocks, owner = allocate_block_table(kv_lens, page, generator)
    esl, r2r, cu = [], [], [0]
    for b, (n, rows) in enumerate(zip(kv_lens, rows_per_request)):
        for j in range(rows):
            esl.append(n - rows + j + 1)
            r2r.append(b)
        cu.append(cu[-1] + rows)
    empty = torch.empty(0, dtype=torch.int32)
    fmha = IndexerFmhaParams(
        expanded_seq_lens=torch.tensor(esl, dtype=torch.int32), topk_indices_offset=empty, ks=empty, ke=empty
    )
    multi = any(rows != 1 for rows in rows_per_request)
    attn = IndexerAttentionInputs(
        is_prefill=False,
        kv_cache_kernel_block_id_device=table,
        decode_cu_seqlens_device=torch.tensor(cu, dtype=torch.int32) if multi else None,
    )
    return Batch(list(kv_lens), table, num_blocks, owner, fmha, attn, r2r, esl, [0] * len(esl))


def zigzag_cp_rows(batch_new_lens: Sequence[int], cp_size: int, cp_rank: int) -> List[int]:
    """Global rows a CP rank owns: each request's query tokens cut into ``2 * cp_size``
    chunks; rank ``r`` takes chunks ``r`` and ``2 * cp_size - 1 - r`` (load balancing)."""
    rows, start = [], 0
    parts = 2 * cp_size
    for new in batch_new_lens:
        bounds = [start + (new * c) // parts for c in range(parts + 1)]
        for c in (cp_rank, parts - 1 - cp_rank):
            rows.extend(range(bounds[c], bounds[c + 1]))
        start += new
    return rows


def build_cp_params(batch: Batch, global_rows: Sequence[int], cp_size: int, cp_rank: int, pad_rows: int = 1):
    """CP parameters for a rank whose query buffer is ``pad_rows`` padding rows then
    ``global_rows`` in order; returns ``(IndexerCPParams, local_buffer_rows)`` where
    ``local_buffer_rows[i]`` is the global row held in local buffer row ``i`` (-1: padding)."""
    local_rows = [-1] * pad_rows + list(global_rows)
    local_ids = torch.tensor([pad_rows + i for i in range(len(global_rows))], dtype=torch.int64)
    params = IndexerCPParams.plan(
        batch.fmha_params,
        total_local_ids=local_ids,
        total_global_ids=torch.tensor(list(global_rows), dtype=torch.int64),
        cu_kv_seqlens_global=batch.attention_inputs.cu_kv_seqlens_device,
        total_kv_len=batch.attention_inputs.total_kv_len,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
    return params, local_rows


@dataclasses.dataclass
class IndexerCase:
    """One step (prefill or decode): parameters, keys and queries, reproducible from a seed."""

    batch: Batch
    keys: torch.Tensor  # [total_kv_len, D] ragged, request-major
    slots: torch.Tensor  # int64 [total_kv_len] physical slot of every key
    positions: torch.Tensor  # int64 [total_kv_len] request-local position of every key
    request_ids: torch.Tensor  # int64 [total_kv_len]
    is_prefix: torch.Tensor  # bool [total_kv_len] cached before this step
    q: torch.Tensor  # [R, H, D]
    weights: torch.Tensor  # [R, H, 1]


def _fill_case(
    batch, prefix_lens, dim, page, gen, planted_shift_blocks, shift_scale, rows, heads, integer_valued=False
) -> IndexerCase:
    keys, slots, positions, request_ids, is_prefix = [], [], [], [], []
    for i, (n, prefix) in enumerate(zip(batch.kv_lens, prefix_lens)):
        k = torch.randn(n, dim, generator=gen)
        for b in planted_shift_blocks:
            k[b * page :] += shift_scale * torch.randn(dim, generator=gen) / dim**0.5
        keys.append(k)
        for p in range(n):
            slots.append(int(batch.block_table[i, p // page]) * page + p % page)
            positions.append(p)
            request_ids.append(i)
            is_prefix.append(p < prefix)
    q = torch.randn(rows, heads, dim, generator=gen)
    weights = torch.randn(rows, heads, 1, generator=gen)
    keys = torch.cat(keys)
    if integer_valued:
        # Small integers: every dot product and weighted sum is exact in fp32 whatever
        # the accumulation order, so results cannot depend on the kernel or batch shape.
        keys, q, weights = (2 * keys).round(), (2 * q).round(), (2 * weights).round()
    as64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return IndexerCase(
        batch, keys, as64(slots), as64(positions), as64(request_ids), torch.tensor(is_prefix), q, weights
    )


def build_prefill_case(
    prefix_lens: Sequence[int],
    new_lens: Sequence[int],
    heads: int,
    dim: int,
    page: int,
    seed: int,
    planted_shift_blocks: Sequence[int] = (),
    shift_scale: float = 8.0,
    integer_valued: bool = False,
) -> IndexerCase:
    """Random keys with a step change (a content shift of norm ~``shift_scale``) at the
    start of every block in ``planted_shift_blocks``: those blocks are the high-drift ones.
    ``integer_valued`` rounds ``2 * value`` of keys, queries and weights to integers
    (exact logits: for bit-equality checks across batch shapes and devices)."""
    gen = torch.Generator().manual_seed(seed)
    batch = build_prefill_batch(prefix_lens, new_lens, page, gen)
    rows = len(batch.row_lengths)
    return _fill_case(
        batch, prefix_lens, dim, page, gen, planted_shift_blocks, shift_scale, rows, heads, integer_valued
    )


def build_decode_case(
    kv_lens: Sequence[int],
    heads: int,
    dim: int,
    page: int,
    seed: int,
    planted_shift_blocks: Sequence[int] = (),
    shift_scale: float = 8.0,
    rows_per_request: Optional[Sequence[int]] = None,
) -> IndexerCase:
    """Decode step over ``kv_lens`` (keys as :func:`build_prefill_case`); the last
    ``rows_per_request[b]`` tokens of request ``b`` are this step's (not prefix). Keys and
    allocation depend only on ``kv_lens`` and ``seed``, not on ``rows_per_request``."""
    gen = torch.Generator().manual_seed(seed)
    batch = build_decode_batch(kv_lens, page, gen, rows_per_request)
    per_req = [1] * len(kv_lens) if rows_per_request is None else list(rows_per_request)
    prefix_lens = [n - r for n, r in zip(kv_lens, per_req)]
    case = _fill_case(batch, prefix_lens, dim, page, gen, planted_shift_blocks, shift_scale, 0, heads)
    qgen = torch.Generator().manual_seed(seed + 1)
    rows = len(batch.row_lengths)
    case.q = torch.randn(rows, heads, dim, generator=qgen)
    case.weights = torch.randn(rows, heads, 1, generator=qgen)
    return case
