"""The engine surface an RL framework drives, on one process: token-budget micro-batches equal
one large micro-batch, forward_backward + optimizer_step equal train_step, forward-only scoring
with a loss, offload by part (measured, each part on its own), train/eval modes, save/load with
step and keep, and bucketed HF-named weight export (size bound, measured peak, names loaded
by ``transformers`` including a multimodal checkpoint's prefix)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import save_file

from bumblebee import load_config
from bumblebee.perf.memory import MemoryTracker
from bumblebee.rl import microbatch as mbs
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss, TokenNLL

SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=32",
    "primitives.attention=sdpa",
    "train.global_batch=4",
    "train.micro_batch=2",
    "model.arch.router_aux_loss_coef=0.0",
]
LOSS = PolicyLoss(kl_coef=0.05, entropy_coef=0.01, agg="seq-mean-token-mean")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def engine(tmp_path, *overrides, **kw):
    return Engine(load_config(None, SMALL + [f"train.out_dir={tmp_path}", *overrides]), **kw)


def rollouts(seed=0, n=11, seq_len=24):
    g = torch.Generator().manual_seed(seed)
    tokens = [
        torch.randint(0, 256, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    masks = [[i >= 2 for i in range(len(t))] for t in tokens]
    b = pack_sequences(tokens, masks, seq_len, advantages=torch.randn(n, generator=g).tolist())
    return b.replace(ref_logprobs=-torch.rand(b.input_ids.shape, generator=g) * 6)


def test_token_budget_packing_is_balanced_and_bounded():
    lengths = [11, 3, 7, 9, 2, 5, 8]
    assert mbs.ffd_bins(lengths, 16) == 3
    bins = mbs.token_bins(lengths, 16, 4)  # more bins than needed (another dp rank needs 4)
    assert sorted(i for b in bins for i in b) == list(range(7)) and len(bins) == 4
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= 16 and max(loads) - min(loads) <= 3  # LPT evens the load
    assert [sum(lengths[i] for i in r) for r in mbs.assign_to_ranks(lengths, 2)] == [23, 22]
    with pytest.raises(ValueError, match="does not fit max_tokens_per_micro_batch=8"):
        mbs.check_budget(lengths, 8)


def test_token_budget_micro_batches_equal_one_large_micro_batch(tmp_path):
    b = rollouts()
    one = engine(tmp_path / "one", "train.micro_batch=64")  # every row in one micro-batch
    budget = engine(tmp_path / "budget", max_tokens_per_micro_batch=16)
    spans = mbs.spans(b.position_ids, b.seq_index)
    assert mbs.ffd_bins([n for _, n in spans], 16) >= 4  # really several micro-batches
    results = []
    for e in (one, budget):
        lp = e.compute_logprobs(b, entropy=True)
        m = e.train_step(b.replace(old_logprobs=lp.logprobs), LOSS, lr=1e-2)
        results.append((lp, m, e.compute_logprobs(b).logprobs))
    (lp1, m1, after1), (lp2, m2, after2) = results
    real = b.seq_index >= 0  # the budget path skips row padding
    assert torch.allclose(lp1.logprobs[real], lp2.logprobs[real], atol=1e-5)
    assert torch.allclose(lp1.entropy[real], lp2.entropy[real], atol=1e-5)
    for k in ("loss", "grad_norm", "kl", "entropy", "clip_frac", "tokens"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    assert torch.allclose(after1[real], after2[real], atol=1e-5)  # the same update
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=4"):
        budget.forward_backward(b, LOSS, max_tokens_per_micro_batch=4)


def test_forward_backward_and_optimizer_step_equal_train_step(tmp_path):
    b = rollouts()
    a, c = engine(tmp_path / "a"), engine(tmp_path / "c")
    b = b.replace(old_logprobs=a.compute_logprobs(b).logprobs)
    want = a.train_step(b, LOSS, lr=1e-2)
    with c.train_mode():
        c.zero_grad()
        out = c.forward_backward(b, LOSS)
        opt = c.optimizer_step(lr=1e-2)
    assert (
        out.loss == want["loss"]
        and opt["grad_norm"] == want["grad_norm"]
        and out.tokens == want["tokens"]
    )
    assert (
        out.metrics == {k: want[k] for k in out.metrics} and c.weight_version == 1 and c.step == 1
    )
    # forward only, with the loss: the same figures as the next update's, and every log-prob
    with c.eval_mode():
        scored = c.forward_backward(b, LOSS, forward_only=True, entropy=True)
    assert all(p.grad is None for p in c.model.parameters())
    assert torch.equal(scored.logprobs, c.compute_logprobs(b).logprobs)
    assert scored.loss == pytest.approx(a.train_step(b, LOSS, lr=1e-2)["loss"], rel=1e-6)
    assert c.get_data_parallel_rank() == 0 and c.get_data_parallel_size() == 1
    assert c.get_data_parallel_group() is None


def test_routing_replay_records_and_replays(tmp_path):
    e = engine(tmp_path)
    b = rollouts()
    lp = e.compute_logprobs(b, return_routing=True)
    L, K = e.arch.num_hidden_layers, e.arch.num_experts_per_tok
    assert lp.routing.shape == (*b.input_ids.shape, L, K)
    same = e.compute_logprobs(
        b.replace(routing=lp.routing), return_routing=True
    )  # replaying what it chose
    assert torch.equal(same.logprobs, lp.logprobs) and torch.equal(same.routing, lp.routing)
    given = (lp.routing + 1) % e.arch.num_experts  # other experts: the log-probs follow them
    other = e.compute_logprobs(b.replace(routing=given), return_routing=True)
    assert torch.equal(other.routing, given) and (other.logprobs - lp.logprobs).abs().max() > 1e-3
    budget = engine(
        tmp_path / "b", max_tokens_per_micro_batch=16
    )  # repacked sequences keep their experts
    real = b.seq_index >= 0
    got = budget.compute_logprobs(b.replace(routing=given), return_routing=True)
    assert torch.equal(got.routing[real], given[real])
    assert torch.allclose(got.logprobs[real], other.logprobs[real], atol=1e-5)
    with pytest.raises(ValueError, match="RLBatch.routing has shape"):
        b.replace(routing=given[:, :, 0])


def test_offload_by_part_moves_only_that_part(tmp_path):
    e = engine(tmp_path)
    b = rollouts()
    e.train_step(b, TokenNLL(), lr=1e-3)  # optimizer state exists
    e.forward_backward(b, TokenNLL())  # gradients exist
    grads = {n: p.grad for n, p in e.model.named_parameters()}
    params = {n: p.data_ptr() for n, p in e.model.named_parameters()}
    # on a CPU machine "to the CPU" moves nothing, and says so
    assert e.offload(device="cpu")["moved_bytes"] == {"params": 0, "grads": 0, "optimizer": 0}
    e.onload()
    host = torch.device("cpu", 0)  # compares unequal to "cpu": .to copies (see engine_checks.py)
    report = e.offload(params=False, grads=True, optimizer=False, device=host)
    grad_bytes = sum(g.numel() * g.element_size() for g in grads.values())
    assert report["moved_bytes"] == {"grads": grad_bytes}
    assert all(p.grad is None for p in e.model.parameters())  # detached while away
    assert {n: p.data_ptr() for n, p in e.model.named_parameters()} == params  # parameters stayed
    with pytest.raises(RuntimeError, match="grads are offloaded"):
        e.optimizer_step()
    e.compute_logprobs(b)  # scoring needs only the parameters
    assert e.onload()["moved_bytes"] == {"grads": 0}  # back on "cpu" (equal to where they sit now)
    assert all(
        torch.equal(p.grad, grads[n]) and p.grad.data_ptr() != grads[n].data_ptr()
        for n, p in e.model.named_parameters()
    )
    # optimizer only; train_mode brings it back for the update and sends it away again
    report = e.offload(params=False, grads=False, optimizer=True, device=host)
    state = [
        v for s in e.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    ]
    assert report["moved_bytes"] == {"optimizer": sum(t.numel() * t.element_size() for t in state)}
    with pytest.raises(RuntimeError, match="optimizer are offloaded"):
        e.optimizer_step()
    with e.train_mode():
        e.optimizer_step()
    assert "optimizer" in e.offloader.away and e.offloaded


def test_save_load_step_and_keep(tmp_path):
    e = engine(tmp_path / "run")
    b = rollouts()
    for step in (3, 5, 7):
        e.train_step(b, TokenNLL(), lr=1e-3)
        e.save(str(tmp_path / "ckpt"), step=step, keep=2)
    assert sorted(os.listdir(tmp_path / "ckpt" / "checkpoints")) == [
        "step_00000005",
        "step_00000007",
    ]
    r = engine(tmp_path / "run2")
    assert r.load(str(tmp_path / "ckpt"), step=5) == 5 and r.weight_version == 1
    assert r.load(str(tmp_path / "ckpt")) == 7
    assert torch.equal(r.compute_logprobs(b).logprobs, e.compute_logprobs(b).logprobs)


def _hf_dir(buckets, config: dict, out: str) -> str:
    """A rollout side's view: the streamed tensors as a HF directory."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(
        {n: t.contiguous() for bucket in buckets for n, t in bucket},
        os.path.join(out, "model.safetensors"),
    )
    return out


