"""The drift tracker's one-call update (the key store plus the running centroids and drift).

On CPU, :meth:`BlockDriftTracker.update` (the C++ kernel) equals
:meth:`BlockDriftTracker.update_reference` (torch ops, the specification) bit for bit:
pool rows, sums, counts and drift, over random shapes, block sizes, multi-row steps,
positions across block boundaries and past capacity, pool and index dtypes (hypothesis).
The distance rule itself is pinned against a plain Python loop and hand-computed values.
The Triton kernel (``kernels/triton_drift.py``; under ``TRITON_INTERPRET=1`` on CPU, compiled
on a GPU under test) equals the same reference bit for bit: over the same random runs with
keys on a dyadic grid (its atomics may add a multi-key step in any order; those sums are
exact in any order) and on decode-shaped steps with arbitrary keys (one key per request and
block: no order to choose). An ahead-of-time compile for sm_90 checks the generated PTX for
IEEE division and square root and for the absence of fused multiply-adds. On a GPU under
test (``tools.device_under_test``) the tracker runs the Triton kernel there, and a decode
step's update is captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import math
import struct
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtp_llm.models_py.modules.hybrid.topology_kv.drift import (
    BlockDriftTracker,
    DriftMetric,
    block_drift_scores_unchecked,
    block_key_centroids,
    pair_drift_unchecked,
)
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import triton_drift
from tools.device_under_test import DEVICE

ON_CPU = DEVICE.type == "cpu"
cpu_only = pytest.mark.skipif(not ON_CPU, reason=f"the C++ kernel runs on CPU tensors (device under test: {DEVICE})")
needs_triton = pytest.mark.skipif(
    not triton_drift.can_use_triton(DEVICE),
    reason=f"triton cannot run on {DEVICE} here (on CPU it needs TRITON_INTERPRET=1 before import)",
)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _loop_drift(prev, cur, metric: DriftMetric) -> float:
    """The rule written out: fp32 centroid values, fp64 sums in index order, one fp32 rounding."""
    p = [float(v) for v in prev]
    c = [float(v) for v in cur]
    if metric is DriftMetric.L2:
        acc = 0.0
        for a, b in zip(c, p):
            d = _f32(a - b)  # the fp32 difference
            acc += d * d
        return _f32(math.sqrt(acc))
    a2 = b2 = ab = 0.0
    for a, b in zip(c, p):
        a2 += a * a
        b2 += b * b
        ab += a * b
    return _f32(1.0 - ab / math.sqrt(max(a2 * b2, 1e-24)))


def test_pair_drift_hand_computed():
    prev = torch.tensor([[0.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    cur = torch.tensor([[3.0, 4.0], [1.0, 0.0], [5.0, 0.0], [0.0, 0.0]])
    assert pair_drift_unchecked(prev, cur, DriftMetric.L2).tolist() == [5.0, _f32(math.sqrt(2.0)), 3.0, 0.0]
    # Cosine: orthogonal 1, parallel 0, a zero centroid 1 (cos taken as 0).
    assert pair_drift_unchecked(prev[1:], cur[1:], DriftMetric.COSINE).tolist() == [1.0, 0.0, 1.0]
    assert pair_drift_unchecked(prev, cur).dtype == torch.float32
    assert pair_drift_unchecked(prev.double(), cur.double()).dtype == torch.float64


@given(k=st.integers(1, 300), scale=st.sampled_from([1e-3, 1.0, 1e3]), seed=st.integers(0, 2**31 - 1),
       metric=st.sampled_from(list(DriftMetric)))
@settings(max_examples=60, deadline=None)
def test_pair_drift_is_the_written_rule(k, scale, seed, metric):
    g = torch.Generator().manual_seed(seed)
    prev = (torch.randn(3, k, generator=g) * scale).to(DEVICE)
    cur = (torch.randn(3, k, generator=g) * scale).to(DEVICE)
    got = pair_drift_unchecked(prev, cur, metric).cpu()
    want = torch.tensor([_loop_drift(prev[i].cpu().tolist(), cur[i].cpu().tolist(), metric) for i in range(3)])
    if ON_CPU:  # cumsum runs in index order: bit for bit
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


def test_offline_scores_use_the_same_rule():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 40, 2, 8, generator=g)
    cents = block_key_centroids(keys, 8)  # [2, 5, 2, 8]
    got = block_drift_scores_unchecked(cents, DriftMetric.L2)
    flat = cents.flatten(-2)
    assert got[:, 0].eq(0).all()
    for b in range(2):
        for n in range(1, 5):
            assert got[b, n].item() == _loop_drift(flat[b, n - 1].tolist(), flat[b, n].tolist(), DriftMetric.L2)


_POOL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@st.composite
def _runs(draw):
    B = draw(st.integers(1, 4))
    N = draw(st.integers(1, 8))
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    K = draw(st.integers(1, 24))
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        T = draw(st.integers(0, 3 * bs + 2))
        steps.append((T, draw(st.integers(0, 2**31 - 1))))
    return dict(
        B=B, N=N, bs=bs, K=K, steps=steps,
        metric=draw(st.sampled_from(list(DriftMetric))),
        pool_dtype=draw(st.sampled_from(_POOL_DTYPES + [None])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        key_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64])),
        batch=draw(st.booleans()),
    )


def _step_inputs(run, T, seed, dyadic=False):
    g = torch.Generator().manual_seed(seed)
    B, N, bs, K = run["B"], run["N"], run["bs"], run["K"]
    if dyadic:  # multiples of 1/8 up to 8: every fp32 sum of them is exact, in any order
        keys = (torch.randint(-64, 65, (T, K), generator=g) / 8).to(run["key_dtype"])
    else:
        keys = (torch.randn(T, K, generator=g) * 2 + 0.5).to(run["key_dtype"])
    # Mostly in range, some negative or past capacity (the dump column); block boundaries by construction.
    pos = torch.randint(-2, N * bs + 3, (T,), generator=g).to(run["index_dtype"])
    req = torch.randint(0, B, (T,), generator=g).to(run["index_dtype"]) if run["batch"] else None
    slots = torch.randperm(4 * T + 4, generator=g)[:T].to(run["index_dtype"])
    if T:
        slots[0] = slots[0] - (4 * T + 4)  # a negative slot reads from the end, as tensor indexing does
    return keys, pos, req, slots


@cpu_only
@given(run=_runs())
@settings(max_examples=150, deadline=None)
def test_fused_update_equals_reference_bit_for_bit(run):
    fused = BlockDriftTracker(run["B"], run["N"], run["K"], block_size=run["bs"], metric=run["metric"])
    ref = fused.clone()
    assert fused.fused
    size = 4 * max((T for T, _ in run["steps"]), default=0) + 4
    pools = [torch.zeros(size, run["K"], dtype=run["pool_dtype"]) for _ in range(2)] if run["pool_dtype"] else None
    for T, seed in run["steps"]:
        keys, pos, req, slots = _step_inputs(run, T, seed)
        if pools is None:
            fused.update(keys, pos, req)
            ref.update_reference(keys, pos, req)
        else:
            fused.update(keys, pos, req, pool=pools[0][: 4 * T + 4], slots=slots)
            ref.update_reference(keys, pos, req, pool=pools[1][: 4 * T + 4], slots=slots)
    assert torch.equal(fused._sums, ref._sums)
    assert torch.equal(fused._counts, ref._counts)
    assert torch.equal(fused.drift_scores(), ref.drift_scores())
    if pools is not None:
        assert torch.equal(pools[0], pools[1])


def test_prefill_then_decode_across_a_page_boundary():
    """A whole prefill in one call, then tokens one by one across a block boundary: the
    drift of a block appears exactly when it and its predecessor are complete."""
    bs, K = 4, 3
    tr = BlockDriftTracker(1, 4, K, block_size=bs, device=DEVICE)
    keys = torch.arange(16 * K, dtype=torch.float32).view(16, K).to(DEVICE)
    tr.update(keys[:7], torch.arange(7, device=DEVICE))
    assert tr.drift_scores().cpu().tolist() == [[0.0, 0.0, 0.0, 0.0]]  # block 1 holds 3 of 4
    tr.update(keys[7:8], torch.tensor([7], device=DEVICE))
    # Centroids of blocks 0 and 1: token means 1.5 and 5.5 -> every coordinate moves by 4 * K = 12.
    assert tr.drift_scores().cpu()[0, 1].item() == _f32(math.sqrt(K * 12.0**2))
    for p in range(8, 12):
        assert tr.drift_scores().cpu()[0, 2].item() == 0.0
        tr.update(keys[p : p + 1], torch.tensor([p], device=DEVICE))
    assert tr.drift_scores().cpu()[0, 2].item() == _f32(math.sqrt(K * 12.0**2))


def test_device_path_matches_cpu_kernel():
    g = torch.Generator().manual_seed(11)
    B, N, bs, K = 3, 6, 4, 16
    cpu = BlockDriftTracker(B, N, K, block_size=bs)
    dev = BlockDriftTracker(B, N, K, block_size=bs, device=DEVICE)
    pool_cpu, pool_dev = torch.zeros(64, K), torch.zeros(64, K, device=DEVICE)
    for step in range(8):
        T = 5
        keys = torch.randn(T, K, generator=g)
        pos = torch.randint(0, N * bs, (T,), generator=g)
        req = torch.randint(0, B, (T,), generator=g)
        slots = torch.randperm(64, generator=g)[:T]
        cpu.update(keys, pos, req, pool=pool_cpu, slots=slots)
        dev.update(keys.to(DEVICE), pos.to(DEVICE), req.to(DEVICE), pool=pool_dev, slots=slots.to(DEVICE))
    assert torch.equal(pool_dev.cpu(), pool_cpu)
    assert torch.equal(dev._counts.cpu(), cpu._counts)
    torch.testing.assert_close(dev._sums.cpu(), cpu._sums, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dev.drift_scores().cpu(), cpu.drift_scores(), rtol=1e-5, atol=1e-6)


@cpu_only
@pytest.mark.parametrize(
    "bad, match",
    [
        ("request", r"request_ids: expected values in \[0, 2\), got 2 at index 1"),
        ("slot", r"slot_mapping: expected values in \[-8, 8\), got 8 at index 2"),
        ("negative_slot", r"slot_mapping: expected values in \[-8, 8\), got -9 at index 0"),
    ],
)
def test_bad_index_raises_before_any_write(bad, match):
    tr = BlockDriftTracker(2, 4, 3, block_size=2)
    pool = torch.zeros(8, 3)
    tr.update(torch.ones(2, 3), torch.tensor([0, 1]), torch.tensor([0, 1]), pool=pool, slots=torch.tensor([0, 1]))
    before = (tr._sums.clone(), tr._counts.clone(), tr._drift_flat.clone(), pool.clone())
    req = torch.tensor([0, 2 if bad == "request" else 1, 0])
    slots = torch.tensor([-9 if bad == "negative_slot" else 3, 4, 8 if bad == "slot" else 5])
    with pytest.raises(RuntimeError, match=match):
        tr.update(torch.full((3, 3), 7.0), torch.tensor([2, 3, 4]), req, pool=pool, slots=slots)
    for a, b in zip(before, (tr._sums, tr._counts, tr._drift_flat, pool)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pool=torch.zeros(4, 3)), r"pool / slots: expected both or neither, got a pool and no slots"),
        (dict(slots=torch.arange(2)), r"pool / slots: expected both or neither, got no pool and slots"),
        (dict(pool=torch.zeros(4, 5), slots=torch.arange(2)), r"pool: expected \[S, 3\], got shape \(4, 5\)"),
        (dict(pool=torch.zeros(4, 3), slots=torch.arange(3)), r"slots: expected shape \(2,\) like keys' first dim, got \(3,\)"),
    ],
)
def test_pool_argument_errors(kwargs, match):
    tr = BlockDriftTracker(1, 4, 3, block_size=2)
    before = tr._sums.clone()
    with pytest.raises(ValueError, match=match):
        tr.update(torch.ones(2, 3), torch.tensor([0, 1]), **kwargs)
    assert torch.equal(before, tr._sums)


@cpu_only
def test_unsupported_pool_dtype_takes_the_torch_path():
    """A pool the kernel does not write (int8 here) is stored by the torch path; the result
    is the reference's."""
    a = BlockDriftTracker(1, 4, 3, block_size=2)
    b = a.clone()
    pa, pb = torch.zeros(6, 3, dtype=torch.int8), torch.zeros(6, 3, dtype=torch.int8)
    keys = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    a.update(keys, torch.tensor([0, 1]), pool=pa, slots=torch.tensor([2, 5]))
    b.update_reference(keys, torch.tensor([0, 1]), pool=pb, slots=torch.tensor([2, 5]))
    assert torch.equal(pa, pb) and pa[5].tolist() == [4, 5, 6]
    assert torch.equal(a._sums, b._sums)


