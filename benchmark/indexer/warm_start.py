"""A trained indexer's starting point taken from the layer's own attention (``--init attention``).

At the own-q.k proxy's cost (``--shape proxy-cost``: the attention's ``H`` query heads of
``D`` dims) and for a model with one KV head, DSA's indexer form can hold the attention's
own projections:

* ``wq_b`` rows of head ``h`` = the attention's ``q_proj`` rows of head ``h`` times its
  q-norm gain (where the model has a q norm), ``wk`` = ``k_proj`` times the k-norm gain
  placed in ``k_norm``'s weight (bias 0);
* RoPE: the model's rotate-half layout pairs dim ``i`` with ``i + D/2`` at frequency
  ``theta ** (-2 i / D)``; the indexer's pairs dim ``j`` with ``j + rope_dim/2`` at
  ``theta ** (-2 j / rope_dim)``. With ``rope_dim == D`` the layouts are the same; with a
  smaller ``rope_dim`` (dividing ``D``) the model's pairs ``i = j * D / rope_dim`` (the
  same frequencies) go to the indexer's rotary dims and every other pair to its unrotated
  dims, so those lose their rotation. The model's RoPE is taken to be plain (no
  frequency scaling) with the base the shape records (``rope_theta``), as Gemma 3's
  global layers' is;
* ``weights_proj``: the model normalises each head's query (RMSNorm), the indexer cannot
  (its per-head weight is linear in the layer input), so ``weights_proj`` is the least-
  squares fit, over the training windows' layer inputs, of ``scaling / rms(q_h)``: the
  score then approximates ``sum_h relu(logit_h)`` of the model's own logits.

So the start is close to the proxy (on Gemma 3 270M with ``rope_dim == D``, its recall
within 0.006 of the proxy's at 1/16, 1/8 and 1/4), and distillation goes on from there.
The differences left: ``k_norm`` is a LayerNorm (it subtracts the key's mean, RMSNorm
does not) and the fitted weights.
"""

from __future__ import annotations

from typing import Dict

import torch

from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjectionShape


def rope_permutation(head_dim: int, rope_dim: int) -> torch.Tensor:
    """int64 ``[head_dim]``: indexer dim ``n`` takes the model's (rotate-half layout) dim ``perm[n]``.

    The indexer's rotary pair ``(j, j + rope_dim/2)`` gets the model's pair ``(i, i + D/2)``
    of the same frequency, ``i = j * D / rope_dim``; the model's other pairs fill the
    unrotated dims in order (first halves, then second halves).
    """
    if head_dim % 2 or rope_dim < 2 or rope_dim % 2 or head_dim % rope_dim:
        raise ValueError(f"rope_dim: expected an even divisor of head_dim={head_dim} (>= 2), got {rope_dim}")
    half, step = head_dim // 2, head_dim // rope_dim
    rotary = list(range(0, half, step))
    others = [i for i in range(half) if i % step]
    perm = rotary + [i + half for i in rotary] + others + [i + half for i in others]
    return torch.tensor(perm, dtype=torch.int64)


def _norm_gain(norm, dim: int) -> torch.Tensor:
    """The per-dim gain of an RMSNorm-like module (its output on a vector of ones), or ones."""
    if norm is None:
        return torch.ones(dim)
    with torch.no_grad():
        return norm(torch.ones(1, dim, dtype=torch.float32)).reshape(dim).to(torch.float32)


def check_warm_start(attention, shape: IndexerProjectionShape) -> None:
    """ValueError unless ``attention``'s projections fit ``shape`` (its own heads x dims, one KV
    head, the same input width) and ``shape.rope_dim`` is 0 or an even divisor of the head dims."""
    H, D = shape.heads, shape.head_dim
    q_out, q_in = attention.q_proj.weight.shape
    k_out = attention.k_proj.weight.shape[0]
    if q_out != H * D or k_out != D:
        raise ValueError(
            f"needs the attention's own shape (--shape proxy-cost) and one KV head: indexer {H} x {D}, "
            f"attention q / k output dims {q_out} / {k_out} (expected {H * D} / {D})")
    if q_in != shape.hidden_size or shape.q_input_size != shape.hidden_size:
        raise ValueError(f"the attention reads {q_in} dims, the indexer {shape.hidden_size} (q input {shape.q_input_size})")
    if shape.rope_dim:
        rope_permutation(D, shape.rope_dim)


def attention_warm_start(attention, shape: IndexerProjectionShape, hidden: torch.Tensor) -> Dict[str, torch.Tensor]:
    """State dict of :class:`IndexerProjections` (``shape``) started from ``attention``'s own q/k.

    attention : the layer's attention module (``q_proj``, ``k_proj``, optional ``q_norm`` /
        ``k_norm``, ``scaling``), a model with one KV head
    hidden : fp32 ``[N, C]`` layer inputs to fit ``weights_proj`` on (the training windows')
    """
    check_warm_start(attention, shape)
    wq = attention.q_proj.weight.detach().to(torch.float32)  # [H * D, C]
    wk = attention.k_proj.weight.detach().to(torch.float32)  # [D, C]
    H, D = shape.heads, shape.head_dim
    if hidden.dim() != 2 or hidden.shape[1] != shape.hidden_size or hidden.shape[0] < shape.hidden_size:
        raise ValueError(f"hidden: expected [N >= {shape.hidden_size}, {shape.hidden_size}], got {list(hidden.shape)}")
    perm = rope_permutation(D, shape.rope_dim) if shape.rope_dim else torch.arange(D)
    gq = _norm_gain(getattr(attention, "q_norm", None), D)
    gk = _norm_gain(getattr(attention, "k_norm", None), D)
    q_rows = (wq.view(H, D, -1) * gq.view(1, D, 1))[:, perm, :].reshape(H * D, -1)
    x = hidden.to(torch.float32)
    q = (x @ wq.T).view(-1, H, D)
    rms = q.pow(2).mean(dim=-1).add(1e-6).sqrt()  # [N, H]
    target = float(attention.scaling) / rms / shape.weight_scale
    fit = torch.linalg.lstsq(x.to(torch.float64), target.to(torch.float64)).solution  # [C, H]
    return {
        "wq_b.weight": q_rows.contiguous(),
        "wk.weight": wk[perm].contiguous(),
        "k_norm.weight": gk[perm].contiguous(),
        "k_norm.bias": torch.zeros(D),
        "weights_proj.weight": fit.T.to(torch.float32).contiguous(),
    }
