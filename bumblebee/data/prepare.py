"""Tokenize an input once into the memory-mapped format (``bumblebee data prepare``), or into
memory for a run that reads text / chat data directly.

The reader (records.py) cuts the input into chunks in file order; worker
processes parse and encode chunks (encode.py) and return flat arrays; the
parent writes them in input order, so the output does not depend on the number
of workers. Bad records follow ``on_error``: ``"raise"`` stops at the first one
in file order with ``file:line: reason`` (exit code 2 from the CLI), ``"skip"``
drops it and counts it by reason; the counts go to meta.json and the run summary.
Records that were used but need a word (a chat record rendered per turn, tool calls
the template does not render) are counted by note the same way (``notes``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager

import numpy as np

from bumblebee.data.encode import Encoder
from bumblebee.data.errors import BadRecord, DataError
from bumblebee.data.records import Chunk, chunks, parse_line, scan
from bumblebee.data.store import StoreWriter, TokenStore, doc_loss_counts

ON_ERROR = ("raise", "skip")


def encode_chunk(enc: Encoder, chunk: Chunk, on_error: str) -> dict:
    """Encode one chunk: flat tokens / mask / lengths, skip and note counts, and the first error."""
    ids: list[int] = []
    mask: list[int] = []
    lengths: list[int] = []
    skipped: Counter = Counter()
    notes: Counter = Counter()
    first_error = None
    for i, item in enumerate(chunk.items):
        try:
            rec = item if chunk.columnar else parse_line(item)
            if rec is None:  # blank line
                continue
            docs, said = enc.documents(rec)
        except BadRecord as e:
            reason = str(e)
            if on_error == "raise":
                first_error = f"{chunk.where(i)}: {reason}"
                break
            skipped[reason.split(" (")[0]] += 1
            continue
        notes.update(said)
        for t, m in docs:
            ids += t
            mask += m
            lengths.append(len(t))
    return {
        "tokens": np.asarray(ids, dtype=np.uint32),
        "mask": np.asarray(mask, dtype=np.uint8),
        "lengths": np.asarray(lengths, dtype=np.int64),
        "skipped": skipped,
        "notes": notes,
        "error": first_error,
        "units": chunk.units,
    }


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, every 10% otherwise)."""

    def __init__(self, total: int, unit: str, stream=None, label: str = "prepare"):
        self.total, self.unit, self.stream, self.label = (
            max(total, 1),
            unit,
            stream or sys.stderr,
            label,
        )
        self.done, self.docs, self.start, self._tenth = 0, 0, time.perf_counter(), -1
        self.tty = getattr(stream, "isatty", lambda: False)()

    def update(self, units: int, docs: int) -> None:
        self.done, self.docs = self.done + units, self.docs + docs
        tenth = min(10, 10 * self.done // self.total)
        if self.tty or tenth != self._tenth:
            self._tenth = tenth
            self._draw(end="" if self.tty else "\n")

    def _fmt(self, n: float) -> str:
        if self.unit != "B":
            return f"{n:.0f} {self.unit}"
        return f"{n / 2**20:.1f} MiB" if self.total >= 2**20 else f"{n / 2**10:.1f} KiB"

    def _draw(self, end: str) -> None:
        frac = min(self.done / self.total, 1.0)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = (
            f"{self.label} [{bar}] {100 * frac:3.0f}%  {self._fmt(self.done)} / {self._fmt(self.total)}  "
            f"{self.docs} docs  {self._fmt(self.done / elapsed)}/s"
        )
        self.stream.write(("\r\033[K" if self.tty else "") + line + end)
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self._draw(end="\n")


_WORKER: dict = {}  # inside a worker process only: its encoder (the tokenizer loads once per worker)


def _pool_init(enc: Encoder) -> None:
    # Ctrl-C reaches the whole process group: only the parent stops (and terminates the pool); a
    # worker that died of it mid-task left imap waiting forever, and printed its traceback. SIGINT
    # is blocked from before the fork (see _pool): ignore it, then let other signals through.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the parent's SIGTERM handler raises (bumblebee ...): a worker dies of it, as Pool.terminate wants
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _WORKER["enc"] = enc


def _pool(workers: int, enc: Encoder):
    """(a fork pool whose workers ignore SIGINT, whether Ctrl-C came while it started). SIGINT is
    blocked meanwhile, so no worker sees it before its initializer, and only recorded: raised
    inside the at-fork callbacks that run Python code (logging's), it was swallowed."""
    hit: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda s, f: hit.append(s)) if main else None
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = mp.get_context("fork").Pool(workers, initializer=_pool_init, initargs=(enc,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if main:
            signal.signal(signal.SIGINT, previous)
    return pool, bool(hit)


@contextmanager
def no_interrupts():
    """SIGINT and SIGTERM ignored within the block (cleanup after the first Ctrl-C or SIGTERM: a
    second one must not cut a pool's termination or the removal of a partial output short); a
    no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _pool_encode(args) -> dict:
    chunk, on_error = args
    return encode_chunk(_WORKER["enc"], chunk, on_error)


def _wind_down(pool, results, stop: threading.Event, slots: threading.Semaphore) -> None:
    """Stop feeding, let the chunks in flight finish (dropped), and end the workers."""
    stop.set()
    slots.release()  # the feeder returns instead of waiting for a slot
    pool.close()
    deadline = time.monotonic() + 30
    try:
        while results is not None:
            results.next(timeout=max(deadline - time.monotonic(), 0.01))
    except StopIteration:
        pool.join()
        return
    except Exception:  # a worker failed, or is stuck for 30 s: nothing left worth waiting for
        pass
    pool.terminate()
    pool.join()


def encode_input(
    path: str,
    enc: Encoder,
    *,
    on_error: str = "raise",
    workers: int = 1,
    progress: bool | str = False,
    stream=None,
    label: str = "prepare",
):
    """Yield encoded chunks of ``path`` in input order (in ``workers`` processes when > 1).
    ``progress="auto"``: a bar when stderr is a terminal or the input is 64 MiB or more."""
    if on_error not in ON_ERROR:
        raise DataError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    files, total, unit = scan(path)
    if progress == "auto":
        tty = getattr(stream or sys.stderr, "isatty", lambda: False)()
        progress = tty or (unit == "B" and total >= 64 * 2**20)
    bar = Progress(total, unit, stream, label) if progress else None
    jobs = ((c, on_error) for c in chunks(files))
    pool, results = None, None
    # Pool.terminate() can hang for good (its feeder thread blocked writing to workers nobody
    # reads any more, or a worker holding the result queue's lock while it writes a chunk the
    # stopped result thread never reads: Ctrl-C near the end hung). So the pool is never
    # terminated with work in flight: at most 2 chunks per worker are fed ahead of the results
    # taken, and on the way out the feeder stops and those few finish and are dropped.
    slots, stop = threading.Semaphore(2 * workers), threading.Event()

    def fed():
        for job in jobs:
            slots.acquire()
            if stop.is_set():
                return
            yield job

    try:
        if workers > 1:
            os.environ.setdefault(
                "TOKENIZERS_PARALLELISM", "false"
            )  # the tokenizers library warns after fork
            pool, interrupted = _pool(workers, enc)
            if interrupted:
                raise KeyboardInterrupt
            results = pool.imap(_pool_encode, fed(), chunksize=1)
        else:
            results = (encode_chunk(enc, c, e) for c, e in jobs)
        for r in results:
            slots.release()
            if r["error"]:
                raise DataError(r["error"])
            if bar:
                bar.update(r["units"], len(r["lengths"]))
            yield r
    finally:
        if pool is not None:
            with no_interrupts():
                _wind_down(pool, results, stop, slots)
        if bar:
            bar.close()


def prepare(
    path: str,
    out_dir: str,
    enc: Encoder,
    *,
    on_error: str = "raise",
    workers: int = 1,
    progress: bool = True,
    stream=None,
) -> dict:
    """Write ``out_dir`` in the memory-mapped format; returns its meta.json."""
    scan(path)  # a missing or unknown input fails before OUT is created
    writer = StoreWriter(out_dir)
    skipped: Counter = Counter()
    notes: Counter = Counter()
    max_id = -1
    try:
        for r in encode_input(
            path, enc, on_error=on_error, workers=workers, progress=progress, stream=stream
        ):
            writer.append(r["tokens"], r["mask"], r["lengths"])
            skipped.update(r["skipped"])
            notes.update(r["notes"])
            if len(r["tokens"]):
                max_id = max(max_id, int(r["tokens"].max()))
        if writer.num_tokens == 0:
            raise DataError(
                f"{path}: no usable records" + (f" (skipped: {dict(skipped)})" if skipped else "")
            )
        # inside the try: an interrupt while the offsets or meta.json are written is a partial output
        return writer.close(
            {
                "source": os.path.abspath(path),
                **enc.describe(),
                "max_token_id": max_id,
                "skipped": dict(skipped),
                "skipped_total": sum(skipped.values()),
                "notes": dict(notes),
            }
        )
    except BaseException:
        with no_interrupts():
            writer.abort()
        raise


def encode_in_memory(
    path: str, enc: Encoder, *, on_error: str = "raise", progress: bool | str = "auto", stream=None
) -> TokenStore:
    """The same encoding into an in-memory store (text / chat sources read directly by a run),
    with a progress bar on a large input (tokenizing gigabytes at start was silent for minutes)."""
    parts = list(
        encode_input(
            path, enc, on_error=on_error, progress=progress, stream=stream, label="tokenize"
        )
    )
    skipped: Counter = Counter()
    notes: Counter = Counter()
    for r in parts:
        skipped.update(r["skipped"])
        notes.update(r["notes"])
    lengths = np.concatenate([r["lengths"] for r in parts]) if parts else np.zeros(0, np.int64)
    if not len(lengths):
        raise DataError(
            f"{path}: no usable records" + (f" (skipped: {dict(skipped)})" if skipped else "")
        )
    tokens = np.concatenate([r["tokens"] for r in parts])
    mask = np.concatenate([r["mask"] for r in parts])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    meta = {
        "source": os.path.abspath(path),
        **enc.describe(),
        "documents": len(lengths),
        "tokens": len(tokens),
        "max_token_id": int(tokens.max()),
        "skipped": dict(skipped),
        "skipped_total": sum(skipped.values()),
        "notes": dict(notes),
    }
    return TokenStore(tokens, mask, offsets, doc_loss_counts(mask, offsets), meta)
