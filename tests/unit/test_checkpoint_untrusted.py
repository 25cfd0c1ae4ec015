"""A checkpoint is untrusted input: every name and size inside it is checked before a byte is read
(runtime/checkpoint/reader.py), by every reader.

Generated the way test_bad_formats.py generates file variants: crafted names (a relative escape,
an absolute path, ``/dev/zero``, ``..``, NUL, a control character, a 300-byte name, a link inside
the checkpoint pointing out, a link to ``/dev/zero``, a fifo, a file the marker does not list, a
byte range past the end of its file) in each place a checkpoint names a file (``complete.json``'s
``files`` and ``checksums``, ``.metadata``'s storage entries), a marker claiming 10^12 layers,
and each real file of a checkpoint replaced by a link pointing out (to an identical copy, so only
the link rule stops it), a link to ``/dev/zero``, a fifo, or a file whose size lies. Each through
each reader (``checkpoint verify``, ``convert``, ``train --resume``; ``Engine.load`` and unpickling
in their own tests): one line naming the checkpoint (exit 1 for ``verify``, whose code for a
checkpoint that is not intact is 1; exit 2 for the others), no traceback, never a file outside the
checkpoint opened (an audit hook sees every open), never a hang (an alarm), no export written.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import shutil
import signal
import sys
import zlib
from contextlib import contextmanager

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import bumblebee.runtime.checkpoint.export  # noqa: F401  (imported before any alarm is armed)
import bumblebee.runtime.trainer  # noqa: F401
from bumblebee.cli import main
from bumblebee.errors import CheckpointError

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
    "train.warmup_steps=1",
]
DATA = "__0_0.distcp"
ALARM_S = 60  # far above any of these calls; only a hang reaches it


def _sets(items):
    return [a for s in items for a in ("--set", s)]


# ------------------------------------------------------------------------------ watching opens
_OPENED: list[str] | None = None


def _audit(event, args):
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes)):
        p = os.fsdecode(args[0])
        _OPENED.append(os.path.realpath(p) if "\0" not in p else p)


sys.addaudithook(_audit)


class _Hung(BaseException):
    """A reader that blocked: raised by the alarm, caught by nothing but the test."""


@contextmanager
def _watched():
    """Every path opened meanwhile (links resolved), and an alarm instead of a hang."""
    global _OPENED

    def hung(*_):  # not TimeoutError: an OSError, which a reader's error handling would swallow
        raise _Hung(f"no answer within {ALARM_S} s: the reader blocked")

    before = signal.signal(signal.SIGALRM, hung)
    _OPENED = []
    signal.alarm(ALARM_S)
    try:
        yield _OPENED
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
        _OPENED = None


# ------------------------------------------------------------------------------ the checkpoint
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("untrusted") / "run"
    argv = ["train"] + _sets(TINY + ["train.steps=1", "train.save_every=1", f"train.out_dir={out}"])
    assert main(argv) == 0
    return out / "checkpoints" / "step_00000001"


def _crc(path) -> str:
    with open(path, "rb") as f:
        return f"{zlib.crc32(f.read()):08x}"


def _marker(d):
    return json.loads((d / "complete.json").read_text())


def _write_marker(d, info):
    (d / "complete.json").write_text(json.dumps(info))


def _resign(d, info, name):
    """What an attacker does after editing ``name``: record its new size and checksum."""
    info["files"][name] = os.path.getsize(d / name)
    info["checksums"][name] = _crc(d / name)


def _metadata(d):
    with open(d / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, trusted checkpoint


def _write_metadata(d, md):
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)
    info = _marker(d)
    _resign(d, info, ".metadata")
    _write_marker(d, info)


# a name found inside a checkpoint: (kind, make(ckpt dir, outside dir) -> the name)
def _place_link(target):
    def make(d, outside):
        os.symlink(target(outside), d / "planted")
        return "planted"

    return make


def _place_fifo(d, outside):
    os.mkfifo(d / "planted")
    return "planted"


def _place_unlisted(d, outside):
    shutil.copy(d / DATA, d / "planted")  # a real file inside, whose size no marker claims
    return "planted"


NAMES = [
    ("relative", lambda d, o: os.path.relpath(o / DATA, d)),
    ("absolute", lambda d, o: str(o / DATA)),
    ("dev-zero", lambda d, o: "/dev/zero"),
    ("dotdot", lambda d, o: ".."),
    ("nul", lambda d, o: DATA + "\0.txt"),
    ("control", lambda d, o: "x\x1b[2Jy"),
    ("long", lambda d, o: "a" * 300),
    ("link-out", _place_link(lambda o: o / DATA)),
    ("link-dev-zero", _place_link(lambda o: "/dev/zero")),
    ("fifo", _place_fifo),
    ("unlisted", _place_unlisted),
]


def _in_files(d, name, outside):
    info = _marker(d)
    info["files"][name] = os.path.getsize(outside / DATA)
    _write_marker(d, info)


def _in_checksums(d, name, outside):
    info = _marker(d)
    info["checksums"][name] = _crc(outside / DATA)
    _write_marker(d, info)


def _in_storage(d, name, outside):
    md = _metadata(d)
    for where in md.storage_data.values():
        where.relative_path = name
    _write_metadata(d, md)


SLOTS = [("files", _in_files), ("checksums", _in_checksums), ("storage", _in_storage)]


def _past_end(d, outside):
    md = _metadata(d)
    where = max(md.storage_data.values(), key=lambda w: w.offset)
    where.length += 64  # the last chunk's bytes run past the end of its file
    _write_metadata(d, md)


# a real file of the checkpoint replaced: (kind, edit(ckpt dir, outside dir, file name))
def _member_link_out(d, outside, name):
    shutil.copy(d / name, outside / name)  # identical bytes: sizes and checksums all match
    os.remove(d / name)
    os.symlink(outside / name, d / name)


def _member_link_zero(d, outside, name):
    os.remove(d / name)
    os.symlink("/dev/zero", d / name)


def _member_fifo(d, outside, name):
    os.remove(d / name)
    os.mkfifo(d / name)


def _member_grown(d, outside, name):
    with open(d / name, "ab") as f:
        f.write(b"\0" * 8)


MEMBERS = [
    ("link-out", _member_link_out),
    ("link-dev-zero", _member_link_zero),
    ("fifo", _member_fifo),
    ("size-lies", _member_grown),
]
FILES = [".metadata", DATA, "config.toml", "complete.json"]


def _cases():
    out = [
        (f"{slot}:{kind}", ("name", slot, kind))
        for slot, _ in SLOTS
        for kind, _ in NAMES
        if (slot, kind) != ("files", "unlisted")  # listed there, it is a file of the checkpoint
    ]
    out.append(("storage:past-end", ("past-end", None, None)))
    out.append(("marker:1e12-layers", ("huge-arch", None, None)))
    out += [(f"{f}:{kind}", ("member", f, kind)) for f in FILES for kind, _ in MEMBERS]
    return out


CASES = _cases()


def _craft(saved, tmp_path, case):
    """A copy of the saved checkpoint with ``case`` applied; (its directory, the outside one)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(saved / DATA, outside / DATA)  # another run's data, byte for byte this one's
    d = tmp_path / "c" / "step_00000001"
    shutil.copytree(saved, d)
    what, slot, kind = case
    if what == "name":
        name = dict(NAMES)[kind](d, outside)
        dict(SLOTS)[slot](d, name, outside)
    elif what == "past-end":
        _past_end(d, outside)
    elif what == "huge-arch":  # a size claim no reader may act on (it would hang building)
        info = _marker(d)
        info["arch"]["num_hidden_layers"] = 10**12
        _write_marker(d, info)
    else:
        dict(MEMBERS)[kind](d, outside, slot)
    return d, outside


