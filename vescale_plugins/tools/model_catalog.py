"""Per-unit parameter shapes of real open models, from their public Hugging Face configs.

Plain data for the planner's report and tests: no torch, no downloads. ``CONFIGS`` holds the
config numbers used (names as in each model's ``config.json``); ``CATALOG`` maps a model
name to its FSDP units, one per transformer block plus one for the embedding and one for
the final norm and LM head, each as ``(param_name, shape)`` pairs in module order (the order
``named_parameters()`` yields). Shapes follow the Hugging Face modules: a ``Linear`` weight is
``[out_features, in_features]``; GPT-OSS stores its experts fused as ``[experts, in, out]``.

A *row* is the last dim (``shape[-1]`` elements, the tensor's trailing dims under
``RaggedShard(dims=(0, ..., n-2))``); a 1-D tensor's row is one element. See
:func:`block_size` for k-row blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "CATALOG",
    "CONFIGS",
    "ModelUnits",
    "Unit",
    "block_size",
    "dim0_block_rows",
    "model_from_config",
    "planner_inputs",
    "row_count",
    "row_length",
]

Shape = tuple[int, ...]
Param = tuple[str, Shape]

# Config numbers from the public config.json of each model (Hugging Face Hub).
# A table: each model's numbers stay together, as on its config.json.
# fmt: off
CONFIGS: dict[str, dict[str, int | bool]] = {
    "Llama-3-8B": dict(  # meta-llama/Meta-Llama-3-8B
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "Llama-3-70B": dict(  # meta-llama/Meta-Llama-3-70B
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "Llama-3.1-405B": dict(  # meta-llama/Llama-3.1-405B
        hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "Mixtral-8x7B": dict(  # mistralai/Mixtral-8x7B-v0.1
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
    ),
    "Qwen3-30B-A3B": dict(  # Qwen/Qwen3-30B-A3B
        hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False,
    ),
    "DeepSeek-V3-671B": dict(  # deepseek-ai/DeepSeek-V3 (the MTP layer is not a training unit here)
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
        tie_word_embeddings=False,
    ),
    "GPT-OSS-120B": dict(  # openai/gpt-oss-120b
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
        num_local_experts=128, num_experts_per_tok=4, tie_word_embeddings=False,
    ),
}
# fmt: on


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its parameters, and how many identical copies the model has."""

    name: str
    count: int
    params: tuple[Param, ...]

    @property
    def numel(self) -> int:
        """Elements in one copy of the unit."""
        return sum(math.prod(shape) for _, shape in self.params)


@dataclass(frozen=True)
class ModelUnits:
    """A model as FSDP units (embedding, blocks, final norm + head)."""

    name: str
    units: tuple[Unit, ...]

    @property
    def numel(self) -> int:
        """Parameters in the whole model."""
        return sum(unit.count * unit.numel for unit in self.units)


def row_length(shape: Shape) -> int:
    """Elements in one row: the last dim, or one element for a 1-D tensor."""
    return shape[-1] if len(shape) > 1 else 1


def row_count(shape: Shape) -> int:
    """Rows in a tensor: every dim but the last flattened (elements for a 1-D tensor)."""
    return math.prod(shape) // row_length(shape)


def block_size(shape: Shape, rows_per_block: int) -> int:
    """Elements in a block of ``rows_per_block`` rows, the unit that must stay on one rank.

    A tensor whose row count is not a multiple of ``rows_per_block`` uses blocks of
    ``gcd(rows_per_block, rows)`` rows (e.g. DeepSeek's 576-row ``kv_a_proj_with_mqa`` at
    128 rows gets 64-row blocks), so blocks always tile the tensor.
    """
    return math.gcd(rows_per_block, row_count(shape)) * row_length(shape)


def dim0_block_rows(shapes: Sequence[Shape], rows_per_block: int | None) -> list[int | None]:
    """``block_size_fn``'s answer per parameter as the bench's ``--block-rows`` gives it:
    ``rows_per_block`` dim-0 rows for a tensor of 2 or more dims whose dim 0 it divides,
    else ``None`` (no block structure: ``fully_shard`` may cut it anywhere). ``None`` or 1
    rows per block: no ``block_size_fn`` at all (``None`` for every parameter)."""
    if rows_per_block is None or rows_per_block == 1:
        return [None] * len(shapes)
    return [rows_per_block if len(shape) >= 2 and shape[0] % rows_per_block == 0 else None for shape in shapes]


