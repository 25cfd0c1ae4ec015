"""One prepared GPU check (issue 43): environment, kernel numerics, kernel speed, a real-width
slice beside the planner, several ranks on one GPU. One JSON and one markdown table.

    python benchmarks/gpu_check.py --out results/            # one H100/H200, <= 8 minutes, offline
    python benchmarks/gpu_check.py --smoke --out /tmp/gc     # CPU, tiny shapes, < 1 minute

Sections (each guarded: an exception becomes ``"status": "error"`` with its one-line message
and the next section runs; a case past ``--case-cap-s`` stops with an error and the next case
runs; past ``--budget-s`` the rest is ``"skipped: time budget"``):

1. ``env``: torch / CUDA / Triton / fla versions, device, the flash kernel torch will run (FA2 /
   FA3), the allocator setting (the one every run uses), a trivial Triton compile (a missing
   compiler is one line here, not an error deep in a case), a bf16 8192^3 matmul (the roofline).
2. ``numerics``: each CUDA kernel path of the project in bf16 against the project's own
   reference in fp32 on upcast inputs, same device: varlen flash attention (Qwen3.5 and Qwen3
   heads, GQA, packed documents) forward and backward; the CP ring's block kernel and LSE merge
   (``ring_flash.forward_step`` / ``backward_step``, every rank's blocks in one process) against
   full attention; FLA ``chunk_gated_delta_rule`` through ``fla_gated_delta_rule`` (per-document
   states) against the chunked PyTorch path; linear CE against materialized CE; grouped-GEMM
   experts against the expert loop; MLA through the varlen core against MLA through the masked
   SDPA reference. Per tensor: max abs error, max abs error over max |reference|, and the
   relative norm error ||a - b|| / ||b||, which passes at <= the case's stated tolerance.
   Under ``--smoke`` the same code runs on CPU inside ``emulate_cuda()`` (the kernels replaced by
   the references of their contracts), so the glue, the comparisons and the tolerances are tested.
3. ``speed``: at 32K tokens, CUDA events, median; TFLOP/s and fraction of the roofline, each
   kernel beside the pure-PyTorch path it replaces.
4. ``slice``: Qwen3.5-35B-A3B and Qwen3-30B-A3B at real width (preset's hidden, heads, experts,
   vocabulary; the first n layers of the preset's layer pattern), the real ``Trainer`` (bf16,
   full recompute, linear CE, one rank, one document per row so that the model FLOPs' causal
   attention over the whole row is the work done, weights drawn on the device) at 32K and 128K
   tokens per step, two depths chosen by the planner's memory prediction; step time, tokens/s,
   model TFLOP/s, peak memory, host syncs per step, the per-layer time (difference of the two
   depths), the planner's prediction for the same slice (attention efficiency of the flash kernel
   that ran) and the ratio. ``--smoke`` runs the tiny presets at 256 tokens.
5. ``multirank``: two ranks over gloo on CPU tensors inside ``emulate_cuda()``: the CP ring
   (``ring_flash_attention`` with its real ring passes) and the EP all-to-all against one rank.
   On a GPU it is skipped with the reason (one device holds one NCCL rank, and gloo takes no
   CUDA tensors in all_to_all or point-to-point calls).

Run order: env, numerics, speed, multirank, slice (the slices take what budget is left).
It never passes or fails on a timing (the project's testing rule); numerics carry pass/fail.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

# stated bf16 tolerances on the relative norm error ||kernel - ref|| / ||ref|| (ref in fp32 on the
# same upcast inputs): bf16 rounding of one output is ~2e-3 relative; a backward chains a few
# bf16 GEMMs, a recurrence (GDN) many more
TOL = {"fwd": 1e-2, "bwd": 2e-2, "gdn": 3e-2, "loss": 1e-3}
SKIP_NO_CUDA = "skipped: no CUDA"
SKIP_BUDGET = "skipped: time budget"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, under a minute")
    p.add_argument(
        "--budget-s", type=float, default=None, help="wall budget (default 450; smoke 90)"
    )
    p.add_argument("--reps", type=int, default=None, help="timed repeats (default 5; smoke 1)")
    p.add_argument("--only", default="", help="comma list of sections to run (env always runs)")
    p.add_argument("--gpu", default=None, help="planner GPU name (default: from the device)")
    p.add_argument(
        "--case-cap-s",
        type=float,
        default=None,
        help="time cap of one case (default 150; smoke: the budget)",
    )
    args = p.parse_args(argv)
    args.budget_s = args.budget_s or (90.0 if args.smoke else 450.0)
    args.case_cap_s = args.case_cap_s or (args.budget_s if args.smoke else 150.0)
    args.reps = args.reps or (1 if args.smoke else 5)
    args.only = {s for s in args.only.split(",") if s}
    return args


# ----------------------------------------------------------------------------- helpers
def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def compare(name: str, got, ref, tol: float) -> dict:
    """Error of ``got`` (kernel) against ``ref`` (fp32 reference), in float64."""
    a, b = got.detach().double(), ref.detach().double()
    if a.shape != b.shape:
        return {
            "tensor": name,
            "pass": False,
            "error": f"shape {tuple(a.shape)} != {tuple(b.shape)}",
        }
    diff = (a - b).abs()
    ref_max = b.abs().max().item() if b.numel() else 0.0
    max_abs = diff.max().item() if b.numel() else 0.0
    rel = ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
    ok = bool(math.isfinite(max_abs) and math.isfinite(rel) and rel <= tol)
    return {
        "tensor": name,
        "max_abs": max_abs,
        "max_rel": max_abs / ref_max if ref_max else max_abs,
        "rel_norm": rel,
        "tol": tol,
        "pass": ok,
    }


def grads(leaves):
    return [x.grad for x in leaves]


def leaves_like(xs, dtype):
    return [x.detach().to(dtype).requires_grad_() for x in xs]


def packed_positions(doc_rows, device):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in doc_rows]).to(device)


class Timer:
    """Median milliseconds of ``fn`` after warm-up: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device, reps: int, warmup: int = 1):
        self.cuda, self.reps, self.warmup = device.type == "cuda", reps, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]


