"""The end-to-end benchmark's host page-fault count (benchmark/e2e/memory.py,
``minor_page_faults``): fresh memory touched shows up as faults, reused memory does not;
the printed line gives the range over rows in pages and MiB."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmark.e2e.memory import minor_page_faults
from benchmark.e2e.report import format_host_faults

FRESH_BYTES = 64 * 1024 * 1024  # above glibc's largest mmap threshold (32 MiB): always mapped fresh
PAGE = 4096


def _thp_always() -> bool:
    """Transparent huge pages on every anonymous mapping: fresh memory then faults in 2 MiB
    pages, so 4 KiB page counts do not apply (Debian's default is ``madvise``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="getrusage counts minor faults on Linux")
@pytest.mark.skipif(_thp_always(), reason="transparent huge pages set to always: 2 MiB faults")
def test_fresh_pages_fault_and_reused_ones_do_not():
    before = minor_page_faults()
    fresh = torch.empty(FRESH_BYTES // 4)
    fresh.fill_(1.0)  # every page touched once
    touched = minor_page_faults()
    fresh.fill_(2.0)  # the same pages again: already mapped
    again = minor_page_faults()
    assert isinstance(before, int)
    assert touched - before >= 0.9 * FRESH_BYTES // PAGE, f"{touched - before} faults for {FRESH_BYTES // PAGE} fresh pages"
    assert again - touched < 0.01 * FRESH_BYTES // PAGE, f"{again - touched} faults re-touching mapped pages"


def test_the_fault_line_gives_the_range_in_pages_and_mib():
    rows = [{"host_minor_faults_per_step": 0}, {"host_minor_faults_per_step": 256.0},
            {"host_minor_faults_per_step": None}, {}]
    assert format_host_faults(rows) == ("host minor page faults per timed step (mean per row): 0 .. 256 "
                                        "(0.0 .. 1.0 MiB of pages taken fresh from the OS)")
    assert format_host_faults([{}, {"host_minor_faults_per_step": None}]) is None
