"""The paged KV layout of a batch: where every request's tokens live, for every variant.

One pool per layer, 64-token pages, like the engine's paged cache:

* model K/V pool ``[num_blocks, 64, Hkv, D]`` fp32 and indexer key pool
  ``[num_blocks, 64, Di]`` (an :class:`IndexerKeyCache`);
* each request's full prefill blocks are shared by every variant (read-only, as prefix
  caching shares them); its partial last block and everything decoded after it live in
  blocks private to the variant (copied on write at prefill), so every variant decodes
  from the same prefilled state in a fraction of the memory;
* each variant has its own block table ``[B, MB]`` int32 (``-1`` unused) and, per layer,
  its own ``BlockDriftTracker`` fed by ``Indexer.write_keys``.

Every tensor of a run lives on :attr:`Layout.device`, the model's device (``--device``):
the pools, block tables, trackers and each step's inputs. What stays on the host is
Python metadata (lengths kept as lists).

Request ``b`` of a batch holds the first ``c_b`` tokens of one prefilled text
(``c_b = C - floor(b * C * spread / B)``; causal attention makes a prefix's K/V exactly
what its own prefill would give).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from benchmark.e2e.clock import phase_clock
from rtp_llm.models_py.modules.hybrid.indexer_params import IndexerKeyCache
from rtp_llm.models_py.modules.hybrid.topology_kv.config import DEFAULT_BLOCK_SIZE
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import BlockDriftTracker

if TYPE_CHECKING:  # annotations only
    from benchmark.e2e.indexers import ProxyIndexer, TimedIndexer

BLOCK_SIZE = DEFAULT_BLOCK_SIZE  # the engine's KV page


def request_lengths(context: int, batch: int, spread: float) -> List[int]:
    """``c_b = C - floor(b * C * spread / B)``: request 0 is the longest."""
    return [max(2, context - int(b * context * spread / batch)) for b in range(batch)]


@dataclasses.dataclass
class Layout:
    """Where every request's tokens live, for ``V`` variants (module docstring).

    Shared region: request ``b``'s full prefill blocks are pool blocks
    ``b * SB .. b * SB + p_b / 64 - 1`` (``p_b = 64 * floor(c_b / 64)``, ``SB`` = the
    longest's). Private region of variant ``v``: request ``b``'s positions ``p_b ..`` are
    pool blocks ``B * SB + (v * B + b) * TB + j``. Both regions are contiguous per request,
    so dense attention reads them as strided views.

    ``device``: where the run's tensors live (the model's device); :attr:`clock` is the
    phase timers' clock there (:func:`benchmark.e2e.clock.phase_clock`).
    """

    context_lens: List[int]
    variants: int
    rows_per_step: int
    steps: int
    page: int = BLOCK_SIZE
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.clock = phase_clock(self.device)
        pg = self.page
        self.batch = len(self.context_lens)
        self.shared_lens = [(c // pg) * pg for c in self.context_lens]
        self.shared_blocks = max(self.shared_lens) // pg  # SB
        self.tail_blocks = -(-(pg - 1 + self.steps * self.rows_per_step) // pg)  # TB
        self.num_blocks = self.batch * self.shared_blocks + self.variants * self.batch * self.tail_blocks
        self.max_blocks = self.shared_blocks + self.tail_blocks  # MB

    @property
    def shared_tokens(self) -> int:
        return self.shared_blocks * self.page  # P

    @property
    def tail_tokens(self) -> int:
        return self.tail_blocks * self.page  # Tc

    def tail_first_block(self, v: int, b: int) -> int:
        return self.batch * self.shared_blocks + (v * self.batch + b) * self.tail_blocks

    def block_table(self, v: int) -> torch.Tensor:
        """int32 ``[B, MB]`` of variant ``v``, ``-1`` in unused columns."""
        table = torch.full((self.batch, self.max_blocks), -1, dtype=torch.int32, device=self.device)
        for b, p in enumerate(self.shared_lens):
            n = p // self.page
            table[b, :n] = torch.arange(b * self.shared_blocks, b * self.shared_blocks + n, dtype=torch.int32,
                                        device=self.device)
            first = self.tail_first_block(v, b)
            table[b, n : n + self.tail_blocks] = torch.arange(first, first + self.tail_blocks, dtype=torch.int32,
                                                              device=self.device)
        return table


def slots_of(table: torch.Tensor, request: torch.Tensor, position: torch.Tensor, page: int = BLOCK_SIZE):
    """Physical slots ``table[req, pos // page] * page + pos % page`` (int64)."""
    block = table.to(torch.int64)[request, torch.div(position, page, rounding_mode="floor")]
    return block * page + position % page


def rows_to_slots(rows: torch.Tensor, table: torch.Tensor, row_to_request: torch.Tensor,
                  page: int = BLOCK_SIZE) -> torch.Tensor:
    """The sparse op's mapping: ``table[req, tok // page] * page + tok % page``; -1 stays -1."""
    tok = rows.to(torch.int64)
    valid = tok >= 0
    safe = tok.clamp(min=0)
    phys = table.to(torch.int64)[row_to_request.unsqueeze(1), torch.div(safe, page, rounding_mode="floor")]
    return torch.where(valid, phys * page + safe % page, -1)


@dataclasses.dataclass
class LayerPools:
    """One layer's pools (every variant's blocks) and its indexer's inputs; a layer whose
    decode stays dense (a sliding-window layer) has no indexer keys and no indexer."""

    k: torch.Tensor  # [NB, page, Hkv, D] fp32
    v: torch.Tensor
    index_cache: Optional[IndexerKeyCache]  # k_cache [NB, page, Di] fp32 (fp8-representable values)
    proxy: Optional[ProxyIndexer]
    layout: Layout

    def caches(self) -> Tuple[torch.Tensor, ...]:
        """The paged tensors this layer holds: K, V and, on a sparse layer, the indexer keys."""
        return (self.k, self.v) if self.index_cache is None else (self.k, self.v, self.index_cache.k_cache)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:])

    def shared(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, P, Hkv, D]`` view of the shared region."""
        L = self.layout
        return t[: L.batch * L.shared_blocks].view(L.batch, L.shared_tokens, *t.shape[2:])

    def tail(self, t: torch.Tensor, v: int) -> torch.Tensor:
        """``[B, Tc, Hkv, D]`` view of variant ``v``'s private region."""
        L = self.layout
        first = L.tail_first_block(v, 0)
        return t[first : first + L.batch * L.tail_blocks].view(L.batch, L.tail_tokens, *t.shape[2:])


@dataclasses.dataclass
class VariantState:
    name: str
    index: int  # v in the layout
    block_table: torch.Tensor
    indexers: Dict[int, Optional[TimedIndexer]]
    trackers: Dict[int, Optional[BlockDriftTracker]]
    lens: List[int]  # current KV length per request (host)

    def own_bytes(self, pools: Dict[int, LayerPools]) -> int:
        """Bytes this variant owns: its private K/V/indexer-key blocks and drift trackers."""
        total = 0
        for layer, p in pools.items():
            for t in p.caches():
                total += p.tail(t, self.index).numel() * t.element_size()
            tr = self.trackers.get(layer)
            if tr is not None:
                total += sum(x.numel() * x.element_size() for x in (tr._sums, tr._counts, tr._drift_flat))
        return total

