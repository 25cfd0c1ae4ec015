"""A run's record in its ``out_dir``, and what a new run does with an earlier run's record.

The record is everything ``bumblebee train`` writes there: ``config.toml``, ``metrics.jsonl``,
``tensorboard/``, ``hf/`` and ``checkpoints/step_*``. Runs default to one ``out_dir``
(``runs/default``), so a second run meeting a first run's record is the common case, and a
run must never destroy another run's record. The rule (docs/checkpoints.md says why):

- a run that **continues** the run recorded in ``out_dir`` (resumed from one of its own
  checkpoints, at step S) keeps that record: ``metrics.jsonl`` keeps its lines up to S and the
  new steps follow. What it would replace is set aside first: checkpoints newer than S (an
  abandoned future) and ``hf/`` are moved, ``metrics.jsonl`` (when it has lines past S) and
  ``config.toml`` (when the new config differs) are copied;
- **any other run** (fresh; resumed from a checkpoint elsewhere; ``--resume auto`` finding no
  checkpoint) moves the whole earlier record aside before it writes anything.

"Aside" is ``out_dir/previous/<time>-<pid>/``, with the record's own layout (so
``bumblebee report`` and ``--resume`` take it as a run directory); nothing is deleted, and
neither pruning nor ``convert`` of ``out_dir`` sees it again.

One exception, so that a run stopped before its first save (a full disk, Ctrl-C, a kill) costs
nothing: ``--resume auto`` in an ``out_dir`` without a complete checkpoint, whose newest
set-aside record holds one of the same run (same model, data and schedule but for
``train.steps``), moves that record back (``restore_set_aside``; the stopped run's own record
goes aside in its place) and continues it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

from bumblebee import safe_write

PREVIOUS = "previous"
FILES = ("metrics.jsonl", "config.toml")  # rewritten by every run
DIRS = ("tensorboard", "hf")  # written into by a run (hf: replaced by the export at its end)
RECORD = FILES + DIRS + ("checkpoints",)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _steps(root: str) -> list[tuple[int, str]]:
    return (
        sorted((int(m.group(1)), n) for n in os.listdir(root) if (m := _STEP_DIR.match(n)))
        if os.path.isdir(root)
        else []
    )


def _has_lines_after(path: str, step: int) -> bool:
    """Whether ``metrics.jsonl`` has a line a run continuing at ``step`` drops (a later step,
    or a line that does not parse)."""
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                return True
            if (
                not isinstance(rec, dict)
                or not isinstance(rec.get("step"), int)
                or rec["step"] > step
            ):
                return True
    return False


def _same_text(path: str, text: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == text
    except (OSError, UnicodeDecodeError):
        return False


def _newest_checkpoint(root: str) -> str | None:
    from bumblebee.runtime.checkpoint.directory import newest_complete

    return newest_complete(root)


def restore_set_aside(out_dir: str, same_run) -> tuple[str, str] | None:
    """The exception of the module doc: when ``out_dir/checkpoints`` holds no complete checkpoint
    and the newest record in ``out_dir/previous/`` that holds one passes ``same_run(checkpoint)``,
    set the current record aside and move that one back. Returns (the record restored, where the
    current one went), or None when nothing moved."""
    if _newest_checkpoint(os.path.join(out_dir, "checkpoints")) is not None:
        return None
    previous = os.path.join(out_dir, PREVIOUS)
    stamps = sorted(os.listdir(previous), reverse=True) if os.path.isdir(previous) else []
    for stamp in stamps:
        record = os.path.join(previous, stamp)
        found = _newest_checkpoint(os.path.join(record, "checkpoints"))
        if found is None:
            continue
        if not same_run(found):
            return None
        moved = set_aside(out_dir, continues_from=None, config_text="")
        entries = [n for n in FILES + DIRS if os.path.lexists(os.path.join(record, n))]
        for name in entries:
            os.rename(os.path.join(record, name), os.path.join(out_dir, name))
        # the checkpoints last: a restore cut short is found again by the next --resume auto
        os.makedirs(os.path.join(out_dir, "checkpoints"), exist_ok=True)
        for _, name in _steps(os.path.join(record, "checkpoints")):
            os.rename(
                os.path.join(record, "checkpoints", name),
                os.path.join(out_dir, "checkpoints", name),
            )
        for leftover in (os.path.join(record, "checkpoints"), record):
            try:
                os.rmdir(leftover)
            except OSError:  # something else in it: it stays in previous/
                pass
        return record, moved[0] if moved else ""
    return None


def set_aside(
    out_dir: str, *, continues_from: int | None, config_text: str
) -> tuple[str, list[str]] | None:
    """Apply the rule of the module doc before a run writes into ``out_dir``. ``continues_from``:
    the step of ``out_dir``'s own checkpoint the run resumed from (None: not a continuation);
    ``config_text``: the ``config.toml`` the run will write. Returns (the directory the old
    record went to, what went there), or None when nothing had to move."""
    root = os.path.join(out_dir, "checkpoints")
    # a planted link would make the moves below take (or put) files outside out_dir
    safe_write.refuse_links(*(os.path.join(out_dir, n) for n in RECORD + (PREVIOUS,)))
    moves, copies = [], []
    for step, name in _steps(root):
        if continues_from is None or step > continues_from:
            moves.append(os.path.join("checkpoints", name))
    for name in FILES:
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            continue
        if continues_from is None:
            moves.append(name)
        elif (name == "metrics.jsonl" and _has_lines_after(path, continues_from)) or (
            name == "config.toml" and not _same_text(path, config_text)
        ):
            copies.append(name)
    moves += [
        name
        for name in DIRS
        if os.path.isdir(os.path.join(out_dir, name)) and (continues_from is None or name == "hf")
    ]
    if not moves and not copies:
        return None
    base = os.path.join(out_dir, PREVIOUS, f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    aside, n = base, 1
    while os.path.exists(aside):  # a second set-aside by this process within the same second
        n += 1
        aside = f"{base}-{n}"
    fresh = not os.path.lexists(os.path.join(out_dir, PREVIOUS))
    safe_write.make_dirs(os.path.join(aside, "checkpoints"), root=out_dir)
    try:
        for rel in copies:
            src, dst = os.path.join(out_dir, rel), os.path.join(aside, rel)
            safe_write.copy_file(src, dst, doing="set the earlier record aside")
            shutil.copystat(src, dst, follow_symlinks=False)
    except BaseException:  # e.g. a full disk: nothing has moved yet, the half-made aside goes
        shutil.rmtree(os.path.join(out_dir, PREVIOUS) if fresh else aside, ignore_errors=True)
        raise
    for rel in moves:
        os.rename(
            os.path.join(out_dir, rel), os.path.join(aside, rel)
        )  # same filesystem: atomic, no copy
    if not os.listdir(os.path.join(aside, "checkpoints")):
        os.rmdir(os.path.join(aside, "checkpoints"))
    return aside, sorted(copies + moves)
