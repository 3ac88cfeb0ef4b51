"""vescale_plugins.optim.Muon computes torch.optim.Muon's updates, sharded, with two all-to-alls a bucket.

The sharded runs are checked against ``torch.optim.Muon`` on the full matrices in the same
process (same threads, so the same bfloat16 matmul kernels): the gradients are given, not
computed, so any difference is the optimizer's. Shapes are uneven (97x42), tall and wide,
and some have fewer rows than ranks, so some ranks hold nothing of them; the element-wise
layouts cut matrices mid-row.
"""

import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from vescale_plugins import RaggedShard
from vescale_plugins.optim import Muon, muon_param_groups, split_muon_params

STEPS = 5
SHAPES = [(97, 42), (42, 97), (2, 13), (64, 64), (5, 7), (3, 200), (1, 9)]
HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95)


def _full(shape, salt):
    # crc32, not hash(): str hashes differ between processes.
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, salt)).encode()))
    return torch.randn(shape, generator=g)


def _layouts(world):
    """(dims, local_units) per shape: row-wise uneven with empty ranks, and element-wise."""
    layouts = []
    for i, (rows, cols) in enumerate(SHAPES):
        if i % 2 == 0:  # row-wise: one row per unit, spread unevenly, rank (i % world) empty
            units = [0] * world
            for r in range(rows):
                units[(r * 7 + i) % world if world > 1 else 0] += 1
            if world > 1 and rows >= world and units[i % world]:
                moved, units[i % world] = units[i % world], 0
                units[(i + 1) % world] += moved
            layouts.append(((0,), tuple(units)))
        else:  # element-wise, cut mid-row
            numel, units = rows * cols, []
            for r in range(world - 1):
                units.append((numel * (r + 1)) // (world + 1) - sum(units))
            units.append(numel - sum(units))
            layouts.append(((0, 1), tuple(units)))
    return layouts


def _sharded_params(world):
    mesh = init_device_mesh("cpu", (world,))
    params = []
    for i, (shape, (dims, units)) in enumerate(zip(SHAPES, _layouts(world))):
        params.append(nn.Parameter(distribute_tensor(_full(shape, ("param", i)), mesh, [RaggedShard(dims, units)])))
    return params


def _set_grads(params, step):
    for i, p in enumerate(params):
        full = _full(tuple(p.shape), ("grad", i, step))
        if isinstance(p, DTensor):
            placement = p.placements[0]
            local = placement.split_full(full, dist.get_rank()).clone()
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = full


def _reference_params(steps, **hyper):
    params = [nn.Parameter(_full(shape, ("param", i))) for i, shape in enumerate(SHAPES)]
    opt = torch.optim.Muon(params, **hyper)
    for step in range(steps):
        _set_grads(params, step)
        opt.step()
    return params


# ----------------------------------------------------------------------------------
# one process: the same numbers as torch.optim.Muon
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hyper",
    [
        HYPER,
        dict(lr=0.01, nesterov=False, adjust_lr_fn="match_rms_adamw"),
        dict(lr=0.05, weight_decay=0.0, momentum=0.9, ns_steps=3, eps=1e-5, ns_coefficients=(3.0, -3.2, 1.2)),
    ],
)
def test_plain_tensors_match_torch_muon_bitwise(hyper):
    want = _reference_params(STEPS, **hyper)
    params = [nn.Parameter(_full(shape, ("param", i))) for i, shape in enumerate(SHAPES)]
    opt = Muon(params, **hyper)
    for step in range(STEPS):
        _set_grads(params, step)
        opt.step()
    for p, q in zip(params, want):
        assert torch.equal(p, q)
    assert opt.exchange_plan is None


def test_defaults_and_argument_errors_are_torchs():
    torch_defaults = torch.optim.Muon([nn.Parameter(torch.zeros(2, 2))]).defaults
    ours = Muon([nn.Parameter(torch.zeros(2, 2))]).defaults
    assert {k: ours[k] for k in torch_defaults} == torch_defaults
    for bad, message in [
        (dict(lr=-1.0), "Learning rate"),
        (dict(momentum=-0.1), "momentum"),
        (dict(weight_decay=-1.0), "weight decay"),
        (dict(adjust_lr_fn="cubic"), "not supported"),
    ]:
        with pytest.raises(ValueError, match=message):
            Muon([nn.Parameter(torch.zeros(2, 2))], **bad)


def test_a_non_matrix_in_a_muon_group_is_refused_with_its_name():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"size: torch.Size\(\[4\]\).*'0.bias'.*muon_param_groups"):
        Muon(list(model.named_parameters()))


class _TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.lm_head = nn.Linear(10, 11, bias=False)

    def forward(self, tokens):
        return self.lm_head(self.norm(torch.relu(self.hidden(self.embed(tokens)))))


