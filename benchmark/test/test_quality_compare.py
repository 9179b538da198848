"""Tests of the before/after comparison of quality runs (benchmark/topology_kv_quality_compare.py)."""

from __future__ import annotations

import json

import pytest

from benchmark.quality import compare_cli as cli
from benchmark.quality.compare import compare_rows, load_runs, markdown_table, recall_wins
from benchmark.quality.errors import UsageError


def _results(ppl, recall, contexts=(100,)):
    """A minimal results.json: cells of (selector -> ppl) at budget 1/4, per-layer recall."""
    cells = []
    for sel, value in ppl.items():
        per_layer = {str(i): {"recall_mean": r} for i, r in enumerate(recall.get(sel, []))}
        mean = sum(recall[sel]) / len(recall[sel]) if sel in recall else None
        cells.append({"context": contexts[0], "budget": "1/4", "width": 25, "selector": sel, "ppl": value,
                      "ppl_ratio": value / 10.0, "layers": {"recall_mean": mean}, "per_layer": per_layer})
    settings = {"model": {"gguf_sha256": "abc"}, "text": {"novel": "n", "windows": 1, "window_seed": 0},
                "grid": {"contexts": list(contexts), "budgets": ["1/4"], "metric_stride": 1,
                         "selectors": list(ppl)}}
    return {"settings": settings, "cells": cells, "dense": {}}


def _write(tmp_path, name, data):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_rows_hand_computed(tmp_path):
    before = _results({"learned": 20.0, "locality": 25.0, "oracle": 16.0, "topology_only": 24.0},
                      {"locality": [0.5, 0.6, 0.7], "topology_only": [0.6, 0.6, 0.8]})
    runs = load_runs([("before", _write(tmp_path, "b", before))])
    rows = {r["selector"]: r for r in compare_rows(runs)}
    topo = rows["topology_only"]
    assert topo["vs_learned"] == pytest.approx(0.2)  # 24 / 20 - 1
    assert topo["vs_locality"] == pytest.approx(-0.04)  # 24 / 25 - 1
    assert topo["vs_oracle"] == pytest.approx(0.5)  # 24 / 16 - 1
    assert topo["recall_wins_vs_locality"] == (2, 3)  # layer 1 is a tie
    assert rows["locality"]["recall_wins_vs_locality"] is None
    assert "| 100 | 1/4 | 25 | topology_only | before | 24.000 | +20.00% | -4.00% | +50.00% | 0.667 | 2/3 |" in (
        markdown_table(compare_rows(runs)))


def test_recall_wins_ignores_summation_noise():
    a = {"per_layer": {"0": {"recall_mean": 0.5 + 1e-7}, "1": {"recall_mean": 0.6}}}
    b = {"per_layer": {"0": {"recall_mean": 0.5}, "1": {"recall_mean": 0.5}}}
    assert recall_wins(a, b) == (1, 2)


def test_different_grids_are_refused(tmp_path):
    base = _results({"learned": 20.0}, {})
    base["dense"] = {"100": {"ppl": 10.0}}
    other_budgets = json.loads(json.dumps(base))
    other_budgets["settings"]["grid"]["budgets"] = ["1/8"]
    other_window = json.loads(json.dumps(base))
    other_window["dense"]["100"]["ppl"] = 10.5
    more_contexts = _results({"learned": 20.0}, {}, contexts=(100, 200))
    more_contexts["dense"] = {"100": {"ppl": 10.0}, "200": {"ppl": 9.0}}
    a = _write(tmp_path, "a", base)
    with pytest.raises(UsageError, match="grid.budgets is \\['1/8'\\], but a has \\['1/4'\\]"):
        load_runs([("a", a), ("b", _write(tmp_path, "b", other_budgets))])
    with pytest.raises(UsageError, match="dense perplexity at context 100 is 10.500000, but a has 10.000000"):
        load_runs([("a", a), ("w", _write(tmp_path, "w", other_window))])
    assert len(load_runs([("a", a), ("m", _write(tmp_path, "m", more_contexts))])) == 2  # shared 100 matches
    with pytest.raises(UsageError, match="cannot read results.json"):
        load_runs([("x", str(tmp_path / "missing.json"))])


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    data = _results({"learned": 20.0, "locality": 25.0, "topology_only": 24.0},
                    {"learned": [0.9, 0.9], "locality": [0.5, 0.6], "topology_only": [0.6, 0.7]})
    a, b = _write(tmp_path, "a", data), _write(tmp_path, "b", data)
    out = tmp_path / "out"
    assert cli.main(["--run", f"before={a}", "--run", f"after={b}", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("| topology_only |") == 2
    topo = [line for line in printed.splitlines() if "| topology_only |" in line]
    assert "| before |" in topo[0] and "| after |" in topo[1]  # runs in the order given
    payload = json.loads((out / "compare.json").read_text())
    assert payload["runs"] == ["before", "after"] and len(payload["rows"]) == 6
    assert (out / "layer_recall.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        cli.parse_args(["--run", "no-equals-sign"])


def test_raised_gate_side_by_side(tmp_path):
    from benchmark.quality.compare import raised_gate_table

    a = _results({"learned": 20.0}, {})
    b = _results({"learned": 20.0}, {})
    a["raised_gate"] = [{"name": "witness signal (ctx 100)", "passed": False, "detail": "1/4: 0/3 layers"}]
    b["raised_gate"] = [{"name": "witness signal (ctx 100)", "passed": True, "detail": "1/4: 3/3 layers"},
                        {"name": "failure 'noisy' (ctx 100)", "passed": None, "detail": "not measured"}]
    table = raised_gate_table([("before", a), ("after", b)])
    assert "| witness signal (ctx 100) | **FAIL** 1/4: 0/3 layers | **PASS** 1/4: 3/3 layers |" in table
    assert "| failure 'noisy' (ctx 100) | - | **n/a** not measured |" in table
    assert raised_gate_table([("x", _results({"learned": 20.0}, {}))]) == ""
