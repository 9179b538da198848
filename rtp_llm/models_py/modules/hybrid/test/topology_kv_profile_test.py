"""Per-layer profiles (``topology_kv.profile``): loader errors, the budget pick, and the
``Indexer`` taking each layer's own settings once, at construction.

CPU by default; ``//rtp_llm/models_py/modules/hybrid/test:topology_kv_profile_cuda_manual``
runs the same file on a GPU (plus the no-sync check).
"""

from __future__ import annotations

import copy
import json
from fractions import Fraction
from unittest import mock

import pytest
import torch

from rtp_llm.models_py.modules.hybrid import indexer as indexer_module
from rtp_llm.models_py.modules.hybrid.topology_kv import layer as layer_module
from rtp_llm.models_py.modules.hybrid.topology_kv import profile as profile_module
from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.indexer_params import IndexerKeyCache
from rtp_llm.models_py.modules.hybrid.test import indexer_ref as ref
from rtp_llm.models_py.modules.hybrid.test.indexer_cases import (
    DIM,
    HEADS,
    MERGE,
    PAGE,
    WIDTH,
    engine_rows,
    to_device,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    ENV_POLICY,
    ENV_WITNESS_SIGNAL,
    IndexerTopologySettings,
    WitnessSignal,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.profile import (
    ENV_PROFILE,
    ENV_PROFILE_BUDGET,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    ModelFingerprint,
    load_topology_profile,
    parse_topology_profile,
    read_profile_file,
)
from tools.device_under_test import DEVICE

FINGERPRINT = ModelFingerprint("ab" * 32, "tiny.gguf", num_layers=4, full_attention_layers=(0, 1, 3))
# Layer 0: sinks only, a quarter of W; layer 1: two local blocks, an eighth; layer 3 skipped.
SINKS_ONLY = {"max_structural_fraction": 0.25, "sink_tokens": 4, "local_blocks": 0, "witness_blocks": 0}
LOCAL_ONLY = {"max_structural_fraction": 0.125, "sink_tokens": 0, "local_blocks": 2, "witness_blocks": 0}
SKIP = {"max_structural_fraction": 0, "sink_tokens": 0, "local_blocks": 0, "witness_blocks": 0}
# A prefill whose rows cross W = 2048: lengths 2001..2060 (long from 2049) and 1..8 (short).
PREFIX, NEW = (2000, 0), (60, 8)


def _profile_dict():
    return copy.deepcopy({
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": FINGERPRINT.to_json(),
        "text": {"name": "austen", "sha256": "cd" * 32},
        "settings": {
            "policy": "topology_sparse_merge",
            "block_size": PAGE,
            "contexts": [4096, 8192],
            "budgets": ["1/16", "1/4"],
        },
        "command": "topology_kv_calibrate.py --contexts 4096,8192",
        "layers": {
            "0": {"1/16": SKIP, "1/4": SINKS_ONLY},
            "1": {"1/16": SKIP, "1/4": LOCAL_ONLY},
            "3": {"1/16": SKIP, "1/4": SKIP},
        },
    })


def _write(tmp_path, data, name="profile.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_valid_profile_loads_into_frozen_settings(tmp_path):
    p = load_topology_profile(_write(tmp_path, _profile_dict()), model_fingerprint=FINGERPRINT)
    assert p.budgets == (Fraction(1, 16), Fraction(1, 4)) and p.reference_context == 8192
    assert p.policy is MERGE and p.block_size == PAGE
    assert p.setting(0, Fraction(1, 4)).sink_tokens == 4 and p.setting(3, Fraction(1, 4)).skipped
    assert p.setting(2, Fraction(1, 4)) is None  # not a full-attention layer
    # The name is informational: a renamed file with the same weights is the same model.
    renamed = ModelFingerprint(FINGERPRINT.gguf_sha256.upper(), "other-name.gguf", 4, (0, 1, 3))
    load_topology_profile(_write(tmp_path, _profile_dict()), model_fingerprint=renamed)


def _broken(change):
    data = _profile_dict()
    change(data)
    return data


# (how the file is broken, the error it must give): each names the field, expected vs got.
BAD_PROFILES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (_broken(lambda d: d.update(format="other")), "format: expected 'rtp_llm.topology_kv_profile', got 'other'"),
    (_broken(lambda d: d.update(version=2)), "version: expected 1, got 2"),
    (_broken(lambda d: d.pop("model")), "model: expected the model's fingerprint object, missing"),
    (_broken(lambda d: d["model"].update(gguf_sha256="ef" * 32)), r"made for tiny.gguf \(sha256 efefefef"),
    (_broken(lambda d: d["model"].update(num_layers=30, full_attention_layers=[0, 1, 3])), "30 layers"),
    (_broken(lambda d: d["layers"].pop("1")), r"layers: missing full-attention layers \[1\]"),
    (_broken(lambda d: d["layers"]["0"].pop("1/16")), r"layers.0: missing budgets \['1/16'\]"),
    (_broken(lambda d: d["layers"]["0"].update({"1/8": SKIP})), r"layers.0.1/8: unknown budget key"),
    (_broken(lambda d: d["layers"]["0"].update({"half": SKIP})), "layers.0.half: expected a budget"),
    (_broken(lambda d: d["layers"].update({"2": d["layers"]["0"]})), "layers.2: expected a full-attention layer"),
    (_broken(lambda d: d["layers"]["0"]["1/4"].update(local_blocks=-1)), "local_blocks"),
    (_broken(lambda d: d["layers"]["0"]["1/4"].update(local_blocks=65)), "local_blocks"),
    (_broken(lambda d: d["layers"]["0"]["1/4"].update(sink_tokens=0, local_blocks=0)), "expected > 0"),
    (_broken(lambda d: d["layers"]["0"]["1/4"].update(max_structural_fraction=1.5)), "in \\[0, 1\\], got 1.5"),
    (_broken(lambda d: d["layers"]["0"]["1/4"].pop("witness_blocks")), "witness_blocks: expected an integer"),
    (_broken(lambda d: d["layers"]["0"]["1/4"].update(sink_blocks=1)), r"unknown fields \['sink_blocks'\]"),
    (_broken(lambda d: d["settings"].update(policy="disabled")), "settings.policy: expected an enabled mode"),
    (_broken(lambda d: d["settings"].update(contexts=[])), "settings.contexts: expected a non-empty list"),
    (_broken(lambda d: d.pop("command")), "command: expected the command line"),
    (_broken(lambda d: d["settings"].update(witness_signal="query_mass")),
     r"settings.witness_signal: expected a signal serving computes \(auto, key_drift, recency, query_group_mass, or default\)"),
    (_broken(lambda d: d.update(indexer_share=[0, 3])), "indexer_share: expected an object with the scanning layers"),
    (_broken(lambda d: d.update(indexer_share={})), "indexer_share.scanning: expected a list of layer indices"),
    (_broken(lambda d: d.update(indexer_share={"scanning": [1, 3]})),
     "indexer_share.scanning: expected the first scanning layer to be the first sparse layer 0"),
    (_broken(lambda d: d.update(indexer_share={"scanning": [0, 2]})),
     r"indexer_share.scanning: layers \[2\] are not sparse layers of this model"),
    (_broken(lambda d: d.update(indexer_share={"scanning": [0, 3, 1]})),
     "indexer_share.scanning: expected ascending layers without repeats"),
    (_broken(lambda d: d.update(indexer_share={"scanning": [0, True]})),
     "indexer_share.scanning: expected a list of integers"),
    # topology_only: the structure is the whole row; no layer can skip to learned rows
    (_broken(lambda d: d["settings"].update(policy="topology_only")),
     "layers.0.1/16.max_structural_fraction: expected 1 for a topology_only profile"),
]


@pytest.mark.parametrize("data, message", BAD_PROFILES)
def test_bad_profiles_fail_naming_file_and_field(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=message) as err:
        load_topology_profile(path, model_fingerprint=FINGERPRINT)
    assert str(path) in str(err.value)


def test_a_scanning_set_loads_and_serves_as_the_share_plan(tmp_path):
    from rtp_llm.models_py.modules.hybrid.indexer_share import ENV_INDEXER_SHARE, IndexerSharePlan

    data = _profile_dict()
    data["indexer_share"] = {"scanning": [0, 3], "cost": {"1": 0.01, "3": 0.2}}
    p = load_topology_profile(_write(tmp_path, data), model_fingerprint=FINGERPRINT)
    assert p.scanning_layers == (0, 3)
    plan = IndexerSharePlan.from_env({ENV_INDEXER_SHARE: " Profile "}, FINGERPRINT.full_attention_layers, p)
    assert plan.scanning == (0, 3) and plan.spec == "profile" and plan.source(1) == 0 and plan.scans(3)
    # Without the variable the profile's set is not served: the default stays every layer scanning.
    assert not IndexerSharePlan.from_env({}, FINGERPRINT.full_attention_layers, p).shares
    plain = load_topology_profile(_write(tmp_path, _profile_dict(), "plain.json"), model_fingerprint=FINGERPRINT)
    assert plain.scanning_layers is None
    with pytest.raises(ValueError, match=r"RTP_LLM_TOPOLOGY_KV_INDEXER_SHARE=profile: the profile .*plain.json.* has no "
                                         r"indexer_share.scanning \(calibrate with --scan K"):
        IndexerSharePlan.from_env({ENV_INDEXER_SHARE: "profile"}, FINGERPRINT.full_attention_layers, plain)
    with pytest.raises(ValueError, match="=profile: expected a loaded profile"):
        IndexerSharePlan.from_env({ENV_INDEXER_SHARE: "profile"}, FINGERPRINT.full_attention_layers)
    only = _only_profile_dict()
    only["indexer_share"] = {"scanning": [0]}
    with pytest.raises(ValueError, match="indexer_share: expected no scanning set in a topology_only profile"):
        load_topology_profile(_write(tmp_path, only, "only.json"), model_fingerprint=FINGERPRINT)


def test_wrong_model_names_both_fingerprints(tmp_path):
    other = ModelFingerprint("12" * 32, "gemma-3-270m.gguf", 18, (5, 11, 17))
    with pytest.raises(ValueError) as err:
        load_topology_profile(_write(tmp_path, _profile_dict()), model_fingerprint=other)
    assert "tiny.gguf" in str(err.value) and "gemma-3-270m.gguf" in str(err.value)


def test_a_profile_read_without_its_model_is_validated_for_the_model_it_names(tmp_path):
    data, profile = read_profile_file(_write(tmp_path, _profile_dict()))
    assert data == _profile_dict() and profile.model == FINGERPRINT
    assert profile == load_topology_profile(_write(tmp_path, _profile_dict()), model_fingerprint=FINGERPRINT)
    bad = _profile_dict()
    bad["layers"]["1"]["1/4"] = dict(LOCAL_ONLY, sink_tokens=-1)
    with pytest.raises(ValueError, match=r"profile.json: layers\.1\.1/4"):
        read_profile_file(_write(tmp_path, bad))
    with pytest.raises(ValueError, match="cannot read the topology KV profile"):
        read_profile_file(tmp_path / "absent.json")


def test_unreadable_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read the topology KV profile") as err:
        load_topology_profile(tmp_path / "absent.json", model_fingerprint=FINGERPRINT)
    assert "absent.json" in str(err.value)


# (W, override, picked budget) for budgets 1/16 and 1/4 at reference context 8192.
BUDGET_PICKS = [
    (2048, None, Fraction(1, 4)),  # 2048 / 8192 = 1/4 exactly
    (512, None, Fraction(1, 16)),  # 1/16 exactly
    (1024, None, Fraction(1, 16)),  # 1/8: as far from both in log scale, the smaller wins
    (1100, None, Fraction(1, 4)),  # just past the geometric midpoint
    (8192, None, Fraction(1, 4)),  # beyond every budget: the largest
    (64, None, Fraction(1, 16)),
    (2048, "1/16", Fraction(1, 16)),  # the override wins
    (2048, " 0.0625 ", Fraction(1, 16)),
]


@pytest.mark.parametrize("width, override, expected", BUDGET_PICKS)
def test_budget_pick(width, override, expected):
    p = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    assert p.pick_budget(width, override) == expected


@pytest.mark.parametrize("override", ["1/8", "abc", "0"])
def test_budget_override_must_be_calibrated(override):
    p = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match=rf"{ENV_PROFILE_BUDGET}: expected one of .*\[1/16, 1/4\], got '{override}'"):
        p.pick_budget(2048, override)


