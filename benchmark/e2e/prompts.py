"""Several prompts per run: where they start in the novel, and one row pooled over them.

A mean KL over the greedy steps of one prompt is one text's start: a single step can carry
most of it, and a verdict "at ``learned``'s KL" then says little. ``--prompts N`` decodes
``N`` prompts cut from evenly spaced token offsets of the novel (:func:`prompt_offsets`),
each prefilled on its own and decoded by every variant with the same layout; a row pools
them (:func:`pool_prompts`): the timed steps and per-step KLs are concatenated prompt after
prompt (step ``i`` of every variant still ran in the same round, so the paired ratios and
the paired KL difference of :mod:`benchmark.e2e.paired` stay paired), and the row keeps
each prompt's offset and mean KL beside the pooled values.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Sequence, Tuple

from benchmark.e2e.paired import nearest_rank
from benchmark.e2e.policy_counters import KEY as COUNTERS_KEY

Row = Dict[str, object]


def prompt_offsets(text_tokens: int, length: int, prompts: int) -> List[int]:
    """``prompts`` start offsets, evenly spaced from 0 to ``text_tokens - length`` (the last
    prompt ends at the text's end); one prompt starts at 0.

    Raises ValueError when the text is shorter than ``length`` or ``prompts`` < 1."""
    if prompts < 1:
        raise ValueError(f"prompts: expected >= 1, got {prompts}")
    room = text_tokens - length
    if room < 0:
        raise ValueError(f"the text has {text_tokens} tokens, fewer than one prompt's {length}")
    if prompts == 1:
        return [0]
    if room < prompts - 1:
        raise ValueError(f"the text has {text_tokens} tokens: {prompts} prompts of {length} tokens need "
                         f"at least {length + prompts - 1} for distinct offsets")
    return [p * room // (prompts - 1) for p in range(prompts)]


def _max_or_none(values: Sequence[object]):
    present = [v for v in values if v is not None]
    return max(present) if present else None


def pool_rows(parts: Sequence[Tuple[int, Row]]) -> Row:
    """One variant's rows of several prompts, ``[(offset, row), ...]`` in decode order, as one row.

    Concatenated in that order: ``step_ms``, ``step_parts_ms``, ``step_kl``, ``tokens``,
    ``first_divergence`` (per prompt, per request). Recomputed from them: the step medians,
    p90, tokens/s and each part's median. Means over prompts (every prompt has the same
    requests and steps, so they equal the pooled means): ``top1_agreement``, ``mean_kl``,
    ``host_minor_faults_per_step``. ``kv_bytes_per_step``: the median of the prompts'
    medians; memory: the largest; host faults: the mean of the prompts that have them; ``prefill_s`` and the policy counters: summed. Added:
    ``prompt_offsets``, ``prompt_kl`` and ``prompt_top1`` (each prompt's own). One prompt: its
    row plus those three fields.

    Raises ValueError for no rows, or rows of different variants or layouts."""
    if not parts:
        raise ValueError("pool_rows: expected at least one prompt's row, got none")
    first = parts[0][1]
    same = ("variant", "context", "context_lens", "batch", "rows_per_request", "budget")
    for _, r in parts[1:]:
        diff = [k for k in same if r.get(k) != first.get(k)]
        if diff:
            raise ValueError(f"pool_rows: rows differ in {diff}: {[r.get(k) for k in diff]} vs "
                             f"{[first.get(k) for k in diff]}")
    rows = [r for _, r in parts]
    out = dict(first)
    totals = [x for r in rows for x in r["step_ms"]]
    med = statistics.median(totals)
    out["steps"] = sum(r["steps"] for r in rows)
    out["step_ms"] = totals
    out["step_ms_median"] = med
    out["step_ms_p90"] = nearest_rank(totals, 0.9)
    out["tokens_per_s"] = first["batch"] * first["rows_per_request"] * 1e3 / med
    out["kv_bytes_per_step"] = statistics.median(r["kv_bytes_per_step"] for r in rows)
    out["top1_agreement"] = statistics.fmean(r["top1_agreement"] for r in rows)
    out["mean_kl"] = statistics.fmean(r["mean_kl"] for r in rows)
    out["step_kl"] = [x for r in rows for x in r["step_kl"]]
    out["first_divergence"] = [x for r in rows for x in r["first_divergence"]]
    out["matches_dense"] = all(r["matches_dense"] for r in rows)
    for key in ("step_peak_bytes", "own_state_bytes", "shared_state_bytes", "peak_bytes"):
        out[key] = _max_or_none([r.get(key) for r in rows])
    faults = [r["host_minor_faults_per_step"] for r in rows if r.get("host_minor_faults_per_step") is not None]
    out["host_minor_faults_per_step"] = statistics.fmean(faults) if faults else None
    out["prefill_s"] = sum(r["prefill_s"] for r in rows)
    out["tokens"] = [step for r in rows for step in r["tokens"]]
    if all(COUNTERS_KEY in r for r in rows):
        out[COUNTERS_KEY] = {k: sum(r[COUNTERS_KEY][k] for r in rows) for k in first[COUNTERS_KEY]}
    parts_ms = {p: [x for r in rows for x in r["step_parts_ms"][p]] for p in first["step_parts_ms"]}
    out["step_parts_ms"] = parts_ms
    for p, values in parts_ms.items():
        out[f"{p}_ms"] = statistics.median(values)
    out["prompt_offsets"] = [offset for offset, _ in parts]
    out["prompt_kl"] = [r["mean_kl"] for r in rows]
    out["prompt_top1"] = [r["top1_agreement"] for r in rows]
    return out


def pool_prompts(per_prompt: Sequence[Tuple[int, List[Row]]]) -> List[Row]:
    """Every variant's rows of one (context, batch, W) over its prompts, ``[(offset, rows), ...]``
    (each ``rows`` in variant order, dense first): one pooled row per variant
    (:func:`pool_rows`), with ``speedup_vs_dense`` and ``kv_bytes_vs_dense`` against the
    pooled dense row. Raises ValueError when the prompts ran different variants."""
    if not per_prompt:
        raise ValueError("pool_prompts: expected at least one prompt, got none")
    names = [[r["variant"] for r in rows] for _, rows in per_prompt]
    if any(n != names[0] for n in names):
        raise ValueError(f"pool_prompts: the prompts ran different variants: {names}")
    pooled = [pool_rows([(offset, rows[i]) for offset, rows in per_prompt]) for i in range(len(names[0]))]
    dense = pooled[0]
    for row in pooled:
        row["speedup_vs_dense"] = dense["step_ms_median"] / row["step_ms_median"]
        row["kv_bytes_vs_dense"] = row["kv_bytes_per_step"] / dense["kv_bytes_per_step"]
    return pooled
