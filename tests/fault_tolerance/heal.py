"""Rank bodies for healing a replica group over torchft's ``PGTransport``, without a manager.

Four gloo ranks as 2 replica groups x 2 ranks (the mesh's ``replica`` and ``shard`` dims):
each group shards the model over its ``shard`` dim, as each torchft replica group is one
FSDP job. Replica 0 trains (the live group); replica 1 is freshly built (the restarted group)
and heals: each of its ranks receives the state dict of the same-index rank of replica 0 over
the ``replica`` dim's process group, which is what torchft's manager does with its own
process group on a heal (``send_checkpoint`` / ``recv_checkpoint``). The transport's sends are
counted (messages and bytes) by wrapping the process group it is given.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten
from torchft.checkpointing.pg_transport import PGTransport as TorchftPGTransport

import vescale_plugins
import vescale_plugins.optim as vescale_optim
from tests.support.models import PER_RANK, batch, loss_fn, make_decoder
from vescale_plugins.bench.llama import LlamaConfig
from vescale_plugins.checkpoint.fault_tolerance import FlatBufferTransport, PGTransport

TIMEOUT = timedelta(seconds=60)
STEPS = 3
ENGINES = {"torch": torch_fully_shard, "vescale": vescale_plugins.fully_shard}
TRANSPORTS = {"torchft": TorchftPGTransport, "vescale": PGTransport, "flat": FlatBufferTransport}


class CountingGroup:
    """A process group that counts the messages and bytes sent through it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.messages, self.bytes, self.payload = group, 0, 0, 0

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.messages += len(tensors)
        sent = sum(t.numel() * t.element_size() for t in tensors)
        self.bytes += sent
        if tag > 2:  # tags 1 and 2: the metadata's length and pickle (both transports)
            self.payload += sent
        return self.group.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self.group.recv(tensors, src, tag)


def build(engine: str, mesh: Any, layers: int | str, optim: str = "adamw") -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tests' decoder with ``layers`` blocks, or ``"bench"``: the benchmark's default Llama
    (4 blocks, hidden 384, vocabulary 8003: 12.5M parameters), each block a unit; with
    ``optim``: torch's AdamW, or (our engine only) our AdamW8bit (whole 32x32 tiles per
    rank), Muon (AdamW for what Muon is not for) or flat AdamW."""
    if layers == "bench":
        torch.manual_seed(0)
        model: nn.Module = LlamaConfig().build()
    else:
        model = make_decoder(seed=0, layers=int(layers))
    shard = ENGINES[engine]
    kwargs = {"block_size_fn": vescale_optim.tile_rows(32)} if optim == "adamw8bit" else {}
    for layer in model.layers:
        shard(layer, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    optimizer: torch.optim.Optimizer
    if optim == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif optim == "adamw8bit":
        optimizer = vescale_optim.AdamW8bit(model.parameters(), lr=1e-2)
    elif optim == "flat_adamw":
        optimizer = vescale_optim.AdamW(model.parameters(), lr=1e-2)
    else:
        groups = vescale_optim.muon_param_groups(model, adamw_lr=1e-2, adamw_weight_decay=0.05)
        optimizer = vescale_optim.Muon(groups, lr=0.02, weight_decay=0.1)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, shard_rank: int) -> float:
    """One step on the ``shard_rank``-th rows of the step's batch: both replicas see the same."""
    tokens, targets = (t[shard_rank * PER_RANK : (shard_rank + 1) * PER_RANK] for t in batch(step, 2, PER_RANK))
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter's and optimizer state's local shard, as plain tensors (to compare)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.to_local().detach().clone()
        for key, value in optimizer.state[p].items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"{name}.{key}"] = local.detach().clone()
    return out


def heal_over_pg_transport(
    engine: str,
    transport: str,
    layers: int | str = 4,
    in_place: bool = False,
    states: bool = True,
    optim: str = "adamw",
    hsdp: bool = False,
) -> dict[str, Any]:
    """Replica 0 trains ``STEPS`` steps and heals replica 1; both then take one more step.
    With ``hsdp``, each group is an HSDP job (its own 1 x 2 mesh) instead of an FSDP one.

    Returns this rank's replica index, the sends counted on the live side (messages, bytes),
    the heal's wall time (seconds, the receiver's), and (with ``states``) the local state
    after the heal and after the step that follows it, and that step's loss.
    """
    # A shard dim named per case: DTensor's sharding cache matches meshes by equality (their
    # layout and names), so in a worker pool the DTensors of an earlier body's equal mesh come
    # back on that mesh's process groups, and Muon refuses parameters on two groups.
    shard = f"shard_{optim}_{layers}{'_hsdp' if hsdp else ''}"
    if hsdp:  # HSDP inside each group: 1 replica x 2 shards, 2-D placements in the state dicts
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replica", "hsdp", shard))
        unit_mesh = mesh["hsdp", shard]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", shard))
        unit_mesh = mesh[shard]
    replica, shard_rank = mesh.get_local_rank("replica"), mesh.get_local_rank(shard)
    model, optimizer = build(engine, unit_mesh, layers, optim)
    if replica == 0:
        for step in range(STEPS):
            train_step(model, optimizer, step, shard_rank)
    else:  # the restarted group: optimizer states exist (as torchft's first step makes them)
        model.zero_grad()
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
    group = CountingGroup(mesh.get_group("replica"))

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    cls = TRANSPORTS[transport]
    in_place_state = {"state_dict": state} if in_place else {}
    sender = cls(group, TIMEOUT, torch.device("cpu"), **in_place_state)  # type: ignore[arg-type]
    dist.barrier()
    start = time.perf_counter()
    if replica == 0:
        sender.send_checkpoint([1], STEPS, state(), TIMEOUT)
    else:
        received = sender.recv_checkpoint(0, "<n/a>", STEPS, TIMEOUT)
        model.load_state_dict(received["model"])
        optimizer.load_state_dict(received["optim"])
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {"replica": replica, "messages": group.messages, "bytes": group.bytes, "seconds": seconds}
    result["payload"], result["own_bytes"] = group.payload, own_bytes(state())
    result["tensors"] = sum(isinstance(v, torch.Tensor) for v in tree_flatten(state())[0])
    if states:
        result["healed"] = local_state(model, optimizer)
        result["loss"] = train_step(model, optimizer, STEPS, shard_rank)
        result["after"] = local_state(model, optimizer)
    return result


