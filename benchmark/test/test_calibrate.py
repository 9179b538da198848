"""Tests of the calibration (``//benchmark:topology_kv_calibrate_test``): the shared-logits
error against the harness's metrics, the choice rule, and a whole calibration of a tiny
random model into a profile that the engine's loader and ``Indexer`` accept.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from benchmark.quality.calibration import (
    Candidate,
    CalibrationSettings,
    Measurements,
    calibrate,
    candidate_errors,
    candidate_rows,
    choose,
    format_table,
    model_fingerprint,
    parse_components,
    plot_shares,
)
from benchmark.quality.metrics import LayerMetrics
from benchmark.quality.model import LoadedModel, full_attention_layers
from benchmark.quality.sparse_attention import sparse_layer_attention
from benchmark.quality.synthetic import synthetic_layer, synthetic_settings
from benchmark.quality.text import sample_windows
from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.topology_kv.config import IndexerTopologySettings
from rtp_llm.models_py.modules.hybrid.topology_kv.profile import load_topology_profile

SETTINGS = synthetic_settings()
# Width 37: long rows (>37) and dense ones in the first chunk of 64; T = 150: a partial chunk.
WIDTH = 37
SMALL = CalibrationSettings(contexts=(150,), budgets=(Fraction(1, 4),), shares=(Fraction(1, 8), Fraction(1, 4)),
                            component_sets=parse_components("sinks,local,sinks+local+witnesses"), block_size=8,
                            sink_tokens=4, local_blocks=1, witness_blocks=1,
                            # the trained indexer of the synthetic layers and the tiny model: seeded random
                            selector_settings=synthetic_settings())


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("stride", [1, 4])
def test_shared_logits_errors_equal_the_harness_metrics(softcap, stride):
    layer = dataclasses.replace(synthetic_layer(seed=3, layer_idx=2), softcap=softcap)
    rows = candidate_rows(layer, WIDTH, SMALL, SMALL.candidates())
    assert len(rows) == 1 + 2 * 3
    errors = candidate_errors(layer, rows, WIDTH, stride)
    for name, r in rows.items():
        metrics = LayerMetrics()
        sparse_layer_attention(layer, r, WIDTH, metrics, 4, stride)
        cos = torch.cat(metrics.values[2]["cos_diff"]).double()
        recall = torch.cat(metrics.values[2]["recall"]).double()
        cos_sum, recall_sum, n = errors[name]
        assert n == cos.numel() > 0
        torch.testing.assert_close(cos_sum, float(cos.sum()), atol=1e-4, rtol=1e-4, msg=name)
        torch.testing.assert_close(recall_sum, float(recall.sum()), atol=1e-4, rtol=1e-4, msg=name)
    assert errors["learned"] != errors["1/4:sinks+local+witnesses"]


def _measurements(learned, structural):
    m = Measurements()
    m.add(0, Fraction(1, 4), 150, "learned", (learned * 10, 9.0, 10))
    m.add(0, Fraction(1, 4), 150, "1/8:sinks", (structural * 10, 9.5, 10))
    return m


# (structural error / learned error, kept?): the margin is 5%.
MARGIN_CASES = [(0.90, True), (0.96, False), (1.0, False), (1.2, False)]


@pytest.mark.parametrize("ratio, kept", MARGIN_CASES)
def test_structure_is_kept_only_past_the_margin(ratio, kept):
    settings = dataclasses.replace(SMALL, component_sets=parse_components("sinks"), shares=(Fraction(1, 8),))
    choice = choose(_measurements(0.01, 0.01 * ratio), [0], settings)[0][Fraction(1, 4)]
    assert choice.candidate == (Candidate(Fraction(1, 8), frozenset({"sinks"})) if kept else Candidate(Fraction(0)))
    assert choice.baseline_error == pytest.approx(0.01) and choice.baseline == Candidate(Fraction(0))


def test_unmeasured_budget_keeps_the_learned_rows():
    settings = dataclasses.replace(SMALL, component_sets=parse_components("sinks"), shares=(Fraction(1, 8),))
    assert choose(Measurements(), [0], settings)[0][Fraction(1, 4)].candidate.share == 0


@pytest.mark.parametrize("text", ["sinks,bogus", "", "sinks+"])
def test_bad_component_sets_are_rejected_naming_the_flag(text):
    with pytest.raises(ValueError, match="--components"):
        parse_components(text)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="margin: expected a number in \\[0, 1\\), got 1.5"):
        dataclasses.replace(SMALL, margin=1.5)
    with pytest.raises(ValueError, match="budgets: 1/256 of context 150 is less than one token"):
        dataclasses.replace(SMALL, budgets=(Fraction(1, 256),))


def _tiny_model():
    """Random Qwen2 with a sliding layer between two full ones (as test_topology_kv_quality's)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from benchmark.quality import sparse_attention

    sparse_attention.register()
    cfg = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=32, use_sliding_window=True,
                      sliding_window=16, max_position_embeddings=512,
                      layer_types=["full_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=sparse_attention.ATTENTION_NAME).eval()
    sparse_attention.install_hidden_capture(model)
    return LoadedModel(model=model, tokenizer=None, gguf_path=None, gguf_sha256="0f" * 32,
                       full_attention_layers=full_attention_layers(model.config))


def test_calibrating_a_tiny_model_gives_a_profile_serving_accepts(tmp_path):
    lm = _tiny_model()
    tokens = torch.randint(0, 100, (1500,), generator=_gen(4)).tolist()
    settings = dataclasses.replace(SMALL, contexts=(128, 192), budgets=(Fraction(1, 8), Fraction(1, 4)), margin=0.0)
    windows = {c: sample_windows(tokens, "rand", c, 2, seed=0) for c in settings.contexts}
    profile = calibrate(lm, windows, settings, text={"name": "rand", "sha256": "00" * 32}, command="test",
                        progress=False, guard=False)  # the per-layer choice itself (the guard: tests below)
    assert set(profile["layers"]) == {"0", "2"} and profile["settings"]["budgets"] == ["1/8", "1/4"]
    for layer, per_budget in profile["measurements"].items():
        for budget, m in per_budget.items():
            cells = m["candidates"]
            assert set(cells) == {c.name for c in settings.candidates()}
            assert all(c["rows"] > 0 and 0 <= c["recall"] <= 1 + 1e-6 for c in cells.values())
            best = min(cells, key=lambda n: cells[n]["cos_diff"])
            # margin 0: the least error wins, unless that is the learned rows themselves
            assert m["chosen"] == best or cells[m["chosen"]]["cos_diff"] == cells[best]["cos_diff"]
            setting = profile["layers"][layer][budget]
            assert (setting["max_structural_fraction"] == 0) == (m["chosen"] == "learned")
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    loaded = load_topology_profile(path, model_fingerprint=model_fingerprint(lm))
    assert loaded.block_size == 8 and loaded.reference_context == 192
    # The engine takes each layer's entry (block size 8 here, as calibrated).
    for layer in (0, 2):
        indexer = Indexer(4, 32, 48, 8, layer_idx=layer, topology=IndexerTopologySettings.from_env({}, block_size=8),
                          topology_profile=loaded)  # 48 / 192 = 1/4
        entry = profile["layers"][str(layer)]["1/4"]
        assert indexer.topology.enabled == (entry["max_structural_fraction"] > 0)
        if indexer.topology.enabled:
            assert indexer.topology.policy.max_structural_fraction == entry["max_structural_fraction"]
            assert indexer.topology.policy.local_blocks == entry["local_blocks"]
    # The harness's "profile" selector runs it inside the model's forward; with every layer
    # skipped it is the learned selector exactly, otherwise the kept structure changes the loss.
    from benchmark.quality.runner import GridSettings, run_grid

    grid_settings = GridSettings(contexts=(192,), budgets=(Fraction(1, 4),), selectors=("learned", "profile"),
                                 selector_settings=SETTINGS, profile=loaded)
    grid = run_grid(lm, {192: windows[192]}, grid_settings, progress=False)
    learned_ppl, profile_ppl = (grid.cell(192, Fraction(1, 4), n).ppl for n in ("learned", "profile"))
    skipped_all = all(profile["layers"][str(layer)]["1/4"]["max_structural_fraction"] == 0 for layer in (0, 2))
    assert (profile_ppl == learned_ppl) == skipped_all, (profile_ppl, learned_ppl, skipped_all)
    table = format_table(profile)
    assert table.splitlines()[0] == "| layer | W = 1/8 | W = 1/4 |" and "| 2 |" in table
    plot_shares(profile, tmp_path / "share_kept.png")
    assert (tmp_path / "share_kept.png").stat().st_size > 1000


def test_the_default_margin_never_keeps_structure_that_loses(tmp_path):
    lm = _tiny_model()
    tokens = torch.randint(0, 100, (800,), generator=_gen(5)).tolist()
    settings = dataclasses.replace(SMALL, contexts=(128,))
    windows = {128: sample_windows(tokens, "rand", 128, 1, seed=0)}
    profile = calibrate(lm, windows, settings, text={"name": "rand", "sha256": "00" * 32}, command="test",
                        progress=False)
    for per_budget in profile["measurements"].values():
        for m in per_budget.values():
            assert m["chosen_cos_diff"] <= m["baseline_cos_diff"] * (1 - settings.margin) or m["chosen"] == "learned"


def test_cli_rejects_bad_flags_before_loading(capsys):
    from benchmark.quality import calibrate_cli as topology_kv_calibrate

    assert topology_kv_calibrate.main(["--components", "sinks,nope"]) == 2
    assert "--components" in capsys.readouterr().err
    assert topology_kv_calibrate.main(["--margin", "2"]) == 2
    assert "margin" in capsys.readouterr().err
    assert topology_kv_calibrate.main(["--budgets", "3/2"]) == 2
    assert topology_kv_calibrate.main(["--novel", "emma,nope"]) == 2
    assert "--novel: expected novels from" in capsys.readouterr().err


def test_quality_cli_rejects_profile_flags_before_loading(tmp_path):
    from benchmark.quality.cli import build_parser, resolve_args
    from benchmark.quality.errors import UsageError

    parse = build_parser().parse_args
    with pytest.raises(UsageError, match="'profile' needs --profile FILE"):
        resolve_args(parse(["--selectors", "learned,profile", "--out-dir", str(tmp_path)]))
    with pytest.raises(UsageError, match="--profile: no such file"):
        resolve_args(parse(["--profile", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path)]))
    (tmp_path / "p.json").write_text("{}")
    cfg = resolve_args(parse(["--selectors", "learned", "--profile", str(tmp_path / "p.json"),
                              "--out-dir", str(tmp_path)]))
    assert cfg["selectors"] == ("learned", "profile") and "profile" in cfg["policy_modes"]
    cfg = resolve_args(parse(["--selectors", "learned,profile:topology_compress_sparse", "--profile",
                              str(tmp_path / "p.json"), "--out-dir", str(tmp_path)]))
    assert cfg["selectors"] == ("learned", "profile:topology_compress_sparse")  # no plain "profile" added
    assert cfg["policy_modes"] == ("profile:topology_compress_sparse",)
    # A shared selector that runs the profile (its scanning set, or its entries): no plain "profile" added.
    for listed in ("learned,learned-shared:profile", "learned,learned-shared:profile+topology_sparse_merge",
                   "learned,learned-shared:4+profile"):
        cfg = resolve_args(parse(["--selectors", listed, "--profile", str(tmp_path / "p.json"),
                                  "--out-dir", str(tmp_path)]))
        assert cfg["selectors"] == tuple(listed.split(",")), listed
    # A shared selector that does not read the profile leaves the auto-added one.
    cfg = resolve_args(parse(["--selectors", "learned,learned-shared:4", "--profile", str(tmp_path / "p.json"),
                              "--out-dir", str(tmp_path)]))
    assert cfg["selectors"] == ("learned", "learned-shared:4", "profile")
    with pytest.raises(UsageError, match="'learned-shared:4\\+profile' needs --profile FILE"):
        resolve_args(parse(["--selectors", "learned,learned-shared:4+profile", "--out-dir", str(tmp_path)]))
    with pytest.raises(UsageError, match="'profile:topology_compress_sparse' needs --profile FILE"):
        resolve_args(parse(["--selectors", "profile:topology_compress_sparse", "--out-dir", str(tmp_path)]))
    with pytest.raises(UsageError, match="unknown selector 'profile:bogus'"):
        resolve_args(parse(["--selectors", "profile:bogus", "--out-dir", str(tmp_path)]))


def test_profile_selector_takes_each_layers_entry():
    from benchmark.quality.policy_selectors import PolicySettings, make_policy_selector
    from benchmark.quality.profile_selectors import make_profile_selector
    from benchmark.quality.selector_base import learned_rows_and_scores
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import ModelFingerprint, parse_topology_profile

    sinks = {"max_structural_fraction": 0.25, "sink_tokens": 4, "local_blocks": 0, "witness_blocks": 0}
    skip = {"max_structural_fraction": 0, "sink_tokens": 0, "local_blocks": 0, "witness_blocks": 0}
    fingerprint = ModelFingerprint("00" * 32, "synthetic", 3, (0, 2))
    profile = parse_topology_profile({
        "format": "rtp_llm.topology_kv_profile", "version": 1, "model": fingerprint.to_json(),
        "text": {"name": "t", "sha256": "0"}, "command": "test",
        "settings": {"policy": "topology_sparse_merge", "block_size": 8, "contexts": [150], "budgets": ["1/4"]},
        "layers": {"0": {"1/4": skip}, "2": {"1/4": sinks}},
    }, model_fingerprint=fingerprint)
    selector = make_profile_selector(profile, SETTINGS)
    skipped, kept = synthetic_layer(seed=6, layer_idx=0), synthetic_layer(seed=6, layer_idx=2)
    assert torch.equal(selector(skipped, WIDTH, {}), learned_rows_and_scores(skipped, WIDTH, SETTINGS)[0])
    expected = make_policy_selector("topology_sparse_merge", SETTINGS,
                                    PolicySettings(block_size=8, sink_blocks=0, **sinks))(kept, WIDTH, {})
    out = selector(kept, WIDTH, {})
    assert torch.equal(out, expected)
    assert not torch.equal(out, learned_rows_and_scores(kept, WIDTH, SETTINGS)[0])
    assert bool((out[WIDTH:, :] == 0).any(dim=1).all()), "long rows keep sink token 0"
    # The same structure under the other merge mode (with a scaffold, compress differs).
    from benchmark.quality.selectors import make_selector

    scaffold = PolicySettings(scaffold_tokens=16)
    compress = make_selector("profile:topology_compress_sparse", SETTINGS, scaffold, profile=profile)
    expected = make_policy_selector("topology_compress_sparse", SETTINGS,
                                    PolicySettings(block_size=8, sink_blocks=0, scaffold_tokens=16, **sinks))(kept, WIDTH, {})
    assert torch.equal(compress(kept, WIDTH, {}), expected)
    assert torch.equal(compress(skipped, WIDTH, {}), learned_rows_and_scores(skipped, WIDTH, SETTINGS)[0])
    from benchmark.quality.errors import UsageError

    with pytest.raises(UsageError, match="'profile:topology_only': .*calibrated 'topology_sparse_merge'"):
        make_selector("profile:topology_only", SETTINGS, profile=profile)


# ------------------------------------------------------------------------- topology_only

ONLY_SMALL = dataclasses.replace(SMALL, policy="topology_only", sink_options=(0, 1, 4, 16))


def test_topology_only_candidates_start_from_locality_and_its_rows_are_locality():
    from benchmark.quality.selectors import make_locality
    from benchmark.quality.selector_base import SelectorSettings

    cands = ONLY_SMALL.candidates()
    assert [c.name for c in cands] == ["sinks=4", "sinks=0", "sinks=1", "sinks=16"]
    assert ONLY_SMALL.resolved_witness_signal == "recency" and SMALL.resolved_witness_signal == "key_drift"
    layer = synthetic_layer(seed=3, layer_idx=2)
    rows = candidate_rows(layer, WIDTH, ONLY_SMALL, cands)
    newest = make_locality(SelectorSettings(sink_tokens=1))(layer, WIDTH, {}).clone()  # hand-made "sinks=0":
    long_rows = layer.lengths > WIDTH
    newest[long_rows, 0] = (layer.lengths[long_rows] - WIDTH).to(newest.dtype)  # token 0 -> the W-th newest
    for n in (0, 1, 4, 16):
        locality = newest if n == 0 else make_locality(SelectorSettings(sink_tokens=n))(layer, WIDTH, {})
        # same sets per row (the engine orders a row sinks, then newest first)
        assert torch.equal(torch.sort(rows[f"sinks={n}"], dim=1).values, torch.sort(locality, dim=1).values), n
    assert not torch.equal(rows["sinks=0"], rows["sinks=16"])
    setting = cands[1].setting(4, 1, 1)
    assert setting.to_json() == {"max_structural_fraction": 1.0, "sink_tokens": 0, "local_blocks": 1,
                                 "witness_blocks": 0}


def test_topology_only_keeps_locality_unless_another_sink_count_beats_it_by_the_margin():
    m = Measurements()
    m.add(0, Fraction(1, 4), 150, "sinks=4", (0.10, 9.0, 10))
    m.add(0, Fraction(1, 4), 150, "sinks=0", (0.097, 9.0, 10))  # 3% better: below the margin
    m.add(0, Fraction(1, 4), 150, "sinks=16", (0.2, 9.0, 10))
    choice = choose(m, [0], ONLY_SMALL)[0][Fraction(1, 4)]
    assert choice.candidate.only_sinks == 4 and choice.best_other.only_sinks == 0
    m.add(0, Fraction(1, 4), 150, "sinks=1", (0.08, 9.0, 10))  # 20% better: kept
    assert choose(m, [0], ONLY_SMALL)[0][Fraction(1, 4)].candidate.only_sinks == 1


@pytest.mark.parametrize("change, message", [
    (dict(policy="topology_compress_sparse"), "policy: expected one of"),
    (dict(witness_signal="query_mass"), "witness_signal: expected default, key_drift, recency or query_group_mass"),
    (dict(sink_options=()), "sink_options: expected a non-empty list"),
    (dict(sink_options=(4, -1)), "sink_options: expected a non-empty list of integers >= 0"),
])
def test_bad_policy_settings_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **change)