def planner_inputs(unit: Unit, rows_per_block: int) -> tuple[list[int], list[int]]:
    """What the planner takes for one copy of ``unit``: its tensors' elements and their block
    sizes (elements) at ``rows_per_block``-row blocks, in the unit's order."""
    shapes = [shape for _, shape in unit.params]
    return [math.prod(shape) for shape in shapes], [block_size(shape, rows_per_block) for shape in shapes]


def _norm(name: str, size: int) -> Param:
    """An RMSNorm weight."""
    return (f"{name}.weight", (size,))


def _linear(name: str, out_features: int, in_features: int, bias: bool = False) -> list[Param]:
    """An ``nn.Linear``: weight ``[out, in]``, then the optional bias."""
    params: list[Param] = [(f"{name}.weight", (out_features, in_features))]
    if bias:
        params.append((f"{name}.bias", (out_features,)))
    return params


def _gqa_attention(c: dict, bias: bool = False, qk_norm: bool = False) -> list[Param]:
    """Grouped-query attention (Llama, Mixtral, Qwen3, GPT-OSS)."""
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    params = _linear("self_attn.q_proj", q_out, hidden, bias)
    params += _linear("self_attn.k_proj", kv_out, hidden, bias)
    params += _linear("self_attn.v_proj", kv_out, hidden, bias)
    params += _linear("self_attn.o_proj", hidden, q_out, bias)
    if qk_norm:
        params += [_norm("self_attn.q_norm", head_dim), _norm("self_attn.k_norm", head_dim)]
    return params


def _mla_attention(c: dict) -> list[Param]:
    """DeepSeek-V3 multi-head latent attention."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    params = _linear("self_attn.q_a_proj", c["q_lora_rank"], hidden)
    params.append(_norm("self_attn.q_a_layernorm", c["q_lora_rank"]))
    params += _linear("self_attn.q_b_proj", heads * qk_head, c["q_lora_rank"])
    params += _linear("self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden)
    params.append(_norm("self_attn.kv_a_layernorm", c["kv_lora_rank"]))
    params += _linear(
        "self_attn.kv_b_proj",
        heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
        c["kv_lora_rank"],
    )
    params += _linear("self_attn.o_proj", hidden, heads * c["v_head_dim"])
    return params


def _gated_mlp(
    prefix: str,
    hidden: int,
    intermediate: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> list[Param]:
    """Gate, up and down projections (the order the modules register them)."""
    gate, up, down = names
    return (
        _linear(f"{prefix}.{gate}", intermediate, hidden)
        + _linear(f"{prefix}.{up}", intermediate, hidden)
        + _linear(f"{prefix}.{down}", hidden, intermediate)
    )


def _block(attention: list[Param], mlp: list[Param], hidden: int) -> tuple[Param, ...]:
    """A decoder block in registration order: attention, MLP, then the two norms (the
    Hugging Face decoder layers create their norms after ``self_attn`` and ``mlp``)."""
    return tuple(attention + mlp + [_norm("input_layernorm", hidden), _norm("post_attention_layernorm", hidden)])


def _ends(c: dict, blocks: list[Unit]) -> tuple[Unit, ...]:
    """Embedding unit, the blocks, then final norm + LM head."""
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    embed = Unit("embed_tokens", 1, (("embed_tokens.weight", (vocab, hidden)),))
    head = Unit("norm+lm_head", 1, (_norm("norm", hidden), ("lm_head.weight", (vocab, hidden))))
    return (embed, *blocks, head)


def _llama(name: str, c: dict) -> ModelUnits:
    """Llama 3 / 3.1: GQA attention and a SwiGLU MLP."""
    hidden = c["hidden_size"]
    block = _block(_gqa_attention(c), _gated_mlp("mlp", hidden, c["intermediate_size"]), hidden)
    return ModelUnits(name, _ends(c, [Unit("decoder_layer", c["num_hidden_layers"], block)]))


def _mixtral(name: str, c: dict) -> ModelUnits:
    """Mixtral: router, then 8 experts of w1, w3, w2 (``block_sparse_moe``)."""
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    moe = _linear("block_sparse_moe.gate", c["num_local_experts"], hidden)
    for e in range(c["num_local_experts"]):
        moe += _gated_mlp(f"block_sparse_moe.experts.{e}", hidden, inter, ("w1", "w3", "w2"))
    block = _block(_gqa_attention(c), moe, hidden)
    blocks = [Unit("decoder_layer", c["num_hidden_layers"], block)]
    return ModelUnits(name, _ends(c, blocks))


def _qwen3_moe(name: str, c: dict) -> ModelUnits:
    """Qwen3 MoE: GQA with per-head q/k norms, router, then 128 experts."""
    hidden = c["hidden_size"]
    moe = _linear("mlp.gate", c["num_experts"], hidden)
    for e in range(c["num_experts"]):
        moe += _gated_mlp(f"mlp.experts.{e}", hidden, c["moe_intermediate_size"])
    block = _block(_gqa_attention(c, qk_norm=True), moe, hidden)
    blocks = [Unit("decoder_layer", c["num_hidden_layers"], block)]
    return ModelUnits(name, _ends(c, blocks))


def _deepseek_v3(name: str, c: dict) -> ModelUnits:
    """DeepSeek-V3: MLA attention; 3 dense layers, then MoE layers of 256 routed experts,
    the router (its ``e_score_correction_bias`` is a parameter in DeepSeek's own modeling
    code) and one shared expert, in that registration order."""
    hidden, experts = c["hidden_size"], c["n_routed_experts"]
    dense = _block(_mla_attention(c), _gated_mlp("mlp", hidden, c["intermediate_size"]), hidden)
    moe = []
    for e in range(experts):
        moe += _gated_mlp(f"mlp.experts.{e}", hidden, c["moe_intermediate_size"])
    moe += _linear("mlp.gate", experts, hidden)
    moe.append(("mlp.gate.e_score_correction_bias", (experts,)))
    moe += _gated_mlp("mlp.shared_experts", hidden, c["n_shared_experts"] * c["moe_intermediate_size"])
    moe_block = _block(_mla_attention(c), moe, hidden)
    dense_count = c["first_k_dense_replace"]
    return ModelUnits(
        name,
        _ends(
            c,
            [
                Unit("dense_decoder_layer", dense_count, dense),
                Unit("moe_decoder_layer", c["num_hidden_layers"] - dense_count, moe_block),
            ],
        ),
    )


def _gpt_oss(name: str, c: dict) -> ModelUnits:
    """GPT-OSS: biased GQA with attention sinks, a biased router and fused experts
    (``gate_up_proj [experts, hidden, 2 * intermediate]``). ``sinks`` is the attention
    module's own parameter, so ``named_parameters()`` yields it before the projections."""
    hidden, inter, experts = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    attention = [("self_attn.sinks", (c["num_attention_heads"],))] + _gqa_attention(c, bias=True)
    moe = _linear("mlp.router", experts, hidden, bias=True) + [
        ("mlp.experts.gate_up_proj", (experts, hidden, 2 * inter)),
        ("mlp.experts.gate_up_proj_bias", (experts, 2 * inter)),
        ("mlp.experts.down_proj", (experts, inter, hidden)),
        ("mlp.experts.down_proj_bias", (experts, hidden)),
    ]
    block = _block(attention, moe, hidden)
    blocks = [Unit("decoder_layer", c["num_hidden_layers"], block)]
    return ModelUnits(name, _ends(c, blocks))