# ------------------------------------------------------------------------- in the Indexer


def _step():
    gen = torch.Generator().manual_seed(5)
    batch = ref.build_prefill_batch(PREFIX, NEW, PAGE, gen)
    rows = sum(NEW)
    case = ref.IndexerCase(batch, None, None, None, None, None, torch.zeros(rows, HEADS, DIM),
                           torch.zeros(rows, HEADS, 1))
    known = engine_rows(batch.row_lengths, batch.row_offsets, gen).to(DEVICE)
    return case, known


def _call(indexer, case, known):
    cache = IndexerKeyCache(torch.zeros(1, PAGE, DIM, device=DEVICE))
    with mock.patch.object(Indexer, "_get_topk_ragged", autospec=True, return_value=known):
        return indexer._compute_topk(
            case.q.to(DEVICE), case.weights.to(DEVICE), cache,
            to_device(case.batch.fmha_params), to_device(case.batch.attention_inputs), None,
        )


def _layers(profile, **kw):
    return {i: Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=i, topology=IndexerTopologySettings(),
                       topology_profile=profile, **kw) for i in (0, 1, 2, 3)}


def test_each_layer_gets_its_own_settings_and_a_skipped_layer_returns_the_op_rows(tmp_path):
    profile = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    layers = _layers(profile)  # W 2048 / 8192 -> budget 1/4
    base = TopologyKVPolicyConfig()
    assert layers[0].topology.policy == TopologyKVPolicyConfig(policy=MERGE, **SINKS_ONLY)
    assert layers[1].topology.policy == TopologyKVPolicyConfig(policy=MERGE, **LOCAL_ONLY)
    for skipped in (2, 3):  # 2: not full attention; 3: share 0
        assert layers[skipped].topology.policy == base and not layers[skipped].topology.enabled
    case, known = _step()
    before = known.clone()
    outs = {i: _call(layer, case, known) for i, layer in layers.items()}
    assert outs[3] is known and outs[2] is known, "a skipped layer must return the op's tensor itself"
    assert torch.equal(known, before)
    for i, settings in ((0, SINKS_ONLY), (1, LOCAL_ONLY)):
        plain = Indexer(HEADS, DIM, WIDTH, PAGE, topology=IndexerTopologySettings(
            policy=TopologyKVPolicyConfig(policy=MERGE, **settings)))
        assert torch.equal(outs[i], _call(plain, case, known)), f"layer {i}: not its profile's settings"
    lengths = case.batch.row_lengths
    long_rows = [r for r, n in enumerate(lengths) if n > WIDTH]
    assert long_rows
    assert not torch.equal(outs[0], outs[1])
    for r in long_rows:
        row0, row1 = set(outs[0][r].tolist()), set(outs[1][r].tolist())
        n = lengths[r]
        assert {0, 1, 2, 3} <= row0, f"row {r}: layer 0 keeps the 4 sink tokens"
        last_block = (n - 1) // PAGE
        assert set(range(last_block * PAGE, n)) <= row1, f"row {r}: layer 1 keeps its local blocks"


