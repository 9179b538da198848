"""Shared fixtures of the metrics tests: the device under test (TOPOLOGY_KV_TEST_DEVICE), where the
step counters' tensors live."""

from tools.device_under_test import pytest_collection_modifyitems, pytest_report_header  # noqa: F401 (hooks)
