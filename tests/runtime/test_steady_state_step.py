"""A steady-state training step (after warm-up) neither reads a tensor back to the host nor
allocates a buffer that outlives it, as FSDP2's: what a CUDA graph of the step needs.

Each parametrization trains the test decoder (a unit per block and the root, uneven shapes,
tied weights) with torch's AdamW at W=2, ours and FSDP2 side by side, warms up, then records
steady steps phase by phase (forward, backward, optimizer step, ``zero_grad``) under a
dispatch mode that sees every op, those inside DTensor's dispatch included:

* host reads: an op that hands a tensor's value to Python (``item``, ``bool``, ``equal``,
  ``tolist``), one whose output shape depends on values (``nonzero``, boolean indexing,
  ``unique``), a tensor made from host data (``torch.tensor``, list indexing: a copy from
  pageable host memory on CUDA) and a copy between devices. The only ones allowed are
  AdamW's reads of its ``step`` counters, which torch keeps on the host unless
  ``capturable=True`` (no device sync on CUDA), in the same number as FSDP2's.
* buffers: every DBuffer keeps its sharded buffer (same storage, the parameters still its
  views) and its unsharded parameter and gradient tensors (their memory freed and re-grown,
  the views kept); the buffers the runtime allocates in a step are freed in it, the same
  bytes each step; the step's allocating ops are no more than FSDP2's. The sharded gradients
  are allocated by backward and freed by ``zero_grad()`` as FSDP2's; with
  ``zero_grad(set_to_none=False)`` both engines keep them at the same addresses.

The checks can fail: an injected ``.item()`` in the runtime (on a DBuffer's all-gather) is
caught, and the step is then no longer clean.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.models import local_batch, loss_fn, make_decoder
from tests.support.parity import adamw, shard_decoder
from vescale_plugins import fully_shard
from vescale_plugins.dbuffer import DBuffer, observer

aten = torch.ops.aten
WARMUP_STEPS = 3
STEADY_STEPS = 2
PHASES = ("forward", "backward", "optimizer step", "zero_grad")

# Ops that return a tensor's value to Python, or whose output shape depends on values.
_READS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_consecutive.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.repeat_interleave.Tensor,
}
_ALLOCATING = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.zeros.default,
    aten.new_zeros.default,
    aten.full.default,
    aten.new_full.default,
}


def _host_sync(func, args, kwargs) -> str | None:
    """What makes this op a host sync (a read, host data to a device, a copy across devices)."""
    if func in _READS:
        return str(func)
    if func is aten.lift_fresh.default:
        return "a tensor made from host data"
    if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
            return f"{func} with a boolean mask"
    if func is aten.copy_.default and args[0].device != args[1].device:
        return f"copy {args[1].device} -> {args[0].device}"
    if func is aten._to_copy.default and kwargs.get("device") not in (None, args[0].device):
        return f"to {kwargs['device']} from {args[0].device}"
    return None


class _StepOps(TorchDispatchMode):
    """Records the host syncs and allocating ops of what runs under it. A DTensor's op is
    handed on (``NotImplemented``), so the ops its dispatch runs are seen too.
    ``allowed``: data pointers of tensors that live on the host by design (a read of one is
    counted apart)."""

    def __init__(self, allowed: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.allowed = allowed
        self.syncs: list[str] = []
        self.allowed_reads = 0
        self.allocations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if any(t is not torch.Tensor for t in types):  # fake tensors of sharding propagation
            return func(*args, **kwargs)
        sync = _host_sync(func, args, kwargs)
        if sync is not None:
            if func is aten._local_scalar_dense.default and args[0].data_ptr() in self.allowed:
                self.allowed_reads += 1
            else:
                self.syncs.append(sync)
        self.allocations += func in _ALLOCATING
        return func(*args, **kwargs)

    def __enter__(self):
        # ``tolist`` and ``numpy`` read without dispatching an op.
        self._patches = contextlib.ExitStack()
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)

            def reading(tensor, *a, _original=original, _name=name, **k):
                self.syncs.append(f"Tensor.{_name}")
                return _original(tensor, *a, **k)

            self._patches.enter_context(mock.patch.object(torch.Tensor, name, reading))
        return super().__enter__()

    def __exit__(self, *exc):
        self._patches.close()
        return super().__exit__(*exc)


class _BufferEvents:
    """The runtime's buffer observer: allocations and frees per kind (bytes)."""

    def __init__(self) -> None:
        self.allocated: Counter[str] = Counter()
        self.freed: Counter[str] = Counter()

    def now(self) -> float:
        return 0.0

    def buffer_allocated(self, kind: str, nbytes: int) -> None:
        self.allocated[kind] += nbytes

    def buffer_freed(self, kind: str, nbytes: int) -> None:
        self.freed[kind] += nbytes

    def collective_issued(self, kind, unit, nbytes, dtype) -> None:
        return None

    def collective_enqueued(self, token) -> None:
        pass

    def collective_done(self, token, wait_started) -> None:
        pass


def _dbuffers(model: torch.nn.Module) -> list[DBuffer]:
    units = {id(u): u for m in model.modules() if (u := getattr(m, "_vescale_fsdp_unit", None)) is not None}
    return [b for unit in units.values() for b in unit.dbuffers]


