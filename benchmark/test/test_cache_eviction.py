"""The cache evictor of the benchmarks' cold-cache timing: its size and what it writes."""

from __future__ import annotations

import pytest
import torch

from benchmark.candidates import cache_eviction as ce


@pytest.mark.parametrize("text, value", [("32768K", 32 << 20), ("2M", 2 << 20), ("512\n", 512), ("1G", 1 << 30)])
def test_parse_cache_size(text, value):
    assert ce.parse_cache_size(text) == value


@pytest.mark.parametrize("text", ["", "K", "12X", "abcK"])
def test_parse_cache_size_names_the_bad_entry(text):
    with pytest.raises(ValueError, match=r"^cache size: expected digits with an optional K/M/G suffix, got "):
        ce.parse_cache_size(text)


def _fake_sysfs(root, sizes):
    for i, size in enumerate(sizes):
        (root / f"index{i}").mkdir()
        (root / f"index{i}" / "size").write_text(size + "\n")
    (root / "uevent").write_text("")  # not a level


def test_the_largest_level_sets_twice_the_size(tmp_path):
    _fake_sysfs(tmp_path, ["48K", "32K", "1024K", "16384K"])
    assert ce.largest_cpu_cache_bytes(str(tmp_path)) == 16 << 20
    evict = ce.CacheEvictor(torch.device("cpu"), cache_dir=str(tmp_path))
    assert evict.nbytes == 32 << 20 and evict.describe() == {"evict_bytes": 32 << 20, "cache_size_from": str(tmp_path)}


def test_unreadable_sysfs_falls_back(tmp_path):
    _fake_sysfs(tmp_path, ["garbage"])
    assert ce.largest_cpu_cache_bytes(str(tmp_path)) is None
    assert ce.largest_cpu_cache_bytes(str(tmp_path / "missing")) is None
    evict = ce.CacheEvictor(torch.device("cpu"), cache_dir=str(tmp_path / "missing"))
    assert evict.nbytes == 2 * ce.FALLBACK_BYTES and evict.source == "fallback"


def test_each_call_writes_every_element_with_a_new_value():
    evict = ce.CacheEvictor(torch.device("cpu"), nbytes=4096)
    assert evict.nbytes == 4096 and evict.source == "given"
    evict()
    first = evict._buffer.clone()
    evict()
    assert first.numel() == 1024 and bool((first != evict._buffer).all())


def test_size_is_capped_and_must_be_positive():
    assert ce.CacheEvictor(torch.device("cpu"), nbytes=ce.MAX_BYTES * 4).nbytes == ce.MAX_BYTES
    with pytest.raises(ValueError, match=r"^nbytes: expected > 0, got 0$"):
        ce.CacheEvictor(torch.device("cpu"), nbytes=0)
