"""bumblebee: long-context Mixture-of-Experts training in pure PyTorch.

Public API (stable): ``from_hf``, ``to_hf``, ``load_config``, ``build_model``, ``Config``,
``ConfigError``; ``Engine`` (the RL actor, ``bumblebee.rl.engine``).

Every name is imported on first use (PEP 562): ``import bumblebee.cli`` must not pull in
torch, so that ``bumblebee --help`` and ``--version`` answer at once (torch and its
distributed packages take seconds to import).
"""

__version__ = "0.1.0"
__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "build_model",
    "from_hf",
    "to_hf",
    "Engine",
    "__version__",
]


# reachable as attributes of the package, imported on first use (plan is the CLI's, not the API's)
_SUBPACKAGES = {
    "config",
    "errors",
    "registry",
    "primitives",
    "models",
    "runtime",
    "rl",
    "data",
    "perf",
}


def __getattr__(name: str):
    # one explicit import per name (not importlib on a string): the layering test reads these
    if name == "Config":
        from bumblebee.config import Config as value
    elif name == "ConfigError":
        from bumblebee.errors import ConfigError as value
    elif name == "build_model":
        from bumblebee.models import build_model as value
    elif name == "from_hf":
        from bumblebee.models.hf import from_hf as value
    elif name == "to_hf":  # under the target's export lock (runtime/checkpoint/export_dir.py)
        from bumblebee.runtime.checkpoint.export_dir import to_hf as value
    elif name == "load_config":
        from bumblebee.runtime.resolve import load_config as value
    elif name == "Engine":  # the RL actor pulls in the runtime
        from bumblebee.rl.engine import Engine as value
    elif name in _SUBPACKAGES:  # `import bumblebee; bumblebee.models.resolve_arch(...)` as before
        import importlib

        value = importlib.import_module(f"bumblebee.{name}")
    else:
        raise AttributeError(f"module 'bumblebee' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
