"""The CUDA branches of the training step, executed on CPU (``train.emulate_cuda``), against the
plain CPU path on the same ranks: flash varlen attention, the CP ring of flash block calls
(one row per micro-batch, partial RoPE: strided K/V), MLA's latent ring, FLA's custom op with
its recomputing backward (Gated DeltaNet, under GDN CP too), the chunked-EP side stream, the
NCCL forms of FSDP2's reduce-scatter (in place, with record_stream) and all-gather, the CP
reduce-scatters; every collective and point-to-point call checked for contiguity and for the
ranks agreeing on shape and dtype. In fp32 the two runs match to fp32 rounding (the reference
kernels compute what the CPU paths compute, in another order); bf16 runs agree to bf16 noise.
A planted non-contiguous send, or ranks disagreeing on a shape, fails through the checks."""

import io

import pytest
import torch
import torch.distributed as dist
from data_helpers import write_jsonl_docs
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.primitives import comm_check, emulation
from bumblebee.primitives.attention import flash
from bumblebee.primitives.comm_check import CheckedComm, CommCheckError
from bumblebee.primitives.cp import ring_flash
from bumblebee.primitives.linear_attention import fla
from bumblebee.runtime.trainer import Trainer

T = 64
DOCS = [[5, 40, 19], [64], [30, 34], [1, 63]]
TINY = [
    "model.arch.hidden_size=64",
    "model.arch.vocab_size=256",
    "model.arch.moe_intermediate_size=32",
]
QWEN3_5 = [
    "model.name=qwen3_5_moe",
    "model.preset=tiny",
    "model.arch.shared_expert_intermediate_size=32",
    "model.arch.num_experts=4",
    "model.arch.linear_key_head_dim=16",
    "model.arch.linear_value_head_dim=16",
    "model.arch.head_dim=16",
    *TINY,
]
QWEN3 = ["model.name=qwen3_moe", "model.preset=tiny", "model.arch.num_hidden_layers=2", *TINY]
DSV3 = [
    "model.name=deepseek_v3",
    "model.arch.num_hidden_layers=2",
    "model.arch.intermediate_size=96",
    "model.arch.n_routed_experts=8",
    "model.arch.n_group=4",
    "model.arch.topk_group=2",
    "model.arch.num_experts_per_tok=3",
    *TINY,
]
COMMON = [
    f"train.seq_len={T}",
    "train.global_batch=4",
    "train.clip_grad=0",
    "train.lr=3e-3",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "data.source='jsonl'",
]

# (model, layout and primitives, dtype tolerance) on 2 ranks
CASES = {
    "qwen3_5 cp2 ring mb1": (
        QWEN3_5,
        ["parallel.cp=2", "primitives.cp_attention='ring'", "train.micro_batch=1"],
    ),
    "qwen3_5 ep2 chunked mb2": (
        QWEN3_5,
        ["parallel.ep=2", "primitives.moe_comm='chunked'", "train.micro_batch=2"],
    ),
    "qwen3 cp2 ring ep2 mb1": (
        QWEN3,
        [
            "parallel.cp=2",
            "parallel.ep=2",
            "primitives.cp_attention='ring'",
            "primitives.moe_comm='chunked'",
            "train.micro_batch=1",
        ],
    ),
    "deepseek cp2 ring mtp mb1": (
        DSV3,
        ["parallel.cp=2", "primitives.cp_attention='ring'", "train.micro_batch=1"],
    ),
    "qwen3 pp2 mb1": (
        QWEN3,
        [
            "parallel.pp=2",
            "primitives.pipeline='1f1b'",
            "train.micro_batch=1",
            "train.balance='micro_batch'",
        ],
    ),
    "qwen3_5 cp2 ring bf16": (
        QWEN3_5,
        [
            "parallel.cp=2",
            "primitives.cp_attention='ring'",
            "train.micro_batch=1",
            "train.dtype='bfloat16'",
        ],
    ),
}


# the CUDA branches, counted where they run (module attributes the branches look up at call time)
BRANCHES = {
    "varlen_attn": (flash, "reference_varlen_attn"),
    "ring flash ops": (ring_flash, "reference_block_kernel"),
    "fla op": (fla, "_fla_kernel"),
    "side stream": (emulation, "side_stream"),
    "record_stream": (emulation, "record_stream"),
    "checked p2p": (comm_check, "_check_p2p"),
    "checked collective": (comm_check, "_agree"),
}


def _counting(calls):
    for name, (module, attr) in BRANCHES.items():
        original = getattr(module, attr)

        def wrap(*a, _fn=original, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **kw)

        setattr(module, attr, wrap)


