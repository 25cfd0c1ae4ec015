"""Training data: a global batch per step, a deterministic function of (seed, step).

A source gives the rows of a step's global batch (all data-parallel ranks
together) that one rank asks for: ``rows_at(step, lo, hi)``, and the global
batch's label count ``num_valid_at(step)`` (the loss is a mean over all of its
tokens whatever the layout). Because the batch depends only on the seed and the
step, the same config gives the same token stream on any layout, and a resumed
run continues the stream exactly.

Sources: ``synthetic`` (the embedded task), ``jsonl`` (pre-tokenized, validated
in one pass, then read by offset: only a rank's rows), ``tokens`` (a prepared memory-mapped directory, read row by row),
``text`` / ``chat`` (tokenized at start with a local Hugging Face tokenizer,
then packed like ``tokens``). ``eval_batch_list()`` gives held-out global
batches where the source has a held-out split.
"""

from __future__ import annotations

from bumblebee.data.packing import Batch


def _token_store(data_cfg, path: str):
    from bumblebee.data.encode import Encoder
    from bumblebee.data.prepare import encode_in_memory
    from bumblebee.data.store import open_store

    if data_cfg.source == "tokens":
        return open_store(path)
    enc = Encoder(
        data_cfg.source,
        data_cfg.tokenizer,
        chat_loss=data_cfg.chat_loss,
        tools=data_cfg.tools,
        template_kwargs=data_cfg.chat_template_kwargs,
    )
    import os

    rank0 = os.environ.get("RANK", "0") == "0"  # one bar for the job
    return encode_in_memory(
        path, enc, on_error=data_cfg.on_error, progress="auto" if rank0 else False
    )


def build_source(data_cfg, train_cfg, vocab_size: int):
    """The data source a ``[data]`` section describes."""
    if data_cfg.source == "synthetic":
        from bumblebee.data.synthetic import KeyValueRetrieval

        return KeyValueRetrieval(
            seq_len=train_cfg.seq_len,
            global_batch=train_cfg.global_batch,
            seed=train_cfg.seed,
            min_records=data_cfg.min_records,
            max_records=data_cfg.max_records,
            min_doc_len=data_cfg.min_doc_len,
            max_doc_len=data_cfg.max_doc_len,
            ramp_steps=data_cfg.ramp_steps,
            value_len=data_cfg.value_len,
            eval_min_distance=data_cfg.eval_min_distance,
            eval_docs=data_cfg.eval_docs,
        )
    if data_cfg.source == "jsonl":
        from bumblebee.data.jsonl import JsonlSource

        return JsonlSource(
            data_cfg.path,
            seq_len=train_cfg.seq_len,
            global_batch=train_cfg.global_batch,
            seed=train_cfg.seed,
            vocab_size=vocab_size,
            too_long=data_cfg.too_long,
        )
    from bumblebee.data.stream import TokenSource

    eval_store = _token_store(data_cfg, data_cfg.eval_path) if data_cfg.eval_path else None
    return TokenSource(
        _token_store(data_cfg, data_cfg.path),
        seq_len=train_cfg.seq_len,
        global_batch=train_cfg.global_batch,
        seed=train_cfg.seed,
        vocab_size=vocab_size,
        too_long=data_cfg.too_long,
        eval_fraction=data_cfg.eval_fraction,
        eval_store=eval_store,
        eval_batches=data_cfg.eval_batches,
    )


__all__ = ["Batch", "build_source"]
