"""Serving settings from the RTP_LLM_TOPOLOGY_KV_* environment: defaults, parsing, errors.
"""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import pytest
import torch

from rtp_llm.models_py.modules.hybrid.indexer import Indexer
from rtp_llm.models_py.modules.hybrid.test.indexer_cases import (
    DIM,
    HEADS,
    MERGE,
    ONLY,
    PAGE,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    ALL_PATHS,
    ENV_BACKEND,
    ENV_LOCAL_BLOCKS,
    ENV_MAX_STRUCTURAL_FRACTION,
    ENV_MISMATCH_ACTION,
    ENV_PATHS,
    ENV_POLICY,
    ENV_SINK_BLOCKS,
    ENV_SINK_TOKENS,
    ENV_WITNESS_BLOCKS,
    ENV_WITNESS_SIGNAL,
    MAX_STRUCTURAL_BLOCKS,
    TopologyKVPolicyConfig,
    CoordinateMismatchAction,
    IndexerPath,
    IndexerTopologySettings,
    WitnessSignal,
    TopologyKVPolicyMode,
)

# ------------------------------------------------------------------ settings from the environment


def test_env_defaults():
    s = IndexerTopologySettings.from_env({})
    assert s.policy.policy is TopologyKVPolicyMode.DISABLED and not s.enabled
    assert (s.policy.sink_blocks, s.policy.local_blocks, s.policy.witness_blocks) == (1, 2, 2)
    assert s.policy.max_structural_fraction == 0.25 and s.policy.block_size == PAGE
    assert s.policy.coordinate_mismatch_action is CoordinateMismatchAction.FALLBACK_DISABLED
    assert s.paths == ALL_PATHS
    blank = {name: "  " for name in (ENV_POLICY, ENV_SINK_BLOCKS, ENV_PATHS, ENV_MAX_STRUCTURAL_FRACTION)}
    assert IndexerTopologySettings.from_env(blank) == s  # blank = unset


def test_env_all_variables_parsed_case_insensitively():
    env = {
        ENV_POLICY: " Topology_Only ",
        ENV_SINK_BLOCKS: "3",
        ENV_LOCAL_BLOCKS: "0",
        ENV_WITNESS_BLOCKS: "5",
        ENV_MAX_STRUCTURAL_FRACTION: "1",
        ENV_MISMATCH_ACTION: "RAISE",
        ENV_PATHS: " Decode , CP ",
    }
    s = IndexerTopologySettings.from_env(env, block_size=32)
    assert s.policy.policy is ONLY
    assert (s.policy.sink_blocks, s.policy.local_blocks, s.policy.witness_blocks, s.policy.block_size) == (3, 0, 5, 32)
    assert s.policy.max_structural_fraction == 1.0
    assert s.policy.coordinate_mismatch_action is CoordinateMismatchAction.RAISE
    assert s.paths == {IndexerPath.DECODE, IndexerPath.CP}
    assert IndexerTopologySettings.from_env({ENV_PATHS: "all"}).paths == ALL_PATHS


