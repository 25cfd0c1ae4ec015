"""Starting ranks: local multi-process runs through torch.distributed.elastic, and
joining a job that ``torchrun`` started (one node or many).

``bumblebee train --nproc N`` validates the config and the layout in the parent
process, then starts N workers with ``elastic_launch`` (the machinery behind
``torchrun``; c10d rendezvous on a free local port). If any worker raises, the
elastic agent stops the others and the parent prints one line naming the rank that
failed *first* (failures.py: per-rank reports with nanosecond timestamps; peer-loss
and timeout errors on the other ranks are consequences), then exits non-zero: no
hang, no orphans, no blame on a healthy rank.

Restarts. With ``train.max_restarts = N`` the agent restarts every rank after a
failure (up to N times); a restarted rank resumes from the newest complete
checkpoint of ``train.out_dir`` (``resume = "auto"``), and rank 0 prints which rank
caused the restart.

Preemption. Workers stop at a step boundary on SIGTERM / SIGUSR1 (signals.py). The
parent does not let torch elastic turn SIGTERM into "kill the workers": it forwards
the signal to workers that have not received it themselves (a scheduler often
signals every process), and a second signal stops everything at once. Outside the
training loop a worker stops at once on it (interrupts.py ``Terminated``); the launch
exits 128 + signal either way.

Lifetime. The workers die with the launcher: each asks the kernel for SIGKILL when its
parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so a launcher killed by SIGKILL or the
OOM killer leaves no rank running and writing; and each adds itself to the out_dir lock the
launcher holds (outdir.py ``join``), so the lock stays live while any of them is.

Under ``torchrun`` (RANK / WORLD_SIZE / MASTER_ADDR set by it), ``bumblebee
train`` joins the process group directly; that is the multi-node path.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from bumblebee import safe_write
from bumblebee.config import ConfigError
from bumblebee.runtime.launch.failures import (
    diagnose,
    failing_tail,
    first_failure,
    read_reports,
    write_report,
)
from bumblebee.runtime.launch.interrupts import Terminated, exit_code_of, terminate_raises
from bumblebee.runtime.launch.launch_env import check_launch_env, port_in_use
from bumblebee.runtime.launch.outdir import join, remove_partial_saves
from bumblebee.runtime.launch.rank_logs import LOGS, rank_log
from bumblebee.runtime.launch.signals import PREEMPT_SIGNALS, Preempted

PREEMPTED = "preempted.json"


def started_by_torchrun() -> bool:
    """True inside a worker that torchrun / elastic started (its environment protocol); a
    malformed or partial set of torchrun's variables is a ``ConfigError`` naming the variable."""
    check_launch_env()
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def restart_count() -> int:
    """How many times the elastic agent restarted this job's workers (0: first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Join the process group (NCCL with CUDA, gloo otherwise); returns this rank's device.
    ``timeout_s`` bounds every collective of the world group (mesh.py gives the same
    bound to every sub-group)."""
    check_launch_env()  # before any collective: a bad variable is one line, not a hang
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
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        return device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # the elastic agent keeps one store across restarts: without a per-attempt prefix a
        # restarted rank reads the addresses its dead predecessors published and fails to connect
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timeout,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"bumblebee/attempt_{restart_count()}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    else:
        try:
            dist.init_process_group(backend, timeout=timeout)
        except (RuntimeError, OSError) as e:
            if not port_in_use(e):
                raise
            raise ConfigError(
                f"MASTER_PORT={os.environ.get('MASTER_PORT')} is already in use on "
                f"{os.environ.get('MASTER_ADDR')}: another job holds it; choose a free port "
                "(torchrun --master-port) or stop that job"
            ) from None
    return device


def resume_spec(cfg) -> str:
    """What a worker resumes from: after a restart, the newest complete checkpoint of
    this run when there is one, else what the config says."""
    from bumblebee.runtime.checkpoint.directory import checkpoint_root, newest_complete

    if restart_count() > 0 and newest_complete(checkpoint_root(cfg.train.out_dir)) is not None:
        return "auto"
    return cfg.train.resume


