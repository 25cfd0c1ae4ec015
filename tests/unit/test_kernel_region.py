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


def test_emulated_fla_counts_as_flas_kernels():
    """The emulated FLA op (edge and middle documents: two calls) counts as FLA's forward per call,
    and per backward call its backward plus the forward it re-runs; no host syncs (the chunk
    indices come from the layout)."""
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.primitives.linear_attention.fla import FLA_BWD, FLA_FWD
    from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
    from bumblebee.primitives.packed import doc_layout

    rows = [[3, 5, 8], [16]]
    lay = doc_layout(torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows]))
    g = torch.Generator().manual_seed(0)
    B, T, G, H, K, V = 2, 16, 1, 2, 4, 4
    q, k = (torch.randn(B, T, G, K, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, requires_grad=True)
    gate = (-torch.rand(B, T, H, generator=g)).requires_grad_()
    beta = torch.rand(B, T, H, generator=g).requires_grad_()
    lay.doc_ids(torch.device("cpu"))  # the layout's host read: once per micro-batch, not FLA's
    with emulate_cuda(check_comm=False), SyncCounter() as c:
        o, S = gated_delta_rule_chunked(q, k, v, gate, beta, lay, None)
        (o.square().sum() + S.square().sum()).backward()
    assert c.by_kernel == {FLA_FWD[0]: 4, FLA_BWD[0]: 2}, c.by_kernel
    assert c.syncs == 0, c.by_site
