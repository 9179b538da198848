"""One run: load the model, prefill per context, decode every (context, batch), one row per variant.

Per variant, context and batch (:func:`summarize`): step time (median, p90 over the steps
after warm-up) split into indexer (proxy q/k projections, ``write_keys``, the scan and
top-k), policy (the rest of ``_compute_topk``), attention (K/V write, gather, softmax) and
the rest of the model; tokens/s (rows per second); KV bytes read per step (modelled);
agreement with dense (top-1 agreement rate over every row and step, mean KL(dense ||
variant) of the next-token distribution); peak memory (see
:func:`benchmark.e2e.memory.measure_step_memory`); the host's minor page faults per timed
step (mean; :func:`benchmark.e2e.memory.minor_page_faults`).

``--device`` places the model, its trained indexer and every tensor of the run
(:class:`benchmark.e2e.layout.Layout`); on CUDA the timers synchronize at each phase
boundary (:mod:`benchmark.e2e.clock`) and the memory is the allocator's peak. The JSON's
``environment`` names the device.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmark.e2e.attention import ATTENTION_NAME, PARTS, register
from benchmark.e2e.decode import BatchRun, build_batch, decode_batch, kv_geometry, prefill_text, sparse_layers
from benchmark.e2e.indexers import (
    DSA_RATIO,
    E2EProfile,
    IndexerShape,
    resolve_indexer_shape,
    runs_profile_entries,
    share_plan,
)
from benchmark.e2e.layout import request_lengths
from benchmark.e2e.memory import memory_counter
from benchmark.e2e.paired import nearest_rank
from benchmark.e2e.policy_counters import KEY as COUNTERS_KEY, sum_totals
from benchmark.e2e.prompts import pool_prompts, prompt_offsets
from benchmark.e2e.report import iso_quality, paired_with_learned, targets


def kv_bytes_per_step(step: Dict[str, float], Hkv: int, D: int) -> int:
    """Modelled bytes read: fp32 K and V of every attended token (dense: once per request),
    1-byte fp8 indexer keys once per request (``scanned_key_bytes``: each scanning layer's
    key width)."""
    return int((step["sparse_attended_tokens"] + step["dense_read_tokens"]) * Hkv * D * 8 + step["scanned_key_bytes"])



def summarize(variant: str, run: BatchRun, rec: Dict[str, list], Hkv: int, D: int, warmup: int,
              own_bytes: int) -> Dict[str, object]:
    """One table row; timings over ``steps[warmup:]``, agreement over every step."""
    L = run.layout
    steps = rec["steps"][warmup:]
    totals = [s["total_s"] * 1e3 for s in steps]
    med = statistics.median(totals)
    rows_per_step = L.batch * L.rows_per_step
    top1 = [x for step in rec["top1"] for x in step]
    kls = [x for step in rec["kl"] for x in step]
    peaks = [s["step_peak_bytes"] for s in rec["steps"] if s["step_peak_bytes"] is not None]
    faults = [s["host_minor_faults"] for s in steps if s.get("host_minor_faults") is not None]
    step_peak = max(peaks) if peaks else None
    B, T = L.batch, L.rows_per_step
    first_div = []
    for b in range(B):
        idx = next((i for i, step in enumerate(rec["top1"]) if not all(step[b * T : (b + 1) * T])), None)
        first_div.append(idx)
    row = {
        "variant": variant,
        "context": max(L.context_lens),
        "context_lens": list(L.context_lens),
        "batch": B,
        "rows_per_request": T,
        "budget": run.width,
        "indexer_preset": run.shape.preset,
        "indexer_heads": run.shape.heads,
        "indexer_dim": run.shape.dim,
        # layers whose trained indexer has another shape (the same cost per key): layer -> "HxD"
        "indexer_layer_shapes": {str(x): f"{s.heads}x{s.dim}" for x, s in sorted(run.layer_shapes.items())
                                 if (s.heads, s.dim) != (run.shape.heads, run.shape.dim)},
        "steps": len(steps),
        "step_ms_median": med,
        "step_ms": totals,  # per timed step, in decode order (steps of every variant interleave)
        "step_ms_p90": nearest_rank(totals, 0.9),
        "tokens_per_s": rows_per_step * 1e3 / med,
        "kv_bytes_per_step": statistics.median(kv_bytes_per_step(s, Hkv, D) for s in steps),
        "top1_agreement": sum(top1) / len(top1),
        "mean_kl": sum(kls) / len(kls),
        "step_kl": [sum(step) / len(step) for step in rec["kl"]],  # per step (every step), for paired intervals
        "first_divergence": first_div,
        "matches_dense": all(top1),
        "step_peak_bytes": step_peak,
        "own_state_bytes": own_bytes,
        "shared_state_bytes": run.shared_bytes,
        "peak_bytes": None if step_peak is None else run.shared_bytes + own_bytes + step_peak,
        "memory_counter": memory_counter(L.device),
        "host_minor_faults_per_step": sum(faults) / len(faults) if faults else None,  # mean over timed steps
        "prefill_s": run.prefill_s,
        "tokens": [step for step in rec["argmax"]],
        COUNTERS_KEY: sum_totals(rec["steps"]),  # every step, warm-up included, as the exporter counts
    }
    for p in PARTS:
        row[f"{p}_ms"] = statistics.median(s[f"{p}_s"] * 1e3 for s in steps)
    # Per timed step, in the order of step_ms: each step's parts add up to its total (rest is
    # the remainder, clamped at 0); their medians need not add up to the median step.
    row["step_parts_ms"] = {p: [s[f"{p}_s"] * 1e3 for s in steps] for p in PARTS}
    return row



def load_model(model_path: Optional[str], num_layers: Optional[int], device: torch.device = torch.device("cpu")):
    """The quality harness's offline GGUF loader, switched to this module's attention, the
    model moved to ``device``."""
    from benchmark.quality.model import load_gguf_model

    loaded = load_gguf_model(model_path, num_layers=num_layers)
    loaded.model.to(device)
    use_decode_attention(loaded.model)
    return loaded


def use_decode_attention(model) -> None:
    """Switch a transformers model to this module's attention (prefill and decode steps),
    with its attention inputs captured for the trained indexer."""
    from benchmark.e2e.attention import PLAN_KWARG
    from benchmark.quality.sparse_attention import install_hidden_capture

    register()
    model.set_attn_implementation(ATTENTION_NAME)
    install_hidden_capture(model, PLAN_KWARG)  # the trained indexer reads the attention's input


def prompt_windows(loaded, novel: str, length: int, data_dir, prompts: int = 1) -> List[Tuple[int, List[int]]]:
    """``[(token offset, length tokens), ...]``: one prompt from the novel's start, or
    ``prompts`` from evenly spaced offsets (:func:`~benchmark.e2e.prompts.prompt_offsets`);
    ``SystemExit`` naming the flag when the novel is too short."""
    from benchmark.quality.paths import default_data_dir, user_path
    from benchmark.quality.text import ensure_austen_text

    corpus = ensure_austen_text(default_data_dir() if data_dir is None else user_path(data_dir))
    if novel not in corpus.texts:
        raise SystemExit(f"--novel: expected one of {sorted(corpus.texts)}, got {novel!r}")
    ids = []
    if prompts == 1:  # the start alone: tokenize a prefix that is long enough, not the whole novel
        ids = loaded.tokenizer(corpus.texts[novel][: length * 8], add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        ids = loaded.tokenizer(corpus.texts[novel], add_special_tokens=False)["input_ids"]
    try:
        offsets = prompt_offsets(len(ids), length, prompts)
    except ValueError as err:
        flag = "--contexts" if len(ids) < length else "--prompts"
        raise SystemExit(f"{flag}: {novel}: {err}") from None
    return [(o, list(ids[o : o + length])) for o in offsets]


def run_one(model, text: Sequence[int], context_lens: Sequence[int], variants: Sequence[str], steps: int,
            next_n: int, width: int, shape: IndexerShape, warmup: int, on_step=None, log=None, prefilled=None,
            trained=None, profile=None, mode_settings=None):
    """Prefill (unless ``prefilled``), lay out, decode and summarize one (context, batch, mode);
    ``profile``: the run's :class:`E2EProfile` or None (each row of a variant that runs
    profile entries records the entry as ``profile_budget``); ``mode_settings``: the
    ``--policy-mode-settings`` (:func:`~benchmark.e2e.indexers.variant_policy`)."""
    _, Hkv, D = kv_geometry(model)
    run = build_batch(model, text, context_lens, variants, steps, next_n, width, shape, prefilled, trained,
                      profile, mode_settings)
    if log:
        log(f"[e2e] context {max(context_lens)} batch {len(context_lens)} rows/request {next_n + 1}: "
            f"dense prefill {run.prefill_s:.1f} s")
    decoded = decode_batch(model, run, steps, on_step, measure_memory_step=0, first_timed=warmup)
    rows = [summarize(v, run, decoded[v], Hkv, D, warmup, run.states[v].own_bytes(run.pools)) for v in variants]
    for row in rows:
        if runs_profile_entries(row["variant"]):
            row["profile_budget"] = str(profile.entry(width, max(context_lens)))
    dense = rows[0]
    for row in rows:
        row["speedup_vs_dense"] = dense["step_ms_median"] / row["step_ms_median"]
        row["kv_bytes_vs_dense"] = row["kv_bytes_per_step"] / dense["kv_bytes_per_step"]
    return rows


def run(args: argparse.Namespace, log=None) -> Dict[str, object]:
    """Every (context, batch) of ``args`` (the command line's namespace): the ``--json`` payload."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    from rtp_llm.metrics import register_topology_kv_reporter

    register_topology_kv_reporter()  # RTP_LLM_TOPOLOGY_KV_METRICS*: the steps are reported when on
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    loaded = load_model(args.model, args.num_layers, device)
    model = loaded.model
    H, Hkv, D = kv_geometry(model)
    trained, checkpoint, layer_shapes = None, None, {}
    if args.indexer == "trained":
        trained, checkpoint, shape, info = load_trained(args, loaded, H, D, device)
        layer_shapes = {str(x): f"{s.heads}x{s.head_dim}" for x, s in info.layer_shapes.items()}
        what = f"trained indexer {checkpoint}"
    else:
        shape = resolve_indexer_shape(args.indexer_preset, args.indexer_heads, args.indexer_dim, H, Hkv, D)
        what = f"untrained proxy indexer {shape.preset} (a null model: its rows are mostly decided by ties)"
    profile = load_profile(args, loaded)
    log(f"[e2e] {what}: {shape.heads} heads x {shape.dim} dims = {shape.macs_per_key} "
        f"multiply-adds per key, {shape.ratio_to_attention:.3f} of attention's {shape.attention_macs_per_key} "
        f"(DSA: {DSA_RATIO:.3f})" + (f"; layers with their own shape, same cost: {layer_shapes}" if layer_shapes else ""))
    from benchmark.progress import progress_bar

    configs = [(c, b, w) for c in args.contexts for b in args.batches for w in args.budget]
    prompts = getattr(args, "prompts", 1)
    total = len(configs) * args.new_tokens * prompts
    bar = progress_bar(total, "decode e2e steps", "step", not args.no_progress)
    rows: List[Dict[str, object]] = []
    T = args.next_n + 1
    for context in args.contexts:
        windows = prompt_windows(loaded, args.novel, context + (args.new_tokens * T if args.next_n else 0),
                                 args.data_dir, prompts)
        # one prefill per (context, prompt), shared by the batches and budgets
        want = sorted({c - 1 for b in args.batches for c in request_lengths(context, b, args.length_spread)})
        per_config: Dict[Tuple[int, int], List[Tuple[int, List[Dict[str, object]]]]] = {}
        for p, (offset, text) in enumerate(windows):
            prefilled = (*prefill_text(model, text[:context], want), want)
            for batch in args.batches:
                for width in args.budget:
                    def on_step(i, context=context, batch=batch, width=width, p=p):
                        bar.update(1)
                        bar.set_postfix_str(f"context {context} batch {batch} W {width}"
                                            + (f" prompt {p + 1}/{prompts}" if prompts > 1 else ""))

                    lens = request_lengths(context, batch, args.length_spread)
                    got = run_one(model, text, lens, args.variants, args.new_tokens, args.next_n, width, shape,
                                  args.warmup, on_step, log, prefilled, trained, profile,
                                  getattr(args, "mode_settings", None))
                    per_config.setdefault((batch, width), []).append((offset, got))
            del prefilled
        for batch in args.batches:
            for width in args.budget:
                rows += pool_prompts(per_config[(batch, width)])
    bar.close()
    return {
        "environment": environment(device),
        "model": loaded.describe(),
        "indexer": {**shape.describe(), "kind": args.indexer, "checkpoint": checkpoint, "layer_shapes": layer_shapes},
        "profile": None if profile is None else {
            "file": str(profile.profile.path), "policy": profile.profile.policy.value, "budget": profile.budget,
            "reference_context": profile.profile.reference_context,
            "scanning_layers": None if profile.profile.scanning_layers is None else list(
                profile.profile.scanning_layers)},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "merge", "out", "mode_settings")},
        "rows": rows,
        "targets": targets(rows),
        "iso_quality": iso_quality(rows),
        "paired": paired_with_learned(rows),
    }


