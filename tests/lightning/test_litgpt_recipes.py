"""LitGPT 0.5.13's three recipes with the vescale_fsdp Fabric strategy swapped in, loss for loss
against Lightning's ``ModelParallelStrategy`` + torch's FSDP2 from the same start weights, W=2.

Two ways. The recipes' own ``setup()`` (``_*_setup``): ``litgpt.pretrain.setup``,
``litgpt.finetune.full.setup`` and ``litgpt.finetune.lora.setup`` called as a user would, with
the strategy name in the recipe's module bound to ours and nothing else of LitGPT patched; a
checkpoint directory, a tokenizer and a data set written into tmp_path, ``sys.argv`` set to the
command line ``save_hyperparameters`` parses. The losses the recipes log (``metrics.csv``), their
final checkpoints and LoRA's adapters and merged model are compared with the same recipe run on
``_FSDP2Reference``, which is not Lightning's FSDP1 ``FSDPStrategy`` (Fabric refuses it off GPU);
pretraining's ``torch.compile`` is switched off (minutes on two CPU cores; our compile path is
tests/runtime/test_compile.py).

And each recipe's ``main`` reproduced call for call with LitGPT's own objects and functions
(``GPT``, ``Config``, ``Block``, ``litgpt.lora``, ``pretrain.initialize_weights``,
``utils.load_checkpoint``, ``utils.instantiate_torch_optimizer``, ``chunked_cross_entropy``,
the LoRA recipe's own ``parallelize_fn`` and ``save_lora_checkpoint``), with the strategy
built from the recipe's own arguments: this covers what ``setup()`` does not reach, full
fine-tuning resumed from its periodic save as its ``resume`` branch does, and a LoRA
reference on stock LitGPT's own ``ModelParallelStrategy`` branch (loaded before the optimizer
is built: in the recipe's order, its ``assign=True`` load leaves the adapters untrained).

The reference shards as the recipes' strategy does on FSDP2: each ``Block`` (checkpoint-wrapped
for full fine-tuning), then the root; the LoRA recipe's ``parallelize_fn`` runs unchanged under
both strategies (under ours its torch ``fully_shard`` calls run ours). The checkpoints each
recipe saves are loaded by stock LitGPT on rank 0 (``lazy_load`` + ``load_state_dict``; LoRA
adapters into ``litgpt.lora.GPT``, then ``merge_lora_weights``) and compared with the reference.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy, Strategy
from lightning_utilities.core import rank_zero as rank_zero_module
from torch.distributed._composable import checkpoint
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from lightning_strategy import VeScaleFSDPFabricStrategy
from tests.support.lightning_harness import launched_by_harness
from tests.support.parity import EXACT

# `make setup` installs LitGPT in the default (2.13.0) environment only; the other releases'
# environments run none of tests/lightning (make test-other-torch).
litgpt = pytest.importorskip("litgpt", reason="LitGPT is installed in the torch 2.13.0 environment only (Makefile)")
from litgpt import lora  # noqa: E402
from litgpt.finetune import lora as lora_recipe  # noqa: E402
from litgpt.model import GPT, Block, Config  # noqa: E402
from litgpt.pretrain import initialize_weights  # noqa: E402
from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer, lazy_load, load_checkpoint  # noqa: E402

WORLD, MICRO_BATCH, ACCUMULATE, STEPS = 2, 2, 2, 3
RESUME_AT = 2  # full fine-tuning saves its resumable state after this many steps
ARCH = dict(
    block_size=16,
    vocab_size=64,
    padded_vocab_size=64,
    n_layer=2,
    n_head=4,
    n_embd=32,
    n_query_groups=2,
    rotary_percentage=1.0,
    parallel_residual=False,
    bias=False,
    norm_class_name="RMSNorm",
    mlp_class_name="LLaMAMLP",
    intermediate_size=48,
)
LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True, lora_mlp=True)


def _batch(step: int, micro: int) -> torch.Tensor:
    """This rank's token ids for one micro-batch, the same under both strategies."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randint(0, ARCH["vocab_size"], (MICRO_BATCH, ARCH["block_size"]), generator=g)


