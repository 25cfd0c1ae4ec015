"""``recompute = "offload"``: full recompute with every decoder layer's input moved to host memory
after the layer's forward and brought back, one layer ahead, for its recompute.

Gradients equal ``full`` bit for bit (the same ops on the same bytes); the tracked activation
peak drops by the offloaded layer inputs (all but the one being recomputed and the prefetched
one) and the host buffers hold them; the order is offload x L, then restore of the last layer
with a prefetch of each earlier one; an input that shares its storage stays on the device; a
training run's loss trace equals ``full``'s.
"""

from __future__ import annotations

import io

import pytest
import torch

from bumblebee import load_config, registry
from bumblebee.config import PrimitivesConfig
from bumblebee.models import build_model
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.perf import MemoryTracker
from bumblebee.runtime.trainer import Trainer

L, T, H = 6, 1024, 128
ARCH = dict(
    vocab_size=97,
    hidden_size=H,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
)


def step(recompute):
    torch.manual_seed(0)
    model = build_model(Qwen3MoeArch(**ARCH), PrimitivesConfig(recompute=recompute))
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 97, (1, T), generator=g) for _ in range(2))
    pos = torch.cat([torch.arange(300), torch.arange(T - 300)])[None]  # two packed documents
    with MemoryTracker("cpu", model=model) as mem:
        loss = model(ids, position_ids=pos, labels=labels)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, mem, model.recompute


@pytest.fixture(scope="module")
def both():
    return step("full"), step("offload")


def test_gradients_equal_full_bitwise(both):
    (loss_f, grads_f, *_), (loss_o, grads_o, *_) = both
    assert torch.equal(loss_f, loss_o)
    for name, g in grads_f.items():
        assert torch.equal(g, grads_o[name]), name


def test_the_layer_input_term_drops_by_the_offloaded_inputs(both):
    (*_, mem_f, _), (*_, mem_o, policy) = both
    one = T * H * 4  # one fp32 layer input
    saved = mem_f.breakdown("peak")["activations"] - mem_o.breakdown("peak")["activations"]
    # at the backward's peak: the input being recomputed and the prefetched one stay
    assert saved == (L - 2) * one, (saved, one)
    assert mem_o.host_peak_bytes == L * one and mem_f.host_peak_bytes == 0
    assert mem_o.host_bytes == 0  # every host buffer released once its input is back
    s = policy.store.stats
    assert (s.offloaded, s.restored, s.prefetched, s.skipped, s.bytes) == (L, L, L - 1, 0, L * one)
    kinds = [k for k, _ in s.order]
    assert kinds == ["offload"] * L + ["restore"] + ["prefetch"] * (L - 1)
    ids = [i for _, i in s.order]
    assert ids[L:] == ids[:L][::-1]  # the last layer's input first, then each earlier one


def test_an_input_sharing_its_storage_stays():
    policy = registry.get("recompute", "offload").factory([])
    base = torch.randn(2, 8, requires_grad=True)
    x = base[0] * 1.0  # owns its storage: offloaded
    view = (base * 1.0)[1]  # a view of a larger storage: kept
    y = policy.decoder_layer(lambda t: t.exp(), x) + policy.decoder_layer(lambda t: t.exp(), view)
    assert x.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() > 0
    y.sum().backward()
    assert torch.allclose(base.grad, base.detach().exp())
    assert (policy.store.stats.offloaded, policy.store.stats.skipped) == (1, 1)


def test_training_trace_equals_full(tmp_path):
    def trace(rc):
        cfg = load_config(
            None,
            [
                "train.steps=2",
                "train.seq_len=128",
                "train.global_batch=2",
                f"train.out_dir={tmp_path / rc}",
                f"primitives.recompute={rc}",
            ],
        )
        trainer = Trainer(cfg, stream=io.StringIO())
        return [(r["loss"], r["grad_norm"]) for r in (trainer.train_step() for _ in range(2))]

    assert trace("offload") == trace("full")


def test_planner_counts_host_bytes_and_exposed_copies():
    import dataclasses

    from bumblebee.plan.hardware import GB, get_gpu
    from bumblebee.plan.layout import Layout, Workload
    from bumblebee.plan.recipe import evaluate, recipe_primitives
    from bumblebee.plan.spec import load_spec

    spec, _ = load_spec("qwen3.5-35b-a3b")
    lay, work = Layout(tp=1, pp=1, ep=8, cp=4, dp_shard=8), Workload(seq=131072, global_batch=32)
    full = recipe_primitives()
    off = dataclasses.replace(full, recompute="offload")
    h100 = get_gpu("h100")
    a, b = evaluate(spec, lay, full, work, h100), evaluate(spec, lay, off, work, h100)
    one = 32768 * spec.hidden * 2  # one bf16 layer input of 32K local tokens
    assert b.memory.saved_inputs == 2 * one < a.memory.saved_inputs
    assert "GB of layer inputs in host memory" in b.memory.why["saved_inputs"]
    assert b.tokens_per_s == a.tokens_per_s  # 134 MB per copy at 50 GB/s hides under a layer
    slow = dataclasses.replace(h100, pcie_gbps=0.01)
    c = evaluate(spec, lay, off, work, slow)
    assert c.perf.parts_s["offload"] > 0 and c.tokens_per_s < b.tokens_per_s
    assert a.memory.total - b.memory.total > 20 * GB
