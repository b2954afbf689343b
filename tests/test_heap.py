"""quantkit.heap: freed memory is handed back when the resident set has grown, and only then."""
from __future__ import annotations

import mmap
import sys

import pytest

from quantkit import heap

MiB = 2**20


@pytest.fixture
def trims(monkeypatch):
    """Counts the trims a release makes, with a resident set the test sets (it drops to `after` on a trim)."""
    state = {"rss": 500 * MiB, "after": 400 * MiB, "trims": 0}

    def trim(_pad):
        state["trims"] += 1
        state["rss"] = state["after"]
    monkeypatch.setattr(heap, "_malloc_trim", lambda: trim)
    monkeypatch.setattr(heap, "resident_bytes", lambda: state["rss"])
    monkeypatch.setattr(heap, "_last_trim", {"rss": None})
    return state


def test_a_release_trims_once_the_resident_set_has_grown_past_the_last_trim(trims):
    heap.release_free_memory()
    assert trims["trims"] == 1                       # the first release has nothing to compare with
    trims["rss"] = 400 * MiB + heap.GROWTH - MiB     # a stage that reused what the last one freed
    heap.release_free_memory()
    assert trims["trims"] == 1
    trims["rss"] = 400 * MiB + heap.GROWTH + MiB     # a heap that kept growing
    heap.release_free_memory()
    assert trims["trims"] == 2
    heap.release_free_memory()                       # measured from where that trim left it
    assert trims["trims"] == 2


def test_a_release_trims_every_time_where_the_resident_set_cannot_be_read(trims, monkeypatch):
    monkeypatch.setattr(heap, "resident_bytes", lambda: None)
    for _ in range(3):
        heap.release_free_memory()
    assert trims["trims"] == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc are Linux's")
def test_the_resident_set_is_read_from_this_process():
    # a fresh anonymous mapping: a malloc'd block may reuse freed pages that are resident already (the tests
    # before this one leave the allocator a different amount of them)
    block = mmap.mmap(-1, 64 * MiB)
    before = heap.resident_bytes()
    block[::4096] = b"\1" * len(block[::4096])  # every page touched: resident
    assert heap.resident_bytes() >= before + 60 * MiB
    block.close()
