"""The prepared-token format: flat memory-mapped arrays that any rank can read by offset.

A prepared directory (``bumblebee data prepare ... OUT``) holds:

    tokens.u32     uint32 [N]       every document's tokens, back to back
    loss_mask.u8   uint8  [N]       1 where the token is a prediction target
    offsets.i64    int64  [D + 1]   document d is tokens[offsets[d]:offsets[d + 1]]
    doc_loss.i64   int64  [D]       labels each document gives when packed whole (sum of mask[1:])
    meta.json      counts, the tokenizer, EOS id, skipped-record counts (written last: its
                   presence marks a complete directory)

All arrays are little-endian raw binaries (``numpy.memmap``), so opening a
corpus costs no reads: a rank touches only the tokens of the rows it trains on.
``doc_loss`` lets the packer count every row's labels without reading tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from bumblebee import safe_write
from bumblebee.data.errors import DataError

FORMAT = "bumblebee-tokens"
VERSION = 1
FILES = {
    "tokens": ("tokens.u32", np.uint32),
    "mask": ("loss_mask.u8", np.uint8),
    "offsets": ("offsets.i64", np.int64),
    "doc_loss": ("doc_loss.i64", np.int64),
}
NAMES = [name for name, _ in FILES.values()] + ["meta.json"]


@dataclass
class TokenStore:
    """Documents as flat arrays (memory-mapped from disk, or in memory for a run that
    tokenizes on the fly). ``meta`` carries counts and provenance."""

    tokens: np.ndarray  # uint32 [N]
    mask: np.ndarray  # uint8 [N]
    offsets: np.ndarray  # int64 [D + 1]
    doc_loss: np.ndarray  # int64 [D]
    meta: dict
    location: str = ""  # the prepared directory it was opened from ("" in memory)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def document(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = int(self.offsets[d]), int(self.offsets[d + 1])
        return self.tokens[s:e], self.mask[s:e]


def doc_loss_counts(mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per document, the number of labels it yields: mask[1:] of the document (its first
    token is never a target: nothing in the same document precedes it)."""
    csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    starts, ends = offsets[:-1], offsets[1:]
    first = mask[starts].astype(np.int64) if len(starts) else np.zeros(0, np.int64)
    return csum[ends] - csum[starts] - first


