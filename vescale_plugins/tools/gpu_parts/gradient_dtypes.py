"""``gradient_dtypes``: gradients summed, cast and scaled as FSDP2's on NCCL and CUDA streams.

The CPU suite pins this on gloo (``tests/runtime/test_gradient_dtypes.py``); on the device the
reductions are NCCL's (``AVG`` and ``PREMUL_SUM`` multiply each input before the ring's sum,
gloo's ``AVG`` divides the sum) and each reduce-scatter runs on its own stream. Both engines
build the same model (blocks, then torchtitan's grouped ``[norm, head]`` unit) with bf16
parameters and fp32 reduction, then on every rank:

* a chunked loss over the head (8 chunks, sync off for all but the last chunk's backward,
  the head kept unsharded), then the decoder's backward from the chunks' gradients;
* four micro-batches, sync on the last only, with ``set_gradient_divide_factor(3.0)``
  (``PREMUL_SUM(1/3)`` in FSDP2: the sum divided by 3).

Every full gradient is compared with FSDP2's: equal bits at W=2; at W > 2 within the
rounding of the cross-rank sum's order (a few units in the last place of fp32). The head's
gradient is also compared with the fp32 sum of its per-chunk bf16 gradients, computed here,
so that the check does not rest on the device's FSDP2 alone (its torch is older than ours).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from vescale_plugins.tools.gpu_parts.context import PartContext, launch

__all__ = ["run"]

DIM, HIDDEN, VOCAB, LAYERS, TOKENS, CHUNKS, MICRO_BATCHES = 96, 160, 1000, 2, 256, 8, 4


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        x = self.norm(x)
        return x if skip_head else self.head(x)


class _DecoderGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        (grad,) = ctx.saved_tensors
        return grad, None


def _build(shard: Any, device: torch.device, divide_factor: float | None) -> _Model:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    model = _Model().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        shard(layer, mp_policy=policy)
    shard([model.norm, model.head], mp_policy=policy)
    shard(model, mp_policy=policy)
    if divide_factor is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):  # FSDP2's units and ours
                module.set_gradient_divide_factor(divide_factor)
                # gloo (a CPU run of this part) has no PREMUL_SUM: FSDP2 needs the sum there.
                module.set_force_sum_reduction_for_comms(device.type != "cuda")
    return model


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(TOKENS, DIM, generator=g).to(device), torch.randint(0, VOCAB, (TOKENS,), generator=g).to(device)


def _chunked(model: _Model, device: torch.device) -> list[torch.Tensor]:
    """The chunked loss's backward; returns the chunks the head saw."""
    x, y = _batch(0, device)
    hidden = model(x, skip_head=True)
    head: Any = model.head
    pieces = [c.detach().requires_grad_() for c in hidden.chunk(CHUNKS)]
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    for i, (piece, target) in enumerate(zip(pieces, y.chunk(CHUNKS))):
        if i == CHUNKS - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        F.cross_entropy(head(piece).float(), target, reduction="sum").div(TOKENS).backward()
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.reshard()
    grad = torch.cat([p.grad.float() for p in pieces]).to(hidden.dtype)
    _DecoderGradient.apply(hidden, grad).backward()
    return [p.detach() for p in pieces]


def _head_reference(weight: torch.Tensor, pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The head's gradient as it should be, whatever FSDP2's version does: each chunk's
    gradient in bf16 (as autograd computes it), summed in fp32, averaged over ranks."""
    _, y = _batch(0, device)
    weight = weight.to(torch.bfloat16).requires_grad_()
    total = torch.zeros(weight.shape, dtype=torch.float32, device=device)
    for piece, target in zip(pieces, y.chunk(CHUNKS)):
        loss = F.cross_entropy(F.linear(piece, weight).float(), target, reduction="sum").div(TOKENS)
        total += torch.autograd.grad(loss, weight)[0]
    every = [torch.empty_like(total) for _ in range(dist.get_world_size())]
    dist.all_gather(every, total)
    return (torch.stack(every).sum(0) / dist.get_world_size()).cpu()


def _micro_batches(model: _Model, device: torch.device) -> None:
    """Four micro-batches, gradient sync on the last only."""
    for micro in range(MICRO_BATCHES):
        model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)  # type: ignore[operator]
        x, y = _batch(1 + micro, device)
        (F.cross_entropy(model(x).float(), y) / MICRO_BATCHES).backward()


def _rank(kind: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from vescale_plugins import fully_shard

    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    world = dist.get_world_size()
    figures: dict[str, Any] = {"torch": torch.__version__}
    for case, run, factor in (("chunked_head", _chunked, None), ("micro_batches_divide_by_3", _micro_batches, 3.0)):
        grads = {}
        for engine, shard in (("vescale", fully_shard), ("torch", torch_fully_shard)):
            model = _build(shard, device, factor)
            try:
                pieces = run(model, device)
            except RuntimeError as error:
                if engine == "vescale":
                    raise
                # The device's torch may be older than ours: its FSDP2 then lacks what the
                # case needs (grouped units called in part, 2.13's), said in the figures.
                figures[f"{case}_fsdp2_error"] = str(error).splitlines()[0]
                continue
            grads[engine] = {n: cast(DTensor, p.grad).full_tensor().float().cpu() for n, p in model.named_parameters()}
            if pieces is not None and engine == "vescale":
                expected = _head_reference(cast(DTensor, model.head.weight).full_tensor(), pieces, device)
                figures["head_vs_fp32_sum_of_chunks"] = (grads[engine]["head.weight"] - expected).abs().max().item()
                figures["head_bound"] = 1e-6 * expected.abs().max().item()
        by_name = {}
        for name, theirs in grads.get("torch", {}).items():
            ours = grads["vescale"][name]
            bound = 0.0 if world <= 2 else 2 * (world - 1) * torch.finfo(torch.float32).eps * theirs.abs().max().item()
            by_name[name] = {"max_abs_diff": (ours - theirs).abs().max().item(), "bound": bound}
        figures[case] = by_name
    return figures


def run(ctx: PartContext) -> dict[str, Any]:
    ranks = launch(ctx, _rank, ctx.kind)
    failures = []
    for rank, figures in enumerate(ranks):
        if figures["head_vs_fp32_sum_of_chunks"] > figures["head_bound"]:
            failures.append(f"rank {rank}: head gradient {figures['head_vs_fp32_sum_of_chunks']:.3e} off the fp32 sum")
        for case in ("chunked_head", "micro_batches_divide_by_3"):
            for name, d in figures[case].items():
                if d["max_abs_diff"] > d["bound"]:
                    failures.append(f"rank {rank} {case} {name}: {d['max_abs_diff']:.3e} > {d['bound']:.3e} from FSDP2")
    figures = {"ranks": ranks, **ctx.figures()}
    assert not failures, (failures, figures)
    exact = "bit for bit" if ctx.world <= 2 else "within the cross-rank order's rounding"
    compared = [case for case in ("chunked_head", "micro_batches_divide_by_3") if ranks[0][case]]
    refused = [case for case in ("chunked_head", "micro_batches_divide_by_3") if f"{case}_fsdp2_error" in ranks[0]]
    figures["summary"] = (
        f"head = the fp32 sum of its chunks; equal to FSDP2's {exact} on {ctx.world} rank(s): {', '.join(compared)}"
        + (f"; FSDP2 (torch {ranks[0]['torch']}) failed: {', '.join(refused)}" if refused else "")
    )
    return figures
