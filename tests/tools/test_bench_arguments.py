"""What a newcomer meets first: the benchmark's arguments and output, the repository's git state."""

import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from vescale_plugins.bench.__main__ import parse_args
from vescale_plugins.observe.quiet_profiler import profile

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "0"], "argument --world-size: 0 is too small: it must be at least 1"),
        (["--block-rows", "0"], "argument --block-rows: 0 is too small: it must be at least 1"),
        (["--steps", "0"], "argument --steps: 0 is too small: it must be at least 1"),
        (["--batch-size", "0"], "argument --batch-size: 0 is too small: it must be at least 1"),
        (["--warmup", "-1"], "argument --warmup: -1 is too small: it must be at least 0"),
        (["--steps", "two"], "argument --steps: 'two' is not an integer"),
        (["--model", "smal"], "argument --model: 'smal' is neither a preset (.*) \\(did you mean 'small'\\?\\) nor a directory"),
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


def _profile_once(profiler_class):
    with profiler_class(activities=[ProfilerActivity.CPU], profile_memory=True):
        torch.ones(3).add_(1)


def test_profiler_markers_do_not_reach_stderr(capfd):
    _profile_once(torch_profile)
    assert "profiler_start" in capfd.readouterr().err  # what the benchmark printed dozens of times
    _profile_once(profile)
    assert "profiler_" not in capfd.readouterr().err


def test_example_output_directories_are_ignored_by_git():
    for path in ("lightning_train_output/last.ckpt", "examples/fabric_train_output/checkpoint", "accelerate_train_output/state"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0, path