def _argv(entry, d, tmp_path):
    if entry == "verify":
        return ["checkpoint", "verify", str(d)]
    if entry == "convert":
        return ["convert", "--to", "hf", str(d), str(tmp_path / "hf")]
    return ["train"] + _sets(
        TINY + ["train.steps=2", f"train.out_dir={tmp_path / 'out'}", f"train.resume={d}"]
    )


@pytest.mark.parametrize("entry", ["verify", "convert", "resume"])
def test_crafted_checkpoints_are_refused_by_every_reader(saved, tmp_path, capsys, entry):
    """11 names x 3 places (less an unlisted file listed) + a byte range past the end + a marker
    claiming 1e12 layers + 4 files x 4 replacements = 50 variants per reader."""
    assert len(CASES) == 50
    for i, (label, case) in enumerate(CASES):
        root = tmp_path / f"v{i}"
        root.mkdir()
        d, outside = _craft(saved, root, case)
        try:
            with _watched() as opened:
                code = main(_argv(entry, d, root))
            err = capsys.readouterr().err
            lines = [
                x
                for x in err.splitlines()
                if x.startswith(("bumblebee: error:", "bumblebee: FAILED"))
            ]
            assert "Traceback" not in err, err
            assert code == (1 if entry == "verify" else 2), (code, err)
            assert len(lines) == 1 and str(d) in lines[0], err
            reached = [p for p in opened if p.startswith(str(outside)) or p == "/dev/zero"]
            assert not reached, f"read outside the checkpoint: {reached}"
            assert not (root / "hf").exists()
        except (Exception, CheckpointException, _Hung) as e:  # a traceback, a hang, a failed check
            raise AssertionError(f"{entry} of {label}: {type(e).__name__}: {e}") from None


