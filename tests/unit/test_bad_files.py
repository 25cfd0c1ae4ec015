"""Files that are not what they claim end in one line ``bumblebee: error: ...`` (exit 2):
JSONL that is compressed, not UTF-8 or has nothing to train on; a ``config.json`` that is
not an object or lacks required keys; a safetensors index without ``weight_map``; a
truncated safetensors file; integer weights; a checkpoint marker with wrong types. And
``metrics.jsonl`` is strict JSON, with a torn last line no obstacle to a resume."""

import bz2
import gzip
import json
import math
import os
import shutil

import pytest
import torch
from cli_helpers import one_line_error as _one_line_error
from cli_helpers import sets
from safetensors.torch import load_file, save_file

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.models import build_model, resolve_arch
from bumblebee.models.hf import from_hf, to_hf
from bumblebee.runtime.metrics import json_line
from bumblebee.runtime.metrics import strict as strict_json


def one_line_error(capsys, argv, fragment) -> str:
    return _one_line_error(
        capsys, argv, fragment, notices_before=True
    )  # preflight may print notices first


TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "train.seq_len=32",
    "train.global_batch=1",
    "data.min_records=1",
    "data.max_records=2",
    "train.steps=1",
]


def train_argv(tmp_path, *items):
    return ["train"] + sets(TINY + [f"train.out_dir={tmp_path / 'run'}", *items])


JSONL = [  # (file bytes, fragment)
    (gzip.compress(b'{"input_ids": [1, 2, 3]}\n'), "a gzip-compressed file"),
    (bz2.compress(b'{"input_ids": [1, 2, 3]}\n'), "a bzip2-compressed file"),
    (b'{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2], "x": "\xff\xfe"}\n', ":2: not UTF-8 text"),
    ('{"input_ids": [1, 2, 3]}\n'.encode("utf-16"), ":1: not UTF-8 text"),
    (b'{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}\n', "nothing to train on"),
    (b'{"input_ids": [1]}\n{"input_ids": [2]}\n', "nothing to train on"),
    (b"[" * 100000 + b"\n", ":1: not valid JSON"),
    (b'{"input_ids": [1, 2.5]}\n', ":1: 'input_ids' must be a non-empty list of integers"),
    (b'{"input_ids": [1, 2], "loss_mask": [1, 2]}\n', ":1: 'loss_mask' must be a list of 0/1"),
]


@pytest.mark.parametrize("data, fragment", JSONL, ids=[f for _, f in JSONL])
def test_jsonl_files_that_are_not_jsonl(capsys, tmp_path, data, fragment):
    f = tmp_path / "d.jsonl"
    f.write_bytes(data)
    one_line_error(capsys, train_argv(tmp_path, "data.source=jsonl", f"data.path={f}"), fragment)


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_bad_jsonl_line_with_nproc_is_found_before_launch(capsys, tmp_path, nproc):
    f = tmp_path / "d.jsonl"
    f.write_text('{"input_ids": [1, 2, 3]}\nnot json\n')
    one_line_error(
        capsys,
        ["train", "--nproc", nproc]
        + train_argv(tmp_path, "data.source=jsonl", f"data.path={f}", "train.global_batch=2")[1:],
        f"{f}:2: not valid JSON",
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    to_hf(build_model(resolve_arch(load_config(None, TINY).model)), str(d))
    return d


def edited_copy(hf_dir, tmp_path, edit):
    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    edit(d)
    return d


def set_config(value):
    return lambda d: (d / "config.json").write_text(
        value if isinstance(value, str) else json.dumps(value)
    )


def drop_key(key):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        del cfg[key]
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def retype(key, value):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


CONFIGS = [
    (set_config([]), "expected a JSON object, got list"),
    (set_config("7"), "expected a JSON object, got int"),
    (set_config("{"), "not a JSON text"),
    (lambda d: (d / "config.json").write_bytes(b'{"model_type": "\xff"}'), "not a JSON text"),
    (drop_key("hidden_size"), "missing hidden_size"),
    (drop_key("num_key_value_heads"), "missing num_key_value_heads"),
    (drop_key("num_experts"), "missing num_experts"),
    (retype("hidden_size", "32"), "hidden_size must be an integer, got '32'"),
    (retype("tie_word_embeddings", "false"), "tie_word_embeddings must be true or false"),
    # the probe's 10^12 layers: refused from its number, before anything is built (it hung)
    (retype("num_hidden_layers", 10**12), "num_hidden_layers = 1000000000000 is beyond any model"),
]


@pytest.mark.parametrize("edit, fragment", CONFIGS, ids=[f for _, f in CONFIGS])
def test_config_json_that_is_not_a_model_config(capsys, hf_dir, tmp_path, edit, fragment):
    d = edited_copy(hf_dir, tmp_path, edit)
    one_line_error(capsys, train_argv(tmp_path, f"model.hf_path={d}"), fragment)
    with pytest.raises(ValueError, match=fragment.split(",")[0].replace("(", r"\(")):
        from_hf(str(d))


def shard_with_index(index):
    def edit(d):
        (d / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def truncate(d):
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(d / "model.safetensors") // 2)


def garbage_header(d):
    (d / "model.safetensors").write_bytes(b"\xff" * 64)


def non_finite_weight(value):
    def edit(d):
        tensors = load_file(d / "model.safetensors")
        tensors["model.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors["model.norm.weight"][0] = value
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})

    return edit


def stored_twice(d):
    """A second shard holding a tensor the first one holds, both named by the index."""
    tensors = load_file(d / "model.safetensors")
    name = "model.norm.weight"
    save_file({name: tensors[name]}, d / "extra.safetensors", metadata={"format": "pt"})
    weight_map = {n: "model.safetensors" for n in tensors} | {name: "extra.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def integer_weight(d):
    tensors = load_file(d / "model.safetensors")
    name = "model.norm.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, d / "model.safetensors")


WEIGHTS = [
    (shard_with_index({"metadata": {}}), "needs a 'weight_map' object"),
    (shard_with_index({"weight_map": ["a"]}), "needs a 'weight_map' object"),
    (shard_with_index([1, 2]), "not a JSON object"),
    (shard_with_index({"weight_map": {"x": "../model.safetensors"}}), "names a file outside"),
    (truncate, "unreadable safetensors file"),
    (garbage_header, "unreadable safetensors file"),
    (integer_weight, "model.norm.weight is stored as torch.int32"),
    # st-nan / st-inf exited 1 (a failed run) instead of 2; a duplicate was accepted silently
    (non_finite_weight(math.nan), "tensor model.norm.weight holds NaN or infinite values"),
    (non_finite_weight(math.inf), "tensor model.norm.weight holds NaN or infinite values"),
    (stored_twice, "tensor model.norm.weight is stored twice"),
]


@pytest.mark.parametrize("edit, fragment", WEIGHTS, ids=[f for _, f in WEIGHTS])
def test_weights_that_are_not_what_they_claim(capsys, hf_dir, tmp_path, edit, fragment):
    d = edited_copy(hf_dir, tmp_path, edit)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        from_hf(str(d))
    one_line_error(capsys, train_argv(tmp_path, f"model.hf_path={d}"), fragment)


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    assert (
        main(
            ["train"] + sets(TINY + ["train.steps=2", "train.save_every=2", f"train.out_dir={out}"])
        )
        == 0
    )
    return out


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("step", -1, "'step' must be an integer >= 0"),
        ("step", "2", "'step' must be an integer >= 0"),
        ("step", True, "'step' must be an integer >= 0"),
        ("step", 2.0, "'step' must be an integer >= 0"),
        ("files", ["a"], "'files' must map file names to sizes"),
        ("files", {"a": "1"}, "'files' must map"),
        ("arch", None, "'arch' and 'shapes' must be objects"),
        ("shapes", [], "'arch' and 'shapes' must be objects"),
    ],
)
def test_checkpoint_marker_with_wrong_types(capsys, checkpoint_run, tmp_path, key, value, fragment):
    run = tmp_path / "run"
    shutil.copytree(checkpoint_run, run)
    marker = run / "checkpoints" / "step_00000002" / "complete.json"
    info = json.loads(marker.read_text())
    info[key] = value
    marker.write_text(json.dumps(info))
    ckpt = str(run / "checkpoints" / "step_00000002")
    one_line_error(capsys, train_argv(tmp_path, f"train.resume={json.dumps(ckpt)}"), fragment)
    one_line_error(capsys, ["convert", "--to", "hf", ckpt, str(tmp_path / "hf")], fragment)


