"""Pipeline parallelism over our units: ``torch.distributed.pipelining``'s schedules drive
stages whose layers and root are sharded by ``fully_shard`` (pp=2 x dp=2, 4 gloo ranks) and
train what the same model trains without PP or FSDP, and what FSDP2's units train under the
same schedule in the same launch, for several steps.

The schedules reach the units through ``FSDPModule``'s methods (``set_is_last_backward``,
``set_requires_gradient_sync``, ``unshard(async_op=True)``, ...) and, at their reduce-grad
step, through ``fully_shard.state(stage)`` (FSDP2's state: every unit's ``post_backward`` and
the root's final callback); the zero-bubble schedules' split backward takes
``param.view_as(param)`` of the sharded parameters.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.pipelining as pipelining
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.torch_version import TorchVersion

from vescale_plugins import fully_shard as our_fully_shard

LAYERS, WIDTH, MICROBATCHES, BATCH_PER_DP_RANK, STEPS, LR = 8, 12, 4, 8, 3, 0.1
# Agreement with the unpipelined model at fp32 (max absolute difference): FSDP2's on this
# model is about 1e-7 for gradients (micro-batch sums in another order) and 1e-8 for
# parameters after 3 steps; ours must be as good.
GRAD_TOL = dict(rtol=0.0, atol=5e-7)
PARAM_TOL = dict(rtol=0.0, atol=5e-7)
# Against FSDP2 under the same schedule (and, for bf16 compute with fp32 reduction, the
# same policy); measured equal to the last bit on gloo.
BF16_TOL = dict(rtol=0.0, atol=1e-6)

SINGLE_STAGE = {"ScheduleGPipe", "Schedule1F1B"}
# The split backward's input step (``stage_backward_input``) finds the weights through the
# stage's registered parameters before autograd's hooks run: the unsharded ones only where
# forward left them gathered (torchtitan's default under PP), for FSDP2 as for us.
SPLIT_BACKWARD = {"ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
SCHEDULES = [
    name
    for name in (
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble",
        "ScheduleDualPipeV",
    )
    if hasattr(pipelining, name)
]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Layer() for _ in range(LAYERS)])


def _batch(step: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    rows = dp_size * BATCH_PER_DP_RANK
    return torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _stage_indices(schedule: str, pp_rank: int, pp_size: int) -> list[int]:
    if schedule in SINGLE_STAGE:
        return [pp_rank]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank, pp_rank + pp_size]  # looped


def _reference(dp_size: int) -> list[dict[str, torch.Tensor]]:
    """The unpipelined, unsharded model's gradients and parameters after each step."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for step in range(STEPS):
        x, y = _batch(step, dp_size)
        _loss(model(x), y).backward()
        grads = {f"{name}.grad": p.grad.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        history.append({**grads, **params})
    return history


def _build(schedule: str, shard, mesh, pp_group, pp_rank: int, pp_size: int, mp_policy):
    """This rank's stages (each a ``Sequential`` of its layers, every layer and the stage
    sharded by ``shard`` on ``mesh``), their layers' names in the full model, the schedule."""
    full = _model()
    num_stages = pp_size if schedule in SINGLE_STAGE else 2 * pp_size
    per_stage = LAYERS // num_stages
    stages, modules, names = [], [], []
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    kwargs["reshard_after_forward"] = schedule not in SPLIT_BACKWARD
    for index in _stage_indices(schedule, pp_rank, pp_size):
        layers = [copy.deepcopy(full[i]) for i in range(index * per_stage, (index + 1) * per_stage)]
        module = nn.Sequential(*layers)
        for layer in module:
            shard(layer, mesh=mesh, **kwargs)
        shard(module, mesh=mesh, **kwargs)
        modules.append(module)
        names.append({f"{j}.": f"{index * per_stage + j}." for j in range(per_stage)})
        stages.append(PipelineStage(module, index, num_stages, torch.device("cpu"), group=pp_group))
    cls = getattr(pipelining, schedule)
    if schedule in SINGLE_STAGE:
        runner = cls(stages[0], MICROBATCHES, loss_fn=_loss)
    else:
        runner = cls(stages, MICROBATCHES, loss_fn=_loss)
    return modules, names, runner


def _full_name(local: str, prefixes: dict[str, str]) -> str:
    head, _, rest = local.partition(".")
    return prefixes[f"{head}."] + rest


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _meshes(mesh_shape: tuple[int, ...]):
    """(pp, data-parallel mesh: 1-D FSDP or 2-D (replicate, shard) HSDP, dp size, dp rank)."""
    names = ("pp", "replicate", "shard") if len(mesh_shape) == 2 else ("pp", "dp")
    device_mesh = init_device_mesh("cpu", (2, *mesh_shape), mesh_dim_names=names)
    mesh = device_mesh[names[1:]] if len(names) > 2 else device_mesh["dp"]
    dp_rank = 0
    for size, coordinate in zip(mesh.mesh.shape, mesh.get_coordinate()):
        dp_rank = dp_rank * size + coordinate
    return device_mesh["pp"], mesh, mesh.mesh.numel(), dp_rank


def _named_state(modules, prefixes) -> dict[str, torch.Tensor]:
    return {
        _full_name(name, prefix): value
        for module, prefix in zip(modules, prefixes)
        for name, value in module.state_dict().items()
    }


def _resume_from(checkpoint_dir: str, schedule: str, shard, pp_mesh, mesh, mp_policy):
    """Fresh stages (parameters zeroed), loaded from the DCP checkpoint in ``checkpoint_dir``."""
    modules, prefixes, runner = _build(
        schedule, shard, mesh, pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size(), mp_policy
    )
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.zero_()
    state = _named_state(modules, prefixes)
    dcp.load(state, checkpoint_id=checkpoint_dir)
    for module, prefix in zip(modules, prefixes):
        module.load_state_dict({name: state[_full_name(name, prefix)] for name in module.state_dict()})
    return modules, prefixes, runner


def _train(schedule: str, shard, meshes, mp_policy, checkpoint_dir: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Train ``STEPS`` steps under ``schedule``; each step's full gradients and parameters of
    this rank's layers, named as in the full model. With ``checkpoint_dir``: save after the
    first step with DCP (every rank, every stage) and go on from fresh stages loaded from it."""
    pp_mesh, mesh, dp_size, dp_rank = meshes
    modules, prefixes, runner = _build(
        schedule, shard, mesh, pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size(), mp_policy
    )
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
    history = []
    for step in range(STEPS):
        if checkpoint_dir is not None and step == 1:
            dcp.save(_named_state(modules, prefixes), checkpoint_id=checkpoint_dir)
            modules, prefixes, runner = _resume_from(checkpoint_dir, schedule, shard, pp_mesh, mesh, mp_policy)
            optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
        x, y = _batch(step, dp_size)
        rows = slice(dp_rank * BATCH_PER_DP_RANK, (dp_rank + 1) * BATCH_PER_DP_RANK)
        # Inputs on the first stage's rank only (pp rank 0 holds stage 0 in every schedule
        # here): torch 2.11 refuses them on the others.
        inputs = (x[rows],) if pp_mesh.get_local_rank() == 0 else ()
        runner.step(*inputs, target=y[rows])
        record = {}
        for module, prefix in zip(modules, prefixes):
            for name, p in module.named_parameters():
                assert p.grad is not None, f"{name} got no gradient at step {step}"
                record[f"{_full_name(name, prefix)}.grad"] = _full(p.grad).detach().clone()
        optimizer.step()
        optimizer.zero_grad()
        for module, prefix in zip(modules, prefixes):
            for name, p in module.named_parameters():
                record[_full_name(name, prefix)] = _full(p).detach().clone()
        history.append(record)
    return history


def _max_differences(got, want) -> tuple[float, float]:
    """The largest absolute difference of any gradient and of any parameter, over the steps."""
    grads, params = 0.0, 0.0
    for g, w in zip(got, want):
        for name, value in g.items():
            difference = (value.float() - w[name].float()).abs().max().item()
            if name.endswith(".grad"):
                grads = max(grads, difference)
            else:
                params = max(params, difference)
    return grads, params


def _assert_close(got, want, grad_tol, param_tol, label):
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want)):
        for name, value in g.items():
            tol = grad_tol if name.endswith(".grad") else param_tol
            torch.testing.assert_close(
                value.float(), w[name].float(), **tol, msg=lambda m: f"{label}, step {step}, {name}: {m}"
            )


# torch's pipelining before 2.12 fails two kinds of case this file runs, for FSDP2 and ours
# alike (the same error at the same place): bf16 mixed precision (the stage backward: "Found
# dtype Float but expected BFloat16") and the V-schedules (ZBV, DualPipeV: gloo's "Pair is not
# connected"). Skipped there, with that reason.
_PIPELINES_ALL = TorchVersion(torch.__version__) >= "2.12"
_V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def _skip_where_torch_pipelining_fails(schedule: str, bf16: bool) -> None:
    if not _PIPELINES_ALL and (bf16 or schedule in _V_SCHEDULES):
        what = "bf16 mixed precision" if bf16 else f"{schedule}"
        pytest.skip(f"torch {torch.__version__}'s pipelining fails {what} for FSDP2 and ours alike (2.12 runs it)")


def _pipelined_parity(
    schedule: str, mesh_shape: tuple[int, ...], bf16: bool, checkpoint_dir: str | None = None
) -> None:
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    ckpt = (lambda impl: None) if checkpoint_dir is None else (lambda impl: os.path.join(checkpoint_dir, impl))
    meshes = _meshes(mesh_shape)  # one set of process groups for both
    theirs = _train(schedule, torch_fully_shard, meshes, mp_policy, ckpt("fsdp2"))
    ours = _train(schedule, our_fully_shard, meshes, mp_policy, ckpt("ours"))
    if bf16:
        _assert_close(ours, theirs, BF16_TOL, BF16_TOL, "ours against FSDP2 (bf16)")
        if os.environ.get("PIPELINING_REPORT"):
            print(f"rank {dist.get_rank()} {schedule} bf16: ours against FSDP2 {_max_differences(ours, theirs)}")
        return
    reference = _reference(dist.get_world_size() // 2)
    _assert_close(theirs, reference, GRAD_TOL, PARAM_TOL, "FSDP2 against the unpipelined model")
    _assert_close(ours, reference, GRAD_TOL, PARAM_TOL, "ours against the unpipelined model")
    _assert_close(ours, theirs, BF16_TOL, BF16_TOL, "ours against FSDP2")
    if os.environ.get("PIPELINING_REPORT"):
        print(
            f"rank {dist.get_rank()} {schedule} {mesh_shape}: max |grad|, |param| difference to the "
            f"unpipelined model: FSDP2 {_max_differences(theirs, reference)}, ours {_max_differences(ours, reference)}; "
            f"ours against FSDP2 {_max_differences(ours, theirs)}",
            flush=True,
        )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_trains_as_unpipelined_model_and_fsdp2(dist_run, schedule):
    _skip_where_torch_pipelining_fails(schedule, False)
    dist_run(_pipelined_parity, 4, schedule, (2,), False, timeout=180)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_with_hsdp_trains_as_unpipelined_model_and_fsdp2(dist_run, schedule):
    _skip_where_torch_pipelining_fails(schedule, False)
    dist_run(_pipelined_parity, 4, schedule, (2, 1), False, timeout=180)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_with_bf16_mixed_precision_trains_as_fsdp2(dist_run, schedule):
    _skip_where_torch_pipelining_fails(schedule, True)
    dist_run(_pipelined_parity, 4, schedule, (2,), True, timeout=180)


@pytest.mark.parametrize("schedule", ["Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"])
def test_schedule_resumes_from_dcp_checkpoint_as_unpipelined_model(dist_run, schedule, tmp_path):
    _skip_where_torch_pipelining_fails(schedule, False)
    dist_run(_pipelined_parity, 4, schedule, (2,), False, str(tmp_path), timeout=180)


def _microbatches_with_is_last_backward() -> None:
    """Micro-batches whose backwards are not the last (``set_is_last_backward(False)``: their
    reductions are left in flight, FSDP2's meaning) sum to the full batch's gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = _model()
    trained = {}
    for impl, shard in (("fsdp2", torch_fully_shard), ("ours", our_fully_shard)):
        model = _model()
        for layer in model:
            shard(layer)
        shard(model)
        trained[impl] = model
    models = [reference, *trained.values()]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    for step in range(STEPS):
        x, y = _batch(step, world)
        _loss(reference(x), y).backward()
        rows = slice(rank * BATCH_PER_DP_RANK, (rank + 1) * BATCH_PER_DP_RANK)
        for model in trained.values():
            for i, (xs, ys) in enumerate(zip(x[rows].chunk(MICROBATCHES), y[rows].chunk(MICROBATCHES))):
                model.set_is_last_backward(i == MICROBATCHES - 1)
                (_loss(model(xs), ys) / MICROBATCHES).backward()
        for (name, want), theirs, ours in zip(
            reference.named_parameters(), trained["fsdp2"].parameters(), trained["ours"].parameters()
        ):
            torch.testing.assert_close(_full(ours.grad), want.grad, **GRAD_TOL, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(_full(ours.grad), _full(theirs.grad), **BF16_TOL, msg=lambda m: f"{name}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for want, ours in zip(reference.parameters(), trained["ours"].parameters()):
        torch.testing.assert_close(_full(ours).detach(), want.detach(), **PARAM_TOL)


def test_backwards_not_the_last_leave_reductions_to_the_last(dist_run):
    dist_run(_microbatches_with_is_last_backward, 2, timeout=120)