def test_a_smaller_width_picks_the_other_budget():
    profile = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    layer = Indexer(HEADS, DIM, 512, PAGE, layer_idx=0, topology=IndexerTopologySettings(), topology_profile=profile)
    assert not layer.topology.enabled  # 512 / 8192 = 1/16: skipped there
    forced = Indexer(HEADS, DIM, 512, PAGE, layer_idx=0, topology=IndexerTopologySettings(),
                     topology_profile=profile, topology_profile_budget="1/4")
    assert forced.topology.policy.sink_tokens == 4


def test_the_environment_path(tmp_path, monkeypatch):
    path = _write(tmp_path, _profile_dict())
    monkeypatch.setenv(ENV_PROFILE, str(path))
    with pytest.raises(ValueError, match=f"{ENV_PROFILE}=.*model_fingerprint="):
        Indexer(HEADS, DIM, WIDTH, PAGE)
    layer = Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=1, model_fingerprint=FINGERPRINT)
    assert layer.topology.policy.local_blocks == 2 and layer.topology.policy.policy is MERGE
    monkeypatch.setenv(ENV_PROFILE_BUDGET, "1/16")
    assert not Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=1, model_fingerprint=FINGERPRINT).topology.enabled
    other = ModelFingerprint("12" * 32, "other.gguf", 4, (0, 1, 3))
    with pytest.raises(ValueError, match=f"{ENV_PROFILE}: .*made for tiny.gguf"):
        Indexer(HEADS, DIM, WIDTH, PAGE, model_fingerprint=other)
    monkeypatch.setenv(ENV_POLICY, "topology_only")
    with pytest.raises(ValueError, match="calibrated 'topology_sparse_merge' but the policy is set to 'topology_only'"):
        Indexer(HEADS, DIM, WIDTH, PAGE, model_fingerprint=FINGERPRINT)
    # A merge profile serves the other merge mode with the same per-layer structure.
    monkeypatch.setenv(ENV_POLICY, "topology_compress_sparse")
    monkeypatch.setenv(ENV_PROFILE_BUDGET, "1/4")
    compress = Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=1, model_fingerprint=FINGERPRINT)
    assert compress.topology.policy == TopologyKVPolicyConfig(policy="topology_compress_sparse", **LOCAL_ONLY)
    monkeypatch.setenv(ENV_PROFILE_BUDGET, "1/16")
    monkeypatch.delenv(ENV_PROFILE)
    monkeypatch.delenv(ENV_POLICY)
    with pytest.raises(ValueError, match=f"{ENV_PROFILE_BUDGET}='1/16': expected {ENV_PROFILE} to be set too"):
        Indexer(HEADS, DIM, WIDTH, PAGE)


