"""CUDA kernels against the PyTorch references (skipped without CUDA; ready for a GPU run).

- ``varlen`` attention (PyTorch's flash ``varlen_attn``) vs the dense-mask SDPA reference;
- ``reference_varlen_attn`` and the ring's block kernel contract vs the flash ops themselves
  (the CPU glue tests rely on the references having the kernels' semantics);
- the gated delta rule through FLA (when installed) vs the recurrent reference.
bf16 error budget: the kernel's error against an fp32/fp64 ground truth may not exceed the
reference's by more than 2x (plus a small floor).
"""

import pytest
import torch

from bumblebee.primitives import kernel_choice
from bumblebee.primitives.attention.flash import flash_varlen, reference_varlen_attn
from bumblebee.primitives.attention.sdpa import sdpa_masked
from bumblebee.primitives.cp.ring_flash import cuda_block_kernel, reference_block_kernel
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_recurrent
from bumblebee.primitives.packed import doc_layout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DOCS = [[100, 37, 119], [256]]


def layout(device):
    return doc_layout(
        torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS]).to(device)
    )


def err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_varlen_attn_matches_reference_within_budget():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 64, device="cuda", generator=g) for h in (8, 2, 2))
    lay = layout("cuda")
    truth = sdpa_masked(q.double(), k.double(), v.double(), lay, 0.125)
    ref = sdpa_masked(*(x.bfloat16() for x in (q, k, v)), lay, 0.125)
    fast = flash_varlen(*(x.bfloat16() for x in (q, k, v)), lay, 0.125)
    assert err(fast, truth) <= 2 * err(ref, truth) + 1e-3


def test_block_kernel_contract_matches_flash_ops():
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(96, h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (8, 2, 2)
    )
    do = torch.randn_like(q)
    cu = torch.tensor([0, 40, 96], dtype=torch.int32, device="cuda")
    for causal in (True, False):
        outs = []
        for kern in (cuda_block_kernel(), reference_block_kernel()):
            o, lse = kern.forward(q, k, v, cu, cu, 56, 56, causal, 0.125)
            outs.append(
                (o, lse, *kern.backward(do, q, k, v, o, lse, cu, cu, 56, 56, causal, 0.125))
            )
        for a, b in zip(*outs):
            assert err(a, b) < 2e-2


def test_reference_varlen_attn_matches_varlen_attn():
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (
        torch.randn(80, h, 64, device="cuda", generator=g, dtype=torch.bfloat16) for h in (4, 4, 4)
    )
    cu = torch.tensor([0, 30, 80], dtype=torch.int32, device="cuda")
    a = varlen_attn(q, k, v, cu, cu, 50, 50, return_aux=AuxRequest(lse=True), window_size=(-1, 0))
    b = reference_varlen_attn(
        q, k, v, cu, cu, 50, 50, return_aux=AuxRequest(lse=True), window_size=(-1, 0)
    )
    assert a[1].shape == b[1].shape  # the LSE layout the ring relies on
    assert err(a[0], b[0]) < 2e-2 and err(a[1], b[1]) < 1e-3


@pytest.mark.skipif(not kernel_choice.package_present("fla"), reason="needs flash-linear-attention")
def test_fla_chunk_matches_recurrent_within_budget():
    from bumblebee.primitives.linear_attention.fla import fla_gated_delta_rule

    g = torch.Generator(device="cuda").manual_seed(3)
    B, T, G, H, K, V = 2, 256, 2, 4, 64, 64
    q, k = (torch.randn(B, T, G, K, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", generator=g)
    gd, beta = (
        -torch.rand(B, T, H, device="cuda", generator=g),
        torch.rand(B, T, H, device="cuda", generator=g),
    )
    h0 = torch.randn(B, H, K, V, device="cuda", generator=g)
    lay = layout("cuda")
    truth = gated_delta_rule_recurrent(
        q.double(), k.double(), v.double(), gd.double(), beta.double(), lay, h0
    )
    bf = [x.bfloat16() for x in (q, k, v)]
    ref = gated_delta_rule_recurrent(*bf, gd, beta.bfloat16(), lay, h0)
    fast = fla_gated_delta_rule(*bf, gd, beta.bfloat16(), lay, h0)
    for f, r, t in zip(fast, ref, truth):
        assert err(f, t) <= 2 * err(r, t) + 1e-3
