"""GPU probe for CuTe step 3 (split k on decode shapes): `cd gemm && python probe_cute.py`.

1. pytest -q test.py -k cute, in SHARDS processes at once (the time is mostly compiling
   builds): step 3's own tests in one, the rest in contiguous runs; counts and failures. It
   runs after part 2, on what is left of TOTAL_BUDGET_S (a shard still running then is
   killed and counted from its progress marks).
2. Decode shapes, NT (x @ W.T: A row-major, B = W.T), bfloat16: m in (1, 16, 64, 128) x
   (n, k) in DECODE_NK. torch.addmm (cuBLAS), step 2 alone and step 3, interleaved in rotated
   rounds, triton.testing.do_bench medians (L2 flushed before every call); per shape the plan
   step 3 chose, its error against a float64 product in units of the bound, and whether two
   calls gave the same bits. Then the plan's neighbours at m = 64 (other tile widths and S)
   and the host cost per call at m = 1.

Prints one line per result and writes everything to $OUT/probe_cute.json when $OUT is set.
Nothing stops at a failure: each case reports its error. The floor, for reference: W's 2nk
bytes at 4.2 TB/s (8.0 us at n = k = 4096, 21.5 us at 11008 x 4096).
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
SHARDS = min(8, max(1, (os.cpu_count() or 2) // 2))
TOTAL_BUDGET_S = 215  # the timings, then pytest until then: the probe stays under 4 minutes
DECODE_M = [1, 16, 64, 128]
DECODE_NK = [(4096, 4096), (11008, 4096), (4096, 11008)]
NEIGHBOURS = [(128, 2), (128, 3), (128, 4), (128, 6), (128, 8), (256, 2), (256, 3), (256, 4)]
ROUNDS = 3
BANDWIDTH = 4.2e12  # bytes/s: the floor's DRAM rate
results = {"pytest": {}, "decode": [], "neighbours": [], "host_us": {}}


def say(line):
    print(line, flush=True)


def progress_counts(output):
    """Counts from pytest -q's progress characters: what a shard killed at the deadline did."""
    marks = "".join(
        line.split(" [")[0]
        for line in output.splitlines()
        if re.fullmatch(r"[.sFExX]+(\s+\[\s*\d+%\])?", line.strip())
    )
    words = {".": "passed", "s": "skipped", "F": "failed", "E": "error", "x": "xfailed"}
    return {word: marks.count(mark) for mark, word in words.items() if mark in marks}


