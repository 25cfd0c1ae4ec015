"""``bumblebee convert --to hf``: a training checkpoint as a Hugging Face directory.

Streaming: the checkpoint is read in buckets of whole tensors (at most ``BUCKET_BYTES``, or
one tensor if larger; one ``torch.distributed.checkpoint`` load per bucket) and each tensor is
written as soon as it is read (models/hf_write.py),
so the export holds a bucket and one converted tensor, never the model. Given the Hugging Face
directory the run started from (``source``: ``convert --source``, or the trainer's own
``model.hf_path``), the tensors it holds outside the language model (vision tower, MTP head) and
its non-weight files are carried over, so the export is again a complete checkpoint; given a
tokenizer (``convert --tokenizer``, or the trainer's own ``data.tokenizer``), its files and token
ids are exported too (models/hf_tokenizer.py). A path written inside the checkpoint (its
config.toml's ``model.hf_path``, ``data.tokenizer``, ``data.path``) is never followed: a checkpoint
from elsewhere cannot make the export copy files the user did not name; a note says what the
run used and how to include it.

The export is written beside the target (a hidden temporary directory) and moved in
when complete, one export at a time per target (export_dir.py), so an interrupted or killed
export leaves no half-written model where a loader would look and blocks no re-run, and two
exports into one target never mix. The target must be new or empty; a directory holding an
earlier export is replaced only with ``overwrite`` (as a whole, so an old index and its shards
never mix with a new single file), and a checkpoint or run directory is never written into.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

import bumblebee.outputs as outputs
from bumblebee import safe_write
from bumblebee.config import PrimitivesConfig
from bumblebee.console import Progress
from bumblebee.errors import DiskFullError, disk_full, out_of_room
from bumblebee.models import build_model
from bumblebee.models.base import persistent_buffers
from bumblebee.models.hf import CheckpointError
from bumblebee.models.hf_read import checkpoint_block_size
from bumblebee.models.hf_write import ENTRY_FILES, check_export_target, write_hf_files
from bumblebee.models.lora import is_lora_name, merged_stream
from bumblebee.runtime.checkpoint.checkpointer import HF_SHARD_BYTES, saved_lora
from bumblebee.runtime.checkpoint.directory import (
    MARKER,
    STEP_DIR,
    check_fits,
    named_checkpoint,
    read_marker,
    saved_arch,
    saved_config,
)
from bumblebee.runtime.checkpoint.export_dir import (
    EXPORT_FILE,
    export_lock,
)
from bumblebee.runtime.checkpoint.integrity import verify_checksums
from bumblebee.runtime.checkpoint.reader import shown
from bumblebee.runtime.checkpoint.state import Piece, load_pieces, read_dcp_metadata
from bumblebee.runtime.launch.interrupts import stop_signal

BUCKET_BYTES = 64 * 2**20


def export_checkpoint(
    spec: str,
    out_dir: str,
    max_shard_bytes: int = HF_SHARD_BYTES,
    overwrite: bool = False,
    dtype: str | None = None,
    *,
    source: str = "",
    tokenizer: str = "",
    chat: bool | None = None,
    root: str | None = None,
) -> str:
    """``bumblebee convert --to hf``: the parameters of a checkpoint (or the newest complete
    one under a run / checkpoints directory) as a HF directory, in ``dtype`` ("bfloat16" |
    "float32"; default the run's ``train.dtype``, bfloat16 for a block-FP8 ``source``); one
    process. Returns the checkpoint used. ``source``: the HF directory the run started from,
    whose other tensors and files are carried over; ``tokenizer``: a tokenizer directory to
    export beside the weights (``chat``: with the end-of-turn token as an eos; default: the run
    was a chat run). Both are the caller's, never read from the checkpoint.
    ``out_dir`` must be new or empty, or an earlier export with ``overwrite`` (its files are
    replaced, so two exports never mix); never a checkpoint or run directory. ``root``: a
    directory above ``out_dir`` below which no link is followed (``safe_write``; the trainer's
    out_dir for its ``hf/``)."""
    if max_shard_bytes < 1:
        raise CheckpointError(f"--max-shard-bytes must be >= 1, got {max_shard_bytes}")
    outputs.check_target(out_dir, "convert OUT_DIR", kind="dir", inputs=[spec], nested=False)
    with export_lock(out_dir):  # the target's checks and its writing, one export at a time
        return _export(
            spec,
            out_dir,
            max_shard_bytes,
            overwrite,
            dtype,
            source=source,
            tokenizer=tokenizer,
            chat=chat,
            root=root,
        )


def _export(
    spec: str,
    out_dir: str,
    max_shard_bytes: int,
    overwrite: bool,
    dtype,
    *,
    source: str,
    tokenizer: str,
    chat: bool | None,
    root: str | None,
) -> str:
    old = export_target_files(out_dir, overwrite)
    path = named_checkpoint(spec, notify=lambda text: print(f"bumblebee: {text}", file=sys.stderr))
    arch, named_shapes, tensors = stream_checkpoint(path)  # checksums verified
    saved = saved_config(path, read_marker(path))
    named = _table(saved, "model").get("hf_path", "")
    # --overwrite would replace the run's own starting model (a path compared, nothing read)
    for start in {source, named if isinstance(named, str) and "\0" not in named else ""} - {""}:
        check_export_target(out_dir, start)
    _note_unfollowed(saved, source, tokenizer)
    if source and not os.path.isfile(os.path.join(source, "config.json")):
        print(
            f"bumblebee: {source} (the run's model.hf_path) is gone: exporting the language model only",
            file=sys.stderr,
        )
        source = ""
    fp8 = bool(source) and checkpoint_block_size(source) is not None
    dtype = dtype or (
        "bfloat16" if fp8 or _table(saved, "train").get("dtype") == "bfloat16" else "float32"
    )
    if fp8:  # never re-quantized: say so, since the export is about twice the source's size
        print(
            f"bumblebee: {source} is block-FP8: exporting {dtype} weights (dequantized, no "
            "_scale_inv tensors, config.json without quantization_config)",
            file=sys.stderr,
        )
    try:
        with safe_write.staged_dir(
            out_dir, doing="write the export", root=root, last=ENTRY_FILES
        ) as stage:  # written beside the target, then moved in
            with Progress(f"convert {path}: tensors written", total=len(named_shapes)) as progress:
                write_hf_files(
                    stage.path,
                    arch,
                    named_shapes,
                    _counted(tensors, progress),
                    dtype=getattr(torch, dtype),
                    max_shard_bytes=max_shard_bytes,
                    source=source,
                )
            if tokenizer:
                from bumblebee.models.hf_tokenizer import add_tokenizer

                is_chat = _table(saved, "data").get("source") == "chat" if chat is None else chat
                add_tokenizer(stage.path, tokenizer, chat=is_chat)
            stage.remove(old)  # the earlier export's files (--overwrite)
    except DiskFullError as e:  # the partial export (beside the target) is removed
        raise disk_full(out_dir, "write the export", getattr(e, "cause", e)) from None
    except (OSError, RuntimeError) as e:
        if (stop := stop_signal(e)) is not None:  # Ctrl-C inside torch's reader, not an error
            raise stop.with_traceback(None) from None
        if out_of_room(e):
            raise disk_full(out_dir, "write the export", e) from None
        if isinstance(e, RuntimeError):
            raise
        raise CheckpointError(f"{out_dir}: cannot write the export ({e.strerror or e})") from None
    return path


def run_tokenizer(data: dict) -> tuple[str, bool]:
    """The tokenizer directory a run's own ``data`` config trained with (``data.tokenizer``, or the
    one its prepared ``tokens`` directory was made with) and whether it was a chat run; ("", False)
    for none, or when the directory is gone (said on stderr). For the trainer's own config only:
    ``convert`` never follows the paths inside a checkpoint."""
    tok, kind = data.get("tokenizer", ""), data.get("source")
    if not tok and kind == "tokens":  # a prepared directory names the tokenizer it was made with
        try:
            with open(os.path.join(data.get("path", ""), "meta.json"), encoding="utf-8") as f:
                meta = json.load(f)
            tok, kind = meta.get("tokenizer", ""), meta.get("kind")
        except (OSError, ValueError):
            return "", False
    if not tok:
        return "", False
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        print(
            f"bumblebee: {tok} (the run's data.tokenizer) is gone: exporting without tokenizer files",
            file=sys.stderr,
        )
        return "", False
    return tok, kind == "chat"


def _table(saved: dict, name: str) -> dict:
    part = saved.get(name, {})
    return part if isinstance(part, dict) else {}


def _note_unfollowed(saved: dict, source: str, tokenizer: str) -> None:
    """Say which paths the checkpoint's config names that this export did not read, and how to
    include them (the checkpoint's own word is not enough to read a path)."""
    model, data = _table(saved, "model"), _table(saved, "data")
    hf = model.get("hf_path", "")
    if hf and not source:
        print(
            f"bumblebee: note: the run started from {shown(hf)} (model.hf_path in the checkpoint's "
            "config.toml); paths inside a checkpoint are not followed: pass --source DIR to carry "
            "over that model's other tensors (vision tower, MTP) and files",
            file=sys.stderr,
        )
    tok = data.get("tokenizer", "") or (
        data.get("path", "") if data.get("source") == "tokens" else ""
    )
    if tok and not tokenizer:
        what = "data.tokenizer" if data.get("tokenizer") else "data.path, prepared with a tokenizer"
        print(
            f"bumblebee: note: the run trained with {shown(tok)} ({what} in the checkpoint's "
            "config.toml); paths inside a checkpoint are not followed: pass --tokenizer DIR to "
            "export a tokenizer beside the weights",
            file=sys.stderr,
        )


def _counted(items, progress):
    """``items`` unchanged, each one counted on the progress line as the writer takes it."""
    for item in items:
        progress.update()
        yield item


def stream_checkpoint(path: str, bucket_bytes: int = BUCKET_BYTES):
    """(arch, [(name, global shape)], iterator of (name, full fp32 tensor)) of checkpoint ``path``
    (checksums verified, shapes checked): the iterator reads ``bucket_bytes`` of tensors at a time."""
    info = read_marker(path)
    verify_checksums(path, info)
    arch = saved_arch(path, info)
    # a router with a selection bias saved its buffer: build that router to receive it
    biased = any(k.endswith("mlp.gate.e_score_correction_bias") for k in info.get("shapes", {}))
    lora = saved_lora(path, info)
    whole = build_model(
        arch,
        PrimitivesConfig(router="sigmoid_bias") if biased else None,
        device="meta",
        lora=lora,
    )
    named_shapes = [
        (n, tuple(p.shape)) for n, p in list(whole.named_parameters()) + persistent_buffers(whole)
    ]
    meta = {f"model/{n}": Piece(torch.empty(0, device="meta"), 0, s) for n, s in named_shapes}
    check_fits(path, info, read_dcp_metadata(path, info), meta)

    def tensors():
        bucket, size = [], 0
        for i, (name, shape) in enumerate(named_shapes):
            bucket.append((name, shape))
            size += math.prod(shape) * 4
            following = math.prod(named_shapes[i + 1][1]) * 4 if i + 1 < len(named_shapes) else None
            if following is None or size + following > bucket_bytes:
                full = {n: torch.empty(s) for n, s in bucket}
                load_pieces(
                    path,
                    {f"model/{n}": Piece(t.view(-1), 0, tuple(t.shape)) for n, t in full.items()},
                    info=info,
                )
                for n, _ in bucket:
                    yield n, full.pop(n)
                bucket, size = [], 0

    if lora is None:
        return arch, named_shapes, tensors()
    # LoRA: the adapters merged into their base tensors, which are what a HF directory holds
    base = [(n, shape) for n, shape in named_shapes if not is_lora_name(n)]
    return arch, base, merged_stream(tensors(), lora.alpha / lora.rank, torch.float32)


def export_target_files(out_dir: str, overwrite: bool) -> list[str]:
    """Check that a HF export may go to ``out_dir``; returns the files of an earlier export
    there that ``overwrite`` replaces. Refuses a file, a checkpoint or run directory, and a
    non-empty directory without ``overwrite``."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is not a directory")
    if not os.path.isdir(out_dir):
        return []
    names = os.listdir(out_dir)
    if (
        MARKER in names
        or ".metadata" in names
        or STEP_DIR.match(os.path.basename(os.path.abspath(out_dir)))
        or any(STEP_DIR.match(n) for n in names)
    ):
        raise CheckpointError(
            f"{out_dir}: a training checkpoint directory; export to a new directory"
        )
    if "checkpoints" in names or "metrics.jsonl" in names or "config.toml" in names:
        raise CheckpointError(
            f"{out_dir}: a training run directory; export to a new directory (e.g. {out_dir}/hf)"
        )
    if not names:
        return []
    if not overwrite:
        raise CheckpointError(
            f"{out_dir}: not empty ({len(names)} entries); export to a new directory, or pass "
            "--overwrite to replace the Hugging Face export in it"
        )
    old = sorted(
        n for n in names if EXPORT_FILE.match(n) and os.path.isfile(os.path.join(out_dir, n))
    )
    if "config.json" not in old:
        raise CheckpointError(
            f"{out_dir}: --overwrite replaces an earlier Hugging Face export, and this directory "
            "holds none (no config.json); export to a new directory"
        )
    return old
