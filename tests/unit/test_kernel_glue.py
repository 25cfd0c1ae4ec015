"""The CUDA kernels' glue, tested on CPU with reference callables that have the kernels'
exact signatures and semantics (``reference_varlen_attn`` for PyTorch's ``varlen_attn``,
``reference_chunk_gated_delta_rule`` for FLA's ``chunk_gated_delta_rule``): packing,
cu_seqlens from per-document position ids, GQA / GVA head maps, carried states. Plus the
affine-scan identity CP relies on, through the FLA glue, and the kernel table."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bumblebee.config import PrimitivesConfig
from bumblebee.primitives import kernel_choice
from bumblebee.primitives.attention.flash import flash_varlen, reference_varlen_attn
from bumblebee.primitives.attention.sdpa import sdpa_masked
from bumblebee.primitives.linear_attention.fla import (
    fla_chunk_indices,
    fla_gated_delta_rule,
    reference_chunk_gated_delta_rule,
)
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_recurrent
from bumblebee.primitives.packed import doc_layout

DOCS = [[10, 3, 11], [24]]


def layout():
    return doc_layout(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS]))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_flash_varlen_glue_matches_masked_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    outs = []
    for fn in (lambda *a: flash_varlen(*a, kernel=reference_varlen_attn), sdpa_masked):
        o = fn(q, k, v, layout(), 0.3)
        grads = torch.autograd.grad(o.square().sum(), (q, k, v))
        outs.append((o, *grads))
    for a, b in zip(*outs):
        assert rel(a, b) < 1e-5


def gdn_inputs(G=2, H=4, K=8, V=6, T=24, B=2):
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(B, T, G, K, generator=g),
        torch.randn(B, T, G, K, generator=g),
        torch.randn(B, T, H, V, generator=g),
        -torch.rand(B, T, H, generator=g),
        torch.rand(B, T, H, generator=g),
        torch.randn(B, H, K, V, generator=g),
    ]


def test_fla_glue_matches_recurrent_reference():
    xs = [x.requires_grad_() for x in gdn_inputs()]
    results = []
    for fn in (
        lambda *a: fla_gated_delta_rule(*a, kernel=reference_chunk_gated_delta_rule),
        gated_delta_rule_recurrent,
    ):
        o, S = fn(*xs[:5], layout(), xs[5])
        grads = torch.autograd.grad(o.square().sum() + S.square().sum(), xs)
        results.append((o, S, *grads))
    for a, b in zip(*results):
        assert rel(a, b) < 1e-5


def test_affine_scan_identity_through_fla_glue():
    """What CP builds on: from an incoming state S_in, o = o|0 + e S_in and S_out = M S_in + S_out|0,
    where one probe call on values [v | 0_K] from the state [0 | I_K] gives o|0, e, S_out|0, M."""
    q, k, v, g, beta, S_in = gdn_inputs(B=1)
    lay = doc_layout(torch.arange(24)[None])
    K, V = q.shape[-1], v.shape[-1]

    def run(vv, h0):
        return fla_gated_delta_rule(
            q, k, vv, g, beta, lay, h0, kernel=reference_chunk_gated_delta_rule
        )

    v_ext = torch.cat([v, v.new_zeros(v.shape[:-1] + (K,))], -1)
    h0 = torch.cat([S_in.new_zeros(S_in.shape), torch.eye(K).expand(1, 4, K, K)], -1)
    o_ext, S_ext = run(v_ext, h0)
    o0, e = o_ext.split([V, K], -1)
    S0, M = S_ext.split([V, K], -1)
    o, S = run(v, S_in)
    assert rel(o0 + torch.einsum("bthk,bhkv->bthv", e, S_in), o) < 1e-5
    assert rel(M @ S_in + S0, S) < 1e-5


def test_fla_custom_op_has_fake_shapes_and_autograd():
    lay = layout()  # built outside: the layout reads real position ids
    with FakeTensorMode():
        q, k, v, g, beta, h0 = (
            torch.empty(x.shape, device="meta", requires_grad=True) for x in gdn_inputs()
        )
        o, S = fla_gated_delta_rule(q, k, v, g, beta, lay, h0)
        (o.float().sum() + S.sum()).backward()
        assert o.shape == v.shape and S.shape == h0.shape and q.grad.shape == q.shape


def test_dispatch_table():
    sel = kernel_choice.select
    assert sel("attention", "varlen", "cuda", torch.bfloat16).name == "varlen_attn"
    assert sel("attention", "varlen", "cuda", torch.float32).name == "sdpa_per_doc"
    assert sel("attention", "varlen", "cpu", torch.bfloat16).name == "sdpa_per_doc"
    assert sel("attention", "sdpa", "cuda", torch.bfloat16).name == "sdpa"  # references never swap
    assert sel("cp_attention", "ring", "cuda", "bfloat16").name == "ring_varlen_attn"
    assert sel("cp_attention", "ring", "cpu", "bfloat16").name == "ring_tiles"
    assert sel("linear_attention", "chunked", "cuda", "bfloat16", fla=True).name == "fla_chunk"
    absent = sel("linear_attention", "chunked", "cuda", "bfloat16", fla=False)
    assert absent.name == "torch_chunked" and "fla not installed" in absent.note
    assert sel("conv", "causal", "cuda", "bfloat16", fla=True).name == "fla_causal_conv1d"
    assert sel("conv", "causal", "cuda", "bfloat16", fla=False).name == "conv_blocks"
    assert sel("conv", "causal", "cpu", "bfloat16", fla=True).name == "conv_blocks"
    assert sel("glue", "fused", "cuda", "float32").name == "compiled"
    assert sel("glue", "fused", "cpu", "bfloat16").name == "eager"
    with kernel_choice.unfused():  # the pre-fusion CUDA paths
        assert sel("conv", "causal", "cuda", "bfloat16", fla=True).name == "conv_blocks"
        assert sel("glue", "fused", "cuda", "bfloat16").name == "eager"
        assert sel("loss", "linear_ce", "cuda", "bfloat16").name == "eager_tiles"
    assert sel("loss", "linear_ce", "cuda", "bfloat16").name == "compiled_tiles"
    assert sel("loss", "linear_ce", "cpu", "bfloat16").name == "eager_tiles"
    with kernel_choice.configured(PrimitivesConfig(fused="off")):  # the user's switch
        assert sel("glue", "fused", "cuda", "bfloat16").name == "eager"
    fa3 = sel("attention", "varlen", "cuda", "bfloat16", fa3=True)
    assert fa3.name == "varlen_attn" and "FA3" in fa3.label
    table = kernel_choice.kernel_table(
        PrimitivesConfig(), "cuda", "bfloat16", cp=4, fla=True, fa3=False
    )
    assert kernel_choice.describe(table) == (
        "attention: varlen_attn (flash, FA2); cp_attention: ring of varlen_attn steps (flash, FA2); "
        "linear_attention: fla chunk_gated_delta_rule; conv: fla causal_conv1d (fused, varlen); "
        "glue: torch.compile per function (inductor); "
        "loss: linear CE, torch.compile per 4096 x 16384 tile"
    )
    assert set(kernel_choice.kernel_table(PrimitivesConfig(), "cpu", "float32")) == {
        "attention",
        "linear_attention",
        "conv",
        "glue",
        "loss",
    }


@pytest.mark.parametrize(
    "slot,impl",
    [
        ("attention", "varlen"),
        ("cp_attention", "ring"),
        ("linear_attention", "chunked"),
        ("conv", "causal"),
        ("glue", "fused"),
    ],
)
def test_dispatch_rows_cover_devices(slot, impl):
    rows = kernel_choice.rows(slot, impl)
    assert {r[0] for r in rows} == {"cuda", "cpu"} and all(r[2] for r in rows)


MANY = [[3, 2, 4, 1, 5, 3, 6], [2, 2, 20], [24]]  # rows of 7, 3 and 1 documents


def many_layout():
    return doc_layout(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in MANY]))


def test_fla_glue_states_only_for_edge_documents():
    """Per-document states blow up at long context with short documents (one fp32 [H, K, V] each):
    only each row's first and last document get one; the rest run without (planted: one call with
    a state per document -> 11 states, not 5)."""
    seen = []

    def recording(*a, initial_state=None, output_final_state=False, cu_seqlens=None, **kw):
        seen.append(
            (
                0 if initial_state is None else initial_state.shape[0],
                output_final_state,
                cu_seqlens.numel() - 1,
            )
        )
        return reference_chunk_gated_delta_rule(
            *a,
            initial_state=initial_state,
            cu_seqlens=cu_seqlens,
            output_final_state=output_final_state,
            **kw,
        )

    xs = [x.requires_grad_() for x in gdn_inputs(B=3)]
    results = []
    for fn in (lambda *a: fla_gated_delta_rule(*a, kernel=recording), gated_delta_rule_recurrent):
        o, S = fn(*xs[:5], many_layout(), xs[5])
        grads = torch.autograd.grad(o.square().sum() + S.square().sum(), xs)
        results.append((o, S, *grads))
    for a, b in zip(*results):
        assert rel(a, b) < 1e-5
    states = sum(n for n, _, _ in seen)
    assert states <= 2 * 3, seen  # <= 2 per row: 5 here (the one-document row has one)
    assert sum(docs for _, _, docs in seen) == 11  # every document still runs


def test_fla_custom_op_under_emulation():
    """The CUDA branch (``bumblebee::fla_gdn`` op, its registered autograd and the backward op)
    runs on CPU in the emulated-CUDA mode with the reference kernel inside; gradients equal the
    plain reference's, and ``torch.library.opcheck`` accepts the op's schema, fake and autograd."""
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked

    xs = [x.requires_grad_() for x in gdn_inputs(B=3)]
    results = []
    for emulated in (True, False):
        with emulate_cuda(check_comm=False) if emulated else contextlib.nullcontext():
            o, S = gated_delta_rule_chunked(*xs[:5], many_layout(), xs[5])
            grads = torch.autograd.grad(o.square().sum() + S.square().sum(), xs)
        results.append((o, S, *grads))
    for a, b in zip(*results):
        assert rel(a, b) < 1e-5
    flat = [x.detach().reshape((1, -1) + tuple(x.shape[2:])).requires_grad_() for x in xs[:5]]
    cu = torch.tensor([0, 30, 72], dtype=torch.long)
    idx = torch.tensor(fla_chunk_indices([0, 30, 72]), dtype=torch.long)
    args = (*flat, xs[5][:2].detach().requires_grad_(), cu, idx, 0.35, True)
    with emulate_cuda(check_comm=False):
        # not the aot_dispatch utils: the backward op runs autograd inside (bumblebee never compiles)
        torch.library.opcheck(
            torch.ops.bumblebee.fla_gdn,
            args,
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


@pytest.mark.parametrize("docs", [DOCS, [[1, 2, 21], [24]], [[24], [2, 22]]])
@pytest.mark.parametrize("act", [None, "silu"])
def test_fla_conv_glue_matches_conv_blocks(docs, act):
    """FLA's causal_conv1d glue (rows as documents, the carried window as the first document's
    state, the final window off the last, short documents included) against the channel-blocks
    path, forward and backward, x / weight / window gradients; fp32: equal to fp32 rounding."""
    from bumblebee.primitives.linear_attention.conv import (
        causal_conv1d,
        fla_causal_conv1d,
        reference_fla_causal_conv1d,
    )

    lay = doc_layout(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs]))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, 6, generator=g, requires_grad=True)
    w = torch.randn(6, 4, generator=g, requires_grad=True)
    init = torch.randn(2, 3, 6, generator=g, requires_grad=True)
    silu = torch.nn.functional.silu if act else (lambda y: y)
    ref_y, ref_f = causal_conv1d(x, w, lay, init)
    ref_y = silu(ref_y)
    y, f = fla_causal_conv1d(x, w, lay, init, act, kernel=reference_fla_causal_conv1d)
    torch.testing.assert_close(y, ref_y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(f, ref_f, rtol=0, atol=0)
    dy, df = torch.randn_like(y, generator=g), torch.randn_like(f, generator=g)
    got = torch.autograd.grad((y * dy).sum() + (f * df).sum(), (x, w, init))
    want = torch.autograd.grad((ref_y * dy).sum() + (ref_f * df).sum(), (x, w, init))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_conv_layer_takes_fla_under_emulation():
    """The GDN conv layer runs FLA's glue on the CUDA branch (emulated) and matches its CPU path."""
    from bumblebee.perf.syncs import SyncCounter
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.primitives.linear_attention.conv import FLA_CONV_FWD, CausalConv1d

    conv = CausalConv1d(6, 4)
    torch.nn.init.normal_(conv.weight)
    x = torch.randn(2, 24, 6)
    cpu = conv(x, layout(), None, torch.nn.functional.silu)
    with emulate_cuda(check_comm=False), SyncCounter() as c:
        emu = conv(x, layout(), None, torch.nn.functional.silu)
    assert c.by_kernel == {FLA_CONV_FWD[0]: 1}
    for a, b in zip(emu, cpu):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fla_chunk_indices_are_flas():
    """FLA's prepare_chunk_indices (64-token chunks; fla/ops/utils/index.py), from host ints."""
    assert fla_chunk_indices([0, 1, 65, 65 + 128]) == [[0, 0], [1, 0], [2, 0], [2, 1]]
    assert fla_chunk_indices([0, 64, 129]) == [[0, 0], [1, 0], [1, 1]]
