"""Muon on RaggedShard parameters: each matrix orthogonalised once, on a load-balanced root.

``torch.optim.Muon`` (torch 2.13) semantics and arguments, for plain tensors and for the
``nn.Parameter(DTensor)`` parameters of ``vescale_plugins.fully_shard``. A step:

1. Momentum and Nesterov (element-wise) on each rank's local shard, no communication.
2. Each matrix goes to its *root* rank (chosen once, at construction, balancing
   Newton–Schulz cost over the ranks) in buckets of one matrix per root: one
   ``all_to_all_single`` per bucket; the root orthogonalises it; a second all-to-all returns
   every rank its interval of the update (``muon_exchange``). Buckets are issued
   asynchronously, so the next bucket's collectives overlap this one's Newton–Schulz.
3. Decoupled weight decay and the update, on the local shard.

No rank ever holds a matrix it is not the root of (and at most three of its own at a time),
and there is no all-gather. The momentum
buffer is a DTensor with the parameter's layout, so DCP saves and reloads it under any world
size (the roots are recomputed for the new group).

Param groups with ``"algorithm": "adamw"`` are stepped by AdamW (``torch.optim.AdamW``'s
single-tensor math, its state names): one optimizer for a whole model, see
:func:`vescale_plugins.optim.muon_param_groups`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as functional_adam

from vescale_plugins.optim.closure import evaluate_closure
from vescale_plugins.optim.muon_exchange import EXCHANGE_DTYPE, BucketExchange, ExchangePlan, build_exchange_plan
from vescale_plugins.optim.newton_schulz import newton_schulz_for, zeropower_via_newtonschulz
from vescale_plugins.ragged.placement import RaggedShard

__all__ = ["Muon", "DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "EPS"]

# torch.optim.Muon's defaults (Keller Jordan's constants).
EPS = 1e-7
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
ALGORITHMS = ("muon", "adamw")


def adjust_lr(lr: float, adjust_lr_fn: str | None, param_shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of ``param_shape``."""
    rows, cols = param_shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _param_name(group: dict, index: int, group_index: int) -> str:
    names = group.get("param_names")
    return repr(names[index]) if names else f"parameter {index} of param group {group_index}"


