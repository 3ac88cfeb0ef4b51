"""Tiny Hugging Face models (random init from a small config, nothing downloaded) and their data.

Shared by the scripts the Hugging Face tests launch (``hf_trainer_run.py``,
``hf_lightning_run.py``) and by the tests, which reload what those runs saved. Each model is
one of the families the issue names: Llama (decoder), GPT-2 (tied embedding, Conv1D),
Mixtral (mixture of experts: routing differs per rank) and BERT (encoder, masked LM). Dropout
is off everywhere so that DDP and FSDP runs can be compared to fp32 tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers

VOCAB = 101
SEQ = 16
SAMPLES = 32  # enough for 2 optimizer steps x accumulation 2 x 2 per device x 2 ranks, twice over
MASK_ID = 3  # BERT's [MASK] here: any id works for a randomly initialised model


# The size Llama, Mixtral and BERT share; each family's own keys stand beside it.
_TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}


def _llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(**_TINY, intermediate_size=64, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _mixtral() -> transformers.PreTrainedModel:
    config = transformers.MixtralConfig(
        **_TINY,
        intermediate_size=48,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )
    return transformers.MixtralForCausalLM(config)


def _bert() -> transformers.PreTrainedModel:
    config = transformers.BertConfig(
        **_TINY, intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    return transformers.BertForMaskedLM(config)


MODELS: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    "llama": _llama,
    "gpt2": _gpt2,
    "mixtral": _mixtral,
    "bert": _bert,
}
AUTO_CLASSES = {
    "llama": transformers.AutoModelForCausalLM,
    "gpt2": transformers.AutoModelForCausalLM,
    "mixtral": transformers.AutoModelForCausalLM,
    "bert": transformers.AutoModelForMaskedLM,
}


def make_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    """The same random weights on every rank and in every run."""
    torch.manual_seed(seed)
    return MODELS[name]()


def examples(name: str) -> list[dict[str, torch.Tensor]]:
    """``SAMPLES`` training examples; causal LMs predict every token, BERT a masked quarter of them."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, VOCAB, (SAMPLES, SEQ), generator=g)
    if name != "bert":
        return [{"input_ids": t, "labels": t.clone()} for t in tokens]
    masked = torch.rand(SAMPLES, SEQ, generator=g) < 0.25
    masked[:, 0] = True  # every example has at least one label
    inputs = torch.where(masked, torch.full_like(tokens, MASK_ID), tokens)
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    return [{"input_ids": i, "labels": label} for i, label in zip(inputs, labels)]


# Fine-tuning variants of a model: PEFT LoRA adapters (r=8 on the attention's q and v
# projections, as PEFT's own examples), over the base weights in fp32 (``lora``) or, QLoRA
# style without the 4-bit kernels CPUs lack, over frozen bf16 base weights (``qlora``); PEFT
# keeps the adapters in fp32 either way.
FINE_TUNING = ("lora", "qlora")


def make_lora_model(name: str, variant: str, seed: int = 0) -> Any:
    """``make_model(name, seed)`` with LoRA adapters: only the adapters train."""
    import peft

    model = make_model(name, seed)
    if variant == "qlora":
        model = model.to(torch.bfloat16)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(seed)
    return peft.get_peft_model(model, config)


def probe_input() -> torch.Tensor:
    """A fixed batch whose logits compare the trained model, its saved copy and DDP's."""
    return torch.randint(5, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))


