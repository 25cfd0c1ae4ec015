"""What a dry run returns (``dryrun.py``): each memory term measured beside the analytic model's,
per moment, with the notes and the collectives the rank made."""

from __future__ import annotations

from dataclasses import dataclass, field

TERMS = ("saved_inputs", "live_layer", "moe_buffers", "loss", "optim_temp")


@dataclass
class DryRunResult:
    stage: int
    layout: str  # the executed layout
    skew: float
    terms: dict[str, dict[str, tuple[float, float]]]  # moment -> term -> (measured GB, analytic GB)
    static: tuple[
        float, float
    ]  # (measured, analytic) GB: bf16 params + grads, fp32 master + moments
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    collectives: dict[str, int] = field(default_factory=dict)  # c10d op -> calls made by the rank

    def worst(self) -> float:
        """Largest relative gap: of a whole moment's dynamic bytes, and of each term that is at least
        10% of its sub-moment ("forward:mixer", "backward:moe", ...: the same code running in both)."""
        gaps = []
        for moment, terms in self.terms.items():
            if ":" not in moment:
                m, a = (sum(v[i] for v in terms.values()) for i in (0, 1))
                gaps.append(abs(m / a - 1) if a else 0.0)
                continue
            dyn = sum(a for _, a in terms.values())
            gaps += [abs(m / a - 1) for k, (m, a) in terms.items() if a > 0.10 * dyn]
        return max(gaps, default=0.0)

    def summary(self) -> str:
        parts = []
        for moment, terms in self.terms.items():
            parts.append(
                f"{moment}: "
                + ", ".join(f"{k} {m:.2f}/{a:.2f}" for k, (m, a) in terms.items() if m or a)
            )
        return (
            f"dry run (stage {self.stage} of {self.layout}, one rank, fake tensors + fake process group, "
            f"routing skew {self.skew:g}, {self.seconds:.0f} s), GB measured/analytic: static "
            f"{self.static[0]:.2f}/{self.static[1]:.2f}; "
            + "; ".join(parts)
            + "; "
            + "; ".join(self.notes)
        )

    def table(self) -> str:
        """The result for a terminal: one row per moment, one column per term, ``measured/analytic``
        GB in each cell ('-' where both are zero), then the notes."""
        cols: list[str] = []
        for terms in self.terms.values():
            cols += [k for k, (m, a) in terms.items() if (m or a) and k not in cols]
        rows = [["GB measured/analytic", *cols, "total"]]
        rows.append(
            [
                "static (params, grads, optimizer)",
                *["" for _ in cols],
                f"{self.static[0]:.2f}/{self.static[1]:.2f}",
            ]
        )
        for moment, terms in self.terms.items():
            cells = [
                f"{terms[k][0]:.2f}/{terms[k][1]:.2f}" if k in terms and any(terms[k]) else "-"
                for k in cols
            ]
            m, a = (sum(v[i] for v in terms.values()) for i in (0, 1))
            rows.append([moment, *cells, f"{m:.2f}/{a:.2f}"])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            f"dry run: stage {self.stage} of {self.layout}, one rank, fake tensors + fake process group, "
            f"routing skew {self.skew:g}, {self.seconds:.0f} s"
        ]
        lines += [
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
            for r in rows
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {
            "stage": self.stage,
            "layout": self.layout,
            "skew": self.skew,
            "seconds": round(self.seconds, 1),
            "collectives": self.collectives,
            "static_gb": [round(v, 3) for v in self.static],
            "notes": self.notes,
            "terms_gb": {
                mo: {k: [round(m, 3), round(a, 3)] for k, (m, a) in t.items()}
                for mo, t in self.terms.items()
            },
        }
