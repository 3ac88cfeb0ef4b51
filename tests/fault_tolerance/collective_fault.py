"""A peer dying inside a unit's all-gather or reduce-scatter: what the survivor sees, and its rejoin.

Two gloo ranks train a sharded 1-block decoder (units ``layers.0`` and the root) one step and
save a DCP checkpoint. In the next step rank 1 dies (``os._exit``) at a precise point:

- ``forward``: in a forward pre-hook on ``layers.0`` that runs before the engine's own, so
  rank 0 is alone in ``layers.0``'s forward all-gather (forward prefetch is off: a prefetched
  gather could have been fed before the death);
- ``backward``: in a hook on the gradient of ``layers.0``'s input, after that block's
  backward and before its post-backward, so rank 0 is alone in ``layers.0``'s
  reduce-scatter (every earlier collective was waited on by both ranks).

Rank 0 records the error, resets the root (``reset_iter_state()``), destroys its process
group, joins a new one with a replacement rank 1 (started by the launcher once rank 1 is
gone), builds the model again, loads the checkpoint and trains 2 more steps; so does the
replacement. Each rank's results come back on a queue; every process runs under a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import vescale_plugins
from tests.support.models import local_batch, loss_fn, make_decoder
from vescale_plugins.tools import launch

ENGINES = {"vescale": vescale_plugins.fully_shard, "torch": torch_fully_shard}
# How long a collective may wait for a peer (gloo's timeout): a death usually shows sooner,
# as the closed connection.
COLLECTIVE_TIMEOUT_S = 10.0
# The new group's: its rendezvous waits for the other process to get there.
REJOIN_TIMEOUT_S = 60.0
DEADLINE_S = 90.0  # a whole case, per engine
DEATH_EXIT = 17
FAULT_STEP, STEPS_AFTER = 1, 2


def _build(engine: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_decoder(seed=0, layers=1)
    shard = ENGINES[engine]
    for layer in model.layers:
        shard(layer)
    shard(model)
    for module in model.modules():
        if hasattr(module, "set_modules_to_forward_prefetch"):
            module.set_modules_to_forward_prefetch([])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    tokens, targets = local_batch(step)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _die_at(model: torch.nn.Module, phase: str) -> None:
    """Make this rank exit at ``phase``'s point of the next step (see the module docstring)."""
    block = model.layers[0]

    def die(*_: Any) -> None:
        os._exit(DEATH_EXIT)

    if phase == "forward":
        block.register_forward_pre_hook(die, prepend=True)
    else:

        def hook_input_gradient(module: torch.nn.Module, args: tuple) -> None:
            args[0].register_hook(die)

        block.register_forward_pre_hook(hook_input_gradient)


