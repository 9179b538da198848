"""What every selector builds on: the selector contract, its settings, top-W rows from
chunked scores, the trained indexer that the learned, policy and failure-mode selectors
start from, and the untrained proxies kept as named null models.

A selector is called as ``selector(layer, width, stats)`` with a
:class:`~benchmark.quality.layer.LayerInputs`, the budget ``W`` and a dict it may add
counters to, and returns int32 ``[T, W]`` rows in the engine's convention
(:mod:`benchmark.quality.index_rows`): rows of causal length ``<= W`` are
``0..len-1`` then ``-1`` (dense), longer rows hold ``W`` unique causal positions. Like
the engine, one index set per query token is shared by all heads.

Dependency direction: this module imports only the leaf modules (``errors``,
``index_rows``, ``layer``) and the engine's ``indexer_torch_ops``;
:mod:`~benchmark.quality.policy_selectors` and :mod:`~benchmark.quality.failure_modes`
import it, and :mod:`~benchmark.quality.selectors` (the registry) imports all three.

fp8 emulation and the engine's quantization. The engine quantizes the indexer's q and
k to float8-e4m3 per token, in groups of 128 channels, each group with scale
``amax / 448`` (448: the largest finite e4m3 value); ``indexer_torch_ops.
fp8_e4m3_round_trip`` emulates exactly that. The proxy here applies the same function
with one group per vector (``group_size`` = the vector's length, i.e. the head dim, or
``lowrank_dims`` for the weak proxy): identical to the engine's grouping whenever the
head dim is at most 128 (SmolLM2: 64), and one scale per head vector instead of one per
128 channels for wider heads, as the harness has always measured it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from benchmark.quality.errors import UsageError
from benchmark.quality.index_rows import dense_rows, engine_topk
from benchmark.quality.layer import LayerInputs, expand_transpose_keys
from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip, weighted_relu_logits

Selector = Callable[[LayerInputs, int, Dict[str, float]], torch.Tensor]

# ``chunk_scores(c0, c1, lc)``: float ``[Tc, lc]`` scores of query rows ``[c0, c1)`` over
# keys ``[0, lc)`` (see :meth:`LayerInputs.chunks`).
ChunkScores = Callable[[int, int, int], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class SelectorSettings:
    """Knobs of the built-in selectors.

    seed : random selector, and the projection of the weak proxy
    sink_tokens : locality keeps the first ``sink_tokens`` positions; 4, the sink count
        the harness uses throughout (locality, ``nosink``, the sink-retention metric;
        docs/quality.md)
    lowrank_dims : dimensions the weak proxy projects each head's q and k to; 4 of 64
        makes it a deliberately poor indexer
    fp8 : emulate the fp8-e4m3 indexer inputs (DSA runs its indexer in fp8; see the
        module doc for how the emulation maps to the engine's quantization)
    trained : layer -> the trained indexer's ``IndexerProjections`` (a loaded checkpoint,
        ``rtp_llm.models_py.modules.hybrid.indexer_checkpoint``), what ``learned`` and
        everything built on it rank with; None: those selectors refuse to run
    trained_source : where ``trained`` came from (the checkpoint path), for the run's JSON
    """

    seed: int = 0
    sink_tokens: int = 4
    lowrank_dims: int = 4
    fp8: bool = True
    trained: Optional[Mapping[int, object]] = dataclasses.field(default=None, compare=False, repr=False)
    trained_source: str = ""

    def __post_init__(self) -> None:
        for name in ("sink_tokens", "lowrank_dims"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')}: expected an int >= 1, got {value!r}")


def layer_generator(seed: int, layer_idx: int) -> torch.Generator:
    """CPU generator of one stream per (seed, layer): different layers draw different sets."""
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + layer_idx)


def top_rows_by_chunk(layer: LayerInputs, width: int, chunk_scores: ChunkScores) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-W rows of ``chunk_scores(c0, c1, lc)`` (``[Tc, lc]``) over query chunks, and their scores.

    Returns int32 rows ``[T, W]`` and fp32 scores ``[T, W]`` (``-inf`` at ``-1`` padding).
    Chunks whose rows are all short (dense by convention) are not scored; their entries
    get score 0. ``chunk_scores`` may return a scratch buffer: it is overwritten in place
    (``-inf`` past each row's causal length) before the next call.

    The same rows and scores, bit for bit, as :func:`~benchmark.quality.index_rows.rows_from_scores`
    on each chunk (tests: ``benchmark/test/test_quality_fast_path.py``): the same
    :func:`~benchmark.quality.index_rows.engine_topk` on the same ``[Tc, lc]`` values, so ties
    resolve the same way (to the lower position); only the masking
    touches the ``[Tc, Tc]`` corner instead of a copy of the block, and the outputs are
    written in place instead of concatenated.
    """
    T, L, device = layer.num_queries, layer.key_length, layer.lengths.device
    rows = torch.empty(T, width, dtype=torch.int32, device=device)
    scores = torch.empty(T, width, dtype=torch.float32, device=device)
    for c0, c1, lc in layer.chunks():
        lengths = layer.lengths[c0:c1]
        if lc <= width:
            r = rows[c0:c1] = dense_rows(lengths, width)
            scores[c0:c1] = torch.zeros(r.shape, device=device).masked_fill_(r < 0, float("-inf"))
            continue
        s = layer.causal_fill_(chunk_scores(c0, c1, lc).to(torch.float32), c0, c1, lc, float("-inf"))  # [Tc, lc]
        top = engine_topk(s, width)  # [Tc, W] int64, ties to the lower position (the engine's rule)
        all_long = L - T + c0 + 1 > width  # the chunk's shortest row is longer than W (host arithmetic)
        if not all_long:  # the chunk holding the last short rows
            top = torch.where((lengths > width).unsqueeze(1), top, dense_rows(lengths, width).to(torch.int64))
        rows[c0:c1] = top
        # Scores of the entries: the unmasked values (every entry is causal); -inf at -1.
        sc = torch.gather(s, 1, top.clamp(min=0) if not all_long else top, out=scores[c0:c1])
        if not all_long:
            sc.masked_fill_(top < 0, float("-inf"))
    return rows, scores


