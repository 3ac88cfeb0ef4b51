"""A small Llama-style decoder for the benchmark: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Written here so ``make bench`` needs nothing but torch; shapes follow Llama's config names.
The defaults are sized for a 2-core CPU and deliberately uneven (vocabulary and MLP width do
not divide by common world sizes), which is where FSDP2's per-parameter padding shows.
A config builds its model, its batches (random tokens) and its loss (next-token cross
entropy), as every model the benchmark compares on does (see ``linear_stack``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaConfig", "Llama", "PRESETS"]


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape (sizes in elements): Llama's own config names."""

    vocab_size: int = 8003
    hidden_size: int = 384
    intermediate_size: int = 1031
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)

    def build(self) -> Llama:
        return Llama(self)

    def batches(
        self, generator: torch.Generator, count: int, batch_size: int, seq_len: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` (tokens, next tokens) pairs of ``batch_size`` x ``seq_len`` random tokens."""
        data = torch.randint(0, self.vocab_size, (count, batch_size, seq_len + 1), generator=generator)
        return [(d[:, :-1], d[:, 1:]) for d in data]

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


PRESETS = {
    # Small enough for a smoke test of the Muon benchmark (Newton-Schulz in bf16 is slow on CPUs).
    "micro": LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=67,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "tiny": LlamaConfig(
        vocab_size=1009,
        hidden_size=96,
        intermediate_size=257,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": LlamaConfig(),
    "medium": LlamaConfig(
        vocab_size=16007,
        hidden_size=768,
        intermediate_size=2053,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """``forward(tokens) -> logits``; ``layers`` is the ModuleList FSDP units are made of."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        angles = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = (
            self.rope_cos[:s].to(self.embed_tokens.weight.dtype),
            self.rope_sin[:s].to(self.embed_tokens.weight.dtype),
        )
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def fsdp_units(self) -> list[tuple[str, list[nn.Module]]]:
        """The units both engines shard, named, in forward order (the root, holding no
        parameters of its own, comes after them): torchtitan's, the embedding, each layer, the
        final norm with the head. The embedding and the head are used at opposite ends of the
        step, so one unit holding both would keep the embedding's gradients (and parameters)
        alive through all of backward."""
        layers = [(f"layers.{i}", [layer]) for i, layer in enumerate(self.layers)]
        return [("embed_tokens", [self.embed_tokens]), *layers, ("norm+lm_head", [self.norm, self.lm_head])]
