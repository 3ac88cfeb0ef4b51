"""One rank of one torchft replica group: a sharded 4-block transformer trained under torchft's
``Manager`` as torchtitan wires it (the cross-group average in ``set_all_reduce_hook``, the
optimizer stepping only when the quorum commits), healed over HTTP, ``PGTransport`` or our ``FlatBufferTransport``.

Run by :mod:`.test_manager_heal` as ``python -m tests.fault_tolerance.ft_train ENGINE
TRANSPORT REPLICA STEPS OUT_DIR SCENARIO`` with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``: the group's own rendezvous) and ``TORCHFT_LIGHTHOUSE``.
Scenarios:

- ``healthy``: both groups from step 0 to the end (the lighthouse wants both);
- ``restart``: replica 0 signals when it reaches step ``WAIT_AT``; the test then starts
  replica 1, late, as a restarted group is;
- ``crash``: both groups start together; replica 1 dies (``os._exit``) before step
  ``CRASH_AT``; the test starts it again (``RESTARTED=1``).

``ASYNC_QUORUM=1`` runs torchft's default asynchronous quorum instead of the synchronous one.
``FT_CASE`` (JSON, :class:`tests.fault_tolerance.ft_case.Case`) picks the rest of the matrix:
the model (the decoder, or the uneven MLP), the state dicts (the modules' own, or DCP's
``get_*_state_dict`` / ``set_*_state_dict``, torchtitan's), the manager's all-reduce hook or
none, a flat or an HSDP (1 x 2) mesh per group, and where replica 1 dies (between two steps,
or inside a backward).

Whenever replica 1 is missing from step ``WAIT_AT`` on, replica 0 waits until replica 1's
manager is up, then steps slowly until the quorum has both groups, so that replica 1 joins,
heals from it and trains on with it. Each rank writes
its final full parameters and optimizer states, its losses and what its transport sent.
"""

from __future__ import annotations

import io
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._serialization import _streaming_save
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import keystr, tree_flatten_with_path
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.checkpointing.pg_transport import PGTransport as TorchftPGTransport
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from tests.fault_tolerance.ft_case import Case, build_model, case_step, die_together
from tests.fault_tolerance.heal import ENGINES
from vescale_plugins.checkpoint.fault_tolerance import FlatBufferTransport, PGTransport

TIMEOUT = timedelta(seconds=30)
WAIT_AT = 3
CRASH_AT = 3


def local_snapshot(state: Any) -> dict[str, Any]:
    """Every leaf of a state dict by its path: a DTensor as (global shape, placements, a copy of
    its local shard), a tensor as a copy, anything else as it is."""
    out: dict[str, Any] = {}
    for path, value in tree_flatten_with_path(state)[0]:
        if isinstance(value, DTensor):
            out[keystr(path)] = (tuple(value.shape), repr(value.placements), value.to_local().detach().clone())
        elif isinstance(value, torch.Tensor):
            out[keystr(path)] = value.detach().clone()
        else:
            out[keystr(path)] = value
    return out


class Recording:
    """A checkpoint transport that records what each heal sends (:func:`local_snapshot` of the
    state dict, by step, for the test to compare with what the healed group loaded) and, for
    HTTP, the bytes its server streams (``torch.distributed._serialization``, torchft's format)."""

    def __init__(self, transport: Any, out: Path, name: str, http: bool) -> None:
        self.transport, self.out, self.name, self.http = transport, out, name, http
        self.messages, self.bytes = 0, 0

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        torch.save(local_snapshot(state_dict["user"]), self.out / f"sent.{self.name}.step{step}.pt")
        if self.http:
            out = io.BytesIO()
            _streaming_save(state_dict, out)
            self.messages, self.bytes = self.messages + 1, self.bytes + len(out.getvalue())
        self.transport.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class CountingGloo(ProcessGroupGloo):
    """torchft's gloo group, counting what point-to-point sends carry (a heal's transport)."""

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.messages, self.bytes = 0, 0

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Any:
        self.messages += len(tensors)
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return super().send(tensors, dst_rank, tag)


