"""GPU probe for gemv's column split: correctness first, then timings against cuBLAS.

    cd gemv && python probe_split.py            # under 85 s: each stage has a deadline
    cd gemv && python probe_split.py --pytest   # then test.py's split tests of column-major A

Each stage runs in a child process of its own: a kernel that faults poisons the CUDA context
of its process, and the next stage still runs. Every case is caught and reported; the summary
goes to stdout and, when $OUT is set, to $OUT/probe_split.json.

1. check. First a direct call of CuTe's column-major gemv on 2 x 3 (and 4 x 3, its vector
   build) of small integers, unsplit and in 2 parts, printing y before, expected and got: the
   sums are exact, so any difference is the kernel's. Then Triton and CuTe on column-major A
   of float32 and bfloat16, 2 x 3 up to 4096 x 4096, forced into 1, 2 and 4 parts: y a
   strided view inside a NaN guard, checked against float64 within test.py's bound (its
   error_bound reads the forced split), nothing around y written, a second run bit-identical.
2. time. Column-major 4096^2, 8192^2 and the decode-like 4096 x 11008, float32 and bfloat16:
   torch.addmv (cuBLAS), each kernel unsplit (main's behaviour) and split by its rule, each
   checked as above, then timed by triton.testing.do_bench (L2 flushed before every call,
   median), in rotating order over ROUNDS rounds. The floor is the bytes moved,
   (mn + n + 2m) s, over 4.2 TB/s; the flops (2mn) take well under 1% of it at 700 TFLOP/s.
3. pytest, with --pytest: test.py's split tests of column-major A (at most 150 s more).
"""

import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGET_S = {"check": 36, "time": 38, "pytest": 150}  # no case starts later; 5 s more, stopped
ALPHA, BETA = 1.5, 0.5  # y stays bounded over repeated in-place calls
ROUNDS = 3
BANDWIDTH = 4.2e12  # bytes/s, the H200's HBM3e
CHECK_SHAPES = [(2, 3), (37, 300), (130, 2049), (4096, 4096)]
TIME_SHAPES = [(4096, 4096), (8192, 8192), (4096, 11008)]
FORCED_PARTS = [1, 2, 4]
PYTEST_SELECTION = "(split_matches_reference or split_special_values or cuda_graph) and col"


def say(line):
    print(line, flush=True)


def failure():
    return traceback.format_exc(limit=2).strip().splitlines()[-1][:300]


# ---------------------------------------------------------------- in a stage's child process


def load_modules():
    """torch, the two kernel modules and test.py (for its bound, guard and stand-in reference)."""
    global torch, triton, triton_impl, cute_impl, cute_missing, tests
    import torch
    import triton
    import triton.testing

    sys.path.insert(0, str(HERE))
    import triton_impl

    try:
        import cute_impl
    except ImportError as error:
        cute_impl, cute_missing = None, str(error)
    spec = importlib.util.spec_from_file_location("gemv_tests", HERE / "test.py")
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)


def cublas_gemv(alpha, A, x, beta, y):
    return y.addmv_(A, x, beta=beta, alpha=alpha)


def gemv_of(impl):
    return {"cublas": cublas_gemv, "triton": triton_impl.gemv}.get(impl) or cute_impl.gemv