def test_a_checkpoint_found_through_a_link_is_not_read(saved, tmp_path, capsys):
    """Below the directory the user names nothing is followed: a ``step_N`` or a ``checkpoints``
    link inside a run directory is reported, never read; the checkpoint named itself is."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    os.symlink(saved, run / "checkpoints" / "step_00000009")
    with _watched() as opened:
        assert main(["checkpoint", "verify", str(run)]) == 1
        assert main(["convert", "--to", "hf", str(run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "step_00000009: a symbolic link" in err and "Traceback" not in err
    assert not [p for p in opened if p.startswith(str(saved))]
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(saved.parent, other / "checkpoints")
    assert main(["checkpoint", "verify", str(other)]) == 2
    assert "checkpoints: a symbolic link" in capsys.readouterr().err
    assert main(["checkpoint", "verify", str(run / "checkpoints" / "step_00000009")]) == 0


class _System:
    def __reduce__(self):
        return (os.system, ("touch PWNED-system",))


class _Exec:
    def __reduce__(self):
        return (exec, ("open('PWNED-exec', 'w').write('x')",))


class _Eval:
    def __reduce__(self):
        return (eval, ("__import__('pathlib').Path('PWNED-eval').touch()",))


class _Persistent(pickle.Pickler):
    def persistent_id(self, obj):
        return "PWNED" if isinstance(obj, torch.Size) else None


def _payloads(d):
    """(name, .metadata bytes): payloads alone and hidden inside genuine DCP metadata."""
    md = _metadata(d)
    out = [(n, pickle.dumps(p())) for n, p in (("system", _System), ("exec", _Exec))]
    for name, payload in (("nested-system", _System), ("nested-eval", _Eval)):
        md.storage_meta = payload()
        out.append((name, pickle.dumps(md)))
    md = _metadata(d)
    next(iter(md.storage_data.values())).relative_path = _Exec()
    out.append(("in-storage", pickle.dumps(md)))
    buf = io.BytesIO()
    _Persistent(buf).dump(_metadata(d))
    out.append(("persistent-id", buf.getvalue()))
    return out


def test_metadata_payloads_never_run(saved, tmp_path, capsys, monkeypatch):
    """A pickled ``.metadata`` that would run code (os.system, exec, eval; alone, inside genuine
    metadata, as a storage name; a persistent id) is refused by the allow-list unpickler before
    anything runs: no marker file appears, one line per reader. The same loader runs on torch
    2.11 and 2.13 (DCP's metadata classes are the same)."""
    monkeypatch.chdir(tmp_path)
    probe = tmp_path / "probe" / "step_00000001"
    shutil.copytree(saved, probe)
    payloads = _payloads(probe)
    assert len(payloads) == 6
    for i, (label, raw) in enumerate(payloads):
        d = tmp_path / f"p{i}" / "step_00000001"
        shutil.copytree(saved, d)
        (d / ".metadata").write_bytes(raw)
        info = _marker(d)
        _resign(d, info, ".metadata")  # a checksum is no defence against tampering
        _write_marker(d, info)
        for entry in ("verify", "convert", "resume"):
            with _watched():
                code = main(_argv(entry, d, tmp_path / f"p{i}"))
            err = capsys.readouterr().err
            assert code == (1 if entry == "verify" else 2) and "Traceback" not in err, (label, err)
            assert str(d) in err and ".metadata" in err, (label, err)
        assert not list(tmp_path.glob("PWNED*")), label


def test_data_file_payload_never_runs(saved, tmp_path, capsys, monkeypatch):
    """A tensor file holding a pickle payload instead of tensors: torch loads it with
    ``weights_only``, which refuses; the reader says so on one line."""
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "c" / "step_00000001"
    shutil.copytree(saved, d)
    torch.save({"x": _System()}, d / DATA)
    info = _marker(d)
    size = os.path.getsize(d / DATA)
    _resign(d, info, DATA)
    _write_marker(d, info)
    md = _metadata(d)
    for where in md.storage_data.values():
        where.offset, where.length = 0, size
    _write_metadata(d, md)
    with _watched():
        assert main(_argv("resume", d, tmp_path)) == 2
    err = capsys.readouterr().err
    assert "unreadable tensor data" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("PWNED*"))


