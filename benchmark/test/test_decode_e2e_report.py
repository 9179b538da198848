"""The e2e report without a model: tables grouped by proxy indexer and rows per request,
targets paired within a run's preset, the JSON of several runs merged into one report."""

from __future__ import annotations

import json

import pytest

from benchmark.e2e import cli as e2e
from benchmark.e2e import report

DSA = ("dsa-ratio", 1, 64)  # SmolLM2's dsa-ratio preset: 1 head x 64 dims
MODEL = ("model", 3, 192)  # its model preset: G = 3 heads x Hkv * D = 192 dims


def row(variant, context, batch, ms, indexer=DSA, rows_per_request=1, dense_ms=100.0, budget=1024):
    """Every field the table reads, with a recognisable step time."""
    preset, heads, dim = indexer
    return {"variant": variant, "context": context, "batch": batch, "rows_per_request": rows_per_request,
            "budget": budget, "indexer_preset": preset, "indexer_heads": heads, "indexer_dim": dim,
            "step_ms_median": ms, "step_ms_p90": ms * 1.1, "tokens_per_s": batch * rows_per_request * 1e3 / ms,
            "speedup_vs_dense": dense_ms / ms, "kv_bytes_vs_dense": 0.5, "top1_agreement": 1.0, "mean_kl": 0.0,
            "peak_bytes": 2**20, **{f"{p}_ms": ms / 4 for p in report.PARTS}}


def payload(rows, indexer=DSA, next_n=0, contexts=(8192,), batches=(1, 8)):
    preset, heads, dim = indexer
    settings = {"contexts": list(contexts), "batches": list(batches), "next_n": next_n, "new_tokens": 8,
                "warmup": 2, "budget": 1024, "indexer_preset": preset, "indexer_heads": None, "indexer_dim": None,
                "num_layers": None, "length_spread": 1 / 16}
    return {"environment": {"threads": 2, "device": "x86_64", "torch": "2.x"}, "model": {},
            "indexer": {"preset": preset, "heads": heads, "dim": dim, "ratio_to_attention": 0.056},
            "settings": settings, "rows": rows, "targets": report.targets(rows)}


def table_blocks(markdown):
    """``{heading: [table lines]}`` of a format_table text."""
    blocks = {}
    for block in markdown.split("\n\n"):
        lines = block.split("\n")
        if lines[0].startswith("**"):
            heading = lines[0]
        elif lines[0].startswith("| context"):
            blocks[heading] = lines[2:]
    return blocks


def test_tables_are_grouped_by_indexer_and_rows_per_request():
    rows = [row("dense", 2048, 1, 50.0), row("learned", 2048, 1, 40.0),
            row("dense", 2048, 1, 90.0, rows_per_request=2), row("learned", 2048, 1, 70.0, rows_per_request=2),
            row("dense", 2048, 1, 55.0, indexer=MODEL), row("learned", 2048, 1, 60.0, indexer=MODEL),
            row("dense", 1024, 1, 30.0)]  # a smaller context after: sorted to the top of its table
    blocks = table_blocks(e2e.format_table(rows))
    assert list(blocks) == [
        "**Untrained proxy indexer `dsa-ratio` (1 head x 64 dims), W = 1024, 1 row per request (greedy decode)**",
        "**Untrained proxy indexer `dsa-ratio` (1 head x 64 dims), W = 1024, 2 rows per request (--next-n 1, "
        "speculative verification)**",
        "**Untrained proxy indexer `model` (3 heads x 192 dims), W = 1024, 1 row per request (greedy decode)**",
    ]
    single, multi, model = blocks.values()
    assert [line.split(" | ")[:4] for line in single] == [["| 1024", "1", "1", "dense"], ["| 2048", "1", "1", "dense"],
                                                          ["| 2048", "1", "1", "learned"]]
    assert all(line.split(" | ")[2] == "2" for line in multi) and len(multi) == 2
    assert "60.0 (66.0)" in model[1]  # the model preset's learned row, median (p90)
    header = e2e.format_table(rows).split("\n")[2]
    assert header == "| " + " | ".join(report.MARKDOWN_COLUMNS) + " |"


