"""The repository's git state: what running the examples writes stays out of ``git status``."""

import subprocess

import pytest

from tests.support.launched import REPO


@pytest.mark.distributed  # runs git
def test_example_output_directories_are_ignored_by_git():
    for path in (
        "lightning_train_output/last.ckpt",
        "examples/fabric_train_output/checkpoint",
        "accelerate_train_output/state",
    ):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0, path
