"""Prefill once, lay the batch out for every variant, decode the variants interleaved.

Decode modes: one row per request per step (``next_n = 0``): greedy, every variant
teacher-forced on dense's tokens so that each step's next-token distributions compare on
the same context (a variant's own argmax is its token; the first step where it differs
from dense's is where free-running greedy would diverge); or ``next_n + 1`` rows per
request per step (speculative verification: ``IndexerAttentionInputs(is_target_verify=True,
decode_cu_seqlens_device=...)``), the rows verifying the text's own continuation (an
oracle drafter), every variant on the same rows. Variants decode interleaved, one step of
each in turn (dense first, the others in an order rotated per step), so a shared, noisy
machine slows them alike and no variant's position in the round biases its times.

Everything runs on the model's device (the runner moves the model to ``--device``): the
prefill's buffers, the layout's pools and tables, each step's inputs. The step's total is
read on the layout's phase clock (:mod:`benchmark.e2e.clock`), like its parts.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmark.e2e.attention import PARTS, PLAN_KWARG, StepPlan, dense_mask
from benchmark.e2e.clock import phase_clock
from benchmark.e2e.indexers import (
    E2EProfile,
    IndexerShape,
    ProxyIndexer,
    TrainedIndexerInputs,
    layer_indexer_shape,
    make_indexer,
    share_plan,
)
from benchmark.e2e.layout import LayerPools, Layout, VariantState, slots_of
from benchmark.e2e.memory import measure_step_memory, minor_page_faults, tensor_bytes
from benchmark.e2e.paired import balanced_orders
from benchmark.e2e.policy_counters import KEY as COUNTERS_KEY, step_totals
from benchmark.quality.model import full_attention_layers
from rtp_llm.models_py.modules.hybrid.indexer import TopologyStepCounters
from rtp_llm.models_py.modules.hybrid.indexer_params import (
    IndexerAttentionInputs,
    IndexerFmhaParams,
    IndexerKeyCache,
)
from rtp_llm.models_py.modules.hybrid.indexer_share import SharedTopkRows
from rtp_llm.models_py.modules.hybrid.topology_kv.drift import BlockDriftTracker

PREFILL_CHUNK = 1024  # prefill query tokens per forward (bounds the [H, T, L] logits)


def attention_layers(model) -> List[int]:
    return list(range(model.config.num_hidden_layers))


def sparse_layers(model) -> List[int]:
    """The layers whose decode attention is sparse: every layer, or the full-attention ones
    of a model with sliding-window layers (``config.layer_types``; those stay dense in
    their window, with no indexer)."""
    return list(full_attention_layers(model.config))


def kv_geometry(model):
    cfg = model.config
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return H, Hkv, D


@torch.no_grad()
def prefill_text(model, tokens: Sequence[int], want: Sequence[int], chunk: int = PREFILL_CHUNK):
    """Dense causal prefill of one text in chunks of ``chunk`` tokens, on the model's device.

    Returns ``(K, V, logits, seconds, X)``: per layer fp32 ``[C, Hkv, D]`` keys and values,
    ``logits [len(want), vocab]`` at positions ``want`` (the lm_head runs only there), and
    per layer the attention inputs ``[C, hidden]`` (what a trained indexer reads).
    """
    H, Hkv, D = kv_geometry(model)
    C = len(tokens)
    layers = attention_layers(model)
    dev = model.device
    plan = StepPlan("prefill", pools={},
                    prefill_k={i: torch.empty(C, Hkv, D, device=dev) for i in layers},
                    prefill_v={i: torch.empty(C, Hkv, D, device=dev) for i in layers},
                    prefill_h={i: torch.zeros(C, model.config.hidden_size, device=dev) for i in layers})
    ids = torch.tensor([list(tokens)], device=dev)
    want_t = torch.tensor(list(want), dtype=torch.int64, device=dev)
    logits = torch.empty(len(want), model.config.vocab_size, device=dev)
    clock = phase_clock(dev)
    t0 = clock()
    for start in range(0, C, chunk):
        end = min(C, start + chunk)
        plan.position = start
        sel = ((want_t >= start) & (want_t < end)).nonzero().flatten()
        keep = (want_t[sel] - start) if sel.numel() else 1
        out = model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end, device=dev).unsqueeze(0),
                    use_cache=False, logits_to_keep=keep, **{PLAN_KWARG: plan})
        if sel.numel():
            logits[sel] = out.logits[0].to(torch.float32)
    return plan.prefill_k, plan.prefill_v, logits, clock() - t0, plan.prefill_h


@dataclasses.dataclass
class BatchRun:
    """Everything one (context, batch, mode) decode needs, built from one prefill."""

    layout: Layout
    pools: Dict[int, LayerPools]
    states: Dict[str, VariantState]
    first_tokens: List[int]  # dense greedy token after each request's prefill
    continuation: Optional[List[int]]  # text tokens after position C (multi-row mode)
    text: List[int]
    shape: IndexerShape  # the run's indexer; a trained file may give some layers another (``layer_shapes``)
    width: int
    prefill_s: float
    shared_bytes: int
    sparse: Tuple[int, ...]  # the layers with an indexer; the others are sliding-window layers
    window: Optional[int]  # those layers' window (tokens), None when every layer is sparse
    layer_shapes: Dict[int, IndexerShape] = dataclasses.field(default_factory=dict)  # sparse layer -> its shape


@torch.no_grad()
def build_batch(model, text: Sequence[int], context_lens: Sequence[int], variants: Sequence[str], steps: int,
                next_n: int, width: int, shape: IndexerShape, prefilled=None, trained=None,
                profile: Optional[E2EProfile] = None, mode_settings=None) -> BatchRun:
    """Prefill ``text`` once and lay out ``B`` requests (prefixes of it) for every variant,
    on the model's device (the layout's ``device``).

    ``prefilled``: a :func:`prefill_text` result for ``text[:max(context_lens)]`` whose
    logits positions include every ``c_b - 1`` (reused across batch sizes; not modified).
    ``trained``: layer -> trained ``IndexerProjections`` (the learned variants rank with
    them), or None (the untrained proxy of ``shape``). ``profile``: the run's
    :class:`E2EProfile` (the ``profile`` variants need it), or None. ``mode_settings``:
    :func:`~benchmark.e2e.indexers.variant_policy`'s (``--policy-mode-settings``).
    """
    H, Hkv, D = kv_geometry(model)
    C = max(context_lens)
    T = next_n + 1
    dev = model.device
    layout = Layout(list(context_lens), len(variants), T, steps, device=dev)
    want = [c - 1 for c in context_lens]
    if prefilled is None:
        prefilled = (*prefill_text(model, text[:C], want), want)
    K, V, logits, prefill_s, X, positions = prefilled
    row_of = {p: i for i, p in enumerate(positions)}
    first = [int(logits[row_of[p]].argmax()) for p in want]
    pg = layout.page
    states = {name: VariantState(name, v, layout.block_table(v), {}, {}, list(context_lens))
              for v, name in enumerate(variants)}
    pools: Dict[int, LayerPools] = {}
    req = torch.cat([torch.full((c,), b, dtype=torch.int64, device=dev) for b, c in enumerate(context_lens)])
    pos = torch.cat([torch.arange(c, dtype=torch.int64, device=dev) for c in context_lens])
    in_shared = pos < torch.tensor(layout.shared_lens, dtype=torch.int64, device=dev)[req]
    own_req, own_pos = req[~in_shared], pos[~in_shared]  # each variant's private partial blocks
    sparse = sparse_layers(model)
    plans = {name: share_plan(name, sparse, None if profile is None else profile.profile) for name in variants}
    layer_shapes: Dict[int, IndexerShape] = {}
    for layer in attention_layers(model):
        dense_only = layer not in sparse  # a sliding-window layer: no indexer, no indexer keys
        if dense_only:
            proxy, index_keys = None, None
        elif trained is not None:
            proxy = TrainedIndexerInputs(trained[layer])
            index_keys = proxy.prefill_keys(X[layer], torch.arange(C, device=dev))  # [C, Di]
        else:
            proxy = ProxyIndexer(shape, H, Hkv, D, K[layer] if shape.dim < Hkv * D else None)
            index_keys = proxy.keys(K[layer])  # [C, Di]
        # A trained file may give this layer its own shape (the same cost per key): its keys, pool and drift.
        lshape = shape if trained is None or dense_only else layer_indexer_shape(trained[layer], H, D)
        if not dense_only:
            layer_shapes[layer] = lshape
        index_cache = None if dense_only else IndexerKeyCache(torch.zeros(layout.num_blocks, pg, lshape.dim, device=dev))
        pool = LayerPools(torch.zeros(layout.num_blocks, pg, Hkv, D, device=dev),
                          torch.zeros(layout.num_blocks, pg, Hkv, D, device=dev), index_cache, proxy, layout)
        table0 = states[variants[0]].block_table  # the shared blocks are the same in every table
        shared_slots = slots_of(table0, req[in_shared], pos[in_shared], pg)
        pool.flat(pool.k)[shared_slots] = K[layer][pos[in_shared]]
        pool.flat(pool.v)[shared_slots] = V[layer][pos[in_shared]]
        base: Optional[BlockDriftTracker] = None
        attention_trackers: Dict[int, BlockDriftTracker] = {}  # block size -> the prefill's attention-key blocks

        def attention_tracker(block_size: int) -> BlockDriftTracker:
            """A fresh copy of the prefill's attention-key tracker at ``block_size``."""
            if block_size not in attention_trackers:
                blocks = -(-layout.max_blocks * pg // block_size)
                tracker = BlockDriftTracker(layout.batch, blocks, Hkv * D, block_size=block_size, device=dev)
                tracker.update(K[layer][pos], pos, req)
                attention_trackers[block_size] = tracker
            return attention_trackers[block_size].clone()

        for name, st in states.items():
            slots = slots_of(st.block_table, own_req, own_pos, pg)
            pool.flat(pool.k)[slots] = K[layer][own_pos]
            pool.flat(pool.v)[slots] = V[layer][own_pos]
            st.indexers[layer] = None
            st.trackers[layer] = None
            if dense_only:
                continue
            indexer = make_indexer(name, lshape, width, layer, dev,
                                   projections=None if trained is None else trained[layer], share=plans[name],
                                   profile=profile, context=C, mode_settings=mode_settings)
            st.indexers[layer] = indexer
            if indexer is None:
                continue
            if indexer.shares_rows_of is not None:  # no indexer keys: its drift reads the attention keys
                if indexer.reads_drift or indexer.reads_queries:
                    st.trackers[layer] = attention_tracker(indexer.topology.policy.block_size)
                continue
            if base is None:  # the first indexer variant writes every key through write_keys, feeding drift
                base = BlockDriftTracker(layout.batch, layout.max_blocks, lshape.dim, block_size=pg, device=dev)
                indexer.write_keys(index_keys[pos], pool.index_cache, slots_of(st.block_table, req, pos, pg),
                                   drift_tracker=base, positions=pos, request_ids=req)
                st.trackers[layer] = base
            else:  # the others: their private blocks, and the prefill's drift state
                indexer.write_keys(index_keys[own_pos], pool.index_cache, slots)
                st.trackers[layer] = base.clone()
            if indexer.reads_queries:  # query_group_mass witnesses: the tracker reads the attention keys
                st.trackers[layer] = attention_tracker(indexer.topology.policy.block_size)
        pools[layer] = pool
    shared_bytes = sum(p.shared(t).numel() * t.element_size() for p in pools.values() for t in p.caches())
    shared_bytes += tensor_bytes(model.parameters())
    cont = list(text[C:]) if next_n > 0 else None
    window = getattr(model.config, "sliding_window", None) if len(sparse) < len(attention_layers(model)) else None
    return BatchRun(layout, pools, states, first, cont, list(text), shape, width, prefill_s, shared_bytes,
                    tuple(sparse), window, layer_shapes)


def step_inputs(run: BatchRun, st: VariantState, tokens: torch.Tensor) -> Tuple[StepPlan, torch.Tensor, torch.Tensor]:
    """The step's plan (the engine's per-step planning, once for all layers), ids, positions;
    on the layout's device, timed on its clock."""
    L = run.layout
    dev = L.device
    B, T = tokens.shape
    lens = torch.tensor(st.lens, dtype=torch.int64, device=dev)  # KV length before the step
    positions = lens.unsqueeze(1) + torch.arange(T, device=dev).unsqueeze(0)  # [B, T]
    request_ids = torch.arange(B, device=dev).repeat_interleave(T)
    flat_pos = positions.reshape(-1)
    slots = slots_of(st.block_table, request_ids, flat_pos, L.page)
    row_lengths = positions + 1
    shared_lens = torch.tensor(L.shared_lens, dtype=torch.int64, device=dev)
    empty = torch.empty(0, dtype=torch.int32, device=dev)
    fmha = IndexerFmhaParams(expanded_seq_lens=row_lengths.reshape(-1).to(torch.int32), topk_indices_offset=empty,
                             ks=empty, ke=empty, slot_mapping=slots)
    multi = T > 1
    attn = IndexerAttentionInputs(
        is_prefill=False, kv_cache_kernel_block_id_device=st.block_table,
        decode_cu_seqlens_device=torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev) if multi else None,
        is_target_verify=multi,
    )
    plan = StepPlan("decode", run.pools, st, slots=slots, positions=flat_pos, request_ids=request_ids,
                    row_lengths=row_lengths, shared_lens=shared_lens, fmha=fmha, attn=attn,
                    weights=torch.full((B * T, run.shape.heads), 1.0 / run.shape.heads, device=dev),
                    counters=TopologyStepCounters(), clock=L.clock,
                    shared_rows=SharedTopkRows() if any(
                        i is not None and i.shares_rows_of is not None for i in st.indexers.values()) else None)
    if any(i is None for i in st.indexers.values()):
        plan.dense_mask = dense_mask(shared_lens, row_lengths, L.shared_tokens, L.tail_tokens)
    return plan, tokens, positions


