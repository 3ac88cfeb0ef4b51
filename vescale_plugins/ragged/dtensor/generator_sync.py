"""One generator state for every rank of a mesh before sharded random init draws.

Each rank draws its slice of a full-tensor draw (:mod:`.random_init`), so the slices fit
together only if every rank starts from the same generator state. As DTensor's
``OffsetBasedRNGTracker`` does for FSDP2 on GPU, the first random op on a ragged DTensor
first gives every rank the state of the mesh's first rank (rank 0 on the default mesh): one
broadcast of the fixed-size state per mesh dim, not one per parameter. Afterwards every rank
draws the same amounts, so the states stay equal without further exchanges.

Differences from DTensor's tracker, each deliberate: the exchange is armed again by every
``fully_shard`` (DTensor's once per process would leave a model built later in the same
process with whatever states the ranks have drifted to); it runs over the DTensor's own mesh,
not the world (ranks outside it, other pipeline stages with their own seeds, neither take
part nor are overwritten); and it runs for CPU generators too (DTensor's tracker is
accelerator-only, so FSDP2 on CPU draws each shard from the rank's own generator). A draw
with an explicit ``generator=`` is the caller's to keep in step, as DTensor leaves it.

Armed or not is kept per world (the default process group), not per process: ranks run as
threads of one process (a threaded process group) each have their own world and must each
take part in their own broadcast.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["default_generator", "sync_generator_at_next_draw", "sync_generator_once"]

# The worlds (default groups, held weakly) whose ranks have synced since the last arming; a
# new world starts armed, and every fully_shard arms its world again.
_SYNCED: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def sync_generator_at_next_draw() -> None:
    """The next random op on a ragged DTensor first syncs the generator over its mesh
    (``fully_shard`` calls this on every rank: a new unit may be initialised next)."""
    if dist.group.WORLD is not None:
        _SYNCED.discard(dist.group.WORLD)


def default_generator(device: torch.device) -> torch.Generator:
    """The generator a random op on ``device`` draws from when given none."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


def sync_generator_once(mesh: DeviceMesh, device: torch.device) -> None:
    """If armed: set ``device``'s default generator on every rank of ``mesh`` to the state of
    the mesh's first rank (a collective over the mesh), and disarm."""
    world = dist.group.WORLD
    assert world is not None  # a mesh exists only in an initialised world
    if world in _SYNCED:
        return
    generator = default_generator(device)
    wire = generator.get_state().to(_comm_device(mesh))
    # After dim d's broadcast a rank holds the state of the rank at coordinate 0 on dims 0..d.
    for dim in range(mesh.ndim):
        dist.broadcast(wire, group=mesh.get_group(dim), group_src=0)
    generator.set_state(wire.cpu())
    _SYNCED.add(world)


def _comm_device(mesh: DeviceMesh) -> torch.device:
    """Where the mesh's collectives take their tensors (its process groups' device)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
