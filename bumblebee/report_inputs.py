"""What ``bumblebee report`` checks before it draws: every metrics file is UTF-8 JSON, one
object per line with an integer ``step`` (a torn last line from a crash is allowed), and the
output is a new image path (a supported extension, not a directory, not one of the inputs,
in a writable directory). Each failure is one line naming the file and the problem."""

from __future__ import annotations

import json
import os

import bumblebee.outputs as outputs
from bumblebee.config import ConfigError

FORMATS = (".png", ".pdf", ".svg")


def metrics_path(run_dir: str) -> str:
    return run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")


def load_metrics(run_dir: str) -> list[dict]:
    """The records of a run's metrics.jsonl, checked."""
    path = metrics_path(run_dir)
    if os.path.isdir(path):
        raise ConfigError(f"{path}: a directory, not a metrics file")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir}: no metrics.jsonl (not a run directory)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    lines = data.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    out = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        last = i == len(lines)
        try:
            rec = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(
                f"{path}:{i}: not UTF-8 text (a binary file, not metrics.jsonl)"
            ) from None
        except (json.JSONDecodeError, RecursionError):
            if last:
                break  # torn by a crash
            raise ConfigError(f"{path}:{i}: not valid JSON") from None
        if not isinstance(rec, dict):
            raise ConfigError(
                f"{path}:{i}: a JSON {type(rec).__name__}, not an object (one record per line)"
            )
        step = rec.get("step")
        if "step" not in rec:
            raise ConfigError(f"{path}:{i}: record has no 'step'")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ConfigError(
                f"{path}:{i}: 'step' must be an integer, got {type(step).__name__} {step!r:.40}"
            )
        out.append(rec)
    if not out:
        raise ConfigError(f"{path}: no steps logged")
    return out


def check_output(out: str, run_dirs: list[str]) -> None:
    """The report's output path: a supported image extension, not a directory, not an input, writable."""
    ext = os.path.splitext(out)[1].lower()
    if ext not in FORMATS:
        raise ConfigError(
            f"{out}: unsupported output format {ext or '(no extension)'!r}; "
            f"use one of {', '.join(FORMATS)}"
        )
    if os.path.isdir(out):
        raise ConfigError(
            f"{out}: is a directory; give a file name such as {os.path.join(out, 'report.png')}"
        )
    inputs = [metrics_path(d) for d in run_dirs]  # a report inside a run directory is fine
    outputs.check_target(out, "report -o", kind="file", inputs=inputs)


def check_inputs(run_dirs: list[str], out: str) -> None:
    check_output(out, run_dirs)
    for d in run_dirs:
        load_metrics(d)
