"""FLA's real Triton kernels, run on CPU through Triton's interpreter
(``primitives/triton_interpreter.py``), against the project's references of their contracts, through
the glue bumblebee calls them with: ``chunk_gated_delta_rule`` in the ``bumblebee::fla_gdn`` op
(packed documents, grouped keys, a carried initial state, final states; the edge documents' call
and the one without states), ``chunk_kda`` (per-channel gates) and ``causal_conv1d`` (carried
window, SiLU). Each case runs the same glue twice inside the emulated-CUDA mode: with
``real_kernels`` (FLA's kernel) and without (``reference_chunk_gated_delta_rule``,
``reference_chunk_kda``, ``reference_fla_causal_conv1d``: token by token in fp32), and compares
the outputs, final states and every input gradient (carried state included) to a fraction of each
tensor's largest value: fp32 1e-5 (measured <= 5e-7), bf16 inputs 1e-2 (measured <= 7.6e-3: the
kernels round intermediates to bf16 where the references keep fp32; with the interpreter's fp32 ->
bf16 casts truncating instead of rounding to nearest even, up to 1.8e-2).

Skipped without ``triton`` and ``fla-core`` (CI's torch-2.11 environment has both)."""

import importlib

import pytest
import torch

from bumblebee.primitives import triton_interpreter
from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.linear_attention.conv import fla_causal_conv1d
from bumblebee.primitives.linear_attention.fla import fla_gated_delta_rule
from bumblebee.primitives.linear_attention.fla_kda import fla_kda
from bumblebee.primitives.packed import DocLayout

MISSING = triton_interpreter.missing()
needs_kernels = pytest.mark.skipif(MISSING is not None, reason=f"real kernels: {MISSING}")

# max |real - reference| / max |reference|, per output and gradient
BUDGET = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def layout(docs) -> DocLayout:
    T = sum(docs[0])
    return DocLayout(tuple(tuple([0, *torch.tensor(d).cumsum(0).tolist()]) for d in docs), T)


# row 0: two documents (both carry a state in or out); row 1: three (the middle one runs in the
# glue's second call, without states)
GDN_DOCS = [[12, 20], [5, 14, 13]]
KDA_DOCS = [[6, 10], [3, 8, 5]]  # fewer tokens: one of KDA's kernels runs a program per token


def gen(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=g)


class Spy:
    """Counts the calls of FLA's entry point ``name`` (looked up by the glue at call time)."""

    def __init__(self, monkeypatch, name):
        module, attr = triton_interpreter.ENTRY_POINTS[name]
        self.calls, mod = 0, importlib.import_module(module)
        real = getattr(mod, attr)

        def spy(*a, **k):
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(mod, attr, spy)


def both_modes(fn, inputs, cast):
    """fn(*inputs) -> outputs, and the gradients of a random projection of them, with FLA's kernels
    and with the references; ``cast``: indices of the inputs given in the compute dtype."""
    results = []
    for real in (True, False):
        xs = [x.to(cast[i]) if i in cast else x for i, x in enumerate(inputs)]
        xs = [x.detach().requires_grad_() for x in xs]
        with emulate_cuda(check_comm=False, real_kernels=real):
            outs = fn(*xs)
            w = gen(7)
            loss = sum((o.float() * w(*o.shape)).sum() for o in outs)
            grads = torch.autograd.grad(loss, xs)
        results.append([t.detach().float() for t in (*outs, *grads)])
    return results


def assert_close(names, real, ref, dtype):
    for name, a, b in zip(names, real, ref, strict=True):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= BUDGET[dtype], f"{name}: {err:.2e} of its largest value > {BUDGET[dtype]}"


@needs_kernels
@DTYPES
def test_gated_delta_rule_real_kernel(dtype, monkeypatch):
    G, H, K, V = 1, 2, 16, 16  # two value heads read one key head (Qwen3.5's grouping)
    lay, r = layout(GDN_DOCS), gen()
    B, T = len(GDN_DOCS), lay.seq_len
    xs = [
        r(B, T, G, K),
        r(B, T, G, K),
        r(B, T, H, V),
        -r(B, T, H).abs() * 0.3,
        r(B, T, H).sigmoid(),
    ]
    xs.append(r(B, H, K, V) * 0.5)  # the state each row's first document starts from
    with triton_interpreter.interpreted():
        spy = Spy(monkeypatch, "chunk_gated_delta_rule")
        real, ref = both_modes(
            lambda *a: fla_gated_delta_rule(*a[:5], lay, a[5]), xs, dict.fromkeys(range(5), dtype)
        )
    # forward, and the backward's forward re-run: edge documents and the middle one, each
    assert spy.calls == 4
    names = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    assert_close(names, real, ref, dtype)


@needs_kernels
@DTYPES
def test_kda_real_kernel(dtype, monkeypatch):
    H, K, V = 2, 16, 16
    lay, r = layout(KDA_DOCS), gen(1)
    B, T = len(KDA_DOCS), lay.seq_len
    xs = [r(B, T, H, K), r(B, T, H, K), r(B, T, H, V), -r(B, T, H, K).abs() * 0.3]
    xs += [r(B, T, H).sigmoid(), r(B, H, K, V) * 0.5]
    with triton_interpreter.interpreted():
        spy = Spy(monkeypatch, "chunk_kda")
        real, ref = both_modes(
            lambda *a: fla_kda(*a[:5], lay, a[5]), xs, dict.fromkeys(range(5), dtype)
        )
    assert spy.calls == 2  # edge documents, the middle one (FLA's own backward)
    names = ["o", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    assert_close(names, real, ref, dtype)


@needs_kernels
@DTYPES
def test_causal_conv1d_real_kernel(dtype, monkeypatch):
    C, W = 24, 4
    lay, r = layout(GDN_DOCS), gen(2)
    B, T = len(GDN_DOCS), lay.seq_len
    xs = [r(B, T, C), r(C, W) * 0.5, r(B, W - 1, C)]  # input, weight, carried window
    with triton_interpreter.interpreted():
        spy = Spy(monkeypatch, "causal_conv1d")
        real, ref = both_modes(
            lambda x, w, h0: fla_causal_conv1d(x, w, lay, h0, "silu"),
            xs,
            dict.fromkeys(range(3), dtype),
        )
    assert spy.calls == 1
    assert_close(["y", "final window", "dx", "dweight", "d window"], real, ref, dtype)
