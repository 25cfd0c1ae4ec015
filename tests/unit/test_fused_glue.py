"""Fused glue (primitives/fused.py): on CUDA each function is ``torch.compile``d on its own; here
the compiled function (inductor on CPU) is checked against its eager reference, forward and
backward, and the emulated-CUDA path (the eager function in a kernel region) is checked to be
the reference exactly and to count as the compiled kernels. Tolerance of the compiled path:
inductor fuses the fp32 reduction and reorders it, and keeps bf16 intermediates in fp32: fp32
outputs and gradients to 1e-5; bf16 outputs to rtol 1.6e-2 / atol 1e-2 (about one bf16 ulp),
bf16 gradients to 1e-2 of their norm (the weight and RoPE-table gradients are sums over rows,
which eager rounds to bf16 per op and inductor accumulates in fp32)."""

import shutil

import pytest
import torch

from bumblebee.perf.syncs import SyncCounter
from bumblebee.primitives import fused as fz
from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.linear_attention.gdn import GatedRMSNorm, gated_rms_norm
from bumblebee.primitives.norms import (
    RMSNorm,
    ZeroCenteredRMSNorm,
    rms_norm,
    zero_centered_rms_norm,
)
from bumblebee.primitives.rope import apply_rope, rope_reference


def _cases(dtype):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    w = torch.randn(16, generator=g)
    return {
        "rms_norm": (rms_norm, (r(3, 5, 16), w.to(dtype), 1e-6)),
        "zero_centered_rms_norm": (zero_centered_rms_norm, (r(3, 5, 16), w * 0.1, 1e-6)),
        "gated_rms_norm": (gated_rms_norm, (r(3, 5, 4, 16), r(3, 5, 4, 16), w.to(dtype), 1e-6)),
        "rope": (rope_reference, (r(2, 4, 5, 16), r(2, 5, 8), r(2, 5, 8))),
        "swiglu": (fz._swiglu, (r(7, 16), r(7, 16))),
        "swiglu_halves": (fz._swiglu_halves, (r(7, 32),)),
    }


def _run(fn, args):
    leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*leaves)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    grads = torch.autograd.grad(out, [x for x in leaves if isinstance(x, torch.Tensor)], dout)
    return out, grads


@pytest.mark.parametrize("name", list(_cases(torch.float32)))
def test_emulated_is_the_reference_counted_as_compiled(name):
    fn, args = _cases(torch.bfloat16)[name]
    want = _run(fn, args)
    with emulate_cuda(check_comm=False), SyncCounter() as c:
        got = _run(lambda *a: fz.fused(name, fn, *a), args)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert c.by_kernel == {f"{name} fwd (compiled)": 1, f"{name} bwd (compiled)": 1}


def test_modules_take_the_fused_path_under_emulation():
    x = torch.randn(2, 3, 4, 16, dtype=torch.bfloat16)
    for mod, args in (
        (RMSNorm(16), (x,)),
        (ZeroCenteredRMSNorm(16), (x,)),
        (GatedRMSNorm(16), (x, torch.randn_like(x))),
    ):
        cpu = mod(*args)
        with emulate_cuda(check_comm=False), SyncCounter() as c:
            emu = mod(*args)
        assert torch.equal(cpu, emu) and len(c.by_kernel) == 1, (mod, c.by_kernel)
    cos, sin = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    q = torch.randn(2, 3, 4, 16)
    with emulate_cuda(check_comm=False):
        assert torch.equal(apply_rope(q, cos, sin), rope_reference(q, cos, sin))


@pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_reference(dtype):
    torch._dynamo.reset()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for name, (fn, args) in _cases(dtype).items():
        want = _run(fn, args)
        got = _run(torch.compile(fn, fullgraph=True), args)
        torch.testing.assert_close(got[0], want[0], **tol, msg=name)
        for a, b in zip(got[1], want[1]):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, **tol, msg=name)
            else:
                rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert rel < 1e-2, (name, rel)


def _rms_variants(x, w, eps: float):
    """``rms_norm`` under a code object of this test's own (dynamo counts recompiles per code)."""
    return rms_norm(x, w, eps)


def test_more_input_variants_than_the_recompile_limit_still_run():
    """Row counts from training, eval, MTP and RL, in two dtypes, with and without grad: more
    variants than dynamo compiles one function for (8). The ninth on would be a hard error under
    ``fullgraph``; they run eagerly after one warning, with the reference's values and gradients
    (dynamo's "eager" backend: the recompile rule is dynamo's, whichever backend compiles)."""
    fn = fz._compiled(_rms_variants, backend="eager")
    w = torch.randn(8)
    # 12 row counts (batch x tokens), single rows and single tokens among them
    rows = [(2, 5), (2, 7), (1, 9), (1, 1), (3, 1), (4, 2), (5, 3), (1, 4), (6, 6), (7, 1), (2, 3)]
    rows.append((3, 9))
    with pytest.warns(UserWarning, match="recompile limit") as caught:
        for B, T in rows:
            for dtype in (torch.float32, torch.bfloat16):
                for grad in (False, True):
                    x = torch.randn(B, T, 8).to(dtype).requires_grad_(grad)
                    want = rms_norm(x, w.to(dtype), 1e-6)
                    got = fn(x, w.to(dtype), 1e-6)
                    assert torch.equal(got, want), (B, T, dtype, grad)
                    if grad:
                        (g,) = torch.autograd.grad(got.sum(), x)
                        assert torch.equal(g, torch.autograd.grad(want.sum(), x)[0])
    assert len([w for w in caught if "recompile limit" in str(w.message)]) == 1
