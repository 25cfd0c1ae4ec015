"""The table and verdict of ``bumblebee pair``: rows checked against a tolerance, printed
fixed-width (``command.py`` builds the two configs, ``run.py`` runs them and makes rows)."""

from __future__ import annotations

import math


def check(rows: list[dict], rtol: float) -> list[str]:
    """Mark every checked row ok / not ok against ``rtol``; returns the failures as text."""
    failures = []
    for r in rows:
        if not r.get("checked"):
            continue
        rel = r["rel"]
        r["ok"] = rel is not None and not math.isnan(rel) and rel <= rtol
        if not r["ok"]:
            failures.append(f"step {r['step']} {r['quantity']}: rel {rel:.3g} > {rtol:g}")
    return failures


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_rows(rows: list[dict], a: str, b: str, header: bool) -> str:
    """Fixed-width table lines; tensor rows show max|x| in the a / b columns."""
    w = max(14, len(a) + 3, len(b) + 3)
    cols = (
        f"{'step':>4}  {'quantity':<18} {'a: ' + a:>{w}} {'b: ' + b:>{w}} {'b/a':>7} {'max|a-b|':>10} "
        f"{'rel':>9}  {'bits':<9} check"
    )
    lines = [cols] if header else []
    for r in rows:
        fmt = {"tensor": ".4g", "scalar": ".7g", "memory": ".2f", "time": ".3f"}[r["kind"]]
        check_txt = "" if not r.get("checked") else ("ok" if r.get("ok") else "FAIL")
        bits = (
            "" if r.get("identical") is None else ("identical" if r["identical"] else "different")
        )
        step = "end" if r["step"] is None else str(r["step"])
        lines.append(
            f"{step:>4}  {r['quantity']:<18} {_num(r['a'], fmt):>{w}} {_num(r['b'], fmt):>{w}} "
            f"{_num(r['ratio'], '.3f'):>7} {_num(r['max_abs'], '.2e'):>10} {_num(r['rel'], '.2e'):>9}  "
            f"{bits:<9} {check_txt}".rstrip()
        )
    return "\n".join(lines)


def summarize(result: dict) -> str:
    if result["passed"]:
        return (
            f"pass: every compared difference within the {result['slot']} tolerance for {result['dtype']} "
            f"(rel <= {result['tolerance']:g})"
        )
    return (
        f"FAIL: {len(result['failures'])} difference(s) above rel {result['tolerance']:g}: "
        + "; ".join(result["failures"][:5])
    )