def test_resume_errors_found_before_launch(capsys, checkpoint_run, tmp_path):
    one_line_error(
        capsys,
        ["train", "--nproc", "2"]
        + train_argv(tmp_path, f"train.resume={tmp_path}", "train.global_batch=2")[1:],
        "not a bumblebee checkpoint",
    )
    one_line_error(
        capsys,
        ["train", "--nproc", "2"]
        + train_argv(
            tmp_path,
            f"train.resume={checkpoint_run}",
            "model.arch.moe_intermediate_size=8",
            "train.global_batch=2",
        )[1:],
        "was saved for another architecture (moe_intermediate_size 16 -> 8)",
    )


def test_metrics_are_strict_json_and_a_torn_last_line_does_not_block_resume(
    capsys, checkpoint_run, tmp_path
):
    assert json.loads(json_line({"loss": math.nan, "g": math.inf, "n": -math.inf, "ok": 1.5})) == {
        "loss": None,
        "g": None,
        "n": None,
        "ok": 1.5,
    }
    # `pair --json` writes nested rows through the same cleaner: a diverged side is null there too.
    assert json.loads(
        json.dumps(
            strict_json({"rows": [{"a": math.nan, "b": (1.0, math.inf)}], "passed": False}),
            allow_nan=False,
        )
    ) == {"rows": [{"a": None, "b": [1.0, None]}], "passed": False}
    run = tmp_path / "run"
    shutil.copytree(checkpoint_run, run)
    metrics = run / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 1.2')  # a crash mid-write
    assert (
        main(
            ["train"]
            + sets(TINY + ["train.steps=3", f"train.out_dir={run}"])
            + ["--resume", "auto"]
        )
        == 0
    )
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().out
    lines = metrics.read_text().splitlines()

    def strict(token):
        raise ValueError(f"non-JSON token {token}")

    assert [json.loads(x, parse_constant=strict)["step"] for x in lines] == [1, 2, 3]


def test_a_diverging_run_writes_null_not_nan(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            ["train"]
            + sets(
                TINY
                + [
                    "train.steps=3",
                    "train.lr=1e30",
                    "train.min_lr=1e30",
                    "train.clip_grad=0",
                    "train.on_nonfinite=skip",
                    f"train.out_dir={out}",
                ]
            )
        )
        == 0
    )

    def strict(token):
        raise ValueError(f"non-JSON token {token}")

    records = [
        json.loads(x, parse_constant=strict)
        for x in (out / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(records) == 3 and any(r["loss"] is None or r["grad_norm"] is None for r in records)
