"""LoRA (models/lora.py) on one process, against ``transformers`` + ``peft`` (the [test] extra).

For Qwen3-MoE (attention + routed experts) and Qwen3.5-MoE (Gated DeltaNet and gated attention
projections, routed and shared experts), from a tiny random ``transformers`` checkpoint:

- only the adapters train: a few SFT steps lower the loss, the base stays bit-identical, and the
  optimizer holds state for the adapters only;
- ``export_peft`` writes a directory ``peft.PeftModel.from_pretrained`` loads onto the
  ``transformers`` model with the Engine's logits (routed experts through PEFT's
  ``target_parameters``), which moved away from the base model's;
- the merged weight buckets (transformers names) equal PEFT's ``merge_and_unload`` tensors, and the
  HF-named buckets streamed in pieces of experts equal the whole merged tensors, in bf16;
- a bf16 base: static bytes (parameters, gradients, optimizer state) measured on the live tensors
  after a step are >= 3x lower than full fine-tuning of the same model;
- a target the model does not have is refused with the valid names, bad settings in one line;
- ``bumblebee rl --lora R``: the sampler, fed merged weights, scores its tokens as the Engine.
"""

from __future__ import annotations

import io
import json

import peft
import pytest
import torch
import transformers

from bumblebee import load_config
from bumblebee.config import ConfigError
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import TokenNLL

VOCAB = 256  # the config check asks for a byte-level vocabulary (synthetic data source)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, intermediate_size=48)
    ),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeForCausalLM(
        transformers.Qwen3_5MoeTextConfig(
            **COMMON,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            shared_expert_intermediate_size=24,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
        )
    ),
}
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "primitives.attention=sdpa"]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hf_checkpoint(tmp_path, family: str) -> str:
    torch.manual_seed(0)
    path = str(tmp_path / f"hf_{family}")
    FAMILIES[family]().save_pretrained(path)
    return path


def sft_batch(seed=0, n=4, seq_len=24):
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, VOCAB, (20,), generator=g).tolist() for _ in range(n)]
    return pack_sequences(tokens, [[i >= 2 for i in range(20)] for _ in tokens], seq_len)


def engine(tmp_path, hf_path, *overrides):
    cfg = load_config(
        None,
        [
            f"model.name={'qwen3_5_moe' if 'qwen3_5' in hf_path else 'qwen3_moe'}",
            f"model.hf_path={hf_path}",
            "train.global_batch=4",
            "train.micro_batch=2",
            f"train.out_dir={tmp_path / 'run'}",
            *LORA,
            *overrides,
        ],
    )
    return Engine(cfg)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapters_train_and_load_into_peft_with_equal_logits(tmp_path, family):
    hf_path = hf_checkpoint(tmp_path, family)
    e = engine(tmp_path, hf_path)
    trainable = {n for n, p in e.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert any("experts.lora_A_gate_up" in n for n in trainable)
    if family == "qwen3_5_moe":  # GDN projections and the shared expert are adapted too
        assert any("linear_attn.in_proj_qkv.lora_A" in n for n in trainable)
        assert any("shared_expert.down_proj.lora_B" in n for n in trainable)
    base = {n: p.detach().clone() for n, p in e.model.named_parameters() if not p.requires_grad}
    b = sft_batch()
    losses = [e.train_step(b, TokenNLL(), lr=2e-2)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(torch.equal(p, base[n]) for n, p in e.model.named_parameters() if n in base)
    state = e.optimizer.state  # AdamW moments for the adapters only (the base has no state)
    assert len(state) == len(trainable)
    updated = [p for g in e.optimizer.param_groups for p in g["params"]]
    assert len(updated) == len(trainable) and all(p.requires_grad for p in updated)

    out = str(tmp_path / "adapter")
    e.export_peft(out)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_path).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = ref(ids).logits
        tuned = peft.PeftModel.from_pretrained(ref, out).eval()
        peft_logits = tuned(ids).logits
        ours = e.model(ids)
    assert (ours - base_logits).abs().max().item() > 1e-2  # the adapters moved the model
    assert (peft_logits - ours).abs().max().item() < 1e-4

    # merged weights for a rollout engine: transformers names, equal to PEFT's merged model
    merged = tuned.merge_and_unload().state_dict()
    buckets = [
        (n, t) for bk in e.weight_buckets(names="transformers", dtype=torch.float32) for n, t in bk
    ]
    assert {n for n, _ in buckets} == set(merged)
    worst = max((t - merged[n]).abs().max().item() for n, t in buckets)
    assert worst < 1e-6, worst
    # HF names in bf16: stacked experts streamed in pieces merge like whole tensors
    whole = dict(e.named_weights(dtype=torch.bfloat16))
    pieces = [(n, t) for bk in e.weight_buckets(bucket_bytes=2048) for n, t in bk]
    assert len(pieces) == len(whole) and all(torch.equal(t, whole[n]) for n, t in pieces)
    up = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert torch.equal(
        whole[up], merged["model.layers.1.mlp.experts.gate_up_proj"][3, 16:].bfloat16()
    )


def test_bf16_base_static_bytes_at_least_3x_lower(tmp_path):
    """Static bytes per rank (live parameters, gradients, optimizer state after one step, the
    sharding primitive's count) with LoRA vs full fine-tuning of the same model and layout."""
    small = [
        "model.arch.num_hidden_layers=2",
        "model.arch.hidden_size=64",
        "model.arch.num_experts=8",
        "model.arch.moe_intermediate_size=64",
        "model.arch.vocab_size=256",
        "train.dtype=bfloat16",
        "train.global_batch=4",
        "train.micro_batch=2",
        "primitives.attention=sdpa",
        f"train.out_dir={tmp_path}",
    ]
    totals = {}
    for name, extra in (("full", []), ("lora", ["model.lora.rank=4"])):
        e = Engine(load_config(None, small + extra))
        b = pack_sequences([list(range(3, 20))] * 4, [[True] * 17] * 4, 24)
        e.train_step(b, TokenNLL(), lr=1e-3)  # the optimizer state exists from the first step
        e.forward_backward(b, TokenNLL())  # and the gradients during every step
        totals[name] = e.sharding.state_bytes(e.optimizer)
    assert totals["full"]["grads"] == totals["full"]["params"] and totals["lora"]["grads"] > 0
    full, lora = (sum(totals[k].values()) for k in ("full", "lora"))
    assert full >= 3 * lora, totals
    frozen = [p for p in e.model.parameters() if not p.requires_grad and p.dim() >= 2]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)


