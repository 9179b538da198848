"""The device every test of this repository runs on: one switch, read once.

``TOPOLOGY_KV_TEST_DEVICE`` (default ``cpu``) selects it; the ``*_cuda_manual`` Bazel
twins set it to ``cuda``. Test modules import :data:`DEVICE`; the ``conftest.py`` of each
test folder imports the two pytest hooks below, which report the device in the header and
skip every collected test when the requested device is missing (so a GPU target on a
machine without one reports skips, not errors).
"""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

TEST_DEVICE_ENV = "TOPOLOGY_KV_TEST_DEVICE"

DEVICE = torch.device(os.environ.get(TEST_DEVICE_ENV, "cpu"))

# On CPU the policy's Triton kernel runs under Triton's interpreter; the variable must be
# set before triton is first imported, and every test folder's conftest imports this module
# before any test module. A caller's explicit setting wins.
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def skip_reason() -> Optional[str]:
    """Why the tests cannot run on :data:`DEVICE`, or None when they can."""
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        return f"{TEST_DEVICE_ENV}=cuda but no CUDA device"
    return None


def pytest_report_header(config):
    return f"device under test: {DEVICE}"


def pytest_collection_modifyitems(config, items):
    reason = skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        item.add_marker(marker)
