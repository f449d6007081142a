"""GPU probe for triton_impl.launch (issue 13): what an eager gemm call costs on the host.

Per case: the wall time of a call (1000 back-to-back calls, the median of 3 runs) of gemm through
the direct launch ("ours"), of gemm forced through kernel[grid] ("kernel[grid]", the old path),
of cuBLAS (torch.addmm) and of its two parts: gemm's Python with the launch left out ("host
python") and the compiled kernel's launcher alone ("launcher"; on the TMA path, of which
"descriptor encode" turns the two descriptors into CUtensorMaps); do_bench times of the three
calls; and whether ours gives the bits of kernel[grid]. Floors: a bare Triton launch of a
3-argument kernel and torch's y.copy_(x). Then the Triton tests of test.py that the launch
touches. Run from gemm/: python probe_launch.py (writes $OUT/probe_launch.json when OUT is set).
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
import triton.language as tl
from triton.backends.nvidia.driver import make_tensordesc_arg
from triton.tools.tensor_descriptor import TensorDescriptor

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import triton_impl  # noqa: E402

# "NN padded": A's rows one element longer than k, which TMA cannot fetch: the pointer kernel.
CASES = [(64, 64, 64, "NN"), (64, 64, 64, "NN padded"), (1, 4096, 4096, "NT"),
         (16, 4096, 4096, "NT"), (64, 4096, 4096, "NT"), (1024, 1024, 1024, "NN"),
         (2048, 2048, 2048, "NN")]  # fmt: skip
TESTS = (
    "specialisation_is or launch_key or once_per_key or direct_launch"
    " or cuda_graph_replays_triton_paths"
)


@triton.jit
def bare_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def wall_us(calls, count=1000):
    """{name: host wall time of one call} for each of `calls` run `count` times back to back,
    the median of 3 runs, interleaved: every call's run r before any call's run r + 1."""
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


def bench_us(call):
    return round(triton.testing.do_bench(call) * 1e3, 2)


def through_kernel_grid(call):
    """call() with gemm's launches sent through kernel[grid], as before launch() (swapping the
    function back and forth adds about 0.3 us)."""
    direct = triton_impl.launch

    def forced():
        triton_impl.launch = lambda kernel, programs, args, constants, _: kernel[(programs,)](
            *args, **constants
        )
        try:
            call()
        finally:
            triton_impl.launch = direct

    return forced


class Recorder:
    """A CompiledKernel stand-in whose launches are appended to `launches`; None: dropped."""

    def __init__(self, compiled, launches):
        self.function, self.packed_metadata = compiled.function, compiled.packed_metadata
        self.launches = launches

    def run(self, *launch):
        if self.launches is not None:
            self.launches.append(launch)


def operands(m, n, k, layout, dtype=torch.bfloat16):
    A = torch.randn(m, k + 1 if "padded" in layout else k, device="cuda", dtype=dtype)[:, :k]
    B = torch.randn(k, n, device="cuda", dtype=dtype)
    if layout[1] == "T":
        B = torch.randn(n, k, device="cuda", dtype=dtype).T
    return A, B, torch.randn(m, n, device="cuda", dtype=dtype)


def probe_case(m, n, k, layout):
    A, B, C = operands(m, n, k, layout)
    config = triton_impl.configuration(m, n, k, torch.bfloat16)
    row = {"shape": [m, n, k], "layout": layout, "path": triton_impl.choose_path(A, B, True),
           "tile": [config["BLOCK_M"], config["BLOCK_N"]], "splits": config["SPLITS"]}  # fmt: skip
    ours = lambda: triton_impl.gemm(1.0, A, B, 0.5, C)  # noqa: E731
    calls = {"ours": ours, "kernel[grid]": through_kernel_grid(ours),
             "cublas": lambda: torch.addmm(C, A, B, beta=0.5, out=C)}  # fmt: skip
    triton_impl.COMPILED.clear()
    direct, old = C.clone(), C.clone()
    triton_impl.gemm(1.0, A, B, 0.5, direct)  # compiles; the key is kept
    triton_impl.gemm(1.0, A, B, 0.5, direct.copy_(C))  # a direct launch
    through_kernel_grid(lambda: triton_impl.gemm(1.0, A, B, 0.5, old))()
    row["same bits"] = bool(torch.equal(direct.view(torch.int16), old.view(torch.int16)))
    row.update({f"{name} wall": us for name, us in wall_us(calls).items()})
    row.update({f"{name} bench": bench_us(call) for name, call in calls.items()})
    # The parts of ours: the launcher alone, on the arguments gemm hands it, and gemm's Python
    # with a launcher that launches nothing.
    ((key, (compiled, rest)),) = triton_impl.COMPILED.items()
    launches = []
    triton_impl.COMPILED[key] = Recorder(compiled, launches), rest
    ours()
    triton_impl.COMPILED[key] = Recorder(compiled, None), rest
    row.update(wall_us({"host python": ours, "launcher": lambda: compiled.run(*launches[0])}))
    # Of the launcher's time on the TMA path: encoding the two CUtensorMaps, as it does per call.
    descriptors = [arg for arg in launches[0] if isinstance(arg, TensorDescriptor)]
    if descriptors:
        metadata = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descriptors)
        pairs = list(zip(descriptors, metadata, strict=True))
        encode = lambda: [make_tensordesc_arg(*pair) for pair in pairs]  # noqa: E731
        row["descriptor encode"] = wall_us({"encode": encode})["encode"]
    triton_impl.COMPILED.clear()
    return row


def run_tests(budget_s):
    """The Triton tests the launch touches, within budget_s seconds."""
    command = [sys.executable, "-m", "pytest", "test.py", "-q", "-p", "no:cacheprovider"]
    command += ["-k", TESTS]
    try:
        done = subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired as timeout:
        return {"rc": "timeout", "tail": (timeout.stdout or b"")[-1500:].decode(errors="replace")}
    return {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-1500:]}


def main():
    started = time.perf_counter()
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
           "torch": torch.__version__}  # fmt: skip
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    floors = {"torch copy_": lambda: y.copy_(x),
              "bare Triton launch": lambda: bare_copy[(4,)](x, y, 4096, BLOCK=1024)}  # fmt: skip
    out.update({f"floor: {name} wall": us for name, us in wall_us(floors).items()})
    print(json.dumps(out), flush=True)
    rows = []
    for case in CASES:
        try:
            rows.append(probe_case(*case))
        except Exception:
            rows.append({"case": list(case), "error": traceback.format_exc()[-1500:]})
        print(json.dumps(rows[-1]), flush=True)
    out["rows"] = rows
    out["tests"] = run_tests(max(30, 88 - (time.perf_counter() - started)))
    print(out["tests"]["tail"], flush=True)
    out["seconds"] = round(time.perf_counter() - started, 1)
    print("seconds", out["seconds"])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_launch.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