# (variable, bad value): every variable, every kind of bad value.
BAD_ENV = [
    (ENV_POLICY, "merge"),  # unknown mode
    (ENV_POLICY, "on"),
    (ENV_SINK_BLOCKS, "one"),  # not an integer
    (ENV_SINK_BLOCKS, "1.5"),
    (ENV_SINK_BLOCKS, "-1"),  # negative
    (ENV_LOCAL_BLOCKS, "2x"),
    (ENV_LOCAL_BLOCKS, "-2"),
    (ENV_WITNESS_BLOCKS, "many"),
    (ENV_WITNESS_BLOCKS, "-3"),
    (ENV_MAX_STRUCTURAL_FRACTION, "0"),  # out of (0, 1]
    (ENV_MAX_STRUCTURAL_FRACTION, "1.5"),
    (ENV_MAX_STRUCTURAL_FRACTION, "-0.1"),
    (ENV_MAX_STRUCTURAL_FRACTION, "nan"),
    (ENV_MAX_STRUCTURAL_FRACTION, "quarter"),  # not a number
    (ENV_MISMATCH_ACTION, "ignore"),  # unknown action
    (ENV_PATHS, "decode,verify"),  # unknown path name
    (ENV_PATHS, "decode,,cp"),  # empty item
    # int() / float() accept these; a block count or fraction never means them.
    (ENV_LOCAL_BLOCKS, "3_000"),  # digit separator
    (ENV_LOCAL_BLOCKS, "+2"),  # sign
    (ENV_WITNESS_BLOCKS, "\u0663"),  # ARABIC-INDIC DIGIT THREE
    (ENV_SINK_TOKENS, "12345678901234567890"),  # 20 digits
    (ENV_MAX_STRUCTURAL_FRACTION, "0_5"),
    # Block counts past MAX_STRUCTURAL_BLOCKS (a call grew 400x at 2000).
    (ENV_LOCAL_BLOCKS, "2000"),
    (ENV_WITNESS_BLOCKS, "65"),
    # The serving witness signal.
    (ENV_WITNESS_SIGNAL, "drift"),  # not a member (key_drift is)
    (ENV_WITNESS_SIGNAL, "query_mass"),  # a harness signal the Indexer does not compute
]


@pytest.mark.parametrize("name,value", BAD_ENV)
def test_env_bad_value_names_variable_and_value(name, value):
    with pytest.raises(ValueError) as err:
        IndexerTopologySettings.from_env({ENV_POLICY: "topology_sparse_merge", name: value})
    assert name in str(err.value) and repr(value) in str(err.value), str(err.value)


def test_env_inconsistent_block_counts_name_the_variables():
    env = {ENV_POLICY: "topology_sparse_merge", ENV_SINK_BLOCKS: "0", ENV_LOCAL_BLOCKS: "0", ENV_WITNESS_BLOCKS: "0"}
    # The default sinks are 4 tokens, so zero blocks of every kind still inject something...
    assert IndexerTopologySettings.from_env(env).policy.sink_tokens == 4
    # ...but with no sink tokens either the policy would inject nothing.
    for tokens in ("0", "blocks"):
        with pytest.raises(ValueError, match=f"{ENV_SINK_BLOCKS}=0, {ENV_SINK_TOKENS}={tokens}, "
                                             f"{ENV_LOCAL_BLOCKS}=0, {ENV_WITNESS_BLOCKS}=0"):
            IndexerTopologySettings.from_env({**env, ENV_SINK_TOKENS: tokens})


def test_indexer_reads_environment_once_at_construction():
    with mock.patch.dict(os.environ, {ENV_SINK_BLOCKS: "-1"}):
        with pytest.raises(ValueError, match=ENV_SINK_BLOCKS):
            Indexer(HEADS, DIM)
    with mock.patch.dict(os.environ, {ENV_POLICY: "topology_sparse_merge", ENV_PATHS: "decode"}):
        indexer = Indexer(HEADS, DIM)
    with mock.patch.dict(os.environ, {ENV_POLICY: "bogus"}):
        assert indexer.topology.policy.policy is MERGE  # later changes are not read
        assert indexer.topology.paths == {IndexerPath.DECODE}



def test_env_sink_tokens_and_structural_budget():
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import IndexerTopologySettings, StructuralBudget

    env = {"RTP_LLM_TOPOLOGY_KV_POLICY": "topology_sparse_merge", "RTP_LLM_TOPOLOGY_KV_SINK_TOKENS": "4",
           "RTP_LLM_TOPOLOGY_KV_STRUCTURAL_BUDGET": "Scaled"}
    settings = IndexerTopologySettings.from_env(env)
    assert settings.policy.sink_tokens == 4
    assert settings.policy.structural_budget is StructuralBudget.SCALED
    blocks = IndexerTopologySettings.from_env({**env, "RTP_LLM_TOPOLOGY_KV_SINK_TOKENS": "blocks"})
    assert blocks.policy.sink_tokens is None
    for name, bad in [("RTP_LLM_TOPOLOGY_KV_SINK_TOKENS", "-4"), ("RTP_LLM_TOPOLOGY_KV_SINK_TOKENS", "four"),
                      ("RTP_LLM_TOPOLOGY_KV_STRUCTURAL_BUDGET", "elastic")]:
        with pytest.raises(ValueError, match=name):
            IndexerTopologySettings.from_env({**env, name: bad})



