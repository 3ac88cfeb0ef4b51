"""The benchmark's arguments: a bad one is refused with a message saying what is wrong."""

import re

import pytest

from vescale_plugins.bench.__main__ import parse_args


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "0"], "argument --world-size: 0 is too small: it must be at least 1"),
        (["--block-rows", "0"], "argument --block-rows: 0 is too small: it must be at least 1"),
        (["--steps", "0"], "argument --steps: 0 is too small: it must be at least 1"),
        (["--batch-size", "0"], "argument --batch-size: 0 is too small: it must be at least 1"),
        (["--warmup", "-1"], "argument --warmup: -1 is too small: it must be at least 0"),
        (["--steps", "two"], "argument --steps: 'two' is not an integer"),
        (
            ["--engines", "zero3"],
            "argument --engines: unknown engine 'zero3': choose from fsdp2, vescale, megatron-fsdp, megatron-fsdp-v2, deepspeed",
        ),
        (["--comm", "int4"], "argument --comm: unknown --comm 'int4': choose from int8, int8-grads"),
        (
            ["--model", "smal"],
            "argument --model: 'smal' is neither a preset (.*) \\(did you mean 'small'\\?\\) nor a directory",
        ),
    ],
)
def test_bench_arguments_are_refused_with_a_clear_message(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def test_bench_arguments_that_are_fine_pass(tmp_path):
    args = parse_args(["--world-size", "3", "--block-rows", "2", "--warmup", "0", "--model", str(tmp_path)])
    assert (args.world_size, args.block_rows, args.warmup, args.model) == (3, 2, 0, str(tmp_path))
    assert parse_args(["--model", "org/some-model"]).model == "org/some-model"  # a hub id is the user's call


def test_engines_always_include_the_reference_and_ours_first():
    assert parse_args([]).engines == ("fsdp2", "vescale")
    assert parse_args(["--engines", "vescale"]).engines == ("fsdp2", "vescale")


def test_the_zero3_config_is_sized_to_the_units_and_frees_after_forward():
    from vescale_plugins.bench.deepspeed_engine import zero3_config
    from vescale_plugins.bench.llama import PRESETS

    model = PRESETS["small"].build()
    config = zero3_config(model, batch_size=4, mixed_precision=False, free_after_forward=True)
    zero = config["zero_optimization"]
    largest = max(sum(p.numel() for m in modules for p in m.parameters()) for _, modules in model.fsdp_units())
    assert zero["reduce_bucket_size"] == zero["stage3_prefetch_bucket_size"] == largest  # not DeepSpeed's 5e8
    assert zero["stage3_max_reuse_distance"] == 0
    assert zero["stage3_max_live_parameters"] == 2 * largest
    # The norms stay whole, every matrix is partitioned (as FSDP shards it).
    assert zero["stage3_param_persistence_threshold"] == PRESETS["small"].hidden_size
    assert min(p.numel() for p in model.parameters() if p.dim() == 2) > zero["stage3_param_persistence_threshold"]
    assert "bf16" not in config
    assert "offload_param" not in zero
    assert "offload_optimizer" not in zero
    kept = zero3_config(model, batch_size=4, mixed_precision=True, free_after_forward=False)
    assert "stage3_max_reuse_distance" not in kept["zero_optimization"]
    assert kept["bf16"] == {"enabled": True}
    assert kept["communication_data_type"] == "fp32"
