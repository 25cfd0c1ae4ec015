"""The interpreter gaps ``primitives/triton_interpreter.py`` closes, each on a small kernel of its
own (written here, run inside ``interpreted()``) against what compiled Triton computes: an
autotuned kernel runs without a GPU benchmark, a ``range`` loop index is a tensor, bf16
arithmetic and reductions compute on values (not bit patterns) and round to nearest even like
torch's bf16, a Python bool runs as a runtime argument, a scalar tensor bounds a Python
``range``; and leaving the context puts FLA's and ``triton.language``'s compiled-Triton
functions back. Skipped without ``triton`` and ``fla-core``."""

import pytest
import torch

from bumblebee.primitives import triton_interpreter

MISSING = triton_interpreter.missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"real kernels: {MISSING}")


def test_autotuned_kernel_runs_without_a_benchmark():
    with triton_interpreter.interpreted():
        import triton
        import triton.language as tl

        configs = [triton.Config({"BLOCK": b}) for b in (4, 16, 8)]

        @triton.autotune(configs=configs, key=["n"])
        @triton.jit
        def copy(x, y, n, BLOCK: tl.constexpr):
            o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y + o, tl.load(x + o, mask=o < n), mask=o < n)

        x, y = torch.arange(20.0), torch.zeros(20)
        copy[lambda meta: (triton.cdiv(20, meta["BLOCK"]),)](x, y, 20)
    assert torch.equal(y, x)
    assert copy.best_config.kwargs == {"BLOCK": 16}  # the largest block, untimed


def test_loop_index_is_a_tensor_and_a_scalar_bounds_a_range():
    with triton_interpreter.interpreted():
        import triton
        import triton.language as tl

        @triton.jit
        def ramp(y, n):
            for i in range(0, min(8, n)):  # n: a scalar tensor, read as a Python int
                tl.store(y + i, i.to(tl.int64) * 3)  # i: a tensor, as in compiled Triton

        y = torch.zeros(8, dtype=torch.int64)
        ramp[(1,)](y, 5)
    assert y.tolist() == [0, 3, 6, 9, 12, 0, 0, 0]


def test_bf16_computes_on_values_and_rounds_to_nearest_even():
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(2))
    f = torch.randn(64, generator=g) * 100
    with triton_interpreter.interpreted():
        import triton
        import triton.language as tl

        @triton.jit
        def ops(a, b, f, out, cast, total):
            o = tl.arange(0, 64)
            x, y = tl.load(a + o), tl.load(b + o)
            tl.store(out + o, x * y + x)  # bf16 arithmetic, one rounding per op
            tl.store(cast + o, tl.load(f + o).to(tl.bfloat16))  # fp32 -> bf16
            tl.store(total, tl.sum(x, 0))  # a bf16 reduction

        out, cast = torch.empty_like(a), torch.empty(64, dtype=torch.bfloat16)
        total = torch.empty(1, dtype=torch.bfloat16)
        ops[(1,)](a, b, f, out, cast, total)
    assert torch.equal(out, a * b + a)  # torch's bf16 ops round to nearest even
    assert torch.equal(cast, f.to(torch.bfloat16))
    assert torch.allclose(total.float(), a.float().sum(), rtol=1e-2)


def test_bool_runtime_argument():
    with triton_interpreter.interpreted():
        import triton
        import triton.language as tl

        @triton.jit
        def pick(y, flag):
            if flag:
                tl.store(y, 1.0)
            else:
                tl.store(y, 2.0)

        y = torch.zeros(2)
        pick[(1,)](y, True)
        pick[(1,)](y[1:], False)
    assert y.tolist() == [1.0, 2.0]


def test_leaving_puts_compiled_triton_back():
    import triton.language as tl
    from triton import knobs
    from triton.runtime.jit import JITFunction

    with triton_interpreter.interpreted():
        from fla.modules.norm import l2norm

        assert knobs.runtime.interpret
        assert type(tl.sum) is not JITFunction
        assert type(l2norm.l2norm_fwd_kernel.fn) is not JITFunction  # under its autotuner
        with triton_interpreter.interpreted():  # nested: one install
            pass
        assert type(tl.sum) is not JITFunction
    assert not knobs.runtime.interpret
    assert type(tl.sum) is JITFunction
    assert type(l2norm.l2norm_fwd_kernel.fn) is JITFunction
