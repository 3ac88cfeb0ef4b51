"""The Triton 8-bit AdamW kernel against the torch reference, on CPU under TRITON_INTERPRET=1.

The interpreter must be switched on before triton is first imported, so the comparison runs
in a fresh interpreter process (``_compare`` below) and this test checks what it reports.
Sizes are tiny: the interpreter runs each tile program in numpy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402  (after the skip: triton may be absent)

from vescale_plugins.optim.kernels.adam8bit_triton import _code  # noqa: E402  (imports triton)

pytestmark = pytest.mark.distributed  # the comparison runs in a subprocess

REPO = Path(__file__).resolve().parents[3]


@triton.jit
def _codes_kernel(x_ptr, out_ptr, table_ptr, n, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """The kernel's code lookup alone, on a flat array of normalised values."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, _code(x, table_ptr, SIGNED), mask=mask)


def _compare() -> dict:
    """One flat run of several parameters (edges, 1-D, 0-D, a 3-D) stepped both ways."""
    from vescale_plugins.tools.gpu_parts.triton_adam import compare_with_reference

    return compare_with_reference([(20, 13), (70,), (), (5, 3, 4)], tile=8, device="cpu", steps=2, gap=3)


def _code_rule_mismatches() -> dict:
    """The kernel's code lookup against :func:`quant_map.quantize` on values at and around
    every rounding threshold (each map value, each midpoint and their neighbouring floats),
    signs, zeros and subnormals: the number of values whose codes differ, per map."""
    import torch

    from vescale_plugins.optim.kernels.quant_map import bucket_table, dynamic_map, quantize

    mismatches = {}
    for signed in (True, False):
        q = dynamic_map(signed)
        mid = (q[1:] + q[:-1]) / 2
        points = torch.cat([q, mid, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0, 1.5, -1.5])])
        near = [torch.nextafter(points, torch.full_like(points, d)) for d in (2.0, -2.0)]
        x = torch.cat([points, *near, torch.rand(2000, generator=torch.Generator().manual_seed(1)) * 2 - 1])
        out = torch.empty(x.numel(), dtype=torch.int32)
        _codes_kernel[(triton.cdiv(x.numel(), 256),)](x, out, bucket_table(signed), x.numel(), SIGNED=signed, BLOCK=256)
        mismatches["signed" if signed else "unsigned"] = int((out != quantize(x, signed).int()).sum())
    return mismatches


def test_triton_kernel_matches_the_torch_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    code = (
        f"import json, {__name__} as t; "
        "print('REPORT' + json.dumps(dict(t._compare(), code_rule_mismatches=t._code_rule_mismatches())))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("REPORT", 1)[1])
    for step in report["steps"]:
        assert step["param_max_abs_diff"] < 1e-6, step
        assert step["padding_untouched"], step
        assert step["code_max_diff"] <= 1, step
        assert step["codes_differing"] <= max(1, step["codes_total"] // 1000), step
        assert step["scale_max_rel_diff"] < 1e-5, step
    # The code of a normalised value is the reference's bit for bit (one table gather).
    assert report["code_rule_mismatches"] == {"signed": 0, "unsigned": 0}, report["code_rule_mismatches"]


def _ptx_for_hopper(align: int) -> str:
    """The kernel compiled ahead of time for sm_90 (Triton's own compiler and ptxas; no GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vescale_plugins.optim.kernels.adam8bit_triton import _adam8bit_tile_kernel

    pointers = dict(
        p_ptr="*fp32", g_ptr="*fp32", mc_ptr="*u8", ms_ptr="*fp32", vc_ptr="*u8", vs_ptr="*fp32", qs_ptr="*fp32"
    )
    pointers.update(qu_ptr="*fp32", ts_ptr="*i32", tu_ptr="*i32", table_ptr="*i64")
    constants = dict(DECOUPLED=True, BLOCK=32, ALIGN=align)
    names = _adam8bit_tile_kernel.arg_names
    signature = {n: pointers.get(n, "constexpr" if n in constants else "fp32") for n in names}
    source = ASTSource(
        fn=_adam8bit_tile_kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        # What the launcher specialises for 16-byte aligned tensors.
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in pointers},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def test_triton_kernel_compiles_for_hopper_with_vector_loads_and_correctly_rounded_math():
    aligned = _ptx_for_hopper(16)
    # No 64-bit division or remainder per lane; the square root and divisions round to
    # nearest (the interpreter's and CUDA's fused Adam's), not the approximations.
    for instruction in ("div.s64", "rem.s64", "div.u64", "rem.u64", "sqrt.approx", "div.full", "div.approx"):
        assert instruction not in aligned, instruction
    assert "sqrt.rn.f32" in aligned
    assert "div.rn.f32" in aligned
    # Parameter and gradient rows come in 16-byte vectors when the table is aligned, and
    # per element when it is not (the mapping is the same; only the alignment differs).
    assert "ld.global.v4.b32" in aligned
    assert "ld.global.v4" not in _ptx_for_hopper(1)