def test_block_counts_are_bounded_at_config_time():
    """At most MAX_STRUCTURAL_BLOCKS scheduled blocks, named in the error."""
    TopologyKVPolicyConfig(policy=MERGE, sink_tokens=4, local_blocks=MAX_STRUCTURAL_BLOCKS - 3, witness_blocks=2)
    with pytest.raises(ValueError, match="local_blocks: expected <= 64, got 2000"):
        TopologyKVPolicyConfig(policy=MERGE, local_blocks=2000)
    with pytest.raises(ValueError, match="expected <= 64 scheduled blocks"):
        TopologyKVPolicyConfig(policy=MERGE, sink_tokens=4, local_blocks=40, witness_blocks=24)
    with pytest.raises(ValueError, match="scheduled blocks"):
        TopologyKVPolicyConfig(policy=MERGE, sink_tokens=64 * 64 + 1, local_blocks=0, witness_blocks=0)


def test_a_fraction_that_injects_nothing_at_the_width_is_rejected():
    """floor(W * fraction) == 0 would make a merge mode a silent no-op."""
    env = {ENV_POLICY: "topology_sparse_merge", ENV_MAX_STRUCTURAL_FRACTION: "0.0001"}
    settings = IndexerTopologySettings.from_env(env)  # valid on its own ...
    with pytest.raises(ValueError, match=ENV_MAX_STRUCTURAL_FRACTION):
        Indexer(HEADS, DIM, index_topk=2048, topology=settings)  # ... but 0 tokens at W = 2048
    Indexer(HEADS, DIM, index_topk=2048, topology=IndexerTopologySettings.from_env({**env, ENV_POLICY: "topology_only"}))
    Indexer(HEADS, DIM, index_topk=2048, topology=IndexerTopologySettings.from_env({**env, ENV_MAX_STRUCTURAL_FRACTION: "0.0005"}))


def test_python_config_and_serving_env_default_to_the_same_sync_free_action():
    """TopologyKVPolicyConfig() and the environment default to the same action,
    fallback_disabled (raise costs a host sync per call)."""
    fallback = CoordinateMismatchAction.FALLBACK_DISABLED
    assert TopologyKVPolicyConfig().coordinate_mismatch_action is fallback
    assert IndexerTopologySettings.from_env({}).policy.coordinate_mismatch_action is fallback
    assert IndexerTopologySettings().policy.coordinate_mismatch_action is fallback


def test_a_forced_backend_the_layer_device_cannot_run_fails_at_construction():
    """With its device known, the Indexer resolves (and builds) the policy's backend once,
    at construction: a forced backend that cannot run there fails now, naming itself."""
    settings = IndexerTopologySettings.from_env({ENV_POLICY: "topology_sparse_merge", ENV_BACKEND: "cpu_fused"})
    with pytest.raises(ValueError, match="backend: 'cpu_fused' cannot run on meta"):
        Indexer(HEADS, DIM, topology=settings, device=torch.device("meta"))
    Indexer(HEADS, DIM, topology=settings)  # device unknown: resolved at the first call
    Indexer(HEADS, DIM, topology=IndexerTopologySettings(), device=torch.device("meta"))  # disabled: nothing


