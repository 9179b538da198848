"""One immutable policy object per sparse-attention layer, built with the ``Indexer``.

:meth:`TopologyKVLayerPolicy.build` does, once, everything that does not change between
calls: it validates the settings, applies the layer's profile entry, checks that a merge
mode can inject at the layer's width, derives the kernels' :class:`PolicyLayout`, resolves
the backend for the layer's device (building the fused CPU kernel now rather than at the
first call) and decides whether the layer reads the drift tracker. Per call,
:meth:`TopologyKVLayerPolicy.run` takes only tensors: the top-k rows and what the path
hands in (lengths, offsets, row-to-request map, drift, the step's plan).

The rows a layer object returns are exactly those of :func:`apply_topology_kv_policy` with
the same settings (tested); it skips that entry's per-call argument checks because the
``Indexer`` hands in tensors of its own top-k op and the engine's parameter objects. On
CPU with the fused kernel a call is one C++ entry whose metadata checks cost nothing
next to the rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple, Union

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    ENV_MAX_STRUCTURAL_FRACTION,
    CoordinateMismatchAction,
    IndexerPath,
    IndexerTopologySettings,
    TopologyKVBackend,
    TopologyKVPolicyMode,
    WitnessSignal,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_fused
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.dispatch import buffer_counters, resolve_backend
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import PolicyLayout, PolicyTensors
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import (
    TopologyKVCounters,
    TopologyKVPolicyResult,
    apply_topology_kv_policy,
    run_layout,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.profile import (
    TopologyKVProfile,
    budget_key,
    check_profile_layer,  # noqa: F401 (the rule build applies, documented there)
    layer_topology_settings,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.request import ContextArg, TopologyStepPlan


# The plan of a call without contexts (no scaffold, no fingerprint): immutable, shared.
_NO_CONTEXT_PLAN = TopologyStepPlan(scaffold_lengths=None)


@dataclasses.dataclass(frozen=True)
class TopologyKVLayerPolicy:
    """The policy of one layer: settings, layout and backend, fixed at construction.

    Attributes
    ----------
    settings : the layer's :class:`IndexerTopologySettings` (its profile entry applied)
    layer_idx : the layer (profile lookup, log messages; 0 when built without one and no profile)
    width : ``W``, the layer's top-k width
    layout : the kernels' :class:`PolicyLayout`, or None when the policy is disabled
    backend : the backend resolved for ``device``, or None (no device given: resolved on the
        rows' device at the first call, cached per device)
    reads_drift : whether the layer passes the drift tracker's scores (the policy is on and
        its witness signal resolves to ``key_drift``)
    reads_queries : whether the layer ranks witnesses by ``query_group_mass`` (the policy is
        on and its signal is that one): it reads the caller's attention queries and a tracker
        of the layer's attention keys
    kernel : ``(compiled entry, its constants for width W)`` when the fused CPU kernel runs
        and mismatches do not raise: a call on rows of width W without contexts is one
        direct call of the compiled op; else None
    """

    settings: IndexerTopologySettings
    layer_idx: int
    width: int
    layout: Optional[PolicyLayout]
    backend: Optional[TopologyKVBackend]
    reads_drift: bool
    reads_queries: bool = False
    kernel: Optional[Tuple[Callable, tuple]] = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        settings: IndexerTopologySettings,
        *,
        layer_idx: Optional[int],
        width: int,
        device: Union[None, str, torch.device] = None,
        profile: Optional[TopologyKVProfile] = None,
        profile_budget: Optional[str] = None,
    ) -> "TopologyKVLayerPolicy":
        """Validate and derive everything once; errors name the setting and the value.

        ``layer_idx`` is required with a profile and must be a layer of its model
        (:func:`check_profile_layer`); without one it only names the layer in messages (None: 0).
        """
        if not isinstance(settings, IndexerTopologySettings):
            raise TypeError(f"topology: expected IndexerTopologySettings, got {type(settings).__name__}")
        if profile is not None:
            settings = layer_topology_settings(settings, profile, layer_idx, width, profile_budget)
        policy = settings.policy
        if policy.enabled and policy.policy is not TopologyKVPolicyMode.TOPOLOGY_ONLY:
            if policy.structural_cap(width) == 0 and profile is not None:
                budget = budget_key(profile.pick_budget(width, profile_budget))
                raise ValueError(
                    f"{profile.path}: layers.{layer_idx}.{budget}.max_structural_fraction: expected >= 1 / "
                    f"index_topk (1/{width}) so that {policy.policy.value} can inject a token, got "
                    f"{policy.max_structural_fraction} (floor({width} * {policy.max_structural_fraction}) = 0)"
                )
            if policy.structural_cap(width) == 0:
                raise ValueError(
                    f"max_structural_fraction ({ENV_MAX_STRUCTURAL_FRACTION}): expected >= 1 / index_topk "
                    f"(1/{width}) so that {policy.policy.value} can inject a token, got "
                    f"{policy.max_structural_fraction} (floor({width} * {policy.max_structural_fraction}) = 0)"
                )
        backend = None
        if device is not None and policy.enabled:
            backend = resolve_backend(policy.backend, device)  # raises naming backend and device
        layout = PolicyLayout.from_config(policy) if policy.enabled else None
        kernel = None
        if (backend is TopologyKVBackend.CPU_FUSED and width >= 1
                and policy.coordinate_mismatch_action is not CoordinateMismatchAction.RAISE):
            kernel = (cpu_fused.compiled_entry(), cpu_fused.layer_args(layout, width))
        return cls(
            settings=settings,
            layer_idx=0 if layer_idx is None else layer_idx,
            width=width,
            layout=layout,
            backend=backend,
            reads_drift=policy.enabled and settings.resolved_witness_signal is WitnessSignal.KEY_DRIFT,
            reads_queries=policy.enabled and settings.resolved_witness_signal is WitnessSignal.QUERY_GROUP_MASS,
            kernel=kernel,
        )

    @property
    def enabled(self) -> bool:
        return self.layout is not None

    def applies_to(self, path: IndexerPath) -> bool:
        return self.settings.applies_to(path)

    def run(
        self,
        topk_indices: torch.Tensor,
        lengths: torch.Tensor,
        offsets: Optional[torch.Tensor] = None,
        block_drift_scores: Optional[torch.Tensor] = None,
        row_to_request: Optional[torch.Tensor] = None,
        *,
        learned_scores: Optional[torch.Tensor] = None,
        context: ContextArg = None,
        plan: Optional[TopologyStepPlan] = None,
        out: Optional[torch.Tensor] = None,
        counters_out: Optional[torch.Tensor] = None,
    ) -> TopologyKVPolicyResult:
        """The layer's policy on its top-k rows (shapes as in :func:`apply_topology_kv_policy`;
        ``learned_scores``: the indexer's scores of the rows' entries, for score eviction).

        Disabled: ``topk_indices`` itself and no counters. ``coordinate_mismatch_action=raise``
        runs the public entry (its host check is the point of that setting). With
        ``cpu_fused`` the rows come from one C++ entry (as :func:`run_layout` calls it: the
        metadata checks in C++, drift rows read through ``row_to_request``), called
        directly with the layer's constants when the rows have the layer's width.
        """
        kernel = self.kernel
        if kernel is not None and context is None and topk_indices.shape[1] == self.width:
            # The serving call: run_layout's CPU call with the constants fixed at build, one
            # direct call of the compiled op and two small objects (the caches are cold here).
            entry, args = kernel
            rows, buffer = entry(
                topk_indices, lengths, offsets, block_drift_scores,
                None if block_drift_scores is None else row_to_request,
                plan.scaffold_lengths if plan is not None and self.layout.compress_mode else None,
                learned_scores, out, counters_out, None, *args,
            )
            counters = TopologyKVCounters({}, 0, functools.partial(buffer_counters, buffer))
            if plan is None:
                return TopologyKVPolicyResult(rows, counters)
            counters.compression_hits = plan.compression_hits
            return TopologyKVPolicyResult(rows, counters, plan.fingerprints)
        config = self.settings.policy
        if self.layout is None:
            return TopologyKVPolicyResult(indices=topk_indices, counters=None)
        if config.coordinate_mismatch_action is CoordinateMismatchAction.RAISE:
            return apply_topology_kv_policy(
                topk_indices, lengths, config=config, topk_indices_offset=offsets,
                block_drift_scores=block_drift_scores, row_to_request=row_to_request, learned_scores=learned_scores,
                context=context, plan=plan, backend=self.backend, out=out, counters_out=counters_out,
            )
        R, W = topk_indices.shape
        if W == 0:  # the kernels need a column
            raise ValueError(f"topk_indices: expected W >= 1 columns, got shape {tuple(topk_indices.shape)}")
        if plan is None:
            plan = _NO_CONTEXT_PLAN if context is None else TopologyStepPlan.build(
                config, W, context, num_rows=R, row_to_request=row_to_request, device=topk_indices.device
            )
        elif context is not None:
            raise ValueError("context: expected None when plan is given (the plan was built from the contexts)")
        backend = self.backend
        if backend is None:
            backend = resolve_backend(config.backend, topk_indices.device)  # cached per (backend, device)
        inputs = PolicyTensors(topk_indices, lengths, offsets, block_drift_scores, learned_scores,
                               plan.scaffold_lengths)
        rows, counters, lazy = run_layout(
            backend, self.layout, inputs, row_to_request, out=out, counters_out=counters_out
        )
        return TopologyKVPolicyResult(
            indices=rows,
            counters=TopologyKVCounters(tensors=counters, compression_hits=plan.compression_hits, lazy=lazy),
            fingerprints=plan.fingerprints,
        )
