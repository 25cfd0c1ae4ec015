"""Reading a Hugging Face checkpoint into a model that holds only its share of it.

The model may be one pipeline stage, hold a block of the experts (expert parallelism)
and FSDP2 shards of every tensor; every rank reads only the rows it owns, with
``safetensors.safe_open(...).get_slice(name)[lo:hi]`` (the file is memory-mapped: rows
nobody asked for are never read), converting the dtype on the fly into the live tensor.
No rank ever holds the checkpoint, or one full tensor of it.

Checked before any data is read, on every rank alike (from the file headers and a meta-device
build of the whole model): every checkpoint tensor is a model tensor (after the family's
renames and skip list: the multimodal wrapper's ``model.language_model.`` prefix, its vision
tower and MTP head, models/family.py) with the model's shape and a floating-point dtype, and
every model tensor is in the checkpoint; anything else is a one-line ``CheckpointError``
naming the tensor. Expert tensors come per expert (HF's files:
``mlp.experts.{e}.{gate,up,down}_proj.weight``) or fused (``experts.gate_up_proj`` [E, 2F, H],
``experts.down_proj`` [E, H, F]); bumblebee stacks them as ``w_gate_up`` / ``w_down``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import ExitStack

import torch
from safetensors import SafetensorError, safe_open

from bumblebee.errors import CheckpointError
from bumblebee.models.base import persistent_buffers
from bumblebee.models.family import family_of_model_type
from bumblebee.models.mtp_names import skip_prefixes
from bumblebee.primitives.sharding.common import row_extent

EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def weight_files(path: str) -> list[str]:
    """The safetensors files of a HF directory (one file, or the shards an index names)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a JSON object ({e})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(
                f"{index}: needs a 'weight_map' object of tensor name -> file name"
            )
        files = sorted(set(weight_map.values()))
        if any(os.path.basename(n) != n for n in files):
            raise CheckpointError(f"{index}: weight_map names a file outside {path}")
        missing = [n for n in files if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise CheckpointError(f"{path}: index names missing shard(s) {missing}")
        return [os.path.join(path, n) for n in files]
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _unreadable(file: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"{file}: unreadable safetensors file ({str(e).splitlines()[0][:200]})")


class HFCheckpoint:
    """The tensors of a HF directory by bumblebee name (renamed, skip list applied), read lazily.
    A context manager: the files stay open (memory-mapped) while it is."""

    def __init__(
        self, path: str, renames: dict | None = None, skip_prefixes: tuple = (), name_in=None
    ):
        self.path, self.renames, self.skip_prefixes = path, renames or {}, tuple(skip_prefixes)
        self.name_in = (
            name_in  # the family's arch-aware map (DeepSeek's MTP layers); "" = a shared copy
        )
        self.files = weight_files(path)
        self.where: dict[
            str, tuple[object, str, str]
        ] = {}  # our name -> (handle, stored name, file)
        self.skipped: list[str] = []  # stored names under the skip list

    def __enter__(self):
        self._stack = ExitStack()
        for file in self.files:
            try:
                handle = self._stack.enter_context(safe_open(file, framework="pt"))
                names = list(handle.keys())
            except (OSError, RuntimeError, SafetensorError) as e:
                self._stack.close()
                raise _unreadable(file, e) from None
            for stored in names:
                if stored.startswith(self.skip_prefixes):
                    self.skipped.append(stored)
                    continue
                ours = next(
                    (o + stored[len(p) :] for p, o in self.renames.items() if stored.startswith(p)),
                    stored,
                )
                ours = self.name_in(ours) if self.name_in else ours
                if (
                    ours
                ):  # "": a copy of a shared tensor (DeepSeek's per-MTP-module embedding / head)
                    self.where[ours] = (handle, stored, file)
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _slice(self, name: str):
        handle, stored, file = self.where[name]
        try:
            return handle.get_slice(stored)
        except (OSError, RuntimeError, SafetensorError) as e:
            raise _unreadable(file, e) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype | str:
        kind = self._slice(name).get_dtype()
        return _DTYPES.get(kind, kind)

    def rows(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Rows [lo, hi) of dim 0 (all of it by default): only those bytes are read."""
        handle, stored, file = self.where[name]
        try:
            sl = handle.get_slice(stored)
            return sl[lo:hi] if sl.get_shape() else handle.get_tensor(stored)
        except (OSError, RuntimeError, SafetensorError) as e:
            raise _unreadable(file, e) from None


def _plan(ckpt: HFCheckpoint, full: dict[str, tuple], F: int, tied: bool) -> dict[str, str]:
    """Check every checkpoint tensor against the whole model's tensors ``full`` (name -> global
    shape); returns, for each stacked expert tensor, "fused" or "per_expert"."""
    experts = {n: s for n, s in full.items() if n.endswith(("experts.w_gate_up", "experts.w_down"))}
    kinds: dict[str, str] = {}
    covered: set[str] = set()
    for name in ckpt.where:
        file = ckpt.where[name][2]
        if m := EXPERT.match(name):
            base, e, proj = m.group(1), int(m.group(2)), m.group(3)
            target = f"{base}.w_down" if proj == "down_proj" else f"{base}.w_gate_up"
            if target not in experts or e >= experts[target][0]:
                raise CheckpointError(f"unexpected tensor {name} for this model")
            E, a, b = experts[target]
            want = (a, b) if proj == "down_proj" else (F, b)
            kinds[target] = "per_expert"
        elif m := FUSED.match(name):
            target = f"{m.group(1)}.{'w_gate_up' if m.group(2) == 'gate_up_proj' else 'w_down'}"
            if target not in experts:
                raise CheckpointError(f"unexpected tensor {name} for this model")
            want, kinds[target] = experts[target], "fused"
        elif name in full:
            want = full[name]
        elif name == "lm_head.weight" and tied:
            continue  # tied checkpoints sometimes store the head too
        else:
            raise CheckpointError(f"unexpected tensor {name} in {file}")
        shape, dtype = ckpt.shape(name), ckpt.dtype(name)
        if shape != tuple(want):
            raise CheckpointError(
                f"shape mismatch for {name}: checkpoint {shape}, model {tuple(want)}"
            )
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise CheckpointError(
                f"{name} is stored as {dtype}; model weights must be floating point"
            )
        covered.add(name)
    missing = []
    for name in full:
        if name not in experts:
            missing += [] if name in covered else [name]
        elif kinds.get(name) != "fused":
            base = name.rsplit(".", 1)[0]
            projs = ("gate_proj", "up_proj") if name.endswith("w_gate_up") else ("down_proj",)
            missing += [
                n
                for e in range(full[name][0])
                for p in projs
                if (n := f"{base}.{e}.{p}.weight") not in covered
            ]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(
            f"{ckpt.path}: checkpoint lacks {', '.join(sorted(missing)[:3])}{more}"
        )
    return kinds


@torch.no_grad()
def load_hf_weights(model, path: str) -> None:
    """Fill this rank's share of ``model`` (a whole model, or a pipeline stage / expert slice /
    FSDP2 shards of one: ``model.groups`` says which experts) from the HF checkpoint at ``path``,
    reading only the rows it owns; every tensor of the whole model must be in the checkpoint."""
    family = family_of_model_type(model.arch.model_type)
    with torch.device("meta"):
        whole = family.model(
            model.arch, model.prims
        )  # the whole model's names and global shapes only
    full = {
        n: tuple(p.shape) for n, p in list(whole.named_parameters()) + persistent_buffers(whole)
    }
    F = model.arch.moe_intermediate_size
    ep, ep_rank = model.groups.ep_size, model.groups.ep_rank
    name_in = (lambda n: family.hf_name_in(model.arch, n)) if family.hf_name_in else None
    skip = skip_prefixes(family, model.arch)
    with HFCheckpoint(path, family.hf_prefixes, skip, name_in) as ckpt:
        kinds = _plan(ckpt, full, F, whole.lm_head is None)
        for name, p in list(model.named_parameters()) + persistent_buffers(
            model
        ):  # buffers: the router bias
            shape, lo, part = row_extent(p, model.is_expert_param(name), ep_rank, ep)
            hi = lo + (part.shape[0] if part.dim() else 1)
            assert shape == full[name], (name, shape, full[name])
            if part.numel() == 0:
                continue
            if kinds.get(name) == "per_expert":
                base = name.rsplit(".", 1)[0]
                for e in range(lo, hi):
                    if name.endswith("w_gate_up"):
                        part[e - lo, :F].copy_(ckpt.rows(f"{base}.{e}.gate_proj.weight"))
                        part[e - lo, F:].copy_(ckpt.rows(f"{base}.{e}.up_proj.weight"))
                    else:
                        part[e - lo].copy_(ckpt.rows(f"{base}.{e}.down_proj.weight"))
            elif kinds.get(name) == "fused":
                stored = f"{name.rsplit('.', 1)[0]}.{'gate_up_proj' if name.endswith('w_gate_up') else 'down_proj'}"
                part.copy_(ckpt.rows(stored, lo, hi))
            else:
                part.copy_(ckpt.rows(name, lo, hi) if part.dim() else ckpt.rows(name))
        if ckpt.skipped:
            print(
                f"bumblebee: ignored {len(ckpt.skipped)} checkpoint tensor(s) under "
                f"{', '.join(skip)} (not part of the language model)",
                file=sys.stderr,
            )
