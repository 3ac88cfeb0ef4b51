"""A small transformer whose dims split evenly over TP=2 but not over FSDP, and its TP plan.

Shared by the core's tensor-parallel tests and the front ends' (Lightning, Accelerate), which
also share the check that a run trained what FSDP2 and an unsharded model train.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import TensorDataset

from tests.support.parity import PARAM_TOL, TOL

DIM, HEADS, HIDDEN, VOCAB, SEQ, BATCH = 12, 2, 18, 16, 7, 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No key bias: its gradient is exactly zero (softmax is shift invariant), and Adam
        # would turn rounding noise there into full-size, implementation-dependent updates.
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=name != "k") for name in "qkvo")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under TP each rank holds HEADS / tp of them
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(DIM), Attention()
        self.mlp_norm, self.w1, self.w2 = nn.RMSNorm(DIM), nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _replicated_input(module, inputs, mesh):
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(module, output, mesh):
    return output.to_local()


def tensor_parallel(model: Transformer, tp_mesh) -> Transformer:
    """Colwise/Rowwise on every linear and the embedding (torchtitan's plan without sequence
    parallelism); norms hold Replicate DTensors, so every parameter is a TP DTensor."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn.wq": ColwiseParallel(),
                "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(),
                "w1": ColwiseParallel(),
                "w2": RowwiseParallel(),
            },
        )
    replicate_norms(model, tp_mesh)
    return model


def replicate_norms(model: nn.Module, tp_mesh) -> None:
    """Every norm's parameters Replicate DTensors on ``tp_mesh`` (local tensors in and out),
    as torchtitan's SequenceParallel leaves them: all parameters then share the TP mesh."""
    for module in model.modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            distribute_module(module, tp_mesh, input_fn=_replicated_input, output_fn=_local_output)


def data_parallel(model: Transformer, shard, dp_mesh) -> Transformer:
    """Each block a unit, then the root, over ``dp_mesh`` (``shard``: ours or FSDP2's)."""
    for block in model.layers:
        shard(block, mesh=dp_mesh)
    shard(model, mesh=dp_mesh)
    return model


def token_batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s tokens and targets at ``step`` (``BATCH`` sequences)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def token_dataset(examples: int) -> TensorDataset:
    """``examples`` next-token examples (``SEQ`` tokens, the same shifted by one), the same in
    every process: what the front-end tests feed their loaders."""
    data = torch.randint(0, VOCAB, (examples, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return TensorDataset(data[:, :-1], data[:, 1:])


def lm_loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def default_adamw(model):
    """AdamW with torch's default eps."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def assert_same(a: nn.Module, b: nn.Module, what: str, tol: dict) -> None:
    """Every ``what`` ("param" or "grad") of ``a`` equals ``b``'s, DTensor or not, to ``tol``."""
    for (name, p), (other_name, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert name == other_name
        x, y = (p, q) if what == "param" else (p.grad, q.grad)
        torch.testing.assert_close(_full(x), _full(y), **tol, msg=lambda m: f"{what} {name}: {m}")


def assert_trained_like_fsdp2_and_unsharded(ours, initial, batches, losses, tp_groups, tp_mesh, dp_mesh, clip) -> None:
    """``ours`` (trained from ``initial`` on this rank's ``batches``, with ``losses``, clipping
    at ``clip``) ends where FSDP2 with the same TP plan and an unsharded model end.

    ``tp_groups[d]``: the ranks of data-parallel rank d's TP group, which must all have read
    the same batches (and the first two groups different ones). FSDP2 replays this rank's
    batches; the unsharded model replays every data-parallel rank's together.
    """
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, batches)
    for d, group in enumerate(tp_groups):
        for rank in group:
            assert all(torch.equal(a[0], b[0]) for a, b in zip(everyone[rank], everyone[group[0]])), (d, rank)
    assert not torch.equal(everyone[tp_groups[0][0]][0][0], everyone[tp_groups[1][0]][0][0])

    fsdp2 = data_parallel(tensor_parallel(copy.deepcopy(initial), tp_mesh), torch_fully_shard, dp_mesh)
    reference = copy.deepcopy(initial)
    optimizers = [default_adamw(fsdp2), default_adamw(reference)]
    for step, (tokens, targets) in enumerate(batches):
        fsdp2_loss = lm_loss(fsdp2, tokens, targets)
        fsdp2_loss.backward()
        torch.testing.assert_close(losses[step], fsdp2_loss.detach(), **TOL)
        dp_batches = [everyone[group[0]][step] for group in tp_groups]
        (sum(lm_loss(reference, *b) for b in dp_batches) / len(dp_batches)).backward()
        for model in (fsdp2, reference):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert_same(ours, fsdp2, "param", PARAM_TOL)
    assert_same(ours, reference, "param", PARAM_TOL)
