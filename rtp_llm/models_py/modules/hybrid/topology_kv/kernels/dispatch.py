"""The one dispatch point of the policy core: torch, compiled torch, Triton, fused C++.

:func:`apply_topology_kv_policy` calls :func:`run_policy_core` with a
:class:`TopologyKVBackend` (``backend=`` argument, else the config's, else
``RTP_LLM_TOPOLOGY_KV_BACKEND``). Every backend computes exactly what
:func:`topology_kv_policy_core` computes, rows and counters bit for bit (each kernel's
test compares them on hand-computed cases and a hypothesis suite); they differ in cost:

========== ============================================ =====================================
backend    runs on                                      cost per layer call
========== ============================================ =====================================
torch      any device                                   ~30 eager ops, each a pass or launch
compiled   CPU (inductor C++), CUDA (inductor Triton)   fused by inductor; first call compiles
                                                        (tens of seconds), rows are dynamic;
                                                        past a compile budget, a call that
                                                        would compile runs the fused kernel
triton     CUDA; CPU only with TRITON_INTERPRET=1       one launch, one program per row
cpu_fused  CPU (C++ extension built at first use)       one pass per row, rows in parallel
========== ============================================ =====================================

``auto`` picks ``triton`` on CUDA and ``cpu_fused`` on CPU when :func:`can_use_backend`
says they can run, else ``torch``. A backend forced by name that cannot run on the
device raises ``ValueError`` naming the backend, the device and why.

Output buffers: every backend writes into a caller-provided ``out`` (``[R, W]``, the rows'
dtype) and *adds* its counters into a caller-provided ``counters_out`` (int64
``[len(COUNTER_NAMES)]``) when given; with both, the Triton path allocates nothing and
reads nothing on the host, so a CUDA graph can capture it.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable, Dict, Optional, Tuple

import torch

from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import cpu_fused as topology_kv_policy_cpu
from rtp_llm.models_py.modules.hybrid.topology_kv.config import TopologyKVBackend
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.layout import COUNTER_NAMES, PolicyLayout, PolicyTensors
from rtp_llm.models_py.modules.hybrid.topology_kv.kernels.torch_core import topology_kv_policy_core

logger = logging.getLogger(__name__)


def _triton_module():
    """``topology_kv_policy_triton``, imported on first use: triton is a large optional
    import, and ``TRITON_INTERPRET`` must be set before it for CPU runs, so nothing imports
    it until a caller asks for the ``triton`` backend (or ``auto`` on a CUDA device)."""
    from rtp_llm.models_py.modules.hybrid.topology_kv.kernels import triton_fused as topology_kv_policy_triton

    return topology_kv_policy_triton


def _why_not(backend: TopologyKVBackend, device: torch.device) -> Optional[str]:
    """None when ``backend`` can run on ``device``, else the reason (for the error)."""
    if backend is TopologyKVBackend.TORCH:
        return None
    if backend is TopologyKVBackend.COMPILED:
        if device.type in ("cpu", "cuda"):
            return None
        return f"torch.compile of the core is supported on cpu and cuda, not {device.type}"
    if backend is TopologyKVBackend.TRITON:
        triton_kernel = _triton_module()
        if triton_kernel.can_use_triton(device):
            return None
        if triton_kernel.triton is None:
            return "triton does not import"
        if device.type == "cpu":
            return "triton runs on CPU tensors only under TRITON_INTERPRET=1 (set before import)"
        return f"triton needs a CUDA device, got {device}"
    if backend is TopologyKVBackend.CPU_FUSED:
        if device.type != "cpu":
            return f"the fused C++ kernel runs on CPU tensors, got {device}"
        if topology_kv_policy_cpu.can_use_cpu_kernel(device):
            return None
        return f"its C++ extension did not build ({topology_kv_policy_cpu.build_error()})"
    return f"unknown backend {backend}"


def can_use_backend(backend, device) -> bool:
    """Whether ``backend`` (a :class:`TopologyKVBackend` or its name) can run on ``device``.

    ``auto`` can always run (it falls back to ``torch``). Never raises for a known backend.
    """
    backend = TopologyKVBackend.parse(backend)
    if backend is TopologyKVBackend.AUTO:
        return True
    return _why_not(backend, torch.device(device)) is None


def resolve_backend(backend, device) -> TopologyKVBackend:
    """The concrete backend that runs on ``device``: ``auto`` resolved, a forced one checked.

    Raises ``ValueError`` naming the backend, the device and the reason when a backend
    forced by name cannot run there. Cached per (backend, device): whether a backend can
    run does not change within a process, and the policy calls this on every layer.
    """
    return _resolve_cached(TopologyKVBackend.parse(backend), torch.device(device))


@functools.lru_cache(maxsize=64)
def _resolve_cached(backend: TopologyKVBackend, device: torch.device) -> TopologyKVBackend:
    if backend is TopologyKVBackend.AUTO:
        preferred = TopologyKVBackend.TRITON if device.type == "cuda" else TopologyKVBackend.CPU_FUSED
        return preferred if _why_not(preferred, device) is None else TopologyKVBackend.TORCH
    reason = _why_not(backend, device)
    if reason is not None:
        raise ValueError(f"backend: {backend.value!r} cannot run on {device}: {reason}")
    return backend


# Compiles of the core a process pays for before a call that would compile again runs the
# fused kernel instead: each compile stalls its call 16-40 s on CPU (the first ~38 s, each
# new drift-table width ~26 s on 2 cores), and dynamo's own limit (8, shared by every
# compiled function) would make every later call raise.
COMPILED_COMPILE_BUDGET = 4

_RECOMPILE_STANCE_ERROR = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


class CompiledCore:
    """``torch.compile(topology_kv_policy_core, fullgraph=True, dynamic=True)`` and its budget.

    ``dynamic=True`` marks every size dynamic, so a new number of rows per step reuses the
    compiled graph. What the core reads as a Python number still compiles again when it
    changes: the :class:`PolicyLayout` (mode, block counts), the dtypes, which optional
    tensors are given, the drift table's width (it sizes the duplicate bitmap). The first
    :data:`COMPILED_COMPILE_BUDGET` compiles are paid; after them a call is run with
    dynamo's ``fail_on_recompile`` stance, and one that would compile again runs
    :func:`fallback_backend` instead (same rows and counters bit for bit), with one warning
    per process naming the backend and what changed. Calls that match a compiled graph keep
    running it. Process-wide, like dynamo's own cache of compiled code.
    """

    def __init__(self) -> None:
        self.fn = torch.compile(topology_kv_policy_core, fullgraph=True, dynamic=True)
        self.signatures = []  # what each paid compile was for (compile_signature)
        self.logged = False
        self._lock = threading.Lock()

    def __call__(self, inputs: PolicyTensors, layout: PolicyLayout):
        """``(rows, counters)`` of the compiled core, or None: run the fallback backend."""
        from torch._dynamo.exc import FailOnRecompileLimitHit

        signature = compile_signature(inputs, layout)
        try:
            if len(self.signatures) < COMPILED_COMPILE_BUDGET:
                graphs = _compiled_graphs()
                result = self.fn(inputs, layout=layout)
                if _compiled_graphs() > graphs:
                    with self._lock:
                        self.signatures.append(signature)
                return result
            with torch.compiler.set_stance("fail_on_recompile"):
                return self.fn(inputs, layout=layout)
        except FailOnRecompileLimitHit as err:
            self._log_once(signature, f"dynamo's recompile limit was hit ({_first_line(err)})", inputs)
            return None
        except RuntimeError as err:
            if _RECOMPILE_STANCE_ERROR not in str(err):
                raise
            self._log_once(signature, f"its budget of {COMPILED_COMPILE_BUDGET} compiles is spent", inputs, err)
            return None

    def _log_once(self, signature, why: str, inputs: PolicyTensors, err: Optional[BaseException] = None) -> None:
        with self._lock:
            if self.logged:
                return
            self.logged = True
        changed = describe_change(self.signatures[-1], signature) if self.signatures else "the first call"
        guard = _guard_failure(err) if err is not None else ""
        logger.warning(
            "backend 'compiled': %s and this call would compile the policy core again (changed: %s%s); "
            "calls that would compile run the %r backend instead, same rows and counters (logged once)",
            why, changed, f"; dynamo: {guard}" if guard else "", fallback_backend(inputs.topk_indices.device).value,
        )


def compile_signature(inputs: PolicyTensors, layout: PolicyLayout) -> Tuple:
    """What the compiled core specializes on, by field: the layout, each tensor's dtype (None
    when absent) and contiguity, and the drift table's width."""
    tensors = tuple(
        (name, None if t is None else (str(t.dtype).replace("torch.", ""), t.is_contiguous()))
        for name, t in zip(_TENSOR_NAMES, inputs)
    )
    drift = inputs.drift
    return (("layout", layout),) + tensors + (("block_drift_scores width", None if drift is None else drift.shape[1]),)


def describe_change(before: Tuple, after: Tuple) -> str:
    """The fields of two :func:`compile_signature` that differ, ``name before -> after``."""
    diffs = [f"{name} {old} -> {new}" for (name, old), (_, new) in zip(before, after) if old != new]
    return ", ".join(diffs) if diffs else "a size or stride the signature does not list"


# The engine's names of PolicyTensors' fields, for messages.
_TENSOR_NAMES = ("topk_indices", "lengths", "topk_indices_offset", "block_drift_scores", "learned_scores",
                 "scaffold_lengths")


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__


def _guard_failure(err: BaseException) -> str:
    """Dynamo's first guard-failure line of a ``fail_on_recompile`` error (what it saw change)."""
    lines = [line.strip(" -") for line in str(err).splitlines() if line.strip().startswith("- ")]
    return lines[0][:200] if lines else ""


def fallback_backend(device: torch.device) -> TopologyKVBackend:
    """The backend a compiled call past its budget runs: the device's fused kernel, else torch."""
    fused = TopologyKVBackend.TRITON if device.type == "cuda" else TopologyKVBackend.CPU_FUSED
    return fused if _why_not(fused, device) is None else TopologyKVBackend.TORCH


@functools.lru_cache(maxsize=None)
def compiled_core() -> CompiledCore:
    """The process's :class:`CompiledCore`, made once (the first call compiles: tens of seconds on CPU)."""
    return CompiledCore()


