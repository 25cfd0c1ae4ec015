"""The RL Engine's DSA indexer loss has the Trainer's normalization: an Engine step over several
micro-batches gives the indexer the gradient of one forward over the same rows with the step's
tokens set (``CausalLM.set_step_tokens``, what the Trainer does), not each forward's own mean."""

from __future__ import annotations

import torch

from bumblebee import load_config
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine

CFG = [
    "model.name=deepseek_v32",
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=96",
    "model.arch.moe_intermediate_size=32",
    "model.arch.index_topk=6",  # below the rows' length: the selection drops keys
    "train.global_batch=3",
    "train.micro_batch=1",  # three forwards in the step
]


def _indexer_grads(model):
    # the decoder layers' indexers (the MTP module is carried, not trained, by the Engine)
    return {
        n: p.grad.clone()
        for n, p in model.named_parameters()
        if n.startswith("model.layers.") and ".indexer." in n
    }


def test_engine_indexer_loss_matches_the_trainer(tmp_path):
    torch.manual_seed(0)
    e = Engine(load_config(None, CFG + [f"train.out_dir={tmp_path}/run"]))
    model = e.model
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (10, 6, 9, 7, 16)]
    b = pack_sequences(tokens, [[i >= 2 for i in range(len(t))] for t in tokens], 16)
    rows, width = b.input_ids.shape
    assert rows == 3  # one micro-batch per row
    with e.train_mode():
        e.zero_grad()
        # a policy-gradient-like loss (its own gradient never reaches the indexer)
        e.forward_backward(b, lambda x: (-(x.logprobs * x.weights).sum(), {}))
        engine = _indexer_grads(model)
    assert all(m.step_tokens == 0 for m in model.modules() if hasattr(m, "step_tokens"))

    # the Trainer's rule on the same rows: one forward, the step's tokens set, the KL's gradient only
    # (the indexer's inputs are detached: the LM loss at weight 0 gives it nothing else)
    model.zero_grad(set_to_none=True)
    model.set_step_tokens(rows * width)
    (0.0 * model(b.input_ids, b.position_ids).sum()).backward()
    model.set_step_tokens(0)
    trainer = _indexer_grads(model)
    assert (
        engine.keys() == trainer.keys() and len(engine) == 2 * 5
    )  # 2 layers x wq_b, wk, k_norm (2), weights_proj
    for n, want in trainer.items():
        assert want.abs().sum() > 0, n
        torch.testing.assert_close(engine[n], want, rtol=1e-4, atol=1e-7, msg=n)
