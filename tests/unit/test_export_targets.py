"""Exports replace what bumblebee writes and nothing else, and never leave a wrong model behind:

- ``convert --overwrite`` replaces the earlier export's ``config.json`` and weight files; an
  adapter, a README or other files beside it stay;
- ``to_hf`` into a directory holding an earlier *sharded* export removes the old index and
  shards, so ``from_hf`` loads the new model (it used to load the old shards);
- exporting into the directory the model was loaded from (``to_hf(..., source=d)``,
  ``Engine.export_hf`` into ``model.hf_path``, ``convert`` of a run started from ``d``) is
  refused, and ``d`` is untouched.
"""

import os

import pytest
import torch

import bumblebee
from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.errors import CheckpointError

SMALL = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "primitives.attention=sdpa",
    "train.seq_len=32",
    "train.global_batch=1",
    "data.min_records=1",
    "data.max_records=2",
    "train.warmup_steps=0",
]


def model(seed):
    torch.manual_seed(seed)
    cfg = load_config(None, SMALL)
    m = bumblebee.build_model(bumblebee.models.resolve_arch(cfg.model), cfg.primitives)
    for p in m.parameters():
        p.data.normal_(0, 0.02)
    return m


def same(a, b) -> bool:
    return all(
        torch.equal(p, q) for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters())
    )


def files(d) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def test_to_hf_over_an_earlier_sharded_export_loads_the_new_model(tmp_path):
    old, new = model(0), model(1)
    bumblebee.to_hf(old, str(tmp_path), max_shard_bytes=20000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    (tmp_path / "README.md").write_text("mine")
    bumblebee.to_hf(new, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["README.md", "config.json", "model.safetensors"]
    assert same(bumblebee.from_hf(str(tmp_path)), new)


def test_to_hf_into_its_own_source_is_refused(tmp_path):
    bumblebee.to_hf(model(0), str(tmp_path))
    before = files(tmp_path)
    with pytest.raises(CheckpointError, match="the model was loaded from"):
        bumblebee.to_hf(model(1), str(tmp_path), source=str(tmp_path))
    assert files(tmp_path) == before


def test_engine_export_into_its_hf_path_is_refused(tmp_path):
    src = tmp_path / "src"
    bumblebee.to_hf(model(0), str(src))
    before = files(src)
    engine = bumblebee.Engine(
        load_config(None, SMALL + [f"train.out_dir={tmp_path / 'out'}"]), hf_path=str(src)
    )
    with pytest.raises(CheckpointError, match="the model was loaded from"):
        engine.export_hf(str(src))
    assert files(src) == before


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 1-step run started from a HF directory, with a checkpoint."""
    root = tmp_path_factory.mktemp("conv")
    bumblebee.to_hf(model(0), str(root / "src"))
    argv = ["train"] + [
        a
        for s in SMALL
        + [
            "train.steps=1",
            "train.save_every=1",
            f"model.hf_path={root / 'src'}",
            f"train.out_dir={root / 'run'}",
        ]
        for a in ("--set", s)
    ]
    assert main(argv) == 0
    return root


def test_convert_overwrite_keeps_files_it_did_not_write(run, tmp_path):
    d = tmp_path / "hf"
    assert (
        main(["convert", "--to", "hf", str(run / "run"), str(d), "--max-shard-bytes", "20000"]) == 0
    )
    (d / "adapter_model.safetensors").write_bytes(b"an adapter")
    (d / "adapter_config.json").write_text("{}")
    assert main(["convert", "--to", "hf", str(run / "run"), str(d), "--overwrite"]) == 0
    assert (d / "adapter_model.safetensors").read_bytes() == b"an adapter"
    assert (d / "adapter_config.json").read_text() == "{}"
    assert not (d / "model.safetensors.index.json").exists() and (d / "model.safetensors").exists()


def test_convert_overwrite_into_the_runs_source_model_is_refused(run, capsys):
    before = files(run / "src")
    assert main(["convert", "--to", "hf", str(run / "run"), str(run / "src"), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the model was loaded from" in err
    assert files(run / "src") == before
