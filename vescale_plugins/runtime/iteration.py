"""What the units under one root share for the iteration in progress, below the units.

FSDP2 keeps the same below its ``FSDPParamGroup``: an ``FSDPCommContext`` (the reduce-scatter
states in flight, the post-forward order the prefetch reads) shared by the units of one
root. Here :class:`IterationContext` holds the orders in which this forward ran and finished
the units, the reductions in flight, and what a backward's end needs counted; its methods
wait for reductions and attach gradients. It never calls a unit: the units read the orders
(their peers) and append to them. Two things only the end-of-backward driver above the units
(:class:`~vescale_plugins.runtime.state.RootState`) does, and this context asks for them
through the callbacks that driver gives it: start a backward (queue its end) and end one
whose end compiled autograd does not call back for.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch
from torch.autograd import Variable

from vescale_plugins.dbuffer import DBuffer
from vescale_plugins.dbuffer.faults import CollectiveError
from vescale_plugins.dbuffer.handles import ReduceScatterHandle
from vescale_plugins.runtime.dynamo import eager_hook

if TYPE_CHECKING:
    from vescale_plugins.runtime.param import FSDPParam

__all__ = ["IterationContext", "TrainingState", "in_compiled_autograd"]


def in_compiled_autograd() -> bool:
    """Whether the backward running now is compiled autograd's graph (a hook called from it;
    asked at each hook of a backward, here beside the counting it decides).

    Compiled autograd drops the callbacks an eager hook queues with ``queue_callback``
    (only those Dynamo traces with ``fullgraph=True`` run), so the end of such a backward is
    found otherwise (:meth:`RootState.end_after_counted_events`). Dynamo is not imported to
    ask: without it no compiled autograd runs.
    """
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is not None and bool(compiled_autograd.in_compiled_autograd_region)


class TrainingState(enum.Enum):
    """Where a unit is in the current iteration (FSDP2's ``TrainingState``)."""

    IDLE = enum.auto()  # nothing pending: no forward with grad since the last backward
    FORWARD = enum.auto()  # ran forward with grad: its backward is expected
    PRE_BACKWARD = enum.auto()  # its backward started, gradients not reduced yet
    POST_BACKWARD = enum.auto()  # its gradients were reduced (until the backward ends)


class _Unit(Protocol):
    @property
    def dbuffers(self) -> list[DBuffer]: ...


U = TypeVar("U", bound=_Unit)


class IterationContext(Generic[U]):
    """Shared by ``root`` and every unit under it (``groups``, outermost first, the root first).

    ``on_backward_start`` is called at the first pre-backward hook of a backward (the driver
    queues the end of backward there); ``on_backward_end`` after the last counted gradient
    event under compiled autograd (see :meth:`count_backward_event`).
    """

    def __init__(
        self,
        root: U,
        groups: list[U],
        *,
        on_backward_start: Callable[[], None],
        on_backward_end: Callable[[], None],
    ) -> None:
        self.root = root
        self.groups = groups
        self.on_backward_start, self.on_backward_end = on_backward_start, on_backward_end
        self.forward_order: list[U] = []  # units in the order this forward ran them
        self.previous_forward_order: list[U] = []
        # Units in the order this forward finished them (a unit's forward ends after those of
        # the units inside it): backward runs in its reverse, so it orders the prefetch.
        self.post_forward_order: list[U] = []
        self.reduces_in_flight: list[list[ReduceScatterHandle]] = []  # per unit, oldest first
        # Reduce-scatters done whose all-reduce (HSDP) or hook is still in flight: waited for
        # at the end of backward, where FSDP2 waits for its post-reduce events.
        self.reduces_landing: list[ReduceScatterHandle] = []
        # Parameters reduced this backward without a local gradient, with the sharded
        # gradient buffer that holds what other ranks sent them (see attach_remote_gradients).
        self.reduced_without_local_grad: list[tuple[FSDPParam, torch.Tensor]] = []
        self.callback_queued = False  # the end of this backward is queued (or counted)
        self.finish_queued = False  # finish_reductions_after_this_backward's callback
        # Under compiled autograd (which drops the final callback): the gradient events (a
        # parameter's gradient accumulated, a unit's _PostBackward run) seen since the last
        # backward ended, and how many more end the one in progress (None: not counting).
        self.backward_events = 0
        self.events_to_end: int | None = None
        # FSDP2 2.15's manual finalization: the root's mode, fixed when a backward starts
        # (None between iterations), and whether finalize_backward(async_op=True)'s handle
        # is still to be waited for.
        self.manual_active: bool | None = None
        self.reduction_pending: object | None = None

    # -- forward ----------------------------------------------------------------------

    def start_forward(self) -> None:
        """(At the root's pre-forward) The last forward's order becomes the prefetch order."""
        self.backward_events = 0  # any backward since the last one that ended ran no unit
        if self.forward_order:
            self.previous_forward_order, self.forward_order = self.forward_order, []
            self.post_forward_order = []

    # -- backward ---------------------------------------------------------------------

    def backward_starts(self) -> None:
        """(Each unit's pre-backward hook) The first one of a backward starts it."""
        if not self.callback_queued:
            self.callback_queued = True
            self.on_backward_start()

    def count_backward_event(self) -> None:
        """A managed parameter's gradient accumulated or a unit's ``_PostBackward`` ran: under
        compiled autograd, the last one this backward will run ends it."""
        self.backward_events += 1
        if self.events_to_end is not None:
            self.events_to_end -= 1
            if self.events_to_end == 0:
                self.on_backward_end()

    # -- reductions -------------------------------------------------------------------

    def wait_for_reduces(self, keep: int = 0) -> None:
        """Complete the oldest units' reduce-scatters until ``keep`` units' remain in flight,
        freeing their gradient buffers (what follows a reduce-scatter stays in flight). If
        one fails, every reduction in flight is dropped before its error rises."""
        try:
            while len(self.reduces_in_flight) > keep:
                for handle in self.reduces_in_flight[0]:
                    handle.wait_reduce_scatter()
                    if not handle.done:
                        self.reduces_landing.append(handle)
                self.reduces_in_flight.pop(0)
        except CollectiveError:
            self.abandon_reductions()
            raise

    def wait_for_host_reduces(self, keep: int = 0) -> None:
        """``wait_for_reduces`` where every reduce-scatter in flight is a host collective
        (no side stream to overlap with: waiting early costs no overlap on the device)."""
        if all(handle.on_host for handles in self.reduces_in_flight for handle in handles):
            self.wait_for_reduces(keep)

    def wait_for_gradients(self) -> None:
        """Complete every reduction in flight: the sharded gradients are final."""
        self.wait_for_reduces()
        try:
            for handle in self.reduces_landing:
                handle.wait()
        except CollectiveError:
            self.abandon_reductions()
            raise
        self.reduces_landing = []

    def abandon_reductions(self, also: Iterable[ReduceScatterHandle] = ()) -> None:
        """(A collective failed: a peer died) Drop every reduction in flight, and ``also``,
        without waiting: none lands, and the gradients attached to their buffers are
        forgotten (the handles' ``on_abandon``), so no half-reduced gradient is left."""
        for handle in [*self.in_flight(), *also]:
            handle.abandon()
        self.reduces_in_flight, self.reduces_landing = [], []
        self.reduced_without_local_grad = []

    def finish_reductions(self) -> None:
        """Complete every reduction in flight (and, under CPU offload, the gradients' copies to
        host, as FSDP2) and attach the gradients only other ranks' data reached: every
        sharded gradient is final."""
        self.wait_for_gradients()
        for group in self.groups:
            for dbuffer in group.dbuffers:
                dbuffer.wait_for_offloaded_grads()
        if self.reduced_without_local_grad:
            self.attach_remote_gradients()

    def finish_reductions_after_this_backward(self) -> None:
        """(A unit reduced in a backward no pre-backward hook saw: a grouped unit's partial
        forward, a head called per chunk) Make its gradients final when this backward ends,
        as the final callback does for the model's backward; the units' states are left as
        they are, since the model's own backward may still come."""
        if self.finish_queued:
            return
        self.finish_queued = True
        Variable._execution_engine.queue_callback(self._finish_partial_backward)

    @eager_hook
    def _finish_partial_backward(self) -> None:
        self.finish_queued = False
        self.finish_reductions()

    def attach_remote_gradients(self) -> None:
        """(Once every reduce-scatter of the backward is done) Give a gradient to each
        parameter this rank's data never reached but another rank's did.

        With data-dependent routing (mixture-of-experts layers, conditional branches) a
        parameter can get gradients on some ranks only. Its reduce-scatter already carried the
        other ranks' contributions and a presence flag per parameter (see DBuffer): a
        parameter some rank had a gradient for gets the reduced gradient on every rank (so
        every shard steps), one no rank's data reached keeps ``grad=None`` on every rank (so
        optimizers skip it everywhere), as under DDP. Whether a gradient is None is decided
        on the host (optimizers skip on it), so ranks that lacked some gradient read the
        flags back: in one read per backward for every unit (:func:`_read_flags`), after
        the compute stream has waited for every reduction anyway. Ranks that had every
        gradient read nothing (FSDP2 reads nothing either, and has no such flags).
        """
        pending, self.reduced_without_local_grad = self.reduced_without_local_grad, []
        by_buffer: dict[int, tuple[list[FSDPParam], torch.Tensor]] = {}
        for fsdp_param, sharded_grad in pending:
            members, _ = by_buffer.setdefault(id(fsdp_param.buffer), ([], sharded_grad))
            members.append(fsdp_param)
        groups = list(by_buffer.values())
        flags = [members[0].dbuffer.received_gradient(grad, [p.slot for p in members]) for members, grad in groups]
        for (members, _), received in zip(groups, _read_flags(flags)):
            attached = [p for p, got in zip(members, received) if got and p.sharded.grad is None]
            for fsdp_param in attached:
                fsdp_param.attach_sharded_grad()
            for fsdp_param in attached:
                fsdp_param.run_post_accumulate_grad_hooks()

    def in_flight(self) -> Iterable[ReduceScatterHandle]:
        """Every reduction handle not yet waited for to the end."""
        return [h for handles in self.reduces_in_flight for h in handles] + self.reduces_landing


def _read_flags(flags: list[torch.Tensor]) -> list[list[bool]]:
    """Each boolean vector as a list, in one host read per device holding any of them (one
    on a GPU run; host-offloaded gradients' flags are read where they are)."""
    by_device: dict[torch.device, list[int]] = {}
    for position, vector in enumerate(flags):
        by_device.setdefault(vector.device, []).append(position)
    read: list[list[bool]] = [[] for _ in flags]
    for positions in by_device.values():
        values = torch.cat([flags[p] for p in positions]).tolist()
        start = 0
        for p in positions:
            read[p] = values[start : start + flags[p].numel()]
            start += flags[p].numel()
    return read