@torch.no_grad()
def decode_step(model, run: BatchRun, st: VariantState, tokens: torch.Tensor, measure_memory: bool = False):
    """One step of variant ``st`` on ``tokens [B, T]``: (log-probs ``[B, T, vocab]``, step record)."""
    plan, ids, positions = step_inputs(run, st, tokens)
    clock = plan.clock

    def forward():
        t0 = clock()
        out = model(input_ids=ids, position_ids=positions, use_cache=False, **{PLAN_KWARG: plan})
        logp = torch.log_softmax(out.logits.to(torch.float32), dim=-1)
        return logp, clock() - t0

    faults_before = minor_page_faults()
    if measure_memory:
        (logp, total), mem = measure_step_memory(forward, run.layout.device)
    else:
        (logp, total), mem = forward(), None
    faults_after = minor_page_faults()
    timers = dict(plan.timers)
    timers["rest"] = max(0.0, total - sum(timers[p] for p in PARTS if p != "rest"))
    st.lens = [n + tokens.shape[1] for n in st.lens]
    kv_after = sum(st.lens)
    scanning = [layer for layer, i in st.indexers.items() if i is not None and i.scan and i.shares_rows_of is None]
    n_scan = len(scanning)
    n_dense = sum(1 for layer in run.sparse if st.indexers[layer] is None)
    n_window = len(st.indexers) - len(run.sparse)
    window_read = 0 if n_window == 0 else sum(min(n, run.window) for n in st.lens) * n_window
    step = {"total_s": total, **{f"{p}_s": timers[p] for p in PARTS},
            "attended_tokens": _host_sum(plan.attended),  # over rows and layers
            "sparse_attended_tokens": _host_sum(plan.sparse_attended),
            # dense reads each request's KV once for its rows; a sliding-window layer its window
            "dense_read_tokens": kv_after * n_dense + window_read,
            "scanned_keys": kv_after * n_scan,  # the indexer reads each request's keys once
            # 1-byte fp8 keys of each scanning layer's own width
            "scanned_key_bytes": kv_after * sum(run.layer_shapes.get(layer, run.shape).dim for layer in scanning),
            "step_peak_bytes": mem,
            # host pages the step took fresh from the OS (None off Unix, and on the step whose
            # memory is measured: its malloc_trim hands pages back first)
            "host_minor_faults": (None if faults_before is None or measure_memory
                                  else faults_after - faults_before)}
    # After the step, as serving reads it: one host read, reported too when metrics are on.
    step[COUNTERS_KEY] = step_totals(plan.counters, timers["policy"] * 1e3)
    return logp, step


