"""Caller mistakes are one-line errors naming the argument: the model's public forward and
record_routing (1-D ids, position_ids / labels of another shape or dtype, negative positions, a
model still on the meta device), and config values (a NUL in a string, a --set value holding a
line break, min_doc_len > max_doc_len, an eval distance the rows cannot hold)."""

from __future__ import annotations

import os

import pytest
import torch

from bumblebee import ConfigError, load_config
from bumblebee.config import ModelConfig
from bumblebee.config_parse import parse_override
from bumblebee.data.synthetic import eval_distance_warning
from bumblebee.models import build_model, resolve_arch


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(resolve_arch(ModelConfig(name="qwen3_moe")), seed=0)


def test_one_dimensional_ids_name_the_fix(model):
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq_len\], got shape \(5,\)"):
        model(torch.arange(5))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"position_ids": torch.arange(4)[None]}, r"position_ids has shape \(1, 4\), expected"),
        ({"position_ids": torch.zeros(1, 6)}, "position_ids must be an integer tensor"),
        ({"position_ids": torch.tensor([[0, 1, -1, 2, 3, 4]])}, "position_ids must be >= 0"),
        ({"labels": torch.zeros(1, 5, dtype=torch.long)}, r"labels has shape \(1, 5\)"),
    ],
)
def test_forward_arguments_of_another_shape_or_dtype(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model(torch.arange(6)[None], **kwargs)


def test_record_routing_checks_its_ids(model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.record_routing(torch.tensor([[1, 2, model.arch.vocab_size]]))


def test_a_model_on_the_meta_device_says_materialize():
    meta = build_model(resolve_arch(ModelConfig(name="qwen3_moe")), device="meta")
    with pytest.raises(ValueError, match="on the meta device"):
        meta(torch.arange(6)[None])


def test_nul_in_a_config_string_is_one_line():
    with pytest.raises(ConfigError, match="train.out_dir: .* holds a NUL character"):
        load_config(None, ['train.out_dir="runs/a\\u0000b"'])


def test_set_value_with_a_line_break_is_refused():
    with pytest.raises(ConfigError, match="the value holds a line break"):
        parse_override("train.steps=5\ntrain.lr=1")


def test_min_doc_len_above_max_doc_len():
    with pytest.raises(ConfigError, match="data.min_doc_len = 600 > data.max_doc_len = 500"):
        load_config(None, ["data.min_doc_len=600", "data.max_doc_len=500"])


def test_an_eval_distance_the_rows_cannot_hold_is_warned():
    cfg = load_config(None, ["data.eval_min_distance=100000"])
    warning = eval_distance_warning(cfg.data, cfg.train.seq_len)
    assert warning and "cannot be met in rows of train.seq_len = 2048" in warning
    assert eval_distance_warning(load_config(None, []).data, 2048) is None  # the default adapts


def test_absurd_depth_is_refused_at_once():
    with pytest.raises(ConfigError, match="num_hidden_layers = 1000000000000 is beyond any model"):
        load_config(None, ["model.arch.num_hidden_layers=1000000000000"])


def test_a_vocabulary_no_memory_holds_is_refused_before_start():
    from bumblebee.runtime.launch.preflight import preflight

    cfg = load_config(None, ["model.arch.vocab_size=1000000000000"])
    with pytest.raises(ConfigError, match="for its fp32 weights alone"):
        preflight(cfg, 1)


def _exported(model, tmp_path):
    import bumblebee

    out = tmp_path / "hf"
    bumblebee.to_hf(model, str(out))
    (file,) = sorted(out.glob("*.safetensors"))
    return out, file


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_a_damaged_checkpoint(model, tmp_path, value):
    from safetensors.torch import load_file, save_file

    import bumblebee
    from bumblebee.errors import CheckpointError

    out, file = _exported(model, tmp_path)
    tensors = load_file(str(file))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone().flatten().index_fill_(0, torch.tensor([0]), value)
    tensors[name] = tensors[name].view(load_file(str(file))[name].shape)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {name} holds NaN or infinite values"):
        bumblebee.from_hf(str(out))


def test_a_tensor_stored_in_two_shards_is_refused(model, tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    import bumblebee
    from bumblebee.errors import CheckpointError

    out, file = _exported(model, tmp_path)
    tensors = load_file(str(file))
    name = sorted(tensors)[0]
    save_file({name: tensors[name]}, str(out / "extra.safetensors"), metadata={"format": "pt"})
    # an index naming both shards, each holding the tensor
    weight_map = {n: file.name for n in tensors} | {name: "extra.safetensors"}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"tensor {name} is stored twice"):
        bumblebee.from_hf(str(out))


def test_a_lone_surrogate_in_a_jsonl_record_is_a_bad_record():
    from bumblebee.data.errors import BadRecord
    from bumblebee.data.records import parse_line

    assert parse_line(b'{"text": "caf\\u00e9"}') == {"text": "caf\u00e9"}
    with pytest.raises(BadRecord, match="lone UTF-16 surrogate"):
        parse_line(b'{"text": "bad \\ud800 half"}')


@pytest.mark.parametrize(
    "template, message",
    [
        ({"tool_use": "{{ messages }}"}, "none is called 'default'"),
        (42, "chat_template must be a string, got int"),
    ],
)
def test_a_chat_template_that_is_not_text_is_a_data_error(template, message):
    from types import SimpleNamespace

    from bumblebee.data.chat import ChatRenderer
    from bumblebee.data.errors import DataError

    with pytest.raises(DataError, match=message):
        ChatRenderer(SimpleNamespace(chat_template=template), "assistant", None, {})


def test_plot_and_json_targets_are_checked_before_the_work(tmp_path):
    from bumblebee.outputs import check_target
    from bumblebee.report import check_plot_target

    (tmp_path / "f.txt").write_text("a file")
    with pytest.raises(ConfigError, match="not an image format matplotlib writes"):
        check_plot_target(str(tmp_path / "out.txt"), "--plot")
    with pytest.raises(ConfigError, match="--plot"):
        check_plot_target(str(tmp_path / "f.txt" / "x.png"), "--plot")
    with pytest.raises(ConfigError, match="--json"):
        check_target(str(tmp_path), "--json", kind="file")
    check_plot_target(str(tmp_path / "ok.png"), "--plot")


def test_a_bad_id_in_a_prepared_directory_names_that_directory():
    import dataclasses

    from bumblebee.data.errors import DataError
    from bumblebee.data.store import from_documents
    from bumblebee.data.stream import TokenSource

    store = from_documents([([1, 2, 300], [0, 1, 1])], {"source": "chats.jsonl"})
    store.meta["max_token_id"] = 300
    store = dataclasses.replace(store, location="runs/prep")
    with pytest.raises(DataError, match=r"^runs/prep \(prepared from chats.jsonl\): token id 300"):
        TokenSource(store, seq_len=8, global_batch=1, seed=0, vocab_size=272)


def _emptied_tokenizer(tmp_path, name, keep_special: bool):
    """A tokenizer directory whose vocabulary is empty (``keep_special``: but for its EOS)."""
    import json

    from data_helpers import make_tokenizer

    d = tmp_path / name
    make_tokenizer(d)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["model"]["vocab"], tj["model"]["merges"] = {}, []
    if not keep_special:
        tj["added_tokens"] = []
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg = {k: v for k, v in cfg.items() if k not in ("eos_token", "pad_token")}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        (d / "special_tokens_map.json").write_text("{}")
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


@pytest.mark.parametrize("keep_special", [True, False], ids=["eos-only", "nothing"])
@pytest.mark.parametrize("source", ["text", "chat"])
def test_a_tokenizer_with_an_empty_vocabulary_is_one_line(tmp_path, capsys, source, keep_special):
    """The probe's case: ``data prepare`` with such a tokenizer ended in an ``IndexError``
    traceback from a worker (a text encoded to no ids)."""
    import json

    from cli_helpers import one_line_error

    tok = _emptied_tokenizer(tmp_path, "tok", keep_special)
    src = tmp_path / "in.jsonl"
    record = {"text": "the quick brown fox"}
    if source == "chat":
        record = {
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]
        }
    src.write_text(json.dumps(record) + "\n")
    argv = ["data", "prepare", str(src), str(tmp_path / "out"), "--source", source]
    line = one_line_error(capsys, argv + ["--tokenizer", str(tok), "--no-progress"], str(tok))
    assert "encodes text to no tokens" in line, line
    assert not (tmp_path / "out").exists()


def test_a_jinja_sandbox_refusal_says_so(tmp_path, capsys):
    """A chat template reaching for Python internals: the sandbox refuses it, and the one line
    says that (it surfaced as an unrelated message before), naming no record as the culprit."""
    import json

    from cli_helpers import one_line_error
    from data_helpers import make_tokenizer

    tok = make_tokenizer(
        tmp_path / "tok", template="{{ ''.__class__.__mro__[1].__subclasses__() }}"
    )
    src = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    src.write_text(json.dumps({"messages": turns}) + "\n")
    argv = ["data", "prepare", str(src), str(tmp_path / "out"), "--source", "chat"]
    line = one_line_error(capsys, argv + ["--tokenizer", tok, "--no-progress"], "sandbox refuses")
    assert "__class__" in line and "chat template" in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the same cases through the CLI
CLI_TINY = [
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
    "train.steps=1",
    "train.warmup_steps=0",
    "data.min_records=1",
    "data.max_records=2",
]


def _train_argv(tmp_path, *items):
    from cli_helpers import sets

    return ["train"] + sets(CLI_TINY + [f"train.out_dir={tmp_path / 'run'}", *items])


@pytest.mark.parametrize(
    "items, fragment",
    [
        (
            ["data.min_doc_len=600", "data.max_doc_len=500"],
            "data.min_doc_len = 600 > data.max_doc_len",
        ),
        (["model.arch.vocab_size=1e12"], "vocab_size must be an integer, got 1000000000000.0"),
        (["model.arch.vocab_size=1000000000000"], "for its fp32 weights alone"),
        (['train.out_dir="runs/a\\u0000b"'], "holds a NUL character"),
    ],
)
def test_config_mistakes_through_train_are_one_line(tmp_path, capsys, items, fragment):
    """The previous round's CLI tracebacks (an allocator error for a 1e12 vocabulary) and a NUL
    in ``--set``: one line, before anything is written."""
    from cli_helpers import one_line_error

    one_line_error(capsys, _train_argv(tmp_path, *items), fragment)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["train.out_dir", "data.path"])