def _fit(fabric, model, optimizer, max_norm: float | None, steps: range = range(STEPS)) -> list[float]:
    """The recipes' step: accumulate under ``no_backward_sync``, (clip,) step, zero; local losses."""
    losses = []
    for step in steps:
        for micro in range(ACCUMULATE):
            input_ids = _batch(step, micro)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                logits = model(input_ids)
                loss = chunked_cross_entropy(logits[..., :-1, :], input_ids[..., 1:])
                fabric.backward(loss / ACCUMULATE)
            losses.append(loss.item())
        if max_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=max_norm)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered (a collective), names as in a LitGPT checkpoint."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        name = name.removeprefix("_forward_module.").replace("_checkpoint_wrapped_module.", "")
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def _fabric(strategy) -> Fabric:
    # The recipes: L.Fabric(devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision, ...)
    return Fabric(accelerator="cpu", devices=WORLD, num_nodes=1, strategy=strategy, precision="32-true")


def _fsdp2_blocks_and_root(checkpoint_blocks: bool):
    """What the recipes' ``FSDPStrategy(auto_wrap_policy={Block}, ...)`` shards, in FSDP2 terms."""

    def parallelize(model, device_mesh):
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if isinstance(module, Block):
                # The composable form: Lightning's load_raw does not see through checkpoint_wrapper's names.
                if checkpoint_blocks:
                    checkpoint(module)
                fully_shard(module, mesh=device_mesh["data_parallel"])
        fully_shard(model, mesh=device_mesh["data_parallel"])
        return model

    return parallelize


def _start_weights(root: Path, config: Config, model_cls) -> Path:
    """The "pretrained" checkpoint both strategies start from: ``lit_model.pth``, written on rank 0,
    with a base model's names (a LoRA model's start values of its adapters too)."""
    path = root / "lit_model.pth"
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        state = model_cls(config).state_dict()
        torch.save({name.replace(".linear.", "."): value for name, value in state.items()}, path)
    dist.barrier()
    return path


def _stock_litgpt_params(path: Path, config: Config) -> dict[str, torch.Tensor]:
    """Stock LitGPT's load of a full checkpoint (``load_checkpoint``'s single-device branch)."""
    model = GPT(config)
    state_dict = lazy_load(path)
    model.load_state_dict(state_dict.get("model", state_dict), strict=True)
    return {name: p.detach() for name, p in model.named_parameters()}


# -- pretrain ---------------------------------------------------------------------------------


def _pretrain_main(fabric, config, initial_checkpoint: Path, out_dir: Path):
    # litgpt/pretrain.py main(), less torch.compile, the data and the logging.
    fabric.seed_everything(42)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    model = fabric.setup(model)
    optimizer = instantiate_torch_optimizer("AdamW", model.parameters(), fused=False)
    optimizer = fabric.setup_optimizers(optimizer)
    fabric.load_raw(initial_checkpoint, model)
    losses = _fit(fabric, model, optimizer, max_norm=1.0)
    state = {"model": model, "optimizer": optimizer, "iter_num": STEPS * ACCUMULATE, "step_count": STEPS}
    fabric.save(out_dir / "step-final" / "lit_model.pth", state)  # pretrain.save_checkpoint's call
    return losses, _full_params(model)


def _pretrain(root: str):
    root = Path(root)
    config = Config(**ARCH)
    initial = _start_weights(root, config, GPT)
    with launched_by_harness():
        # litgpt/pretrain.py: FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="HYBRID_SHARD")
        ours = _fabric(
            VeScaleFSDPFabricStrategy(
                auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="HYBRID_SHARD"
            )
        )
        our_losses, our_params = ours.launch(_pretrain_main, config, initial, root / "ours")
        theirs = _fabric(
            ModelParallelStrategy(
                parallelize_fn=_fsdp2_blocks_and_root(False), data_parallel_size=WORLD, tensor_parallel_size=1
            )
        )
        their_losses, their_params = theirs.launch(_pretrain_main, config, initial, root / "fsdp2")
    stock = _stock_litgpt_params(root / "ours" / "step-final" / "lit_model.pth", config) if dist.get_rank() == 0 else {}
    return our_losses, their_losses, our_params, their_params, stock


