"""Shared indexer scans in the harness: ``learned-shared:K`` and ``learned-shared:K+<mode>``.

What serving does with ``RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=every:K``
(``rtp_llm/models_py/modules/hybrid/indexer_share.py``): within one forward, the first
sparse layer and every ``K``-th sparse layer after it rank with the trained indexer; every
other sparse layer takes the rows (and their index scores) of the nearest scanning layer
below it, for the same query tokens. ``learned-shared:K`` attends over those rows as they
are; ``learned-shared:K+<merge mode>`` runs the policy of each layer on them, with that
layer's own witness scores (its own keys' drift), as a sharing layer's own policy hook
does. ``learned-shared:1`` is ``learned``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from benchmark.quality.errors import UsageError
from benchmark.quality.layer import LayerInputs
from benchmark.quality.selector_base import Selector, SelectorSettings, learned_rows_and_scores

SHARED_PREFIX = "learned-shared:"
MERGE_MODES = ("topology_sparse_merge", "topology_compress_sparse")


def split_shared_name(name: str) -> Optional[Tuple[int, Optional[str]]]:
    """``"learned-shared:4+topology_sparse_merge"`` -> ``(4, "topology_sparse_merge")``,
    ``"learned-shared:2"`` -> ``(2, None)``; None for any other name; ``UsageError`` for a
    malformed shared one."""
    key = name.strip().lower()
    if not key.startswith(SHARED_PREFIX):
        return None
    body, _, mode = key[len(SHARED_PREFIX):].partition("+")
    if not body.isdigit() or int(body) < 1 or (mode and mode not in MERGE_MODES):
        raise UsageError(f"--selectors: expected {SHARED_PREFIX}K or {SHARED_PREFIX}K+<mode> with K >= 1 and mode "
                         f"one of {list(MERGE_MODES)}, got {name.strip()!r}")
    return int(body), (mode or None)


class SharedScan:
    """The scanning layers' rows within one forward, per budget (one per selector).

    The harness calls a selector once per sparse layer, in ascending layer order, in each
    forward; a layer index not above the previous one starts a new forward. The ``n``-th
    sparse layer of a forward (from 0) scans when ``n % every == 0``.
    """

    def __init__(self, every: int) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: expected an int >= 1, got {every!r}")
        self.every = every
        self._state: Dict[int, Tuple[int, int, Tuple[torch.Tensor, torch.Tensor]]] = {}  # width -> (layer, n, rows)

    def rows(self, layer: LayerInputs, width: int, settings: SelectorSettings) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(rows, scores)`` for ``layer``: its own trained-indexer rows when it scans, else
        those of the forward's last scanning layer."""
        last = self._state.get(width)
        n = 0 if last is None or layer.layer_idx <= last[0] else last[1] + 1
        if n % self.every == 0:
            found = learned_rows_and_scores(layer, width, settings)
        else:
            found = last[2]
            if found[0].shape[0] != layer.lengths.shape[0]:
                raise ValueError(f"learned-shared:{self.every}: layer {layer.layer_idx} has {layer.lengths.shape[0]} "
                                 f"query rows, its scanning layer {found[0].shape[0]}")
        self._state[width] = (layer.layer_idx, n, found)
        return found


def make_shared_learned(every: int, settings: SelectorSettings) -> Selector:
    """Selector ``learned-shared:K``: the rows of the nearest scanning layer, unchanged."""
    memory = SharedScan(every)

    def select_shared(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        return memory.rows(layer, width, settings)[0]

    select_shared.__name__ = f"select_learned_shared_{every}"
    return select_shared


def shared_base_rows(every: int, settings: SelectorSettings):
    """``base_rows(layer, width) -> (rows, scores)`` of ``learned-shared:K`` (for the policy selectors)."""
    memory = SharedScan(every)
    return lambda layer, width: memory.rows(layer, width, settings)