def _faulty_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine: str) -> dict[str, Any]:
    """The step rank 1 dies in, on rank 0: the error, and the state it leaves."""
    threads_before = {t.name for t in threading.enumerate()}
    start = time.monotonic()
    try:
        _step(model, optimizer, FAULT_STEP)
    except RuntimeError as err:
        error: BaseException = err
    else:
        raise AssertionError("the step in which the peer died did not fail")
    seen: dict[str, Any] = {
        "seconds": time.monotonic() - start,
        "type": type(error).__name__,
        "text": str(error),
        "cause": None if error.__cause__ is None else f"{type(error.__cause__).__name__}: {error.__cause__}",
        # Sharded gradients after the error: None or untouched, never a partial reduce.
        "grads": {name: _local(p.grad) for name, p in model.named_parameters()},
    }
    del error
    if engine == "vescale":
        start = time.monotonic()
        model.reset_iter_state()  # type: ignore[operator]  # FSDPModule's method
        seen["reset_seconds"] = time.monotonic() - start
        units = [m._vescale_fsdp_unit for m in model.modules() if hasattr(m, "_vescale_fsdp_unit")]
        state = units[0].context
        seen["pending"] = [u.has_pending_unshard for u in units] + [len(list(state.in_flight()))]
        seen["grads_after_reset"] = [name for name, p in model.named_parameters() if p.grad is not None]
        try:  # the old group is broken: a new step says so at once instead of waiting
            start = time.monotonic()
            _step(model, optimizer, FAULT_STEP)
        except RuntimeError as err:
            seen["next_step"] = (str(err), time.monotonic() - start)
    dist.destroy_process_group()
    seen["threads_left"] = sorted({t.name for t in threading.enumerate()} - threads_before)
    return seen


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient's local values (FSDP2's are plain tensors when its backward failed midway)."""
    if grad is None:
        return None
    return (grad.to_local() if hasattr(grad, "to_local") else grad).detach().clone()


def _load_and_train(engine: str, checkpoint: str) -> dict[str, Any]:
    """(In the new group) A fresh model from the checkpoint, trained ``STEPS_AFTER`` steps."""
    model, optimizer = _build(engine)
    _step(model, optimizer, 0)  # optimizer states to load into (overwritten)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    losses = [_step(model, optimizer, FAULT_STEP + k) for k in range(STEPS_AFTER)]
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "full": full}


def rank_main(
    rank: int, role: str, engine: str, phase: str, ports: tuple[int, int], out: str, results: Any, parent: int
) -> None:
    """One process: ``role`` is ``first`` (ranks 0, 1 of the first group) or ``replacement``."""
    launch.exit_when_orphaned(parent)
    torch.set_num_threads(1)
    checkpoint = str(Path(out) / "checkpoint")
    try:
        if role == "replacement":
            launch.join_process_group(rank, 2, ports[1], "gloo", REJOIN_TIMEOUT_S)
            value: dict[str, Any] = _load_and_train(engine, checkpoint)
            dist.destroy_process_group()
        else:
            launch.join_process_group(rank, 2, ports[0], "gloo", COLLECTIVE_TIMEOUT_S)
            torch.manual_seed(1234)
            model, optimizer = _build(engine)
            _step(model, optimizer, 0)
            dcp.save(
                {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                checkpoint_id=checkpoint,
            )
            if rank == 1:
                _die_at(model, phase)
                _step(model, optimizer, FAULT_STEP)
                raise AssertionError(f"rank 1 did not reach its death point ({phase})")
            value = {"fault": _faulty_step(model, optimizer, engine)}
            del model, optimizer
            launch.join_process_group(rank, 2, ports[1], "gloo", REJOIN_TIMEOUT_S)
            value.update(_load_and_train(engine, checkpoint))
            dist.destroy_process_group()
        # Through a file: tensors on a queue are shared memory this process's exit may take away.
        torch.save(value, Path(out) / f"{role}{rank}.pt")
        results.put((role, rank, True, None))
    except BaseException:
        results.put((role, rank, False, traceback.format_exc()))


def run_case(engine: str, phase: str, out: Path) -> dict[str, Any]:
    """Run one engine through the fault at ``phase`` and the rejoin; rank 0's and the
    replacement's results. Raises with each failing rank's traceback, or at the deadline."""
    context = mp.get_context("forkserver")
    # (Unless the test suite's pool started the fork server already, with its own preload.)
    context.set_forkserver_preload(["torch", "torch.distributed", "vescale_plugins", __name__])
    stores = [launch.rendezvous_store(2), launch.rendezvous_store(2)]
    ports = (stores[0].port, stores[1].port)
    results = context.Queue()

    def start(rank: int, role: str) -> Any:
        p = context.Process(
            target=rank_main, args=(rank, role, engine, phase, ports, str(out), results, os.getpid()), daemon=True
        )
        p.start()
        return p

    # The replacement starts with the others: it waits in the new group's rendezvous.
    first = [start(0, "first"), start(1, "first")]
    processes = [*first, start(1, "replacement")]
    deadline = time.monotonic() + DEADLINE_S
    got: dict[tuple[str, int], Any] = {}
    try:
        while first[1].is_alive() and time.monotonic() < deadline and all(ok for ok, _ in got.values()):
            _drain(results, got, deadline=min(deadline, time.monotonic() + 0.5))
        first[1].join(timeout=1)
        if first[1].exitcode != DEATH_EXIT:
            _drain(results, got, deadline=time.monotonic() + 1)
            raise AssertionError(f"{engine}: rank 1 exited with {first[1].exitcode}, not at its death point: {got}")
        while len(got) < 2 and time.monotonic() < deadline:
            _drain(results, got, deadline=min(deadline, time.monotonic() + 0.5))
            if any(not ok for ok, _ in got.values()):
                break
        failures = {key: value for key, (ok, value) in got.items() if not ok}
        if failures or len(got) < 2:
            raise AssertionError(f"{engine} ({phase}): failed or timed out after {DEADLINE_S:.0f}s: {failures or got}")
        return {key: torch.load(out / f"{key[0]}{key[1]}.pt", weights_only=False) for key in got}
    finally:
        launch.kill(processes)


def _drain(results: Any, got: dict, deadline: float) -> None:
    while True:
        try:
            role, rank, ok, value = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return
        got[(role, rank)] = (ok, value)


class _FailingWork:
    """A collective's work that completes, then raises as a dead peer's would (the real
    messages are exchanged, so the ranks leave no half-done collective behind)."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> bool:
        self.work.wait()
        raise RuntimeError("simulated: Connection closed by peer")