def test_param_split_sends_embeddings_heads_norms_and_biases_to_adamw():
    muon, adamw = split_muon_params(_TinyLM())
    assert [n for n, _ in muon] == ["hidden.weight"]
    assert [n for n, _ in adamw] == ["embed.weight", "hidden.bias", "norm.weight", "norm.bias", "lm_head.weight"]
    tied = _TinyLM()
    tied.out = nn.Linear(6, 11, bias=False)
    tied.out.weight = tied.embed.weight  # tied to the embedding under another name
    assert [n for n, _ in split_muon_params(tied)[0]] == ["hidden.weight"]


def test_one_optimizer_steps_muon_and_adamw_groups_like_torchs_pair():
    torch.manual_seed(0)
    model, reference = _TinyLM(), _TinyLM()
    reference.load_state_dict(model.state_dict())
    opt = Muon(muon_param_groups(model, adamw_lr=3e-3, adamw_weight_decay=0.05), lr=0.02)
    muon, adamw = split_muon_params(reference)
    torch_opts = [
        torch.optim.Muon([p for _, p in muon], lr=0.02),
        torch.optim.AdamW(
            [p for _, p in adamw], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, foreach=False
        ),
    ]
    for step in range(3):
        tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
        for m in (model, reference):
            m(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for o in torch_opts:
            o.step()
            o.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name


# ----------------------------------------------------------------------------------
# W ranks: the sharded run equals the unsharded one
# ----------------------------------------------------------------------------------


def _sharded_matches_unsharded(hyper):
    world = dist.get_world_size()
    params = _sharded_params(world)
    opt = Muon(params, **hyper)
    for step in range(STEPS):
        _set_grads(params, step)
        opt.step()
    want = _reference_params(STEPS, **hyper)
    for i, (p, q) in enumerate(zip(params, want)):
        assert isinstance(p, DTensor)
        assert isinstance(opt.state[p]["momentum_buffer"], DTensor)
        assert opt.state[p]["momentum_buffer"].placements == p.placements
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=0, msg=lambda m: f"{SHAPES[i]}: {m}")
    plan = opt.exchange_plan
    if world == 1:  # a DTensor on one rank is its own root: no plan, no collective
        assert plan is None
        return []
    roots = [m.root for m in plan.matrices]
    assert sorted(set(roots)) == list(range(min(world, len(SHAPES))))
    for bucket in plan.buckets:
        bucket_roots = [plan.matrices[i].root for i in bucket]
        assert len(set(bucket_roots)) == len(bucket_roots)
    return roots


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_matches_unsharded_torch_muon_after_five_steps(dist_run, world):
    roots = dist_run(_sharded_matches_unsharded, world, HYPER)
    assert all(r == roots[0] for r in roots)  # every rank chose the same roots


def test_sharded_without_nesterov_and_with_match_rms_adamw(dist_run):
    dist_run(
        _sharded_matches_unsharded, 3, dict(lr=0.01, nesterov=False, adjust_lr_fn="match_rms_adamw", weight_decay=0.0)
    )


def _count_one_step():
    world = dist.get_world_size()
    params = _sharded_params(world)
    opt = Muon(params, **HYPER)
    _set_grads(params, 0)
    with CommDebugMode() as mode:
        opt.step()
    counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    plan = opt.exchange_plan
    per_root = max(sum(m.root == r for m in plan.matrices) for r in range(world))
    return counts, len(plan.buckets), per_root


@pytest.mark.parametrize("world", [2, 3])
def test_one_step_is_two_all_to_alls_per_bucket_and_nothing_else(dist_run, world):
    counts, buckets, most_on_one_root = dist_run(_count_one_step, world)[0]
    assert buckets == most_on_one_root  # one matrix per root per bucket
    assert counts == {"alltoall_base_": 2 * buckets}, counts  # all_to_all_single


def _first_collective_after_the_warm_up():
    """A stand-in for the compiled Newton–Schulz (any function but the eager one is warmed)
    and a log of its calls and of the all-to-alls, over two steps; then the parameters."""
    import vescale_plugins.optim.muon as muon_module
    from vescale_plugins.optim.newton_schulz import zeropower_via_newtonschulz

    log = []

    def compiled_stand_in(matrix, *args):
        log.append(("newton_schulz", tuple(matrix.shape)))
        return zeropower_via_newtonschulz(matrix, *args)

    real_all_to_all = dist.all_to_all_single

    def logged_all_to_all(*args, **kwargs):
        log.append(("all_to_all", None))
        return real_all_to_all(*args, **kwargs)

    world = dist.get_world_size()
    params = _sharded_params(world)
    opt = Muon(params, **HYPER)
    own = sorted({m.shape for m in opt.exchange_plan.matrices if m.root == dist.get_rank()})
    original = muon_module.newton_schulz_for
    muon_module.newton_schulz_for = lambda device: compiled_stand_in
    dist.all_to_all_single = logged_all_to_all
    logs = []
    try:
        for step in range(2):
            _set_grads(params, step)
            log.clear()
            opt.step()
            logs.append(list(log))
    finally:
        muon_module.newton_schulz_for = original
        dist.all_to_all_single = real_all_to_all
    return own, logs, [p.full_tensor().detach() for p in params]


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_newton_schulz_is_warmed_for_every_shape_before_the_first_all_to_all(dist_run, world):
    results = dist_run(_first_collective_after_the_warm_up, world)
    want = [q.detach() for q in _reference_params(2, **HYPER)]
    for own, (first, second), params in results:
        before = first[: first.index(("all_to_all", None))]
        # Every shape this rank is the root of ran before any collective (a compile there
        # keeps no other rank waiting), and only once: the second step warms nothing.
        assert sorted({shape for _, shape in before}) == own, (own, first)
        assert second.index(("all_to_all", None)) == 0, second
        for p, q in zip(params, want):
            assert torch.equal(p, q)  # the warm-up ran on scratch: the same numbers


