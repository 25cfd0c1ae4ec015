"""The calls bumblebee's CUDA path makes into optional packages and torch's newer APIs
(``primitives/external_calls.py``), checked on CPU against what is installed, so a function that
moved, was renamed or lost a keyword fails here rather than on the GPU:

- each declaration against the callee's signature or operator schema: it imports and is callable
  (not a subpackage of that name), takes the positional arguments by those names in that order,
  and every keyword bumblebee passes as a named parameter (not swallowed by ``**kwargs``);
  skipped only where the package is absent (fla-core: the torch-2.11 CI environment has it);
- torch's flash call sites, run as the CUDA path runs them, on meta tensors (the operators' fake
  kernels), GQA included;
- the equal-size collectives resolve to a function of this torch;
- no module calls these packages except through the declarations, and a call site that passes
  other arguments than declared raises (so the emulated-CUDA tests keep the declarations true).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib

import pytest
import torch
import torch.distributed as dist

import bumblebee
from bumblebee.primitives import collectives, external_calls
from bumblebee.primitives.attention import flash, flash_sinks, tree, varlen_api
from bumblebee.primitives.cp import ring_flash
from bumblebee.primitives.external_calls import ExternalCall
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.prefix_tree import TreeLayout

CALLS = {n: c for n, c in vars(external_calls).items() if isinstance(c, ExternalCall)}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_declared_call_matches_the_installed_callee(name):
    call = CALLS[name]
    top = (call.registers or call.module).split(".")[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"{call.package} is not installed")
    fn = call.load()
    assert callable(fn)
    params = call.parameters()
    names = list(params)
    assert names[: len(call.positional)] == list(call.positional), (call.qualname, names)
    passed = set(call.positional) | set(call.keywords)
    missing = [n for n in call.keywords if n not in params]
    assert not missing, f"{call.qualname} takes no keyword {missing}; it takes {names}"
    required = [n for n, has_default in params.items() if not has_default and n not in passed]
    assert not required, f"{call.qualname} also needs {required}"
    if not call.is_op:
        inspect.signature(fn).bind(*call.positional, **dict.fromkeys(call.keywords))


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_torch_flash_call_sites_run_on_meta_tensors():
    """The statements the CUDA path runs, on meta tensors (torch's fake kernels give shapes):
    the public varlen_attn through flash.py and tree.py, the operators through the ring's and the
    sinks' kernels, 4 query heads over 2 K/V heads."""
    S, N, K, D = 12, 4, 2, 16
    q, k, v = _meta(S, N, D), _meta(S, K, D), _meta(S, K, D)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    o, lse = varlen_api.forward(q, k, v, cu, cu, 6, 6, True, 0.25, (-1, 0))
    assert o.shape == (S, N, D) and lse.shape == (N, S)
    grads = varlen_api.backward(o, q, k, v, o, lse, cu, cu, 6, 6, True, 0.25, (-1, 0))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    ring = ring_flash.cuda_block_kernel()
    o, lse = ring.forward(q, k, v, cu, cu, 6, 6, False, 0.25)
    assert [g.shape for g in ring.backward(o, q, k, v, o, lse, cu, cu, 6, 6, False, 0.25)] == [
        q.shape,
        k.shape,
        v.shape,
    ]
    sinks = flash_sinks.cuda_kernel()
    o, lse = sinks.forward(q, k, v, cu, 6, (3, 0), 0.25)
    assert sinks.backward(o, q, k, v, o, lse, cu, 6, (3, 0), 0.25)[1].shape == k.shape

    B, T = 2, 6
    qb, kb, vb = _meta(B, N, T, D), _meta(B, K, T, D), _meta(B, K, T, D)
    layout = DocLayout(bounds=((0, 2, 6), (0, 6)), seq_len=T)
    assert flash.flash_varlen(qb, kb, vb, layout, 0.25).shape == qb.shape
    assert flash.flash_varlen(qb, kb, vb, layout, 0.25, window=2).shape == qb.shape
    tree_lay = TreeLayout(bounds=((0, 2, 6), (0, 6)), seq_len=T, parents=((-1, 0), (-1,)))
    out = tree.gathered_varlen(qb, kb, vb, tree_lay, 0.25, flash.cuda_varlen_attn())
    assert out.shape == qb.shape


@pytest.mark.parametrize("which", ["all_gather_single", "reduce_scatter_single"])
@pytest.mark.parametrize("newer_name", [True, False])
def test_collectives_resolve_to_this_torchs_function(which, newer_name, monkeypatch):
    """The helper calls the ``*_single`` name where torch has it, else the ``*_tensor`` one (as on
    torch 2.11), with arguments that bind to the real function's signature."""
    older = {"all_gather_single": "all_gather_into_tensor"}.get(which, "reduce_scatter_tensor")
    present = [n for n in (which, older) if hasattr(dist, n)]
    assert present, f"torch.distributed has neither {which} nor {older}"
    if not newer_name:
        monkeypatch.delattr(dist, which, raising=False)
    elif not hasattr(dist, which):
        pytest.skip(f"this torch has no {which}")
    target = which if newer_name else older
    real, seen = getattr(dist, target), []

    def record(*args, **kwargs):
        inspect.signature(real).bind(*args, **kwargs)
        seen.append(target)

    monkeypatch.setattr(dist, target, record)
    x = torch.zeros(4)
    getattr(collectives, which)(x, x, group=None)
    assert seen == [target]


def _calls_outside_the_declarations():
    """(file, line, what) of every import from fla, of a declared name from its module, of a
    torch.ops.torch_attn operator, and of a raw equal-size collective, outside the modules that
    own them."""
    root = pathlib.Path(bumblebee.__file__).parent
    declared = {(c.module, c.name) for c in CALLS.values()}
    raw = {"all_gather_single", "all_gather_into_tensor"}
    raw |= {"reduce_scatter_single", "reduce_scatter_tensor"}
    owners = {"primitives/external_calls.py", "primitives/collectives.py"}
    owners.add("primitives/comm_check.py")  # it wraps torch.distributed's own names
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.split(".")[0] == "fla"]
            elif isinstance(node, ast.ImportFrom) and node.module:
                bad = [
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if node.module.split(".")[0] == "fla" or (node.module, a.name) in declared
                ]
            elif isinstance(node, ast.Attribute):
                text = ast.unparse(node)
                bad = [text] if text.startswith("torch.ops.torch_attn") else []
                bad += [text] if node.attr in raw and text.startswith("dist.") else []
            else:
                continue
            found += [(rel, node.lineno, b) for b in bad]
    return found


def test_no_module_bypasses_the_declarations():
    assert _calls_outside_the_declarations() == []


def test_a_call_site_passing_undeclared_arguments_raises():
    call = external_calls.CHUNK_KDA
    args = (None,) * len(call.positional)
    kwargs = dict.fromkeys(call.keywords)
    assert call.call(lambda *a, **kw: (a, kw), *args, **kwargs) == (args, kwargs)
    with pytest.raises(TypeError, match="declared in external_calls.py"):
        call.call(lambda *a, **kw: None, *args, **kwargs, use_gate_in_kernel=False)
    with pytest.raises(TypeError, match="declared in external_calls.py"):
        call.call(lambda *a, **kw: None, *args[:-1], **kwargs)
    del kwargs["cu_seqlens_cpu"]
    with pytest.raises(TypeError, match="declared in external_calls.py"):
        call.call(lambda *a, **kw: None, *args, **kwargs)
    with pytest.raises(TypeError, match="not declared optional"):
        external_calls.VARLEN_ATTN.take(num_splits=1)
