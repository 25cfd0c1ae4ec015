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
from collections.abc import Iterator
from dataclasses import dataclass

from bumblebee.data.errors import DataError, check_json_object, require

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
    raise DataError(
        f"{f}: unknown input format; expected .jsonl, .parquet, or a directory saved by datasets"
    )


def _dir_files(path: str) -> list[tuple[str, str]]:
    dd = check_json_object(os.path.join(path, "dataset_dict.json"), "datasets directory")
    if dd is not None:
        splits = dd.get("splits", [])
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise DataError(
                f"{os.path.join(path, 'dataset_dict.json')}: 'splits' must be a list of names"
            )
        if "train" not in splits:
            raise DataError(
                f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(splits)}); "
                "point data.path at the split directory"
            )
        return _dir_files(os.path.join(path, "train"))
    state_path = os.path.join(path, "state.json")
    state = check_json_object(state_path, "datasets directory")
    if state is not None:
        entries = state.get("_data_files")
        if (
            not isinstance(entries, list)
            or not entries
            or not all(isinstance(d, dict) and isinstance(d.get("filename"), str) for d in entries)
        ):
            raise DataError(
                f"{state_path}: '_data_files' must be a non-empty list of {{\"filename\": ...}} "
                "(a corrupt datasets directory)"
            )
        out = []
        for d in entries:
            n = d["filename"]
            if os.path.basename(n) != n or n in ("", ".", ".."):
                raise DataError(
                    f"{state_path}: data file name {n!r} is not a file in the directory"
                )
            if not os.path.isfile(os.path.join(path, n)):
                raise DataError(
                    f"{path}: missing {n} (listed in state.json; an incomplete datasets directory)"
                )
            out.append(("arrow", os.path.join(path, n)))
        return out
    files = sorted(f for f in os.listdir(path) if f.endswith((".jsonl", ".parquet")))
    if not files:
        raise DataError(
            f"{path}: no .jsonl or .parquet files, and not a directory saved by datasets"
        )
    return [(_kind(f), os.path.join(path, f)) for f in files]


def _arrow_error(kind: str, f: str, e: BaseException) -> DataError:
    why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    what = "Parquet" if kind == "parquet" else "Arrow stream (datasets)"
    return DataError(f"{f}: not a readable {what} file ({why})")


_ARROW_ERRORS = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    MemoryError,
    EOFError,
    NotImplementedError,
    RuntimeError,
)  # what pyarrow raises (its errors subclass these)


def _num_rows(kind: str, f: str) -> int:
    if kind == "jsonl":
        return _count_lines(f)
    if kind == "parquet":
        pq = require("pyarrow.parquet", "reading Parquet")
        try:
            return pq.ParquetFile(f).metadata.num_rows
        except _ARROW_ERRORS as e:  # pyarrow's ArrowInvalid / ArrowIOError are ValueError / OSError
            raise _arrow_error(kind, f, e) from None
    ipc = require("pyarrow.ipc", "reading a datasets directory")
    try:
        with open(f, "rb") as fh:
            return sum(b.num_rows for b in ipc.open_stream(fh))
    except _ARROW_ERRORS as e:
        raise _arrow_error(kind, f, e) from None


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
    try:
        if kind == "parquet":
            pq = require("pyarrow.parquet", "reading Parquet")
            yield from _batches(f, pq.ParquetFile(f).iter_batches(batch_size=size))
            return
        ipc = require("pyarrow.ipc", "reading a datasets directory")
        with open(f, "rb") as fh:
            yield from _batches(
                f,
                (
                    big.slice(i, size)
                    for big in ipc.open_stream(fh)
                    for i in range(0, big.num_rows, size)
                ),
            )
    except _ARROW_ERRORS as e:
        raise _arrow_error(kind, f, e) from None


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
        rec = json.loads(line)
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise BadRecord(f"not valid JSON ({e.msg})") from None
    # JSON's \uD800-\uDFFF escapes decode to lone surrogates, which no tokenizer can encode
    if b"\\u" in line and _lone_surrogate(rec):
        raise BadRecord(
            "a string holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape): not text"
        )
    return rec


def _lone_surrogate(obj) -> bool:
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
