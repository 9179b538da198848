"""The e2e's prompts: their offsets in the novel, one row pooled over them, the per-prompt
KL table, the flag (no model)."""

from __future__ import annotations

import copy
import types

import pytest
from hypothesis import given, settings, strategies as st

from benchmark.e2e import cli as e2e
from benchmark.e2e import prompts, runner
from benchmark.e2e.paired import mean_difference_interval, paired_step_ratio
from benchmark.e2e.policy_counters import KEY as COUNTERS_KEY
from benchmark.e2e.report import (PAIRED_HEADING, _speed_and_kl, command_of, format_merged, format_paired,
                                  format_prompt_kl, merge_runs, paired_with_learned)


def test_the_offsets_by_hand():
    assert prompts.prompt_offsets(100, 10, 1) == [0]
    assert prompts.prompt_offsets(100, 10, 4) == [0, 30, 60, 90]  # the last ends at the text's end
    assert prompts.prompt_offsets(100, 10, 3) == [0, 45, 90]
    assert prompts.prompt_offsets(12, 10, 3) == [0, 1, 2]
    assert prompts.prompt_offsets(10, 10, 1) == [0]


@pytest.mark.parametrize("args, words", [((100, 10, 0), "prompts: expected >= 1, got 0"),
                                         ((9, 10, 1), "9 tokens, fewer than one prompt's 10"),
                                         ((11, 10, 3), "3 prompts of 10 tokens need at least 12")])
def test_bad_offsets_say_what_was_expected(args, words):
    with pytest.raises(ValueError, match=words):
        prompts.prompt_offsets(*args)


@given(st.integers(1, 5000), st.integers(1, 50), st.integers(0, 5000))
@settings(max_examples=200, deadline=None)
def test_offsets_are_distinct_increasing_and_inside_the_text(length, n, room):
    text = length + room
    if n > 1 and room < n - 1:
        with pytest.raises(ValueError):
            prompts.prompt_offsets(text, length, n)
        return
    got = prompts.prompt_offsets(text, length, n)
    assert len(got) == n and got[0] == 0 and all(a < b for a, b in zip(got, got[1:]))
    assert got[-1] + length <= text and (n == 1 or got[-1] + length == text)