def test_env_witness_signal_defaults_to_auto_recency_only_for_topology_only():
    """auto serves topology_only with recency (it then selects plain locality) and
    the merge modes with key drift; an explicit value applies to every mode."""
    assert IndexerTopologySettings().witness_signal is WitnessSignal.AUTO
    for mode, want in [("topology_only", "recency"), ("topology_sparse_merge", "key_drift"),
                       ("topology_compress_sparse", "key_drift"), ("disabled", "key_drift")]:
        s = IndexerTopologySettings.from_env({ENV_POLICY: mode})
        assert s.witness_signal is WitnessSignal.AUTO
        assert s.resolved_witness_signal is WitnessSignal(want), mode
    for raw, want in [(" Recency ", "recency"), ("KEY_DRIFT", "key_drift"), ("auto", "auto"), ("  ", "auto")]:
        for mode in ("topology_only", "topology_sparse_merge"):
            s = IndexerTopologySettings.from_env({ENV_POLICY: mode, ENV_WITNESS_SIGNAL: raw})
            assert s.witness_signal is WitnessSignal(want), (raw, mode)
            if want != "auto":
                assert s.resolved_witness_signal is WitnessSignal(want), (raw, mode)


def test_env_bad_witness_signal_lists_the_valid_values():
    with pytest.raises(ValueError) as err:
        IndexerTopologySettings.from_env({ENV_POLICY: "topology_only", ENV_WITNESS_SIGNAL: "drift"})
    assert str(err.value) == (
        f"{ENV_WITNESS_SIGNAL}='drift': expected one of [auto, key_drift, recency, query_group_mass] "
        "(case-insensitive), got 'drift'"
    )
    valid = "witness_signal: expected one of \\[auto, key_drift, recency, query_group_mass\\]"
    with pytest.raises(ValueError, match=valid):
        IndexerTopologySettings(witness_signal="bogus")
    with pytest.raises(ValueError, match=valid):  # a harness-only signal: serving does not compute it
        IndexerTopologySettings(witness_signal="query_mass")
    served = IndexerTopologySettings.from_env({ENV_POLICY: "topology_sparse_merge", ENV_WITNESS_SIGNAL: "Query_Group_Mass"})
    assert served.resolved_witness_signal is WitnessSignal.QUERY_GROUP_MASS


def test_env_structure_layers():
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import ENV_STRUCTURE_LAYERS, StructureLayers

    assert IndexerTopologySettings.from_env({}).structure_layers is StructureLayers.ALL
    assert IndexerTopologySettings.from_env({ENV_STRUCTURE_LAYERS: " Sharing "}).structure_layers is StructureLayers.SHARING
    with pytest.raises(ValueError) as err:
        IndexerTopologySettings.from_env({ENV_STRUCTURE_LAYERS: "scanning"})
    assert str(err.value) == (f"{ENV_STRUCTURE_LAYERS}='scanning': expected all, sharing or a comma list of layer "
                              "indices (e.g. 1,17,24), got 'scanning'")
    with pytest.raises(ValueError, match=r"structure_layers: expected one of \[all, sharing\]"):
        IndexerTopologySettings(structure_layers="some")
    listed = IndexerTopologySettings.from_env({ENV_STRUCTURE_LAYERS: " 24, 1,17 "})
    assert listed.structure_layers is StructureLayers.LISTED
    assert listed.structure_layer_list == (1, 17, 24)
    for bad in ("1,,2", "1;2", "-1", "1,1"):
        with pytest.raises(ValueError, match=f"^{ENV_STRUCTURE_LAYERS}="):
            IndexerTopologySettings.from_env({ENV_STRUCTURE_LAYERS: bad})


@pytest.mark.parametrize("value, kind, layers", [
    ("all", "ALL", ()), (" SHARING ", "SHARING", ()), ("3", "LISTED", (3,)), ("9,2,5", "LISTED", (2, 5, 9)),
    ((4, 0), "LISTED", (0, 4)), ([7], "LISTED", (7,)),
])
def test_structure_layers_forms(value, kind, layers):
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import StructureLayers

    settings = IndexerTopologySettings(structure_layers=value)
    assert settings.structure_layers is StructureLayers[kind]
    assert settings.structure_layer_list == layers
    # dataclasses.replace (the Indexer's scanning-layer copy) keeps the list
    again = dataclasses.replace(settings, policy=TopologyKVPolicyConfig())
    assert (again.structure_layers, again.structure_layer_list) == (settings.structure_layers, layers)


