"""Topology KV candidate policy: merge structural KV blocks into the learned top-k rows.

The serving path calls :func:`apply_topology_kv_policy` after the indexer's top-k op on
every sparse-attention layer. It takes the top-k rows in the engine's convention and
returns rows of the same shape, dtype and device that the sparse attention consumes
unchanged. Shape vocabulary: ``R`` rows, ``W`` top-k width, ``B`` requests, ``N`` blocks,
``S`` structural slots (``scheduled blocks * block_size``).

Coordinate contract (docs/architecture.md): row ``r`` holds request-local token positions in
``[offset[r], offset[r] + lengths[r])``; negative entries are padding. The output keeps
that interval, is unique per row, has valid entries first and ``-1`` after them, and
never reaches past the causal length. Input rows that break the contract (including
duplicate entries) are *broken*: returned unchanged and counted, or rejected in
``raise`` mode (:func:`row_violations` lists the rules).

Hot-path rule: :func:`topology_kv_policy_core` (in ``kernels.torch_core``, with
everything it calls) is pure tensor code with static shapes: no ``.item()``,
``.tolist()``, ``nonzero`` or loops over rows, so it runs inside a CUDA graph and under
``torch.compile(fullgraph=True)``. This module holds the public entry around it.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.config import (  # noqa: F401 (re-exported)
    CoordinateMismatchAction,
    TopologyKVBackend,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import PolicyLayout, PolicyTensors
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_fused
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.dispatch import (  # noqa: F401 (re-exported)
    buffer_counters,
    resolve_backend,
    run_policy_core,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_row_to_request,
    check_tensor,
    select_request_rows,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.torch_core import (  # noqa: F401 (re-exported)
    COUNTER_NAMES,
    topology_kv_policy_core,
    topology_only_learned_kept,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.row_contract import VIOLATIONS, row_violations
from rtp_llm.models_py.modules.hybrid.topology_kv.request import (  # noqa: F401 (re-exported)
    ContextArg,
    TopologyRequestContext,
    TopologyStepPlan,
    policy_fingerprint,
)

# ---------------------------------------------------------------------------------------
# Counters and result.
# ---------------------------------------------------------------------------------------


class TopologyKVCounters:
    """Counters as 0-dim int64 device tensors; :meth:`to_dict` materializes them (syncs).

    Token counters cover the rows the policy processed; rows returned unchanged after a
    coordinate mismatch are counted only in ``coordinate_mismatch_fallbacks``.
    ``compression_hits`` is a host int: the number of contexts in this call whose
    fingerprint equalled their previous one. ``lazy``, when given, returns the per-name
    views of a counter buffer on the first read. Read-only by contract; a plain class with
    slots because a layer builds one per call (a dataclass's init costs about twice as much
    when the caches are cold, as between two layers of a decode step).
    """

    __slots__ = ("tensors", "compression_hits", "lazy")

    def __init__(self, tensors: Dict[str, torch.Tensor], compression_hits: int = 0,
                 lazy: Optional[Callable[[], Dict[str, torch.Tensor]]] = None) -> None:
        self.tensors = tensors
        self.compression_hits = compression_hits
        self.lazy = lazy

    def _tensors(self) -> Dict[str, torch.Tensor]:
        if self.lazy is not None:
            self.tensors.update(self.lazy())
            self.lazy = None
        return self.tensors

    def to_dict(self) -> Dict[str, int]:
        tensors = self._tensors()
        out = {name: int(tensors[name]) for name in COUNTER_NAMES}
        out["compression_hits"] = self.compression_hits
        return out

    def __getattr__(self, name: str):
        if name in COUNTER_NAMES:
            return self._tensors()[name]
        raise AttributeError(name)

    def __repr__(self) -> str:
        return (f"TopologyKVCounters(names={sorted(self.tensors)}, pending={self.lazy is not None}, "
                f"compression_hits={self.compression_hits})")


class TopologyKVPolicyResult:
    """What :func:`apply_topology_kv_policy` and a layer's call return (read-only by contract;
    slots, as :class:`TopologyKVCounters`).

    indices : the output rows (the input tensor itself when disabled)
    counters : TopologyKVCounters, or None when disabled (nothing was computed)
    fingerprints : one per context passed in (empty when no context)
    schedule_ms : wall time of the policy in ms when ``measure_time=True`` (syncs), else None
    """

    __slots__ = ("indices", "counters", "fingerprints", "schedule_ms")

    def __init__(self, indices: torch.Tensor, counters: Optional[TopologyKVCounters],
                 fingerprints: Tuple[str, ...] = (), schedule_ms: Optional[float] = None) -> None:
        self.indices = indices
        self.counters = counters
        self.fingerprints = fingerprints
        self.schedule_ms = schedule_ms

    def __repr__(self) -> str:
        return (f"TopologyKVPolicyResult(indices={tuple(self.indices.shape)}, counters={self.counters!r}, "
                f"fingerprints={self.fingerprints!r}, schedule_ms={self.schedule_ms!r})")


# ---------------------------------------------------------------------------------------
# Validation (public entry; may sync) and the contract check.
# ---------------------------------------------------------------------------------------


def _validate_inputs(topk_indices, lengths, offsets, drift, row_to_request, learned_scores) -> None:
    check_tensor("topk_indices", topk_indices, dtypes=INDEX_DTYPES)
    if topk_indices.dim() != 2:
        raise ValueError(f"topk_indices: expected rank 2 [R, W], got shape {tuple(topk_indices.shape)}")
    R, W = topk_indices.shape
    if W == 0:
        raise ValueError(f"topk_indices: expected W >= 1 columns, got shape {tuple(topk_indices.shape)}")
    dev = topk_indices.device
    same = dict(device=dev, device_of="topk_indices")
    check_tensor("lengths", lengths, dtypes=INDEX_DTYPES, shape=(R,), **same)
    if offsets is not None:
        check_tensor("topk_indices_offset", offsets, dtypes=INDEX_DTYPES, shape=(R,), **same)
    if learned_scores is not None:
        check_tensor("learned_scores", learned_scores, dtypes=FLOAT_DTYPES, shape=(R, W), **same)
    if drift is not None:
        check_tensor("block_drift_scores", drift, dtypes=FLOAT_DTYPES, ndims=(2,), **same)
        if row_to_request is None and drift.shape[0] != R:
            raise ValueError(
                f"block_drift_scores: expected {R} rows (one per top-k row) without row_to_request, "
                f"got shape {tuple(drift.shape)}"
            )
    if row_to_request is not None:
        check_tensor("row_to_request", row_to_request, dtypes=INDEX_DTYPES, shape=(R,), **same)


def check_topk_coordinates(
    topk_indices: torch.Tensor,
    lengths: torch.Tensor,
    topk_indices_offset: Optional[torch.Tensor] = None,
    *,
    drift_blocks: Optional[int] = None,
    block_size: int = 1,
) -> None:
    """Raise ``ValueError`` naming the first broken row, its value and the rule it breaks.

    The rules are :func:`row_violations`' (the policy core's broken-row rules): offset
    ``>= 0``, length ``> 0``, ``offset + length - 1`` within ``topk_indices``' dtype,
    every non-negative entry inside ``[offset, offset + length)``, valid entries before
    padding, no entry twice, and with ``drift_blocks`` (the drift table's ``N``) at most
    ``N`` blocks of ``block_size`` per row. All flags are computed on the device and read
    with one host sync on success (more reads only to build the message): run it off the
    CUDA-graph path (tests, warm-up, ``coordinate_mismatch_action=raise``).
    """
    _validate_inputs(topk_indices, lengths, topk_indices_offset, None, None, None)
    flags = row_violations(topk_indices, lengths, topk_indices_offset, drift_blocks, block_size)
    table = torch.stack([flags[name] for name in VIOLATIONS if name in flags], dim=1)  # [R, V]
    if not bool(table.any()):  # the only host read on success
        return
    row = int(torch.argmax(table.any(dim=1).to(torch.int8)))
    rule = [name for name, bad in zip([n for n in VIOLATIONS if n in flags], table[row].tolist()) if bad][0]
    raise ValueError(_violation_message(rule, row, topk_indices, lengths, topk_indices_offset, drift_blocks, block_size))


def _violation_message(rule, row, topk_indices, lengths, offsets, drift_blocks, block_size) -> str:
    """The message for row ``row`` breaking ``rule`` (failure path only: reads values)."""
    vals = topk_indices[row].tolist()
    length = int(lengths[row])
    off = 0 if offsets is None else int(offsets[row])
    if rule == "offset":
        return f"topk_indices_offset: row {row} has offset {off} (expected >= 0)"
    if rule == "length":
        return f"lengths: row {row} has length {length} (expected > 0)"
    if rule == "overflow":
        dtype = str(topk_indices.dtype).replace("torch.", "")
        return (
            f"topk_indices: row {row} covers [{off}, {off + length}) (offset {off}, length {length}), "
            f"past the {dtype} range of topk_indices (max {torch.iinfo(topk_indices.dtype).max})"
        )
    if rule == "interval":
        bad = [v for v in vals if v >= 0 and not off <= v < off + length][0]
        return (
            f"topk_indices: row {row} holds {bad}, outside its interval "
            f"[{off}, {off + length}) (offset {off}, length {length})"
        )
    if rule == "padding":
        n = sum(1 for v in vals if v >= 0)
        col = next(c for c in range(n, len(vals)) if vals[c] >= 0)
        return (
            f"topk_indices: row {row} holds {vals[col]} at column {col} after padding "
            "(valid entries must come first)"
        )
    if rule == "duplicate":
        seen = set()
        val = next(v for v in vals if v >= 0 and (v in seen or seen.add(v)))
        return f"topk_indices: row {row} holds {val} twice (rows must be unique)"
    need = -(-length // block_size)
    return (
        f"block_drift_scores: row {row} needs {need} blocks (length {length}, block size {block_size}), "
        f"the table has {drift_blocks}"
    )


# ---------------------------------------------------------------------------------------
# Public entry point.
# ---------------------------------------------------------------------------------------

def apply_topology_kv_policy(
    topk_indices: torch.Tensor,
    lengths: torch.Tensor,
    *,
    config: TopologyKVPolicyConfig,
    topk_indices_offset: Optional[torch.Tensor] = None,
    block_drift_scores: Optional[torch.Tensor] = None,
    row_to_request: Optional[torch.Tensor] = None,
    learned_scores: Optional[torch.Tensor] = None,
    context: ContextArg = None,
    measure_time: bool = False,
    validate: bool = True,
    backend: Union[None, str, TopologyKVBackend] = None,
    plan: Optional[TopologyStepPlan] = None,
    out: Optional[torch.Tensor] = None,
    counters_out: Optional[torch.Tensor] = None,
) -> TopologyKVPolicyResult:
    """Apply the topology policy to learned top-k rows.

    Parameters
    ----------
    topk_indices : int32 or int64 Tensor ``[R, W]`` (any other dtype: ``TypeError``)
        Learned rows in the engine's convention: request-local positions inside
        ``[offset, offset + length)``, negative = padding. Never modified.
    lengths : int32/int64 ``[R]``
        Causal length of each row (``expanded_seq_lens``), > 0. Either dtype with either
        row dtype: lengths and offsets are read as int64, never truncated to the rows'
        dtype (a row whose ``offset + length - 1`` does not fit that dtype is broken).
    config : TopologyKVPolicyConfig
    topk_indices_offset : int32/int64 ``[R]`` or None (zeros); ``>= 0``
    block_drift_scores : float ``[R, N]``, or ``[B, N]`` with ``row_to_request``
        Witness score of each block of the row's request (e.g. key-centroid drift).
        Blocks past a row's causal length are ignored; a row needing more than ``N``
        blocks is broken. None: witnesses are the most recent eligible blocks
        (documented fallback).
    row_to_request : int ``[R]`` or None
        Request index of each row into ``block_drift_scores`` and ``context``.
    learned_scores : float ``[R, W]`` or None
        Indexer scores aligned with ``topk_indices``; merge modes evict the lowest.
    context : TopologyRequestContext, a sequence of them (one per request), or None
        Per-request state owned by the caller: scaffold tokens for compress mode and the
        fingerprint history. Updated in place (each context by its own caller only).
    measure_time : bool
        Synchronize and report the policy's wall time in ``schedule_ms``.
    validate : bool
        Check argument shapes, dtypes and devices (no value is read; no sync).
    backend : TopologyKVBackend, its name, or None (``config.backend``)
        Which implementation runs (``kernels.dispatch``: same rows and counters
        bit for bit). A backend forced by name that cannot run on the rows' device raises
        ``ValueError`` naming it, the device and why.
    plan : TopologyStepPlan or None
        The step's shared inputs (scaffold spans on the device, fingerprints), built once
        per forward with :meth:`TopologyStepPlan.build` and passed to every layer; then
        ``context`` must be None. None: built here from ``context`` (host work per call).
    out : like ``topk_indices`` (same shape, dtype, device), or None
        Written with the result rows (fully overwritten), which are then ``out`` itself.
        It must not share memory with any input (``ValueError`` naming both, checked with
        ``validate``: addresses only, no sync).
    counters_out : int64 ``[len(COUNTER_NAMES)]`` on the rows' device, or None
        The call *adds* its counts to it (running totals across layers or steps; the
        result's counters are then views of it: the caller's totals, which change when the
        caller adds into it again). Apart from every input and from ``out``. With ``out`` and ``counters_out`` the
        ``triton`` backend allocates nothing and reads nothing on the host.

    Returns
    -------
    TopologyKVPolicyResult. ``DISABLED`` returns ``topk_indices`` itself and no counters.

    Broken rows (the rules of :func:`row_violations`: negative offset, length <= 0, an
    interval past the rows' dtype, an entry outside its interval, padding before a valid
    entry, a duplicate entry, a row longer than the drift table): ``RAISE`` checks on the
    host (one device sync; not for CUDA-graph capture) and raises ``ValueError`` naming
    row and value. ``FALLBACK_DISABLED`` returns each such row unchanged and counts it in
    ``coordinate_mismatch_fallbacks``, with no sync. ``W == 0``: ``ValueError``.
    """
    if not isinstance(config, TopologyKVPolicyConfig):
        raise TypeError(f"config: expected TopologyKVPolicyConfig, got {type(config).__name__}")
    if validate:
        _validate_inputs(topk_indices, lengths, topk_indices_offset, block_drift_scores, row_to_request, learned_scores)
    elif config.enabled and topk_indices.shape[1] == 0:  # the core needs a column
        raise ValueError(f"topk_indices: expected W >= 1 columns, got shape {tuple(topk_indices.shape)}")
    if not config.enabled:
        return TopologyKVPolicyResult(indices=topk_indices, counters=None)

    start = None
    if measure_time:
        _synchronize(topk_indices.device)
        start = time.perf_counter()
    if config.coordinate_mismatch_action is CoordinateMismatchAction.RAISE:
        check_topk_coordinates(
            topk_indices,
            lengths,
            topk_indices_offset,
            drift_blocks=None if block_drift_scores is None else block_drift_scores.shape[1],
            block_size=config.block_size,
        )
        if row_to_request is not None and block_drift_scores is not None:
            check_row_to_request(row_to_request, block_drift_scores.shape[0], "the rows of block_drift_scores")

    W = topk_indices.shape[1]
    if plan is None:
        plan = TopologyStepPlan.build(
            config, W, context, num_rows=topk_indices.shape[0], row_to_request=row_to_request,
            device=topk_indices.device,
        )
    elif context is not None:
        raise ValueError("context: expected None when plan is given (the plan was built from the contexts)")
    scaffold = plan.scaffold_lengths
    if scaffold is not None and tuple(scaffold.shape) != (topk_indices.shape[0],):
        raise ValueError(f"plan.scaffold_lengths: expected shape ({topk_indices.shape[0]},), got {tuple(scaffold.shape)}")
    resolved = resolve_backend(config.backend if backend is None else backend, topk_indices.device)
    if validate:
        inputs_by_name = {
            "topk_indices": topk_indices, "lengths": lengths, "topk_indices_offset": topk_indices_offset,
            "block_drift_scores": block_drift_scores, "row_to_request": row_to_request,
            "learned_scores": learned_scores, "plan.scaffold_lengths": scaffold,
        }
        _validate_buffers(topk_indices, out, counters_out, inputs_by_name)
    inputs = PolicyTensors(topk_indices, lengths, topk_indices_offset, block_drift_scores, learned_scores, scaffold)
    rows, counters, lazy = run_layout(
        resolved, PolicyLayout.from_config(config), inputs, row_to_request, out=out, counters_out=counters_out
    )
    elapsed = None
    if measure_time:
        _synchronize(topk_indices.device)
        elapsed = (time.perf_counter() - start) * 1e3
    return TopologyKVPolicyResult(
        indices=rows,
        counters=TopologyKVCounters(tensors=counters, compression_hits=plan.compression_hits, lazy=lazy),
        fingerprints=plan.fingerprints,
        schedule_ms=elapsed,
    )


def run_layout(
    backend: TopologyKVBackend,
    layout: PolicyLayout,
    inputs: PolicyTensors,
    row_to_request: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    counters_out: Optional[torch.Tensor] = None,
):
    """The policy on already-checked inputs: a resolved backend and a layout, tensors only.

    What :func:`apply_topology_kv_policy` runs after its checks, and what a
    :class:`~rtp_llm.models_py.modules.hybrid.topology_kv.layer.TopologyKVLayerPolicy`
    runs per call. ``inputs.drift`` is ``[B, N]`` with ``row_to_request``, else ``[R, N]``.
    Returns :func:`run_policy_core`'s ``(rows, counters, lazy)``.
    """
    x = inputs.topk_indices
    if backend is TopologyKVBackend.CPU_FUSED and x.shape[1] >= 1:
        # One C++ entry: metadata checks, drift rows through row_to_request, the rows.
        _, lengths, offsets, drift, scores, scaffold = inputs
        rows, buffer = cpu_fused.run_layer(
            x, lengths, offsets, drift, row_to_request if drift is not None else None,
            scaffold if layout.compress_mode else None, cpu_fused.layer_args(layout, x.shape[1]),
            learned_scores=scores, out=out, counters=counters_out,
        )
        return rows, {}, lambda: buffer_counters(buffer)
    if inputs.drift is not None and row_to_request is not None:
        drift = select_request_rows(inputs.drift, row_to_request, "the rows of block_drift_scores")  # [B, N] -> [R, N]
        inputs = inputs._replace(drift=drift)
    return run_policy_core(backend, inputs, layout=layout, out=out, counters_out=counters_out)


def _validate_buffers(topk_indices: torch.Tensor, out, counters_out, inputs: Dict[str, Optional[torch.Tensor]]) -> None:
    """Metadata of ``out`` / ``counters_out``, and neither shares a byte with an input or the other.

    Inputs are never modified, and a kernel that writes a row another row still has to read
    gives wrong rows without an error, so any overlap is refused: the same address, one
    row past the input in one buffer, a view of ``lengths``' memory. Host metadata only
    (addresses, sizes, strides; no value is read).
    """
    R, W = topk_indices.shape
    if out is not None:
        check_tensor("out", out, dtypes=(topk_indices.dtype,), shape=(R, W), device=topk_indices.device,
                     device_of="topk_indices")
        _check_apart("out", out, inputs)
    if counters_out is not None:
        check_tensor("counters_out", counters_out, dtypes=(torch.int64,), shape=(len(COUNTER_NAMES),),
                     device=topk_indices.device, device_of="topk_indices")
        _check_apart("counters_out", counters_out, {**inputs, "out": out})


def _check_apart(name: str, buffer: torch.Tensor, others: Dict[str, Optional[torch.Tensor]]) -> None:
    for other_name, other in others.items():
        if other is not None and memory_overlaps(buffer, other):
            raise ValueError(
                f"{name}: expected a buffer apart from {other_name} (inputs are never modified), "
                f"got one that shares memory with it"
            )


def _byte_extent(t: torch.Tensor) -> Tuple[int, int]:
    """``[first, last + 1)`` byte addresses a tensor's elements span (strides are >= 0 in torch)."""
    start = t.data_ptr()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (span + 1) * t.element_size()


def memory_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share a byte: an address-range check on the same device.

    Exact for dense tensors; conservative for strided views whose extents interleave (two
    columns of one matrix count as overlapping). Empty tensors overlap nothing. Host
    metadata only, no sync; ``torch._C._overlaps`` is no substitute: it calls two disjoint
    slices of one buffer overlapping.
    """
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a_start, a_end = _byte_extent(a)
    b_start, b_end = _byte_extent(b)
    return a_start < b_end and b_start < a_end


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
