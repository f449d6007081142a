"""GPU probe for the column split (issue 13): timings against cuBLAS, then the tests.

    cd gemv && python probe_gemv.py [--no-tests] [--tests-only] [--all-tests]

1. Timings, implementations interleaved (rotated order, ROUNDS rounds, median of the rounds'
   medians): triton.testing.do_bench, which flushes L2 before every call, of torch.addmv
   (cuBLAS), triton_impl.gemv and cute_impl.gemv at 4096^2, 8192^2 and 16384^2, float32 and
   bfloat16, row- and column-major A, with the parts each kernel cut the columns into.
2. A sweep of forced part counts (1 .. 8) for the column-major kernels at 4096^2 and 8192^2
   and the row-major ones at 4096^2: what the split rule should pick, measured.
3. Host cost per call (wall time of back-to-back calls) at 64 x 64 (unsplit) and at 4096^2
   column-major bfloat16 (split), against torch.addmv.
4. pytest -q test.py in a child process, in whatever is left of TIME_BUDGET_S: the tests of
   what the split touches (TEST_SELECTION), or every test with --all-tests.
Every case is caught and reported; results go to stdout and, when $OUT is set, to
$OUT/probe_gemv.json.
"""

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
sys.path.insert(0, str(HERE))

import triton_impl  # noqa: E402

try:
    import cute_impl  # noqa: E402
except ImportError as error:
    cute_impl, CUTE_MISSING = None, str(error)
else:
    CUTE_MISSING = None

START = time.perf_counter()
TIME_BUDGET_S = 225  # the lead's limit is 4 minutes
ALPHA, BETA = 1.5, 0.5  # y stays bounded over repeated in-place calls (as bench.py)
ROUNDS = 3
SIZES = [4096, 8192, 16384]
DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = ["row", "col"]
SWEEP_SPLITS = [1, 2, 4, 8]
TEST_SELECTION = (
    "split or matches_reference or views_inside or repeatability or cuda_graph or zero_scalars"
    " or special_values or 2_to_31 or at_h200_sizes or ptx"
)
RESULTS = {"device": None, "timing": [], "sweep": [], "host_us": [], "pytest": None, "errors": []}


def say(line):
    print(line, flush=True)


def record_error(what):
    RESULTS["errors"].append({"case": what, "error": traceback.format_exc(limit=3)[-1500:]})
    say(f"ERROR {what}: {traceback.format_exc(limit=1).strip().splitlines()[-1]}")


def library_gemv(alpha, A, x, beta, y):
    return y.addmv_(A, x, beta=beta, alpha=alpha)


def implementations():
    impls = {"cublas": library_gemv, "triton": triton_impl.gemv}
    if cute_impl is not None:
        impls["cute"] = cute_impl.gemv
    return impls


def operands(size, dtype, layout):
    A = torch.randn(size, size, device="cuda").to(dtype)
    A = A if layout == "row" else A.T  # column-major: strides (1, size)
    x, y = (torch.randn(size, device="cuda").to(dtype) for _ in range(2))
    return A, x, y


def splits_taken(impl, A):
    if impl == "triton":
        return triton_impl.column_split(A)[0]
    if impl == "cute":
        return cute_impl.split_columns(*A.shape, A.dtype, cute_impl.mapping(A))[0]
    return None


def worst_error(gemv, A, x, y):
    """max |y_hat - y| / (|alpha| |A| |x| + |beta y|) over the rows, against float64: a sanity
    check of the split at sizes the tests do not run (the tests check the bound)."""
    out = y.clone()
    gemv(ALPHA, A, x, BETA, out)
    exact = ALPHA * (A.double() @ x.double()) + BETA * y.double()
    scale = ALPHA * (A.double().abs() @ x.double().abs()) + BETA * y.double().abs()
    return ((out.double() - exact).abs() / scale).max().item()