# ---------------------------------------------------------------- the Triton kernel


def _triton_update(tracker, keys, pos, req, pool, slots):
    """``tracker.update`` through the Triton kernel on the device under test (the tracker's
    own routing on a GPU; a direct call of the interpreted kernel on CPU)."""
    if DEVICE.type == "cuda":
        assert tracker.kernel == "triton"
        tracker.update(keys, pos, req, pool=pool, slots=slots)
        return
    T = keys.shape[0]
    assert tracker._kernel_takes(keys, pos, req, pool, slots)
    triton_drift.track_keys_triton(
        keys.reshape(T, tracker.key_dim), pos, req, tracker._sums, tracker._counts, tracker._drift_flat,
        block_size=tracker.block_size, cosine=tracker.metric is DriftMetric.COSINE, pool=pool, slots=slots,
    )


def _on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def _check_same_state(dev, ref, pools=None):
    assert torch.equal(dev._sums.cpu(), ref._sums)
    assert torch.equal(dev._counts.cpu(), ref._counts)
    assert torch.equal(dev.drift_scores().cpu(), ref.drift_scores())
    if pools is not None:
        assert torch.equal(pools[0].cpu(), pools[1])


@needs_triton
@given(run=_runs())
@settings(max_examples=int(__import__("os").environ.get("TOPOLOGY_KV_TRITON_EXAMPLES", "40")), deadline=None)
def test_triton_update_equals_reference_bit_for_bit(run):
    if run["key_dtype"] == torch.float64 and run["pool_dtype"] is not None:
        run["key_dtype"] = torch.float32  # a pool written from fp64 keys takes the torch path
    dev = BlockDriftTracker(run["B"], run["N"], run["K"], block_size=run["bs"], metric=run["metric"], device=DEVICE)
    ref = BlockDriftTracker(run["B"], run["N"], run["K"], block_size=run["bs"], metric=run["metric"])
    size = 4 * max((T for T, _ in run["steps"]), default=0) + 4
    pools = None
    if run["pool_dtype"]:
        pools = [torch.zeros(size, run["K"], dtype=run["pool_dtype"], device=DEVICE),
                 torch.zeros(size, run["K"], dtype=run["pool_dtype"])]
    for T, seed in run["steps"]:
        keys, pos, req, slots = _step_inputs(run, T, seed, dyadic=True)
        if pools is None:
            _triton_update(dev, *_on(DEVICE, keys, pos, req), None, None)
            ref.update_reference(keys, pos, req)
        else:
            _triton_update(dev, *_on(DEVICE, keys, pos, req), pools[0][: 4 * T + 4], slots.to(DEVICE))
            ref.update_reference(keys, pos, req, pool=pools[1][: 4 * T + 4], slots=slots)
    _check_same_state(dev, ref, pools)