# -- full fine-tune ---------------------------------------------------------------------------


def _full_main(fabric, config, checkpoint_path: Path, out_dir: Path):
    # litgpt/finetune/full.py main(), less the data, validation and logging.
    fabric.seed_everything(1337)
    with fabric.init_module(empty_init=(fabric.world_size > 1)):
        model = GPT(config)
    model = fabric.setup(model)
    optimizer = instantiate_torch_optimizer("AdamW", model.parameters())
    optimizer = fabric.setup_optimizers(optimizer)
    if isinstance(fabric.strategy, ModelParallelStrategy):
        # The reference: LitGPT's load_checkpoint has a ModelParallelStrategy branch for LoRA
        # models only (it renames every ".weight" to ".linear.weight"); Lightning's load_raw is
        # what its FSDPStrategy branch calls.
        fabric.load_raw(checkpoint_path, model)
    else:
        load_checkpoint(fabric, model, checkpoint_path)
    losses = _fit(fabric, model, optimizer, max_norm=None, steps=range(RESUME_AT))
    state = {"model": model, "optimizer": optimizer, "iter_num": RESUME_AT * ACCUMULATE, "step_count": RESUME_AT}
    fabric.save(out_dir / f"step-{RESUME_AT:06d}" / "lit_model.pth", state)  # fit()'s periodic save
    losses += _fit(fabric, model, optimizer, max_norm=None, steps=range(RESUME_AT, STEPS))
    save_path = out_dir / "final" / "lit_model.pth"
    save_path.parent.mkdir(parents=True, exist_ok=True)
    fabric.save(save_path, {"model": model})
    return losses, _full_params(model)


def _full_resume(fabric, config, out_dir: Path):
    # full.py main() with resume: the same set-up, then fabric.load(resume, state).
    fabric.seed_everything(1337)
    with fabric.init_module(empty_init=(fabric.world_size > 1)):
        model = GPT(config)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(instantiate_torch_optimizer("AdamW", model.parameters()))
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    fabric.load(out_dir / f"step-{RESUME_AT:06d}" / "lit_model.pth", state)
    assert state["step_count"] == RESUME_AT
    return _fit(fabric, model, optimizer, max_norm=None, steps=range(RESUME_AT, STEPS)), _full_params(model)


def _full(root: str):
    root = Path(root)
    config = Config(**ARCH)
    checkpoint = _start_weights(root, config, GPT)
    with launched_by_harness():
        # litgpt/finetune/full.py's FSDPStrategy arguments, as they are.
        def strategy():
            return VeScaleFSDPFabricStrategy(
                auto_wrap_policy={Block},
                activation_checkpointing_policy={Block},
                state_dict_type="full",
                limit_all_gathers=True,
                cpu_offload=False,
            )

        our_losses, our_params = _fabric(strategy()).launch(_full_main, config, checkpoint, root / "ours")
        resumed = _fabric(strategy()).launch(_full_resume, config, root / "ours")
        theirs = _fabric(
            ModelParallelStrategy(
                parallelize_fn=_fsdp2_blocks_and_root(True), data_parallel_size=WORLD, tensor_parallel_size=1
            )
        )
        their_losses, their_params = theirs.launch(_full_main, config, checkpoint, root / "fsdp2")
    stock = _stock_litgpt_params(root / "ours" / "final" / "lit_model.pth", config) if dist.get_rank() == 0 else {}
    return our_losses, their_losses, our_params, their_params, stock, resumed


# -- LoRA fine-tune ---------------------------------------------------------------------------