@pytest.mark.parametrize("value, message", [
    ("1,1", "expected each layer once, got '1,1'"),
    ("", "expected one of [all, sharing] or a comma list of layer indices (e.g. 1,17,24), got ''"),
    ("1,x", "expected one of [all, sharing] or a comma list of layer indices (e.g. 1,17,24), got '1,x'"),
    ((1, -2), "expected layer indices >= 0, got (1, -2)"),
    ((1, True), "expected layer indices >= 0, got (1, True)"),
    ((), "expected all, sharing or a comma list of layer indices (e.g. 1,17,24), got ()"),
    ("listed", "expected one of [all, sharing] or a comma list"),
])
def test_structure_layers_refusals(value, message):
    with pytest.raises(ValueError) as err:
        IndexerTopologySettings(structure_layers=value)
    assert str(err.value).startswith("structure_layers: " + message)


def test_structure_layer_list_only_with_listed():
    with pytest.raises(ValueError, match=r"^structure_layer_list: expected it only with structure_layers listed"):
        IndexerTopologySettings(structure_layers="sharing", structure_layer_list=(1,))


def test_every_serving_variable_is_read_and_documented_in_the_readme():
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import serving_variables
    from rtp_llm.models_py.modules.hybrid.topology_kv.profile import ENV_PROFILE, ENV_PROFILE_BUDGET
    from rtp_llm.metrics import metrics_variables
    from rtp_llm.models_py.modules.hybrid.indexer_share import ENV_INDEXER_SHARE

    names = serving_variables() + (ENV_PROFILE, ENV_PROFILE_BUDGET, ENV_INDEXER_SHARE) + metrics_variables()
    assert len(set(names)) == len(names) == 18
    readme = open(os.path.join(os.path.dirname(__file__), *[os.pardir] * 5, "README.md"), encoding="utf-8").read()
    table = [line for line in readme.splitlines() if line.startswith("| `RTP_LLM_TOPOLOGY_KV_")]
    documented = {line.split("`")[1] for line in table}
    assert documented == set(names), (sorted(documented ^ set(names)))
    # Each policy variable changes the setting it names (a non-default value is read).
    changed = {
        "RTP_LLM_TOPOLOGY_KV_SINK_BLOCKS": "3", "RTP_LLM_TOPOLOGY_KV_LOCAL_BLOCKS": "3",
        "RTP_LLM_TOPOLOGY_KV_WITNESS_BLOCKS": "3", "RTP_LLM_TOPOLOGY_KV_MAX_STRUCTURAL_FRACTION": "0.5",
        "RTP_LLM_TOPOLOGY_KV_MISMATCH_ACTION": "raise", "RTP_LLM_TOPOLOGY_KV_SINK_TOKENS": "blocks",
        "RTP_LLM_TOPOLOGY_KV_STRUCTURAL_BUDGET": "scaled", "RTP_LLM_TOPOLOGY_KV_BACKEND": "torch",
    }
    base = {"RTP_LLM_TOPOLOGY_KV_POLICY": "topology_sparse_merge"}
    default = IndexerTopologySettings.from_env(base).policy
    for name, value in changed.items():
        assert IndexerTopologySettings.from_env({**base, name: value}).policy != default, name


@pytest.mark.parametrize("value", ["x" * 100_000, "9" * 100_000, "topology_only," * 10_000])
def test_a_long_bad_value_is_cut_in_the_message(value):
    # The variable and the start of the value are enough to find it; a 100k-character
    # value is not echoed whole.
    from rtp_llm.models_py.modules.hybrid.topology_kv.config import serving_variables

    for name in serving_variables():
        env = {ENV_POLICY: "topology_sparse_merge", name: value}
        with pytest.raises(ValueError) as err:
            IndexerTopologySettings.from_env(env)
        assert name in str(err.value) and len(str(err.value)) < 1000, (name, len(str(err.value)))