def _buffers(model: torch.nn.Module) -> dict[str, object]:
    """Each DBuffer's persistent parts, by name: the sharded buffer and its address, the
    unsharded parameter and gradient tensors (objects: their memory comes and goes, the
    tensors and the views cut from them stay); each parameter's local shard's address."""
    parts: dict[str, object] = {}
    for i, b in enumerate(_dbuffers(model)):
        parts |= {
            f"dbuffer {i} sharded": b.sharded,
            f"dbuffer {i} sharded address": b.sharded.data_ptr(),
            f"dbuffer {i} unsharded": b._unsharded.tensor,
            f"dbuffer {i} unsharded grads": b._unsharded_grad.tensor,
        }
    return parts | {f"{name} address": p.to_local().data_ptr() for name, p in model.named_parameters()}


def _made_anew(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """The parts that are not the same object (or address) after a step as before it."""
    assert before.keys() == after.keys()
    return [k for k in before if not (before[k] is after[k] or (isinstance(before[k], int) and before[k] == after[k]))]


def _steps(model, optimizer, first: int, count: int, set_to_none: bool = True) -> list[dict]:
    """``count`` training steps from batch ``first``, each phase under its own recorder."""
    done = []
    for step in range(first, first + count):
        tokens, targets = local_batch(step)  # the batch is the data loader's, not the step's
        allowed = frozenset(s["step"].data_ptr() for s in optimizer.state.values())
        modes = {phase: _StepOps(allowed) for phase in PHASES}
        events = _BufferEvents()
        with observer.observed_by(events):
            with modes["forward"]:
                loss = loss_fn(model(tokens), targets)
            with modes["backward"]:
                loss.backward()
            with modes["optimizer step"]:
                optimizer.step()
            with modes["zero_grad"]:
                optimizer.zero_grad(set_to_none=set_to_none)
        done.append(
            {
                "syncs": {phase: m.syncs for phase, m in modes.items()},
                "allowed_reads": sum(m.allowed_reads for m in modes.values()),
                "allocations": sum(m.allocations for m in modes.values()),
                "allocated": dict(events.allocated),
                "freed": dict(events.freed),
                "grad addresses": [
                    None if p.grad is None else p.grad.to_local().data_ptr() for p in model.parameters()
                ],
            }
        )
    return done


def _steady_state(mixed: bool, reshard: bool) -> dict:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    kwargs = dict(reshard_after_forward=reshard, **({"mp_policy": policy} if mixed else {}))
    out = {}
    for name, shard in (("vescale", fully_shard), ("fsdp2", torch_fully_shard)):
        model = shard_decoder(make_decoder(), shard=shard, **kwargs)
        optimizer = adamw(model)
        _steps(model, optimizer, 0, WARMUP_STEPS)
        before = _buffers(model) if name == "vescale" else None
        out[name] = _steps(model, optimizer, WARMUP_STEPS, STEADY_STEPS)
        # zero_grad(set_to_none=False) keeps the gradients, and so their buffers, from step to step.
        out[f"{name} kept grads"] = _steps(model, optimizer, WARMUP_STEPS + STEADY_STEPS, 2, set_to_none=False)
        if before is not None:
            out["made anew"] = _made_anew(before, _buffers(model))
            out["dbuffers"] = len(_dbuffers(model))
            out["injected"] = _with_injected_read(model, optimizer)
    return out


def _with_injected_read(model, optimizer) -> dict:
    """One more step with a ``.item()`` in the runtime (each DBuffer's all-gather reads its
    shard's first element): the recorder must see it."""
    all_gather = DBuffer.all_gather

    def reading(self, *args, **kwargs):
        self.sharded[0].item()
        return all_gather(self, *args, **kwargs)

    with mock.patch.object(DBuffer, "all_gather", reading):
        return _steps(model, optimizer, WARMUP_STEPS + STEADY_STEPS + 2, 1)[0]


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no_reshard"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_steady_step_never_syncs_the_host_nor_allocates_lasting_buffers(dist_run, mixed, reshard):
    result = dist_run(_steady_state, 2, mixed, reshard, timeout=120)[0]
    ours, theirs = result["vescale"], result["fsdp2"]
    for step, (mine, fsdp2) in enumerate(zip(ours, theirs, strict=True)):
        assert mine["syncs"] == {phase: [] for phase in PHASES}, f"steady step {step}"
        assert fsdp2["syncs"] == {phase: [] for phase in PHASES}, f"FSDP2's steady step {step}"
        # AdamW's step counters, one read per parameter, both engines alike.
        assert mine["allowed_reads"] == fsdp2["allowed_reads"]
        assert mine["allowed_reads"] == len(list(make_decoder().parameters()))
        assert mine["allocations"] <= fsdp2["allocations"]
        # Every buffer the runtime allocated in the step was freed in it.
        assert mine["allocated"] == mine["freed"], f"steady step {step}"
        assert mine["allocated"]["unsharded_params"] > 0
    assert result["made anew"] == []
    for key in ("allocated", "freed", "allocations", "syncs"):
        assert ours[0][key] == ours[1][key], key
    for name in ("vescale", "fsdp2"):
        first, second = result[f"{name} kept grads"]
        assert None not in first["grad addresses"], name
        assert first["grad addresses"] == second["grad addresses"], name
        assert second["syncs"] == {phase: [] for phase in PHASES}, name

    # The injected read is seen at every all-gather: each DBuffer's in forward, and in
    # backward those resharded after forward gather again.
    injected = result["injected"]["syncs"]
    assert injected["forward"] == [str(aten._local_scalar_dense.default)] * result["dbuffers"]
    if reshard:
        assert injected["backward"]
    else:
        assert injected["backward"] == []
