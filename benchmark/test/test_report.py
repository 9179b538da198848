"""The main job in --quick mode: every section of report.json is present and sane."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmark.validation import report as report


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    assert report.main(["--quick", "--out-dir", str(out), "--device", "cpu"]) == 0
    return out, json.loads((out / "report.json").read_text())


def test_every_section_file_and_plot(quick_report):
    out, rep = quick_report
    assert set(rep["parts"]) == set(report.PARTS)
    for name in ("report.md", "micro.json", "micro_warm.json", "policy.json", "e2e.json", "speedup_vs_budget.png",
                 "e2e_breakdown.png", "e2e_step_vs_batch.png", "quality/results.json",
                 "quality/ppl_ratio_vs_budget.png"):
        assert (out / name).exists(), name
    md = (out / "report.md").read_text()
    for heading in ("Attention microbenchmark", "Policy overhead", "End-to-end decode step", "Quality gate"):
        assert heading in md
    assert "| seq_len | selected | dense ms (cold)" in md and "| context | B | rows | variant" in md
    assert rep["parts"]["micro"]["args"]["cache"] == "cold" and rep["parts"]["micro"]["warm"]["args"]["cache"] == "warm"


def test_sane_values_and_consistent_ratios(quick_report):
    _, rep = quick_report
    for row in rep["parts"]["micro"]["rows"]:
        assert row["sparse_selected_ms"] > 0 and row["dense_sdpa_ms"] > 0
        assert row["fraction_of_ideal"] == pytest.approx(row["speedup"] / row["ideal_speedup"])
    for row in rep["parts"]["policy"]["rows"]:
        assert row["policy_ms"] > 0 and row["topk_ms"] > 0
        assert row["policy_over_topk"] == pytest.approx(row["policy_ms"] / row["topk_ms"])
    rows = rep["parts"]["e2e"]["rows"]
    assert {r["batch"] for r in rows} == {1, 4}  # --quick: two batch sizes for the step-vs-batch plot
    for row in rows:
        dense = next(r for r in rows if (r["context"], r["batch"]) == (row["context"], row["batch"])
                     and r["variant"] == "dense")
        assert row["step_ms_median"] > 0 and 0 <= row["top1_agreement"] <= 1 and row["mean_kl"] >= 0
        assert row["speedup_vs_dense"] == pytest.approx(dense["step_ms_median"] / row["step_ms_median"])
        # Each timed step's parts add up to its total (rest is the remainder, 0 when the timed
        # parts overrun the total); the medians of parts need not add up to the median total.
        per_step = row["step_parts_ms"]
        assert set(per_step) == {"indexer", "policy", "attention", "rest"}
        for i, total in enumerate(row["step_ms"]):
            timed = sum(per_step[p][i] for p in ("indexer", "policy", "attention"))
            rest = per_step["rest"][i]
            assert rest >= 0
            assert timed + rest == pytest.approx(total, rel=1e-9, abs=1e-9) or (rest == 0 and timed > total), (i, row)
        for p in per_step:
            assert len(per_step[p]) == len(row["step_ms"])
            assert row[f"{p}_ms"] == pytest.approx(statistics.median(per_step[p]))


def test_gate_and_summary_fields(quick_report):
    _, rep = quick_report
    gate = rep["parts"]["quality"]["gate"]
    assert {g["mode"] for g in gate} == {"topology_sparse_merge", "topology_compress_sparse", "topology_only"}
    assert all(g["status"] in ("PASS", "FAIL", "INCOMPLETE") for g in gate)
    summary = rep["summary"]
    for key in ("gate", "where_time_goes", "best_e2e_tradeoff", "micro_fraction_of_ideal", "policy_targets"):
        assert key in summary
    shares = summary["where_time_goes"]
    assert sum(shares[p] for p in ("indexer", "policy", "attention", "rest")) == pytest.approx(1.0)
    assert rep["environment"]["torch"]


def test_bad_part_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        report.parse_args(["--parts", "speed"])
    assert "--parts" in capsys.readouterr().err


def test_the_report_writes_only_its_declared_outputs(quick_report):
    out, _ = quick_report
    assert {p.name for p in out.iterdir()} <= set(report.REPORT_OUTPUTS)


def test_a_rerun_replaces_its_own_outputs_and_keeps_everything_else(tmp_path):
    out = tmp_path / "report"
    (out / "quality").mkdir(parents=True)
    (out / "quality" / "results.json").write_text("{}")
    (out / "report.md").write_text("old")
    (out / "indexer_smollm2").mkdir()
    (out / "indexer_smollm2" / "recall.md").write_text("keep")
    (out / "notes.txt").write_text("keep")
    report.clear_previous_report(out)
    assert sorted(p.name for p in out.iterdir()) == ["indexer_smollm2", "notes.txt"]
    assert (out / "indexer_smollm2" / "recall.md").read_text() == "keep"
    fresh = tmp_path / "a" / "b"
    report.clear_previous_report(fresh)
    assert fresh.is_dir() and not any(fresh.iterdir())