# ------------------------------------------------------------------------- proxy indexer


def fp8_per_vector_round_trip(x: torch.Tensor) -> torch.Tensor:
    """The engine's fp8-e4m3 emulation with one scale per vector (last dim).

    ``indexer_torch_ops.fp8_e4m3_round_trip`` with ``group_size = x.shape[-1]``: each
    vector scaled so its absolute max maps to 448, cast to ``float8_e4m3fn`` and back
    (3 mantissa bits), rescaled. fp32 in, fp32 out (the harness's q and k are fp32).
    """
    return fp8_e4m3_round_trip(x, group_size=x.shape[-1])


def indexer_inputs(layer: LayerInputs, settings: SelectorSettings, lowrank: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q ``[H, T, D']``, k ``[Hkv, L, D']``) as the proxy indexer sees them."""
    q, k = layer.query, layer.key
    if lowrank:
        D = q.shape[-1]
        gen = layer_generator(settings.seed, layer.layer_idx)
        # Gaussian projection with E[P P^T] = I, so (qP).(kP) estimates q.k, noisily.
        proj = torch.randn(D, settings.lowrank_dims, generator=gen) / settings.lowrank_dims**0.5
        proj = proj.to(q.device)
        q, k = q @ proj, k @ proj  # [H, T, r], [Hkv, L, r]
    if settings.fp8:
        q, k = fp8_per_vector_round_trip(q), fp8_per_vector_round_trip(k)
    return q, k


def proxy_index_scores(layer: LayerInputs, q: torch.Tensor, k: torch.Tensor) -> ChunkScores:
    """``chunk_scores`` of the proxy: ``sum_h relu(q_h[t] . k_h[s]) / H`` (fp32 ``[Tc, lc]``).

    q ``[H, T, D']``, k ``[Hkv, L, D']``. The returned block is a scratch buffer of
    ``layer`` (valid until the next call). Bit for bit :func:`proxy_index_scores_reference`:
    the same product per head (one ``bmm`` on keys repeated and transposed once per layer,
    :meth:`LayerInputs.head_dot_into`), the same ``sum`` over heads, in place.
    """
    H = q.shape[0]
    key_t = expand_transpose_keys(k, H // k.shape[0])  # [H, D', L], once per layer

    def chunk_scores(c0: int, c1: int, lc: int) -> torch.Tensor:
        s = layer.head_dot_into(q[:, c0:c1], key_t, lc, "proxy_heads").clamp_(min=0)  # [H, Tc, lc]
        out = layer.scratch("proxy_scores", (c1 - c0, lc))
        return torch.sum(s, dim=0, out=out).div_(H)  # [Tc, lc]

    return chunk_scores


def proxy_index_scores_reference(layer: LayerInputs, q: torch.Tensor, k: torch.Tensor) -> ChunkScores:
    """The plain form of :func:`proxy_index_scores` (tests and benchmarks only): fresh tensors per chunk."""
    H = q.shape[0]

    def chunk_scores(c0: int, c1: int, lc: int) -> torch.Tensor:
        return layer.head_dot(q[:, c0:c1], k[:, :lc]).clamp(min=0).sum(dim=0) / H  # [Tc, lc]

    return chunk_scores


def trained_indexer_inputs(layer: LayerInputs, settings: SelectorSettings) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trained indexer's ``(q [T, Hi, Di], weights [T, Hi], keys [L, Di])`` at ``layer``, fp32.

    From the layer's attention input (``layer.hidden``) through this layer's projections
    (``settings.trained[layer_idx]``): queries and weights of the ``T`` query positions,
    keys of every position, q and k fp8-e4m3 round-tripped in 128-value groups (the
    engine's quantization) when ``settings.fp8``.
    """
    if settings.trained is None:
        raise UsageError("learned: no trained indexer for this model: pass --indexer-checkpoint FILE "
                         "(train one with benchmark/topology_kv_indexer_train.py), or run the untrained null "
                         "model 'proxy'")
    module = settings.trained.get(layer.layer_idx)
    if module is None:
        raise UsageError(f"learned: the trained indexer ({settings.trained_source or 'given'}) has no layer "
                         f"{layer.layer_idx} (it has {sorted(settings.trained)})")
    if layer.hidden is None:
        raise ValueError(f"learned: layer {layer.layer_idx} came without its attention input (LayerInputs.hidden)")
    L, T = layer.key_length, layer.num_queries
    positions = layer.key_positions  # [L]
    with torch.no_grad():
        keys = module.keys(layer.hidden, positions)  # [L, Di]
        x_q = layer.hidden[L - T:]  # [T, C]
        q = module.queries(x_q, positions[L - T:])  # [T, Hi, Di]
        weights = module.weights(x_q)  # [T, Hi]
    if settings.fp8:
        q, keys = fp8_e4m3_round_trip(q), fp8_e4m3_round_trip(keys)
    return q, weights, keys


