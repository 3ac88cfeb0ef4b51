"""State shared by the units under one root (FSDP2 keeps it on the root's ``FSDPState``).

The first unit to run forward becomes the root of every unit below its modules. The root's
state orders the gathers (the previous forward's order drives the prefetch), holds the
reduce-scatters in flight, and closes each backward in one autograd callback: the last
reduce-scatters are waited for, parameters only other ranks' data reached get their
gradients, and units reshard.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge

from vescale_plugins.dbuffer.handles import ReduceScatterHandle
from vescale_plugins.runtime.dynamo import eager_hook

if TYPE_CHECKING:
    from vescale_plugins.runtime.param import FSDPParam
    from vescale_plugins.runtime.param_group import FSDPParamGroup

__all__ = ["RootState", "TrainingState", "groups_under"]


class TrainingState(enum.Enum):
    """Where a unit is in the current iteration (FSDP2's ``TrainingState``)."""

    IDLE = enum.auto()  # nothing pending: no forward with grad since the last backward
    FORWARD = enum.auto()  # ran forward with grad: its backward is expected
    PRE_BACKWARD = enum.auto()  # its backward started, gradients not reduced yet
    POST_BACKWARD = enum.auto()  # its gradients were reduced (until the backward ends)


def groups_under(modules: Iterable[nn.Module]) -> list[FSDPParamGroup]:
    """Every unit whose modules are among ``modules`` or below them, outermost first."""
    groups: list[FSDPParamGroup] = []
    for module in modules:
        for sub in module.modules():
            group = getattr(sub, "_vescale_fsdp_unit", None)
            if group is not None and group not in groups:
                groups.append(group)
    return groups


class RootState:
    """What the units under ``root`` share for the iteration in progress."""

    def __init__(self, root: FSDPParamGroup, groups: list[FSDPParamGroup]) -> None:
        self.root = root
        self.groups = groups  # every unit under the root, outermost first (the root first)
        self.forward_order: list[FSDPParamGroup] = []  # units in the order this forward ran them
        self.previous_forward_order: list[FSDPParamGroup] = []
        # Units in the order this forward finished them (a unit's forward ends after those of
        # the units inside it): backward runs in its reverse, so it orders the prefetch.
        self.post_forward_order: list[FSDPParamGroup] = []
        self.reduces_in_flight: list[list[ReduceScatterHandle]] = []  # per unit, oldest first
        # Reduce-scatters done whose all-reduce (HSDP) or hook is still in flight: waited for
        # at the end of backward, where FSDP2 waits for its post-reduce events.
        self.reduces_landing: list[ReduceScatterHandle] = []
        # Parameters reduced this backward without a local gradient, with the sharded
        # gradient buffer that holds what other ranks sent them (see _attach_remote_gradients).
        self.reduced_without_local_grad: list[tuple[FSDPParam, torch.Tensor]] = []
        self.callback_queued = False
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

    @staticmethod
    def init_under(root: FSDPParamGroup) -> None:
        """Make ``root`` (the first unit to run forward) the root of every unit below its
        modules that has none yet; label their buffers with their module names."""
        found = groups_under(root.modules)
        if any(g is not root and g.manual_backward_finalization and g.root_state is None for g in found):
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        names = {id(p): name for module in root.modules for name, p in module.named_parameters()}
        for group in found:
            if group.root_state is None or group.root_state.root is root:
                group.check_materialized(names)
        groups = [g for g in found if g.root_state is None or g.root_state.root is root]
        state = RootState(root, groups)
        for group in groups:
            group.root_state = state
        for root_module in root.modules:
            for name, module in root_module.named_modules():
                unit = getattr(module, "_vescale_fsdp_unit", None)
                if unit in groups and module is unit.modules[0]:
                    for dbuffer in unit.dbuffers:
                        dbuffer.label = name or "<root>"

    # -- forward ----------------------------------------------------------------------

    def start_forward(self) -> None:
        """(At the root's pre-forward) The last forward's order becomes the prefetch order."""
        self.backward_events = 0  # any backward since the last one that ended ran no unit
        if self.forward_order:
            self.previous_forward_order, self.forward_order = self.forward_order, []
            self.post_forward_order = []

    def forward_prefetch_targets(self, group: FSDPParamGroup) -> list[FSDPParamGroup]:
        """The units set by ``set_modules_to_forward_prefetch``, else the unit that ran next
        in the previous training forward.

        On CUDA, FSDP2 overlaps the next all-gather with compute implicitly (the CPU runs
        ahead of the GPU and issues it early); a CPU backend has no run-ahead, so the next
        unit is gathered explicitly. It costs one more unit's parameters during forward.
        """
        if group.forward_prefetch is not None:
            return group.forward_prefetch
        order = self.previous_forward_order
        if group not in order:
            return []
        position = order.index(group) + 1
        return [order[position]] if position < len(order) and order[position] is not group else []

    def complete_partial_forwards(self, output: Any) -> Any:
        """(Root, end of forward) Finish the forward of grouped units some of whose modules
        did not run (a chunked loss calls the head after forward), on the root's output, as
        FSDP2 does: they reshard, and their backward starts with the root's."""
        for group in reversed(self.groups):
            if group is not self.root and group._modules_run:
                output = group.complete_forward(output)
        return output

    # -- backward ---------------------------------------------------------------------

    def backward_prefetch_targets(self, group: FSDPParamGroup) -> list[FSDPParamGroup]:
        """The units set by ``set_modules_to_backward_prefetch``, else the latest unit to
        finish its forward before ``group`` did whose backward has not started (FSDP2's
        post-forward order: the root gathers the last block during the head's backward).

        None where a unit passed over on the way is in its backward and has yet to prefetch
        that same unit at its first gradient: a root without parameters, whose pre-backward
        runs with the head's on the logits' gradient, leaves the last block to the head, so
        it is not gathered while the logits' gradient is alive (the head's backward frees it
        before the head's first gradient; see ``FSDPParamGroup._prefetch_for_backward``).
        """
        if group.backward_prefetch is not None:
            return group.backward_prefetch
        order = self.post_forward_order
        if group not in order:
            return []
        position = order.index(group)
        for earlier in reversed(order[:position]):
            if earlier is group:
                continue
            if earlier.training_state is TrainingState.PRE_BACKWARD and earlier.prefetches_at_first_gradient():
                return []
            if earlier.training_state not in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
                return [earlier]
        return []

    def wait_for_reduces(self, keep: int = 0) -> None:
        """Complete the oldest units' reduce-scatters until ``keep`` units' remain in flight,
        freeing their gradient buffers (what follows a reduce-scatter stays in flight)."""
        while len(self.reduces_in_flight) > keep:
            for handle in self.reduces_in_flight.pop(0):
                handle.wait_reduce_scatter()
                if not handle.done:
                    self.reduces_landing.append(handle)

    def wait_for_host_reduces(self, keep: int = 0) -> None:
        """``wait_for_reduces`` where every reduce-scatter in flight is a host collective
        (no side stream to overlap with: waiting early costs no overlap on the device)."""
        if all(handle.on_host for handles in self.reduces_in_flight for handle in handles):
            self.wait_for_reduces(keep)

    def wait_for_gradients(self) -> None:
        """Complete every reduction in flight: the sharded gradients are final."""
        self.wait_for_reduces()
        landing, self.reduces_landing = self.reduces_landing, []
        for handle in landing:
            handle.wait()

    def end_after_counted_events(self) -> None:
        """(At the first pre-backward hook under compiled autograd) Run the final callback at
        the last of this backward's gradient events instead of queueing it.

        Compiled autograd never runs a callback an eager hook queues (FSDP2 loses its final
        callback there: units no post-backward node reaches keep unreduced gradients).
        Autograd says which nodes this backward will run: the accumulation of each managed
        parameter's gradient (each fires ``_after_gradient``) and each unit's
        ``_PostBackward``. After the last of them, no node left in the graph reads a unit's
        parameters or writes their gradients.
        """
        will_run = torch._C._will_engine_execute_node
        expected = 0
        for group in self.groups:
            for fsdp_param in group.fsdp_params:
                unsharded = fsdp_param.unsharded
                if unsharded is not None and unsharded.requires_grad:
                    expected += bool(will_run(get_gradient_edge(unsharded).node))
            for ref in group.post_backward_nodes:
                node = ref()
                expected += node is not None and bool(will_run(node))
        remaining = expected - self.backward_events
        if remaining <= 0:
            raise RuntimeError(
                "fully_shard under compiled autograd: this backward reaches no managed parameter and no unit's "
                "inputs, so its end cannot be found (compiled autograd drops autograd's final callbacks); run "
                "this backward without compiled autograd"
            )
        self.events_to_end = remaining

    def count_backward_event(self) -> None:
        """A managed parameter's gradient accumulated or a unit's ``_PostBackward`` ran: under
        compiled autograd, the last one this backward will run ends it."""
        self.backward_events += 1
        if self.events_to_end is not None:
            self.events_to_end -= 1
            if self.events_to_end == 0:
                self.final_callback()

    def backward_starts(self) -> None:
        """(At the first pre-backward hook of a backward) Fix the finalization mode."""
        if self.manual_active is None:
            self.manual_active = self.root.manual_backward_finalization

    @eager_hook
    def final_callback(self) -> None:
        """End of backward: reduce every unit the per-input hooks did not reach, wait for
        every reduce-scatter (gradients are final when ``backward()`` returns), reshard every
        unit (those no backward reached too), reset state.

        Under manual finalization (FSDP2 2.15's ``set_manual_backward_finalization``) the
        units the hooks did not reach wait for ``finalize_backward``, and so do the waits
        and the resharding of units no backward reached."""
        self.callback_queued = False
        self.backward_events = 0
        self.events_to_end = None
        manual = bool(self.manual_active)
        for group in reversed(self.groups):
            group._modules_run.clear()  # a grouped unit's partial calls after forward (chunks)
            if group.training_state is TrainingState.PRE_BACKWARD:
                if manual and group.requires_gradient_sync:
                    group.post_backward_pending = True  # IDLE below until finalize_backward
                    group.training_state = TrainingState.POST_BACKWARD
                else:
                    group.post_backward()
            group._pending_post_backward = 0
            group.post_backward_nodes = []
            # FORWARD: no backward reached the unit (a frozen embedding), though it may have
            # been prefetched for one; it reshards below, as FSDP2's final callback does.
            if group.training_state in (TrainingState.POST_BACKWARD, TrainingState.FORWARD):
                group.training_state = TrainingState.IDLE
        if not manual:
            self.end_backward_iteration()

    def end_backward_iteration(self) -> None:
        """Every gradient final, every unit the backward left gathered resharded (the root's
        ``reshard_after_backward``), the finalization mode free to change again."""
        self.finish_reductions()
        if self.root.reshard_after_backward:
            for group in self.groups:
                if group.is_unsharded and group.training_state is TrainingState.IDLE:
                    group.reshard()
        self.manual_active = None
        self.reduction_pending = None

    def label_of(self, group: FSDPParamGroup) -> str:
        """The unit's module name, as FSDP2 names a parameter group in errors."""
        return group.dbuffers[0].label if group.dbuffers else "<root>"

    def finalize_backward(self, wait: bool) -> object | None:
        """FSDP2 2.15's ``FSDPModule.finalize_backward`` (checked by the caller): reduce the
        units whose reduction waited for it, then (``wait``) end the iteration."""
        for group in reversed(self.groups):
            if group.post_backward_pending:
                group.post_backward_pending = False
                group._backward_prefetched = True  # backward is over: nothing to prefetch
                group.training_state = TrainingState.PRE_BACKWARD
                group.post_backward()
            elif group.reshard_after_backward and group.is_unsharded:
                group.reshard()
            group._pending_post_backward = 0
            group.post_backward_nodes = []
            group.training_state = TrainingState.IDLE
        if wait:
            self.end_backward_iteration()
            return None
        self.reduction_pending = object()  # the token the handle holds
        return self.reduction_pending

    def finish_reductions(self) -> None:
        """Complete every reduction in flight (and, under CPU offload, the gradients' copies to
        host, as FSDP2) and attach the gradients only other ranks' data reached: every
        sharded gradient is final."""
        self.wait_for_gradients()
        for group in self.groups:
            for dbuffer in group.dbuffers:
                dbuffer.wait_for_offloaded_grads()
        if self.reduced_without_local_grad:
            self._attach_remote_gradients()

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

    def _attach_remote_gradients(self) -> None:
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

    def reset_iteration(self) -> None:
        """After an exception aborted a forward or backward: finish every collective in
        flight, reshard every unit and forget the iteration (its unreduced gradients and
        no-sync accumulation are dropped), as FSDP2's ``reset_iter_state``."""
        for handle in [h for handles in self.reduces_in_flight for h in handles] + self.reduces_landing:
            handle.after_wait = None  # the aborted iteration's gradients trigger no hooks
        self.wait_for_gradients()
        self.reduced_without_local_grad = []
        self.callback_queued = self.finish_queued = False
        self.manual_active = None
        self.reduction_pending = None
        self.backward_events = 0
        self.events_to_end = None
        self.forward_order = []
        self.post_forward_order = []
        for group in self.groups:
            group.reset_iteration_state()


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