def own_bytes(state_dict: object) -> int:
    """The bytes of the elements of every tensor in ``state_dict`` (a DTensor's local shard)."""
    leaves, _ = tree_flatten(state_dict)
    locals_ = [v.to_local() if isinstance(v, DTensor) else v for v in leaves if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in locals_)


def pickled_sizes(engine: str) -> dict[str, tuple[int, int]]:
    """Per state-dict entry of a 2-rank sharded transformer: (bytes ``torch.save`` writes for
    that entry alone, bytes it writes for a copy of the entry, which owns its storage)."""
    import io

    mesh = init_device_mesh("cpu", (2,))
    model, _ = build(engine, mesh, layers=2)

    def saved(value: torch.Tensor) -> int:
        out = io.BytesIO()
        torch.save(value, out)
        return len(out.getvalue())

    return {name: (saved(value), saved(value.clone())) for name, value in model.state_dict().items()}


def state_dicts_while_training(engine: str, steps: int = 6) -> dict[str, Any]:
    """Train ``steps`` steps twice over 2 ranks: alone, then while another thread takes
    ``model.state_dict()`` and ``optimizer.state_dict()`` in a loop, as torchft's quorum thread
    does for a heal under the asynchronous quorum. Returns both runs' losses, the reader's
    errors and reads, and the entries it saw that were not this rank's shards."""
    import threading

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    model, optimizer = build(engine, mesh, 4)
    alone = [train_step(model, optimizer, step, rank) for step in range(steps)]
    model, optimizer = build(engine, mesh, 4)
    shards = {name: v.to_local().shape for name, v in model.state_dict().items() if isinstance(v, DTensor)}
    stop, errors, reads, unsharded = threading.Event(), [], [0], set()

    def read() -> None:
        while not stop.is_set():
            try:
                state = model.state_dict()
                optimizer.state_dict()
            except Exception as error:  # reported to the test
                errors.append(repr(error))
                return
            reads[0] += 1
            for name, shape in shards.items():
                value = state[name]
                if not isinstance(value, DTensor) or value.to_local().shape != shape:
                    unsharded.add(name)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        losses = [train_step(model, optimizer, step, rank) for step in range(steps)]
    finally:
        stop.set()
        reader.join()
    return {"alone": alone, "losses": losses, "errors": errors, "reads": reads[0], "unsharded": sorted(unsharded)}


def dcp_state_dicts_inside_a_forward(engine: str) -> dict[str, Any]:
    """Another thread takes DCP's ``get_model_state_dict`` and ``get_optimizer_state_dict``
    while the main thread is inside the second block's forward (held there until the thread is
    done, so the two always meet: a thread racing freely meets a forward only sometimes).
    Returns the thread's errors, how many parameters its optimizer state dict names and those
    of them that are not the optimizer's, how many the optimizer holds states for, its
    model entries that were not this rank's shards, and the step's loss beside the same step
    without the thread."""
    import threading

    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    model, optimizer = build(engine, mesh, 4)
    train_step(model, optimizer, 0, rank)  # optimizer states exist, as in a live group
    alone_model, alone_optimizer = build(engine, mesh, 4)
    train_step(alone_model, alone_optimizer, 0, rank)
    alone = train_step(alone_model, alone_optimizer, 1, rank)
    shards = {name: v.to_local().shape for name, v in model.state_dict().items() if isinstance(v, DTensor)}
    inside, done, seen, errors = threading.Event(), threading.Event(), {}, []

    def hold(*_: Any) -> None:
        inside.set()
        done.wait(60)

    def take() -> None:
        inside.wait(60)
        try:
            seen["model"] = get_model_state_dict(model)
            seen["optim"] = get_optimizer_state_dict(model, optimizer)
        except Exception as error:  # reported to the test
            errors.append(repr(error))
        done.set()

    handle = model.layers[1].register_forward_pre_hook(hold)
    reader = threading.Thread(target=take)
    reader.start()
    try:
        loss = train_step(model, optimizer, 1, rank)
    except Exception as error:  # FSDP2's forward meets the reader's reshard
        loss = float("nan")
        errors.append(f"main thread: {error!r}")
    finally:
        done.set()
        reader.join()
        handle.remove()
    unsharded = [
        name
        for name, value in seen.get("model", {}).items()
        if name in shards and (not isinstance(value, DTensor) or value.to_local().shape != shards[name])
    ]
    # Each name the thread's optimizer state dict keys by is one of the optimizer's parameters.
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = sorted(seen.get("optim", {}).get("state", {}))
    return {
        "errors": errors,
        "named": len(named),
        "foreign": [name for name in named if id(model.get_parameter(name)) not in owned],
        "states": len(optimizer.state),
        "unsharded": unsharded,
        "loss": loss,
        "alone": alone,
    }
