"""A peer dying inside one of our collectives: the survivor's error names the unit and the
collective, leaves nothing half-landed or pending, and the survivor rejoins a new group and
trains on equal to FSDP2 doing the same (see :mod:`.collective_fault`)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.fault_tolerance.collective_fault import failing_reduction, run_case
from tests.support.parity import PARAM_TOL, TOL

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

EXPECTED = {
    "forward": "all-gather in forward of unit 'layers.0' failed",
    "backward": "reduce-scatter of unit 'layers.0' failed",
}


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_peer_death_names_the_unit_and_the_survivor_rejoins(tmp_path, phase):
    results = {}
    for engine in ("vescale", "torch"):
        (tmp_path / engine).mkdir()
        results[engine] = run_case(engine, phase, tmp_path / engine)
    ours, fsdp2 = results["vescale"][("first", 0)], results["torch"][("first", 0)]
    print(f"\n{phase}, FSDP2's error: {fsdp2['fault']['type']}: {fsdp2['fault']['text']}")
    print(f"{phase}, ours: {ours['fault']['type']}: {ours['fault']['text']}")
    fault = ours["fault"]
    # The error: ours, naming the unit and the collective, chained to the backend's.
    assert fault["type"] == "CollectiveError"
    assert EXPECTED[phase] in fault["text"], fault["text"]
    assert fault["cause"] is not None
    assert fault["cause"].split(":", 1)[1].strip() in fault["text"]
    # Nothing half-landed: the reduce-scatter's gradients (views of the buffer it was writing)
    # are gone, not left holding a partial reduction.
    assert all(grad is None for grad in fault["grads"].values()), [
        n for n, g in fault["grads"].items() if g is not None
    ]
    # The reset waits on nothing of the broken group; nothing pending, no gradient, no thread.
    assert fault["reset_seconds"] < 2, fault["reset_seconds"]
    assert not any(fault["pending"]), fault["pending"]
    assert fault["grads_after_reset"] == []
    assert fault["threads_left"] == []
    assert fsdp2["fault"]["threads_left"] == []
    # The broken group is refused at once (not after gloo's timeout), naming the first failure.
    text, seconds = fault["next_step"]
    assert "its process group failed earlier" in text, text
    assert EXPECTED[phase].removesuffix(" failed") in text, text
    assert seconds < 2
    # After the rejoin (new group, checkpoint reloaded), both ranks train on as FSDP2's do.
    for key in (("first", 0), ("replacement", 1)):
        got, want = results["vescale"][key], results["torch"][key]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOL)
        for name, value in want["full"].items():
            torch.testing.assert_close(got["full"][name], value, **PARAM_TOL, msg=lambda m: f"{key} {name}: {m}")


@pytest.mark.parametrize("hsdp", [False, True], ids=["reduce_scatter_accumulating", "hsdp_all_reduce"])
def test_failed_reduction_names_the_unit_and_lands_nothing(dist_run, hsdp):
    """The reduce-scatter (onto gradients accumulated before) or HSDP's all-reduce fails:
    the error names the unit and the collective; accumulated gradients keep their values,
    in-place ones (views of the buffer being reduced) are gone; the group is refused after."""
    for rank in dist_run(failing_reduction, 2, hsdp):
        collective = "all-reduce across replicas (HSDP)" if hsdp else "reduce-scatter"
        assert re.search(rf"{re.escape(collective)} of unit '(blocks\.[01]|<root>)' failed", rank["text"]), rank["text"]
        assert "simulated: Connection closed by peer" in rank["text"]
        for name, before in rank["before"].items():
            after = rank["after"][name]
            if before is None:
                assert after is None, name
            else:
                assert torch.equal(after, before), name
        assert f"{collective} of unit" in rank["refused"], rank["refused"]
        assert "its process group failed earlier" in rank["refused"], rank["refused"]
