"""A ``.grad`` the user assigns between steps is added to by the next backward, as FSDP2 does.

``p.grad = torch.zeros_like(p)`` (or any DTensor of the parameter's layout) is not a view of
the unit's sharded gradient buffer; FSDP2 adds the next reduced gradient to it
(``grad._local_tensor += new``). Ours lost the new gradient: the reduction landed in the buffer
and the assigned tensor kept its values.
"""

import pytest
import torch

from tests.support.models import local_batch, loss_fn
from tests.support.parity import TOL, reference_ours_and_fsdp2s


def _assigned_grads_accumulate_as_fsdp2s(fill):
    _, ours, fsdp2 = reference_ours_and_fsdp2s()
    tokens, targets = local_batch(0)
    for model in (ours, fsdp2):
        for index, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, fill * (index + 1))
        loss_fn(model(tokens), targets).backward()
    moved = 0
    for (name, got), want in zip(ours.named_parameters(), fsdp2.parameters()):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad.full_tensor(), **TOL, msg=name)
        moved += int(not torch.equal(want.grad.full_tensor(), torch.full_like(want.full_tensor(), 0.0)))
    assert moved > 0  # the backward reached the parameters


@pytest.mark.parametrize("fill", [0.0, 0.25], ids=["zeros", "values"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_assigned_grads_accumulate_as_fsdp2s(dist_run, world_size, fill):
    dist_run(_assigned_grads_accumulate_as_fsdp2s, world_size, fill, timeout=120)
