"""Renamed config spellings (bumblebee/config_aliases.py): an old key or value resolves to the
same config as the new spelling, with one note naming the new one; unknown keys still fail."""

from __future__ import annotations

import pytest

from bumblebee import config_aliases
from bumblebee.config import ConfigError
from bumblebee.config_parse import dump_toml, parse_config


@pytest.fixture(autouse=True)
def fresh_notes():
    config_aliases.note.cache_clear()  # each test sees its own first note
    yield
    config_aliases.note.cache_clear()


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("bumblebee: note:")]


@pytest.mark.parametrize(
    "old,new,says",
    [
        ("primitives.cp=allgather", "primitives.cp_attention=allgather", "primitives.cp_attention"),
        ("train.balance=global_batch", "train.balance=step", "train.balance = 'step'"),
    ],
)
def test_old_spelling_by_set_resolves_the_same(capsys, old, new, says):
    want = dump_toml(parse_config(None, [new]))
    assert notes(capsys.readouterr().err) == []
    got = dump_toml(parse_config(None, [old]))
    assert got == want
    (line,) = notes(capsys.readouterr().err)
    assert says in line


def test_old_spelling_in_toml_resolves_the_same(tmp_path, capsys):
    old = tmp_path / "old.toml"
    old.write_text('[primitives]\ncp = "allgather"\n[train]\nbalance = "global_batch"\n')
    new = tmp_path / "new.toml"
    new.write_text('[primitives]\ncp_attention = "allgather"\n[train]\nbalance = "step"\n')
    want = dump_toml(parse_config(str(new)))
    assert notes(capsys.readouterr().err) == []
    assert dump_toml(parse_config(str(old))) == want
    assert len(notes(capsys.readouterr().err)) == 2  # one per old spelling


def test_note_is_printed_once(capsys):
    for _ in range(2):  # `bumblebee pair` parses the same overrides for each side
        parse_config(None, ["primitives.cp=ring"])
    assert len(notes(capsys.readouterr().err)) == 1


def test_only_rank_zero_notes(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    parse_config(None, ["primitives.cp=ring"])
    assert notes(capsys.readouterr().err) == []


def test_old_and_new_key_together_is_an_error(tmp_path):
    f = tmp_path / "both.toml"
    f.write_text('[primitives]\ncp = "allgather"\ncp_attention = "ring"\n')
    with pytest.raises(ConfigError, match="primitives.cp_attention and primitives.cp are one key"):
        parse_config(str(f))


@pytest.mark.parametrize(
    "item,match",
    [
        ("primitives.cpp=ring", "unknown key primitives.cpp"),
        (
            "parallel.cp_attention=ring",
            "unknown key parallel.cp_attention",
        ),  # aliases are per section
        ("train.balance=global", "train.balance must be"),  # only the listed old values map
    ],
)
def test_unknown_spellings_still_fail(item, match, capsys):
    with pytest.raises(ConfigError, match=match):
        parse_config(None, [item])
    assert notes(capsys.readouterr().err) == []


def test_planner_set_takes_the_old_key(capsys):
    from bumblebee.config import PrimitivesConfig
    from bumblebee.plan.layout import apply_overrides

    # the planner chooses no CP attention core: the old key reaches it under its new name
    with pytest.raises(ConfigError, match="unknown planner primitive 'cp_attention'"):
        apply_overrides(PrimitivesConfig(), ["primitives.cp=ring"])
    (line,) = notes(capsys.readouterr().err)
    assert "primitives.cp_attention" in line


def test_pair_takes_the_old_slot_name(capsys):
    from bumblebee.cli import build_parser
    from bumblebee.runtime.pair.command import build_pair

    args = build_parser("pair").parse_args(
        ["pair", "--slot", "cp", "--a", "allgather", "--b", "ring", "--nproc", "2"]
    )
    a, b, _ = build_pair(args)
    assert (a.primitives.cp_attention, b.primitives.cp_attention) == ("allgather", "ring")
    assert args.slot == "cp_attention"
    assert len(notes(capsys.readouterr().err)) == 1


def test_train_command_notes_the_old_spelling(capsys):
    from bumblebee.cli import main

    # a bad step count stops the command before any model is built; the note came first
    code = main(["train", "--set", "train.balance=global_batch", "--set", "train.steps=-1"])
    err = capsys.readouterr().err
    assert code == 2 and "train.steps" in err
    (line,) = notes(err)
    assert "train.balance = 'step'" in line
