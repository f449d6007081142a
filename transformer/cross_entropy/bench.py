"""Benchmark cross-entropy on the GPU, forward and forward+backward, against the anchors.

    python bench.py            writes results.json and perf.png beside this file
    python bench.py --quick    bf16 at the two headline shapes only, no files
    python bench.py --headline both dtypes at the two headline shapes, per-call rows; files

Minimal traffic: the forward reads the MV logits (the M targets, losses and lse are noise);
fwd+bwd counts 3MV, the forward's read, the backward's read and its write of dx (DESIGN.md's
count for the anchors). A kernel that writes dx inside the forward (Liger, QuACK, our `triton`
row: the loss is the graph's last op) moves 2MV to 3MV, as L2 keeps the row, and can show
more than 100%; `triton.unfused` is the forward and backward kernels apart. Times are medians of
`triton.testing.do_bench` (L2 flushed before each call) of each pass captured in a CUDA graph
and replayed: the kernels' time (timed call by call, fwd+bwd was host-bound wherever its GPU
work was under ~0.5 ms; the per-call rows measure the host). A call that cannot be captured is
timed eagerly, and its row's `timing` says why. Implementations are interleaved shape by shape.
The ceiling is a 1 GiB device-to-device copy of the same run. The library op is
`F.cross_entropy` (mean over rows; fwd+bwd: its autograd). Anchors, when importable:
torch.compile of the library op (its result checked first), Liger's LigerCrossEntropyFunction,
QuACK's cross_entropy; a missing one prints why. Every call of ours reads the targets once on
the host side (Triton: `kept_rows`, one kernel and an 8-byte read; torch and CuTe:
reference.check_forward), which the per-call rows include; a sync, it keeps their passes out
of a graph (timed eagerly).
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
# (M tokens, V vocabulary): DESIGN.md's anchor shape and a 32k vocabulary at 32k tokens; then a
# sweep for perf.png: Llama 2 (32000), Llama 3 (128256), Qwen 2 (151936) and Gemma (262144)
# vocabularies at a 4096-token batch, 16384 x 65536, and a decode step.
SHAPES = [
    (8192, 131072), (32768, 32768), (4096, 32000), (4096, 128256), (4096, 151936),
    (4096, 262144), (16384, 65536), (32, 128256),
]  # fmt: skip
QUICK_SHAPES = SHAPES[:2]
DTYPES = [torch.bfloat16, torch.float32]
TINY_SHAPE, CALLS, ROUNDS = (4, 1024), 1000, 3  # per-call rows


def liger_loss():
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    def loss(logits, target):
        out = LigerCrossEntropyFunction.apply(logits, target, None)  # no class weights
        return out[0] if isinstance(out, tuple) else out  # newer versions add the z-loss

    return loss


def quack_loss():
    from quack.cross_entropy import cross_entropy

    def loss(logits, target):
        out = cross_entropy(logits, target)
        return out if out.dim() == 0 else out.mean()  # some versions return the row losses

    return loss


def triton_unfused(logits, target):
    return triton_impl.CrossEntropyFunction.apply(logits, target, -100, 0.0, "mean", False)


def implementations():
    """{impl: differentiable loss(logits, target) -> mean}, anchors included where importable."""
    impls = {"library": F.cross_entropy, "torch": torch_impl.cross_entropy}
    # triton: the fused forward+backward when a gradient is wanted (README.md, "The fused
    # path"); triton.unfused: the lesson's first step, forward and backward kernels apart (its
    # fwd is the same kernel as triton's).
    impls["triton"] = triton_impl.cross_entropy
    impls["triton.unfused"] = triton_unfused
    try:
        import cute_impl

        impls["cute"] = cute_impl.cross_entropy
    except ImportError as error:
        print(f"cute is not measured: {error}")
    impls["compile"] = torch.compile(F.cross_entropy)
    for name, make in (("liger", liger_loss), ("quack", quack_loss)):
        try:
            impls[name] = make()
        except ImportError as error:
            print(f"{name} is not measured: {error}")
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


# These read the targets on the host (a range check, a count of ignored rows): a CUDA graph cannot
# capture them, and on the H200 a refused capture left torch's CUDA generator in capture state
# (the next torch.randn raised), so they are timed eagerly without trying. At the headline
# shapes a call is 0.5-2 ms of GPU work, so the host does not set the figure.
HOST_READS = {"torch", "triton", "triton.unfused", "cute", "liger"}


def timed_passes(name, loss, logits, target):
    """((fwd ms, fwd+bwd ms), their timings) of a differentiable loss; each must agree with
    the library's. The forward runs on logits that need no gradient (Liger writes dx over them
    when they do); the fwd+bwd on a copy that does."""
    expected = F.cross_entropy(logits.float(), target)
    got = loss(logits.clone(), target).float()
    if not torch.allclose(got, expected, atol=1e-2, rtol=1e-2):  # a sanity check, not the bound
        raise RuntimeError(f"wrong loss {got.item():.6g}, expected {expected.item():.6g}")
    eager = lambda fn: (median_ms(fn), "eager: reads the host")  # noqa: E731
    timer = eager if name in HOST_READS else graph_ms
    fwd = timer(lambda: loss(logits, target))
    leaf = logits.clone().requires_grad_()

    def forward_backward():
        leaf.grad = None
        loss(leaf, target).backward()

    both = timer(forward_backward)
    return (fwd[0], both[0]), (fwd[1], both[1])


def per_call_rows(impls, dtype):
    """host_us: wall time of back-to-back forward calls at TINY_SHAPE, rounds rotated."""
    logits = torch.randn(*TINY_SHAPE, device="cuda", dtype=dtype)
    target = torch.randint(0, TINY_SHAPE[1], TINY_SHAPE[:1], device="cuda")
    names = list(impls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            impls[name](logits, target)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                impls[name](logits, target)
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
    logits = torch.randn(m, n, device="cuda", dtype=dtype)
    target = torch.randint(0, n, (m,), device="cuda")
    times, timings = {}, {}
    for name, loss in impls.items():
        try:
            times[name], timings[name] = timed_passes(name, loss, logits, target)
        except Exception as error:  # an anchor that refuses a shape or a dtype
            print(f"{name:8s} {str(dtype)[6:]:9s} {m}x{n}: skipped ({type(error).__name__}: "
                  f"{str(error)[:80]})")  # fmt: skip
        torch.cuda.empty_cache()
    rows = []
    for name, (fwd_ms, both_ms) in times.items():
        for pass_name, ms, elements in (("fwd", fwd_ms, m * n), ("fwd+bwd", both_ms, 3 * m * n)):
            gbps = elements * logits.element_size() / ms / 1e6
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
    timed_shapes = {tuple(r["shape"]) for r in timed}
    labels = [f"{m}x{n}" for m, n in SHAPES if (m, n) in timed_shapes]
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
        title = f"cross_entropy {pass_name}, {dtype}"
        ax.set(ylabel="% of copy bandwidth (minimal bytes)", title=title)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(quick=False, headline=False):
    ceiling, impls, rows = copy_ceiling_gbps(), implementations(), []
    for dtype in DTYPES[:1] if quick else DTYPES:
        if not quick:
            rows += per_call_rows(impls, dtype)
        for shape in QUICK_SHAPES if quick or headline else SHAPES:
            rows += shape_rows(impls, dtype, shape, ceiling)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    results = {"device": torch.cuda.get_device_name(), "ceilings": {"copy_GBps": ceiling},
               "rows": rows}  # fmt: skip
    if not quick:
        (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(rows, HERE / "perf.png")
    return results


if __name__ == "__main__":
    main(quick="--quick" in sys.argv, headline="--headline" in sys.argv)
