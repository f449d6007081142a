"""Benchmark SwiGLU on the GPU, forward and forward+backward, against the anchors.

    python bench.py            writes results.json and perf.png beside this file
    python bench.py --quick    bf16 at Llama 3 8B's width, 16384 and 32768 tokens, no files
    python bench.py --quick --dtype float32 --tiles 4096x4,4096x8,2048x8
        float32 (or bfloat16, the default of --quick) with Triton rows `triton.4096x8` beside
        `triton` for each (tile elements)x(warps) given, used by both passes of that dtype

Minimal traffic: the forward reads g and u and writes y (3MN elements); the backward reads g, u
and dy and writes dg and du (5MN), so fwd+bwd counts 8MN. g and u are two (M, N) tensors, the
form every anchor takes. Times are medians of `triton.testing.do_bench` (the L2 cache flushed
before each call) of each pass captured in a CUDA graph and replayed: the kernels' time (timed
call by call, fwd+bwd was host-bound wherever its GPU work was under ~0.5 ms; the per-call rows
measure the host). A call that cannot be captured is timed eagerly, and its row's `timing` says
why. Implementations are interleaved shape by shape. The ceiling is a 1 GiB device-to-device
copy of the same run. The library op is `F.silu(g) * u` (fwd+bwd: its autograd). Anchors, when
importable: torch.compile of the library expression (inductor's fused kernel; its result checked
first) and Liger's LigerSiLUMulFunction; a missing one prints why.
The per-call floors of the same run (`call_floors_us`: torch's `y.copy_(x)` and a bare Triton
launch on 4096 float32) go into results.json's ceilings beside the per-call rows.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import torch_impl
import triton_impl

HERE = Path(__file__).resolve().parent
# Intermediate widths N of Llama 3 8B (14336), Llama 2 7B (11008) and Llama 3 70B (28672), at a
# 4096-token batch and at 32768 tokens (fills the chip many times); the DESIGN anchors' 16384
# tokens; a narrow 4096; a decode step.
SHAPES = [
    (4096, 14336), (32768, 14336), (16384, 14336), (4096, 11008), (32768, 11008),
    (4096, 28672), (32768, 28672), (32768, 4096), (32, 14336),
]  # fmt: skip
QUICK_SHAPES = [(16384, 14336), (32768, 14336)]  # the DESIGN anchor and the chip filled
DTYPES = [torch.bfloat16, torch.float32]
TINY_SHAPE, CALLS, ROUNDS = (4, 1024), 1000, 3  # per-call rows


def library(g, u):
    return F.silu(g) * u


def with_tile(tile):
    """triton_impl.swiglu with `tile` ((elements, warps), or None for triton_impl's own) in
    both passes of the operands' dtype. The backward reads TILES when autograd runs it, after
    the forward returns: each Triton row sets the table before its call."""
    defaults = dict(triton_impl.TILES)

    def forward(g, u):
        for direction in ("forward", "backward"):
            key = (direction, g.element_size())
            triton_impl.TILES[key] = tile or defaults[key]
        return triton_impl.swiglu(g, u)

    return forward


def implementations(tiles=()):
    """{impl: differentiable forward(g, u) -> y}, anchors included where importable, and a
    Triton row per tile candidate."""
    # Without candidates "triton" is the plain call, so its per-call row times nothing else.
    triton_row = with_tile(None) if tiles else triton_impl.swiglu
    impls = {"library": library, "torch": torch_impl.swiglu, "triton": triton_row}
    impls.update({f"triton.{elems}x{warps}": with_tile((elems, warps)) for elems, warps in tiles})
    try:
        import cute_impl

        impls["cute"] = cute_impl.swiglu
    except ImportError as error:
        print(f"cute is not measured: {error}")
    # What a user compiles: the library expression, which inductor fuses into one kernel per
    # pass (torch_impl.swiglu is an autograd.Function over out= calls: nothing to fuse).
    impls["compile"] = torch.compile(library)
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        impls["liger"] = LigerSiLUMulFunction.apply
    except ImportError as error:
        print(f"liger is not measured: {error}")
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


@triton.jit
def bare_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """The least a Triton launch can do: the floor under every Triton launcher's per-call cost."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def call_floors_us():
    """The per-call floors of this run (DESIGN.md, "Per-call cost"), us a back-to-back call on
    4096 float32: torch's y.copy_(x) and a bare Triton launch."""
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    launch = lambda: bare_copy[(4,)](x, y, 4096, BLOCK=1024)  # noqa: E731
    return {"torch_call_us": wall_us(lambda: y.copy_(x)), "triton_launch_us": wall_us(launch)}


def wall_us(fn):
    """Wall time of one of CALLS back-to-back calls of fn, us."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def timed_passes(forward, g, u, dy):
    """((fwd ms, fwd+bwd ms), their timings) of a differentiable forward; the anchor must
    agree with torch. The backward gets copies of g and u: Liger's writes its gradients over
    the saved inputs."""
    g_grad, u_grad = (t.detach().clone().requires_grad_() for t in (g, u))
    expected = library(g.float(), u.float())
    got = forward(g, u).float()
    if not torch.allclose(got, expected, atol=5e-2, rtol=2e-2):  # a sanity check, not the bound
        raise RuntimeError(f"wrong result (largest error {(got - expected).abs().max():.3g})")
    fwd = graph_ms(lambda: forward(g, u))

    def forward_backward():
        g_grad.grad = u_grad.grad = None
        forward(g_grad, u_grad).backward(dy)

    both = graph_ms(forward_backward)
    return (fwd[0], both[0]), (fwd[1], both[1])


def per_call_rows(impls, dtype):
    """host_us: wall time of back-to-back forward calls at TINY_SHAPE, rounds rotated."""
    g, u = (torch.randn(*TINY_SHAPE, device="cuda", dtype=dtype) for _ in range(2))
    names = list(impls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            samples[name].append(wall_us(lambda name=name: impls[name](g, u)))
    host = {name: statistics.median(us) for name, us in samples.items()}
    return [
        {"impl": impl, "pass": "fwd", "dtype": str(dtype)[6:], "shape": list(TINY_SHAPE),
         "ms": None, "GBps": None, "TFLOPs": None, "pct_of_ceiling": None,
         "vs_library": host["library"] / us, "host_us": us}
        for impl, us in host.items()
    ]  # fmt: skip


def shape_rows(impls, dtype, shape, ceiling):
    m, n = shape
    g, u, dy = (torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(3))
    times, timings = {}, {}
    for name, forward in impls.items():
        try:
            times[name], timings[name] = timed_passes(forward, g, u, dy)
        except Exception as error:  # an anchor that refuses a shape or a dtype
            print(f"{name:8s} {str(dtype)[6:]:9s} {m}x{n}: skipped ({type(error).__name__}: "
                  f"{str(error)[:80]})")  # fmt: skip
    rows = []
    for name, (fwd_ms, both_ms) in times.items():
        # fwd: g, u, y; fwd+bwd adds g, u, dy, dg and du
        for pass_name, ms, elements in (("fwd", fwd_ms, 3 * m * n),
                                        ("fwd+bwd", both_ms, 8 * m * n)):  # fmt: skip
            gbps = elements * g.element_size() / ms / 1e6
            library_ms = times.get("library", (None, None))[pass_name == "fwd+bwd"]
            timing = timings[name][pass_name == "fwd+bwd"]
            rows.append(
                {"impl": name, "pass": pass_name, "dtype": str(dtype)[6:], "shape": [m, n],
                 "ms": ms, "GBps": gbps, "TFLOPs": None, "pct_of_ceiling": 100 * gbps / ceiling,
                 "vs_library": library_ms / ms if library_ms else None,
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
    figure, axes = plt.subplots(len(panels), 1, figsize=(12, 4 * len(panels)))
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
        ax.set(ylabel="% of copy bandwidth (minimal bytes)", title=f"swiglu {pass_name}, {dtype}")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(quick=False, dtypes=None, tiles=()):
    ceiling, impls, rows = copy_ceiling_gbps(), implementations(tiles), []
    floors = call_floors_us()
    for dtype in dtypes or (DTYPES[:1] if quick else DTYPES):
        if not quick:
            rows += per_call_rows(impls, dtype)
        for shape in QUICK_SHAPES if quick else SHAPES:
            rows += shape_rows(impls, dtype, shape, ceiling)
            torch.cuda.empty_cache()  # 32768x28672 float32 operands are 3.8 GB each
    print(f"copy ceiling {ceiling:.0f} GB/s; per call: torch {floors['torch_call_us']:.1f} us, "
          f"Triton launch {floors['triton_launch_us']:.1f} us")  # fmt: skip
    ceilings = {"copy_GBps": ceiling, **floors}
    results = {"device": torch.cuda.get_device_name(), "ceilings": ceilings, "rows": rows}
    if not quick:
        (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(rows, HERE / "perf.png")
    return results


def arguments(argv):
    """(quick, dtypes or None, tile candidates) from the command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", action="append", choices=[str(d)[6:] for d in DTYPES])
    parser.add_argument("--tiles", default="", help="comma-separated ELEMSxWARPS, e.g. 2048x8")
    args = parser.parse_args(argv)
    tiles = [tuple(int(v) for v in c.split("x")) for c in args.tiles.split(",") if c]
    dtypes = [getattr(torch, name) for name in args.dtype] if args.dtype else None
    return args.quick, dtypes, tiles


if __name__ == "__main__":
    main(*arguments(sys.argv[1:]))