# Hugging Face ``model_type`` -> builder; the catalogue's own models by name.
_BUILDERS = {
    "llama": _llama,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}
_CATALOG_TYPES = {
    "Llama-3-8B": "llama",
    "Llama-3-70B": "llama",
    "Llama-3.1-405B": "llama",
    "Mixtral-8x7B": "mixtral",
    "Qwen3-30B-A3B": "qwen3_moe",
    "DeepSeek-V3-671B": "deepseek_v3",
    "GPT-OSS-120B": "gpt_oss",
}


def model_from_config(name: str, config: dict) -> ModelUnits:
    """FSDP units of a model from its Hugging Face ``config.json`` contents.

    ``config["model_type"]`` picks the architecture (``llama``, ``mixtral``, ``qwen3_moe``,
    ``deepseek_v3``, ``gpt_oss``); ``head_dim`` defaults to ``hidden_size //
    num_attention_heads`` and ``num_key_value_heads`` to ``num_attention_heads``, as in
    the Hugging Face configs. Raises ``ValueError`` for another model type.
    """
    model_type = config.get("model_type", "llama")
    if model_type not in _BUILDERS:
        raise ValueError(
            f"model_type {model_type!r} is not supported; use one of {sorted(_BUILDERS)} "
            "(a Llama-like decoder can say model_type 'llama')"
        )
    c = dict(config)
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return _BUILDERS[model_type](name, c)


CATALOG: dict[str, ModelUnits] = {
    name: model_from_config(name, {**CONFIGS[name], "model_type": model_type})
    for name, model_type in _CATALOG_TYPES.items()
}
