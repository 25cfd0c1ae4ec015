"""A kill is a normal event: a save, a convert or a run stopped at any point loses nothing that
was published, blocks no re-run, and a signal ends the command with 128 + its number.

The points are generated (tests/fault_points.py): every filesystem step the operation takes
(each entry created, renamed or removed, each file opened for writing and its first write),
found by running it once, then the operation is run again in a forked child stopped just before
each step in turn:

- SIGKILL at every step of a save (a new step that prunes an old one; the same step saved
  again, which replaces it): every checkpoint left verifies, those not being replaced are
  byte-identical, ``--resume auto`` takes the newest complete one, and the save run again works
  and leaves nothing hidden behind;
- SIGKILL at every step of a convert (into a new target; over an earlier export with
  ``--overwrite``): the target holds the earlier export or the new one, whole, and the same
  command run again works;
- SIGINT and SIGTERM at every step of a final save, of a convert, and while an earlier run's
  record is set aside: exit 130 / 143 with one line, no lock or temporary left.

And the races: two saves of one step into one directory, two converts into one target, two runs
meeting one stale out_dir lock; a lock whose launcher died while its ranks live; an out_dir
deleted under a run; a full disk at the first save of a run that set an earlier record aside.
"""

import contextlib
import dataclasses
import errno
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from cli_helpers import sets
from fault_points import run_stopped

from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.runtime.checkpoint import checkpointer, record
from bumblebee.runtime.checkpoint.checkpointer import Checkpointer
from bumblebee.runtime.checkpoint.export import export_checkpoint
from bumblebee.runtime.checkpoint.verify import verify_command
from bumblebee.runtime.launch import outdir
from bumblebee.runtime.launch.outdir import LOCK_NAME, OutDirLock
from bumblebee.runtime.trainer import Trainer

TINY = [
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
    "train.eval_every=0",
]


def snapshot(d) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), d)] = fh.read()
    return out


