"""FLA's forward at most twice per layer under full recompute (primitives/linear_attention/fla.py):
inside a checkpoint's recompute the ``bumblebee::fla_gdn`` call runs the kernel under autograd
and hands its graph to the op's backward through the saved handle, so the backward runs FLA's
backward kernels without a forward of its own. Checked in the emulated-CUDA mode (the reference
kernel inside FLA's regions): the forward region counted twice per call (once without recompute
too), the backward once, gradients equal to the run without recompute, and the checkpoint's
saved-tensor matching intact (a non-reentrant checkpoint raises on a mismatch)."""

import pytest
import torch

from bumblebee.perf.syncs import SyncCounter
from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.linear_attention.fla import FLA_BWD, FLA_FWD
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
from bumblebee.primitives.packed import doc_layout
from bumblebee.primitives.recompute import FullRecompute, NoRecompute

# row 0: three documents (edge + middle call), row 1: one
DOCS = [[10, 3, 5, 6], [24]]


def _inputs():
    g = torch.Generator().manual_seed(1)
    B, T, G, H, K, V = 2, 24, 2, 4, 8, 6
    xs = [
        torch.randn(B, T, G, K, generator=g),
        torch.randn(B, T, G, K, generator=g),
        torch.randn(B, T, H, V, generator=g),
        -torch.rand(B, T, H, generator=g),
        torch.rand(B, T, H, generator=g),
        torch.randn(B, H, K, V, generator=g),
    ]
    return [x.requires_grad_() for x in xs]


def _layer(q, k, v, g, beta, h0):
    """A layer around the core: ops before (saved for backward) and after it."""
    lay = doc_layout(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS]))
    o, S = gated_delta_rule_chunked(q.tanh(), k * 1.5, v.sigmoid(), g, beta, lay, h0)
    return o.square().sum() + (S * S.sin()).sum()


@pytest.mark.parametrize("policy", [NoRecompute, FullRecompute])
def test_fla_forward_twice_under_full_recompute(policy):
    xs = _inputs()
    with emulate_cuda(check_comm=False):
        want = torch.autograd.grad(_layer(*xs), xs)
        with SyncCounter() as c:
            got = torch.autograd.grad(policy().layer(_layer, *xs), xs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    calls = 2  # row 0's middle document runs in a call of its own
    # forward + (recompute | the op's backward re-run); FLA's backward kernels once
    assert c.by_kernel == {FLA_FWD[0]: 2 * calls, FLA_BWD[0]: calls}, c.by_kernel
