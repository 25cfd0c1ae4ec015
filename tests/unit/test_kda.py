"""Kimi Delta Attention's core: the gated delta rule with a per-channel gate g [B, T, H, K]
(``linear_attention`` slot), its chunked CPU path and FLA ``chunk_kda`` glue.

- the recurrent reference equals HF's ``recurrent_kimi_delta_attention`` (an independent
  implementation of the same recurrence);
- the chunked path (16-token chunks and others, packed documents, carried state) equals the
  recurrent one in fp64, values and gradients, also with decays fast enough that exp(-log Gamma)
  would overflow;
- the contract context parallelism builds on: x[:s] then x[s:] with the carried state = x;
- a per-head gate broadcast over K gives Gated DeltaNet's results;
- the FLA glue (``fla_kda``), with ``reference_chunk_kda`` standing in for ``chunk_kda`` (its
  signature; checked against HF's recurrence too), equals the reference, and the chunked slot
  takes it on the (emulated) CUDA branch.
"""

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi

from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.linear_attention.fla_kda import fla_kda, reference_chunk_kda
from bumblebee.primitives.linear_attention.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from bumblebee.primitives.packed import DocLayout

B, T, H, K = 2, 37, 3, 8
ONE_DOC = DocLayout(((0, T), (0, T)), T)
PACKED = DocLayout(((0, 3, 5, 20, 30, T), (0, 17, T)), T)  # edge and middle documents


def inputs(dtype=torch.float64, fast=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, K, generator=g, dtype=dtype) for _ in range(3))
    gate = -torch.rand(B, T, H, K, generator=g, dtype=dtype) * 3 * fast
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, K, generator=g, dtype=dtype)
    return [q, k, v, gate, beta, S0]


def close(a, b, tol):
    return (a - b).abs().max().item() <= tol * max(b.abs().max().item(), 1.0)


def test_recurrent_matches_hf_recurrence():
    q, k, v, g, beta, _ = inputs(torch.float32)
    o, S = gated_delta_rule_recurrent(q, k, v, g, beta, ONE_DOC)
    o_hf, S_hf = hf_kimi.recurrent_kimi_delta_attention(
        q, k, v, g, beta, None, True, use_qk_l2norm_in_kernel=True
    )
    assert close(o, o_hf, 1e-5) and close(S, S_hf, 1e-5)
    o_ref, S_ref = reference_chunk_kda(q, k, v, g, beta, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert close(o_ref, o_hf, 1e-5) and close(S_ref, S_hf, 1e-5)


@pytest.mark.parametrize("chunk", [None, 4, 64])
@pytest.mark.parametrize("fast", [1.0, 30.0])
def test_chunked_matches_recurrent_with_gradients(chunk, fast):
    """fast = 30: per-token log decays down to -90, |log Gamma| ~ 1e3 within a chunk."""
    xs = [x.requires_grad_() for x in inputs(fast=fast)]
    outs = []
    for fn in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        kw = {"chunk_size": chunk} if fn is gated_delta_rule_chunked else {}
        o, S = fn(*xs[:5], PACKED, xs[5], **kw)
        grads = torch.autograd.grad((o * o.detach().cos()).sum() + S.square().sum(), xs)
        outs.append((o, S, *grads))
    for a, b in zip(*outs):
        assert a.isfinite().all() and close(a, b, 1e-10)


def test_split_with_carried_state_equals_one_call():
    q, k, v, g, beta, S0 = inputs()
    lay = DocLayout(((0, T), (0, T)), T)
    o, S = gated_delta_rule_chunked(q, k, v, g, beta, lay, S0)
    s = 21
    o1, S1 = gated_delta_rule_chunked(*(x[:, :s] for x in (q, k, v, g, beta)),
                                      DocLayout(((0, s),) * B, s), S0)  # fmt: skip
    o2, S2 = gated_delta_rule_chunked(*(x[:, s:] for x in (q, k, v, g, beta)),
                                      DocLayout(((0, T - s),) * B, T - s), S1)  # fmt: skip
    assert close(torch.cat([o1, o2], 1), o, 1e-12) and close(S2, S, 1e-12)


def test_per_head_gate_broadcast_is_gated_deltanet():
    q, k, v, _, beta, S0 = inputs()
    g_head = -torch.rand(B, T, H, dtype=torch.float64)
    o, S = gated_delta_rule_chunked(q, k, v, g_head, beta, PACKED, S0)
    o2, S2 = gated_delta_rule_chunked(q, k, v, g_head[..., None].expand(B, T, H, K), beta,
                                      PACKED, S0)  # fmt: skip
    assert close(o2, o, 1e-12) and close(S2, S, 1e-12)


@pytest.mark.parametrize("layout", [ONE_DOC, PACKED])
def test_fla_glue_matches_reference(layout):
    xs = [x.float().requires_grad_() for x in inputs()]
    o_ref, S_ref = gated_delta_rule_recurrent(*xs[:5], layout, xs[5])
    o, S = fla_kda(*xs[:5], layout, xs[5], kernel=reference_chunk_kda)
    assert close(o, o_ref, 1e-5) and close(S, S_ref, 1e-5)
    g_ref = torch.autograd.grad(o_ref.sum() + S_ref.sum(), xs)
    g = torch.autograd.grad(o.sum() + S.sum(), xs)
    assert all(close(a, b, 1e-4) for a, b in zip(g, g_ref))
    with emulate_cuda(check_comm=False):  # the slot's CUDA branch takes the glue
        o_cuda, S_cuda = gated_delta_rule_chunked(*xs[:5], layout, xs[5])
    assert close(o_cuda, o_ref, 1e-5) and close(S_cuda, S_ref, 1e-5)


def test_bad_gate_shape_is_refused():
    q, k, v, g, beta, _ = inputs()
    with pytest.raises(ValueError, match="per channel"):
        gated_delta_rule_chunked(q, k, v, g[..., :-1], beta, ONE_DOC)
