"""Policy overhead benchmark: apply_topology_kv_policy beside what it rides on.

For each mode, row count ``R`` and context length ``L`` (width ``W`` = 2048) it times,
side by side in one process, interleaved round by round (so a noisy machine slows every
column alike; medians over rounds). Every call is timed twice per round: *cold*, right after
the caches were evicted (:mod:`benchmark.candidates.cache_eviction`: between two policy
calls of a decode step a whole model layer streams through the caches), the serving-like
figure every ``*_ms`` / ``*_us`` / ratio column and every target reads; and *warm*, straight
after it, the best case, in the ``*_warm_*`` columns beside:

* ``policy``     ``apply_topology_kv_policy`` (``FALLBACK_DISABLED``: no host sync) on each
                 ``--backend``: ``torch`` (eager ops), ``compiled`` (torch.compile),
                 ``cpu_fused`` (one C++ pass per row), ``triton`` (one launch);
* ``layer``      the same rows through the per-layer object the ``Indexer`` calls
                 (``TopologyKVLayerPolicy.run``: settings, layout and backend fixed at
                 construction, no per-call argument handling), per backend; the serving call;
                 with ``cpu_fused`` also ``layer_one_thread``: that call with all ``R`` rows
                 in one parallel chunk (one thread), and ``layer_over_one_thread``, what
                 splitting the rows over the threads buys;
* ``topk``       ``torch.topk`` over ``[R, L]`` fp32 indexer logits (the op the policy
                 follows; skipped above ``--max-topk-elements`` to bound memory), timed in
                 the same interleaved rounds as the policy;
* ``copy``       a plain copy of the ``[R, W]`` index rows (the memory-traffic floor);
* ``reference``  the plain loop reference on ``--reference-rows`` rows, scaled to ``R``.

After the policy grid, a small table times what the merge modes add to a decode step's
key write: the indexer-key store plus the drift tracker's update per layer call
(``BlockDriftTracker.update``: one C++ call on CPU, two Triton launches on CUDA; beside
``update_reference``, its torch ops), for 1, 8 and 64 requests, interleaved (JSON key ``tracker_update``).
A last table times the served ``query_group_mass`` witness scores per layer call (one C++
call on CPU, beside their torch reference; SmolLM2's attention shape at 8-token blocks, 8k)
with the bytes each call must read and the rate reached (JSON key ``witness_scores``). The
last one times a sharing layer's whole policy hook with those witnesses (key tracker update,
scores, merge) and each part alone, with the checked block exchange that would replace the
scores and the merge beside them (JSON key ``sharing_layer``).

Input rows are synthetic but valid: ``W`` unique positions per row spread over ``[0, L)``
in random order (the engine's top-k order is arbitrary), drift scores and learned scores
uniform. Prints a TSV table, the targets with PASS/FAIL (the best backend per cell), and
``--json``. The per-call targets are checked on the layer call (what serving runs per
layer and step); the public entry's figures are printed beside it.

    python benchmark/topology_kv_policy_bench.py --rows 1 8 64 1024 --lengths 8192 131072
    bazel run //benchmark:topology_kv_policy_bench -- --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple


import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.test import reference as ref
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    CoordinateMismatchAction,
    IndexerTopologySettings,
    TopologyKVBackend,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.layer import TopologyKVLayerPolicy
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import apply_topology_kv_policy
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_fused
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.dispatch import can_use_backend, resolve_backend
from benchmark.cli_checks import FlagError, check_output_file, given_flags
from benchmark.candidates.cache_eviction import CacheEvictor
from benchmark.candidates.witness import (
    query_bound_scores_unchecked,
    query_centroid_scores_unchecked,
    query_mass_scores_unchecked,
)

ENABLED_MODES = [m.value for m in TopologyKVPolicyMode if m is not TopologyKVPolicyMode.DISABLED]
BACKENDS = [b.value for b in TopologyKVBackend if b is not TopologyKVBackend.AUTO]
COLUMNS = [
    "mode", "backend", "rows", "seq_len", "width", "learned_scores", "policy_us", "policy_ms", "policy_p10_ms", "policy_p90_ms",
    "topk_ms", "copy_ms", "reference_ms", "policy_over_topk", "policy_over_copy", "per_row_us",
    "layer_us", "layer_over_topk", "layer_warm_us", "topk_warm_ms", "layer_over_topk_warm",
    "layer_one_thread_us", "layer_over_one_thread", "witness_query_centroid_ms", "witness_query_mass_ms", "witness_query_bound_ms",
]
# DeepSeek-V3.2's indexer: 64 heads of dim 128 (the query-centroid witness signal uses
# the indexer's own q and per-block centroids of its keys, one KV head).
INDEXER_HEADS, INDEXER_DIM = 64, 128
LAYER_PREFIX = "layer:"  # the layer object's column of a backend in the interleaved rounds
# The fused CPU kernel's layer call with every row on one thread (the rows' split over the
# threads off), in the same rounds: what splitting a call's rows buys, side by side.
ONE_THREAD = "layer-one-thread:" + TopologyKVBackend.CPU_FUSED.value


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 1024], help="rows R per call")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 131072], help="context L")
    p.add_argument("--backend", nargs="+", default=None, metavar="NAME",
                   help=f"policy backends timed side by side, of {BACKENDS} (default: torch and the fused "
                        "kernel the device runs: cpu_fused on CPU, triton on CUDA)")
    p.add_argument("--width", type=int, default=2048, help="top-k width W")
    p.add_argument("--witness-block-size", type=int, default=64,
                   help="block size of the query-aware witness signals' cost columns (N = L / this)")
    p.add_argument("--modes", nargs="+", default=ENABLED_MODES, help=f"subset of {ENABLED_MODES}")
    p.add_argument("--learned-scores", choices=["with", "without", "both"], default="both")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reference-rows", type=int, default=8, help="rows the loop reference is timed on")
    p.add_argument("--max-topk-elements", type=int, default=1 << 28, help="skip topk above R*L")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny grid for a smoke run")
    p.add_argument("--json", default=None, help="write rows and environment to this path")
    args = p.parse_args(argv)
    if args.quick:  # the smoke grid's values, for the flags not typed
        typed = given_flags(p, argv)
        quick = dict(rows=[64], lengths=[4096, 16384], rounds=3, warmup=1, reference_rows=2)
        for dest, value in quick.items():
            if dest not in typed:
                setattr(args, dest, value)
    if args.json:
        path = args.json
        if not os.path.isabs(path) and os.environ.get("BUILD_WORKING_DIRECTORY"):
            path = os.path.join(os.environ["BUILD_WORKING_DIRECTORY"], path)
        try:
            check_output_file("--json", path)
        except FlagError as err:
            p.error(str(err))
    for name in ("rows", "lengths"):
        bad = [v for v in getattr(args, name) if v <= 0]
        if bad:
            p.error(f"--{name}: expected positive integers, got {bad}")
    if args.width <= 0:
        p.error(f"--width: expected > 0, got {args.width}")
    if args.witness_block_size <= 0:
        p.error(f"--witness-block-size: expected > 0, got {args.witness_block_size}")
    unknown = [m for m in args.modes if m.lower() not in ENABLED_MODES]
    if unknown:
        p.error(f"--modes: expected a subset of {ENABLED_MODES}, got {unknown}")
    if args.rounds < 1 or args.warmup < 0:
        p.error(f"--rounds >= 1 and --warmup >= 0 expected, got {args.rounds}, {args.warmup}")
    args.device = resolve_device(args.device, p)
    if args.backend is None:
        fused = resolve_backend("auto", args.device)
        args.backend = ["torch"] + ([fused.value] if fused is not TopologyKVBackend.TORCH else [])
    for name in args.backend:
        if name.strip().lower() not in BACKENDS:
            p.error(f"--backend: expected names of {BACKENDS}, got {name!r}")
        if not can_use_backend(name, args.device):
            try:
                resolve_backend(name, args.device)
            except ValueError as err:
                p.error(f"--backend {name}: {err}")
    args.backend = [TopologyKVBackend.parse(b).value for b in args.backend]
    return args


def resolve_device(name: str, parser: argparse.ArgumentParser) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if name not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu, cuda or auto, got {name!r}")
    return torch.device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, rounds: int, warmup: int) -> List[float]:
    """Per-call wall times in ms (CUDA events on GPU), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_interleaved(fns: Dict[str, Callable[[], object]], device: torch.device, rounds: int,
                     warmup: int, evict: Callable[[], None]) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:
    """``(cold, warm)`` per-call ms of each function, called in turn within every round
    (interleaved): cold right after ``evict()``, warm straight after the cold call."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    cold = {name: [] for name in fns}
    warm = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            evict()
            cold[name].extend(time_ms(fn, device, 1, 0))
            warm[name].extend(time_ms(fn, device, 1, 0))
    return cold, warm


def synthetic_rows(rows: int, length: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, width]`` int32: unique positions in ``[0, length)``, random order.

    Rows with ``length <= width`` follow the engine convention (``0..length-1``, ``-1``).
    """
    if length <= width:
        ar = torch.arange(width)
        return torch.where(ar < length, ar, -1).to(torch.int32).expand(rows, width).contiguous()
    stride = length // width  # one position per stride window: unique and in range
    base = torch.arange(width) * stride
    pos = base.unsqueeze(0) + torch.randint(0, stride, (rows, width), generator=gen)
    order = torch.argsort(torch.rand(rows, width, generator=gen), dim=1)
    return torch.gather(pos, 1, order).to(torch.int32)


def _pct(values: List[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def run(args: argparse.Namespace, log=print, evict: Optional[CacheEvictor] = None) -> List[Dict[str, object]]:
    device = args.device
    evict = evict or CacheEvictor(device)
    gen = torch.Generator().manual_seed(args.seed)
    W = args.width
    results = []
    cells = [(R, L) for R in args.rows for L in args.lengths]
    for ci, (R, L) in enumerate(cells):
        x = synthetic_rows(R, L, W, gen).to(device)
        lengths = torch.full((R,), L, dtype=torch.int32, device=device)
        drift = torch.rand(R, (L + 63) // 64, generator=gen).to(device)
        scores = torch.rand(R, W, generator=gen).to(device)
        copy_out = torch.empty_like(x)
        # Hidden cost of the query-aware witness signal: scores of every block for every
        # row (key drift costs nothing per call: the tracker keeps it up to date).
        q_idx = torch.randn(R, INDEXER_HEADS, INDEXER_DIM, generator=gen).to(device)
        wbs = args.witness_block_size
        cents = torch.randn((L + wbs - 1) // wbs, 1, INDEXER_DIM, generator=gen).to(device)
        witness_ms = statistics.median(
            time_ms(lambda: query_centroid_scores_unchecked(q_idx, cents), device, args.rounds, args.warmup)
        )
        mass_ms = statistics.median(
            time_ms(lambda: query_mass_scores_unchecked(q_idx, cents, lengths, wbs), device, args.rounds, args.warmup)
        )
        # query_bound: per-block key min/max (two centroid-sized tables), causal masking, softmax.
        kmin, kmax = cents - 1.0, cents + 1.0
        bound_ms = statistics.median(
            time_ms(lambda: query_bound_scores_unchecked(q_idx, kmin, kmax, lengths, wbs), device, args.rounds, args.warmup)
        )
        del q_idx, cents, kmin, kmax
        # The baselines are timed inside each interleaved round with the policy (below), so
        # a noisy machine slows them alike and the ratios stay meaningful.
        baselines = {"copy": lambda: copy_out.copy_(x)}
        logits = None
        if R * L <= args.max_topk_elements:
            logits = torch.randn(R, L, generator=gen).to(device)
            k = min(W, L)
            baselines["topk"] = lambda: torch.topk(logits, k, dim=1)
        score_opts = {"with": [True], "without": [False], "both": [False, True]}[args.learned_scores]
        for mode in args.modes:
            for use_scores in score_opts:
                s_ = scores if use_scores else None
                cfg = TopologyKVPolicyConfig(
                    policy=mode, coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED
                )
                out = torch.empty_like(x)

                def call(backend, cfg=cfg, s_=s_, out=out):
                    # The rows into a caller buffer, as serving would pass it. No counters_out:
                    # with it the torch backend must also compute topology_only's learned
                    # counters (a sort per row), which it otherwise leaves until they are read.
                    return apply_topology_kv_policy(
                        x, lengths, config=cfg, block_drift_scores=drift, learned_scores=s_, validate=False,
                        backend=backend, out=out,
                    )

                def layer_call(backend, cfg=cfg, s_=s_, out=out, one_thread=False):
                    layer = TopologyKVLayerPolicy.build(
                        IndexerTopologySettings(policy=dataclasses.replace(cfg, backend=backend)), layer_idx=0,
                        width=W, device=device,
                    )
                    if one_thread:  # one parallel chunk of all R rows
                        entry, _ = layer.kernel
                        layer = dataclasses.replace(
                            layer, kernel=(entry, cpu_fused.layer_args(layer.layout, W, grain_rows=R)))
                    return lambda: layer.run(x, lengths, block_drift_scores=drift, learned_scores=s_, out=out)

                # The backend as a member, as a config holds it (a name would be parsed per call).
                fns = {**baselines, **{b: functools.partial(call, TopologyKVBackend.parse(b)) for b in args.backend}}
                fns.update({LAYER_PREFIX + b: layer_call(TopologyKVBackend.parse(b)) for b in args.backend})
                if TopologyKVBackend.CPU_FUSED.value in args.backend:
                    fns[ONE_THREAD] = layer_call(TopologyKVBackend.CPU_FUSED, one_thread=True)
                if "compiled" in fns:
                    t0 = time.perf_counter()
                    fns["compiled"]()
                    compile_s = time.perf_counter() - t0
                else:
                    compile_s = None
                all_times, warm_times = time_interleaved(fns, device, args.rounds, args.warmup, evict)
                warm = {name: statistics.median(t) for name, t in warm_times.items()}
                copy_ms = statistics.median(all_times.pop("copy"))
                topk_times = all_times.pop("topk", None)
                topk_ms = None if topk_times is None else statistics.median(topk_times)
                topk_warm = warm.get("topk")
                layer_times = {b: all_times.pop(LAYER_PREFIX + b) for b in args.backend}
                one_thread_times = all_times.pop(ONE_THREAD, None)
                one_thread_ms = None if one_thread_times is None else statistics.median(one_thread_times)
                n_ref = min(R, args.reference_rows)
                xr, lr = x[:n_ref].cpu(), lengths[:n_ref].cpu()
                dr, sr = drift[:n_ref].cpu(), None if s_ is None else s_[:n_ref].cpu()
                t0 = time.perf_counter()
                ref.reference_topology_policy(
                    xr, lr, mode=cfg.policy.value, sink_blocks=cfg.sink_blocks, local_blocks=cfg.local_blocks,
                    witness_blocks=cfg.witness_blocks, block_size=cfg.block_size,
                    max_structural_fraction=cfg.max_structural_fraction, drift=dr, learned_scores=sr,
                    sink_tokens=cfg.sink_tokens,
                )
                reference_ms = (time.perf_counter() - t0) * 1e3 * R / n_ref
                for backend, times in all_times.items():
                    policy_ms = statistics.median(times)
                    layer_ms = statistics.median(layer_times[backend])
                    layer_warm = warm[LAYER_PREFIX + backend]
                    fused = backend == TopologyKVBackend.CPU_FUSED.value
                    results.append({
                        "mode": cfg.policy.value,
                        "backend": backend,
                        "device_type": device.type,
                        "rows": R,
                        "seq_len": L,
                        "width": W,
                        "learned_scores": use_scores,
                        "policy_us": policy_ms * 1e3,
                        "policy_ms": policy_ms,
                        "policy_p10_ms": _pct(times, 0.1),
                        "policy_p90_ms": _pct(times, 0.9),
                        "topk_ms": topk_ms,
                        "copy_ms": copy_ms,
                        "reference_ms": reference_ms,
                        "policy_over_topk": None if topk_ms is None else policy_ms / topk_ms,
                        "policy_over_copy": policy_ms / copy_ms if copy_ms > 0 else None,
                        "per_row_us": policy_ms * 1e3 / R,
                        "layer_us": layer_ms * 1e3,
                        "layer_ms": layer_ms,
                        "layer_over_topk": None if topk_ms is None else layer_ms / topk_ms,
                        "policy_warm_us": warm[backend] * 1e3,
                        "layer_warm_us": layer_warm * 1e3,
                        "topk_warm_ms": topk_warm,
                        "copy_warm_ms": warm["copy"],
                        "policy_over_topk_warm": None if topk_warm is None else warm[backend] / topk_warm,
                        "layer_over_topk_warm": None if topk_warm is None else layer_warm / topk_warm,
                        "layer_one_thread_us": one_thread_ms * 1e3 if fused else None,
                        "layer_over_one_thread": layer_ms / one_thread_ms if fused else None,
                        "compile_s": compile_s if backend == "compiled" else None,
                        "witness_query_centroid_ms": witness_ms,
                        "witness_query_mass_ms": mass_ms,
                        "witness_query_bound_ms": bound_ms,
                    })
        del logits, baselines  # the [R, L] logits can be 512 MiB
        log(f"[policy-bench] cell {ci + 1}/{len(cells)} rows={R} seq_len={L} done", file=sys.stderr)
    return results


def evaluate_targets(results: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """The policy's cost targets per mode and learned-scores setting, on the best backend per cell.

    Per-call targets judge the layer call (``layer_*``: what the ``Indexer`` runs per layer
    and step; rows without it, from older JSON, fall back to the public entry's ``policy_*``).
    CPU: R = 1 at 8k <= 150 us per call and <= 0.5x ``torch.topk`` of the row; 1024 x 8k
    <= 0.15x ``torch.topk``. GPU: <= 10% of ``torch.topk`` at 64 x 128k and <= 5 us per
    call at R = 1 (and 4, when run). Both: the public entry's per-row time flat from 8k to
    128k (<= 2x).
    """
    checks = []
    keys = sorted({(r["mode"], r["learned_scores"]) for r in results})
    for mode, scored in keys:
        rows = [r for r in results if r["mode"] == mode and r["learned_scores"] == scored]
        best = {}
        for r in rows:
            cell = (r["rows"], r["seq_len"])
            if cell not in best or _call_ms(r) < _call_ms(best[cell]):
                best[cell] = r
        gpu = any(r.get("device_type") == "cuda" for r in rows)
        tag = f"{mode} scores={'yes' if scored else 'no'}"

        def check(target, cell, key, bound):
            r = best.get(cell)
            if r is None:
                return
            entry = "layer" if r.get("layer_" + key) is not None else "policy"
            value = r.get(f"{entry}_{key}")
            if value is None:
                return
            checks.append(dict(target=f"{tag}: {entry if entry == 'layer' else 'public'} call {target} "
                                      f"[{r['backend']}]", value=value, bound=bound, passed=value <= bound))

        if gpu:
            check("<= 10% of topk at 64x128k", (64, 131072), "over_topk", 0.10)
            for R in (1, 4):
                check(f"<= 5 us at R={R}, 8k", (R, 8192), "us", 5.0)
        else:
            check("<= 150 us at R=1, 8k", (1, 8192), "us", 150.0)
            check("<= 0.5x topk of the row at R=1, 8k", (1, 8192), "over_topk", 0.5)
            check("<= 0.15x topk at 1024x8k", (1024, 8192), "over_topk", 0.15)
        for R in sorted({r["rows"] for r in rows}):
            a, b = best.get((R, 8192)), best.get((R, 131072))
            if a and b:
                ratio = b["per_row_us"] / a["per_row_us"]
                checks.append(dict(target=f"{tag}: per-row time 128k / 8k at R={R} <= 2 [{b['backend']}]",
                                   value=ratio, bound=2.0, passed=ratio <= 2.0))
    return checks


def _call_ms(row: Dict[str, object]) -> float:
    """The serving call's median ms: the layer object's, else (older JSON) the public entry's."""
    return row["layer_ms"] if row.get("layer_ms") is not None else row["policy_ms"]


TRACKER_BATCHES = (1, 8, 64)  # decode rows per tracker update (one key per request)


def time_tracker_update(device: torch.device, rounds: int, warmup: int, evict: Callable[[], None],
                        key_dim: int = 128, context: int = 8192,
                        block_size: int = 64) -> List[Dict[str, object]]:
    """A decode step's key store plus drift tracker update per layer call, interleaved:
    ``BlockDriftTracker.update`` (its :attr:`kernel`: one C++ call on CPU, two Triton
    launches on CUDA) beside ``update_reference`` (torch ops), for batches of
    :data:`TRACKER_BATCHES` requests, one new key each, mid-block.

    ``key_dim`` 128 is DSA's indexer key. Each call writes the same mid-block positions
    again, so no block pair completes: the case of 63 of 64 decode steps. The step that
    completes a block also computes one ``key_dim``-long distance per key in the C++ call
    (the torch ops compute theirs every step); these figures leave that step out.
    """
    from rtp_llm.models_py.modules.hybrid.topology_kv.drift import BlockDriftTracker

    out = []
    gen = torch.Generator().manual_seed(0)
    for B in TRACKER_BATCHES:
        blocks = context // block_size + 1
        tracker = BlockDriftTracker(B, blocks, key_dim, block_size=block_size, device=device)
        pool = torch.zeros(B * blocks * block_size, key_dim, device=device)
        keys = torch.randn(B, key_dim, generator=gen).to(device)
        pos = torch.full((B,), context - block_size // 2, device=device)
        req = torch.arange(B, device=device)
        slots = req * blocks * block_size + pos
        fns = {"fused": lambda: tracker.update(keys, pos, req, pool=pool, slots=slots),
               "torch": lambda: tracker.update_reference(keys, pos, req, pool=pool, slots=slots)}
        times, warm = time_interleaved(fns, device, max(rounds, 20), warmup, evict)
        fused_us, torch_us = (1e3 * statistics.median(times[k]) for k in ("fused", "torch"))
        fused_warm, torch_warm = (1e3 * statistics.median(warm[k]) for k in ("fused", "torch"))
        out.append({"batch": B, "key_dim": key_dim, "kernel": tracker.kernel, "update_us": fused_us,
                    "reference_us": torch_us, "speedup": torch_us / fused_us,
                    "update_warm_us": fused_warm, "reference_warm_us": torch_warm})
    return out


WITNESS_BATCHES = (1, 8, 64)  # decode rows per layer call (one row per request)


def time_witness_scores(device: torch.device, rounds: int, warmup: int, evict: Callable[[], None],
                        heads: int = 9, kv_heads: int = 3, head_dim: int = 64, context: int = 8192,
                        block_size: int = 8) -> List[Dict[str, object]]:
    """The served ``query_group_mass`` witness scores per layer call, interleaved:
    ``tracker_query_group_mass_scores`` (one C++ call on CPU when it builds) beside
    ``tracker_query_group_mass_scores_reference`` (torch ops), for decode batches of
    :data:`WITNESS_BATCHES` requests, one row each, every row at ``context`` tokens.

    The shape is SmolLM2-135M's attention (9 query heads over 3 KV heads of 64) at the
    8-token blocks the shared-scan configurations serve; the tracker's table is a
    ``[:, :N]`` view of ``[B, N + 1, Hkv D]`` fp32, as :class:`BlockDriftTracker` hands it.
    ``table_mb``: the bytes of every row's request table, which a call must read once;
    ``kernel_gbps``: that over the kernel's cold time (its distance from memory bandwidth).
    """
    from rtp_llm.models_py.modules.hybrid.topology_kv import witness
    from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_witness

    out = []
    gen = torch.Generator().manual_seed(0)
    blocks = context // block_size
    K = kv_heads * head_dim
    for B in WITNESS_BATCHES:
        full = torch.randn(B, blocks + 1, K, generator=gen).to(device)
        sums = full[:, :blocks]
        counts = torch.full((B, blocks + 1), float(block_size), device=device)[:, :blocks]
        queries = torch.randn(B, heads, head_dim, generator=gen).to(device)
        rows = torch.arange(B, device=device)
        lengths = torch.full((B,), context, device=device)
        args = (queries, sums, counts, rows, lengths, block_size)
        fns = {"served": lambda: witness.tracker_query_group_mass_scores_unchecked(*args),
               "torch": lambda: witness.tracker_query_group_mass_scores_reference(*args)}
        times, warm = time_interleaved(fns, device, max(rounds, 20), warmup, evict)
        served_us, torch_us = (1e3 * statistics.median(times[k]) for k in ("served", "torch"))
        served_warm, torch_warm = (1e3 * statistics.median(warm[k]) for k in ("served", "torch"))
        kernel = "cpu" if device.type == "cpu" and cpu_witness.can_use_witness_kernel(device) else "torch"
        table_mb = B * blocks * K * 4 / 1e6
        out.append({"batch": B, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "context": context,
                    "block_size": block_size, "kernel": kernel, "scores_us": served_us, "reference_us": torch_us,
                    "speedup": torch_us / served_us, "scores_warm_us": served_warm,
                    "reference_warm_us": torch_warm, "table_mb": table_mb,
                    "kernel_gbps": table_mb * 1e-3 / (served_us * 1e-6)})
    return out


SHARING_BATCHES = (1, 8, 64)  # decode rows per layer call (one row per request)
# SmolLM2's attention at 8k, the e2e's W and witness settings in its sharing layers.
SHARING_SHAPE = dict(heads=9, kv_heads=3, head_dim=64, context=8192, width=1024, block_size=8, witness_blocks=64,
                     share=0.25)
SHARING_PARTS = ("hook", "update", "scores", "merge")
# Timed beside the parts, not in the hook: the checked block exchange, which would replace
# the scores and the merge (benchmark/candidates/checked_exchange.py), and the verified token
# exchange with its block-box update, which would replace the whole hook
# (benchmark/candidates/verified_exchange.py; 64 candidate blocks, as the harness runs it), in
# torch ops and (``verified_cpp``, CPU only) as one C++ pass per row; ``verified_cpp_b32``: the
# same with boxes of 32-token blocks and 16 candidate blocks (the same 512 candidate tokens,
# a quarter of the box tables' bytes); ``verified_mean`` / ``verified_mean_cpp``: the exchange
# with its candidate blocks ranked by their outsiders' mean logit, from the drift tracker's
# key sums (updated with the step's key, as the hook does) instead of boxes.
SHARING_ALTERNATIVES = ("checked", "verified", "verified_cpp", "verified_cpp_b32", "verified_mean",
                        "verified_mean_cpp")
CPP_ALTERNATIVES = ("verified_cpp", "verified_cpp_b32", "verified_mean_cpp")  # CPU only
VERIFIED_BLOCKS = 64
COARSE_BOX_BLOCK = 32


def sharing_layer_calls(device: torch.device, batch: int, gen: torch.Generator, *, heads: int, kv_heads: int,
                        head_dim: int, context: int, width: int, block_size: int, witness_blocks: int, share: float,
                        ) -> Tuple[Dict[str, Callable[[], object]], Callable[[torch.Tensor], object], Dict[str, torch.Tensor]]:
    """``(calls, merge_with, state)`` on one layer's state for ``batch`` requests (random keys, reused
    rows and queries from ``gen``): the calls :func:`time_sharing_layer` times (``hook``,
    ``update``, ``scores``, and ``merge``: ``merge_with`` the scores of the state as built), and
    ``merge_with(scores)``, the layer policy's run on the reused rows with ``scores``; beside
    them ``checked``, the checked block exchange on the same rows (each request's keys in a
    ``[B, L, Hkv * D]`` cache, the tracker's block sums, at most ``share`` of ``W`` swapped), and
    ``verified``, the block boxes' update with the row's key then the verified token exchange
    on the same rows (:data:`VERIFIED_BLOCKS` candidate blocks, margin 1, same cap). ``state``:
    the reused ``rows``, the ``queries`` (times the softmax scale) and each request's keys
    ``cache`` the exchanges read. The shape keywords are :data:`SHARING_SHAPE`'s."""
    from benchmark.candidates.checked_exchange import checked_exchange_decode
    from benchmark.candidates.verified_exchange import (BlockBoxes, verified_exchange_cpu, verified_exchange_decode,
                                                        verified_exchange_mean_cpu, verified_exchange_mean_decode)
    from rtp_llm.models_py.modules.hybrid.indexer import Indexer
    from rtp_llm.models_py.modules.hybrid.indexer_params import IndexerAttentionInputs, IndexerFmhaParams
    from rtp_llm.models_py.modules.hybrid.indexer_share import IndexerSharePlan, SharedTopkRows
    from rtp_llm.models_py.modules.hybrid.topology_kv import witness
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import IndexerTopologySettings, TopologyKVPolicyConfig
    from rtp_llm.models_py.modules.hybrid.topology_kv.drift import BlockDriftTracker

    config = TopologyKVPolicyConfig(policy="topology_sparse_merge", block_size=block_size,
                                    witness_blocks=witness_blocks, local_blocks=0, sink_tokens=0,
                                    max_structural_fraction=share)
    settings = IndexerTopologySettings(policy=config, witness_signal="query_group_mass")
    plan = IndexerSharePlan.parse("0", (0, 1))  # layer 1 reuses layer 0's rows
    indexer = Indexer(1, 64, width, 64, layer_idx=1, topology=settings, device=device, share=plan)
    B, K = batch, kv_heads * head_dim
    tracker = BlockDriftTracker(B, -(-(context + 1) // block_size), K, block_size=block_size, device=device)
    tracker.update(torch.randn(B * context, K, generator=gen).to(device),
                   torch.arange(context).repeat(B).to(device), torch.arange(B).repeat_interleave(context).to(device))
    rows = torch.stack([torch.randperm(context + 1, generator=gen)[:width] for _ in range(B)]).to(
        device=device, dtype=torch.int32)
    shared = SharedTopkRows()
    shared.by_layer[0] = rows
    queries = torch.randn(B, heads, head_dim, generator=gen).to(device) * head_dim ** -0.5
    keys = torch.randn(B, K, generator=gen).to(device)
    positions = torch.full((B,), context, device=device)
    request_ids = torch.arange(B, device=device)
    lengths = (positions + 1).to(torch.int32)
    empty = torch.empty(0, dtype=torch.int32, device=device)
    fmha = IndexerFmhaParams(expanded_seq_lens=lengths, topk_indices_offset=empty, ks=empty, ke=empty,
                             slot_mapping=empty)
    attn = IndexerAttentionInputs(is_prefill=False, decode_cu_seqlens_device=None, is_target_verify=False,
                                  kv_cache_kernel_block_id_device=torch.zeros(B, 1, dtype=torch.int32, device=device))

    def scores():
        return witness.tracker_query_group_mass_scores_unchecked(
            queries, tracker.block_sums(), tracker.block_counts(), request_ids, lengths, block_size)

    def update():
        tracker.update(keys, positions, request_ids)

    def hook():
        update()
        return indexer._compute_topk(None, None, None, fmha, attn, None, drift_tracker=tracker,
                                     shared_rows=shared, witness_queries=queries)

    def merge_with(witness_scores: torch.Tensor):
        return indexer.topology_layer.run(rows, lengths, None, witness_scores, None)

    cache = torch.randn(B, context + 1, K, generator=gen).to(device)
    cap = int(share * width)

    def checked():
        return checked_exchange_decode(rows, lengths, queries, cache, tracker.block_sums(), tracker.block_counts(),
                                       request_ids, block_size, 1.0, cap)

    boxes = BlockBoxes(B, -(-(context + 1) // block_size), K, block_size=block_size, device=device)
    boxes.update(cache[:, :context].reshape(B * context, K), torch.arange(context).repeat(B).to(device),
                 torch.arange(B).repeat_interleave(context).to(device))

    step_keys = cache[:, context].contiguous()  # the row's own key, fed as the step's

    def verified():
        boxes.update(step_keys, positions, request_ids)
        kmin, kmax = boxes.tables()
        return verified_exchange_decode(rows, lengths, queries, cache, kmin, kmax, request_ids, block_size, 1.0,
                                        cap, VERIFIED_BLOCKS)

    def verified_cpp():
        boxes.update(step_keys, positions, request_ids)
        kmin, kmax = boxes.tables()
        return verified_exchange_cpu(rows, lengths, queries, cache, kmin, kmax, request_ids, block_size, 1.0, cap,
                                     VERIFIED_BLOCKS)

    coarse = BlockBoxes(B, -(-(context + 1) // COARSE_BOX_BLOCK), K, block_size=COARSE_BOX_BLOCK, device=device)
    coarse.update(cache[:, :context].reshape(B * context, K), torch.arange(context).repeat(B).to(device),
                  torch.arange(B).repeat_interleave(context).to(device))
    coarse_blocks = VERIFIED_BLOCKS * block_size // COARSE_BOX_BLOCK

    def verified_cpp_b32():
        coarse.update(step_keys, positions, request_ids)
        kmin, kmax = coarse.tables()
        return verified_exchange_cpu(rows, lengths, queries, cache, kmin, kmax, request_ids, COARSE_BOX_BLOCK, 1.0,
                                     cap, coarse_blocks)

    # A tracker over the cache's keys: its first step makes it hold exactly the row's keys (each
    # later timed call adds the step's key again, the hook's repeated update).
    sums = BlockDriftTracker(B, -(-(context + 1) // block_size), K, block_size=block_size, device=device)
    sums.update(cache[:, :context].reshape(B * context, K), torch.arange(context).repeat(B).to(device),
                torch.arange(B).repeat_interleave(context).to(device))

    def verified_mean():
        sums.update(step_keys, positions, request_ids)
        return verified_exchange_mean_decode(rows, lengths, queries, cache, sums.block_sums(), sums.block_counts(),
                                             request_ids, block_size, 1.0, cap, VERIFIED_BLOCKS)

    def verified_mean_cpp():
        sums.update(step_keys, positions, request_ids)
        return verified_exchange_mean_cpu(rows, lengths, queries, cache, sums.block_sums(), sums.block_counts(),
                                          request_ids, block_size, 1.0, cap, VERIFIED_BLOCKS)

    built = scores()
    calls = {"hook": hook, "update": update, "scores": scores, "merge": lambda: merge_with(built),
             "checked": checked, "verified": verified, "verified_mean": verified_mean}
    if device.type == "cpu":
        calls.update(verified_cpp=verified_cpp, verified_cpp_b32=verified_cpp_b32, verified_mean_cpp=verified_mean_cpp)
    return calls, merge_with, {"rows": rows, "queries": queries, "cache": cache}


def time_sharing_layer(device: torch.device, rounds: int, warmup: int, evict: Callable[[], None],
                       **shape) -> List[Dict[str, object]]:
    """A sharing layer's policy hook per decode step and its parts, interleaved: what the
    end-to-end benchmark's sharing layers serve with ``query_group_mass`` witnesses
    (``topology_sparse_merge``, 64 witness blocks of 8 tokens, at most a quarter of ``W`` =
    1024, no sinks nor local blocks; SmolLM2's 9 query heads over 3 KV heads of 64; other
    values through ``shape``, :data:`SHARING_SHAPE`'s keys), for decode batches of
    :data:`SHARING_BATCHES` requests, one row each at 8k tokens.

    ``hook``: the attention-key tracker's update, then ``Indexer._compute_topk`` on the
    scanning layer's rows (what the e2e's policy column times in a sharing layer); its
    parts alone: ``update`` (``BlockDriftTracker.update`` with the row's key), ``scores``
    (``tracker_query_group_mass_scores_unchecked``, the witness scores the hook computes)
    and ``merge`` (the layer policy's ``run`` on the rows with such scores). ``rest``, the
    hook less the three parts, is the hook's own work (argument handling, the row-to-request map).
    ``checked`` (:data:`SHARING_ALTERNATIVES`): the checked block exchange at margin 1, which
    would replace ``scores`` and ``merge``; ``verified``: the block boxes' update and the
    verified token exchange at margin 1, which would replace the whole ``hook``;
    ``verified_cpp``: the same with the exchange's C++ pass (None off the CPU);
    ``verified_cpp_b32``: that with boxes of :data:`COARSE_BOX_BLOCK` tokens and as many
    candidate tokens (None off the CPU); ``verified_mean`` / ``verified_mean_cpp``: the
    tracker's update and the exchange with candidates ranked by their outsiders' mean logit
    (torch ops; C++, None off the CPU).
    """
    out = []
    gen = torch.Generator().manual_seed(0)
    shape = {**SHARING_SHAPE, **shape}
    for B in SHARING_BATCHES:
        calls, _, _ = sharing_layer_calls(device, B, gen, **shape)
        times, warm = time_interleaved(calls, device, max(rounds, 20), warmup, evict)
        row = {"batch": B, **{k: shape[k] for k in ("context", "width", "block_size", "witness_blocks", "share")}}
        for part in SHARING_PARTS + SHARING_ALTERNATIVES:
            ran = part in times  # the C++ passes (CPP_ALTERNATIVES) run on the CPU only
            row[f"{part}_us"] = 1e3 * statistics.median(times[part]) if ran else None
            row[f"{part}_warm_us"] = 1e3 * statistics.median(warm[part]) if ran else None
        row["rest_us"] = row["hook_us"] - sum(row[f"{p}_us"] for p in SHARING_PARTS[1:])
        out.append(row)
    return out


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def environment(device: torch.device) -> Dict[str, object]:
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    evict = CacheEvictor(args.device)
    results = run(args, evict=evict)
    print(f"# cold: each call right after writing {evict.nbytes >> 20} MiB (twice the largest cache, from "
          f"{evict.source}); warm: the same call straight after; targets read the cold figures")
    print("\t".join(COLUMNS))
    for r in results:
        print("\t".join(_fmt(r[c]) for c in COLUMNS))
    checks = evaluate_targets(results)
    for c in checks:
        print(f"{'PASS' if c['passed'] else 'FAIL'}\t{c['target']}\t{c['value']:.3f} (bound {c['bound']})")
    tracker = time_tracker_update(args.device, args.rounds, args.warmup, evict)
    print("\nkey store + drift tracker update per layer call (update: one fused call, C++ on CPU, Triton on CUDA; "
          "reference: torch ops; cold, warm beside)")
    print("batch\tkey_dim\tkernel\tupdate_us\treference_us\tspeedup\tupdate_warm_us\treference_warm_us")
    for t in tracker:
        print(f"{t['batch']}\t{t['key_dim']}\t{t['kernel']}\t{t['update_us']:.1f}\t{t['reference_us']:.1f}\t"
              f"{t['speedup']:.1f}x\t{t['update_warm_us']:.1f}\t{t['reference_warm_us']:.1f}")
    witness_scores = time_witness_scores(args.device, args.rounds, args.warmup, evict)
    print("\nquery_group_mass witness scores per layer call (scores: what the Indexer runs, C++ on CPU; reference: "
          "torch ops; SmolLM2's 9 over 3 heads of 64, 8-token blocks, 8k; cold, warm beside)")
    print("batch\tkernel\tscores_us\treference_us\tspeedup\tscores_warm_us\treference_warm_us\ttable_MB\t"
          "scores_GB/s")
    for t in witness_scores:
        print(f"{t['batch']}\t{t['kernel']}\t{t['scores_us']:.1f}\t{t['reference_us']:.1f}\t{t['speedup']:.1f}x\t"
              f"{t['scores_warm_us']:.1f}\t{t['reference_warm_us']:.1f}\t{t['table_mb']:.2f}\t"
              f"{t['kernel_gbps']:.1f}")
    sharing = time_sharing_layer(args.device, args.rounds, args.warmup, evict)
    print("\na sharing layer's policy hook per decode step (hook: key tracker update + Indexer._compute_topk on the "
          "reused rows, as the e2e serves query_group_mass witnesses; its parts alone; rest: hook - parts; SmolLM2's "
          "9 over 3 heads of 64, 8k, W 1024, 64 witness blocks of 8 at most a quarter of W; cold, warm beside; "
          "checked: the checked block exchange that would replace scores + merge; verified: block-box update + the "
          "verified token exchange (64 candidate blocks; torch ops, and cpp: one C++ pass per row, CPU only; "
          "cpp_b32: boxes of 32-token blocks, 16 candidates; mean: candidates ranked by their outsiders' mean "
          "logit from the drift tracker's key sums, torch ops and cpp) that would replace the hook; none in the hook)")
    print("batch\thook_us\tupdate_us\tscores_us\tmerge_us\trest_us\thook_warm_us\tupdate_warm_us\tscores_warm_us\t"
          "merge_warm_us\tchecked_us\tchecked_warm_us\tverified_us\tverified_warm_us\tverified_cpp_us\t"
          "verified_cpp_warm_us\tverified_cpp_b32_us\tverified_cpp_b32_warm_us\tverified_mean_us\t"
          "verified_mean_warm_us\tverified_mean_cpp_us\tverified_mean_cpp_warm_us")
    for t in sharing:
        print("\t".join([str(t["batch"])] + ["n/a" if t[k] is None else f"{t[k]:.1f}" for k in (
            "hook_us", "update_us", "scores_us", "merge_us", "rest_us", "hook_warm_us", "update_warm_us",
            "scores_warm_us", "merge_warm_us", "checked_us", "checked_warm_us", "verified_us",
            "verified_warm_us", "verified_cpp_us", "verified_cpp_warm_us", "verified_cpp_b32_us",
            "verified_cpp_b32_warm_us", "verified_mean_us", "verified_mean_warm_us", "verified_mean_cpp_us",
            "verified_mean_cpp_warm_us")]))
    if args.json:
        path = args.json
        if not os.path.isabs(path) and os.environ.get("BUILD_WORKING_DIRECTORY"):
            path = os.path.join(os.environ["BUILD_WORKING_DIRECTORY"], path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        payload = {"environment": {**environment(args.device), "cache": {"timing": "cold (headline), warm beside",
                                                                          **evict.describe()}},
                   "args": {k: str(v) for k, v in vars(args).items()},
                   "rows": results, "targets": checks, "tracker_update": tracker,
                   "witness_scores": witness_scores, "sharing_layer": sharing}
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
