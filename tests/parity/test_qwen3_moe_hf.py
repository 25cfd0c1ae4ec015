"""Parity of bumblebee's Qwen3-MoE with Hugging Face ``transformers`` (the correctness anchor).

Tiny random ``transformers.Qwen3MoeForCausalLM`` models are saved with
``save_pretrained`` and loaded with ``bumblebee.from_hf``. In fp32 the logits
must match to 1e-4 max-abs, and after one backward of the same scalar loss
(computed identically from both logits) every parameter's gradient must match
to 1e-4 relative. Configurations cover heads / KV heads / head_dim / experts /
top-k / norm_topk_prob / tied embeddings / dense layers; every configuration
runs through each of bumblebee's attention and expert implementations.

Also: packed rows (documents separated by restarting position_ids) against the
same documents run one by one, the ``labels`` loss path against HF's own loss,
and a bf16 smoke test.

HF keeps experts fused in memory as ``mlp.experts.gate_up_proj`` [E, 2F, H] and
``mlp.experts.down_proj`` [E, H, F]; bumblebee stacks them as
``mlp.experts.w_gate_up`` / ``w_down`` with the same layout, so gradients compare
tensor for tensor once the names are mapped.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: E402  (the [test] extra; conftest.py stops the run without it)

import bumblebee  # noqa: E402
import bumblebee.primitives  # noqa: E402,F401  (registers every implementation; the package root is lazy)
from bumblebee import registry  # noqa: E402
from bumblebee.config import PrimitivesConfig  # noqa: E402

VOCAB = 101
LOGITS_ATOL = 1e-4
GRAD_RTOL = 1e-4

# name -> Qwen3MoeConfig overrides on top of BASE. Hidden sizes differ from heads * head_dim on
# purpose (Qwen3 allows it) so that a wrong reshape cannot pass.
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    max_position_embeddings=64,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
CONFIGS = {
    "gqa2-e4k2": {},
    "mqa-e6k3-norm": dict(
        num_key_value_heads=1,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=True,
    ),
    "mha-e3k1-tied": dict(
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=12,
        num_experts=3,
        num_experts_per_tok=1,
        tie_word_embeddings=True,
    ),
    "dense-mlp-only-layer": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    "dense-sparse-step": dict(
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=4,
        decoder_sparse_step=2,
        num_experts=5,
        num_experts_per_tok=2,
    ),
    "topk-all-experts": dict(
        num_experts=3, num_experts_per_tok=3, norm_topk_prob=True, rope_theta=1e6
    ),
}
IMPLS = [(attn, experts) for attn in ("sdpa", "varlen") for experts in ("loop", "grouped")]


def hf_name_to_bumblebee(name: str) -> str:
    return name.replace("mlp.experts.gate_up_proj", "mlp.experts.w_gate_up").replace(
        "mlp.experts.down_proj", "mlp.experts.w_down"
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Lazily built HF models, one per config name, each saved with ``save_pretrained``."""
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(sum(map(ord, name)))
            cfg = transformers.Qwen3MoeConfig(**{**BASE, **CONFIGS[name]})
            model = transformers.Qwen3MoeForCausalLM(cfg).eval()
            with torch.no_grad():  # norm weights are ones after init; make them informative
                for pname, p in model.named_parameters():
                    if pname.endswith("norm.weight"):
                        p.add_(0.2 * torch.randn_like(p))
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (model, str(path))
        model, path = cache[name]
        model.zero_grad(set_to_none=True)
        return model, path

    return get


def load(path, attention="sdpa", experts="loop", dtype=torch.float32):
    model = bumblebee.from_hf(
        path, dtype=dtype, prims=PrimitivesConfig(attention=attention, experts=experts)
    )
    return model.eval()


def target_logprob_sum(logits_BTV, targets_BT):
    """The shared test loss: sum of log-softmax at the target ids (fp32)."""
    logp = torch.log_softmax(logits_BTV.float(), dim=-1)
    return logp.gather(-1, targets_BT[..., None]).sum()


