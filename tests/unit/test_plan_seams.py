"""The planner's seams into the runtime's code: the dry run states what it assumes through
context variables the primitives read (no patched module globals), and the planner counts each
loss and sharding from the facts it declares in the registry."""

from pathlib import Path

import torch

from bumblebee import registry
from bumblebee.primitives import kernel_choice, packed, recompute
from bumblebee.primitives.loss.linear_ce import default_tiles
from bumblebee.primitives.recompute_scope import in_recompute

PACKAGE = Path(__file__).parents[2] / "bumblebee"


def test_no_patched_globals_in_the_package():
    words = ("unittest.mock", "unittest import mock", "mock.patch")
    hits = [p for p in PACKAGE.rglob("*.py") if any(w in p.read_text() for w in words)]
    assert not hits


def test_assume_changes_the_choice_only_inside():
    cpu = torch.device("cpu")
    assert kernel_choice.select("attention", "varlen", "cpu", torch.bfloat16).name == "sdpa_per_doc"
    assert default_tiles(cpu) == (2048, 4096)
    with kernel_choice.assume("cuda", fla=True):
        assert (
            kernel_choice.select("attention", "varlen", "cpu", torch.bfloat16).name == "varlen_attn"
        )
        assert (
            kernel_choice.select("linear_attention", "chunked", "cpu", torch.float32).name
            == "fla_chunk"
        )
        assert default_tiles(cpu) == (2048, 8192)
    assert kernel_choice.assumed_device() is None
    assert kernel_choice.select("attention", "varlen", "cpu", torch.bfloat16).name == "sdpa_per_doc"


def test_assumed_documents():
    stated = packed.DocLayout(bounds=((0, 2, 4),), seq_len=4)
    pos = torch.arange(4)[None]
    with packed.assume_documents(lambda p: stated):
        assert packed.doc_layout(pos) is stated
    assert packed.doc_layout(pos).bounds == ((0, 4),)


def test_observer_wraps_each_recompute_forward():
    seen = []

    class Scope:
        def __enter__(self):
            seen.append("enter")

        def __exit__(self, *exc):
            seen.append(f"exit {in_recompute()}")

    x = torch.randn(3, requires_grad=True)
    with recompute.observe(Scope):
        y = recompute.FullRecompute().layer(lambda t: (t.sin() * 2).sum(), x)
        assert seen == []  # the first forward is not a recompute
        y.backward()
    assert seen == ["enter", "exit False"]  # around the recompute, outside its flag


def test_every_loss_and_sharding_declares_its_costs():
    import bumblebee.primitives  # noqa: F401  (registers every implementation)

    for slot in ("loss", "sharding"):
        assert all(i.costs is not None for i in registry.implementations(slot).values()), slot