def test_a_trained_file_with_layer_shapes_gets_its_own_table_naming_them():
    trained = dict(indexer_preset="trained", indexer_heads=1, indexer_dim=64)
    shaped = dict(trained, indexer_layer_shapes={"19": "4x16", "0": "4x16", "5": "2x32"})
    rows = [{**row("dense", 2048, 1, 50.0), **trained}, {**row("learned", 2048, 1, 40.0), **trained},
            {**row("dense", 2048, 1, 51.0), **shaped}, {**row("learned", 2048, 1, 41.0), **shaped}]
    blocks = table_blocks(e2e.format_table(rows))
    assert list(blocks) == [
        "**Trained indexer `trained` (1 head x 64 dims), W = 1024, 1 row per request (greedy decode)**",
        "**Trained indexer `trained` (1 head x 64 dims; layers 0, 19: 4 heads x 16 dims; layer 5: 2 heads x 32 dims), "
        "W = 1024, 1 row per request (greedy decode)**",
    ]
    assert [len(b) for b in blocks.values()] == [2, 2]  # the files' rows are not paired with each other
    # A run written before rows carried the field: its run-level record names the layers.
    old = payload([{**row("learned", 2048, 1, 41.0), **trained}], indexer=("trained", 1, 64))
    old["indexer"]["layer_shapes"] = {"0": "4x16"}
    merged = report.merge_runs([("old.json", old)])
    assert merged["rows"][0]["indexer_layer_shapes"] == {"0": "4x16"}


def test_targets_pair_compress_with_learned_of_its_own_preset():
    rows = [row("dense", 8192, 8, 100.0), row("topology_only_noscan", 8192, 8, 70.0),
            row("learned", 8192, 1, 50.0), row("learned+topology_compress_sparse", 8192, 1, 50.5),
            row("learned", 8192, 1, 80.0, indexer=MODEL),
            row("learned+topology_compress_sparse", 8192, 1, 90.0, indexer=MODEL),
            row("learned+topology_compress_sparse", 8192, 8, 90.0, rows_per_request=2)]  # multi-row: no target
    found = {(t["batch"], t["indexer_preset"]): t for t in report.targets(rows)
             if "sparse_merge" not in t["target"] and " policy <= " not in t["target"]
             and not t["target"].startswith("a configuration ")}
    assert found[(8, "dsa-ratio")]["passed"] is True  # noscan 100 / 70 = 1.43x
    assert found[(1, "dsa-ratio")]["value"] == pytest.approx(1.01) and found[(1, "dsa-ratio")]["passed"]
    assert found[(1, "model")]["value"] == pytest.approx(90 / 80) and not found[(1, "model")]["passed"]
    assert found[(8, None)]["passed"] is None  # compress at batch 8, one row per request: not run
    text = report.format_targets(report.targets(rows))
    assert "NOT RUN: learned+topology_compress_sparse within 3% of learned step time, batch 8" in text
    assert "FAIL: learned+topology_compress_sparse within 3% of learned step time, batch 1 (context 8192, " \
           "indexer model): step time ratio 1.125" in text


def test_the_step_ratio_pairs_the_interleaved_steps():
    """Step i of a variant and of learned ran in the same round: the target's ratio is the
    median of the paired ratios, which a slow patch hitting both steps leaves alone (the
    ratio of the medians here would be 1.5); rows without per-step times use the medians."""
    base, merged = row("learned", 8192, 1, 100.0), row("learned+topology_sparse_merge", 8192, 1, 150.0)
    base["step_ms"] = [100.0, 200.0, 100.0, 200.0, 100.0]
    merged["step_ms"] = [103.0, 202.0, 101.0, 204.0, 150.0]  # ratios 1.03, 1.01, 1.01, 1.02, 1.5
    assert report.step_ratio(merged, base) == pytest.approx(1.02)
    t = next(t for t in report.targets([base, merged]) if t["target"].startswith("learned+topology_sparse_merge within"))
    assert t["value"] == pytest.approx(1.02) and t["passed"]
    del merged["step_ms"]
    assert report.step_ratio(merged, base) == pytest.approx(1.5)  # older JSON: the medians
    merged["step_ms"] = [150.0] * 4  # a different number of steps: not paired
    assert report.step_ratio(merged, base) == pytest.approx(1.5)


