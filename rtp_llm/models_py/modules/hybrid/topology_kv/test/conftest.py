"""Shared fixtures of the policy, kernel, backend, plan and schedule tests: the device under test
(TOPOLOGY_KV_TEST_DEVICE; on CPU it also switches the Triton interpreter on before triton is
imported)."""

from tools.device_under_test import pytest_collection_modifyitems, pytest_report_header  # noqa: F401 (hooks)
