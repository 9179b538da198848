"""Property tests of the public entry's caller buffers on every backend the device runs.

Two rules over random shapes, modes, dtypes and buffer placements:

* ``out`` sharing any byte with ``topk_indices`` (one workspace, rows shifted by less than
  ``R``) is refused with a ``ValueError`` naming both; placed apart in the same workspace it
  gives the torch backend's rows and leaves the input as it was;
* the counters a call returns are values fixed at the call's end: reading them after the
  caller has reused ``out`` for another call and overwritten its input gives the call's
  own counts; with ``counters_out`` the caller's totals are the sum of the calls.

Backends: ``torch`` and ``cpu_fused`` on CPU (``triton`` on CUDA); on CPU also ``triton``
under the interpreter and ``compiled`` (one layout, so it compiles once), with fewer examples
because each example costs seconds there.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv.config import (
    CoordinateMismatchAction,
    TopologyKVBackend,
    TopologyKVPolicyConfig,
    TopologyKVPolicyMode,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.dispatch import can_use_backend
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import COUNTER_NAMES, apply_topology_kv_policy
from tools.device_under_test import DEVICE

MODES = [TopologyKVPolicyMode.TOPOLOGY_SPARSE_MERGE, TopologyKVPolicyMode.TOPOLOGY_COMPRESS_SPARSE,
         TopologyKVPolicyMode.TOPOLOGY_ONLY]
# (backend, examples): the interpreter and the compiled core take seconds per call.
BACKENDS = ([("torch", 60), ("cpu_fused", 60), ("triton", 12), ("compiled", 6)] if DEVICE.type == "cpu"
            else [("torch", 60), ("triton", 60)])


def _config(mode, backend):
    return TopologyKVPolicyConfig(
        policy=mode, local_blocks=1, witness_blocks=1, block_size=4, max_structural_fraction=0.5,
        coordinate_mismatch_action=CoordinateMismatchAction.FALLBACK_DISABLED, backend=backend,
    )


@st.composite
def batches(draw, fixed_mode=None):
    """Engine-style rows ``[R, W]`` (all positions when ``L <= W``, else ``W`` distinct ones)."""
    seed = draw(st.integers(0, 2**16))
    R = draw(st.integers(1, 5))
    W = draw(st.sampled_from([2, 5, 8, 16]))
    dtype = torch.int32 if fixed_mode is not None else draw(st.sampled_from([torch.int32, torch.int64]))
    mode = fixed_mode or draw(st.sampled_from(MODES))
    gen = torch.Generator().manual_seed(seed)
    lengths = [draw(st.integers(1, 48)) for _ in range(R)]
    rows = []
    for L in lengths:
        toks = list(range(L)) if L <= W else torch.randperm(L, generator=gen)[:W].tolist()
        rows.append(toks + [-1] * (W - len(toks)))
    x = torch.tensor(rows, dtype=dtype, device=DEVICE)
    return mode, x, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)


def _backend_or_skip(name):
    if not can_use_backend(name, DEVICE):
        pytest.skip(f"{name} cannot run on {DEVICE}")
    return TopologyKVBackend.parse(name)


def _property(max_examples):
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _mode_for(backend):
    # The compiled core compiles once per layout: one mode keeps it to one compile.
    return MODES[0] if backend == "compiled" else None


@pytest.mark.parametrize("backend, examples", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_out_overlapping_the_input_is_refused_and_apart_is_exact(backend, examples):
    name = _backend_or_skip(backend)

    @_property(examples)
    @given(batch=batches(_mode_for(backend)), shift=st.integers(-6, 6))
    def check(batch, shift):
        mode, x, lengths = batch
        R, W = x.shape
        config = _config(mode, name)
        want = apply_topology_kv_policy(x, lengths, config=config, backend="torch")
        # One workspace of 2R + 6 rows: the input at row 6, the output `shift` rows away.
        pool = torch.full((2 * R + 12, W), -5, dtype=x.dtype, device=DEVICE)
        pool[6:6 + R] = x
        src, dst = pool[6:6 + R], pool[6 + shift:6 + shift + R]
        if abs(shift) < R:
            with pytest.raises(ValueError, match=r"out: expected a buffer apart from topk_indices\b"):
                apply_topology_kv_policy(src, lengths, config=config, out=dst)
            assert torch.equal(pool[6:6 + R], x), "input modified by a refused call"
            return
        got = apply_topology_kv_policy(src, lengths, config=config, out=dst)
        assert got.indices is dst
        assert torch.equal(dst, want.indices), "rows differ from the torch backend"
        assert torch.equal(pool[6:6 + R], x), "input modified"
        assert got.counters.to_dict() == want.counters.to_dict()

    check()


@pytest.mark.parametrize("backend, examples", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_counters_are_fixed_at_the_calls_end_after_buffer_reuse(backend, examples):
    name = _backend_or_skip(backend)

    @_property(examples)
    @given(first=batches(_mode_for(backend)), seed=st.integers(0, 2**16))
    def check(first, seed):
        mode, x, lengths = first
        config = _config(mode, name)
        want = apply_topology_kv_policy(x.clone(), lengths.clone(), config=config, backend="torch").counters.to_dict()
        # The second call: other rows of the same shape into the same out= buffer.
        gen = torch.Generator().manual_seed(seed)
        other = torch.stack([torch.randperm(64, generator=gen)[: x.shape[1]] for _ in range(x.shape[0])])
        other = other.to(x.dtype).to(DEVICE)
        other_lengths = torch.full_like(lengths, 64)
        out = torch.empty_like(x)
        got = apply_topology_kv_policy(x, lengths, config=config, out=out)
        second = apply_topology_kv_policy(other, other_lengths, config=config, out=out)
        x.fill_(-1)  # the caller reuses its input buffer too
        lengths.fill_(1)
        assert got.counters.to_dict() == want, "counters changed after the call"
        # counters_out: the caller's running totals, the sum of the calls.
        totals = torch.zeros(len(COUNTER_NAMES), dtype=torch.int64, device=DEVICE)
        apply_topology_kv_policy(other, other_lengths, config=config, out=out, counters_out=totals)
        apply_topology_kv_policy(other, other_lengths, config=config, out=out, counters_out=totals)
        per_call = second.counters.to_dict()
        assert [int(v) for v in totals.tolist()] == [2 * per_call[n] for n in COUNTER_NAMES]

    check()
