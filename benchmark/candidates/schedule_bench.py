"""Decode microbenchmark: dense attention vs attention over topology-selected tokens.

One decode step of one request: a single query token with ``H`` heads attends to a
token-major KV cache ``[L, H, D]`` (the layout of a paged cache, so one token's K or V
for all heads is ``H * D`` contiguous elements). For every token budget ``S`` the
benchmark

1. builds the topology candidate tokens from the keys: block centroids -> centroid
   drift -> ``TopologyScheduleConfig.from_token_budget(S)`` -> sink/local/witness
   blocks -> ascending token ids (timed as ``schedule_ms``, never folded into the
   attention times);
2. times dense decode attention over all ``L`` tokens (torch SDPA on the cache, and
   the same math as two batched matmuls, often faster on CPU);
3. times attention over the selected tokens: gather their K/V rows into preallocated
   buffers, then the same two-matmul attention over ``S`` tokens.

Run::

    python benchmark/topology_kv_candidate_schedule.py --seq-len 16384 \\
        --selected-tokens 128 256 512 1024 --heads 16 --head-dim 64 \\
        --rounds 60 --warmup 20 --device cuda --json /tmp/topology_kv.json
    bazel run //benchmark:topology_kv_candidate_schedule -- --device cpu

Output: a TSV table on stdout (one row per budget; the first eight columns are the
contract, more follow), progress lines on stderr, and with ``--json PATH`` the same
rows plus device, torch version, thread count, dtype and the arguments.

Columns
-------
seq_len, selected_tokens
    ``L`` and the budget ``S`` (a multiple of ``--block-size``).
dense_sdpa_ms
    Median of ``torch.nn.functional.scaled_dot_product_attention`` over all ``L``
    tokens of the cache (strided views, no copy).
sparse_selected_ms
    Median of :func:`selected_decode_attention_unchecked` (gather + attention), with
    ``-1`` handling included.
speedup
    ``best_dense_ms / sparse_selected_ms`` where ``best_dense_ms`` is the faster of
    ``dense_sdpa_ms`` and ``dense_matmul_ms`` (named in ``baseline``). The sparse
    path uses the matmul formulation, so comparing against the faster dense kernel
    credits only the sparsity, never a kernel choice.
schedule_ms
    Median time to build the candidate tokens from the keys (centroids of all
    ``L`` keys, drift, block selection, expansion).
ideal_speedup, fraction_of_ideal
    ``L / S`` and ``speedup / ideal_speedup``.

Timing (see :func:`time_kernels`): ``--warmup`` untimed calls of each kernel, then
``--rounds`` rounds that time one call of every kernel of every budget, interleaved so
that all of them see the same machine noise (``time.perf_counter`` on CPU; CUDA
events, synchronized, on GPU); reported: median, p10 and p90 over rounds. The cache
state is explicit (``--cache``):

* ``warm`` (default): every timed call follows an identical untimed call, the steady
  state of a hot loop. The selected K/V (at most 8 MiB at S=1024 in fp32) then sits in
  the last-level cache, while the dense pass (128 MiB at L=16384) streams from DRAM
  whatever the mode, so this favours the selected path.
* ``cold``: a 256 MiB scratch buffer is zeroed before every timed call. On a CPU this
  also evicts the interpreter's and the dispatcher's code and data, so each of the
  selected path's ~10 small ops pays tens of microseconds of misses; a pessimistic
  bound there. On a GPU it evicts L2 (the usual ``do_bench`` practice).

Threads (CPU): the whole session runs once per count of ``--threads`` (default 1 and
torch's default) and every kernel is reported at its fastest, the baseline included;
the thread counts of the attention kernels' fastest runs are columns.
On the 2-core dev box the selected path is fastest on one thread: its gather and its
two small GEMMs each take tens of microseconds, and a 2-thread OpenMP fork/join plus
moving the gathered rows between the cores' L2 caches cost more than they save.

Random data comes from a private ``torch.Generator`` seeded by ``--seed``; the
global RNG state is not touched.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Union


import torch
import torch.nn.functional as F

from rtp_llm.models_py.modules.hybrid.topology_kv.config import DEFAULT_BLOCK_SIZE
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import (
    DriftMetric,
    block_drift_scores,
    block_key_centroids,
)
from benchmark.cli_checks import FlagError, check_output_file
from benchmark.candidates.block_schedule import (
    TopologyScheduleConfig,
    build_topology_token_indices,
)

# The first eight are the TSV contract (order matters to the consumers of the
# TSV); the rest are diagnostics.
COLUMNS = (
    "seq_len",
    "selected_tokens",
    "dense_sdpa_ms",
    "sparse_selected_ms",
    "speedup",
    "schedule_ms",
    "ideal_speedup",
    "fraction_of_ideal",
    "attended_tokens",  # valid selected tokens (< selected_tokens only if L % block_size)
    "dense_matmul_ms",
    "baseline",  # which dense kernel `speedup` divides: "sdpa" or "matmul"
    "dense_sdpa_threads",  # CPU threads of the fastest run of each kernel (see --threads)
    "dense_matmul_threads",
    "sparse_threads",
    "schedule_select_ms",  # part of schedule_ms after centroids + drift
    "dense_sdpa_p10_ms",
    "dense_sdpa_p90_ms",
    "dense_matmul_p10_ms",
    "dense_matmul_p90_ms",
    "sparse_selected_p10_ms",
    "sparse_selected_p90_ms",
    "schedule_p10_ms",
    "schedule_p90_ms",
    "dense_gb_s",  # K+V bytes read by the best dense kernel per second
    "sparse_gb_s",  # selected K+V bytes gathered per second
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Larger than the last-level cache of the machines we run on (32 MiB L3 on the 2-core
# EPYC dev box, 50 MiB L2 on H100/H200), so rewriting it evicts the KV cache.
_FLUSH_BYTES = 256 * 1024 * 1024


class DenseBackend(enum.Enum):
    """Dense decode attention formulation (both read the token-major cache in place)."""

    SDPA = "sdpa"  # torch.nn.functional.scaled_dot_product_attention
    MATMUL = "matmul"  # q @ K^T, softmax, p @ V as two batched matmuls


# ----------------------------------------------------------------------------------------
# Attention kernels.
# ----------------------------------------------------------------------------------------


def _check_decode_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, value in (("q", q), ("k", k), ("v", v)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected torch.Tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            raise TypeError(f"{name}: expected a floating dtype, got {value.dtype}")
    if q.dim() != 2:
        raise ValueError(f"q: expected shape [H, D], got {tuple(q.shape)}")
    if k.dim() != 3 or k.shape[1:] != q.shape:
        raise ValueError(f"k: expected shape [L, {q.shape[0]}, {q.shape[1]}], got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (same as k), got {tuple(v.shape)}")
    if k.shape[0] == 0:
        raise ValueError("k: expected L > 0 tokens, got 0")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("k, v: expected contiguous token-major [L, H, D] tensors")


def dense_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: DenseBackend = DenseBackend.SDPA
) -> torch.Tensor:
    """Attention of one query token over every token of a token-major cache.

    Parameters
    ----------
    q : Tensor ``[H, D]``, float16/bfloat16/float32
        The decode query, one vector per head.
    k, v : Tensor ``[L, H, D]``, same dtype and device as ``q``, contiguous
        Token-major cache (one token's heads are contiguous, like a paged KV cache).
    backend : DenseBackend
        ``SDPA`` (torch's fused kernel) or ``MATMUL`` (two batched matmuls); both read
        the cache through strided views without copying it.

    Returns
    -------
    Tensor ``[H, D]``, dtype of ``q``: ``softmax(q k^T / sqrt(D)) v`` per head.
    """
    if not isinstance(backend, DenseBackend):
        raise TypeError(f"backend: expected DenseBackend, got {type(backend).__name__} {backend!r}")
    _check_decode_inputs(q, k, v)
    if backend is DenseBackend.SDPA:
        return dense_sdpa_decode_attention_unchecked(q, k, v)
    return dense_matmul_decode_attention_unchecked(q, k, v)


def dense_sdpa_decode_attention_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`dense_decode_attention` with ``SDPA``, no validation."""
    H, D = q.shape
    k_heads = k.permute(1, 0, 2).unsqueeze(0)  # [L, H, D] -> [1, H, L, D] (view)
    v_heads = v.permute(1, 0, 2).unsqueeze(0)  # [1, H, L, D] (view)
    out = F.scaled_dot_product_attention(q.view(1, H, 1, D), k_heads, v_heads)  # [1, H, 1, D]
    return out.view(H, D)


def _two_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Optional[torch.Tensor],
                          pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` per head for token-major ``k, v`` ``[T, H, D]``.

    ``pad_mask`` bool ``[T]`` (True: token excluded) or None; ``out`` ``[H, D]`` or None.
    The softmax runs in fp32 for 16-bit inputs.
    """
    H, D = q.shape
    k_t = k.permute(1, 2, 0)  # [T, H, D] -> [H, D, T] (view; BLAS reads it with ld = H*D)
    v_h = v.transpose(0, 1)  # [T, H, D] -> [H, T, D] (view)
    # [H, 1, D] x [H, D, T] -> [H, 1, T]; the 1/sqrt(D) scale rides on the GEMM (alpha).
    scores = torch.baddbmm(q.new_empty(()), q.view(H, 1, D), k_t, beta=0.0, alpha=D ** -0.5)
    if pad_mask is not None:
        scores.masked_fill_(pad_mask, float("-inf"))  # [T] broadcast over heads
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)  # [H, 1, T]
    if out is None:
        return torch.bmm(probs, v_h).view(H, D)  # [H, 1, T] x [H, T, D] -> [H, 1, D]
    torch.bmm(probs, v_h, out=out.view(H, 1, D))
    return out


def dense_matmul_decode_attention_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`dense_decode_attention` with ``MATMUL``, no validation."""
    return _two_matmul_attention(q, k, v, out=None)


@dataclasses.dataclass
class SelectedAttentionWorkspace:
    """Preallocated buffers of :func:`selected_decode_attention_unchecked` for ``S`` tokens.

    Reusing one workspace across calls keeps the hot path free of large allocations
    (and, on CUDA, makes it graph-capturable). Buffers are overwritten by every call.

    Attributes
    ----------
    safe_index : int64 ``[S]``      token ids with ``-1`` replaced by 0
    k_sel, v_sel : ``[S, H, D]``   gathered K/V rows, the cache's dtype
    pad_mask : bool ``[S]``         True where the token id is ``-1``
    out : ``[H, D]``                the attention output
    """

    safe_index: torch.Tensor
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    pad_mask: torch.Tensor
    out: torch.Tensor

    @classmethod
    def allocate(cls, selected: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> "SelectedAttentionWorkspace":
        for name, value in (("selected", selected), ("heads", heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        return cls(
            safe_index=torch.empty(selected, dtype=torch.int64, device=device),
            k_sel=torch.empty(selected, heads, head_dim, dtype=dtype, device=device),
            v_sel=torch.empty(selected, heads, head_dim, dtype=dtype, device=device),
            pad_mask=torch.empty(selected, dtype=torch.bool, device=device),
            out=torch.empty(heads, head_dim, dtype=dtype, device=device),
        )


def selected_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    token_indices: torch.Tensor,
    *,
    workspace: Optional[SelectedAttentionWorkspace] = None,
) -> torch.Tensor:
    """Attention of one query token over the selected tokens of a token-major cache.

    Parameters
    ----------
    q : Tensor ``[H, D]``, float16/bfloat16/float32
    k, v : Tensor ``[L, H, D]``, same dtype and device as ``q``, contiguous
    token_indices : int64 Tensor ``[S]`` on the same device
        Token ids in ``[0, L)`` or ``-1`` (no token; ignored). Any order; entries must
        be unique (a duplicate is attended twice, as in the sparse kernels), and at
        least one must be valid (an all ``-1`` row gives NaN).
    workspace : SelectedAttentionWorkspace, optional
        Buffers for ``S`` tokens; allocated per call when omitted. The result then
        lives in ``workspace.out`` and is overwritten by the next call.

    Returns
    -------
    Tensor ``[H, D]``, dtype of ``q``.

    Raises ``ValueError`` / ``TypeError`` naming the argument on bad shapes, dtypes,
    devices, out-of-range or duplicate ids (this check syncs with the device; the
    ``_unchecked`` variant does not).
    """
    _check_decode_inputs(q, k, v)
    if not isinstance(token_indices, torch.Tensor):
        raise TypeError(f"token_indices: expected torch.Tensor, got {type(token_indices).__name__}")
    if token_indices.dtype != torch.int64:
        raise TypeError(f"token_indices: expected dtype int64, got {token_indices.dtype}")
    if token_indices.dim() != 1:
        raise ValueError(f"token_indices: expected shape [S], got {tuple(token_indices.shape)}")
    if token_indices.device != q.device:
        raise ValueError(f"token_indices: expected device {q.device}, got {token_indices.device}")
    S, L = token_indices.shape[0], k.shape[0]
    if S == 0:
        raise ValueError("token_indices: expected S > 0 entries, got 0")
    valid = token_indices[token_indices >= 0]
    if valid.numel() == 0:
        raise ValueError("token_indices: expected at least one id >= 0, got only -1")
    low, high = int(token_indices.min()), int(valid.max())
    if low < -1 or high >= L:
        raise ValueError(f"token_indices: expected ids in [0, {L}) or -1, got range [{low}, {high}]")
    if torch.unique(valid).numel() != valid.numel():
        raise ValueError("token_indices: expected unique ids, got duplicates")
    if workspace is None:
        workspace = SelectedAttentionWorkspace.allocate(S, q.shape[0], q.shape[1], q.dtype, q.device)
    elif workspace.k_sel.shape != (S,) + tuple(q.shape) or workspace.k_sel.dtype != q.dtype:
        raise ValueError(
            f"workspace: expected buffers for [{S}, {q.shape[0]}, {q.shape[1]}] {q.dtype}, "
            f"got {tuple(workspace.k_sel.shape)} {workspace.k_sel.dtype}"
        )
    return selected_decode_attention_unchecked(q, k, v, token_indices, workspace)


def selected_decode_attention_unchecked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    token_indices: torch.Tensor,
    workspace: SelectedAttentionWorkspace,
) -> torch.Tensor:
    """:func:`selected_decode_attention` without validation and without a host sync.

    Writes and returns ``workspace.out``. Cost: one small index clamp and mask, a gather
    of ``2 * S`` contiguous rows of ``H * D`` elements, and two batched matmuls over
    ``S`` tokens.
    """
    ws = workspace
    torch.clamp(token_indices, min=0, out=ws.safe_index)  # -1 -> token 0, masked below
    torch.index_select(k, 0, ws.safe_index, out=ws.k_sel)  # [S, H, D]: S row copies
    torch.index_select(v, 0, ws.safe_index, out=ws.v_sel)
    torch.lt(token_indices, 0, out=ws.pad_mask)  # masked, not branched on: no host sync
    return _two_matmul_attention(q, ws.k_sel, ws.v_sel, out=ws.out, pad_mask=ws.pad_mask)


def reference_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_indices: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Plain fp32 softmax attention of one query over the listed tokens (tests only).

    ``q [H, D]``, ``k, v [L, H, D]``; ``token_indices`` int ``[S]`` with ``-1`` entries
    ignored, or None for every token. Returns float32 ``[H, D]``. Written for clarity:
    the valid ids are read on the host.
    """
    ids = list(range(k.shape[0])) if token_indices is None else [t for t in token_indices.tolist() if t >= 0]
    qf, kf, vf = q.float(), k[ids].float(), v[ids].float()  # [H, D], [T, H, D], [T, H, D]
    out = torch.empty_like(qf)
    for h in range(q.shape[0]):
        scores = kf[:, h, :] @ qf[h] / math.sqrt(q.shape[1])  # [T]
        weights = torch.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ vf[:, h, :]  # [T] x [T, D] -> [D]
    return out


# ----------------------------------------------------------------------------------------
# Candidate schedule.
# ----------------------------------------------------------------------------------------


def block_drift_from_keys(keys: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE,
                          metric: DriftMetric = DriftMetric.L2) -> torch.Tensor:
    """Per-block key-centroid drift of one request: ``keys [L, H, D]`` -> float32 ``[N]``."""
    return block_drift_scores(block_key_centroids(keys, block_size), metric)


def candidate_token_indices_from_drift(drift: torch.Tensor, seq_len: int, selected_tokens: int,
                                       block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Topology candidate tokens of one request from its block drift.

    ``drift`` float ``[N]``; returns int64 ``[S]`` (``S`` = ``selected_tokens`` rounded
    down to whole blocks): ascending token ids ``< seq_len``, ``-1`` tail.
    """
    config = TopologyScheduleConfig.from_token_budget(selected_tokens, block_size)
    lengths = torch.tensor([seq_len], dtype=torch.int64, device=drift.device)  # [B = 1]
    return build_topology_token_indices(lengths, config, drift.unsqueeze(0))[0]  # [S]


def candidate_token_indices(keys: torch.Tensor, selected_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE,
                            metric: DriftMetric = DriftMetric.L2) -> torch.Tensor:
    """Keys ``[L, H, D]`` -> centroids -> drift -> sink/local/witness blocks -> token ids ``[S]``."""
    drift = block_drift_from_keys(keys, block_size, metric)
    return candidate_token_indices_from_drift(drift, keys.shape[0], selected_tokens, block_size)


# ----------------------------------------------------------------------------------------
# Timing.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimingStats:
    """Milliseconds over the timed rounds."""

    median_ms: float
    p10_ms: float
    p90_ms: float

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> "TimingStats":
        ordered = sorted(samples_ms)

        def pct(p: float) -> float:  # nearest-rank percentile
            return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

        return cls(statistics.median(ordered), pct(0.10), pct(0.90))


class CacheMode(enum.Enum):
    """Cache state every timed call starts from."""

    WARM = "warm"  # right after an identical untimed call: the steady state of a hot loop
    COLD = "cold"  # right after rewriting a scratch buffer larger than the last-level cache

    @classmethod
    def parse(cls, value: Union[str, "CacheMode"]) -> "CacheMode":
        """Parse a mode name case-insensitively; unknown names list the valid ones."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.strip().lower() == member.value:
                    return member
        valid = ", ".join(m.value for m in cls)
        raise ValueError(f"cache mode: expected one of [{valid}], got {value!r}")


def time_kernels(kernels: Dict[str, Callable[[], object]], rounds: int, warmup: int, device: torch.device,
                 cache: CacheMode = CacheMode.WARM) -> Dict[str, TimingStats]:
    """Median and spread of ``rounds`` timed calls of every kernel.

    ``warmup`` untimed calls of each kernel, then ``rounds`` rounds that time one call
    of every kernel in dict order. Interleaving spreads machine noise evenly over the
    kernels: on a shared 2-core box a burst of load otherwise lands on whichever kernel
    happens to run then. Before each timed call, outside the timed region:

    * ``CacheMode.WARM``: one untimed call of the same kernel, so the timed call sees
      the caches as a hot loop over that kernel would (whatever of its working set
      fits stays cached);
    * ``CacheMode.COLD``: a 256 MiB scratch buffer is zeroed, evicting data *and* the
      code and data of the Python/dispatcher path from the CPU caches (pessimistic on
      CPU, where per-op overhead then dominates small kernels; on GPU it evicts L2).

    On CUDA each call is bracketed by CUDA events and the device is synchronized before
    they are read; on CPU the ops are synchronous and ``time.perf_counter`` brackets
    the call.
    """
    cache = CacheMode.parse(cache)
    cuda = device.type == "cuda"
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=device) if cache is CacheMode.COLD else None
    samples: Dict[str, List] = {name: [] for name in kernels}
    for fn in kernels.values():
        for _ in range(warmup):
            fn()
    if cuda:
        torch.cuda.synchronize(device)
    for _ in range(rounds):
        for name, fn in kernels.items():
            if flush is not None:
                flush.zero_()
            else:
                fn()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                samples[name].append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        samples = {name: [s.elapsed_time(e) for s, e in pairs] for name, pairs in samples.items()}
    return {name: TimingStats.from_samples(values) for name, values in samples.items()}


# ----------------------------------------------------------------------------------------
# The benchmark.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchmarkConfig:
    """Validated benchmark settings (see :func:`parse_args` for the flags)."""

    seq_len: int = 8192
    selected_tokens: tuple = (512,)
    heads: int = 16
    head_dim: int = 64
    rounds: int = 50
    warmup: int = 20
    device: str = "cpu"  # resolved: "cpu" or "cuda"
    dtype: str = "float32"  # resolved: a key of _DTYPES
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = 0
    cache: CacheMode = CacheMode.WARM
    threads: tuple = (1,)  # CPU thread counts every attention kernel is timed at


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@contextlib.contextmanager
def torch_threads(num_threads: Optional[int]):
    """Run the block with ``torch.set_num_threads(num_threads)``; None changes nothing.

    The previous count is restored on exit.
    """
    if num_threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _best(stats: Dict[Optional[int], Dict[str, TimingStats]], name: str):
    """(thread count, stats) of the fastest median of kernel ``name`` over the sessions."""
    return min(((n, by_name[name]) for n, by_name in stats.items()), key=lambda item: item[1].median_ms)


def run_benchmark(config: BenchmarkConfig, log: Callable[[str], None] = lambda s: None) -> List[dict]:
    """Run every budget of ``config``; returns one dict per budget with :data:`COLUMNS` keys.

    All kernels of all budgets are timed in one interleaved session (see
    :func:`time_kernels`), so the dense baseline, timed once per round, sits beside
    every budget's selected path under the same noise. On CPU there is one session per
    thread count of ``config.threads`` and every kernel (attention and schedule) is
    reported at its fastest: each kernel, the baseline included, gets its best
    setting. On CUDA the thread count does not apply (one session).
    """
    device = torch.device(config.device)
    dtype = _DTYPES[config.dtype]
    L, H, D = config.seq_len, config.heads, config.head_dim
    thread_counts: Sequence[Optional[int]] = config.threads if device.type == "cpu" else (None,)
    gen = torch.Generator(device="cpu").manual_seed(config.seed)  # private: global RNG untouched
    # Generated on the CPU so that the data does not depend on the device.
    q = torch.randn(H, D, generator=gen).to(device=device, dtype=dtype)  # [H, D]
    k = torch.randn(L, H, D, generator=gen).to(device=device, dtype=dtype)  # [L, H, D]
    v = torch.randn(L, H, D, generator=gen).to(device=device, dtype=dtype)  # [L, H, D]
    elem = torch.empty((), dtype=dtype).element_size()
    # fp32 sums of a few thousand products differ by ~1e-6; 16-bit outputs round at ~4e-3.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # Both dense formulations must agree before either serves as the baseline.
    torch.testing.assert_close(
        dense_matmul_decode_attention_unchecked(q, k, v).float(),
        dense_sdpa_decode_attention_unchecked(q, k, v).float(),
        atol=tol, rtol=tol, msg="dense matmul vs dense SDPA",
    )
    drift = block_drift_from_keys(k, config.block_size)  # [N]
    kernels: Dict[str, Callable[[], object]] = {
        "dense_sdpa": functools.partial(dense_sdpa_decode_attention_unchecked, q, k, v),
        "dense_matmul": functools.partial(dense_matmul_decode_attention_unchecked, q, k, v),
    }
    attended = {}
    for budget in config.selected_tokens:
        token_indices = candidate_token_indices(k, budget, config.block_size)  # [S]
        workspace = SelectedAttentionWorkspace.allocate(token_indices.shape[0], H, D, dtype, device)
        # Correctness gate before timing: the selected path must match the plain math.
        got = selected_decode_attention(q, k, v, token_indices, workspace=workspace).float()
        want = reference_decode_attention(q, k, v, token_indices).to(device)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"selected attention, budget {budget}")
        attended[budget] = int((token_indices >= 0).sum())
        schedule = TopologyScheduleConfig.from_token_budget(budget, config.block_size)
        log(
            f"[topology_kv] S={budget}: {attended[budget]} candidate tokens ({schedule.sink_blocks} sink + "
            f"{schedule.local_blocks} local + {schedule.witness_blocks} witness blocks), matches the reference"
        )
        kernels[f"sparse{budget}"] = functools.partial(
            selected_decode_attention_unchecked, q, k, v, token_indices, workspace
        )
        kernels[f"schedule{budget}"] = functools.partial(candidate_token_indices, k, budget, config.block_size)
        kernels[f"select{budget}"] = functools.partial(
            candidate_token_indices_from_drift, drift, L, budget, config.block_size
        )
    # One session per thread count: switching counts between calls leaves the idle
    # OpenMP workers of the larger team spinning next to the next call (measured: a
    # 0.7 ms selected call then sometimes took 5 ms on the loaded 2-core box).
    stats: Dict[Optional[int], Dict[str, TimingStats]] = {}
    for n in thread_counts:
        log(f"[topology_kv] timing {len(kernels)} kernels on {n or 'default'} thread(s): {config.warmup} "
            f"warm-up calls each, {config.rounds} interleaved rounds, {config.cache.value} caches")
        with torch_threads(n):
            stats[n] = time_kernels(kernels, config.rounds, config.warmup, device, config.cache)
    sdpa_threads, sdpa = _best(stats, "dense_sdpa")
    matmul_threads, matmul = _best(stats, "dense_matmul")
    baseline, best_dense = ("matmul", matmul) if matmul.median_ms < sdpa.median_ms else ("sdpa", sdpa)
    default_threads = torch.get_num_threads()
    rows = []
    for budget in config.selected_tokens:
        sparse_threads, sparse = _best(stats, f"sparse{budget}")
        _, schedule = _best(stats, f"schedule{budget}")
        _, select = _best(stats, f"select{budget}")
        speedup = best_dense.median_ms / sparse.median_ms
        ideal = L / budget
        row = {
            "seq_len": L,
            "selected_tokens": budget,
            "dense_sdpa_ms": sdpa.median_ms,
            "sparse_selected_ms": sparse.median_ms,
            "speedup": speedup,
            "schedule_ms": schedule.median_ms,
            "ideal_speedup": ideal,
            "fraction_of_ideal": speedup / ideal,
            "attended_tokens": attended[budget],
            "dense_matmul_ms": matmul.median_ms,
            "baseline": baseline,
            "dense_sdpa_threads": sdpa_threads or default_threads,
            "dense_matmul_threads": matmul_threads or default_threads,
            "sparse_threads": sparse_threads or default_threads,
            "schedule_select_ms": select.median_ms,
            "dense_sdpa_p10_ms": sdpa.p10_ms,
            "dense_sdpa_p90_ms": sdpa.p90_ms,
            "dense_matmul_p10_ms": matmul.p10_ms,
            "dense_matmul_p90_ms": matmul.p90_ms,
            "sparse_selected_p10_ms": sparse.p10_ms,
            "sparse_selected_p90_ms": sparse.p90_ms,
            "schedule_p10_ms": schedule.p10_ms,
            "schedule_p90_ms": schedule.p90_ms,
            "dense_gb_s": 2 * L * H * D * elem / best_dense.median_ms / 1e6,
            "sparse_gb_s": 2 * attended[budget] * H * D * elem / sparse.median_ms / 1e6,
        }
        assert tuple(row) == COLUMNS, "row keys drifted from COLUMNS"
        rows.append(row)
        log(
            f"[topology_kv] L={L} S={budget}: dense {best_dense.median_ms:.3f} ms ({baseline}), "
            f"selected {sparse.median_ms:.3f} ms, speedup {speedup:.1f}x of ideal {ideal:.1f}x "
            f"= {speedup / ideal:.2f}, schedule {schedule.median_ms:.3f} ms"
        )
    return rows


def format_tsv(rows: Sequence[dict]) -> str:
    """Header plus one tab-separated line per row; floats with 4 decimals."""
    def cell(value) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    lines = ["\t".join(COLUMNS)]
    lines += ["\t".join(cell(row[c]) for c in COLUMNS) for row in rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="topology_kv_candidate_schedule",
        description="Decode attention over all tokens vs over topology-selected tokens.",
    )
    p.add_argument("--seq-len", type=int, default=8192, help="KV length L (default 8192)")
    p.add_argument("--selected-tokens", type=int, nargs="+", default=[512],
                   help="token budgets S, multiples of --block-size (default 512)")
    p.add_argument("--heads", type=int, default=16, help="attention heads H (default 16)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D (default 64)")
    p.add_argument("--rounds", type=int, default=50, help="timed rounds (default 50)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per kernel first (default 20)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto = cuda when available, else cpu")
    p.add_argument("--dtype", default="auto", choices=("auto",) + tuple(_DTYPES),
                   help="auto = float32 on cpu (no fast 16-bit CPU matmul), bfloat16 on cuda")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per KV block (default 64, the engine's page size)")
    p.add_argument("--seed", type=int, default=0, help="seed of the private generator (default 0)")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="CPU thread counts; the timing session runs at each and every kernel is "
                        "reported at its fastest (default: 1 and torch's default; ignored on cuda)")
    p.add_argument("--cache", default="warm", choices=tuple(m.value for m in CacheMode),
                   help="warm: an identical untimed call precedes every timed call (hot loop); "
                        "cold: a 256 MiB buffer is zeroed first (default warm)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write rows and environment as JSON (relative to the caller's "
                        "directory under bazel run)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate flags; bad values exit with status 2 and name the flag."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    for flag, value, minimum in (
        ("--seq-len", args.seq_len, 1),
        ("--heads", args.heads, 1),
        ("--head-dim", args.head_dim, 1),
        ("--rounds", args.rounds, 1),
        ("--warmup", args.warmup, 0),
        ("--block-size", args.block_size, 1),
    ):
        if value < minimum:
            parser.error(f"{flag}: expected >= {minimum}, got {value}")
    for budget in args.selected_tokens:
        if budget <= 0 or budget > args.seq_len:
            parser.error(f"--selected-tokens: expected every budget in [1, --seq-len {args.seq_len}], got {budget}")
        if budget % args.block_size:
            parser.error(
                f"--selected-tokens: expected multiples of --block-size {args.block_size} "
                f"(the schedule selects whole blocks), got {budget}"
            )
    if args.threads is None:
        args.threads = sorted({1, torch.get_num_threads()})
    for count in args.threads:
        if count < 1:
            parser.error(f"--threads: expected every count >= 1, got {count}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (torch.cuda.is_available() is False); "
                     "use --device cpu or auto")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.json is not None and not os.path.isabs(args.json) and os.environ.get("BUILD_WORKING_DIRECTORY"):
        # `bazel run` starts us in the runfiles tree; resolve against the caller's cwd.
        args.json = os.path.join(os.environ["BUILD_WORKING_DIRECTORY"], args.json)
    if args.json is not None:
        try:
            check_output_file("--json", args.json)
        except FlagError as err:
            parser.error(str(err))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    config = BenchmarkConfig(
        seq_len=args.seq_len,
        selected_tokens=tuple(args.selected_tokens),
        heads=args.heads,
        head_dim=args.head_dim,
        rounds=args.rounds,
        warmup=args.warmup,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        seed=args.seed,
        cache=CacheMode.parse(args.cache),
        threads=tuple(args.threads),
    )
    device = torch.device(config.device)
    print(
        f"[topology_kv] device {_device_name(device)}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {config.dtype}",
        file=sys.stderr,
    )
    rows = run_benchmark(config, log=lambda line: print(line, file=sys.stderr, flush=True))
    sys.stdout.write(format_tsv(rows))
    sys.stdout.flush()
    if args.json is not None:
        report = {
            "device": _device_name(device),
            "device_type": device.type,
            "torch_version": torch.__version__,
            "num_threads": torch.get_num_threads(),
            "dtype": config.dtype,
            "args": vars(args),
            "columns": list(COLUMNS),
            "rows": rows,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0
