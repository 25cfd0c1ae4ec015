"""One writer guard (bumblebee/outputs.py) for every command that writes: train's out_dir, data
prepare's OUT, convert's OUT_DIR, report's -o. A target that is a file (or a directory where a
file goes), is or holds or lies in an input, cannot be written, or meets a full disk ends in one
line, exit 2, with nothing written."""

import errno
import json
import os

import pytest
from cli_helpers import one_line_error, sets

from bumblebee import outputs
from bumblebee.errors import ConfigError, DiskFullError

UNWRITABLE = "/proc/bumblebee-out"  # root may write anywhere else; /proc takes no new entries


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_text(
        "".join(json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(4))
    )
    return d


def _prepare(src_path, out):
    return ["data", "prepare", str(src_path), str(out), "--source", "tokens", "--no-progress"]


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("file", "exists and is not a directory"),
        ("input-file", "exists and is not a directory"),
        ("input-dir", "the input"),
        ("inside-input", "the input"),
        ("under-a-file", "is a file, not a directory"),
        ("unwritable", "not writable"),
    ],
)
def test_data_prepare_refuses_a_bad_output(capsys, tmp_path, src, case, fragment):
    (tmp_path / "a_file").write_text("x")
    source, out = {
        "file": (src, tmp_path / "a_file"),
        "input-file": (src / "a.jsonl", src / "a.jsonl"),
        "input-dir": (src, src),
        "inside-input": (src, src / "prepared"),
        "under-a-file": (src, tmp_path / "a_file" / "out"),
        "unwritable": (src, UNWRITABLE),
    }[case]
    before = sorted(os.listdir(src))
    one_line_error(capsys, _prepare(source, out), fragment)
    assert sorted(os.listdir(src)) == before  # nothing written into the input
    assert (tmp_path / "a_file").read_text() == "x"


def test_convert_and_report_and_train_use_the_same_guard(capsys, tmp_path, src, monkeypatch):
    """Each command stops on the guard's verdict before it reads or writes anything else."""
    seen = []

    def refuse(path, what, **kwargs):
        seen.append(what)
        raise ConfigError(f"{what} {path}: refused by the guard")

    monkeypatch.setattr(outputs, "check_target", refuse)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    argvs = [
        ["train"] + sets([f"train.out_dir={tmp_path / 'r'}", "train.steps=1"]),
        _prepare(src, tmp_path / "p"),
        ["convert", "--to", "hf", str(run), str(tmp_path / "hf")],
        ["report", str(run), "-o", str(tmp_path / "r.png")],
    ]
    for argv in argvs:
        one_line_error(capsys, argv, "refused by the guard", notices_before=True)
    assert len(seen) == 4, seen
    assert not (tmp_path / "p").exists() and not (tmp_path / "hf").exists()


def test_convert_and_report_refuse_bad_targets(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (tmp_path / "a_file").write_text("x")
    conv = ["convert", "--to", "hf", str(run)]
    one_line_error(capsys, conv + [str(tmp_path / "a_file")], "exists and is not a directory")
    one_line_error(capsys, conv + [UNWRITABLE], "not writable")
    one_line_error(capsys, conv + [str(run)], "is the input")
    one_line_error(capsys, ["report", str(run), "-o", UNWRITABLE + ".png"], "not writable")


def test_a_full_disk_at_the_guard_is_one_line(tmp_path, monkeypatch):
    """The probe's write fails for want of room on either path it takes (an unnamed O_TMPFILE
    written with os.write, or a named probe file where the filesystem has no O_TMPFILE)."""
    real_open, real_write = open, os.write

    def full_open(path, *args, **kwargs):
        if ".bumblebee-write-test" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    def full_write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("builtins.open", full_open)
    monkeypatch.setattr(outputs.os, "write", full_write)
    with pytest.raises(DiskFullError, match="no room"):
        outputs.check_target(str(tmp_path / "out"), "data prepare OUT")
    monkeypatch.setattr(outputs.os, "write", real_write)
    if hasattr(os, "O_TMPFILE"):
        monkeypatch.delattr(outputs.os, "O_TMPFILE")
    with pytest.raises(DiskFullError, match="no room"):
        outputs.check_target(str(tmp_path / "out"), "data prepare OUT")
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []
