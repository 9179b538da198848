"""A decode step's transient peak memory on the run's device, and the host pages it faulted in.

CPU: the process's host memory (Linux/glibc counters; None elsewhere). CUDA: the caching
allocator's device memory (``torch.cuda`` peak statistics). On either, the host's minor
page faults (:func:`minor_page_faults`) count the pages a step took fresh from the OS.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

try:
    import resource
except ImportError:  # not Unix: no fault counts
    resource = None

# What each device's counter measures (the rows' ``memory_counter`` field).
HOST_COUNTER = "VmHWM - VmRSS around step 0 after malloc_trim, plus counted shared and own tensors"
CUDA_COUNTER = ("torch.cuda.max_memory_allocated - memory_allocated around step 0 after reset_peak_memory_stats, "
                "plus counted shared and own tensors")


def memory_counter(device: torch.device) -> str:
    """The description of :func:`measure_step_memory`'s counter on ``device``."""
    return CUDA_COUNTER if torch.device(device).type == "cuda" else HOST_COUNTER


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _proc_status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_step_memory(fn, device: torch.device):
    """Run ``fn()`` and return ``(result, transient peak bytes or None)`` on ``device``.

    CPU: free heap memory is handed back to the OS first (``malloc_trim``), the process's
    resident high-water mark is reset (``/proc/self/clear_refs``), and the step's transient
    peak is ``VmHWM`` after it minus ``VmRSS`` before it: every page the step's temporaries
    touched above what was resident. None where Linux/glibc lack these.

    CUDA: the allocator's peak is reset (``reset_peak_memory_stats``) and the transient
    peak is ``max_memory_allocated`` after the step minus ``memory_allocated`` before it:
    the most the step's tensors held above what was allocated (the allocator counts on the
    host, at allocation time, so no synchronization is needed).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(fn, device)
    return _measure_host(fn)


def _measure_cuda(fn, device: torch.device):
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    return result, max(0, torch.cuda.max_memory_allocated(device) - before)


def _measure_host(fn):
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ok = True
    except OSError:
        ok = False
    before = _proc_status("VmRSS")
    result = fn()
    peak = _proc_status("VmHWM")
    if not ok or before is None or peak is None:
        return result, None
    return result, max(0, peak - before)


def minor_page_faults() -> Optional[int]:
    """The process's minor page faults so far (``getrusage``), or None where the platform lacks it.

    The difference of two readings around a decode step counts the host pages its
    allocations took fresh from the OS (each zero-filled by the kernel), a cost a serving
    process's caching allocator does not pay per step; a step that only reuses freed heap
    memory takes none."""
    if resource is None:
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
