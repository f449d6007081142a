"""Benchmark softmax on the GPU, forward and forward+backward, against the anchors.

    python bench.py            writes results.json and perf.png beside this file
    python bench.py --quick    the two large shapes only, no files (the GPU probe)
    python bench.py --quick 8192x131072    the named shapes only, no files

Minimal traffic: the forward reads x and writes y (2MN elements); the backward reads y and dy
and writes dx (3MN), so fwd+bwd counts 5MN. Times are medians over ROUNDS rounds of
`triton.testing.do_bench` (the L2 cache flushed before each call) of each pass captured in a
CUDA graph and replayed: the kernels' time (timed call by call, fwd+bwd was host-bound wherever
its GPU work was under ~0.5 ms; the per-call rows measure the host). A call that cannot be
captured is timed eagerly, and its row's `timing` says why. Each round runs the implementations
in a rotated order (the clock follows power and temperature, so a fixed order favours whichever
runs first). Ceilings of the same run: a 1 GiB device-to-device copy, and the per-call floors
(torch's `y.copy_(x)` and a bare Triton launch on 4096 elements). The library op is
torch.softmax (fwd+bwd: its autograd). Where CuTe's step 2 (the row held on chip) takes a shape,
step 1 (two passes) is timed beside it as `cute.step1`. Anchors, when importable: torch.compile
of torch.softmax (inductor's fused kernel; its result checked first), Liger's and QuACK's
softmax; a missing one prints why.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import torch_impl
import triton_impl

HERE = Path(__file__).resolve().parent
# The two anchor shapes of DESIGN.md first (the quick run), then the rest of issue 14's M = 32768
# sweep (N = 1024 ... 32768), a 32k vocabulary at a 4096-token batch and two decode steps.
SHAPES = [(32768, 8192), (8192, 131072), (32768, 4096), (4096, 32000), (1, 32000), (1, 131072),
          (32768, 1024), (32768, 16384), (32768, 32768)]  # fmt: skip
QUICK_SHAPES = SHAPES[:2]
DTYPES = [torch.bfloat16, torch.float32]
TINY_SHAPE, CALLS, ROUNDS = (4, 1024), 1000, 3  # per-call rows; rounds of every timing


def implementations():
    """{impl: differentiable forward(x) -> y}, anchors included where importable."""
    impls = {
        "library": lambda x: torch.softmax(x, -1),
        "torch": torch_impl.softmax,
        "triton": triton_impl.softmax,
    }
    try:
        import cute_impl

        impls["cute"] = cute_impl.softmax
        impls["cute.step1"] = two_pass_only(cute_impl)
    except ImportError as error:
        print(f"cute is not measured: {error}")
    # What a user compiles: the library op, which inductor turns into its own fused kernel
    # (torch_impl's functions are an autograd.Function over out= calls: nothing to fuse).
    impls["compile"] = torch.compile(lambda x: torch.softmax(x, -1))
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction

        impls["liger"] = LigerSoftmaxFunction.apply
    except ImportError as error:
        print(f"liger is not measured: {error}")
    try:
        from quack.softmax import softmax as quack_softmax

        impls["quack"] = quack_softmax
    except ImportError as error:
        print(f"quack is not measured: {error}")
    return impls


def two_pass_only(cute_impl):
    """CuTe's softmax with step 2 (the row held on chip) switched off in both passes: step 1's
    forward and backward, each a call with cute_impl.kernel_plan answering None (the backward
    runs when autograd calls it, so switching around the forward alone would time step 2's)."""
    choose = cute_impl.kernel_plan

    def step1(launch):
        def call(*operands):
            cute_impl.kernel_plan = lambda direction, n, dtype: None
            try:
                return launch(*operands)
            finally:
                cute_impl.kernel_plan = choose

        return call

    function = torch_impl.autograd_function(
        step1(cute_impl.softmax_forward), step1(cute_impl.softmax_backward)
    )

    def softmax(x):
        return function.apply(x)

    # Timed only where step 2 differs: a shape step 2 takes, forward or backward.
    softmax.takes = lambda n: any(choose(d, n, torch.float32) for d in ("forward", "backward"))
    return softmax


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def graph_ms(fn):
    """(median ms, timing) of fn, replayed as one captured CUDA graph: the figure is the
    kernels' time. Timed call by call, a pass whose host work (Python, the autograd engine)
    outlasts its kernels would time the host, which the per-call rows measure on their own. A
    call that waits on the host (it reads a value) cannot be captured: timed eagerly, it says why.
    """
    stream, graph, timing = torch.cuda.Stream(), torch.cuda.CUDAGraph(), "graph"
    stream.wait_stream(torch.cuda.current_stream())
    # Warm-up (compiles, autotunes, allocates) and capture on one side stream: autograd runs a
    # backward op on its forward's stream, and leaving the block restores the caller's stream
    # even when a failed capture skips torch.cuda.graph's own restore.
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        try:
            with torch.cuda.graph(graph, stream=stream):
                fn()
        except Exception as error:  # fn ran eagerly just above: this is the capture's refusal
            timing = f"eager: not capturable ({str(error).splitlines()[0][:80]})"
    return median_ms(graph.replay if timing == "graph" else fn), timing


def copy_ceiling_gbps():
    source = torch.randn(2**28, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.nbytes / median_ms(lambda: target.copy_(source)) / 1e6


@triton.jit
def bare_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def call_floors_us():
    """(torch's y.copy_(x), a bare Triton launch) on 4096 float32, us a back-to-back call."""
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    return tuple(
        wall_us(fn) for fn in (lambda: y.copy_(x), lambda: bare_copy[(4,)](x, y, 4096, BLOCK=1024))
    )


def wall_us(fn):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def timed_passes(forward, x, dy):
    """((fwd ms, fwd+bwd ms), their timings) of a differentiable forward; the anchor must
    agree with torch."""
    x_grad = x.detach().requires_grad_()
    expected = torch.softmax(x.float(), -1)
    got = forward(x).float()
    if not torch.allclose(got, expected, atol=1e-2, rtol=0):  # a sanity check, not the bound
        raise RuntimeError(f"wrong result (largest error {(got - expected).abs().max():.3g})")
    fwd = graph_ms(lambda: forward(x))

    def forward_backward():
        x_grad.grad = None
        forward(x_grad).backward(dy)

    both = graph_ms(forward_backward)
    return (fwd[0], both[0]), (fwd[1], both[1])


def per_call_rows(impls, dtype):
    """host_us: wall time of back-to-back forward calls at TINY_SHAPE, rounds rotated."""
    x = torch.randn(*TINY_SHAPE, device="cuda", dtype=dtype)
    names = [name for name in impls if not hasattr(impls[name], "takes")]
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            samples[name].append(wall_us(lambda name=name: impls[name](x)))
    host = {name: statistics.median(us) for name, us in samples.items()}
    return [
        {"impl": impl, "pass": "fwd", "dtype": str(dtype)[6:], "shape": list(TINY_SHAPE),
         "ms": None, "GBps": None, "TFLOPs": None, "pct_of_ceiling": None,
         "vs_library": host["library"] / us, "host_us": us}
        for impl, us in host.items()
    ]  # fmt: skip


def shape_rows(impls, dtype, shape, ceiling):
    m, n = shape
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    dy = torch.randn(m, n, device="cuda", dtype=dtype)
    names = [name for name in impls if getattr(impls[name], "takes", lambda n: True)(n)]
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            if name not in samples:
                continue  # refused the shape in an earlier round
            try:
                samples[name].append(timed_passes(impls[name], x, dy))
            except Exception as error:  # an anchor that refuses a shape (Liger past N = 65536)
                print(f"{name:10s} {str(dtype)[6:]:9s} {m}x{n}: skipped ({type(error).__name__}: "
                      f"{str(error)[:80]})")  # fmt: skip
                del samples[name]
    times = {
        name: tuple(statistics.median(ms[i] for ms, _ in runs) for i in range(2))
        for name, runs in samples.items()
    }
    timings = {name: runs[0][1] for name, runs in samples.items()}
    rows = []
    for name, (fwd_ms, both_ms) in times.items():
        for pass_name, ms, elements in (("fwd", fwd_ms, 2), ("fwd+bwd", both_ms, 5)):
            gbps = elements * m * n * x.element_size() / ms / 1e6
            library = times.get("library", (None, None))[pass_name == "fwd+bwd"]
            timing = timings[name][pass_name == "fwd+bwd"]
            rows.append(
                {"impl": name, "pass": pass_name, "dtype": str(dtype)[6:], "shape": [m, n],
                 "ms": ms, "GBps": gbps, "TFLOPs": None, "pct_of_ceiling": 100 * gbps / ceiling,
                 "vs_library": library / ms if library else None,
                 "timing": timing}
            )  # fmt: skip
            print(f"{name:10s} {str(dtype)[6:]:9s} {m}x{n} {pass_name:7s} {ms * 1e3:9.1f} us "
                  f"{gbps:6.0f} GB/s {100 * gbps / ceiling:5.1f}% of copy {timing}")  # fmt: skip
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["ms"] is not None]
    panels = [(d, p) for d in ("bfloat16", "float32") for p in ("fwd", "fwd+bwd")]
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5))
    labels = [f"{m}x{n}" for m, n in SHAPES]
    for ax, (dtype, pass_name) in zip(axes, panels, strict=True):
        names = list(dict.fromkeys(r["impl"] for r in timed))
        for k, name in enumerate(names):
            mine = [
                r for r in timed if (r["impl"], r["dtype"], r["pass"]) == (name, dtype, pass_name)
            ]
            pct = {"{}x{}".format(*r["shape"]): r["pct_of_ceiling"] for r in mine}
            width = 1 / (len(names) + 1)
            bars = [pct.get(label, 0) for label in labels]
            ax.bar([i + k * width for i in range(len(labels))], bars, width, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=30)
        ax.set(ylabel="% of copy bandwidth (minimal bytes)", title=f"softmax {pass_name}, {dtype}")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(quick=False, quick_shapes=QUICK_SHAPES):
    ceiling, impls, rows = copy_ceiling_gbps(), implementations(), []
    torch_call_us, triton_launch_us = call_floors_us()
    ceilings = {"copy_GBps": ceiling, "torch_call_us": torch_call_us,
                "triton_launch_us": triton_launch_us}  # fmt: skip
    results = {"device": torch.cuda.get_device_name(), "ceilings": ceilings, "rows": rows}
    for dtype in DTYPES:
        if not quick:
            rows += per_call_rows(impls, dtype)
        for shape in quick_shapes if quick else SHAPES:
            rows += shape_rows(impls, dtype, shape, ceiling)
            if not quick:  # written as it grows: a run stopped part-way keeps what it measured
                (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"copy ceiling {ceiling:.0f} GB/s; per call: torch {torch_call_us:.1f} us, "
          f"Triton launch {triton_launch_us:.1f} us")  # fmt: skip
    if not quick:
        plot(rows, HERE / "perf.png")
    return results


if __name__ == "__main__":
    named = [tuple(int(size) for size in arg.split("x")) for arg in sys.argv[1:] if "x" in arg]
    main(quick="--quick" in sys.argv, quick_shapes=named or QUICK_SHAPES)
