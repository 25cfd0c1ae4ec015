"""Checkpoints of the Qwen3.5 hybrid (Gated DeltaNet + gated attention + shared expert).

The Qwen3-MoE checkpoint tests never touch the GDN-only tensors (``A_log``, ``dt_bias``,
the depthwise ``conv1d`` weight, ``in_proj_ba``...) nor the shared expert and its gate.
Here, on a tiny hybrid (3 GDN layers + 1 full-attention layer):

- HF -> bumblebee -> HF: a ``transformers`` model's files, loaded and written back,
  give the same tensor names, shapes and bits;
- training moves ``A_log``, ``dt_bias`` and the conv weight; a resumed run repeats the
  uninterrupted run's losses and final parameters bit for bit;
- ``convert`` of the checkpoint loads in ``transformers`` with the trained model's logits,
  and ``train.export_hf`` wrote the trained tensors;
- the single-process checkpoint resumes on 2 ranks (fsdp2, ep=2) with the same losses.
"""

import io
import os

import torch
import transformers  # noqa: E402  (the [test] extra; conftest.py stops the run without it)
from dist_utils import run_distributed
from safetensors.torch import load_file

import bumblebee
from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.runtime.trainer import Trainer

STEPS = 4
BASE = [
    "model.name=qwen3_5_moe",
    "model.preset=tiny",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.linear_key_head_dim=8",
    "model.arch.linear_value_head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.shared_expert_intermediate_size=16",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "train.seq_len=64",
    "train.global_batch=2",
    "data.min_records=2",
    "data.max_records=4",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "train.deterministic=true",
    f"train.steps={STEPS}",
    "train.save_every=2",
]
GDN_ONLY = ("A_log", "dt_bias", "conv1d.weight")


def cfg(out_dir, *extra):
    return load_config(None, BASE + [*extra, f"train.out_dir={out_dir}"])


def run(config):
    t = Trainer(config, stream=io.StringIO())
    start = t.step
    t.run()
    return start, [r["loss"] for r in t.metrics.history], t


def files(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_hf_to_bumblebee_to_hf_files_are_identical(tmp_path):
    torch.manual_seed(0)
    conf = transformers.Qwen3_5MoeTextConfig(
        vocab_size=97,
        hidden_size=48,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    hf = transformers.Qwen3_5MoeForCausalLM(conf)
    with torch.no_grad():
        for p in hf.parameters():  # off the init (A_log, dt_bias, norms are constants there)
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "a")
    bumblebee.to_hf(bumblebee.from_hf(str(tmp_path / "a")), str(tmp_path / "b"))
    a, b = files(tmp_path / "a"), files(tmp_path / "b")
    assert a.keys() == b.keys()
    for suffix in GDN_ONLY + ("shared_expert_gate.weight",):
        assert any(k.endswith(suffix) for k in a), suffix
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def _resume_on_two_ranks(rank, world, out_dir, ckpt):
    start, losses, _ = run(
        cfg(out_dir, "primitives.sharding=fsdp2", "parallel.ep=2", f"train.resume={ckpt}")
    )
    return start, losses


def test_train_save_resume_convert_export_reshard(tmp_path, capsys):
    start, full, trainer = run(cfg(tmp_path / "full", "train.export_hf=true"))
    assert start == 0 and len(full) == STEPS
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    init = {
        n: p.detach().clone()
        for n, p in Trainer(cfg(tmp_path / "init"), stream=io.StringIO()).model.named_parameters()
    }
    for suffix in GDN_ONLY:
        names = [n for n in final if n.endswith(suffix)]
        assert len(names) == 3, suffix  # one per GDN layer
        assert all(not torch.equal(final[n], init[n]) for n in names), suffix  # trained

    step2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    start, resumed, t2 = run(cfg(tmp_path / "resumed", f"train.resume={step2}"))
    assert start == 2 and resumed == full[2:]  # bit-identical
    for n, p in t2.model.named_parameters():
        assert torch.equal(p, final[n]), n

    out = tmp_path / "hf"
    assert main(["convert", "--to", "hf", str(tmp_path / "full"), str(out)]) == 0, (
        capsys.readouterr().err
    )
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (
            (hf.float().eval()(input_ids=ids, use_cache=False).logits - trainer.model.eval()(ids))
            .abs()
            .max()
        )
    assert err.item() <= 1e-5, err
    exported = files(tmp_path / "full" / "hf")
    for k, v in files(out).items():
        assert torch.equal(exported[k], v), k
    a_log = [k for k in exported if k.endswith("A_log")]
    assert len(a_log) == 3 and all(torch.equal(exported[k], final[k]) for k in a_log)

    ranks = run_distributed(_resume_on_two_ranks, 2, str(tmp_path / "two"), str(step2))
    start, two = ranks[0]
    assert start == 2 and len(two) == STEPS - 2
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(two, full[2:])), (two, full[2:])
