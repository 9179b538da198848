"""Which sparse layers scan: the profile's ``indexer_share``, chosen from measured reuse costs.

A sparse layer that does not scan reuses the learned rows of the nearest scanning layer
below it (``rtp_llm.models_py.modules.hybrid.indexer_share``). What that costs layer ``i``
depends on which layer it reuses, so the calibration records a cost per pair:
``cost[i][j]`` for every sparse layer ``j`` below ``i``, the loss of ``i``'s output
(``cos_diff``, mean over the calibrated budgets) when it attends over ``j``'s learned rows
instead of its own. A scanning set then costs the sum, over the layers that do not scan,
of ``cost[i][nearest scanning layer below i]``.

:func:`pick_scanning` returns the set of ``K`` layers, the first sparse layer among them
(nothing is below it to reuse), with the least such sum: exact, by dynamic programming over
the positions of the scanning layers (``O(K * N^2)`` for ``N`` sparse layers). Ranking layers
by the cost of reusing only the layer directly below would price a run of sharing layers
as if each reused its neighbour, when all of them reuse the scanning layer under the run.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Mapping, Sequence, Tuple

from benchmark.cli_checks import shown

RULE = ("the first sparse layer and the set of the others that minimises the summed cost of the layers that "
        "do not scan, each costing what reusing the learned rows of the nearest scanning layer below it loses "
        "in its output (cos_diff, mean over the budgets); exact over the recorded costs")

Costs = Mapping[int, Mapping[int, float]]  # cost[layer][source]: every sparse layer below ``layer``


def _check_costs(name: str, costs: Costs, layers: Sequence[int]) -> None:
    missing = [(i, j) for pos, i in enumerate(layers) for j in layers[:pos]
               if i not in costs or j not in costs[i]]
    if missing:
        shown_pairs = ", ".join(f"{i}<-{j}" for i, j in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"scan: expected {name} for every sparse layer and every sparse layer below it, "
                         f"missing (layer<-source) {shown_pairs}")
    bad = [(i, j) for pos, i in enumerate(layers) for j in layers[:pos] if not math.isfinite(costs[i][j])]
    if bad:
        raise ValueError(f"scan: expected finite {name}, got NaN or inf for (layer<-source) "
                         + ", ".join(f"{i}<-{j}" for i, j in bad[:8]))


def best_scanning_set(cost: Costs, layers: Sequence[int], scan: int) -> Tuple[List[int], float]:
    """(the ``scan`` scanning layers, their total cost): the least-cost set containing ``layers[0]``.

    Sets of equal cost are equally good by the measurements; the choice among them is
    deterministic (the first minimum the recursion meets).
    """
    layers = sorted(layers)
    n = len(layers)
    if not 1 <= scan <= n:
        raise ValueError(f"scan: expected 1 to the {n} sparse layers, got {scan}")
    _check_costs("a reuse cost", cost, layers)
    # seg[a][b]: the layers strictly between positions a and b, all reusing layers[a].
    seg = [[0.0] * (n + 1) for _ in range(n)]
    for a in range(n):
        total = 0.0
        for b in range(a + 1, n + 1):
            seg[a][b] = total
            if b < n:
                total += cost[layers[b]][layers[a]]
    inf = float("inf")
    # best[k][b]: least cost of positions < b with k scanning layers, the k-th at position b.
    best = [[inf] * n for _ in range(scan + 1)]
    back = [[-1] * n for _ in range(scan + 1)]
    best[1][0] = 0.0
    for k in range(2, scan + 1):
        for b in range(k - 1, n):
            for a in range(k - 2, b):
                if best[k - 1][a] == inf:
                    continue
                value = best[k - 1][a] + seg[a][b]
                if value < best[k][b]:
                    best[k][b], back[k][b] = value, a
    last, total = -1, inf
    for a in range(scan - 1, n):
        if best[scan][a] < inf and best[scan][a] + seg[a][n] < total:
            last, total = a, best[scan][a] + seg[a][n]
    chosen = []
    k, pos = scan, last
    while pos >= 0:
        chosen.append(layers[pos])
        pos, k = back[k][pos], k - 1
    return sorted(chosen), total


def sources_of(scanning: Sequence[int], layers: Sequence[int]) -> Dict[int, int]:
    """Each sparse layer that does not scan -> the nearest scanning layer below it."""
    out, current = {}, None
    for x in sorted(layers):
        if x in scanning:
            current = x
        elif current is not None:
            out[x] = current
    return out


def set_cost(cost: Costs, scanning: Sequence[int], layers: Sequence[int]) -> float:
    """What a given scanning set costs: the sum over the sharing layers of ``cost[layer][source]``.

    ``ValueError`` unless ``scanning`` holds the first sparse layer and only sparse layers
    (a layer below every scanning layer would have nothing to reuse)."""
    layers = sorted(layers)
    if not layers or layers[0] not in scanning or not set(scanning) <= set(layers):
        raise ValueError(f"scanning: expected sparse layers starting with the first, {layers[:1]}, "
                         f"got {sorted(scanning)}")
    return sum(cost[x][s] for x, s in sources_of(scanning, layers).items())


def profile_set_cost(profile: Mapping[str, object], scanning: Sequence[int]) -> float:
    """:func:`set_cost` of ``scanning`` under a profile JSON's recorded pairwise costs (to
    compare another set, e.g. ``every:K``'s, with the one the calibration chose)."""
    cost, _ = recorded_costs(profile)
    return set_cost(cost, scanning, sorted(int(x) for x in profile["layers"]))


