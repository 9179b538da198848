"""The policy selector with per-layer settings from a profile (docs/profile.md).

``make_profile_selector(profile, ...)`` behaves as serving does with
``RTP_LLM_TOPOLOGY_KV_PROFILE``: each full-attention layer takes its own entry at the
profile budget nearest ``W / L`` (``L`` the window's key length; exact for a grid run at the
calibrated budgets), and a skipped layer (share 0) returns the proxy indexer's rows as they
are. The witness signal is the one the profile was calibrated with (serving refuses any
other). The harness adds it with ``--profile FILE`` (docs/profile.md).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Dict, Optional, Tuple

import torch

from benchmark.quality.layer import LayerInputs
from benchmark.quality.policy_selectors import PolicySettings, make_policy_selector
from benchmark.quality.selector_base import Selector, SelectorSettings, learned_rows_and_scores
from rtp_llm.models_py.modules.hybrid.topology_kv.config import TopologyKVPolicyMode
from rtp_llm.models_py.modules.hybrid.topology_kv.profile import TopologyKVProfile


def make_profile_selector(
    profile: TopologyKVProfile, settings: SelectorSettings, policy_settings: PolicySettings = None,
    mode: Optional[str] = None, base_rows=None,
) -> Selector:
    """Selector running ``profile.policy`` (or ``mode``, one it serves) with each layer's entry (see module doc).

    Raises ``ValueError`` for a mode the profile does not serve (``TopologyKVProfile.served_mode``).

    ``policy_settings`` gives what the profile does not fix (the budget rule; the witness
    signal when the profile records none); block size, the four structural fields and a
    recorded witness signal come from the profile. ``base_rows(layer, width) -> (rows,
    scores)``: the rows each layer's entry merges into (default: that layer's own trained
    indexer rows; a skipped layer returns them as they are).
    """
    base = policy_settings or PolicySettings()
    if profile.witness_signal is not None:
        base = dataclasses.replace(base, witness_signal=profile.witness_signal.value)
    mode = profile.served_mode(None if mode is None else TopologyKVPolicyMode.parse(mode)).value
    cache: Dict[Tuple[int, Fraction], Selector] = {}

    def select_profile(layer: LayerInputs, width: int, stats: Dict[str, float]) -> torch.Tensor:
        budget = profile.pick_budget(max(1, round(width * profile.reference_context / layer.key_length)))
        entry = profile.setting(layer.layer_idx, budget)
        if entry is None or entry.skipped:
            return (learned_rows_and_scores(layer, width, settings) if base_rows is None
                    else base_rows(layer, width))[0]
        key = (layer.layer_idx, budget)
        if key not in cache:
            ps = dataclasses.replace(base, block_size=profile.block_size, sink_blocks=0, **entry.to_json())
            cache[key] = make_policy_selector(mode, settings, ps, base_rows=base_rows)
        return cache[key](layer, width, stats)

    return select_profile