def train_worker(cfg) -> None:
    """The default worker: join the group and train (resuming after a restart)."""
    from bumblebee.runtime.launch.interrupts import interrupt_once
    from bumblebee.runtime.trainer import Trainer

    init_distributed(cfg.train.collective_timeout_s)
    cfg.train.resume = resume_spec(cfg)
    with interrupt_once(
        ignore_after=True
    ):  # Ctrl-C stops the rank quietly (the launcher prints one line)
        Trainer(cfg).run()


def rank_log_dir(cfg) -> str | None:
    """``out_dir/logs`` of a run config (None for a worker argument without one)."""
    out_dir = getattr(getattr(cfg, "train", None), "out_dir", None)
    return os.path.join(out_dir, LOGS) if isinstance(out_dir, str) and out_dir else None


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """This process gets SIGKILL when its parent dies (Linux; elsewhere nothing). If the parent
    ``parent`` is already gone (it died before the request), now."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _stopped(report_dir: str, message: str, exit_code: int) -> None:
    """Record the first rank's clean stop (preemption, SIGTERM, Ctrl-C) for the launcher."""
    try:
        fd = os.open(os.path.join(report_dir, PREEMPTED), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        json.dump({"message": message, "exit_code": exit_code, "time_ns": time.time_ns()}, f)


@record  # also writes torch elastic's own error file for the agent's log
def _entry(
    worker,
    report_dir: str,
    world: int,
    max_restarts: int,
    cfg,
    launcher: int,
    lock: str,
    log_dir: str | None = None,
) -> None:
    die_with_parent(launcher)
    terminate_raises()  # a forwarded SIGTERM before or after the training loop ends the rank
    rank, attempt = int(os.environ["RANK"]), restart_count()
    if lock:
        join(lock, rank)
    if attempt and rank == 0:
        cause = diagnose(read_reports(report_dir, attempt - 1), world, log_dir=log_dir)
        print(
            f"bumblebee: restart {attempt}/{max_restarts} after: {cause}",
            file=sys.stderr,
            flush=True,
        )
    with rank_log(log_dir, rank, attempt) as log:
        try:
            worker(cfg)
        except (
            Preempted
        ) as p:  # a clean stop: exit 0 so the agent does not restart, the parent reports it
            if rank == 0:
                safe_write.write_file(
                    os.path.join(report_dir, PREEMPTED),
                    json.dumps({"message": str(p), "exit_code": p.exit_code}),
                    durable=False,
                )
        except (KeyboardInterrupt, Terminated) as e:  # stopped by a signal: exits 128 + it
            _stopped(report_dir, f"{e or 'interrupted'} (rank {rank})", exit_code_of(e))
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised
            # before the group is torn down, so a cause is stamped before its echoes on other ranks
            if write_report(report_dir, attempt, rank, e, log=log) != "error":
                # an echo lingers: the agent then sees (and gives the exit code of) the cause's
                # death first; its SIGTERM meanwhile ends the linger, not the report
                try:
                    time.sleep(1.0)
                except (KeyboardInterrupt, Terminated):
                    pass
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _worker_pids_catching(signum: int) -> list[int]:
    """Child processes of this one that still catch ``signum`` (a worker whose handler
    already ran has reset it; the multiprocessing resource tracker ignores it)."""
    me, pids = os.getpid(), []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if (
            int(status.get("PPid", "0")) == me
            and int(status.get("SigCgt", "0"), 16) >> (signum - 1) & 1
        ):
            pids.append(int(name))
    return pids


class _ForwardPreemption:
    """In the parent: the first SIGTERM / SIGUSR1 is forwarded (after a short delay) to
    the workers that did not get it themselves; a second one stops the job at once."""

    def __init__(self):
        self.signum, self._previous = 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in PREEMPT_SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum, frame):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.signum:  # the second signal: torch elastic stops every worker with it
            raise SignalException(
                f"second {signal.Signals(signum).name}", sigval=signal.Signals(signum)
            )
        self.signum = signum
        print(
            f"bumblebee: {signal.Signals(signum).name}: stopping after the current step "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

        def forward():
            for pid in _worker_pids_catching(signum):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

        timer = threading.Timer(0.5, forward)
        timer.daemon = True
        timer.start()


def _report_stop(report_dir: str, failures_after: int | None = None) -> int:
    """The exit code of a recorded clean stop (its line printed; Ctrl-C raised as
    ``KeyboardInterrupt`` for the CLI's own line), 0 if none. ``failures_after``: an attempt
    whose failure reports, when one precedes the stop, make it no stop at all: torch elastic
    SIGTERMs the surviving ranks after one failed, and that teardown is not the cause."""
    preempted = os.path.join(report_dir, PREEMPTED)
    if not os.path.exists(preempted):
        return 0
    with open(preempted) as f:
        info = json.load(f)
    if failures_after is not None and "time_ns" in info:
        reports = read_reports(report_dir, failures_after)
        if any(r.get("time_ns", 0) < info["time_ns"] for r in reports.values()):
            return 0
    if int(info["exit_code"]) == 128 + signal.SIGINT:
        raise KeyboardInterrupt
    print(f"bumblebee: {info['message']}", file=sys.stderr)
    return int(info["exit_code"])


def launch_local(
    cfg,
    nproc: int,
    worker=None,
    max_restarts: int = 0,
    lock: str = "",
    log_dir: str | None = None,
) -> int:
    """Run ``worker(cfg)`` (default: join the group and train) on ``nproc`` local ranks,
    restarting all of them up to ``max_restarts`` times after a failure. Returns the exit
    code; a failure prints one line naming the rank that failed first and the file holding
    its full traceback (``log_dir``, default ``cfg.train.out_dir/logs``). ``lock``: the out_dir
    lock file the caller holds, which every rank joins."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from bumblebee.config import ConfigError
    from bumblebee.runtime.launch import rank_errors

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # signals_to_handle: torch elastic's own SIGTERM handler would kill the workers; _ForwardPreemption owns it
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"bumblebee-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
    )
    report_dir = tempfile.mkdtemp(prefix="bumblebee-ranks-")
    log_dir = log_dir or rank_log_dir(cfg)
    forward = _ForwardPreemption()
    try:
        with (
            forward,
            rank_errors.quiet_elastic(),
        ):  # our one line replaces elastic's logs
            elastic_launch(config, _entry)(
                worker or train_worker,
                report_dir,
                nproc,
                max_restarts,
                cfg,
                os.getpid(),
                lock,
                log_dir,
            )
        return _report_stop(report_dir) or 0
    except ChildFailedError as e:
        # a rank stopped by a signal (the others then failed for its absence), or the launcher
        # was: 128 + the signal, not a failure
        if forward.signum:
            if code := _report_stop(report_dir):
                return code
        elif code := _report_stop(report_dir, failures_after=max_restarts):
            return code
        if forward.signum:
            print(f"bumblebee: stopped by {signal.Signals(forward.signum).name}", file=sys.stderr)
            return 128 + forward.signum
        if (message := rank_errors.config_error(e.failures)) is not None:
            raise ConfigError(message) from None  # bad input found by a rank: one line, exit 2
        rank, failure = first_failure(e.failures)
        reports = read_reports(report_dir, max_restarts)  # the last attempt
        seen = (rank, failure.exitcode)
        cause = diagnose(reports, nproc, seen, log_dir=log_dir)
        for line in failing_tail(reports, nproc, seen):  # no log file: keep the traceback's end
            print(f"  {line}", file=sys.stderr)
        print(
            f"bumblebee: {cause}" + (f" (after {max_restarts} restarts)" if max_restarts else ""),
            file=sys.stderr,
        )
        return 1
    except SignalException as e:
        if rank_errors.interrupted(e):  # Ctrl-C: the CLI prints one line and exits 130
            raise KeyboardInterrupt from None
        print(f"bumblebee: stopped at once by a second {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
        if isinstance(out_dir := getattr(getattr(cfg, "train", None), "out_dir", None), str):
            remove_partial_saves(out_dir)  # every rank has stopped: nobody is writing into them
