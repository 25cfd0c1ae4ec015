"""Training data: a global batch per step, a deterministic function of (seed, step).

Every source returns the *global* batch of a step (all data-parallel ranks
together); each rank takes its rows. Because the batch depends only on the seed
and the step, the same config gives the same token stream on any layout, and a
resumed run continues the stream exactly.
"""

from __future__ import annotations

from bumblebee.data.packing import Batch


def build_source(data_cfg, train_cfg, vocab_size: int):
    """The data source a ``[data]`` section describes."""
    if data_cfg.source == "synthetic":
        from bumblebee.data.synthetic import KeyValueRetrieval

        return KeyValueRetrieval(seq_len=train_cfg.seq_len, global_batch=train_cfg.global_batch,
                                 seed=train_cfg.seed, min_records=data_cfg.min_records,
                                 max_records=data_cfg.max_records)
    from bumblebee.data.jsonl import JsonlSource

    return JsonlSource(data_cfg.path, seq_len=train_cfg.seq_len, global_batch=train_cfg.global_batch,
                       seed=train_cfg.seed, vocab_size=vocab_size)


__all__ = ["Batch", "build_source"]
