"""Routing replay (primitives/moe/replay.py): ids recorded in a no-grad pass, weights changed by
one optimizer step; the replayed forward routes exactly as recorded (also in the recompute
forward of full recompute: its gradients equal those without recompute), its router weights
get gradients, and the unreplayed forward routes differently. Both routers, both families."""

import pytest
import torch

from bumblebee.config import ModelConfig, PrimitivesConfig
from bumblebee.models import build_model, resolve_arch
from bumblebee.primitives.moe.replay import RoutingScope

ARCH = {
    "num_hidden_layers": 3,
    "hidden_size": 32,
    "head_dim": 8,
    "moe_intermediate_size": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 64,
}


def model_for(family, router, recompute, seed=0):
    arch = (
        dict(ARCH, mlp_only_layers=[1])
        if family == "qwen3_moe"
        else dict(ARCH, shared_expert_intermediate_size=16)
    )
    torch.manual_seed(seed)
    return build_model(
        resolve_arch(ModelConfig(name=family, arch=arch)),
        PrimitivesConfig(router=router, recompute=recompute, loss="ce", moe_comm="local"),
    )


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "family,router", [("qwen3_moe", "softmax_topk"), ("qwen3_5_moe", "sigmoid_bias")]
)
def test_replay_after_a_step(family, router):
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, 40)), torch.randint(0, 64, (2, 40))
    models = {rc: model_for(family, router, rc) for rc in ("none", "full")}
    recorded = models["full"].record_routing(ids)
    L = models["full"].num_moe_layers
    assert recorded.shape == (2, 40, L, 2)
    for model in models.values():  # one large step changes the routing
        opt = torch.optim.SGD(model.parameters(), lr=5.0)
        model.loss_terms(ids, labels).loss_sum.backward()
        opt.step()
        opt.zero_grad()
    free = models["full"].record_routing(ids)
    assert (free != recorded).any(), "the step should have changed some routing"
    out = {}
    for rc, model in models.items():
        scope = RoutingScope(replay_BTLK=recorded, record={})
        terms = model.loss_terms(ids, labels, routing=scope)
        (terms.loss_sum + terms.aux_loss).backward()
        assert torch.equal(scope.recorded(), recorded)
        out[rc] = (terms.loss_sum.detach(), grads(model))
    # the recompute forward (in backward) used the replayed ids too: same gradients as without recompute
    torch.testing.assert_close(out["full"][0], out["none"][0], rtol=0, atol=0)
    for name, g in out["none"][1].items():
        torch.testing.assert_close(out["full"][1][name], g, rtol=1e-6, atol=1e-9, msg=name)
    gate = [n for n in out["full"][1] if n.endswith("mlp.gate.weight")]
    assert len(gate) == L and all(out["full"][1][n].abs().sum() > 0 for n in gate)
    # replaying the free routing reproduces the plain forward exactly
    plain = models["none"].loss_terms(ids, labels).loss_sum
    again = models["none"].loss_terms(ids, labels, routing=RoutingScope(replay_BTLK=free)).loss_sum
    assert torch.equal(plain, again) and not torch.equal(plain, out["none"][0])


def test_replay_ids_must_match_the_batch():
    model = model_for("qwen3_moe", "softmax_topk", "none")
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match=r"routing replay ids must be \[B, T, L, K\]"):
        model.hidden_states(
            ids, routing=RoutingScope(replay_BTLK=torch.zeros(2, 7, 2, 2, dtype=torch.long))
        )
