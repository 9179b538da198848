"""Indexer failure modes: the trained indexer degraded in ways real indexers fail.

Each mode changes how the trained indexer (``learned``,
:func:`~benchmark.quality.selector_base.learned_rows_and_scores`) scores keys, and leaves
the engine's row convention alone (short rows stay dense):

* ``noisy``   index scores plus Gaussian noise at signal-to-noise ratio ``noise_snr``
              (power ratio: noise std = row score std / sqrt(snr)), seeded per layer;
* ``nosink``  never selects the first ``drop_tokens`` positions (unless a row has fewer
              than W other positions): the reported failure of indexers that drop the
              attention-sink tokens once the context passes W;
* ``stale``   ranks with the index keys of the previous full-attention layer (an indexer
              whose key cache lags a layer behind, or a layer reusing another's keys);
              the first layer uses its own keys.

Selectors ``learned-<mode>`` expose each degraded indexer, and ``learned-<mode>+<policy
mode>`` the policy applied on top of it (:mod:`benchmark.quality.policy_selectors`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from benchmark.quality.errors import UsageError
from benchmark.quality.layer import LayerInputs
from benchmark.quality.selector_base import (
    Selector,
    SelectorSettings,
    layer_generator,
    top_rows_by_chunk,
    trained_index_scores,
    trained_indexer_inputs,
)

FAILURE_MODES = ("noisy", "nosink", "stale")


@dataclasses.dataclass(frozen=True)
class FailureSettings:
    """noise_snr : ``noisy`` signal-to-noise power ratio (1.0: noise as strong as the signal)
    drop_tokens : ``nosink`` positions never selected (4: the sink count the harness uses
        throughout, docs/quality.md)
    """

    noise_snr: float = 1.0
    drop_tokens: int = 4

    def __post_init__(self) -> None:
        if not self.noise_snr > 0:
            raise UsageError(f"--failure-noise-snr: expected > 0, got {self.noise_snr}")
        if isinstance(self.drop_tokens, bool) or not isinstance(self.drop_tokens, int) or self.drop_tokens < 1:
            raise UsageError(f"--failure-drop-tokens: expected an int >= 1, got {self.drop_tokens!r}")


class StaleKeys:
    """Index keys of the previous full-attention layer within one forward (per selector)."""

    def __init__(self) -> None:
        self._last: Optional[Tuple[int, torch.Tensor]] = None

    def swap(self, layer_idx: int, keys: torch.Tensor) -> torch.Tensor:
        """The index keys to rank with at layer ``layer_idx`` (its own: ``keys``), remembering
        them for the next layer."""
        prev = self._last
        self._last = (layer_idx, keys)
        if prev is None or prev[0] >= layer_idx or prev[1].shape != keys.shape:
            return keys  # first layer of a forward: nothing older to use
        return prev[1]


def degraded_rows_and_scores(
    kind: str,
    layer: LayerInputs,
    width: int,
    settings: SelectorSettings,
    failure: FailureSettings,
    stale: Optional[StaleKeys] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows and scores of the ``kind`` degraded trained indexer (same contract as ``learned``)."""
    if kind not in FAILURE_MODES:
        raise UsageError(f"failure mode: expected one of {list(FAILURE_MODES)}, got {kind!r}")
    q, weights, keys = trained_indexer_inputs(layer, settings)
    if kind == "stale":
        if stale is None:
            raise ValueError("stale: needs a StaleKeys memory")
        keys = stale.swap(layer.layer_idx, keys)
    base_scores = trained_index_scores(q, weights, keys)
    gen = layer_generator(settings.seed + 7919, layer.layer_idx)

    def chunk_scores(c0, c1, lc):
        s = base_scores(c0, c1, lc)  # [Tc, lc]
        if kind == "noisy":
            std = s.std(dim=-1, keepdim=True) / failure.noise_snr**0.5
            s = s + torch.randn(s.shape, generator=gen).to(s.device) * std
        elif kind == "nosink":
            # Below every other score: chosen only when a row has fewer than W other positions.
            s = s.clone()
            s[:, : failure.drop_tokens] = s.min() - 1.0
        return s

    return top_rows_by_chunk(layer, width, chunk_scores)


def make_degraded_learned(kind: str, settings: SelectorSettings, failure: FailureSettings) -> Selector:
    """Selector ``learned-<kind>``: the degraded trained indexer's rows."""
    stale = StaleKeys()

    def select_degraded(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        return degraded_rows_and_scores(kind, layer, width, settings, failure, stale)[0]

    select_degraded.__name__ = f"select_learned_{kind}"
    return select_degraded


def split_selector_name(name: str) -> Tuple[str, Optional[str]]:
    """``"learned-nosink+topology_sparse_merge"`` -> ``("nosink", "topology_sparse_merge")``;
    ``"learned-noisy"`` -> ``("noisy", None)``; anything else -> ``("", None)``."""
    base, _, mode = name.partition("+")
    if base.startswith("learned-") and base[len("learned-"):] in FAILURE_MODES:
        return base[len("learned-"):], (mode or None)
    return "", None
