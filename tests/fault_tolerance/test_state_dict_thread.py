"""``state_dict()`` from another thread while the unit trains: torchft's asynchronous quorum
builds the live group's state dict in its quorum thread while the forward runs."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from tests.fault_tolerance.heal import dcp_state_dicts_inside_a_forward, state_dicts_while_training

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


def test_dcp_state_dicts_from_another_thread_inside_a_forward(dist_run):
    """torchtitan's heal path under the async quorum: DCP's state dicts from another thread
    while a forward is inside a unit. Ours: no error (before: ``KeyError`` in
    ``get_optimizer_state_dict``, the optimizer's parameters not among those the modules
    named), the optimizer state dict keyed by every parameter's name, every model entry this
    rank's shard, and the step's loss what it is without the thread. FSDP2, forced to meet
    the forward the same way, fails in the forward (its state dict reshards under it)."""
    for result in dist_run(dcp_state_dicts_inside_a_forward, 2, "vescale"):
        assert result["errors"] == []
        assert result["named"] == result["states"]
        assert result["foreign"] == []
        assert result["unsharded"] == []
        assert result["loss"] == result["alone"]
    for result in dist_run(dcp_state_dicts_inside_a_forward, 2, "torch"):
        assert any("main thread" in error for error in result["errors"]), result["errors"]