def failing_reduction(hsdp: bool) -> dict[str, Any]:
    """(``dist_run`` body, 2 ranks) A unit's reduce-scatter (1-D mesh, accumulating onto the
    gradients of an earlier backward) or HSDP's all-reduce across replicas (2 x 1 mesh, in
    place) fails on both ranks: the error, and which gradients are left."""
    from torch.distributed.device_mesh import DeviceMesh

    from tests.support.models import TwoBlocks
    from vescale_plugins.dbuffer import buffer, handles

    # Groups of this body's own (the failure marks them broken; the pool's group stays usable).
    if hsdp:  # (init_device_mesh would reuse the pool's group for the replicate dim)
        replicate, shards = dist.new_group([0, 1]), [dist.new_group([r]) for r in range(2)]
        groups = [replicate, shards[dist.get_rank()]]
        mesh = DeviceMesh.from_group(groups, "cpu", mesh=[[0], [1]], mesh_dim_names=("replicate", "shard"))
    else:
        mesh = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu")
    assert all(group is not dist.group.WORLD for group in mesh.get_all_groups())
    torch.manual_seed(0)
    model = TwoBlocks()
    for block in model.blocks:
        vescale_plugins.fully_shard(block, mesh=mesh)
    vescale_plugins.fully_shard(model, mesh=mesh)
    x = torch.randn(4, 6)
    if not hsdp:  # gradients to accumulate onto
        model(x).sum().backward()
    sharded = dict(model.named_parameters())  # the sharded faces, between iterations
    before = {name: _local(p.grad) for name, p in sharded.items()}
    if hsdp:
        real, patched = dist.all_reduce, "all_reduce"
        target: Any = handles.dist
    else:
        real, patched, target = buffer.reduce_scatter_into, "reduce_scatter_into", buffer
    try:
        setattr(target, patched, lambda *args, **kwargs: _FailingWork(real(*args, **kwargs)))
        try:
            model(x).sum().backward()
        except RuntimeError as err:
            error: BaseException = err
        else:
            raise AssertionError("the failing reduction raised nothing")
    finally:
        setattr(target, patched, real)
    # Read at once (the root may still hold its unsharded parameters): the sharded gradients.
    after = {name: _local(p.grad) for name, p in sharded.items()}
    text = str(error)
    del error
    model.reset_iter_state()  # type: ignore[operator]  # FSDPModule's method
    refused = None
    try:  # HSDP: the shard groups are fine, so forward runs; the all-reduce is refused
        model(x).sum().backward()
    except RuntimeError as err:
        refused = str(err)
    return {"text": text, "before": before, "after": after, "refused": refused}