def test_a_nul_in_a_toml_config_names_the_file(tmp_path, capsys, key):
    from cli_helpers import one_line_error

    section, name = key.split(".")
    config = tmp_path / "run.toml"
    config.write_text(f'[{section}]\n{name} = "runs/a\\u0000b"\n')
    line = one_line_error(capsys, ["train", "--config", str(config)], "holds a NUL character")
    assert str(config) in line and key in line, line


def test_an_unmeetable_eval_distance_is_said_on_the_command_line(tmp_path, capsys):
    """``data.eval_min_distance=100000`` was accepted silently (the evaluation ran at distance
    58): the run says so in a warning before it starts."""
    from bumblebee.cli import main

    items = ["data.eval_min_distance=100000", "train.eval_every=1"]
    assert main(_train_argv(tmp_path, *items)) == 0
    err = capsys.readouterr().err
    assert "bumblebee: warning: data.eval_min_distance = 100000 cannot be met" in err, err


def test_a_lone_surrogate_through_data_prepare_names_the_line(tmp_path, capsys):
    import json

    from cli_helpers import one_line_error

    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"input_ids": [3, 4, 5]}) + "\n" + '{"input_ids": [3], "x": "\\ud800"}\n'
    )
    argv = ["data", "prepare", str(src), str(tmp_path / "out"), "--source", "tokens"]
    line = one_line_error(capsys, argv + ["--no-progress"], f"{src}:2: a string holds a lone")
    assert "surrogate" in line and not (tmp_path / "out").exists()


def test_rl_plot_and_pair_json_targets_are_refused_before_the_run(tmp_path, capsys):
    """``rl --plot out.txt`` (matplotlib's ValueError after the run finished) and ``pair --json
    DIR`` (IsADirectoryError): one line, before any training (no out_dir written)."""
    from cli_helpers import one_line_error

    argv = ["rl", "--plot", str(tmp_path / "out.txt"), "--set", f"train.out_dir={tmp_path / 'rl'}"]
    one_line_error(capsys, argv, "not an image format matplotlib writes")
    assert not (tmp_path / "rl").exists()
    (tmp_path / "dir").mkdir()
    argv = ["pair", "--slot", "loss", "--a", "ce", "--b", "linear_ce", "--steps", "1"]
    argv += ["--json", str(tmp_path / "dir"), "--set", f"train.out_dir={tmp_path / 'pair'}"]
    one_line_error(capsys, argv, "is a directory; give a file name")
    assert not (tmp_path / "pair").exists() and os.listdir(tmp_path / "dir") == []
