"""A transport for ``Engine.sync_weights``: each weight bucket broadcast from a source rank over a
process group (gloo or NCCL) as one flat buffer per dtype, its names, shapes and dtypes first."""

from __future__ import annotations

import torch
import torch.distributed as dist


class BroadcastTransport:
    """Broadcast each bucket from ``src`` (a global rank) over ``group`` as one flat buffer per
    dtype, after its names / shapes / dtypes. Call it with the bucket on every rank of the
    group (``sync_weights``), or on a rank without the engine call ``receive()``; both return
    the received bucket on receivers (the bucket itself on ``src``). ``finish(version)`` ends a
    sync (receivers' ``receive()`` returns None, ``version`` is then set)."""

    def __init__(self, src: int = 0, group=None, device: torch.device | str = "cpu"):
        self.src, self.group, self.device = src, group, torch.device(device)
        self.version = None

    def _is_src(self) -> bool:
        return dist.get_rank() == self.src

    def __call__(self, bucket):
        return self._send(bucket) if self._is_src() else self.receive()

    def _send(self, bucket):
        meta = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket]
        dist.broadcast_object_list([meta], src=self.src, group=self.group)
        for dtype in sorted({m[2] for m in meta}):
            flat = torch.cat(
                [t.reshape(-1) for t, m in zip((t for _, t in bucket), meta) if m[2] == dtype]
            )
            dist.broadcast(flat.to(self.device), src=self.src, group=self.group)
        return bucket

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        if isinstance(box[0], int):  # the end marker: the weight version
            self.version = box[0]
            return None
        out = {}
        for dtype in sorted({m[2] for m in box[0]}):
            members = [m for m in box[0] if m[2] == dtype]
            flat = torch.empty(
                sum(torch.Size(s).numel() for _, s, _ in members),
                dtype=getattr(torch, dtype),
                device=self.device,
            )
            dist.broadcast(flat, src=self.src, group=self.group)
            for (name, shape, _), part in zip(
                members, flat.split([torch.Size(s).numel() for _, s, _ in members])
            ):
                out[name] = part.view(shape)
        return [(n, out[n]) for n, _, _ in box[0]]

    def finish(self, version: int) -> None:
        if self._is_src():
            dist.broadcast_object_list([version], src=self.src, group=self.group)
        else:
            self.receive()