def load_profile(args: argparse.Namespace, loaded) -> Optional[E2EProfile]:
    """``--profile`` checked against the loaded model, with its ``--profile-budget`` rule;
    None without the flag (``SystemExit`` naming the flag for a profile of another model, a
    budget it lacks, or a ``profile`` scanning set it does not have)."""
    if getattr(args, "profile", None) is None:
        return None
    from benchmark.quality.calibration import model_fingerprint
    from benchmark.quality.paths import user_path
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import load_topology_profile

    try:
        loaded_profile = load_topology_profile(user_path(args.profile), model_fingerprint=model_fingerprint(loaded))
        profile = E2EProfile(loaded_profile, args.profile_budget)
    except ValueError as exc:
        raise SystemExit(f"error: --profile: {exc}") from None
    sparse = sparse_layers(loaded.model)
    for v in args.variants:
        try:
            share_plan(v, sparse, loaded_profile)
        except ValueError as exc:
            raise SystemExit(f"error: --variants: {exc}") from None
    return profile


def load_trained(args: argparse.Namespace, loaded, H: int, D: int, device: torch.device):
    """``(layer -> projections on device, checkpoint path, IndexerShape, IndexerCheckpointInfo)``:
    ``--indexer-checkpoint`` or the shipped one; the shape is the file's (``info.layer_shapes``:
    the layers with another of the same cost per key)."""
    from benchmark.e2e.indexers import trained_indexer_shape
    from benchmark.indexer.checkpoints import load_trained_indexer, resolve_checkpoint
    from benchmark.quality.paths import user_path

    explicit = None if args.indexer_checkpoint is None else user_path(args.indexer_checkpoint)
    path = resolve_checkpoint(explicit, loaded.gguf_sha256)
    if path is None:
        raise SystemExit(f"error: --indexer-checkpoint: no trained indexer ships for {loaded.gguf_path.name}; train "
                         "one with benchmark/topology_kv_indexer_train.py, or run the untrained proxy (--indexer proxy)")
    try:
        trained, info = load_trained_indexer(path, loaded.gguf_sha256)
    except ValueError as exc:
        raise SystemExit(f"error: --indexer-checkpoint: {exc}") from None
    missing = [i for i in sparse_layers(loaded.model) if i not in trained]  # sliding-window layers need none
    if missing:
        raise SystemExit(f"error: --indexer-checkpoint {path}: no indexer for layers {missing}")
    for projections in trained.values():
        projections.to(device)
    return trained, str(path), trained_indexer_shape(info.shape.heads, info.shape.head_dim, H, D), info


def environment(device: torch.device) -> Dict[str, object]:
    """The machine: ``device`` is the host's processor, ``device_type`` where the run's
    tensors lived (``cpu`` or ``cuda``), with ``cuda_device`` (the GPU's name) on CUDA."""
    env = {
        "device": platform.processor() or platform.machine(),
        "device_type": device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        env["cuda_device"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env

