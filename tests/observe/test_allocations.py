"""The allocation tracker against byte counts computed by hand (single process, CPU)."""

from __future__ import annotations

import torch

from vescale_plugins.observe.allocations import BEFORE, AllocationTracker, _Block, _Event, _pair

F32 = 4  # bytes per float32 element


def test_known_tensors_and_their_frees():
    with AllocationTracker() as tracker:
        with tracker.region("work"):
            a = torch.empty(1024)  # 4096 B
            b = torch.empty(256, dtype=torch.float64)  # 2048 B
            del a
            c = torch.empty(100)  # 400 B, allocated after the peak
    work = tracker.region_memory("work")
    assert (work.start_bytes, work.peak_bytes, work.end_bytes) == (0, 6144, 2448)
    assert work.peak_by_owner == {"work": 6144}
    assert tracker.peak_bytes == 6144
    del b, c


def test_storage_resized_in_place_like_dbuffer():
    # Made before the tracker, like DBuffer's unsharded buffer at fully_shard time.
    flat = torch.empty(2000)
    view = flat[10:20]  # cut once while allocated; it survives the storage's resizes
    flat.untyped_storage().resize_(0)
    with AllocationTracker() as tracker:
        with tracker.region("gather"):
            flat.untyped_storage().resize_(2000 * F32)
            view.fill_(1.0)  # the old view sees the new storage
            flat.untyped_storage().resize_(0)
        with tracker.region("after"):
            small = torch.empty(10)
    gather = tracker.region_memory("gather")
    assert (gather.start_bytes, gather.peak_bytes, gather.end_bytes) == (0, 8000, 0)
    assert tracker.region_memory("after").peak_bytes == 40
    del small


def test_growing_a_live_storage_holds_old_and_new_at_once():
    with AllocationTracker() as tracker:
        with tracker.region("grow"):
            t = torch.empty(1000)  # 4000 B
            t.untyped_storage().resize_(8000)  # new 8000 B block, copy, then free the 4000 B one
    grow = tracker.region_memory("grow")
    assert (grow.peak_bytes, grow.end_bytes) == (12000, 8000)
    del t


def test_blocks_from_before_the_tracker_are_not_counted_nor_their_frees():
    old = torch.empty(5000)
    with AllocationTracker() as first:
        kept = torch.empty(250)  # 1000 B, allocated here, freed during the next tracker
    assert first.peak_bytes == 1000
    with AllocationTracker() as tracker:
        with tracker.region("frees"):
            del old, kept
            fresh = torch.empty(25)  # 100 B
    frees = tracker.region_memory("frees")
    assert (frees.start_bytes, frees.peak_bytes, frees.end_bytes) == (0, 100, 100)
    del fresh


def test_peak_split_by_the_region_that_allocated():
    with AllocationTracker() as tracker:
        persistent = torch.empty(500)  # 2000 B, outside every region
        with tracker.region("step"):
            with tracker.region("forward"):
                act = torch.empty(300)  # 1200 B
            with tracker.region("backward"):
                tmp = torch.empty(100)  # 400 B: the peak is here
                del tmp, act
    step = tracker.region_memory("step")
    assert (step.start_bytes, step.peak_bytes, step.end_bytes) == (2000, 3600, 2000)
    assert step.peak_by_owner == {BEFORE: 2000, "forward": 1200, "backward": 400}
    assert tracker.region_names() == ["step", "forward", "backward"]
    del persistent


def test_a_collective_temporary_freed_off_the_profiled_threads_is_closed_after_the_op():
    # Gloo's worker thread sometimes drops the last reference to a reduce-scatter's clone
    # where the profiler cannot see it. Thread 1 issues the op (ends at 20) and allocates
    # again at 30; thread 2 is another thread's event in between.
    events = [
        _Event(10, ptr=0xA, nbytes=4096, tid=1, collective_end_ns=20),  # its free is never reported
        _Event(25, ptr=0xB, nbytes=100, tid=2, collective_end_ns=None),
        _Event(30, ptr=0xC, nbytes=200, tid=1, collective_end_ns=None),
        _Event(40, ptr=0xC, nbytes=-200, tid=1, collective_end_ns=None),
    ]
    assert sorted(_pair(events), key=lambda b: b.alloc_ns) == [
        _Block(4096, 10, 30),  # closed at thread 1's first event after the op
        _Block(100, 25, None),  # still live at the end
        _Block(200, 30, 40),
    ]


def test_an_address_handed_out_again_closes_its_unreported_block():
    events = [
        _Event(10, ptr=0xA, nbytes=64, tid=1, collective_end_ns=None),
        _Event(50, ptr=0xA, nbytes=32, tid=1, collective_end_ns=None),
        _Event(60, ptr=0xD, nbytes=-999, tid=1, collective_end_ns=None),  # allocated before tracking
    ]
    assert sorted(_pair(events), key=lambda b: b.alloc_ns) == [_Block(64, 10, 50), _Block(32, 50, None)]


def test_peak_split_by_scope_of_allocation_or_else_of_free():
    from torch.profiler import record_function

    with AllocationTracker(scopes=("made::",), free_scopes=("freed::",)) as tracker:
        with record_function("made::buffer"):
            buffer = torch.empty(250)  # 1000 B, attributed where it was made
        grad = torch.empty(100)  # 400 B, made in no scope: attributed where it dies
        other = torch.empty(50)  # 200 B, made and freed outside every scope
        with record_function("made::too"):
            kept = torch.empty(25)  # 100 B: its free below does not re-attribute it
        with record_function("freed::grad"):
            del grad, kept
        del other, buffer
    peak, by_scope = tracker.peak_by_scope()
    assert peak == 1700
    assert by_scope == {"made::": 1100, "freed::": 400, None: 200}
