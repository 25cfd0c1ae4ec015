"""Writing a Hugging Face directory one tensor at a time.

The shard plan (which tensor goes to which ``model-XXXXX-of-YYYYY.safetensors``, at most
``max_shard_bytes`` each, with ``model.safetensors.index.json``) is made from names, shapes and
the output dtype alone, so every safetensors header is written before any data; tensors then
arrive one by one in that order (from a model in memory, a training checkpoint read tensor by
tensor, or gathered just in time across ranks) and their bytes are appended to the open shard.
No more than one tensor (plus its dtype-converted copy) is held: never the model, never a
shard. The file format is safetensors' own (8-byte little-endian header length, JSON header
with ``dtype``, ``shape``, ``data_offsets`` per tensor, the header padded with spaces to a
multiple of 8, then the raw little-endian bytes).

Carried over (``source``): when the model came from a HF directory whose checkpoint holds more
than the language model (the multimodal wrapper's vision tower, an MTP head: the family's skip
list), those tensors are copied unchanged from the source, the language model is written
under the source's prefix (``model.language_model.``), and the source's ``config.json`` and
other non-weight files (tokenizer, processor, chat template) are kept, so the export is again a
complete checkpoint. A tensor the model wrote itself is never carried over a second time.

A block-FP8 source (models/hf_read.py) is never written back in FP8: the export is in
``dtype`` (bf16 unless asked otherwise, runtime/checkpoint/export.py), carried FP8 tensors are
dequantized into it, their ``_scale_inv`` tensors dropped, and ``config.json`` loses the
source's ``quantization_config`` (it would tell loaders to dequantize plain weights).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct

import torch

from bumblebee import safe_write
from bumblebee.errors import DiskFullError, disk_full
from bumblebee.models.family import family_of_model_type
from bumblebee.models.hf_read import HFCheckpoint
from bumblebee.models.hf_stored import stored_entry
from bumblebee.models.mtp_names import skip_prefixes

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# the weight files an export writes (and so replaces): anything else in the directory (an adapter,
# a README, tokenizer files) belongs to someone else and is never removed
WEIGHT_FILE = re.compile(
    r"^(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$"
)


def check_export_target(out_dir: str, source: str) -> None:
    """Refuse to export into ``source``, the directory the model was loaded from: the export
    would overwrite the weights it is carrying over (and the user's original checkpoint)."""
    from bumblebee.errors import CheckpointError

    if (
        source
        and os.path.isdir(out_dir)
        and os.path.isdir(source)
        and os.path.samefile(out_dir, source)
    ):
        raise CheckpointError(
            f"{out_dir}: the Hugging Face directory the model was loaded from (model.hf_path); "
            "export to another directory"
        )


def stale_weight_files(out_dir: str, written: list[str]) -> list[str]:
    """Weight files of an earlier export in ``out_dir`` that this one did not write (an old index
    and its shards beside a new single file would be what ``from_hf`` loads)."""
    return sorted(n for n in os.listdir(out_dir) if WEIGHT_FILE.match(n) and n not in written)


def hf_layout(named_shapes, F: int, stored=()):
    """(HF name, shape, bumblebee name, part) for every parameter given as (name, global shape),
    experts split per expert (``part`` = (expert, rows) of the stacked tensor, else None; a
    callable for a tensor stored in a declared layout, ``stored``: models/hf_stored.py)."""
    for name, shape in named_shapes:
        base = name.rsplit(".", 1)[0]
        if entry := stored_entry(stored, name):
            yield (
                entry.checkpoint_name(name), entry.stored_shape(shape), name,
                entry.to_checkpoint,
            )  # fmt: skip
        elif name.endswith("experts.w_gate_up"):
            for e in range(shape[0]):
                yield f"{base}.{e}.gate_proj.weight", (F, shape[2]), name, (e, slice(0, F))
                yield f"{base}.{e}.up_proj.weight", (F, shape[2]), name, (e, slice(F, 2 * F))
        elif name.endswith("experts.w_down"):
            for e in range(shape[0]):
                yield f"{base}.{e}.down_proj.weight", tuple(shape[1:]), name, (e, slice(None))
        else:
            yield name, tuple(shape), name, None


def _entry(name: str, shape: tuple, dtype: torch.dtype) -> tuple[str, tuple, int, str]:
    return (
        name,
        tuple(shape),
        math.prod(shape) * torch.empty((), dtype=dtype).element_size(),
        _ST_DTYPES[dtype],
    )


def _plan(entries: list, max_shard_bytes: int) -> list[list]:
    """Consecutive entries into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards, size = [[]], 0
    for entry in entries:
        if shards[-1] and size + entry[2] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[2]
    return shards


def _header(shard: list) -> bytes:
    head, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, nbytes, st_dtype in shard:
        head[name] = {
            "dtype": st_dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]  # numpy has no bf16
    return memoryview(t.view(as_int).numpy()).cast("B")


class _Source:
    """What a source HF directory adds to an export: its prefix for the language model and the
    tensors outside it (the family's skip list)."""

    def __init__(self, path: str, family, arch):
        self.path, self.family = path, family
        with HFCheckpoint(path, {}, ()) as ckpt:  # stored names, nothing renamed or skipped
            stored = list(ckpt.where)
            # an FP8 tensor comes out of ckpt.rows dequantized: carried in the export's dtype
            self.carried = [
                (n, ckpt.shape(n), None if n in ckpt.scales else ckpt.dtype(n))
                for n in stored
                if n.startswith(skip_prefixes(family, arch))
            ]
        self.prefix = next(
            ((p, o) for p, o in family.hf_prefixes.items() if any(n.startswith(p) for n in stored)),
            None,
        )

    def rename(self, name: str) -> str:
        if self.prefix and name.startswith(self.prefix[1]):
            return self.prefix[0] + name[len(self.prefix[1]) :]
        return name


# the files a loader starts from: moved into an existing directory after the rest
ENTRY_FILES = ("model.safetensors", "model.safetensors.index.json", "config.json")


def write_hf(
    out_dir: str,
    arch,
    named_shapes,
    tensors,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    source: str = "",
    root: str | None = None,
) -> None:
    """Write ``out_dir``: config.json and safetensors in ``dtype``. ``named_shapes``: (bumblebee
    name, global shape) of every parameter in the order ``tensors`` yields (name, full tensor);
    ``source``: the HF directory the model came from, whose extra tensors are carried over.
    The files are written beside ``out_dir`` and moved in when all are complete
    (``safe_write.staged_dir``; ``root``: the directory of the caller's below which no link is
    followed), replacing an earlier export's weight files: a failure leaves it as it was."""
    check_export_target(out_dir, source)
    try:
        with safe_write.staged_dir(
            out_dir, doing="write the export", root=root, last=ENTRY_FILES
        ) as stage:
            written = write_hf_files(
                stage.path,
                arch,
                named_shapes,
                tensors,
                dtype=dtype,
                max_shard_bytes=max_shard_bytes,
                source=source,
            )
            if os.path.isdir(out_dir):
                stage.remove(stale_weight_files(out_dir, written))
    except DiskFullError as e:  # name the export, not its staging directory
        raise disk_full(out_dir, "write the export", getattr(e, "cause", e)) from None


@torch.no_grad()
def write_hf_files(
    out_dir: str,
    arch,
    named_shapes,
    tensors,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    source: str = "",
) -> list[str]:
    """``write_hf``'s files, written into ``out_dir`` (a new directory: ``staged_dir``'s);
    returns the weight files written."""
    F = arch.moe_intermediate_size
    family = family_of_model_type(arch.model_type)
    src = _Source(source, family, arch) if source else None
    layout = list(hf_layout(named_shapes, F, family.hf_stored))
    if (
        family.hf_name_out
    ):  # names that need the arch (DeepSeek's MTP modules at model.layers.{L + k})
        layout = [
            (family.hf_name_out(arch, h), shape, name, part) for h, shape, name, part in layout
        ]
    if family.hf_copies:  # copies right after their tensor: the stream yields it once
        copies = family.hf_copies(arch)
        layout = [
            row
            for entry in layout
            for row in [entry]
            + [
                (c, entry[1], entry[2], entry[3])
                for c in copies.get(entry[2], ())
                if entry[3] is None
            ]
        ]
    entries = [_entry(src.rename(h) if src else h, shape, dtype) for h, shape, _, _ in layout]
    written = {e[0] for e in entries}
    carried = [
        _entry(n, s, d or dtype) for n, s, d in (src.carried if src else []) if n not in written
    ]  # never twice
    shards = _plan(entries, max_shard_bytes)
    extra = _plan(carried, max_shard_bytes) if carried else []
    total = len(shards) + len(extra)
    names = (
        ["model.safetensors"]
        if total == 1
        else [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
    )
    parts = _parts(layout, tensors)
    for fname, shard in zip(names, shards):
        with safe_write.AtomicFile(os.path.join(out_dir, fname), doing="write the export") as f:
            f.write(_header(shard))
            for _ in shard:
                f.write(_raw(next(parts).to(dtype)))
    assert next(parts, None) is None, "more tensors than parameters"
    if extra:
        _carry(src, out_dir, names[len(shards) :], extra)
    if total > 1:
        weight_map = {e[0]: fname for fname, shard in zip(names, shards + extra) for e in shard}
        nbytes = sum(e[2] for shard in shards + extra for e in shard)
        index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
        safe_write.write_file(
            os.path.join(out_dir, "model.safetensors.index.json"),
            json.dumps(index, indent=2),
            doing="write the export",
        )
    _config(out_dir, arch, dtype, src)
    return names + (["model.safetensors.index.json"] if total > 1 else [])


def _parts(layout, tensors):
    """The HF tensors of ``layout`` from (name, full tensor) pairs, one parameter at a time."""
    current, t, it = None, None, iter(tensors)
    for _, _, name, part in layout:
        if name != current:
            got, t = next(it)
            assert got == name, (got, name)
            current = name
        if part is None:
            yield t
        else:
            yield part(t) if callable(part) else t[part[0], part[1]]


def _carry(src: _Source, out_dir: str, fnames: list[str], shards) -> None:
    with HFCheckpoint(src.path, {}, ()) as ckpt:
        for fname, shard in zip(fnames, shards):
            with safe_write.AtomicFile(os.path.join(out_dir, fname), doing="write the export") as f:
                f.write(_header(shard))
                for name, _, _, st_dtype in shard:
                    f.write(_raw(ckpt.rows(name).to(_FROM_ST[st_dtype])))


def _config(out_dir: str, arch, dtype: torch.dtype, src: _Source | None) -> None:
    cfg = arch.to_hf_dict()
    cfg["dtype"] = DTYPE_NAMES.get(dtype, "float32")
    if src is not None:
        with open(os.path.join(src.path, "config.json"), encoding="utf-8") as f:
            outer = json.load(f)
        if isinstance(
            outer.get("text_config"), dict
        ):  # the multimodal wrapper: our arch is its text part
            text_type = outer["text_config"].get("model_type", cfg["model_type"])
            outer["text_config"] = {**outer["text_config"], **cfg, "model_type": text_type}
            cfg = outer
        for d in (cfg, cfg.get("text_config") or {}):
            d.pop("quantization_config", None)  # the weights are written dequantized
        for name in os.listdir(src.path):  # tokenizer, processor, chat template, generation config
            path = os.path.join(src.path, name)
            if (
                os.path.isfile(path)
                and name != "config.json"
                and not name.endswith(".safetensors")
                and name != "model.safetensors.index.json"
            ):
                safe_write.copy_file(path, os.path.join(out_dir, name), doing="write the export")
    safe_write.write_file(
        os.path.join(out_dir, "config.json"), json.dumps(cfg, indent=2), doing="write the export"
    )
