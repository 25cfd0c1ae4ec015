"""The launch environment (torchrun's variables), checked before any collective.

torchrun and its elastic agent hand each rank ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` and
``TORCHELASTIC_RESTART_COUNT``. A stale or hand-written set of them (left in a shell, copied
from another job's script) otherwise ends deep in ``init_process_group``: a traceback for a
value that is not a number, a rank that waits forever for peers that cannot exist (``RANK``
outside ``0..WORLD_SIZE-1``), or a rendezvous on a port another process holds. Each problem is
one line naming the variable, its value and what would be valid.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from bumblebee.config import ConfigError

# the variables bumblebee reads as integers, with their smallest valid value
_INTEGERS = {
    "RANK": 0,
    "WORLD_SIZE": 1,
    "LOCAL_RANK": 0,
    "LOCAL_WORLD_SIZE": 1,
    "MASTER_PORT": 1,
    "TORCHELASTIC_RESTART_COUNT": 0,
}
_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_HINT = "(set by torchrun; unset it to run without torchrun)"


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={raw!r} is not an integer {_HINT}"
        ) from None
    if value < _INTEGERS[name] or (name == "MASTER_PORT" and value > 65535):
        top = " and <= 65535" if name == "MASTER_PORT" else ""
        raise ConfigError(
            f"environment variable {name}={raw!r} must be >= {_INTEGERS[name]}{top} {_HINT}"
        )
    return value


def check_launch_env(env: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` naming the first torchrun variable of ``env`` (default: this
    process's environment) that is malformed or inconsistent with the others."""
    env = os.environ if env is None else env
    values = {name: _int(env, name) for name in _INTEGERS}
    rank, world = values["RANK"], values["WORLD_SIZE"]
    if rank is not None and world is not None and rank >= world:
        raise ConfigError(f"environment variable RANK={rank} must be < WORLD_SIZE={world} {_HINT}")
    local, local_world = values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]
    if local is not None and local_world is not None and local >= local_world:
        raise ConfigError(
            f"environment variable LOCAL_RANK={local} must be < LOCAL_WORLD_SIZE={local_world} "
            f"{_HINT}"
        )
    torchrun = "TORCHELASTIC_RUN_ID" in env or (rank is not None and world is not None)
    if torchrun:
        missing = [name for name in _REQUIRED if not env.get(name, "").strip()]
        if missing:
            given = "TORCHELASTIC_RUN_ID" if "TORCHELASTIC_RUN_ID" in env else "RANK and WORLD_SIZE"
            raise ConfigError(
                f"{given} set but {', '.join(missing)} not: a partial torchrun environment; "
                "start the job with torchrun, or unset the variables to run without it"
            )


def port_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` (from ``init_process_group``) says the rendezvous port is taken."""
    text = str(exc).lower()
    return "address already in use" in text or "errno 98" in text or "eaddrinuse" in text
