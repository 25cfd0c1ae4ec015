"""What each rank owns of the training state, and how DCP writes and reads it.

Layout independence. Every tensor (a parameter or its optimizer state) is stored
flattened to 1-D at its *global* size, expert tensors with all E experts. Every
layout gives a rank one contiguous range of that flat tensor: FSDP2 shards dim 0
(a row range), expert parallelism owns a block of experts (dim 0), zero1 slices
the flattened parameter, a single process owns everything. A rank therefore
describes its state as pieces (key, offset, 1-D view of live memory); the save
planner writes each piece as one chunk (DCP drops replicas and checks that the
chunks tile each tensor), and the load planner reads, for each piece, the overlap
of every saved chunk with the range the rank owns now. So any save layout
(sharding none/zero1/fsdp2, any dp_shard x cp x ep) loads into any other.
``get_state_dict`` cannot describe this: with ep > 1 one parameter name holds
different experts on different ranks, and zero1's optimizer state belongs to flat
slices of the parameters.

Safety. DCP's reader would unpickle ``.metadata`` and byte items; here the metadata
goes through an allow-list unpickler (DCP's metadata classes, torch sizes and
dtypes), byte items are refused, and tensors load with ``weights_only=True``. What the
metadata says is checked before DCP acts on it (``check_metadata``): every chunk is stored in a
file the marker lists, inside that file's size, without a stream transform; and DCP opens every
file through reader.py (a plain name inside the checkpoint, a regular file of its size).

Keys: ``model/<param>`` (and ``model/<buffer>`` for persistent buffers such as the
``sigmoid_bias`` router's bias, replicated on every rank), ``optim/<param>/<state>``,
``rng/<rank>/<generator>``.
"""

from __future__ import annotations

import math
import os
import pickle
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor, Shard

from bumblebee.errors import disk_full, out_of_room
from bumblebee.models.base import persistent_buffers
from bumblebee.models.hf import CheckpointError
from bumblebee.runtime.checkpoint.reader import check_name, open_file, shown
from bumblebee.runtime.launch.interrupts import stop_signal