# ----------------------------------------------------------------------------------
# errors before any collective
# ----------------------------------------------------------------------------------


def _fsdp2_shard(mesh):
    return [nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]))]


def _replicated(mesh):
    return [nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()]))]


def _two_groups(mesh):
    world = dist.get_world_size()
    meshes = [
        DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu", mesh_dim_names=(name,)) for name in ("a", "b")
    ]
    return [nn.Parameter(distribute_tensor(torch.zeros(6, 4), m, [RaggedShard((0,), (1,) * world)])) for m in meshes]


def _errors_before_any_collective():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases = [
        (_fsdp2_shard, r"Shard\(dim=0\).*FSDP2.*vescale_plugins.fully_shard"),
        (_replicated, r"Replicate.*needs RaggedShard"),
        (_two_groups, "different process groups"),
    ]
    for make_params, match in cases:
        params = make_params(mesh)
        with CommDebugMode() as mode, pytest.raises(ValueError, match=match):
            Muon(params)
        assert mode.get_total_counts() == 0, make_params


def test_bad_input_is_refused_on_every_rank_before_any_collective(dist_run):
    assert dist_run(_errors_before_any_collective, 3) == [None] * 3


# ----------------------------------------------------------------------------------
# root assignment (pure arithmetic)
# ----------------------------------------------------------------------------------


def test_roots_balance_newton_schulz_flops_on_a_catalogue_model():
    from vescale_plugins.optim import assign_roots, newton_schulz_flops
    from vescale_plugins.tools import muon_balance_report as report
    from vescale_plugins.tools.model_catalog import CATALOG

    costs = [newton_schulz_flops(s) for s in report.muon_matrix_shapes(CATALOG["Llama-3-70B"])]
    assert len(costs) == 80 * 7
    for world in (8, 64):
        assignment = assign_roots(costs, world)
        assert assignment == assign_roots(costs, world)  # deterministic
        assert sorted(set(assignment.roots)) == list(range(world))
        assert sum(assignment.loads) == sum(costs)
        assert assignment.lower_bound <= assignment.max_over_mean <= min(assignment.upper_bound, 1.10)
    # Fewer matrices than ranks: the largest matrix alone sets the maximum.
    few = assign_roots([9, 1, 1], 4)
    assert few.loads == (9, 1, 1, 0)
    assert few.max_over_mean == few.lower_bound == 9 * 4 / 11


def test_newton_schulz_flops_count_the_three_matmuls_per_step():
    from vescale_plugins.optim import newton_schulz_flops

    # X is 3x5 (wide): X X^T 2*3*3*5, G G 2*3*3*3, (.) X 2*3*3*5, per step.
    assert newton_schulz_flops((3, 5), ns_steps=1) == 90 + 54 + 90
    assert newton_schulz_flops((5, 3), ns_steps=2) == 2 * (90 + 54 + 90)


def _count_one_step_of_a_fully_sharded_decoder():
    from tests.support.models import local_batch, loss_fn, make_decoder
    from tests.support.parity import shard_decoder

    model = shard_decoder(make_decoder())
    opt = Muon(muon_param_groups(model, adamw_lr=1e-2), lr=0.02)
    tokens, targets = local_batch(0)
    loss_fn(model(tokens), targets).backward()
    with CommDebugMode() as mode:
        opt.step()
    counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    return counts, len(opt.exchange_plan.buckets), len(opt.exchange_plan.matrices)


def test_a_fully_sharded_decoders_step_is_two_all_to_alls_per_bucket(dist_run):
    counts, buckets, matrices = dist_run(_count_one_step_of_a_fully_sharded_decoder, 3)[0]
    assert matrices == 3 * 4  # 3 blocks x (qkv, out, up, down); the tied embedding/head is AdamW's
    assert counts == {"alltoall_base_": 2 * buckets}, counts
