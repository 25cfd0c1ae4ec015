"""Where ``train.global_batch`` travels from ``Trainer.__init__`` (issue 36's "walk").

The value is replaced by an int that records every Python operation on it -- arithmetic,
comparison, formatting -- and hands the same recording type to whatever is computed from it
(rows per rank, micro-batches, the balance denominator, tokens per step, ...). C code reads an
int subclass without calling its methods (``range(n)``, ``float * n``), so a line tracer also
records each executed line that names a variable or a plain attribute (``self.x``, ``cfg.t.x``)
holding such a value. A Trainer is built and runs one step (single process, the default tiny
model, 2 layers, 64 tokens); the walk is the sequence of bumblebee files those lines are in,
in execution order, repeats in a row merged. ``files``: the distinct files; ``climbs``: calls
on the way to a touching line that go *up* -- into a higher layer (core < primitives, data,
perf < models < runtime < rl: the layering test's rules, ``tests/layering_rules.py``), or
within a layer into a module whose module-level imports reach the caller's -- and into a file
the call stack did not come through, counted once per (caller file, callee file) pair.
``returns`` (reported, not a goal): how often the walk comes back to a file it had left; the
Trainer handing the batch size to the data source and asking it for rows each step is one.
The operations' values are those of a plain int: nothing the run computes changes.

    python benchmarks/global_batch_walk.py   # prints the walk, then files and climbs
"""

from __future__ import annotations

import ast
import io
import linecache
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "bumblebee") + os.sep
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the layering rules the layering test checks
from layering_rules import LAYER_OF, rank  # noqa: E402

_SEEN: list[tuple[str, int]] = []  # (file under bumblebee/, line) of each operation
_STACKS: set[tuple[str, ...]] = set()  # the bumblebee files on the call stack of each touch


def _record(f) -> None:
    name = os.path.abspath(f.f_code.co_filename)
    if not name.startswith(PACKAGE):
        return
    _SEEN.append((os.path.relpath(name, ROOT), f.f_lineno))
    stack = []
    while f is not None:
        where = os.path.abspath(f.f_code.co_filename)
        if where.startswith(PACKAGE):
            rel = os.path.relpath(where, ROOT)
            if not stack or stack[-1] != rel:
                stack.append(rel)
        f = f.f_back
    _STACKS.add(tuple(reversed(stack)))


def _note() -> None:
    _record(sys._getframe(2))  # the caller of the dunder


CHAIN = re.compile(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _plain(obj, chain: list[str]):
    """``obj.a.b`` through instance dicts only (no property runs), or None."""
    for attr in chain:
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict) or attr not in d:
            return None
        obj = d[attr]
    return obj


def _line(frame, event, _arg):
    if event == "line":
        text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).split("#")[0]
        for m in CHAIN.finditer(text):
            base, *chain = m.group(1).split(".")
            if base in frame.f_locals:
                value = frame.f_locals[base]
                for i in range(len(chain) + 1):
                    if isinstance(_plain(value, chain[:i]), Traced):
                        _record(frame)
                        return _line
    return _line


def _call(frame, event, _arg):
    if event == "call" and os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE):
        return _line
    return None


def _traced(op: str, wraps: bool):
    base = getattr(int, op)

    def method(self, *args):
        _note()
        out = base(self, *args)
        if wraps and type(out) is int:
            return Traced(out)
        if wraps and type(out) is tuple:  # divmod
            return tuple(Traced(v) if type(v) is int else v for v in out)
        return out

    return method


class Traced(int):
    """An int whose operations are recorded; results computed from it are Traced too."""

    def __repr__(self) -> str:
        _note()
        return int.__repr__(self)

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        _note()
        return format(int(self), spec)

    def __hash__(self) -> int:
        return int.__hash__(self)


for _op in (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __floordiv__ __rfloordiv__ __mod__ "
    "__rmod__ __divmod__ __rdivmod__ __neg__ __pos__ __abs__ __pow__ __rpow__"
).split():
    setattr(Traced, _op, _traced(_op, True))
