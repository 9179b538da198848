"""The end-to-end benchmark's host page-fault count (benchmark/e2e/memory.py,
``minor_page_faults``): fresh memory touched shows up as faults, reused memory does not;
the printed line gives the range over rows in pages and MiB."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from benchmark.e2e.memory import minor_page_faults
from benchmark.e2e.report import format_host_faults

FRESH_BYTES = 64 * 1024 * 1024
PAGE = mmap.PAGESIZE


def _fresh_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous mapping no page of which is mapped yet, kept out of transparent huge
    pages of every size (``MADV_NOHUGEPAGE``): each page touched is then exactly one fault,
    whatever the kernel's THP settings (``always``, or multi-size THP such as 64 KiB folios)."""
    m = mmap.mmap(-1, nbytes)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    return m


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_NOHUGEPAGE"),
                    reason="getrusage counts minor faults on Linux; the mapping needs MADV_NOHUGEPAGE")
def test_fresh_pages_fault_and_reused_ones_do_not():
    m = _fresh_mapping(FRESH_BYTES)
    try:
        pages = torch.frombuffer(m, dtype=torch.uint8)
        before = minor_page_faults()
        pages.fill_(1)  # every page touched once
        touched = minor_page_faults()
        pages.fill_(2)  # the same pages again: already mapped
        again = minor_page_faults()
        del pages
    finally:
        m.close()
    assert isinstance(before, int)
    assert touched - before >= 0.9 * FRESH_BYTES // PAGE, f"{touched - before} faults for {FRESH_BYTES // PAGE} fresh pages"
    assert again - touched < 0.01 * FRESH_BYTES // PAGE, f"{again - touched} faults re-touching mapped pages"


def test_the_fault_line_gives_the_range_in_pages_and_mib():
    rows = [{"host_minor_faults_per_step": 0}, {"host_minor_faults_per_step": 256.0},
            {"host_minor_faults_per_step": None}, {}]
    assert format_host_faults(rows) == ("host minor page faults per timed step (mean per row): 0 .. 256 "
                                        "(0.0 .. 1.0 MiB at 4 KiB a fault; a transparent-huge-page fault maps more)")
    assert format_host_faults([{}, {"host_minor_faults_per_step": None}]) is None