def _lora_main(fabric, config, checkpoint_path: Path, out_dir: Path):
    # litgpt/finetune/lora.py main(), less the data, validation and logging.
    fabric.seed_everything(1337)
    with fabric.init_module(empty_init=(fabric.world_size > 1)):
        model = lora.GPT(config)
    lora.mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    reference = isinstance(fabric.strategy, ModelParallelStrategy)
    if reference:
        # LitGPT's ModelParallelStrategy branch loads with load_state_dict(assign=True), which
        # replaces the parameters: an optimizer built before steps the replaced ones, and the
        # model's adapters never change (stock LitGPT 0.5.13). The reference loads first.
        load_checkpoint(fabric, model, checkpoint_path, strict=False)
    optimizer = instantiate_torch_optimizer("AdamW", model.parameters())
    optimizer = fabric.setup_optimizers(optimizer)
    if not reference:
        load_checkpoint(fabric, model, checkpoint_path, strict=False)  # the recipe's order
    losses = _fit(fabric, model, optimizer, max_norm=None)
    save_path = out_dir / "final" / "lit_model.pth.lora"
    save_path.parent.mkdir(parents=True, exist_ok=True)
    lora_recipe.save_lora_checkpoint(fabric, model, save_path)
    fabric.barrier()
    return losses, _full_params(model)


def _merged(base: Path, adapter: Path, config) -> dict[str, torch.Tensor]:
    """Stock LitGPT on one process: the base weights, the adapter, ``merge_lora_weights``."""
    model = lora.GPT(config)
    model.load_state_dict(lazy_load(base), strict=False)
    model.load_state_dict(lazy_load(adapter)["model"], strict=False)
    lora.merge_lora_weights(model)
    # litgpt.scripts.merge_lora saves the merged model under a base model's names, as here.
    return {name.replace(".linear.", "."): p for name, p in model.state_dict().items() if "lora_" not in name}


def _lora(root: str):
    root = Path(root)
    config = lora.Config(**ARCH, **LORA)
    checkpoint = _start_weights(root, config, lora.GPT)  # with the adapters' start values
    with launched_by_harness():
        # litgpt/finetune/lora.py: ModelParallelStrategy(parallelize_fn=parallelize_fn, data_parallel_size=..., tensor_parallel_size=1)
        mp_args = dict(parallelize_fn=lora_recipe.parallelize_fn, data_parallel_size=WORLD, tensor_parallel_size=1)
        log = rank_zero_module.log  # Lightning's Fabric or Trainer logger, whichever was imported last
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
        log.addHandler(handler)
        level = log.level
        log.setLevel(logging.INFO)
        try:
            our_losses, our_params = _fabric(VeScaleFSDPFabricStrategy(**mp_args)).launch(
                _lora_main, config, checkpoint, root / "ours"
            )
        finally:
            log.removeHandler(handler)
            log.setLevel(level)
        theirs = _fabric(ModelParallelStrategy(**mp_args))
        their_losses, their_params = theirs.launch(_lora_main, config, checkpoint, root / "fsdp2")
    merged = {}
    if dist.get_rank() == 0:
        adapter = Path("final") / "lit_model.pth.lora"
        merged = {who: _merged(checkpoint, root / who / adapter, config) for who in ("ours", "fsdp2")}
        merged["base"] = torch.load(checkpoint)
    routed_logs = [r for r in records if "called torch.distributed.fsdp.fully_shard" in r]
    return our_losses, their_losses, our_params, their_params, merged, routed_logs


# -- tests ------------------------------------------------------------------------------------


def _assert_same(got: dict, want: dict, tol: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tol, msg=lambda m: f"{what} {name}: {m}")


def _check_training(results, tol=EXACT):
    our_losses, their_losses, our_params, their_params = results[:4]
    assert len(our_losses) == STEPS * ACCUMULATE
    torch.testing.assert_close(our_losses, their_losses, **tol)
    _assert_same(our_params, their_params, tol, "parameter after training")


@pytest.mark.timeout(240)
def test_litgpt_pretrain_matches_fsdp2_and_loads_in_litgpt(dist_run, tmp_path):
    for rank, results in enumerate(dist_run(_pretrain, WORLD, str(tmp_path), timeout=200)):
        _check_training(results)
        if rank == 0:  # the checkpoint stock LitGPT loads holds the trained weights
            _assert_same(results[4], results[3], EXACT, "stock LitGPT's load of our checkpoint")


