"""The run record: what a sharded run did, so a user can trust it.

``with record_run(model, optimizer) as record: ...train...`` collects, for every all-gather
and reduce-scatter, its unit, bytes, start and end, and how much of it was hidden behind
compute; the memory of each kind of buffer over time; and a static view of the sharding and
precision. ``record.to_dict()`` is JSON-ready and ``record.summary()`` is for people.

The record is the buffers' observer (:mod:`vescale_plugins.dbuffer.observer`) while open; off,
it costs one module-level lookup per collective: nothing is timed or stored. Open, it also runs a memory-profiling ``torch.profiler``
session (unless another profiler is already running) to split the peak of live tensor bytes
by what they were: this slows the recorded steps down, which is why it is a record and not a
default.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from vescale_plugins.dbuffer import observer
from vescale_plugins.planner import Layout
from vescale_plugins.runtime.state import groups_under

__all__ = ["RunRecord", "record_run", "CollectiveEvent", "unit_sharding_figures", "zero_stage_bytes_per_parameter"]


@dataclass
class CollectiveEvent:
    """One collective. Times in seconds since the record opened; ``exposed_s`` is the part the
    training thread (on CUDA: the compute stream) spent waiting for it (the rest overlapped
    with compute). On CUDA the times are timing events on the stream the collective ran on."""

    kind: str
    unit: str
    bytes: int
    dtype: str
    start_s: float
    end_s: float = math.nan
    exposed_s: float = math.nan
    step: int = 0

    @property
    def overlap_ratio(self) -> float:
        duration = self.end_s - self.start_s
        return 0.0 if duration <= 0 else max(0.0, 1.0 - self.exposed_s / duration)


class _HostClock:
    """Seconds on the host since the record opened: off CUDA a collective runs on the calling
    thread or the backend's, so it ends when its wait returns."""

    on_device = False

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter() - self._t0

    def seconds(self, mark: float) -> float:
        return mark


class _DeviceClock:
    """Timing events on the current stream of a CUDA device (``module``: ``torch.cuda``):
    where the work runs, not when the host enqueued it. Read when the record is reported,
    so recording costs no host sync."""

    on_device = True

    def __init__(self, module: Any) -> None:
        self._module = module
        self._t0 = self.mark()

    def mark(self) -> Any:
        event = self._module.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: Any) -> float:
        mark.synchronize()
        return self._t0.elapsed_time(mark) / 1e3


def _device_timing_module(device_type: str) -> Any:
    """The stream API whose events time work on ``device_type``, or None (the host clock)."""
    return torch.cuda if device_type == "cuda" else None


@dataclass
class _CollectiveMarks:
    """One collective's clock marks: issued and (on a device) enqueued on its stream; where
    the caller stood when it started waiting; ended (host: when the wait returned)."""

    issued: Any
    ended: Any = None
    wait_started: Any = None
    done: bool = False


@dataclass
class _MemoryKinds:
    """Bytes of live library buffers by kind, and the peak of their sum (with its split)."""

    live: dict[str, int] = field(
        default_factory=lambda: {"unsharded_params": 0, "unsharded_grads": 0, "comm_buffers": 0}
    )
    peak: dict[str, int] = field(
        default_factory=lambda: {"unsharded_params": 0, "unsharded_grads": 0, "comm_buffers": 0}
    )
    at_peak_total: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.live[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.live[kind])
        if sum(self.live.values()) > sum(self.at_peak_total.values() or [0]):
            self.at_peak_total = dict(self.live)


# Profiler scopes whose allocations the peak split tells apart (innermost wins), and their kind.
_MEMORY_SCOPES = {
    "c10d::": "comm_buffers",  # the collective backend's own staging (gloo copies through them)
    "gloo:": "comm_buffers",
    "vescale::comm_buffer": "comm_buffers",  # mixed-precision casts around the collectives
    "vescale::all_gather": "unsharded_params",
    "vescale::gradient_buffer": "unsharded_grads",
    "vescale::reduce_scatter": "sharded_grads",
}
# Scopes that tell blocks apart by where they were freed (when no scope above made them).
_FREE_SCOPES = {"vescale::gradient_release": "unsharded_grads"}  # autograd's gradients
PEAK_KINDS = (
    "sharded_state",
    "unsharded_params",
    "unsharded_grads",
    "sharded_grads",
    "comm_buffers",
    "activations_and_temporaries",
)


