"""The surface FSDP2 gained in torch 2.15, on ours, against FSDP2 itself where torch has it.

- ``set_manual_backward_finalization`` / ``finalize_backward(async_op=...)`` /
  ``GradientReductionHandle``: backward leaves the last reductions (and the units only the
  final callback reduces: the root, whose input needs no gradient) to ``finalize_backward``;
  the gradients after it are FSDP2's, bit for bit at W=2 and W=3, synchronous or through the
  handle, after no-sync micro-batches; the errors are FSDP2's, word for word.
- ``set_keep_unsharded_storage``: resharding keeps the gathered memory, so every unsharded
  parameter has the same address at every gather; training is unchanged.
- ``MixedPrecisionPolicy.param_dtype_override_fn``: chosen parameters stay in their own dtype
  under a bf16 policy; gradients and parameters after steps equal FSDP2's, bit for bit; a bad
  answer raises FSDP2's error.

On torch < 2.15 ours offers the same methods (checked against the automatic path); the
FSDP2 comparisons and ``param_dtype_override_fn`` need 2.15.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.torch_version import TorchVersion

from vescale_plugins import GradientReductionHandle, fully_shard

pytestmark = pytest.mark.distributed
T = 120
TORCH_215 = TorchVersion(torch.__version__) >= "2.15"
needs_215 = pytest.mark.skipif(not TORCH_215, reason=f"FSDP2 gained this in torch 2.15; this is {torch.__version__}")
DIM, HIDDEN = 13, 22  # uneven: nothing divides by 2 or 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    """A root with parameters of its own at the start of forward (its input needs no
    gradient) and one its forward never uses, so only the final callback reduces it, and
    three blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(DIM, 2)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _sharded(engine: str, **kwargs) -> Model:
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:  # what param_dtype_override_fn keeps in fp32 (_keep_norms_in_fp32)
        for param in block.norm.parameters():
            param.in_norm = True
    shard = fully_shard if engine == "vescale" else torch_fully_shard
    for block in model.blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _shard_and_run(shard, mp_policy: MixedPrecisionPolicy) -> None:
    model = Model()
    shard(model, mp_policy=mp_policy)
    model(_batches(1)[0])


def _batches(micro: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randn(4, DIM, generator=generator) for _ in range(micro)]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}


def _train(engine: str, manual: bool, async_op: bool, micro: int = 2, steps: int = 2, **kwargs):
    """``steps`` optimizer steps of ``micro`` micro-batches, sync on the last only; the
    gradients of the last step and the parameters after all steps."""
    model = _sharded(engine, **kwargs)
    if manual:
        model.set_manual_backward_finalization(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: dict[str, torch.Tensor] = {}
    for _ in range(steps):
        for i, x in enumerate(_batches(micro)):
            model.set_requires_gradient_sync(i == micro - 1)
            model(x).square().sum().backward()
        if manual:
            handle = model.finalize_backward(async_op=async_op)
            if async_op:
                assert isinstance(handle, GradientReductionHandle if engine == "vescale" else object)
                handle.wait()
                handle.wait()  # a second wait does nothing, as FSDP2's
            else:
                assert handle is None
        grads = _grads(model)
        optimizer.step()
        optimizer.zero_grad()
    return grads, {name: p.full_tensor() for name, p in model.named_parameters()}


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)


