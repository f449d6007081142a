"""Benchmark gemm on the GPU: every implementation against the device's bf16 matmul rate.

    python bench.py            writes results.json and perf.png beside this file

gemm is compute bound from a few hundred on a side, so the measure is TFLOP/s = 2mnk / time
(README.md, "The math and its cost"). The cases: SHAPES (squares, and the projections of a
7B-class layer at 16384 tokens) in every dtype, NN; then MODEL_CASES (every layout at 8192^3,
the projections in NT, decode steps, a shape TMA cannot take as it is); at STEP_CASES each step
of the CuTe lesson as its own row ("cute.step1" ...), for README.md's "what each CuTe step
gained". The library op a user would otherwise call is torch.addmm (cuBLAS), in place on C; the
ceiling is torch.matmul on bfloat16 8192^3, measured in the same run.

Time is the GPU's (`graph_ms`): each implementation's calls on enough operand sets to pass
ROTATE_BYTES (so a decode step's W comes from memory, not L2) captured in one CUDA graph, whose
replay `triton.testing.do_bench` times. `interleaved_ms` takes the median of ROUNDS rounds that
rotate the order of the implementations: at full tensor-core rate the clock follows power and
temperature, so a fixed order favours whichever runs first. The per-call rows (`per_call_us`)
time the host path instead: CALLS back-to-back calls at TINY^3, beside the run's floors, torch's
`y.copy_(x)` and a bare Triton launch on FLOOR_N float32 elements (as copy/bench.py's).
"""

import functools
import json
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import torch_impl
import triton_impl

KERNEL = "gemm"
HERE = Path(__file__).resolve().parent
ALPHA, BETA = 1.0, 0.5  # C stays bounded over the repeated in-place calls
ROUNDS = 3
LAYOUT = "NN"  # A and B row-major, every row
TINY, CALLS, FLOOR_N = 64, 2000, 4096  # per-call rows: m = n = k, calls timed; the floors' n
# Operand sets a timed graph rotates through: 2.5x the H200's 50 MiB L2 in all, so that each
# call's A and B come from memory; at most MAX_COPIES (small shapes stay in L2 regardless).
ROTATE_BYTES, MAX_COPIES = 125 * 2**20, 16


def library_gemm(alpha, A, B, beta, C):
    return C.addmm_(A, B, beta=beta, alpha=alpha)


IMPLS = {"library": library_gemm, "torch": torch_impl.gemm, "triton": triton_impl.gemm}
STEPS = {}  # the CuTe lesson's steps, timed at STEP_CASES only
try:
    import cute_1_tiled
    import cute_2_tma_wgmma
    import cute_3_split_k
    import cute_4_staged
    import cute_impl

    IMPLS["cute"] = cute_impl.gemm
    STEPS = {
        "cute.step1": cute_1_tiled.gemm,
        "cute.step2": cute_2_tma_wgmma.gemm,
        "cute.step3": cute_3_split_k.gemm,
        "cute.step4": cute_4_staged.gemm,
    }
except ImportError as error:
    print(f"cute_impl is not measured: {error}")
SQUARES = [256, 512, 1024, 2048, 4096, 8192, 16384]
# (n, k) of a 7B-class layer's projections: q/k/v/o, gate and up, down, a wider MLP.
PROJECTIONS = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
SHAPES = [(s, s, s) for s in SQUARES] + [(16384, n, k) for n, k in PROJECTIONS]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The layouts and shapes a model calls, timed after the NN sweep: every layout at 8192^3
# (nn.Linear's forward is x @ W.T, NT; its backward NN and TN), the projections in NT at 4096
# and 16384 tokens, decode steps (1 to 128 tokens, NT), and a shape TMA cannot take as it is
# (k and n odd: rows off 16-byte boundaries).
MODEL_CASES = (
    [(dtype, layout, (8192,) * 3) for dtype in DTYPES[:2] for layout in ("NT", "TN", "TT")]
    + [(torch.bfloat16, "NT", (m, n, k)) for m in (4096, 16384) for n, k in PROJECTIONS]
    + [(torch.bfloat16, "NT", (m, n, k)) for m in (1, 16, 64, 128) for n, k in PROJECTIONS[:3]]
    + [(torch.bfloat16, "NN", (4097, 5121, 3079))]
)
# (dtype, layout, shape) where each step is timed beside cute: the cases of the step table.
# Step 1 takes bf16 8192^3 on the CUDA cores (about 20 ms a call); IEEE float32 runs step 1 in
# every step; step 3 changes the decode shapes only, step 4 the unaligned one.
STEP_CASES = {
    (torch.bfloat16, "NN", (4096, 4096, 4096)),
    (torch.bfloat16, "NN", (8192, 8192, 8192)),
    (torch.float32, "NN", (4096, 4096, 4096)),
    *((torch.bfloat16, "NT", (64, n, k)) for n, k in PROJECTIONS[:3]),
    (torch.bfloat16, "NN", (4097, 5121, 3079)),
}


