"""Held-out evaluation without [tokens, vocab] logits (runtime/eval.py): the tiled argmax is the
argmax (first index of a tie included), the answer loss and accuracy equal the full-logits
evaluation it replaced, and at a 102,400-token vocabulary and 4,096-token rows the evaluation's
peak live memory stays a linear-CE tile above the static state (the full-logits one asked
1.56 GiB more)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from bumblebee import load_config
from bumblebee.data.packing import IGNORE
from bumblebee.primitives.loss import linear_cross_entropy
from bumblebee.runtime.eval import answer_scores, evaluate, tiled_argmax
from bumblebee.runtime.trainer import Trainer

MiB = 2**20
SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "train.seq_len=256",
    "train.global_batch=2",
    "train.micro_batch=1",
    "data.min_records=2",
    "data.max_records=6",
    "data.eval_min_distance=64",
    "data.eval_docs=4",
    "data.value_len=1",
    "train.lr=1e-2",
    "train.warmup_steps=1",
]


def trainer_for(tmp_path, *overrides) -> Trainer:
    return Trainer(
        load_config(None, SMALL + [f"train.out_dir={tmp_path}", *overrides]), stream=io.StringIO()
    )


@torch.no_grad()
def full_logits_reference(trainer) -> dict:
    """The evaluation before this change: the model's [B, T, V] logits, cross-entropy and argmax on them."""
    model, held_out = trainer.model, trainer.source.eval_queries()
    wrong_Q = torch.zeros(sum(len(ev.distances) for ev in held_out), dtype=torch.float64)
    loss, tokens, offset = 0.0, 0, 0
    model.eval()
    for ev in held_out:
        b = ev.batch
        for i in range(b.input_ids.shape[0]):
            logits_TV = model(b.input_ids[i : i + 1], position_ids=b.position_ids[i : i + 1])[
                0
            ].float()
            keep = b.labels[i] != IGNORE
            lab_N = b.labels[i][keep]
            loss += float(F.cross_entropy(logits_TV[keep], lab_N, reduction="sum"))
            tokens += lab_N.numel()
            wrong_Q.index_add_(
                0, ev.query_ids[i][keep] + offset, (logits_TV[keep].argmax(-1) != lab_N).double()
            )
        offset += len(ev.distances)
    model.train()
    return {
        "eval_loss": loss / tokens,
        "eval_tokens": tokens,
        "eval_accuracy": float((wrong_Q == 0).double().mean()),
    }


def test_tiled_argmax_is_argmax_first_index_of_ties():
    g = torch.Generator().manual_seed(0)
    h_NH, w_VH = (
        torch.randn(37, 16, generator=g),
        torch.randn(10000, 16, generator=g),
    )  # 3 vocab tiles on CPU
    w_VH /= w_VH.norm(
        dim=1, keepdim=True
    )  # unit rows: h = c w[i] scores row i (and its copies) highest
    w_VH[9000] = w_VH[5000] = w_VH[100]  # a tie across tiles: the first index wins, as in argmax
    h_NH[:5] = w_VH[100] * 10  # rows whose maximum is that tie
    want = (h_NH @ w_VH.T).argmax(-1)
    assert bool((want[:5] == 100).all())
    assert torch.equal(tiled_argmax(h_NH, w_VH), want)


def test_answer_scores_equal_full_logits_per_token():
    """Per token, against [T, V] logits: the loss and the miss at scored positions, 0 elsewhere
    (10,000-token vocabulary: 3 vocab tiles on CPU; the labels half the argmax, half random)."""
    g = torch.Generator().manual_seed(1)
    T, V, H = 300, 10000, 32
    h_TH, w_VH = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    logits_TV = h_TH @ w_VH.T
    labels_T = torch.where(
        torch.rand(T, generator=g) < 0.5, logits_TV.argmax(-1), torch.randint(V, (T,), generator=g)
    )
    labels_T[torch.rand(T, generator=g) < 0.7] = IGNORE
    keep = labels_T != IGNORE
    got_T2 = answer_scores(h_TH, w_VH, labels_T, linear_cross_entropy)
    assert not got_T2[~keep].any()
    want_loss = F.cross_entropy(logits_TV[keep], labels_T[keep], reduction="none")
    torch.testing.assert_close(got_T2[keep, 0], want_loss, rtol=1e-5, atol=1e-5)
    want_miss = (logits_TV[keep].argmax(-1) != labels_T[keep]).float()
    assert 0 < want_miss.sum() < keep.sum()
    assert torch.equal(got_T2[keep, 1], want_miss)


@pytest.mark.parametrize("loss", ["linear_ce", "ce"])
def test_answers_match_the_full_logits_evaluation(tmp_path, loss):
    trainer = trainer_for(tmp_path, f"primitives.loss={loss}", "train.steps=3")
    for _ in range(3):  # a trained model: some answers right, some wrong
        trainer.train_step()
    got, want = evaluate(trainer), full_logits_reference(trainer)
    print(got, want)
    assert got["eval_tokens"] == want["eval_tokens"] > 0
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert 0 < want["eval_accuracy"] < 1  # one-digit answers: some right, some wrong
    assert got["eval_accuracy"] == want["eval_accuracy"]


def test_eval_peak_has_no_tokens_by_vocab_block(tmp_path):
    """102,400-token vocabulary, one 4,096-token held-out row, evaluated with the trainer's own
    measurement (MemoryTracker: live tensor bytes, ``eval_peak_mem_bytes``; static state: the
    parameters). The full-logits evaluation held a [4096, 102400] fp32 block, 1.56 GiB, above the
    static state; now a linear-CE tile (32 MiB on CPU) and the row's activations do: bound 64 MiB.
    (A training step at this size takes seconds on the head alone; the metrics line gives both
    peaks, ``peak_mem_bytes`` and ``eval_peak_mem_bytes``.)"""
    V, T = 102400, 4096
    trainer = trainer_for(
        tmp_path,
        f"model.arch.vocab_size={V}",
        "model.arch.hidden_size=16",
        f"train.seq_len={T}",
        "train.global_batch=1",
        "data.eval_docs=1",
        "data.eval_min_distance=1024",
        "data.max_records=16",
        "primitives.loss=linear_ce",
        "train.steps=1",
    )
    static = sum(
        p.numel() * p.element_size() for p in trainer.model.parameters()
    )  # no step: no gradient, no Adam
    out = (
        trainer.evaluate()
    )  # the trainer's own measurement (MemoryTracker), logged as eval_peak_mem_bytes
    over = out["eval_peak_mem_bytes"] - static
    print(f"static {static / MiB:.1f} MiB, evaluation peak +{over / MiB:.1f} MiB, {out}")
    assert out["eval_tokens"] == 16
    assert over <= 64 * MiB, (
        f"evaluation peak {over / MiB:.0f} MiB above the static state: a [{T}, {V}] "
        f"fp32 block is {T * V * 4 / MiB:.0f} MiB"
    )
