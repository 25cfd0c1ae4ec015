"""CPU training-step throughput: bumblebee's Qwen3-MoE against Hugging Face transformers.

One training step = forward + mean next-token cross-entropy + backward + AdamW
step (``torch.optim.AdamW``, the same optimizer on both sides), on the same
architecture and the same initial weights: the HF model is built from a
``Qwen3MoeConfig``, saved with ``save_pretrained`` and loaded into bumblebee
with ``bumblebee.from_hf``. Both sides run in one process, in the same dtype;
timed steps alternate between the two models so that background load on a
shared machine hits both alike. Reported: median wall-clock tokens/s of each
side and their ratio, plus the median process CPU time per step (less sensitive
to other processes competing for the cores). The script prints figures only; it
never passes or fails on a timing (the project's testing rule).

HF's expert FFN is selectable (``experts_implementation``): ``eager`` (a Python
loop over experts with ``index_add_``), ``grouped_mm`` (``torch._grouped_mm``,
HF's default) and ``batched_mm`` (gathers one weight matrix *per routed token*:
[T*K, 2F, H] plus [T*K, H, F] temporaries, so it is skipped above
``--batched-mm-max-gb``). ``--hf-experts`` takes a comma list; every entry is
measured against the same bumblebee run.

Default shapes scale Qwen3-30B-A3B down: expert FFN = 0.375 x hidden, GQA 4:1,
16 experts top-2, no dense layers.

Example (the issue's setting: sequence 4096, fp32):

    python benchmarks/cpu_throughput.py --seq 4096 --hf-experts grouped_mm,eager
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter and compute dtype")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-ffn", type=int, default=192, help="moe_intermediate_size")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    p.add_argument("--steps", type=int, default=5, help="timed steps per model and HF variant (median reported)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--hf-experts", default="grouped_mm,eager",
                   help="comma list of HF experts_implementation values (eager, grouped_mm, batched_mm)")
    p.add_argument("--batched-mm-max-gb", type=float, default=4.0,
                   help="skip HF batched_mm when its per-layer gathered weights exceed this many GB")
    p.add_argument("--attention", default=None, help="bumblebee attention primitive (default: config default)")
    p.add_argument("--experts-impl", default=None, help="bumblebee experts primitive (default: config default)")
    p.add_argument("--loss", default=None, help="bumblebee loss primitive (default: config default)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after timing, profile one step of each side and print the top ROWS ops")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def hf_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        moe_intermediate_size=args.moe_ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=max(args.seq, 4096), rope_theta=1e6, tie_word_embeddings=False)


def bumblebee_primitives(args):
    from bumblebee.config import PrimitivesConfig

    prims = PrimitivesConfig()
    for field, value in (("attention", args.attention), ("experts", args.experts_impl), ("loss", args.loss)):
        if value is not None:
            setattr(prims, field, value)
    return prims


def build_models(args, workdir: str):
    """The HF model (saved to ``workdir``) and bumblebee's model loaded from it."""
    from transformers import Qwen3MoeForCausalLM

    import bumblebee

    torch.manual_seed(args.seed)
    hf = Qwen3MoeForCausalLM(hf_config(args))
    hf.save_pretrained(workdir)
    dtype = DTYPES[args.dtype]
    bb = bumblebee.from_hf(workdir, dtype=dtype, prims=bumblebee_primitives(args))
    return hf.to(dtype), bb


def hf_loss(model, input_ids, labels):
    # HF shifts labels itself: the unshifted ids give the same targets as bumblebee's shifted labels.
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def bb_loss(model, input_ids, labels):
    return model(input_ids, labels=labels)


class Stepper:
    """One model, its optimizer, and timed training steps: wall seconds per phase
    (forward, backward, optimizer) and process CPU seconds per step."""

    def __init__(self, name, model, loss_fn):
        self.name, self.model, self.loss_fn = name, model, loss_fn
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        self.phases: list[tuple[float, float, float]] = []
        self.cpu: list[float] = []
        self.model.train()

    @property
    def wall(self) -> list[float]:
        return [sum(p) for p in self.phases]

    def step(self, input_ids, labels, timed: bool) -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        loss = self.loss_fn(self.model, input_ids, labels)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if timed:
            self.phases.append((t1 - t0, t2 - t1, t3 - t2))
            self.cpu.append(time.process_time() - c0)
        return loss.item()

    def phase_medians(self) -> str:
        fwd, bwd, opt = (statistics.median(p[i] for p in self.phases) for i in range(3))
        return f"forward {fwd:.3f} s, backward {bwd:.3f} s, optimizer {opt:.3f} s"


