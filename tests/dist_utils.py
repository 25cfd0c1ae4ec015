"""Spawn N gloo ranks from inside a test and collect what each returns.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes with
the ``spawn`` start method, joins them in a gloo process group, calls
``fn(rank, world_size, *args)`` and returns the per-rank results (anything
picklable). A rank that raises fails the test with that rank's traceback, one that dies
without reporting (a signal) with its exit code; a hang fails after ``timeout`` seconds.
``fn`` must be a module-level function (it is pickled by name).

Rendezvous without a port race: the parent process opens the c10d ``TCPStore``
itself on port 0 (the kernel picks a free port and the store keeps it bound for
the whole run) and the ranks connect to it as clients. Picking a "free" port,
closing it and letting a child bind it later (check-then-bind) can collide with
any other process on the machine, e.g. another test's ranks.
"""

from __future__ import annotations

import datetime
import io
import os
import time
import traceback
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


def _worker(rank, world_size, port, fn, args, queue, collective_timeout):
    os.environ.update(
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=120)
        )
        kw = (
            {"timeout": datetime.timedelta(seconds=collective_timeout)}
            if collective_timeout
            else {}
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, **kw)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()  # by value: shared-memory tensors would die with this process
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report everything, including assertion errors
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn, world_size: int, *args, timeout: float = 300.0, collective_timeout: float | None = None
):
    """``collective_timeout``: seconds a rank's collective waits for the others (the process
    group's timeout; torch's default when None): a rank whose peers died raises after it."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # the parent owns the store (and so the port) until every rank has finished
    store = dist.TCPStore(
        HOST,
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, store.port, fn, args, queue, collective_timeout)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except Empty:
                # a rank killed by a signal (a segfault) reports nothing: fail now, not at the deadline
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results
                ]
                if dead:
                    code = procs[dead[0]].exitcode
                    errors[dead[0]] = f"exited with code {code} before reporting (negative: signal)"
                    break
                if time.monotonic() > deadline:
                    raise
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
                break  # the others may now hang on a collective
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
        del store
    if errors:
        rank, tb = next(iter(errors.items()))
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    return [results[r] for r in range(world_size)]
