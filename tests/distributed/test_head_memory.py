"""The LM head and the embedding hold their full [V, H] tables only while they are used.

Two gloo ranks, fsdp2, a model whose two vocabulary tables (16 MiB each in fp32) dwarf its
layers. The trainer's MemoryTracker (live tensor bytes) measures the second step, where the
sharded parameters and Adam state are alive throughout and the sharded gradients fill up. With the head and the
embedding as FSDP2 units of their own (``CausalLM.fsdp_units``; the loss reads the head inside
its forward, ``CausalLM.apply_head``), the step adds to that static state at most two tables at
once (measured 2.0: the gathered head and its full gradient in the head's backward, or a full
gradient and its reduce-scatter copy). With the head in the root unit (gathered, with its full
gradient, from the loss to the end of backward) the embedding's gradient and its reduce-scatter
copy come on top: measured 3.5 tables (2.95 with the embedding already a unit of its own); an
embedding kept gathered after its forward: 2.5. The bound, 2.25 tables, leaves a quarter table
for the activations alive at the peak (the end of backward: next to none).
"""

from __future__ import annotations

import io

from dist_utils import run_distributed

from bumblebee import load_config

MiB = 2**20
V, H = 16384, 256
TABLE = V * H * 4  # bytes of one full fp32 [V, H] table
ARGS = [
    "model.name=qwen3_moe",
    f"model.arch.vocab_size={V}",
    f"model.arch.hidden_size={H}",
    "model.arch.num_hidden_layers=2",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2",
    "model.arch.head_dim=32",
    "model.arch.intermediate_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "primitives.sharding=fsdp2",
    "primitives.loss=linear_ce",
    "train.seq_len=64",
    "train.global_batch=2",
    "train.micro_batch=1",
    "train.steps=2",
    "train.track_memory=true",
    "data.min_records=1",
    "data.max_records=2",
]


def _ranks(rank, world, out_dir):
    from bumblebee.runtime.trainer import Trainer

    trainer = Trainer(load_config(None, ARGS + [f"train.out_dir={out_dir}"]), stream=io.StringIO())
    trainer.train_step()
    peak = trainer.train_step()["peak_mem_bytes"]  # largest over the ranks
    state = trainer.sharding.state_bytes(
        trainer.optimizer
    )  # the step ended by dropping the gradients:
    return peak, 2 * state["params"] + state[
        "optimizer"
    ]  # every fp32 parameter has a sharded fp32 gradient


def test_vocabulary_tables_are_gathered_only_while_used(tmp_path):
    for rank, (peak, static) in enumerate(run_distributed(_ranks, 2, str(tmp_path))):
        over = peak - static
        print(
            f"rank {rank}: static {static / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB, "
            f"over {over / TABLE:.2f} tables"
        )
        assert over <= 2.25 * TABLE, (
            f"rank {rank}: the step's peak live memory is {over / MiB:.0f} MiB above the "
            f"static state ({static / MiB:.0f} MiB): {over / TABLE:.1f} full [V, H] tables "
            f"of {TABLE / MiB:.0f} MiB; at most 2 should be alive at once"
        )
