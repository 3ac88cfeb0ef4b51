"""Small torchtitan-shaped models: a llama3-style decoder (RMSNorm, SwiGLU, no biases,
``layers`` a ModuleDict, a forward that can stop before the output head for the chunked
loss) and an MoE-style model (a router and grouped experts per block, dense parameters on
the dense SPMD mesh, experts on the sparse one), with their parallelisations and
``init_weights``.

``init_weights`` draws every parameter's full value from a generator seeded by its name and
writes the local part (``distribute_tensor`` onto the parameter's own mesh and placements):
torch's DTensor random ops on CPU draw per rank under FSDP2's placements, so a sharded
``trunc_normal_`` would give each engine, and the unsharded model, other values.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd, reduce_scatter_tensor_autograd
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.support.tp_transformer import replicate_norms

DIM, HEADS, HIDDEN, VOCAB, LAYERS = 16, 4, 24, 32, 2
EXPERTS, MOE_IN, MOE_OUT = 4, 6, 5


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under TP each rank holds HEADS / tp of them
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        # Causal attention written out: F.scaled_dot_product_attention inside a checkpointed
        # block compiled with DTensors in it fails in AOT autograd (torch 2.13, FSDP2 alike:
        # "expected all tensors_saved_with_vc_check to be Tensors", a DeviceMesh among them).
        scores = (q @ k.transpose(-2, -1)) / (DIM // HEADS) ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.RMSNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): LlamaBlock() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, skip_lm_head: bool = False) -> torch.Tensor:
        """The logits, or (``skip_lm_head``, torchtitan's chunked loss) the normed hidden states."""
        # A copy of the embedding's output: a compiled block whose input is the output of
        # DTensor.to_local() (the TP embedding's) gives that input no gradient (torch 2.13,
        # FSDP2 alike; without FSDP the backward fails in Redistribute).
        x = self.tok_embeddings(tokens).clone()
        for layer in self.layers.values():
            x = layer(x)
        x = self.norm(x)
        return x if skip_lm_head else self.output(x)


def tensor_parallel_llama(model: Llama, tp_mesh) -> Llama:
    """torchtitan's llama3 TP plan without sequence parallelism: the embedding Rowwise,
    attention and SwiGLU Colwise then Rowwise, the output Colwise with a replicated output,
    the norms replicated."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
    replicate_norms(model, tp_mesh)
    return model


class GroupedExperts(nn.Module):
    """``EXPERTS`` two-layer MLPs as stacked weights; under EP each rank holds a Shard(0) of them."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(EXPERTS, HIDDEN, DIM))
        self.w2 = nn.Parameter(torch.empty(EXPERTS, DIM, HIDDEN))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Every local expert on every token, weighted by its gate (top-1 gates are zero
        elsewhere): dense routing keeps the shapes static for ``fullgraph`` compiles."""
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        hidden = F.silu(torch.einsum("td,ehd->eth", x, w1))
        return torch.einsum("eth,edh,te->td", hidden, w2, gates)


class MoEBlock(nn.Module):
    """A dense MLP (TP: Colwise then Rowwise on the dense mesh's tp dim), then a top-1 router
    and the experts (EP over the sparse mesh's ep dim). The experts see this rank's share of
    the tokens split over dp_shard and tp (torchtitan's sequence-parallel MoE input), so no
    token reaches an expert twice."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in, self.w_out = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = GroupedExperts()
        self.ep_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.w_out(F.gelu(self.w_in(x)))
        if self.ep_group is None:  # the unsharded reference
            return h + self.experts(h, self._gates(self.router(h)))
        mesh, batch = h.device_mesh, [Shard(0), Replicate()]
        tokens = h.redistribute(mesh, [Shard(0), Shard(0)])
        local = tokens.to_local()
        gates = self._gates(self.router(tokens).to_local())
        ep_rank, ep_size = dist.get_rank(self.ep_group), dist.get_world_size(self.ep_group)
        first = ep_rank * EXPERTS // ep_size
        all_local = all_gather_tensor_autograd(local, 0, self.ep_group)
        all_gates = all_gather_tensor_autograd(gates, 0, self.ep_group)[:, first : first + EXPERTS // ep_size]
        routed = reduce_scatter_tensor_autograd(self.experts(all_local, all_gates), "sum", 0, self.ep_group)
        moe = DTensor.from_local(routed, mesh, [Shard(0), Shard(0)], run_check=False)
        return (h + moe.redistribute(mesh, batch)).redistribute(mesh, batch)

    @staticmethod
    def _gates(logits: torch.Tensor) -> torch.Tensor:
        scores = logits.softmax(-1)
        top = scores.argmax(-1, keepdim=True)
        return torch.zeros_like(scores).scatter(-1, top, scores.gather(-1, top))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(MOE_IN, DIM)
        self.layers = nn.ModuleDict({str(i): MoEBlock() for i in range(LAYERS)})
        self.head = nn.Linear(DIM, MOE_OUT)
        self.dense_mesh = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens in, its outputs out; on the dense mesh the tokens are split over
        dp_shard and replicated over tp."""
        if self.dense_mesh is not None:
            x = DTensor.from_local(x, self.dense_mesh, [Shard(0), Replicate()], run_check=False)
        x = self.proj(x)
        for layer in self.layers.values():
            x = layer(x)
        out = self.head(x)
        return out if self.dense_mesh is None else out.redistribute(self.dense_mesh, [Shard(0), Replicate()]).to_local()


# TP placements of the MoE blocks' dense parameters on the dense mesh's tp dim
_MOE_TP = {"w_in.weight": Shard(0), "w_in.bias": Shard(0), "w_out.weight": Shard(1)}


def spmd_parallel_moe(model: MoE, dense_mesh, sparse_mesh) -> set[nn.Parameter]:
    """torchtitan's SPMD storage: every dense parameter a DTensor on the full dense
    (dp_shard, tp) mesh (Replicate on dp_shard, its TP placement on tp), the experts on the
    sparse (efsdp, ep) mesh (Replicate on efsdp, Shard(0) on ep). Returns the experts."""
    experts = set()
    for name, p in list(model.named_parameters()):
        module_name, attr = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if isinstance(module, GroupedExperts):
            dt = distribute_tensor(p.detach(), sparse_mesh, [Replicate(), Shard(0)])
        else:
            dt = distribute_tensor(
                p.detach(), dense_mesh, [Replicate(), _MOE_TP.get(name.split(".", 2)[-1], Replicate())]
            )
        setattr(module, attr, nn.Parameter(dt))
        if isinstance(module, GroupedExperts):
            experts.add(getattr(module, attr))
    model.dense_mesh = dense_mesh
    for block in model.layers.values():
        block.ep_group = sparse_mesh.get_group("ep")
    return experts


def _seeded_full(name: str, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return 1 + 0.1 * torch.randn(shape, generator=g)
    return 0.02 * torch.randn(shape, generator=g) * 10 / max(shape[-1], 1) ** 0.5


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """Every parameter's full value from a generator seeded by its name (wrappers' prefixes
    dropped), its local part written in place."""
    for name, p in model.named_parameters():
        full = _seeded_full(name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""), p.shape)
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
        else:
            p.copy_(full)


class DecoderOutputGradient(torch.autograd.Function):
    """torchtitan's ``_DecoderOutputGradientBackProp``: the loss, whose backward hands the
    accumulated gradient of the hidden states to the decoder."""

    @staticmethod
    def forward(ctx, hidden, grad, loss):
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, _):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def chunked_loss(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunks: int, denominator: int, dim: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torchtitan's ``ChunkedLossWrapper`` around an FSDP-managed output head: the head kept
    unsharded across the chunks of ``hidden`` (cut along ``dim``), each chunk's summed
    cross-entropy over ``denominator`` backpropagated at once, gradient sync off for every
    chunk's backward but the last. Returns the loss whose backward runs the decoder's backward
    from the chunks' gradients (summed in fp32), and the chunks the head saw."""
    pieces = [c.detach().requires_grad_() for c in hidden.chunk(chunks, dim=dim)]
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    total = hidden.new_zeros((), dtype=torch.float32)
    for i, (piece, target) in enumerate(zip(pieces, targets.chunk(chunks, dim=dim))):
        if i == chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        logits = head(piece).float().flatten(0, -2)
        loss = F.cross_entropy(logits, target.flatten(), reduction="sum") / denominator
        loss.backward()
        total = total + loss.detach()
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.set_requires_gradient_sync(True, recurse=False)
    head.reshard()
    grad = torch.cat([p.grad.float() for p in pieces], dim=dim).to(hidden.dtype)
    return DecoderOutputGradient.apply(hidden, grad, total), [p.detach() for p in pieces]
