"""Where checkpoints are and whether one is whole: the ``step_<N>`` directories of a run, their
``complete.json`` marker (format, step, shapes, the size of every file), the newest complete one,
the directory a ``train.resume`` value names, and whether a checkpoint's tensors fit a model.
Every name and size in a marker is untrusted: files are checked and read through reader.py.
Writing them is checkpointer.py's."""

from __future__ import annotations

import json
import os
import re

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from bumblebee.config_parse import tomllib
from bumblebee.errors import ConfigError
from bumblebee.models import arch_from_hf_dict
from bumblebee.models.hf import CheckpointError
from bumblebee.runtime.checkpoint.reader import (
    check_name,
    read_file,
    shown,
    stat_file,
    subdirectory,
)
from bumblebee.runtime.checkpoint.state import Piece

FORMAT, VERSION = "bumblebee-checkpoint", 1
MARKER = "complete.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
MARKER_BYTES = 64 * 2**20  # far above any marker (one line per file and per parameter)
CONFIG_BYTES = 16 * 2**20


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def read_marker(path: str) -> dict:
    """Validate checkpoint directory ``path`` and return its marker; a one-line
    ``CheckpointError`` for anything incomplete, truncated or foreign."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    marker = os.path.join(path, MARKER)
    if not os.path.lexists(marker):
        if os.path.isfile(os.path.join(path, ".metadata")) or os.path.basename(path).startswith(
            ".tmp-"
        ):
            raise CheckpointError(
                f"{path}: incomplete checkpoint (no {MARKER}: its save did not finish)"
            )
        if os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(
                f"{path}: a Hugging Face model directory, not a training checkpoint "
                "(start a run from it with model.hf_path)"
            )
        raise CheckpointError(f"{path}: not a bumblebee checkpoint (no {MARKER})")
    raw = read_file(path, MARKER, None, "the checkpoint", MARKER_BYTES)
    try:
        info = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable {MARKER} ({e})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {MARKER} does not describe a bumblebee checkpoint")
    if info.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {shown(info.get('version'))}; "
            f"this bumblebee reads {VERSION}"
        )
    step, files, arch, shapes = (
        info.get("step"),
        info.get("files"),
        info.get("arch"),
        info.get("shapes", {}),
    )
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(
            f"{path}: {MARKER}: 'step' must be an integer >= 0, got {shown(step)}"
        )
    if not isinstance(files, dict) or not all(
        isinstance(n, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for n, v in files.items()
    ):
        raise CheckpointError(f"{path}: {MARKER}: 'files' must map file names to sizes in bytes")
    if not isinstance(arch, dict) or not isinstance(shapes, dict):
        raise CheckpointError(f"{path}: {MARKER}: 'arch' and 'shapes' must be objects")
    for name, size in files.items():
        stat_file(path, name, size, f"{MARKER} 'files'")
    sums = info.get("checksums", {})
    if not isinstance(sums, dict) or not all(
        isinstance(n, str) and isinstance(v, str) for n, v in sums.items()
    ):
        raise CheckpointError(f"{path}: {MARKER}: 'checksums' must map file names to checksums")
    for name in sums:
        check_name(path, name, f"{MARKER} 'checksums'")
        if name not in files:
            raise CheckpointError(
                f"{path}: {MARKER}: 'checksums' names {shown(name)}, which its 'files' does not "
                "list (a checkpoint's files are listed with their sizes)"
            )
    return info


def saved_arch(path: str, info: dict):
    """The architecture checkpoint ``path``'s marker ``info`` records, checked like any model
    config (sizes included: a crafted marker cannot make a reader build an absurd model); a
    one-line ``CheckpointError`` naming the checkpoint otherwise."""
    try:
        return arch_from_hf_dict(info["arch"])
    except ConfigError as e:
        raise CheckpointError(f"{path}: {MARKER} 'arch': {e}") from None


def saved_config(path: str, info: dict) -> dict:
    """The ``config.toml`` of checkpoint ``path`` (``info``: its marker) as a table; {} when the
    marker lists none or it does not parse. Its paths are the saved run's, not the reader's:
    nothing here follows them."""
    size = info.get("files", {}).get("config.toml")
    if size is None:
        return {}
    try:
        raw = read_file(path, "config.toml", size, f"{MARKER} 'files'", CONFIG_BYTES)
        table = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # not UTF-8, malformed TOML
        return {}
    return table if isinstance(table, dict) else {}


def _step_dirs(root: str) -> list[tuple[int, str]]:
    return (
        sorted((int(m.group(1)), n) for n in os.listdir(root) if (m := STEP_DIR.match(n)))
        if os.path.isdir(root)
        else []
    )


def newest_complete(root: str, notify=None) -> str | None:
    """The newest valid ``step_<N>`` under ``root`` (None if none); others are reported."""
    for _, name in reversed(_step_dirs(root)):
        try:
            path = subdirectory(root, name)
            if path is not None:
                read_marker(path)
                return path
        except CheckpointError as e:
            if notify:
                notify(f"skipping {e}")
    return None


def find_checkpoint(spec: str, out_dir: str, notify=None) -> str | None:
    """The directory a ``train.resume`` value names: ``auto`` = the newest complete checkpoint
    of the run in ``out_dir`` (None if there is none yet), else ``named_checkpoint(spec)``."""
    if spec == "auto":
        root = subdirectory(out_dir, "checkpoints") if os.path.isdir(out_dir) else None
        return newest_complete(root, notify) if root else None
    return named_checkpoint(spec, notify)


def checkpoints_in(spec: str) -> str | None:
    """The directory of ``step_<N>`` checkpoints ``spec`` names: ``spec`` itself, or its
    ``checkpoints`` (a run directory; a real directory, not a link); None for neither."""
    if os.path.isdir(spec) and any(STEP_DIR.match(n) for n in os.listdir(spec)):
        return spec
    root = subdirectory(spec, "checkpoints") if os.path.isdir(spec) else None
    if root and os.path.isdir(root) and any(STEP_DIR.match(n) for n in os.listdir(root)):
        return root
    return None


def named_checkpoint(spec: str, notify=None) -> str:
    """A checkpoint directory as is, or the newest complete checkpoint of a run directory
    (or of its ``checkpoints`` directory); validated."""
    if not os.path.lexists(os.path.join(spec, MARKER)):
        root = checkpoints_in(spec)
        if root is not None:
            found = newest_complete(root, notify)
            if found is None:
                raise CheckpointError(f"{root}: no complete checkpoint")
            return found
    read_marker(spec)
    return spec


def check_fits(
    path: str, info: dict, md: Metadata, pieces: dict[str, Piece], whole: bool = True
) -> None:
    """Every piece's tensor exists in the checkpoint at its global size and, for a ``whole``
    model (not one pipeline stage), the checkpoint holds no parameter the model lacks."""
    shapes = {f"model/{n}": tuple(s) for n, s in info.get("shapes", {}).items()}
    mine = {k for k in pieces if k.startswith("model/")}
    extra = sorted(set(shapes) - mine)
    for key, p in pieces.items():
        saved = md.state_dict_metadata.get(key)
        if saved is None:
            raise CheckpointError(
                f"{path}: checkpoint lacks {key[6:] if key in mine else key} (a different model?)"
            )
        if not isinstance(saved, TensorStorageMetadata):
            raise CheckpointError(f"{path}: {key} is not a tensor in the checkpoint")
        if (key in shapes and shapes[key] != p.shape) or tuple(saved.size) != (p.numel,):
            raise CheckpointError(
                f"{path}: {key[6:]} has shape {list(shapes.get(key, saved.size))} in the checkpoint, "
                f"{list(p.shape)} in this model (a different architecture?)"
            )
    if extra and whole:
        raise CheckpointError(
            f"{path}: checkpoint has tensors this model lacks: {', '.join(k[6:] for k in extra[:3])}"
        )
