"""CPU training-step throughput and peak memory: bumblebee against Hugging Face transformers.

One training step = forward + mean next-token cross-entropy + backward + AdamW
step, on the same architecture and the same initial weights: the HF model
(``Qwen3MoeForCausalLM`` or the Qwen3.5 hybrid ``Qwen3_5MoeForCausalLM``) is built
from a small config, saved with ``save_pretrained`` and loaded into bumblebee
with ``bumblebee.from_hf``. Both sides run in one process, in the same dtype;
timed steps alternate between all measured variants so that background load on
a shared machine hits them alike (ratios are robust to it, absolute figures are
not). Reported per variant: median wall-clock tokens/s, median process CPU time
per step, phases, and the peak of live tensor bytes of one extra step
(``perf.memory.MemoryTracker``, the same accounting on both sides).

Equal work: bumblebee's recompute policy defaults to ``none`` here, because HF
keeps all activations; ``--recompute full --hf-checkpointing`` compares both
with activation checkpointing. Both sides step ``torch.optim.AdamW(fused=True)``:
bumblebee's trainer default (``train.adamw``) and the default of transformers'
``Trainer`` on torch >= 2.8 (``optim = "adamw_torch_fused"``). bumblebee variants
(``--variants``, each one measured side by side with the others in the same run):

- ``base``: the model as the trainer runs it (fused AdamW, no memory tracker);
- ``loop``: ``base`` with AdamW's one-tensor-at-a-time implementation (torch's
  CPU default, and bumblebee's before fused became its default);
- ``tracker``: ``base`` with the step inside a ``MemoryTracker`` (what the
  trainer's optional ``train.track_memory`` costs on CPU);
- ``ce``: ``base`` with the materialized cross-entropy (``loss = ce``), the
  same loss work as transformers' side (``linear_ce`` recomputes the logits
  tiles in backward instead of keeping ``[tokens, vocab]`` logits).

``--seqs 2048 8192 32768`` runs the cost curve instead: for each length, fresh
models, bumblebee ``base`` and the first ``--hf-experts`` entry, tokens/s and
peak memory; a side that fails (out of memory, ``--mem-limit-gb``) is printed
as failed at that length and the curve goes on. Prints figures only; never
passes or fails on a timing.

Examples (the issue's setting: sequence 4096, fp32):

    python benchmarks/cpu_throughput.py --family qwen3_moe --seq 4096 --variants base,loop,ce
    python benchmarks/cpu_throughput.py --family qwen3_5_moe --seq 4096
    python benchmarks/cpu_throughput.py --seqs 2048 8192 32768 --steps 1 --mem-limit-gb 12
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import tempfile
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VARIANTS = ("base", "loop", "tracker", "ce")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--family", choices=("qwen3_moe", "qwen3_5_moe"), default="qwen3_moe")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument(
        "--seqs", type=int, nargs="+", default=None, help="cost curve over these lengths"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="parameter and compute dtype"
    )
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument(
        "--layers", type=int, default=4, help="decoder layers (qwen3_5_moe: 3 linear : 1 full)"
    )
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument(
        "--moe-ffn", type=int, default=192, help="moe_intermediate_size (and the shared expert's)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (median reported)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)"
    )
    p.add_argument(
        "--variants",
        default="base",
        help="comma list of bumblebee variants: base, loop, tracker, ce",
    )
    p.add_argument(
        "--hf-experts",
        default="grouped_mm",
        help="comma list of HF experts_implementation values (eager, grouped_mm, batched_mm)",
    )
    p.add_argument(
        "--hf-checkpointing",
        action="store_true",
        help="HF gradient checkpointing (pair with --recompute full)",
    )
    p.add_argument(
        "--recompute", default="none", help="bumblebee recompute primitive (none = HF's work)"
    )
    p.add_argument(
        "--attention", default=None, help="bumblebee attention primitive (default: config default)"
    )
    p.add_argument(
        "--experts-impl", default=None, help="bumblebee experts primitive (default: config default)"
    )
    p.add_argument(
        "--loss", default=None, help="bumblebee loss primitive (default: config default)"
    )
    p.add_argument(
        "--mem-limit-gb",
        type=float,
        default=0,
        help="address-space limit, so that running out of memory is an error, not the OOM killer",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="after timing, profile one step of each side and print the top ROWS ops",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def hf_model(args, seq: int):
    import transformers

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_ffn,
        max_position_embeddings=max(seq, 4096),
        tie_word_embeddings=False,
    )
    if args.family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common, intermediate_size=3 * args.hidden, norm_topk_prob=True, rope_theta=1e6
        )
        return transformers.Qwen3MoeForCausalLM(cfg)
    kinds = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(args.layers)]
    cfg = transformers.Qwen3_5MoeTextConfig(
        **common,
        layer_types=kinds,
        shared_expert_intermediate_size=args.moe_ffn,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim,
        linear_num_key_heads=args.kv_heads,
        linear_num_value_heads=args.heads // 2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    return transformers.Qwen3_5MoeForCausalLM(cfg)


def bumblebee_primitives(args, variant: str = "base"):
    from bumblebee.config import PrimitivesConfig

    prims = PrimitivesConfig(recompute=args.recompute)
    for field, value in (
        ("attention", args.attention),
        ("experts", args.experts_impl),
        ("loss", args.loss),
    ):
        if value is not None:
            setattr(prims, field, value)
    if variant == "ce":
        prims.loss = "ce"
    return prims


class Stepper:
    """One model, its optimizer, and timed training steps: wall seconds per phase
    (forward, backward, optimizer) and process CPU seconds per step."""

    def __init__(self, name, model, loss_fn, *, fused=True, tracker=False):
        self.name, self.model, self.loss_fn, self.tracker = name, model, loss_fn, tracker
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused, foreach=False
        )
        self.phases: list[tuple[float, float, float]] = []
        self.cpu: list[float] = []
        self.peak = None
        self.model.train()

    @property
    def wall(self) -> float:
        return statistics.median(sum(p) for p in self.phases)

    def step(self, input_ids, labels, timed: bool) -> float:
        from bumblebee.perf.memory import MemoryTracker

        scope = (
            MemoryTracker("cpu", self.model, self.opt) if self.tracker else contextlib.nullcontext()
        )
        c0, t0 = time.process_time(), time.perf_counter()
        with scope:
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

    def measure_peak(self, input_ids, labels) -> None:
        from bumblebee.perf.memory import MemoryTracker

        with MemoryTracker("cpu", self.model, self.opt) as mem:
            self.step(input_ids, labels, timed=False)
        self.peak = mem.peak_bytes

    def line(self, tokens: int, ref: Stepper | None = None) -> str:
        cpu = statistics.median(self.cpu)
        out = (
            f"  {self.name:<28} {tokens / self.wall:9.1f} tokens/s  {self.wall:7.3f} s/step  cpu {cpu:7.3f} "
            f"s/step  peak {self.peak / 2**20 if self.peak else float('nan'):7.0f} MiB"
        )
        if ref is not None:
            out += (
                f"   bumblebee/this: tokens/s {self.wall / ref.wall:.2f}x, cpu time "
                f"{cpu / statistics.median(ref.cpu):.2f}x"
            )
        return out

    def phase_line(self) -> str:
        fwd, bwd, opt = (statistics.median(p[i] for p in self.phases) for i in range(3))
        return f"  {self.name:<28} forward {fwd:.3f} s, backward {bwd:.3f} s, optimizer {opt:.3f} s"


def hf_loss(model, input_ids, labels):
    # HF shifts labels itself: the unshifted ids give the same targets as bumblebee's shifted labels.
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def bb_loss(model, input_ids, labels):
    return model(input_ids, labels=labels)


def build(args, seq: int, variants: list[str], hf_impls: list[str]):
    """Steppers of every bumblebee variant and HF experts implementation, same initial weights."""
    import bumblebee

    torch.manual_seed(args.seed)
    hf = hf_model(args, seq)
    dtype = DTYPES[args.dtype]
    steppers = []
    with tempfile.TemporaryDirectory() as workdir:
        hf.save_pretrained(workdir)
        for v in variants:
            if v not in VARIANTS:
                raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
            bb = bumblebee.from_hf(workdir, dtype=dtype, prims=bumblebee_primitives(args, v))
            steppers.append(
                Stepper(f"bumblebee[{v}]", bb, bb_loss, fused=v != "loop", tracker=v == "tracker")
            )
    initial = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    for i, impl in enumerate(hf_impls):
        model = hf if i == 0 else hf_model(args, seq)
        model.load_state_dict(initial)
        model = model.to(dtype)
        model.set_experts_implementation(impl)
        if args.hf_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        steppers.append(Stepper(f"transformers[{impl}]", model, hf_loss))
    return steppers


def batch_of(args, seq: int):
    torch.manual_seed(args.seed)
    input_ids = torch.randint(0, args.vocab, (args.batch, seq))
    labels = torch.cat([input_ids[:, 1:], torch.full((args.batch, 1), -100)], dim=1)
    return input_ids, labels


def run(steppers, input_ids, labels, args) -> list:
    """Warm up, time alternately, measure peaks; a stepper that fails is dropped (and reported)."""
    alive = []
    for st in steppers:
        try:
            for _ in range(args.warmup):
                st.step(input_ids, labels, timed=False)
            alive.append(st)
        except (RuntimeError, MemoryError) as e:
            print(
                f"  {st.name}: failed at seq {input_ids.shape[1]}: {str(e).splitlines()[0][:160]}",
                flush=True,
            )
    for _ in range(args.steps):  # alternate so background load hits every variant alike
        for st in list(alive):
            try:
                st.step(input_ids, labels, timed=True)
            except (RuntimeError, MemoryError) as e:
                print(
                    f"  {st.name}: failed at seq {input_ids.shape[1]}: {str(e).splitlines()[0][:160]}"
                )
                alive.remove(st)
    for st in alive:
        try:
            st.measure_peak(input_ids, labels)
        except (RuntimeError, MemoryError) as e:
            print(f"  {st.name}: peak measurement failed: {str(e).splitlines()[0][:160]}")
    return alive


def describe(args, seq: int, bb) -> None:
    a, p = bb.arch, bb.prims
    print(
        f"config: {args.family}, seq {seq} x batch {args.batch}, {args.dtype}, vocab {a.vocab_size}, hidden "
        f"{a.hidden_size}, layers {a.num_hidden_layers}, heads {a.num_attention_heads}/{a.num_key_value_heads} x "
        f"{a.head_dim}, experts {a.num_experts} top-{a.num_experts_per_tok} ffn {a.moe_intermediate_size}; "
        f"{sum(x.numel() for x in bb.parameters()) / 1e6:.1f}M params; {torch.get_num_threads()} threads"
    )
    print(
        f"bumblebee primitives: attention={p.attention} experts={p.experts} loss={p.loss} moe_comm={p.moe_comm} "
        f"recompute={p.recompute}; HF gradient checkpointing: {args.hf_checkpointing}",
        flush=True,
    )


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mem_limit_gb:
        limit = int(args.mem_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    hf_impls = [s.strip() for s in args.hf_experts.split(",") if s.strip()]
    if args.seqs:
        return cost_curve(args, hf_impls[0])
    steppers = build(args, args.seq, variants, hf_impls)
    describe(args, args.seq, steppers[0].model)
    input_ids, labels = batch_of(args, args.seq)
    with torch.no_grad():
        first = [st.loss_fn(st.model.eval(), input_ids, labels).item() for st in steppers]
    print(
        "initial loss: " + "  ".join(f"{st.name} {x:.6f}" for st, x in zip(steppers, first)),
        flush=True,
    )
    alive = run(steppers, input_ids, labels, args)
    tokens = args.batch * args.seq
    ours = [s for s in alive if s.name.startswith("bumblebee")]
    theirs = [s for s in alive if not s.name.startswith("bumblebee")]
    print(
        f"\nmedians over {args.steps} alternating steps per variant (after {args.warmup} warm-up steps):"
    )
    for st in ours:
        print(st.line(tokens, ours[0] if st is not ours[0] else None))
    for st in theirs:
        print(st.line(tokens, ours[0] if ours else None))
    print("phases (median wall):")
    for st in alive:
        print(st.phase_line())
    if args.profile:
        from torch.profiler import profile

        for st in alive:
            with profile(record_shapes=True) as prof:
                st.step(input_ids, labels, timed=False)
            print(f"\nprofile of one {st.name} step (top {args.profile} ops by self CPU time):")
            print(
                prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=args.profile, max_name_column_width=48
                )
            )


def cost_curve(args, hf_impl: str) -> None:
    """Each length's rows are printed as soon as they are measured (a long curve that is stopped
    keeps what it has)."""
    print(f"cost curve ({args.steps} timed steps per length and side, median):")
    print(f"  {'seq':>6}  {'side':<28} {'tokens/s':>9}  {'peak MiB':>8}", flush=True)
    for seq in args.seqs:
        steppers = build(args, seq, ["base"], [hf_impl])
        if seq == args.seqs[0]:
            describe(args, seq, steppers[0].model)
        input_ids, labels = batch_of(args, seq)
        alive = {st.name: st for st in run(steppers, input_ids, labels, args)}
        for st in steppers:
            got = alive.get(st.name)
            tps = f"{seq * args.batch / got.wall:9.1f}" if got else "   failed"
            peak = f"{got.peak / 2**20:8.0f}" if got and got.peak else "       -"
            print(f"  {seq:>6}  {st.name:<28} {tps}  {peak}", flush=True)
        del steppers, alive


if __name__ == "__main__":
    main()