def interleaved_us(calls):
    names = list(calls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            ms = triton.testing.do_bench(calls[name], warmup=25, rep=40, return_mode="median")
            samples[name].append(ms * 1e3)
    return {name: statistics.median(us) for name, us in samples.items()}


def time_case(size, dtype, layout):
    impls = implementations()
    A, x, y = operands(size, dtype, layout)
    errors = {name: worst_error(f, A, x, y) for name, f in impls.items() if name != "cublas"}
    us = interleaved_us({name: gemv_call(f, A, x, y) for name, f in impls.items()})
    for name, t in us.items():
        RESULTS["timing"].append(
            {"impl": name, "dtype": str(dtype)[6:], "layout": layout, "size": size,
             "us": round(t, 2), "x_cublas": round(us["cublas"] / t, 3),
             "splits": splits_taken(name, A), "rel_error": errors.get(name)}
        )  # fmt: skip
    parts = {name: f" ({splits_taken(name, A)} parts)" if name != "cublas" else "" for name in us}
    say(f"{str(dtype)[6:]} {layout} {size}^2: " + "  ".join(
        f"{name} {t:7.1f} us x{us['cublas'] / t:.3f}{parts[name]}" for name, t in us.items()
    ))  # fmt: skip


def time_sizes():
    for size in SIZES:
        for dtype in DTYPES:
            for layout in LAYOUTS:
                try:
                    time_case(size, dtype, layout)
                except Exception:
                    record_error(f"{str(dtype)[6:]} {layout} {size}^2")
                torch.cuda.empty_cache()


def gemv_call(gemv, A, x, y):
    return lambda: gemv(ALPHA, A, x, BETA, y)


def forced(impl, splits):
    """(module, rule): impl's module and a split rule that always answers `splits` parts."""

    def triton_rule(m, n, block_m, block_n, element_size):
        steps = -(-n // block_n)
        return splits, -(-steps // splits)

    def cute_rule(m, n, dtype, layout):
        tiles = -(-n // cute_impl.block_geometry(dtype, layout)[1])
        return splits, -(-tiles // splits)

    return (triton_impl, triton_rule) if impl == "triton" else (cute_impl, cute_rule)


def with_rule(module, rule, gemv):
    """gemv with module's split rule replaced by `rule` for the call."""

    def call(*args):
        original, module.split_columns = module.split_columns, rule
        try:
            return gemv(*args)
        finally:
            module.split_columns = original

    return call


def sweep_case(size, dtype, layout):
    A, x, y = operands(size, dtype, layout)
    calls, errors = {"cublas": gemv_call(library_gemv, A, x, y)}, {}
    for name, gemv in implementations().items():
        if name == "cublas":
            continue
        for splits in SWEEP_SPLITS:
            key = f"{name} {splits}"
            forced_gemv = with_rule(*forced(name, splits), gemv)
            try:
                errors[key] = worst_error(forced_gemv, A, x, y)
                calls[key] = gemv_call(forced_gemv, A, x, y)
            except Exception:
                record_error(f"sweep {key} {str(dtype)[6:]} {layout} {size}^2")
    us = interleaved_us(calls)
    line = f"sweep {str(dtype)[6:]} {layout} {size}^2: cublas {us['cublas']:.1f} us;"
    for key, t in us.items():
        if key != "cublas":
            name, splits = key.split()
            RESULTS["sweep"].append(
                {"impl": name, "splits": int(splits), "dtype": str(dtype)[6:], "layout": layout,
                 "size": size, "us": round(t, 2), "x_cublas": round(us["cublas"] / t, 3),
                 "rel_error": errors[key]}
            )  # fmt: skip
            line += f" {key}: x{us['cublas'] / t:.3f}"
    say(line)


def sweep():
    cases = [(s, d, "col") for s in (4096, 8192) for d in DTYPES]
    for size, dtype, layout in cases + [(4096, d, "row") for d in DTYPES]:
        try:
            sweep_case(size, dtype, layout)
        except Exception:
            record_error(f"sweep {str(dtype)[6:]} {layout} {size}^2")
        torch.cuda.empty_cache()


def host_costs(calls_per_round=500):
    impls = implementations()
    for size, dtype, layout in ((64, torch.float32, "row"), (4096, torch.bfloat16, "col")):
        try:
            A, x, y = operands(size, dtype, layout)
            samples = {name: [] for name in impls}
            names = list(impls)
            for shift in range(ROUNDS):
                for name in names[shift:] + names[:shift]:
                    impls[name](ALPHA, A, x, BETA, y)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(calls_per_round):
                        impls[name](ALPHA, A, x, BETA, y)
                    torch.cuda.synchronize()
                    samples[name].append((time.perf_counter() - start) / calls_per_round * 1e6)
            us = {name: statistics.median(v) for name, v in samples.items()}
            for name, t in us.items():
                RESULTS["host_us"].append({"impl": name, "dtype": str(dtype)[6:], "size": size,
                                           "layout": layout, "us_per_call": round(t, 2),
                                           "splits": splits_taken(name, A)})  # fmt: skip
            say(f"per call {str(dtype)[6:]} {layout} {size}^2: "
                + ", ".join(f"{n} {t:.1f} us" for n, t in us.items()))  # fmt: skip
        except Exception:
            record_error(f"host cost {size}")


def run_tests():
    left = int(TIME_BUDGET_S - (time.perf_counter() - START))
    if left < 20:
        RESULTS["pytest"] = {"skipped": f"only {left} s left of the budget"}
        return
    command = [sys.executable, "-m", "pytest", "test.py", "-q", "-rfE", "-p", "no:cacheprovider",
               "-W", "ignore::RuntimeWarning", "-W", "ignore::UserWarning"]  # fmt: skip
    if "--all-tests" not in sys.argv:
        command += ["-k", TEST_SELECTION]
    say(f"pytest with {left} s left: {' '.join(command[1:])}")
    try:
        child = subprocess.run(
            command, cwd=HERE, capture_output=True, text=True, timeout=left, check=False
        )
        output, rc = child.stdout + child.stderr, child.returncode
    except subprocess.TimeoutExpired as timeout:
        output = timeout.stdout or ""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        output, rc = output + "\n[probe: pytest stopped at the time budget]", None
    lines = output.strip().splitlines()
    problems = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    progress = "".join(ln for ln in lines if set(ln.split(" [")[0]) <= set(".FEsxX"))
    RESULTS["pytest"] = {
        "rc": rc, "summary": lines[-1] if lines else "", "problems": problems[:40],
        "progress_counts": {c: progress.count(c) for c in ".FEs"}, "tail": lines[-15:],
    }  # fmt: skip
    say(f"pytest rc {rc}: {lines[-1] if lines else 'no output'}")
    for line in problems[:20]:
        say("  " + line[:200])


def write_results():
    out = os.environ.get("OUT")
    if out:
        Path(out, "probe_gemv.json").write_text(json.dumps(RESULTS, indent=1) + "\n")


def main():
    only_tests, no_tests = "--tests-only" in sys.argv, "--no-tests" in sys.argv
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["cute_missing"] = CUTE_MISSING
    say(f"{RESULTS['device']}; cute_impl: {'missing: ' + CUTE_MISSING if CUTE_MISSING else 'ok'}")
    if not only_tests:
        for step in (time_sizes, sweep, host_costs):
            try:
                step()
            except Exception:
                record_error(step.__name__)
            write_results()
            say(f"[{time.perf_counter() - START:.0f} s]")
    torch.cuda.empty_cache()
    if not no_tests:
        run_tests()
    write_results()
    say(f"done in {time.perf_counter() - START:.0f} s; {len(RESULTS['errors'])} errors")


if __name__ == "__main__":
    main()