def test_nothing_run_is_not_run():
    text = report.format_targets(report.targets([row("dense", 2048, 32, 100.0)]))
    # noscan, both merge modes at batch 1 and 8, structure and any configuration at learned's
    # quality at batch 1 and 8, both policy shares
    assert text.count("NOT RUN") == 11 and "PASS" not in text and "FAIL" not in text


def test_merge_mode_targets_and_the_policy_share():
    rows = [row("learned", 8192, 1, 100.0), row("learned+topology_sparse_merge", 8192, 1, 104.0),
            row("learned+topology_compress_sparse", 8192, 1, 102.0),
            row("learned", 2048, 8, 200.0), row("learned+topology_sparse_merge", 2048, 8, 205.0)]
    rows[1]["policy_ms"], rows[2]["policy_ms"] = 3.2, 2.5
    text = report.format_targets(report.targets(rows))
    assert "FAIL: learned+topology_sparse_merge within 3% of learned step time, batch 1 (context 8192, " \
           "indexer dsa-ratio): step time ratio 1.040" in text
    assert "PASS: learned+topology_compress_sparse within 3% of learned step time, batch 1 (context 8192, " \
           "indexer dsa-ratio): step time ratio 1.020" in text
    assert "PASS: learned+topology_sparse_merge within 3% of learned step time, batch 8 (context 2048, " \
           "indexer dsa-ratio): step time ratio 1.025" in text
    assert "FAIL: learned+topology_sparse_merge policy <= 3% of its step, batch 1 (context 8192, " \
           "indexer dsa-ratio): policy 3.1% of the step" in text
    assert "PASS: learned+topology_compress_sparse policy <= 3% of its step, batch 1 (context 8192, " \
           "indexer dsa-ratio): policy 2.5% of the step" in text


def test_merge_keeps_every_row_and_names_its_source():
    a = payload([row("dense", 8192, 8, 100.0), row("topology_only_noscan", 8192, 8, 60.0)])
    b = payload([row("dense", 8192, 8, 110.0, indexer=MODEL), row("learned", 8192, 8, 90.0, indexer=MODEL)],
                indexer=MODEL)
    merged = report.merge_runs([("a.json", a), ("b.json", b)])
    assert [r["source"] for r in merged["rows"]] == ["a.json"] * 2 + ["b.json"] * 2
    assert all(set(r) == set(a["rows"][0]) | {"source"} for r in merged["rows"])  # every field kept
    assert [r["source"] for r in merged["runs"]] == ["a.json", "b.json"]
    assert merged["targets"][0]["passed"] is True
    with pytest.raises(ValueError, match="b.json: row .* is also in a.json"):
        report.merge_runs([("a.json", a), ("b.json", a)])
    with pytest.raises(ValueError, match=r"c.json: expected a topology_kv_decode_e2e --json file, missing keys \['rows'"):
        report.merge_runs([("c.json", {"settings": {}})])


def test_command_of_omits_defaults():
    settings = payload([], next_n=1, contexts=(2048,), batches=(32,))["settings"]
    assert report.command_of(settings) == ("python benchmark/topology_kv_decode_e2e.py --contexts 2048 --batches 32 "
                                           "--next-n 1 --new-tokens 8 --warmup 2 --budget 1024 "
                                           "--indexer-preset dsa-ratio")
    settings.update(variants=["dense", "learned"], threads=2, novel="emma")
    assert report.command_of(settings) == ("python benchmark/topology_kv_decode_e2e.py --contexts 2048 --batches 32 "
                                           "--variants dense learned --next-n 1 --new-tokens 8 --warmup 2 "
                                           "--budget 1024 --indexer-preset dsa-ratio --novel emma --threads 2")
    settings["variants"] = list(e2e.VARIANTS)  # all of them: the default, left out
    assert "--variants" not in report.command_of(settings)


