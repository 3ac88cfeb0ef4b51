"""Minimal repros of issue-11 runtime failures (2 gloo ranks). Usage: python repro.py torch|vescale"""
import os, sys, copy, traceback
import torch, torch.nn as nn, torch.distributed as dist
import torch.multiprocessing as mp

def fs(impl):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard; return fully_shard
    import vescale_plugins; return vescale_plugins.fully_shard

def ac_composable(impl):
    from torch.distributed._composable import checkpoint
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    checkpoint(model[0])
    fs(impl)(model[0]); fs(impl)(model)
    model(torch.randn(4, 8)).sum().backward()
    bad = [n for n, p in model.named_parameters() if not isinstance(p, DTensor) or not isinstance(p.grad, DTensor)]
    assert not bad, f"not DTensor after backward (param or grad): {bad}"

def ac_utils(impl):
    from torch.utils.checkpoint import checkpoint
    from torch.distributed.tensor import DTensor
    class Model(nn.Module):  # as common_dtensor.Transformer(checkpoint_activations=True)
        def __init__(self):
            super().__init__(); self.block = nn.Linear(8, 8); self.out = nn.Linear(8, 8)
        def forward(self, x):
            return self.out(checkpoint(self.block, x, use_reentrant=False))
    torch.manual_seed(0)
    model = Model()
    fs(impl)(model.block); fs(impl)(model)
    model(torch.randn(4, 8)).sum().backward()
    bad = [n for n, p in model.named_parameters() if not isinstance(p, DTensor) or not isinstance(p.grad, DTensor)]
    assert not bad, f"not DTensor after backward (param or grad): {bad}"

def tied_siblings(impl):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__(); self.emb = nn.Embedding(17, 16); self.out = nn.Linear(16, 17, bias=False)
            self.out.weight = self.emb.weight
        def forward(self, ids): return self.out(self.emb(ids))
    m = Tied()
    fs(impl)(m.emb); fs(impl)(m.out); fs(impl)(m)
    try:
        m(torch.randint(0, 17, (2, 8)))
    except ValueError as e:
        return
    raise AssertionError("no error: the tied weight is silently two parameters: " + str([n for n, _ in m.named_parameters()]))

def chunked_head(impl):
    torch.manual_seed(0)
    class M(nn.Module):
        def __init__(self):
            super().__init__(); self.body = nn.Linear(8, 8); self.norm = nn.LayerNorm(8); self.head = nn.Linear(8, 16, bias=False)
        def forward(self, x, skip_head=False):
            h = self.norm(self.body(x)); return h if skip_head else self.head(h)
    ref = M(); m = copy.deepcopy(ref)
    fs(impl)([m.norm, m.head]); fs(impl)(m)
    x = torch.randn(4, 8)
    def run(model):
        h = model(x, skip_head=True)
        hg = []
        for c in h.detach().chunk(2):
            c = c.clone().requires_grad_(True); model.head(c).sum().backward(); hg.append(c.grad)
        h.backward(torch.cat(hg))
    run(m); run(ref)
    for p in ref.parameters():
        dist.all_reduce(p.grad); p.grad /= dist.get_world_size()
    g = m.head.weight.grad.full_tensor()
    assert torch.allclose(g, ref.head.weight.grad, atol=1e-5), f"head grad max diff {(g - ref.head.weight.grad).abs().max().item()}"

def grad_acc_chunked(impl):
    torch.manual_seed(0)
    class M(nn.Module):
        def __init__(self):
            super().__init__(); self.body = nn.Linear(8, 8); self.norm = nn.RMSNorm(8); self.head = nn.Linear(8, 16, bias=False)
        def forward(self, x, skip_head=False):
            h = self.norm(self.body(x)); return h if skip_head else self.head(h)
    m = M()
    m.embed = nn.Linear(8, 8)  # a unit before the grouped one, as in the original
    fwd = m.forward
    m.forward = lambda x, skip_head=False: fwd(m.embed(x), skip_head)
    fs(impl)(m.embed); fs(impl)(m.body); fs(impl)([m.norm, m.head]); fs(impl)(m)
    for i in range(2):
        m.set_requires_gradient_sync(i == 1); m.set_is_last_backward(i == 1)
        h = m(torch.randn(4, 8), skip_head=True)
        hg = []
        for c in h.detach().chunk(2):
            c = c.clone().requires_grad_(True); m.head(c).sum().backward(); hg.append(c.grad)
        h.backward(torch.cat(hg))

CASES = [ac_composable, ac_utils, tied_siblings, chunked_head, grad_acc_chunked]

def worker(rank, impl, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for case in CASES:
        try:
            case(impl); r = "ok"
        except Exception as e:
            r = f"FAIL {type(e).__name__}: {str(e)[:300]}"
        dist.barrier()
        if rank == 0:
            print(f"{impl} {case.__name__}: {r}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
