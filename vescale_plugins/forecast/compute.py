"""Compute per step (FLOPs, seconds at a stated MFU) and activation memory, per rank.

FLOPs per token, training (forward + backward = 3 forward passes of matmuls):
``6 * active matmul parameters + 6 * layers * seq_len * attention_width`` where the active
matmul parameters are every tensor of 2 or more dims except the embedding lookup, routed
experts counted ``top_k / experts`` of the time, and the attention term is causal
``Q K^T`` plus ``A V`` (``2 * 2 * s * width / 2`` per token forward), ``attention_width``
being ``o_proj``'s input width (heads x value head dim). Activation checkpointing of every
block adds one more forward: ``8 *`` instead of ``6 *`` for the blocks.

Activation bytes per token per transformer block, saved for backward (a count in the style of
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
adapted to pre-norm blocks with fused (flash) attention, grouped-query attention, SwiGLU
MLPs and no dropout; ``h`` hidden size, ``q``/``kv`` the query and key/value widths, ``I``
the MLP width, ``e`` the compute dtype's bytes):

    e * (4h            two norm inputs, the attention input and the MLP input
         + 2q + 2kv    q, k, v and the attention output
         + 4I)         gate and up outputs, the SiLU output and its product with up

A mixture-of-experts block saves ``top_k * (h + 4 I_expert)`` for its routed experts (each
token's input copy and the expert's activations) plus ``4 I_shared`` per shared expert,
instead of ``4I``. The output layer adds ``vocab * (e + 8)`` per token: the logits in the
compute dtype, and in fp32 for the loss with its gradient. With activation checkpointing
of every block, each block keeps only its input (``e * h``) and one block's full
activations exist again while it is recomputed in backward.
"""

from __future__ import annotations

import math

from vescale_plugins.forecast.model import ModelSpec, is_routed_expert
from vescale_plugins.tools.model_catalog import Unit

__all__ = [
    "activation_bytes",
    "is_block",
    "block_activation_elements",
    "training_flops_per_token",
    "unit_flops_per_token",
]


def _top_k_fraction(config: dict) -> float:
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    if not experts:
        return 1.0
    return config.get("num_experts_per_tok", 1) / experts


def is_block(unit: Unit) -> bool:
    """A transformer block (it has an attention output projection)."""
    return any(name.endswith("o_proj.weight") for name, _ in unit.params)


def _attention_width(unit: Unit) -> int:
    return next(shape[1] for name, shape in unit.params if name.endswith("o_proj.weight"))


def unit_flops_per_token(unit: Unit, config: dict, seq_len: int) -> float:
    """Training FLOPs per token of one copy of ``unit`` (no recomputation)."""
    active = 0.0
    fraction = _top_k_fraction(config)
    for name, shape in unit.params:
        if len(shape) < 2 or name.startswith("embed_tokens"):
            continue
        active += math.prod(shape) * (fraction if is_routed_expert(name) else 1.0)
    flops = 6 * active
    if is_block(unit):
        flops += 6 * seq_len * _attention_width(unit)
    return flops


def training_flops_per_token(spec: ModelSpec, seq_len: int, activation_checkpointing: bool) -> float:
    """Training FLOPs per token of the whole model; checkpointed blocks run forward twice."""
    total = 0.0
    for unit in spec.units.units:
        flops = unit_flops_per_token(unit, spec.config, seq_len)
        if activation_checkpointing and is_block(unit):
            flops *= 8 / 6
        total += unit.count * flops
    return total


def _shape_of(unit: Unit, suffix: str) -> tuple[int, ...] | None:
    return next((shape for name, shape in unit.params if name.endswith(suffix)), None)


def block_activation_elements(unit: Unit, config: dict) -> float:
    """Saved activation elements per token of one block (see the module docstring)."""
    h = config["hidden_size"]
    q = _attention_width(unit)
    k_proj = _shape_of(unit, "k_proj.weight")
    kv = k_proj[0] if k_proj is not None else q  # MLA decompresses keys and values per head
    elements = 4 * h + 2 * q + 2 * kv
    if any(is_routed_expert(name) for name, _ in unit.params):
        routed = config.get("moe_intermediate_size") or config["intermediate_size"]
        shared = config.get("n_shared_experts", 0)
        elements += config.get("num_experts_per_tok", 1) * (h + 4 * routed) + shared * 4 * routed
    else:
        elements += 4 * config["intermediate_size"]
    return elements


def activation_bytes(spec: ModelSpec, tokens: int, compute_itemsize: int) -> tuple[int, int]:
    """Activation bytes per rank for ``tokens`` tokens per step: ``(without, with)``
    activation checkpointing of every block."""
    blocks = [(u, block_activation_elements(u, spec.config)) for u in spec.units.units if is_block(u)]
    logits = spec.config["vocab_size"] * (compute_itemsize + 8)
    full = sum(u.count * e for u, e in blocks) * compute_itemsize + logits
    layers = sum(u.count for u, _ in blocks)
    checkpointed = (
        layers * spec.config["hidden_size"] + max((e for _, e in blocks), default=0)
    ) * compute_itemsize + logits
    return math.ceil(full * tokens), math.ceil(checkpointed * tokens)