def _only_profile_dict():
    data = _profile_dict()
    data["settings"].update(policy="topology_only", witness_signal="recency")
    entry = lambda sinks: {"max_structural_fraction": 1.0, "sink_tokens": sinks, "local_blocks": 2,  # noqa: E731
                           "witness_blocks": 0}
    data["layers"] = {"0": {"1/16": entry(4), "1/4": entry(0)}, "1": {"1/16": entry(4), "1/4": entry(16)},
                      "3": {"1/16": entry(4), "1/4": entry(4)}}
    return data


def test_a_topology_only_profile_gives_each_layer_its_sink_count():
    profile = parse_topology_profile(_only_profile_dict(), model_fingerprint=FINGERPRINT)
    assert profile.policy is TopologyKVPolicyMode.TOPOLOGY_ONLY and profile.witness_signal is WitnessSignal.RECENCY
    layers = _layers(profile)  # budget 1/4
    assert [layers[i].topology.policy.sink_tokens for i in (0, 1, 3)] == [0, 16, 4]
    assert all(layers[i].topology.policy.policy is TopologyKVPolicyMode.TOPOLOGY_ONLY for i in (0, 1, 3))
    assert not layers[2].topology.enabled  # not full attention
    assert not any(layer.reads_drift for layer in layers.values())
    case, known = _step()
    for i, sinks in ((0, 0), (1, 16)):
        plain = Indexer(HEADS, DIM, WIDTH, PAGE, topology=IndexerTopologySettings(policy=TopologyKVPolicyConfig(
            policy="topology_only", sink_tokens=sinks, local_blocks=2, witness_blocks=0, max_structural_fraction=1.0)))
        assert torch.equal(_call(layers[i], case, known), _call(plain, case, known)), f"layer {i}"
    assert not torch.equal(_call(layers[0], case, known), _call(layers[1], case, known))