@pytest.mark.timeout(240)
def test_litgpt_full_finetune_matches_fsdp2_resumes_and_loads_in_litgpt(dist_run, tmp_path):
    for rank, results in enumerate(dist_run(_full, WORLD, str(tmp_path), timeout=200)):
        _check_training(results)
        resumed_losses, resumed_params = results[5]  # continued from the step-2 checkpoint
        torch.testing.assert_close(resumed_losses, results[0][RESUME_AT * ACCUMULATE :], **EXACT)
        _assert_same(resumed_params, results[2], EXACT, "parameter after resuming")
        if rank == 0:
            _assert_same(results[4], results[3], EXACT, "stock LitGPT's load of our checkpoint")


@pytest.mark.timeout(240)
def test_litgpt_lora_recipe_runs_unchanged_matches_fsdp2_and_merges(dist_run, tmp_path):
    for rank, results in enumerate(dist_run(_lora, WORLD, str(tmp_path), timeout=200)):
        _check_training(results)
        if rank == 0:
            merged = results[4]
            _assert_same(merged["ours"], merged["fsdp2"], EXACT, "merged LoRA weights")
            changed = [
                n for n, w in merged["base"].items() if "lora_" not in n and not torch.equal(w, merged["ours"][n])
            ]
            assert changed, "merging the trained adapters changed no weight"
            assert len(results[5]) == 1, results[5]  # the routing is logged once


# -- a model torch's FSDP2 sharded ------------------------------------------------------------


def _refused(root: str, where: str) -> str:
    config = Config(**ARCH)
    with launched_by_harness():
        fabric = _fabric(VeScaleFSDPFabricStrategy(parallelize_fn=_bound_before(where)))
        fabric.launch()
        torch.manual_seed(0)
        model = GPT(config)
        if where == "before setup":
            torch_fully_shard(model, mesh=fabric.strategy.device_mesh)
        with pytest.raises(ValueError, match="sharded by torch.distributed.fsdp.fully_shard") as error:
            fabric.setup_module(model)
    return str(error.value)


def _bound_before(where: str):
    def parallelize(model, device_mesh):
        if where == "in parallelize_fn":  # a name bound at import, out of the strategy's reach
            torch_fully_shard(model, mesh=device_mesh)
        return model

    return parallelize


@pytest.mark.parametrize("where", ["before setup", "in parallelize_fn"])
def test_model_sharded_by_torch_fsdp2_is_refused_with_the_way_out(dist_run, tmp_path, where):
    messages = dist_run(_refused, WORLD, str(tmp_path), where)
    assert messages[0] == messages[1]
    assert "GPT" in messages[0]
    assert "vescale_plugins.fully_shard" in messages[0]


# -- the recipes' own setup() -------------------------------------------------------------------

SETUP_STEPS, SETUP_MICRO, SETUP_GLOBAL = 3, 2, 8  # 8 / (2 ranks x 2) = 2 accumulated micro-batches
WORDS = [f"w{i}" for i in range(ARCH["vocab_size"] - 3)]


def _checkpoint_dir(root: Path, config: Config, model_cls) -> Path:
    """What ``setup(checkpoint_dir)`` reads, written on rank 0: the start weights, the config, a
    tokenizer ``litgpt.Tokenizer`` loads (a word-level ``tokenizers`` one over ``WORDS``) and a
    JSON instruction data set."""
    ckpt = root / "checkpoint"
    if dist.get_rank() == 0:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        ckpt.mkdir(parents=True)
        torch.manual_seed(0)
        state = model_cls(config).state_dict()
        torch.save({name.replace(".linear.", "."): value for name, value in state.items()}, ckpt / "lit_model.pth")
        (ckpt / "model_config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in ARCH.items()))
        vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
        tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(ckpt / "tokenizer.json"))
        special = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "tokenizer_class": "Tiny"}
        (ckpt / "tokenizer_config.json").write_text(json.dumps(special))
        g = torch.Generator().manual_seed(7)
        samples = []
        for _ in range(40):
            words = [WORDS[i] for i in torch.randint(0, len(WORDS), (12,), generator=g).tolist()]
            samples.append({"instruction": " ".join(words[:6]), "input": "", "output": " ".join(words[6:])})
        (root / "data.json").write_text(json.dumps(samples))
    dist.barrier()
    return ckpt


