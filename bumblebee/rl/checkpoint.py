"""The Engine's resumable state: ``save(dir, step, keep)`` / ``load(dir, step)`` over the runtime's
checkpoints (runtime/checkpoint/checkpointer.py: crash-safe ``<dir>/checkpoints/step_<N>``, one file set per
rank, loadable on any layout, also by ``bumblebee train`` and ``bumblebee convert``).

A mixin of ``rl.engine.Engine``: it uses the engine's config, context, model, sharding,
optimizer, ``step`` and ``weight_version``.
"""

from __future__ import annotations

import dataclasses
import io
import os

from bumblebee.config import ConfigError
from bumblebee.runtime.checkpoint.checkpointer import Checkpointer
from bumblebee.runtime.checkpoint.directory import checkpoint_root, named_checkpoint


class EngineCheckpoints:
    def _checkpointer(self, out_dir: str, keep: int | None = None) -> Checkpointer:
        train = dataclasses.replace(
            self.cfg.train, out_dir=out_dir, **({} if keep is None else {"keep_last": keep})
        )
        cfg = dataclasses.replace(self.cfg, train=train)
        return Checkpointer(
            cfg, self.ctx, self.model, self.sharding, self.optimizer, stream=io.StringIO()
        )

    def save(self, path: str, step: int | None = None, keep: int | None = None) -> str:
        """Parameters, optimizer state, step and RNG as ``<path>/checkpoints/step_<step>`` (default:
        the engine's step count); ``keep``: keep the newest ``keep`` checkpoints there (0: all;
        default ``train.keep_last``). Returns the directory. Collective."""
        self.offloader.require("params", "optimizer")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"step must be an integer >= 0, got {step!r}")
        if keep is not None and keep < 0:
            raise ConfigError(f"keep must be >= 0, got {keep}")
        return self._checkpointer(path, keep).save(self.step if step is None else step)

    def load(self, path: str, step: int | None = None) -> int:
        """Restore a checkpoint directory, the newest complete one under ``path`` (what ``save``
        wrote, or a ``bumblebee train`` run directory), or with ``step`` that step's. The engine
        continues from the saved step. Collective."""
        self.offloader.require("params", "optimizer")
        if step is not None:
            path = os.path.join(checkpoint_root(path), f"step_{step:08d}")
        self.step = self._checkpointer(self.cfg.train.out_dir).load(named_checkpoint(path))
        self.weight_version += 1
        return self.step
