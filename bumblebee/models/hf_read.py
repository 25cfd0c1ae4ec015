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
``experts.down_proj`` [E, H, F]); bumblebee stacks them as ``w_gate_up`` / ``w_down``. A family's
``hf_stored`` declarations (models/hf_stored.py) name tensors stored under another name or
layout (transposed, interleaved halves): their rows are read and converted as they arrive.

Block-FP8 checkpoints as released (DeepSeek-V3, Kimi-K2, MiniMax-M2, GLM FP8): ``config.json``
has ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [b0, b1]}``
and a weight stored as ``float8_e4m3fn`` comes with ``<name>_scale_inv`` (fp32, one value per
b0 x b1 block of its last two dims). Such a weight is dequantized as read, rows [lo, hi) with
the scale block rows that cover them (a slice may start or end inside a block):
``w = fp8.float() * scale_inv`` broadcast over the blocks, then cast to the model's dtype. The
``_scale_inv`` tensors are not model tensors; any other quantization (method, fmt, block size
not two positive ints, a scale whose shape does not match the block size, an fp8 weight without
its scale or a scale without its weight) is a one-line ``CheckpointError``.
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
from bumblebee.models.hf_config import read_hf_config
from bumblebee.models.hf_stored import model_name, stored_entry
from bumblebee.models.lora import is_lora_name
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
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE = "_scale_inv"  # suffix of a block-FP8 weight's scale: ``q_proj.weight_scale_inv``


