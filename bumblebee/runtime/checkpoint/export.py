"""``bumblebee convert --to hf``: a training checkpoint as a Hugging Face directory.

Streaming: the checkpoint is read in buckets of whole tensors (at most ``BUCKET_BYTES``, or
one tensor if larger; one ``torch.distributed.checkpoint`` load per bucket) and each tensor is
written as soon as it is read (models/hf_write.py),
so the export holds a bucket and one converted tensor, never the model. When the run started
from a Hugging Face directory (``model.hf_path`` in the checkpoint's config) that still exists,
the tensors it holds outside the language model (vision tower, MTP head) and its non-weight
files are carried over, so the export is again a complete checkpoint. A run trained with
``data.tokenizer`` exports that tokenizer and its token ids (models/hf_tokenizer.py).

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
import shutil
import sys

import torch

import bumblebee.outputs as outputs
from bumblebee.config import PrimitivesConfig
from bumblebee.config_parse import tomllib
from bumblebee.console import Progress
from bumblebee.errors import disk_full, out_of_room
from bumblebee.models import arch_from_hf_dict, build_model
from bumblebee.models.base import persistent_buffers
from bumblebee.models.hf import CheckpointError
from bumblebee.models.hf_read import checkpoint_block_size
from bumblebee.models.hf_write import check_export_target, write_hf
from bumblebee.models.lora import is_lora_name, merged_stream
from bumblebee.runtime.checkpoint.checkpointer import HF_SHARD_BYTES, saved_lora
from bumblebee.runtime.checkpoint.directory import (
    MARKER,
    STEP_DIR,
    check_fits,
    named_checkpoint,
    read_marker,
)
from bumblebee.runtime.checkpoint.export_dir import (
    EXPORT_FILE,
    export_lock,
    publish_export,
    temporary,
)
from bumblebee.runtime.checkpoint.integrity import verify_checksums
from bumblebee.runtime.checkpoint.state import Piece, load_pieces, read_dcp_metadata
from bumblebee.runtime.launch.interrupts import stop_signal

BUCKET_BYTES = 64 * 2**20


def export_checkpoint(
    spec: str,
    out_dir: str,
    max_shard_bytes: int = HF_SHARD_BYTES,
    overwrite: bool = False,
    dtype: str | None = None,
) -> str:
    """``bumblebee convert --to hf``: the parameters of a checkpoint (or the newest complete
    one under a run / checkpoints directory) as a HF directory, in ``dtype`` ("bfloat16" |
    "float32"; default the run's ``train.dtype``, bfloat16 for a run from a block-FP8
    ``model.hf_path``); one process. Returns the checkpoint used.
    ``out_dir`` must be new or empty, or an earlier export with ``overwrite`` (its files are
    replaced, so two exports never mix); never a checkpoint or run directory."""
    if max_shard_bytes < 1:
        raise CheckpointError(f"--max-shard-bytes must be >= 1, got {max_shard_bytes}")
    outputs.check_target(out_dir, "convert OUT_DIR", kind="dir", inputs=[spec], nested=False)
    with export_lock(out_dir):  # the target's checks and its writing, one export at a time
        return _export(spec, out_dir, max_shard_bytes, overwrite, dtype)


def _export(spec: str, out_dir: str, max_shard_bytes: int, overwrite: bool, dtype) -> str:
    export_target_files(out_dir, overwrite)
    path = named_checkpoint(spec, notify=lambda text: print(f"bumblebee: {text}", file=sys.stderr))
    arch, named_shapes, tensors = stream_checkpoint(path)  # checksums verified
    saved = _saved_config(path)
    source = saved.get("model", {}).get("hf_path", "")
    if source and not os.path.isfile(os.path.join(source, "config.json")):
        print(
            f"bumblebee: {source} (the run's model.hf_path) is gone: exporting the language model only",
            file=sys.stderr,
        )
        source = ""
    fp8 = bool(source) and checkpoint_block_size(source) is not None
    dtype = dtype or (
        "bfloat16" if fp8 or saved.get("train", {}).get("dtype") == "bfloat16" else "float32"
    )
    if fp8:  # never re-quantized: say so, since the export is about twice the source's size
        print(
            f"bumblebee: {source} is block-FP8: exporting {dtype} weights (dequantized, no "
            "_scale_inv tensors, config.json without quantization_config)",
            file=sys.stderr,
        )
    check_export_target(out_dir, source)  # --overwrite would replace the run's own starting model
    tmp = temporary(out_dir)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        with Progress(f"convert {path}: tensors written", total=len(named_shapes)) as progress:
            write_hf(
                tmp,
                arch,
                named_shapes,
                _counted(tensors, progress),
                dtype=getattr(torch, dtype),
                max_shard_bytes=max_shard_bytes,
                source=source,
            )  # written beside the target, then moved in
        _export_tokenizer(tmp, saved.get("data", {}))
        publish_export(tmp, out_dir)  # an earlier export (--overwrite) is replaced as a whole
    except (OSError, RuntimeError) as e:
        if (stop := stop_signal(e)) is not None:  # Ctrl-C inside torch's reader, not an error
            raise stop.with_traceback(None) from None
        if out_of_room(e):  # the partial export (beside the target) is removed below
            raise disk_full(out_dir, "write the export", e) from None
        if isinstance(e, RuntimeError):
            raise
        raise CheckpointError(f"{out_dir}: cannot write the export ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _export_tokenizer(out_dir: str, data: dict) -> None:
    """The run's ``data.tokenizer`` (or the one its prepared ``tokens`` directory was made with) beside the
    weights, its token ids in the configs (models/hf_tokenizer.py)."""
    tok, kind = data.get("tokenizer", ""), data.get("source")
    if not tok and kind == "tokens":  # a prepared directory names the tokenizer it was made with
        try:
            with open(os.path.join(data.get("path", ""), "meta.json"), encoding="utf-8") as f:
                meta = json.load(f)
            tok, kind = meta.get("tokenizer", ""), meta.get("kind")
        except (OSError, ValueError):
            return
    if not tok:
        return
    if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        print(
            f"bumblebee: {tok} (the run's data.tokenizer) is gone: exporting without tokenizer files",
            file=sys.stderr,
        )
        return
    from bumblebee.models.hf_tokenizer import add_tokenizer

    add_tokenizer(out_dir, tok, chat=kind == "chat")


def _counted(items, progress):
    """``items`` unchanged, each one counted on the progress line as the writer takes it."""
    for item in items:
        progress.update()
        yield item


def _saved_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.toml"), "rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, malformed TOML
        return {}


def stream_checkpoint(path: str, bucket_bytes: int = BUCKET_BYTES):
    """(arch, [(name, global shape)], iterator of (name, full fp32 tensor)) of checkpoint ``path``
    (checksums verified, shapes checked): the iterator reads ``bucket_bytes`` of tensors at a time."""
    info = read_marker(path)
    verify_checksums(path, info)
    arch = arch_from_hf_dict(info["arch"])
    # a router with a selection bias saved its buffer: build that router to receive it
    biased = any(k.endswith("mlp.gate.e_score_correction_bias") for k in info.get("shapes", {}))
    lora = saved_lora(path)
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
    check_fits(path, info, read_dcp_metadata(path), meta)

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