def full_parameters(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every parameter as a full fp32 CPU tensor, named as in the bare model (a collective for
    sharded parameters: call on every rank). ``prefix``: the bare model's name in ``model``."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        # Activation-checkpoint wrappers insert a module level into the name (not into state dicts).
        out[name.replace("_checkpoint_wrapped_module.", "").removeprefix(prefix)] = t.detach().float().cpu().clone()
    return out


def assert_training_moved(name: str, variant: str, trained: dict[str, Any]) -> None:
    """Training changed the model: some trained parameter differs from the run's initial one
    (the LoRA model under a ``FINE_TUNING`` variant, else the bare model)."""
    initial = full_parameters(make_lora_model(name, variant) if variant in FINE_TUNING else make_model(name))
    assert any(not torch.allclose(initial[k], v) for k, v in trained["params"].items())


def assert_trained_alike(got: dict[str, Any], want: dict[str, Any], rank: int) -> None:
    """One rank's record of a run (losses, final parameters, probe logits) equals the reference run's."""
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), msg=lambda m: f"rank {rank} losses: {m}"
    )
    assert got["params"].keys() == want["params"].keys()
    for key, value in want["params"].items():
        torch.testing.assert_close(got["params"][key], value, msg=lambda m: f"rank {rank} {key}: {m}")
    torch.testing.assert_close(got["logits"], want["logits"], msg=lambda m: f"rank {rank} logits: {m}")


def assert_saved_model_matches(saved_dir: Any, name: str, trained: dict[str, Any]) -> None:
    """The model saved in ``saved_dir`` loads with ``from_pretrained`` in this (single)
    process with the trained run's parameters exactly and its logits on ``probe_input()``,
    and GPT-2's head stays tied to its embedding."""
    model = AUTO_CLASSES[name].from_pretrained(saved_dir)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe_input()).logits
    torch.testing.assert_close(logits, trained["logits"])
    loaded = full_parameters(model)
    assert loaded.keys() == trained["params"].keys()
    for key, value in trained["params"].items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight


def assert_fine_tuned(name: str, variant: str, trained: dict[str, Any]) -> None:
    """A fine-tuning run trained only its fp32 adapters: every base weight is bit for bit what
    it was (bf16 under ``qlora``), and every adapter moved."""
    initial = make_lora_model(name, variant)
    dtypes = {n: p.dtype for n, p in initial.named_parameters()}
    before = full_parameters(initial)
    assert trained["params"].keys() == before.keys()
    adapters = [key for key in before if "lora_" in key]
    assert adapters
    assert all(dtypes[key] == torch.float32 for key in adapters)
    base_dtype = torch.bfloat16 if variant == "qlora" else torch.float32
    for key, value in before.items():
        if key in adapters:
            assert not torch.equal(trained["params"][key], value), f"adapter {key} did not train"
        else:
            assert dtypes[key] == base_dtype, key
            assert torch.equal(trained["params"][key], value), f"frozen {key} changed"


def assert_saved_adapter_matches(saved_dir: Any, name: str, variant: str, trained: dict[str, Any]) -> None:
    """The adapter saved in ``saved_dir`` (``save_pretrained``: the adapters alone) loads onto
    the base model in this (single) process with the trained parameters exactly and its
    logits on ``probe_input()``."""
    import peft
    import safetensors.torch

    saved = safetensors.torch.load_file(f"{saved_dir}/adapter_model.safetensors")
    assert saved, sorted(saved)
    assert all("lora_" in key for key in saved), sorted(saved)
    base = make_model(name)
    model = peft.PeftModel.from_pretrained(base.to(torch.bfloat16) if variant == "qlora" else base, saved_dir)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe_input()).logits.float()
    torch.testing.assert_close(logits, trained["logits"], rtol=0, atol=0)
    loaded = full_parameters(model)
    assert loaded.keys() == trained["params"].keys()
    for key, value in trained["params"].items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


def count_expert_tokens(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
    """Count, from now on, the tokens each Mixtral layer routes to each expert; call the result to read them.

    Evidence that routing is data dependent: ranks with different batches route differently.
    """
    counts: list[torch.Tensor] = []
    routers = [m for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"]
    for layer, router in enumerate(routers):
        counts.append(torch.zeros(router.num_experts, dtype=torch.long))

        def hook(module, args, output, layer=layer):
            top_k_index = output[-1]  # (router_logits, top_k_weights, top_k_index)
            counts[layer] += torch.bincount(top_k_index.flatten().cpu(), minlength=counts[layer].numel())

        router.register_forward_hook(hook)
    assert routers, "no Mixtral router found"
    return lambda: torch.stack(counts)
