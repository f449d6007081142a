"""Benchmark layernorm on the GPU, forward and forward+backward, against the anchors.

    python bench.py            writes results.json and perf.png beside this file
    python bench.py --quick    two shapes only, no files (the GPU probe)

Minimal traffic: the forward reads x and writes y (2MN elements, plus w and b); the backward
reads x and dy and writes dx (3MN, plus w, dw and db), so fwd+bwd counts 5MN. Times are medians
of `triton.testing.do_bench` (the L2 cache flushed before each call) of each pass captured in a
CUDA graph and replayed: the kernels' time (timed call by call, fwd+bwd was host-bound wherever
its GPU work was under ~0.5 ms; the per-call rows measure the host). A call that cannot be
captured is timed eagerly, and its row's `timing` says why. Implementations are interleaved
shape by shape. The ceiling is a 1 GiB device-to-device copy of the same run. The library op is
torch.nn.functional.layer_norm (fwd+bwd: its autograd). Anchors, when importable: torch.compile
of the library op (inductor's fused kernel; its result checked first), Liger's and QuACK's
layernorm (QuACK with float32 weight and bias, which it requires); a missing one prints why.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import torch_impl
import triton_impl

HERE = Path(__file__).resolve().parent
M = 32768
SHAPES = [(M, 1024), (M, 4096), (M, 8192), (M, 16384), (M, 32768), (4096, 4096), (1, 4096)]
QUICK_SHAPES = [(M, 4096), (M, 8192)]
DTYPES = [torch.bfloat16, torch.float32]
EPS = 1e-5
TINY_SHAPE, CALLS, ROUNDS = (4, 1024), 1000, 3  # per-call rows


def implementations():
    """{impl: differentiable forward(x, w, b) -> y}, anchors included where importable."""
    impls = {
        "library": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS),
        "torch": lambda x, w, b: torch_impl.layernorm(x, w, b, EPS),
        "triton": lambda x, w, b: triton_impl.layernorm(x, w, b, EPS),
    }
    try:
        import cute_impl

        impls["cute"] = lambda x, w, b: cute_impl.layernorm(x, w, b, EPS)
    except ImportError as error:
        print(f"cute is not measured: {error}")
    # What a user compiles: the library op, which inductor turns into its own fused kernel
    # (torch_impl.layernorm is an autograd.Function over out= calls: nothing to fuse).
    impls["compile"] = torch.compile(lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS))
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        impls["liger"] = lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)
    except ImportError as error:
        print(f"liger is not measured: {error}")
    try:
        from quack.layernorm import layernorm as quack_layernorm

        impls["quack"] = lambda x, w, b: quack_layernorm(x, w.float(), b.float(), eps=EPS)
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


def timed_passes(forward, x, w, b, dy):
    """((fwd ms, fwd+bwd ms), their timings) of a differentiable forward; the anchor must
    agree with torch."""
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    expected = F.layer_norm(x.float(), x.shape[-1:], w.float(), b.float(), EPS)
    got = forward(x, w, b).float()
    if not torch.allclose(got, expected, atol=1e-2, rtol=2**-7):  # a sanity check, not the bound
        raise RuntimeError(f"wrong result (largest error {(got - expected).abs().max():.3g})")
    fwd = graph_ms(lambda: forward(x, w, b))

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        forward(*leaves).backward(dy)

    both = graph_ms(forward_backward)
    return (fwd[0], both[0]), (fwd[1], both[1])


def per_call_rows(impls, dtype):
    """host_us: wall time of back-to-back forward calls at TINY_SHAPE, rounds rotated."""
    x = torch.randn(*TINY_SHAPE, device="cuda", dtype=dtype)
    w, b = torch.ones(x.shape[-1:], device="cuda", dtype=dtype), torch.zeros_like(x[0])
    names = list(impls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            impls[name](x, w, b)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                impls[name](x, w, b)
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
    w, b = (1 + torch.randn(n, device="cuda")).to(dtype), torch.randn(n, device="cuda").to(dtype)
    times, timings = {}, {}
    for name, forward in impls.items():
        try:
            times[name], timings[name] = timed_passes(forward, x, w, b, dy)
        except Exception as error:  # an anchor that refuses a shape or a dtype
            print(f"{name:8s} {str(dtype)[6:]:9s} {m}x{n}: skipped ({type(error).__name__}: "
                  f"{str(error)[:80]})")  # fmt: skip
    rows, size = [], x.element_size()
    traffic = {"fwd": (2 * m * n + 2 * n) * size, "fwd+bwd": (5 * m * n + 6 * n) * size}
    for name, (fwd_ms, both_ms) in times.items():
        for pass_name, ms in (("fwd", fwd_ms), ("fwd+bwd", both_ms)):
            nbytes = traffic[pass_name]
            gbps = nbytes / ms / 1e6
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
            pct = {"{}x{}".format(*r["shape"]): r["pct_of_ceiling"] for r in timed
                   if (r["impl"], r["dtype"], r["pass"]) == (name, dtype, pass_name)}  # fmt: skip
            bars = [pct.get(label, 0) for label in labels]
            ax.bar([i + k * width for i in range(len(labels))], bars, width, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=30)
        ax.set(
            ylabel="% of copy bandwidth (minimal bytes)", title=f"layernorm {pass_name}, {dtype}"
        )
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