def test_merge_command_writes_one_report_and_plot(tmp_path, capsys):
    runs = {
        "dsa_8k.json": payload([row("dense", 8192, b, 100.0 * b) for b in (1, 8)]
                               + [row("learned", 8192, b, 80.0 * b, dense_ms=100.0 * b) for b in (1, 8)]),
        "model_8k.json": payload([row("dense", 8192, 1, 100.0, indexer=MODEL),
                                  row("learned", 8192, 1, 95.0, indexer=MODEL)], indexer=MODEL),
        "dsa_2k_next1.json": payload([row("dense", 2048, 32, 300.0, rows_per_request=2),
                                      row("learned", 2048, 32, 200.0, rows_per_request=2, dense_ms=300.0)],
                                     next_n=1, contexts=(2048,), batches=(32,)),
    }
    for name, content in runs.items():
        (tmp_path / name).write_text(json.dumps(content))
    out = tmp_path / "merged"
    assert e2e.main(["--merge", *(str(tmp_path / n) for n in runs), "--out", str(out)]) == 0
    md = (out / "e2e.md").read_text()
    assert md == capsys.readouterr().out.rstrip("\n") + "\n"
    assert md.count("| context | B | rows | variant") == 3
    assert "Untrained proxy indexer `model` (3 heads x 192 dims)" in md and "2 rows per request (--next-n 1" in md
    assert "--contexts 2048 --batches 32 --next-n 1" in md and "![step time vs batch](e2e_step_vs_batch.png)" in md
    assert "NOT RUN: topology_only_noscan" in md
    merged = json.loads((out / "e2e.json").read_text())
    assert len(merged["rows"]) == 4 + 2 + 2 and len(merged["runs"]) == 3
    assert (out / report.PLOT_NAME).stat().st_size > 0
    assert (out / report.PARETO_NAME).stat().st_size > 0 and "![step time vs KL](e2e_pareto.png)" in md


def test_a_budget_sweep_is_one_table_per_budget_and_one_pareto_point_each(tmp_path):
    rows = []
    for w in (256, 1024):
        rows += [row("dense", 8192, 1, 100.0, budget=w), row("learned", 8192, 1, 60.0 + w / 100, budget=w),
                 row("learned-shared:2+topology_sparse_merge", 8192, 1, 50.0 + w / 100, budget=w)]
    for r in rows:
        r["mean_kl"] = 0.01 if r["variant"] != "dense" else 0.0
    blocks = table_blocks(report.format_table(rows))
    assert [h for h in blocks] == ["**Untrained proxy indexer `dsa-ratio` (1 head x 64 dims), W = 256, 1 row per "
                                   "request (greedy decode)**",
                                   "**Untrained proxy indexer `dsa-ratio` (1 head x 64 dims), W = 1024, 1 row per "
                                   "request (greedy decode)**"]
    assert report.plot_pareto(rows, tmp_path / "p.png").stat().st_size > 0
    settings = payload(rows)["settings"]
    settings["budget"] = [256, 1024]
    assert "--budget 256 1024" in report.command_of(settings)
    args = e2e.parse_args(["--budget", "256", "1024"])
    assert args.budget == [256, 1024]
    with pytest.raises(SystemExit):
        e2e.parse_args(["--budget", "256", "256"])


def test_merge_errors_name_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        e2e.parse_args(["--merge", "a.json"])
    assert "--merge and --out" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--merge: .*No such file"):
        e2e.main(["--merge", str(tmp_path / "absent.json"), "--out", str(tmp_path / "out")])
    run = tmp_path / "a.json"
    run.write_text(json.dumps(payload([row("dense", 2048, 1, 10.0)])))
    with pytest.raises(SystemExit, match="--merge: .*a.json: row .* is also in .*a.json"):
        e2e.main(["--merge", str(run), str(run), "--out", str(tmp_path / "out")])


