"""GPU probe of triton_impl's gemm paths (TMA in four layouts, split k, staged TMA) on the H200.

    cd gemm && python probe_triton.py     # under 4 minutes; $OUT/probe_triton.json if $OUT is set

1. The Triton tests of test.py on the GPU (every selected test, in PARALLEL pytest processes so
   that Triton's compiles overlap; a failure is reported, never fatal), with their summary line.
2. Timings against torch.addmm (cuBLAS), C = 1.0 * A @ B + 0.5 * C in place: the median of
   ROUNDS rounds, ours and cuBLAS alternating with the first one rotating, each a
   triton.testing.do_bench median (L2 flushed before every call). Cases: 8192^3 bf16 and fp16 in
   NN, NT, TN, TT; the 7B projections in NT bf16 (m 4096 and 16384); decode NT bf16, m in
   (1, 16, 64, 128) x (n, k) in ((4096, 4096), (11008, 4096), (4096, 11008)); 4097 x 5121 x 3079
   bf16 NN on the staged path and, forced, on the pointer kernel; float32 with TF32 at 4096^3 in
   NT (K-major operands) and NN (a pass through registers for B), NN also on the pointer
   kernel; and a sweep of the split count and the pipeline depth at two decode shapes, the
   variants the rule did not pick. Each row: our ms, cuBLAS ms, ratio (cuBLAS / ours: above 1
   is faster), the path and the plan.
"""

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

import torch_impl
import triton_impl

HERE = Path(__file__).resolve().parent
START = time.monotonic()
BUDGET_S = 215  # the whole probe after its imports, under the lead's four minutes
PYTEST_S = 105  # the test part's share
PARALLEL = 4
ROUNDS = 3
ALPHA, BETA = 1.0, 0.5  # C stays bounded over the repeated in-place calls
TESTS = (
    "(triton or tma_path or staged or split or aligned_copy or large_tiles or configuration_rule"
    " or grouped_order) and not cute and not triton_ptx"  # triton_ptx: a CPU compile check
)
SUMMARY = re.compile(r"\d+ (passed|failed|skipped|error).* in [\d.]+s")
PROGRESS = re.compile(r"^[.FsEx]+( +\[ *\d+%\])?$")
MARKS = {".": "passed", "F": "failed", "s": "skipped", "E": "errors"}
# n, k of the 7B projections; decode step sizes.
PROJECTIONS = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)]
DECODE_M = [1, 16, 64, 128]
DECODE_NK = [(4096, 4096), (11008, 4096), (4096, 11008)]


def left_s():
    return BUDGET_S - (time.monotonic() - START)


def run_tests():
    """Collect the selected tests, deal them out to PARALLEL pytest processes, wait up to
    PYTEST_S; the counts of each process's summary line, summed, and the failures' ids."""
    base = [sys.executable, "-m", "pytest", "test.py", "-p", "no:cacheprovider", "-k", TESTS]
    collected = subprocess.run(
        [*base, "--collect-only", "-q"], cwd=HERE, capture_output=True, text=True, check=False
    )
    ids = [line for line in collected.stdout.splitlines() if line.startswith("test.py::")]
    if not ids:
        output = collected.stdout[-2000:] + collected.stderr[-2000:]
        return {"error": "nothing collected", "output": output}
    logs = [open(f"/tmp/probe_triton_pytest_{i}.log", "w+") for i in range(PARALLEL)]
    children = [
        subprocess.Popen(
            [*base[:3], "-q", "-rf", "-W", "ignore", *ids[i::PARALLEL]],
            cwd=HERE, stdout=logs[i], stderr=subprocess.STDOUT, text=True,
        )
        for i in range(PARALLEL)
    ]  # fmt: skip
    deadline = time.monotonic() + PYTEST_S
    timed_out = False
    for child in children:
        try:
            child.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            timed_out = True
    counts, failed, tails = {}, [], []
    for log in logs:
        log.seek(0)
        lines = log.read().splitlines()
        tails.append("\n".join(lines[-3:]))
        failed += [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        summary = next((line for line in reversed(lines) if SUMMARY.search(line)), None)
        if summary is None:  # killed: count its progress marks instead
            marks = "".join(line.split(" [")[0] for line in lines if PROGRESS.match(line))
            found = [(marks.count(mark), word) for mark, word in MARKS.items()]
        else:
            found = re.findall(r"(\d+) (\w+)", summary.split(" in ")[0])
        for number, word in found:
            counts[word] = counts.get(word, 0) + int(number)
    line = ", ".join(f"{v} {k}" for k, v in counts.items())
    return {"collected": len(ids), "counts": counts, "summary": line, "timed_out": timed_out,
            "failed": failed[:40], "tails": tails if timed_out or failed else []}  # fmt: skip


def operand(rows, cols, dtype, transposed):
    if transposed:
        return torch.randn(cols, rows, device="cuda").to(dtype).T
    return torch.randn(rows, cols, device="cuda").to(dtype)


def median_ms(fn, rep):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def plan_of(A, B, m, n, k, tf32):
    config = triton_impl.configuration(m, n, k, A.dtype, tf32)
    path = triton_impl.choose_path(A, B, True)
    tile = f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']}"
    return f"{path} {tile} w{config['num_warps']} s{config['num_stages']} splits={config['SPLITS']}"


def time_case(name, m, n, k, dtype, layout, rep):
    """One row: ours against torch.addmm on the same operands, interleaved in ROUNDS rounds.
    float32 runs TF32 in both (cuBLAS with torch's TF32 flag set for its calls only)."""
    A = operand(m, k, dtype, layout[0] == "T")
    B = operand(k, n, dtype, layout[1] == "T")
    C = torch.randn(m, n, device="cuda").to(dtype)
    tf32 = dtype == torch.float32
    ours = lambda: triton_impl.gemm(ALPHA, A, B, BETA, C, allow_tf32=tf32)  # noqa: E731
    cublas = lambda: C.addmm_(A, B, beta=BETA, alpha=ALPHA)  # noqa: E731
    ours()  # compile outside the timing
    times = {"ours": [], "cublas": []}
    for round_ in range(ROUNDS):
        order = [("ours", ours), ("cublas", cublas)][:: 1 if round_ % 2 == 0 else -1]
        for label, fn in order:
            with torch_impl.float32_matmul_precision(C.device, tf32 and label == "cublas"):
                times[label].append(median_ms(fn, rep))
    ours_ms, cublas_ms = statistics.median(times["ours"]), statistics.median(times["cublas"])
    flops = 2.0 * m * n * k
    return {
        "case": name, "m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."),
        "layout": layout, "plan": plan_of(A, B, m, n, k, tf32), "ours_ms": round(ours_ms, 5),
        "cublas_ms": round(cublas_ms, 5), "ratio": round(cublas_ms / ours_ms, 3),
        "ours_TFLOPs": round(flops / ours_ms / 1e9, 1),
        "weight_GBps": round(2.0 * n * k / ours_ms / 1e6, 0) if m <= 128 else None,
    }  # fmt: skip


