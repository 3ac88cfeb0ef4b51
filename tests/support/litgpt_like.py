"""A LitGPT-shaped model and LitGPT's pretraining init, for meta-device init tests.

LitGPT (``litgpt.pretrain.initialize_weights``) builds its GPT under
``init_module(empty_init=True)`` and replaces the ``reset_parameters`` of every ``nn.Linear``
and ``nn.Embedding`` with its own scaled normal init (the attention and MLP output
projections get a smaller std), leaving the call to the strategy that materialises the model.
LitGPT 0.5.13 pins ``huggingface-hub<1.4``, which the test extra's transformers cannot install
beside, so this module does what its model and ``initialize_weights`` do, on a small GPT;
``Head`` adds the other kinds of custom init a model carries (``trunc_normal_``,
``xavier_uniform_`` on a module's own parameters).
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, EMBD, HEADS, LAYERS, HIDDEN, SEQ = 97, 30, 3, 2, 46, 12  # nothing divides by 2 or 3 evenly


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(EMBD, 3 * EMBD, bias=False)
        self.proj = nn.Linear(EMBD, EMBD, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).split(EMBD, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, EMBD))


class LLaMAMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(EMBD, HIDDEN, bias=False), nn.Linear(EMBD, HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, EMBD, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_1, self.attn = nn.RMSNorm(EMBD), CausalSelfAttention()
        self.norm_2, self.mlp = nn.RMSNorm(EMBD), LLaMAMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class Head(nn.Module):
    """An output head with its own parameters and ``reset_parameters``: a truncated normal
    weight and a Xavier-uniform gate (what torchtitan's ``init_weights`` and many models use)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, EMBD))
        self.gate = nn.Parameter(torch.empty(EMBD, EMBD))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02, a=-0.04, b=0.04)
        nn.init.xavier_uniform_(self.gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x @ self.gate, self.weight)


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.h = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.RMSNorm(EMBD)
        self.lm_head = Head()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def initialize_weights(model: nn.Module) -> None:
    """LitGPT's ``initialize_weights``: replace the init of every ``nn.Linear`` and
    ``nn.Embedding`` (the strategy calls it when it materialises the model)."""

    def init_weights(module: nn.Module, std: float) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.Linear)):
            module.reset_parameters = partial(init_weights, module, std=math.sqrt(2.0 / 5 / EMBD))
    for module in model.modules():
        if isinstance(module, (LLaMAMLP, CausalSelfAttention)):
            module.proj.reset_parameters = partial(init_weights, module.proj, std=1 / math.sqrt(EMBD) / LAYERS)


def reset_parameters(model: nn.Module) -> None:
    """LitGPT's ``litgpt.utils.reset_parameters``: what a single-device run calls itself."""
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def single_process_init(seed: int) -> GPT:
    """The reference: LitGPT's single-device path (an uninitialised model, its overrides, every
    module reset in module order), same seed."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT()
    model.to_empty(device="cpu")
    initialize_weights(model)
    reset_parameters(model)
    return model