def test_the_runs_line_names_the_device():
    cpu = payload([row("dense", 8192, 1, 100.0)])
    assert report.machine_of(cpu["environment"]) == "2 threads on x86_64"  # a run without device_type: the CPU
    gpu = payload([row("dense", 8192, 8, 10.0)])
    gpu["environment"].update(device_type="cuda", cuda_device="NVIDIA H200", threads=16)
    gpu["settings"]["device"] = "cuda"
    md = report.format_merged(report.merge_runs([("cpu.json", cpu), ("gpu.json", gpu)]), plot_name=None)
    runs = [line for line in md.splitlines() if line.startswith("- `")]
    assert "; 2 threads on x86_64, torch 2.x" in runs[0] and "--device" not in runs[0]
    assert "; CUDA NVIDIA H200 (host x86_64, 16 threads), torch 2.x" in runs[1]
    assert "--budget 1024 --indexer-preset dsa-ratio --device cuda`" in runs[1]


def test_iso_quality_is_the_smallest_budget_as_good_as_learned_at_an_eighth_of_the_context():
    def at(variant, w, ms, kl, batch=1):
        r = row(variant, 8192, batch, ms, budget=w)
        r.update(mean_kl=kl, attention_ms=ms / 2, kv_bytes_per_step=1000.0 * w)
        return r

    M, S, NEVER = "learned+topology_sparse_merge", "learned-shared:2", "learned-shared:4"
    rows = [at("dense", w, 300.0, 0.0) for w in (512, 1024, 2048)]
    rows += [at("learned", 512, 90.0, 0.08), at("learned", 1024, 100.0, 0.05), at("learned", 2048, 120.0, 0.02)]
    # The merge is as good as learned@1024 already at 512; sharing alone only at 2048; one never.
    rows += [at(M, 512, 80.0, 0.05), at(M, 1024, 95.0, 0.01), at(M, 2048, 130.0, 0.005)]
    rows += [at(S, 512, 60.0, 0.2), at(S, 1024, 70.0, 0.06), at(S, 2048, 90.0, 0.049)]
    rows += [at(NEVER, 1024, 50.0, 0.3)]
    rows += [at("learned", 512, 40.0, 0.1, batch=8)]  # batch 8 has no learned at 1024: no entry
    entries = {e["variant"]: e for e in report.iso_quality(rows)}
    assert set(entries) == {"learned", M, S, NEVER}
    assert entries["learned"]["budget"] == 1024 and entries["learned"]["step"] == 1.0
    m = entries[M]
    assert (m["budget"], m["mean_kl"], m["reference_kl"]) == (512, 0.05, 0.05)
    assert m["step"] == pytest.approx(0.8) and m["attention"] == pytest.approx(0.8) and m["kv_read"] == 0.5
    s = entries[S]
    assert (s["budget"], s["step"], s["kv_read"]) == (2048, pytest.approx(0.9), 2.0) and s["budgets"] == [512, 1024, 2048]
    assert entries[NEVER]["budget"] is None
    text = report.format_iso_quality(report.iso_quality(rows))
    assert "| 8192 | 1 | learned+topology_sparse_merge | 512,1024,2048 | 512 | 0.0500 (0.0500) | 0.800x | 0.800x | 0.500x |" in text
    assert "| 8192 | 1 | learned-shared:4 | 1024 | none | - (0.0500) | - | - | - |" in text
    assert report.format_iso_quality([]) == "" and report.iso_quality([r for r in rows if r["budget"] != 1024]) == []
    merged = report.merge_runs([("a", payload(rows))])
    assert merged["iso_quality"] == report.iso_quality(rows) and "Iso-quality budgets" in report.format_merged(merged)