def _recipe_args(root: Path, who: str) -> dict:
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON
    from litgpt.prompts import Default

    return dict(
        out_dir=root / who,
        precision="32-true",
        devices=WORLD,
        data=JSON(json_path=root / "data.json", val_split_fraction=0.2, prompt_style=Default(), num_workers=0),
        train=TrainArgs(
            save_interval=None,
            log_interval=1,
            global_batch_size=SETUP_GLOBAL,
            micro_batch_size=SETUP_MICRO,
            lr_warmup_steps=1,
            epochs=5,
            max_steps=SETUP_STEPS,
            max_seq_length=ARCH["block_size"],
        ),
        eval=EvalArgs(interval=10**6, max_new_tokens=4, max_iters=1, initial_validation=False, final_validation=False),
    )


def _logged_losses(out_dir: Path) -> list[float]:
    """The ``loss`` column of the recipe's CSV log (rank 0's running mean over a step's micro-batches)."""
    with open(out_dir / "logs" / "csv" / "version_0" / "metrics.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row.get("loss")]


@contextmanager
def _swapped(module, name: str, strategy_cls):
    """The swap: the recipe module's strategy name bound to ``strategy_cls`` (None: LitGPT's own)."""
    original = getattr(module, name)
    if strategy_cls is not None:
        setattr(module, name, strategy_cls)
    try:
        yield
    finally:
        setattr(module, name, original)


def _run_setup(recipe, strategy_name: str, strategy_cls, argv: list[str], **kwargs) -> None:
    """``recipe.setup(**kwargs)`` as in a fresh process started by ``argv``: workers are reused,
    and Fabric seeds its DistributedSampler from ``PL_GLOBAL_SEED``, which the recipe's
    ``seed_everything`` sets only after the data loaders are built."""
    saved_argv, saved_seed = sys.argv, os.environ.pop("PL_GLOBAL_SEED", None)
    sys.argv = argv  # save_hyperparameters parses the command line a user typed
    try:
        with launched_by_harness(), _swapped(recipe, strategy_name, strategy_cls):
            recipe.setup(**kwargs)
    finally:
        sys.argv = saved_argv
        os.environ.pop("PL_GLOBAL_SEED", None)
        if saved_seed is not None:
            os.environ["PL_GLOBAL_SEED"] = saved_seed


class _FSDP2Reference(ModelParallelStrategy, FabricFSDPStrategy):
    """The reference for the full fine-tuning recipe: ``ModelParallelStrategy`` + FSDP2, sharding
    what the recipe's ``FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})``
    names, writing its ``state_dict_type="full"`` file. Lightning's FSDP1 cannot be the reference
    here: Fabric refuses it off GPU, and torch's FSDP1 wants an accelerator unless given a CPU
    ``device_id``, which Lightning never passes. An ``FSDPStrategy`` by class only so that LitGPT's
    ``load_checkpoint`` takes its ``load_raw`` branch (its ModelParallelStrategy branch renames
    every weight for LoRA models); every method is ``ModelParallelStrategy``'s."""

    def __init__(self, parallelize_fn=None, data_parallel_size=WORLD, tensor_parallel_size=1, **fsdp1_arguments):
        ModelParallelStrategy.__init__(
            self,
            parallelize_fn=parallelize_fn
            or _fsdp2_blocks_and_root("activation_checkpointing_policy" in fsdp1_arguments),
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=False,
        )

    # FSDPStrategy's clipping asks for FSDP1 modules; ModelParallelStrategy inherits Strategy's.
    clip_gradients_norm = Strategy.clip_gradients_norm

    def load_checkpoint(self, path, state=None, strict=True, **kwargs):
        """``fabric.load_raw(path, model)``: the full state dict under the model's names, as
        Lightning's FSDP loads it through ``load_state_dict`` (where ``litgpt.lora.GPT``'s hook
        maps a base checkpoint's ``qkv.weight`` to ``qkv.linear.weight``; torch's
        ``set_model_state_dict`` bypasses that hook and would drop those weights)."""
        if not isinstance(state, torch.nn.Module):
            return super().load_checkpoint(path, state, strict, **kwargs)
        names = set(state.state_dict())
        full = {}
        for name, value in torch.load(path).items():
            lora_name = name.replace(".weight", ".linear.weight").replace(".bias", ".linear.bias")
            full[name if name in names else lora_name] = value
        set_model_state_dict(state, full, options=StateDictOptions(full_state_dict=True, strict=strict))
        return {}


def _full_setup(root: str):
    from litgpt.finetune import full as full_recipe

    root = Path(root)
    ckpt = _checkpoint_dir(root, Config(**ARCH), GPT)
    argv = ["litgpt", "finetune_full", str(ckpt), "--devices", str(WORLD)]
    for who, cls in (("ours", VeScaleFSDPFabricStrategy), ("fsdp2", _FSDP2Reference)):
        _run_setup(full_recipe, "FSDPStrategy", cls, argv, checkpoint_dir=ckpt, **_recipe_args(root, who))
    if dist.get_rank() != 0:
        return None
    losses = {who: _logged_losses(root / who) for who in ("ours", "fsdp2")}
    final = {who: torch.load(root / who / "final" / "lit_model.pth")["model"] for who in ("ours", "fsdp2")}
    final["stock LitGPT's load of ours"] = _stock_litgpt_params(
        root / "ours" / "final" / "lit_model.pth", Config(**ARCH)
    )
    return losses, final


def _lora_setup(root: str):
    root = Path(root)
    ckpt = _checkpoint_dir(root, lora.Config(**ARCH, **LORA), lora.GPT)  # with the adapters' start values
    argv = ["litgpt", "finetune_lora", str(ckpt), "--devices", str(WORLD)]
    argv += [arg for key, value in LORA.items() for arg in (f"--{key}", str(value).lower())]
    for who, cls in (("ours", VeScaleFSDPFabricStrategy), ("fsdp2", _FSDP2Reference)):
        _run_setup(
            lora_recipe, "ModelParallelStrategy", cls, argv, checkpoint_dir=ckpt, **LORA, **_recipe_args(root, who)
        )
    if dist.get_rank() != 0:
        return None
    losses = {who: _logged_losses(root / who) for who in ("ours", "fsdp2")}
    final = root / "{}" / "final"
    adapters = {who: torch.load(str(final).format(who) + "/lit_model.pth.lora")["model"] for who in ("ours", "fsdp2")}
    # The recipe's own merge_lora (rank 0) writes the merged model beside the adapters.
    merged = {who: torch.load(str(final).format(who) + "/lit_model.pth") for who in ("ours", "fsdp2")}
    merged["base"] = torch.load(ckpt / "lit_model.pth")
    return losses, adapters, merged


class _TokenRows(torch.utils.data.Dataset):
    """Fixed rows of ``length`` token ids (pretraining's input and its shifted targets)."""

    def __init__(self, rows: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, ARCH["vocab_size"], (rows, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class _PretrainData(litgpt.data.DataModule):
    """A pretraining data module over in-memory token rows (LitGPT's own ones stream with litdata)."""

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = -1) -> None:
        self.batch_size, self.length = batch_size, max_seq_length + 1

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_TokenRows(32, self.length, 1), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(_TokenRows(8, self.length, 2), batch_size=self.batch_size)


def _pretrain_once(pretrain, root: Path, ckpt: Path, argv: list[str], who: str, cls, train, eval) -> None:
    kwargs = dict(model_config=Config(**ARCH), out_dir=root / who, precision="32-true", initial_checkpoint_dir=ckpt)
    kwargs.update(data=_PretrainData(), train=train, eval=eval, devices=WORLD, logger_name="csv")
    _run_setup(pretrain, "FSDPStrategy", cls, argv, model_name="tiny", **kwargs)


def _pretrain_setup(root: str):
    from litgpt import pretrain
    from litgpt.args import EvalArgs, TrainArgs

    root = Path(root)
    ckpt = _checkpoint_dir(root, Config(**ARCH), GPT)
    argv = ["litgpt", "pretrain", "tiny", "--devices", str(WORLD)]
    train = TrainArgs(
        save_interval=None,
        log_interval=1,
        global_batch_size=SETUP_GLOBAL,
        micro_batch_size=SETUP_MICRO,
        # pretraining stops by tokens: SETUP_STEPS steps of 2 micro-batches of block_size tokens, per rank
        max_tokens=SETUP_STEPS * 2 * SETUP_MICRO * ARCH["block_size"] * WORLD,
        max_norm=1.0,
        min_lr=4e-5,
        lr_warmup_steps=1,
        tie_embeddings=False,
    )
    eval = EvalArgs(interval=10**6, max_iters=1, initial_validation=False, final_validation=False)
    # The recipe wraps the model in torch.compile: compiling takes minutes on two CPU cores, so
    # dynamo is switched off as TORCH_COMPILE_DISABLE=1 would (the OptimizedModule runs eagerly;
    # our compile path is tests/runtime/test_compile.py).
    compile_disabled, torch._dynamo.config.disable = torch._dynamo.config.disable, True
    try:
        for who, cls in (("ours", VeScaleFSDPFabricStrategy), ("fsdp2", _FSDP2Reference)):
            _pretrain_once(pretrain, root, ckpt, argv, who, cls, train, eval)
    finally:
        torch._dynamo.config.disable = compile_disabled
    if dist.get_rank() != 0:
        return None
    losses = {who: _logged_losses(root / who) for who in ("ours", "fsdp2")}
    # pretrain.save_checkpoint saves the whole state, its (pickled) data loader too: a file this test wrote
    final = {
        w: torch.load(root / w / "final" / "lit_model.pth", weights_only=False)["model"] for w in ("ours", "fsdp2")
    }
    final["stock LitGPT's load of ours"] = _stock_litgpt_params(
        root / "ours" / "final" / "lit_model.pth", Config(**ARCH)
    )
    return losses, final


@pytest.mark.timeout(240)
def test_litgpt_full_finetune_setup_runs_with_the_strategy_swapped(dist_run, tmp_path):
    result = dist_run(_full_setup, WORLD, str(tmp_path), timeout=200)[0]
    losses, final = result
    assert len(losses["ours"]) == SETUP_STEPS * 2  # logged every micro-batch (log_interval=1)
    torch.testing.assert_close(losses["ours"], losses["fsdp2"], **EXACT)
    _assert_same(final["ours"], final["fsdp2"], EXACT, "the recipe's final checkpoint")
    _assert_same(final["stock LitGPT's load of ours"], final["fsdp2"], EXACT, "stock LitGPT's load")


@pytest.mark.timeout(240)
def test_litgpt_lora_setup_runs_with_the_strategy_swapped(dist_run, tmp_path):
    losses, adapters, merged = dist_run(_lora_setup, WORLD, str(tmp_path), timeout=200)[0]
    assert len(losses["ours"]) == SETUP_STEPS * 2
    torch.testing.assert_close(losses["ours"], losses["fsdp2"], **EXACT)
    _assert_same(adapters["ours"], adapters["fsdp2"], EXACT, "the recipe's LoRA checkpoint")
    _assert_same(merged["ours"], merged["fsdp2"], EXACT, "the recipe's merged checkpoint")
    assert any(not torch.equal(w, merged["ours"][n]) for n, w in merged["base"].items() if "lora_" not in n)


@pytest.mark.timeout(300)
def test_litgpt_pretrain_setup_runs_with_the_strategy_swapped(dist_run, tmp_path):
    losses, final = dist_run(_pretrain_setup, WORLD, str(tmp_path), timeout=60)[0]
    assert len(losses["ours"]) == SETUP_STEPS
    torch.testing.assert_close(losses["ours"], losses["fsdp2"], **EXACT)
    _assert_same(final["ours"], final["fsdp2"], EXACT, "the recipe's final checkpoint")
    _assert_same(final["stock LitGPT's load of ours"], final["fsdp2"], EXACT, "stock LitGPT's load")
