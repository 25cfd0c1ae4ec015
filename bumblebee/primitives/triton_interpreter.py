"""FLA's real Triton kernels on CPU tensors, through Triton's interpreter, for the real-kernel
emulation (``train.emulate_cuda = "real_kernels"``) and the kernel tests only.

Triton's interpreter (``triton.runtime.interpreter``, what ``TRITON_INTERPRET=1`` selects) runs a
``@triton.jit`` function as Python over NumPy arrays, one program instance at a time: FLA's kernels
(``chunk_gated_delta_rule``, ``chunk_kda``, ``causal_conv1d``) then run, unchanged, on a machine
without a GPU. Six gaps of the stock interpreter (Triton 3.6 / 3.7) stop or corrupt them; each is
closed here, in memory, while ``interpreted()`` is entered (FLA's files are not touched):

1. ``@triton.autotune`` times every config with the GPU driver's benchmarker ("0 active
   drivers"): the config with the largest blocks is taken without timing (fewest program
   instances: the fastest in the interpreter; every config computes the same values).
2. A ``range`` / ``tl.range`` loop index is a tensor in compiled Triton and a Python int in the
   interpreter (FLA's ``i_t.to(tl.int64)`` fails): the loop body starts by making it a tensor
   (``tl.static_range`` keeps ints, as compiled Triton does).
3. bf16 values are held as their uint16 bit patterns and only the fp32 casts decode them; every
   other operation computes on the bits (triton-lang/triton#11584): arithmetic, math, dots,
   reductions and scans on bf16 decode to fp32, compute, and round back.
4. fp32 -> bf16 casts truncate where compiled Triton rounds to nearest even: they round to
   nearest even.
5. A Python bool passed as a runtime argument is typed int1 over int32 data and rejected: it is
   passed as bool data.
6. A scalar tensor used as a Python int (``range(2, min(BC, T - i))``) converts its one-element
   1-D array with ``int()``, which NumPy 2.4 refuses: its element is read instead.

And one nuisance: kernels compute on masked-out lanes and discard them (``tl.where(m, exp2(x),
0)``), silently in IEEE arithmetic on a GPU; NumPy warns of each overflow there, so the kernels
run under ``np.errstate(all="ignore")``.

The switch itself: kernels decorated before ``interpreted()`` (FLA imported earlier, and
``triton.language``'s own ``@jit`` helpers such as ``tl.sum``) are compiled-Triton
``JITFunction`` objects; inside, each is swapped for an ``InterpretedFunction`` of the same
Python function in its module (and in autotuner / heuristics wrappers, and closures such as
``tl.tensor.sum``), and put back on exit. The interpreter only runs on CPU tensors (it copies any
other tensor to the host and back). Entering is process-wide and nests; it is meant for CPU
processes that run FLA nowhere else.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import sys
import threading

# FLA's entry points bumblebee calls on CUDA (module, attribute)
ENTRY_POINTS = {
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "chunk_kda": ("fla.ops.kda", "chunk_kda"),
    "causal_conv1d": ("fla.modules.causal_conv1d", "causal_conv1d"),
}
_PACKAGES = ("triton", "fla")


def missing() -> str | None:
    """Why the real kernels cannot run here (a package absent), or None."""
    absent = [p for p in _PACKAGES if importlib.util.find_spec(p) is None]
    if not absent:
        return None
    pkg = " and ".join("fla-core" if p == "fla" else p for p in absent)
    return f"{pkg} not installed (pip install triton fla-core)"


_LOCK = threading.Lock()
_DEPTH = 0
_PATCHES: list = []


@contextlib.contextmanager
def interpreted():
    """Run Triton kernels through the patched interpreter inside (see the module docstring)."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            reason = missing()
            if reason:
                raise RuntimeError(f"real Triton kernels on CPU: {reason}")
            try:
                _install(_PATCHES)
            except BaseException:
                _restore()
                raise
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                _restore()


def _restore() -> None:
    for obj, name, old in reversed(_PATCHES):
        _put(obj, name, old)
    _PATCHES.clear()


def _put(obj, name, value) -> None:
    if name == "cell_contents":
        obj.cell_contents = value
    elif isinstance(obj, dict):
        obj[name] = value
    else:
        setattr(obj, name, value)


def _set(patches: list, obj, name, value) -> None:
    """Set ``obj.name`` (a dict key, a closure cell) to ``value``, remembering the old value."""
    if name == "cell_contents":
        old = obj.cell_contents
    elif isinstance(obj, dict):
        old = obj[name]
    else:
        old = getattr(obj, name)
    patches.append((obj, name, old))
    _put(obj, name, value)


