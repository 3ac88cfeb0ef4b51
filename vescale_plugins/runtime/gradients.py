"""A unit's gradient path: after its backward, gradients move into the gradient buffers and
leave by one reduce-scatter per DBuffer (then, under HSDP, one all-reduce across replicas);
routed parameters get the other ranks' gradients; hooks run once gradients are final."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from vescale_plugins.ragged.dtensor import make_dtensor
from vescale_plugins.runtime.managed import ManagedParam

if TYPE_CHECKING:
    from vescale_plugins.runtime.fsdp_unit import FSDPUnit

__all__ = ["UnitGradients", "run_post_accumulate_grad_hooks"]


class UnitGradients:
    """Mixin of ``FSDPUnit``: post-backward, reduce-scatter, accumulation without sync."""

    def post_backward(self: "FSDPUnit") -> None:
        """Reshard, then reduce-scatter the unit's gradients (unless accumulating without sync).

        Resharding first frees the unsharded parameters before the reduce-scatter allocates.
        """
        if self._iteration.reduced:
            return
        self._iteration.reduced = True
        self._prefetch_for_backward()  # if no gradient reached this unit
        if self.reshard_after_backward:
            self.reshard()
        if self.requires_gradient_sync:
            self._reduce_gradients()
        else:
            self._accumulate_in_reduce_dtype()

    def _accumulate_in_reduce_dtype(self: "FSDPUnit") -> None:
        """Without sync, move each gradient into an accumulator in the reduce dtype where it
        differs from the gradient's (bf16 compute, fp32 reduce), as FSDP2 does; otherwise
        autograd keeps accumulating on the parameter in place."""
        for m in self.managed:
            grad = m.gathered_grad()
            if grad is None:
                continue
            reduce_dtype = self.dbuffers[m.buffer_index].reduce_dtype
            if m.accumulated_grad is None and grad.dtype == reduce_dtype:
                continue
            m.unsharded.grad = None
            if m.accumulated_grad is None:
                m.accumulated_grad = grad.to(reduce_dtype)
            else:
                m.accumulated_grad.add_(grad)

    def _reduce_gradients(self: "FSDPUnit") -> None:
        """Move the unit's gradients into its gradient buffers and reduce-scatter them
        asynchronously (at most one unit in flight).

        Called after resharding, as FSDP2 chunk-cats after resharding: the buffer is allocated
        once the unsharded parameters are freed and the previous unit's reduce-scatter (which
        overlapped this unit's backward) is finished, so one unit's full gradients are alive
        at a time, the root's aside. Autograd's gradients are copied in (one copy each: its
        backward ops always write fresh tensors) and freed as they are copied. The root waits
        for the last reduce-scatters at the end of backward.
        """
        root = self.root
        root.wait_for_reduces()
        for dbuffer_index, dbuffer in enumerate(self.dbuffers):
            members = [m for m in self._members[dbuffer_index] if m.sharded.requires_grad]
            if not members:
                continue
            # Every rank reduces every unit that ran backward, gradients or not (another rank's
            # data may have reached parameters this one's did not): slices no gradient reached
            # are zeroed.
            grads = _take_gradients(members)
            got = [grads[m.slot_index] is not None for m in members]
            # The buffer holds the last references: each gradient is freed as it is copied,
            # before the reduce-scatter allocates the sharded gradient.
            dbuffer.fill_unsharded_grad(grads)
            accumulate = any(m.sharded.grad is not None for m in members)
            if accumulate:
                # Gradients set to None since the last step restart from zero in the buffer.
                for m in members:
                    if m.sharded.grad is None:
                        dbuffer.sharded_grad_view(m.slot_index).zero_()
            buffer_mesh = self.buffer_meshes[dbuffer_index]
            replicate_group = buffer_mesh.replicate_group
            if replicate_group is not None and not self.requires_all_reduce:
                # HSDP accumulating without the all-reduce (FSDP2's set_requires_all_reduce):
                # the shard group's sums wait in a partial buffer; no gradient is attached yet.
                root._reduces_in_flight.append(dbuffer.reduce_scatter(1.0, accumulate=False, async_op=True, partial=True))
                continue
            # Default: the mean over every data-parallel rank of the buffer's own mesh.
            divide_factor = float(buffer_mesh.mesh.size()) if self.gradient_divide_factor is None else self.gradient_divide_factor
            handle = dbuffer.reduce_scatter(divide_factor, accumulate=accumulate, async_op=True, replicate_group=replicate_group)
            handle.after_wait = functools.partial(run_post_accumulate_grad_hooks, members)
            root._reduces_in_flight.append(handle)
            for m, received in zip(members, got):
                if m.sharded.grad is not None:
                    continue
                if received:
                    self._attach_sharded_grad(m)
                else:
                    root._reduced_without_local_grad.append((m, self, dbuffer.sharded_grad))

    def _attach_sharded_grad(self: "FSDPUnit", m: ManagedParam) -> None:
        local = self.dbuffers[m.buffer_index].sharded_grad_view(m.slot_index)
        m.sharded.grad = make_dtensor(local, m.sharded.device_mesh, m.sharded.placements, m.sharded.shape, m.sharded.stride())

    def _attach_remote_gradients(self: "FSDPUnit") -> None:
        """(Root, once every reduce-scatter of the backward is done) Give a gradient to each
        parameter this rank's data never reached but another rank's did.

        With data-dependent routing (mixture-of-experts layers, conditional branches) a
        parameter can get gradients on some ranks only. Its reduce-scatter already carried the
        other ranks' contributions and a presence flag per parameter (see DBuffer): a
        parameter some rank had a gradient for gets the reduced gradient on every rank (so
        every shard steps), one no rank's data reached keeps ``grad=None`` on every rank (so
        optimizers skip it everywhere), as under DDP. Ranks that had every gradient read
        nothing back; the others read one small flag vector per buffer.
        """
        pending, self._reduced_without_local_grad = self._reduced_without_local_grad, []
        by_buffer: dict[tuple[int, int], list[ManagedParam]] = {}
        owners: dict[tuple[int, int], tuple[FSDPUnit, torch.Tensor]] = {}
        for m, unit, sharded_grad in pending:
            key = (id(unit), m.buffer_index)
            by_buffer.setdefault(key, []).append(m)
            owners[key] = (unit, sharded_grad)
        for key, members in by_buffer.items():
            unit, sharded_grad = owners[key]
            received = unit.dbuffers[members[0].buffer_index].received_gradient(sharded_grad, [m.slot_index for m in members])
            attached = []
            for m, got in zip(members, received):
                if got and m.sharded.grad is None:
                    unit._attach_sharded_grad(m)
                    attached.append(m)
            run_post_accumulate_grad_hooks(attached)

    def wait_for_reduces(self: "FSDPUnit") -> None:
        """(Root) complete every reduce-scatter in flight, freeing their gradient buffers."""
        for handle in self._reduces_in_flight:
            handle.wait()
        self._reduces_in_flight = []


def _take_gradients(members: list[ManagedParam]) -> dict[int, torch.Tensor | None]:
    """Detach each member's gradient (adding what accumulated without sync) into a dict by
    slot, holding no other reference to it (a loop variable would keep the last one, often
    the unit's largest gradient, alive through the reduce-scatter)."""
    grads: dict[int, torch.Tensor | None] = {}
    for m in members:
        grads[m.slot_index] = m.gathered_grad()
        if m.unsharded is not None:
            m.unsharded.grad = None
        if m.accumulated_grad is not None:
            own = grads[m.slot_index]
            grads[m.slot_index] = m.accumulated_grad if own is None else m.accumulated_grad.add_(own)
            m.accumulated_grad = None
            del own
    return grads


def run_post_accumulate_grad_hooks(members: list[ManagedParam]) -> None:
    """Hooks users registered on the sharded parameters run once the reduced sharded
    gradient is final (optimizer-in-backward steps there), as FSDP2's do."""
    for m in members:
        hooks = getattr(m.sharded, "_post_accumulate_grad_hooks", None)
        if hooks and m.sharded.grad is not None:
            for hook in list(hooks.values()):
                hook(m.sharded)
