"""MLA under the CP ring: bytes each rank actually sends per hop, latent ring vs expanded heads,
and a small CPU case timed side by side (with the latent ring's save-vs-recompute choice).

Part 1 (bytes): one MLA layer at a preset's attention dims (default DeepSeek-V3: heads, kv latent,
rope / nope / value dims; the hidden size is shrunk, it does not enter what the ring sends), bf16
autocast as in training, on ``--cp`` gloo ranks, forward + backward. Every tensor handed to
``isend`` by the ring (``dist.P2POp``) is counted; the totals are divided by the hops and by the
rank's tokens. Two designs: ``latent`` (``cp_attention = "ring"``: normalized kv latent + roped rope key
per hop, re-expanded by every rank, ``primitives/cp/ring_latent.py``) and ``expanded`` (the same
layer with ``cp_latents = ""``: per-head K and V through the generic ``ring`` core, v padded to
the qk head dim).

Part 2 (time, memory): a small fp32 MLA attention core at ``--seq`` tokens on the same ranks, forward
+ backward of the ring only (q, latents and kv_b_proj's weight in, output out): the latent ring
re-expanding each block in backward (what runs), the latent ring keeping every hop's expansion
(``save_expanded``), and the expanded-head ring fed K/V expanded beforehand (its expansion and that
GEMM's backward timed in too). Peak is the live-tensor peak inside the call (inputs excluded).

    python benchmarks/mla_cp_bytes.py [--preset deepseek-v3-671b|kimi-k2] [--cp 2] [--seq 2048]
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bumblebee.models import arch_from_hf_dict
from bumblebee.models.presets import preset
from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.cp.ring import ring_attention
from bumblebee.primitives.cp.ring_latent import latent_ring_attention
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import rope_cos_sin

SMALL = dict(heads=16, kv_lora_rank=128, rope=32, nope=64, v_dim=64)  # part 2's attention dims


class Counter:
    """Counts the bytes of every isend the process issues (forward / backward phases)."""

    def __init__(self):
        self.real, self.phase, self.bytes, self.calls = dist.P2POp, "forward", {}, {}

    def __enter__(self):
        def p2p(op, tensor, peer, group=None, tag=0):
            if op is dist.isend:
                self.bytes[self.phase] = (
                    self.bytes.get(self.phase, 0) + tensor.numel() * tensor.element_size()
                )
                self.calls[self.phase] = self.calls.get(self.phase, 0) + 1
            return self.real(op, tensor, peer, group, tag)

        dist.P2POp = p2p
        return self

    def __exit__(self, *exc):
        dist.P2POp = self.real


def bytes_per_hop(a, cp: int, tokens: int) -> dict:
    r = dist.get_rank()
    pos = shard_sequence(torch.arange(tokens)[None], cp, r)
    layout = build_cp_shards(pos, dist.group.WORLD)
    cos, sin = rope_cos_sin(
        pos, a.qk_rope_head_dim, a.rope_theta, torch.bfloat16
    )  # as under autocast
    out = {}
    for design, attend, latents in (("latent", None, "ring"), ("expanded", ring_attention, "")):
        torch.manual_seed(0)
        layer = MultiHeadLatentAttention(
            256,
            a.num_attention_heads,
            q_lora_rank=64,
            kv_lora_rank=a.kv_lora_rank,
            qk_nope_head_dim=a.qk_nope_head_dim,
            qk_rope_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            eps=1e-6,
            scale=a.head_dim**-0.5,
            rope_interleave=False,
            attend=attend,
            recompute=NoRecompute(),
            cp_latents=latents,
        )
        x = torch.randn(1, tokens // cp, 256, requires_grad=True)
        with Counter() as count:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x, cos, sin, layout)
            count.phase = "backward"
            y.float().sum().backward()
        out[design] = (count.bytes, count.calls)
    return out


def core_case(design: str, q, lat, w, layout, scale, dv):
    if design == "expanded":  # per-head K / V expanded from the latents first (the layer's path)
        B, N, L, D = q.shape
        C = w.shape[1]
        kv = F.linear(lat[..., :C], w).view(B, L, N, -1).transpose(1, 2)
        k = torch.cat(
            (kv[..., : D - (lat.shape[-1] - C)], lat[:, None, :, C:].expand(B, N, L, -1)), dim=-1
        )
        v = F.pad(kv[..., D - (lat.shape[-1] - C) :], (0, D - dv))
        return ring_attention(q, k, v, layout, scale)[..., :dv]
    return latent_ring_attention(
        q, lat, w, layout, scale, dv, save_expanded=design == "latent, kept"
    )


def timed(design, seq: int, cp: int) -> tuple[float, int]:
    r, s = dist.get_rank(), SMALL
    g = torch.Generator().manual_seed(0)
    L, D = seq // cp, s["nope"] + s["rope"]
    q = torch.randn(1, s["heads"], L, D, generator=g)
    lat = torch.randn(1, L, s["kv_lora_rank"] + s["rope"], generator=g)
    w = torch.randn(s["heads"] * (s["nope"] + s["v_dim"]), s["kv_lora_rank"], generator=g) * 0.05
    pos = shard_sequence((torch.arange(seq) % 1024)[None], cp, r)  # packed 1K-token documents
    layout = build_cp_shards(pos, dist.group.WORLD)
    best, peak = float("inf"), 0
    for i in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, lat, w)]
        dist.barrier()
        start = time.perf_counter()
        with MemoryTracker("cpu") as mem:
            o = core_case(design, *leaves, layout, D**-0.5, s["v_dim"])
            o.backward(torch.ones_like(o))
        if i:  # best of 2 after a warm-up
            best, peak = min(best, time.perf_counter() - start), max(peak, mem.peak_bytes)
    return best, peak


DESIGNS = ("latent", "latent, kept", "expanded")


def worker(preset_name: str, cp: int, seq: int):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    a = arch_from_hf_dict(preset("deepseek_v3", preset_name))
    result = {
        "bytes": bytes_per_hop(a, cp, 8 * cp),
        "time": {d: timed(d, seq, cp) for d in DESIGNS},
    }
    dist.destroy_process_group()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="deepseek-v3-671b")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=args.cp,
        run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        start_method="spawn",
    )
    res = elastic_launch(cfg, worker)(args.preset, args.cp, args.seq)[0]
    a = arch_from_hf_dict(preset("deepseek_v3", args.preset))
    tokens, hops = 8, args.cp - 1
    print(
        f"{args.preset}: heads {a.num_attention_heads}, qk head dim {a.head_dim}, v head dim {a.v_head_dim}, "
        f"kv latent {a.kv_lora_rank} + rope {a.qk_rope_head_dim}; cp {args.cp}, bf16 autocast, rank 0's isends"
    )
    per_token = {}
    for design, (nbytes, calls) in res["bytes"].items():
        fwd, bwd = nbytes["forward"] / (tokens * hops), nbytes["backward"] / tokens
        per_token[design] = fwd, bwd
        print(
            f"  {design:<9} forward {fwd / 1024:7.2f} KiB per token and hop ({calls['forward']} isends); "
            f"backward {bwd / 1024:7.2f} KiB per token over its {hops + 1} hops ({calls['backward']} isends)"
        )
    (lf, lb), (ef, eb) = per_token["latent"], per_token["expanded"]
    print(
        f"  expanded / latent: forward {ef / lf:.0f}x, backward {eb / lb:.0f}x (on this CPU path the "
        f"expanded ring's backward sends K / V in fp32; its CUDA path sends them in bf16)"
    )
    expand = 2 * a.kv_lora_rank * a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
    print(
        f"  re-expanding one received latent token (kv_b_proj): {expand / 1e6:.1f} MFLOP forward, "
        f"3x that in backward (re-expand, d latent, d W)"
    )
    s = SMALL
    print(
        f"\nsmall fp32 core, {args.seq} tokens, cp {args.cp} (heads {s['heads']}, latent {s['kv_lora_rank']}, "
        f"rope {s['rope']}, nope {s['nope']}, v {s['v_dim']}): forward + backward, rank 0, best of 2"
    )
    for design, (t, peak) in res["time"].items():
        print(f"  {design:<13} {t:7.3f} s   peak {peak / 2**20:7.1f} MiB")


if __name__ == "__main__":
    main()