def test_weight_buckets_bound_names_and_transformers_logits(tmp_path):
    e = engine(tmp_path)
    e.train_step(rollouts(), TokenNLL(), lr=1e-2)
    bucket_bytes = 24 << 10
    sizes, buckets, peak = [], [], 0
    with MemoryTracker(
        "cpu"
    ) as mem:  # counts what the iteration allocates (the model is not counted)
        for bucket in e.weight_buckets(bucket_bytes=bucket_bytes):
            sizes.append([t.numel() * t.element_size() for _, t in bucket])
            assert all(t.dtype == torch.bfloat16 for _, t in bucket)
            del bucket
        peak = mem.peak_bytes
    assert len(sizes) > 3 and all(sum(s) <= bucket_bytes or len(s) == 1 for s in sizes)
    assert 0 < peak <= 2 * bucket_bytes, peak  # measured: the bucket being filled + the consumer's
    buckets = list(e.weight_buckets(bucket_bytes=bucket_bytes, dtype=torch.float32))
    names = [n for bucket in buckets for n, _ in bucket]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and len(names) == len(set(names))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        _hf_dir(buckets, e.arch.to_hf_dict(), str(tmp_path / "hf"))
    ).eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert (hf(ids).logits - e.model(ids)).abs().max().item() < 1e-4
    whole = {
        n: t for n, t in e.named_weights(dtype=torch.float32)
    }  # stacked experts gathered whole
    pieces = [
        (n, t)
        for bucket in e.weight_buckets(bucket_bytes=4096, dtype=torch.float32)
        for n, t in bucket
    ]
    assert len(pieces) == len(whole) and all(
        torch.equal(t, whole[n]) for n, t in pieces
    )  # in pieces of experts
    with pytest.raises(ValueError, match="names must be"):
        next(e.weight_buckets(names="vllm"))