def test_the_step_target_prints_its_interval_and_whether_it_settles_the_bound():
    """Ten paired steps: the sign-test interval is [r_(2), r_(9)] (97.9 %); one that holds
    1.03 says the run does not settle the target, one wholly above it says nothing more."""
    base, merged = row("learned", 8192, 1, 100.0), row("learned+topology_sparse_merge", 8192, 1, 104.0)
    base["step_ms"] = [100.0] * 10
    merged["step_ms"] = [101.0, 102.0, 103.0, 104.0, 104.0, 104.0, 105.0, 106.0, 107.0, 120.0]
    t = next(t for t in report.targets([base, merged]) if t["target"].startswith("learned+topology_sparse_merge within")
             and t["batch"] == 1)
    assert t["value"] == pytest.approx(1.04) and not t["passed"]
    assert (t["interval"]["lo"], t["interval"]["hi"]) == pytest.approx((1.02, 1.07))
    line = next(x for x in report.format_targets([t]).splitlines())
    own = "; its indexer + policy columns alone: 1.020 (attention and the rest taken as learned's)"
    assert line.endswith("step time ratio 1.040 [1.020, 1.070] (98% sign-test interval over 10 steps; "
                         "it holds the bound, not settled by this run)" + own)
    merged["step_ms"] = [x + 10.0 for x in merged["step_ms"]]  # every ratio above 1.1
    t = next(t for t in report.targets([base, merged]) if t["target"].startswith("learned+topology_sparse_merge within")
             and t["batch"] == 1)
    assert report.format_targets([t]).endswith("step time ratio 1.140 [1.120, 1.170] (98% sign-test interval over "
                                               "10 steps)" + own)


def test_the_step_target_counts_the_columns_where_the_work_differs():
    """Hand-computed: (81 + 6.2) - (80 + 2) = 5.2 ms more over learned's 400 ms step -> 1.013,
    whatever the attention and rest columns did (here 10 ms slower: noise it leaves out)."""
    base, merged = row("learned", 2048, 8, 400.0), row("learned+topology_sparse_merge", 2048, 8, 420.0)
    base.update(indexer_ms=80.0, policy_ms=2.0, attention_ms=200.0, rest_ms=118.0)
    merged.update(indexer_ms=81.0, policy_ms=6.2, attention_ms=210.0, rest_ms=122.8)
    t = next(t for t in report.targets([base, merged]) if t["target"].startswith("learned+topology_sparse_merge within")
             and t["batch"] == 8)
    assert t["value"] == pytest.approx(1.05) and t["own_columns_ratio"] == pytest.approx(1.013)
    assert report.format_targets([t]).endswith("step time ratio 1.050; its indexer + policy columns alone: 1.013 "
                                               "(attention and the rest taken as learned's)")
    del merged["policy_ms"]  # an older JSON without the column: no estimate, the line as before
    t = next(t for t in report.targets([base, merged]) if t["target"].startswith("learned+topology_sparse_merge within")
             and t["batch"] == 8)
    assert t["own_columns_ratio"] is None and report.format_targets([t]).endswith("step time ratio 1.050")


def test_the_quality_target_prints_the_speed_interval_and_the_kl_difference():
    base = {**row("learned", 8192, 1, 100.0), "mean_kl": 0.05, "step_ms": [100.0] * 6,
            "step_kl": [0.05, 0.04, 0.06, 0.05, 0.05, 0.05]}
    shared = {**row("learned-shared:2+topology_sparse_merge", 8192, 1, 80.0), "mean_kl": 0.045,
              "step_ms": [78.0, 79.0, 80.0, 80.0, 81.0, 82.0], "step_kl": [0.045, 0.035, 0.055, 0.045, 0.045, 0.045]}
    t = next(t for t in report.targets([base, shared]) if t["target"].startswith("a configuration with structure")
             and t["batch"] == 1)
    assert t["passed"] and t["value"] == pytest.approx(1.25)
    # six steps: [min, max] of the ratios (0.78 .. 0.82), inverted
    assert (t["interval"]["lo"], t["interval"]["hi"]) == pytest.approx((1 / 0.82, 1 / 0.78))
    assert t["kl_difference"]["point"] == pytest.approx(-0.005) and t["kl_difference"]["hi"] == pytest.approx(-0.005)
    assert t["detail"].endswith(f"speed interval [{1 / 0.82:.3f}, {1 / 0.78:.3f}]; KL difference -0.0050 "
                                "[-0.0050, -0.0050]")


