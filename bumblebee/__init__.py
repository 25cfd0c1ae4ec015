"""bumblebee: long-context Mixture-of-Experts training in pure PyTorch.

Public API (stable): ``from_hf``, ``to_hf``, ``load_config``, ``build_model``; ``Engine``
(the RL actor, ``bumblebee.rl.engine``), imported on first use.
"""

from bumblebee.config import Config
from bumblebee.errors import ConfigError
from bumblebee.models import build_model
from bumblebee.models.hf import from_hf, to_hf
from bumblebee.runtime.resolve import load_config

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "load_config", "build_model", "from_hf", "to_hf", "Engine", "__version__"]


def __getattr__(name: str):
    if name == "Engine":  # lazy: the RL actor pulls in the runtime
        from bumblebee.rl.engine import Engine

        return Engine
    raise AttributeError(f"module 'bumblebee' has no attribute {name!r}")
