"""Export to Hugging Face: ``bumblebee convert --to hf CKPT_DIR OUT_DIR`` writes a
directory (sharded safetensors with an index above the shard size) that
``transformers`` loads with no missing keys and that gives the trained model's
logits; ``train.export_hf = true`` (even without periodic saves) writes the same tensors
at the end of training."""

import io
import json
import os

import torch
import transformers  # noqa: E402  (the [test] extra; conftest.py stops the run without it)

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.runtime.trainer import Trainer

BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.intermediate_size=48",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "model.arch.mlp_only_layers=[1]",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "train.seq_len=64",
    "train.global_batch=2",
    "data.min_records=2",
    "data.max_records=4",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "train.steps=2",
    "train.export_hf=true",
]  # export_hf alone saves a final checkpoint


def tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_convert_gives_a_transformers_model_with_the_same_logits(tmp_path, capsys):
    trainer = Trainer(
        load_config(None, BASE + [f"train.out_dir={tmp_path / 'run'}"]), stream=io.StringIO()
    )
    trainer.run()
    model = trainer.model.eval()

    out = tmp_path / "hf"
    code = main(
        ["convert", "--to", "hf", str(tmp_path / "run"), str(out), "--max-shard-bytes", "20000"]
    )
    assert code == 0, capsys.readouterr().err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with an index

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    assert isinstance(hf, transformers.Qwen3MoeForCausalLM)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (hf.eval()(input_ids=ids, use_cache=False).logits - model(ids)).abs().max().item()
    assert err <= 1e-5, f"logits differ by {err:.3e}"

    exported = tensors(tmp_path / "run" / "hf")  # written in-process at the end of training
    converted = tensors(out)
    assert exported.keys() == converted.keys()
    assert all(torch.equal(exported[k], converted[k]) for k in exported)
