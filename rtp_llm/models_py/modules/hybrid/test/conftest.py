"""Shared fixtures of the indexer tests: the device under test (TOPOLOGY_KV_TEST_DEVICE), the
prefill and decode cases (built once per module)."""

import pytest

from rtp_llm.models_py.modules.hybrid.test import indexer_ref
from rtp_llm.models_py.modules.hybrid.test.indexer_cases import (
    DECODE_KV_LENS,
    DIM,
    HEADS,
    PAGE,
    PLANTED_BLOCKS,
    PREFILL_NEW,
    PREFILL_PREFIX,
)
from tools.device_under_test import pytest_collection_modifyitems, pytest_report_header  # noqa: F401 (hooks)


@pytest.fixture(scope="module")
def prefill_case():
    """Four prefill requests crossing the width (indexer_cases.PREFILL_PREFIX / _NEW)."""
    return indexer_ref.build_prefill_case(
        PREFILL_PREFIX, PREFILL_NEW, HEADS, DIM, PAGE, seed=11, planted_shift_blocks=PLANTED_BLOCKS
    )


@pytest.fixture(scope="module")
def decode_case():
    """Eight decode requests at the page and width edges (indexer_cases.DECODE_KV_LENS)."""
    return indexer_ref.build_decode_case(DECODE_KV_LENS, HEADS, DIM, PAGE, seed=12, planted_shift_blocks=PLANTED_BLOCKS)
