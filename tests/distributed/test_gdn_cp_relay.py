"""Probe-free Gated DeltaNet context parallelism (``linear_attention/cp_relay.py``, ``carry =
"relay"``): the state passed rank to rank through the core's initial state.

One GatedDeltaNet layer at cp=2 and cp=4 on packed documents (the layouts of
``test_gdn_context_parallel.py``: 1- and 2-token documents, boundaries at and one token before
shard edges, a document spanning every rank), zigzag and relayout shards, with the chunked
core and with the FLA adapter driven by its reference kernel (``chunk_gated_delta_rule``'s
signature in plain PyTorch): outputs, input gradients and every weight gradient equal the
single-process layer and the probe ("scan") path at 1e-5. One spawn per world size.
"""

import functools

import pytest
import torch
from dist_utils import run_distributed
from test_gdn_context_parallel import LAYER_DOCS, T_LAYER, layer_and_inputs, one_thread  # noqa: F401

from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence, unshard_sequence
from bumblebee.primitives.linear_attention.cp import gated_delta_net_cp
from bumblebee.primitives.linear_attention.fla import (
    fla_gated_delta_rule,
    reference_chunk_gated_delta_rule,
)
from bumblebee.primitives.packed import doc_layout

FLA_REF = functools.partial(fla_gated_delta_rule, kernel=reference_chunk_gated_delta_rule)
CASES = [
    (core, carry, relayout)
    for core in ("chunked", "fla")
    for carry, relayout in (("relay", False), ("relay", True), ("scan", False))
]


def make(core: str):
    layer, x, w, pos = layer_and_inputs()
    if core == "fla":
        layer.core = FLA_REF
    return layer, x, w, pos


def run_single(core: str):
    layer, x, w, pos = make(core)
    x = x.clone().requires_grad_()
    y, _ = layer(x, doc_layout(pos))
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _ranks(rank, world):
    out = []
    for core, carry, relayout in CASES:
        layer, x, w, pos = make(core)
        layout = build_cp_shards(shard_sequence(pos, world, rank), torch.distributed.group.WORLD)
        x_local = shard_sequence(x, world, rank).clone().requires_grad_()
        y = gated_delta_net_cp(layer, x_local, layout, relayout=relayout, carry=carry)
        (y * shard_sequence(w, world, rank)).sum().backward()
        out.append((y.detach(), x_local.grad, {n: p.grad for n, p in layer.named_parameters()}))
    return out


def gathered(results, i):
    """(output, input grad, {name: grad summed over ranks}) of case i, in global order."""
    y = unshard_sequence([r[i][0] for r in results])
    gx = unshard_sequence([r[i][1] for r in results])
    return y, gx, {n: sum(r[i][2][n] for r in results) for n in results[0][i][2]}


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("world", [2, 4])
def test_relay_equals_single_process_and_probe(world):
    assert T_LAYER % (2 * world) == 0 and len(LAYER_DOCS) == 2
    results = run_distributed(_ranks, world)
    for i, (core, carry, relayout) in enumerate(CASES):
        what = f"cp={world} {core} {carry}{' relayout' if relayout else ''}"
        y, gx, grads = gathered(results, i)
        y_ref, gx_ref, grads_ref = run_single(core)
        pairs = [(y, y_ref, "output"), (gx, gx_ref, "input grad")] + [
            (grads[n], g, n) for n, g in grads_ref.items()
        ]
        if carry == "relay":  # and the probe path of the same core
            y_p, gx_p, grads_p = gathered(results, CASES.index((core, "scan", False)))
            pairs += [(y, y_p, "output vs scan"), (gx, gx_p, "input grad vs scan")]
            pairs += [(grads[n], grads_p[n], f"{n} vs scan") for n in grads_p]
        for got, ref, name in pairs:
            assert rel(got, ref) < 1e-5, f"{what}: {name} relative error {rel(got, ref):.1e}"


def test_unknown_carry_is_refused():
    layer, x, _, pos = layer_and_inputs()
    with pytest.raises(ValueError, match="carry must be one of scan, relay"):
        gated_delta_net_cp(layer, x, None, carry="probe")