def test_a_topology_only_profile_is_served_and_never_worse_than_locality_by_construction(tmp_path):
    from benchmark.quality.gate import GateThresholds, evaluate_gate, never_worse_pairs
    from benchmark.quality.runner import GridSettings, run_grid
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import WitnessSignal, TopologyKVPolicyMode

    lm = _tiny_model()
    tokens = torch.randint(0, 100, (1500,), generator=_gen(4)).tolist()
    settings = dataclasses.replace(ONLY_SMALL, contexts=(192,), budgets=(Fraction(1, 4),), margin=0.0)
    windows = {192: sample_windows(tokens, "rand", 192, 2, seed=0)}
    profile = calibrate(lm, windows, settings, text={"name": "rand", "sha256": "00" * 32}, command="test",
                        progress=False, guard=False)
    assert profile["settings"]["policy"] == "topology_only" and profile["settings"]["witness_signal"] == "recency"
    assert profile["settings"]["baseline"] == "sinks=4" and profile["settings"]["sink_options"] == [4, 0, 1, 16]
    for layer, per_budget in profile["measurements"].items():
        m = per_budget["1/4"]
        cells = m["candidates"]
        assert m["chosen_cos_diff"] == min(c["cos_diff"] for c in cells.values())  # margin 0
        entry = profile["layers"][layer]["1/4"]
        assert entry["max_structural_fraction"] == 1.0 and m["chosen"] == f"sinks={entry['sink_tokens']}"
    path = tmp_path / "only.json"
    path.write_text(json.dumps(profile))
    loaded = load_topology_profile(path, model_fingerprint=model_fingerprint(lm))
    assert loaded.policy is TopologyKVPolicyMode.TOPOLOGY_ONLY and loaded.witness_signal is WitnessSignal.RECENCY
    for layer in (0, 2):
        indexer = Indexer(4, 32, 48, 8, layer_idx=layer, topology=IndexerTopologySettings.from_env({}, block_size=8),
                          topology_profile=loaded)
        assert indexer.topology.policy.policy is TopologyKVPolicyMode.TOPOLOGY_ONLY
        assert indexer.topology.policy.sink_tokens == profile["layers"][str(layer)]["1/4"]["sink_tokens"]
        assert not indexer.reads_drift  # recency witnesses: no drift tracker
    grid = run_grid(lm, windows, GridSettings(contexts=(192,), budgets=(Fraction(1, 4),),
                                              selectors=("locality", "profile"), selector_settings=SETTINGS,
                                              profile=loaded), progress=False)
    loc, prof = (grid.cell(192, Fraction(1, 4), n).ppl for n in ("locality", "profile"))
    all_default = all(profile["layers"][str(i)]["1/4"]["sink_tokens"] == 4 for i in (0, 2))
    assert (loc == prof) == all_default, (loc, prof, all_default)
    pairs = never_worse_pairs(["profile"])
    assert ("profile", "locality") in pairs and ("profile", "locality") not in never_worse_pairs()
    verdict = evaluate_gate(grid, ["profile"], GateThresholds(), pairs)[0]
    check = next(c for c in verdict.checks if c.name.startswith("ppl <= locality"))
    assert check.passed is not None and "at most 1" in check.name
    table = format_table(profile)
    assert "the sink count changed in" in table and "baseline (sinks=4)" in table
    plot_shares(profile, tmp_path / "only.png")
    assert (tmp_path / "only.png").stat().st_size > 1000


