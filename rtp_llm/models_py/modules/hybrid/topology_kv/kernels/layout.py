"""The structural-slot layout every kernel of the policy shares, derived once.

:class:`PolicyLayout` is built from a :class:`TopologyKVPolicyConfig` (or directly, by the
kernel tests) and holds the mode, the block counts and every constant the kernels derive
from them: the sink span, whether the last sink block is partial, the compression start.
The torch core, the C++ kernel and the Triton kernel take this one object, so none of
them re-derives or re-validates a setting. What a layout guarantees (checked here, once):
an enabled mode, block counts ``>= 0``, ``block_size >= 1``, ``sink_tokens`` None or ``>= 0``.

Slot layout of a row (``S`` slots): ``[sink tokens | local blocks | witness blocks]``,
``sink_slots + (local_blocks + witness_count(W)) * block_size`` slots in all.

:func:`check_kernel_buffers` is the one metadata check of the fused kernels' tensors
(shapes, dtypes, devices; no value is read): a wrong shape there would read out of bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Tuple

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    StructuralBudget,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)

COUNTER_NAMES = (
    "selected_tokens",  # valid output entries (rows the policy processed)
    "structural_injected_tokens",  # output tokens that were not in the learned row
    "learned_kept_tokens",  # learned tokens present in the output
    "learned_evicted_tokens",  # learned tokens absent from the output
    "unselected_tokens",  # causal tokens (sum of lengths) not selected
    "coordinate_mismatch_fallbacks",  # rows returned unchanged for a contract violation
    "compressed_blocks",  # compress mode: scaffold blocks represented by one token
    "compression_saved_tokens",  # compress mode: tokens those blocks did not spend
)

_INDEX_DTYPES = (torch.int32, torch.int64)


class PolicyTensors(NamedTuple):
    """A policy call's input tensors (``R`` rows, ``W`` width, ``N`` blocks), never modified.

    topk_indices : int32/int64 ``[R, W]`` learned rows: request-local positions inside
        ``[offset, offset + length)``, valid entries first, then negative padding
    lengths : int32/int64 ``[R]`` causal lengths (a row with length <= 0 is broken)
    offsets : int32/int64 ``[R]`` row offsets, or None (all zero)
    drift : float ``[R, N]`` witness scores (``[B, N]`` with a row-to-request map, before
        :func:`~rtp_llm.models_py.modules.hybrid.topology_kv.policy.run_layout` selects the
        rows), or None (the most recent blocks win)
    learned_scores : float ``[R, W]`` aligned with ``topk_indices``, or None (merge modes
        evict the row's last entries); ignored by ``TOPOLOGY_ONLY``
    scaffold_lengths : int32/int64 ``[R]`` scaffold span per row (compress mode), or None
    """

    topk_indices: torch.Tensor
    lengths: torch.Tensor
    offsets: Optional[torch.Tensor] = None
    drift: Optional[torch.Tensor] = None
    learned_scores: Optional[torch.Tensor] = None
    scaffold_lengths: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class PolicyLayout:
    """An enabled mode's structural settings and the constants derived from them.

    Attributes (given)
    ------------------
    mode : an enabled :class:`TopologyKVPolicyMode`
    sink_blocks, local_blocks, witness_blocks, block_size, sink_tokens : as in the config
    max_structural_fraction : float; the merge modes inject at most
        ``floor(W * max_structural_fraction)`` tokens per row (:meth:`structural_cap`)
    scale_budget_by_length : the ``scaled`` structural budget (merge modes only)

    Attributes (derived)
    --------------------
    only : ``mode is TOPOLOGY_ONLY``
    compress_mode : ``mode is TOPOLOGY_COMPRESS_SPARSE`` (compresses when given scaffold spans)
    token_sinks : ``sink_tokens is not None``
    sink_full_blocks : whole sink blocks (``sink_tokens // block_size`` or ``sink_blocks``)
    partial_sink : token sinks that end inside a block (that block's other tokens are not sinks)
    sink_slots : slots of the sink segment (``sink_tokens`` or ``sink_blocks * block_size``)
    compress_start_block : first block compress mode may compress (blocks holding sinks stay whole)
    compress_start : its first token
    """

    mode: TopologyKVPolicyMode
    sink_blocks: int
    local_blocks: int
    witness_blocks: int
    block_size: int
    sink_tokens: Optional[int] = None
    max_structural_fraction: float = 0.25
    scale_budget_by_length: bool = False
    only: bool = dataclasses.field(init=False)
    compress_mode: bool = dataclasses.field(init=False)
    token_sinks: bool = dataclasses.field(init=False)
    sink_full_blocks: int = dataclasses.field(init=False)
    partial_sink: bool = dataclasses.field(init=False)
    sink_slots: int = dataclasses.field(init=False)
    compress_start_block: int = dataclasses.field(init=False)
    compress_start: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        mode = TopologyKVPolicyMode.parse(self.mode)
        if mode is TopologyKVPolicyMode.DISABLED:
            raise ValueError("mode: expected an enabled TopologyKVPolicyMode, got disabled")
        for name in ("sink_blocks", "local_blocks", "witness_blocks"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if int(self.block_size) < 1:
            raise ValueError(f"block_size: expected >= 1, got {self.block_size}")
        if self.sink_tokens is not None and int(self.sink_tokens) < 0:
            raise ValueError(f"sink_tokens: expected >= 0 or None, got {self.sink_tokens}")
        bs = int(self.block_size)
        token_sinks = self.sink_tokens is not None
        sink_tokens = int(self.sink_tokens) if token_sinks else None
        only = mode is TopologyKVPolicyMode.TOPOLOGY_ONLY
        derived = dict(
            mode=mode,
            sink_blocks=int(self.sink_blocks),
            local_blocks=int(self.local_blocks),
            witness_blocks=int(self.witness_blocks),
            block_size=bs,
            sink_tokens=sink_tokens,
            scale_budget_by_length=bool(self.scale_budget_by_length) and not only,
            only=only,
            compress_mode=mode is TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE,
            token_sinks=token_sinks,
            sink_full_blocks=sink_tokens // bs if token_sinks else int(self.sink_blocks),
            partial_sink=token_sinks and sink_tokens % bs != 0,
            sink_slots=sink_tokens if token_sinks else int(self.sink_blocks) * bs,
            compress_start_block=-(-sink_tokens // bs) if token_sinks else 0,
        )
        derived["compress_start"] = derived["compress_start_block"] * bs
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        # Immutable, so its hash is fixed: computed once (layouts key per-call caches).
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_config(cls, config: TopologyKVPolicyConfig) -> "PolicyLayout":
        """The layout of an enabled config (cached: configs are immutable and hashable)."""
        return _layout_of(config)

    def structural_cap(self, width: int) -> int:
        """Most structural tokens a merge mode injects into a row of width ``width``."""
        return int(math.floor(width * self.max_structural_fraction))

    def witness_count(self, width: int) -> int:
        """Witness blocks scheduled per row: ``witness_blocks``, or for ``TOPOLOGY_ONLY``
        enough blocks to fill a row of width ``width`` whatever its alignment."""
        return (width + self.block_size - 1) // self.block_size + 1 if self.only else self.witness_blocks

    def slot_count(self, width: int) -> int:
        """``S``: structural slots per row."""
        return self.sink_slots + (self.local_blocks + self.witness_count(width)) * self.block_size


@functools.lru_cache(maxsize=256)
def _layout_of(config: TopologyKVPolicyConfig) -> PolicyLayout:
    return PolicyLayout(
        mode=config.policy,
        sink_blocks=config.sink_blocks,
        local_blocks=config.local_blocks,
        witness_blocks=config.witness_blocks,
        block_size=config.block_size,
        sink_tokens=config.sink_tokens,
        max_structural_fraction=config.max_structural_fraction,
        scale_budget_by_length=config.structural_budget is StructuralBudget.SCALED,
    )


def _check_vector(name: str, t, R: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32/int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != (R,) or t.device != device:
        raise ValueError(f"{name}: expected shape ({R},) on {device}, got {tuple(t.shape)} on {t.device}")


def _check_float(name: str, t, shape: str, R: int, width: Optional[int], device: torch.device) -> None:
    if (not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2 or t.shape[0] != R
            or (width is not None and t.shape[1] != width) or t.device != device):
        raise ValueError(f"{name}: expected a float tensor {shape} on {device}, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def check_kernel_buffers(
    layout: PolicyLayout,
    inputs: PolicyTensors,
    out: Optional[torch.Tensor],
    counters: Optional[torch.Tensor],
    mismatch_rows: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Metadata checks of a fused kernel's tensors; returns ``(out, counters)``, allocated
    when None. Errors name the argument, expected and actual; no value is read.

    The fused kernels' buffers: ``out`` like ``topk_indices`` (same shape and dtype), or None
    (allocated), fully overwritten; ``counters`` int64 ``[len(COUNTER_NAMES)]``, or None
    (zeros allocated), to which the call *adds* its counts in :data:`COUNTER_NAMES` order
    (for ``TOPOLOGY_ONLY`` the learned kept / evicted / structural injected counts too);
    ``mismatch_rows`` bool ``[R]`` or None, set to the broken-row flags when given.
    """
    if not isinstance(layout, PolicyLayout):
        raise TypeError(f"layout: expected PolicyLayout, got {type(layout).__name__}")
    x, lengths, offsets, drift, learned_scores, scaffold_lengths = inputs
    if not isinstance(x, torch.Tensor) or x.dtype not in _INDEX_DTYPES or x.dim() != 2:
        raise TypeError("topk_indices: expected an int32/int64 tensor [R, W], got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    R, W = x.shape
    dev = x.device
    _check_vector("lengths", lengths, R, dev)
    if offsets is not None:
        _check_vector("offsets", offsets, R, dev)
    if layout.compress_mode and scaffold_lengths is not None:
        _check_vector("scaffold_lengths", scaffold_lengths, R, dev)
    if drift is not None:
        _check_float("drift", drift, f"[{R}, N]", R, None, dev)
    if learned_scores is not None and not layout.only:
        _check_float("learned_scores", learned_scores, f"[{R}, {W}]", R, W, dev)
    if out is None:
        out = torch.empty((R, W), dtype=x.dtype, device=dev)
    elif (not isinstance(out, torch.Tensor) or out.dtype != x.dtype or tuple(out.shape) != (R, W)
          or out.device != dev):
        raise ValueError(f"out: expected {x.dtype} [{R}, {W}] on {dev}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
    if counters is None:
        counters = torch.zeros(len(COUNTER_NAMES), dtype=torch.int64, device=dev)
    elif (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int64
          or tuple(counters.shape) != (len(COUNTER_NAMES),) or counters.device != dev):
        raise ValueError(f"counters: expected int64 [{len(COUNTER_NAMES)}] on {dev}, got "
                         f"{getattr(counters, 'dtype', type(counters).__name__)} "
                         f"{tuple(getattr(counters, 'shape', ()))}")
    if mismatch_rows is not None and (
        not isinstance(mismatch_rows, torch.Tensor) or mismatch_rows.dtype != torch.bool
        or tuple(mismatch_rows.shape) != (R,) or mismatch_rows.device != dev
    ):
        raise ValueError(f"mismatch_rows: expected bool [{R}] on {dev}")
    return out, counters