def main(engine: str, transport_name: str, replica: int, steps: int, out_dir: Path, scenario: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    case = Case.from_env()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    if case.hsdp:  # HSDP inside the group: 1 replica x 2 shards, 2-D placements
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("hsdp", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    # Groups that start together start equal (torchft's init sync may heal either one from the
    # other at step 0); a restarted group does not, so only its heal can make it equal.
    restarted = replica == 1 and (scenario == "restart" or bool(os.environ.get("RESTARTED")))
    model = build_model(case.model, seed=100 if restarted else 0)
    shard = ENGINES[engine]
    for layer in model.layers:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state_dict() -> dict[str, Any]:
        if case.state == "dcp":  # torchtitan's fault-tolerance path
            return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, inner)}
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        if case.state == "dcp":
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, inner, state["optim"])
        else:
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optim"])
        # What the healed group holds now, in the form its sender sent (compared by the test).
        torch.save(
            local_snapshot({"default": state_dict()}),
            out_dir / f"healed.{replica}.{rank}.step{manager.current_step()}.pt",
        )

    pg = CountingGloo(TIMEOUT)
    transports = {
        "http": lambda: HTTPTransport(TIMEOUT, num_chunks=0),
        "pg": lambda: PGTransport(pg, TIMEOUT, torch.device("cpu")),
        "torchft-pg": lambda: TorchftPGTransport(pg, TIMEOUT, torch.device("cpu")),
        "flat": lambda: FlatBufferTransport(pg, TIMEOUT, torch.device("cpu")),
    }
    transport = Recording(transports[transport_name](), out_dir, f"{replica}.{rank}", http=transport_name == "http")
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{replica}",
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        rank=rank,
        world_size=world,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        # ASYNC_QUORUM=1: torchft's default, the quorum (and a live group's state dict for a
        # heal) in torchft's thread while this thread's forward runs.
        use_async_quorum=bool(os.environ.get("ASYNC_QUORUM")),
        # Both groups start from the same seed, so step 0 needs no sync (torchft's advice); with
        # it, the async quorum heals one group at step 0 and averages that step over one
        # group's gradient, which the sync quorum does not.
        init_sync=False,
        checkpoint_transport=transport,  # type: ignore[arg-type]
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
    )

    def all_reduce_hook(gradient: torch.Tensor) -> None:
        manager.allreduce(gradient).wait()

    for module in model.modules():
        if case.hook and hasattr(module, "set_all_reduce_hook"):
            module.set_all_reduce_hook(all_reduce_hook)
    optimizer = OptimizerWrapper(manager, inner)
    started = out_dir / f"started{replica}.{rank}"
    started.touch()
    losses = []
    try:
        while manager.current_step() < steps:
            step = manager.current_step()
            dies = replica == 1 and scenario == "crash" and step == CRASH_AT and not os.environ.get("RESTARTED")
            if dies:
                started.unlink()
                if case.fail == "boundary":
                    die_together()  # the whole group dies between two steps
            _wait_for_the_other_group(replica, rank, world, scenario, step, manager, out_dir)
            optimizer.zero_grad()  # the quorum, and a heal if this group is behind
            step = manager.current_step()
            inner_step = _StepOnCommit(optimizer, case.hook)
            losses.append((step, case_step(case.model, model, inner_step, step, rank, die_in_backward=dies)))
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            for key, value in inner.state[p].items():
                full[f"{name}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
        sent = transport if transport_name == "http" else pg
        result = {"losses": losses, "full": full, "messages": sent.messages, "bytes": sent.bytes}
        torch.save(result, out_dir / f"result{replica}.{rank}.pt")
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()


def _wait_for_the_other_group(
    replica: int, rank: int, world: int, scenario: str, step: int, manager: Manager, out_dir: Path
) -> None:
    """Before a quorum: hold a group where the scenario needs both groups in that quorum."""
    both_from_start = scenario == "crash" and step == 0  # (healthy: the lighthouse waits)
    if replica == 1 and both_from_start and not os.environ.get("RESTARTED"):
        # The lighthouse (min_replicas=1) would let a group alone form the first quorum:
        # replica 1, up first on a loaded machine, then trained steps 0-2 by itself and
        # crashed before replica 0 joined, leaving nothing to heal from. Wait for replica 0's
        # manager (its started files) and its first heartbeat.
        while not all((out_dir / f"started0.{r}").exists() for r in range(world)):
            time.sleep(0.1)
        time.sleep(0.5)
    if replica == 0 and (both_from_start or step >= WAIT_AT) and manager.num_participants() < 2:
        if step == WAIT_AT:
            (out_dir / f"waiting0.{rank}").touch()
        while scenario != "healthy" and not all((out_dir / f"started1.{r}").exists() for r in range(world)):
            time.sleep(0.1)
        if step > 0:
            time.sleep(0.3)  # replica 1's first quorum request is on its way


class _StepOnCommit:
    """``train_step``'s optimizer: the manager's wrapper steps only if the quorum commits;
    ``zero_grad`` already ran (it starts the quorum), so it is not run again."""

    def __init__(self, optimizer: OptimizerWrapper, hooked: bool) -> None:
        self.optimizer, self.hooked = optimizer, hooked

    def step(self) -> None:
        if not self.optimizer.manager._use_async_quorum or self.hooked:
            self.optimizer.step()
            return
        # Without the manager's all-reduce nothing waits for an async quorum before
        # should_commit: a heal that lands after it is never applied (its step count is), for
        # any engine. torchtitan always reduces through the manager; here, wait as it would.
        self.optimizer.manager.wait_quorum()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.optim.zero_grad()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]), sys.argv[6])
