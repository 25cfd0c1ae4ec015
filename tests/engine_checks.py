"""Checks on an RL ``Engine`` shared by the single-process and the 2-rank tests."""

import torch

from bumblebee.primitives.sharding.common import local


def train_state(e):
    """(what, tensor) for everything offload must move: parameters, optimizer-only
    parameters (zero1's fp32 masters) and non-scalar optimizer state."""
    own = {id(p) for p in e.model.parameters()}
    out = [("param " + n, local(p)) for n, p in e.model.named_parameters()]
    out += [
        ("master", p) for g in e.optimizer.param_groups for p in g["params"] if id(p) not in own
    ]
    out += [
        (f"state {k}", local(v))
        for st in e.optimizer.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and v.dim() > 0
    ]
    return out


def check_offload_moves_everything(e):
    """Every state tensor gets new storage holding the same values, the bytes reported moved
    are those bytes, and the Parameter objects (which the optimizer holds) survive. On a CPU
    machine offload (to "cpu") skips every tensor, as all are already there (and reports 0
    bytes moved); so the offload is run towards ``cpu:0``, which compares unequal to the
    tensors' ``cpu``: ``.to`` copies into new storage."""
    before, params = train_state(e), list(e.model.parameters())
    assert any(w.startswith("state exp_avg") for w, _ in before)
    old = [(t.untyped_storage().data_ptr(), t.clone()) for _, t in before]
    report = e.offload(device=torch.device("cpu", 0))
    after = train_state(e)
    assert [w for w, _ in after] == [w for w, _ in before]
    stayed = [w for (w, t), (ptr, _) in zip(after, old) if t.untyped_storage().data_ptr() == ptr]
    assert not stayed, f"offload does not move: {stayed[:4]}"
    assert all(torch.equal(t, value) for (_, t), (_, value) in zip(after, old))
    assert all(a is b for a, b in zip(e.model.parameters(), params))
    nbytes = lambda kind: sum(t.numel() * t.element_size() for w, t in before if kind(w))  # noqa: E731
    assert report["moved_bytes"]["params"] == nbytes(lambda w: w.startswith("param "))
    assert report["moved_bytes"]["optimizer"] == nbytes(lambda w: not w.startswith("param "))
    e.onload()