def test_calibrate_cli_rejects_bad_policy_flags(capsys):
    from benchmark.quality import calibrate_cli as topology_kv_calibrate

    assert topology_kv_calibrate.main(["--policy", "topology_only", "--sink-options", "4,-1"]) == 2
    assert "--sink-options: expected integers >= 0" in capsys.readouterr().err


# ------------------------------------------------------------------- shipped profiles

SHIPPED = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.json"))


def test_the_shipped_profiles_are_found():
    assert len(SHIPPED) >= 4, [p.name for p in SHIPPED]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_profile_loads_for_its_model_and_keeps_its_calibration_rule(path):
    """The profiles under benchmark/profiles (docs/profile.md) load with today's loader, and
    every chosen candidate beats its baseline by the recorded margin (or is the baseline)."""
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import ModelFingerprint

    data = json.loads(path.read_text())
    fingerprint = ModelFingerprint(**{**data["model"], "full_attention_layers": tuple(data["model"]["full_attention_layers"])})
    profile = load_topology_profile(path, model_fingerprint=fingerprint)
    assert profile.witness_signal is not None and profile.budgets == (Fraction(1, 16), Fraction(1, 8), Fraction(1, 4))
    settings = data["settings"]
    for layer, per_budget in data["measurements"].items():
        for budget, m in per_budget.items():
            assert m["chosen"] in m["candidates"] and m["baseline"] == settings["baseline"]
            if m["chosen"] != m["baseline"]:
                assert m["chosen_cos_diff"] < m["baseline_cos_diff"] * (1 - settings["margin"]), (layer, budget)
            entry = profile.setting(int(layer), Fraction(budget))
            if settings["policy"] == "topology_only":
                assert entry.max_structural_fraction == 1 and m["chosen"] == f"sinks={entry.sink_tokens}"
            else:
                assert entry.skipped == (m["chosen"] == "learned")


