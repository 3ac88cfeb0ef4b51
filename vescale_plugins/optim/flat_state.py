"""The base of the group-level optimizers: per-parameter state as views of flat run buffers.

``optimizer.state[p]`` keeps torch's shape (a dict of tensors per parameter, DTensors for
DTensor parameters), so ``state_dict()``, ``load_state_dict()``, DCP and full state dicts
work unchanged; underneath, each entry is a view of one flat buffer per contiguous run
(:mod:`.flat`), so a run's step touches a few flat tensors. After ``load_state_dict`` (which
makes new tensors) the next step packs the state back into flat buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from vescale_plugins.optim.closure import evaluate_closure
from vescale_plugins.optim.flat import Run, contiguous_runs, local_of
from vescale_plugins.ragged.dtensor import with_own_bytes

__all__ = ["FlatStateOptimizer", "StateSpec"]


class StateSpec:
    """One state entry of each parameter, as functions of the parameter's local tensor.

    ``dtype(local)``; ``numel(local)``: its elements in the run's flat buffer, or ``None`` for
    element-wise state laid out like the parameters (the flat buffer spans the run, padding
    included); ``local_shape(local)``: the view's shape; ``wrap(view, param)``: the entry in
    ``optimizer.state`` (a DTensor for DTensor parameters).
    """

    def __init__(
        self,
        dtype: Callable[[torch.Tensor], torch.dtype],
        numel: Callable[[torch.Tensor], int] | None,
        local_shape: Callable[[torch.Tensor], tuple[int, ...]],
        wrap: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.dtype, self.numel, self.local_shape, self.wrap = dtype, numel, local_shape, wrap


class FlatStateOptimizer(Optimizer):
    """Subclasses define ``state_specs(group)`` (name -> :class:`StateSpec`) and
    ``step_run(run, group, flats, step)``; ``flats`` maps each state name to its flat buffer
    and ``member_offsets[name]`` to each member's offset in it."""

    def state_specs(self, group: dict[str, Any]) -> dict[str, StateSpec]:
        raise NotImplementedError

    def step_run(
        self, run: Run, group: dict[str, Any], flats: dict[str, torch.Tensor], offsets: dict[str, list[int]], step: int
    ) -> None:
        raise NotImplementedError

    def check_param(self, name: str, param: torch.Tensor) -> None:
        """Raise ``ValueError`` for a parameter this optimizer cannot step (default: none)."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        for group_index, group in enumerate(self.param_groups):
            names = group.get("param_names") or [None] * len(group["params"])
            for index, (param, name) in enumerate(zip(group["params"], names)):
                self.check_param(repr(name) if name else f"parameter {index} of param group {group_index}", param)
        # Run layout key -> the flat buffers its members' state entries are views of.
        self._flat_cache: dict[tuple, dict[str, torch.Tensor]] = {}
        self.register_state_dict_post_hook(_states_over_own_bytes, prepend=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch casts floating-point state to the parameter's dtype; restore each entry's own
        # dtype (8-bit codes are integers, exactly representable in fp32).
        for group in self.param_groups:
            specs = self.state_specs(group)
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                for name, spec in specs.items():
                    if name in state and state[name].dtype != spec.dtype(p):
                        state[name] = state[name].to(spec.dtype(p))
        self._flat_cache.clear()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            specs = self.state_specs(group)
            for index, p in enumerate(params):
                state = self.state[p]
                if "step" not in state:
                    # Also here: front ends (Accelerate) swap sharded parameters in after __init__.
                    self.check_param(f"parameter {index} of param group {self.param_groups.index(group)}", p)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["step"] = state["step"] + 1  # a new tensor: a loaded one may be shared
            # Parameters at different step counts (added later) step in separate runs.
            by_step: dict[int, list[torch.Tensor]] = {}
            for p in params:
                by_step.setdefault(int(self.state[p]["step"].item()), []).append(p)
            for step, members in by_step.items():
                for run in contiguous_runs(members):
                    flats, offsets = self._flat_state(run, specs)
                    if run.span:
                        self.step_run(run, group, flats, offsets, step)
        return loss

    def _flat_state(
        self, run: Run, specs: dict[str, StateSpec]
    ) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        """The run's flat state buffers; (re)packs members' state into them when needed."""
        offsets: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for name, spec in specs.items():
            if spec.numel is None:
                offsets[name] = [m.offset for m in run.members]
                sizes[name] = run.span
            else:
                running, offsets[name] = 0, []
                for m in run.members:
                    offsets[name].append(running)
                    running += spec.numel(m.local)
                sizes[name] = running
        flats = self._flat_cache.get(run.key)
        if flats is not None and self._is_packed(run, specs, flats, offsets):
            return flats, offsets
        device = run.members[0].local.device
        flats = {}
        for name, spec in specs.items():
            dtype = spec.dtype(run.members[0].local)
            if spec.numel is None and len(run.members) == 1:
                flats[name] = torch.zeros(run.members[0].local.shape, dtype=dtype, device=device)
            else:
                flats[name] = torch.zeros(sizes[name], dtype=dtype, device=device)
        for index, m in enumerate(run.members):
            state = self.state[m.param]
            for name, spec in specs.items():
                view = self._member_view(flats[name], spec, m.local, offsets[name][index])
                old = state.get(name)
                if old is not None:
                    view.copy_(local_of(old).reshape(view.shape))
                state[name] = spec.wrap(view, m.param)
        self._flat_cache[run.key] = flats
        return flats, offsets

    @staticmethod
    def _member_view(flat: torch.Tensor, spec: StateSpec, local: torch.Tensor, offset: int) -> torch.Tensor:
        shape = spec.local_shape(local)
        if flat.dim() != 1:  # a run of one stepped in its own shape
            return flat.view(shape)
        return flat[offset : offset + math.prod(shape)].view(shape)

    def _is_packed(
        self, run: Run, specs: dict[str, StateSpec], flats: dict[str, torch.Tensor], offsets: dict[str, list[int]]
    ) -> bool:
        for index, m in enumerate(run.members):
            state = self.state[m.param]
            for name in specs:
                entry = state.get(name)
                if entry is None:
                    return False
                local = local_of(entry)
                expected = flats[name].data_ptr() + offsets[name][index] * flats[name].element_size()
                if (
                    local.data_ptr() != expected
                    or local.numel()
                    and local.untyped_storage().data_ptr() != flats[name].untyped_storage().data_ptr()
                ):
                    return False
        return True


def _states_over_own_bytes(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict()``'s states over storages of exactly their own bytes: views of the flat
    buffers (the same memory, no copy), so consumers that serialise tensors through their
    storages (torchft's ``PGTransport``, ``torch.save`` of one entry) send each state once,
    not its run's whole buffer per parameter; in-place loads into them land in the buffers.
    New dicts: torch's ``state_dict()`` hands out the optimizer's own per-parameter dicts."""
    state_dict["state"] = {
        key: {name: with_own_bytes(value) for name, value in entry.items()}
        for key, entry in state_dict["state"].items()
    }
    return state_dict
