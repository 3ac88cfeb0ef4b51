"""The end-of-backward driver above the units (FSDP2's root ``FSDPState``).

The first unit to run forward becomes the root of every unit below its modules
(:func:`pre_forward`). Its :class:`RootState` is the units' shared
:class:`~vescale_plugins.runtime.iteration.IterationContext` (the orders, the reductions in
flight) and what only the root does: queue the end of each backward and run it in one
autograd callback (the last reduce-scatters are waited for, parameters only other ranks'
data reached get their gradients, units reshard), finalize a backward under manual
finalization, and reset an iteration an exception aborted. The units never call it: they
reach it only through the two callbacks it gives the context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge

from vescale_plugins.dbuffer.faults import CollectiveError
from vescale_plugins.runtime.dynamo import eager_hook
from vescale_plugins.runtime.iteration import IterationContext, TrainingState, in_compiled_autograd
from vescale_plugins.runtime.param_group import FSDPParamGroup

__all__ = ["RootState", "groups_under", "post_forward", "pre_forward", "root_state_of"]


def groups_under(modules: Iterable[nn.Module]) -> list[FSDPParamGroup]:
    """Every unit whose modules are among ``modules`` or below them, outermost first."""
    groups: list[FSDPParamGroup] = []
    for module in modules:
        for sub in module.modules():
            group = vars(sub).get("_vescale_fsdp_unit")
            if group is not None and group not in groups:
                groups.append(group)
    return groups


def root_state_of(group: FSDPParamGroup) -> RootState | None:
    """The root state ``group`` runs under (``None`` before its first forward)."""
    context = group.context
    assert context is None or isinstance(context, RootState)  # only RootState makes contexts
    return context


def pre_forward(group: FSDPParamGroup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The forward pre-hook of a unit's modules: the first unit to run forward becomes the
    root of the units below it; then the unit's own pre-forward."""
    if group.context is None:
        RootState.init_under(group)
    return group.pre_forward(module, args, kwargs)


def post_forward(group: FSDPParamGroup, module: nn.Module, output: Any) -> Any:
    """The forward hook of a unit's modules (the unit's own post-forward)."""
    return group.post_forward(module, output)


class RootState(IterationContext[FSDPParamGroup]):
    """What the units under ``root`` share for the iteration in progress, and the root's
    end of backward."""

    def __init__(self, root: FSDPParamGroup, groups: list[FSDPParamGroup]) -> None:
        super().__init__(root, groups, on_backward_start=self._start_backward, on_backward_end=self.final_callback)

    @staticmethod
    def init_under(root: FSDPParamGroup) -> None:
        """Make ``root`` (the first unit to run forward) the root of every unit below its
        modules that has none yet; label their buffers with their module names."""
        found = groups_under(root.modules)
        if any(g is not root and g.manual_backward_finalization and g.context is None for g in found):
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        names = {id(p): name for module in root.modules for name, p in module.named_parameters()}
        for group in found:
            if group.context is None or group.context.root is root:
                group.check_materialized(names)
        groups = [g for g in found if g.context is None or g.context.root is root]
        state = RootState(root, groups)
        for group in groups:
            group.context = state
        for root_module in root.modules:
            for name, module in root_module.named_modules():
                unit = vars(module).get("_vescale_fsdp_unit")
                if unit in groups and module is unit.modules[0]:
                    for dbuffer in unit.dbuffers:
                        dbuffer.label = name or "<root>"

    # -- backward ---------------------------------------------------------------------

    def _start_backward(self) -> None:
        """(The first pre-backward hook of a backward) Fix the finalization mode and queue
        the end of this backward (under compiled autograd: count the events that end it)."""
        if self.manual_active is None:
            self.manual_active = self.root.manual_backward_finalization
        if in_compiled_autograd():
            self.end_after_counted_events()
        else:
            Variable._execution_engine.queue_callback(self.final_callback)

    def end_after_counted_events(self) -> None:
        """(At the first pre-backward hook under compiled autograd) Run the final callback at
        the last of this backward's gradient events instead of queueing it.

        Compiled autograd never runs a callback an eager hook queues (FSDP2 loses its final
        callback there: units no post-backward node reaches keep unreduced gradients).
        Autograd says which nodes this backward will run: the accumulation of each managed
        parameter's gradient (each fires the unit's ``after_gradient``) and each unit's
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

    @eager_hook
    def final_callback(self) -> None:
        """End of backward: reduce every unit the per-input hooks did not reach, wait for
        every reduce-scatter (gradients are final when ``backward()`` returns), reshard every
        unit (those no backward reached too), reset state.

        Under manual finalization (FSDP2 2.15's ``set_manual_backward_finalization``) the
        units the hooks did not reach wait for ``finalize_backward``, and so do the waits
        and the resharding of units no backward reached. A backward the root was told is not
        the last (``set_is_last_backward(False)``) leaves its reductions in flight."""
        self.callback_queued = False
        self.backward_events = 0
        self.events_to_end = None
        manual = bool(self.manual_active)
        for group in reversed(self.groups):
            group.clear_partial_forward()  # a grouped unit's partial calls after forward (chunks)
            if group.training_state is TrainingState.PRE_BACKWARD:
                if manual and group.requires_gradient_sync:
                    group.post_backward_pending = True  # IDLE below until finalize_backward
                    group.training_state = TrainingState.POST_BACKWARD
                else:
                    group.post_backward()
            group.forget_post_backward_nodes()
            # FORWARD: no backward reached the unit (a frozen embedding), though it may have
            # been prefetched for one; it reshards below, as FSDP2's final callback does.
            if group.training_state in (TrainingState.POST_BACKWARD, TrainingState.FORWARD):
                group.training_state = TrainingState.IDLE
        if not manual:
            self.end_backward_iteration(wait=self.root.is_last_backward)

    def end_backward_iteration(self, wait: bool = True) -> None:
        """Every gradient final (unless not ``wait``: FSDP2's not-last backward, whose
        reductions a later backward waits for), every unit the backward left gathered
        resharded (the root's ``reshard_after_backward``), the finalization mode free to
        change again."""
        if wait:
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
                group.reduce_when_finalized()
            elif group.reshard_after_backward and group.is_unsharded:
                group.reshard()
            group.forget_post_backward_nodes()
            group.training_state = TrainingState.IDLE
        if wait:
            self.end_backward_iteration()
            return None
        self.reduction_pending = object()  # the token the handle holds
        return self.reduction_pending

    def reset_iteration(self) -> None:
        """After an exception aborted a forward or backward: finish every collective in
        flight, reshard every unit and forget the iteration (its unreduced gradients and
        no-sync accumulation are dropped), as FSDP2's ``reset_iter_state``.

        After a collective failed (a peer died), nothing is waited on the broken group:
        its collectives in flight are dropped, with the gradients attached to their buffers."""
        for handle in self.in_flight():
            handle.after_wait = None  # the aborted iteration's gradients trigger no hooks
        with contextlib.suppress(CollectiveError):  # raised once its reductions were dropped
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
