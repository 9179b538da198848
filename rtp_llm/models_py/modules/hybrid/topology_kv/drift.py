"""Block key centroids, their drift, and the live :class:`BlockDriftTracker`.

The default witness signal of the topology policy is *key-centroid drift*: how far the
mean key of block ``n`` moved from the mean key of block ``n - 1`` (where the content
changes). Shape vocabulary (shared with the policy):

    B  requests           L  KV length (tokens)    N  blocks, ``ceil(L / block_size)``
    H  heads, D head dim  K  flattened key size (``H * D``)

Public functions validate their arguments (``ValueError`` / ``TypeError`` naming the
argument, expected and actual); the ``_unchecked`` variants never force a host sync.
The serving path keeps centroids incrementally in a caller-owned
:class:`BlockDriftTracker` (one per layer and batch), so a decode step never rescans the
cache.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import FLOAT_DTYPES, check_block_keys, check_tensor
from rtp_llm.models_py.modules.hybrid.topology_kv.config import DEFAULT_BLOCK_SIZE, parse_enum_member
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_drift, triton_drift


class DriftMetric(enum.Enum):
    """How far a block's key centroid moved from the previous block's centroid."""

    L2 = "l2"  # ||c[b] - c[b-1]||_2 over (H, D)
    COSINE = "cosine"  # 1 - cos(c[b], c[b-1]) over the flattened (H, D) vector

    @classmethod
    def parse(cls, value: Union[str, "DriftMetric"]) -> "DriftMetric":
        """Parse a metric name case-insensitively; unknown names list the valid ones."""
        return parse_enum_member(cls, value, "drift metric")


def block_key_centroids(
    keys: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mean key of every block of ``block_size`` tokens.

    Parameters
    ----------
    keys : Tensor ``[L, H, D]`` or ``[B, L, H, D]``, float16/bfloat16/float32/float64
        Token-major keys (like a paged cache).
    block_size : int > 0
    lengths : optional int Tensor ``[B]`` (batched input only)
        Valid tokens per request; tokens at or past a length are ignored. Default: all L.

    Returns
    -------
    Tensor ``[N, H, D]`` or ``[B, N, H, D]``, float32 (float64 for float64 input),
    ``N = ceil(L / block_size)``. Accumulation is in fp32 for 16-bit input. The
    partial last block is the mean of its valid tokens; a block with no valid
    token is all zeros.
    """
    check_block_keys(keys, block_size, lengths)
    return block_key_centroids_unchecked(keys, block_size, lengths)


