"""Shared fixtures of the benchmark, policy and schedule tests: the device under test."""

import pytest

from tools.device_under_test import DEVICE, skip_reason


def pytest_report_header(config):
    return f"device under test: {DEVICE}"


def pytest_collection_modifyitems(config, items):
    reason = skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        item.add_marker(marker)
