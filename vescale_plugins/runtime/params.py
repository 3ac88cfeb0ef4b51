"""A unit's parameters and their DBuffers: sharding in, the two faces (sharded DTensor
between steps, unsharded view around forward/backward), unshard/reshard, and adopting new
storage or assigned values."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from vescale_plugins.ragged.dtensor import make_dtensor, set_local_tensor
from vescale_plugins.dbuffer.buffer import DBuffer
from vescale_plugins.runtime.tensor_parallel import ParallelSpec
from vescale_plugins.runtime.buffer_split import split_group
from vescale_plugins.runtime.managed import ManagedParam, track_slots
from vescale_plugins.runtime.mesh import UnitMesh, post_forward_group
from vescale_plugins.runtime.traversal import outside_functorch

if TYPE_CHECKING:
    from vescale_plugins.runtime.fsdp_unit import FSDPUnit

__all__ = ["UnitParams"]

# (fqn, owners, parameter, block rows, how it is distributed besides FSDP (TP/EP) or None,
# the mesh it shards over when shard_placement_fn gave it its own, else None: the unit's)
ParamSpec = tuple[str, list[tuple[nn.Module, str]], nn.Parameter, int, "ParallelSpec | None", "DeviceMesh | None"]


class UnitParams:
    """Mixin of ``FSDPUnit``: everything that touches the parameters and their buffers."""

    # -- construction -----------------------------------------------------------------

    def _build(self: "FSDPUnit", params: list[ParamSpec]) -> list[ManagedParam]:
        """Plan and allocate the DBuffers of each (mesh, dtype, requires_grad) group, one or
        more as the planner's split says (:mod:`.buffer_split`); shard into them."""
        groups: dict[tuple[DeviceMesh, torch.dtype, bool], list[int]] = {}
        for i, (_, _, param, _, _, param_mesh) in enumerate(params):
            groups.setdefault((self.mesh if param_mesh is None else param_mesh, param.dtype, param.requires_grad), []).append(i)
        self.dbuffers: list[DBuffer] = []
        self.buffer_meshes: list[UnitMesh] = []  # the mesh each DBuffer shards over
        unit_meshes = {self.mesh: self.unit_mesh}
        managed: list[ManagedParam | None] = [None] * len(params)
        for (mesh, dtype, requires_grad), group_indices in groups.items():
            unit_mesh = unit_meshes.setdefault(mesh, UnitMesh.of(mesh))
            device = params[group_indices[0]][2].device
            shapes, block_rows = [_local(params[i][2]).shape for i in group_indices], [params[i][3] for i in group_indices]
            comm_dtype = (self.mp_policy.param_dtype or dtype) if dtype.is_floating_point else dtype
            for positions, layout in split_group(shapes, block_rows, dtype, comm_dtype, unit_mesh.shard_size):
                self._build_buffer(params, [group_indices[p] for p in positions], unit_mesh, dtype, requires_grad, device, layout, managed)
        result = [m for m in managed if m is not None]
        for m in result:
            m.register(m.sharded)
        track_slots(self, result)
        # Which parameters live in which DBuffer is fixed here; per-step code reads it.
        self._members: list[list[ManagedParam]] = [[m for m in result if m.buffer_index == i] for i in range(len(self.dbuffers))]
        return result

    def _build_buffer(self: "FSDPUnit", params: list[ParamSpec], indices: list[int], unit_mesh: UnitMesh, dtype: torch.dtype,
                      requires_grad: bool, device: torch.device, layout, managed: list[ManagedParam | None]) -> None:
        """One DBuffer over ``params[indices]`` with the planned ``layout``, sharded over
        ``unit_mesh``; shard into it."""
        dbuffer = self._new_dbuffer([_local(params[i][2]).shape for i in indices], [params[i][3] for i in indices], dtype, device, unit_mesh.shard_group, layout=layout)
        self.dbuffers.append(dbuffer)
        self.buffer_meshes.append(unit_mesh)
        for slot_index, i in enumerate(indices):
            fqn, owners, param, _, parallel, _ = params[i]
            sharded = nn.Parameter(self._shard_into(len(self.dbuffers) - 1, slot_index, param, parallel), requires_grad=requires_grad)
            managed[i] = ManagedParam(fqn, owners, sharded, len(self.dbuffers) - 1, slot_index, original=weakref.ref(param), parallel=parallel)

    def _new_dbuffer(self: "FSDPUnit", shapes, block_rows, dtype: torch.dtype, device: torch.device, group, layout=None) -> DBuffer:
        floating = dtype.is_floating_point
        return DBuffer(
            shapes, block_rows, dtype, device, group,
            param_dtype=self.mp_policy.param_dtype if floating else None,
            reduce_dtype=self.mp_policy.reduce_dtype if floating else None,
            layout=layout,
        )

    def _placements(self: "FSDPUnit", dbuffer_index: int, slot_index: int) -> list[Placement]:
        slot = self.dbuffers[dbuffer_index].slots[slot_index]
        return self.buffer_meshes[dbuffer_index].placements(slot.shape, slot.numel, slot.local_units)

    def _slice_start(self: "FSDPUnit", dbuffer_index: int, slot_index: int) -> int:
        """Where this rank's part of the slot's parameter starts in the flattened parameter."""
        dbuffer = self.dbuffers[dbuffer_index]
        slot = dbuffer.slots[slot_index]
        return self.buffer_meshes[dbuffer_index].shard_rank * dbuffer.shard_size + slot.local_offset - slot.global_offset

    def _shard_into(self: "FSDPUnit", dbuffer_index: int, slot_index: int, param: torch.Tensor, parallel: ParallelSpec | None) -> torch.Tensor:
        """Copy this rank's part of ``param`` into the sharded buffer once; return the DTensor.

        A tensor-parallel parameter's slot is its local TP tensor; the DTensor lives on the
        (dp, tp) mesh with the ragged cut on the dp dim (see ``tensor_parallel``)."""
        dbuffer = self.dbuffers[dbuffer_index]
        slot = dbuffer.slots[slot_index]
        local = dbuffer.sharded_view(slot_index)
        if param.device.type != "meta":
            with torch.no_grad():
                flat = _local(param).detach().reshape(-1)
                start = self._slice_start(dbuffer_index, slot_index)
                local.reshape(-1).copy_(flat[start : start + slot.local_length])
        if parallel is not None:
            ragged = self._placements(dbuffer_index, slot_index)[-1]
            return make_dtensor(local, parallel.sharded_mesh, parallel.sharded_placements(ragged), parallel.shape, parallel.stride)
        mesh = self.buffer_meshes[dbuffer_index].mesh
        return make_dtensor(local, mesh, self._placements(dbuffer_index, slot_index), slot.shape, _contiguous_stride(slot.shape))

    def readopt_sharded_params(self: "FSDPUnit") -> None:
        """After ``to_empty``/``_apply`` replaced local tensors: move them back into DBuffers."""
        for dbuffer_index, dbuffer in enumerate(self.dbuffers):
            members = self._members[dbuffer_index]
            locals_ = [m.sharded._local_tensor for m in members]
            device = locals_[0].device if locals_ else dbuffer.device
            dtype = locals_[0].dtype if locals_ else dbuffer.dtype
            if all(_same_storage(t, dbuffer.sharded_view(m.slot_index)) and t.dtype == dbuffer.dtype for t, m in zip(locals_, members)):
                continue
            if device != dbuffer.device or dtype != dbuffer.dtype or dbuffer.sharded.device.type == "meta":
                label = dbuffer.label
                # module.to(device or dtype) / to_empty: new buffers in the new device and dtype;
                # mixed-precision dtypes follow a dtype change unless the policy fixed them.
                self.dbuffers[dbuffer_index] = dbuffer = self._new_dbuffer(
                    [s.shape for s in dbuffer.slots], [s.block_rows for s in dbuffer.slots], dtype, device, dbuffer.group, layout=dbuffer.layout
                )
                dbuffer.label = label
                if self.root is not None:
                    dbuffer.use_storage_pool(self.root._storage_pool)
            for m, old_local in zip(members, locals_):
                view = dbuffer.sharded_view(m.slot_index)
                if old_local.device.type != "meta":
                    with torch.no_grad():
                        view.copy_(old_local)
                set_local_tensor(m.sharded, view)
                m.unsharded = None

    def adopt_assigned(self: "FSDPUnit", m: ManagedParam, value: nn.Parameter) -> nn.Parameter | None:
        """``module.<name> = value`` on a managed parameter (``load_state_dict(assign=True)``
        too): keep the sharded DTensor in its DBuffer and take ``value``'s data for this rank.

        ``value`` is the full parameter (a plain tensor) or a DTensor of any placement over this
        unit's mesh (a sharded state dict). Returns the parameter to register.
        """
        if value is m.sharded or value is m.unsharded:
            return None
        if tuple(value.shape) != tuple(m.sharded.shape):
            raise ValueError(
                f"cannot assign a tensor of shape {tuple(value.shape)} to {m.fqn!r}, a parameter of "
                f"shape {tuple(m.sharded.shape)} sharded by fully_shard; assign a tensor of the same shape"
            )
        if self.is_unsharded or self._pending_unshard:
            self.reshard()
        if value.device.type == "meta":
            return m.sharded
        if self.dbuffers[m.buffer_index].sharded.device.type == "meta":
            # Assigned over a meta-initialised unit: its buffer moves to the value's device
            # (what to_empty would do; new DTensors, as to_empty makes, since a DTensor's
            # device is fixed); the other parameters wait for their own values.
            for member in self._members[m.buffer_index]:
                old = member.sharded
                local = torch.empty(old._local_tensor.shape, dtype=old.dtype, device=value.device)
                member.sharded = nn.Parameter(make_dtensor(local, old.device_mesh, old.placements, old.shape, old.stride()), requires_grad=old.requires_grad)
                member.register(member.sharded)
            self.readopt_sharded_params()
        dbuffer = self.dbuffers[m.buffer_index]
        slot = dbuffer.slots[m.slot_index]
        with torch.no_grad():
            if isinstance(value, DTensor):
                same = value.placements == m.sharded.placements and value.device_mesh == m.sharded.device_mesh
                local = value.to_local() if same else value.redistribute(m.sharded.device_mesh, m.sharded.placements).to_local()
            else:
                full = value.detach() if m.parallel is None else m.parallel.local_part(value.detach()).contiguous()
                start = self._slice_start(m.buffer_index, m.slot_index)
                local = full.reshape(-1)[start : start + slot.local_length]
            dbuffer.sharded_view(m.slot_index).reshape(-1).copy_(local.reshape(-1))
        return m.sharded

    def register_state_dict_hooks(self: "FSDPUnit") -> None:
        """Reshard before ``state_dict()``/``load_state_dict()`` so both see the sharded params."""
        owners = {id(module): module for m in self.managed for module, _ in m.owners}
        for module in owners.values():
            module.register_state_dict_pre_hook(lambda *args, **kwargs: self.reshard())
            module._register_load_state_dict_pre_hook(lambda *args, **kwargs: self.reshard())

    # -- unshard / reshard ------------------------------------------------------------

    @property
    def is_unsharded(self: "FSDPUnit") -> bool:
        return all(b.is_unsharded for b in self.dbuffers)

    def _check_materialized(self: "FSDPUnit") -> None:
        for m in self.managed:
            if m.sharded.device.type == "meta":
                raise RuntimeError(
                    f"parameter {m.fqn!r} is still on the meta device: call module.to_empty(device=...) "
                    "and initialise it (e.g. reset_parameters()) before running forward"
                )

    def unshard(self: "FSDPUnit", async_op: bool = False) -> None:
        """All-gather every DBuffer in place; with ``async_op`` the caller waits later."""
        if self.is_unsharded or self._pending_unshard:
            return
        self._check_materialized()
        with outside_functorch():
            self._pending_unshard = [b.all_gather(async_op=async_op) for b in self.dbuffers]

    def wait_for_unshard(self: "FSDPUnit") -> None:
        with outside_functorch():
            for work in self._pending_unshard:
                work.wait()
        self._pending_unshard = []

    def use_unsharded_params(self: "FSDPUnit") -> None:
        """Register the unsharded parameters (views of the unsharded buffers) in the modules."""
        self.unshard()
        self.wait_for_unshard()
        for m in self.managed:
            if m.unsharded is None:
                dbuffer = self.dbuffers[m.buffer_index]
                view = dbuffer.unsharded_view(m.slot_index)
                gathered = view if m.parallel is None else m.parallel.unsharded_param(view)
                m.unsharded = nn.Parameter(gathered, requires_grad=m.sharded.requires_grad)
                if m.unsharded.requires_grad:
                    m.unsharded.register_post_accumulate_grad_hook(self._after_gradient)
            m.register(m.unsharded)

    def reshard_to_post_forward_group(self: "FSDPUnit") -> None:
        """``reshard_after_forward=k``: keep the parameters sharded over groups of k
        consecutive ranks until backward, which gathers within those k ranks only (FSDP2's
        memory and traffic: 1/k of the unit per rank)."""
        self.wait_for_unshard()
        for m in self.managed:
            m.register(m.sharded)
        for b, unit_mesh in zip(self.dbuffers, self.buffer_meshes):
            b.reshard_to_group(post_forward_group(unit_mesh.mesh, self.reshard_after_forward))

    def reshard(self: "FSDPUnit") -> None:
        """Free the unsharded buffers and register the sharded parameters again."""
        self.wait_for_unshard()
        for m in self.managed:
            m.register(m.sharded)
        for b in self.dbuffers:
            b.release_unsharded()


def _local(param: torch.Tensor) -> torch.Tensor:
    """What a unit's DBuffer holds of a parameter: a DTensor's (TP/EP) local tensor."""
    return param._local_tensor if isinstance(param, DTensor) else param


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "meta" or b.device.type == "meta":
        return False
    return a.data_ptr() == b.data_ptr() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