# ------------------------------------------------------------------------- the guard


class _FakeGrid:
    """``interval`` answers from a table: (context, budget) -> (point, lo, hi)."""

    def __init__(self, table):
        self.table = table

    def interval(self, ctx, budget, selector, reference):
        from benchmark.quality.intervals import Interval

        assert selector == "profile" and reference in ("learned", "locality")
        return Interval(*self.table[(ctx, budget)])


@pytest.mark.parametrize("hi_2k, hi_4k, kept", [(0.99, 0.98, True), (1.001, 0.98, False), (0.99, 1.2, False)])
def test_the_guard_keeps_a_budget_only_if_every_context_is_significantly_better(monkeypatch, hi_2k, hi_4k, kept):
    from benchmark.quality import calibration as calibration_module
    from benchmark.quality import runner

    lm = _tiny_model()
    tokens = torch.randint(0, 100, (1500,), generator=_gen(4)).tolist()
    settings = dataclasses.replace(ONLY_SMALL, contexts=(128, 192), budgets=(Fraction(1, 4),), margin=0.0)
    windows = {c: sample_windows(tokens, "rand", c, 1, seed=0) for c in settings.contexts}
    profile = calibrate(lm, windows, settings, text={"name": "rand", "sha256": "00" * 32}, command="test",
                        progress=False, guard=False)
    # Force a change in layer 0 so the guard has something to check.
    profile["layers"]["0"]["1/4"]["sink_tokens"] = 16
    profile["measurements"]["0"]["1/4"]["chosen"] = "sinks=16"
    table = {(128, Fraction(1, 4)): (0.95, 0.9, hi_2k), (192, Fraction(1, 4)): (0.95, 0.9, hi_4k)}
    calls = []
    monkeypatch.setattr(runner, "run_grid", lambda lm_, w, gs, progress=True: calls.append(gs) or _FakeGrid(table))
    out = calibration_module.guard_profile(lm, windows, profile, settings, progress=False)
    assert calls and calls[0].selectors == ("locality", "profile") and calls[0].budgets == (Fraction(1, 4),)
    verdict = out["settings"]["guard"]["budgets"]["1/4"]
    assert verdict["kept"] is kept and verdict["run"] and set(verdict["contexts"]) == {"128", "192"}
    assert (out["layers"]["0"]["1/4"]["sink_tokens"] == 16) is kept
    if not kept:
        assert all(layer["1/4"]["sink_tokens"] == 4 for layer in out["layers"].values())
        assert out["measurements"]["0"]["1/4"]["reverted_by_guard"] == "sinks=16"
        assert "(guard; measured sinks=16)" in format_table(out)
    # the guarded profile must still load
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import parse_topology_profile

    parse_topology_profile(out, model_fingerprint=model_fingerprint(lm))


def test_the_guard_runs_nothing_when_every_entry_is_the_baseline(monkeypatch):
    from benchmark.quality import calibration as calibration_module
    from benchmark.quality import runner

    lm = _tiny_model()
    tokens = torch.randint(0, 100, (800,), generator=_gen(5)).tolist()
    settings = dataclasses.replace(SMALL, contexts=(128,), margin=0.99)  # nothing beats the learned rows by 99%
    windows = {128: sample_windows(tokens, "rand", 128, 1, seed=0)}
    monkeypatch.setattr(runner, "run_grid", lambda *a, **k: pytest.fail("the guard ran a grid with nothing to check"))
    profile = calibrate(lm, windows, settings, text={"name": "rand", "sha256": "00" * 32}, command="test",
                        progress=False)
    assert profile["settings"]["guard"]["budgets"]["1/4"] == {"kept": True, "run": False}
    assert "nothing to check" in calibration_module.format_guard(profile)


def test_the_guard_on_a_real_forward_reverts_exactly_the_budgets_it_reports(tmp_path):
    lm = _tiny_model()
    tokens = torch.randint(0, 100, (1500,), generator=_gen(4)).tolist()
    settings = dataclasses.replace(SMALL, contexts=(192,), budgets=(Fraction(1, 8), Fraction(1, 4)), margin=0.0)
    windows = {192: sample_windows(tokens, "rand", 192, 2, seed=0)}
    profile = calibrate(lm, windows, settings, text={"name": "rand", "sha256": "00" * 32}, command="test",
                        progress=False)
    for budget, verdict in profile["settings"]["guard"]["budgets"].items():
        entries = [layer[budget] for layer in profile["layers"].values()]
        if verdict["run"]:
            assert verdict["kept"] == (verdict["contexts"]["192"]["hi"] < 1.0)
        if not verdict["kept"]:
            assert all(e["max_structural_fraction"] == 0 for e in entries), budget
    path = tmp_path / "guarded.json"
    path.write_text(json.dumps(profile))
    load_topology_profile(path, model_fingerprint=model_fingerprint(lm))


