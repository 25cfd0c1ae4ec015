"""Checked communication: every collective and point-to-point call verified before it runs.

NCCL moves ``numel`` elements in memory order and trusts the caller: a non-contiguous buffer
gets its bytes in the wrong places, and a receiver whose shape or dtype differs from the
sender's reads garbage, silently (gloo raises on some of these, not all: a float32 send into
an int32 buffer of the same size passes). ``CheckedComm`` wraps the ``torch.distributed``
functions bumblebee and FSDP2 call and, on every call, checks

- that every tensor handed over is contiguous (send, receive and output buffers alike);
- that the ranks agree: collectives exchange a fingerprint (operation, dtype, shape, split
  sizes) over their group and compare; each point-to-point send first passes its dtype and
  shape to the receiver, which compares them with its buffer (a 0-d scalar and a one-element
  [1] buffer agree: torch's pipeline warm-up sends one into the other).

A failed check raises ``CommCheckError`` naming the call, the ranks and what differs. Used by
the emulated-CUDA mode (emulation.py) and by tests; the extra exchanges make every call
slower, so it is never on in a real run.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
_META = 10  # dtype code, ndim, up to 8 dims


class CommCheckError(RuntimeError):
    """A collective or point-to-point call that NCCL would run wrongly."""


def _contiguous(call: str, **tensors) -> None:
    for name, t in tensors.items():
        for x in t if isinstance(t, (list, tuple)) else [t]:
            if isinstance(x, torch.Tensor) and not x.is_contiguous():
                raise CommCheckError(
                    f"{call}: {name} is not contiguous (shape {tuple(x.shape)}, stride "
                    f"{x.stride()}): NCCL would move its bytes in memory order"
                )


def _agree(call: str, group, mine) -> list:
    """Every rank's fingerprint ``mine`` over ``group``; raises unless all are equal."""
    world = c10d.get_world_size(group)
    everyone = [None] * world
    c10d.all_gather_object(everyone, mine, group=group)
    if any(f != everyone[0] for f in everyone):
        detail = "; ".join(f"rank {r}: {f}" for r, f in enumerate(everyone))
        raise CommCheckError(f"{call}: the ranks disagree ({detail})")
    return everyone


def _sig(t: torch.Tensor) -> tuple:
    return (str(t.dtype), tuple(t.shape))


