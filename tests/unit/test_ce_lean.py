"""The materialized ``ce`` keeps one fp32 [T, V] working copy (softmax, then its gradient, in
place): values and gradients equal torch's cross-entropy, and the peak is ~6 B per logit in
bf16 (the figure the planner's loss term uses), not autograd log-softmax's 10+ B."""

import pytest
import torch
import torch.nn.functional as F

from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.loss.ce import cross_entropy


@pytest.mark.parametrize("temperature,reduction", [(1.0, "mean"), (0.7, "sum"), (1.0, "none")])
def test_ce_matches_torch(temperature, reduction):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(53, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 53, (37,), generator=g)
    labels[::5] = -100
    out = cross_entropy(h, w, labels, reduction=reduction, temperature=temperature)
    ref = F.cross_entropy(h @ w.T / temperature, labels, ignore_index=-100, reduction=reduction)
    torch.testing.assert_close(out, ref)
    gout = torch.randn_like(out, dtype=torch.float64) if reduction == "none" else None
    grads = torch.autograd.grad(out, (h, w), gout)
    refs = torch.autograd.grad(ref, (h, w), gout)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b)


def test_ce_backward_twice_is_refused():
    h = torch.randn(4, 8, requires_grad=True)
    loss = cross_entropy(h, torch.randn(10, 8), torch.tensor([1, 2, 3, 4]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_ce_peak_is_six_bytes_per_logit_in_bf16():
    T, V, H = 512, 8192, 64
    h = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    with MemoryTracker("cpu") as mem:
        cross_entropy(h, w, labels).backward()
    per_logit = mem.peak_bytes / (T * V)
    assert 5.5 < per_logit < 6.6, per_logit
