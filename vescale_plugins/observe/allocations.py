"""Live tensor bytes and their peak, counted from the allocator's own events (not RSS).

Mechanism: ``torch.profiler.profile(profile_memory=True)``. With memory profiling on, every
allocation and free of the device allocator is reported to the profiler with its address and
size; on CPU that is ``c10::ProfiledCPUMemoryReporter`` inside the default CPU allocator.
:class:`AllocationTracker` replays those events in time order: ``+n`` bytes at an
allocation, minus the recorded size at the free of the same address. Why this and not the
alternatives:

* It sits below every tensor API, so it sees what Python-level trackers miss: storage that
  grows or shrinks in place (``untyped_storage().resize_(n)`` / ``resize_(0)``, which both
  DBuffer and FSDP2 use to allocate and free unsharded buffers, is an allocator free plus
  allocation), buffers allocated inside C++ (autograd, gloo's flat staging tensors) and
  tensor subclasses (DTensor), for both engines alike.
* ``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode`` plus a
  patched ``UntypedStorage.resize_``) is wrong for exactly that pattern on torch 2.13: a
  storage created before the tracker (like DBuffer's unsharded buffers, made at
  ``fully_shard`` time) is not counted when it is resized, and its peak is only sampled at
  dispatched ops, so a ``resize_(n)`` followed by ``resize_(0)`` never shows in the peak
  (docs/benchmark.md has the check).
* A hand-written dispatch mode with storage finalizers would share those blind spots.

What is counted: bytes the allocator handed out *since the tracker started* and not yet freed.
Blocks allocated before it started are invisible, and so are their frees (the allocator does
not report them, and frees of addresses this tracker never saw allocated are ignored), so
build what you measure inside the tracker. Sizes are the requested bytes (no allocator
alignment slack). Reading the events uses the profiler's ``experimental_event_tree()``, the
same entry point as ``torch.profiler._memory_profiler``.

Frees the profiler cannot see: the allocator reports only on threads that carry the
profiler's thread-local state, and a collective backend's worker thread sometimes drops the
last reference to a tensor. Two cases, seen with gloo:

* temporaries the collective allocated (gloo's reduce-scatter clones its input; a few of
  those frees go unreported). A block allocated inside a collective op (``c10d::*``,
  ``gloo:*``) whose free never shows is closed at the first allocator event of its thread
  after that op: the issuing thread of a synchronous collective blocks in ``wait()`` until
  the collective completes, and the worker frees the temporary as it completes.
* tensors the caller handed to the collective and dropped while the worker still held them
  (seen for FSDP2's all-gather output in some runs). Such a block, like any other
  whose free went unreported, is closed when its address is handed out again, or stays live.

A free that stays unreported can only make the count too high, and which frees go missing
changes from run to run, so a caller that needs an exact figure repeats the measurement and
keeps the smallest (as the benchmark does). The first rule could close a temporary a
little early if the issuing thread allocated again before the collective completed (an
asynchronous collective); with gloo those frees are not the ones that go missing.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch._C._profiler import _EventType, _ExtraFields_Allocation
from torch.profiler import ProfilerActivity, record_function

from vescale_plugins.observe.quiet_profiler import profile

__all__ = ["AllocationTracker", "RegionMemory", "BEFORE"]

# Prefix of the record-function scopes that mark regions, so they cannot clash with others.
_REGION_PREFIX = "memtrack::"
# Owner of live bytes allocated before any region (e.g. parameters, optimizer state).
BEFORE = "<before>"
# Profiler scopes of collective backends: blocks allocated under them are the backend's temporaries.
_COLLECTIVE_PREFIXES = ("c10d::", "gloo:")


@dataclass(frozen=True)
class _Event:
    """One allocator event: ``nbytes`` > 0 allocates at ``ptr``, < 0 frees it.

    ``collective_end_ns`` is when the collective op it happened in ended (None outside one).
    """

    time_ns: int
    ptr: int
    nbytes: int
    tid: int
    collective_end_ns: int | None
    scope: str | None = None


@dataclass(frozen=True)
class _Block:
    """One allocation of ``nbytes`` at ``alloc_ns``; ``free_ns`` is None while still live at the end.

    ``scope`` is the innermost tracked scope (see ``AllocationTracker(scopes=...)``) it was
    allocated in, if any.
    """

    nbytes: int
    alloc_ns: int
    free_ns: int | None
    scope: str | None = None


@dataclass(frozen=True)
class _Region:
    """A span marked with :meth:`AllocationTracker.region` (ns, profiler clock)."""

    name: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class RegionMemory:
    """Live bytes around and inside one region.

    Attributes:
        name: the region.
        start_bytes: live bytes when it began.
        peak_bytes: the most live bytes at any moment inside it (at least ``start_bytes``).
        end_bytes: live bytes when it ended.
        peak_by_owner: the bytes live at the peak, by the innermost region that allocated
            them (``BEFORE`` for bytes older than every region); sums to ``peak_bytes``.
    """

    name: str
    start_bytes: int
    peak_bytes: int
    end_bytes: int
    peak_by_owner: dict[str, int]


class AllocationTracker:
    """Context manager counting live allocator bytes of one device type from its events.

    Only one can be active at a time (it runs a profiler session). Results are available
    after ``__exit__``::

        with AllocationTracker() as tracker:
            build()
            with tracker.region("step"):
                step()
        print(tracker.region_memory("step").peak_bytes)

    Args:
        device_type: which allocator to count (``"cpu"`` or ``"cuda"``).
        scopes: prefixes of profiler scope names (record functions, ops) to attribute
            allocations to: each block belongs to the innermost enclosing scope whose name
            starts with one of them (see :meth:`peak_by_scope`).
        free_scopes: the same for frees: a block allocated outside every ``scopes`` entry
            and freed inside one of these belongs to it (what a tensor was is sometimes only
            known where it dies: autograd's gradients are made by whichever op computes them).
    """

    def __init__(
        self, device_type: str = "cpu", scopes: tuple[str, ...] = (), free_scopes: tuple[str, ...] = ()
    ) -> None:
        self.device_type = device_type
        self._scopes = scopes
        self._free_scopes = free_scopes
        activities = [ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, profile_memory=True)
        self._blocks: list[_Block] = []
        self._regions: list[_Region] = []

    def __enter__(self) -> AllocationTracker:
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._profiler.__exit__(*exc)
        self._read_events()

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Mark a named span of time (regions may nest; names should be unique)."""
        with record_function(_REGION_PREFIX + name):
            yield

    # -- reading the profile ------------------------------------------------------------

    def _read_events(self) -> None:
        events: list[_Event] = []
        regions: list[_Region] = []
        profiler = self._profiler.profiler
        assert profiler is not None and profiler.kineto_results is not None  # read after the profile ended
        stack = list(profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                assert isinstance(fields, _ExtraFields_Allocation)  # what the Allocation tag carries
                if fields.device.type == self.device_type and fields.alloc_size != 0:
                    scope = _scope(node, self._scopes if fields.alloc_size > 0 else self._free_scopes)
                    events.append(
                        _Event(
                            node.start_time_ns,
                            fields.ptr,
                            fields.alloc_size,
                            node.start_tid,
                            _collective_end(node),
                            scope,
                        )
                    )
            elif node.name.startswith(_REGION_PREFIX):
                regions.append(_Region(node.name[len(_REGION_PREFIX) :], node.start_time_ns, node.end_time_ns))
        events.sort(key=lambda e: e.time_ns)  # stable: ties keep the tree's order
        self._blocks = _pair(events)
        self._regions = sorted(regions, key=lambda r: r.start_ns)

    def _replay(self) -> Iterator[tuple[int, int, set[int]]]:
        """Yield (time in ns, live bytes, indices of live blocks) after each allocation or free."""
        deltas = [(b.alloc_ns, 1, i) for i, b in enumerate(self._blocks)]
        deltas += [(b.free_ns, 0, i) for i, b in enumerate(self._blocks) if b.free_ns is not None]
        deltas.sort()  # at one timestamp, frees (0) before allocations (1)
        live: set[int] = set()
        total = 0
        for time_ns, is_alloc, index in deltas:
            if is_alloc:
                live.add(index)
                total += self._blocks[index].nbytes
            else:
                live.discard(index)
                total -= self._blocks[index].nbytes
            yield time_ns, total, live

    # -- results ------------------------------------------------------------------------

    @property
    def peak_bytes(self) -> int:
        """The most live bytes at any moment while the tracker ran."""
        return max((total for _, total, _ in self._replay()), default=0)

    def region_names(self) -> list[str]:
        """The regions marked, in the order they began."""
        return [r.name for r in self._regions]

    def region_memory(self, name: str) -> RegionMemory:
        """Live bytes at the start, peak and end of the (first) region called ``name``."""
        region = next((r for r in self._regions if r.name == name), None)
        if region is None:
            raise KeyError(f"no region {name!r}; marked: {self.region_names()}")
        start = end = peak = 0
        peak_step = -1  # how many replay steps lead to the peak moment (-1: none)
        for step, (time_ns, total, _) in enumerate(self._replay()):
            if time_ns < region.start_ns:
                start = end = peak = total
                peak_step = step
            elif time_ns <= region.end_ns:
                end = total
                if total > peak:
                    peak, peak_step = total, step
            else:
                break
        return RegionMemory(
            name, start, peak, end, self._live_after(peak_step, lambda block: self._owner(block.alloc_ns))
        )

    def peak_by_scope(self) -> tuple[int, dict[str | None, int]]:
        """The most live bytes at any moment, and those bytes by scope prefix (None: no scope)."""
        peak, peak_step = 0, -1
        for step, (_, total, _) in enumerate(self._replay()):
            if total > peak:
                peak, peak_step = total, step
        return peak, self._live_after(peak_step, lambda block: block.scope)

    def _live_after(self, last_step: int, key: Callable[[_Block], Any]) -> dict[Any, int]:
        """Live bytes after replay step ``last_step``, grouped by ``key(block)``."""
        groups: dict[Any, int] = {}
        for step, (_, _, live) in enumerate(self._replay()):
            if step == last_step:
                for index in live:
                    block = self._blocks[index]
                    groups[key(block)] = groups.get(key(block), 0) + block.nbytes
                break
        return groups

    def _owner(self, time_ns: int) -> str:
        """The innermost region open at ``time_ns`` (the one that began last), else ``BEFORE``."""
        owner = BEFORE
        for region in self._regions:
            if region.start_ns > time_ns:
                break
            if time_ns <= region.end_ns:
                owner = region.name
        return owner


def _collective_end(node: Any) -> int | None:
    """For an allocation inside a collective op: when that op ends (ns); else None."""
    parent = node.parent
    while parent is not None:
        if parent.name.startswith(_COLLECTIVE_PREFIXES):
            return parent.end_time_ns
        parent = parent.parent
    return None


def _scope(node: Any, prefixes: tuple[str, ...]) -> str | None:
    """The prefix of the innermost enclosing scope of ``node`` that matches one, else None."""
    parent = node.parent
    while parent is not None and prefixes:
        for prefix in prefixes:
            if parent.name.startswith(prefix):
                return prefix
        parent = parent.parent
    return None


def _lost_free_deadlines(events: list[_Event]) -> list[int | None]:
    """Per event: for a collective's temporary, the first event time of its thread after the op."""
    times_by_thread: dict[int, list[int]] = {}
    for e in events:
        times_by_thread.setdefault(e.tid, []).append(e.time_ns)
    deadlines: list[int | None] = []
    for e in events:
        if e.collective_end_ns is None:
            deadlines.append(None)
            continue
        times = times_by_thread[e.tid]
        later = bisect.bisect_right(times, e.collective_end_ns)
        deadlines.append(times[later] if later < len(times) else e.collective_end_ns)
    return deadlines


def _pair(events: list[_Event]) -> list[_Block]:
    """Match each free to the open allocation at its address; close the ones never freed.

    ``events`` are in time order. A collective's temporary whose free never shows is closed
    at its deadline (see the module docstring), another block at the next allocation of its
    address; the rest stay live.
    """
    blocks: list[_Block] = []
    open_at: dict[int, tuple[int, int, int | None, str | None]] = {}  # address -> (bytes, alloc ns, deadline, scope)
    for e, deadline in zip(events, _lost_free_deadlines(events)):
        if e.nbytes < 0:
            if e.ptr in open_at:  # else: allocated before the tracker started
                size, alloc_ns, _, scope = open_at.pop(e.ptr)
                blocks.append(_Block(size, alloc_ns, e.time_ns, scope if scope is not None else e.scope))
            continue
        if e.ptr in open_at:  # the address is handed out again: its old block's free went unreported
            size, alloc_ns, lost_deadline, scope = open_at.pop(e.ptr)
            blocks.append(
                _Block(size, alloc_ns, e.time_ns if lost_deadline is None else min(e.time_ns, lost_deadline), scope)
            )
        open_at[e.ptr] = (e.nbytes, e.time_ns, deadline, e.scope)
    blocks += [_Block(size, alloc_ns, deadline, scope) for size, alloc_ns, deadline, scope in open_at.values()]
    return blocks
