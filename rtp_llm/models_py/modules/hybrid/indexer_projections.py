"""The lightning indexer's own weights, in DeepSeek-V3.2's form: q, k and head weights from hidden states.

DeepSeek-V3.2's ``Indexer`` computes, for a layer input ``x [T, C]`` (the attention's
input, after the layer's input norm) and, where the model has one, the q-LoRA latent
``qr [T, Cq]`` (a model without one feeds ``x`` there)::

    q = wq_b(qr).view(T, H, D)                       # H indexer heads of D dims
    k = k_norm(wk(x))                                # one key head [T, D], LayerNorm over D
    q, k = rope(q), rope(k)                          # non-interleaved, first rope_dim dims
    w = weights_proj(x) * H ** -0.5 * D ** -0.5      # [T, H] per-head weights
    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])   # the index score

Module names (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``) follow DSA's checkpoint
layout (``layers.{i}.self_attn.indexer.<name>.weight``, ``k_norm`` also has a ``bias``),
so a real checkpoint's tensors map one to one (:mod:`indexer_checkpoint`). The fp8-e4m3
quantization of q and k (one scale per 128 values) and the Hadamard rotation (orthogonal:
dot products unchanged up to fp8 error) belong to the ops that consume q and k
(``Indexer(fp8_emulation=True)`` quantizes on the key write and in the top-k op), not to
these projections.

RoPE here is DSA's non-interleaved layout on the first ``rope_dim`` dims: the rotary part
is split in halves ``(a, b)`` and rotated as ``(a cos - b sin, a sin + b cos)`` with
frequencies ``theta ** (-2 i / rope_dim)``, ``i < rope_dim / 2``.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class IndexerProjectionShape:
    """Shape of one layer's indexer projections.

    heads : ``H`` indexer query heads (DeepSeek-V3.2: 64)
    head_dim : ``D`` (DeepSeek-V3.2: 128)
    rope_dim : leading dims of q and k that carry RoPE (DeepSeek-V3.2: 64, half of D)
    hidden_size : ``C``, the layer input's width
    q_input_size : ``Cq``, the width of what ``wq_b`` reads (the q-LoRA latent; ``C``
        for a model without one)
    rope_theta : RoPE base of the served model
    """

    heads: int
    head_dim: int
    rope_dim: int
    hidden_size: int
    q_input_size: int
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("heads", "head_dim", "hidden_size", "q_input_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if isinstance(self.rope_dim, bool) or not isinstance(self.rope_dim, int):
            raise ValueError(f"rope_dim: expected an int, got {self.rope_dim!r}")
        if not 0 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim: expected an even int in [0, head_dim={self.head_dim}], got {self.rope_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta: expected > 0, got {self.rope_theta!r}")

    @property
    def weight_scale(self) -> float:
        """DSA's factor on ``weights_proj(x)``: ``heads ** -0.5`` times the softmax scale ``head_dim ** -0.5``."""
        return self.heads**-0.5 * self.head_dim**-0.5

    @property
    def macs_per_key(self) -> int:
        """Multiply-adds the score costs per (query row, key): ``H * D``."""
        return self.heads * self.head_dim

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def rope_non_interleaved(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """RoPE on the first ``rope_dim`` dims of ``x [..., T, (heads,) D]``'s last axis, halves layout.

    x : float ``[T, D]`` or ``[T, H, D]``; positions : int ``[T]`` (absolute token positions).
    Returns a new tensor of ``x``'s shape and dtype (fp32 maths); dims past ``rope_dim``
    pass through unchanged.
    """
    if rope_dim == 0:
        return x
    half = rope_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / rope_dim)  # [half]
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # [T, half]
    cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
    if x.dim() == 3:  # [T, H, D]: the same angle for every head
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xf = x.to(torch.float32)
    a, b, rest = xf[..., :half], xf[..., half:rope_dim], xf[..., rope_dim:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, rest], dim=-1).to(x.dtype)


class IndexerProjections(nn.Module):
    """One layer's indexer modules (module docstring); fp32 parameters."""

    def __init__(self, shape: IndexerProjectionShape) -> None:
        super().__init__()
        self.shape = shape
        H, D = shape.heads, shape.head_dim
        self.wq_b = nn.Linear(shape.q_input_size, H * D, bias=False)
        self.wk = nn.Linear(shape.hidden_size, D, bias=False)
        self.k_norm = nn.LayerNorm(D)
        self.weights_proj = nn.Linear(shape.hidden_size, H, bias=False)
        self.weight_scale = shape.weight_scale

    def keys(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden [T, C]`` at ``positions [T]`` -> fp32 keys ``[T, D]`` (normed, RoPE'd)."""
        k = self.k_norm(self.wk(hidden.to(torch.float32)))  # [T, D]
        return rope_non_interleaved(k, positions, self.shape.rope_dim, self.shape.rope_theta)

    def queries(self, q_input: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``q_input [T, Cq]`` at ``positions [T]`` -> fp32 queries ``[T, H, D]`` (RoPE'd)."""
        T = q_input.shape[0]
        q = self.wq_b(q_input.to(torch.float32)).view(T, self.shape.heads, self.shape.head_dim)
        return rope_non_interleaved(q, positions, self.shape.rope_dim, self.shape.rope_theta)

    def weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, C]`` -> fp32 per-head weights ``[T, H]`` (scales folded in)."""
        return self.weights_proj(hidden.to(torch.float32)) * self.weight_scale

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, q_input: torch.Tensor = None
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, H, D], k [T, D], weights [T, H])`` for ``hidden [T, C]`` at ``positions [T]``.

        q_input : ``[T, Cq]`` (the q-LoRA latent), or None to feed ``hidden`` (a model
        without q-LoRA).
        """
        q_src = hidden if q_input is None else q_input
        return self.queries(q_src, positions), self.keys(hidden, positions), self.weights(hidden)

