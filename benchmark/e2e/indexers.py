"""The proxy indexer (SmolLM2 has no trained one), its presets, and the variants' ``Indexer``.

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

``--indexer-heads`` / ``--indexer-dim`` override the preset's shape.

Variants, one budget ``W`` (``--budget``):

* ``dense``              attention over every cached token (no ``Indexer``);
* ``learned``            ``Indexer._compute_topk`` (paged decode op over the block table,
                         top-``W``, policy disabled);
* ``learned+<mode>``     the same ``Indexer`` with the topology policy enabled for ``mode``;
* ``topology_only_noscan`` an ``Indexer`` whose decode op does no scan (it returns the
                         engine's short-row convention and ``-1`` rows), policy
                         ``topology_only``: sink/local/witness tokens only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional

import torch

from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    DEFAULT_BLOCK_SIZE,
    CoordinateMismatchAction,
    IndexerTopologySettings,
    TopologyKVPolicyConfig,
)

POLICY_MODES = ("topology_sparse_merge", "topology_compress_sparse", "topology_only")
VARIANTS = ("dense", "learned") + tuple(f"learned+{m}" for m in POLICY_MODES) + ("topology_only_noscan",)
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


class TrainedIndexerInputs:
    """One layer's trained indexer (``IndexerProjections``) behind the proxy's place in the pools.

    The variant's ``Indexer`` holds the projections and computes q, k and weights from the
    layer's attention input (``Indexer.index_inputs``); q and k are then fp8-e4m3
    round-tripped in 128-value groups once (keys on write), as the proxy's are.
    """

    reads_hidden = True

    def __init__(self, projections) -> None:
        self.projections = projections

    def prefill_keys(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden [C, hidden]`` at ``positions [C]`` -> fp32 ``[C, Di]`` (fp8 round-tripped)."""
        with torch.no_grad():
            return fp8_e4m3_round_trip(self.projections.keys(hidden, positions))

    def from_hidden(self, indexer: Indexer, hidden: torch.Tensor, positions: torch.Tensor):
        """``(q [R, Hi, Di], keys [R, Di], weights [R, Hi])`` of the step's rows, through ``indexer``."""
        q, k, w = indexer.index_inputs(hidden, positions)
        return fp8_e4m3_round_trip(q), fp8_e4m3_round_trip(k), w


class TimedIndexer(Indexer):
    """The serving ``Indexer`` with its decode op timed (``last_op_s``), where the engine's
    kernels slot in; ``scan=False`` replaces the op by one that reads no key: the
    engine's short-row convention (``0 .. length - 1`` when ``length <= W``) and ``-1``
    rows otherwise, for ``topology_only`` without an indexer."""

    def __init__(self, *args, scan: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scan = scan
        self.last_op_s = 0.0

    def _get_topk_paged(self, q, weights, kv_cache, fmha_params, attention_inputs):
        t0 = time.perf_counter()
        if self.scan:
            out = super()._get_topk_paged(q, weights, kv_cache, fmha_params, attention_inputs)
        else:
            lengths = fmha_params.expanded_seq_lens.to(torch.int64).unsqueeze(1)
            ar = torch.arange(self.index_topk, device=q.device).unsqueeze(0)
            out = torch.where((ar < lengths) & (lengths <= self.index_topk), ar, -1).to(torch.int32)
        self.last_op_s = time.perf_counter() - t0
        return out


def variant_policy(variant: str) -> Optional[TopologyKVPolicyConfig]:
    """The policy config a variant applies after (or instead of) the indexer."""
    if variant in ("dense", "learned"):
        return None
    mode = "topology_only" if variant == "topology_only_noscan" else variant.split("+", 1)[1]
    # FALLBACK_DISABLED: no host sync, as a CUDA-graph serving path would run it.
    return TopologyKVPolicyConfig(policy=mode, coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED)


def make_indexer(variant: str, shape: IndexerShape, width: int, layer: int,
                 device: torch.device, projections=None) -> Optional[TimedIndexer]:
    """The variant's ``Indexer`` for one layer (None for dense).

    Built with ``device=``: the policy backend is resolved at construction, so the fused
    CPU kernel compiles here, before timing starts, not inside the first timed step.
    """
    if variant == "dense":
        return None
    policy = variant_policy(variant)
    settings = IndexerTopologySettings() if policy is None else IndexerTopologySettings(policy=policy)
    return TimedIndexer(shape.heads, shape.dim, width, DEFAULT_BLOCK_SIZE, layer_idx=layer, fp8_emulation=False,
                        topology=settings, device=device, scan=variant != "topology_only_noscan",
                        projections=projections)