def _install(patches: list) -> None:
    import triton  # noqa: F401  (imported before the knob: its own helpers are converted below)
    from triton import knobs

    # FLA's kernels are imported as compiled-Triton functions and converted like the rest
    for module, _ in ENTRY_POINTS.values():
        importlib.import_module(module)
    # kernels decorated from here on (FLA modules imported lazily) are interpreted directly; the
    # knob also makes triton's constexpr helpers return plain values, as the interpreter expects
    env = os.environ.get("TRITON_INTERPRET")
    _set(patches, knobs.runtime, "interpret", True)
    # the knob writes the variable too: keep it out of child processes
    if env is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = env
    _convert_jit_functions(patches)
    _patch_autotune(patches)
    _patch_loop_index(patches)
    _patch_bf16(patches)
    _patch_bool_args(patches)
    _patch_scalar_index(patches)
    _patch_fp_warnings(patches)


def _convert_jit_functions(patches: list) -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, KernelInterface

    made: dict[int, InterpretedFunction] = {}

    def interp(jf):
        if id(jf) not in made:
            made[id(jf)] = InterpretedFunction(jf.fn)
        return made[id(jf)]

    def is_jit(v) -> bool:
        return type(v) is JITFunction

    def convert_wrapper(v) -> None:  # Autotuner(Heuristics(JITFunction)) and the like
        while isinstance(v, KernelInterface) and not isinstance(v, JITFunction):
            inner = getattr(v, "fn", None)
            if is_jit(inner):
                _set(patches, v, "fn", interp(inner))
                return
            v = inner

    def convert_closure(f) -> None:  # tl.tensor.sum and other member wrappers
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if is_jit(value):
                _set(patches, cell, "cell_contents", interp(value))

    import triton.language as tl

    names = [n for n in sys.modules if n.split(".")[0] in ("fla", "triton")]
    for name in names:
        module = sys.modules.get(name)
        if module is None or not (name.startswith("fla") or name.startswith("triton.language")):
            continue
        space = vars(module)
        for key, value in list(space.items()):
            if is_jit(value):
                _set(patches, space, key, interp(value))
            elif isinstance(value, KernelInterface):
                convert_wrapper(value)
    for value in list(vars(tl.core.tensor).values()):
        if callable(value) and not isinstance(value, type):
            convert_closure(value)


def _patch_autotune(patches: list) -> None:
    from triton.runtime import autotuner

    def score(self, *args, config, **meta):
        # the benchmark's [median, p20, p80]: the most work per program instance wins
        size = 1.0
        for v in config.kwargs.values():
            if isinstance(v, int) and not isinstance(v, bool):
                size *= max(v, 1)
        return [-size] * 3

    def no_disk_cache(self, tuning_key, configs, bench_fn):
        bench_fn()  # nothing timed: nothing worth keeping across processes
        return False

    _set(patches, autotuner.Autotuner, "_bench", score)
    _set(patches, autotuner.Autotuner, "check_disk_cache", no_disk_cache)


class _TensorLoopIndex(ast.NodeTransformer):
    """The interpreter's AST rewrite (assignments through ``to_tensor``) plus a first statement in
    each ``range`` / ``tl.range`` loop that makes its index a tensor."""

    def __init__(self, base):
        self.base = base

    def visit_Assign(self, node):
        return self.base.visit_Assign(node)

    def visit_For(self, node):
        self.generic_visit(node)
        f = node.iter.func if isinstance(node.iter, ast.Call) else None
        name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
        if name == "range" and isinstance(node.target, ast.Name):
            i = node.target.id
            first = ast.Assign(targets=[ast.Name(i, ast.Store())], value=ast.Name(i, ast.Load()))
            node.body.insert(0, self.base.visit_Assign(first))
        return node


def _patch_loop_index(patches: list) -> None:
    from triton.runtime import interpreter as ti

    rewriter = ti.FunctionRewriter
    _set(patches, rewriter, "ast_transformer", _TensorLoopIndex(rewriter.ast_transformer))
    # functions rewritten before (by a stock interpreter run) are rewritten again
    _set(patches, ti.InterpretedFunction, "rewritten_fn", {})