class Check:
    def __init__(self, args):
        self.args, self.smoke = args, args.smoke
        self.cuda = torch.cuda.is_available() and not args.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s
        self.result = {"sections": {}}
        self.roofline = None  # TFLOP/s, measured
        self.slice_build_s = 5.0 if args.smoke else 30.0  # raised to what a slice build took

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def emulated(self):
        """The CUDA branches on CPU with the kernels' references (``--smoke``)."""
        if self.cuda:
            return contextlib.nullcontext()
        from bumblebee.primitives.emulation import emulate_cuda

        return emulate_cuda(check_comm=False)

    def section(self, name: str, fn) -> None:
        out = {"cases": []}
        self.result["sections"][name] = out
        t = time.monotonic()
        if self.args.only and name != "env" and name not in self.args.only:
            out["status"] = "skipped: not in --only"
            return
        if self.left() <= 0:
            out["status"] = SKIP_BUDGET
            return
        try:
            status = fn(out)
            out["status"] = status or _status(out["cases"])
        except Exception as e:  # one failure is recorded; the rest still runs
            out["status"] = "error"
            out["error"] = one_line(e)
            out["traceback"] = traceback.format_exc(limit=-4)
        finally:
            out["seconds"] = round(time.monotonic() - t, 2)
            if self.cuda:
                gc.collect()
                torch.cuda.empty_cache()
        print(f"[gpu_check] {name}: {out['status']} ({out['seconds']} s)", flush=True)

    def case(self, out: dict, name: str, fn, need_cuda: bool = False) -> None:
        """One guarded case inside a section."""
        c = {"case": name}
        out["cases"].append(c)
        if need_cuda and not self.cuda:
            c["status"] = SKIP_NO_CUDA
            return
        if self.left() <= 0:
            c["status"] = SKIP_BUDGET
            return
        t = time.monotonic()
        try:
            with time_cap(min(self.left(), self.args.case_cap_s)):
                c.update(fn() or {})
            if "status" not in c:
                rows = c.get("tensors", [])
                c["status"] = "pass" if all(r["pass"] for r in rows) else "fail"
        except Exception as e:
            c["status"] = "error"
            c["error"] = one_line(e)
        finally:
            c["seconds"] = round(time.monotonic() - t, 2)
            if self.cuda:
                gc.collect()
                torch.cuda.empty_cache()


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_cap(seconds: float):
    """Raise ``CaseTimeout`` in the main thread after ``seconds`` (a case that would eat the rest
    of the budget stops; the next case runs). Python code is interrupted between bytecodes, so a
    kernel running on the device finishes first."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def expire(signum, frame):
        raise CaseTimeout(f"over its time cap of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _status(cases) -> str:
    states = [c.get("status", "") for c in cases]
    if any(s == "fail" for s in states):
        return "fail"
    if any(s == "error" for s in states):
        return "error"
    if states and all(s.startswith("skipped") for s in states):
        return states[0]
    return "ok"


# ----------------------------------------------------------------------------- 1. environment
def triton_compiles() -> str:
    """ "ok", or one line saying why a trivial Triton kernel cannot be compiled and run here
    (Triton compiles with the host C compiler and Python.h at first launch: without them every
    FLA kernel fails later, deep inside a case)."""
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

        x = torch.zeros(100, device="cuda")
        add_one[(1,)](x, 100, BLOCK=128)
        torch.cuda.synchronize()
        return "ok" if bool((x == 1).all()) else "error: the trivial kernel computed wrong values"
    except Exception as e:
        return f"error: {one_line(e)}"


def section_env(ck: Check, out: dict):
    from bumblebee.primitives import kernel_choice

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "smoke": ck.smoke,
        "device": torch.cuda.get_device_name() if ck.cuda else "cpu",
        "budget_s": ck.args.budget_s,
    }
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except OSError:
        env["commit"] = None
    for mod in ("triton", "fla", "transformers", "einops", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # absent (fla travels as a wheel) or broken
            env[mod] = f"absent ({one_line(e)})"
    env["fla_present"] = kernel_choice.package_present("fla")
    env["flash_impl"] = kernel_choice.flash_impl()  # what torch's flash ops will run here
    env["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    env["triton_compile"] = triton_compiles() if ck.cuda else SKIP_NO_CUDA
    print(f"[gpu_check] triton compile: {env['triton_compile']}", flush=True)
    if ck.cuda:
        props = torch.cuda.get_device_properties(0)
        env["sm"] = f"{props.major}.{props.minor}"
        env["multiprocessors"] = props.multi_processor_count
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
        n = 8192
        g = torch.Generator(device="cuda").manual_seed(0)
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "ab")
        ms = Timer(ck.device, reps=10, warmup=3)(lambda: a @ b)
        ck.roofline = 2 * n**3 / ms / 1e9
        env["matmul_bf16_8192_tflops"] = round(ck.roofline, 1)
        del a, b
    else:
        env["matmul_bf16_8192_tflops"] = SKIP_NO_CUDA
    out.update(env)
    ck.result["env"] = env
    return "ok"


# ----------------------------------------------------------------------------- 2. numerics
def attn_shapes(ck: Check):
    """(name, query heads, kv heads, head dim): Qwen3.5-35B-A3B and Qwen3-30B-A3B full attention."""
    if ck.smoke:
        return [("qwen3.5", 8, 1, 32), ("qwen3", 8, 1, 16)]
    return [("qwen3.5", 16, 2, 256), ("qwen3", 32, 4, 128)]


def doc_rows(ck: Check):
    """Packed documents per row: uneven, crossing the ring's zigzag chunk borders."""
    if ck.smoke:
        return [[13, 40, 11, 32], [96]]
    return [[700, 37, 1300, 2059], [4096]]


def case_attention(ck: Check, N, K, D):
    from bumblebee.primitives.attention.sdpa import sdpa_masked, sdpa_varlen
    from bumblebee.primitives.packed import doc_layout

    dev = ck.device
    rows = doc_rows(ck)
    B, T = len(rows), sum(rows[0])
    lay = doc_layout(packed_positions(rows, dev))
    g = torch.Generator(device=dev).manual_seed(1)
    xs = [torch.randn(B, h, T, D, device=dev, generator=g) for h in (N, K, K)]
    do = torch.randn(B, N, T, D, device=dev, generator=g)
    scale = D**-0.5
    fast = leaves_like(xs, torch.bfloat16)
    with ck.emulated():
        o = sdpa_varlen(*fast, lay, scale)
        o.backward(do.bfloat16())
    ref = leaves_like([x.bfloat16() for x in xs], torch.float32)
    o_ref = sdpa_masked(*ref, lay, scale)
    o_ref.backward(do.bfloat16().float())
    tensors = [compare("o", o, o_ref, TOL["fwd"])]
    tensors += [
        compare(n, a, b, TOL["bwd"]) for n, a, b in zip(("dq", "dk", "dv"), grads(fast), grads(ref))
    ]
    return {"shape": f"B={B} T={T} N={N} K={K} D={D}", "tensors": tensors}


