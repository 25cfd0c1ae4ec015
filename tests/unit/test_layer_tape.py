"""The layer-by-layer backward of paired micro-batches (``primitives/layer_tape.py``) gives the
gradients of one ``backward()`` bit for bit.

``moe_comm = overlap_mb`` cuts each micro-batch's forward at every decoder-layer boundary and runs
its backward one layer at a time (the partner runs between the parts: on CUDA no hand-over can
happen inside a backward call). Tiny models on packed documents, fp32, deterministic algorithms:
Qwen3-MoE (MoE and dense layers, router stats through the balance loss), the Qwen3.5 hybrid
(Gated DeltaNet layers), DeepSeek-V3 with an MTP layer (the MTP's embedding and MoE in the loss's
part), under recompute none / full / offload; and the parts' order and keys. (The stream order
``Pair`` keeps between two micro-batches' parts: tests/unit/test_mb_pair.py.)
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from bumblebee.config import PrimitivesConfig
from bumblebee.models import arch_from_hf_dict, build_model
from bumblebee.models.presets import PRESETS
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.primitives import layer_tape

QWEN3 = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
)


def _arch(family):
    if family == "qwen3_moe":
        return Qwen3MoeArch(**QWEN3)
    return arch_from_hf_dict(PRESETS[family]["tiny"])


def _batch(vocab, B=2, T=48):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = torch.randint(0, vocab, (B, T), generator=g)
    labels[:, ::7] = -100
    pos = torch.stack([torch.cat([torch.arange(20), torch.arange(28)])] * B)
    return ids, labels, pos


def _grads(family, recompute, tape, mtp=False):
    torch.manual_seed(0)
    prims = PrimitivesConfig(recompute=recompute)
    arch = _arch(family)
    model = build_model(arch, prims)
    assert model.mtp_depth == int(mtp)
    ids, labels, pos = _batch(arch.vocab_size)
    with layer_tape.recording(tape):
        terms = model.loss_terms(ids, labels, pos, balance="micro_batch")
    loss = terms.loss_sum / 100 + 0.1 * terms.aux_loss
    if tape is None:
        loss.backward()
    else:
        parts = []

        @contextlib.contextmanager
        def part(key):
            parts.append(key)
            yield

        tape.backward(loss, part)
        assert parts[0] == "ends" and parts[-1] == "ends", parts
        assert parts[1:-1] == [("layer", i) for i in range(arch.num_hidden_layers, 0, -1)], parts
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "family, recompute, mtp",
    [
        ("qwen3_moe", "none", False),
        ("qwen3_moe", "full", False),
        ("qwen3_moe", "offload", False),
        ("qwen3_5_moe", "full", False),
        ("deepseek_v3", "full", True),
    ],
)
def test_tape_backward_is_one_backward(family, recompute, mtp):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        ref = _grads(family, recompute, None, mtp)
        got = _grads(family, recompute, layer_tape.LayerTape(), mtp)
    finally:
        torch.use_deterministic_algorithms(before)
    assert torch.equal(ref[0], got[0])
    assert ref[1].keys() == got[1].keys()
    missing = [n for n, g in ref[1].items() if g is not None and got[1][n] is None]
    assert not missing, missing
    for name, g in ref[1].items():
        if g is not None:
            assert torch.equal(g, got[1][name]), name