def trained_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> ChunkScores:
    """``chunk_scores`` of the trained indexer: ``sum_h w[t, h] relu(q[t, h] . k[s])``, fp32 ``[Tc, lc]``."""

    def chunk_scores(c0: int, c1: int, lc: int) -> torch.Tensor:
        return weighted_relu_logits(q[c0:c1], weights[c0:c1], keys[:lc])

    return chunk_scores


def learned_rows_and_scores(layer: LayerInputs, width: int, settings: SelectorSettings) -> Tuple[torch.Tensor, torch.Tensor]:
    """The trained indexer's top-W rows and their scores (DSA's form; the ``learned`` baseline).

    Scores :func:`trained_index_scores` of :func:`trained_indexer_inputs`; rows by the
    engine's tie rule. Cost per key: ``Hi * Di`` multiply-adds (the checkpoint's shape).

    Returns
    -------
    rows : int32 ``[T, W]``, engine convention (long rows by descending score)
    scores : fp32 ``[T, W]``, the index score of each entry; ``-inf`` at ``-1`` padding
    """
    q, weights, keys = trained_indexer_inputs(layer, settings)
    return top_rows_by_chunk(layer, width, trained_index_scores(q, weights, keys))


def proxy_rows_and_scores(
    layer: LayerInputs, width: int, settings: SelectorSettings, lowrank: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The untrained proxy's top-W rows and their scores (the null models ``proxy`` and ``proxy-lowrank``).

    **A proxy, not a trained indexer.** On raw post-RoPE q and k, ``relu(q . k)`` is 0 for
    many keys (a key-independent negative offset that softmax ignores and relu does not);
    where a row has fewer than ``W`` positive scores, the rest is decided by the tie rule
    (the engine's: lower position first), which keeps the oldest tokens and drops the
    newest. It keeps DSA's lightning-indexer functional form,
    ``I[t, s] = sum_h w_h * relu(q_h[t] . k_h[s])``, but feeds it the model's own post-RoPE
    attention q/k (fp8-e4m3 round trip per vector) with uniform weights ``w_h = 1 / H``,
    the cost of the harness's first baseline. With ``lowrank=True`` q and k
    are first projected to ``settings.lowrank_dims`` random dimensions per head: a
    deliberately weak indexer. Cost: one ``[H, Tc, lc]`` product per query chunk.

    Returns
    -------
    rows : int32 ``[T, W]``, engine convention (long rows by descending score)
    scores : fp32 ``[T, W]``, the index score of each entry; ``-inf`` at ``-1`` padding
    """
    q, k = indexer_inputs(layer, settings, lowrank)
    return top_rows_by_chunk(layer, width, proxy_index_scores(layer, q, k))


def pca_proxy_rows_and_scores(layer: LayerInputs, width: int, settings: SelectorSettings) -> Tuple[torch.Tensor, torch.Tensor]:
    """The end-to-end benchmark's untrained proxy (null model ``proxy-pca``): rows and scores.

    ``benchmark.quality.proxy_indexers.ProxyIndexer`` at its ``dsa-ratio`` shape (SmolLM2: one head of
    64 dims): one key head, the KV heads' keys concatenated and projected on their top
    principal directions (fitted on this layer's keys), queries the mean over their query
    groups projected the same way, fp8-e4m3 round-tripped; ``relu`` scores with uniform
    weights. Most of its scores are exactly 0, so its rows are mostly decided by ties.
    """
    from benchmark.quality.proxy_indexers import ProxyIndexer, resolve_indexer_shape

    H, T, D = layer.query.shape
    Hkv = layer.key.shape[0]
    shape = resolve_indexer_shape("dsa-ratio", None, None, H, Hkv, D)
    keys_tld = layer.key.transpose(0, 1)  # [L, Hkv, D]
    proxy = ProxyIndexer(shape, H, Hkv, D, keys_tld if shape.dim < Hkv * D else None)
    keys = proxy.keys(keys_tld)  # [L, Di]
    q = proxy.queries(layer.query.transpose(0, 1))  # [T, Hi, Di]
    weights = torch.full((T, shape.heads), 1.0 / shape.heads, device=q.device)
    return top_rows_by_chunk(layer, width, trained_index_scores(q, weights, keys))
