"""A unit's state machine: what its forward and backward hooks do, in which order, and how
the root closes an iteration (or abandons one after an exception)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn as nn
from torch.autograd import Variable

from vescale_plugins.runtime.mesh import is_group_size
from vescale_plugins.runtime.traversal import cast_floating, map_grad_tensors, register_on_tensors, tensors_requiring_grad

if TYPE_CHECKING:
    from vescale_plugins.runtime.fsdp_unit import FSDPUnit

__all__ = ["IterationState", "UnitHooks", "units_under"]


@dataclass
class IterationState:
    """What one forward/backward pass has done so far to this unit."""

    pending_post_backward: int = 0
    reduced: bool = True
    pre_backward_done: bool = False
    backward_prefetched: bool = False


def units_under(modules: Iterable[nn.Module]) -> list["FSDPUnit"]:
    """Every unit whose modules are among ``modules`` or below them, outermost first."""
    units: list[FSDPUnit] = []
    for module in modules:
        for sub in module.modules():
            unit = getattr(sub, "_vescale_fsdp_unit", None)
            if unit is not None and unit not in units:
                units.append(unit)
    return units


class UnitHooks:
    """Mixin of ``FSDPUnit``: forward/backward hooks and the root's end-of-iteration work."""

    _iteration_callback_queued = False

    # -- forward ----------------------------------------------------------------------

    def pre_forward(self: "FSDPUnit", module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._iteration.pre_backward_done:
            # Activation checkpointing recomputes this forward inside the unit's backward: the
            # backward owns the parameters' state, so only make sure they are unsharded (an
            # earlier post-backward of a unit run twice may have resharded them), as FSDP2.
            self.use_unsharded_params()
            return self._cast_forward_inputs(args, kwargs)
        if self._modules_run:
            self._modules_run.add(id(module))
            return self._cast_forward_inputs(args, kwargs)  # every module of a grouped unit
        self._modules_run.add(id(module))
        if self.root is None:
            self._lazy_init_as_root()
        root = self.root
        if root is self and root._forward_order:
            root._previous_forward_order, root._forward_order = root._forward_order, []
        if torch.is_grad_enabled():
            root._forward_order.append(self)
        self.use_unsharded_params()
        for unit in self._forward_prefetch_targets():
            unit.unshard(async_op=True)
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        if torch.is_grad_enabled():
            self._iteration.reduced = False
            self._iteration.pre_backward_done = False
            args, kwargs = self._attach_post_backward((args, kwargs))
        return args, kwargs

    def _cast_forward_inputs(self: "FSDPUnit", args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``MixedPrecisionPolicy(cast_forward_inputs=True)``: floating-point inputs to
        ``param_dtype``, wherever they are nested (as FSDP2: lists, dicts, dataclasses)."""
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _cast_output(self: "FSDPUnit", output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            return cast_floating(output, self.mp_policy.output_dtype)
        return output

    def post_forward(self: "FSDPUnit", module: nn.Module, output: Any) -> Any:
        if self._iteration.pre_backward_done:
            return self._cast_output(output)  # a recomputation (see pre_forward)
        if len(self._modules_run) < len(self.modules):
            return self._cast_output(output)  # each module of a grouped unit, as FSDP2
        output = self._complete_forward(output)
        if self.root is self:
            output = self._complete_partial_forwards(output)
            # The loss and the start of backward (usual peaks) hold no pooled memory.
            self._storage_pool.clear()
        return self._cast_output(output)

    def _complete_forward(self: "FSDPUnit", output: Any) -> Any:
        self._modules_run.clear()
        if self._reshards_after_forward():
            if is_group_size(self.reshard_after_forward) and torch.is_grad_enabled():
                self.reshard_to_post_forward_group()
            else:
                self.reshard()
        if torch.is_grad_enabled():
            output = register_on_tensors(output, self._pre_backward_hook)
        return output

    def _complete_partial_forwards(self: "FSDPUnit", output: Any) -> Any:
        """(Root, end of forward) Finish the forward of grouped units some of whose modules
        did not run (a chunked loss calls the head after forward), on the root's output, as
        FSDP2 does: they reshard, and their backward starts with the root's."""
        for unit in reversed(self._root_units):
            if unit is not self and unit._modules_run:
                output = unit._complete_forward(output)
        return output

    def _reshards_after_forward(self: "FSDPUnit") -> bool:
        if not torch.is_grad_enabled():
            return True  # no backward will need the parameters (evaluation, inference)
        if self.reshard_after_forward is None:
            return self.root is not self
        return self.reshard_after_forward

    def _lazy_init_as_root(self: "FSDPUnit") -> None:
        """The first unit to run forward is the root of every unit below its modules."""
        units = units_under(self.modules)
        for unit in units:
            if unit.root is not None and unit.root is not self:
                continue
            unit.root = self
            unit._check_materialized()
        self._root_units = [u for u in units if u.root is self]
        for unit in self._root_units:
            for dbuffer in unit.dbuffers:
                dbuffer.use_storage_pool(self._storage_pool)
        for root_module in self.modules:
            for name, module in root_module.named_modules():
                unit = getattr(module, "_vescale_fsdp_unit", None)
                if unit in self._root_units and module is unit.modules[0]:
                    for dbuffer in unit.dbuffers:
                        dbuffer.label = name or "<root>"

    # -- backward ---------------------------------------------------------------------

    def _attach_post_backward(self: "FSDPUnit", inputs: Any) -> Any:
        tensors = tensors_requiring_grad(inputs)
        if not tensors or torch._C._are_functorch_transforms_active():
            # (under torch.func transforms the final callback reduces the unit instead)
            return inputs
        self._iteration.pending_post_backward += 1
        outs = _PostBackward.apply(self, *tensors)
        replacements = iter(outs if isinstance(outs, tuple) else (outs,))
        return map_grad_tensors(inputs, lambda t: next(replacements))

    def _pre_backward_hook(self: "FSDPUnit", grad: torch.Tensor) -> None:
        if self._iteration.pre_backward_done:
            return
        self._iteration.pre_backward_done = True
        root = self.root
        if not root._iteration_callback_queued:
            root._iteration_callback_queued = True
            Variable._execution_engine.queue_callback(root._final_callback)
        self.use_unsharded_params()
        self._iteration.backward_prefetched = False
        if not any(m.sharded.requires_grad for m in self.managed):
            self._prefetch_for_backward()

    def _post_backward_from_inputs(self: "FSDPUnit") -> None:
        self._iteration.pending_post_backward -= 1
        if self._iteration.pending_post_backward <= 0 and self._iteration.pre_backward_done:
            self.post_backward()

    def _final_callback(self: "FSDPUnit") -> None:
        """End of backward: reduce every unit the per-input hooks did not reach, wait for
        every reduce-scatter (gradients are final when ``backward()`` returns), reset state."""
        self._iteration_callback_queued = False
        for unit in reversed(self._root_units):
            unit._modules_run.clear()  # a grouped unit's partial calls after forward (chunks)
            if not unit._iteration.reduced and unit._iteration.pre_backward_done:
                unit.post_backward()
            unit._iteration.pending_post_backward = 0
            unit._iteration.pre_backward_done = False
        self.wait_for_reduces()
        if self._reduced_without_local_grad:
            self._attach_remote_gradients()
        if self.reshard_after_backward:
            for unit in self._root_units:
                if unit.is_unsharded and unit._iteration.reduced:
                    unit.reshard()
        self._storage_pool.clear()  # the optimizer step holds no pooled memory

    def reset_iteration(self: "FSDPUnit") -> None:
        """(Root) After an exception aborted a forward or backward: finish every collective
        in flight, reshard every unit and forget the iteration (its unreduced gradients and
        no-sync accumulation are dropped), as FSDP2's ``reset_iter_state``."""
        if self.root is not None and self.root is not self:
            raise RuntimeError(
                "reset_iter_state() must be called on the root module (the one fully_shard was "
                "applied to last, which runs forward first), not on a unit inside it"
            )
        units = self._root_units or units_under(self.modules)
        for handle in self._reduces_in_flight:
            handle.after_wait = None  # the aborted iteration's gradients trigger no hooks
        self.wait_for_reduces()
        self._reduced_without_local_grad = []
        self._iteration_callback_queued = False
        self._forward_order = []
        for unit in units:
            unit.wait_for_unshard()
            unit._iteration = IterationState()
            unit._modules_run.clear()
            for m in unit.managed:
                m.accumulated_grad = None
                if m.unsharded is not None:
                    m.unsharded.grad = None
            unit.reshard()
            for dbuffer in unit.dbuffers:
                dbuffer.release_unsharded_grad()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, unit: "FSDPUnit", *inputs: torch.Tensor) -> Any:
        ctx.unit = unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.unit._post_backward_from_inputs()
        return (None, *grads)
