"""Synthetic layer inputs for the harness's tests and quick checks (no model needed)."""

from __future__ import annotations

from typing import Optional

import torch

from benchmark.quality.layer import LayerInputs


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
    return LayerInputs.build(
        layer_idx=layer_idx,
        query=torch.randn(H, T, D, generator=g),
        key=torch.randn(Hkv, L, D, generator=g),
        value=torch.randn(Hkv, L, D, generator=g),
        scaling=D**-0.5,
        query_chunk=query_chunk,
    )
