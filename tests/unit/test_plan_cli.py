"""`bumblebee plan`: JSON schema, --layout / --set, one-line errors with exit code 2,
config.json input, --plot, --explain (the dry run: test_plan_dryrun.py)."""

import json

import pytest

from bumblebee import cli as top_cli
from bumblebee.config import ConfigError
from bumblebee.models.presets import PRESETS
from bumblebee.plan import cli

BREAKDOWN = {
    "total",
    "parameters",
    "gradients",
    "optimizer",
    "saved_inputs",
    "live_layer",
    "moe_buffers",
    "loss",
    "allgather",
    "workspace",
    "optim_temp",
    "overhead",
}
SMALL_QWEN3 = {  # a small qwen3_moe: big enough that activations, logits and experts all matter
    "model_type": "qwen3_moe",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}


def _run(argv, capsys):
    code = top_cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _check_candidate(c):
    assert set(c) == {
        "layout",
        "primitives",
        "memory_gb",
        "tflops_per_gpu",
        "tokens_per_s_per_gpu",
        "feasible",
        "reason",
        "config",
        "runtime_problem",
        "peak_stage",
        "peak_moment",
        "stages",
        "assumptions",
    }
    assert (
        c["assumptions"]["compute_dtype"] == "bfloat16"
        and "attention" in c["assumptions"]["kernels"]
    )
    if (
        c["memory_gb"] is not None
    ):  # per stage: its peak moment and terms; the candidate's peak is the largest
        assert len(c["stages"]) == c["layout"]["pp"]
        assert max(st["peak_gb"] for st in c["stages"]) == c["memory_gb"]["total"]
        for st in c["stages"]:
            assert st["peak_moment"] in ("forward", "backward", "loss", "optimizer")
            assert (
                set(st["terms_gb"]) == BREAKDOWN
                and st["moments_gb"][st["peak_moment"]] == st["peak_gb"]
            )
    assert set(c["layout"]) == {"tp", "pp", "ep", "cp", "dp_shard"}
    assert c["config"].startswith("# written by bumblebee plan") and c["runtime_problem"] == ""
    assert set(c["primitives"]) == {"sharding", "loss", "recompute", "moe_comm"}
    assert set(c["memory_gb"]) == BREAKDOWN
    parts = sum(v for k, v in c["memory_gb"].items() if k != "total")
    assert parts == pytest.approx(c["memory_gb"]["total"], abs=0.06)
    assert isinstance(c["feasible"], bool) and c["reason"]


