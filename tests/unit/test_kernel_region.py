"""Kernel regions (primitives/kernel_region.py): a stand-in counts as the kernel it stands for in
the launch counter (perf/syncs.py), once per call, forward and backward; values unchanged."""

import torch

from bumblebee.perf.syncs import SyncCounter
from bumblebee.primitives.attention.flash import (
    FLASH_BWD,
    FLASH_FWD,
    emulated_varlen_attn,
    reference_varlen_attn,
)
from bumblebee.primitives.kernel_region import kernel, standin


def _ops(x):
    y = (x * 2).exp().sum()
    return y + x.mean()


def test_region_counts_once_and_hides_its_ops():
    x = torch.randn(8)
    with SyncCounter() as plain:
        _ops(x)
    assert plain.launches >= 4
    with SyncCounter() as c:
        with kernel("k", 3, syncs=1):
            _ops(x)
            x.sum().item()  # the stand-in's own host read: not the kernel's
        _ops(x)  # outside: counted op by op
    assert c.launches == 3 + plain.launches
    assert c.syncs == 1 and c.by_kernel == {"k": 1}


def test_nested_regions_count_each_once():
    x = torch.randn(8)
    with SyncCounter() as c:
        with kernel("outer", 5):
            _ops(x)
            with kernel("inner", 2):
                _ops(x)
            _ops(x)
    assert c.launches == 7 and c.by_kernel == {"outer": 1, "inner": 1}


def test_standin_is_fn_in_values_and_grads_and_counts_its_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(12, 4, 8, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    kw = dict(scale=0.3, window_size=(-1, 0), enable_gqa=False)
    ref = reference_varlen_attn(q, k, v, cu, cu, 7, 7, **kw)
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    with SyncCounter() as c:
        out = emulated_varlen_attn(q, k, v, cu, cu, 7, 7, **kw)
        loss = out.square().sum()
        grads = torch.autograd.grad(loss, (q, k, v))
    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(grads, g_ref))
    assert c.by_kernel == {FLASH_FWD[0]: 1, FLASH_BWD[0]: 1}
    # the kernels, plus the loss's few eager ops (square, sum and their backward)
    assert FLASH_FWD[1] + FLASH_BWD[1] <= c.launches <= FLASH_FWD[1] + FLASH_BWD[1] + 6
    assert c.syncs == 0  # the reference's cu_seqlens.tolist() is the stand-in's, not flash's


def test_standin_passes_constants_and_unneeded_grads():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    out = standin(lambda a, s, b: a * s + b, ("f", 1), ("b", 1), a, 2.0, b)
    (ga,) = torch.autograd.grad(out.sum(), (a,))
    assert torch.equal(ga, torch.full((3,), 2.0))
