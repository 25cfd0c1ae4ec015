"""A released-style multimodal Qwen3.5 checkpoint (``Qwen3_5MoeForConditionalGeneration``: the
language model under ``model.language_model.``, a vision tower ``model.visual.*``, plus MTP
tensors ``mtp.*``) starts ``bumblebee train`` and the RL Engine (the family's skip list applies on
every path), and both exports carry the vision tower and the MTP tensors over unchanged, with
the language model back under its prefix and the source's config: transformers loads the export
as the multimodal model with every weight accounted for. Carried tensors are bit-identical; with
lr = 1e-30 the trained language model is the source up to 1e-20.

Two MTP cases: a config that counts no MTP modules (its ``mtp.*`` tensors are skipped and carried),
and the released configs' ``mtp_num_hidden_layers = 1`` with the full ``mtp.*`` set (fc, the two
pre-fc norms, one decoder layer, norm): loaded as the model's MTP part, trained, written back.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import bumblebee  # noqa: E402
from bumblebee.cli import main  # noqa: E402

TEXT = dict(
    vocab_size=272,
    hidden_size=48,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
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
VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=48,
    num_position_embeddings=16,
    patch_size=4,
)
MTP = {"mtp.fc.weight": (48, 96), "mtp.norm.weight": (48,)}


def mtp_tensors(tmp_path_factory) -> dict:
    """The released names and shapes of one MTP layer for TEXT (a text model with it, exported)."""
    from bumblebee.models.qwen3_5_moe.arch import Qwen3_5MoeArch

    path = tmp_path_factory.mktemp("mtp")
    bumblebee.to_hf(
        bumblebee.build_model(Qwen3_5MoeArch(**TEXT, mtp_num_hidden_layers=1), seed=1), str(path)
    )
    return {k: v for k, v in read_dir(path).items() if k.startswith("mtp.")}


@pytest.fixture(scope="module", params=["mtp skipped", "mtp trained"])
def multimodal(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("mm")
    torch.manual_seed(0)
    released = request.param == "mtp trained"
    text = transformers.Qwen3_5MoeTextConfig(
        **TEXT, **({"mtp_num_hidden_layers": 1} if released else {})
    )
    cfg = transformers.Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=VISION)
    transformers.Qwen3_5MoeForConditionalGeneration(cfg).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in tensors)
    # as released checkpoints carry them
    tensors.update(
        mtp_tensors(tmp_path_factory) if released else {k: torch.randn(s) for k, s in MTP.items()}
    )
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "tokenizer_config.json").write_text("{}")  # a non-weight file the export keeps
    return path


def read_dir(path):
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def check_export(out, src):
    exported, source = read_dir(out), read_dir(src)
    assert exported.keys() == source.keys()
    trained = any(
        k.startswith("mtp.layers.") for k in source
    )  # the MTP part is the model's: written back
    carried = ("model.visual.",) if trained else ("model.visual.", "mtp.")
    for k, v in source.items():
        if k.startswith(carried):
            assert torch.equal(exported[k], v), k
        else:
            assert torch.allclose(exported[k], v, rtol=0, atol=1e-20), k
    assert (out / "tokenizer_config.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and "vision_config" in cfg
    model, info = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        out, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), (
        info
    )  # transformers has no MTP module


def test_train_starts_from_multimodal_and_exports_it_complete(multimodal, tmp_path, capfd):
    run = tmp_path / "run"
    argv = [
        "train",
        "--set",
        "model.name=qwen3_5_moe",
        "--set",
        f"model.hf_path={multimodal}",
        "--set",
        "train.steps=1",
        "--set",
        "train.lr=1e-30",
        "--set",
        "train.min_lr=0",
        "--set",
        "train.seq_len=64",
        "--set",
        "train.global_batch=1",
        "--set",
        "train.export_hf=true",
        "--set",
        f"train.out_dir={run}",
    ]
    assert main(argv) == 0
    assert "ignored" in capfd.readouterr().err
    check_export(run / "hf", multimodal)


def test_engine_starts_from_multimodal_and_exports_it_complete(multimodal, tmp_path):
    cfg = bumblebee.load_config(None, ["model.name=qwen3_5_moe", f"train.out_dir={tmp_path}/e"])
    engine = bumblebee.Engine(cfg, hf_path=str(multimodal))
    trained = any(k.startswith("mtp.layers.") for k in read_dir(multimodal))
    assert engine.model.mtp_modules() == int(trained)
    ref = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(multimodal).eval()
    ids = torch.randint(0, 272, (1, 24))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = engine.model(ids)
    assert (want - got).abs().max().item() < 1e-4
    engine.export_hf(str(tmp_path / "export"))
    check_export(tmp_path / "export", multimodal)