def test_bad_lora_settings_are_refused(tmp_path):
    cfg = load_config(
        None, [f"train.out_dir={tmp_path}", "model.lora.rank=2", "model.lora.targets=['qproj']"]
    )
    with pytest.raises(ConfigError, match="qproj not in this model; valid: .*q_proj"):
        Engine(cfg)
    for bad, says in (
        (["model.lora.rnk=2"], "unknown key 'rnk' .did you mean 'rank'"),
        (["model.lora.rank=-1"], "model.lora.rank must be >= 0"),
        (["model.lora.rank=2", "model.lora.base_dtype=bfloat16"], "needs train.dtype = 'bfloat16'"),
    ):
        with pytest.raises(ConfigError, match=says):
            load_config(None, [f"train.out_dir={tmp_path}", *bad])


def test_rl_demo_lora_sampler_gets_the_merged_policy(tmp_path):
    """``bumblebee rl --lora 4``: GRPO trains adapters on the warmed-up base, and the sampler, which
    gets the merged weights after every update, scores its tokens as the Engine does."""
    from bumblebee.cli import build_parser
    from bumblebee.rl.cli import configs_from_args
    from bumblebee.rl.run import run

    args = build_parser().parse_args(
        ["rl", "--lora", "4", "--set", "model.lora.rank=2", "--set", f"train.out_dir={tmp_path}"]
        + [
            x
            for k in ("steps=3", "warmup_steps=2", "eval_problems=0")
            for x in ("--set", f"rl.{k}")
        ]
    )
    cfg, rl = configs_from_args(args)
    assert cfg.model.lora.rank == 4  # --lora wins over --set
    run(cfg, rl, stream=io.StringIO())
    with open(tmp_path / "metrics.jsonl") as f:
        grpo = [r for r in map(json.loads, f) if r.get("phase") == "grpo"]
    assert len(grpo) == 3 and all(r["grad_norm"] > 0 for r in grpo)
    # steps 2 and 3 sample from adapters that moved (B != 0): an unmerged push would show here
    assert max(r["rollout_logprob_err"] for r in grpo) < 1e-4, grpo


def test_train_saves_adapters_and_exports_merged_weights(tmp_path, capsys):
    """``bumblebee train`` with ``model.lora``: checkpoints hold the base and the adapters (their
    optimizer state only), and the HF export at the end (and ``to_hf``) is the merged model."""
    import bumblebee
    from bumblebee.cli import main
    from bumblebee.runtime.checkpoint.checkpointer import load_model

    sets = ["train.steps=2", "train.seq_len=64", "model.lora.rank=4", "model.lora.alpha=32"]
    sets += ["model.arch.num_hidden_layers=2", "train.export_hf=true", "train.eval_every=0"]
    sets += ["train.lr=0.05", f"train.out_dir={tmp_path}"]
    assert main(["train"] + [x for s in sets for x in ("--set", s)]) == 0
    from bumblebee.runtime.checkpoint.directory import read_marker
    from bumblebee.runtime.checkpoint.state import read_dcp_metadata

    ckpt = str(tmp_path / "checkpoints" / "step_00000002")
    keys = list(read_dcp_metadata(ckpt, read_marker(ckpt)).state_dict_metadata)
    optim = {k.split("/")[1] for k in keys if k.startswith("optim/")}
    assert optim and all(".lora_" in n for n in optim)  # the frozen base has no optimizer state
    trained = load_model(ckpt).eval()
    names = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n for n in names)
    assert any(p.abs().max() > 0 for n, p in trained.named_parameters() if ".lora_B" in n)
    bumblebee.to_hf(trained, str(tmp_path / "to_hf"))  # the public writer merges too
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    for where in ("hf", "to_hf"):
        exported = bumblebee.from_hf(str(tmp_path / where)).eval()
        with torch.no_grad():
            assert (trained(ids) - exported(ids)).abs().max().item() < 1e-5, where


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_expert_adapters_match_the_loop_reference(dtype):
    """The grouped path's adapter GEMMs (rank 3: zero-padded to a 16-byte row) against the
    per-expert loop, outputs and factor gradients, with an expert that gets no token."""
    from bumblebee.primitives.moe.experts import Experts, experts_grouped, experts_loop

    g = torch.Generator().manual_seed(0)
    E, H, F, R = 4, 16, 8, 3
    ex = Experts(E, H, F)
    ex.add_lora(R, scale=2.0)
    for p in ex.parameters():
        p.data = torch.randn(p.shape, generator=g, dtype=dtype) * 0.3
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, H, generator=g, dtype=dtype)
    outs, grads = [], []
    for fn in (experts_loop, experts_grouped):
        ex.zero_grad()
        y = ex(x, counts, fn)
        y.float().square().sum().backward()
        outs.append(y.float())
        grads.append([p.grad.float() for n, p in ex.named_parameters() if "lora" in n])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, **tol)
    assert grads[0][0][1].abs().max() == 0  # the expert without tokens gets no gradient
