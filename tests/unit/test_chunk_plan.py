"""Uneven chunks for chunked EP overlap: the timeline of chunked.py's schedule
(primitives/moe/chunk_plan.py), the weights it picks, and the dispatcher splitting tokens by them.
(Numerics of uneven chunks against alltoall: tests/distributed/test_chunked_ep.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from bumblebee import load_config, registry
from bumblebee.config import ConfigError, PrimitivesConfig
from bumblebee.models import build_model
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.primitives.moe import chunk_plan, chunked
from bumblebee.primitives.moe.chunk_plan import PhaseTimes, best, evaluate, token_bounds


def test_token_bounds():
    assert token_bounds(10, (0.2, 0.8)) == [(0, 2), (2, 10)]
    assert token_bounds(10, (1, 1, 2)) == [(0, 2), (2, 5), (5, 10)]  # shares, normalized
    assert token_bounds(3, (0.05, 0.2, 0.6, 0.15)) == [(0, 0), (0, 1), (1, 3), (3, 3)]


def test_forward_timeline_by_hand():
    p = PhaseTimes(dispatch=1.0, gemm=2.0, combine=1.0)
    # even halves: dispatch 0 ends 0.5, GEMM 0 0.5-1.5, GEMM 1 1.5-2.5; comm: dispatch 1 ends
    # 1.0, combine 0 1.5-2.0, combine 1 2.5-3.0
    assert chunk_plan.forward_end((0.5, 0.5), p) == pytest.approx(3.0)
    # 0.25 / 0.75: dispatch 0 ends 0.25, GEMM 0 0.25-0.75, dispatch 1 ends 1.0, GEMM 1 1.0-2.5,
    # combine 0 1.0-1.25, combine 1 2.5-3.25
    assert chunk_plan.forward_end((0.25, 0.75), p) == pytest.approx(3.25)
    back = PhaseTimes(dispatch=1.0, gemm=1.0, combine=1.0, after=1.0)
    # combine-bwd 0 ends 0.5, dgrad 0 0.5-1.0, dgrad 1 (after cb 1 at 1.0) 1.0-1.5, wgrad -2.5;
    # comm: dispatch-bwd 0 1.0-1.5, dispatch-bwd 1 1.5-2.0
    assert chunk_plan.backward_end((0.5, 0.5), back) == pytest.approx(2.5)


def test_uneven_chunks_hide_more_where_gemms_dominate():
    phases = [("forward", PhaseTimes(0.5, 1.0, 0.5)), ("backward", PhaseTimes(0.5, 1.0, 0.5, 1.0))]
    ev = evaluate(chunk_plan.even(3), phases)
    got = best(phases, counts=(3,))
    assert got.exposed < 0.8 * ev.exposed, (got, ev)
    assert got.weights[0] < 1 / 3  # a smaller first chunk: less dispatch with nothing under it
    # where the transfers outlast the GEMMs the communication stream bounds the phase: even
    # chunks are as good as any (and win the tie)
    comm_bound = [("forward", PhaseTimes(2.0, 1.0, 2.0))]
    assert best(comm_bound, counts=(3,)).weights == chunk_plan.even(3)
    # a fixed cost per chunk: fewer chunks when the phases are short (balanced routing) than
    # when skew stretches them on the busiest rank
    short = best([("forward", PhaseTimes(0.2, 0.8, 0.2))], per_chunk_s=0.05)
    long = best([("forward", PhaseTimes(0.8, 3.2, 0.8))], per_chunk_s=0.05)
    assert len(short.weights) < len(long.weights), (short, long)


def test_dispatch_splits_tokens_by_the_weights(monkeypatch):
    seen = []
    permute = chunked.permute

    def spy(idx_TK, *a, **k):
        seen.append(idx_TK.shape[0])
        return permute(idx_TK, *a, **k)

    monkeypatch.setattr(chunked, "permute", spy)
    arch = Qwen3MoeArch(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    prims = PrimitivesConfig(
        moe_comm="chunked", moe_chunk_weights=[[0.25, 0.75], [0.1, 0.2, 0.7]], recompute="none"
    )
    model = build_model(arch, prims)
    model(torch.randint(0, 97, (1, 40)), labels=torch.randint(0, 97, (1, 40))).backward()
    assert seen == [10, 30, 4, 8, 28]  # layer 0 in 2 chunks, layer 1 in 3


def test_bad_weights():
    factory = registry.get("moe_comm", "chunked").factory
    for bad in ([0.5], [0.5, 0.5, 0.5], [1, -1], [[0.5, 0.5], [1.0]], ["a", "b"]):
        with pytest.raises(ConfigError, match="moe_chunk_weights"):
            factory(num_experts=8, num_chunks=2, chunk_weights=bad)
    d = factory(num_experts=8, num_chunks=2, chunk_weights=[[1, 1], [1, 2]])
    with pytest.raises(ConfigError, match="has 2 per-layer lists; the model has 3 MoE layers"):
        d.for_layer(0, 3)
    with pytest.raises(ConfigError, match="needs moe_comm = 'chunked'"):
        load_config(None, ["primitives.moe_comm=alltoall", "primitives.moe_chunk_weights=[1, 2]"])


# ---------------------------------------------------------------------------------- the planner
def _metrics(path, loads, n=3):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(n):
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
            f.write(json.dumps({"step": step, "expert_load": loads}) + "\n")
        f.write('{"step": 9, "expert_lo')  # a line cut by a crash


def test_run_skew_from_histograms(tmp_path):
    from bumblebee.plan.chunks import run_skew
    from bumblebee.plan.spec import load_spec

    spec, _ = load_spec("qwen3_moe/tiny")
    E = spec.experts
    layers = sum(m == "moe" for m in spec.mlps)
    hot = [4] * (E // 2) + [1] * (E // 2)  # rank 0 of ep 2 gets 4x rank 1's rows
    flat = [1] * E
    _metrics(tmp_path, [hot] + [flat] * (layers - 1))
    skews = run_skew(str(tmp_path), spec, ep=2)
    assert skews[0] == pytest.approx(8 / 5) and skews[1:] == [1.0] * (layers - 1)
    assert run_skew(str(tmp_path), spec, ep=1) == [1.0] * layers
    with pytest.raises(ConfigError, match="no expert_load histograms"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 1}\n')
        run_skew(str(tmp_path / "empty"), spec, ep=2)
    _metrics(tmp_path / "other", [[1] * (E + 1)] * layers)
    with pytest.raises(ConfigError, match="experts"):
        run_skew(str(tmp_path / "other"), spec, ep=2)


def test_plan_chooses_chunks_under_skew(capsys):
    from bumblebee.plan import cli

    args = ["--model", "qwen3-30b-a3b", "--gpus", "16", "--seq", "65536"]
    args += ["--layout", "tp=1 pp=1 ep=8 cp=2", "--json"]
    assert cli.main(args) == 0
    even = json.loads(capsys.readouterr().out)
    assert "chunks" not in even
    assert cli.main(args + ["--skew", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["chunks"]
    assert c["skew"] == [4.0] and c["exposed_s"] < c["exposed_even_s"]
    assert "moe_chunk_weights" in out["recommended"]["config"]
    # skew: the busiest rank is slower, and more memory is routed to it
    slow, fast = out["recommended"], even["recommended"]
    assert slow["tokens_per_s_per_gpu"] < fast["tokens_per_s_per_gpu"]
    assert slow["memory_gb"]["moe_buffers"] > fast["memory_gb"]["moe_buffers"]
    assert cli.main(args + ["--skew", "2", "--from-run", "x"]) == 2
    assert "drop --skew" in capsys.readouterr().err