def test_a_topology_only_profile_serves_no_merge_mode():
    profile = parse_topology_profile(_only_profile_dict(), model_fingerprint=FINGERPRINT)
    for mode in ("topology_sparse_merge", "topology_compress_sparse"):
        with pytest.raises(ValueError, match=rf"calibrated 'topology_only' but the policy is set to '{mode}'; "
                                             r"unset it or set it to one of \['topology_only'\]"):
            Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, topology_profile=profile,
                    topology=IndexerTopologySettings(policy=TopologyKVPolicyConfig(policy=mode), witness_signal="recency"))
    assert profile.served_mode(TopologyKVPolicyMode.TOPOLOGY_ONLY) is TopologyKVPolicyMode.TOPOLOGY_ONLY


def test_the_served_witness_signal_must_be_the_calibrated_one():
    profile = parse_topology_profile(_only_profile_dict(), model_fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match=f"calibrated with 'recency' witnesses, but serving resolves to 'key_drift'; "
                                         f"set {ENV_WITNESS_SIGNAL} to 'recency'"):
        Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, topology_profile=profile,
                topology=IndexerTopologySettings(witness_signal="key_drift"))
    merge = _profile_dict()
    merge["settings"]["witness_signal"] = "default"  # the harness's name: serving's auto, key drift for merge
    merge = parse_topology_profile(merge, model_fingerprint=FINGERPRINT)
    assert merge.witness_signal is WitnessSignal.KEY_DRIFT
    Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, topology_profile=merge, topology=IndexerTopologySettings())
    with pytest.raises(ValueError, match="calibrated with 'key_drift' witnesses"):
        Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, topology_profile=merge,
                topology=IndexerTopologySettings(witness_signal="recency"))


