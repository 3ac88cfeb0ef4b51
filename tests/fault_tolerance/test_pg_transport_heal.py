"""Healing a restarted replica group over torchft's ``PGTransport``: our engine and FSDP2 side by
side, counting what the transport sends (see :mod:`.heal`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchft")

from tests.fault_tolerance.heal import heal_over_pg_transport  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _check_healed(results: list[dict]) -> None:
    """Ranks 0, 1 are replica 0's; 2, 3 replica 1's: each healed rank holds its peer's state
    bit for bit, and the step after the heal agrees too."""
    for live, healed in ((results[0], results[2]), (results[1], results[3])):
        assert (live["replica"], healed["replica"]) == (0, 1)
        print("LOSS", live["loss"], healed["loss"], [k for k in live["after"] if not torch.equal(live["after"][k], healed["after"][k])])
        assert live["healed"].keys() == healed["healed"].keys()
        for key in live["healed"]:
            assert torch.equal(live["healed"][key], healed["healed"][key]), key
            assert torch.equal(live["after"][key], healed["after"][key]), key
        assert live["loss"] == healed["loss"]


def _sent(results: list[dict]) -> tuple[int, int]:
    return sum(r["messages"] for r in results), sum(r["bytes"] for r in results)


@pytest.mark.parametrize("in_place", [False, True], ids=["allocated", "in_place"])
def test_heal_sends_no_more_than_fsdp2(dist_run, in_place):
    """Healing our sharded transformer over torchft's own ``PGTransport`` sends at most FSDP2's
    bytes (before the fix: the unit's whole buffer per parameter, 4x), and the healed group
    equals the live one bit for bit, then trains on identically."""
    ours = dist_run(heal_over_pg_transport, 4, "vescale", "torchft", in_place=in_place)
    fsdp2 = dist_run(heal_over_pg_transport, 4, "torch", "torchft", in_place=in_place)
    _check_healed(fsdp2)
    _check_healed(ours)
    (our_messages, our_bytes), (fsdp2_messages, fsdp2_bytes) = _sent(ours), _sent(fsdp2)
    print(f"PGTransport heal: ours {our_bytes} B in {our_messages} sends, FSDP2 {fsdp2_bytes} B in {fsdp2_messages}")
    assert our_bytes <= fsdp2_bytes