def _patch_bf16(patches: list) -> None:
    import numpy as np
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as ti

    TH, B = ti.TensorHandle, ti.InterpreterBuilder

    def is_bf16(h) -> bool:
        return h.dtype == tl.bfloat16 and h.data.dtype == np.uint16

    def decode(bits):
        return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)

    def encode(x, nearest: bool = True):
        """fp32 -> bf16 bits, rounding to nearest even (or truncating); NaN stays NaN."""
        x = np.asarray(x, dtype=np.float32)
        u = x.view(np.uint32)  # same item size: any shape and strides, 0-d kept 0-d
        if nearest:
            r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        else:
            r = u >> np.uint32(16)
        r = np.where(np.isnan(x), (u >> np.uint32(16)) | np.uint32(0x40), r)
        return r.astype(np.uint16)

    def as_f32(h):
        return TH(decode(h.data), tl.float32) if is_bf16(h) else h

    def finish(out, want):
        """``out`` computed on decoded inputs, returned as ``want`` (its dtype) would be."""
        if want == tl.bfloat16 and np.issubdtype(out.data.dtype, np.floating):
            return TH(encode(out.data), tl.bfloat16)
        return out

    def on_decoded(name, result_arg):
        orig = getattr(B, name)

        def method(self, *args):
            handles = [a for a in args if isinstance(a, TH)]
            if not any(is_bf16(h) for h in handles):
                return orig(self, *args)
            want = args[result_arg].dtype
            out = orig(self, *[as_f32(a) if isinstance(a, TH) else a for a in args])
            return finish(out, want)

        _set(patches, B, name, method)

    on_decoded("binary_op", 0)  # every create_<binary op> goes through it; result: lhs's type
    on_decoded("ternary_op", 2)  # select / clamp; result: the third operand's type
    on_decoded("unary_op", 0)
    on_decoded("create_fma", 2)
    on_decoded("create_erf", 0)
    on_decoded("create_rsqrt", 0)
    on_decoded("create_dot", 2)

    cast_impl = B.cast_impl

    def cast(self, src, dst_type, nearest=True):
        src_bf, dst_bf = src.dtype.scalar == tl.bfloat16, dst_type.scalar == tl.bfloat16
        if not (src_bf or dst_bf):
            return cast_impl(self, src, dst_type)
        x = decode(src.data) if src_bf else src.data
        if dst_bf:
            return TH(encode(x.astype(np.float32), nearest), tl.bfloat16)
        return TH(x.astype(ti._get_np_dtype(dst_type)), dst_type.scalar)

    fp_to_fp = B.create_fp_to_fp

    def to_fp(self, src, dst_type, rounding_mode):
        if tl.bfloat16 in (src.dtype.scalar, dst_type.scalar) and tl.float32 in (
            src.dtype.scalar,
            dst_type.scalar,
        ):
            return cast(self, src, dst_type, rounding_mode != ir.ROUNDING_MODE.RTZ)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    _set(patches, B, "cast_impl", cast)
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si", "create_fp_to_ui"):
        _set(patches, B, name, lambda self, src, dst: self.cast_impl(src, dst))
    for name in ("create_fp_ext", "create_fp_trunc"):
        _set(patches, B, name, lambda self, src, dst: self.cast_impl(src, dst))
    _set(patches, B, "create_fp_to_fp", to_fp)

    # reductions and scans: the fast paths run NumPy on the data (the generic ones call the
    # combine function, through the patched ops above)
    iface = ti.ReduceScanOpInterface
    to_tensor = iface.to_tensor

    def to_tensor_bf16(self, ret, dtype):
        if dtype.scalar == tl.bfloat16 and np.issubdtype(np.asarray(ret).dtype, np.floating):
            bits = encode(ret)
            return to_tensor(self, bits if bits.shape else bits.item(), dtype)
        return to_tensor(self, ret, dtype)

    _set(patches, iface, "to_tensor", to_tensor_bf16)

    def values(t):
        return decode(t.handle.data) if is_bf16(t.handle) else t.handle.data

    def r_sum(self, input):
        out = np.sum(values(input), axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(out, input.dtype)

    def r_min_max(self, input, val_reduce_op, idx_reduce_op=None):
        input = input[0] if isinstance(input, tuple) else input
        data, kw = values(input), dict(axis=self.axis, keepdims=self.keep_dims)
        val = (
            None
            if val_reduce_op is None
            else self.to_tensor(val_reduce_op(data, **kw), input.dtype)
        )
        idx = None if idx_reduce_op is None else self.to_tensor(idx_reduce_op(data, **kw), tl.int32)
        return (val, idx) if val is not None and idx is not None else (val if idx is None else idx)

    def scan(op):
        return lambda self, input: [self.to_tensor(op(values(input), axis=self.axis), input.dtype)]

    _set(patches, ti.ReduceOps, "sum", r_sum)
    _set(patches, ti.ReduceOps, "min_max", r_min_max)
    _set(patches, ti.ScanOps, "cumsum", scan(np.cumsum))
    _set(patches, ti.ScanOps, "cumprod", scan(np.cumprod))


def _patch_bool_args(patches: list) -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    implicit_cvt = ti._implicit_cvt

    def cvt(arg):
        if isinstance(arg, bool):
            return tl.tensor(ti.TensorHandle(np.array([arg], dtype=bool), tl.int1), tl.int1)
        return implicit_cvt(arg)

    _set(patches, ti, "_implicit_cvt", cvt)


def _patch_scalar_index(patches: list) -> None:
    from triton.runtime import interpreter as ti

    patch_lang_tensor = ti._patch_lang_tensor

    def patch(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _set(patches, ti, "_patch_lang_tensor", patch)


def _patch_fp_warnings(patches: list) -> None:
    import numpy as np
    from triton.runtime import interpreter as ti

    call = ti.GridExecutor.__call__

    def quiet(self, *args, **kwargs):
        with np.errstate(all="ignore"):
            return call(self, *args, **kwargs)

    _set(patches, ti.GridExecutor, "__call__", quiet)