def make_operands(m, n, k, dtype, layout=LAYOUT):
    """A, B in `layout` (T: that operand is the transpose of a contiguous matrix), C row-major."""

    def random(rows, cols, transposed=False):
        if transposed:
            return torch.randn(cols, rows, device="cuda").to(dtype).T
        return torch.randn(rows, cols, device="cuda").to(dtype)

    return random(m, k, layout[0] == "T"), random(k, n, layout[1] == "T"), random(m, n)


def operand_sets(m, n, k, dtype, layout):
    """COPIES sets of (A, B, C): enough that together they pass ROTATE_BYTES, at most MAX_COPIES."""
    one_set = (m * k + k * n + m * n) * dtype.itemsize
    copies = min(MAX_COPIES, -(-ROTATE_BYTES // one_set))
    return [make_operands(m, n, k, dtype, layout) for _ in range(copies)]


def gemm_call(gemm, operands):
    """One call of gemm on each operand set in turn."""

    def call():
        for A, B, C in operands:
            gemm(ALPHA, A, B, BETA, C)

    return call


def graph_ms(calls, copies, rep=40):
    """(ms of one gemm call, timing): `calls` (one call per operand set) captured in a CUDA
    graph whose replay is timed, divided by the sets. A call the capture refuses is timed
    eagerly, and `timing` says why."""
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # leaving it restores the stream even if the capture fails
        calls()  # compiles and allocates outside the capture
        try:
            with torch.cuda.graph(graph, stream=stream):
                calls()
        except Exception as error:
            reason = str(error).splitlines()[0][:80]
            return median_ms(calls, rep) / copies, f"eager: not capturable ({reason})"
    return median_ms(graph.replay, rep) / copies, "graph"


def median_ms(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def interleaved_ms(calls, copies):
    """{name: (ms, timing)}: the median over ROUNDS rounds of each call's `graph_ms`, every round
    in a rotated order, so that no implementation always runs first (cool) or last (hot)."""
    names = list(calls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            samples[name].append(graph_ms(calls[name], copies))
    return {
        name: (statistics.median(ms for ms, _ in runs), runs[-1][1])
        for name, runs in samples.items()
    }


@triton.jit
def bare_copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """The least a Triton launch can do: the floor under every Triton launcher's cost."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def per_call_us(calls):
    """{name: microseconds per call}: the wall time of CALLS back-to-back calls, the median of
    ROUNDS rounds in rotated order (the host path is what is timed: the GPU keeps up)."""
    names = list(calls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            calls[name]()  # compiled and loaded before the clock starts
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                calls[name]()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / CALLS * 1e6)
    return {name: statistics.median(us) for name, us in samples.items()}


def per_call_floors():
    """The run's floors: torch's y.copy_(x) and a bare Triton launch, on FLOOR_N float32s."""
    x, y = torch.randn(FLOOR_N, device="cuda"), torch.empty(FLOOR_N, device="cuda")
    return per_call_us({
        "torch_call_us": lambda: y.copy_(x),
        "triton_launch_us": lambda: bare_copy_kernel[(FLOOR_N // 1024,)](x, y, FLOOR_N, BLOCK=1024),
    })  # fmt: skip


def per_call_rows(dtype):
    """One row per implementation and the library op (torch.addmm): host_us at TINY^3."""
    A, B, C = make_operands(TINY, TINY, TINY, dtype)
    # One call each, not gemm_call's loop over operand sets: the loop's Python is not the op's.
    host = per_call_us(
        {name: functools.partial(f, ALPHA, A, B, BETA, C) for name, f in IMPLS.items()}
    )
    return [
        {"impl": impl, "dtype": str(dtype)[6:], "layout": LAYOUT, "shape": [TINY] * 3,
         "ms": None, "GBps": None, "TFLOPs": None, "pct_of_ceiling": None,
         "vs_library": host["library"] / us, "host_us": us}
        for impl, us in host.items()
    ]  # fmt: skip


def matmul_ceiling_tflops(size=8192):
    """torch.matmul on bfloat16 size^3: the rate of the matrix units as cuBLAS reaches it."""
    A = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.matmul(A, B))
    return 2 * size**3 / ms / 1e9


def plot_per_call(ax, rows, floors):
    """Bars of microseconds per call, per implementation and dtype, with the run's floors."""
    names = list(dict.fromkeys(r["impl"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    width = 0.8 / len(dtypes)
    for i, dtype in enumerate(dtypes):
        us = {r["impl"]: r["host_us"] for r in rows if r["dtype"] == dtype}
        ax.bar([j + width * i for j in range(len(names))], [us[n] for n in names], width,
               label=dtype)  # fmt: skip
    for (name, value), style in zip(floors.items(), ("--", ":"), strict=True):
        ax.axhline(value, color="gray", linestyle=style, label=name)
    ax.set_xticks([j + width * (len(dtypes) - 1) / 2 for j in range(len(names))], names)
    ax.set(ylabel="us per call", title=f"{KERNEL}: host cost per call, {TINY}^3, {LAYOUT}")
    ax.legend(fontsize=7)


def plot_model_cases(ax, rows):
    """Bars of x cuBLAS (torch.addmm's time / ours) for each of MODEL_CASES."""
    labels = [
        f"{str(d)[6:]} {layout} {'x'.join(map(str, shape))}" for d, layout, shape in MODEL_CASES
    ]
    names = [name for name in IMPLS if name != "library"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ratio = {
            (r["dtype"], r["layout"], tuple(r["shape"])): r["vs_library"]
            for r in rows
            if r["impl"] == name
        }
        values = [ratio[str(d)[6:], layout, shape] for d, layout, shape in MODEL_CASES]
        ax.bar([j + width * i for j in range(len(values))], values, width, label=name)
    ax.axhline(1.0, color="gray", linestyle="--", label="torch.addmm (cuBLAS)")
    ax.set_xticks(range(len(labels)), labels, rotation=75, fontsize=6)
    ax.set(ylabel="x torch.addmm", title=f"{KERNEL}: the layouts and shapes a model calls")
    ax.legend(fontsize=7)


def plot(rows, ceiling, floors, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(DTYPES) + 2
    widths = [1] * len(DTYPES) + [2.5, 1]  # the model-case panel has 27 cases side by side
    figure, axes = plt.subplots(1, panels, figsize=(6 * sum(widths), 5), width_ratios=widths)
    sweep = [r for r in rows if r["ms"] is not None and tuple(r["shape"]) in SHAPES]
    sweep = [r for r in sweep if r["layout"] == LAYOUT]
    labels = [f"{m}x{n}x{k}" for m, n, k in SHAPES]
    for ax, dtype in zip(axes, DTYPES, strict=False):
        if ax is not axes[0]:
            ax.sharey(axes[0])
        for impl in IMPLS:
            points = [r for r in sweep if r["impl"] == impl and r["dtype"] == str(dtype)[6:]]
            ax.plot(range(len(points)), [r["TFLOPs"] for r in points], "o-", label=impl)
        ax.axhline(ceiling, color="gray", linestyle="--", label="torch.matmul bf16 8192^3")
        ax.set(ylabel="TFLOP/s (2mnk)", title=f"{KERNEL}, {str(dtype)[6:]}, {LAYOUT}")
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend()
    plot_model_cases(axes[-2], [r for r in rows if r["ms"] is not None])
    plot_per_call(axes[-1], [r for r in rows if r["ms"] is None], floors)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def timed_rows(dtype, layout, shape, ceiling):
    """One row per implementation (and step, at STEP_CASES) for one case, timed interleaved."""
    m, n, k = shape
    operands = operand_sets(m, n, k, dtype, layout)
    steps = STEPS if (dtype, layout, shape) in STEP_CASES else {}
    rounds = IMPLS | {name: f for name, f in steps.items() if name != "cute.step1"}
    calls = {name: gemm_call(f, operands) for name, f in rounds.items()}
    times = interleaved_ms(calls, len(operands))
    # Step 1 is timed after the rounds: its CUDA-core kernel draws less power than the tensor
    # cores, and inside the rounds the clock it left high favoured whichever ran next (step 2
    # read 8% faster than the same kernel as cute at bf16 4096^3).
    if "cute.step1" in steps:
        step1 = gemm_call(steps["cute.step1"], operands)
        times["cute.step1"] = graph_ms(step1, len(operands))
    rows = []
    for impl, (ms, timing) in times.items():
        tflops = 2 * m * n * k / ms / 1e9
        rows.append(
            {"impl": impl, "dtype": str(dtype)[6:], "layout": layout, "shape": [m, n, k],
             "ms": ms, "GBps": None, "TFLOPs": tflops,
             "pct_of_ceiling": 100 * tflops / ceiling, "vs_library": times["library"][0] / ms,
             "timing": timing}
        )  # fmt: skip
        print(f"{impl:10s} {str(dtype)[6:]:9s} {layout} {m}x{n}x{k} {ms * 1e3:10.1f} us "
              f"{tflops:6.1f} TFLOP/s {100 * tflops / ceiling:5.1f}% "
              f"x{times['library'][0] / ms:.2f} vs torch.addmm {timing}")  # fmt: skip
    return rows


def main():
    ceiling, floors = matmul_ceiling_tflops(), per_call_floors()
    rows = []
    for dtype in DTYPES:
        rows += per_call_rows(dtype)
        for row in rows[-len(IMPLS) :]:
            print(f"{row['impl']:7s} {row['dtype']:9s} per call {row['host_us']:6.1f} us")
        for shape in SHAPES:
            rows += timed_rows(dtype, LAYOUT, shape, ceiling)
    for dtype, layout, shape in MODEL_CASES:
        rows += timed_rows(dtype, layout, shape, ceiling)
    results = {
        "device": torch.cuda.get_device_name(),
        "ceilings": {"bf16_matmul_TFLOPs": ceiling, **floors},
        "rows": rows,
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(rows, ceiling, floors, HERE / "perf.png")
    print(f"floors per call: torch {floors['torch_call_us']:.1f} us, Triton launch "
          f"{floors['triton_launch_us']:.1f} us")  # fmt: skip
    print(f"bf16 matmul ceiling {ceiling:.0f} TFLOP/s; wrote results.json and perf.png")


if __name__ == "__main__":
    main()
