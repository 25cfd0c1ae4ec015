"""Layering (docs/architecture.md, "Package layout"): dependencies point downward only, and no cycles.

Every module under bumblebee/ is parsed with ``ast``; every import of a bumblebee
module -- at the top or inside a function (a lazy import is still a dependency) --
is checked against ``ALLOWED``:

    core (errors, config, registry)  <-  primitives  <-  models  <-  runtime  <-  rl
    data and perf sit beside primitives (core only); plan reads models and the
    runtime's resolver; nothing but the CLI imports plan.

``core`` is a leaf: it imports nothing but itself. ``api`` is the package root
``bumblebee/__init__.py``: the public facade users import (it may re-export anything
but plan), which no layer below runtime may import from. On top of the layer rules,
the module import graph (every explicit import, lazy ones included) must be acyclic.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from layering_rules import ALLOWED, ALLOWED_MODULES, LAYER_OF

PACKAGE = Path(__file__).parents[2] / "bumblebee"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (
        PACKAGE.parent / rel / "__init__.py"
    ).is_file()


def imported_modules(source: str, module: str, is_package: bool):
    """(line, dotted bumblebee module) for every import in ``source``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "bumblebee":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != "bumblebee":
                continue
            for alias in node.names:  # `from bumblebee.x import y`: y may be a submodule
                yield (
                    node.lineno,
                    f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base,
                )


def layer(dotted: str) -> str | None:
    parts = dotted.split(".")
    return LAYER_OF.get(parts[1] if len(parts) > 1 else "__init__")


def violations(path: Path, source: str) -> list[str]:
    module = module_name(path)
    own = layer(module)
    found = []
    for line, target in imported_modules(source, module, path.name == "__init__.py"):
        other = layer(target)
        if target in ALLOWED_MODULES.get(own, ()):
            continue
        if other is None or other not in ALLOWED[own]:
            found.append(
                f"bumblebee/{path.relative_to(PACKAGE)}:{line}: {own} imports {target} ({other})"
            )
    return found


def sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_belongs_to_a_layer():
    unknown = sorted(
        {p.relative_to(PACKAGE).parts[0] for p in sources()}
        - {f"{name}.py" for name in LAYER_OF}
        - set(LAYER_OF)
    )
    assert not unknown, (
        f"bumblebee/{unknown[0]} is in no layer (docs/architecture.md): add it to LAYER_OF / ALLOWED"
    )


def test_imports_follow_the_layering():
    found = [v for p in sources() for v in violations(p, p.read_text())]
    assert not found, "imports across the layering (docs/architecture.md):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "path,source",
    [
        ("primitives/loss/fake.py", "from bumblebee.runtime.trainer import Trainer"),
        ("primitives/fake.py", "def f():\n    from bumblebee.models import build_model"),
        ("models/fake.py", "import bumblebee.rl.losses"),
        ("runtime/fake.py", "from bumblebee.plan import recipe"),
        ("rl/fake.py", "from bumblebee.plan.memory import stage_memory"),
        ("config.py", "def f():\n    from bumblebee.models import resolve_arch"),
        ("registry.py", "import bumblebee.primitives"),
        ("primitives/fake.py", "from bumblebee import build_model"),
        ("primitives/cp/fake.py", "from ...models import arch"),
    ],
)
def test_checker_catches_violations(path, source):
    assert len(violations(PACKAGE / path, source)) == 1


def test_checker_accepts_downward_imports():
    ok = "from bumblebee import registry\nfrom bumblebee.primitives.packed import doc_layout\nfrom . import experts"
    assert violations(PACKAGE / "primitives/moe/fake.py", ok) == []
    assert violations(PACKAGE / "runtime/fake.py", "from bumblebee.models import build_model") == []


# ------------------------------------------------------------------------------ cycles
def import_graph(overrides: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the bumblebee modules it imports; ``overrides`` replaces sources by path.

    Importing ``a.b.c`` first runs ``a/__init__`` and ``a/b/__init__``: those package edges count
    too (a cycle through a package ``__init__`` is as real as a direct one), except a module's own
    ancestors, which are already importing it."""
    graph = {}
    for p in sources():
        source = (overrides or {}).get(str(p.relative_to(PACKAGE)), None) or p.read_text()
        m = module_name(p)
        targets = {t for _, t in imported_modules(source, m, p.name == "__init__.py") if t != m}
        for t in list(targets):
            parts = t.split(".")
            for k in range(2, len(parts)):
                package = ".".join(parts[:k])
                if package != m and not m.startswith(package + "."):
                    targets.add(package)
        graph[m] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next((x for x in it if x in graph), None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return found


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_cycle_checker_catches_a_planted_cycle():
    planted = {
        "data/packing.py": (PACKAGE / "data/packing.py").read_text()
        + "\nimport bumblebee.data.jsonl\n"
    }
    assert any("bumblebee.data.packing" in c for c in cycles(import_graph(planted)))


def test_cycle_checker_sees_package_init_edges():
    """chunked -> recompute -> (primitives.moe.replay, so) primitives/moe/__init__ -> chunked: no
    direct edge closes it, the package's __init__ does."""
    planted = {
        "primitives/moe/chunked.py": (PACKAGE / "primitives/moe/chunked.py").read_text()
        + "\nfrom bumblebee.primitives.recompute import lean\n"
    }
    found = cycles(import_graph(planted))
    assert any(
        "bumblebee.primitives.moe" in c and "bumblebee.primitives.recompute" in c for c in found
    )


def test_allowed_modules_are_leaves():
    """What a layer may import by exception imports nothing from bumblebee itself."""
    for targets in ALLOWED_MODULES.values():
        for t in targets:
            path = PACKAGE.parent / (t.replace(".", "/") + ".py")
            assert not list(imported_modules(path.read_text(), t, False)), t
    assert violations(PACKAGE / "perf/fake.py", "from bumblebee.primitives import packed") != []