def block_key_centroids_unchecked(
    keys: torch.Tensor, block_size: int, lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """:func:`block_key_centroids` without validation (no host sync)."""
    acc_dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
    squeeze = keys.dim() == 3
    k = keys.unsqueeze(0) if squeeze else keys  # [B, L, H, D]
    B, L, H, D = k.shape
    N = (L + block_size - 1) // block_size
    pad = N * block_size - L
    kf = k.to(acc_dtype)
    if lengths is not None:
        token = torch.arange(L, device=k.device)
        valid = token.unsqueeze(0) < lengths.to(k.device).unsqueeze(1)  # [B, L]
        kf = kf * valid.unsqueeze(-1).unsqueeze(-1).to(acc_dtype)
        counts = valid.to(acc_dtype)
    else:
        counts = torch.ones(B, L, dtype=acc_dtype, device=k.device)
    if pad:
        kf = torch.nn.functional.pad(kf, (0, 0, 0, 0, 0, pad))  # [B, N*bs, H, D]
        counts = torch.nn.functional.pad(counts, (0, pad))
    sums = kf.view(B, N, block_size, H, D).sum(dim=2)  # [B, N, H, D]
    n = counts.view(B, N, block_size).sum(dim=2)  # [B, N]
    centroids = sums / n.clamp(min=1).unsqueeze(-1).unsqueeze(-1)
    return centroids.squeeze(0) if squeeze else centroids


def block_drift_scores(centroids: torch.Tensor, metric: Union[DriftMetric, str] = DriftMetric.L2) -> torch.Tensor:
    """Drift of every block's centroid from the previous block's centroid.

    Parameters
    ----------
    centroids : float Tensor ``[N, H, D]`` or ``[B, N, H, D]`` (from :func:`block_key_centroids`)
    metric : DriftMetric or its name

    Returns
    -------
    float32 (float64 for float64 input) Tensor ``[N]`` or ``[B, N]``; block 0 scores 0.
    L2: ``||c[b] - c[b-1]||``; COSINE: ``1 - cos(c[b], c[b-1])`` (0 if either is zero).
    """
    metric = DriftMetric.parse(metric)
    check_tensor("centroids", centroids, ndims=(3, 4), dtypes=FLOAT_DTYPES)
    return block_drift_scores_unchecked(centroids, metric)


def block_drift_scores_unchecked(centroids: torch.Tensor, metric: DriftMetric = DriftMetric.L2) -> torch.Tensor:
    """:func:`block_drift_scores` without validation (no host sync)."""
    out_dtype = torch.float64 if centroids.dtype == torch.float64 else torch.float32
    c = centroids.to(out_dtype).flatten(-2)  # [..., N, H*D]
    scores = torch.zeros(c.shape[:-1], dtype=out_dtype, device=c.device)  # [..., N]
    if c.shape[-2] > 1:
        scores[..., 1:] = pair_drift_unchecked(c[..., :-1, :], c[..., 1:, :], metric)
    return scores


def pair_drift_unchecked(prev: torch.Tensor, cur: torch.Tensor, metric: DriftMetric = DriftMetric.L2) -> torch.Tensor:
    """Drift of centroid ``cur`` from ``prev`` (float ``[..., K]`` each), ``[...]``; no validation.

    The rule every path follows bit for bit: fp32 (fp64) differences ``cur - prev``, their
    squares (cosine: ``cur * cur``, ``prev * prev``, ``cur * prev``) summed in fp64 in
    index order, the square root in fp64, rounded once to the input's dtype. Cosine drift
    is ``1 - ab / sqrt(max(a2 * b2, 1e-24))`` (a zero centroid: drift 1). Products of fp32
    values are exact in fp64, so the sum's order is the only freedom, and it is fixed:
    ``cumsum`` runs in index order on the CPU.
    """
    out_dtype = torch.float64 if cur.dtype == torch.float64 else torch.float32

    def total(x: torch.Tensor) -> torch.Tensor:  # fp64 sum over K in index order
        return torch.cumsum(x, dim=-1, dtype=torch.float64)[..., -1]

    if metric is DriftMetric.L2:
        d = (cur - prev).to(torch.float64)
        return total(d * d).sqrt().to(out_dtype)
    c, p = cur.to(torch.float64), prev.to(torch.float64)
    a2, b2, ab = total(c * c), total(p * p), total(c * p)
    denom = torch.fmax(a2 * b2, torch.full_like(a2, 1e-24)).sqrt()
    return (1.0 - ab / denom).to(out_dtype)


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
        self._kernel: Optional[str] = None  # what update() runs: "cpu", "triton" or "torch" (on first use)
        self._drift_view = self._drift_flat[: B * N].view(B, N)  # the state is never reallocated

    @property
    def device(self) -> torch.device:
        return self._sums.device

    def drift_scores(self) -> torch.Tensor:
        """float32 ``[B, N]`` live drift (a view; updated in place by :meth:`update`)."""
        return self._drift_view

    def centroids(self) -> torch.Tensor:
        """float32 ``[B, N, K]`` mean key of the tokens fed so far per block (zeros if none)."""
        sums, counts = self._sums[:, : self.max_blocks], self._counts[:, : self.max_blocks]
        return sums / counts.clamp(min=1).unsqueeze(-1)

    def block_counts(self) -> torch.Tensor:
        """float32 ``[B, N]`` tokens fed per block."""
        return self._counts[:, : self.max_blocks]

    def block_sums(self) -> torch.Tensor:
        """float32 ``[B, N, K]`` sum of the keys fed per block (a view; no copy, unlike
        :meth:`centroids`)."""
        return self._sums[:, : self.max_blocks]

    def clone(self) -> "BlockDriftTracker":
        """An independent copy of this tracker's state (same settings, same device).

        For callers that fork a batch's state, e.g. several decode variants continuing
        from one prefilled cache; updating either copy leaves the other unchanged.
        """
        copy = BlockDriftTracker(
            self.num_requests,
            self.max_blocks,
            self.key_dim,
            block_size=self.block_size,
            metric=self.metric,
            device=self.device,
        )
        copy._sums.copy_(self._sums)
        copy._counts.copy_(self._counts)
        copy._drift_flat.copy_(self._drift_flat)
        return copy

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

    @property
    def kernel(self) -> str:
        """What :meth:`update` runs on this tracker's device: ``"cpu"`` (the C++ kernel, CPU
        state and a working build), ``"triton"`` (CUDA state and triton) or ``"torch"``
        (:meth:`update_reference`'s ops)."""
        if self._kernel is None:
            if cpu_drift.can_use_drift_kernel(self.device):
                self._kernel = "cpu"
            elif self.device.type == "cuda" and triton_drift.can_use_triton(self.device):
                self._kernel = "triton"
            else:
                self._kernel = "torch"
        return self._kernel

    @property
    def fused(self) -> bool:
        """Whether :meth:`update` is one fused kernel call (C++ on CPU, Triton on CUDA)."""
        return self.kernel != "torch"

    def update(
        self,
        keys: torch.Tensor,
        positions: torch.Tensor,
        request_ids: Optional[torch.Tensor] = None,
        *,
        pool: Optional[torch.Tensor] = None,
        slots: Optional[torch.Tensor] = None,
    ) -> None:
        """Add new keys to their blocks and refresh the drift they affect; no host sync.

        Parameters
        ----------
        keys : float ``[T, D]`` or ``[T, H, D]`` keys as stored in the cache
        positions : int ``[T]`` request-local token positions; ``< 0`` or past
            ``max_blocks * block_size`` are ignored
        request_ids : int ``[T]`` request (block-table row) of each key, or None (all 0)
        pool, slots : optional ``[S, K]`` key pool and int ``[T]`` slots: the keys are
            stored there too (``pool[slots] = keys.to(pool.dtype)``), in the same call

        One fused call where :attr:`kernel` says so, against :meth:`update_reference` (the
        specification, which runs everywhere else and for inputs the kernels do not take):
        C++ on CPU, bit for bit, a bad request id or slot raising before anything is
        written; Triton on CUDA, two launches, bit for bit when no block receives two keys
        in one call (a decode step), else the block sums add in the atomics' order (as
        ``index_add_`` on CUDA does), and a key with a bad request id or slot is skipped.
        """
        T = self._check_update(keys, positions, request_ids, pool, slots)
        kernel = self.kernel
        if kernel == "cpu" and self._cpu_takes(keys, positions, request_ids, pool, slots):
            # The keys as they come ([T, D] or [T, H, D]): a reshape is a dispatched op, which
            # costs tens of microseconds with the caches cold, as between two layers.
            cpu_drift.track_keys_cpu(
                keys, positions, request_ids, self._sums, self._counts, self._drift_flat,
                block_size=self.block_size, cosine=self.metric is DriftMetric.COSINE, pool=pool, slots=slots,
            )
            return
        if kernel == "triton" and self._kernel_takes(keys, positions, request_ids, pool, slots):
            triton_drift.track_keys_triton(
                keys.reshape(T, self.key_dim), positions, request_ids, self._sums, self._counts, self._drift_flat,
                block_size=self.block_size, cosine=self.metric is DriftMetric.COSINE, pool=pool, slots=slots,
            )
            return
        self._update_torch(keys, positions, request_ids, pool, slots)

    @staticmethod
    def _pool_takes(keys, pool) -> bool:
        """A pool the fused kernels store into: a supported dtype, unit stride along ``K``,
        keys exact in fp32 (or no pool)."""
        return pool is None or (pool.dtype in cpu_drift.POOL_DTYPES and pool.stride(1) == 1
                                and keys.dtype in cpu_drift.EXACT_IN_FP32)

    @classmethod
    def _cpu_takes(cls, keys, positions, request_ids, pool, slots) -> bool:
        """:meth:`_kernel_takes` for CPU state, by tensor properties only (no device objects)."""
        if not (keys.is_cpu and positions.is_cpu and (request_ids is None or request_ids.is_cpu)):
            return False
        return pool is None or (pool.is_cpu and slots.is_cpu and cls._pool_takes(keys, pool))

    def _kernel_takes(self, keys, positions, request_ids, pool, slots) -> bool:
        """Whether the fused kernel takes these inputs (metadata only): all on the state's
        device, a pool of a supported dtype with unit stride along ``K``, keys exact in fp32."""
        device = self.device
        tensors = (keys, positions, request_ids, pool, slots)
        if any(t is not None and t.device != device for t in tensors):
            return False
        if self.kernel == "triton" and keys.reshape(keys.shape[0], self.key_dim).stride(-1) != 1:
            return False
        return self._pool_takes(keys, pool)

    def update_reference(
        self,
        keys: torch.Tensor,
        positions: torch.Tensor,
        request_ids: Optional[torch.Tensor] = None,
        *,
        pool: Optional[torch.Tensor] = None,
        slots: Optional[torch.Tensor] = None,
    ) -> None:
        """:meth:`update` in torch ops on any device (the specification of the fused kernel)."""
        self._check_update(keys, positions, request_ids, pool, slots)
        self._update_torch(keys, positions, request_ids, pool, slots)

    def _check_update(self, keys, positions, request_ids, pool, slots) -> int:
        T = keys.shape[0]
        if positions.shape != (T,) or (request_ids is not None and request_ids.shape != (T,)):
            raise ValueError(
                f"positions / request_ids: expected shape ({T},) like keys' first dim, got "
                f"{tuple(positions.shape)} / {None if request_ids is None else tuple(request_ids.shape)}"
            )
        if keys.numel() != T * self.key_dim:
            raise ValueError(f"keys: expected {self.key_dim} values per token, got shape {tuple(keys.shape)}")
        if (pool is None) != (slots is None):
            raise ValueError("pool / slots: expected both or neither, got "
                             f"{'a pool' if pool is not None else 'no pool'} and {'slots' if slots is not None else 'no slots'}")
        if pool is not None:
            if pool.dim() != 2 or pool.shape[1] != self.key_dim:
                raise ValueError(f"pool: expected [S, {self.key_dim}], got shape {tuple(pool.shape)}")
            if slots.shape != (T,):
                raise ValueError(f"slots: expected shape ({T},) like keys' first dim, got {tuple(slots.shape)}")
        return T

    def _update_torch(self, keys, positions, request_ids, pool, slots) -> None:
        T = keys.shape[0]
        if pool is not None:
            pool[slots.to(torch.int64)] = keys.reshape(T, self.key_dim).to(pool.dtype)
        flat = keys.reshape(T, self.key_dim).to(device=self.device, dtype=torch.float32)  # [T, K]
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
        drift = pair_drift_unchecked(cents[..., 0, :], cents[..., 1, :], self.metric)  # [T, 2]
        live = (target >= 1) & (target < N)
        complete = (counts == bs).all(dim=2) & live
        dst = torch.where(live, req.view(T, 1) * N + target, self.num_requests * N)  # dump slot
        # Duplicate destinations carry identical values (same state), so the write is exact.
        self._drift_flat.index_put_((dst.flatten(),), torch.where(complete, drift, 0.0).flatten())
