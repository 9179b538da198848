"""The Triton policy kernel equals the torch core bit for bit (indices and every counter).

The shared equality suite (hand-computed cases, buffers, the property test) is
``rtp_llm/models_py/modules/hybrid/topology_kv/test/kernel_suite.py``; this file adds what is specific to the Triton
kernel: its device predicate, the W > 0 check, an ahead-of-time compile for sm_90 and a
CUDA graph capture and replay.

CPU by default: the kernel runs under the Triton interpreter (``tools.device_under_test``,
imported by the folder's ``conftest.py`` before any test module, sets
``TRITON_INTERPRET=1`` before triton is imported). ``TOPOLOGY_KV_TEST_DEVICE=cuda`` runs
the same checks compiled on a GPU (``//rtp_llm/models_py/modules/hybrid/topology_kv/test:triton_fused_cuda_manual``).
"""

from __future__ import annotations

import os

import pytest
import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.test.kernel_suite import *  # noqa: F401,F403 (the shared tests, collected here)
from rtp_llm.models_py.modules.hybrid.topology_kv.test.kernel_suite import (
    COMPRESS,
    ENABLED_MODES,
    MERGE,
    _kw,
    _t,
    broken_rows,
    check_equal,
    equals_core_test,
    expected,
    tensor_call,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import COUNTER_NAMES
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.triton_fused import (
    can_use_triton,
    topology_kv_policy_triton,
)
from tools.device_under_test import DEVICE

KERNEL = tensor_call(topology_kv_policy_triton)

test_triton_equals_core = equals_core_test(KERNEL, int(os.environ.get("TOPOLOGY_KV_TRITON_EXAMPLES", "120")))


def test_can_use_triton():
    assert can_use_triton(DEVICE)
    assert not can_use_triton(torch.device("meta"))


def test_rejects_zero_width():
    # The fused C++ kernel returns an empty [R, 0] instead (apply_topology_kv_policy rejects
    # W == 0 before any backend runs).
    with pytest.raises(ValueError, match="W > 0"):
        KERNEL(_t([[]]), _t([2]), None, None, None, None, **_kw(MERGE, 0))


# ---------------------------------------------------------------- compiled for a GPU target

# Run in a fresh interpreter without TRITON_INTERPRET (the kernel is then a JITFunction):
# compile the kernel ahead of time for sm_90 (H200/H20) through Triton's whole pipeline and
# ptxas, with the arguments the wrapper builds. No GPU needed; catches what the interpreter
# cannot (constexpr folding, loop-carried types, the lowering of sort/gather/histogram).
_AOT_SCRIPT = r"""
import os, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import triton_fused as K
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import PolicyLayout, PolicyTensors
from rtp_llm.models_py.modules.hybrid.topology_kv.policy import COUNTER_NAMES, TopologyKVPolicyMode as M

PTR = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32", torch.float16: "*fp16",
       torch.bfloat16: "*bf16", torch.float64: "*fp64", torch.bool: "*i1"}
def compile_case(mode, W, bs, idt, *, scores=None, drift=False, offsets=False, scaffold=False, sink_tokens=None,
                 scaled=False, mismatch=True):
    R = 2
    x = torch.full((R, W), -1, dtype=idt)
    L = torch.full((R,), 40, dtype=torch.int32)
    _, _, (args, consts, warps) = K._launch_spec(PolicyTensors(
        x, L, torch.zeros(R, dtype=torch.int64) if offsets else None,
        torch.zeros(R, 50) if drift else None, None if scores is None else torch.zeros(R, W, dtype=scores),
        torch.zeros(R, dtype=torch.int64) if scaffold else None), layout=PolicyLayout(mode=mode, sink_blocks=1,
        local_blocks=2, witness_blocks=2, block_size=bs, sink_tokens=sink_tokens, max_structural_fraction=0.25,
        scale_budget_by_length=scaled), out=None, counters=None,
        mismatch_rows=torch.zeros(R, dtype=torch.bool) if mismatch else None)
    names = K._topology_kv_policy_kernel.arg_names
    sig = dict(zip([n for n in names if n not in consts],
                   [PTR[a.dtype] if isinstance(a, torch.Tensor) else "i32" for a in args]))
    sig.update({n: "constexpr" for n in consts})
    triton.compile(ASTSource(K._topology_kv_policy_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})
    print("compiled", mode.value, W, bs, idt, flush=True)

compile_case(M.TOPOLOGY_SPARSE_MERGE, 20, 3, torch.int32, scores=torch.bfloat16, drift=True, offsets=True,
             sink_tokens=4, scaled=True)
compile_case(M.TOPOLOGY_SPARSE_MERGE, 64, 8, torch.int64, mismatch=False)
compile_case(M.TOPOLOGY_COMPRESS_SPARSE, 33, 4, torch.int64, scores=torch.float32, scaffold=True)
compile_case(M.TOPOLOGY_COMPRESS_SPARSE, 16, 4, torch.int32, drift=True, scaffold=True, sink_tokens=6)
compile_case(M.TOPOLOGY_ONLY, 33, 4, torch.int64, drift=True, offsets=True, sink_tokens=4)
compile_case(M.TOPOLOGY_ONLY, 20, 1, torch.int32)
"""


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU every test above compiles and runs the kernel")
def test_kernel_compiles_for_sm90():
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton's NVIDIA backend is not installed")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 6))  # the repository root
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's notice; the kernel has no float math
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("compiled") == 6, proc.stdout


# ---------------------------------------------------------------- CUDA graph


def _graph_inputs(seed, W=64, R=8, N=40):
    """Rows (valid entries first), lengths, drift, scores, scaffold spans for the graph test."""
    gen = torch.Generator().manual_seed(seed)
    L = torch.randint(1, 300, (R,), generator=gen)
    x = torch.stack([torch.randperm(300, generator=gen)[:W] for _ in range(R)])
    x = torch.where(x < L.unsqueeze(1), x, 10**6)  # padding sorts last
    x = torch.sort(x, dim=1).values
    x = torch.where(x == 10**6, -1, x)
    return [t.to(DEVICE) for t in (x, L, torch.rand(R, N, generator=gen), torch.rand(R, W, generator=gen),
                                   torch.randint(0, 64, (R,), generator=gen))]


def test_graph_inputs_are_good_rows():
    # The CUDA-graph test's inputs (checked here on any device; the graph itself needs a GPU).
    x, L, drift, scores, scaffold = _graph_inputs(1, W=8, R=3)
    check_equal(KERNEL, x, L, drift=drift, scores=scores, scaffold=scaffold,
                **_kw(COMPRESS, 8, sink_tokens=4, local_blocks=2, witness_blocks=2, block_size=8))
    assert not broken_rows(x, L, None, drift, 8).any()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ENABLED_MODES)
def test_cuda_graph_capture_and_replay(mode):
    W, R, N = 64, 8, 40
    kw = _kw(mode, W, sink_tokens=4, local_blocks=2, witness_blocks=2, block_size=8)

    inputs = _graph_inputs

    bufs = inputs(0)
    out = torch.empty_like(bufs[0])
    counters = torch.zeros(len(COUNTER_NAMES), dtype=torch.int64, device=DEVICE)
    args = lambda: (bufs[0], bufs[1], None, bufs[2], bufs[3], bufs[4])  # noqa: E731
    KERNEL(*args(), out=out, counters=counters, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        KERNEL(*args(), out=out, counters=counters, **kw)
    for seed in (1, 2, 3):
        new = inputs(seed)
        for buf, val in zip(bufs, new):
            buf.copy_(val)
        counters.zero_()
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_counters = KERNEL(*args(), **kw)
        assert torch.equal(out, eager_out) and torch.equal(counters, eager_counters)
        want, want_counters, _ = expected(*args(), **kw)
        assert torch.equal(out.cpu(), want) and counters.cpu().tolist() == want_counters
