"""Synthetic layer inputs for the harness's tests and quick checks (no model needed), and a
seeded random stand-in for a trained indexer checkpoint (any layer, any hidden width)."""

from __future__ import annotations

import collections.abc
from typing import Dict, Iterator, Optional

import torch

from benchmark.quality.layer import LayerInputs
from benchmark.quality.selector_base import SelectorSettings

SYNTHETIC_HIDDEN = 64  # width of the synthetic attention input (the tests' tiny models use 64 too)


def synthetic_layer(
    seed: int = 0,
    layer_idx: int = 0,
    T: int = 150,
    L: Optional[int] = None,
    H: int = 6,
    Hkv: int = 2,
    D: int = 16,
    query_chunk: int = 64,
) -> LayerInputs:
    """Gaussian post-RoPE-like q ``[H, T, D]``, k and v ``[Hkv, L, D]`` drawn from ``seed``.

    Defaults: GQA 3:1, ``L = T = 150`` and a partial last query chunk (150 = 2 x 64 + 22).
    ``layer_idx`` seeds the per-layer streams of the random and degraded selectors.
    """
    L = T if L is None else L
    g = torch.Generator(device="cpu").manual_seed(seed)
    query = torch.randn(H, T, D, generator=g)
    key = torch.randn(Hkv, L, D, generator=g)
    value = torch.randn(Hkv, L, D, generator=g)
    hidden = torch.randn(L, SYNTHETIC_HIDDEN, generator=g)  # drawn last: q/k/v as before
    return LayerInputs.build(layer_idx=layer_idx, query=query, key=key, value=value, scaling=D**-0.5,
                             query_chunk=query_chunk, hidden=hidden)


class RandomIndexers(collections.abc.Mapping):
    """layer -> seeded random ``IndexerProjections`` (made on first use, for any layer id).

    Stands in for a trained checkpoint where only the code path matters (tests of the
    selectors built on ``learned``): deterministic in ``(seed, layer)``.
    """

    def __init__(self, hidden_size: int = SYNTHETIC_HIDDEN, heads: int = 1, head_dim: int = 16, seed: int = 0):
        from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjectionShape

        self.shape = IndexerProjectionShape(heads=heads, head_dim=head_dim, rope_dim=head_dim // 2,
                                            hidden_size=hidden_size, q_input_size=hidden_size)
        self.seed = seed
        self._made: Dict[int, object] = {}

    def __getitem__(self, layer: int):
        if layer not in self._made:
            from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjections

            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(layer))
            module = IndexerProjections(self.shape)
            with torch.no_grad():
                for p in (module.wq_b.weight, module.wk.weight, module.weights_proj.weight):
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            self._made[layer] = module.eval().requires_grad_(False)
        return self._made[layer]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._made))

    def __len__(self) -> int:
        return len(self._made)


def synthetic_settings(hidden_size: int = SYNTHETIC_HIDDEN, **kwargs) -> SelectorSettings:
    """:class:`SelectorSettings` whose trained indexer is :class:`RandomIndexers` (tests)."""
    return SelectorSettings(trained=RandomIndexers(hidden_size), trained_source="random (tests)", **kwargs)
