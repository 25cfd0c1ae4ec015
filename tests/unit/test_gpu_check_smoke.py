"""``benchmarks/gpu_check.py --smoke``: the GPU check's own code on CPU at tiny shapes, so that it
never rots between GPU runs. Every numerics case runs its CUDA path inside ``emulate_cuda()``
(kernels replaced by their references) against the fp32 reference and must pass its stated
tolerance; the GPU-only speed cases say "skipped: no CUDA"; the slice runs the real Trainer
on the tiny presets beside the planner; two gloo ranks check the CP ring and the EP all-to-all."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SECTIONS = ("env", "numerics", "speed", "multirank", "slice")


def test_gpu_check_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--smoke"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| section | case | status | detail |" in table
    secs = result["sections"]
    assert tuple(secs) == SECTIONS
    assert result["env"]["torch"] and result["env"]["smoke"] is True
    # what a real run uses, and what the planner's attention efficiency follows
    assert result["env"]["alloc_conf"] == "expandable_segments:True"
    assert result["env"]["flash_impl"] in ("FA2", "FA3")
    assert result["env"]["triton_compile"] == "skipped: no CUDA"
    assert result["wall_s"] < result["env"]["budget_s"]

    numerics = secs["numerics"]
    assert numerics["status"] == "ok", numerics
    assert len(numerics["cases"]) == 11
    for case in numerics["cases"]:
        assert case["status"] == "pass", case
        assert case["tensors"], case
        for row in case["tensors"]:
            assert {"max_abs", "max_rel", "rel_norm", "tol", "pass"} <= set(row), row
            assert row["pass"] and row["rel_norm"] <= row["tol"], (case["case"], row)

    assert secs["speed"]["status"] == "skipped: no CUDA"
    assert all(c["status"] == "skipped: no CUDA" for c in secs["speed"]["cases"])

    assert secs["slice"]["status"] == "ok", secs["slice"]
    for case in secs["slice"]["cases"]:
        assert case["status"] == "ok", case
        assert [r["layers"] for r in case["runs"]] == [2, 4]
        for run in case["runs"]:
            assert run["step_s"] > 0 and run["predicted"]["step_s"] > 0
            assert isinstance(run["host_syncs_per_step"], int)
        assert "per_layer_s" in case and "per_layer_predicted_s" in case

    (multi,) = secs["multirank"]["cases"]
    assert multi["status"] == "pass", multi
    assert len(multi["tensors"]) == 2 * 4 + 2  # o, dq, dk, dv per rank; all-to-all per rank


def test_a_case_over_its_time_cap_stops_and_the_next_runs():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import time

    import gpu_check

    ck = gpu_check.Check(
        gpu_check.parse_args(["--smoke", "--out", "unused", "--case-cap-s", "0.5"])
    )
    out = {"cases": []}
    ck.case(out, "slow", lambda: time.sleep(30))
    ck.case(out, "quick", lambda: {"status": "pass"})
    slow, quick = out["cases"]
    assert slow["status"] == "error" and "time cap" in slow["error"], slow
    assert slow["seconds"] < 10
    assert quick["status"] == "pass"