# cost[i][j]: what layer i loses reusing layer j's rows. Reusing the layer below is cheap for
# 1, 3 and 4 (0.01) and dearest for 6 (0.05), but 3 reusing 0 costs 0.10: ranking by the
# layer below alone would scan {0, 6, 1} (summed cost 0.03, 3 and 4 reusing 1); {0, 3, 6}
# costs 0.02 (1 reuses 0, 4 reuses 3). Every set of three, by hand: {0,1,3} 0.07, {0,1,4}
# 0.06, {0,1,6} 0.03, {0,3,4} 0.06, {0,3,6} 0.02, {0,4,6} 0.11.
HAND_COSTS = {
    1: {0: 0.01},
    3: {0: 0.10, 1: 0.01},
    4: {0: 0.12, 1: 0.02, 3: 0.01},
    6: {0: 0.20, 1: 0.07, 3: 0.06, 4: 0.05},
}


def _measured_costs(costs, overlaps=None, budgets=(Fraction(1, 8), Fraction(1, 4)), context=128):
    """Measurements whose layer ``i`` loses ``costs[i][j]`` cos_diff by reusing layer ``j``'s
    rows (at every budget) and keeps ``overlaps[i][j]`` (default 0.5) of its top-k."""
    from benchmark.quality.calibration import Measurements, reuse_name

    m = Measurements()
    for i, row in costs.items():
        for b in budgets:
            m.add(i, b, context, "learned", (0.1 * 10, 0.0, 10))
            for j, c in row.items():
                m.add(i, b, context, reuse_name(j), ((0.1 + c) * 10, 0.0, 10))
                m.add_overlap(i, j, b, context, ((overlaps or {}).get((i, j), 0.5) * 10, 10))
    return m


def test_the_scanning_set_is_the_least_cost_set_with_each_layer_priced_by_the_layer_it_reuses():
    from benchmark.quality.calibration import choose_scanning

    settings = dataclasses.replace(SMALL, contexts=(128,), budgets=(Fraction(1, 8), Fraction(1, 4)), scan=3)
    layers = (0, 1, 3, 4, 6)
    m = _measured_costs(HAND_COSTS, overlaps={(1, 0): 0.9, (4, 3): 0.4})
    share = choose_scanning(m, layers, settings)
    assert share["scanning"] == [0, 3, 6] and share["scan"] == "3 of 5"
    assert share["total_cost_cos_diff"] == pytest.approx(0.02) and share["sources"] == {"1": 0, "4": 3}
    assert share["reuse_cost_cos_diff"]["4"]["0"] == pytest.approx(0.12) and set(share["reuse_cost_cos_diff"]["6"]) == {"0", "1", "3", "4"}
    assert share["reuse_overlap"]["1"]["0"] == pytest.approx(0.9) and share["reuse_overlap"]["4"]["3"] == pytest.approx(0.4)
    two = choose_scanning(m, layers, dataclasses.replace(settings, scan=2))  # {0,1} .10, {0,3} .08, {0,4} .16, {0,6} .23
    assert two["scanning"] == [0, 3] and two["total_cost_cos_diff"] == pytest.approx(0.08)
    one = choose_scanning(m, layers, dataclasses.replace(settings, scan=1))
    assert one["scanning"] == [0] and one["total_cost_cos_diff"] == pytest.approx(0.43)
    assert one["sources"] == {"1": 0, "3": 0, "4": 0, "6": 0}
    every = choose_scanning(m, layers, dataclasses.replace(settings, scan=5))
    assert every["scanning"] == list(layers) and every["total_cost_cos_diff"] == 0 and every["sources"] == {}
    with pytest.raises(ValueError, match="scan: expected at most the 5 sparse layers, got 6"):
        choose_scanning(m, layers, dataclasses.replace(settings, scan=6))
    with pytest.raises(ValueError, match=r"scan: layers \[7\] have no measured row"):
        choose_scanning(m, layers + (7,), settings)
    with pytest.raises(ValueError, match="scan: expected an int >= 1"):
        dataclasses.replace(settings, scan=0)
    with pytest.raises(ValueError, match="scan: expected no scanning set for topology_only"):
        dataclasses.replace(settings, policy="topology_only")


def test_equal_cost_sets_are_broken_the_same_way_every_time():
    from benchmark.quality.scan_choice import best_scanning_set

    flat = {i: {j: 0.01 for j in range(i)} for i in range(1, 9)}
    first = best_scanning_set(flat, range(9), 4)
    assert first[1] == pytest.approx(0.05) and first[0][0] == 0 and len(set(first[0])) == 4
    assert all(best_scanning_set(flat, range(9), 4) == first for _ in range(3))


@hyp_settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_scanning_set_is_the_least_cost_one_of_all_sets(data):
    from benchmark.quality.scan_choice import best_scanning_set, set_cost

    n = data.draw(st.integers(1, 7), label="layers")
    layers = sorted(data.draw(st.sets(st.integers(0, 40), min_size=n, max_size=n), label="indices"))
    scan = data.draw(st.integers(1, n), label="scan")
    value = st.floats(-0.05, 0.2, allow_nan=False, allow_infinity=False)
    cost = {i: {j: data.draw(value) for j in layers[:p]} for p, i in enumerate(layers) if p}
    chosen, total = best_scanning_set(cost, layers, scan)
    assert len(chosen) == scan and chosen[0] == layers[0] and set(chosen) <= set(layers)

    def priced(subset):
        return set_cost(cost, subset, layers)

    assert total == pytest.approx(priced(chosen), abs=1e-12)
    brute = min(priced([layers[0], *rest]) for rest in itertools.combinations(layers[1:], scan - 1))
    assert total <= brute + 1e-12


def test_the_scan_choice_refuses_missing_or_non_finite_costs():
    from benchmark.quality.scan_choice import best_scanning_set

    with pytest.raises(ValueError, match=r"missing \(layer<-source\) 4<-0"):
        best_scanning_set({1: {0: 0.1}, 4: {1: 0.2}}, (0, 1, 4), 2)
    with pytest.raises(ValueError, match=r"got NaN or inf for \(layer<-source\) 4<-1"):
        best_scanning_set({1: {0: 0.1}, 4: {0: 0.1, 1: float("nan")}}, (0, 1, 4), 2)
    with pytest.raises(ValueError, match="scan: expected 1 to the 3 sparse layers, got 0"):
        best_scanning_set({1: {0: 0.1}, 4: {0: 0.1, 1: 0.1}}, (0, 1, 4), 0)


