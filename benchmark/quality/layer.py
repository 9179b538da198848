"""One attention layer's inputs, as a selector sees them, and the chunked attention maths.

Everything is computed in query chunks of ``query_chunk`` rows, each against only the
keys its causal range can reach (``lc = L - T + c1``), so that the ``[H, Tc, lc]`` score
block stays small: 9 heads x 256 queries x 8192 keys x 4 B = 75 MB at 8k context.

The attention maths is written once: logits (scale, then soft-capping) in
:meth:`LayerInputs.query_logits` / :meth:`LayerInputs.query_logits_into`, the softmax over
the keys a mask allows in :func:`masked_softmax`. The harness's sparse layers and metrics,
the calibration and the tests' fp64 reference (``attention_reference``) all use them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, Iterator, Optional, Tuple

import torch

from benchmark.quality.index_rows import causal_lengths
from benchmark.quality.metrics import soft_cap, soft_cap_

DEFAULT_QUERY_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """Post-RoPE attention inputs of one full-attention layer for one request.

    Attributes
    ----------
    layer_idx : the decoder layer's index
    query : fp32 ``[H, T, D]`` post-RoPE queries (the last ``T`` positions)
    key, value : fp32 ``[Hkv, L, D]`` post-RoPE keys and values (query head ``h``
        reads KV head ``h // (H // Hkv)``, transformers' ``repeat_kv`` order)
    lengths : int64 ``[T]`` causal lengths, ``L - T + t + 1``
    scaling : softmax scale (usually ``D ** -0.5``)
    softcap : logit soft-capping (``tanh(s / c) * c``) or None
    allowed : bool ``[T, L]`` mask the model built (padding, ...) or None = causal
    query_chunk : rows per chunk of the chunked computations
    hidden : fp32 ``[L, C]`` the attention's input (after the layer's input norm) at every
        key position, what a trained indexer reads; None where the forward did not
        capture it (:func:`~benchmark.quality.sparse_attention.install_hidden_capture`)
    """

    layer_idx: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    lengths: torch.Tensor
    scaling: float
    softcap: Optional[float] = None
    allowed: Optional[torch.Tensor] = None
    query_chunk: int = DEFAULT_QUERY_CHUNK
    hidden: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, layer_idx, query, key, value, scaling, softcap=None, allowed=None, query_chunk=DEFAULT_QUERY_CHUNK,
              hidden=None):
        """From fp32 ``[H, T, D]`` / ``[Hkv, L, D]`` tensors (and ``hidden [L, C]``); lengths from the shapes."""
        H, T, D = query.shape
        Hkv, L, _ = key.shape
        if H % Hkv:
            raise ValueError(f"query heads {H} is not a multiple of key/value heads {Hkv}")
        if hidden is not None and hidden.shape[0] != L:
            raise ValueError(f"hidden: expected [{L}, C] (one row per key position), got {list(hidden.shape)}")
        return cls(layer_idx, query, key, value, causal_lengths(T, L, query.device), float(scaling),
                   softcap, allowed, query_chunk, hidden)

    @property
    def key_positions(self) -> torch.Tensor:
        """int64 ``[L]``: the absolute position of each key (the window starts at 0)."""
        return torch.arange(self.key_length, device=self.query.device)

    @property
    def num_queries(self) -> int:
        return self.query.shape[1]

    @property
    def key_length(self) -> int:
        return self.key.shape[1]

    @property
    def groups(self) -> int:
        return self.query.shape[0] // self.key.shape[0]

    @functools.cached_property
    def expanded_key(self) -> torch.Tensor:
        """fp32 ``[H, L, D]``: keys repeated per query head (built once per layer, not per chunk)."""
        return self.key.repeat_interleave(self.groups, dim=0) if self.groups > 1 else self.key

    @functools.cached_property
    def expanded_value(self) -> torch.Tensor:
        """fp32 ``[H, L, D]``: values repeated per query head."""
        return self.value.repeat_interleave(self.groups, dim=0) if self.groups > 1 else self.value

    @functools.cached_property
    def expanded_key_t(self) -> torch.Tensor:
        """fp32 ``[H, D, L]`` contiguous: :attr:`expanded_key` transposed, for :meth:`head_dot_into`."""
        return expand_transpose_keys(self.key, self.groups)

    @functools.cached_property
    def _scratch(self) -> Dict[str, torch.Tensor]:
        return {}

    def scratch(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A contiguous ``shape`` view of this layer's buffer ``name`` (contents undefined).

        One allocation per layer and name, sized for the largest chunk (``query_chunk`` rows
        against all ``L`` keys) on first use, instead of one per chunk: at 8k a ``[H, Tc, lc]``
        block is up to 75 MB, and every fresh block of that size is page-faulted in again
        (the CLI makes glibc return such blocks to the OS, see ``cli.limit_heap_fragmentation``).
        A later call with the same name overwrites the earlier view's contents.
        """
        numel = math.prod(shape)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
            capacity = max(numel, lead * min(self.query_chunk, self.num_queries) * self.key_length)
            buf = self._scratch[name] = torch.empty(capacity, dtype=dtype, device=self.query.device)
        return buf[:numel].view(shape)

    def chunks(self) -> Iterator[Tuple[int, int, int]]:
        """``(c0, c1, lc)``: query rows ``[c0, c1)`` and the ``lc`` keys they can reach."""
        T, L = self.num_queries, self.key_length
        for c0 in range(0, T, self.query_chunk):
            c1 = min(T, c0 + self.query_chunk)
            yield c0, c1, L - T + c1

    def head_dot(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``q . k`` per head: query ``[H, Tc, D']`` x key ``[Hkv, lc, D']`` -> ``[H, Tc, lc]``."""
        H, Tc, Dq = query.shape
        Hkv = key.shape[0]
        q = query.reshape(Hkv, H // Hkv, Tc, Dq)  # [Hkv, g, Tc, D']
        s = torch.matmul(q, key.unsqueeze(1).transpose(-1, -2))  # [Hkv, g, Tc, lc]
        return s.reshape(H, Tc, key.shape[1])

    def query_logits(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Scaled (and soft-capped) logits, unmasked: query ``[H, R, D]`` x key ``[Hkv, lc, D]`` -> ``[H, R, lc]``."""
        s = self.head_dot(query, key) * self.scaling
        return s if self.softcap is None else soft_cap(s, self.softcap)

    def query_logits_into(self, query: torch.Tensor, lc: int, name: str) -> torch.Tensor:
        """:meth:`query_logits` against the first ``lc`` keys, in the scratch buffer ``name``.

        :meth:`head_dot_into` on :attr:`expanded_key_t`, then the same scale and soft-cap
        ops in place: fp32 ``[H, R, lc]``, bit for bit :meth:`query_logits`.
        """
        s = self.head_dot_into(query, self.expanded_key_t, lc, name).mul_(self.scaling)
        return s if self.softcap is None else soft_cap_(s, self.softcap)

    def head_dot_into(self, query: torch.Tensor, key_t: torch.Tensor, lc: int, name: str) -> torch.Tensor:
        """:meth:`head_dot` into the scratch buffer ``name``: fp32 ``[H, Tc, lc]``, bit for bit equal.

        query ``[H, Tc, D']``; key_t ``[H, D', L]`` contiguous, keys already repeated per
        query head (:func:`expand_transpose_keys`). One ``bmm`` over the ``lc`` first key
        columns, without the per-chunk copy of the broadcast keys that :meth:`head_dot`'s
        ``matmul`` makes. Same GEMM per head, so the same bits (pinned by the tests).
        """
        H, Tc, _ = query.shape
        out = self.scratch(name, (H, Tc, lc))
        return torch.bmm(query, key_t[:, :, :lc], out=out)

    def causal_fill_(self, scores: torch.Tensor, c0: int, c1: int, lc: int, value: float) -> torch.Tensor:
        """Set ``scores[..., t, s] = value`` where key ``s`` lies past row ``t``'s causal length; in place.

        scores : ``[..., Tc, lc]`` of query rows ``[c0, c1)``. Row ``t`` of the chunk sees
        ``lc - Tc + t + 1`` keys, so only the last ``Tc`` columns can lie past a row's
        length, and there the pattern is the strict upper triangle of ``[Tc, Tc]``, the
        same for every chunk of ``Tc`` rows: one cached mask, one op per chunk.
        """
        Tc = c1 - c0
        scores[..., lc - Tc:].masked_fill_(self._strict_upper(Tc), value)
        return scores

    def _strict_upper(self, size: int) -> torch.Tensor:
        """bool ``[size, size]``, ``True`` above the diagonal (cached per size)."""
        key = f"strict_upper_{size}"
        if key not in self._scratch:
            self._scratch[key] = torch.ones(size, size, dtype=torch.bool, device=self.query.device).triu_(1)
        return self._scratch[key]

    def dense_probabilities_into(self, c0: int, c1: int, lc: int, name: str) -> torch.Tensor:
        """:meth:`dense_probabilities` bit for bit, in the scratch buffer ``name``: fp32 ``[H, Tc, lc]``.

        The same ops (logits, scale, soft-cap, ``-inf`` outside the allowed keys, softmax),
        each in place, with the causal mask applied to the ``[Tc, Tc]`` corner only when the
        model built no mask of its own.
        """
        s = self.query_logits_into(self.query[:, c0:c1], lc, name)
        if self.allowed is None:
            return softmax_(self.causal_fill_(s, c0, c1, lc, float("-inf")))
        return masked_softmax(s, self.allowed_chunk(c0, c1, lc), in_place=True)

    def logits(self, c0: int, c1: int, lc: int) -> torch.Tensor:
        """fp32 ``[H, Tc, lc]`` scaled (and soft-capped) attention logits, unmasked."""
        return self.query_logits(self.query[:, c0:c1], self.key[:, :lc])

    def allowed_chunk(self, c0: int, c1: int, lc: int) -> torch.Tensor:
        """bool ``[Tc, lc]``: causal, and the model's own mask when it built one."""
        col = torch.arange(lc, device=self.query.device).unsqueeze(0)
        causal = col < self.lengths[c0:c1].unsqueeze(1)
        if self.allowed is None:
            return causal
        return causal & self.allowed[c0:c1, :lc]

    def weighted_values(self, probs: torch.Tensor, value: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[H, Tc, lc]`` probabilities x values -> fp32 ``[H, Tc, D]``.

        value : ``[Hkv, lc, D]`` values the columns stand for; None = the first ``lc`` values.
        """
        H, Tc, lc = probs.shape
        v = self.value[:, :lc] if value is None else value
        Hkv = v.shape[0]
        p = probs.reshape(Hkv, H // Hkv, Tc, lc)
        out = torch.matmul(p, v.unsqueeze(1))  # [Hkv, g, Tc, D]
        return out.reshape(H, Tc, -1)

    def masked_attention(self, c0: int, c1: int, lc: int, mask: torch.Tensor,
                         rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of query rows ``[c0, c1)`` over keys ``[0, lc)`` where ``mask`` allows: fp32 ``[H, Tq, D]``.

        mask : bool ``[Tq, lc]``, at least one ``True`` per row; ``rows`` optionally picks
        a subset of the chunk's queries (int64 ``[Tq]`` offsets from ``c0``).
        Fast path: torch SDPA (fused on CPU, ~3x the eager speed at 8k keys); with
        soft-capping, which SDPA lacks, an eager masked softmax.
        """
        q = self.query[:, c0:c1] if rows is None else self.query[:, c0:c1][:, rows]  # [H, Tq, D]
        if self.softcap is None:
            k = self.expanded_key[:, :lc]  # [H, lc, D]
            v = self.expanded_value[:, :lc]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask[None, None], scale=self.scaling)
            return out[0]
        return self.weighted_values(masked_softmax(self.query_logits(q, self.key[:, :lc]), mask))

    def column_attention(self, c0: int, c1: int, cols: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of query rows ``[c0, c1)`` over the key columns ``cols`` only: fp32 ``[H, Tc, D]``.

        cols : int64 ``[U]`` key positions (the union of the chunk's selected keys);
        mask : bool ``[Tc, U]`` (which of them each row may see, at least one per row).
        The same softmax as :meth:`masked_attention` over a mask that is ``False`` outside
        ``cols`` (masked keys weigh exactly 0 there), at ``U / lc`` of its cost.
        """
        q = self.query[:, c0:c1]
        if self.softcap is None:
            k = self.expanded_key.index_select(1, cols)  # [H, U, D]
            v = self.expanded_value.index_select(1, cols)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask[None, None], scale=self.scaling)
            return out[0]
        p = masked_softmax(self.query_logits(q, self.key.index_select(1, cols)), mask)  # [H, Tc, U]
        return self.weighted_values(p, self.value.index_select(1, cols))

    def dense_probabilities(self, c0: int, c1: int, lc: int) -> torch.Tensor:
        """fp32 ``[H, Tc, lc]`` dense softmax probabilities (zero outside the allowed mask)."""
        return masked_softmax(self.logits(c0, c1, lc), self.allowed_chunk(c0, c1, lc))


def softmax_(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in place: ``torch.softmax``'s kernel, writing into ``scores``."""
    return torch.ops.aten._softmax.out(scores, -1, False, out=scores)


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """Softmax over the keys ``allowed`` permits: ``-inf`` elsewhere, so they weigh exactly 0.

    scores : ``[..., R, L]`` logits; allowed : bool ``[R, L]`` (the same for every leading
    index, e.g. every head), at least one ``True`` per row. ``in_place``: mask and softmax
    in ``scores``' own storage (:func:`softmax_`); otherwise ``scores`` is left as it was.
    Either way the same values, bit for bit.
    """
    if in_place:
        return softmax_(scores.masked_fill_(~allowed, float("-inf")))
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def expand_transpose_keys(key: torch.Tensor, groups: int) -> torch.Tensor:
    """``[Hkv, L, D]`` keys -> contiguous ``[Hkv * groups, D, L]`` (repeated per query head, transposed)."""
    k = key.repeat_interleave(groups, dim=0) if groups > 1 else key
    return k.transpose(1, 2).contiguous()