def case_ring(ck: Check, N, K, D, cp: int):
    """The ring of ``ring_flash.py`` without its communication: rank r's forward_step over every
    source block in ring order, the LSE merge in place, backward_step with the final O and LSE;
    the shards put back in global order against full attention in fp32."""
    from bumblebee.primitives.attention.sdpa import sdpa_masked
    from bumblebee.primitives.cp.ring_flash import (
        _flat,
        backward_step,
        cuda_block_kernel,
        forward_step,
    )
    from bumblebee.primitives.cp.zigzag import (
        CPShards,
        shard_sequence,
        unshard_sequence,
        zigzag_index,
    )
    from bumblebee.primitives.packed import doc_layout

    dev = ck.device
    rows = doc_rows(ck)
    B, T = len(rows), sum(rows[0])
    docs = doc_layout(packed_positions(rows, dev))
    g = torch.Generator(device=dev).manual_seed(2)
    q, k, v, do = (
        torch.randn(B, h, T, D, device=dev, generator=g).bfloat16() for h in (N, K, K, N)
    )
    scale = D**-0.5
    shard = lambda x, r: _flat(shard_sequence(x.transpose(1, 2), cp, r).transpose(1, 2))  # noqa: E731
    lays = [
        CPShards(None, cp, r, T, docs.doc_ids(dev), zigzag_index(T, cp, r, dev), docs)
        for r in range(cp)
    ]
    qs, ks, vs, dos = ([shard(x, r) for r in range(cp)] for x in (q, k, v, do))
    L = T // cp
    outs, lses, dq, dk, dv = [], [], [], [], []
    with ck.emulated():
        kern = cuda_block_kernel()
        for r in range(cp):
            o = torch.zeros(qs[r].shape, dtype=torch.float32, device=dev)
            lse = torch.full((N, B * L), float("-inf"), dtype=torch.float32, device=dev)
            for step in range(cp):
                src = (r - step) % cp
                forward_step(qs[r], o, lse, ks[src], vs[src], lays[r], src, scale, kern)
            outs.append(o.to(q.dtype))
            lses.append(lse)
        dk = [torch.zeros(x.shape, dtype=torch.float32, device=dev) for x in ks]
        dv = [torch.zeros_like(x) for x in dk]
        for r in range(cp):
            dq_r = torch.zeros(qs[r].shape, dtype=torch.float32, device=dev)
            for step in range(cp):
                src = (r - step) % cp
                backward_step(
                    dos[r],
                    qs[r],
                    outs[r],
                    lses[r],
                    dq_r,
                    ks[src],
                    vs[src],
                    dk[src],
                    dv[src],
                    lays[r],
                    src,
                    scale,
                    kern,
                )
            dq.append(dq_r)

    def unflat(parts, H):  # [B*L, H, D] per rank -> [B, H, T, D]
        return unshard_sequence([p.view(B, L, H, D) for p in parts]).transpose(1, 2)

    ref = leaves_like([q, k, v], torch.float32)
    o_ref = sdpa_masked(*ref, docs, scale)
    o_ref.backward(do.float())
    tensors = [
        compare("o", unflat(outs, N), o_ref, TOL["fwd"]),
        compare("dq", unflat(dq, N), ref[0].grad, TOL["bwd"]),
        compare("dk", unflat(dk, K), ref[1].grad, TOL["bwd"]),
        compare("dv", unflat(dv, K), ref[2].grad, TOL["bwd"]),
    ]
    return {"shape": f"cp={cp} B={B} T={T} N={N} K={K} D={D}", "tensors": tensors}


def gdn_shape(ck: Check):
    """(key heads, value heads, key dim, value dim): Qwen3.5-35B-A3B's Gated DeltaNet."""
    return (2, 4, 16, 16) if ck.smoke else (16, 32, 128, 128)


def gdn_inputs(ck: Check, B, T, seed):
    G, H, K, V = gdn_shape(ck)
    g = torch.Generator(device=ck.device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=ck.device, generator=g)  # noqa: E731
    q, k, v = r(B, T, G, K), r(B, T, G, K), r(B, T, H, V)
    gate = -F.softplus(r(B, T, H) + 1)  # log decay as the model computes it
    beta = torch.sigmoid(r(B, T, H))
    h0 = r(B, H, K, V) * 0.1
    return [q, k, v, gate, beta], h0


def case_gdn(ck: Check):
    """``fla_gated_delta_rule`` (the custom op over FLA; per-document states: each row's carried
    state in, its last document's state out, middle documents without) against the chunked
    PyTorch path in fp32."""
    from bumblebee.primitives import kernel_choice
    from bumblebee.primitives.linear_attention.fla import fla_gated_delta_rule
    from bumblebee.primitives.linear_attention.gated_delta_rule import _chunked
    from bumblebee.primitives.packed import doc_layout

    if ck.cuda and not kernel_choice.package_present("fla"):
        return {"status": "skipped: fla not installed (see benchmarks/README.md, the wheel line)"}
    rows = doc_rows(ck)
    B, T = len(rows), sum(rows[0])
    lay = doc_layout(packed_positions(rows, ck.device))
    xs, h0 = gdn_inputs(ck, B, T, 3)
    w_o = torch.randn(B, T, gdn_shape(ck)[1], gdn_shape(ck)[3], device=ck.device)
    w_s = torch.randn_like(h0)
    # kernel side as the model feeds it: q, k, v, beta bf16, the log decay and the state fp32
    fast = [
        x.detach().to(torch.float32 if i == 3 else torch.bfloat16).requires_grad_()
        for i, x in enumerate(xs)
    ]
    h0_fast = h0.clone().requires_grad_()
    with ck.emulated():
        o, s = fla_gated_delta_rule(*fast, lay, h0_fast)
        ((o.float() * w_o).sum() + (s * w_s).sum()).backward()
    ref = [x.detach().float().requires_grad_() for x in fast]
    h0_ref = h0.clone().requires_grad_()
    o_r, s_r = _chunked(*ref, h0_ref, lay, 64)
    ((o_r * w_o).sum() + (s_r * w_s).sum()).backward()
    names = ("dq", "dk", "dv", "dg", "dbeta")
    tensors = [compare("o", o, o_r, TOL["gdn"]), compare("final_state", s, s_r, TOL["gdn"])]
    tensors += [compare(n, a.grad, b.grad, TOL["gdn"]) for n, a, b in zip(names, fast, ref)]
    tensors.append(compare("dh0", h0_fast.grad, h0_ref.grad, TOL["gdn"]))
    G, H, K, V = gdn_shape(ck)
    return {"shape": f"B={B} T={T} G={G} H={H} K={K} V={V}", "tensors": tensors}


def case_conv(ck: Check):
    """The GDN short conv through FLA's fused ``causal_conv1d`` (``fla_causal_conv1d``: documents
    from cu_seqlens, the carried window as the first document's state, SiLU fused) in bf16
    against the channel-blocks path (``causal_conv1d`` + SiLU) in fp32: y, final window, and the
    x / weight / window gradients."""
    from bumblebee.primitives import kernel_choice
    from bumblebee.primitives.linear_attention.conv import causal_conv1d, fla_causal_conv1d
    from bumblebee.primitives.packed import doc_layout

    if ck.cuda and not kernel_choice.package_present("fla"):
        return {"status": "skipped: fla not installed (see benchmarks/README.md, the wheel line)"}
    rows = doc_rows(ck)
    B, T = len(rows), sum(rows[0])
    G, H, K, V = gdn_shape(ck)
    C, W = 2 * G * K + H * V, 4
    lay = doc_layout(packed_positions(rows, ck.device))
    g = torch.Generator(device=ck.device).manual_seed(5)
    x, w = (torch.randn(*s, device=ck.device, generator=g) for s in ((B, T, C), (C, W)))
    init = torch.randn(B, W - 1, C, device=ck.device, generator=g)
    dy = torch.randn(B, T, C, device=ck.device, generator=g)
    df = torch.randn(B, W - 1, C, device=ck.device, generator=g)
    fast = leaves_like((x, w, init), torch.bfloat16)
    with ck.emulated():
        y, f = fla_causal_conv1d(fast[0], fast[1], lay, fast[2], "silu")
        ((y.float() * dy).sum() + (f.float() * df).sum()).backward()
    ref = leaves_like((x, w, init), torch.float32)
    y_r, f_r = causal_conv1d(ref[0], ref[1], lay, ref[2])
    y_r = F.silu(y_r)
    ((y_r * dy).sum() + (f_r * df).sum()).backward()
    tensors = [compare("y", y, y_r, TOL["gdn"]), compare("final_window", f, f_r, TOL["gdn"])]
    tensors += [
        compare(n, a.grad, b.grad, TOL["gdn"]) for n, a, b in zip(("dx", "dw", "dinit"), fast, ref)
    ]
    return {"shape": f"B={B} T={T} C={C} W={W}", "tensors": tensors}


