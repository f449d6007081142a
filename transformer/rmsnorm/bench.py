"""Benchmark RMSNorm on the GPU, forward and forward+backward, against the anchors.

    python bench.py            writes results.json and perf.png beside this file
    python bench.py --quick    bf16 and float32 at the two headline shapes only, no files

Minimal traffic: the forward reads x and writes y (2MN elements); the backward reads x and dy
and writes dx (3MN); the weight and dweight (N each) are counted too. Times are medians of
`triton.testing.do_bench` (the L2 cache flushed before each call) of each pass captured in a
CUDA graph and replayed: the kernels' time (timed call by call, fwd+bwd was host-bound wherever
its GPU work was under ~0.5 ms; the per-call rows measure the host). A call that cannot be
captured is timed eagerly, and its row's `timing` says why. Implementations are interleaved
shape by shape. The ceiling is a 1 GiB device-to-device copy of the same run. The library op is
torch.nn.functional.rms_norm (fwd+bwd: its autograd). Anchors, when importable: torch.compile of
the library op (inductor's fused kernel; its result checked first), Liger's and QuACK's RMSNorm;
a missing one prints why. The weight is x's dtype (what Liger and QuACK take).
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

import torch_impl
import triton_impl

HERE = Path(__file__).resolve().parent
EPS = 1e-6
# Llama 8B / 70B hidden sizes at a 4096-token batch and at 32768 rows (fills the chip), a
# decode step, and 405B's 16384.
SHAPES = [(32768, 4096), (32768, 8192), (4096, 4096), (4096, 16384), (32768, 1024), (32, 8192)]
QUICK_SHAPES = SHAPES[:2]
DTYPES = [torch.bfloat16, torch.float32]
TINY_SHAPE, CALLS, ROUNDS = (4, 1024), 1000, 3  # per-call rows


def implementations():
    """{impl: differentiable forward(x, weight) -> y}, anchors included where importable."""
    impls = {
        "library": lambda x, w: torch.nn.functional.rms_norm(x, x.shape[-1:], w, EPS),
        "torch": lambda x, w: torch_impl.rmsnorm(x, w, EPS),
        "triton": lambda x, w: triton_impl.rmsnorm(x, w, EPS),
    }
    try:
        import cute_impl

        impls["cute"] = lambda x, w: cute_impl.rmsnorm(x, w, EPS)
    except ImportError as error:
        print(f"cute is not measured: {error}")
    # What a user compiles: the library op, which inductor turns into its own fused kernel
    # (torch_impl.rmsnorm is an autograd.Function over out= calls: nothing to fuse).
    impls["compile"] = torch.compile(
        lambda x, w: torch.nn.functional.rms_norm(x, x.shape[-1:], w, EPS)
    )
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        impls["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)
    except ImportError as error:
        print(f"liger is not measured: {error}")
    try:
        from quack.rmsnorm import rmsnorm as quack_rmsnorm

        impls["quack"] = lambda x, w: quack_rmsnorm(x, w, eps=EPS)
    except ImportError as error:
        print(f"quack is not measured: {error}")
    return impls


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


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


def timed_passes(forward, x, weight, dy):
    """((fwd ms, fwd+bwd ms), their timings) of a differentiable forward; the anchor must
    agree with torch."""
    x_grad, w_grad = x.detach().requires_grad_(), weight.detach().requires_grad_()
    expected = torch.nn.functional.rms_norm(x.float(), x.shape[-1:], weight.float(), EPS)
    got = forward(x, weight).float()
    if not torch.allclose(got, expected, atol=5e-2, rtol=2e-2):  # a sanity check, not the bound
        raise RuntimeError(f"wrong result (largest error {(got - expected).abs().max():.3g})")
    fwd = graph_ms(lambda: forward(x, weight))

    def forward_backward():
        x_grad.grad = w_grad.grad = None
        forward(x_grad, w_grad).backward(dy)

    both = graph_ms(forward_backward)
    return (fwd[0], both[0]), (fwd[1], both[1])


def per_call_rows(impls, dtype):
    """host_us: wall time of back-to-back forward calls at TINY_SHAPE, rounds rotated."""
    x = torch.randn(*TINY_SHAPE, device="cuda", dtype=dtype)
    weight = torch.ones(TINY_SHAPE[1], device="cuda", dtype=dtype)
    names = list(impls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            impls[name](x, weight)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                impls[name](x, weight)
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / CALLS * 1e6)
    host = {name: statistics.median(us) for name, us in samples.items()}
    return [
        {"impl": impl, "pass": "fwd", "dtype": str(dtype)[6:], "shape": list(TINY_SHAPE),
         "ms": None, "GBps": None, "TFLOPs": None, "pct_of_ceiling": None,
         "vs_library": host["library"] / us, "host_us": us}
        for impl, us in host.items()
    ]  # fmt: skip


def shape_rows(impls, dtype, shape, ceiling):
    m, n = shape
    x, dy = (torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
    times, timings = {}, {}
    for name, forward in impls.items():
        try:
            times[name], timings[name] = timed_passes(forward, x, weight, dy)
        except Exception as error:  # an anchor that refuses a shape or a dtype
            print(f"{name:8s} {str(dtype)[6:]:9s} {m}x{n}: skipped ({type(error).__name__}: "
                  f"{str(error)[:80]})")  # fmt: skip
    rows = []
    for name, (fwd_ms, both_ms) in times.items():
        # fwd: x, y and the weight; fwd+bwd adds x, dy, dx, the weight and dweight
        for pass_name, ms, elements in (("fwd", fwd_ms, 2 * m * n + n),
                                        ("fwd+bwd", both_ms, 5 * m * n + 3 * n)):  # fmt: skip
            gbps = elements * x.element_size() / ms / 1e6
            library = times.get("library", (None, None))[pass_name == "fwd+bwd"]
            timing = timings[name][pass_name == "fwd+bwd"]
            rows.append(
                {"impl": name, "pass": pass_name, "dtype": str(dtype)[6:], "shape": [m, n],
                 "ms": ms, "GBps": gbps, "TFLOPs": None, "pct_of_ceiling": 100 * gbps / ceiling,
                 "vs_library": library / ms if library else None,
                 "timing": timing}
            )  # fmt: skip
            print(f"{name:8s} {str(dtype)[6:]:9s} {m}x{n} {pass_name:7s} {ms * 1e3:9.1f} us "
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
    names = list(dict.fromkeys(r["impl"] for r in timed))
    width = 1 / (len(names) + 1)
    for ax, (dtype, pass_name) in zip(axes, panels, strict=True):
        for k, name in enumerate(names):
            mine = [
                r for r in timed if (r["impl"], r["dtype"], r["pass"]) == (name, dtype, pass_name)
            ]
            pct = {"{}x{}".format(*r["shape"]): r["pct_of_ceiling"] for r in mine}
            bars = [pct.get(label, 0) for label in labels]
            ax.bar([i + k * width for i in range(len(labels))], bars, width, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=30)
        ax.set(ylabel="% of copy bandwidth (minimal bytes)", title=f"rmsnorm {pass_name}, {dtype}")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(quick=False):
    ceiling, impls, rows = copy_ceiling_gbps(), implementations(), []
    for dtype in DTYPES:
        if not quick:
            rows += per_call_rows(impls, dtype)
        for shape in QUICK_SHAPES if quick else SHAPES:
            rows += shape_rows(impls, dtype, shape, ceiling)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    results = {"device": torch.cuda.get_device_name(), "ceilings": {"copy_GBps": ceiling},
               "rows": rows}  # fmt: skip
    if not quick:
        (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(rows, HERE / "perf.png")
    return results


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
