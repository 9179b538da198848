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
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.cpu_fused import (  # noqa: E402
    can_use_cpu_kernel,
    topology_kv_policy_cpu,
)

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
    # rows of width 512 over 4k tokens: 160 rows, more than one thread's grain (32768 entries
    # = 64 rows) so that two threads split them; a few broken rows.
    gen = torch.Generator().manual_seed(11)
    R, W, Lmax = 160, 512, 4096
    L = torch.randint(1, Lmax, (R,), generator=gen)
    L[:4] = torch.tensor([Lmax, W, W - 7, 3])
    rows = []
    for r in range(R):
        n = min(int(L[r]), W)
        rows.append(torch.randperm(int(L[r]), generator=gen)[:n].tolist() + [-1] * (W - n))
    x = torch.tensor(rows, dtype=torch.int32)
    x[5, 3] = x[5, 2]  # duplicate
    x[6, 0] = int(L[6])  # outside
    drift = torch.rand(R, Lmax // 64, generator=gen)
    drift[:, ::3] = 0.5  # ties
    scores = torch.rand(R, W, generator=gen) if scored else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_equal(KERNEL, x, L, offsets=torch.full((R,), 1000), drift=drift, scores=scores, scaffold=L // 3,
                    **_kw(mode, W, block_size=64, sink_tokens=4, local_blocks=2, witness_blocks=2, frac=0.25))
    finally:
        torch.set_num_threads(old)
