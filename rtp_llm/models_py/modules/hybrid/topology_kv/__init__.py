"""Topology-aware KV candidate policy for DeepSeek-V3.2-style sparse attention.

The ``Indexer`` (``rtp_llm/models_py/modules/hybrid/indexer.py``) builds one
:class:`~.layer.TopologyKVLayerPolicy` per layer and calls it after its top-k op. Modules,
from the settings down to the kernels:

============== ===========================================================================
config         modes, the policy config (every setting's default, range, env name, help),
               the serving settings read once from ``RTP_LLM_TOPOLOGY_KV_*``
profile        per-layer structural budgets from an offline calibration
layer          the per-layer object: validated settings, resolved backend, layout constants
policy         the public entry ``apply_topology_kv_policy``, counters, the contract check
request        caller-owned per-request contexts and the per-step plan
step_record    a layer call's host values (path, mode, rows, skip reason) for the metrics
drift          block key centroids, drift, the live ``BlockDriftTracker``
schedule       witness blocks by score and block-to-token expansion (serving)
row_contract   the coordinate contract's broken-row rules, as device tensors
arg_checks     argument checks of the public entries (expected vs actual)
kernels/       ``torch_core`` (the specification), ``cpu_fused`` (C++), ``triton_fused``,
               ``dispatch`` (the one place a backend is chosen)
============== ===========================================================================
"""