def profile_step(stepper, input_ids, labels, rows: int) -> None:
    """One step under torch.profiler: the ops with the most self CPU time."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        stepper.step(input_ids, labels, timed=False)
    print(f"\nprofile of one {stepper.name} step (top {rows} ops by self CPU time):")
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48, max_shapes_column_width=60))


def batched_mm_gb(args) -> float:
    """Bytes of the per-token weight gathers HF's batched_mm makes in one MoE layer."""
    rows = args.batch * args.seq * args.top_k
    itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    return rows * 3 * args.moe_ffn * args.hidden * itemsize / 2**30


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = torch.cat([input_ids[:, 1:], torch.full((args.batch, 1), -100)], dim=1)
    tokens = args.batch * args.seq

    with tempfile.TemporaryDirectory() as workdir:
        hf, bb = build_models(args, workdir)
    arch, prims = bb.arch, bb.prims
    print(f"config: seq {args.seq} x batch {args.batch}, {args.dtype}, vocab {arch.vocab_size}, hidden "
          f"{arch.hidden_size}, layers {arch.num_hidden_layers}, heads {arch.num_attention_heads}/"
          f"{arch.num_key_value_heads} x {arch.head_dim}, experts {arch.num_experts} top-"
          f"{arch.num_experts_per_tok} ffn {arch.moe_intermediate_size}; "
          f"{arch.num_params()['total'] / 1e6:.1f}M params; {torch.get_num_threads()} threads")
    print(f"bumblebee primitives: attention={prims.attention} experts={prims.experts} loss={prims.loss} "
          f"moe_comm={prims.moe_comm} recompute={prims.recompute}; transformers attention="
          f"{hf.config._attn_implementation}")
    hf_initial = {k: v.detach().clone() for k, v in hf.state_dict().items()}

    with torch.no_grad():
        first_hf = hf_loss(hf.eval(), input_ids, labels).item()
        first_bb = bb_loss(bb.eval(), input_ids, labels).item()
    print(f"initial loss: bumblebee {first_bb:.6f}  transformers {first_hf:.6f}  "
          f"|diff| {abs(first_bb - first_hf):.2e}", flush=True)

    bumble = Stepper("bumblebee", bb, bb_loss)
    for _ in range(args.warmup):
        bumble.step(input_ids, labels, timed=False)
    results = {}
    for impl in [s.strip() for s in args.hf_experts.split(",") if s.strip()]:
        if impl == "batched_mm" and batched_mm_gb(args) > args.batched_mm_max_gb:
            print(f"skipping transformers[batched_mm]: {batched_mm_gb(args):.1f} GB of gathered expert weights "
                  f"per layer > --batched-mm-max-gb {args.batched_mm_max_gb}")
            continue
        hf.load_state_dict(hf_initial)  # every HF variant starts from the same weights
        hf.set_experts_implementation(impl)
        other = Stepper(f"transformers[{impl}]", hf, hf_loss)
        for _ in range(args.warmup):
            other.step(input_ids, labels, timed=False)
        for _ in range(args.steps):  # alternate so background load hits both sides alike
            bumble.step(input_ids, labels, timed=True)
            other.step(input_ids, labels, timed=True)
        results[impl] = other
        print(f"  measured transformers[{impl}]", flush=True)
        if args.profile:
            profile_step(other, input_ids, labels, args.profile)
        del other.opt
    if args.profile:
        profile_step(bumble, input_ids, labels, args.profile)

    def line(name, st, ratio=""):
        wall, cpu = statistics.median(st.wall), statistics.median(st.cpu)
        return (f"  {name:<26} {wall:8.3f} s/step  {tokens / wall:9.1f} tokens/s   "
                f"cpu {cpu:8.3f} s/step{ratio}")

    print(f"\nmedians over {len(bumble.wall)} bumblebee / {args.steps} transformers steps each "
          f"(after {args.warmup} warm-up steps):")
    print(line("bumblebee", bumble))
    bb_wall, bb_cpu = statistics.median(bumble.wall), statistics.median(bumble.cpu)
    for impl, st in results.items():
        wall, cpu = statistics.median(st.wall), statistics.median(st.cpu)
        print(line(f"transformers[{impl}]", st, f"   ratio bumblebee/transformers: tokens/s {wall / bb_wall:.2f}x, "
                                                  f"cpu time {cpu / bb_cpu:.2f}x"))
    print("phases (median wall):")
    for st in [bumble, *results.values()]:
        print(f"  {st.name:<26} {st.phase_medians()}")
    if results:
        best = min(results, key=lambda k: statistics.median(results[k].wall))
        print(f"ratio vs the fastest transformers option ({best}): "
              f"{statistics.median(results[best].wall) / bb_wall:.2f}x tokens/s (issue goal: >= 3x)")


if __name__ == "__main__":
    main()