def run_policy_core(
    backend: TopologyKVBackend,
    inputs: PolicyTensors,
    *,
    layout: PolicyLayout,
    out: Optional[torch.Tensor] = None,
    counters_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], Optional[Callable[[], Dict[str, torch.Tensor]]]]:
    """Run the core on a resolved ``backend`` (see :func:`resolve_backend`) with ``layout``.

    Returns ``(indices, counters, lazy)``: the rows (``out`` when given); counters as 0-dim
    int64 tensors keyed by :data:`COUNTER_NAMES` (the torch backends without
    ``counters_out``), or empty with ``lazy`` returning views of the buffer that holds them
    when first read (the fused kernels' own buffer, or ``counters_out``, the caller's
    running totals, when it is given); ``lazy`` is None when the counters are given.
    """
    compiled = None
    if backend is TopologyKVBackend.COMPILED:
        compiled = compiled_core()(inputs, layout)
        if compiled is None:  # past the compile budget: logged once
            backend = fallback_backend(inputs.topk_indices.device)
    if backend in (TopologyKVBackend.TRITON, TopologyKVBackend.CPU_FUSED):
        kernel = (
            _triton_module().topology_kv_policy_triton
            if backend is TopologyKVBackend.TRITON
            else topology_kv_policy_cpu.topology_kv_policy_cpu
        )
        rows, buffer = kernel(inputs, layout=layout, out=out, counters=counters_out)
        # The per-name views cost ~1 us each on CPU: made only when a counter is read.
        return rows, {}, lambda: buffer_counters(buffer)
    rows, counters = compiled if compiled is not None else topology_kv_policy_core(inputs, layout=layout)
    counters.pop("mismatch_rows")
    if out is not None:
        out.copy_(rows)
        rows = out
    if counters_out is None:
        return rows, counters, None
    counters_out.add_(torch.stack([counters[name] for name in COUNTER_NAMES]))
    return rows, {}, lambda: buffer_counters(counters_out)


def buffer_counters(buffer: torch.Tensor) -> Dict[str, torch.Tensor]:
    """0-dim views of an int64 ``[len(COUNTER_NAMES)]`` buffer, keyed by :data:`COUNTER_NAMES`."""
    return {name: buffer[i] for i, name in enumerate(COUNTER_NAMES)}