def fp8_block_size(cfg: dict, where: str) -> tuple[int, int] | None:
    """The (rows, cols) block of a block-FP8 checkpoint's ``config.json`` dict, None when it
    declares no quantization; any quantization we cannot dequantize exactly is refused."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    what = f"{where}: quantization_config {json.dumps(q, sort_keys=True)[:160]}"
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        raise CheckpointError(
            f"{what} is not supported; bumblebee reads block FP8 (quant_method 'fp8')"
        )
    # transformers' fp8 config has no fmt (e4m3 implied); MiniMax spells it 'float8_e4m3fn'
    if q.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
        raise CheckpointError(f"{what}: fmt must be 'e4m3' (float8_e4m3fn weights)")
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"{what}: weight_block_size must be two positive ints, e.g. [128, 128]"
        )
    return block[0], block[1]


def checkpoint_block_size(path: str) -> tuple[int, int] | None:
    """``fp8_block_size`` of the ``config.json`` in HF directory ``path`` (None without one)."""
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return None
    d = read_hf_config(cfg)
    if isinstance(d.get("text_config"), dict) and "quantization_config" not in d:
        d = d["text_config"]
    return fp8_block_size(d, cfg)


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
        self.block = checkpoint_block_size(path)  # block-FP8 (rows, cols), or None
        self.scales: dict[str, tuple[object, str, str]] = {}  # our weight name -> its scale_inv

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
                # a scale is filed under its weight's name, so renames apply to both alike
                scale = stored.endswith(SCALE)
                weight = stored[: -len(SCALE)] if scale else stored
                ours = next(
                    (o + weight[len(p) :] for p, o in self.renames.items() if weight.startswith(p)),
                    weight,
                )
                ours = self.name_in(ours) if self.name_in else ours
                if (
                    ours
                ):  # "": a copy of a shared tensor (DeepSeek's per-MTP-module embedding / head)
                    table = self.scales if scale else self.where
                    if ours in table:  # which copy a load took would depend on the file order
                        self._stack.close()
                        raise CheckpointError(
                            f"{self.path}: tensor {stored} is stored twice, in "
                            f"{os.path.basename(table[ours][2])} and {os.path.basename(file)}"
                        )
                    table[ours] = (handle, stored, file)
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
        """Rows [lo, hi) of dim 0 (all of it by default): only those bytes are read. A block-FP8
        weight comes dequantized (fp32), reading only the scale blocks of those rows. NaN / inf
        values are a ``CheckpointError`` naming the tensor (bad input, not a failed step)."""
        t = self._rows(name, lo, hi)
        if t.is_floating_point() and t.dtype.itemsize > 1 and not bool(torch.isfinite(t).all()):
            _, stored, file = self.where[name]
            raise CheckpointError(
                f"{file}: tensor {stored} holds NaN or infinite values; the checkpoint is damaged"
            )
        return t

    def _rows(self, name: str, lo: int | None, hi: int | None) -> torch.Tensor:
        handle, stored, file = self.where[name]
        try:
            sl = handle.get_slice(stored)
            if name not in self.scales:
                return sl[lo:hi] if sl.get_shape() else handle.get_tensor(stored)
            shape = sl.get_shape()
            lo, hi, _ = slice(lo, hi).indices(shape[0])
            hi, b0 = max(lo, hi), self.block[0]
            scale = self.scales[name][0].get_slice(self.scales[name][1])
            # 2-D: dim 0 is block rows, so read the scale rows [lo, hi) touches; 3-D (stacked
            # experts): dim 0 is whole matrices, each with its own scale
            first = lo // b0 if len(shape) == 2 else lo
            s = scale[first : -(-hi // b0) if len(shape) == 2 else hi]
            w = sl[lo:hi]
        except (OSError, RuntimeError, SafetensorError) as e:
            raise _unreadable(file, e) from None
        return self._dequant(w, s, shape, lo - first * b0 if len(shape) == 2 else None)

    def scale_shape(self, name: str) -> tuple[int, ...]:
        """The ``_scale_inv`` shape the block size asks of weight ``name``."""
        *lead, r, c = self.shape(name)
        return (*lead, -(-r // self.block[0]), -(-c // self.block[1]))

    def _dequant(self, w: torch.Tensor, s: torch.Tensor, shape, skip: int | None) -> torch.Tensor:
        """``w.float() * s`` with each scale spread over its block; ``skip``: the rows of the
        first scale block before ``w`` starts (a slice starting inside a block)."""
        b0, b1 = self.block
        s = s.float().repeat_interleave(b0, -2)
        s = s[skip : skip + w.shape[0]] if skip is not None else s[..., : shape[-2], :]
        return w.float() * s.repeat_interleave(b1, -1)[..., : shape[-1]]


def _plan(
    ckpt: HFCheckpoint, full: dict[str, tuple], F: int, tied: bool, stored=()
) -> dict[str, str]:
    """Check every checkpoint tensor against the whole model's tensors ``full`` (name -> global
    shape; ``stored``: the family's ``hf_stored``); returns, for each stacked expert tensor,
    "fused", "per_expert" or "stored" (a declared layout)."""
    experts = {n: s for n, s in full.items() if n.endswith(("experts.w_gate_up", "experts.w_down"))}
    kinds: dict[str, str] = {}
    covered: set[str] = set()
    for name in ckpt.where:
        file = ckpt.where[name][2]
        if entry := stored_entry(stored, name):
            if name not in full:
                raise CheckpointError(f"unexpected tensor {ckpt.where[name][1]} for this model")
            want = entry.stored_shape(full[name])
            if name in experts:
                kinds[name] = "stored"
        elif m := EXPERT.match(name):
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
        _check_fp8(ckpt, name, shape, dtype)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise CheckpointError(
                f"{name} is stored as {dtype}; model weights must be floating point"
            )
        covered.add(name)
    if orphans := sorted(set(ckpt.scales) - set(ckpt.where)):
        raise CheckpointError(f"{ckpt.scales[orphans[0]][1]} is a scale without its weight")
    missing = []
    for name in full:
        if name not in experts:
            missing += [] if name in covered else [name]
        elif kinds.get(name) not in ("fused", "stored"):
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


def _check_fp8(ckpt: HFCheckpoint, name: str, shape: tuple, dtype) -> None:
    """An fp8 weight needs the declared block format and its scale of the matching shape;
    a scale needs an fp8 weight (anything else would be dequantized wrongly)."""
    stored = ckpt.where[name][1]
    if name in ckpt.scales and dtype not in FP8:
        raise CheckpointError(f"{stored} is stored as {dtype} but has a {SCALE} tensor")
    if dtype not in FP8:
        return
    if ckpt.block is None:
        raise CheckpointError(
            f"{stored} is stored as {dtype} but config.json declares no block-FP8 "
            "quantization_config"
        )
    if dtype != torch.float8_e4m3fn or len(shape) < 2:
        raise CheckpointError(
            f"{stored} is stored as {dtype} {list(shape)}; block FP8 needs float8_e4m3fn matrices"
        )
    if name not in ckpt.scales:
        raise CheckpointError(f"{stored} is stored as {dtype} without its {stored}{SCALE}")
    handle, sname, _ = ckpt.scales[name]
    got, want = tuple(handle.get_slice(sname).get_shape()), ckpt.scale_shape(name)
    sdtype = _DTYPES.get(handle.get_slice(sname).get_dtype())
    if got != want or sdtype not in (torch.float32, torch.bfloat16):
        raise CheckpointError(
            f"{sname}: {sdtype} {list(got)}, expected float32 {list(want)} "
            f"(weight_block_size {list(ckpt.block)} over {list(shape)})"
        )


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
    declared = family.hf_stored  # tensors stored under another name / layout

    def name_in(n):
        n = family.hf_name_in(model.arch, n) if family.hf_name_in else n
        return model_name(declared, n) if n else n

    skip = skip_prefixes(family, model.arch)
    with HFCheckpoint(path, family.hf_prefixes, skip, name_in) as ckpt:
        kinds = _plan(ckpt, full, F, whole.lm_head is None, declared)
        for name, p in list(model.named_parameters()) + persistent_buffers(
            model
        ):  # buffers: the router bias
            if is_lora_name(name):  # adapters (models/lora.py) start from their init, not the file
                continue
            shape, lo, part = row_extent(p, model.is_expert_param(name), ep_rank, ep)
            hi = lo + (part.shape[0] if part.dim() else 1)
            assert shape == full[name], (name, shape, full[name])
            if part.numel() == 0:
                continue
            if entry := stored_entry(declared, name):
                rows = ckpt.rows(name, lo, hi) if part.dim() else ckpt.rows(name)
                part.copy_(entry.from_checkpoint(rows))
            elif kinds.get(name) == "per_expert":
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