class Muon(torch.optim.Optimizer):
    """Muon (``torch.optim.Muon``'s arguments and math) on plain or RaggedShard-sharded matrices.

    Args: as ``torch.optim.Muon``: ``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
    ``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``. A param group may set
    ``"algorithm": "adamw"`` (with ``betas``, ``eps``, ``weight_decay``, ``lr``) for the
    parameters Muon is not for (embeddings, the output head, norms, biases).

    Every Muon parameter must be 2-D, and the DTensor ones must be ``RaggedShard`` on one
    1-D mesh (what ``vescale_plugins.fully_shard`` makes); this is checked at construction,
    before any collective. All ranks must step the same parameters (a parameter without a
    gradient is skipped, as by torch, and must be so on every rank).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            algorithm="muon",
            betas=(0.9, 0.999),
        )
        self._plan: ExchangePlan | None = None
        self._plan_key: tuple[int, ...] | None = None
        # (shape, coefficients, steps, eps) the compiled Newton–Schulz has already run on.
        self._warmed: set[tuple[Any, ...]] = set()
        super().__init__(params, defaults)
        self._build_plan()

    # -- construction ------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(len(self.param_groups) - 1)
        if self._plan_key is not None:  # a group added after construction: new roots for all
            self._build_plan()

    def _check_group(self, group_index: int) -> None:
        group = self.param_groups[group_index]
        if group["algorithm"] not in ALGORITHMS:
            raise ValueError(f"param group {group_index}: algorithm {group['algorithm']!r} is not one of {ALGORITHMS}")
        for index, p in enumerate(group["params"]):
            if torch.is_complex(p):
                raise ValueError(
                    f"Muon: {_param_name(group, index, group_index)} is complex; Muon does not support complex parameters"
                )
            if group["algorithm"] == "muon" and p.ndim != 2:
                raise ValueError(
                    f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()} "
                    f"({_param_name(group, index, group_index)}); put it in an AdamW group "
                    f"(vescale_plugins.optim.muon_param_groups does this)"
                )
            if group["algorithm"] == "muon" and isinstance(p, DTensor):
                self._check_sharding(p, _param_name(group, index, group_index))

    @staticmethod
    def _check_sharding(p: DTensor, name: str) -> None:
        placements = p.placements
        if p.device_mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], RaggedShard):
            hint = (
                (
                    " (an FSDP2 shard from torch.distributed.fsdp.fully_shard: shard the model with "
                    "vescale_plugins.fully_shard instead, whose RaggedShard pieces Muon can route to a root "
                    "rank without an all-gather)"
                )
                if any(pl.is_shard() for pl in placements)
                else ""
            )
            raise ValueError(
                f"Muon: {name} is a DTensor with placements {placements} on a {p.device_mesh.ndim}-D mesh; "
                f"Muon needs RaggedShard on a 1-D mesh{hint}"
            )

    def _muon_params(self) -> list[tuple[dict, Tensor, str]]:
        return [
            (g, p, _param_name(g, i, gi))
            for gi, g in enumerate(self.param_groups)
            if g["algorithm"] == "muon"
            for i, p in enumerate(g["params"])
        ]

    def _muon_params_key(self) -> tuple[int, ...]:
        return tuple(id(p) for _, p, _ in self._muon_params())

    def _build_plan(self) -> None:
        """Roots and buckets of the sharded matrices (pure arithmetic: no collective)."""
        self._plan_key = self._muon_params_key()
        sharded = [
            (g, p, name) for g, p, name in self._muon_params() if isinstance(p, DTensor) and p.device_mesh.size() > 1
        ]
        self._slot_of: dict[int, int] = {}  # id(parameter) -> matrix index in the plan
        self._plan, self._group, self._rank = None, None, 0
        if not sharded:
            return
        groups = {p.device_mesh.get_group() for _, p, _ in sharded}
        if len(groups) > 1:
            first = sharded[0]
            other = next(
                item for item in sharded if item[1].device_mesh.get_group() is not first[1].device_mesh.get_group()
            )
            raise ValueError(
                f"Muon: {first[2]} and {other[2]} are sharded over different process groups; one Muon optimizer "
                f"exchanges matrices within one group: make one optimizer per group"
            )
        self._group = groups.pop()
        self._rank, world = dist.get_rank(self._group), dist.get_world_size(self._group)
        shapes: list[tuple[int, int]] = []
        spans, steps = [], []
        for g, p, _ in sharded:
            placement = p.placements[0]
            assert isinstance(placement, RaggedShard)  # _check_sharding
            layout = placement.layout(p.shape)
            rows, cols = p.shape  # Muon's parameters are matrices (_check_group)
            shapes.append((rows, cols))
            spans.append([(s.offset, s.length) for s in layout.slices])
            steps.append(g["ns_steps"])
        self._plan = build_exchange_plan(shapes, spans, world, steps)
        self._slot_of = {id(p): i for i, (_, p, _) in enumerate(sharded)}

    @property
    def exchange_plan(self) -> ExchangePlan | None:
        """The roots and buckets of the sharded matrices (None when nothing is sharded)."""
        return self._plan

    # -- step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step: every group in order, then the sharded matrices' exchange."""
        loss = evaluate_closure(closure)
        if self._muon_params_key() != self._plan_key:
            # A front end (Accelerate, Fabric) swapped the parameters for their sharded
            # versions after construction: check them and plan again, still before any collective.
            for group_index in range(len(self.param_groups)):
                self._check_group(group_index)
            self._build_plan()
        # matrix index -> (bfloat16 local piece of the update, local parameter, adjusted lr)
        pending: dict[int, tuple[Tensor, Tensor, float]] = {}
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
            else:
                self._muon_local_step(group, pending)
        if pending:
            self._exchange_and_apply(pending)
        return loss

    def _muon_local_step(self, group: dict, pending: dict[int, tuple[Tensor, Tensor, float]]) -> None:
        lr = group["lr"].item() if isinstance(group["lr"], Tensor) else group["lr"]
        momentum, weight_decay = group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf, param = _local(p.grad), _local(state["momentum_buffer"]), _local(p)
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            adjusted_lr = adjust_lr(lr, group["adjust_lr_fn"], p.shape)
            slot = self._slot_of.get(id(p))
            if slot is None:
                # Plain tensor, or a DTensor on one rank: the local tensor is the matrix.
                matrix = update.view(p.shape) if isinstance(p, DTensor) else update
                orthogonal = newton_schulz_for(update.device)(
                    matrix, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                param.mul_(1 - lr * weight_decay)
                param.add_(orthogonal.view(param.shape), alpha=-adjusted_lr)
            else:
                # Rounding to bfloat16 is what Newton–Schulz does first; doing it here halves the bytes.
                pending[slot] = (update.reshape(-1).to(EXCHANGE_DTYPE), param, adjusted_lr)
                param.mul_(1 - lr * weight_decay)

    def _exchange_and_apply(self, pending: dict[int, tuple[Tensor, Tensor, float]]) -> None:
        """Send the pieces to their roots, orthogonalise, bring the updates back, apply them."""
        plan, process_group = self._plan, self._group
        assert plan is not None and process_group is not None  # pending matrices are sharded: _build_plan planned them
        groups = {
            self._slot_of[id(p)]: g
            for g in self.param_groups
            if g["algorithm"] == "muon"
            for p in g["params"]
            if id(p) in self._slot_of
        }
        device = next(iter(pending.values()))[0].device
        newton_schulz = newton_schulz_for(device)
        exchanges = [
            BucketExchange(plan, [i for i in bucket if i in pending], self._rank, process_group)
            for bucket in plan.buckets
        ]
        exchanges = [e for e in exchanges if e.bucket]
        if newton_schulz is not zeropower_via_newtonschulz:
            self._warm_up(newton_schulz, [i for i in pending if plan.matrices[i].root == self._rank], groups, device)
        pieces = {i: piece for i, (piece, _, _) in pending.items()}
        scattered: deque = deque()
        returned: deque = deque()

        def apply(exchange: BucketExchange) -> None:
            for index, update in exchange.returned_pieces():
                _, param, adjusted_lr = pending[index]
                param.view(-1).add_(update, alpha=-adjusted_lr)

        launched = 0

        def launch_next_scatter() -> None:
            nonlocal launched
            if launched < len(exchanges):
                scattered.append(exchanges[launched].scatter_to_roots(pieces, device))
                launched += 1

        launch_next_scatter()
        for exchange in exchanges:
            # Bucket k + 1 travels to its roots while bucket k is orthogonalised, and bucket
            # k - 1's updates travel back: at most three of this rank's matrices in full.
            launch_next_scatter()
            scattered.popleft().wait()
            matrix = exchange.gathered_matrix()
            orthogonal = None
            if matrix is not None:
                assert exchange.own is not None  # the matrix gathered is this rank's own
                g = groups[exchange.own]
                orthogonal = newton_schulz(matrix, g["ns_coefficients"], g["ns_steps"], g["eps"])
            returned.append((exchange, exchange.return_to_owners(orthogonal, device)))
            if len(returned) > 1:
                done, work = returned.popleft()
                work.wait()
                apply(done)
        while returned:
            done, work = returned.popleft()
            work.wait()
            apply(done)

    def _warm_up(
        self, newton_schulz: Callable[..., Tensor], own: list[int], groups: dict[int, dict], device: torch.device
    ) -> None:
        """Run the compiled Newton–Schulz once on every shape this rank orthogonalises, before
        the first all-to-all: compiling inside the pipeline would keep the other ranks waiting
        in a collective for as long as the compiler takes, past a short process-group timeout."""
        plan = self._plan
        assert plan is not None  # own matrices are sharded ones
        for index in own:
            g = groups[index]
            key = (plan.matrices[index].shape, tuple(g["ns_coefficients"]), g["ns_steps"], g["eps"])
            if key not in self._warmed:
                # The real input's dtype, shape and layout (a contiguous bfloat16 matrix), so the
                # same guards hold; a scratch tensor, since Newton–Schulz normalises it in place.
                scratch = torch.zeros(key[0], dtype=EXCHANGE_DTYPE, device=device)
                newton_schulz(scratch, g["ns_coefficients"], g["ns_steps"], g["eps"])
                self._warmed.add(key)

    def _adamw_step(self, group: dict) -> None:
        """torch.optim.AdamW's single-tensor step for this group (its state names)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(
                    0.0, dtype=torch.float32 if torch.get_default_dtype() != torch.float64 else torch.float64
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        functional_adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
