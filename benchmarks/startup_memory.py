"""Peak host memory of every rank starting from a real-size checkpoint, and of the export.

Makes a random Qwen3-MoE Hugging Face checkpoint (default ~0.52 B parameters: hidden 1024,
Qwen3's 151,936-token vocabulary, 4 layers of 64 experts; ~2.1 GB in fp32), then runs

    bumblebee train --nproc 4 --set parallel.ep=4 --set model.hf_path=CKPT ... (one step, saved)
    bumblebee convert --to hf RUN OUT

and prints each rank's peak resident memory (the kernel's ``VmHWM`` of every worker process,
polled every 0.2 s and when rank 0 prints its start line, its step line and its summary; a
high-water mark, so a late poll still sees an early peak: "after startup" is the peak of
building the model and reading the checkpoint) next to
checkpoint bytes / 4, the rank's static fp32 training state (params + grads + AdamW moments =
16 bytes x its parameters) and the goal (static state + 1 GiB); and the export's peak next to
2 x the largest tensor + 1 GiB. ``--tree DIR`` runs another checkout (e.g. the code before
meta-device construction: ``git worktree add /tmp/old <commit>``) for the before figure.

Printed figures only; nothing is asserted. The benchmark's own process never imports torch
(the checkpoint is made in a child), so it adds nothing to what it measures.

``--steps N`` trains N steps (default 1, the issue's figure): from the second step on, AdamW's
state is alive through the whole step, so its peak is the steady state's. The trainer's own
tracker figure (live tensors, largest rank: ``peak_mem_bytes`` in metrics.jsonl) is printed per
step next to the resident figures.

    python benchmarks/startup_memory.py [--work /tmp/startup_mem] [--tree /tmp/old] [--nproc 4] [--steps 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

GiB = 2**30
ARCH = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=4,
)

MAKE = """
import json, sys, torch, bumblebee
from bumblebee.models.qwen3_moe import Qwen3MoeArch
arch = Qwen3MoeArch(**json.loads(sys.argv[2]))
bumblebee.to_hf(bumblebee.build_model(arch, seed=0), sys.argv[1], max_shard_bytes=1 << 30)
"""


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def hwm(pid: int) -> int:
    """The process's peak resident bytes so far (VmHWM), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read() and not is_tracker(pid)
    except OSError:
        return False


def is_tracker(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"resource_tracker" in f.read()


def run_measured(
    argv: list[str], env: dict, marks: dict[str, str]
) -> tuple[dict[int, int], dict[str, dict]]:
    """Run ``argv``: the peak resident bytes of every process it starts (worker ranks by pid, the
    main process as 0), and a snapshot of those peaks when the first output line starting with
    each of ``marks`` (name -> prefix) appeared (stdout is unbuffered: PYTHONUNBUFFERED)."""
    # cwd: ``python -m`` puts the working directory first on sys.path, which would shadow --tree
    proc = subprocess.Popen(
        argv,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=env["PYTHONPATH"],
    )
    peaks: dict[int, int] = {}
    lock = threading.Lock()

    def sample():
        with lock:
            for pid in descendants(proc.pid):
                if pid == proc.pid or is_worker(pid):
                    key = 0 if pid == proc.pid else pid
                    peaks[key] = max(peaks.get(key, 0), hwm(pid))

    def poll():
        while proc.poll() is None:
            sample()
            time.sleep(0.2)

    thread = threading.Thread(target=poll)
    thread.start()
    snaps, tail = {}, []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        for name, prefix in marks.items():
            if name not in snaps and line.startswith(prefix):
                sample()
                with lock:
                    snaps[name] = dict(peaks)
    proc.wait()
    thread.join()
    if proc.returncode:
        sys.exit(f"{' '.join(argv[:4])} failed ({proc.returncode}):\n{''.join(tail)}")
    return peaks, snaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/bumblebee-startup-memory")
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": args.tree, "OMP_NUM_THREADS": "1"}
    ckpt, run, out = (os.path.join(args.work, d) for d in ("hf", "run", "export"))
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        subprocess.run(
            [sys.executable, "-c", MAKE, ckpt, json.dumps(ARCH)],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        size = json.load(f)["metadata"]["total_size"]
    n = size // 4
    a = ARCH
    experts = (
        a["num_hidden_layers"]
        * a["num_experts"]
        * 3
        * a["moe_intermediate_size"]
        * a["hidden_size"]
    )
    largest = a["vocab_size"] * a["hidden_size"] * 4
    per_rank = (
        n // args.nproc
    )  # fsdp2 over every rank, experts split by ep = nproc: 1/nproc of everything
    static = 16 * per_rank
    print(
        f"checkpoint {size / GiB:.2f} GiB ({n / 1e9:.3f} B params, {experts / 1e9:.3f} B in experts); "
        f"tree {args.tree}"
    )
    for d in (run, out):
        subprocess.run(["rm", "-rf", d], check=True)
    t0 = time.time()
    marks = {"startup": "bumblebee: kernels", "step": "[", "end": "done:"}
    peaks, snaps = run_measured(
        [
            sys.executable,
            "-m",
            "bumblebee.cli",
            "train",
            "--nproc",
            str(args.nproc),
            "--set",
            f"parallel.ep={args.nproc}",
            "--set",
            f"model.hf_path={ckpt}",
            "--set",
            f"train.steps={args.steps}",
            "--set",
            "train.track_memory=true",
            "--set",
            "train.seq_len=64",
            "--set",
            f"train.global_batch={args.nproc}",
            "--set",
            "train.save_every=1",
            "--set",
            "train.eval_every=0",
            "--set",
            f"train.out_dir={run}",
        ],
        env,
        marks,
    )
    print(
        f"train --nproc {args.nproc} ep={args.nproc}, {args.steps} step(s) + save: {time.time() - t0:.0f} s"
    )
    print(
        f"  checkpoint / {args.nproc} = {size / args.nproc / GiB:.2f} GiB; static fp32 state per rank "
        f"(16 B x {per_rank / 1e6:.0f} M params) = {static / GiB:.2f} GiB; goal <= {(static + GiB) / GiB:.2f} GiB"
    )
    workers = sorted(k for k in peaks if k)
    print(
        "  peak RSS (GiB) per worker:   "
        + "  ".join(f"{'rank?' if len(workers) > 1 else 'rank'}{i}" for i in range(len(workers)))
        + "   (ranks in pid order)"
    )
    for name in ("startup", "step", "end"):
        if name in snaps:
            print(
                f"    after {name:8s}           "
                + "  ".join(f"{snaps[name].get(w, 0) / GiB:6.2f}" for w in workers)
            )
    print(
        "    whole run                "
        + "  ".join(f"{peaks[w] / GiB:6.2f}" for w in workers)
        + f"   (launcher {peaks.get(0, 0) / GiB:.2f})"
    )
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"peak_mem_bytes"' in line]
    print(
        "  tracker peak (live tensors, largest rank) per step: "
        + "  ".join(f"{r['peak_mem_bytes'] / GiB:.2f}" for r in steps)
        + " GiB"
    )
    t0 = time.time()
    peaks, _ = run_measured(
        [sys.executable, "-m", "bumblebee.cli", "convert", "--to", "hf", run, out], env, {}
    )
    print(
        f"convert --to hf: {time.time() - t0:.0f} s; peak RSS {max(peaks.values()) / GiB:.2f} GiB; "
        f"goal <= 2 x largest tensor ({largest / GiB:.2f} GiB) + 1 GiB = {(2 * largest + GiB) / GiB:.2f} GiB"
    )


if __name__ == "__main__":
    main()