# ------------------------------------------------------------------------------ what a rank owns
@dataclass
class Piece:
    """This rank's part of one stored tensor: ``local`` (a 1-D view of live memory) holds
    elements [offset, offset + local.numel()) of the flattened global tensor."""

    local: torch.Tensor
    offset: int
    shape: tuple[int, ...]  # global shape (experts: all E)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _param_piece(name: str, t: torch.Tensor, ep_rank: int, ep: int, is_expert: bool) -> Piece:
    """The piece of a parameter-shaped tensor ``t`` (the parameter or its optimizer state)."""
    shape, offset, local = tuple(t.shape), 0, t
    if isinstance(t, DTensor):  # fsdp2: dim 0 sharded over a 1-D mesh in torch.chunk sizes
        assert t.device_mesh.ndim == 1 and t.placements == (Shard(0),), (name, t.placements)
        w, r = t.device_mesh.size(), t.device_mesh.get_local_rank()
        rows = shape[0]
        chunk = -(-rows // w)
        start = min(rows, r * chunk)
        local = t.to_local()
        assert local.shape[0] == min(chunk, rows - start), (name, local.shape, rows, w, r)
        offset = start * math.prod(shape[1:])
    if ep > 1 and is_expert:  # this rank's block of experts among all E
        offset += ep_rank * math.prod(shape)
        shape = (shape[0] * ep, *shape[1:])
    return Piece(local.detach().view(-1), offset, shape)


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter the state AdamW creates at its first step (step 0, zero
    moments), so every rank saves and loads the same keys; AdamW then uses it as is."""
    assert isinstance(opt, torch.optim.AdamW), type(opt)
    step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state[p]:
                continue
            on_device = group.get("capturable") or group.get("fused")
            state = {
                "step": torch.zeros((), dtype=step_dtype, device=p.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            opt.state[p] = state


def state_pieces(
    model: torch.nn.Module, sharding, optimizer, ep_rank: int, ep: int
) -> dict[str, Piece]:
    """Keys ``model/<param>`` and ``optim/<param>/<state>`` -> this rank's pieces. The sharding
    primitive says which optimizer parameter holds each parameter's state and where in the
    flattened parameter that state starts (zero1: a slice of it)."""
    named = list(model.named_parameters())
    pieces = {
        f"model/{name}": _param_piece(name, p, ep_rank, ep, model.is_expert_param(name))
        for name, p in named
    }
    for name, b in persistent_buffers(
        model
    ):  # replicated state without optimizer state (router bias)
        pieces[f"model/{name}"] = Piece(b.detach().view(-1), 0, tuple(b.shape))
    ensure_optimizer_state(optimizer)
    owned = {id(q) for g in optimizer.param_groups for q in g["params"]}
    for name, p in named:
        if not p.requires_grad:  # frozen (a LoRA base): saved, but no optimizer state
            continue
        holder, start = sharding.optimizer_param(name, optimizer)
        # a parameter the optimizer does not hold has no state to save: the checkpoint would
        # silently lack it (an unsharded fsdp2 parameter: sharding.reshard() first)
        assert id(holder) in owned, f"{name}: not a parameter of the optimizer (unsharded?)"
        for k, v in optimizer.state[holder].items():
            key = f"optim/{name}/{k}"
            if v.dim() == 0:  # a scalar such as Adam's step count
                pieces[key] = Piece(v.view(-1), 0, (1,))
            elif start is not None:  # the range [start, start + numel) of the flattened parameter
                base = pieces[f"model/{name}"]
                pieces[key] = Piece(v.detach().view(-1), base.offset + start, base.shape)
            else:
                pieces[key] = _param_piece(name, v, ep_rank, ep, model.is_expert_param(name))
    return pieces


def rng_states(rank: int) -> dict[str, torch.Tensor]:
    """This rank's generators: torch (CPU), Python's ``random`` (its 625-word state), CUDA."""
    states = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(random.getstate()[1], dtype=torch.int64),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return {f"rng/{rank}/{k}": v for k, v in states.items()}


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    """Restore generators from ``rng_states``-style keys (a CUDA state only where CUDA is)."""
    for key, v in states.items():
        kind = key.rsplit("/", 1)[1]
        if kind == "torch":
            torch.set_rng_state(v)
        elif kind == "python":
            random.setstate((3, tuple(v.tolist()), None))
        elif kind == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(v)


# ------------------------------------------------------------------------------ DCP planners
def _chunk(p: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([p.offset]), sizes=torch.Size([p.local.numel()]))


class _SavePlanner(DefaultSavePlanner):
    """Each non-empty piece is one chunk of its flat global tensor; DCP's global plan drops
    replicas (equal key and offset) and checks that the chunks tile every tensor."""

    def __init__(self, pieces: dict[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(key, _chunk(p).offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(p),
                    size=torch.Size([p.numel]),
                    properties=TensorProperties.create_from_tensor(p.local),
                ),
            )
            for key, p in self.pieces.items()
            if p.local.numel()
        ]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.fqn].local


class _LoadPlanner(DefaultLoadPlanner):
    """Reads, for each piece, the overlap of every saved chunk with the range it owns."""

    def __init__(self, pieces: dict[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, p in self.pieces.items():
            if p.local.numel():
                items += create_read_items_for_chunk_list(
                    key, self.metadata.state_dict_metadata[key], [_chunk(p)]
                )
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.fqn].local

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(
            f"refusing to unpickle {read_item.dest_index.fqn}: a checkpoint holds tensors only"
        )


_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib._local", "PosixPath"),  # Python >= 3.13 pickles paths from here
    ("pathlib._local", "PurePosixPath"),
    ("pathlib._local", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata objects and nothing else (no arbitrary callables)."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _SAFE_GLOBALS or dtype:
            return super().find_class(module, name)
        raise CheckpointError(
            f"refusing to load {module}.{name} from .metadata (not a DCP metadata type)"
        )


def read_dcp_metadata(path: str, info: dict) -> Metadata:
    """The DCP ``.metadata`` of checkpoint directory ``path`` (``info``: its marker, as
    directory.read_marker validated it), through the allow-list unpickler, checked by
    ``check_metadata``."""
    files = info.get("files", {})
    if ".metadata" not in files:
        raise CheckpointError(f"{path}: its marker does not list .metadata (not a DCP checkpoint)")
    try:
        with open_file(path, ".metadata", files[".metadata"], "the checkpoint") as f:
            md = _MetadataUnpickler(f).load()
        check_metadata(path, md, files)
    except CheckpointError as e:
        text = str(e)
        raise CheckpointError(text if text.startswith(path) else f"{path}: {text}") from None
    # what an allow-listed constructor makes of crafted arguments, or a field missing from them
    except Exception as e:
        raise CheckpointError(
            f"{path}: unreadable .metadata ({type(e).__name__}: {shown(str(e))})"
        ) from None
    return md


def _size(value: object) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(n, int) and n >= 0 for n in value)


def check_metadata(path: str, md: object, files: dict[str, int]) -> None:
    """``md`` (unpickled from ``path``'s ``.metadata``) is DCP metadata whose every tensor chunk
    lies inside its tensor and is stored, untransformed, inside a file of ``files`` (the marker's
    names and sizes); a one-line ``CheckpointError`` otherwise. DCP trusts all of this."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: malformed .metadata ({what})")

    if type(md) is not Metadata:
        raise CheckpointError(f"{path}: .metadata is not DCP metadata")
    tensors, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(tensors, dict) or not isinstance(storage, dict):
        raise bad("no tensor or storage table")
    for index, where in storage.items():
        if type(index) is not MetadataIndex or not isinstance(index.fqn, str):
            raise bad(f"a storage key {shown(index)}")
        if type(where) is not _StorageInfo:
            raise bad(f"the storage of {shown(index.fqn)}")
        name = check_name(
            path, where.relative_path, f".metadata (the storage of {shown(index.fqn)})"
        )
        if name not in files:
            raise CheckpointError(
                f"{path}: .metadata stores {shown(index.fqn)} in {shown(name)}, a file its marker "
                "does not list"
            )
        start, length = where.offset, where.length
        if not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (start, length)
        ):
            raise bad(f"the byte range of {shown(index.fqn)}")
        if start + length > files[name]:
            raise CheckpointError(
                f"{path}: truncated checkpoint: .metadata places {shown(index.fqn)} at bytes "
                f"[{start}, {start + length}) of {name}, which has {files[name]}"
            )
        if getattr(where, "transform_descriptors", None):  # bumblebee writes plain files only
            raise bad(f"{shown(index.fqn)} is stored through a stream transform")
    for key, entry in tensors.items():
        if not isinstance(key, str):
            raise bad(f"a tensor name {shown(key)}")
        if type(entry) is BytesStorageMetadata:
            continue  # never loaded: the load planner refuses byte items
        if type(entry) is not TensorStorageMetadata or not _size(entry.size):
            raise bad(f"the entry of {shown(key)}")
        props = entry.properties
        if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
            raise bad(f"the dtype of {shown(key)}")
        if not isinstance(entry.chunks, list):
            raise bad(f"the chunks of {shown(key)}")
        for chunk in entry.chunks:
            if (
                type(chunk) is not ChunkStorageMetadata
                or not _size(chunk.offsets)
                or not _size(chunk.sizes)
                or not len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
                or any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size))
            ):
                raise bad(f"a chunk of {shown(key)} outside the tensor")
            if MetadataIndex(key, chunk.offsets) not in storage:
                raise bad(f"a chunk of {shown(key)} is stored nowhere")