def verified(path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        return verify_command(str(path)), err.getvalue()


def steps_in(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_"))


def hidden(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def distinct(points: list[str]) -> list[tuple[int, str]]:
    """(step number, step) of ``points`` without the steps that leave the same state as the one
    before: of a run of ``unlink`` steps (shutil.rmtree removing a directory's files) the first
    stands for all, and a file's first write for the open just before it."""

    def same(i: int) -> bool:
        if i == 1:
            return False
        p, q = points[i - 1], points[i - 2]
        return (p.startswith("unlink ") and q.startswith("unlink ")) or (
            p.startswith("first write into ") and q == "open " + p[len("first write into ") :]
        )

    return [(i, p) for i, p in enumerate(points, 1) if not same(i)]


# ------------------------------------------------------------------------------ kill a save
@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """A trainer whose run saved steps 1, 2 and 3 (kept all), and that run's directory."""
    out = tmp_path_factory.mktemp("saves") / "run"
    cfg = load_config(
        None,
        TINY + ["train.steps=3", "train.save_every=1", "train.keep_last=0", f"train.out_dir={out}"],
    )
    t = Trainer(cfg, stream=io.StringIO())
    t.run()
    assert steps_in(out / "checkpoints") == [1, 2, 3]
    return t, out


def aim(t: Trainer, out, keep: int) -> Checkpointer:
    """Point the trainer's checkpointer at run directory ``out`` with ``keep_last = keep``."""
    c = t.checkpoint
    c.cfg = dataclasses.replace(
        c.cfg, train=dataclasses.replace(c.cfg.train, out_dir=str(out), keep_last=keep)
    )
    c.root = str(out / "checkpoints")
    return c


# (step saved, keep_last, the steps after a complete save)
SAVES = {
    "a new step, pruning the oldest": (4, 3, [2, 3, 4]),
    "the newest step again, pruning the oldest": (3, 2, [2, 3]),
}


@pytest.mark.parametrize("case", list(SAVES))
def test_a_kill_at_every_step_of_a_save_loses_nothing(three, tmp_path, case):
    t, base = three
    step, keep, after = SAVES[case]
    before = snapshot(base / "checkpoints")
    shutil.copytree(base, tmp_path / "dry")
    points = run_stopped(lambda: aim(t, tmp_path / "dry", keep).save(step)).steps
    assert len(points) >= 10, points
    failed = []
    for at, point in distinct(points):
        out = tmp_path / f"at{at}"
        shutil.copytree(base, out)
        killed = run_stopped(lambda: aim(t, out, keep).save(step), at, signal.SIGKILL)
        assert killed.signal == signal.SIGKILL, (point, killed)
        root = out / "checkpoints"
        problems = []
        code, err = verified(out)
        if code != 0:
            problems.append(f"verify: {err.strip()}")
        now = snapshot(root)
        for key, data in before.items():  # a published checkpoint is never modified in place
            n = int(key.split("/")[0][5:])
            if n != step and key in now and now[key] != data:
                problems.append(f"{key} changed")
        c = aim(t, out, keep)
        resumed = c.resume("auto")
        newest = max(steps_in(root))
        if resumed != newest or newest < 3:
            problems.append(f"resumed step {resumed}, newest complete {newest}")
        c.save(step)  # the same save again
        code, err = verified(out)
        if code != 0 or steps_in(root) != after or hidden(root):
            problems.append(f"re-run: verify {code} {err.strip()}, {sorted(os.listdir(root))}")
        if problems:
            failed.append(f"killed before step {at} ({point}): {'; '.join(problems)}")
        shutil.rmtree(out)
    assert not failed, "\n".join(failed)


def test_two_saves_of_one_step_into_one_directory(three, tmp_path, monkeypatch):
    """Two processes save the same step into one checkpoints directory at once (the Engine API
    takes no out_dir lock): both succeed, one after the other, and what is published verifies."""
    t, base = three
    out = tmp_path / "run"
    shutil.copytree(base, out)
    inner = checkpointer.save_pieces

    def slow(*args, **kwargs):  # both saves are writing at once
        time.sleep(1.0)
        return inner(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "save_pieces", slow)
    c = aim(t, out, 0)
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                c.save(3)
                os._exit(0)
            except BaseException as e:  # noqa: BLE001
                sys.stderr.write(f"{type(e).__name__}: {e}\n")
                os._exit(1)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    assert codes == [0, 0]
    code, err = verified(out)
    assert code == 0, err
    assert steps_in(out / "checkpoints") == [1, 2, 3] and not hidden(out / "checkpoints")


def _forked(fn) -> tuple[int, int]:
    """Start ``fn()`` in a forked child whose stderr goes to a pipe: (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        sys.stderr = os.fdopen(w, "w", buffering=1)
        signal.alarm(120)  # a child that hangs dies instead of blocking the test
        try:
            if "torch" in sys.modules:  # the parent's OpenMP workers are not in the child
                sys.modules["torch"].set_num_threads(1)
            code = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            sys.stderr.write(f"{type(e).__name__}: {e}\n")
            code = 99
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0)
    os.close(w)
    return pid, r


def _results(children) -> list[tuple[int, str]]:
    out = []
    for pid, r in children:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with os.fdopen(r) as f:
            out.append((code, f.read()))
    return out


def test_two_engine_saves_of_one_step_through_the_python_api(tmp_path, monkeypatch):
    """The probe's form: two ``Engine.save(dir, step=1)`` at once into one directory (one raised
    ``FileNotFoundError``, the other published a checkpoint ``verify`` called corrupt): both
    succeed, one after the other, and the checkpoint verifies and loads."""
    from bumblebee.rl.engine import Engine

    engine = Engine(load_config(None, TINY + [f"train.out_dir={tmp_path / 'e'}"]))
    inner = checkpointer.save_pieces

    def slow(*args, **kwargs):  # both saves are writing at once
        time.sleep(1.0)
        return inner(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "save_pieces", slow)
    out = tmp_path / "out"
    children = [_forked(lambda: engine.save(str(out), step=1) and 0) for _ in range(2)]
    results = _results(children)
    assert [code for code, _ in results] == [0, 0], results
    code, err = verified(out)
    assert code == 0, err
    assert steps_in(out / "checkpoints") == [1] and not hidden(out / "checkpoints")
    assert engine.load(str(out)) == 1


@pytest.mark.parametrize("first", ["resume", "fresh"])
def test_a_fresh_run_racing_a_resume_on_one_out_dir_loses_nothing(tmp_path, monkeypatch, first):
    """A fresh run and a ``--resume auto`` run started at once on one out_dir (the probe lost
    the earlier run's checkpoint): one holds the out_dir, the other is refused with one line,
    and the earlier checkpoint is whole, in ``checkpoints/`` or set aside in ``previous/``."""
    out = tmp_path / "run"
    run = TINY + ["train.save_every=2", "train.keep_last=0", f"train.out_dir={out}"]
    assert main(["train", *sets(run + ["train.steps=2"])]) == 0
    earlier = snapshot(out / "checkpoints" / "step_00000002")
    inner = Trainer.train_step

    def slow(self):  # the runs overlap
        time.sleep(0.5)
        return inner(self)

    monkeypatch.setattr(Trainer, "train_step", slow)
    argv = {
        "resume": ["train", *sets(run + ["train.steps=5"]), "--resume", "auto"],
        "fresh": ["train", *sets(run + ["train.steps=5"])],
    }
    order = [first, "fresh" if first == "resume" else "resume"]
    children = []
    for name in order:
        children.append(_forked(lambda name=name: main(argv[name])))
        time.sleep(0.3)
    results = _results(children)
    codes = sorted(code for code, _ in results)
    refused = [err for code, err in results if code == 2]
    assert codes == [0, 2] and len(refused) == 1, results
    assert "in use by another run" in refused[0] and refused[0].count("bumblebee: error:") == 1
    kept = [out / "checkpoints" / "step_00000002"]
    if (out / "previous").is_dir():
        kept += [
            out / "previous" / s / "checkpoints" / "step_00000002"
            for s in os.listdir(out / "previous")
        ]
    whole = [d for d in kept if d.is_dir() and snapshot(d) == earlier]
    assert whole, f"the earlier step 2 is gone: {[str(d) for d in kept]}"
    code, err = verified(whole[0])
    assert code == 0, err


# ------------------------------------------------------------------------------ kill a convert
@pytest.fixture(scope="module")
def exports(three, tmp_path_factory):
    """The reference exports: of step 3 (new), and an earlier one of step 1 with a user's file."""
    _, base = three
    d = tmp_path_factory.mktemp("exports")
    export_checkpoint(str(base / "checkpoints" / "step_00000003"), str(d / "new"))
    export_checkpoint(str(base / "checkpoints" / "step_00000001"), str(d / "old"))
    (d / "old" / "README.md").write_text("mine")
    return snapshot(d / "new"), snapshot(d / "old"), d / "old"


def _convert(src, target, overwrite: bool) -> int:
    return main(["convert", "--to", "hf", str(src), str(target)] + ["--overwrite"] * overwrite)


@pytest.mark.parametrize("overwrite", [False, True], ids=["new target", "over an earlier export"])
def test_a_kill_at_every_step_of_a_convert_leaves_a_whole_export_and_a_rerun_works(
    three, exports, tmp_path, overwrite, capsys
):
    _, base = three
    new, old, old_dir = exports
    src = base / "checkpoints" / "step_00000003"
    expected_after = {**old, **new} if overwrite else new  # the user's README.md stays

    def target(name):
        d = tmp_path / name / "hf"
        if overwrite:
            shutil.copytree(old_dir, d)
        return d

    dry = target("dry")
    points = run_stopped(lambda: _convert(src, dry, overwrite)).steps
    assert len(points) >= 5, points
    failed = []
    for at, point in distinct(points):
        d = target(f"at{at}")
        killed = run_stopped(lambda: _convert(src, d, overwrite), at, signal.SIGKILL)
        assert killed.signal == signal.SIGKILL, (point, killed)
        now = snapshot(d) if d.is_dir() else {}
        if now not in ({}, expected_after) and not (overwrite and now == old):
            failed.append(f"killed before step {at} ({point}): a partial export {sorted(now)}")
        code = _convert(src, d, overwrite)
        err = capsys.readouterr().err
        leftovers = [n for n in os.listdir(d.parent) if n != "hf"]
        if now == expected_after and not overwrite:  # it had finished: a second one is refused
            if code != 2 or "not empty" not in err or leftovers:
                failed.append(f"re-run after the export finished: exit {code}, {err!r}")
        elif code != 0 or snapshot(d) != expected_after or leftovers:
            failed.append(
                f"re-run after a kill before step {at} ({point}): exit {code}, {leftovers}"
            )
        shutil.rmtree(d.parent)
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def exporters(tmp_path_factory):
    """The Python API's exporters: ``(name, write(target, version))``; version 0 is the earlier
    export (bfloat16), 1 the new one (float32)."""
    import torch

    import bumblebee
    from bumblebee.models import build_model, resolve_arch
    from bumblebee.rl.engine import Engine

    root = tmp_path_factory.mktemp("exporters")  # bumblebee.to_hf: under the export lock
    engine = Engine(load_config(None, TINY + [f"train.out_dir={root / 'e'}"]))
    model = build_model(resolve_arch(load_config(None, TINY).model), seed=0)
    dtypes = (torch.bfloat16, torch.float32)
    return {
        "Engine.export_hf": lambda d, v: engine.export_hf(str(d), dtype=dtypes[v]),
        "to_hf": lambda d, v: bumblebee.to_hf(model, str(d), dtype=dtypes[v]),
        "to_hf sharded": lambda d, v: bumblebee.to_hf(
            model, str(d), dtype=dtypes[v], max_shard_bytes=20_000
        ),
    }


@pytest.mark.parametrize("overwrite", [False, True], ids=["new target", "over an earlier export"])
@pytest.mark.parametrize("exporter", ["Engine.export_hf", "to_hf", "to_hf sharded"])
def test_a_kill_at_every_step_of_an_api_export(exporters, tmp_path, exporter, overwrite):
    """SIGKILL at every filesystem step of ``Engine.export_hf`` / ``bumblebee.to_hf`` (the probe:
    a killed export_hf left temporaries and a partial model): the target holds the earlier
    export or the new one, whole, and the same export run again works and leaves nothing beside
    the target."""
    write = exporters[exporter]
    ref = tmp_path / "ref"
    write(ref / "old", 0)
    (ref / "old" / "README.md").write_text("mine")
    write(ref / "new", 1)
    shutil.copytree(ref / "old", ref / "over")
    write(ref / "over", 1)  # over the earlier one: its weight files replaced, README.md kept
    old, new, over = snapshot(ref / "old"), snapshot(ref / "new"), snapshot(ref / "over")
    after = over if overwrite else new
    assert (
        over["README.md"] == b"mine" and {k: v for k, v in over.items() if k != "README.md"} == new
    )

    def target(name):
        d = tmp_path / name / "hf"
        if overwrite:
            shutil.copytree(ref / "old", d)
        else:
            d.parent.mkdir()
        return d

    dry = target("dry")
    points = run_stopped(lambda: write(dry, 1)).steps
    assert len(points) >= 4, points
    failed = []
    for at, point in distinct(points):
        d = target(f"at{at}")
        killed = run_stopped(lambda: write(d, 1), at, signal.SIGKILL)
        assert killed.signal == signal.SIGKILL, (point, killed)
        now = snapshot(d) if d.is_dir() else {}
        if now not in ({}, after) and not (overwrite and now == old):
            failed.append(f"killed before step {at} ({point}): a partial export {sorted(now)}")
        write(d, 1)
        leftovers = [n for n in os.listdir(d.parent) if n != "hf"]
        if snapshot(d) != after or leftovers:
            failed.append(f"re-run after a kill before step {at} ({point}): {leftovers}")
        shutil.rmtree(d.parent)
    assert not failed, "\n".join(failed)


def test_two_converts_into_one_target(three, exports, tmp_path, monkeypatch):
    """Two converts into one target at once: one writes it, the other is refused with one line;
    the target is one export, not a mix."""
    _, base = three
    new = exports[0]
    import bumblebee.runtime.checkpoint.export as export

    inner = export.write_hf_files

    def slow(*args, **kwargs):
        time.sleep(1.0)
        return inner(*args, **kwargs)

    monkeypatch.setattr(export, "write_hf_files", slow)
    target = tmp_path / "hf"
    pids = []
    for step in (3, 1):  # the second one exports another checkpoint: a mix would show
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            sys.stderr = os.fdopen(w, "w", buffering=1)
            os._exit(_convert(base / "checkpoints" / f"step_{step:08d}", target, False))
        os.close(w)
        pids.append((pid, r))
        time.sleep(0.2)
    results = []
    for pid, r in pids:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with os.fdopen(r) as f:
            results.append((code, f.read()))
    assert results[0][0] == 0, results
    assert results[1][0] == 2 and "another export is writing" in results[1][1], results
    assert results[1][1].count("\n") == 1, results[1][1]
    assert snapshot(target) == new
    assert os.listdir(tmp_path) == ["hf"]


# ------------------------------------------------------------------------------ signals: exit codes
def _train_main(out, *extra) -> int:
    """``bumblebee train`` as the program runs it (its own signal handling)."""
    sys.argv = ["bumblebee", "train", *sets(TINY + [f"train.out_dir={out}", *extra])]
    return main()


def _stopped_cleanly(outcome, signum, out) -> list[str]:
    problems = []
    want = 128 + signum
    if outcome.code != want:
        problems.append(
            f"exit {outcome.code} (signal {outcome.signal}), not {want}: {outcome.error}"
        )
    if (out / LOCK_NAME).exists():
        problems.append("the out_dir lock was left behind")
    root = out / "checkpoints"
    if root.is_dir():
        if hidden(root):
            problems.append(f"left {hidden(root)}")
        code, err = verified(out) if steps_in(root) else (0, "")
        if code:
            problems.append(err.strip())
    return problems


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_every_step_of_the_final_save_exits_128_plus_it(tmp_path, signum):
    """Ctrl-C: 130 and ``bumblebee: interrupted`` (never a full disk: a KeyboardInterrupt inside
    torch's zip writer comes out as a write error); SIGTERM: 143, the save completed
    (preemption), also when it is the last step's."""
    args = ("train.steps=1", "train.save_every=1")
    within = (Checkpointer, "save")
    points = run_stopped(lambda: _train_main(tmp_path / "dry", *args), within=within).steps
    assert len(points) >= 8, points
    failed = []
    for at, point in distinct(points):
        out = tmp_path / f"at{at}"
        stopped = run_stopped(lambda: _train_main(out, *args), at, signum, within=within)
        err = stopped.stderr
        problems = _stopped_cleanly(stopped, signum, out)
        last = err.strip().splitlines()[-1] if err.strip() else ""
        if signum == signal.SIGINT and last != "bumblebee: interrupted":
            problems.append(f"last line {last!r}")
        if signum == signal.SIGTERM and not last.startswith("bumblebee: preempted at step 1"):
            problems.append(f"last line {last!r}")
        if signum == signal.SIGTERM and steps_in(out / "checkpoints") != [1]:
            problems.append("the preemption save is missing")
        if problems:
            failed.append(f"{signal.Signals(signum).name} before step {at} ({point}): {problems}")
        shutil.rmtree(out, ignore_errors=True)
    assert not failed, "\n".join(failed)


def _in_one_place(out, earlier: dict[str, bytes]) -> str:
    """'' if the earlier record ``earlier`` is whole in ``out`` or whole in one ``previous/``
    directory (what was moved aside), else what is split."""
    aside = out / "previous"
    stamps = sorted(os.listdir(aside)) if aside.is_dir() else []
    here = {k: v for k, v in snapshot(out).items() if not k.startswith("previous/")}
    if all(here.get(k) == v for k, v in earlier.items()) and not stamps:
        return ""
    if len(stamps) == 1 and snapshot(aside / stamps[0]) == earlier:
        return ""
    return f"split: {sorted(set(earlier) - set(here))} moved, previous/ {stamps}"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_an_earlier_record_is_set_aside(three, tmp_path, signum):
    """A fresh run moves an earlier run's record aside before it writes: a Ctrl-C or SIGTERM
    in the middle waits for the moves (the record is whole in one place), then ends the run."""
    _, base = three
    earlier = {k: v for k, v in snapshot(base).items() if not k.startswith("previous/")}
    within = (checkpointer, "set_aside")
    shutil.copytree(base, tmp_path / "dry")
    points = run_stopped(lambda: _train_main(tmp_path / "dry", "train.steps=1"), within=within)
    assert len(points.steps) >= 4, points
    failed = []
    for at, point in distinct(points.steps):
        out = tmp_path / f"at{at}"
        shutil.copytree(base, out)
        stopped = run_stopped(lambda: _train_main(out, "train.steps=1"), at, signum, within=within)
        problems = _stopped_cleanly(stopped, signum, out)
        if split := _in_one_place(out, earlier):
            problems.append(split)
        if problems:
            failed.append(f"{signal.Signals(signum).name} before step {at} ({point}): {problems}")
        shutil.rmtree(out)
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------------------ the out_dir lock
def _dead_pid() -> tuple[int, str | None]:
    """A pid and start time of a process that has ended."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    started = outdir._start_time(p.pid)
    p.wait()
    return p.pid, started


def _lock(out, owner: tuple[int, str | None], members=()) -> None:
    host = socket.gethostname()
    lines = [{"host": host, "pid": owner[0], "started": owner[1], "since": "then"}]
    lines += [
        {"host": host, "pid": pid, "started": started, "rank": r}
        for r, (pid, started) in enumerate(members)
    ]
    (out / LOCK_NAME).write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_two_runs_meeting_one_stale_lock_take_it_once(tmp_path, monkeypatch):
    """Two processes find the same stale lock at once (its owner is gone): one takes it over, the
    other is then refused. Deciding "stale" was slowed down so that both decide at once."""
    _lock(tmp_path, _dead_pid())
    alive = outdir._alive

    def slow(pid, started):
        time.sleep(0.5)
        return alive(pid, started)

    monkeypatch.setattr(outdir, "_alive", slow)
    children = []
    for _ in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                with OutDirLock(str(tmp_path), stream=io.StringIO()):
                    os.write(w, b"held")
                    time.sleep(1.5)  # the other decides meanwhile
            except Exception as e:  # noqa: BLE001
                os.write(w, f"refused: {e}".encode())
            os._exit(0)
        os.close(w)
        children.append((pid, r))
    said = []
    for pid, r in children:
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as f:
            said.append(f.read().decode())
    assert sorted(s.split(":")[0] for s in said) == ["held", "refused"], said
    assert any("in use by another run" in s for s in said), said
    assert not (tmp_path / LOCK_NAME).exists() and os.listdir(tmp_path) == []


def test_a_lock_is_live_while_any_of_its_ranks_is(tmp_path):
    """The launcher is gone (SIGKILL) but a rank it started still runs: its lock is in use; once
    no process of it is left, the lock is stale and taken over."""
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock(tmp_path, _dead_pid(), [(rank.pid, outdir._start_time(rank.pid))])
        with pytest.raises(
            outdir.ConfigError, match=f"in use by another run .*pid {rank.pid} still run"
        ):
            OutDirLock(str(tmp_path), stream=io.StringIO()).__enter__()
    finally:
        rank.kill()
        rank.wait()
    note = io.StringIO()
    with OutDirLock(str(tmp_path), stream=note) as held:
        assert held.owned
    assert "stale lock" in note.getvalue()


@pytest.mark.parametrize("planted", ["fifo", "dev-zero link", "directory"])
def test_a_lock_that_is_no_file_is_never_waited_on(tmp_path, planted):
    """Something other than a lock file planted at ``bumblebee.lock`` in a shared out_dir: a fifo
    (reading it blocked the run forever) or a link to ``/dev/zero`` is a stale lock, replaced;
    a directory is one line. An alarm stands in for the hang."""
    lock = tmp_path / LOCK_NAME
    if planted == "fifo":
        os.mkfifo(lock)
    elif planted == "directory":
        lock.mkdir()
    else:
        os.symlink("/dev/zero", lock)

    class Hung(BaseException):  # no OSError (TimeoutError is one): nothing may swallow it
        pass

    def hung(*_):
        raise Hung("the lock was waited on")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        if planted == "directory":
            with pytest.raises(outdir.ConfigError, match="is a directory, not bumblebee's lock"):
                OutDirLock(str(tmp_path), stream=io.StringIO()).__enter__()
            assert lock.is_dir()
            return
        with OutDirLock(str(tmp_path), stream=io.StringIO()) as held:
            assert held.owned and lock.is_file() and not lock.is_symlink()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert not os.path.lexists(lock)


def test_a_zombie_owner_is_not_running(tmp_path):
    """An owner that died and was never reaped (an orphan under a parent that does not reap):
    ``kill(pid, 0)`` still succeeds, but the lock is stale."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until it has exited (state Z)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        _lock(tmp_path, (pid, outdir._start_time(pid)))
        with OutDirLock(str(tmp_path), stream=io.StringIO()) as held:
            assert held.owned
    finally:
        os.waitpid(pid, 0)


def test_a_run_whose_out_dir_is_deleted_stops_and_leaves_the_new_owner_alone(
    tmp_path, monkeypatch, capsys
):
    """While a run trains, its out_dir is deleted and a second run starts there: the first stops
    at its next step with one line, writes nothing into the second's directory and leaves the
    second's lock in place."""
    out = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    inner = Trainer.train_step

    def train_step(self):
        if self.step == 2:
            shutil.rmtree(out)
            os.makedirs(out)
            _lock(out, (other.pid, outdir._start_time(other.pid)))
        return inner(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    try:
        code = main(
            ["train", *sets(TINY + ["train.steps=5", "train.save_every=1", f"train.out_dir={out}"])]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith("bumblebee: error: "), err
        assert "now names another run" in err[-1] and "stopped at step 3" in err[-1], err[-1]
        assert os.listdir(out) == [LOCK_NAME]  # the second run's lock, nothing of the first run
        assert json.loads((out / LOCK_NAME).read_text().splitlines()[0])["pid"] == other.pid
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------------ full disk, then resume
def test_resume_after_a_full_disk_at_a_fresh_runs_first_save_takes_the_set_aside_step(
    tmp_path, monkeypatch, capsys
):
    """A run saved step 4; a second run of the same config into the same out_dir (a fresh start:
    it set the first run's record aside) runs out of room at its first save. ``--resume auto``
    then continues the first run's step 4, with nothing to write, instead of starting again at
    step 0 and running out of room at step 4 again."""
    out = tmp_path / "run"
    run = TINY + ["train.steps=4", "train.save_every=4", f"train.out_dir={out}"]
    assert main(["train", *sets(run)]) == 0
    first = {k: v for k, v in snapshot(out).items()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointer, "save_pieces", full)  # the disk stays too full for a save
    assert main(["train", *sets(run)]) == 2
    assert "no room to write checkpoint step_00000004" in capsys.readouterr().err
    assert main(["train", *sets(run), "--resume", "auto"]) == 0
    said = capsys.readouterr().out
    assert f"resumed from {out / 'checkpoints' / 'step_00000004'} at step 4" in said, said
    now = {k: v for k, v in snapshot(out).items() if not k.startswith("previous/")}
    del now["config.toml"], first["config.toml"]  # rewritten: train.resume = "auto"
    assert now == first  # the first run's record, back in place as it was
    aside = [sorted(snapshot(out / "previous" / s)) for s in os.listdir(out / "previous")]
    assert ["config.toml", "metrics.jsonl"] in aside  # the stopped run's own record


def test_resume_auto_does_not_restore_a_record_of_another_run(tmp_path, monkeypatch, capsys):
    """The set-aside record is restored only for the same run: a changed learning rate starts
    fresh, as before."""
    out = tmp_path / "run"
    run = TINY + ["train.steps=2", "train.save_every=2", f"train.out_dir={out}"]
    assert main(["train", *sets(run)]) == 0

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointer, "save_pieces", full)
    assert main(["train", *sets(run)]) == 2
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["train", *sets(run + ["train.lr=5e-3"]), "--resume", "auto"]) == 0
    assert "no complete checkpoint" in capsys.readouterr().out
    assert record.PREVIOUS in os.listdir(out) and len(os.listdir(out / "previous")) == 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_every_step_of_a_convert(three, exports, tmp_path, signum):
    """Exit 130 / 143 with one line; the target is absent or the whole export (a signal after it
    was moved in), and nothing is left beside it."""
    _, base = three
    src = base / "checkpoints" / "step_00000003"

    def convert(target):
        sys.argv = ["bumblebee", "convert", "--to", "hf", str(src), str(target)]
        return main()

    points = run_stopped(lambda: convert(tmp_path / "dry" / "hf")).steps
    assert len(points) >= 5, points
    failed = []
    for at, point in distinct(points):
        target = tmp_path / f"at{at}" / "hf"
        stopped = run_stopped(lambda: convert(target), at, signum)
        err = stopped.stderr.strip().splitlines()
        problems = []
        if stopped.code != 128 + signum:
            problems.append(f"exit {stopped.code} (signal {stopped.signal}) {stopped.error}")
        if err[-1:] != [
            f"bumblebee: {'interrupted' if signum == signal.SIGINT else 'stopped by SIGTERM'}"
        ]:
            problems.append(f"said {err[-2:]}")
        left = sorted(os.listdir(target.parent)) if target.parent.is_dir() else []
        if left not in ([], ["hf"]) or snapshot(target) not in ({}, exports[0]):
            problems.append(f"left {left}: {sorted(snapshot(target))}")
        if problems:
            failed.append(f"{signal.Signals(signum).name} before step {at} ({point}): {problems}")
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------------------ data prepare
@pytest.fixture(scope="module")
def tokens_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("prep") / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"input_ids": list(range(3, 3 + n))}) + "\n" for n in (5, 9, 7))
    )
    return path