def _meta(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _META - 2:
        raise CommCheckError(
            f"point-to-point of a {t.dim()}-d tensor: the check handles up to {_META - 2} dims"
        )
    m = torch.zeros(_META, dtype=torch.int64)
    m[0], m[1] = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1, t.dim()
    m[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return m.to(t.device)


def _describe(m: torch.Tensor) -> str:
    m = m.tolist()
    dtype = _DTYPES[m[0]] if m[0] >= 0 else "?"
    return f"{dtype}{m[2 : 2 + m[1]]}"


def _fits(sent: torch.Tensor, buffer: torch.Tensor) -> bool:
    """The sender's metadata ``sent`` matches the receive buffer's: equal dtype and shape, or
    equal dtype and one element each as a 0-d scalar and a [1] vector (the same bytes; torch
    2.11's pipeline schedules warm their P2P links up sending ``torch.tensor(stage_index)`` into
    ``torch.zeros(1)``, ``PipelineStage._get_init_p2p_neighbors_ops``)."""
    if torch.equal(sent, buffer):
        return True
    (dtype_a, shape_a), (dtype_b, shape_b) = _unpack(sent), _unpack(buffer)
    return dtype_a == dtype_b and {shape_a, shape_b} == {(), (1,)}


def _unpack(m: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """``_meta``'s (dtype code, shape)."""
    m = m.tolist()
    return m[0], tuple(m[2 : 2 + m[1]])


def _check_p2p(ops: list, send, recv, batch) -> None:
    """``ops``: [(is_send, tensor, peer, group)]: contiguity, then sender metadata vs receiver buffer."""
    meta = []
    for is_send, t, peer, _ in ops:
        _contiguous(f"{'isend' if is_send else 'irecv'} to/from rank {peer}", tensor=t)
        meta.append(_meta(t) if is_send else torch.empty(_META, dtype=torch.int64, device=t.device))
    works = batch(
        [
            c10d.P2POp(send if s else recv, m, peer, group)
            for (s, _, peer, group), m in zip(ops, meta)
        ]
    )
    for w in works:
        w.wait()
    for (is_send, t, peer, _), m in zip(ops, meta):
        if not is_send and not _fits(m, _meta(t)):
            raise CommCheckError(
                f"irecv from rank {peer}: the sender sends {_describe(m)}, the receive buffer "
                f"is {_describe(_meta(t))}"
            )


class CheckedComm:
    """Context manager: the checked versions of ``torch.distributed``'s communication calls."""

    NAMES = (
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_to_all_single",
        "batch_isend_irecv",
        "send",
        "recv",
    )

    def __enter__(self):
        self._saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for n, fn in self._saved.items():
            setattr(dist, n, functools.wraps(fn)(functools.partial(getattr(self, "_" + n), fn)))
        return self

    def __exit__(self, *exc):
        for n, fn in self._saved.items():
            setattr(dist, n, fn)
        return False

    # collectives: contiguity, then a fingerprint every rank of the group must share

    def _all_reduce(self, fn, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _contiguous("all_reduce", tensor=tensor)
        _agree("all_reduce", group, ("all_reduce", _sig(tensor)))
        return fn(tensor, op=op, group=group, async_op=async_op)

    def _broadcast(self, fn, tensor, src=None, group=None, async_op=False, **kw):
        _contiguous("broadcast", tensor=tensor)
        _agree("broadcast", group, ("broadcast", src, kw.get("group_src"), _sig(tensor)))
        return fn(tensor, src, group, async_op, **kw)

    def _all_gather(self, fn, tensor_list, tensor, group=None, async_op=False):
        _contiguous("all_gather", output=tensor_list, input=tensor)
        if any(_sig(o) != _sig(tensor) for o in tensor_list):
            raise CommCheckError(
                f"all_gather: outputs {[_sig(o) for o in tensor_list]} != input {_sig(tensor)}"
            )
        _agree("all_gather", group, ("all_gather", _sig(tensor)))
        return fn(tensor_list, tensor, group, async_op)

    def _gather_into(self, call, fn, output, input, group, async_op):
        _contiguous(call, output=output, input=input)
        world = c10d.get_world_size(group)
        if output.dtype != input.dtype or output.numel() != world * input.numel():
            raise CommCheckError(
                f"{call}: output {_sig(output)} is not {world} x input {_sig(input)}"
            )
        _agree(call, group, (call, _sig(input)))
        return fn(output, input, group=group, async_op=async_op)

    def _all_gather_into_tensor(self, fn, output_tensor, input_tensor, group=None, async_op=False):
        return self._gather_into(
            "all_gather_into_tensor", fn, output_tensor, input_tensor, group, async_op
        )

    def _all_gather_single(self, fn, output_tensor, input_tensor, group=None, async_op=False):
        return self._gather_into(
            "all_gather_single", fn, output_tensor, input_tensor, group, async_op
        )

    def _scatter_from(self, call, fn, output, input, op, group, async_op):
        _contiguous(call, output=output, input=input)
        world = c10d.get_world_size(group)
        if output.dtype != input.dtype or input.numel() != world * output.numel():
            raise CommCheckError(
                f"{call}: input {_sig(input)} is not {world} x output {_sig(output)}"
            )
        _agree(call, group, (call, _sig(input)))
        return fn(output, input, op=op, group=group, async_op=async_op)

    def _reduce_scatter_tensor(
        self, fn, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False
    ):
        return self._scatter_from("reduce_scatter_tensor", fn, output, input, op, group, async_op)

    def _reduce_scatter_single(
        self, fn, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False
    ):
        return self._scatter_from("reduce_scatter_single", fn, output, input, op, group, async_op)

    def _all_to_all_single(
        self,
        fn,
        output,
        input,
        output_split_sizes=None,
        input_split_sizes=None,
        group=None,
        async_op=False,
    ):
        call = "all_to_all_single"
        _contiguous(call, output=output, input=input)
        world, rank = c10d.get_world_size(group), c10d.get_rank(group)
        even = lambda t: [t.shape[0] // world] * world  # noqa: E731
        send = list(input_split_sizes) if input_split_sizes is not None else even(input)
        recv = list(output_split_sizes) if output_split_sizes is not None else even(output)
        if sum(send) != input.shape[0] or sum(recv) != output.shape[0]:
            raise CommCheckError(
                f"{call}: splits {send} / {recv} do not cover input {_sig(input)} / output "
                f"{_sig(output)}"
            )
        row = lambda t: (str(t.dtype), tuple(t.shape[1:]))  # noqa: E731
        if row(input) != row(output):
            raise CommCheckError(f"{call}: input rows {row(input)} != output rows {row(output)}")
        world_view = [None] * world
        c10d.all_gather_object(world_view, (row(input), send, recv), group=group)
        for r, (rows_r, send_r, recv_r) in enumerate(world_view):
            if rows_r != row(input) or send_r[rank] != recv[r] or recv_r[rank] != send[r]:
                raise CommCheckError(
                    f"{call}: rank {rank} expects {recv[r]} rows of {row(input)} from rank {r}, "
                    f"which sends {send_r[rank]} rows of {rows_r}"
                )
        return fn(
            output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )

    # point-to-point: contiguity, then the sender's dtype and shape against the receive buffer

    def _batch_isend_irecv(self, fn, p2p_op_list):
        ops = [(o.op is c10d.isend, o.tensor, o.peer, o.group) for o in p2p_op_list]
        _check_p2p(ops, c10d.isend, c10d.irecv, fn)
        return fn(p2p_op_list)

    def _send(self, fn, tensor, dst=None, group=None, tag=0, **kw):
        _check_p2p(
            [(True, tensor, dst, group)], c10d.isend, c10d.irecv, self._saved["batch_isend_irecv"]
        )
        return fn(tensor, dst, group, tag, **kw)

    def _recv(self, fn, tensor, src=None, group=None, tag=0, **kw):
        _check_p2p(
            [(False, tensor, src, group)], c10d.isend, c10d.irecv, self._saved["batch_isend_irecv"]
        )
        return fn(tensor, src, group, tag, **kw)
