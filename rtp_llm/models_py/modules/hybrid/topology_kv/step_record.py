"""What one layer call of a step did, in host values only: the metrics' tags and skip reasons.

The ``Indexer`` records a :class:`TopologyLayerCall` beside each layer's counters in the
caller's ``TopologyStepCounters`` (``calls[layer_idx]``). Every field is known on the host
without reading a device value (the path, the layer's mode and profile, fixed at
construction; the row count is the top-k tensor's shape), so recording it costs no sync;
the step's metrics read it after the step (``rtp_llm.metrics.topology_kv_step``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from rtp_llm.models_py.modules.hybrid.topology_kv.config import IndexerPath, TopologyKVPolicyMode


class PolicySkipReason(enum.Enum):
    """Why the policy did not run on a layer call (the top-k rows passed through unchanged)."""

    DISABLED = "disabled"  # the policy mode is ``disabled`` (the default)
    PROFILE_SKIPPED_LAYER = "profile_skipped_layer"  # the profile skips this layer (or does not cover it)
    PATH_OFF = "path_off"  # the call's path is not in RTP_LLM_TOPOLOGY_KV_PATHS
    NO_LOCAL_ROWS = "no_local_rows"  # a CP rank with no local rows (the top-k op returned None)
    SCANNING_LAYER = "scanning_layer"  # structure_layers=sharing and this layer scans
    UNLISTED_LAYER = "unlisted_layer"  # structure_layers lists layers, not this one


@dataclasses.dataclass(frozen=True)
class TopologyLayerCall:
    """One layer call of a step, host values only.

    path : the top-k path the call took
    mode : the layer's policy mode (its profile entry applied: ``disabled`` for a skipped layer)
    rows : ``R``, rows of the top-k op's output (0 when it returned None)
    skip_reason : why the policy did not run, or None when it ran (counters were recorded)
    profile : the profile's name (its file name without ``.json``), or None without a profile
    """

    path: IndexerPath
    mode: TopologyKVPolicyMode
    rows: int
    skip_reason: Optional[PolicySkipReason] = None
    profile: Optional[str] = None
