"""The fused C++ CPU policy kernel equals the torch core bit for bit (indices and every counter).

The shared equality suite (hand-computed cases, buffers, the property test) is
``rtp_llm/models_py/modules/hybrid/topology_kv/test/kernel_suite.py``; this file adds what is specific to the C++
kernel: its build predicate, ``out`` aliasing the input, and engine-sized batches split
over threads. CPU only: the module is skipped when the device under test
(``tools.device_under_test``) is not the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from tools.device_under_test import DEVICE

if DEVICE.type != "cpu":
    pytest.skip(f"the CPU kernel runs on CPU tensors only (device under test: {DEVICE})", allow_module_level=True)

from rtp_llm.models_py.modules.hybrid.topology_kv.test.kernel_suite import *  # noqa: E402,F401,F403 (the shared tests, collected here)
from rtp_llm.models_py.modules.hybrid.topology_kv.test.kernel_suite import (  # noqa: E402
    ENABLED_MODES,
    _kw,
    _t,
    check_equal,
    equals_core_test,
    expected,
    tensor_call,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.config import TopologyKVPolicyConfig  # noqa: E402
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_fused  # noqa: E402
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpu_fused import (  # noqa: E402
    can_use_cpu_kernel,
    topology_kv_policy_cpu,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import PolicyLayout  # noqa: E402

KERNEL = tensor_call(topology_kv_policy_cpu)

test_cpu_kernel_equals_core = equals_core_test(KERNEL, int(os.environ.get("TOPOLOGY_KV_CPU_EXAMPLES", "300")))


def test_can_use_cpu_kernel():
    assert can_use_cpu_kernel("cpu")
    assert can_use_cpu_kernel(torch.device("cpu"))
    assert not can_use_cpu_kernel(torch.device("meta"))
    assert not can_use_cpu_kernel("cuda")


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_out_may_be_the_input(mode):
    x = _t([[0, 10, 37, 11, 20, 21, 22, 23], [3, 1, -1, -1, -1, -1, -1, -1], [3, 3, -1, -1, -1, -1, -1, -1]])
    L = _t([40, 9, 9])
    want, want_counters, _ = expected(x, L, None, None, None, _t([20, 20, 20]), **_kw(mode, 8))
    y = x.clone()
    out, counters = KERNEL(y, L, None, None, None, _t([20, 20, 20]), out=y, **_kw(mode, 8))
    assert out is y and torch.equal(y, want) and counters.tolist() == want_counters


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ENABLED_MODES)
@pytest.mark.parametrize("scored", [False, True])
def test_engine_shapes_in_parallel(mode, scored, threads):
    # The default config (block 64, 4 sink tokens, 2 local, 2 witness, 1/4 cap) on decode-like
    # rows of width 512 over 4k tokens: 160 rows, many times one thread's grain (1024 entries
    # = 2 rows) so that two threads split them; a few broken rows. Up to 128 evictions per
    # row: the score eviction's radix sort (64 keys and more) runs, on distinct and tied scores.
    gen = torch.Generator().manual_seed(11)
    R, W, Lmax = 160, 512, 4096
    L = torch.randint(1, Lmax, (R,), generator=gen)
    L[:4] = torch.tensor([Lmax, W, W - 7, 3])
    rows = []
    for r in range(R):
        n = min(int(L[r]), W)
        rows.append(torch.randperm(int(L[r]), generator=gen)[:n].tolist() + [-1] * (W - n))
    x = torch.tensor(rows, dtype=torch.int32)
    x = torch.where(x >= 0, x + 1000, x)  # request-local positions past the offset of 1000
    x[5, 3] = x[5, 2]  # duplicate
    x[6, 0] = 1000 + int(L[6])  # outside
    drift = torch.rand(R, Lmax // 64, generator=gen)
    drift[:, ::3] = 0.5  # ties
    scores = torch.rand(R, W, generator=gen) if scored else None
    if scored:  # every other row on a coarse grid: ties, broken by the column (the later loses)
        scores[::2] = (scores[::2] * 8).floor() / 8
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = check_equal(KERNEL, x, L, offsets=torch.full((R,), 1000), drift=drift, scores=scores, scaffold=L // 3,
                          **_kw(mode, W, block_size=64, sink_tokens=4, local_blocks=2, witness_blocks=2, frac=0.25))
    finally:
        torch.set_num_threads(old)
    # The rows are good but for rows 5 and 6 (the contract's fallback), and the policy changed
    # most of them: the test exercises the row pass, not only the fallback copy.
    changed = (got != x).any(dim=1)
    assert torch.equal(got[5:7], x[5:7]) and changed.sum() > R // 2


@pytest.mark.parametrize("mode", ENABLED_MODES)
@pytest.mark.parametrize("rows", [2, 3, 5, 8])
def test_layer_call_splits_a_decode_batch_over_threads_bit_for_bit(mode, rows):
    # Rows of width 1024 over 8k tokens: the serving grain gives each row a chunk, so two
    # threads split even 2 rows. Rows and counters equal those of the same
    # call with every row in one chunk (one thread) and of the torch core.
    gen = torch.Generator().manual_seed(rows)
    W, L = 1024, 8192
    x = torch.stack([torch.randperm(L, generator=gen)[:W] for _ in range(rows)]).to(torch.int32)
    lengths = torch.full((rows,), L, dtype=torch.int32)
    drift = torch.rand(rows, L // 64, generator=gen)
    scores = torch.rand(rows, W, generator=gen)
    kw = _kw(mode, W, block_size=64, sink_tokens=4, local_blocks=2, witness_blocks=2, frac=0.25)
    layout = kw["layout"]
    split = cpu_fused.layer_args(layout, W)
    assert split[-1] == 1  # one row per chunk at W = 1024
    one_chunk = cpu_fused.layer_args(layout, W, grain_rows=rows)
    assert one_chunk[:-1] == split[:-1] and one_chunk[-1] == rows
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = [cpu_fused.run_layer(x, lengths, None, drift, None, None, args, learned_scores=scores)
               for args in (split, one_chunk)]
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    want, want_counters, _ = expected(x, lengths, None, drift, scores, None, **kw)
    assert torch.equal(got[0][0], want.to(got[0][0].dtype)) and got[0][1].tolist() == want_counters
    assert (got[0][0] != x).any()  # the policy changed rows: the row pass ran, not a fallback copy


@pytest.mark.parametrize("grain", [0, -1, 1.5, True, "2"])
def test_layer_args_rejects_a_bad_grain(grain):
    layout = PolicyLayout.from_config(TopologyKVPolicyConfig(policy="topology_sparse_merge"))
    assert cpu_fused.layer_args(layout, 64, grain_rows=1)[-1] == 1  # cached: True must not hit this entry
    with pytest.raises(ValueError, match=r"^grain_rows: expected an int >= 1 or None, got "):
        cpu_fused.layer_args(layout, 64, grain_rows=grain)


_X, _L = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(lengths=_L.float()), TypeError, r"^lengths: expected an int32/int64 tensor, got Float$"),
        (dict(lengths=torch.tensor([2, 2])), ValueError, r"^lengths: expected shape \(1,\) on cpu, got \[2\] on cpu$"),
        (dict(offsets=torch.zeros(2, dtype=torch.int64)), ValueError, r"^offsets: expected shape \(1,\) on cpu"),
        (dict(drift=torch.ones(2, 3)), ValueError, r"^drift: expected a float tensor \[1, N\] on cpu, got \[2, 3\]$"),
        (dict(drift=torch.ones(1, 3, dtype=torch.int32)), ValueError, r"^drift: expected a float tensor \[B, N\]"),
        (dict(scores=torch.rand(1, 3)), ValueError,
         r"^learned_scores: expected a float tensor \[1, 2\] on cpu, got Float \[1, 3\] on cpu$"),
        (dict(out=torch.empty(1, 2, dtype=torch.int64)), ValueError,
         r"^out: expected Int \[1, 2\] on cpu, got Long \[1, 2\] on cpu$"),
        (dict(counters=torch.zeros(3, dtype=torch.int64)), ValueError,
         r"^counters: expected int64 \[8\] on cpu, got Long \[3\] on cpu$"),
        (dict(mismatch_rows=torch.zeros(1, dtype=torch.int32)), ValueError,
         r"^mismatch_rows: expected bool \[1\] on cpu, got Int \[1\] on cpu$"),
        (dict(mismatch_rows=torch.zeros(2, dtype=torch.bool)), ValueError,
         r"^mismatch_rows: expected bool \[1\] on cpu, got Bool \[2\] on cpu$"),
    ],
)
def test_the_one_entry_names_the_argument(change, error, message):
    """The kernel's metadata checks run in its one C++ entry (the wrapper is a call of it):
    each names the argument, expected and actual, before anything is written."""
    args = dict(lengths=_L, offsets=None, drift=None, scores=None, scaffold=None)
    bufs = dict(out=torch.full((1, 2), 7, dtype=torch.int32), counters=None, mismatch_rows=None)
    for key, value in change.items():
        (args if key in args else bufs)[key] = value
    before = bufs["out"].clone()
    with pytest.raises(error, match=message):
        KERNEL(_X, args["lengths"], args["offsets"], args["drift"], args["scores"], args["scaffold"], **bufs,
               **_kw(ENABLED_MODES[0], 2))
    assert torch.equal(bufs["out"], before)


def test_mismatch_rows_flags_the_broken_rows():
    x = _t([[0, 1], [5, 1], [1, 1]])  # row 1: outside its interval; row 2: a duplicate
    flags = torch.zeros(3, dtype=torch.bool)
    KERNEL(x, _t([2, 2, 2]), None, None, None, None, mismatch_rows=flags, **_kw(ENABLED_MODES[0], 2))
    assert flags.tolist() == [False, True, True]


@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_calls_of_other_shapes_in_turn(mode):
    """The kernel keeps its scratch per thread between calls (buffers only grow): calls of
    large and small layouts in turn (witness count, drift columns, width, block size) each
    equal the core, so nothing one call leaves behind reaches the next."""
    gen = torch.Generator().manual_seed(23)
    shapes = [  # (W, L, block_size, witness_blocks, local_blocks); the same layout with fewer
        # witnesses right after more: its rows hit blocks the previous call's witnesses held
        (64, 900, 8, 12, 2), (64, 900, 8, 2, 2), (64, 900, 8, 12, 2), (16, 120, 4, 1, 1), (8, 40, 2, 3, 0),
        (32, 600, 16, 6, 1), (16, 120, 4, 1, 1), (64, 900, 8, 12, 2),
    ]
    for i, (W, L, bs, wit, loc) in enumerate(shapes):
        R = 3
        x = torch.stack([torch.randperm(L, generator=gen)[:W] for _ in range(R)]).to(torch.int32)
        x[0] = torch.arange(L - W, L)  # the newest tokens: no injection needed
        lengths = torch.full((R,), L)
        drift = torch.rand(R, (L + bs - 1) // bs, generator=gen)
        scores = torch.rand(R, W, generator=gen) if i % 2 else None
        got = check_equal(KERNEL, x, lengths, drift=drift, scores=scores, scaffold=lengths // 2,
                          **_kw(mode, W, block_size=bs, sink_tokens=3, local_blocks=loc, witness_blocks=wit,
                                frac=0.5))
        assert (got != x).any(), f"call {i}: the policy changed no row"