def _row(variant, step_ms, step_kl, *, parts=None, faults=1.0, peak=100, counters=None, kv=1000.0, batch=1):
    parts = parts or {"indexer": [1.0] * len(step_ms), "policy": [0.5] * len(step_ms),
                      "attention": [2.0] * len(step_ms), "rest": [3.0] * len(step_ms)}
    med = sorted(step_ms)[len(step_ms) // 2]
    return {
        "variant": variant, "context": 8192, "context_lens": [8192] * batch, "batch": batch, "rows_per_request": 1,
        "budget": 1024, "steps": len(step_ms), "step_ms": list(step_ms), "step_ms_median": med,
        "step_ms_p90": max(step_ms), "tokens_per_s": batch * 1e3 / med, "kv_bytes_per_step": kv,
        "top1_agreement": 1.0 - sum(step_kl), "mean_kl": sum(step_kl) / len(step_kl), "step_kl": list(step_kl),
        "first_divergence": [None] * batch, "matches_dense": not any(step_kl), "step_peak_bytes": peak,
        "own_state_bytes": 10, "shared_state_bytes": 20, "peak_bytes": 30 + peak, "memory_counter": "host",
        "host_minor_faults_per_step": faults, "prefill_s": 2.0, "tokens": [[7] * batch for _ in step_kl],
        COUNTERS_KEY: counters or {"rows": len(step_kl), "selected_tokens": 5},
        "step_parts_ms": parts, **{f"{p}_ms": sorted(v)[len(v) // 2] for p, v in parts.items()},
        "speedup_vs_dense": 1.0, "kv_bytes_vs_dense": 1.0,
    }


def test_pooling_two_prompts_by_hand():
    a = _row("learned", [1.0, 2.0, 3.0], [0.01, 0.02, 0.03], faults=2.0, peak=100,
             counters={"rows": 3, "selected_tokens": 5}, kv=1000.0)
    b = _row("learned", [10.0, 20.0, 30.0], [0.10, 0.20, 0.30], faults=None, peak=300,
             counters={"rows": 3, "selected_tokens": 7}, kv=3000.0)
    b["matches_dense"] = False
    before = copy.deepcopy((a, b))
    got = prompts.pool_rows([(0, a), (5000, b)])
    assert (a, b) == before  # the inputs are left untouched
    assert got["step_ms"] == [1.0, 2.0, 3.0, 10.0, 20.0, 30.0] and got["steps"] == 6
    assert got["step_ms_median"] == pytest.approx((3.0 + 10.0) / 2)
    assert got["step_ms_p90"] == 30.0  # nearest rank: ceil(0.9 * 6) = 6th of 6
    assert got["tokens_per_s"] == pytest.approx(1e3 / 6.5)
    assert got["step_kl"] == [0.01, 0.02, 0.03, 0.10, 0.20, 0.30]
    assert got["mean_kl"] == pytest.approx((0.02 + 0.20) / 2) and got["prompt_kl"] == pytest.approx([0.02, 0.20])
    assert got["top1_agreement"] == pytest.approx(((1 - 0.06) + (1 - 0.6)) / 2)
    assert got["prompt_offsets"] == [0, 5000] and got["prompt_top1"] == pytest.approx([0.94, 0.4])
    assert got["kv_bytes_per_step"] == 2000.0 and got["step_peak_bytes"] == 300 and got["peak_bytes"] == 330
    assert got["host_minor_faults_per_step"] == 2.0  # the prompts that have a count
    assert got["prefill_s"] == 4.0 and got[COUNTERS_KEY] == {"rows": 6, "selected_tokens": 12}
    assert got["matches_dense"] is False and got["first_divergence"] == [None, None]
    assert got["tokens"] == [[7]] * 6
    assert got["step_parts_ms"]["rest"] == [3.0] * 6 and got["rest_ms"] == 3.0


def test_one_prompt_pools_to_its_own_row_plus_the_prompt_fields():
    row = _row("learned", [5.0, 4.0, 6.0, 5.5], [0.01, 0.0, 0.02, 0.03], faults=1.5)
    row["step_ms_median"] = 5.25  # the true median of four, as summarize computes it
    row["step_ms_p90"] = 6.0
    row["tokens_per_s"] = 1e3 / 5.25
    row["policy_ms"] = 0.5
    got = prompts.pool_rows([(0, row)])
    extra = {k: got.pop(k) for k in ("prompt_offsets", "prompt_kl", "prompt_top1")}
    assert got == row
    assert extra == {"prompt_offsets": [0], "prompt_kl": [row["mean_kl"]], "prompt_top1": [row["top1_agreement"]]}


def test_pooled_rows_stay_paired_round_by_round():
    """Step i of two variants ran in the same round in each prompt; pooling keeps it so."""
    dense = [_row("dense", [10.0, 10.0], [0.0, 0.0]), _row("dense", [20.0, 20.0], [0.0, 0.0])]
    fast = [_row("x", [5.0, 5.0], [0.02, 0.04]), _row("x", [10.0, 10.0], [0.01, 0.01])]
    slow = [_row("y", [20.0, 20.0], [0.01, 0.01]), _row("y", [40.0, 40.0], [0.0, 0.02])]
    pooled = prompts.pool_prompts([(0, [dense[0], fast[0], slow[0]]), (900, [dense[1], fast[1], slow[1]])])
    assert [r["variant"] for r in pooled] == ["dense", "x", "y"]
    ratio = paired_step_ratio(pooled[1]["step_ms"], pooled[2]["step_ms"])
    assert (ratio.point, ratio.lo, ratio.hi) == (0.25, 0.25, 0.25)  # every round: x takes a quarter of y
    assert pooled[1]["speedup_vs_dense"] == pytest.approx(15.0 / 7.5)
    diff = mean_difference_interval(pooled[1]["step_kl"], pooled[2]["step_kl"])
    assert diff.point == pytest.approx((0.01 + 0.03 + 0.01 - 0.01) / 4)


def test_the_report_bootstraps_the_kl_difference_within_each_prompt():
    """x's steps are 0.01 above learned's in one prompt and 0.03 in the other: within each
    prompt the difference is fixed, so the report's interval is the point (drawn across the
    prompts it would not be)."""
    dense = [_row("dense", [10.0] * 2, [0.0] * 2), _row("dense", [10.0] * 2, [0.0] * 2)]
    learned = [_row("learned", [5.0] * 2, [0.01, 0.02]), _row("learned", [5.0] * 2, [0.02, 0.04])]
    x = [_row("x", [4.0] * 2, [0.02, 0.03]), _row("x", [4.0] * 2, [0.05, 0.07])]
    pooled = prompts.pool_prompts([(0, [dense[0], learned[0], x[0]]), (900, [dense[1], learned[1], x[1]])])
    into = {}
    speed, text = _speed_and_kl(into, pooled[2], pooled[1])
    assert speed == pytest.approx(1.25)
    assert into["kl_difference"] == pytest.approx({"point": 0.02, "lo": 0.02, "hi": 0.02})
    assert "KL difference +0.0200 [+0.0200, +0.0200]" in text
    across = mean_difference_interval(pooled[2]["step_kl"], pooled[1]["step_kl"])
    assert across.lo < 0.019 and across.hi > 0.021


def test_every_variant_is_paired_with_the_learned_row_beside_it():
    dense, learned = _row("dense", [10.0] * 4, [0.0] * 4), _row("learned", [5.0, 6.0, 5.0, 6.0], [0.01] * 4)
    x = _row("learned-shared:2", [4.0, 4.0, 4.0, 4.0], [0.03] * 4)
    lone = _row("learned-shared:4", [4.0] * 4, [0.02] * 4, batch=8)  # no learned at batch 8: left out
    wide = dict(_row("learned+topology_sparse_merge", [4.0] * 4, [0.02] * 4), rows_per_request=4)  # beam rows: left out
    before = copy.deepcopy([dense, learned, x, lone, wide])
    got = paired_with_learned([dense, learned, x, lone, wide])
    assert [dense, learned, x, lone, wide] == before
    assert [e["variant"] for e in got] == ["learned-shared:2"]
    e = got[0]
    assert e["speed"] == pytest.approx(1.0 / ((4 / 5 + 4 / 6) / 2))  # the median of 4/5, 4/6, 4/5, 4/6, inverted
    assert (e["mean_kl"], e["learned_mean_kl"]) == pytest.approx((0.03, 0.01))
    assert e["kl_difference"] == pytest.approx({"point": 0.02, "lo": 0.02, "hi": 0.02})
    assert (e["top1_agreement"], e["learned_top1_agreement"]) == pytest.approx((1 - 0.12, 1 - 0.04))
    line = format_paired(got).splitlines()[2]
    assert line == (f"| 8192 | 1 | 1024 | learned-shared:2 | {e['speed']:.3f}x [{e['interval']['lo']:.3f}, {e['interval']['hi']:.3f}] "
                    "| 0.0300 (0.0100) | +0.0200 [+0.0200, +0.0200] | 0.880 (0.960) |")
    assert format_paired([]) is None
    merged = merge_runs([("a.json", {"rows": [dense, learned, x], "indexer": {
        "preset": "trained", "heads": 1, "dim": 64, "ratio_to_attention": 0.1, "layer_shapes": {}},
        "settings": {"contexts": [8192], "batches": [1]}})])
    assert merged["paired"][0]["variant"] == "learned-shared:2"
    assert PAIRED_HEADING in format_merged(merged, plot_name=None)


def test_rows_that_do_not_pool_are_refused():
    with pytest.raises(ValueError, match="expected at least one"):
        prompts.pool_rows([])
    a, b = _row("learned", [1.0], [0.0]), _row("learned", [1.0], [0.0], batch=8)
    with pytest.raises(ValueError, match=r"rows differ in \['context_lens', 'batch'\]"):
        prompts.pool_rows([(0, a), (1, b)])
    with pytest.raises(ValueError, match="different variants"):
        prompts.pool_prompts([(0, [_row("dense", [1.0], [0.0])]), (1, [_row("learned", [1.0], [0.0])])])


def test_the_per_prompt_table_names_each_prompt_and_the_largest_share():
    one = prompts.pool_prompts([(0, [_row("dense", [1.0], [0.0]), _row("learned", [1.0], [0.03])])])
    assert format_prompt_kl(one) is None  # one prompt: nothing to list
    pooled = prompts.pool_prompts([(0, [_row("dense", [1.0], [0.0]), _row("learned", [1.0], [0.03])]),
                                   (4000, [_row("dense", [1.0], [0.0]), _row("learned", [1.0], [0.01])])])
    text = format_prompt_kl(pooled)
    assert text.startswith("prompt offsets (tokens into the novel): context 8192: 0, 4000")
    assert "| 8192 | 1 | 1024 | learned | 0.0300 | 0.0100 | 0.0200 | 75% |" in text
    assert "| dense |" not in text
    merged = merge_runs([("a.json", {"rows": pooled, "indexer": {"preset": "trained", "heads": 1, "dim": 64,
                                                                 "ratio_to_attention": 0.1, "layer_shapes": {}},
                                     "settings": {"contexts": [8192], "batches": [1], "prompts": 2}})])
    assert "Mean KL to dense per prompt:" in format_merged(merged, plot_name=None)


def test_the_flag_is_checked_and_named_in_the_reconstructed_command(capsys):
    with pytest.raises(SystemExit):
        e2e.parse_args(["--prompts", "0"])
    assert "--prompts: expected >= 1, got 0" in capsys.readouterr().err
    assert e2e.parse_args([]).prompts == 1
    settings_ = {"contexts": [8192], "batches": [1, 8], "prompts": 4, "new_tokens": 30}
    assert "--prompts 4" in command_of(settings_)
    assert "--prompts" not in command_of({**settings_, "prompts": 1})


class _CharTokenizer:
    """One id per character, counting its calls' text lengths."""

    def __init__(self):
        self.seen = []

    def __call__(self, text, add_special_tokens=False):
        self.seen.append(len(text))
        return {"input_ids": [ord(c) for c in text]}


def test_the_windows_cut_the_novel_at_the_offsets(monkeypatch, tmp_path):
    novel = "".join(chr(97 + i % 26) for i in range(1000))
    corpus = types.SimpleNamespace(texts={"prideprejudice": novel}, source={})
    monkeypatch.setattr("benchmark.quality.text.ensure_austen_text", lambda _: corpus)
    loaded = types.SimpleNamespace(tokenizer=_CharTokenizer())
    (start, ids), = runner.prompt_windows(loaded, "prideprejudice", 50, tmp_path, 1)
    assert start == 0 and ids == [ord(c) for c in novel[:50]]
    assert loaded.tokenizer.seen == [400]  # one prompt: a prefix, not the whole novel
    got = runner.prompt_windows(loaded, "prideprejudice", 100, tmp_path, 4)
    assert [o for o, _ in got] == [0, 300, 600, 900]
    assert all(w == [ord(c) for c in novel[o : o + 100]] for o, w in got)
    with pytest.raises(SystemExit, match="--prompts: prideprejudice: the text has 1000 tokens: 902 prompts"):
        runner.prompt_windows(loaded, "prideprejudice", 100, tmp_path, 902)
    with pytest.raises(SystemExit, match="--contexts: prideprejudice: the text has 1000 tokens, fewer than"):
        runner.prompt_windows(loaded, "prideprejudice", 1001, tmp_path, 1)
