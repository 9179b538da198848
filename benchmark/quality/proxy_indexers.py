"""The end-to-end benchmark's untrained proxy indexer (a null model), its shape presets and costs.

The proxy is built from the model's own post-RoPE queries and keys in DSA's form
``I[t, s] = sum_j w_j relu(q_j[t] . k[s])`` with one key head (MQA, as DSA): the key is
the concatenation of the KV heads (``Hkv * D`` values) projected to ``Di`` dims (identity
when ``Di = Hkv * D``, else the top principal directions of the layer's prefill keys),
query head ``j`` the mean over its share of the ``G = H / Hkv`` query groups of their
concatenated heads, projected the same way; q and k are fp8-e4m3 round-tripped (per 64-
or 128-channel group) once, keys on write. Presets (``--indexer-preset``):

* ``dsa-ratio`` (default): ``Hi * Di`` multiply-adds per key ~= 1/17 of the attention's
  ``2 * H * D`` (DeepSeek-V3.2: 64 x 128 indexer vs 128 heads x (576 + 512) MLA);
  for SmolLM2 that is 1 head x 64 dims (64 vs 1,152 multiply-adds per key: 1/18);
* ``model``: the model's own heads and dims, ``G`` heads x ``Hkv * D`` dims (576 per
  key, 1/2 of attention: the cost of the earlier proxy).

Untrained: on raw post-RoPE q and k almost every ``relu`` score is exactly 0, so the
proxy's rows are decided by the top-k's tie rule (lower position first) and drop the
newest tokens. The harness (``proxy-pca`` selector) and the end-to-end benchmark
(``--indexer proxy``) both use it, as a named null model beside the trained indexer.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip

# DeepSeek-V3.2: indexer 64 heads x 128 dims per key; MLA 128 heads x (576 q.k + 512 p.v).
DSA_INDEXER_MACS = 64 * 128
DSA_ATTENTION_MACS = 128 * (576 + 512)
DSA_RATIO = DSA_INDEXER_MACS / DSA_ATTENTION_MACS  # ~1/17
PRESETS = ("dsa-ratio", "model")
TRAINED = "trained"  # IndexerShape.preset of a trained checkpoint's shape


@dataclasses.dataclass(frozen=True)
class IndexerShape:
    """Heads and dims of the proxy indexer and what they cost per key."""

    preset: str
    heads: int  # Hi
    dim: int  # Di
    fp8_group: int
    macs_per_key: int  # Hi * Di
    attention_macs_per_key: int  # 2 * H * D (q.k and p.v)

    @property
    def ratio_to_attention(self) -> float:
        return self.macs_per_key / self.attention_macs_per_key

    def describe(self) -> Dict[str, object]:
        return {**dataclasses.asdict(self), "ratio_to_attention": self.ratio_to_attention, "dsa_ratio": DSA_RATIO}


def trained_indexer_shape(heads: int, dim: int, H: int, D: int) -> IndexerShape:
    """The shape record of a trained checkpoint of ``heads`` x ``dim`` (fp8 groups of 128)."""
    return IndexerShape(TRAINED, heads, dim, min(128, dim), heads * dim, 2 * H * D)


def resolve_indexer_shape(preset: str, heads: Optional[int], dim: Optional[int], H: int, Hkv: int,
                          D: int) -> IndexerShape:
    """The preset's ``(Hi, Di)`` for a model with ``H`` query / ``Hkv`` KV heads of ``D`` dims."""
    G, full = H // Hkv, Hkv * D
    attention = 2 * H * D
    if preset == "model":
        h, d = G, full
    elif preset == "dsa-ratio":
        d = min(full, 64)
        h = max(1, min(G, round(attention * DSA_RATIO / d)))
    else:
        raise ValueError(f"indexer preset: expected one of {list(PRESETS)}, got {preset!r}")
    h = heads if heads is not None else h
    d = dim if dim is not None else d
    if not 1 <= h <= G:
        raise ValueError(f"indexer heads: expected 1..{G} (query groups per KV head), got {h}")
    if not 1 <= d <= full:
        raise ValueError(f"indexer dim: expected 1..{full} (Hkv * head_dim), got {d}")
    group = next((g for g in (128, 64) if d % g == 0), d)
    return IndexerShape(preset, h, d, group, h * d, attention)


class ProxyIndexer:
    """One layer's proxy indexer projections (module docstring); no trained weights.

    An untrained null model, labelled for what it is: on raw post-RoPE q and k almost every
    ``relu`` score is exactly 0, so its rows are decided by the top-k's tie rule (lower
    position first) and drop the newest tokens.

    ``projection`` is ``[Hkv * D, Di]`` (None: identity); ``keys_for_fit [L, Hkv, D]``
    (the prefill keys) gives the principal directions when ``Di < Hkv * D``.
    """

    def __init__(self, shape: IndexerShape, H: int, Hkv: int, D: int, keys_for_fit: Optional[torch.Tensor]):
        self.shape, self.H, self.Hkv, self.D = shape, H, Hkv, D
        self.projection: Optional[torch.Tensor] = None
        if shape.dim < Hkv * D:
            if keys_for_fit is None:
                raise ValueError("keys_for_fit: needed to fit a projection to fewer dims than Hkv * D")
            x = keys_for_fit.reshape(keys_for_fit.shape[0], Hkv * D).to(torch.float64)
            cov = (x.T @ x) / max(1, x.shape[0])  # uncentred: keeps the mean direction
            _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
            self.projection = vecs[:, -shape.dim:].flip(1).to(torch.float32).contiguous()
        G = H // Hkv
        self.groups = [chunk.tolist() for chunk in torch.arange(G).tensor_split(shape.heads)]

    reads_hidden = False

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.projection is None else x @ self.projection

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """``k [T, Hkv, D]`` -> fp32 ``[T, Di]`` fp8-e4m3 round-tripped (quantized once, on write)."""
        flat = k.reshape(k.shape[0], self.Hkv * self.D).to(torch.float32)
        return fp8_e4m3_round_trip(self._project(flat), self.shape.fp8_group)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q [R, H, D]`` -> fp32 ``[R, Hi, Di]`` (fp8 round-tripped)."""
        R = q.shape[0]
        G = self.H // self.Hkv
        # Head k * G + g uses KV head k: concatenating group member g over k matches the key layout.
        cat = q.to(torch.float32).view(R, self.Hkv, G, self.D).transpose(1, 2).reshape(R, G, self.Hkv * self.D)
        if self.shape.heads < G:
            cat = torch.stack([cat[:, g].mean(dim=1) for g in self.groups], dim=1)
        return fp8_e4m3_round_trip(self._project(cat), self.shape.fp8_group)