def test_search_json_schema(capsys):
    code, out, _ = _run(
        [
            "--model",
            "qwen3.5-35b-a3b",
            "--gpus",
            "32",
            "--gpu",
            "h100",
            "--seq",
            "131072",
            "--json",
            "--top",
            "5",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"recommended", "candidates"}
    rec = data["recommended"]
    _check_candidate(rec)
    # the recipe: EP 8 (< 100B params), CP for a 32K local sequence, TP 1, FSDP2, linear CE, full recompute
    assert (
        rec["feasible"]
        and rec["layout"]["tp"] == 1
        and rec["layout"]["ep"] == 8
        and rec["layout"]["cp"] == 4
    )
    assert rec["primitives"] == {
        "sharding": "fsdp2",
        "loss": "linear_ce",
        "recompute": "full",
        "moe_comm": "chunked",
    }
    assert rec["memory_gb"]["total"] <= 80 * 0.95
    for c in data["candidates"]:
        _check_candidate(c)
        lay = c["layout"]
        assert lay["tp"] * lay["pp"] * lay["cp"] * lay["dp_shard"] == 32
    feas = [c for c in data["candidates"] if c["feasible"]]
    assert feas and [c["tokens_per_s_per_gpu"] for c in feas] == sorted(
        (c["tokens_per_s_per_gpu"] for c in feas), reverse=True
    )
    assert any(not c["feasible"] for c in data["candidates"])


def test_layout_evaluates_exactly_one(capsys):
    code, out, _ = _run(
        [
            "--model",
            "qwen3.5-35b-a3b",
            "--gpus",
            "32",
            "--seq",
            "131072",
            "--json",
            "--layout",
            "tp=2 pp=4 ep=8 cp=2",
            "--set",
            "primitives.loss=ce",
            "--set",
            "primitives.sharding=zero1",
            "--set",
            "primitives.moe_comm=alltoall",
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out)
    assert len(data["candidates"]) == 1 and data["candidates"][0] == data["recommended"]
    c = data["recommended"]
    assert c["layout"] == {"tp": 2, "pp": 4, "ep": 8, "cp": 2, "dp_shard": 2}
    assert c["primitives"] == {
        "sharding": "zero1",
        "loss": "ce",
        "recompute": "full",
        "moe_comm": "alltoall",
    }
    # the published run fits on 80 GB: every stage, the last one with the vocab-parallel CE's logits
    assert c["feasible"] and c["peak_stage"] == 3 and c["peak_moment"] == "loss"
    stage0 = c["stages"][0]
    assert stage0["peak_gb"] == pytest.approx(42.91, rel=0.10)  # published, rank 0
    assert stage0["peak_moment"] == "backward" and stage0["terms_gb"]["moe_buffers"] > 0


def test_explain_prints_every_term_with_its_formula(capsys):
    code, out, _ = _run(
        [
            "--model",
            "qwen3.5-35b-a3b",
            "--gpus",
            "32",
            "--seq",
            "131072",
            "--explain",
            "--layout",
            "tp=1 pp=2 ep=8 cp=4",
            "--set",
            "primitives.sharding=zero1",
        ],
        capsys,
    )
    assert code == 0
    assert "stage 0 (layers 0-19): peak" in out and "stage 1 (layers 20-39)" in out
    for needle in (
        "saved_inputs",
        "in flight x 32768 tokens",
        "moe_buffers",
        "X=32768",
        "overhead",
        "1.6 GB fixed",
        "zero1:",
        "expert side 3.5X+6.5A",
        "expert grads",
    ):
        assert needle in out, needle


def test_text_output(capsys):
    code, out, _ = _run(
        [
            "--model",
            "qwen3-30b-a3b",
            "--gpus",
            "16",
            "--seq",
            "32768",
            "--layout",
            "tp=1 pp=1 ep=8 cp=2",
        ],
        capsys,
    )
    assert code == 0
    assert "evaluated (fits)" in out and "TFLOPs/GPU" in out and "memory" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "nope", "--gpus", "32", "--seq", "4096"], "unknown model"),
        (
            [
                "--model",
                "qwen3-30b-a3b",
                "--gpus",
                "30",
                "--seq",
                "4096",
                "--layout",
                "tp=1 pp=2 ep=8 cp=4",
            ],
            "divide",
        ),
        (
            ["--model", "qwen3-30b-a3b", "--gpus", "32", "--seq", "4096", "--layout", "tp=one"],
            "integer",
        ),
        (
            ["--model", "qwen3-30b-a3b", "--gpus", "32", "--seq", "4096", "--layout", "foo bar"],
            "bad item",
        ),
        (["--model", "qwen3-30b-a3b", "--gpus", "32", "--seq", "4096", "--layout", "ep=3"], "ep=3"),
        (
            ["--model", "qwen3-30b-a3b", "--gpus", "32", "--seq", "4096", "--gpu", "a100"],
            "unknown --gpu",
        ),
        (["--model", "qwen3-30b-a3b", "--gpus", "0", "--seq", "4096"], "--gpus"),
        (
            [
                "--model",
                "qwen3-30b-a3b",
                "--gpus",
                "8",
                "--seq",
                "4096",
                "--set",
                "primitives.loss=fast",
            ],
            "loss",
        ),
        (
            ["--model", "qwen3-30b-a3b", "--gpus", "8", "--seq", "4096", "--set", "train.lr=1"],
            "primitives.KEY",
        ),
    ],
)
def test_bad_input_exits_2(capsys, argv, needle):
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err
    with pytest.raises(ConfigError):  # run() itself raises; the CLI turns it into exit code 2
        parser = __import__("argparse").ArgumentParser()
        cli.add_arguments(parser)
        cli.run(parser.parse_args(argv))