def _prepare(src, out) -> int:
    sys.argv = [
        "bumblebee",
        "data",
        "prepare",
        str(src),
        str(out),
        "--source",
        "tokens",
        "--no-progress",
    ]
    return main()


def test_a_kill_or_sigterm_at_every_step_of_data_prepare(tokens_input, tmp_path, capsys):
    """SIGTERM: exit 143, and the OUT it created is gone (no partial corpus, no lock); SIGKILL:
    whatever is left, the same prepare run again works and writes the same corpus (or, killed
    once the corpus was whole, is refused as for any finished OUT)."""
    points = run_stopped(lambda: _prepare(tokens_input, tmp_path / "dry" / "out")).steps
    want = {k: v for k, v in snapshot(tmp_path / "dry" / "out").items() if k != "meta.json"}
    assert want and len(points) >= 5, points
    failed = []
    for at, point in distinct(points):
        out = tmp_path / f"term{at}" / "out"
        stopped = run_stopped(lambda: _prepare(tokens_input, out), at, signal.SIGTERM)
        last = stopped.stderr.strip().splitlines()[-1:]
        left = sorted(os.listdir(out.parent)) if out.parent.is_dir() else []
        if stopped.code != 143 or last != ["bumblebee: stopped by SIGTERM"] or left:
            failed.append(
                f"SIGTERM before step {at} ({point}): exit {stopped.code}, {last}, {left}"
            )
        out = tmp_path / f"kill{at}" / "out"
        assert run_stopped(lambda: _prepare(tokens_input, out), at, signal.SIGKILL).signal == 9
        finished = (out / "meta.json").exists()  # killed once the corpus was whole
        argv = ["data", "prepare", str(tokens_input), str(out), "--source", "tokens"]
        code = main(argv + ["--no-progress"])
        err = capsys.readouterr().err
        data = {k: v for k, v in snapshot(out).items() if k != "meta.json"} if out.is_dir() else {}
        ok = (code == 2 and "already holds prepared data" in err) if finished else code == 0
        if not ok or data != want:
            failed.append(
                f"re-run after SIGKILL before step {at} ({point}): exit {code}, "
                f"{sorted(set(data) ^ set(want))} {err[-300:]}"
            )
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------------------ rl
RL_TINY = [
    "model.arch.hidden_size=32",
    "rl.steps=1",
    "rl.warmup_steps=1",
    "rl.eval_problems=2",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
]


