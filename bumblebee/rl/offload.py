"""Offload by part: the Engine's parameters, gradients and optimizer state to host memory and
back, each on its own, measured.

While a rollout engine generates, the trainer's state is dead weight on the GPU; an RL
framework moves it out and back per phase (verl's engine ``to(device, model=, optimizer=,
grad=)``, its train / eval mode contexts). Parts:

- ``params``: the model's parameters (local shards under FSDP2). ``Module.to`` keeps every
  Parameter object (the optimizer holds them) and FSDP2 re-registers its shards in ``_apply``.
- ``grads``: gradients that exist between ``forward_backward`` and ``optimizer_step``. A
  gradient must sit on its parameter's device, so gradients are detached into a stash
  (on the host when offloaded, else where they are) whenever parameters and gradients part
  ways, and re-attached on ``onload``.
- ``optimizer``: optimizer state tensors (AdamW moments) and optimizer-only parameters
  (zero1's fp32 master slices); scalar step counters stay where the optimizer keeps them.

Each call returns what it did, measured rather than assumed: bytes moved per part (a tensor
already on the target device is not copied and counts 0, e.g. "offloading" to the CPU on a
CPU-only run), and the bytes of each part still on the compute device afterwards (plus
``torch.cuda.memory_allocated`` on CUDA). Calls that need a part that is away raise.
"""

from __future__ import annotations

import contextlib

import torch

from bumblebee.primitives.sharding.common import local

PARTS = ("params", "grads", "optimizer")


def _nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


class Offloader:
    def __init__(self, engine):
        self.engine = engine
        self.away: dict[str, torch.device] = {}  # part -> where it is
        self.stash: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # detached gradients

    # ------------------------------------------------------------------ what there is
    def _params(self) -> list[torch.nn.Parameter]:
        return list(self.engine.model.parameters())

    def _optimizer_tensors(self):
        """(container, key) of every optimizer-only parameter and non-scalar state tensor."""
        own = {id(p) for p in self._params()}
        opt = self.engine.optimizer
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in own:
                    yield p, None
        for entry in opt.state.values():
            for k, v in entry.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    yield entry, k

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of each part on the compute device now."""
        dev = self.engine.device
        on = lambda t: local(t).device == dev  # noqa: E731
        out = {
            "params": sum(_nbytes(p) for p in self._params() if on(p)),
            "grads": sum(
                _nbytes(p.grad) for p in self._params() if p.grad is not None and on(p.grad)
            )
            + sum(_nbytes(g) for _, g in self.stash if on(g)),
            "optimizer": sum(
                _nbytes(c if k is None else c[k])
                for c, k in self._optimizer_tensors()
                if on(c if k is None else c[k])
            ),
        }
        if dev.type == "cuda":
            out["cuda_allocated"] = torch.cuda.memory_allocated(dev)
        return out

    # ------------------------------------------------------------------ moves
    def _move_grads(self, device: torch.device) -> int:
        moved = 0
        if not self.stash:  # detach first: parameters may move without them
            self.stash = [(p, p.grad) for p in self._params() if p.grad is not None]
            for p, _ in self.stash:
                p.grad = None
        for i, (p, g) in enumerate(self.stash):
            if local(g).device != device:
                self.stash[i] = (p, g.to(device))
                moved += _nbytes(g)
        return moved

    def _move_params(self, device: torch.device) -> int:
        if not self.stash and any(p.grad is not None for p in self._params()):
            self._move_grads(self.engine.device)  # detached, kept where they are
        moved = sum(_nbytes(p) for p in self._params() if local(p).device != device)
        if moved:
            self.engine.model.to(device)
        return moved

    def _move_optimizer(self, device: torch.device) -> int:
        moved = 0
        for c, k in list(self._optimizer_tensors()):
            t = c if k is None else c[k]
            if local(t).device == device:
                continue
            moved += _nbytes(t)
            if k is None:
                c.data = c.data.to(device)
            else:
                c[k] = t.to(device)
        return moved

    def _reattach(self) -> None:
        """Gradients back on their parameters once both are on the compute device."""
        if self.stash and "params" not in self.away and "grads" not in self.away:
            for p, g in self.stash:
                p.grad = g
            self.stash = []

    @torch.no_grad()
    def offload(self, *, params=True, grads=True, optimizer=True, device=None) -> dict:
        host = torch.device("cpu") if device is None else torch.device(device)
        moved = {}
        for part, on, move in (
            ("grads", grads, self._move_grads),
            ("params", params, self._move_params),
            ("optimizer", optimizer, self._move_optimizer),
        ):
            if on:
                moved[part] = move(host)
                self.away[part] = host
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"moved_bytes": moved, "resident_bytes": self.resident_bytes()}

    @torch.no_grad()
    def onload(self, *, params=True, grads=True, optimizer=True) -> dict:
        dev, moved = self.engine.device, {}
        for part, on, move in (
            ("params", params, self._move_params),
            ("grads", grads, self._move_grads),
            ("optimizer", optimizer, self._move_optimizer),
        ):
            if on and part in self.away:
                moved[part] = move(dev)
                del self.away[part]
        self._reattach()
        return {"moved_bytes": moved, "resident_bytes": self.resident_bytes()}

    @contextlib.contextmanager
    def onloaded(self, **parts):
        """Onload the chosen parts that are away; offload them again on exit (train/eval modes)."""
        back = {p: self.away[p] for p, on in parts.items() if on and p in self.away}
        if back:
            self.onload(**{p: p in back for p in PARTS})
        try:
            yield
        finally:
            for part, where in back.items():
                self.offload(**{p: p == part for p in PARTS}, device=where)

    def require(self, *parts: str) -> None:
        away = [p for p in parts if p in self.away]
        if away:
            raise RuntimeError(
                f"the Engine's {', '.join(away)} are offloaded; call onload() before using them"
            )
