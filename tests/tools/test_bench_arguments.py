"""The benchmark's arguments: a bad one is refused with a message saying what is wrong."""

import re

import pytest

from vescale_plugins.bench.__main__ import parse_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "0"], "argument --world-size: 0 is too small: it must be at least 1"),
        (["--block-rows", "0"], "argument --block-rows: 0 is too small: it must be at least 1"),
        (["--steps", "0"], "argument --steps: 0 is too small: it must be at least 1"),
        (["--batch-size", "0"], "argument --batch-size: 0 is too small: it must be at least 1"),
        (["--warmup", "-1"], "argument --warmup: -1 is too small: it must be at least 0"),
        (["--steps", "two"], "argument --steps: 'two' is not an integer"),
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