def _decode_run(seed, B=3, N=5, bs=4, K=20, metric=DriftMetric.L2, pool_dtype=torch.bfloat16):
    """Prefill-free decode: every step adds one arbitrary fp32 key per request."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(N * bs, B, K, generator=g) * 3
    slots = torch.randperm(N * bs * B, generator=g).view(N * bs, B)
    return keys, slots, torch.zeros(N * bs * B, K, dtype=pool_dtype)


@needs_triton
@pytest.mark.parametrize("metric", list(DriftMetric))
def test_triton_decode_steps_bit_for_bit_with_arbitrary_keys(metric):
    B, N, bs, K = 3, 5, 4, 20
    keys, slots, pool = _decode_run(5, B, N, bs, K, metric)
    dev = BlockDriftTracker(B, N, K, block_size=bs, metric=metric, device=DEVICE)
    ref = BlockDriftTracker(B, N, K, block_size=bs, metric=metric)
    pools = [pool.to(DEVICE), pool.clone()]
    req = torch.arange(B, dtype=torch.int32)
    for p in range(N * bs):
        pos = torch.full((B,), p, dtype=torch.int32)
        _triton_update(dev, *_on(DEVICE, keys[p], pos, req), pools[0], slots[p].to(DEVICE))
        ref.update_reference(keys[p], pos, req, pool=pools[1], slots=slots[p])
    assert (ref.drift_scores()[:, 1:] > 0).all()  # every block completed and scored
    _check_same_state(dev, ref, pools)


@needs_triton
def test_triton_bf16_pool_rounds_to_nearest_even():
    # Ties between two bf16 values (even mantissa wins), a carry into the exponent, inf, NaN.
    vals = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 2.0 - 2**-9, float("inf"), float("nan"), -0.0,
                         3.0e38, 1e-40])
    tr = BlockDriftTracker(1, 2, vals.numel(), block_size=4, device=DEVICE)
    pool = torch.zeros(1, vals.numel(), dtype=torch.bfloat16, device=DEVICE)
    _triton_update(tr, *_on(DEVICE, vals.view(1, -1), torch.tensor([0]), None), pool, torch.tensor([0], device=DEVICE))
    want = vals.to(torch.bfloat16)
    got = pool.cpu()[0]
    assert torch.equal(got.view(torch.int16)[:4], want.view(torch.int16)[:4])
    assert torch.isnan(got[4]) and torch.equal(got[5:].view(torch.int16), want[5:].view(torch.int16))


@needs_triton
def test_triton_skips_a_key_with_a_bad_index():
    """A sync-free kernel cannot raise: a key with an out-of-range request id or slot writes
    nothing; the other keys of the step land as the reference puts them."""
    dev = BlockDriftTracker(2, 4, 3, block_size=2, device=DEVICE)
    ref = BlockDriftTracker(2, 4, 3, block_size=2)
    pools = [torch.zeros(8, 3, device=DEVICE), torch.zeros(8, 3)]
    keys = torch.arange(12, dtype=torch.float32).view(4, 3)
    pos = torch.tensor([0, 1, 2, 3])
    req = torch.tensor([0, 2, 1, -1])  # keys 1 and 3: bad request ids
    slots = torch.tensor([0, 1, 9, 3])  # key 2: bad slot
    _triton_update(dev, *_on(DEVICE, keys, pos, req), pools[0], slots.to(DEVICE))
    ref.update_reference(keys[:1], pos[:1], req[:1], pool=pools[1], slots=slots[:1])
    _check_same_state(dev, ref, pools)
    assert dev._counts.sum().item() == 1.0


def test_tracker_routes_to_the_devices_kernel():
    tr = BlockDriftTracker(1, 2, 3, device=DEVICE)
    want = {"cpu": "cpu", "cuda": "triton"}.get(DEVICE.type, "torch")
    assert tr.kernel == want and tr.fused
    # Inputs the kernel does not take (keys on another device than the state) run the torch path.
    if DEVICE.type == "cuda":
        assert not tr._kernel_takes(torch.ones(1, 3), torch.zeros(1, dtype=torch.int64), None, None, None)


_PTX_SCRIPT = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import triton_drift as K

PTR = {torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32", torch.float16: "*fp16",
       torch.bfloat16: "*bf16", torch.float64: "*fp64"}
I = "i32"
def ptx(fn, args, consts, warps):
    names = [n for n in fn.arg_names if n not in consts]
    sig = {n: (PTR[a] if isinstance(a, torch.dtype) else a) for n, a in zip(names, args)}
    sig.update({n: "constexpr" for n in consts})
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, **K.COMPILE_OPTIONS}).asm["ptx"]
def ops(text):  # the opcode of every instruction (a predicate guard "@%p1" skipped; no labels, directives)
    words = [l.split() for l in text.splitlines() if l.strip() and not l.strip().startswith(("//", "."))]
    words = [w[1:] if w[0].startswith("@") else w for w in words]
    return sorted({w[0] for w in words if w and not w[0].endswith(":") and not w[0].startswith(("{", "}", ")"))})
for pool in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
    a = (torch.float32, I, torch.int32, I, torch.int64, I, torch.int32, I, pool, I, torch.float32, torch.float32,
         I, I, I, I)
    print("store", pool, *ops(ptx(K._store_and_add_kernel, a, dict(BS=64, BLOCK_K=128, HAS_REQ=True, HAS_POOL=True,
                                                                     POOL_BF16=pool == torch.bfloat16), 4)))
for cosine in (False, True):
    a = (torch.int64, I, torch.int64, I, torch.int64, I, torch.float32, torch.float32, torch.float32, I, I, I, I)
    print("drift", "cosine" if cosine else "l2",
          *ops(ptx(K._drift_kernel, a, dict(BS=64, HAS_REQ=True, HAS_POOL=True, COSINE=cosine), 1)))
# Without request ids or a pool (the tracker's other calls), and a block size not a power of two.
a = (torch.bfloat16, I, torch.int32, I, torch.int32, I, torch.int32, I, torch.float32, I, torch.float32,
     torch.float32, I, I, I, I)
ptx(K._store_and_add_kernel, a, dict(BS=48, BLOCK_K=16, HAS_REQ=False, HAS_POOL=False, POOL_BF16=False), 4)
a = (torch.int32, I, torch.int32, I, torch.int32, I, torch.float32, torch.float32, torch.float32, I, I, I, I)
ptx(K._drift_kernel, a, dict(BS=48, HAS_REQ=False, HAS_POOL=False, COSINE=False), 1)
print("compiled without request ids and pool")
"""


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU every Triton test above compiles and runs the kernels")
def test_triton_kernels_compile_for_sm90_with_ieee_rounding():
    """Both kernels through Triton's whole pipeline for sm_90 (no GPU needed), and what their
    PTX does with floats: IEEE division and square root, no fused multiply-add, atomics."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton's NVIDIA backend is not installed")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 6))  # the repository root
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("compiled without request ids and pool"), proc.stdout
    lines = {tuple(l.split()[:2]): set(l.split()[2:]) for l in proc.stdout.splitlines()[:-1]}
    assert len(lines) == 6, proc.stdout
    for key, ops in lines.items():
        assert not any(op.startswith("fma.") for op in ops), (key, sorted(ops))
        assert not any(".approx." in op or op.startswith("rcp.") for op in ops), (key, sorted(ops))
        if key[0] == "store":
            assert any(op.startswith(("red.", "atom.")) for op in ops), (key, sorted(ops))
        else:
            assert {"div.rn.f32", "sqrt.rn.f64", "mul.rn.f64", "add.rn.f64"} <= ops, (key, sorted(ops))
    assert "div.rn.f64" in lines[("drift", "cosine")]
    assert "cvt.rn.f16.f32" in lines[("store", "torch.float16")]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_triton_update_captured_in_a_cuda_graph():
    B, N, bs, K = 3, 5, 4, 20
    keys, slots, pool = _decode_run(9, B, N, bs, K)
    dev = BlockDriftTracker(B, N, K, block_size=bs, device=DEVICE)
    ref = BlockDriftTracker(B, N, K, block_size=bs)
    pools = [pool.to(DEVICE), pool.clone()]
    static = [torch.zeros(B, K, device=DEVICE), torch.zeros(B, dtype=torch.int64, device=DEVICE),
              torch.arange(B, device=DEVICE), torch.zeros(B, dtype=torch.int64, device=DEVICE)]
    assert dev.kernel == "triton"
    warm = BlockDriftTracker(B, N, K, block_size=bs, device=DEVICE)  # compile outside the capture
    warm.update(static[0], static[1], static[2], pool=torch.zeros_like(pools[0]), slots=static[3])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dev.update(static[0], static[1], static[2], pool=pools[0], slots=static[3])
    dev.reset()
    pools[0].zero_()
    req = torch.arange(B)
    for p in range(N * bs):
        pos = torch.full((B,), p, dtype=torch.int64)
        for buf, val in zip(static, (keys[p], pos, req, slots[p])):
            buf.copy_(val)
        graph.replay()
        ref.update_reference(keys[p], pos, req, pool=pools[1], slots=slots[p])
    torch.cuda.synchronize()
    _check_same_state(dev, ref, pools)


@cpu_only
def test_multi_head_keys_go_to_the_kernel_as_they_come():
    """Keys ``[T, H, D]`` reach the C++ call unreshaped (read flat, ``H * D`` per token) and
    give the reference's state and pool bit for bit; the kernel names a wrong key size."""
    from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_drift

    gen = torch.Generator().manual_seed(4)
    fused = BlockDriftTracker(2, 6, 8, block_size=4, metric=DriftMetric.COSINE)
    ref = fused.clone()
    pools = [torch.zeros(64, 8, dtype=torch.bfloat16) for _ in range(2)]
    for step in range(6):
        keys = torch.randn(4, 2, 4, generator=gen)  # [T, H, D], H * D = 8: one whole block per step
        pos, req = torch.arange(4 * step, 4 * step + 4), torch.tensor([step // 3] * 4)
        slots = torch.arange(4 * step, 4 * step + 4) + 33 * (step // 3)
        with mock.patch.object(torch.Tensor, "reshape", side_effect=AssertionError("reshaped")):
            fused.update(keys, pos, req, pool=pools[0], slots=slots)
        ref.update_reference(keys, pos, req, pool=pools[1], slots=slots)
    assert torch.equal(fused._sums, ref._sums) and torch.equal(fused._counts, ref._counts)
    assert torch.equal(fused.drift_scores(), ref.drift_scores()) and torch.equal(pools[0], pools[1])
    assert bool((fused.drift_scores() != 0).any())
    with pytest.raises(RuntimeError, match=r"keys: expected fp32 contiguous \[T, \.\.\.\] with 8 values per token, "
                                           r"got Float \[2, 7\]"):
        cpu_drift.track_keys_cpu(torch.ones(2, 7), pos[:2], req[:2], fused._sums, fused._counts, fused._drift_flat,
                                 block_size=4, cosine=True)