def test_a_layer_keeps_the_served_witness_signal(tmp_path, monkeypatch):
    # Regression: the layer's settings were rebuilt from the policy and paths only, so an
    # explicit witness signal fell back to auto (key drift for a merge profile).
    profile = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)  # records no signal
    layer = Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, topology_profile=profile,
                    topology=IndexerTopologySettings(witness_signal="recency"))
    assert layer.topology.witness_signal is WitnessSignal.RECENCY and not layer.reads_drift
    monkeypatch.setenv(ENV_WITNESS_SIGNAL, "recency")
    monkeypatch.setenv(ENV_PROFILE, str(_write(tmp_path, _profile_dict())))
    assert not Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, model_fingerprint=FINGERPRINT).reads_drift


def test_the_file_is_parsed_once_for_every_layer(tmp_path, monkeypatch):
    path = _write(tmp_path, _profile_dict(), "once.json")
    monkeypatch.setenv(ENV_PROFILE, str(path))
    real = profile_module.load_topology_profile
    with mock.patch.object(profile_module, "load_topology_profile", side_effect=real) as load:
        layers = [Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=i, model_fingerprint=FINGERPRINT) for i in range(4)]
    assert load.call_count == 1
    assert [layer.topology.enabled for layer in layers] == [True, True, False, False]


def test_no_profile_is_todays_behaviour(monkeypatch):
    monkeypatch.delenv(ENV_PROFILE, raising=False)
    monkeypatch.delenv(ENV_PROFILE_BUDGET, raising=False)
    assert Indexer(HEADS, DIM).topology == IndexerTopologySettings.from_env({})
    assert Indexer(HEADS, DIM, model_fingerprint=FINGERPRINT).topology == IndexerTopologySettings.from_env({})


def test_a_layer_call_does_no_profile_or_host_work(tmp_path):
    profile = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    layers = _layers(profile)
    case, known = _step()
    expected = {i: _call(layer, case, known) for i, layer in layers.items()}
    fail = {"side_effect": AssertionError("per-call profile work")}
    with mock.patch.object(profile_module.TopologyKVProfile, "pick_budget", **fail), \
            mock.patch.object(profile_module.TopologyKVProfile, "layer_config", **fail), \
            mock.patch.object(profile_module.TopologyKVProfile, "setting", **fail), \
            mock.patch.object(layer_module, "layer_topology_settings", **fail), \
            mock.patch.object(indexer_module, "profile_from_env", **fail), \
            mock.patch.object(profile_module, "load_topology_profile", **fail), \
            mock.patch.object(profile_module.json, "loads", **fail), \
            mock.patch.object(IndexerTopologySettings, "from_env", **fail), \
            mock.patch.object(indexer_module.torch, "tensor", side_effect=AssertionError("host list")):
        for i, layer in layers.items():
            out = _call(layer, case, known)
            assert torch.equal(out, expected[i])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="sync detection needs CUDA")
def test_profiled_layers_do_not_sync(tmp_path):
    profile = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    layers = _layers(profile)
    case, known = _step()
    _call(layers[0], case, known)  # warm-up (backend resolution, kernel build)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in layers.values():
            _call(layer, case, known)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_profile_object_is_immutable():
    profile = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    with pytest.raises(Exception):
        profile.block_size = 8  # frozen dataclass


# ------------------------------------------------------------------ strict profile files


