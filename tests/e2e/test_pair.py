"""`bumblebee pair`: the paired table, the tolerance verdict and its exit code, and the
refusals (a config diff beyond the slot, a slot with one implementation) with exit 2."""

import json

import pytest

from bumblebee import registry
from bumblebee.cli import build_parser, main
from bumblebee.config import ConfigError
from bumblebee.models.presets import PRESETS
from bumblebee.runtime.pair import command as pair
from bumblebee.runtime.pair import verdict as pair_report

TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=64",
    "train.seq_len=64",
    "train.global_batch=2",
    "data.min_records=2",
    "data.max_records=6",
]


def pair_cli(tmp_path, *args):
    sets = [x for s in TINY + [f"train.out_dir={tmp_path}"] for x in ("--set", s)]
    out = tmp_path / "pair.json"
    code = main(["pair", *args, *sets, "--json", str(out)])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def test_loss_pair_prints_the_table_and_passes(tmp_path, capsys):
    code, result = pair_cli(
        tmp_path, "--slot", "loss", "--a", "ce", "--b", "linear_ce", "--steps", "2"
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert 'primitives.loss: "ce" -> "linear_ce"' in out and "max|a-b|" in out and "pass:" in out
    for quantity in (
        "loss",
        "grad_norm",
        "logprobs",
        "model.layers.0",
        "model.norm",
        "peak_mem_MiB",
        "step_time_s",
    ):
        assert f"   2  {quantity} " in out, quantity
    assert result["passed"] and result["config_diff"] == [["primitives.loss", "ce", "linear_ce"]]
    rows = {(r["step"], r["quantity"]): r for r in result["rows"]}
    # step 1 starts from identical weights: everything before the LM head is bit-identical,
    # and the two losses agree to fp32 reassociation
    assert rows[(1, "model.norm")]["identical"] and rows[(1, "model.layers.0")]["identical"]
    assert rows[(1, "logprobs")]["rel"] < 1e-6 and rows[(1, "grad_norm")]["rel"] < 1e-6
    assert all(r["rel"] <= result["tolerance"] for r in result["rows"] if r["checked"])
    assert rows[(2, "peak_mem_MiB")]["a"] > 0 and rows[(2, "step_time_s")]["ratio"] > 0
    assert (tmp_path / "pair-loss" / "a-ce" / "metrics.jsonl").exists()


def test_bf16_differences_exceed_the_fp32_budget(tmp_path, capsys, monkeypatch):
    """A real bf16 pair: within the loss slot's bf16 tolerance, well outside its fp32 one.
    Holding the bf16 run to the fp32 budget fails with exit code 1."""
    fp32, bf16 = pair.TOLERANCES["loss"]
    monkeypatch.setitem(pair.TOLERANCES, "loss", (fp32, fp32))
    code, result = pair_cli(
        tmp_path,
        "--slot",
        "loss",
        "--a",
        "ce",
        "--b",
        "linear_ce",
        "--steps",
        "2",
        "--set",
        "train.dtype=bfloat16",
    )
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and not result["passed"] and result["failures"]
    assert pair_report.check(result["rows"], bf16) == []
    assert pair_report.check(result["rows"], fp32)


def test_check_marks_rows():
    rows = [
        {"step": 1, "quantity": "loss", "checked": True, "rel": 1e-5},
        {"step": 1, "quantity": "logprobs", "checked": True, "rel": float("nan")},
        {"step": 1, "quantity": "model.norm", "checked": True, "rel": 2e-4},
        {"step": 1, "quantity": "peak_mem_MiB", "checked": False, "rel": None},
    ]
    failures = pair_report.check(rows, 1e-4)
    assert [r.get("ok") for r in rows] == [True, False, False, None]
    assert len(failures) == 2 and "model.norm" in failures[1]
    assert pair.tolerance("loss", "float32") < pair.tolerance("loss", "bfloat16")


def test_config_diff_beyond_the_slot_exits_2(capsys):
    code = main(
        ["pair", "--slot", "loss", "--a", "ce", "--b", "linear_ce", "--set-b", "train.lr=0.01"]
    )
    captured = capsys.readouterr()
    assert code == 2
    assert "train.lr: 0.002 -> 0.01" in captured.out  # the diff is printed before the refusal
    assert captured.err.strip() == (
        "bumblebee: error: the two runs differ in train.lr besides primitives.loss; "
        "a pair may differ only in: primitives.loss"
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--slot", "router", "--a", "softmax_topk", "--b", "softmax_topk"],
            "nothing to pair; slots that can be paired",
        ),
        (
            ["--slot", "routers", "--a", "softmax_topk", "--b", "sigmoid_bias"],
            "unknown slot 'routers'",
        ),
        (
            ["--slot", "loss", "--a", "ce", "--b", "fast_ce"],
            "unknown loss implementation 'fast_ce'",
        ),
        (
            ["--slot", "cp_attention", "--a", "allgather", "--b", "ring"],
            "pass --nproc N with N >= 2",
        ),
        (
            ["--slot", "loss", "--a", "ce", "--b", "linear_ce", "--set-a", "primitives.loss=ce"],
            "choose the implementation",
        ),
    ],
)
def test_bad_pairs_exit_2(args, message, capsys, one_router):
    assert main(["pair", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def one_router(monkeypatch):
    """Every built-in slot has two implementations; a slot with one (here the router with only
    softmax_topk) has nothing to pair."""
    implementations = registry.implementations
    monkeypatch.setattr(
        registry,
        "implementations",
        lambda slot: {
            k: v
            for k, v in implementations(slot).items()
            if slot != "router" or k == "softmax_topk"
        },
    )


def test_pairable_slots_listed_in_the_error(capsys, one_router):
    main(["pair", "--slot", "router", "--a", "softmax_topk", "--b", "softmax_topk"])
    listed = capsys.readouterr().err.split("slots that can be paired: ")[1].strip().split(", ")
    assert (
        listed == [s for s in registry.SLOTS if len(registry.implementations(s)) > 1]
        and "router" not in listed
    )


def test_linear_attention_switches_to_the_hybrid_model(tmp_path):
    args = build_parser().parse_args(
        ["pair", "--slot", "linear_attention", "--a", "recurrent", "--b", "chunked"]
    )
    cfg_a, cfg_b, notes = pair.build_pair(args)
    assert cfg_a.model.name == cfg_b.model.name == "qwen3_5_moe" and "qwen3_5_moe" in notes[0]
    assert pair.config_diff(cfg_a, cfg_b) == [
        ("primitives.linear_attention", "recurrent", "chunked")
    ]
    hf = tmp_path / "hf"  # a qwen3_moe checkpoint cannot be switched: a clear error instead
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(PRESETS["qwen3_moe"]["tiny"]))
    args = build_parser().parse_args(
        [
            "pair",
            "--slot",
            "linear_attention",
            "--a",
            "recurrent",
            "--b",
            "chunked",
            "--set",
            f"model.hf_path={hf}",
        ]
    )
    with pytest.raises(ConfigError, match="only used by model.name = 'qwen3_5_moe'"):
        pair.build_pair(args)


def test_companion_keys_may_differ():
    args = build_parser().parse_args(
        [
            "pair",
            "--slot",
            "moe_comm",
            "--a",
            "local",
            "--b",
            "alltoall",
            "--nproc",
            "2",
            "--set-b",
            "parallel.ep=2",
        ]
    )
    cfg_a, cfg_b, _ = pair.build_pair(args)
    diff = pair.config_diff(cfg_a, cfg_b)
    assert [k for k, _, _ in diff] == ["parallel.ep", "primitives.moe_comm"]
    pair.check_diff(diff, "moe_comm")
    with pytest.raises(ConfigError, match="differ in parallel.ep"):
        pair.check_diff(diff, "experts")


def test_pair_on_two_ranks(tmp_path, capsys):
    """``--nproc 2``: both runs launch on 2 local ranks with the experts split in two (so the
    dispatch really communicates) and agree within the slot's tolerance."""
    code, result = pair_cli(
        tmp_path,
        "--slot",
        "moe_comm",
        "--a",
        "alltoall",
        "--b",
        "chunked",
        "--nproc",
        "2",
        "--steps",
        "2",
        "--set",
        "parallel.ep=2",
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "without communication" not in out and result["passed"]
    for side in ("a-alltoall", "b-chunked"):  # both ran (ep = 2 is refused on one rank)
        assert (tmp_path / "pair-moe_comm" / side / "metrics.jsonl").exists()
    assert result["config_diff"] == [["primitives.moe_comm", "alltoall", "chunked"]]
    rows = {(r["step"], r["quantity"]): r for r in result["rows"]}
    assert rows[(2, "loss")]["checked"] and rows[(2, "loss")]["rel"] <= result["tolerance"]
    # step 1 starts from the same weights; chunked EP runs its expert GEMMs on fewer rows per call, which
    # CPU kernels may round differently for some data (bit identity held for the old task, not the new)
    assert rows[(1, "model.norm")]["rel"] <= 1e-6
