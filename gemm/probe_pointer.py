"""GPU probe for triton_impl.TMA_MIN_VOLUME: the pointer kernel against the TMA kernel at medium
and decode sizes, bf16.

Per case (1024^3, 1536^3, 2048^3 NN; m x 4096 x 4096 NT, x @ W.T, for m = 1, 16, 64, 128; and
128 x 4096 x 11008 NT, the measured tie above TMA_MIN_VOLUME): the path choose_path takes; for
gemm as chosen, for each kernel forced ("pointer": TMA_MIN_VOLUME infinite, "tma": 0; the plan,
split k included, is the same) and for cuBLAS (torch.addmm): the wall time of a call (300
back-to-back calls, the median of 3 interleaved runs), do_bench (L2 flushed, median) and the GPU
time of a call replayed from a CUDA graph of 10 calls; each kernel's result against test.py's
bound around the float64 stand-in, and whether pointer and TMA give the same bits (same tiles
and order of k, but wgmma's order inside a step is not promised). Then the tests of the rule,
in what time is left of about 60 s. Run from gemm/: python probe_pointer.py (writes
$OUT/probe_pointer.json when OUT is set).
"""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import triton_impl  # noqa: E402

# test.py by its path: `import test` could find Python's own test package.
spec = importlib.util.spec_from_file_location("gemm_test", HERE / "test.py")
gemm_test = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gemm_test)

CASES = [(1024, 1024, 1024, "NN"), (1536, 1536, 1536, "NN"), (2048, 2048, 2048, "NN")]
CASES += [(m, 4096, 4096, "NT") for m in (1, 16, 64, 128)] + [(128, 4096, 11008, "NT")]
# The volume each call runs under: the real rule, or one kernel forced.
VOLUMES = {"chosen": triton_impl.TMA_MIN_VOLUME, "pointer": float("inf"), "tma": 0}
ALPHA, BETA = 1.0, 0.5
TESTS = "tma_min_volume or decode_against or triton_paths or direct_launch or split_k"
BUDGET_S = 60


def wall_us(calls, count=300):
    """{name: host wall time of one call}, `count` calls back to back, the median of 3 runs,
    interleaved: every call's run r before any call's run r + 1."""
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    runs = {name: [] for name in calls}
    for _ in range(3):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(count):
                call()
            torch.cuda.synchronize()
            runs[name].append((time.perf_counter() - start) / count * 1e6)
    return {name: round(statistics.median(times), 2) for name, times in runs.items()}


def graph_us(call, calls=10):
    """The GPU time of one call: `calls` calls captured in a CUDA graph, the replay timed."""
    call()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    return round(triton.testing.do_bench(graph.replay) * 1e3 / calls, 2)


def gemm_under(volume, A, B, C):
    """gemm on C in place with TMA_MIN_VOLUME = volume (set at each call: the calls interleave)."""

    def call():
        triton_impl.TMA_MIN_VOLUME = volume
        triton_impl.gemm(ALPHA, A, B, BETA, C)

    return call


def probe_case(m, n, k, layout):
    A, B, C = gemm_test.operands(m, n, k, torch.bfloat16, layout)
    config = triton_impl.configuration(m, n, k, torch.bfloat16)
    row = {"shape": [m, n, k], "layout": layout, "chosen": triton_impl.choose_path(A, B, True),
           "tile": [config["BLOCK_M"], config["BLOCK_N"]], "splits": config["SPLITS"]}  # fmt: skip
    exact = gemm_test.float64_gemm(ALPHA, A, B, BETA, C)
    bound = gemm_test.error_bound(
        "triton", ALPHA, A, B, BETA, C, exact, gemm_test.STAND_IN_ERROR(k)
    )
    results = {}
    for name in ("pointer", "tma"):
        results[name] = C.clone()
        gemm_under(VOLUMES[name], A, B, results[name])()
        try:
            gemm_test.assert_within_bound(results[name], exact, bound, name)
            row[f"{name} within bound"] = True
        except AssertionError as error:
            row[f"{name} within bound"] = str(error)[-300:]
    row["same bits"] = torch.equal(
        results["pointer"].view(torch.int16), results["tma"].view(torch.int16)
    )
    calls = {name: gemm_under(volume, A, B, C) for name, volume in VOLUMES.items()}
    calls["cublas"] = lambda: torch.addmm(C, A, B, beta=BETA, alpha=ALPHA, out=C)
    row.update({f"{name} wall": us for name, us in wall_us(calls).items()})
    for name, call in calls.items():
        row[f"{name} bench"] = round(triton.testing.do_bench(call) * 1e3, 2)
        row[f"{name} graph"] = graph_us(call)
    triton_impl.TMA_MIN_VOLUME = VOLUMES["chosen"]
    return row


def run_tests(budget_s):
    """The tests of the rule and of both kernels' split and graph paths, within budget_s."""
    command = [sys.executable, "-m", "pytest", "test.py", "-v", "-p", "no:cacheprovider"]
    command += ["-k", TESTS]
    try:
        done = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired as timeout:
        output = timeout.stdout or b""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        return {"rc": "timeout", "tail": output[-2500:]}
    return {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-2500:]}


def main():
    started = time.perf_counter()
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
           "torch": torch.__version__, "TMA_MIN_VOLUME": VOLUMES["chosen"]}  # fmt: skip
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    out["floor: torch copy_ wall"] = wall_us({"copy": lambda: y.copy_(x)})["copy"]
    print(json.dumps(out), flush=True)
    rows = []
    for case in CASES:
        try:
            rows.append(probe_case(*case))
        except Exception:
            triton_impl.TMA_MIN_VOLUME = VOLUMES["chosen"]
            rows.append({"case": list(case), "error": traceback.format_exc()[-1500:]})
        print(json.dumps(rows[-1]), flush=True)
    out["rows"] = rows
    out["tests"] = run_tests(max(15, BUDGET_S - (time.perf_counter() - started)))
    print(out["tests"]["tail"], flush=True)
    out["seconds"] = round(time.perf_counter() - started, 1)
    print("seconds", out["seconds"])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_pointer.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
