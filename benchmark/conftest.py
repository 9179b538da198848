"""Shared fixtures of the benchmark, policy and schedule tests: the device under test."""

from tools.device_under_test import pytest_collection_modifyitems, pytest_report_header  # noqa: F401 (hooks)