def hf_logits(model, input_ids, position_ids=None):
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def assert_grads_match(hf_model, bb_model, rtol=GRAD_RTOL):
    hf_grads = {hf_name_to_bumblebee(n): p.grad for n, p in hf_model.named_parameters()}
    bb_grads = {n: p.grad for n, p in bb_model.named_parameters()}
    assert sorted(hf_grads) == sorted(bb_grads), "parameter sets differ after name mapping"
    for name, ref in hf_grads.items():
        got = bb_grads[name]
        assert ref is not None and got is not None, f"{name}: missing gradient"
        assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
        err = (got.float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item()
        assert err <= rtol * scale, (
            f"{name}: max grad error {err:.3e} > {rtol} x max |grad| {scale:.3e}"
        )


def random_batch(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(
        0, VOCAB, (B, T), generator=g
    )


@pytest.mark.parametrize("attention,experts", IMPLS, ids=[f"{a}-{e}" for a, e in IMPLS])
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_logits_and_grads_match_hf(checkpoints, config_name, attention, experts):
    hf_model, path = checkpoints(config_name)
    bb_model = load(path, attention, experts)
    input_ids, targets = random_batch(2, 19, seed=len(config_name))

    hf_out, bb_out = hf_logits(hf_model, input_ids), bb_model(input_ids)
    assert bb_out.shape == hf_out.shape == (2, 19, VOCAB)
    err = (bb_out - hf_out).abs().max().item()
    assert err <= LOGITS_ATOL, f"logits max-abs error {err:.3e}"

    target_logprob_sum(hf_out, targets).backward()
    target_logprob_sum(bb_out, targets).backward()
    assert_grads_match(hf_model, bb_model)


def packed_rows(doc_lengths_per_row, seed):
    """Input ids, restarting position_ids, and the per-row document lengths."""
    g = torch.Generator().manual_seed(seed)
    T = sum(doc_lengths_per_row[0])
    assert all(sum(row) == T for row in doc_lengths_per_row)
    input_ids = torch.randint(0, VOCAB, (len(doc_lengths_per_row), T), generator=g)
    targets = torch.randint(0, VOCAB, (len(doc_lengths_per_row), T), generator=g)
    position_ids = torch.stack(
        [torch.cat([torch.arange(n) for n in row]) for row in doc_lengths_per_row]
    )
    return input_ids, targets, position_ids


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_packed_documents_equal_separate_runs(checkpoints, attention):
    """Row 0 packs two documents, row 1 three; each must equal its document run alone,
    in bumblebee and in HF, for logits and for the gradients of a summed loss."""
    hf_model, path = checkpoints("mqa-e6k3-norm")
    rows = [[9, 14], [5, 10, 8]]
    input_ids, targets, position_ids = packed_rows(rows, seed=7)

    packed = load(path, attention, "grouped")
    packed_logits = packed(input_ids, position_ids=position_ids)
    target_logprob_sum(packed_logits, targets).backward()

    separate = load(path, attention, "grouped")
    loss = 0.0
    for b, row in enumerate(rows):
        start = 0
        for n in row:
            doc, doc_targets = (
                input_ids[b : b + 1, start : start + n],
                targets[b : b + 1, start : start + n],
            )
            bb_doc = separate(doc)
            hf_doc = hf_logits(hf_model, doc)
            for name, ref in (("bumblebee", bb_doc), ("transformers", hf_doc)):
                err = (packed_logits[b : b + 1, start : start + n] - ref).abs().max().item()
                assert err <= LOGITS_ATOL, (
                    f"row {b} doc at {start}: packed vs {name} separate, error {err:.3e}"
                )
            loss = loss + target_logprob_sum(bb_doc, doc_targets)
            target_logprob_sum(hf_doc, doc_targets).backward()
            start += n
    loss.backward()
    assert_grads_match(hf_model, packed)  # packed bumblebee vs separate HF documents
    for (name, p), q in zip(packed.named_parameters(), separate.parameters()):
        err = (p.grad - q.grad).abs().max().item()
        assert err <= GRAD_RTOL * q.grad.abs().max().item(), (
            f"{name}: packed vs separate grads differ by {err:.3e}"
        )

    # HF reads packing from position_ids too: same packed logits.
    err = (packed_logits - hf_logits(hf_model, input_ids, position_ids)).abs().max().item()
    assert err <= LOGITS_ATOL, f"packed logits vs HF packed: {err:.3e}"


@pytest.mark.parametrize("loss_impl", sorted(registry.implementations("loss")))
def test_labels_loss_matches_hf_loss(checkpoints, loss_impl):
    """``model(ids, labels=shifted)`` (mean CE through the loss primitive) equals HF's
    ``labels`` loss, which shifts internally; ignored positions (-100) included."""
    hf_model, path = checkpoints("mha-e3k1-tied")
    bb_model = bumblebee.from_hf(path, prims=PrimitivesConfig(loss=loss_impl))
    input_ids, _ = random_batch(2, 17, seed=3)
    hf_labels = input_ids.clone()
    hf_labels[0, 4:9] = -100
    hf_labels[1, -3:] = -100
    bb_labels = torch.cat([hf_labels[:, 1:], torch.full((2, 1), -100)], dim=1)

    hf_loss = hf_model(input_ids=input_ids, labels=hf_labels, use_cache=False).loss
    bb_loss = bb_model(input_ids, labels=bb_labels)
    assert abs(bb_loss.item() - hf_loss.item()) <= 1e-5, (bb_loss.item(), hf_loss.item())
    hf_loss.backward()
    bb_loss.backward()
    assert_grads_match(hf_model, bb_model)


def test_bf16_smoke(checkpoints):
    """bf16 runs forward and backward with finite results, and its error against the
    fp32 ground truth stays within a small factor of HF's own bf16 error."""
    hf_model, path = checkpoints("gqa2-e4k2")
    input_ids, targets = random_batch(2, 19, seed=11)
    with torch.no_grad():
        truth = hf_logits(hf_model, input_ids)
        hf_bf16 = transformers.Qwen3MoeForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16
        ).eval()
        hf_err = (hf_logits(hf_bf16, input_ids).float() - truth).abs().max().item()

    for attention, experts in IMPLS:
        model = load(path, attention, experts, dtype=torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        logits = model(input_ids)
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
        target_logprob_sum(logits, targets).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), (
                f"{name}: non-finite bf16 gradient"
            )
        err = (logits.float() - truth).abs().max().item()
        assert err <= 2 * hf_err + 1e-2, (
            f"{attention}/{experts}: bf16 error {err:.3e} vs HF bf16 {hf_err:.3e}"
        )
        loss = model(input_ids, labels=targets)
        assert loss.dtype in (torch.float32, torch.bfloat16) and torch.isfinite(loss)
