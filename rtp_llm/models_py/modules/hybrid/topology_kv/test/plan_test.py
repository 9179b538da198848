"""The per-step plan: scaffold spans as device tensors, fingerprints once per step.

A forward step builds one :class:`TopologyStepPlan` from its requests' contexts and passes
it to every layer; a layer call then does no host work for compress mode (no host list,
no host-to-device copy, no fingerprint bookkeeping).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from rtp_llm.models_py.modules.hybrid.topology_kv import request as topology_kv_request
from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    CoordinateMismatchAction,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import (
    TopologyRequestContext,
    TopologyStepPlan,
    apply_topology_kv_policy,
)
from tools.device_under_test import DEVICE

COMPRESS = TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE


def _case():
    config = TopologyKVPolicyConfig(policy=COMPRESS, local_blocks=2, witness_blocks=2, block_size=4,
                                    coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED)
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([60, 60, 44, 60], dtype=torch.int32)
    rows = [torch.randperm(int(n), generator=g)[:16].tolist() for n in lengths]
    x = torch.tensor(rows, dtype=torch.int32).to(DEVICE)
    row_to_request = torch.tensor([0, 1, 1, 2], device=DEVICE)
    return config, x, lengths.to(DEVICE), row_to_request


def _contexts():
    return [TopologyRequestContext(scaffold_token_ids=tuple(range(n))) for n in (0, 40, 24)]


def test_a_plan_gives_the_rows_and_counters_the_contexts_give():
    config, x, lengths, r2r = _case()
    direct = apply_topology_kv_policy(x, lengths, config=config, row_to_request=r2r, context=_contexts())
    contexts = _contexts()
    plan = TopologyStepPlan.build(config, 16, contexts, num_rows=4, row_to_request=r2r, device=DEVICE)
    assert plan.scaffold_lengths.device == torch.device(DEVICE) and plan.scaffold_lengths.tolist() == [0, 40, 40, 24]
    planned = apply_topology_kv_policy(x, lengths, config=config, row_to_request=r2r, plan=plan)
    assert torch.equal(planned.indices, direct.indices)
    assert planned.counters.to_dict() == direct.counters.to_dict()
    assert planned.counters.to_dict()["compressed_blocks"] > 0
    assert planned.fingerprints == direct.fingerprints


def test_layers_sharing_a_plan_do_no_host_work_and_count_each_step_once():
    config, x, lengths, r2r = _case()
    contexts = _contexts()
    steps = []
    for _step in range(2):
        plan = TopologyStepPlan.build(config, 16, contexts, num_rows=4, row_to_request=r2r, device=DEVICE)
        with mock.patch.object(topology_kv_request.torch, "tensor", side_effect=AssertionError("host list")), \
                mock.patch.object(topology_kv_request, "policy_fingerprint", side_effect=AssertionError("fingerprint")):
            for _layer in range(3):
                res = apply_topology_kv_policy(x, lengths, config=config, row_to_request=r2r, plan=plan)
        steps.append(res.counters.compression_hits)
    assert steps == [0, 3]  # the second step's three contexts repeat the first's
    assert [c.compression_hits for c in contexts] == [1, 1, 1]  # once per step, not per layer


def test_plan_and_context_together_or_a_plan_for_other_rows_are_errors():
    config, x, lengths, r2r = _case()
    plan = TopologyStepPlan.build(config, 16, _contexts(), num_rows=4, row_to_request=r2r, device=DEVICE)
    with pytest.raises(ValueError, match="context: expected None when plan is given"):
        apply_topology_kv_policy(x, lengths, config=config, row_to_request=r2r, plan=plan, context=_contexts())
    other = TopologyStepPlan.build(config, 16, _contexts()[:1], num_rows=3, device=DEVICE)
    with pytest.raises(ValueError, match=r"plan.scaffold_lengths: expected shape \(4,\), got \(3,\)"):
        apply_topology_kv_policy(x, lengths, config=config, plan=other)
    with pytest.raises(ValueError, match="context: expected 1 context, one per row"):
        TopologyStepPlan.build(config, 16, _contexts()[:2], num_rows=4, device=DEVICE)