def test_weight_stream_carries_router_bias_buffers(tmp_path):
    """The sigmoid_bias router's ``e_score_correction_bias`` (a buffer, not a parameter) is model state:
    it travels in the buckets and the HF export, and a sampler loads it."""
    import bumblebee
    from bumblebee.rl.sampler import Sampler

    e = engine(tmp_path, "primitives.router=sigmoid_bias")
    for m in e.model.routers():
        m.e_score_correction_bias.uniform_(
            -0.5, 0.5
        )  # not its zero init: a missing copy would show
    names = {n for bucket in e.weight_buckets() for n, _ in bucket}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    e.export_hf(str(tmp_path / "hf"))
    b = rollouts()
    back = Engine(e.cfg, hf_path=str(tmp_path / "hf"))
    assert torch.equal(back.compute_logprobs(b).logprobs, e.compute_logprobs(b).logprobs)
    sampler = Sampler(bumblebee.build_model(e.arch, e.cfg.primitives))
    sampler.load_weights(
        t for bucket in e.weight_buckets(dtype=None, names="bumblebee") for t in bucket
    )
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            sampler.model.routers()[0].e_score_correction_bias,
            e.model.routers()[0].e_score_correction_bias,
        )
    )


def _multimodal_checkpoint(out: str) -> str:
    """A tiny ``Qwen3_5MoeForConditionalGeneration`` (language model under ``model.language_model.``)."""
    torch.manual_seed(2)
    lin, full = "linear_attention", "full_attention"
    text = dict(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        num_hidden_layers=2,
        layer_types=[lin, full],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        num_position_embeddings=16,
        patch_size=4,
    )
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    transformers.Qwen3_5MoeForConditionalGeneration(cfg).save_pretrained(out)
    return out


def test_weight_buckets_keep_a_multimodal_checkpoints_names(tmp_path):
    from bumblebee.rl.weights import checkpoint_names

    src = _multimodal_checkpoint(str(tmp_path / "src"))
    e = Engine(
        load_config(None, ["model.name=qwen3_5_moe", f"train.out_dir={tmp_path}"]), hf_path=src
    )
    buckets = list(e.weight_buckets(bucket_bytes=16 << 10, dtype=torch.float32))
    names = [n for bucket in buckets for n, _ in bucket]
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert set(names) == {
        n for n in checkpoint_names(src) if not n.startswith(("model.visual.", "mtp."))
    }
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    hf = (
        transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
            _hf_dir(buckets, config, str(tmp_path / "hf"))
        )
        .float()
        .eval()
    )
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - e.model(ids)).abs().max().item() < 1e-4
