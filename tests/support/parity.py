"""Train the test decoder sharded and compare it with a reference, parameter by parameter.

The reference is the same model on one process fed the global batch (``models.reference_step``)
or an FSDP2 model; tolerances are the ones every parity test uses.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from tests.support.models import clone, local_batch, loss_fn, make_decoder, reference_step
from vescale_plugins import RaggedShard, fully_shard

TOL = dict(rtol=2e-5, atol=2e-6)
# Adam divides by sqrt(v): a gradient element near zero turns its rounding difference into a
# visible update difference, so parameters after steps get 0.1% of one lr=1e-2 update.
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)
# Two engines that run the same ops in the same order on the same layouts.
EXACT = dict(rtol=0, atol=0)


def shard_decoder(model, shard=fully_shard, **kwargs):
    """Each block a unit, then the root (``shard`` is ours or FSDP2's ``fully_shard``)."""
    for layer in model.layers:
        shard(layer, **kwargs)
    shard(model, **kwargs)
    return model


def reference_and_ours(**kwargs):
    """A fresh test decoder and a copy of it sharded by ``shard_decoder(**kwargs)``."""
    reference = make_decoder()
    return reference, shard_decoder(clone(reference), **kwargs)


def reference_ours_and_fsdp2s(**kwargs):
    """A fresh test decoder, a copy sharded by us and one by FSDP2, both with ``kwargs``."""
    reference, ours = reference_and_ours(**kwargs)
    return reference, ours, shard_decoder(clone(reference), shard=torch_fully_shard, **kwargs)


def meta_init_sharded_decoder():
    """The test decoder built on the meta device, sharded, then given (uninitialised) CPU storage."""
    with torch.device("meta"):
        model = make_decoder()
    shard_decoder(model)
    model.to_empty(device="cpu")
    return model


def adamw(model):
    # eps=1e-6 (BERT's): with 1e-8, an element whose gradient is pure cancellation noise
    # (~1e-10) gets an lr-sized step of random sign, so parity would test rounding, not sharding.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def step_and_zero(*optimizers):
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def global_loss(loss):
    """The mean of every rank's loss (a collective)."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def sharded_step(model, step):
    """Forward and backward of this rank's part of ``step``'s batch; returns the global loss."""
    tokens, targets = local_batch(step)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    return global_loss(loss)


def train_together(model, reference, steps, backward):
    """``steps`` AdamW steps of sharded ``model`` and unsharded ``reference``, ``backward(step)``
    running both backwards (and any checks of the step); the parameters end equal."""
    opt, ref_opt = adamw(model), adamw(reference)
    for step in range(steps):
        backward(step)
        step_and_zero(opt, ref_opt)
    assert_matches(model, reference, "param")


def train_like_reference(model, reference, steps, check_step=None):
    """``train_together`` on the test decoder's global batches, ``check_step(loss,
    reference_loss)`` after each backward."""
    world = dist.get_world_size()

    def backward(step):
        reference_loss = reference_step(reference, step, world)
        loss = sharded_step(model, step)
        if check_step is not None:
            check_step(loss, reference_loss)

    train_together(model, reference, steps, backward)


def assert_matches(sharded, reference, what, tol=None):
    """Every ``what`` ("param" or "grad") of ``sharded`` equals the reference's, to ``tol``."""
    tol = tol or (PARAM_TOL if what == "param" else TOL)
    for (name, p), (ref_name, ref_p) in zip(sharded.named_parameters(), reference.named_parameters(), strict=True):
        assert name == ref_name
        got = p.full_tensor() if what == "param" else (None if p.grad is None else p.grad.full_tensor())
        want = ref_p.detach() if what == "param" else ref_p.grad
        if isinstance(want, DTensor):  # an FSDP2 model as the reference
            want = want.full_tensor()
        if want is None:
            assert got is None, name
            continue
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m: f"{what} {name}: {m}")


def assert_sharded_views(model):
    """Every parameter and gradient is a RaggedShard DTensor viewing its unit's DBuffer."""
    for module in model.modules():
        unit = getattr(module, "_vescale_fsdp_unit", None)
        if unit is None or module is not unit.modules[0]:
            continue
        for m in unit.fsdp_params:
            dbuffer = m.dbuffer
            assert isinstance(m.sharded, DTensor), m.fqn
            assert isinstance(m.sharded.placements[0], RaggedShard), m.fqn
            assert (
                m.sharded._local_tensor.untyped_storage().data_ptr() == dbuffer.sharded.untyped_storage().data_ptr()
            ), m.fqn
            if m.sharded.grad is not None:
                grad_storage = m.sharded.grad._local_tensor.untyped_storage().data_ptr()
                assert grad_storage == dbuffer.sharded_grad.untyped_storage().data_ptr(), m.fqn


def full_params(model, prefix=""):
    """Every parameter gathered in fp32 (a collective: call on every rank), names without ``prefix``."""
    return {name.removeprefix(prefix): p.full_tensor().detach().float().clone() for name, p in model.named_parameters()}


def assert_same_params(got, want, tol):
    """Two ``{name: tensor}`` dicts hold the same names and, to ``tol``, the same values."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **tol, msg=lambda m: f"parameter {name}: {m}")