def _rl_main(out) -> int:
    sys.argv = ["bumblebee", "rl", *sets(RL_TINY + [f"train.out_dir={out}"])]
    return main()


def _left_by_rl(out) -> list[str]:
    """What a stopped ``rl`` must not leave: its lock, a temporary, a partial reference export."""
    problems = []
    if not out.is_dir():
        return problems
    names = sorted(os.listdir(out))
    if LOCK_NAME in names:
        problems.append("the out_dir lock was left behind")
    if hidden(out):
        problems.append(f"left {hidden(out)}")
    ref = out / "reference"
    if ref.is_dir() and sorted(os.listdir(ref)) not in ([], ["config.json", "model.safetensors"]):
        problems.append(f"a partial reference export {sorted(os.listdir(ref))}")
    return problems


@pytest.mark.parametrize(
    "signum", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["SIGKILL", "SIGINT", "SIGTERM"]
)
def test_a_signal_at_every_step_of_rl(tmp_path, signum):
    """``bumblebee rl`` stopped before each of its filesystem steps (the probe: a killed ``rl``
    left temporaries, a partial output or a lock): Ctrl-C / SIGTERM exit 130 / 143 leaving no
    lock, temporary or partial reference export; after SIGKILL the same ``rl`` run again works
    and leaves none of those either."""
    points = run_stopped(lambda: _rl_main(tmp_path / "dry")).steps
    assert len(points) >= 15, points
    failed = []
    for at, point in distinct(points):
        out = tmp_path / f"at{at}"
        stopped = run_stopped(lambda: _rl_main(out), at, signum)
        problems = []
        if signum == signal.SIGKILL:
            assert stopped.signal == signal.SIGKILL, (point, stopped)
            again = run_stopped(lambda: _rl_main(out))
            if again.code != 0:
                problems.append(f"re-run: exit {again.code} {again.stderr.strip()[-300:]}")
        else:
            last = stopped.stderr.strip().splitlines()[-1:]
            if stopped.code != 128 + signum or not last or not last[0].startswith("bumblebee: "):
                problems.append(f"exit {stopped.code} (signal {stopped.signal}), said {last}")
        problems += _left_by_rl(out)
        if problems:
            failed.append(f"{signal.Signals(signum).name} before step {at} ({point}): {problems}")
        shutil.rmtree(out, ignore_errors=True)
    assert not failed, "\n".join(failed)