def case_glue(ck: Check):
    """The glue ``primitives/fused.py`` compiles on CUDA (RMSNorm, zero-centered RMSNorm, gated
    RMSNorm, RoPE, SwiGLU) in bf16, through ``fused`` (compiled on CUDA; emulated: eager), against
    the same functions eagerly in fp32: outputs and input gradients."""
    from bumblebee.primitives import fused as fz
    from bumblebee.primitives.linear_attention.gdn import gated_rms_norm
    from bumblebee.primitives.norms import rms_norm, zero_centered_rms_norm
    from bumblebee.primitives.rope import rope_reference

    T, H, V = (64, 4, 16) if ck.smoke else (4096, 32, 128)
    g = torch.Generator(device=ck.device).manual_seed(7)
    r = lambda *s: torch.randn(*s, device=ck.device, generator=g)  # noqa: E731
    cases = {
        "rms_norm": (rms_norm, [r(T, H * V), r(H * V)], 1e-6),
        "zero_centered_rms_norm": (zero_centered_rms_norm, [r(T, H * V), r(H * V) * 0.1], 1e-6),
        "gated_rms_norm": (gated_rms_norm, [r(T, H, V), r(T, H, V), r(V)], 1e-6),
        "rope": (rope_reference, [r(1, H, T, V), r(1, T, V // 2), r(1, T, V // 2)], None),
        "swiglu": (fz._swiglu_halves, [r(T, 2 * H * V)], None),
    }
    tensors = []
    for name, (fn, xs, eps) in cases.items():
        extra = () if eps is None else (eps,)
        fast, ref = leaves_like(xs, torch.bfloat16), leaves_like(xs, torch.float32)
        with ck.emulated():
            y = fz.fused(name, fn, *fast, *extra)
        y_r = fn(*ref, *extra)
        dy = torch.randn(y_r.shape, device=ck.device, generator=g)
        (y.float() * dy).sum().backward()
        (y_r * dy).sum().backward()
        tensors.append(compare(f"{name} y", y, y_r, TOL["fwd"]))
        tensors.append(compare(f"{name} dx", fast[0].grad, ref[0].grad, TOL["bwd"]))
    return {"shape": f"T={T} H={H} V={V}", "tensors": tensors}


def ce_shape(ck: Check):
    """(tokens, hidden, vocabulary): Qwen3's 152K vocabulary (the fp32 reference holds [T, V])."""
    return (96, 32, 300) if ck.smoke else (4096, 2048, 151936)


def case_linear_ce(ck: Check):
    from bumblebee.primitives.loss.ce import cross_entropy
    from bumblebee.primitives.loss.linear_ce import linear_cross_entropy

    T, Hd, V = ce_shape(ck)
    g = torch.Generator(device=ck.device).manual_seed(4)
    h = torch.randn(T, Hd, device=ck.device, generator=g)
    w = torch.randn(V, Hd, device=ck.device, generator=g) * Hd**-0.5
    labels = torch.randint(0, V, (T,), device=ck.device, generator=g)
    labels[::7] = -100  # ignored positions
    fast = leaves_like([h, w], torch.bfloat16)
    tiles = dict(token_tile=32, vocab_tile=64) if ck.smoke else {}  # several tiles either way
    with ck.emulated():
        loss = linear_cross_entropy(*fast, labels, **tiles)
        loss.backward()
    ref = leaves_like([x.bfloat16() for x in (h, w)], torch.float32)
    loss_r = cross_entropy(*ref, labels)
    loss_r.backward()
    tensors = [
        compare("loss", loss, loss_r, TOL["loss"]),
        compare("dhidden", fast[0].grad, ref[0].grad, TOL["bwd"]),
        compare("dweight", fast[1].grad, ref[1].grad, TOL["bwd"]),
    ]
    return {"shape": f"T={T} H={Hd} V={V}", "tensors": tensors}


def expert_shape(ck: Check):
    """(routed tokens, hidden, expert FFN, experts): Qwen3-30B-A3B's experts."""
    return (40, 32, 16, 4) if ck.smoke else (16384, 2048, 768, 128)


def expert_inputs(ck: Check, seed):
    N, Hd, Fd, E = expert_shape(ck)
    g = torch.Generator(device=ck.device).manual_seed(seed)
    x = torch.randn(N, Hd, device=ck.device, generator=g)
    w1 = torch.randn(E, 2 * Fd, Hd, device=ck.device, generator=g) * Hd**-0.5
    w2 = torch.randn(E, Hd, Fd, device=ck.device, generator=g) * Fd**-0.5
    # uneven counts with an empty expert, summing to N
    share = torch.rand(E, generator=torch.Generator().manual_seed(seed)) + 0.2
    share[1] = 0
    counts = (share / share.sum() * N).floor().long()
    counts[0] += N - counts.sum()
    return x, w1, w2, counts.to(ck.device)


def case_experts(ck: Check):
    from bumblebee.primitives.moe.experts import experts_grouped, experts_loop, grouped_mm_supported

    x, w1, w2, counts = expert_inputs(ck, 5)
    dout = torch.randn(x.shape[0], w2.shape[1], device=ck.device)
    fast = leaves_like([x, w1, w2], torch.bfloat16)
    used = "grouped_mm" if grouped_mm_supported(fast[0]) else "loop (grouped_mm unsupported here)"
    y = experts_grouped(fast[0], counts, fast[1], fast[2])
    y.backward(dout.bfloat16())
    ref = leaves_like([t.bfloat16() for t in (x, w1, w2)], torch.float32)
    y_r = experts_loop(ref[0], counts, ref[1], ref[2])
    y_r.backward(dout.bfloat16().float())
    tensors = [compare("y", y, y_r, TOL["fwd"])]
    tensors += [
        compare(n, a.grad, b.grad, TOL["bwd"])
        for n, a, b in zip(("dx", "dw_gate_up", "dw_down"), fast, ref)
    ]
    N, Hd, Fd, E = expert_shape(ck)
    return {"shape": f"N={N} H={Hd} F={Fd} E={E}", "kernel": used, "tensors": tensors}


def mla_dims(ck: Check):
    """DeepSeek-V3's MLA head dims (hidden narrowed: the core is what is checked)."""
    if ck.smoke:
        return dict(
            hidden=32,
            heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        )
    return dict(
        hidden=2048,
        heads=16,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )


def case_mla(ck: Check):
    import copy

    from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
    from bumblebee.primitives.attention.sdpa import sdpa_masked, sdpa_varlen
    from bumblebee.primitives.packed import doc_layout
    from bumblebee.primitives.recompute import NoRecompute
    from bumblebee.primitives.rope import rope_cos_sin

    d = mla_dims(ck)
    rows = doc_rows(ck)
    B, T = len(rows), sum(rows[0])
    pos = packed_positions(rows, ck.device)
    lay = doc_layout(pos)
    torch.manual_seed(6)
    scale = (d["qk_nope_head_dim"] + d["qk_rope_head_dim"]) ** -0.5
    kw = dict(d, eps=1e-6, scale=scale, rope_interleave=True, recompute=NoRecompute())
    hidden, heads = kw.pop("hidden"), kw.pop("heads")
    ref_m = MultiHeadLatentAttention(hidden, heads, attend=sdpa_masked, **kw).to(ck.device)
    for p in ref_m.parameters():
        torch.nn.init.normal_(p, std=hidden**-0.5) if p.dim() > 1 else torch.nn.init.ones_(p)
    fast_m = copy.deepcopy(ref_m).bfloat16()
    fast_m.attend = sdpa_varlen
    ref_m.load_state_dict({k: v.float() for k, v in fast_m.state_dict().items()})
    x = torch.randn(B, T, hidden, device=ck.device)
    dy = torch.randn(B, T, hidden, device=ck.device)
    x_f = x.bfloat16().requires_grad_()
    with ck.emulated():
        cos, sin = rope_cos_sin(pos, d["qk_rope_head_dim"], 10000.0, torch.bfloat16)
        y = fast_m(x_f, cos, sin, lay)
        y.backward(dy.bfloat16())
    x_r = x.bfloat16().float().requires_grad_()
    cos, sin = rope_cos_sin(pos, d["qk_rope_head_dim"], 10000.0, torch.float32)
    y_r = ref_m(x_r, cos, sin, lay)
    y_r.backward(dy.bfloat16().float())
    tensors = [compare("y", y, y_r, TOL["fwd"]), compare("dx", x_f.grad, x_r.grad, TOL["bwd"])]
    for n in ("kv_b_proj.weight", "q_b_proj.weight", "o_proj.weight"):
        a, b = fast_m.get_parameter(n).grad, ref_m.get_parameter(n).grad
        tensors.append(compare("d" + n, a, b, TOL["bwd"]))
    return {
        "shape": f"B={B} T={T} " + " ".join(f"{k}={v}" for k, v in d.items()),
        "tensors": tensors,
    }


def case_mb_pair(ck: Check):
    """moe_comm = overlap_mb's pair on one GPU (ep = 1: no exchange): two micro-batches' forwards
    on two threads and two CUDA streams, their backwards layer by layer (layer_tape), against the
    same micro-batches one after the other. What it checks is the stream order of the gradient
    writes (a race shows as a mismatch) and the layer-by-layer backward on autograd's device
    thread; fp32."""
    from bumblebee.config import PrimitivesConfig
    from bumblebee.data import Batch
    from bumblebee.models import arch_from_hf_dict, build_model
    from bumblebee.models.presets import PRESETS
    from bumblebee.runtime.step import accumulate_global_balance

    arch = arch_from_hf_dict(PRESETS["qwen3_moe"]["tiny"])
    T = 256 if ck.smoke else 4096
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, arch.vocab_size, (4, T), generator=g)
    pos = torch.arange(T).repeat(4, 1) % (T // 4)
    parts = [Batch(ids[i : i + 1], ids[i : i + 1], pos[i : i + 1]).to(ck.device) for i in range(4)]
    out = []
    for paired in (False, True):
        model = build_model(arch, PrimitivesConfig(recompute="full"), seed=0, device=ck.device)
        with ck.emulated():
            accumulate_global_balance(
                parts, None, model, 4 * T, 0.01, contextlib.nullcontext(), None, paired
            )
        out.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    names = list(out[0])
    tensors = [compare("d" + n, out[1][n], out[0][n], 1e-5) for n in names]
    return {
        "shape": f"4 micro-batches x {T} tokens, qwen3_moe tiny, full recompute",
        "tensors": tensors,
    }


def section_numerics(ck: Check, out: dict):
    for name, N, K, D in attn_shapes(ck):
        ck.case(out, f"varlen attention {name}", lambda s=(N, K, D): case_attention(ck, *s))
    name, N, K, D = attn_shapes(ck)[0]
    for cp in (2, 4):
        ring = lambda c=cp: case_ring(ck, N, K, D, c)  # noqa: E731
        ck.case(out, f"cp ring blocks + lse merge {name} cp{cp}", ring)
    ck.case(out, "fla chunk_gated_delta_rule qwen3.5", lambda: case_gdn(ck))
    ck.case(out, "fla causal_conv1d qwen3.5", lambda: case_conv(ck))
    ck.case(out, "compiled glue (norms, RoPE, SwiGLU) vs eager fp32", lambda: case_glue(ck))
    ck.case(out, "linear CE vs materialized CE", lambda: case_linear_ce(ck))
    ck.case(out, "grouped-GEMM experts vs loop", lambda: case_experts(ck))
    ck.case(out, "MLA (varlen core) vs MLA (sdpa reference)", lambda: case_mla(ck))
    ck.case(out, "overlap_mb pair on two streams vs one by one", lambda: case_mb_pair(ck))


# ----------------------------------------------------------------------------- 3. speed
def speed_row(ck: Check, what: str, impl: str, ms: float, flops: float, peak_mem=None) -> dict:
    tf = flops / ms / 1e9
    row = {"what": what, "impl": impl, "ms": round(ms, 3), "tflops": round(tf, 1)}
    if ck.roofline:
        row["of_roofline"] = round(tf / ck.roofline, 3)
    if peak_mem is not None:
        row["peak_gib"] = round(peak_mem / 2**30, 2)
    return row


def time_impls(ck: Check, what: str, impls, flops: float, reps=None) -> list[dict]:
    """One row per (label, closure), each guarded: an OOM of the baseline keeps the kernel's row."""
    rows = []
    for impl, fn in impls:
        try:
            torch.cuda.reset_peak_memory_stats()
            ms = Timer(ck.device, reps or ck.args.reps)(fn)
            rows.append(speed_row(ck, what, impl, ms, flops, torch.cuda.max_memory_allocated()))
        except Exception as e:
            rows.append({"what": what, "impl": impl, "error": one_line(e)})
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def speedup(rows, key="speedup") -> dict:
    """The baseline's time over the kernel's (rows[0] the kernel, rows[1] the baseline)."""
    if len(rows) == 2 and all("ms" in r for r in rows):
        return {key: round(rows[1]["ms"] / rows[0]["ms"], 2)}
    return {}


def fwd_bwd(fn, leaves, dout):
    def run():
        for x in leaves:
            x.grad = None
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dout)

    return run


def sdpa_per_doc(q, k, v, bounds, scale):
    """The path varlen replaces: one causal SDPA call per document (K/V heads repeated)."""
    G = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(G, 1) for x in (k, v))
    outs = [
        F.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scale
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, 2)


def speed_attention(ck: Check):
    from bumblebee.primitives.attention.sdpa import sdpa_varlen
    from bumblebee.primitives.packed import DocLayout

    T, docs = 32768, [8192] * 4  # 32K tokens per rank, 8K documents
    _, N, K, D = attn_shapes(ck)[0]
    bounds = [0]
    for n in docs:
        bounds.append(bounds[-1] + n)
    lay = DocLayout(bounds=(tuple(bounds),), seq_len=T)
    g = torch.Generator(device="cuda").manual_seed(7)
    xs = [
        torch.randn(1, h, T, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        for h in (N, K, K)
    ]
    dout = torch.randn(1, N, T, D, device="cuda", dtype=torch.bfloat16)
    fwd = sum(2 * 2 * N * D * n * n / 2 for n in docs)  # causal: half the square
    flops = fwd * 3.5  # flash backward: 5 matmuls to the forward's 2
    impls = [
        ("varlen_attn (flash)", fwd_bwd(lambda *a: sdpa_varlen(*a, lay, D**-0.5), xs, dout)),
        ("SDPA per document", fwd_bwd(lambda *a: sdpa_per_doc(*a, bounds, D**-0.5), xs, dout)),
    ]
    rows = time_impls(ck, f"attention fwd+bwd T={T} N={N} K={K} D={D}", impls, flops)
    return {"rows": rows, **speedup(rows), "status": "ok"}


def speed_gdn(ck: Check):
    from bumblebee.primitives import kernel_choice
    from bumblebee.primitives.linear_attention.fla import fla_gated_delta_rule
    from bumblebee.primitives.linear_attention.gated_delta_rule import _chunked
    from bumblebee.primitives.packed import DocLayout

    T = 32768
    lay = DocLayout(bounds=((0, 8192, 16384, 24576, T),), seq_len=T)
    xs, _ = gdn_inputs(ck, 1, T, 8)
    G, H, K, V = gdn_shape(ck)
    xs = [
        x.to(torch.float32 if i == 3 else torch.bfloat16).requires_grad_() for i, x in enumerate(xs)
    ]
    dout = torch.randn(1, T, H, V, device="cuda", dtype=torch.bfloat16)
    flops = 3 * T * 2.0 * H * (3 * K * V + 2 * 64 * (K + V))  # the planner's count, fwd+bwd
    impls = [("torch chunked (64)", fwd_bwd(lambda *a: _chunked(*a, None, lay, 64), xs, dout))]
    if kernel_choice.package_present("fla"):
        impls.insert(
            0,
            (
                "fla chunk_gated_delta_rule",
                fwd_bwd(lambda *a: fla_gated_delta_rule(*a, lay), xs, dout),
            ),
        )
    what = f"GDN fwd+bwd T={T} G={G} H={H} K={K} V={V}"
    rows = time_impls(ck, what, impls, flops, reps=max(2, ck.args.reps // 2))
    res = {"rows": rows, **speedup(rows), "status": "ok"}
    if len(impls) == 1:
        res["note"] = "fla not installed: the fused kernel was not timed"
    return res


def speed_ce(ck: Check):
    from bumblebee.primitives.loss.ce import cross_entropy
    from bumblebee.primitives.loss.linear_ce import linear_cross_entropy

    T, Hd, V = 32768, 2048, 151936
    g = torch.Generator(device="cuda").manual_seed(9)
    h = torch.randn(T, Hd, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(V, Hd, device="cuda", generator=g) * Hd**-0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    impls = [
        (label, fwd_bwd(lambda a, b, fn=fn: fn(a, b, labels), [h, w], None))
        for label, fn in (
            ("linear_ce (tiled)", linear_cross_entropy),
            ("ce (materialized)", cross_entropy),
        )
    ]
    rows = time_impls(ck, f"LM head + CE fwd+bwd T={T} H={Hd} V={V}", impls, 6.0 * T * Hd * V)
    res = {"rows": rows, "status": "ok"}
    if all("ms" in r for r in rows):
        res["linear_over_materialized"] = round(rows[0]["ms"] / rows[1]["ms"], 2)
    return res


def speed_experts(ck: Check):
    from bumblebee.primitives.moe.experts import experts_grouped, experts_loop

    N, Hd, Fd, E = 32768 * 8, 2048, 768, 128  # 32K tokens x top-8, Qwen3-30B-A3B experts
    g = torch.Generator(device="cuda").manual_seed(10)
    x = torch.randn(N, Hd, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w1 = (
        (torch.randn(E, 2 * Fd, Hd, device="cuda", generator=g) * Hd**-0.5)
        .bfloat16()
        .requires_grad_()
    )
    w2 = (torch.randn(E, Hd, Fd, device="cuda", generator=g) * Fd**-0.5).bfloat16().requires_grad_()
    counts = torch.full((E,), N // E, device="cuda", dtype=torch.long)
    dout = torch.randn(N, Hd, device="cuda", dtype=torch.bfloat16)
    impls = [
        (label, fwd_bwd(lambda a, b, c, fn=fn: fn(a, counts, b, c), [x, w1, w2], dout))
        for label, fn in (
            ("grouped_mm", experts_grouped),
            ("expert loop (reference)", experts_loop),
        )
    ]
    rows = time_impls(ck, f"experts fwd+bwd N={N} H={Hd} F={Fd} E={E}", impls, 18.0 * N * Hd * Fd)
    return {"rows": rows, **speedup(rows), "status": "ok"}


def section_speed(ck: Check, out: dict):
    ck.case(out, "attention 32K", lambda: speed_attention(ck), need_cuda=True)
    ck.case(out, "gated delta rule 32K", lambda: speed_gdn(ck), need_cuda=True)
    ck.case(out, "linear CE 32K", lambda: speed_ce(ck), need_cuda=True)
    ck.case(out, "experts 32K x top-8", lambda: speed_experts(ck), need_cuda=True)


# ----------------------------------------------------------------------------- 4. slice
SLICE_MODELS = {"qwen3.5-35b-a3b": "qwen3_5_moe", "qwen3-30b-a3b": "qwen3_moe"}


def planner_gpu(ck: Check) -> str:
    if ck.args.gpu:
        return ck.args.gpu
    name = torch.cuda.get_device_name().lower() if ck.cuda else ""
    return "h200" if "h200" in name else "b200" if "b200" in name else "h100"


def slice_prediction(ck: Check, preset: str, layers: int, seq: int) -> dict:
    """The planner's evaluation of the same slice on one GPU (same layers, no parallelism)."""
    from bumblebee.config import PrimitivesConfig
    from bumblebee.plan.hardware import Efficiency, get_gpu
    from bumblebee.plan.layout import Layout, Workload
    from bumblebee.plan.recipe import evaluate
    from bumblebee.plan.spec import load_spec, spec_from_hf_dict
    from bumblebee.primitives import kernel_choice

    _, d = load_spec(preset)
    d = dict(d, num_hidden_layers=layers)
    if "layer_types" in d:
        d["layer_types"] = list(d["layer_types"])[:layers]
    spec = spec_from_hf_dict(d, f"{preset}[:{layers}]")
    prims = PrimitivesConfig(sharding="none", loss="linear_ce", recompute="full", moe_comm="local")
    # the attention efficiency of the flash kernel torch will run here (FA2 unless FA3 is present)
    eff = Efficiency().for_flash(kernel_choice.flash_impl())
    work = Workload(seq=seq, global_batch=1)
    c = evaluate(spec, Layout(), prims, work, get_gpu(planner_gpu(ck)), eff)
    return {
        "step_s": c.perf.step_s if c.perf else None,
        "tflops": c.perf.tflops_per_gpu if c.perf else None,
        "memory_gib": c.memory.total / 2**30 if c.memory else None,
        "fits": c.feasible,
        "parts_s": {k: round(v, 4) for k, v in (c.perf.parts_s if c.perf else {}).items()},
    }


def slice_depths(ck: Check, preset: str, family: str, seq: int) -> tuple[list[int], str]:
    """(two depths, why): the deepest the planner predicts to fit in 90% of the device, and a
    shallower one. Qwen3.5 deeper than 4: the pair 4 layers apart, so the difference holds one
    period of its 3:1 pattern. If the planner predicts nothing fits, 1 layer is tried anyway:
    the measurement then checks that prediction."""
    if ck.smoke:
        return [2, 4], ""
    free = torch.cuda.get_device_properties(0).total_memory * 0.9 / 2**30
    fit = [n for n in range(1, 9) if slice_prediction(ck, preset, n, seq)["memory_gib"] <= free]
    if not fit:
        return [1], "the planner predicts no depth fits in 90% of the device; 1 layer tried"
    top = max(fit)
    if top == 1:
        return [1], ""
    low = top - 4 if family == "qwen3_5_moe" and top > 4 else max(1, top // 2)
    return [low, top], ""


def run_slice(ck: Check, preset: str, family: str, layers: int, seq: int, steps: int) -> dict:
    from bumblebee import load_config
    from bumblebee.perf.syncs import SyncCounter
    from bumblebee.runtime.trainer import Trainer

    sets = [
        f"model.name={family}",
        f"model.preset={'tiny' if ck.smoke else preset}",
        f"model.arch.num_hidden_layers={layers}",
        f"train.seq_len={seq}",
        "train.global_batch=1",
        "train.micro_batch=1",
        "train.dtype=bfloat16",
        "primitives.recompute=full",
        "primitives.loss=linear_ce",
        "primitives.sharding=none",
        # one document per row: the model FLOPs count causal attention over the whole row
        f"data.min_doc_len={seq}",
        f"data.max_doc_len={seq}",
        "data.ramp_steps=0",
        # the random init drawn on the GPU: at real width a CPU draw takes minutes of the budget
        "train.init_device=device",
        f"train.out_dir={tempfile.mkdtemp(prefix='gpu_check_slice_')}",  # not under --out
    ]
    t0 = time.monotonic()
    trainer = Trainer(load_config(None, sets), stream=io.StringIO())
    try:
        arch = trainer.model.arch
        trainer.train_step()  # the first step builds what a run builds once
        if ck.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        build_s = time.monotonic() - t0
        ck.slice_build_s = max(ck.slice_build_s, build_s)  # the next case's budget guard
        metrics = [trainer.train_step() for _ in range(steps)]
        if ck.cuda:
            peak = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        # one more step, counted and not timed: the counter's dispatch mode slows every op
        with warnings.catch_warnings(record=True) as caught, SyncCounter() as c:
            warnings.simplefilter("always")
            if ck.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step()
            finally:
                if ck.cuda:
                    torch.cuda.set_sync_debug_mode("default")
        debug_syncs = sum("synchroniz" in str(w.message) for w in caught)
        step_s = sorted(m["step_time_s"] for m in metrics)[len(metrics) // 2]
        res = {
            "layers": layers,
            "layer_types": list(getattr(arch, "layer_types", None) or ["full_attention"] * layers),
            "hidden": arch.hidden_size,
            "vocab": arch.vocab_size,
            "experts": getattr(arch, "num_experts", None),
            "step_s": step_s,
            "tokens_per_s": seq / step_s,
            "model_tflops": sorted(m["tflops_per_gpu"] for m in metrics)[len(metrics) // 2],
            "host_syncs_per_step": c.syncs,
            "host_sync_sites": c.top(5),
            "sync_debug_warnings_per_step": debug_syncs if ck.cuda else SKIP_NO_CUDA,
            "loss": metrics[-1]["loss"],
            "build_and_first_step_s": build_s,
        }
        if ck.cuda:
            res["peak_allocated_gib"], res["peak_reserved_gib"] = (x / 2**30 for x in peak)
        return res
    finally:
        del trainer
        gc.collect()
        if ck.cuda:
            torch.cuda.empty_cache()


def case_slice(ck: Check, preset: str, family: str, seq: int):
    steps = 1 if ck.smoke else 2
    depths, why = slice_depths(ck, preset, family, seq)
    runs = []
    for n in depths:
        pred = slice_prediction(ck, f"{family}/tiny" if ck.smoke else preset, n, seq)
        # the build and the steps (first, timed, counted) must fit the budget: the slowest build
        # seen and the planner's step time with a 1.5x margin
        if ck.left() < ck.slice_build_s + 1.5 * (steps + 2) * (pred["step_s"] or 1.0):
            runs.append({"layers": n, "status": SKIP_BUDGET, "predicted": pred})
            continue
        try:
            r = run_slice(ck, preset, family, n, seq, steps)
        except CaseTimeout:
            raise
        except Exception as e:  # an OOM at one depth keeps the other's figures
            runs.append({"layers": n, "status": "error", "error": one_line(e), "predicted": pred})
            continue
        r["predicted"] = pred
        r["step_ratio_measured_over_predicted"] = (
            r["step_s"] / pred["step_s"] if pred["step_s"] else None
        )
        if "peak_reserved_gib" in r and pred["memory_gib"]:
            r["memory_ratio_measured_over_predicted"] = r["peak_reserved_gib"] / pred["memory_gib"]
        runs.append(r)
    errors = [r for r in runs if r.get("status") == "error"]
    status = "error" if errors and len(errors) == len(runs) else "ok"
    res = {"seq": seq, "runs": runs, "status": status}
    if status == "error":
        res["error"] = errors[0]["error"]
    if why:
        res["note"] = why
    done = [r for r in runs if "step_s" in r]
    if len(done) == 2:
        a, b = done
        dl = b["layers"] - a["layers"]
        per_layer = (b["step_s"] - a["step_s"]) / dl
        pred_layer = (b["predicted"]["step_s"] - a["predicted"]["step_s"]) / dl
        res["per_layer_s"] = per_layer
        res["per_layer_predicted_s"] = pred_layer
        res["per_layer_ratio"] = per_layer / pred_layer if pred_layer else None
        res["head_and_optimizer_s"] = a["step_s"] - a["layers"] * per_layer
        # model FLOPs per layer from the measured model TFLOP/s of the deeper slice's difference
        fl_a, fl_b = (r["model_tflops"] * r["step_s"] for r in (a, b))
        res["per_layer_model_tflops"] = (fl_b - fl_a) / dl / per_layer if per_layer > 0 else None
    elif len(depths) < 2:
        res["note"] = (res.get("note", "") + "; one depth: no per-layer difference").lstrip("; ")
    if family == "qwen3_5_moe" and max(depths) < 4 and not ck.smoke:
        res["note"] = (
            res.get("note", "") + "; fewer than 4 layers fit: no attention layer in the slice"
        ).lstrip("; ")
    return res


def section_slice(ck: Check, out: dict):
    seqs = [256] if ck.smoke else [32768, 131072]
    for seq in seqs:
        for preset, family in SLICE_MODELS.items():
            size = f"{seq // 1024}K" if seq >= 1024 else str(seq)
            name = f"{'tiny ' + family if ck.smoke else preset} {size} tokens"
            ck.case(out, name, lambda p=preset, f=family, s=seq: case_slice(ck, p, f, s))


# ----------------------------------------------------------------------------- 5. several ranks
def _multirank(rank, world, shapes):
    """Rank ``rank`` of ``world`` on one device: the CP ring over its real ring passes and the EP
    all-to-all; returns what rank 0 compares with a one-rank run."""
    import torch.distributed as dist

    from bumblebee.primitives.cp.ring_flash import ring_flash_attention
    from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
    from bumblebee.primitives.emulation import emulate_cuda
    from bumblebee.primitives.moe.alltoall import AllToAll

    dev = torch.device("cpu")
    rows, N, K, D = shapes
    pos = packed_positions(rows, dev)
    B, T = pos.shape
    g = torch.Generator(device=dev).manual_seed(11)
    q, k, v, do = (
        torch.randn(B, h, T, D, device=dev, generator=g).bfloat16() for h in (N, K, K, N)
    )
    shard = lambda x: shard_sequence(x.transpose(1, 2), world, rank).transpose(1, 2).contiguous()  # noqa: E731
    with emulate_cuda(check_comm=False):
        layout = build_cp_shards(shard_sequence(pos, world, rank), dist.group.WORLD)
        xs = [shard(x).requires_grad_() for x in (q, k, v)]
        o = ring_flash_attention(*xs, layout, D**-0.5)
        o.backward(shard(do))
    ring = [t.detach().cpu() for t in [o] + [x.grad for x in xs]]
    # EP all-to-all: rank r sends rows tagged (r, dest) to each destination, uneven splits
    send = [2 + rank + d for d in range(world)]
    recv = [2 + s + rank for s in range(world)]
    x = torch.cat([torch.full((n, 4), 100.0 * rank + d, device=dev) for d, n in enumerate(send)])
    x.requires_grad_()
    y = AllToAll.apply(x, send, recv, dist.group.WORLD)
    (y * (rank + 1)).sum().backward()
    want = torch.cat([torch.full((n, 4), 100.0 * s + rank, device=dev) for s, n in enumerate(recv)])
    want_grad = torch.cat([torch.full((n, 4), d + 1.0, device=dev) for d, n in enumerate(send)])
    return ring, (y - want).abs().max().item(), (x.grad - want_grad).abs().max().item()


def section_multirank(ck: Check, out: dict):
    from dist_utils import run_distributed

    from bumblebee.primitives.attention.sdpa import sdpa_varlen
    from bumblebee.primitives.cp.zigzag import shard_sequence
    from bumblebee.primitives.packed import doc_layout

    world = 2
    rows = doc_rows(ck)
    _, N, K, D = attn_shapes(ck)[0]
    if ck.cuda:
        # NCCL refuses two ranks on one device, and gloo takes no CUDA tensors in all_to_all or
        # point-to-point calls; staging every exchange through host memory would test a path no
        # run takes. The ring and the all-to-all run across ranks in the suite (emulated CUDA).
        out["cases"].append(
            {
                "case": f"cp ring + ep all-to-all, {world} ranks on one device",
                "status": "skipped: one device cannot hold two NCCL ranks, and gloo takes no "
                "CUDA tensors in all_to_all / send / recv",
            }
        )
        return None

    def run():
        per_rank = run_distributed(
            _multirank, world, (rows, N, K, D), timeout=min(120.0, max(30.0, ck.left()))
        )
        dev = ck.device
        pos = packed_positions(rows, dev)
        B, T = pos.shape
        g = torch.Generator(device=dev).manual_seed(11)
        q, k, v, do = (
            torch.randn(B, h, T, D, device=dev, generator=g).bfloat16() for h in (N, K, K, N)
        )
        xs = [x.requires_grad_() for x in (q, k, v)]
        with ck.emulated():  # one rank: the varlen core on the whole sequence
            o = sdpa_varlen(*xs, doc_layout(pos), D**-0.5)
            o.backward(do)
        one = [o.detach()] + [x.grad for x in xs]
        tensors = []
        for r, (ring, _, _) in enumerate(per_rank):
            for n, a, b in zip(("o", "dq", "dk", "dv"), ring, one):
                b_r = shard_sequence(b.transpose(1, 2), world, r).transpose(1, 2)
                tensors.append(compare(f"rank{r} {n}", a.to(b_r.device), b_r, TOL["bwd"]))
        a2a = [
            {
                "tensor": f"rank{r} all_to_all y/dx",
                "max_abs": max(ey, eg),
                "tol": 0.0,
                "pass": ey == 0 and eg == 0,
            }
            for r, (_, ey, eg) in enumerate(per_rank)
        ]
        return {
            "backend": "gloo, CPU tensors, emulated CUDA",
            "tensors": tensors + a2a,
        }

    ck.case(out, f"cp ring + ep all-to-all, {world} ranks on one device", run)


# ----------------------------------------------------------------------------- output
def markdown(result: dict) -> str:
    env = result.get("env", {})
    lines = [
        f"# gpu_check: {env.get('device', '?')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"triton {env.get('triton')}, fla {env.get('fla')}",
        "",
        f"{env.get('date')}, commit {env.get('commit')}, bf16 8192^3 matmul "
        f"{env.get('matmul_bf16_8192_tflops')} TFLOP/s, wall {result.get('wall_s')} s"
        + (" (smoke)" if env.get("smoke") else ""),
        "",
        "| section | case | status | detail |",
        "| --- | --- | --- | --- |",
    ]
    for sname, sec in result["sections"].items():
        if not sec.get("cases"):
            lines.append(f"| {sname} | | {sec.get('status')} | {sec.get('error', '')} |")
        for c in sec.get("cases", []):
            lines.append(f"| {sname} | {c['case']} | {c.get('status')} | {_detail(c)} |")
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def _detail(c: dict) -> str:
    if "error" in c:
        return c["error"].replace("|", "/")
    parts = []
    if "tensors" in c:
        worst = max(c["tensors"], key=lambda r: r.get("rel_norm", 0) / max(r.get("tol", 1), 1e-30))
        err = _fmt(worst.get("rel_norm", worst.get("max_abs")))
        parts.append(f"{c['shape'] + '; ' if 'shape' in c else ''}worst {worst['tensor']} ")
        parts[-1] += f"rel {err} (tol {_fmt(worst.get('tol'))})"
        failed = [r["tensor"] for r in c["tensors"] if not r["pass"]]
        if failed:
            parts.append("FAILED: " + ", ".join(failed))
    for r in c.get("rows", []):
        if "error" in r:
            parts.append(f"{r['impl']}: {r['error']}")
            continue
        frac = f", {r['of_roofline']:.0%} of roofline" if "of_roofline" in r else ""
        parts.append(
            f"{r['impl']}: {r['ms']} ms, {r['tflops']} TFLOP/s{frac}, peak {r.get('peak_gib')} GiB"
        )
    for r in c.get("runs", []):
        if "step_s" not in r:
            parts.append(f"{r['layers']} layers: {r.get('error', r.get('status'))}")
            continue
        p = r["predicted"]
        mem = ""
        if "peak_reserved_gib" in r:
            mem = f"{r['peak_allocated_gib']:.1f}/{r['peak_reserved_gib']:.1f} GiB alloc/res "
            mem += f"(plan {p['memory_gib']:.1f}), "
        ratio = r["step_ratio_measured_over_predicted"]
        parts.append(
            f"{r['layers']} layers: {r['step_s']:.3f} s/step (plan {p['step_s']:.3f}, "
            f"x{ratio:.2f}), {r['tokens_per_s']:.0f} tok/s, {r['model_tflops']:.1f} TFLOP/s, "
            f"{mem}{r['host_syncs_per_step']} syncs"
        )
    for key in (
        "per_layer_s",
        "per_layer_ratio",
        "per_layer_model_tflops",
        "speedup",
        "linear_over_materialized",
        "kernel",
        "backend",
        "note",
    ):
        if c.get(key) is not None:
            parts.append(f"{key} {_fmt(c[key])}")
    return "; ".join(parts).replace("|", "/")


def main(argv=None) -> int:
    from bumblebee.cli import use_run_allocator

    use_run_allocator()  # before CUDA's first allocation, as every run does
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    ck = Check(args)
    ck.section("env", lambda out: section_env(ck, out))
    ck.section("numerics", lambda out: section_numerics(ck, out))
    ck.section("speed", lambda out: section_speed(ck, out))
    # the cheap multi-rank check first: the slices take what budget is left
    ck.section("multirank", lambda out: section_multirank(ck, out))
    ck.section("slice", lambda out: section_slice(ck, out))
    ck.result["wall_s"] = round(time.monotonic() - ck.t0, 1)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(ck.result, f, indent=1, default=str)
    md = markdown(ck.result)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
