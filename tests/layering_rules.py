"""The layering's rules (docs/architecture.md, "Package layout"): which layer each module is in, and what each
layer may import. ``tests/unit/test_layering.py`` checks every import against them;
``benchmarks/global_batch_walk.py`` ranks the layers from them (``rank``).
"""

from __future__ import annotations

# first component under bumblebee/ -> layer
LAYER_OF = {
    "config": "core",
    "config_checks": "core",
    "config_aliases": "core",
    "config_parse": "core",
    "console": "core",
    "registry": "core",
    "errors": "core",
    "report": "core",
    "report_inputs": "core",
    "report_panels": "core",
    "outputs": "core",
    "safe_write": "core",
    "__init__": "api",
    "primitives": "primitives",
    "models": "models",
    "data": "data",
    "perf": "perf",
    "runtime": "runtime",
    "rl": "rl",
    "plan": "plan",
    "cli": "cli",
    "commands": "cli",
    "__main__": "cli",
    "integrations": "integrations",
}
BELOW_RUNTIME = {"core", "primitives", "models", "data", "perf"}
ALLOWED = {
    "core": {"core"},  # a leaf: what needs models or the registry is checked in runtime/resolve.py
    "api": {
        "api",
        "core",
        "models",
        "runtime",
        "rl",
    },  # the public facade (from_hf, Engine...), never plan
    "primitives": {"core", "primitives"},
    "models": {"core", "primitives", "models"},
    "data": {"core", "data"},
    "perf": {"core", "perf"},
    "runtime": BELOW_RUNTIME | {"api", "runtime"},
    "rl": BELOW_RUNTIME | {"api", "runtime", "rl"},
    "integrations": BELOW_RUNTIME
    | {"api", "runtime", "rl", "integrations"},  # adapters to other frameworks
    "plan": {
        "core",
        "primitives",
        "models",
        "perf",
        "runtime",
        "plan",
    },  # runtime: its resolver, for runnable configs
    "cli": set(LAYER_OF.values()),
}
# single modules a layer may import beyond ALLOWED, each with its reason
ALLOWED_MODULES = {
    # the launch counter reads the kernel regions the emulated kernels enter; a leaf module
    # (nothing from bumblebee), so perf gains no dependency on primitives' code
    "perf": {"bumblebee.primitives.kernel_region", "bumblebee.primitives.host_memory"},
}


def rank(layer: str) -> int:
    """Height of ``layer``: 0 for core, else one above the highest other layer it may import.
    The ``api`` facade is set aside: runtime and rl may import it, yet it sits above them."""
    below = ALLOWED[layer] - {layer, "api"}
    return 1 + max(map(rank, below)) if below else 0
