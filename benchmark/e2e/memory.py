"""A decode step's transient peak host memory (Linux/glibc counters; None elsewhere)."""

from __future__ import annotations

import ctypes
from typing import Optional


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


def measure_step_memory(fn):
    """Run ``fn()`` and return ``(result, transient peak bytes or None)``.

    The counter: free heap memory is handed back to the OS first (``malloc_trim``), the
    process's resident high-water mark is reset (``/proc/self/clear_refs``), and the
    step's transient peak is ``VmHWM`` after it minus ``VmRSS`` before it: every page the
    step's temporaries touched above what was resident. None where Linux/glibc lack these.
    """
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


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