def ceil_div(a, b):
    return -(-a // b)


@contextlib.contextmanager
def parts(impl, splits):
    """impl's split rule answering `splits` parts while inside (None: its own rule). The bound
    (test.py's *_roundings) reads the same rule, so it follows."""
    if impl == "cublas" or splits is None:
        yield
        return
    module = triton_impl if impl == "triton" else cute_impl

    def triton_rule(m, n, block_m, block_n, element_size):
        return splits, ceil_div(ceil_div(n, block_n), splits)

    def cute_rule(m, n, dtype, layout):
        return splits, ceil_div(ceil_div(n, cute_impl.block_geometry(dtype, layout)[1]), splits)

    original = module.split_columns
    module.split_columns = triton_rule if impl == "triton" else cute_rule
    try:
        yield
    finally:
        module.split_columns = original


def parts_taken(impl, A, splits):
    if splits is not None:
        return splits
    if impl == "triton":
        return triton_impl.column_split(A)[0]
    return cute_impl.split_columns(*A.shape, A.dtype, "col")[0]


def column_major(m, n, dtype):
    return torch.randn(n, m, device="cuda").to(dtype).T, torch.randn(n, device="cuda").to(dtype)


def check(impl, A, x, y_values, splits):
    """None if impl in `splits` parts lands within test.py's bound of float64, writes nothing
    around y and gives the same bits twice; else what went wrong."""
    n = A.shape[1]
    with parts(impl, splits):
        y, buffer = tests.guarded(y_values.clone(), 2)
        exact = tests.float64_gemv(ALPHA, A, x, BETA, y)
        stand_in_error = tests.gamma(n + 2, tests.U64) + tests.gamma(3, tests.U64)
        bound = tests.error_bound(impl, ALPHA, A, x, BETA, y, exact, stand_in_error)
        gemv_of(impl)(ALPHA, A, x, BETA, y)
        again, _ = tests.guarded(y_values.clone(), 2)
        gemv_of(impl)(ALPHA, A, x, BETA, again)
        torch.cuda.synchronize()
    try:
        tests.assert_within_bound(y, exact, bound, "y")
        guard = buffer.clone()
        guard[tests.MARGIN : tests.MARGIN + 2 * y.numel() : 2] = float("nan")
        assert guard.isnan().all(), "an element outside y was written"
        tests.assert_same_bits(again, y, "a second run")
    except AssertionError as error:
        return str(error).splitlines()[0][:300]
    return None


def direct_calls(results):
    """CuTe's column-major gemv on small integers: every product and sum is exact."""
    for m, splits in [(2, 1), (2, 2), (4, 1), (4, 2)]:  # m = 2: the any-stride build, 4: vector
        columns = torch.arange(1.0, 3 * m + 1).reshape(3, m)  # A's 3 columns, each contiguous
        x, y_before = torch.tensor([1.0, 10.0, 100.0]), 1000.0 * torch.arange(1.0, m + 1)
        expected = (columns.T.double() @ x.double() + y_before.double()).tolist()
        case = {"m": m, "n": 3, "parts": splits, "y_before": y_before.tolist()}
        try:
            A, x, y = columns.to("cuda").T, x.to("cuda"), y_before.to("cuda")
            with parts("cute", splits):
                cute_impl.gemv(1.0, A, x, 1.0, y)
            torch.cuda.synchronize()
            case |= {"expected": expected, "got": y.tolist(), "ok": y.tolist() == expected}
        except Exception:
            case["error"] = failure()
        results.add("direct", case)
        say(f"direct cute col {m}x3 float32, {splits} part(s): y before {case['y_before']}, "
            f"expected {expected}, got {case.get('got', case.get('error'))}"
            f"{'' if case.get('ok') else '  <-- WRONG'}")  # fmt: skip


def check_stage(results, deadline):
    if cute_impl is None:
        results.add("errors", {"case": "import cute_impl", "error": cute_missing})
    else:
        direct_calls(results)
    impls = ["cute", "triton"] if cute_impl is not None else ["triton"]
    for (m, n), dtype in [(s, d) for s in CHECK_SHAPES for d in (torch.float32, torch.bfloat16)]:
        A, x = column_major(m, n, dtype)
        y_values = torch.randn(m, device="cuda").to(dtype)
        for impl in impls:
            for splits in FORCED_PARTS:
                name = f"{impl} col {m}x{n} {str(dtype)[6:]} {splits} part(s)"
                if time.time() > deadline:
                    results.add("checks", {"case": name, "skipped": "past the deadline"})
                    continue
                try:
                    problem = check(impl, A, x, y_values, splits)
                except Exception:
                    problem = "raised: " + failure()
                results.add("checks", {"case": name, "ok": problem is None, "problem": problem})
                say(f"check {name}: {'ok' if problem is None else 'FAIL ' + problem}")


def interleaved_us(calls):
    names, samples = list(calls), {name: [] for name in calls}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            ms = triton.testing.do_bench(calls[name], warmup=25, rep=40, return_mode="median")
            samples[name].append(ms * 1e3)
    return {name: statistics.median(us) for name, us in samples.items()}


def forced_call(impl, splits, A, x, y):
    def call():
        with parts(impl, splits):
            gemv_of(impl)(ALPHA, A, x, BETA, y)

    return call


def time_case(results, m, n, dtype):
    A, x = column_major(m, n, dtype)
    y = torch.randn(m, device="cuda").to(dtype)
    variants = {"cublas": ("cublas", None)}  # name: (impl, forced parts or None for the rule)
    for impl in ["triton", "cute"] if cute_impl is not None else ["triton"]:
        variants[f"{impl} unsplit"] = (impl, 1)
        if parts_taken(impl, A, None) > 1:
            variants[f"{impl} split"] = (impl, None)
    calls, rows = {}, {}
    for name, (impl, splits) in variants.items():
        row = {"impl": name, "dtype": str(dtype)[6:], "m": m, "n": n}
        try:
            if impl != "cublas":
                row["parts"] = parts_taken(impl, A, splits)
                problem = check(impl, A, x, y, splits)
                row["ok"] = problem is None
                case = f"{name} col {m}x{n} {row['dtype']} {row['parts']} part(s)"
                results.add("checks", {"case": case, "ok": row["ok"], "problem": problem})
                if problem is not None:
                    say(f"check {case}: FAIL {problem}")
            call = forced_call(impl, splits, A, x, y)
            call()
            calls[name], rows[name] = call, row
        except Exception:
            results.add("errors", {"case": f"{name} {m}x{n} {row['dtype']}", "error": failure()})
    us = interleaved_us(calls)
    floor = (m * n + n + 2 * m) * A.element_size() / BANDWIDTH * 1e6
    line = f"time col {m}x{n} {str(dtype)[6:]} (floor {floor:.1f} us):"
    for name, t in us.items():
        rows[name] |= {"us": round(t, 2), "of_floor": round(floor / t, 3)}
        rows[name]["x_cublas"] = round(us["cublas"] / t, 3) if "cublas" in us else None
        results.add("timing", rows[name])
        label = f"{name}/{rows[name]['parts']}" if "parts" in rows[name] else name
        flag = " WRONG" if rows[name].get("ok") is False else ""
        line += f"  {label} {t:.1f} us {100 * floor / t:.0f}% x{rows[name]['x_cublas']}{flag}"
    say(line)


def time_stage(results, deadline):
    for (m, n), dtype in [(s, d) for s in TIME_SHAPES for d in (torch.bfloat16, torch.float32)]:
        if time.time() > deadline:
            results.add("errors", {"case": f"time {m}x{n} {dtype}", "error": "past deadline"})
            continue
        try:
            time_case(results, m, n, dtype)
        except Exception:
            results.add("errors", {"case": f"time {m}x{n} {dtype}", "error": failure()})
            say(f"ERROR time {m}x{n} {dtype}: {failure()}")
        torch.cuda.empty_cache()


class Results(dict):
    """A stage's results, written to its file at every addition: a stage stopped at its time
    limit still reports what it did."""

    def __init__(self, path):
        super().__init__(direct=[], checks=[], timing=[], errors=[])
        self.path = path

    def add(self, key, item):
        self[key].append(item)
        Path(self.path).write_text(json.dumps(self))


def run_stage(stage, path, deadline):
    results = Results(path)
    try:
        load_modules()
        results["device"] = torch.cuda.get_device_name()
        {"check": check_stage, "time": time_stage}[stage](results, deadline)
    except Exception:
        results.add("errors", {"case": f"stage {stage}", "error": failure()})
        say(f"ERROR stage {stage}: {failure()}")


# ---------------------------------------------------------------- the parent: no CUDA here


def child(command, seconds):
    """Run command (stdout through) for at most `seconds`; its exit code, or None if stopped."""
    try:
        return subprocess.run(command, cwd=HERE, timeout=seconds, check=False).returncode
    except subprocess.TimeoutExpired:
        return None


def pytest_stage(summary):
    command = [sys.executable, "-m", "pytest", "test.py", "-q", "-rfE", "-p", "no:cacheprovider",
               "-k", PYTEST_SELECTION]  # fmt: skip
    say("pytest " + " ".join(command[3:]))
    rc = child(command, BUDGET_S["pytest"])
    summary["pytest_rc"] = rc if rc is not None else "stopped at the time budget"


def main():
    if "--stage" in sys.argv:  # a child: --stage NAME RESULTS_PATH DEADLINE
        _, stage, path, deadline = sys.argv[sys.argv.index("--stage") :][:4]
        return run_stage(stage, path, float(deadline))
    start, summary = time.time(), {"direct": [], "checks": [], "timing": [], "errors": []}
    for stage in ("check", "time"):
        with tempfile.NamedTemporaryFile(suffix=".json") as part:
            deadline = time.time() + BUDGET_S[stage]
            command = [sys.executable, __file__, "--stage", stage, part.name, str(deadline)]
            rc = child(command, BUDGET_S[stage] + 5)
            text = Path(part.name).read_text()
            if rc != 0:
                stopped = "stopped at its time limit" if rc is None else f"exit code {rc}"
                summary["errors"].append({"case": f"stage {stage}", "error": stopped})
            for key, values in (json.loads(text) if text else {}).items():
                summary[key] = summary[key] + values if isinstance(values, list) else values
    if "--pytest" in sys.argv:
        pytest_stage(summary)
    failed = [c["case"] for c in summary["checks"] if c.get("ok") is False]
    wrong = [d for d in summary["direct"] if not d.get("ok")]
    counts = f"{len(failed)} failed, {len(wrong)} direct calls wrong"
    say(f"done in {time.time() - start:.0f} s: {len(summary['checks'])} checks, {counts}, "
        f"{len(summary['errors'])} errors")  # fmt: skip
    for case in failed[:20]:
        say("  FAILED " + case)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_split.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
