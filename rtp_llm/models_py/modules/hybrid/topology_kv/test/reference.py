"""Plain reference implementations (Python loops, ``.tolist()``) for tests and benchmarks.

Never imported by the serving path. Each function mirrors a vectorized function in
``rtp_llm/models_py/modules/hybrid`` and is written to be obviously correct, not fast.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch


def reference_block_key_centroids(keys: torch.Tensor, block_size: int, length: Optional[int] = None) -> torch.Tensor:
    """Per-block mean of ``keys[:length]`` (``[L, H, D]``) in float64, block by block."""
    L = keys.shape[0] if length is None else length
    n_blocks = (keys.shape[0] + block_size - 1) // block_size
    out = torch.zeros(n_blocks, keys.shape[1], keys.shape[2], dtype=torch.float64)
    for b in range(n_blocks):
        lo, hi = b * block_size, min((b + 1) * block_size, L)
        if hi > lo:
            out[b] = keys[lo:hi].to(torch.float64).mean(dim=0)
    return out


def reference_drift_l2(centroids: torch.Tensor) -> List[float]:
    """``[0, ||c1 - c0||, ||c2 - c1||, ...]`` over flattened ``[N, H, D]`` centroids."""
    flat = centroids.to(torch.float64).flatten(1)
    return [0.0] + [float(torch.linalg.vector_norm(flat[b] - flat[b - 1])) for b in range(1, flat.shape[0])]


def reference_block_key_bounds(keys: torch.Tensor, block_size: int, length: Optional[int] = None):
    """Per-block, per-channel (min, max) of ``keys[:length]`` (``[L, H, D]``) in float64; empty blocks 0."""
    L = keys.shape[0] if length is None else length
    n_blocks = (keys.shape[0] + block_size - 1) // block_size
    kmin = torch.zeros(n_blocks, keys.shape[1], keys.shape[2], dtype=torch.float64)
    kmax = torch.zeros_like(kmin)
    for b in range(n_blocks):
        lo, hi = b * block_size, min((b + 1) * block_size, L)
        for h in range(keys.shape[1]):
            for d in range(keys.shape[2]):
                vals = [float(keys[t, h, d]) for t in range(lo, hi)]
                if vals:
                    kmin[b, h, d], kmax[b, h, d] = min(vals), max(vals)
    return kmin, kmax


def _reference_block_mass(H: int, group: int, N: int, n_elig: int, logit) -> List[float]:
    """``sum_h softmax_b(logit(h, g, b))`` over blocks ``b < n_elig``, by loops (others 0)."""
    import math

    out = [0.0] * N
    for h in range(H):
        u = [logit(h, h // group, b) for b in range(n_elig)]
        top = max(u)
        z = sum(math.exp(x - top) for x in u)
        for b in range(n_elig):
            out[b] += math.exp(u[b] - top) / z
    return out


def _eligible_blocks(N: int, length: Optional[int], block_size: int) -> int:
    return N if length is None else min(N, (length + block_size - 1) // block_size)


def reference_query_bound_scores(query, key_min, key_max, length: Optional[int], block_size: int, scale: float):
    """One row: ``sum_h softmax_b(scale * sum_d max(q kmin, q kmax))`` over eligible blocks, by loops.

    ``query`` ``[H, D]``, ``key_min``/``key_max`` ``[N, Hkv, D]``; returns a list of N floats.
    """
    H, D = query.shape
    N, Hkv, _ = key_min.shape

    def logit(h, g, b):
        return scale * sum(max(float(query[h, d]) * float(key_min[b, g, d]),
                               float(query[h, d]) * float(key_max[b, g, d])) for d in range(D))

    return _reference_block_mass(H, H // Hkv, N, _eligible_blocks(N, length, block_size), logit)


def reference_query_mass_scores(query, key_centroids, length: Optional[int], block_size: int, scale: float):
    """One row: ``sum_h softmax_b(scale * q_h . c[b, g(h)])`` over eligible blocks, by loops."""
    H, D = query.shape
    N, Hkv, _ = key_centroids.shape

    def logit(h, g, b):
        return scale * sum(float(query[h, d]) * float(key_centroids[b, g, d]) for d in range(D))

    return _reference_block_mass(H, H // Hkv, N, _eligible_blocks(N, length, block_size), logit)


def reference_query_group_mass_scores(query, key_centroids, length: Optional[int], block_size: int, scale: float):
    """One row: ``sum_g softmax_b(scale * qbar_g . c[b, g])``, ``qbar_g`` the mean of the query
    heads that read KV head ``g``, over eligible blocks, by loops."""
    H, D = query.shape
    N, Hkv, _ = key_centroids.shape
    group = H // Hkv
    qbar = [[sum(float(query[g * group + i, d]) for i in range(group)) / group for d in range(D)] for g in range(Hkv)]

    def logit(g, _g, b):
        return scale * sum(qbar[g][d] * float(key_centroids[b, g, d]) for d in range(D))

    return _reference_block_mass(Hkv, 1, N, _eligible_blocks(N, length, block_size), logit)


def reference_prioritized_blocks(
    length: int,
    sink_blocks: int,
    local_blocks: int,
    witness_blocks: int,
    block_size: int,
    drift: Optional[Sequence[float]] = None,
) -> List[int]:
    """Scheduled blocks of one row in priority order: sinks, locals (newest first), witnesses.

    Witnesses: highest drift among blocks that are neither sink nor local and lie
    inside the causal length; ties to the lower block. Without drift: the most recent
    such blocks (the block index is the score).
    """
    n_blocks = (length + block_size - 1) // block_size
    sinks = [b for b in range(min(sink_blocks, n_blocks))]
    locals_ = []
    for b in range(n_blocks - 1, -1, -1):
        if len(locals_) == local_blocks:
            break
        if b not in sinks:
            locals_.append(b)
    taken = set(sinks) | set(locals_)
    candidates = [b for b in range(n_blocks) if b not in taken]
    score = (lambda b: float(b)) if drift is None else (lambda b: float(drift[b]))
    candidates.sort(key=lambda b: (-score(b), b))
    return sinks + locals_ + candidates[:witness_blocks]


def _locals(length: int, sink_blocks: int, local_blocks: int, block_size: int) -> set:
    """The local blocks of a row: the newest ``local_blocks`` blocks that are not sinks."""
    n_blocks = (length + block_size - 1) // block_size
    sinks = set(range(min(sink_blocks, n_blocks)))
    return set([b for b in range(n_blocks - 1, -1, -1) if b not in sinks][:local_blocks])


def reference_token_indices(length: int, blocks: Sequence[int], block_size: int) -> List[int]:
    """Sorted unique token ids ``< length`` covered by ``blocks``."""
    tokens = set()
    for b in blocks:
        for t in range(b * block_size, (b + 1) * block_size):
            if t < length:
                tokens.add(t)
    return sorted(tokens)


def reference_locality_row(length: int, width: int, sink_tokens: int) -> List[int]:
    """Plain locality in the policy's output order: one row of ``width`` entries.

    The first ``min(sink_tokens, width, length)`` tokens ascending, then the most recent
    tokens newest first until ``min(width, length)`` entries, then ``-1``. It is what
    ``topology_only`` selects with recency witnesses (no drift scores) and token sinks.
    """
    sinks = list(range(min(sink_tokens, width, length)))
    n_recent = min(width, length) - len(sinks)
    recent = list(range(length - 1, length - 1 - n_recent, -1))  # never reaches the sinks
    return sinks + recent + [-1] * (width - len(sinks) - n_recent)


def pad_rows(rows: Sequence[Sequence[int]], width: int, dtype=torch.int64) -> torch.Tensor:
    """Stack ragged Python rows into ``[len(rows), width]`` padded with ``-1``."""
    out = torch.full((len(rows), width), -1, dtype=dtype)
    for r, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {r}: {len(row)} entries > width {width}")
        if row:
            out[r, : len(row)] = torch.tensor(list(row), dtype=dtype)
    return out


def reference_row_is_broken(
    row: Sequence[int], length: int, offset: int, dtype: torch.dtype, drift_blocks: Optional[int], block_size: int
) -> bool:
    """The broken-row rule of the policy's contract (docs/architecture.md), one row.

    Broken: ``offset < 0``; ``length <= 0``; ``offset + length - 1`` past ``dtype``'s max;
    a non-negative entry outside ``[offset, offset + length)``; a non-negative entry after
    a negative one; a non-negative entry twice; more blocks (``ceil(length / block_size)``)
    than the drift table's ``drift_blocks`` columns (when there is a table).
    """
    if offset < 0 or length <= 0 or offset + length - 1 > torch.iinfo(dtype).max:
        return True
    n_valid = sum(1 for v in row if v >= 0)
    valid = [v for v in row if v >= 0]
    if any(v >= 0 for v in row[n_valid:]) or any(not offset <= v < offset + length for v in valid):
        return True
    if len(set(valid)) != len(valid):
        return True
    return drift_blocks is not None and -(-length // block_size) > drift_blocks


def reference_topology_policy(
    topk_indices: torch.Tensor,
    lengths: torch.Tensor,
    *,
    mode: str,
    sink_blocks: int,
    local_blocks: int,
    witness_blocks: int,
    block_size: int,
    max_structural_fraction: float,
    offsets: Optional[torch.Tensor] = None,
    drift: Optional[torch.Tensor] = None,
    learned_scores: Optional[torch.Tensor] = None,
    scaffold_lengths: Optional[Sequence[int]] = None,
    sink_tokens: Optional[int] = None,
    scaled_budget: bool = False,
):
    """Row-by-row policy with Python sets; returns ``(indices, counters, mismatch_rows)``.

    ``mode`` is a ``TopologyKVPolicyMode`` value string. Semantics as documented in
    ``topology_kv_policy_core``; written independently of it.
    """
    import math

    R, W = topk_indices.shape
    bs = block_size
    cap = int(math.floor(W * max_structural_fraction))
    out = topk_indices.clone()
    counters = {
        k: 0
        for k in (
            "selected_tokens",
            "structural_injected_tokens",
            "learned_kept_tokens",
            "learned_evicted_tokens",
            "unselected_tokens",
            "coordinate_mismatch_fallbacks",
            "compressed_blocks",
            "compression_saved_tokens",
        )
    }
    mismatch_rows = []
    for r in range(R):
        row = topk_indices[r].tolist()
        length = int(lengths[r])
        off = 0 if offsets is None else int(offsets[r])
        n_valid = sum(1 for v in row if v >= 0)
        table_blocks = None if drift is None else drift.shape[1]
        if reference_row_is_broken(row, length, off, topk_indices.dtype, table_blocks, bs):
            mismatch_rows.append(r)
            counters["coordinate_mismatch_fallbacks"] += 1
            continue
        learned = [(j, v - off) for j, v in enumerate(row) if v >= 0]
        learned_set = {t for _, t in learned}
        n_wit = (W + bs - 1) // bs + 1 if mode == "topology_only" else witness_blocks
        drift_row = None if drift is None else drift[r].tolist()
        n_blocks = (length + bs - 1) // bs
        sink_blk = sink_blocks if sink_tokens is None else sink_tokens // bs  # blocks wholly sinks
        blocks = reference_prioritized_blocks(length, sink_blk, local_blocks, n_wit, bs, drift_row)
        n_sink = min(sink_blk, n_blocks)
        n_local = len(_locals(length, sink_blk, local_blocks, bs))
        scaffold = 0 if scaffold_lengths is None else int(scaffold_lengths[r])
        compressed = 0

        def tokens_of(b):
            nonlocal compressed
            holds_sinks = b * bs < (sink_tokens or 0)
            if mode == "topology_compress_sparse" and (b + 1) * bs <= min(scaffold, length) and not holds_sinks:
                compressed += 1
                return [b * bs]
            return [t for t in range(b * bs, (b + 1) * bs) if t < length and t >= (sink_tokens or 0)]

        if sink_tokens is None:
            sink_toks = [t for b in blocks[:n_sink] for t in tokens_of(b)]
        else:  # token sinks: never compressed, never counted as blocks
            sink_toks = list(range(min(sink_tokens, length)))
        local_toks = sorted((t for b in blocks[n_sink : n_sink + n_local] for t in tokens_of(b)), reverse=True)
        # Witness blocks newest token first, like the local window: a block the budget cuts
        # keeps its newest tokens.
        wit_toks = [t for b in blocks[n_sink + n_local :] for t in sorted(tokens_of(b), reverse=True)]
        slots = sink_toks + local_toks + wit_toks  # priority order
        if mode == "topology_only":
            chosen = slots[:W]  # covers every token when length <= W
            chosen_set = set(chosen)
            kept = sum(1 for _, t in learned if t in chosen_set)
            injected = len(chosen) - kept
            out[r] = -1
            if chosen:
                out[r, : len(chosen)] = torch.tensor([t + off for t in chosen], dtype=out.dtype)
            n_selected = len(chosen)
        else:
            row_cap = cap * W // max(length, W) if scaled_budget else cap
            target, n_new = [], 0  # the priority prefix: <= W tokens, <= row_cap of them missing
            for s in slots:
                missing = s not in learned_set
                if len(target) == W or (missing and n_new == row_cap):
                    break
                target.append(s)
                n_new += missing
            struct_set = set(target)
            new = [s for s in target if s not in learned_set]
            n_inj = len(new)
            n_evict = max(0, len(learned) + n_inj - W)
            candidates = [(j, t) for j, t in learned if t not in struct_set]
            if learned_scores is None:
                holes = [j for j, _ in candidates[len(candidates) - n_evict :]] if n_evict else []
            else:

                def score(j):
                    s = float(learned_scores[r, j])
                    return float("-inf") if math.isnan(s) else s

                ranked = sorted(candidates, key=lambda jt: (score(jt[0]), -jt[0]))
                holes = [j for j, _ in ranked[:n_evict]]
            result = [v if v >= 0 else -1 for v in row]
            for k, pos in enumerate(holes):
                result[pos] = new[k] + off
            for e in range(n_evict, n_inj):
                result[n_valid + e - n_evict] = new[e] + off
            out[r] = torch.tensor(result, dtype=out.dtype)
            kept = len(learned) - n_evict
            injected = n_inj
            n_selected = kept + n_inj
        counters["selected_tokens"] += n_selected
        counters["structural_injected_tokens"] += injected
        counters["learned_kept_tokens"] += kept
        counters["learned_evicted_tokens"] += len(learned) - kept
        counters["unselected_tokens"] += length - n_selected
        counters["compressed_blocks"] += compressed
        counters["compression_saved_tokens"] += compressed * (bs - 1)
    return out, counters, mismatch_rows