class _CheckpointFiles(FileSystem):
    """DCP's file access confined to one checkpoint: a path DCP builds from a storage entry's
    name is opened through reader.py (a listed regular file of its size, no link followed)."""

    def __init__(self, path: str, files: dict[str, int]):
        super().__init__()
        self.root, self.files = path, files

    def concat_path(self, path, suffix: str):
        name = check_name(self.root, suffix, ".metadata")
        if name not in self.files:
            raise CheckpointError(
                f"{self.root}: .metadata names {shown(name)}, a file its marker does not list"
            )
        return os.path.join(self.root, name)

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if mode != "rb":
            raise CheckpointError(f"{self.root}: a checkpoint is opened for reading only")
        name = os.path.basename(os.fspath(path))
        with open_file(self.root, name, self.files.get(name), ".metadata") as f:
            yield f


class _SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allow-list unpickler and checked,
    and every data file opened through reader.py."""

    def __init__(self, path: str, info: dict):
        super().__init__(path)
        self.info = info
        self.fs = _CheckpointFiles(path, info.get("files", {}))

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = read_dcp_metadata(str(self.path), self.info)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


# ------------------------------------------------------------------------------ save / load
@contextmanager
def _unwrapped(path: str, doing: str):
    """DCP wraps every rank's exception, even ``KeyboardInterrupt``, in a ``CheckpointException``
    (a ``BaseException`` with a multi-rank traceback as its text). Raise what happened instead:
    Ctrl-C as ``KeyboardInterrupt`` and SIGTERM as ``Terminated`` (also when torch's writer
    turned them into a write error), bad input as itself, a full disk or another filesystem
    error as one line; on a read, anything else is the checkpoint's data not decoding (one line)."""
    try:
        yield
    except CheckpointException as e:
        errors = [exc for exc, _ in e.failures.values()]
        for exc in errors:
            if (stop := stop_signal(exc)) is not None:
                raise stop.with_traceback(None) from None
        for kind in (CheckpointError,):
            for exc in errors:
                if isinstance(exc, kind):
                    raise exc.with_traceback(None) from None
        for exc in errors:
            if out_of_room(exc):  # torch's zip writer says so as a RuntimeError
                raise disk_full(path, f"{doing} the checkpoint", exc) from None
        for exc in errors:
            if isinstance(exc, OSError):
                raise CheckpointError(
                    f"{path}: cannot {doing} the checkpoint ({exc.strerror or exc})"
                ) from None
        if doing == "read" and errors:
            exc = errors[0]
            first = (str(exc).strip().splitlines() or [""])[0]
            raise CheckpointError(
                f"{path}: unreadable tensor data ({type(exc).__name__}: {shown(first)})"
            ) from None
        raise


def save_pieces(path: str, pieces: dict[str, Piece], process_group=None) -> None:
    """Write ``pieces`` into directory ``path`` (collective over ``process_group``; ``None``:
    this process alone). Data files are fsynced before DCP writes ``.metadata``."""
    with warnings.catch_warnings(), _unwrapped(path, "write"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {k: p.local for k, p in pieces.items()},
            storage_writer=FileSystemWriter(path, sync_files=True),
            planner=_SavePlanner(pieces),
            process_group=process_group,
            no_dist=process_group is None,
        )


def load_pieces(path: str, pieces: dict[str, Piece], process_group=None, *, info: dict) -> None:
    """Fill ``pieces`` in place from checkpoint ``path`` (collective over ``process_group``;
    ``None`` with no process group: this process alone); ``info``: its marker, as
    directory.read_marker validated it (the files DCP may open and their sizes)."""
    with warnings.catch_warnings(), _unwrapped(path, "read"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            {k: p.local for k, p in pieces.items()},
            storage_reader=_SafeReader(path, info),
            planner=_LoadPlanner(pieces),
            process_group=process_group,
            no_dist=process_group is None,
        )
