"""Starting ranks: local multi-process runs through torch.distributed.elastic, and
joining a job that ``torchrun`` started (one node or many).

``bumblebee train --nproc N`` validates the config and the layout in the parent
process, then starts N workers with ``elastic_launch`` (the machinery behind
``torchrun``; c10d rendezvous on a free local port). If any worker raises, the
elastic agent stops the others and the parent prints one line per failed rank
with its error, then exits non-zero: no hang, no orphans.

Under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR set by it), ``bumblebee
train`` joins the process group directly; that is the multi-node path.
"""

from __future__ import annotations

import datetime
import os
import sys
import uuid

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def started_by_torchrun() -> bool:
    """True inside a worker that torchrun / elastic started (its environment protocol)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Join the process group (NCCL with CUDA, gloo otherwise); returns this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # share the host's cores between the local ranks instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_world, 1)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device


@record  # writes the worker's exception where the elastic agent reports it, with its rank
def _worker(cfg) -> None:
    from bumblebee.runtime.trainer import Trainer

    init_distributed()
    try:
        Trainer(cfg).run()
    finally:
        dist.destroy_process_group()


def launch_local(cfg, nproc: int, worker=None) -> int:
    """Run ``worker(cfg)`` (default: join the group and train) on ``nproc`` local ranks.
    Returns the exit code; a failure prints one line per failed rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"bumblebee-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.2, start_method="spawn")
    try:
        elastic_launch(config, worker or _worker)(cfg)
    except ChildFailedError as e:
        for rank, failure in sorted(e.failures.items()):
            message = failure.message
            if isinstance(message, dict):
                message = message.get("message", message)
            last = str(message).strip().splitlines()
            print(f"bumblebee: rank {rank} failed (exit {failure.exitcode}): {last[-1] if last else 'no message'}",
                  file=sys.stderr)
        return 1
    return 0
