"""Reading user records in chunks from JSONL, Parquet, or a directory saved by ``datasets``.

``scan(path)`` lists the files of an input and the total work (bytes for JSONL,
rows for columnar files) for a progress bar; ``chunks(files)`` yields ``Chunk``s
of a few hundred records in file order. A JSONL chunk carries raw lines (a worker
parses them, so JSON decoding runs in parallel too); a columnar chunk carries
dicts. Each record keeps its position so an error can say ``file:line`` (JSONL)
or ``file:row N`` (Parquet / Arrow).

Accepted inputs: a ``.jsonl`` file, a ``.parquet`` file, a ``datasets`` directory
(``save_to_disk``: ``state.json`` + Arrow stream files; a ``DatasetDict`` directory
reads its ``train`` split), or a plain directory of ``.jsonl`` / ``.parquet`` files
(read in name order). Columnar files need ``pyarrow`` (the ``[data]`` extra);
``datasets`` itself is not needed to read what it saved.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator

from bumblebee.data.errors import DataError, require

CHUNK = 256  # records per chunk handed to a worker


@dataclass
class Chunk:
    path: str
    first: int  # 1-based line / row number of items[0]
    items: list  # raw JSONL lines (bytes) or record dicts
    units: int  # progress units this chunk consumed
    columnar: bool

    def where(self, i: int) -> str:
        n = self.first + i
        return f"{self.path}:row {n}" if self.columnar else f"{self.path}:{n}"


def scan(path: str) -> tuple[list[tuple[str, str]], int, str]:
    """([(kind, file)], total progress units, unit name) for an input path."""
    if os.path.isfile(path):
        files = [(_kind(path), path)]
    elif os.path.isdir(path):
        files = _dir_files(path)
    else:
        raise DataError(f"input not found: {path}")
    total = 0
    for kind, f in files:
        total += os.path.getsize(f) if kind == "jsonl" else _num_rows(kind, f)
    unit = "B" if all(k == "jsonl" for k, _ in files) else "rows"
    if unit == "rows":  # mixed inputs: count rows of JSONL too (one pass over the newlines)
        total = sum(_count_lines(f) if k == "jsonl" else _num_rows(k, f) for k, f in files)
    return files, total, unit


def _kind(f: str) -> str:
    if f.endswith(".jsonl"):
        return "jsonl"
    if f.endswith(".parquet"):
        return "parquet"
    if f.endswith(".arrow"):
        return "arrow"
    raise DataError(f"{f}: unknown input format; expected .jsonl, .parquet, or a directory saved by datasets")


def _dir_files(path: str) -> list[tuple[str, str]]:
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(splits)}); "
                            "point data.path at the split directory")
        return _dir_files(os.path.join(path, "train"))
    if os.path.isfile(os.path.join(path, "state.json")):
        with open(os.path.join(path, "state.json")) as f:
            names = [d["filename"] for d in json.load(f).get("_data_files", [])]
        return [("arrow", os.path.join(path, n)) for n in names]
    files = sorted(f for f in os.listdir(path) if f.endswith((".jsonl", ".parquet")))
    if not files:
        raise DataError(f"{path}: no .jsonl or .parquet files, and not a directory saved by datasets")
    return [(_kind(f), os.path.join(path, f)) for f in files]


def _num_rows(kind: str, f: str) -> int:
    if kind == "jsonl":
        return _count_lines(f)
    if kind == "parquet":
        pq = require("pyarrow.parquet", "reading Parquet")
        return pq.ParquetFile(f).metadata.num_rows
    ipc = require("pyarrow.ipc", "reading a datasets directory")
    with open(f, "rb") as fh:
        return sum(b.num_rows for b in ipc.open_stream(fh))


def _count_lines(f: str) -> int:
    with open(f, "rb") as fh:
        return sum(buf.count(b"\n") for buf in iter(lambda: fh.read(1 << 20), b""))


def chunks(files: list[tuple[str, str]], size: int = CHUNK) -> Iterator[Chunk]:
    for kind, f in files:
        yield from (_jsonl_chunks(f, size) if kind == "jsonl" else _columnar_chunks(kind, f, size))


def _jsonl_chunks(f: str, size: int) -> Iterator[Chunk]:
    with open(f, "rb") as fh:
        first, lines, nbytes = 1, [], 0
        for line in fh:
            lines.append(line)
            nbytes += len(line)
            if len(lines) == size:
                yield Chunk(f, first, lines, nbytes, False)
                first, lines, nbytes = first + size, [], 0
        if lines:
            yield Chunk(f, first, lines, nbytes, False)


def _columnar_chunks(kind: str, f: str, size: int) -> Iterator[Chunk]:
    if kind == "parquet":
        pq = require("pyarrow.parquet", "reading Parquet")
        batches = pq.ParquetFile(f).iter_batches(batch_size=size)
        yield from _batches(f, batches)
        return
    ipc = require("pyarrow.ipc", "reading a datasets directory")
    with open(f, "rb") as fh:
        yield from _batches(f, (big.slice(i, size) for big in ipc.open_stream(fh)
                                for i in range(0, big.num_rows, size)))


def _batches(f: str, batches) -> Iterator[Chunk]:
    first = 1
    for b in batches:
        rows = b.to_pylist()
        yield Chunk(f, first, rows, len(rows), True)
        first += len(rows)


def parse_line(line: bytes):
    """One JSONL line -> a record, None for a blank line; raises BadRecord."""
    from bumblebee.data.errors import BadRecord

    if not line.strip():
        return None
    try:
        return json.loads(line)
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise BadRecord(f"not valid JSON ({e.msg})") from None