@contextlib.contextmanager
def planned(splits=None, num_stages=None, path=None):
    """Force a variant of the rule's plan for the cases inside: a split count, a pipeline depth,
    or the path."""
    rule, choose = triton_impl.configuration, triton_impl.choose_path

    def forced(m, n, k, dtype, allow_tf32=False):
        config = dict(rule(m, n, k, dtype, allow_tf32))
        if splits is not None and k:
            block_k = config["BLOCK_K"]
            per = triton_impl.ceil_div(triton_impl.ceil_div(k, splits), block_k) * block_k
            config.update(SPLITS=triton_impl.ceil_div(k, per), k_per_split=per)
        if num_stages is not None:
            config["num_stages"] = num_stages
        return config

    triton_impl.configuration = forced
    if path is not None:
        triton_impl.choose_path = lambda A, B, tensor_cores: path
    try:
        yield
    finally:
        triton_impl.configuration, triton_impl.choose_path = rule, choose


def cases():
    """(name, variant, m, n, k, dtype, layout, rep ms), most important first."""
    for dtype in (torch.bfloat16, torch.float16):
        for layout in ("NN", "NT", "TN", "TT"):
            yield "square", {}, 8192, 8192, 8192, dtype, layout, 50
    for m in (4096, 16384):
        for n, k in PROJECTIONS:
            yield "projection", {}, m, n, k, torch.bfloat16, "NT", 50
    for n, k in DECODE_NK:
        for m in DECODE_M:
            yield "decode", {}, m, n, k, torch.bfloat16, "NT", 20
    yield "misaligned", {}, 4097, 5121, 3079, torch.bfloat16, "NN", 50
    yield "misaligned", {"path": "pointer"}, 4097, 5121, 3079, torch.bfloat16, "NN", 50
    for layout, variant in (("NT", {}), ("NN", {}), ("NN", {"path": "pointer"})):
        yield "tf32", variant, 4096, 4096, 4096, torch.float32, layout, 50
    for m, n, k in ((1, 4096, 4096), (128, 4096, 4096)):
        chosen = triton_impl.configuration(m, n, k, torch.bfloat16)["SPLITS"]
        for splits in sorted({1, 2, 4, 8} - {chosen}):
            yield "decode sweep", {"splits": splits}, m, n, k, torch.bfloat16, "NT", 20
    yield "decode sweep", {"num_stages": 6}, 1, 4096, 4096, torch.bfloat16, "NT", 20
    yield "decode sweep", {"num_stages": 3}, 128, 4096, 4096, torch.bfloat16, "NT", 20


def main():
    if not torch.cuda.is_available():
        print("probe_triton: no CUDA device")
        return 1
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "tests": run_tests(), "timings": []}  # fmt: skip
    tests = report["tests"]
    print(f"tests: {tests.get('summary') or tests}  (collected {tests.get('collected')},"
          f" timed out: {tests.get('timed_out')})", flush=True)  # fmt: skip
    for line in tests.get("failed", []):
        print("  ", line)
    for name, variant, m, n, k, dtype, layout, rep in cases():
        label = f"{name} {variant or ''} {m}x{n}x{k} {str(dtype)[6:]} {layout}"
        failed = {"case": name, "variant": variant, "shape": [m, n, k], "dtype": str(dtype)}
        if left_s() < 8:
            report["timings"].append({**failed, "error": "not run: out of time"})
            continue
        try:
            with planned(**variant):
                row = time_case(name, m, n, k, dtype, layout, rep)
            row["variant"] = variant
            report["timings"].append(row)
            print(f"{label:55s} {row['plan']:44s} ours {row['ours_ms']*1e3:9.1f} us  cuBLAS "
                  f"{row['cublas_ms']*1e3:9.1f} us  x{row['ratio']:.3f}", flush=True)  # fmt: skip
        except Exception as error:  # report the case, go on with the next
            report["timings"].append({**failed, "error": repr(error)[:500]})
            print(f"{label:55s} ERROR {error!r}"[:300], flush=True)
        torch.cuda.empty_cache()
    report["elapsed_s"] = round(time.monotonic() - START, 1)
    print(f"elapsed {report['elapsed_s']} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_triton.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