def test_hf_config_json_both_families(tmp_path, capsys):
    text = dict(PRESETS["qwen3_5_moe"]["qwen3.5-35b-a3b"])
    wrapped = {
        "model_type": "qwen3_5_moe",
        "text_config": {**text, "model_type": "qwen3_5_moe_text"},
    }
    for name, cfg in (("a", wrapped), ("b", SMALL_QWEN3)):
        path = tmp_path / name / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(cfg))
        code, out, _ = _run(
            [
                "--model",
                str(path),
                "--gpus",
                "8",
                "--seq",
                "16384",
                "--json",
                "--layout",
                "ep=8 cp=2" if name == "a" else "ep=4",
            ],
            capsys,
        )
        assert code == 0 and json.loads(out)["recommended"]["tflops_per_gpu"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "llama"}))
    code, _, err = _run(["--model", str(bad), "--gpus", "8", "--seq", "4096"], capsys)
    assert code == 2 and "model_type" in err


def test_plot(tmp_path, capsys):
    out_png = tmp_path / "plan.png"
    argv = [
        "--model",
        "qwen3-30b-a3b",
        "--gpus",
        "8",
        "--seq",
        "8192",
        "--layout",
        "ep=8",
        "--plot",
        str(out_png),
    ]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, _, err = _run(argv, capsys)
        assert code == 2 and "pip install 'bumblebee[data]'" in err
    else:
        code, _, _ = _run(argv, capsys)
        assert code == 0 and out_png.stat().st_size > 0


@pytest.mark.parametrize(
    "layers, needle",
    [
        (10**12, "num_hidden_layers = 1000000000000 is beyond any model (at most 10000)"),
        (2**63, "is beyond a 64-bit integer"),
        (0, "num_hidden_layers must be positive"),
        (1.5, "num_hidden_layers must be an integer"),
    ],
)
def test_absurd_layer_counts_in_a_config_json(tmp_path, capsys, layers, needle):
    """``plan --model config.json`` with a layer count no model has: one line before any search
    (the probe's 10^12 layers ended in a traceback)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL_QWEN3, "num_hidden_layers": layers}))
    code, out, err = _run(["--model", str(path), "--gpus", "8", "--seq", "4096"], capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_set_train_keys_that_change_memory(capsys):
    """``--set train.balance`` / ``train.micro_batch`` are planned: the step balance loss (the
    default) keeps every micro-batch's saved inputs, micro_batch_global one micro-batch's; the
    emitted config carries the balance asked for; other train keys and bad values are refused."""

    def peak(*sets):
        argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--seq", "16384"]
        argv += ["--layout", "tp=1 pp=1 ep=8 cp=1", "--global-batch", "32", "--json"]
        assert top_cli.main(argv + [x for s in sets for x in ("--set", s)]) == 0
        rec = json.loads(capsys.readouterr().out)["recommended"]
        return rec["memory_gb"]["total"], rec["config"]

    one, one_cfg = peak("train.balance=micro_batch_global")
    step, step_cfg = peak("train.balance=step")
    default, cfg = peak()
    pairs, _ = peak("train.balance=micro_batch_global", "train.micro_batch=2")
    assert step > one + 5 and default == step and pairs > one + 1
    assert 'balance = "micro_batch_global"' in one_cfg and "balance" not in cfg
    for bad, needle in (("train.lr=3", "train.KEY=VALUE"), ("train.balance=x", "train.balance")):
        argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--seq", "16384", "--set", bad]
        assert top_cli.main(argv) == 2
        assert needle in capsys.readouterr().err