def _load_in_thread(call, timeout=10.0):
    """``call()``'s exception (or None) from a daemon thread; fails if it blocks past ``timeout``."""
    import threading

    box = {}

    def target():
        try:
            call()
            box["err"] = None
        except BaseException as err:  # noqa: B902 (reported to the test)
            box["err"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"blocked for {timeout} s"
    return box["err"]


def test_a_fifo_is_refused_without_blocking(tmp_path, monkeypatch):
    import os

    fifo = tmp_path / "profile.fifo"
    os.mkfifo(fifo)
    err = _load_in_thread(lambda: load_topology_profile(fifo, model_fingerprint=FINGERPRINT))
    assert isinstance(err, ValueError) and str(fifo) in str(err) and "not a regular file" in str(err), err
    monkeypatch.setenv(ENV_PROFILE, str(fifo))
    err = _load_in_thread(lambda: Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, model_fingerprint=FINGERPRINT))
    assert isinstance(err, ValueError) and ENV_PROFILE in str(err) and "not a regular file" in str(err), err


def test_a_device_file_is_refused_without_reading_it():
    err = _load_in_thread(lambda: load_topology_profile("/dev/zero", model_fingerprint=FINGERPRINT))
    assert isinstance(err, ValueError) and "/dev/zero" in str(err) and "not a regular file" in str(err), err


def test_a_file_past_the_size_cap_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(profile_module.MAX_PROFILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ValueError, match=r"huge.json: .*bytes, more than the .* cap"):
        load_topology_profile(path, model_fingerprint=FINGERPRINT)


def test_deep_nesting_is_a_value_error_naming_the_file(tmp_path):
    path = _write(tmp_path, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply") as err:
        load_topology_profile(path, model_fingerprint=FINGERPRINT)
    assert str(path) in str(err.value)


def _with_layer_key(key):
    def change(d):
        d["layers"][key] = d["layers"].pop("1")
    return change


def _raw_text_with_duplicate_layer():
    text = json.dumps(_profile_dict())
    # Layer "1" appears twice: the second would silently win.
    return text.replace('"3": {', '"1": {"1/16": %s, "1/4": %s}, "3": {' % (json.dumps(SKIP), json.dumps(SKIP)), 1)


def _set_budgets(budgets, keys=None):
    def change(d):
        d["settings"]["budgets"] = budgets
        if keys is not None:
            for layer in d["layers"].values():
                entries = list(layer.values())
                layer.clear()
                layer.update(zip(keys, entries))
    return change


# (how the file is broken, the error): keys and numbers must be written one way only.
STRICT_PROFILES = [
    (_broken(_with_layer_key("01")), r"layers\.01: expected a layer index in canonical decimal"),
    (_broken(_with_layer_key("+1")), r"layers\.\+1: expected a layer index in canonical decimal"),
    (_broken(_with_layer_key(" 1 ")), r"layers\. 1 : expected a layer index in canonical decimal"),
    (_broken(_with_layer_key("1_0")), r"layers\.1_0: expected a layer index in canonical decimal"),
    (_broken(_with_layer_key("\u0661")), r"expected a layer index in canonical decimal"),  # Arabic-Indic 1
    (_raw_text_with_duplicate_layer(), r"layers: duplicate key '1'"),
    (_broken(_set_budgets(["1/16", "2/32"])), r"settings\.budgets: .*'2/32'.*canonical"),
    (_broken(_set_budgets(["1/16", "1/16"])), r"settings\.budgets: duplicate budget '1/16'"),
    (_broken(_set_budgets(["1/16", "1/4"], ["0.0625", "1/4"])), r"layers\.0\.0\.0625: .*canonical"),
    (_broken(lambda d: d.update(version=True)), r"version: expected 1, got True"),
    (_broken(lambda d: d["model"].update(full_attention_layers=[0, 1.0, 3])),
     r"model\.full_attention_layers: expected a list of integers"),
    (_broken(lambda d: d["model"].update(full_attention_layers=[0, True, 3])),
     r"model\.full_attention_layers: expected a list of integers"),
    (_broken(lambda d: d["settings"].update(block_size=True)), r"settings\.block_size: expected an integer"),
    (json.dumps(_profile_dict()).replace('"num_layers": 4', '"num_layers": ' + "9" * 5000),
     r"model\.num_layers: expected an integer >= 1, got an integer of 5000 digits"),
    (json.dumps(_profile_dict()).replace('"sink_tokens": 4', '"sink_tokens": ' + "9" * 5000),
     r"layers\.0\.1/4\.sink_tokens: expected an integer >= 0, got an integer of 5000 digits"),
]


@pytest.mark.parametrize("data, message", STRICT_PROFILES)
def test_keys_and_numbers_are_strict(tmp_path, data, message):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=message) as err:
        load_topology_profile(path, model_fingerprint=FINGERPRINT)
    assert str(path) in str(err.value)
    assert len(str(err.value)) < 1000, "long values are cut in messages"


