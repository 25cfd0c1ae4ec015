"""``bumblebee convert --to hf``: a training checkpoint as a Hugging Face directory.

The export is written beside the target (a hidden temporary directory) and moved in
when complete, so an interrupted export leaves no half-written model where a loader
would look. The target must be new or empty; a directory holding an earlier export
is replaced only with ``overwrite`` (its files are removed first, so an old index and
its shards never mix with a new single file), and a checkpoint or run directory is
never written into.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

from bumblebee.models.hf import CheckpointError, to_hf
from bumblebee.runtime.checkpoint import _STEP_DIR, HF_SHARD_BYTES, MARKER, load_model, named_checkpoint


def export_checkpoint(spec: str, out_dir: str, max_shard_bytes: int = HF_SHARD_BYTES, overwrite: bool = False) -> str:
    """``bumblebee convert --to hf``: the parameters of a checkpoint (or the newest complete
    one under a run / checkpoints directory) as a HF directory; one process. Returns the
    checkpoint used. ``out_dir`` must be new or empty, or an earlier export with ``overwrite``
    (its files are replaced, so two exports never mix); never a checkpoint or run directory."""
    if max_shard_bytes < 1:
        raise CheckpointError(f"--max-shard-bytes must be >= 1, got {max_shard_bytes}")
    old = export_target_files(out_dir, overwrite)
    path = named_checkpoint(spec, notify=lambda text: print(f"bumblebee: {text}", file=sys.stderr))
    model = load_model(path)  # checksums verified
    parent, base = os.path.split(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{base}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        to_hf(model, tmp, max_shard_bytes)  # written beside the target, then moved in
        if os.path.isdir(out_dir) and not os.listdir(out_dir):
            os.rmdir(out_dir)
        if not os.path.exists(out_dir):
            os.rename(tmp, out_dir)
        else:
            for name in old:  # the earlier export's files (--overwrite)
                os.remove(os.path.join(out_dir, name))
            for name in sorted(os.listdir(tmp), key=lambda n: n.startswith("model.safetensors")):
                os.rename(os.path.join(tmp, name), os.path.join(out_dir, name))  # the entry point last
    except OSError as e:
        raise CheckpointError(f"{out_dir}: cannot write the export ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


_EXPORT_FILE = re.compile(r"^(config\.json|generation_config\.json|model\.safetensors\.index\.json|.*\.safetensors)$")


def export_target_files(out_dir: str, overwrite: bool) -> list[str]:
    """Check that a HF export may go to ``out_dir``; returns the files of an earlier export
    there that ``overwrite`` replaces. Refuses a file, a checkpoint or run directory, and a
    non-empty directory without ``overwrite``."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is not a directory")
    if not os.path.isdir(out_dir):
        return []
    names = os.listdir(out_dir)
    if (MARKER in names or ".metadata" in names or _STEP_DIR.match(os.path.basename(os.path.abspath(out_dir)))
            or any(_STEP_DIR.match(n) for n in names)):
        raise CheckpointError(f"{out_dir}: a training checkpoint directory; export to a new directory")
    if "checkpoints" in names or "metrics.jsonl" in names or "config.toml" in names:
        raise CheckpointError(f"{out_dir}: a training run directory; export to a new directory (e.g. {out_dir}/hf)")
    if not names:
        return []
    if not overwrite:
        raise CheckpointError(f"{out_dir}: not empty ({len(names)} entries); export to a new directory, or pass "
                              "--overwrite to replace the Hugging Face export in it")
    old = sorted(n for n in names if _EXPORT_FILE.match(n) and os.path.isfile(os.path.join(out_dir, n)))
    if "config.json" not in old:
        raise CheckpointError(f"{out_dir}: --overwrite replaces an earlier Hugging Face export, and this directory "
                              "holds none (no config.json); export to a new directory")
    return old
