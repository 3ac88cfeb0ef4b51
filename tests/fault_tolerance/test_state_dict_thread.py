"""``state_dict()`` from another thread while the unit trains: torchft's asynchronous quorum
builds the live group's state dict in its quorum thread while the forward runs."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from tests.fault_tolerance.heal import state_dicts_while_training

pytestmark = pytest.mark.timeout(300)


def test_state_dict_from_another_thread_while_training(dist_run):
    """A thread taking the model's and optimizer's state dicts in a loop while the main thread
    trains: neither fails (before: the state dict's reshard swapped the sharded parameters in
    under the forward), every entry the thread sees is this rank's shard (never a gathered
    parameter), and training is bit for bit what it is without the thread."""
    for result in dist_run(state_dicts_while_training, 2, "vescale"):
        assert result["errors"] == []
        assert result["reads"] > 0
        assert result["unsharded"] == []
        assert result["losses"] == result["alone"]