for _op in (
    "__truediv__ __rtruediv__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __index__ __int__ "
    "__float__ __bool__"
).split():
    setattr(Traced, _op, _traced(_op, False))


def walk(overrides: list[str] | None = None) -> list[str]:
    """The files (repeats in a row merged) the value's operations ran in, building a Trainer
    and running one step."""
    from bumblebee.runtime.resolve import load_config
    from bumblebee.runtime.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        sets = [
            "train.seq_len=64",
            "model.arch.num_hidden_layers=2",
            f"train.out_dir={out}",
            "train.steps=1",
            *(overrides or []),
        ]
        cfg = load_config(None, sets)
        cfg.train.global_batch = Traced(cfg.train.global_batch)
        _SEEN.clear()
        _STACKS.clear()
        sys.settrace(_call)
        try:
            trainer = Trainer(cfg, stream=io.StringIO())
            trainer.train_step()
        finally:
            sys.settrace(None)
        trainer.metrics.close()
    files: list[str] = []
    for name, _line in _SEEN:
        if not files or files[-1] != name:
            files.append(name)
    return files


def _layer(rel: str) -> int:
    """Height of the layer of ``bumblebee/<first>/...`` by the test suite's layering rules."""
    return rank(LAYER_OF[rel.split(os.sep)[1].removesuffix(".py")])


def _file_of(module: str) -> str | None:
    base = os.path.join(ROOT, *module.split("."))
    for cand in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(cand):
            return os.path.relpath(cand, ROOT)
    return None


def _imports() -> dict[str, set[str]]:
    """file -> the bumblebee files its module-level imports name (a function-level import is how
    code reaches up, so it does not make a floor; nor does a package ``__init__`` run on the way
    to one of its modules)."""
    out: dict[str, set[str]] = {}
    for folder, _dirs, names in os.walk(PACKAGE):
        for n in names:
            if not n.endswith(".py"):
                continue
            path = os.path.join(folder, n)
            deps = out.setdefault(os.path.relpath(path, ROOT), set())
            for node in ast.parse(open(path).read()).body:
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    mods = [
                        f"{node.module}.{a.name}"
                        if _file_of(f"{node.module}.{a.name}")
                        else node.module
                        for a in node.names
                    ]
                deps.update(f for m in mods if m.startswith("bumblebee.") and (f := _file_of(m)))
    return out


def _reaches(graph: dict[str, set[str]], a: str, b: str) -> bool:
    seen, todo = set(), [a]
    while todo:
        x = todo.pop()
        if x == b:
            return True
        if x not in seen:
            seen.add(x)
            todo.extend(graph.get(x, ()))
    return False


def climbs() -> list[tuple[str, str]]:
    """(caller, callee) file pairs on a touch's call stack where the callee sits above the caller
    (imports it, and is not imported by it) and is not a file the stack came through already (a
    callback into the code that made the call, e.g. ``errors.gather`` running a check's closure,
    is read where it is written)."""
    graph = _imports()
    up = set()
    for stack in _STACKS:
        for i, (caller, callee) in enumerate(zip(stack, stack[1:])):
            if callee in stack[:i]:
                continue
            higher = _layer(callee) > _layer(caller) or (
                _layer(callee) == _layer(caller)
                and _reaches(graph, callee, caller)
                and not _reaches(graph, caller, callee)
            )
            if higher:
                up.add((caller, callee))
    return sorted(up)


def measure(files: list[str]) -> dict:
    """files (distinct), climbs (upward calls), returns (to a file the walk had left)."""
    return {
        "files": len(set(files)),
        "climbs": len(climbs()),
        "returns": len(files) - len(set(files)),
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    files = walk(sys.argv[1:])
    lines: dict[str, list[int]] = {}
    for name, line in _SEEN:
        lines.setdefault(name, []).append(line)
    for name in files:
        print(name, sorted(set(lines[name])))
    for caller, callee in climbs():
        print(f"climb: {caller} -> {callee}")
    print(measure(files))
