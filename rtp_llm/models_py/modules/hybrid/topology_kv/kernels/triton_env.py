"""Triton, when it is installed, and where the repository's Triton kernels can run.

One predicate for every Triton kernel here (the policy, ``triton_fused.py``; the drift
tracker's update, ``triton_drift.py``). ``triton.jit`` reads ``TRITON_INTERPRET`` when a
kernel is defined, at its module's import; this module records the variable when it is
first imported, which is before either kernel module defines a kernel (both import it
first), so the recorded value is what their kernels saw.
"""

from __future__ import annotations

import os
from typing import Union

import torch

try:  # triton is optional: without it can_use_triton() is False and the torch paths run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # what triton.jit sees in the kernel modules


def can_use_triton(device: Union[torch.device, str]) -> bool:
    """Whether the Triton kernels can run on ``device``; never raises.

    True on CUDA when triton imports (and CUDA is available); on CPU only when
    ``TRITON_INTERPRET=1`` is set in the environment and was set when the kernels were
    defined (they are then interpreted functions). False elsewhere.
    """
    if triton is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and not INTERPRETED
    if device.type == "cpu":
        return INTERPRETED and os.environ.get("TRITON_INTERPRET", "0") == "1"
    return False
