"""The linear CE's CUDA tile loop (primitives/loss/linear_ce_tiles.py), run in the emulated-CUDA
mode: parity against the materialized ``ce`` (loss, per-token loss and entropy, both gradients;
fp32 to 2e-6, bf16 to a few bf16 ulps of the gradients, as the eager loop), the launch count of
the loop equal to ``launches()`` (what the planner prints), the compiled tile functions (inductor
on CPU) equal to their eager form, and the CPU path untouched (no kernel region entered)."""

import shutil

import pytest
import torch

from bumblebee.perf.syncs import SyncCounter
from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.kernel_choice import unfused
from bumblebee.primitives.loss import cross_entropy, linear_cross_entropy
from bumblebee.primitives.loss import linear_ce_tiles as lt

T, H, V = 37, 16, 101


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[[3, 20]] = -100
    return h, w, labels


def _run(fn, dtype, **kw):
    h, w, labels = _inputs(dtype)
    loss_T, ent_T = fn(h, w, labels, with_entropy=True, temperature=0.7, reduction="none", **kw)
    weights = torch.linspace(0.5, 1.5, T)
    total = (loss_T * weights).sum() + (ent_T * weights.flip(0)).sum()
    return (loss_T, ent_T, *torch.autograd.grad(total, (h, w)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_tiles_match_materialized_ce(dtype):
    ref = _run(cross_entropy, dtype)
    with emulate_cuda(check_comm=False), SyncCounter() as c:
        got = _run(linear_cross_entropy, dtype, token_tile=8, vocab_tile=16)
    fwd, bwd = f"{lt.FWD[0]} (compiled)", f"{lt.BWD[0]} (compiled)"
    assert c.by_kernel == {fwd: 5 * 7, bwd: 5 * 7}  # the compiled loop ran: token x vocab tiles
    for name, a, b in zip(("loss", "entropy", "dhidden", "dweight"), got, ref):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, msg=name)
        else:  # the GEMMs and dz in bf16, as the eager loop: a few bf16 ulps of the gradients
            rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert rel < (1e-6 if name in ("loss", "entropy") else 1e-2), (name, rel)


def test_launches_match_the_counter():
    g = torch.Generator().manual_seed(1)
    for tokens, vocab, dtype in ((24, 48, torch.bfloat16), (20, 40, torch.float32), (8, 16, None)):
        dtype = dtype or torch.bfloat16
        h = torch.randn(tokens, 4, generator=g).to(dtype)
        w = torch.randn(vocab, 4, generator=g).to(dtype)
        local = torch.randint(-1, vocab + 3, (tokens,), generator=g)
        tiles = (8, 16)
        with emulate_cuda(check_comm=False), SyncCounter() as f:
            m, s, _, _ = lt.forward(h, w, local, 1.0, False, tiles)
        lse, gl = m + s.log(), torch.ones(tokens)
        with emulate_cuda(check_comm=False), SyncCounter() as b:
            lt.backward(h, w, local, lse, gl, None, None, (True, True), 1.0, tiles)
        want = lt.launches(tokens, vocab, lowp=dtype != torch.float32, tiles=tiles)
        assert (f.launches, b.launches) == want, (tokens, vocab, dtype)


def test_cpu_and_unfused_keep_the_eager_loop():
    h, w, labels = _inputs(torch.float32)
    with SyncCounter() as cpu:
        a = linear_cross_entropy(h, w, labels, token_tile=8, vocab_tile=16)
    with emulate_cuda(check_comm=False), unfused(), SyncCounter() as off:
        b = linear_cross_entropy(h, w, labels, token_tile=8, vocab_tile=16)
    assert not cpu.by_kernel and not off.by_kernel
    assert torch.equal(a, b)


@pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)
def test_compiled_tile_functions_match_their_eager_form():
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    h, w = r(8, 16), r(24, 16)
    col = torch.tensor([0, -1, 5, 23, -1, 2, 2, 7])
    fwd = (h, w, col, r(8) - 3, r(8).abs() + 1, r(8).abs(), r(8), 0.7, True)
    bwd = (h, w, col, r(8) + 3, r(8), r(8), r(8), 0.7, (True, True))
    for fn, args in ((lt.fwd_tile, fwd), (lt.bwd_tile, bwd)):
        want = fn(*args)
        got = torch.compile(fn, fullgraph=True)(*args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_plan_note_prints_the_loss_launches():
    from bumblebee.plan.kernels import kernels_note, measured_per_layer
    from bumblebee.plan.spec import load_spec

    spec, _ = load_spec("qwen3.5-35b-a3b")
    note = kernels_note(2, True, spec.family, spec, tokens=32768)
    fwd, bwd = lt.launches(32768, spec.vocab)
    assert f"{fwd + bwd} launches per micro-batch of 32768 tokens" in note
    per_layer = measured_per_layer(spec.family)[0]
    assert f"~{per_layer * len(spec.mixers) + fwd + bwd:,} launches per micro-batch" in note