class RunRecord:
    """Collects collectives and buffer memory while open; see :func:`record_run`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.events: list[CollectiveEvent] = []
        self.memory = _MemoryKinds()
        self.step = 0
        module = _device_timing_module(self._device_type())
        self._clock: _HostClock | _DeviceClock = _HostClock() if module is None else _DeviceClock(module)
        self._marks: dict[int, _CollectiveMarks] = {}  # by id of the event, until resolved
        self._step_marks = [self._clock.mark()]  # the record's open, then each mark_step
        # The split of the peak of all live tensor bytes, filled in when the record closes.
        self.peak: dict[str, Any] | None = None
        self.peak_unavailable = "the record is still open"

    # -- called by the runtime (only while open) --------------------------------------

    def now(self) -> Any:
        return self._clock.mark()

    def collective_issued(self, kind: str, unit: str, nbytes: int, dtype: torch.dtype) -> CollectiveEvent:
        event = CollectiveEvent(kind, unit, nbytes, str(dtype).removeprefix("torch."), math.nan, step=self.step)
        self.events.append(event)
        self._marks[id(event)] = _CollectiveMarks(self._clock.mark())
        return event

    def collective_enqueued(self, event: CollectiveEvent) -> None:
        if self._clock.on_device:  # an event after the collective on its stream
            self._marks[id(event)].ended = self._clock.mark()

    def collective_done(self, event: CollectiveEvent, wait_started: Any) -> None:
        marks = self._marks[id(event)]
        marks.wait_started = marks.issued if wait_started is None else wait_started
        if not self._clock.on_device:
            marks.ended = self._clock.mark()
        marks.done = True

    def _resolve_times(self) -> None:
        """Fill in the times of the collectives done (on a device, waiting for their events)."""
        seconds = self._clock.seconds
        for event in self.events:
            marks = self._marks.get(id(event))
            if marks is None or not marks.done:
                continue
            event.start_s, event.end_s = seconds(marks.issued), seconds(marks.ended)
            # On a device the compute stream may reach the wait after the collective ended.
            event.exposed_s = max(0.0, event.end_s - seconds(marks.wait_started))
            del self._marks[id(event)]

    def buffer_allocated(self, kind: str, nbytes: int) -> None:
        self.memory.add(kind, nbytes)

    def buffer_freed(self, kind: str, nbytes: int) -> None:
        self.memory.live[kind] -= nbytes

    def mark_step(self) -> None:
        """Call once per optimizer step so events are grouped by step (and steps timed)."""
        self.step += 1
        self._step_marks.append(self._clock.mark())

    def step_seconds(self) -> list[float]:
        """Each step's duration: from the previous ``mark_step`` (or the record's open), on
        the host clock, or between events on the compute stream on CUDA."""
        times = [self._clock.seconds(mark) for mark in self._step_marks]
        return [end - start for start, end in zip(times, times[1:])]

    # -- the record ---------------------------------------------------------------------

    def _units(self) -> list[Any]:
        return groups_under([self.model])

    def sharding(self) -> dict[str, Any]:
        units = self._units()
        group = units[0].group if units else None
        rows = []
        for unit in units:
            names = [_module_name(self.model, m) for m in unit.modules]
            figures = unit_sharding_figures([(b.layout, _itemsize(b.param_dtype)) for b in unit.dbuffers])
            # Which parameters each buffer (one all-gather and one reduce-scatter) holds: a
            # (dtype, requires_grad) group gets several when the planner's split pays.
            members = [[p.fqn for p in b.params] for b in unit.buffers]
            # Ranks each buffer is sharded over: more than one size where shard_placement_fn
            # put parameters on their own mesh (experts over the expert-data-parallel ranks).
            group_sizes = [dist.get_world_size(b.group) for b in unit.dbuffers]
            rows.append({"modules": names, **figures, "buffer_parameters": members, "buffer_group_sizes": group_sizes})
        return {
            "backend": dist.get_backend(group) if group is not None else None,
            "group_size": dist.get_world_size(group) if group is not None else 1,
            "group_ranks": dist.get_process_group_ranks(group) if group is not None else [0],
            "units": rows,
        }

    def precision(self) -> dict[str, Any]:
        units = self._units()
        buffers = [b for u in units for b in u.dbuffers]
        state_dtypes = sorted(
            {
                str(v.dtype).removeprefix("torch.")
                for s in (self.optimizer.state.values() if self.optimizer else [])
                for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            }
        )

        def names(dtypes):
            return sorted({str(d).removeprefix("torch.") for d in dtypes})

        return {
            "sharded_parameters": names(b.dtype for b in buffers),
            "all_gather": names(b.param_dtype for b in buffers),
            "gradients": names(b.param_dtype for b in buffers),
            "reduce_scatter": names(b.reduce_dtype for b in buffers),
            "sharded_gradients": names(b.dtype for b in buffers),
            "optimizer_state": state_dtypes,
        }

    def sharded_state_bytes(self) -> dict[str, int]:
        buffers = [b for u in self._units() for b in u.dbuffers]
        optimizer_bytes = 0
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value):
                        local = getattr(value, "_local_tensor", value)
                        optimizer_bytes += local.numel() * local.element_size()
        return {
            "parameters": sum(b.sharded.numel() * b.sharded.element_size() for b in buffers),
            "gradients": sum(b.shard_size * _itemsize(b.dtype) for b in buffers if b.sharded_grad is not None),
            "optimizer_state": optimizer_bytes,
        }

    def communication(self) -> dict[str, Any]:
        self._resolve_times()
        done = [e for e in self.events if not math.isnan(e.end_s)]
        steps = max(1, len({e.step for e in done}))
        by_kind = {}
        for kind in ("all_gather", "reduce_scatter"):
            mine = [e for e in done if e.kind == kind]
            busy = sum(e.end_s - e.start_s for e in mine)
            hidden = sum((e.end_s - e.start_s) - e.exposed_s for e in mine)
            by_kind[kind] = {
                "count": len(mine),
                "count_per_step": len(mine) / steps,
                "bytes_per_step": sum(e.bytes for e in mine) / steps,
                "seconds": busy,
                "overlap_ratio": hidden / busy if busy > 0 else 0.0,
            }
        return {"summary": by_kind, "events": [asdict(e) | {"overlap_ratio": e.overlap_ratio} for e in done]}

    def zero_stages(self) -> dict[str, Any]:
        """Bytes per parameter by ZeRO stage at this group size, with bf16 compute and fp32
        Adam (2 weight + 2 grad + 4 master + 8 moments = 16), against what was measured."""
        sharding = self.sharding()
        n = max(1, sharding["group_size"])
        model = zero_stage_bytes_per_parameter(n)
        params = sum(r["parameters"] for r in sharding["units"])
        measured = sum(self.sharded_state_bytes().values()) / max(params, 1)
        return {"group_size": n, "model_bytes_per_parameter": model, "measured_sharded_bytes_per_parameter": measured}

    def _device_type(self) -> str:
        buffers = [b for u in self._units() for b in u.dbuffers]
        return buffers[0].device.type if buffers else "cpu"

    def _start_peak_tracking(self) -> Any:
        """A memory-profiling tracker over the record, or None (with the reason kept)."""
        if torch.autograd.profiler._is_profiler_enabled:
            self.peak_unavailable = "another torch.profiler session was running"
            return None
        from vescale_plugins.observe.allocations import AllocationTracker

        state = self.sharded_state_bytes()
        # Tensors made before the record opened are invisible to the tracker: count the sharded
        # parameters and optimizer state that existed then (gradients are remade each step).
        self._state_at_open = state["parameters"] + state["optimizer_state"]
        tracker = AllocationTracker(self._device_type(), scopes=tuple(_MEMORY_SCOPES), free_scopes=tuple(_FREE_SCOPES))
        tracker.__enter__()
        return tracker

    def _finish_peak_tracking(self, tracker: Any) -> None:
        tracker.__exit__(None, None, None)
        tracked, by_scope = tracker.peak_by_scope()
        split = dict.fromkeys(PEAK_KINDS, 0)
        split["sharded_state"] = self._state_at_open
        kinds = {**_MEMORY_SCOPES, **_FREE_SCOPES}
        for scope, nbytes in by_scope.items():
            split[kinds.get(scope, "activations_and_temporaries")] += nbytes
        self.peak = {"total_bytes": self._state_at_open + tracked, "split": split}

    def to_dict(self) -> dict[str, Any]:
        return {
            "sharding": self.sharding(),
            "precision": self.precision(),
            "memory": {
                "sharded_state_bytes": self.sharded_state_bytes(),
                "peak_bytes_by_kind": dict(self.memory.peak),
                "split_at_peak_of_library_buffers": dict(self.memory.at_peak_total),
                # The peak of all live tensor bytes (allocator events) and what they were then.
                "peak": self.peak if self.peak is not None else {"unavailable": self.peak_unavailable},
            },
            "communication": self.communication(),
            "steps": {"clock": "cuda_events" if self._clock.on_device else "host", "seconds": self.step_seconds()},
            "zero_stages": self.zero_stages(),
        }

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def summary(self) -> str:
        d = self.to_dict()
        s, c, m = d["sharding"], d["communication"]["summary"], d["memory"]
        lines = [f"veScale-FSDP run record: {s['backend']} group of {s['group_size']} ranks {s['group_ranks']}"]
        for u in s["units"]:
            lines.append(
                f"  unit {', '.join(u['modules']) or '<root>'}: {u['parameters']:,} params, largest unsharded "
                f"{_mib(u['largest_unsharded_bytes'])}, padding {u['padding_ratio']:.2%}, {u['buffers']} buffer(s)"
                + (f" over groups of {u['buffer_group_sizes']} ranks" if len(set(u["buffer_group_sizes"])) > 1 else "")
            )
        p = d["precision"]
        lines.append(
            f"  precision: params {p['sharded_parameters']}, all-gather {p['all_gather']}, grads {p['gradients']}, reduce-scatter {p['reduce_scatter']}, optimizer {p['optimizer_state']}"
        )
        st = m["sharded_state_bytes"]
        lines.append(
            f"  sharded state per rank: params {_mib(st['parameters'])}, grads {_mib(st['gradients'])}, optimizer {_mib(st['optimizer_state'])}"
        )
        pk = m["peak_bytes_by_kind"]
        lines.append(
            f"  peak library buffers: unsharded params {_mib(pk['unsharded_params'])}, unsharded grads {_mib(pk['unsharded_grads'])}, comm {_mib(pk['comm_buffers'])}"
        )
        if "split" in m["peak"]:
            split = ", ".join(f"{kind.replace('_', ' ')} {_mib(nbytes)}" for kind, nbytes in m["peak"]["split"].items())
            lines.append(f"  peak memory {_mib(m['peak']['total_bytes'])}: {split}")
        else:
            lines.append(f"  peak memory: not measured ({m['peak']['unavailable']})")
        for kind, v in c.items():
            lines.append(
                f"  {kind}: {v['count_per_step']:.1f}/step, {_mib(v['bytes_per_step'])}/step, {v['seconds'] * 1e3:.1f} ms total, {v['overlap_ratio']:.0%} overlapped"
            )
        z = d["zero_stages"]
        model = ", ".join(f"{k} {v:.2f}" for k, v in z["model_bytes_per_parameter"].items())
        lines.append(
            f"  bytes/param (16-byte model, W={z['group_size']}): {model}; measured sharded state {z['measured_sharded_bytes_per_parameter']:.2f}"
        )
        return "\n".join(lines)


def unit_sharding_figures(buffers: Sequence[tuple[Layout, int]]) -> dict[str, Any]:
    """One unit's sharding figures from its buffers' layouts, as the record reports them.

    ``buffers``: ``(layout, unsharded_itemsize)`` per DBuffer, the itemsize (bytes) of the
    all-gathered parameters. Returns parameters and padding (elements), the largest
    unsharded buffer (bytes), padding over parameters, each buffer's shard (elements per
    rank) and the buffer count. The forecast calls this on planned layouts.
    """
    params = sum(sum(layout.numels) for layout, _ in buffers)
    padding = sum(layout.padding for layout, _ in buffers)
    return {
        "parameters": params,
        "largest_unsharded_bytes": max((layout.buffer_size * itemsize for layout, itemsize in buffers), default=0),
        "padding_elements": padding,
        "padding_ratio": padding / max(params, 1),
        "shard_elements_per_rank": [layout.shard_size for layout, _ in buffers],
        "buffers": len(buffers),
    }


def zero_stage_bytes_per_parameter(group_size: int) -> dict[str, float]:
    """Sharded-state bytes per parameter by ZeRO stage for a group of ``group_size`` ranks,
    bf16 compute with fp32 AdamW: 2 weight + 2 grad + 4 master + 8 moments = 16 bytes
    (the seed lesson's model; weights, grads and optimizer state sharded from stage 3, 2, 1)."""
    n = group_size
    return {"DDP": 16.0, "ZeRO-1": 4 + 12 / n, "ZeRO-2": 2 + 14 / n, "ZeRO-3 / FSDP": 16 / n}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _module_name(root: nn.Module, target: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is target:
            return name
    return type(target).__name__


@contextmanager
def record_run(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[RunRecord]:
    """Record what ``model``'s veScale-FSDP units do inside the block (one record at a time)."""
    if observer.current() is not None:
        raise RuntimeError("a run record is already open; close it before opening another")
    record = RunRecord(model, optimizer)
    tracker = record._start_peak_tracking()
    try:
        with observer.observed_by(record):
            yield record
    finally:
        if tracker is not None:
            record._finish_peak_tracking(tracker)
