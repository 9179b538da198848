"""The clock of the step's phase timers (indexer / policy / attention / rest) and its total.

On the CPU the clock is ``time.perf_counter``: a phase's ops have run when the host
reaches its end. On CUDA the host only queues kernels, so every reading first waits for
the device (``torch.cuda.synchronize``): each phase is bounded by two synchronizations and
holds exactly the device work queued inside it. The CUDA split is therefore sync-bounded:
each phase also counts one synchronization's latency and loses the overlap of host and
device work across its boundaries, so the phases and the step total (read the same way)
slightly over-count what an unsynchronized step takes.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

Clock = Callable[[], float]


def phase_clock(device: torch.device) -> Clock:
    """Seconds, read after the device's queued work is done: ``time.perf_counter`` itself on
    the CPU, a synchronize-then-read on CUDA (module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized
