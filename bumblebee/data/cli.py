"""``bumblebee data prepare | inspect``: tokenize once into the memory-mapped format, and look at it.

``prepare`` reads JSONL / Parquet / a ``datasets`` directory (records.py),
encodes records in worker processes (encode.py, prepare.py) with a progress bar
and writes the format of store.py. ``inspect`` prints what a run would train on:
counts, the fraction of tokens that are loss targets, a length histogram, skip
counts, and one packed row decoded with its targets marked.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from bumblebee.data.packing import IGNORE


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    pp = sub.add_parser(
        "prepare",
        help="tokenize JSONL / Parquet / a datasets directory into memory-mapped tokens",
        description="Tokenize an input into OUT (tokens.u32, loss_mask.u8, offsets.i64, "
        "doc_loss.i64, meta.json); train on it with data.source = 'tokens', "
        "data.path = OUT.",
    )
    pp.add_argument(
        "input",
        metavar="IN",
        help=".jsonl, .parquet, a datasets directory, or a directory of those",
    )
    pp.add_argument(
        "out", metavar="OUT", help="output directory (must not already hold prepared data)"
    )
    pp.add_argument(
        "--source",
        required=True,
        choices=["tokens", "text", "chat"],
        help="tokens: {input_ids, loss_mask}; text: {text}; chat: {messages: [...]} or ShareGPT "
        "{conversations: [{from, value}]}",
    )
    pp.add_argument(
        "--tokenizer",
        default="",
        metavar="DIR",
        help="local Hugging Face tokenizer directory (text / chat)",
    )
    pp.add_argument(
        "--chat-loss",
        default="assistant",
        choices=["assistant", "all"],
        help="chat: loss on assistant turns only (default) or on every token",
    )
    pp.add_argument(
        "--tools",
        default="",
        metavar="FILE",
        help="chat: a JSON list of tool schemas for the template (a record's own 'tools' wins)",
    )
    pp.add_argument(
        "--template-kwarg",
        action="append",
        default=[],
        metavar="K=V",
        help="chat: a chat template variable, V a TOML/JSON literal (e.g. enable_thinking=false)",
    )
    pp.add_argument(
        "--on-error",
        default="raise",
        choices=["raise", "skip"],
        help="a bad record: stop with file:line: reason (default), or skip it and count it",
    )
    pp.add_argument(
        "--workers",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 1))),
        metavar="N",
        help="encoding processes (default: CPU count, at most 8)",
    )
    pp.add_argument("--no-progress", action="store_true", help="no progress bar")
    ip = sub.add_parser(
        "inspect",
        help="counts, masked fraction, length histogram, one decoded packed row",
        description="Show what a run would train on from a prepared directory.",
    )
    ip.add_argument("path", metavar="OUT", help="a directory written by `bumblebee data prepare`")
    ip.add_argument(
        "--seq-len", type=int, default=512, metavar="T", help="row length to pack (default 512)"
    )
    ip.add_argument(
        "--too-long",
        default="auto",
        choices=["auto", "split", "truncate", "drop"],
        help="documents longer than T, as data.too_long (default auto: split, chat data truncate)",
    )
    ip.add_argument(
        "--row", type=int, default=0, metavar="K", help="which packed row to decode (default 0)"
    )
    ip.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="decode with this tokenizer (default: the one recorded at prepare time)",
    )


def run(args, stream=None) -> int:
    stream = stream or sys.stdout
    from bumblebee.config import ConfigError

    if args.data_command == "prepare":
        from bumblebee.data.encode import Encoder
        from bumblebee.data.prepare import prepare

        if args.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {args.workers}")
        from bumblebee.config_parse import parse_override

        kwargs = {}
        for item in args.template_kwarg:
            if "=" not in item or not item.split("=", 1)[0]:
                raise ConfigError(f"--template-kwarg {item!r}: expected NAME=VALUE")
            kwargs[item.split("=", 1)[0]] = parse_override(f"x.{item}")[1]
        if (args.tools or kwargs) and args.source != "chat":
            raise ConfigError("--tools and --template-kwarg apply to --source chat")
        enc = Encoder(
            args.source,
            args.tokenizer,
            chat_loss=args.chat_loss,
            tools=args.tools,
            template_kwargs=kwargs,
        )
        meta = prepare(
            args.input,
            args.out,
            enc,
            on_error=args.on_error,
            workers=args.workers,
            progress=not args.no_progress,
        )
        stream.write(
            f"bumblebee: wrote {args.out}: {meta['documents']} documents, {meta['tokens']} tokens, "
            f"{meta['loss_tokens']} loss targets; skipped {meta['skipped_total']}"
            + (f" {meta['skipped']}" if meta["skipped"] else "")
            + "".join(f"; records {k}: {v}" for k, v in meta["notes"].items())
            + "\n"
        )
        return 0
    if args.seq_len < 2:
        raise ConfigError(f"--seq-len must be >= 2, got {args.seq_len}")
    need, have = 40 * args.seq_len, host_memory()  # the packed row: 4 int64 + 1 uint8 per token
    if need > have:
        raise ConfigError(
            f"--seq-len {args.seq_len}: one packed row needs {need / 2**30:.3g} GiB, more than "
            f"this machine's {have / 2**30:.0f} GiB of memory"
        )
    inspect(
        args.path,
        seq_len=args.seq_len,
        row=args.row,
        tokenizer=args.tokenizer,
        stream=stream,
        too_long=args.too_long,
    )
    return 0


def host_memory() -> int:
    """Physical memory in bytes (a generous 1 TiB where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40


def histogram(lengths: np.ndarray) -> list[tuple[str, int]]:
    """Counts of document lengths in power-of-two buckets [2^k, 2^(k+1))."""
    if not len(lengths):
        return []
    top = int(np.ceil(np.log2(max(int(lengths.max()), 1) + 1)))
    out = []
    for k in range(top):
        lo, hi = 2**k, 2 ** (k + 1)
        n = int(((lengths >= lo) & (lengths < hi)).sum())
        if n or out:
            out.append((f"{lo}-{hi - 1}", n))
    return out


def inspect(
    path: str, *, seq_len: int, row: int, tokenizer: str | None, stream, too_long: str = "auto"
) -> None:
    from bumblebee.config import ConfigError
    from bumblebee.data.rowplan import describe_cost
    from bumblebee.data.store import open_store
    from bumblebee.data.stream import PackedRows

    store = open_store(path)
    m = store.meta
    lengths = store.lengths
    w = stream.write
    w(f"{path}: {m.get('kind', '?')} data from {m.get('source', '?')}\n")
    frac = m["loss_tokens"] / max(m["tokens"], 1)
    w(
        f"documents {m['documents']}  tokens {m['tokens']}  loss targets {m['loss_tokens']} ({100 * frac:.1f}%)  "
        f"masked out {100 * (1 - frac):.1f}%\n"
    )
    w(f"document length: min {lengths.min()}  mean {lengths.mean():.1f}  max {lengths.max()}\n")
    if m.get("skipped_total"):
        w(
            f"skipped records {m['skipped_total']}: "
            + ", ".join(f"{k}: {v}" for k, v in m["skipped"].items())
            + "\n"
        )
    for note, n in m.get("notes", {}).items():
        w(f"records {note}: {n}\n")
    hist = histogram(lengths)
    peak = max(n for _, n in hist)
    w("length histogram (tokens: documents)\n")
    for label, n in hist:
        w(f"  {label:>13}  {n:>8}  {'#' * max(int(40 * n / peak), 1 if n else 0)}\n")
    rows = PackedRows(store, seq_len, too_long)
    w(
        f"packed into {rows.num_rows} rows of {seq_len} tokens; {describe_cost(rows.stats, rows.too_long)}\n"
    )
    if not 0 <= row < rows.num_rows:
        raise ConfigError(f"--row {row} out of range: {rows.num_rows} rows")
    b = rows.build(np.array([row]))
    ids, labels, pos = b.input_ids[0].tolist(), b.labels[0].tolist(), b.position_ids[0].tolist()
    target = [t > 0 and labels[t - 1] != IGNORE for t in range(len(ids))]
    tok_dir = tokenizer if tokenizer is not None else m.get("tokenizer", "")
    decode = _decoder(tok_dir)
    w(
        f"row {row} ({sum(target)} targets; [[...]] = trained on, || = document (or continuation) boundary, "
        "padding not shown):\n"
    )
    out, t = [], 0
    end = int(rows.piece_len[int(rows.row_ptr[row]) : int(rows.row_ptr[row + 1])].sum())
    while t < end:
        u = t + 1
        while u < end and target[u] == target[t] and pos[u] != 0:
            u += 1
        piece = decode(ids[t:u])
        out.append(("||" if pos[t] == 0 and t else "") + (f"[[{piece}]]" if target[t] else piece))
        t = u
    w("".join(out) + "\n")


def _decoder(tok_dir: str):
    if tok_dir and os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        from bumblebee.data.encode import load_tokenizer

        tok = load_tokenizer(tok_dir)
        return lambda ids: tok.decode(ids, skip_special_tokens=False)
    return lambda ids: " ".join(str(i) for i in ids) + " "
