"""What training and evaluation read from a dense forward: per layer, the attention's input
and the dense attention distribution of sampled query rows.

One dense forward per text window through the quality harness's attention hook
(:mod:`benchmark.quality.sparse_attention`): a capture selector sees each full-attention
layer's :class:`~benchmark.quality.layer.LayerInputs` (post-RoPE q/k/v and the attention's
input ``hidden``), records a :class:`LayerSample` and returns no rows, so the layer runs
the model's own dense attention (SDPA), not the harness's masked path with a ``[T, L]``
row matrix per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import torch

from benchmark.quality.layer import LayerInputs, masked_softmax
from benchmark.quality.model import LoadedModel
from benchmark.quality.sparse_attention import PLAN_KWARG, SparsePlan
from benchmark.quality.text import TextWindow


@dataclasses.dataclass
class LayerSample:
    """One text window at one layer.

    hidden : fp32 ``[L, C]`` the attention's input at every position
    rows : int64 ``[R]`` sampled query positions (ascending); row ``r`` sees keys
        ``0 .. rows[r]``
    target : fp32 ``[R, L]`` dense attention probabilities of those rows averaged over the
        heads (DSA's "summed over heads, L1-normalised"); 0 past each row's causal length
    query : fp32 ``[H, R, D]`` the rows' post-RoPE attention queries, or None (kept for the
        proxies' evaluation only)
    key : fp32 ``[Hkv, L, D]`` post-RoPE attention keys, or None (likewise)
    """

    hidden: torch.Tensor
    rows: torch.Tensor
    target: torch.Tensor
    query: Optional[torch.Tensor] = None
    key: Optional[torch.Tensor] = None

    @property
    def lengths(self) -> torch.Tensor:
        """int64 ``[R]`` causal length of each sampled row."""
        return self.rows + 1


def sample_rows(length: int, count: int, first: int, seed: int) -> torch.Tensor:
    """``min(count, length - first)`` distinct positions of ``[first, length)``, ascending, seeded."""
    if not 0 <= first < length:
        raise ValueError(f"first: expected 0 <= first < length={length}, got {first}")
    gen = torch.Generator().manual_seed(seed)
    span = length - first
    pick = torch.randperm(span, generator=gen)[: min(count, span)]
    return (pick + first).sort().values


def head_mean_probabilities(layer: LayerInputs, rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``[R, L]``: dense attention of query positions ``rows`` averaged over heads.

    The layer's own logits (scale, soft-cap) and mask (causal, plus the model's own when
    it built one), the same maths as the harness's recall metric.
    """
    L, T = layer.key_length, layer.num_queries
    q_idx = rows - (L - T)  # query index of each position
    logits = layer.query_logits(layer.query.index_select(1, q_idx), layer.key)  # [H, R, L]
    allowed = torch.arange(L).unsqueeze(0) < (rows + 1).unsqueeze(1)  # [R, L]
    if layer.allowed is not None:
        allowed &= layer.allowed.index_select(0, q_idx)
    return masked_softmax(logits, allowed).mean(dim=0)


def capture_window(lm: LoadedModel, window: TextWindow, rows: torch.Tensor, layers: Sequence[int],
                   keep_attention_qk: bool = False) -> Dict[int, LayerSample]:
    """One dense forward of ``window``: a :class:`LayerSample` per layer of ``layers``."""
    samples: Dict[int, LayerSample] = {}
    T = len(window.token_ids)

    def capture(layer: LayerInputs, width: int, stats) -> torch.Tensor:
        if layer.hidden is None:
            raise RuntimeError("capture: the forward did not hand the attention input to the plan "
                               "(install_hidden_capture(model) missing)")
        L = layer.key_length
        q_idx = rows - (L - layer.num_queries)
        samples[layer.layer_idx] = LayerSample(
            hidden=layer.hidden.detach().clone(),
            rows=rows.clone(),
            target=head_mean_probabilities(layer, rows),
            query=layer.query.index_select(1, q_idx).clone() if keep_attention_qk else None,
            key=layer.key.clone() if keep_attention_qk else None,
        )
        return None  # observe only: the model's own attention

    plan = SparsePlan(capture, T, frozenset(layers), check_rows=False)
    ids = torch.tensor([window.token_ids], dtype=torch.int64)
    # no_grad, not inference_mode: the captured tensors feed autograd in training.
    with torch.no_grad():
        lm.model.base_model(input_ids=ids, use_cache=False, **{PLAN_KWARG: plan})
    missing = sorted(set(layers) - set(samples))
    if missing:
        raise RuntimeError(f"capture: layers {missing} ran no full attention in the forward")
    return samples
