"""Smoke test of the policy overhead benchmark: runs a tiny grid, checks the output."""

from __future__ import annotations

import json
import os

from fractions import Fraction

import pytest
import torch

from benchmark.candidates import policy_bench as bench

DEVICE = os.environ.get("TOPOLOGY_KV_TEST_DEVICE", "cpu")  # "cuda" in the _cuda_manual target


def test_tiny_grid_prints_table_targets_and_json(tmp_path, capsys):
    path = tmp_path / "policy.json"
    rc = bench.main(
        ["--rows", "4", "--lengths", "8192", "--width", "64", "--rounds", "2", "--warmup", "0",
         "--reference-rows", "2", "--json", str(path), "--device", DEVICE]
    )
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# cold: each call right after writing ") and "targets read the cold figures" in out[0]
    assert out[1].split("\t") == bench.COLUMNS
    grid = out[2:out.index("")]  # the policy grid and its targets; the tracker table follows
    rows = [line.split("\t") for line in grid if not line.startswith(("PASS", "FAIL"))]
    backends = bench.parse_args(["--device", DEVICE]).backend
    assert backends[0] == "torch" and len(backends) >= 1
    assert len(rows) == 3 * 2 * len(backends)  # three modes x with/without learned scores x backends
    payload = json.loads(path.read_text())
    assert payload["environment"]["torch"] == torch.__version__
    for row in payload["rows"]:
        assert row["policy_ms"] > 0 and row["copy_ms"] > 0 and row["topk_ms"] > 0
        assert min(row[f"witness_{s}_ms"] for s in ("query_centroid", "query_mass", "query_bound")) > 0
        assert row["policy_over_topk"] == pytest.approx(row["policy_ms"] / row["topk_ms"])
        assert row["layer_ms"] > 0 and row["layer_us"] == pytest.approx(row["layer_ms"] * 1e3)
        assert row["layer_over_topk"] == pytest.approx(row["layer_ms"] / row["topk_ms"])
        assert row["layer_warm_us"] > 0 and row["policy_warm_us"] > 0 and row["copy_warm_ms"] > 0
        assert row["layer_over_topk_warm"] == pytest.approx(row["layer_warm_us"] / 1e3 / row["topk_warm_ms"])
        if row["backend"] == "cpu_fused":  # the same call with the rows on one thread, beside
            assert row["layer_one_thread_us"] > 0
            assert row["layer_over_one_thread"] == pytest.approx(row["layer_us"] / row["layer_one_thread_us"])
        else:
            assert row["layer_one_thread_us"] is None and row["layer_over_one_thread"] is None
    cache = payload["environment"]["cache"]
    assert cache["evict_bytes"] > 0 and cache["timing"] == "cold (headline), warm beside"
    tail = out[out.index("") + 1:]
    assert tail[0].startswith("key store + drift tracker update per layer call")
    assert tail[1].split("\t") == ["batch", "key_dim", "kernel", "update_us", "reference_us", "speedup",
                                   "update_warm_us", "reference_warm_us"]
    n = len(bench.TRACKER_BATCHES)
    assert [line.split("\t")[0] for line in tail[2:2 + n]] == [str(b) for b in bench.TRACKER_BATCHES]
    for t in payload["tracker_update"]:
        assert t["update_us"] > 0 and t["reference_us"] > 0 and t["update_warm_us"] > 0
        assert t["kernel"] == {"cpu": "cpu", "cuda": "triton"}[DEVICE]  # the device's fused kernel
    witness = tail[2 + n + 1:]
    assert witness[0].startswith("query_group_mass witness scores per layer call")
    assert witness[1].split("\t") == ["batch", "kernel", "scores_us", "reference_us", "speedup", "scores_warm_us",
                                       "reference_warm_us", "table_MB", "scores_GB/s"]
    m = len(bench.WITNESS_BATCHES)
    assert [line.split("\t")[0] for line in witness[2:2 + m]] == [str(b) for b in bench.WITNESS_BATCHES]
    for t in payload["witness_scores"]:
        assert t["scores_us"] > 0 and t["reference_us"] > 0 and t["scores_warm_us"] > 0
        assert t["kernel"] == {"cpu": "cpu", "cuda": "torch"}[DEVICE]
        assert t["table_mb"] == pytest.approx(t["batch"] * (8192 // 8) * 3 * 64 * 4 / 1e6)
    sharing = witness[2 + m + 1:]
    assert sharing[0].startswith("a sharing layer's policy hook per decode step")
    assert sharing[1].split("\t") == ["batch", "hook_us", "update_us", "scores_us", "merge_us", "rest_us",
                                       "hook_warm_us", "update_warm_us", "scores_warm_us", "merge_warm_us",
                                       "checked_us", "checked_warm_us", "verified_us", "verified_warm_us",
                                       "verified_cpp_us", "verified_cpp_warm_us", "verified_cpp_b32_us",
                                       "verified_cpp_b32_warm_us", "verified_mean_us", "verified_mean_warm_us",
                                       "verified_mean_cpp_us", "verified_mean_cpp_warm_us"]
    assert [line.split("\t")[0] for line in sharing[2:]] == [str(b) for b in bench.SHARING_BATCHES]
    for t in payload["sharing_layer"]:
        cpp = bench.CPP_ALTERNATIVES
        ran = [p for p in bench.SHARING_PARTS + bench.SHARING_ALTERNATIVES if DEVICE == "cpu" or p not in cpp]
        assert all(t[f"{p}_us"] > 0 and t[f"{p}_warm_us"] > 0 for p in ran)
        assert all((t[f"{p}_us"] is None) == (DEVICE != "cpu") for p in cpp)
        assert t["rest_us"] == pytest.approx(t["hook_us"] - t["update_us"] - t["scores_us"] - t["merge_us"])
        assert (t["width"], t["block_size"], t["witness_blocks"], t["share"]) == (1024, 8, 64, 0.25)


def test_the_timed_sharing_hook_is_the_merge_of_the_reused_rows():
    # Two layers built alike: the hook on one equals, on the other, the update then the merge
    # of the reused rows with the updated tracker's scores (the parts the table times alone).
    def case():
        return bench.sharing_layer_calls(torch.device(DEVICE), 2, torch.Generator().manual_seed(5),
                                         **{**bench.SHARING_SHAPE, "context": 512, "width": 64})

    (a, _, state), (b, merge_with, _) = case(), case()
    hook = a["hook"]()
    b["update"]()
    scores = b["scores"]()
    assert scores.shape == (2, 512 // 8 + 1)
    merged = merge_with(scores)
    assert torch.equal(hook, merged.indices)
    assert merged.counters.to_dict()["structural_injected_tokens"] > 0  # witnesses went in
    for r in hook.tolist():  # rows of 64 from 513 tokens, distinct
        assert len(r) == len(set(r)) == 64 and all(0 <= x <= 512 for x in r)
    checked, swaps = a["checked"]()  # the checked exchange on the same rows: at most a quarter of W swapped
    assert 0 < int(swaps.min()) and int(swaps.max()) <= 16
    for r in checked.tolist():
        assert len(r) == len(set(r)) == 64 and all(0 <= x <= 512 for x in r)
    # The verified exchange's decode shape on the same rows chooses what the harness's does on
    # each request's whole cache (queries already carry the softmax scale).
    from benchmark.quality.witness_exchange import VerifiedExchange, verified_exchange_rows

    verified, swaps = a["verified"]()
    assert 0 < int(swaps.min()) and int(swaps.max()) <= 16
    rows, queries, cache = state["rows"], state["queries"], state["cache"]
    for b_ in range(2):
        want, n = verified_exchange_rows(rows[b_:b_ + 1], torch.tensor([513]), queries[b_].unsqueeze(1),
                                         cache[b_].view(513, 3, 64).transpose(0, 1), 1.0, 8,
                                         VerifiedExchange(Fraction(1, 4), 1.0, bench.VERIFIED_BLOCKS))
        assert int(n) == int(swaps[b_]) and sorted(want[0].tolist()) == sorted(verified[b_].tolist())
    if DEVICE == "cpu":  # the C++ pass on the same state: the same rows
        fast, fast_swaps = a["verified_cpp"]()
        assert torch.equal(fast_swaps, swaps)
        assert [sorted(r) for r in fast.tolist()] == [sorted(r) for r in verified.tolist()]
        coarse, coarse_swaps = a["verified_cpp_b32"]()  # 32-token boxes: what the harness chooses with them
        for b_ in range(2):
            want, n = verified_exchange_rows(rows[b_:b_ + 1], torch.tensor([513]), queries[b_].unsqueeze(1),
                                             cache[b_].view(513, 3, 64).transpose(0, 1), 1.0, bench.COARSE_BOX_BLOCK,
                                             VerifiedExchange(Fraction(1, 4), 1.0, 16))
            assert int(n) == int(coarse_swaps[b_]) and sorted(want[0].tolist()) == sorted(coarse[b_].tolist())
    # Ranked by the outsiders' mean logit (the tracker's first step: it holds exactly the row's keys).
    (c, _, _) = case()
    mean_rows, mean_swaps = c["verified_mean"]()
    assert 0 < int(mean_swaps.min()) and int(mean_swaps.max()) <= 16
    for b_ in range(2):
        want, n = verified_exchange_rows(rows[b_:b_ + 1], torch.tensor([513]), queries[b_].unsqueeze(1),
                                         cache[b_].view(513, 3, 64).transpose(0, 1), 1.0, 8,
                                         VerifiedExchange(Fraction(1, 4), 1.0, bench.VERIFIED_BLOCKS, "mean"))
        assert int(n) == int(mean_swaps[b_]) and sorted(want[0].tolist()) == sorted(mean_rows[b_].tolist())
    if DEVICE == "cpu":
        (d, _, _) = case()
        fast, fast_swaps = d["verified_mean_cpp"]()
        assert torch.equal(fast_swaps, mean_swaps)
        assert [sorted(r) for r in fast.tolist()] == [sorted(r) for r in mean_rows.tolist()]


def _row(mode, backend, policy_ms, layer_ms=None, topk_ms=0.2, rows=1, seq_len=8192, scored=False):
    row = dict(mode=mode, backend=backend, rows=rows, seq_len=seq_len, learned_scores=scored, device_type="cpu",
               policy_ms=policy_ms, policy_us=policy_ms * 1e3, policy_over_topk=policy_ms / topk_ms,
               per_row_us=policy_ms * 1e3 / rows)
    if layer_ms is not None:
        row.update(layer_ms=layer_ms, layer_us=layer_ms * 1e3, layer_over_topk=layer_ms / topk_ms)
    return row


def test_targets_judge_the_layer_call_on_its_best_backend():
    # torch: public 0.16 ms, layer 0.12; cpu_fused: public 0.12, layer 0.09 -> cpu_fused's layer call.
    checks = bench.evaluate_targets([_row("topology_only", "torch", 0.16, 0.12),
                                     _row("topology_only", "cpu_fused", 0.12, 0.09)])
    by = {c["target"]: c for c in checks}
    assert set(by) == {"topology_only scores=no: layer call <= 150 us at R=1, 8k [cpu_fused]",
                       "topology_only scores=no: layer call <= 0.5x topk of the row at R=1, 8k [cpu_fused]"}
    assert by["topology_only scores=no: layer call <= 150 us at R=1, 8k [cpu_fused]"]["value"] == pytest.approx(90.0)
    ratio = by["topology_only scores=no: layer call <= 0.5x topk of the row at R=1, 8k [cpu_fused]"]
    assert ratio["value"] == pytest.approx(0.45) and ratio["passed"]
    # JSON from before the layer column: the public entry's figures, named so.
    old = bench.evaluate_targets([_row("topology_only", "cpu_fused", 0.12)])
    assert [c["target"] for c in old][1] == "topology_only scores=no: public call <= 0.5x topk of the row at R=1, 8k [cpu_fused]"
    assert old[1]["value"] == pytest.approx(0.6) and not old[1]["passed"]


def test_synthetic_rows_are_valid_engine_rows():
    gen = torch.Generator().manual_seed(0)
    rows = bench.synthetic_rows(3, 1000, 64, gen)
    assert rows.dtype == torch.int32 and rows.shape == (3, 64)
    for r in rows.tolist():
        assert len(set(r)) == 64 and all(0 <= v < 1000 for v in r)
    short = bench.synthetic_rows(2, 10, 16, gen)
    assert short[0].tolist() == list(range(10)) + [-1] * 6


def test_backend_flag_times_each_backend_side_by_side(tmp_path):
    """One row per backend per cell, in the order given (their results' equality is pinned
    by the backend tests, not here)."""
    path = tmp_path / "policy.json"
    assert bench.main(["--rows", "3", "--lengths", "4096", "--width", "64", "--rounds", "1", "--warmup", "0",
                       "--reference-rows", "1", "--backend", "torch", "cpu_fused", "--modes", "topology_only",
                       "--learned-scores", "without", "--json", str(path), "--device", "cpu"]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["torch", "cpu_fused"]
    assert all(r["policy_us"] > 0 for r in rows)


def test_unknown_or_unusable_backend_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--backend", "fastest"])
    assert "--backend" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--backend", "cpu_fused", "--device", "meta"])
    assert "--device" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["--rows", "0"], "--rows"), (["--width", "-1"], "--width"),
                                        (["--modes", "bogus"], "--modes"),
                                        (["--witness-block-size", "0"], "--witness-block-size")])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert flag in capsys.readouterr().err


def test_cuda_without_gpu_is_a_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda"])
    assert "--device cuda" in capsys.readouterr().err


def test_rounds_time_each_call_cold_after_an_eviction_then_warm():
    """Every round: evict, the cold call, the warm call, for each function in turn."""
    events = []
    fns = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    cold, warm = bench.time_interleaved(fns, torch.device("cpu"), rounds=2, warmup=1,
                                        evict=lambda: events.append("evict"))
    assert events == ["a", "b"] + ["evict", "a", "a", "evict", "b", "b"] * 2
    assert [len(cold[k]) for k in fns] == [2, 2] and [len(warm[k]) for k in fns] == [2, 2]
