"""Cold-cache timing: evict the caches before a timed call, as serving's model does.

Between two policy calls of one decode step a whole model layer runs (attention, the MLP:
megabytes of weights streamed through the caches), so a layer's policy call meets its code,
its Python objects and its inputs cold. :class:`CacheEvictor` writes a buffer of twice the
largest cache level before a timed call, which leaves nothing of the call's working set in
any level. The benchmark times every call once right after the eviction (*cold*, the
serving-like figure) and once more straight after it (*warm*, the best case).

CPU: the largest ``/sys/devices/system/cpu/cpu0/cache/index*/size`` (the shared last level;
:data:`FALLBACK_BYTES` when unreadable). CUDA: the device's L2 (``L2_cache_size``).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

CPU_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"
FALLBACK_BYTES = 32 << 20  # a server part's last-level cache when sysfs does not say
MAX_BYTES = 512 << 20


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache ``size`` entry: ``"32768K"``, ``"2M"``, ``"512"``."""
    text = text.strip()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    if not digits.isdigit():
        raise ValueError(f"cache size: expected digits with an optional K/M/G suffix, got {text!r}")
    return int(digits) * scale


def largest_cpu_cache_bytes(cache_dir: str = CPU_CACHE_DIR) -> Optional[int]:
    """The largest cache level of CPU 0 in bytes, or None when sysfs has no readable entry."""
    sizes = []
    try:
        entries = os.listdir(cache_dir)
    except OSError:
        return None
    for name in entries:
        path = os.path.join(cache_dir, name, "size")
        if not name.startswith("index") or not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                sizes.append(parse_cache_size(f.read(64)))
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else None


class CacheEvictor:
    """Calling it evicts ``device``'s caches: writes ``nbytes`` (twice the largest cache) and,
    on CUDA, waits for the write. ``source`` says where the cache size came from."""

    def __init__(self, device: torch.device, nbytes: Optional[int] = None, cache_dir: str = CPU_CACHE_DIR):
        self.device = torch.device(device)
        if nbytes is not None:
            self.source = "given"
        elif self.device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0)
            nbytes, self.source = (2 * l2, "L2_cache_size") if l2 else (2 * FALLBACK_BYTES, "fallback")
        else:
            largest = largest_cpu_cache_bytes(cache_dir)
            nbytes, self.source = (2 * largest, cache_dir) if largest else (2 * FALLBACK_BYTES, "fallback")
        if nbytes <= 0:
            raise ValueError(f"nbytes: expected > 0, got {nbytes}")
        self.nbytes = min(int(nbytes), MAX_BYTES)
        self._buffer = torch.empty(self.nbytes // 4, dtype=torch.float32, device=self.device)
        self._value = 0.0

    def __call__(self) -> None:
        self._value = 1.0 - self._value  # a new value each time: every line is written
        self._buffer.fill_(self._value)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def describe(self) -> dict:
        return {"evict_bytes": self.nbytes, "cache_size_from": self.source}
