"""Host syncs per training step, counted in the emulated-CUDA mode (``perf/syncs.py``): with expert
parallelism one count read per MoE layer and micro-batch (the forward's; the recompute takes its
value: ``recompute_scope.host_read``), chunked and alltoall alike, none in any other layer, one per
micro-batch (its document layout) and a few per step (logging, the finite check). Before the
document layouts cached their device tensors and the chunked EP read every chunk's counts at once,
Qwen3.5 with cp = 2 took 237 per step here, Qwen3-MoE with chunked EP 175. Planted: one
``.item()`` per decoder layer forward -> over budget."""

import io

from dist_utils import run_distributed

BASE = [
    "train.seq_len=256",
    "train.global_batch=4",
    "train.micro_batch=1",
    "train.dtype=bfloat16",
    "train.eval_every=0",
    "train.emulate_cuda=true",
]
CASES = {
    "qwen3_5 cp2 ring": ["model.name=qwen3_5_moe", "model.preset=tiny", "parallel.cp=2"],
    "qwen3 ep2 chunked": [
        "model.name=qwen3_moe",
        "model.preset=tiny",
        "parallel.ep=2",
        "primitives.moe_comm=chunked",
    ],
    "qwen3 ep2 alltoall": [
        "model.name=qwen3_moe",
        "model.preset=tiny",
        "parallel.ep=2",
        "primitives.moe_comm=alltoall",
    ],
}


def _ranks(rank, world, out_dir):
    from bumblebee import load_config
    from bumblebee.perf.syncs import SyncCounter
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.runtime.trainer import Trainer

    def read(mod, args):
        args[0].sum().item()  # a host read per layer forward (returns None: args unchanged)

    out = {}
    for (name, sets), plant in [(c, False) for c in CASES.items()] + [
        (next(iter(CASES.items())), True)
    ]:
        cfg = load_config(None, BASE + sets + [f"train.out_dir={out_dir}/{name}{plant}/{rank}"])
        trainer = Trainer(cfg, stream=io.StringIO())
        if plant:
            for layer in trainer.model.model.layers:
                layer.register_forward_pre_hook(read)
        trainer.train_step()  # the first step builds what a run builds once
        with emulate_cuda(check_comm=False), SyncCounter() as c:
            trainer.train_step()
        ep = trainer.ctx.layout.ep
        out[name, plant] = (
            c.syncs,
            trainer.model.arch.num_hidden_layers if ep > 1 else 0,
            trainer.accum,
            c.top(5),
        )
    return out


def test_host_syncs_within_budget(tmp_path):
    for rank, out in enumerate(run_distributed(_ranks, 2, str(tmp_path))):
        for (name, plant), (syncs, moe_ep_layers, micro, top) in out.items():
            budget = moe_ep_layers * micro + micro + 14
            assert (syncs <= budget) != plant, (
                f"{name} planted={plant} rank {rank}: {syncs} syncs (budget {budget}): {top}"
            )