def run_pytest(budget_s):
    """pytest -k cute over SHARDS processes at once: step 3's own tests (split, step3) in the
    first, the rest in contiguous runs; returns counts, failures and each shard's summary."""
    base = [sys.executable, "-m", "pytest", "test.py", "-q", "-p", "no:cacheprovider"]
    listed = subprocess.run(
        [*base, "-k", "cute", "--collect-only"], cwd=HERE, capture_output=True, text=True
    )
    ids = [line for line in listed.stdout.splitlines() if line.startswith("test.py::")]
    if not ids:
        return {"error": "nothing collected", "tail": (listed.stdout + listed.stderr)[-3000:]}
    own = [i for i in ids if "split" in i or "step3" in i]
    rest = [i for i in ids if i not in own]
    size = -(-len(rest) // max(1, SHARDS - 1))
    shards = [own] + [rest[s : s + size] for s in range(0, len(rest), size)]
    running = [
        subprocess.Popen(
            [*base, "-rfE", *shard],
            cwd=HERE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for shard in shards
    ]
    deadline = time.monotonic() + budget_s
    counts, failed, summaries, timed_out = {}, [], [], 0
    for process in running:
        try:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            summary = output.strip().splitlines()[-1] if output.strip() else ""
            found = {
                w: int(c) for c, w in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)
            }
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            timed_out += 1
            found = progress_counts(output)
            summary = f"killed at the deadline after {found}"
        failed += [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
        summaries.append(summary)
        for word, number in found.items():
            counts[word] = counts.get(word, 0) + number
    return {"collected": len(ids), "counts": counts, "shards_timed_out": timed_out,
            "failed": failed[:60], "summaries": summaries}  # fmt: skip


def median_us(fn):
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=40, return_mode="median")


def interleaved_us(calls):
    """{name: us}: the median over ROUNDS rotated rounds of each call's do_bench median."""
    names, samples = list(calls), {name: [] for name in calls}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            samples[name].append(median_us(calls[name]))
    return {name: statistics.median(us) for name, us in samples.items()}


def decode_operands(m, n, k):
    A = torch.randn(m, k, device="cuda").bfloat16()
    W = torch.randn(n, k, device="cuda").bfloat16()
    return A, W.T, torch.randn(m, n, device="cuda").bfloat16()


def error_in_bounds(C, A, B, C_in, alpha, beta):
    """max |C - exact| / bound over the elements, bound = u_bf16 |exact| + gamma_{k+2}(2**-24)
    T (the README's bound without its subnormal terms, which these values never reach)."""
    exact = alpha * (A.double() @ B.double()) + beta * C_in.double()
    T = abs(alpha) * (A.double().abs() @ B.double().abs()) + abs(beta) * C_in.double().abs()
    k, u = A.shape[1], 2.0**-24
    bound = 2.0**-8 * exact.abs() + (k + 2) * u / (1 - (k + 2) * u) * T + 1e-30
    return ((C.double() - exact).abs() / bound).max().item()


def decode_row(step2, step3, m, n, k):
    """One decode shape: step 3's plan, error and repeatability, then the three timings."""
    row = {"m": m, "n": n, "k": k, "floor_us": 2 * n * k / BANDWIDTH * 1e6}
    A, B, C = decode_operands(m, n, k)
    row["plan"] = step3.choose_split(A, B, False)
    first, second = C.clone(), C.clone()
    step3.gemm(1.0, A, B, 0.5, first)
    step3.gemm(1.0, A, B, 0.5, second)
    row["same_bits"] = bool(torch.equal(first.view(torch.int16), second.view(torch.int16)))
    row["error_in_bounds"] = error_in_bounds(first, A, B, C, 1.0, 0.5)
    times = interleaved_us({
        "cublas": lambda: C.addmm_(A, B, beta=0.5, alpha=1.0),
        "step2": lambda: step2.gemm(1.0, A, B, 0.5, C),
        "step3": lambda: step3.gemm(1.0, A, B, 0.5, C),
    })  # fmt: skip
    row |= {f"{name}_us": us for name, us in times.items()}
    row["step3_vs_cublas"] = times["cublas"] / times["step3"]
    row["step2_vs_cublas"] = times["cublas"] / times["step2"]
    say(f"m={m:4d} n={n:5d} k={k:5d} plan={row['plan']} cuBLAS {times['cublas']:6.1f} step2 "
        f"{times['step2']:6.1f} step3 {times['step3']:6.1f} us (x{row['step3_vs_cublas']:.2f} "
        f"cuBLAS, floor {row['floor_us']:.1f}) err/bound {row['error_in_bounds']:.3f} "
        f"same bits {row['same_bits']}")  # fmt: skip
    return row


def probe_decode(step2, step3):
    for n, k in DECODE_NK:
        for m in DECODE_M:
            try:
                results["decode"].append(decode_row(step2, step3, m, n, k))
            except Exception:
                error = traceback.format_exc()[-1500:]
                results["decode"].append({"m": m, "n": n, "k": k, "error": error})
                say(f"m={m} n={n} k={k} FAILED: {error.splitlines()[-1]}")


def probe_neighbours(step3):
    """step 3 at m = 64 on other (tile_n, S) than split_plan's, each against cuBLAS."""
    m = 64
    for n, k in DECODE_NK:
        A, B, C = decode_operands(m, n, k)
        calls = {"cublas": lambda A=A, B=B, C=C: C.addmm_(A, B, beta=0.5, alpha=1.0)}
        for choice in NEIGHBOURS:
            calls[choice] = lambda A=A, B=B, C=C, choice=choice: forced(step3, choice, A, B, C)
        try:
            times = interleaved_us(calls)
        except Exception:
            results["neighbours"].append({"n": n, "k": k, "error": traceback.format_exc()[-1500:]})
            continue
        for choice in NEIGHBOURS:
            chosen = step3.split_plan(m, n, k, 2) == choice
            row = {"m": m, "n": n, "k": k, "tile_n": choice[0], "splits": choice[1],
                   "us": times[choice], "vs_cublas": times["cublas"] / times[choice],
                   "chosen": chosen}  # fmt: skip
            results["neighbours"].append(row)
            say(f"  m=64 n={n} k={k} tile_n={choice[0]} S={choice[1]}: {times[choice]:.1f} us "
                f"x{row['vs_cublas']:.2f} cuBLAS{' (chosen)' if chosen else ''}")  # fmt: skip


def forced(step3, choice, A, B, C):
    """step 3's gemm with split_plan answering `choice` (tile_n, S)."""
    plan = step3.split_plan
    step3.split_plan = lambda *_: choice
    try:
        step3.gemm(1.0, A, B, 0.5, C)
    finally:
        step3.split_plan = plan


def host_us(calls, count=500):
    out = {}
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            call()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - start) / count * 1e6
    return out


def probe_timings():
    """Part 2 (run first, on an idle GPU): the decode timings, neighbours and host cost."""
    try:
        import cute_2_tma_wgmma as step2
        import cute_3_split_k as step3
    except Exception:
        results["import_error"] = traceback.format_exc()[-2000:]
        say(f"CuTe steps cannot be imported: {results['import_error'].splitlines()[-1]}")
        return
    probe_decode(step2, step3)
    try:
        probe_neighbours(step3)
    except Exception:
        results["neighbours_error"] = traceback.format_exc()[-2000:]
    try:
        A, B, C = decode_operands(1, 4096, 4096)
        results["host_us"] = host_us({
            "cublas": lambda: C.addmm_(A, B, beta=0.5, alpha=1.0),
            "step3": lambda: step3.gemm(1.0, A, B, 0.5, C),
        })  # fmt: skip
        say(f"host cost per call at 1 x 4096 x 4096 (us): {results['host_us']}")
    except Exception:
        results["host_error"] = traceback.format_exc()[-2000:]


def main():
    started = time.monotonic()
    say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, {SHARDS} pytest shards")  # fmt: skip
    probe_timings()
    budget = TOTAL_BUDGET_S - (time.monotonic() - started)
    try:
        results["pytest"] = run_pytest(max(30.0, budget))
        p = results["pytest"]
        say(f"pytest -k cute: {p.get('collected')} collected, {p.get('counts')}, "
            f"{p.get('shards_timed_out')} shards killed at the deadline")  # fmt: skip
        for line in p.get("failed", [])[:20]:
            say(f"  {line}")
    except Exception:
        results["pytest"] = {"error": traceback.format_exc()[-2000:]}
        say(f"pytest failed to run: {results['pytest']['error'].splitlines()[-1]}")
    results["wall_s"] = time.monotonic() - started
    say(f"probe wall time {results['wall_s']:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_cute.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
