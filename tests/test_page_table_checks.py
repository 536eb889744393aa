"""A corrupt page table is rejected on the host, naming the lane and entry (kv_pool).

The device-side backstop (rows that need a page id outside the pool come out NaN) is tested
with the kernel, in test_kernel_paged_attention.py.
"""

import numpy as np
import pytest

from mtpjax.engine import Engine
from mtpjax.engine.kv_pool import CorruptPageTableError, PageAllocator, validate_page_table
from mtpjax.sampling import SamplingParams

from tiny_models import VOCAB11_CFG as CFG, VOCAB11_PARAMS as PARAMS


def _alloc():
    a = PageAllocator(num_pages=8, page_size=4, max_lanes=3, pages_per_lane=4)
    a.reserve(0, 9)     # 3 pages
    a.reserve(1, 4)     # 1 page
    return a


def test_a_valid_table_passes():
    a = _alloc()
    validate_page_table(a.table, [3, 1, 0], 8)
    assert (a.table[2] == 8).all()


@pytest.mark.parametrize("lane,entry,value,msg", [
    (1, 0, 8, "lane 1 entry 0 holds page 8: outside the pool"),
    (0, 2, -1, "lane 0 entry 2 holds page -1: outside the pool"),
    (1, 1, 5, "lane 1 entry 1 holds page 5: past the lane's 1 owned page"),
    (2, 3, 0, "lane 2 entry 3 holds page 0: past the lane's 0 owned page"),
])
def test_reading_a_corrupt_table_names_the_lane_and_entry(lane, entry, value, msg):
    a = _alloc()
    t = a.table                      # the array itself: writing to it corrupts the allocator
    t[lane, entry] = value
    with pytest.raises(CorruptPageTableError, match=msg) as e:
        a.table
    assert (e.value.lane, e.value.entry, e.value.page) == (lane, entry, value)


def test_a_page_held_twice_is_rejected():
    a = _alloc()
    t = a.table
    t[1, 0] = t[0, 1]
    with pytest.raises(CorruptPageTableError, match=r"lane 1 entry 0 .* also held by lane 0 "
                                                    r"entry 1"):
        a.table


def test_the_engine_rejects_a_table_corrupted_mid_run():
    """The engine reads the allocator's table before every program: a corrupt entry stops the
    run with an error naming the lane and entry (it used to be clamped on the device and read
    some other page)."""
    e = Engine(CFG, PARAMS, num_speculative_tokens=1, max_lanes=2, max_seq_len=32,
               prefill_chunk=8, page_size=4, kernels="reference")
    seen, calls = [], []

    def corrupt(i, ids):         # after the first tokens (a step may emit more than one)
        seen.extend(ids)
        calls.append(len(ids))
        if len(calls) == 1:
            e.alloc.table[0, 0] = e.num_pages + 3

    with pytest.raises(ValueError, match="lane 0 entry 0"):
        e.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=8), on_token=corrupt)
    assert len(calls) == 1 and len(seen) < 8