def from_documents(docs: list[tuple[list[int], list[int]]], meta: dict) -> TokenStore:
    """An in-memory store from (tokens, mask) pairs."""
    lengths = np.array([len(t) for t, _ in docs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter(
        (t for ids, _ in docs for t in ids), dtype=np.uint32, count=int(offsets[-1])
    )
    mask = np.fromiter((m for _, ms in docs for m in ms), dtype=np.uint8, count=int(offsets[-1]))
    return TokenStore(tokens, mask, offsets, doc_loss_counts(mask, offsets), meta)


class StoreWriter:
    """Appends documents chunk by chunk; ``close`` writes the offsets and meta.json. Every file
    goes through ``safe_write`` (hidden temporaries renamed in when complete, meta.json last, no
    link in ``out_dir`` written through)."""

    def __init__(self, out_dir: str):
        # a link planted for any name written is refused before the work, not at its end
        safe_write.refuse_links(*(os.path.join(out_dir, n) for n in NAMES))
        if os.path.exists(os.path.join(out_dir, "meta.json")):
            raise DataError(
                f"{out_dir} already holds prepared data (meta.json); choose a new directory"
            )
        self._created = not os.path.isdir(out_dir)
        safe_write.make_dirs(out_dir)
        # an earlier prepare killed here (SIGKILL, power loss) left its temporaries; the caller
        # holds OUT's lock, so none of them is a live writer's
        safe_write.sweep_temporaries(out_dir, NAMES)
        self.out_dir = out_dir
        self._tokens = self._mask = None
        self._tokens = self._file("tokens")
        self._mask = self._file("mask")
        self._done: list[str] = []  # files already renamed in
        self._lengths: list[np.ndarray] = []
        self._doc_loss: list[np.ndarray] = []
        self.num_tokens = 0
        self.loss_tokens = 0

    def _file(self, key: str) -> safe_write.AtomicFile:
        return safe_write.AtomicFile(
            os.path.join(self.out_dir, FILES[key][0]), doing="write the prepared data"
        )

    def append(self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        assert (
            tokens.dtype == np.uint32
            and mask.dtype == np.uint8
            and len(tokens) == int(lengths.sum())
        )
        self._tokens.write(np.ascontiguousarray(tokens))
        self._mask.write(np.ascontiguousarray(mask))
        self._lengths.append(lengths.astype(np.int64))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._doc_loss.append(doc_loss_counts(mask, offsets))
        self.num_tokens += len(tokens)
        self.loss_tokens += int(self._doc_loss[-1].sum())

    def abort(self) -> None:
        """Remove what was written (a failed prepare leaves no half-written directory behind;
        a directory removed meanwhile is no error)."""
        for f in (self._tokens, self._mask):
            if f is not None:
                f.discard()
        for name in self._done:
            try:
                os.remove(os.path.join(self.out_dir, name))
            except FileNotFoundError:
                pass
        try:
            if self._created and not os.listdir(self.out_dir):
                os.rmdir(self.out_dir)
        except FileNotFoundError:
            pass

    def _write(self, name: str, data) -> None:
        safe_write.write_file(
            os.path.join(self.out_dir, name), data, doing="write the prepared data"
        )
        self._done.append(name)

    def close(self, meta: dict) -> dict:
        for f in (self._tokens, self._mask):
            f.commit()
            self._done.append(os.path.basename(f.path))
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._write(FILES["offsets"][0], offsets.astype("<i8"))
        doc_loss = np.concatenate(self._doc_loss) if self._doc_loss else np.zeros(0, np.int64)
        self._write(FILES["doc_loss"][0], doc_loss.astype("<i8"))
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "documents": len(lengths),
            "tokens": self.num_tokens,
            "loss_tokens": self.loss_tokens,
            **meta,
        }
        self._write("meta.json", json.dumps(meta, indent=1))  # last: marks it complete
        return meta


_INT_KEYS = ("documents", "tokens", "loss_tokens")
_OPTIONAL = {
    "max_token_id": int,
    "skipped_total": int,
    "tokenizer": str,
    "source": str,
    "kind": str,
    "skipped": dict,
    "notes": dict,
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_meta(path: str) -> dict:
    """meta.json of a prepared directory, checked: a JSON object with the counts as
    non-negative integers and the optional fields of the right types (one line otherwise)."""
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path, "rb") as f:
            raw = f.read()
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise DataError(
            f"{meta_path}: not UTF-8 text (a corrupt meta.json); prepare the data again"
        ) from None
    except (json.JSONDecodeError, RecursionError) as e:
        why = (
            f"line {e.lineno}: {e.msg}"
            if isinstance(e, json.JSONDecodeError)
            else "nested too deeply"
        )
        raise DataError(f"{meta_path}: not valid JSON ({why}); prepare the data again") from None
    except OSError as e:
        raise DataError(f"{meta_path}: cannot read: {e.strerror or e}") from None
    if not isinstance(meta, dict):
        raise DataError(
            f"{meta_path}: must be a JSON object, got {type(meta).__name__}; prepare the data again"
        )
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(
            f"{path}: unknown token format {meta.get('format')!r} v{meta.get('version')!r}"
        )
    for k in _INT_KEYS:
        if k not in meta:
            raise DataError(f"{meta_path}: lacks '{k}'; prepare the data again")
        if not _is_int(meta[k]) or meta[k] < 0:
            raise DataError(f"{meta_path}: '{k}' must be a non-negative integer, got {meta[k]!r}")
    for k, t in _OPTIONAL.items():
        if k in meta and not (_is_int(meta[k]) if t is int else isinstance(meta[k], t)):
            raise DataError(
                f"{meta_path}: '{k}' must be {'an integer' if t is int else 'a ' + t.__name__}, "
                f"got {type(meta[k]).__name__}"
            )
    for k in ("skipped", "notes"):
        if any(not _is_int(v) for v in meta.get(k, {}).values()):
            raise DataError(f"{meta_path}: '{k}' must map names to integer counts")
    if meta["loss_tokens"] > meta["tokens"]:
        raise DataError(
            f"{meta_path}: 'loss_tokens' {meta['loss_tokens']} exceeds 'tokens' {meta['tokens']}"
        )
    return meta


def open_store(path: str) -> TokenStore:
    """Memory-map a prepared directory; a missing, incomplete or inconsistent one is a one-line error."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise DataError(
            f"{path}: not a prepared token directory (no meta.json); "
            "make one with `bumblebee data prepare`"
        )
    meta = read_meta(path)
    arrays = {}
    for key, (name, dtype) in FILES.items():
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            raise DataError(f"{path}: missing {name}")
        size, item = os.path.getsize(p), np.dtype(dtype).itemsize
        if size % item:
            raise DataError(
                f"{p}: {size} bytes is not a whole number of {np.dtype(dtype).name} values (truncated)"
            )
        n = size // item
        arrays[key] = np.memmap(p, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
    store = TokenStore(meta=meta, location=path, **arrays)
    if (
        len(store.offsets) < 1
        or store.num_docs != meta["documents"]
        or len(store.tokens) != meta["tokens"]
        or len(store.mask) != len(store.tokens)
        or len(store.doc_loss) != store.num_docs
        or int(store.offsets[-1]) != len(store.tokens)
    ):
        raise DataError(f"{path}: array sizes disagree with meta.json (truncated or mixed files)")
    off = os.path.join(path, FILES["offsets"][0])
    if int(store.offsets[0]) != 0:
        raise DataError(
            f"{off}: the first offset is {int(store.offsets[0])}, not 0 (corrupt offsets)"
        )
    lengths = store.lengths
    if len(lengths) and int(lengths.min()) < 0:
        d = int(np.argmax(lengths < 0))
        raise DataError(
            f"{off}: offsets decrease at document {d} ({int(store.offsets[d])} -> "
            f"{int(store.offsets[d + 1])}): corrupt offsets; prepare the data again"
        )
    if len(store.doc_loss) and (
        int(store.doc_loss.min()) < 0 or bool((store.doc_loss > lengths).any())
    ):
        raise DataError(
            f"{os.path.join(path, FILES['doc_loss'][0])}: label counts outside [0, document length] "
            "(corrupt file); prepare the data again"
        )
    if len(store.mask) and int(store.mask.max()) > 1:
        raise DataError(
            f"{os.path.join(path, FILES['mask'][0])}: values other than 0/1 (corrupt file)"
        )
    return store
