"""Chaos run: kill random ranks of a training job at random times and check that the
restarted job ends with exactly the weights of an uninterrupted one.

Two runs of ``bumblebee train --nproc N`` on the same tiny deterministic config with
periodic checkpoints: a reference run, left alone, and a chaos run with
``--max-restarts`` in which this script SIGKILLs a random worker (a random rank) at a
random step, K times, each time after the restarted job has made progress again.
Printed: every kill (rank, step reached), the restarts the launcher announced (with
the rank it blamed), the steps lost (recomputed after resuming from the newest
checkpoint), and the comparison of the two runs' loss traces and final weights
(bit for bit). Figures only; nothing is asserted except that the comparison is printed.

    python benchmarks/chaos.py --kills 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

TINY = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.intermediate_size=48",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "model.arch.mlp_only_layers=[1]",
    "primitives.loss=ce",
    "train.seq_len=64",
    "train.global_batch=4",
    "data.min_records=2",
    "data.max_records=4",
    "train.lr=1e-2",
    "train.warmup_steps=2",
    "train.deterministic=true",
    "train.keep_last=0",
    "train.collective_timeout_s=60",
]


def command(out_dir: str, args, *extra: str) -> list[str]:
    sets = TINY + [
        f"train.steps={args.steps}",
        f"train.save_every={args.save_every}",
        f"train.out_dir={out_dir}",
    ]
    return [
        sys.executable,
        "-m",
        "bumblebee.cli",
        "train",
        "--nproc",
        str(args.nproc),
        *sum((["--set", s] for s in sets), []),
        *extra,
    ]


def last_step(out_dir: str) -> int:
    try:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            lines = [x for x in f if x.strip()]
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's live worker processes (spawned in local-rank order, so
    by increasing pid; their RANK is set inside the process, invisible in /proc/*/environ)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                ppid = next(int(x.split()[1]) for x in f if x.startswith("PPid:"))
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, StopIteration):
            continue
        if ppid == launcher and b"multiprocessing.spawn" in cmd:
            pids.append(int(name))
    return dict(enumerate(sorted(pids)))


def losses(out_dir: str) -> list[float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(x)["loss"] for x in f if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="bumblebee-chaos-")
    ref, run = os.path.join(root, "ref"), os.path.join(root, "chaos")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    t0 = time.perf_counter()
    r = subprocess.run(command(ref, args), capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"reference run failed:\n{r.stderr[-3000:]}")
    print(
        f"reference run: {args.steps} steps, {args.nproc} ranks, {time.perf_counter() - t0:.0f} s"
    )

    # kill points: K distinct steps after the first checkpoint, spread over the run
    targets = sorted(rng.sample(range(args.save_every + 1, args.steps - 1), args.kills))
    t0 = time.perf_counter()
    with (
        open(os.path.join(root, "chaos.out"), "w") as out,
        open(os.path.join(root, "chaos.err"), "w") as err,
    ):
        proc = subprocess.Popen(
            command(run, args, "--max-restarts", str(args.kills + 1)),
            stdout=out,
            stderr=err,
            env=env,
        )
        kills, previous = [], set()
        for target in targets:
            while proc.poll() is None:
                alive = workers(proc.pid)
                if last_step(run) >= target and alive and not previous & set(alive.values()):
                    break
                time.sleep(0.01)
            if proc.poll() is not None:
                break
            rank = rng.randrange(args.nproc)
            step = last_step(run)
            os.kill(alive[rank], signal.SIGKILL)
            previous = set(alive.values())
            kills.append((rank, step))
            print(f"kill {len(kills)}: SIGKILL rank {rank} (pid {alive[rank]}) after step {step}")
        code = proc.wait()
    wall = time.perf_counter() - t0
    text_err = open(os.path.join(root, "chaos.err")).read()
    text_out = open(os.path.join(root, "chaos.out")).read()
    restarts = re.findall(r"bumblebee: restart (\d+/\d+) after: (.*)", text_err)
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", text_out)]
    for (n, cause), at in zip(restarts, resumed):
        print(f"restart {n}: resumed at step {at}; blamed: {cause[:110]}")
    lost = sum(step - at for (_, step), at in zip(kills, resumed))
    print(
        f"chaos run: exit {code}, {len(kills)} kills, {len(restarts)} restarts, {lost} steps lost "
        f"(recomputed), {wall:.0f} s"
    )

    from bumblebee.runtime.checkpoint.checkpointer import load_model

    same_trace = losses(ref) == losses(run)
    final = f"step_{args.steps:08d}"
    a, b = (load_model(os.path.join(d, "checkpoints", final)) for d in (ref, run))
    diff = [n for (n, x), y in zip(a.named_parameters(), b.parameters()) if not x.equal(y)]
    print(
        f"loss trace ({args.steps} steps) identical: {same_trace}; final weights ({final}) identical: "
        f"{not diff}{'' if not diff else ' (differ: ' + ', '.join(diff[:3]) + ')'}"
    )
    print(f"(run directories in {root})")


if __name__ == "__main__":
    main()