def test_a_share_too_small_for_the_width_names_the_profile_field(tmp_path):
    data = _profile_dict()
    data["layers"]["0"]["1/4"]["max_structural_fraction"] = 1e-300
    path = _write(tmp_path, data)
    profile = load_topology_profile(path, model_fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match=r"layers\.0\.1/4\.max_structural_fraction") as err:
        Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, topology=IndexerTopologySettings(), topology_profile=profile)
    assert str(path) in str(err.value) and "MAX_STRUCTURAL_FRACTION" not in str(err.value)


@pytest.mark.parametrize("layer_idx", [999, 4, -1, True])
def test_a_layer_index_outside_the_profiles_model_is_refused(layer_idx):
    profile = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match=r"layer_idx: expected a layer of the profile's model \[0, 4\)"):
        Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=layer_idx, topology=IndexerTopologySettings(),
                topology_profile=profile)


def test_a_profile_needs_the_layer_index(tmp_path, monkeypatch):
    profile = parse_topology_profile(_profile_dict(), model_fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match="layer_idx: expected the layer's index with a profile, got None"):
        Indexer(HEADS, DIM, WIDTH, PAGE, topology=IndexerTopologySettings(), topology_profile=profile)
    monkeypatch.setenv(ENV_PROFILE, str(_write(tmp_path, _profile_dict())))
    with pytest.raises(ValueError, match="layer_idx: expected the layer's index with a profile, got None"):
        Indexer(HEADS, DIM, WIDTH, PAGE, model_fingerprint=FINGERPRINT)
    monkeypatch.delenv(ENV_PROFILE)
    assert Indexer(HEADS, DIM, WIDTH, PAGE).layer_idx == 0  # without a profile: for log messages only


@pytest.mark.parametrize("kwargs, message", [
    (dict(gguf_sha256=None), r"gguf_sha256: expected a hex sha256 \(64 hex digits\), got None"),
    (dict(gguf_sha256="xyz"), r"gguf_sha256: expected a hex sha256"),
    (dict(name=None), r"name: expected a string, got None"),
    (dict(full_attention_layers=(0, 1.5)), r"full_attention_layers: expected integers, got \[0, 1.5\]"),
    (dict(full_attention_layers=(0, True)), r"full_attention_layers: expected integers"),
])
def test_a_fingerprint_of_wrong_types_is_refused(kwargs, message):
    fields = dict(gguf_sha256="ab" * 32, name="tiny.gguf", num_layers=4, full_attention_layers=(0, 1, 3))
    fields.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=message):
        ModelFingerprint(**fields)


@pytest.mark.parametrize("override", ["\u0661/\u0661\u0666", "1/1\u0666", "\uff11/16", "1_0/160"])
def test_the_budget_variable_takes_ascii_digits_only(tmp_path, monkeypatch, override):
    monkeypatch.setenv(ENV_PROFILE, str(_write(tmp_path, _profile_dict())))
    monkeypatch.setenv(ENV_PROFILE_BUDGET, override)
    with pytest.raises(ValueError, match=rf"{ENV_PROFILE_BUDGET}: expected one of"):
        Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, model_fingerprint=FINGERPRINT)


def test_a_long_profile_path_is_cut_in_messages(monkeypatch):
    monkeypatch.setenv(ENV_PROFILE, "/nonexistent/" + "p" * 100_000)
    with pytest.raises(ValueError) as err:
        Indexer(HEADS, DIM, WIDTH, PAGE, layer_idx=0, model_fingerprint=FINGERPRINT)
    assert ENV_PROFILE in str(err.value) and len(str(err.value)) < 1000