def _host_sum(counts: List[torch.Tensor]) -> int:
    """The sum of per-layer device counts, read to the host once (after the step)."""
    return int(torch.stack(counts).sum()) if counts else 0


def step_order(names: Sequence[str], step: int) -> List[str]:
    """The variants' order in step ``step``: dense first (the others compare with its
    distribution), the rest in row ``step`` (cyclically) of the balanced design of
    :func:`benchmark.e2e.paired.balanced_orders`, so that over a whole cycle each variant
    runs in every position and right after every other variant equally often."""
    rest = list(names[1:])
    if not rest:
        return [names[0]]
    rows = balanced_orders(len(rest))
    return [names[0]] + [rest[j] for j in rows[step % len(rows)]]


def decode_batch(model, run: BatchRun, steps: int, on_step=None, measure_memory_step: Optional[int] = 0,
                 first_timed: int = 0):
    """Decode every variant ``steps`` steps, interleaved: dense first in each step, the rest in
    :func:`step_order`, whose cycles start at step ``first_timed`` (the first step the
    timings keep), so that whole cycles of timed steps are balanced.

    One row per request (``continuation`` None): every variant is fed dense's greedy
    token (teacher forcing), so its next-token distribution compares with dense's on the
    same context. Multi-row: rows verify the text's continuation. Returns, per variant,
    ``{"steps": [...], "argmax": [[B*T] per step], "top1": [[B*T] bool per step],
    "kl": [[B*T] per step]}``.
    """
    L = run.layout
    B, T = L.batch, L.rows_per_step
    names = list(run.states)
    assert names[0] == "dense", "dense decodes first in every step"
    out = {n: {"steps": [], "argmax": [], "top1": [], "kl": []} for n in names}
    dev = L.device
    current = torch.tensor(run.first_tokens, device=dev).unsqueeze(1)  # [B, 1]
    text = torch.tensor(run.text, device=dev)
    for i in range(steps):
        if T == 1:
            tokens = current
        else:
            start = torch.tensor(run.states["dense"].lens, device=dev).unsqueeze(1)
            tokens = text[start + torch.arange(T, device=dev).unsqueeze(0)]  # [B, T] the continuation
        dense_logp = None
        for name in step_order(names, i - first_timed):
            st = run.states[name]
            logp, step = decode_step(model, run, st, tokens, measure_memory=(i == measure_memory_step))
            flat = logp.reshape(B * T, -1)
            am = flat.argmax(dim=-1)
            if name == "dense":
                dense_logp, dense_am = flat, am
            kl = (dense_logp.exp() * (dense_logp - flat)).sum(dim=-1).clamp(min=0.0)
            rec = out[name]
            rec["steps"].append(step)
            rec["argmax"].append(am.tolist())
            rec["top1"].append((am == dense_am).tolist())
            rec["kl"].append(kl.tolist())
        current = dense_am.view(B, T)[:, -1:].clone()
        if on_step is not None:
            on_step(i)
    return out