def test_top_k_overlap_by_hand():
    from benchmark.quality.calibration import top_k_overlap

    layer = synthetic_layer(seed=1, layer_idx=0, T=6)
    own = torch.tensor([[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [0, 2, 4], [3, 4, 5]], dtype=torch.int32)
    other = torch.tensor([[0, -1, -1], [1, -1, -1], [2, 3, 4], [1, 2, 3], [1, 3, 5], [0, 1, 2]], dtype=torch.int32)
    total, rows = top_k_overlap(own, other, layer)
    assert rows == 6 and total == pytest.approx(1 + 0.5 + 1 / 3 + 1 + 0 + 0)


def test_calibrating_a_scanning_set_serves_and_runs_in_the_harness(tmp_path):
    from benchmark.quality.runner import GridSettings, run_grid
    from rtp_llm.models_py.modules.hybrid.indexer_share import ENV_INDEXER_SHARE, IndexerSharePlan

    from benchmark.quality.scan_choice import format_scanning

    lm = _tiny_model()
    tokens = torch.randint(0, 100, (1500,), generator=_gen(6)).tolist()
    settings = dataclasses.replace(SMALL, contexts=(192,), budgets=(Fraction(1, 8), Fraction(1, 4)), scan=1)
    windows = {192: sample_windows(tokens, "rand", 192, 2, seed=0)}
    profile = calibrate(lm, windows, settings, text={"name": "rand", "sha256": "00" * 32}, command="test",
                        progress=False, guard=False)
    share = profile["indexer_share"]
    assert share["scanning"] == [0] and share["scan"] == "1 of 2" and share["sources"] == {"2": 0}
    cost, overlap = share["reuse_cost_cos_diff"]["2"]["0"], share["reuse_overlap"]["2"]["0"]
    assert set(share["reuse_cost_cos_diff"]) == {"2"} and 0 <= overlap <= 1 and math.isfinite(cost)
    assert share["total_cost_cos_diff"] == cost
    # Layer 0's learned rows are not layer 2's own (random indexers: the sign of the cost is not fixed).
    assert overlap < 1 and cost != 0
    table = format_scanning(profile)
    assert f"| 2 | {cost:+.5f} | {overlap:.3f} | no | 0 | {cost:+.5f} | {overlap:.3f} |" in table
    assert "| 0 | - (first sparse layer) | - | yes | - | - | - |" in table
    # The first layer has no reuse measurement; the profile's per-candidate record is unchanged.
    assert not any(name.startswith("reuse") for name in profile["measurements"]["2"]["1/4"]["candidates"])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    loaded = load_topology_profile(path, model_fingerprint=model_fingerprint(lm))
    assert loaded.scanning_layers == (0,)
    plan = IndexerSharePlan.from_env({ENV_INDEXER_SHARE: "profile"}, lm.full_attention_layers, loaded)
    assert plan.scanning == (0,) and plan.source(2) == 0
    # In the harness, the profile's set (layer 0 only) is every-2 sharing over layers (0, 2);
    # with each layer's profile entry on top it is the merge of the profile on shared rows.
    names = ("learned", "learned-shared:2", "learned-shared:profile", "learned-shared:profile+profile",
             "learned-shared:2+profile")
    grid = run_grid(lm, windows, GridSettings(contexts=(192,), budgets=(Fraction(1, 4),), selectors=names,
                                              selector_settings=SETTINGS, profile=loaded), progress=False)
    ppl = {n: grid.cell(192, Fraction(1, 4), n).ppl for n in names}
    assert ppl["learned-shared:profile"] == ppl["learned-shared:2"] != ppl["learned"]
    assert ppl["learned-shared:profile+profile"] == ppl["learned-shared:2+profile"]


def test_calibrate_cli_rejects_bad_scan_flags(capsys):
    from benchmark.quality import calibrate_cli

    for bad, message in (("0", "--scan: expected a number of layers K >= 1 or a fraction"),
                         ("3/2", "--scan: expected"), ("1/0", "--scan: expected"), ("x", "got 'x'")):
        assert calibrate_cli.main(["--scan", bad]) == 2
        assert message in capsys.readouterr().err
    assert calibrate_cli.main(["--scan", "2", "--policy", "topology_only"]) == 2
    assert "--scan: expected a merge --policy" in capsys.readouterr().err
    assert calibrate_cli.parse_scan("1/4", "topology_sparse_merge") == Fraction(1, 4)
    assert calibrate_cli.resolve_scan(Fraction(1, 4), 30) == 8 and calibrate_cli.resolve_scan(Fraction(1, 4), 3) == 1
    with pytest.raises(ValueError, match="at most the model's 3 sparse layers, got 4"):
        calibrate_cli.resolve_scan(4, 3)


def test_rescan_rechooses_the_scanning_set_from_the_recorded_costs_and_changes_nothing_else(tmp_path, capsys):
    from benchmark.quality import calibrate_cli
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import read_profile_file

    source = next(p for p in SHIPPED if p.name == "smollm2_135m_merge.json")
    data = json.loads(source.read_text())
    layers = data["model"]["full_attention_layers"]
    # Costs by hand: reusing any layer costs 0.001, except that layers 8-12 lose 0.09 reusing
    # anything below 7 and layers 13-29 lose 0.05 reusing anything below 13. Three scanning
    # layers: 0, then 7 (layers 8-12 then reuse 7) and 13, summed cost 6 * 0.001 + 5 * 0.001
    # + 16 * 0.001 = 0.027; any other set pays at least one 0.05.
    def cost(i, j):
        return 0.09 if 8 <= i <= 12 and j < 7 else 0.05 if i >= 13 and j < 13 else 0.001

    data["indexer_share"] = {
        "scanning": sorted(layers),
        "reuse_cost_cos_diff": {str(i): {str(j): cost(i, j) for j in layers[:p]} for p, i in enumerate(layers) if p},
        "reuse_overlap": {str(i): {str(j): 0.7 for j in layers[:p]} for p, i in enumerate(layers) if p},
    }
    given = tmp_path / "in" / "profile.json"
    given.parent.mkdir()
    given.write_text(json.dumps(data))
    before = given.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    assert calibrate_cli.main(["--rescan", str(given), "--scan", "3", "--out-dir", str(out)]) == 0
    assert "Scanning layers (3 of 30): 0,7,13 " in capsys.readouterr().out
    written, profile = read_profile_file(out / "profile.json")
    assert profile.scanning_layers == (0, 7, 13)
    assert written["indexer_share"]["total_cost_cos_diff"] == pytest.approx(0.027)
    from benchmark.quality.scan_choice import profile_set_cost

    # Another set priced by the same record: 0 and 13 (8-12 reuse 0 at 0.09, 1-7 at 0.001).
    assert profile_set_cost(written, [0, 13]) == pytest.approx(7 * 0.001 + 5 * 0.09 + 16 * 0.001)
    for bad in ([7, 13], [0, 30]):
        with pytest.raises(ValueError, match=r"scanning: expected sparse layers starting with the first, \[0\]"):
            profile_set_cost(written, bad)
    with pytest.raises(ValueError, match=r"got only each layer's cost of reusing the layer directly below"):
        profile_set_cost(dict(written, indexer_share={"scanning": [0], "cost_cos_diff": {}}), [0])
    assert "--rescan" in written["indexer_share"]["command"] and written["indexer_share"]["scan"] == "3 of 30"
    assert {k: v for k, v in written.items() if k != "indexer_share"} == {k: v for k, v in data.items()
                                                                          if k != "indexer_share"}
    assert calibrate_cli.main(["--rescan", str(given), "--scan", "1/4", "--out-dir", str(out)]) == 0
    # Eight: 0, 7 and 13 and any five more (equal cost), 22 * 0.001 in all.
    written, profile = read_profile_file(out / "profile.json")
    assert len(profile.scanning_layers) == 8 and {0, 7, 13} <= set(profile.scanning_layers)
    assert written["indexer_share"]["total_cost_cos_diff"] == pytest.approx(0.022)
    assert given.read_bytes() == before
    for argv, message in (
        (["--scan", "3", "--windows", "3"], "--rescan: expected only --scan and --out-dir (nothing is measured), "
                                            "got also --windows"),
        ([], "--rescan: expected --scan K"),
        (["--scan", "31"], "--scan: expected at most the model's 30 sparse layers, got 31"),
        (["--scan", "3", "--out-dir", str(given.parent)], "--out-dir: expected a folder other than the one"),
    ):
        assert calibrate_cli.main(["--rescan", str(given), "--out-dir", str(out)] + argv) == 2
        assert message in capsys.readouterr().err
    assert calibrate_cli.main(["--rescan", str(source), "--scan", "3", "--out-dir", str(out)]) == 2
    assert "expected a profile calibrated with --scan" in capsys.readouterr().err
    data["indexer_share"]["reuse_cost_cos_diff"]["5"]["0"] = "high"
    given.write_text(json.dumps(data))
    assert calibrate_cli.main(["--rescan", str(given), "--scan", "3", "--out-dir", str(out)]) == 2
    assert ("indexer_share.reuse_cost_cos_diff[5]: expected source layer index -> number, got '0': 'high'"
            in capsys.readouterr().err)
    del data["indexer_share"]["reuse_cost_cos_diff"]["5"]["0"]
    given.write_text(json.dumps(data))
    assert calibrate_cli.main(["--rescan", str(given), "--scan", "3", "--out-dir", str(out)]) == 2
    assert "missing (layer<-source) 5<-0" in capsys.readouterr().err
    adjacent = dict(data, indexer_share={"scanning": [0], "cost_cos_diff": {"1": 0.1}, "overlap": {"1": 0.5}})
    given.write_text(json.dumps(adjacent))
    assert calibrate_cli.main(["--rescan", str(given), "--scan", "3", "--out-dir", str(out)]) == 2
    assert "got only each layer's cost of reusing the layer directly below (cost_cos_diff): calibrate again" \
        in capsys.readouterr().err
    assert given.read_bytes() != before and calibrate_cli.main(["--rescan", str(tmp_path / "none.json"), "--scan",
                                                                "3", "--out-dir", str(out)]) == 2
    assert "--rescan: " in capsys.readouterr().err


# --shared-structure: the calibration's candidates merged into a sharing layer's reused rows.
def test_shared_structure_summary_by_hand():
    from benchmark.quality.shared_structure import format_shared_structure, summarize_shared_structure
    from rtp_llm.models_py.modules.hybrid.indexer_share import IndexerSharePlan

    settings = dataclasses.replace(SMALL, contexts=(128,), budgets=(Fraction(1, 4),), margin=0.05)
    plan = IndexerSharePlan.parse("0,4", (0, 2, 4, 6))  # 2 reuses 0, 6 reuses 4
    b = Fraction(1, 4)
    m = Measurements()
    names = [c.name for c in settings.candidates()[1:]]
    # layer 2: own 0.010, reuse 0.030, best candidate 0.020 (kept: below 0.030 * 0.95): recovers half.
    # layer 6: own 0.010, reuse 0.020, best 0.0195 (not past the margin): recovers nothing.
    for layer, source, own, reuse, best in ((2, 0, 0.010, 0.030, 0.020), (6, 4, 0.010, 0.020, 0.0195)):
        m.add(layer, b, 128, "learned", (own, 0.0, 1))
        m.add(layer, b, 128, f"reuse:{source}", (reuse, 0.0, 1))
        for i, name in enumerate(names):
            m.add(layer, b, 128, f"reuse:{source}|{name}", (best + 0.001 * i, 0.0, 1))
    s = summarize_shared_structure(m, plan, settings)
    l2, l6 = s["budgets"]["1/4"]["layers"]["2"], s["budgets"]["1/4"]["layers"]["6"]
    assert l2["reuses"] == 0 and l2["chosen"] == names[0] and l2["recovered"] == pytest.approx(0.5)
    assert l6["reuses"] == 4 and l6["chosen"] == "reuse" and l6["recovered"] == 0 and l6["best"] == names[0]
    total = s["budgets"]["1/4"]["sum"]
    assert total["learned"] == pytest.approx(0.02) and total["reuse"] == pytest.approx(0.05)
    assert total["chosen"] == pytest.approx(0.04) and total["recovered"] == pytest.approx(1 / 3)
    table = format_shared_structure(s)
    assert "| **sum** | | 0.0200 / 0.0500 -> 0.0400 (**33%** recovered) |" in table
    assert f"| 2 | 0 | 0.0100 / 0.0300 -> 0.0200 {names[0]} (+50%) |" in table
    assert "| 6 | 4 | 0.0100 / 0.0200 -> 0.0200 - |" in table
    # Only layer 2's structure removes error (0.030 - 0.020); layer 6 keeps its reused rows.
    assert s["ranked"] == [[2, pytest.approx(0.01)]]
    assert "sharing layers by the output error their structure removes (summed over the budgets): 2 (0.0100); " \
           "structure on the first K: `RTP_LLM_TOPOLOGY_KV_STRUCTURE_LAYERS=2` (K = 4)" in table
    # Each candidate in every sharing layer: candidate i sums 0.020 + 0.0195 + 2 x 0.001 i against reuse 0.05.
    every = s["budgets"]["1/4"]["every_layer"]
    assert list(every) == names
    for i, name in enumerate(names):
        assert every[name]["sum"] == pytest.approx(0.0395 + 0.002 * i)
        assert every[name]["recovered"] == pytest.approx((0.05 - 0.0395 - 0.002 * i) / 0.03)
    assert f"| {names[0]} | 0.0395 (+35%) |" in table


def test_shared_structure_reports_the_exchanges_in_every_layer_only():
    from benchmark.quality.shared_structure import format_shared_structure, summarize_shared_structure
    from benchmark.quality.witness_exchange import parse_exchange
    from rtp_llm.models_py.modules.hybrid.indexer_share import IndexerSharePlan

    settings = dataclasses.replace(SMALL, contexts=(128,), budgets=(Fraction(1, 4),), margin=0.05)
    plan = IndexerSharePlan.parse("0", (0, 2))  # 2 reuses 0
    b = Fraction(1, 4)
    ex = parse_exchange("1/4,2,1/2")
    m = Measurements()
    m.add(2, b, 128, "learned", (0.010, 0.0, 1))
    m.add(2, b, 128, "reuse:0", (0.030, 0.0, 1))
    for c in settings.candidates()[1:]:
        m.add(2, b, 128, f"reuse:0|{c.name}", (0.040, 0.0, 1))  # every share adds error
    m.add(2, b, 128, f"reuse:0|{ex.name}", (0.015, 0.0, 1))
    s = summarize_shared_structure(m, plan, settings, [ex])
    # The per-layer choice is among what serving runs: the reused rows stay, the exchange is not chosen.
    layer = s["budgets"]["1/4"]["layers"]["2"]
    assert layer["chosen"] == "reuse" and layer["best"] != ex.name and s["ranked"] == []
    every = s["budgets"]["1/4"]["every_layer"]
    assert list(every)[-1] == ex.name == "exchange:1/4:2:1/2" and every[ex.name]["recovered"] == pytest.approx(0.75)
    assert all(every[c.name]["recovered"] == pytest.approx(-0.5) for c in settings.candidates()[1:])
    table = format_shared_structure(s)
    assert "| exchange:1/4:2:1/2 | 0.0150 (+75%) |" in table and "0.0400 (-50%) |" in table
    assert ex.name not in summarize_shared_structure(m, plan, settings)["budgets"]["1/4"]["every_layer"]


def test_structure_layers_ranked_by_the_error_removed_over_budgets():
    from benchmark.quality.shared_structure import rank_structure_layers

    def layer(reuse, chosen):
        return {"reuse": reuse, "chosen_cos_diff": chosen}

    per_budget = {"1/8": {"layers": {"1": layer(0.03, 0.02), "3": layer(0.02, 0.02), "5": layer(0.05, 0.045)}},
                  "1/4": {"layers": {"1": layer(0.01, 0.01), "5": layer(0.02, 0.01), "7": layer(0.004, 0.002)}}}
    assert rank_structure_layers(per_budget) == [[5, 0.015], [1, 0.01], [7, 0.002]]
    assert rank_structure_layers({"1/8": {"layers": {"2": layer(0.01, 0.01)}}}) == []


@pytest.mark.parametrize("signal", ["default", "query_mass"])
def test_shared_structure_measures_the_rows_the_calibration_measures(tmp_path, signal):
    from benchmark.quality.calibration import measure, reuse_name
    from benchmark.quality.shared_structure import measure_shared_structure, merged_name, summarize_shared_structure
    from rtp_llm.models_py.modules.hybrid.indexer_share import IndexerSharePlan

    lm = _tiny_model()
    tokens = torch.randint(0, 100, (1500,), generator=_gen(6)).tolist()
    settings = dataclasses.replace(SMALL, contexts=(192,), budgets=(Fraction(1, 8), Fraction(1, 4)),
                                   witness_signal=signal, harness_signals=True)
    windows = {192: sample_windows(tokens, "rand", 192, 2, seed=0)}
    plan = IndexerSharePlan.parse("every:2", lm.full_attention_layers)  # layer 2 reuses layer 0
    got = measure_shared_structure(lm, windows, settings, [plan], progress=False)
    pairwise = measure(lm, windows, dataclasses.replace(settings, scan=1, witness_signal="default"), progress=False)
    for b in settings.budgets:
        # The same windows and rows: the calibration's own and reuse:0 errors of layer 2, to the bit.
        assert got.mean(2, b, "learned", (192,)) == pairwise.mean(2, b, "learned", (192,))
        assert got.mean(2, b, reuse_name(0), (192,)) == pairwise.mean(2, b, reuse_name(0), (192,))
        assert got.mean(0, b, "learned", (192,))[2] == 0  # a scanning layer is not measured
    s = summarize_shared_structure(got, plan, settings)
    for b in ("1/8", "1/4"):
        m = s["budgets"][b]["layers"]["2"]
        assert m["chosen_cos_diff"] <= m["reuse"] and m["best_cos_diff"] == min(
            got.mean(2, Fraction(b), merged_name(0, c.name), (192,))[0] for c in settings.candidates()[1:])


def test_shared_structure_measures_the_exchanged_rows():
    from benchmark.quality.calibration import reuse_name
    from benchmark.quality.shared_structure import measure_shared_structure, merged_name
    from benchmark.quality.witness_exchange import Exchange
    from rtp_llm.models_py.modules.hybrid.indexer_share import IndexerSharePlan

    lm = _tiny_model()
    tokens = torch.randint(0, 100, (1500,), generator=_gen(6)).tolist()
    settings = dataclasses.replace(SMALL, contexts=(192,), budgets=(Fraction(1, 8), Fraction(1, 4)),
                                   witness_signal="query_group_mass", harness_signals=True, block_size=8)
    windows = {192: sample_windows(tokens, "rand", 192, 2, seed=0)}
    plan = IndexerSharePlan.parse("every:2", lm.full_attention_layers)
    never = Exchange(Fraction(1, 2), 1e30, Fraction(0))  # no outsider carries 1e30 x an entry: no swap
    free = Exchange(Fraction(1, 2), 0.0, Fraction(0))  # any outsider with mass beats margin 0
    got = measure_shared_structure(lm, windows, settings, [plan], progress=False, exchanges=[never, free])
    for b in settings.budgets:
        reuse = got.mean(2, b, reuse_name(0), (192,))
        assert got.mean(2, b, merged_name(0, never.name), (192,)) == reuse
        assert got.mean(2, b, merged_name(0, free.name), (192,))[0] != reuse[0]


def test_shared_structure_flags_are_checked(capsys):
    from benchmark.quality import calibrate_cli

    assert calibrate_cli.main(["--shared-structure", "every:2", "--scan", "2"]) == 2
    assert "--shared-structure: expected neither --scan nor another --policy" in capsys.readouterr().err
    assert calibrate_cli.main(["--shared-structure", "every:2", "--policy", "topology_only"]) == 2
    assert "got --policy topology_only" in capsys.readouterr().err
    # The harness-only witness signals and other block sizes: only for the diagnostic (no profile).
    assert calibrate_cli.main(["--witness-signal", "query_mass"]) == 2
    assert "--witness-signal: query_mass is computed by the harness only" in capsys.readouterr().err
    assert calibrate_cli.main(["--block-size", "8"]) == 2
    assert "--block-size: expected only with --shared-structure" in capsys.readouterr().err
    for flag in ("--block-size", "--witness-blocks"):
        assert calibrate_cli.main(["--shared-structure", "every:2", flag, "0"]) == 2
        assert f"{flag}: expected >= 1, got 0" in capsys.readouterr().err
    assert calibrate_cli.main(["--exchange", "1/4,2,1/2"]) == 2
    assert "--exchange: expected only with --shared-structure (it merges into reused rows), got --exchange " \
           "'1/4,2,1/2'" in capsys.readouterr().err
    assert calibrate_cli.main(["--shared-structure", "every:2", "--exchange", "1/4,2"]) == 2
    assert "--exchange: expected CAP,MARGIN,PROTECT (e.g. 1/4,2,1/2), got '1/4,2'" in capsys.readouterr().err
    assert calibrate_cli.main(["--shared-structure", "every:2", "--exchange", "1/4,2,1/2",
                               "--witness-signal", "recency"]) == 2
    assert "--exchange: expected a witness signal that scores blocks" in capsys.readouterr().err
    with pytest.raises(ValueError, match="witness_signal: expected default, key_drift, recency or query_group_mass"):
        dataclasses.replace(SMALL, witness_signal="query_mass")
    assert dataclasses.replace(SMALL, witness_signal="query_mass", harness_signals=True).resolved_witness_signal == "query_mass"