def _assert_like_fsdp2(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Bit for bit at W=2. At W=3 a reduced element's three terms are summed in the order of
    the ring ending at the rank that reduces it, and ours reduces some elements on another
    rank than FSDP2's padded rows: the sums may differ by the rounding of 2 additions in fp32
    (tests/runtime/test_gradient_dtypes.py says more), and two SGD steps carry that on."""
    if dist.get_world_size() == 2:
        return _assert_equal(ours, theirs)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        bound = 2 * (dist.get_world_size() - 1) * torch.finfo(torch.float32).eps * theirs[name].abs().max().item()
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=2 * bound, msg=name)


def _manual_finalization_like_automatic_and_fsdp2(async_op: bool) -> None:
    automatic = _train("vescale", manual=False, async_op=False)
    manual = _train("vescale", manual=True, async_op=async_op)
    for ours, reference in zip(manual, automatic):
        _assert_equal(ours, reference)
    if TORCH_215:
        for ours, theirs in zip(manual, _train("torch", manual=True, async_op=async_op)):
            _assert_like_fsdp2(ours, theirs)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_manual_finalization_matches_automatic_and_fsdp2(dist_run, world_size, async_op):
    dist_run(_manual_finalization_like_automatic_and_fsdp2, world_size, async_op, timeout=T)


def _pending_until_finalized() -> None:
    """Backward under manual finalization leaves its last reductions in flight (ours reduces
    each unit as soon as its last gradient lands, so here that is the wait); finalize_backward
    completes them: every gradient is there and every unit is resharded."""
    model = _sharded("vescale")
    model.set_manual_backward_finalization(True)
    model(_batches(1)[0]).sum().backward()
    state = model._vescale_fsdp_unit.context
    assert state.reduces_in_flight, "backward waited for its reductions"
    assert state.manual_active, "backward waited for its reductions"
    model.finalize_backward()
    assert not state.reduces_in_flight
    assert not state.reduces_landing
    assert state.manual_active is None
    assert all(p.grad is not None for name, p in model.named_parameters() if not name.startswith("unused"))
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_manual_finalization_defers_the_last_waits(dist_run):
    dist_run(_pending_until_finalized, 2, timeout=T)


def _error(fn) -> str:
    with pytest.raises(RuntimeError) as error:
        fn()
    return str(error.value)


def _finalization_errors(engine: str) -> list[str]:
    model = _sharded(engine)
    x = _batches(1)[0]
    messages = []
    assert model.finalize_backward() is None  # before the first forward: a no-op
    model(x).sum().backward()
    messages.append(_error(model.finalize_backward))  # manual mode is off
    messages.append(_error(lambda: model.blocks[0].set_manual_backward_finalization(True)))  # not the root
    model.set_manual_backward_finalization(True)
    messages.append(_error(model.blocks[0].finalize_backward))  # not the root
    model(x).sum().backward()
    handle = model.finalize_backward(async_op=True)
    messages.append(_error(model.finalize_backward))  # the handle is not waited for
    model.reset_iter_state()
    messages.append(_error(handle.wait))  # invalidated by the reset
    loss = model(x).sum()
    loss.backward()
    model.finalize_backward()
    return messages


def _errors_like_fsdp2() -> None:
    ours = _finalization_errors("vescale")
    assert "requires manual backward finalization" in ours[0]
    assert "root" in ours[1]
    assert "root" in ours[2]
    assert "must be waited on" in ours[3]
    assert "invalidated" in ours[4]
    if TORCH_215:
        assert ours == _finalization_errors("torch")


def test_finalization_errors_are_fsdp2s(dist_run):
    dist_run(_errors_like_fsdp2, 2, timeout=T)


def _keep_unsharded_storage() -> None:
    model = _sharded("vescale")
    model.set_keep_unsharded_storage(True)
    x = _batches(1)[0]
    addresses = None
    for _ in range(2):
        model.unshard()
        now = [p.data_ptr() for block in model.blocks for p in block.parameters()]
        assert addresses is None or now == addresses, "the gathered memory moved"
        addresses = now
        model.reshard()
        for block in model.blocks:
            for p in block.parameters():
                assert isinstance(p, torch.distributed.tensor.DTensor)  # resharded all the same
    kept = _train("vescale", manual=False, async_op=False)
    for block in model.blocks:  # recurse=True reached every unit
        assert block._vescale_fsdp_unit.keep_unsharded_storage
    model.set_keep_unsharded_storage(False, recurse=False)
    assert not model._vescale_fsdp_unit.keep_unsharded_storage
    assert model.blocks[0]._vescale_fsdp_unit.keep_unsharded_storage

    # Training with the storage kept gives the same numbers.
    def train_keeping() -> tuple[dict, dict]:
        trained = _sharded("vescale")
        trained.set_keep_unsharded_storage(True)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        for _ in range(2):
            for i, batch in enumerate(_batches(2)):
                trained.set_requires_gradient_sync(i == 1)
                trained(batch).square().sum().backward()
            grads = _grads(trained)
            optimizer.step()
            optimizer.zero_grad()
        return grads, {name: p.full_tensor() for name, p in trained.named_parameters()}

    for ours, reference in zip(train_keeping(), kept):
        _assert_equal(ours, reference)
    del x


def test_keep_unsharded_storage_keeps_addresses_and_numbers(dist_run):
    dist_run(_keep_unsharded_storage, 2, timeout=T)


def _keep_norms_in_fp32(param: nn.Parameter) -> torch.dtype | None:
    return param.dtype if getattr(param, "in_norm", False) else None


def _param_dtype_override_like_fsdp2() -> None:
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, param_dtype_override_fn=_keep_norms_in_fp32
    )
    ours = _train("vescale", manual=False, async_op=False, mp_policy=policy)
    theirs = _train("torch", manual=False, async_op=False, mp_policy=policy)
    for mine, fsdp2 in zip(ours, theirs):
        _assert_equal(mine, fsdp2)
    # The kept parameters are gathered in fp32, the others in bf16, as FSDP2's.
    model = _sharded("vescale", mp_policy=policy)
    model.unshard()
    block = model.blocks[0]
    block.unshard()
    assert block.norm.weight.dtype == torch.float32
    assert block.up.weight.dtype == torch.bfloat16
    block.reshard()
    model.reshard()
    # An answer other than None, param_dtype or the parameter's own dtype: FSDP2's error.
    bad = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16)
    messages = []
    for shard in (fully_shard, torch_fully_shard):
        with pytest.raises(ValueError, match="param_dtype_override_fn must return None, param_dtype, or the") as error:
            _shard_and_run(shard, bad)  # FSDP2 checks at its lazy init
        messages.append(str(error.value))
    assert messages[0] == messages[1]


@needs_215
def test_param_dtype_override_fn_matches_fsdp2(dist_run):
    dist_run(_param_dtype_override_like_fsdp2, 2, timeout=T)


@needs_215
def test_the_handle_is_fsdp2s_class():
    from torch.distributed.fsdp import GradientReductionHandle as TorchHandle

    assert issubclass(GradientReductionHandle, TorchHandle)