def test_a_near_miss_prints_the_closest_configuration_with_its_kl_difference():
    """Hand-computed: KL per step 0.05, 0.06 against learned's 0.04, 0.05 -> +0.0100 in both
    steps; speed 100 / 80 = 1.25 in both."""
    base = {**row("learned", 8192, 8, 100.0), "mean_kl": 0.045, "step_ms": [100.0, 100.0], "step_kl": [0.04, 0.05]}
    shared = {**row("learned-shared:2+topology_sparse_merge", 8192, 8, 80.0), "mean_kl": 0.055,
              "step_ms": [80.0, 80.0], "step_kl": [0.05, 0.06]}
    t = next(t for t in report.targets([base, shared]) if t["target"].startswith("a configuration with structure")
             and t["batch"] == 8)
    assert t["passed"] is False and t["value"] is None and "interval" not in t
    assert t["closest"]["kl_difference"]["point"] == pytest.approx(0.01)
    assert t["detail"] == ("no configuration with structure has mean KL <= learned's (0.0450); the closest: "
                           "learned-shared:2+topology_sparse_merge 1.250x learned's step (paired), mean KL 0.0550 vs "
                           "learned's 0.0450; speed interval [1.250, 1.250]; KL difference +0.0100 [+0.0100, +0.0100]")


def test_the_closest_is_judged_against_its_own_budgets_learned():
    """A budget sweep: at W = 512 the shared row is 0.01 above its learned (0.06 vs 0.05), at
    W = 1024 0.02 above (0.03 vs 0.01), though its KL there is the lower one: the closest is
    the W = 512 row."""
    rows = []
    for budget, base_kl, kl in [(512, 0.05, 0.06), (1024, 0.01, 0.03)]:
        rows += [{**row("learned", 8192, 1, 100.0, budget=budget), "mean_kl": base_kl},
                 {**row("learned-shared:2+topology_sparse_merge", 8192, 1, 80.0, budget=budget), "mean_kl": kl}]
    t = next(t for t in report.targets(rows) if t["target"].startswith("a configuration with structure")
             and t["batch"] == 1)
    assert t["passed"] is False
    assert t["closest"]["mean_kl"] == pytest.approx(0.06)
    assert t["detail"].startswith("no configuration with structure has mean KL <= learned's (0.0500); the closest: ")
    assert "mean KL 0.0600 vs learned's 0.0500" in t["detail"]


def test_a_note_when_the_timed_steps_are_not_whole_cycles():
    three = e2e.parse_args(["--variants", "learned", "learned+topology_sparse_merge", "learned+topology_compress_sparse",
                            "--new-tokens", "12", "--warmup", "2"])
    assert e2e.cycle_note(three) == ("note: --new-tokens 12 - --warmup 2 = 10 timed steps, not whole cycles of the "
                                     "balanced order of 3 variants (6 steps each); --new-tokens 14 balances them")
    three.new_tokens = 14
    assert e2e.cycle_note(three) is None
    assert e2e.cycle_note(e2e.parse_args(["--variants", "learned", "--new-tokens", "5", "--warmup", "1"])) is None


def test_the_pareto_plot_tells_up_to_forty_variants_apart():
    styles = report.variant_styles([f"v{i}" for i in range(40)])
    assert len(set(styles.values())) == 40
    assert styles["v0"] == (0, "o", "-") and styles["v10"] == (0, "s", "--") and styles["v13"] == (3, "s", "--")