def _trace(overrides, out_dir, calls):
    cfg = load_config(None, overrides + [f"train.out_dir={out_dir}", "train.steps=2"])
    trainer = Trainer(cfg, stream=io.StringIO())
    calls.clear()
    trace = [(r["loss"], r["grad_norm"]) for r in (trainer.train_step(), trainer.train_step())]
    return trace, dict(calls)


def _ranks(rank, world, names, data, out_dir):
    calls = {}
    _counting(calls)
    out = {}
    for name in names:
        model, layout = CASES[name]
        base = model + COMMON + layout + [f"data.path={data}"]
        out[name] = (
            _trace(base, f"{out_dir}/{name}/cpu{rank}", calls),
            _trace(base + ["train.emulate_cuda=true"], f"{out_dir}/{name}/emu{rank}", calls),
        )
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl_docs(tmp_path_factory.mktemp("emu") / "docs.jsonl", DOCS)


def test_emulated_cuda_matches_cpu(data, tmp_path):
    results = run_distributed(_ranks, 2, list(CASES), data, str(tmp_path), timeout=900)
    ran = {}
    for name in CASES:
        tol = 3e-2 if "bf16" in name else 2e-5
        for rank, out in enumerate(results):
            (cpu, cpu_calls), (emu, emu_calls) = out[name]
            assert not cpu_calls, f"{name}: the CPU run took CUDA branches {cpu_calls}"
            ran.update({k: ran.get(k, 0) + v for k, v in emu_calls.items()})
            for step, ((l0, g0), (l1, g1)) in enumerate(zip(cpu, emu)):
                assert abs(l1 - l0) <= tol * abs(l0), (
                    f"{name} rank {rank} step {step + 1}: loss {l1} vs {l0}"
                )
                assert abs(g1 - g0) <= 5 * tol * abs(g0), (
                    f"{name} rank {rank} step {step + 1}: gnorm {g1} vs {g0}"
                )
    assert set(ran) == set(BRANCHES), f"CUDA branches never executed: {set(BRANCHES) - set(ran)}"


def _planted(rank, world, what):
    with CheckedComm():
        try:
            if what == "strided send":
                x = torch.arange(16.0).view(4, 4)
                ops = [
                    dist.P2POp(dist.isend, x.t(), (rank + 1) % world),
                    dist.P2POp(dist.irecv, torch.empty(4, 4), (rank - 1) % world),
                ]
                [w.wait() for w in dist.batch_isend_irecv(ops)]
            elif what == "dtype":  # same bytes, other dtype: gloo itself passes it
                ops = [
                    dist.P2POp(dist.isend, torch.ones(4), (rank + 1) % world),
                    dist.P2POp(dist.irecv, torch.empty(4, dtype=torch.int32), (rank - 1) % world),
                ]
                [w.wait() for w in dist.batch_isend_irecv(ops)]
            elif what == "p2p shape":  # same element count, other shape
                ops = [
                    dist.P2POp(dist.isend, torch.ones(2, 2), (rank + 1) % world),
                    dist.P2POp(dist.irecv, torch.empty(4), (rank - 1) % world),
                ]
                [w.wait() for w in dist.batch_isend_irecv(ops)]
            elif what == "shape":
                dist.all_reduce(torch.ones(3 + rank))
            elif what == "splits":
                dist.all_to_all_single(
                    torch.empty(4), torch.ones(4), [2, 2], [1, 3] if rank == 0 else [2, 2]
                )
        except CommCheckError as e:
            return str(e)
    return None


@pytest.mark.parametrize("what", ["strided send", "dtype", "p2p shape", "shape", "splits"])
def test_checked_comm_catches_what_nccl_would_not(what):
    errors = run_distributed(_planted, 2, what)
    assert any(errors), errors
    assert all(
        e is None or ("not contiguous" in e or "disagree" in e or "sends" in e) for e in errors
    ), errors


def _scalar_into_one(rank, world):
    """torch 2.11's pipeline warm-up (``PipelineStage._get_init_p2p_neighbors_ops``): a 0-d
    tensor sent into a [1] buffer, and back."""
    with CheckedComm():
        recv = torch.zeros(()) if rank == 0 else torch.zeros(1)
        send = torch.tensor(float(rank + 1)) if rank == 0 else torch.ones(1) * (rank + 1)
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % world),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world),
        ]
        [w.wait() for w in dist.batch_isend_irecv(ops)]
    return recv.item()


def test_checked_comm_takes_a_scalar_into_one_element():
    assert run_distributed(_scalar_into_one, 2) == [2.0, 1.0]