def test_engine_load_refuses_crafted_checkpoints(tmp_path):
    """``Engine.load`` (the RL API) reads through the same reader: a storage entry escaping the
    checkpoint, a checksum naming ``/dev/zero``, a data file linked out: one-line errors."""
    import bumblebee
    from bumblebee import load_config

    cfg = load_config(None, TINY + [f"train.out_dir={tmp_path / 'e'}"])
    engine = bumblebee.Engine(cfg)
    src = pathlib.Path(engine.save(str(tmp_path / "ckpt")))
    variants = [("name", "storage", "relative"), ("name", "checksums", "dev-zero")]
    variants.append(("member", DATA, "link-out"))
    for i, case in enumerate(variants):
        root = tmp_path / f"e{i}"
        root.mkdir()
        d, outside = _craft(src, root, case)
        with _watched() as opened, pytest.raises(CheckpointError) as e:
            engine.load(str(d))
        assert "\n" not in str(e.value) and str(d) in str(e.value), e.value
        assert not [p for p in opened if p.startswith(str(outside)) or p == "/dev/zero"]
    assert engine.load(str(src)) == 0


def _rewrite_config(d, **values):
    """The checkpoint's config.toml with ``key = "value"`` lines replaced, re-signed."""
    text = (d / "config.toml").read_text()
    for key, value in values.items():
        assert f'\n{key} = ""\n' in text, key
        text = text.replace(f'\n{key} = ""\n', f"\n{key} = {json.dumps(value)}\n", 1)
    (d / "config.toml").write_text(text)
    info = _marker(d)
    _resign(d, info, "config.toml")
    _write_marker(d, info)


def test_convert_copies_only_what_the_user_names(saved, tmp_path, capsys):
    """A checkpoint whose config.toml names a Hugging Face directory (``model.hf_path``) and a
    tokenizer (``data.tokenizer``) the user never pointed at: ``convert`` reads neither (a note
    says how to include them); with ``--source`` / ``--tokenizer`` the user's own choice is
    carried over."""
    from data_helpers import make_tokenizer

    import bumblebee
    from bumblebee.runtime.checkpoint.checkpointer import load_model

    victim = tmp_path / "victim"
    bumblebee.to_hf(load_model(str(saved)), str(victim))
    (victim / "secret.txt").write_text("not for the export")
    tok = make_tokenizer(tmp_path / "victim_tok", vocab_size=272)
    d = tmp_path / "c" / "step_00000001"
    shutil.copytree(saved, d)
    _rewrite_config(d, hf_path=str(victim), tokenizer=str(tok))
    with _watched() as opened:
        assert main(["convert", "--to", "hf", str(d), str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert not [p for p in opened if p.startswith((str(victim), str(tok)))]
    assert "pass --source DIR" in err and "pass --tokenizer DIR" in err, err
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    argv = ["convert", "--to", "hf", str(d), str(tmp_path / "hf2")]
    assert main(argv + ["--source", str(victim), "--tokenizer", str(tok)]) == 0
    got = set(os.listdir(tmp_path / "hf2"))
    assert {"secret.txt", "tokenizer.json", "generation_config.json"} <= got, got
    assert main(argv + ["--source", str(tmp_path / "nothing")]) == 2
    assert "--source" in capsys.readouterr().err