def pick_scanning(cost: Costs, overlap: Costs, layers: Sequence[int], scan: int) -> Dict[str, object]:
    """``indexer_share`` from the pairwise reuse costs and top-k overlaps (module docstring)."""
    layers = sorted(layers)
    _check_costs("a top-k overlap", overlap, layers)
    scanning, total = best_scanning_set(cost, layers, scan)
    sources = sources_of(scanning, layers)
    return {
        "scanning": scanning,
        "scan": f"{scan} of {len(layers)}",
        "rule": RULE,
        "total_cost_cos_diff": total,
        "sources": {str(x): s for x, s in sources.items()},
        "reuse_cost_cos_diff": {str(i): {str(j): float(cost[i][j]) for j in layers[:p]}
                                for p, i in enumerate(layers) if p},
        "reuse_overlap": {str(i): {str(j): float(overlap[i][j]) for j in layers[:p]}
                          for p, i in enumerate(layers) if p},
        "env": "RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=profile",
    }


def _read_matrix(share: Mapping[str, object], name: str) -> Dict[int, Dict[int, float]]:
    raw = share[name]
    out: Dict[int, Dict[int, float]] = {}
    for key, row in raw.items():
        if not re.fullmatch(r"[0-9]{1,6}", str(key)) or not isinstance(row, dict):
            raise ValueError(f"indexer_share.{name}: expected layer index -> {{source layer -> number}}, got "
                             f"{shown(key)}: {shown(row)}")
        for source, value in row.items():
            if not re.fullmatch(r"[0-9]{1,6}", str(source)) or isinstance(value, bool) \
                    or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"indexer_share.{name}[{key}]: expected source layer index -> number, got "
                                 f"{shown(source)}: {shown(value)}")
            out.setdefault(int(key), {})[int(source)] = float(value)
    return out


def recorded_costs(data: Mapping[str, object]) -> Tuple[Dict[int, Dict[int, float]], Dict[int, Dict[int, float]]]:
    """(pairwise costs, pairwise overlaps) a profile JSON's ``indexer_share`` recorded;
    ``ValueError`` naming what is missing (no ``indexer_share``, or only the adjacent costs
    of an older calibration) or malformed."""
    share = data.get("indexer_share")
    if not isinstance(share, dict):
        raise ValueError("expected a profile calibrated with --scan (its indexer_share.reuse_cost_cos_diff holds "
                         "each layer's cost of reusing every sparse layer below it), got no indexer_share")
    if not isinstance(share.get("reuse_cost_cos_diff"), dict) or not isinstance(share.get("reuse_overlap"), dict):
        adjacent = "cost_cos_diff" in share
        raise ValueError("expected indexer_share.reuse_cost_cos_diff and .reuse_overlap (each layer's cost of "
                         "reusing every sparse layer below it), got "
                         + ("only each layer's cost of reusing the layer directly below (cost_cos_diff): "
                            "calibrate again with --scan" if adjacent else "neither"))
    return _read_matrix(share, "reuse_cost_cos_diff"), _read_matrix(share, "reuse_overlap")


def rescan_profile(data: Dict[str, object], layers: Sequence[int], scan: int, command: str) -> Dict[str, object]:
    """A copy of the profile JSON ``data`` whose ``indexer_share`` scans ``scan`` layers.

    The choice reuses the pairwise costs and overlaps the calibration recorded
    (:func:`pick_scanning`); nothing else changes except ``indexer_share.command``, the
    command that re-chose it. ``ValueError`` when ``data`` holds no pairwise costs (a
    profile calibrated without ``--scan``, or one that records only each layer's cost of
    reusing the layer directly below) or they do not cover ``layers``.
    """
    cost, overlap = recorded_costs(data)
    out = dict(data)
    out["indexer_share"] = dict(pick_scanning(cost, overlap, layers, scan), command=command)
    return out


def format_scanning(profile: Dict[str, object]) -> str:
    """The ``indexer_share`` choice as a table: per sparse layer, what reusing costs, whether it scans."""
    share = profile["indexer_share"]
    cost, overlap = share["reuse_cost_cos_diff"], share["reuse_overlap"]
    layers = sorted(int(x) for x in profile["layers"])
    lines = [f"\nScanning layers ({share['scan']}): {','.join(map(str, share['scanning']))} "
             f"(serve with {share['env']}); summed cos_diff lost by the sharing layers "
             f"{share['total_cost_cos_diff']:+.5f}", "",
             "| layer | cos_diff lost reusing the layer below | top-k overlap with the layer below | scans "
             "| reuses | cos_diff lost reusing it | top-k overlap with it |",
             "|---|---|---|---|---|---|---|"]
    lines.append(f"| {layers[0]} | - (first sparse layer) | - | yes | - | - | - |")
    for pos, x in enumerate(layers[1:], 1):
        below = str(layers[pos - 1])
        adjacent = f"{cost[str(x)][below]:+.5f} | {overlap[str(x)][below]:.3f}"
        if x in share["scanning"]:
            lines.append(f"| {x} | {adjacent} | yes | - | - | - |")
        else:
            s = str(share["sources"][str(x)])
            lines.append(f"| {x} | {adjacent} | no | {s} | {cost[str(x)][s]:+.5f} | {overlap[str(x)][s]:.3f} |")
    return "\n".join(lines)
