"""GPU probe for softmax: the full test suite, CuTe step 2 (the cluster forward) against torch
and step 1, then bench.py's two large shapes, in one run of under 3 minutes.

    cd transformer/softmax && python probe.py

Prints a summary and writes it to $OUT/softmax_probe.json when OUT is set. Each part is caught
and reported on its own, so a failure in one does not hide the others; the bench part is left
out when the first two ran past BENCH_DEADLINE_S.
"""

import functools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
START = time.time()
TESTS_TIMEOUT_S = 110
BENCH_DEADLINE_S = 125  # the bench's quick shapes take about a minute; the whole probe < 180 s
CLUSTER_SHAPES = [(4096, 65536), (8192, 131072)]


def run_tests():
    """The whole suite, stopped at TESTS_TIMEOUT_S with what it printed so far."""
    start = time.time()
    command = [sys.executable, "test.py", "-q", "-rs", "-s"]
    try:
        done = subprocess.run(command, cwd=HERE, capture_output=True, text=True,
                              timeout=TESTS_TIMEOUT_S)  # fmt: skip
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        parts = (stopped.stdout, stopped.stderr)  # bytes here even with text=True
        rc, output = (
            "timeout",
            "".join(p.decode() if isinstance(p, bytes) else p or "" for p in parts),
        )
    tail = output.strip().splitlines()
    return {"rc": rc, "seconds": round(time.time() - start, 1), "tail": tail[-25:]}


def run_cluster():
    """bf16 forward at CLUSTER_SHAPES: torch.softmax, CuTe step 2 (its cluster) and step 1
    (cute_impl.kernel_plan forced to None): time, GB/s over 2MN bytes, % of copy, and the
    largest difference to torch's float32 softmax and between the two steps."""
    sys.path.insert(0, str(HERE))
    import bench
    import torch

    import cute_impl

    ceiling, choose, rows = bench.copy_ceiling_gbps(), cute_impl.kernel_plan, []
    steps = {"cute.step2": choose, "cute.step1": lambda direction, n, dtype: None}
    for m, n in CLUSTER_SHAPES:
        x = (3 * torch.randn(m, n, device="cuda")).bfloat16()
        expected, outputs = torch.softmax(x.float(), -1), {}
        calls = {"torch": functools.partial(torch.softmax, x, -1)}
        calls.update({step: functools.partial(cute_impl.softmax_forward, x, torch.empty_like(x))
                      for step in steps})  # fmt: skip
        for name, call in calls.items():
            cute_impl.kernel_plan = steps.get(name, choose)
            outputs[name] = call().float()
            ms = bench.median_ms(call)
            gbps = 2 * x.nbytes / ms / 1e6
            error = (outputs[name] - expected).abs().max().item()
            rows.append({"impl": name, "shape": [m, n], "ms": round(ms, 4), "GBps": round(gbps),
                         "pct_of_copy": round(100 * gbps / ceiling, 1),
                         "max_diff_vs_torch_fp32": error})  # fmt: skip
        cute_impl.kernel_plan = choose
        step_diff = (outputs["cute.step2"] - outputs["cute.step1"]).abs().max().item()
        rows.append(
            {"shape": [m, n], "plan": choose("forward", n, x.dtype), "step2_vs_step1": step_diff}
        )
    return rows + [{"copy_GBps": round(ceiling)}]


def run_bench():
    sys.path.insert(0, str(HERE))
    import bench

    results = bench.main(quick=True)
    return [
        {k: row[k] for k in ("impl", "pass", "dtype", "shape", "ms", "pct_of_ceiling", "timing")}
        for row in results["rows"]
    ] + [{"copy_GBps": results["ceilings"]["copy_GBps"]}]


def main():
    summary = {}
    for name, part in (("tests", run_tests), ("cluster", run_cluster), ("bench", run_bench)):
        if name == "bench" and time.time() - START > BENCH_DEADLINE_S:
            summary[name] = {"skipped": f"{time.time() - START:.0f} s in, past BENCH_DEADLINE_S"}
            continue
        try:
            summary[name] = part()
        except Exception:
            summary[name] = {"error": traceback.format_exc()[-3000:]}
    text = json.dumps(summary, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "softmax_probe.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
