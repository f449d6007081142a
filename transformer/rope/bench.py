"""Benchmark RoPE on the GPU, forward and backward separately, against the anchors.

    python bench.py            writes results.json and perf.png beside this file
    python bench.py --quick    bf16 at Llama 3 8B's shape only, no files
    python bench.py --quick --dtype bfloat16 --dtype float32    both dtypes at that shape

q and k are (B, H, S, D) and (B, Hk, S, D) (layout "bhsd", what every anchor takes) with a
Hugging Face (S, D) cos/sin table in q's dtype. Minimal traffic per pass: read and write q and
k, 2 (H + Hk) D B S elements, plus the table read once. The backward is timed alone
(`torch.autograd.grad` of a kept forward graph). Times are medians of `triton.testing.do_bench`
(the L2 cache flushed before each call) of each pass captured in a CUDA graph and replayed: the
kernels' time (timed call by call, the backward was host-bound wherever its GPU work was under
~0.5 ms; the per-call rows measure the host). A call that cannot be captured is timed eagerly,
and its row's `timing` says why. Implementations are interleaved shape by shape. The ceiling is
a 1 GiB device-to-device copy of the same run. The library op is Hugging Face's `q * cos +
rotate_half(q) * sin` (its autograd for the backward). Anchors, when importable: torch.compile
of it (its result checked first) and Liger's liger_rotary_pos_emb; a missing one prints why.
The per-call floors of the same run (`call_floors_us`: torch's `y.copy_(x)` and a bare Triton
launch on 4096 float32) go into results.json's ceilings beside the per-call rows.
Shapes: B = 4, H = 32, Hk = 8, D = 128 at each of SEQS; at FULL_K_SEQ also Hk = 32,
DESIGN.md's anchor shape.
"""

import argparse
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
BATCH, HEADS, HEADS_K, HEAD_DIM = 4, 32, 8, 128  # Llama 3 8B
# A decode step (S = 1), prefill batches, the Llama shape of the DESIGN anchors (4096), long.
SEQS = [1, 128, 1024, 4096, 8192]
# DESIGN.md's anchor row has k with as many heads as q: timed once more at S = 4096 so.
FULL_K_SEQ = 4096
QUICK_SEQS = [4096]
DTYPES = [torch.bfloat16, torch.float32]
TINY_SHAPE, CALLS, ROUNDS = (1, 4, 4, 2, 64), 1000, 3  # per-call rows: (B, S, H, Hk, D)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def library(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def implementations():
    """{impl: differentiable rope(q, k, cos, sin) -> (q, k)}, anchors included where importable."""

    def ours(module):
        return lambda q, k, cos, sin: module.rope(q, k, cos=cos, sin=sin, layout="bhsd")

    impls = {"library": library, "torch": ours(torch_impl), "triton": ours(triton_impl)}
    try:
        import cute_impl

        impls["cute"] = ours(cute_impl)
        impls["cute.general"] = general_kernel(cute_impl)
    except ImportError as error:
        print(f"cute is not measured: {error}")
    # What a user compiles: the library expression (torch_impl.rope is an autograd.Function
    # over out= calls: nothing to fuse).
    impls["compile"] = torch.compile(library)
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        impls["liger"] = lambda q, k, cos, sin: liger_rotary_pos_emb(q, k, cos[None], sin[None])
    except ImportError as error:
        print(f"liger is not measured: {error}")
    return impls


def general_kernel(module):
    """module.rope through its general kernel at the same call: cute_impl's table kernel takes
    only contiguous table rows, so cos and sin go in with a column step of 2 (copies made once
    per table, outside the timed calls): the row beside `cute` that says what the table kernel
    gained."""
    copies = {}

    def rope(q, k, cos, sin):
        key = (cos.data_ptr(), sin.data_ptr())
        if key not in copies:
            copies.clear()
            copies[key] = [t.repeat_interleave(2, dim=-1)[:, ::2] for t in (cos, sin)]
        return module.rope(q, k, cos=copies[key][0], sin=copies[key][1], layout="bhsd")

    return rope


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


def operands(batch, seq, heads, heads_k, head_dim, dtype):
    """q, k, their gradients, and a Hugging Face table: cos and sin of s * inv_freq, (S, D)."""
    q, k, dq, dk = (torch.randn(batch, h, seq, head_dim, device="cuda", dtype=dtype)
                    for h in (heads, heads_k, heads, heads_k))  # fmt: skip
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, device="cuda") / head_dim)
    theta = torch.arange(seq, device="cuda")[:, None] * inv_freq
    theta = torch.cat((theta, theta), dim=-1)
    return q, k, dq, dk, theta.cos().to(dtype), theta.sin().to(dtype)


def timed_passes(rope, q, k, dq, dk, cos, sin):
    """((fwd ms, bwd ms), their timings); the anchor must agree with the library in float32
    first. The backward's forward is made at graph_ms's first call, on the stream it captures
    on: autograd runs each backward op on the stream of its forward."""
    expected = library(q.float(), k.float(), cos.float(), sin.float())
    for got, want in zip(rope(q, k, cos, sin), expected, strict=True):
        if not torch.allclose(got.float(), want, atol=5e-2, rtol=2e-2):  # a sanity check
            raise RuntimeError(f"wrong result (largest error {(got - want).abs().max():.3g})")
    fwd = graph_ms(lambda: rope(q, k, cos, sin))
    q_leaf, k_leaf = (t.detach().clone().requires_grad_() for t in (q, k))
    kept = []

    def backward():
        if not kept:
            kept.append(rope(q_leaf, k_leaf, cos, sin))
        return torch.autograd.grad(kept[0], (q_leaf, k_leaf), (dq, dk), retain_graph=True)

    bwd = graph_ms(backward)
    return (fwd[0], bwd[0]), (fwd[1], bwd[1])


def row(impl, pass_name, dtype, shape, ms=None, gbps=None, ceiling=None, vs=None, host=None):
    return {"impl": impl, "pass": pass_name, "dtype": str(dtype)[6:], "shape": list(shape),
            "ms": ms, "GBps": gbps, "TFLOPs": None,
            "pct_of_ceiling": None if gbps is None else 100 * gbps / ceiling,
            "vs_library": vs, "host_us": host}  # fmt: skip


def per_call_rows(impls, dtype):
    """host_us: wall time of back-to-back forward calls at TINY_SHAPE, rounds rotated."""
    q, k, _, _, cos, sin = operands(*TINY_SHAPE, dtype)
    names = list(impls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            samples[name].append(wall_us(lambda name=name: impls[name](q, k, cos, sin)))
    host = {name: statistics.median(us) for name, us in samples.items()}
    return [row(impl, "fwd", dtype, TINY_SHAPE, vs=host["library"] / us, host=us)
            for impl, us in host.items()]  # fmt: skip


def shape_rows(impls, dtype, seq, ceiling, heads_k=HEADS_K):
    shape = (BATCH, seq, HEADS, heads_k, HEAD_DIM)
    tensors = operands(*shape, dtype)
    times, timings = {}, {}
    for name, rope in impls.items():
        try:
            times[name], timings[name] = timed_passes(rope, *tensors)
        except Exception as error:  # an anchor that refuses a shape or a dtype
            print(f"{name:8s} {str(dtype)[6:]:9s} S={seq}: skipped ({type(error).__name__}: "
                  f"{str(error)[:80]})")  # fmt: skip
    # read and write q and k, read the cos and sin tables once
    heads_bytes = 2 * (HEADS + heads_k) * HEAD_DIM * BATCH * seq * dtype.itemsize
    minimal_bytes = heads_bytes + 2 * seq * HEAD_DIM * dtype.itemsize
    rows = []
    for name, pair in times.items():
        for index, pass_name in enumerate(("fwd", "bwd")):
            ms, gbps = pair[index], minimal_bytes / pair[index] / 1e6
            library_ms = times["library"][index] if "library" in times else None
            vs = library_ms / ms if library_ms else None
            timing = timings[name][index]
            rows.append(row(name, pass_name, dtype, shape, ms, gbps, ceiling, vs))
            rows[-1]["timing"] = timing
            print(f"{name:8s} {str(dtype)[6:]:9s} S={seq:<5d} Hk={heads_k:<2d} {pass_name} "
                  f"{ms * 1e3:9.1f} us "
                  f"{gbps:6.0f} GB/s {100 * gbps / ceiling:5.1f}% of copy {timing}")  # fmt: skip
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["ms"] is not None]
    panels = [(d, p) for d in ("bfloat16", "float32") for p in ("fwd", "bwd")]
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 4 * len(panels)))
    for ax, (dtype, pass_name) in zip(axes, panels, strict=True):
        for name in dict.fromkeys(r["impl"] for r in timed):
            key = (name, dtype, pass_name)
            mine = [r for r in timed if (r["impl"], r["dtype"], r["pass"]) == key
                    and r["shape"][3] == HEADS_K]  # fmt: skip
            ax.plot([r["shape"][1] for r in mine], [r["pct_of_ceiling"] for r in mine], "o-",
                    label=name)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set(xlabel=f"S (B={BATCH}, H={HEADS}, Hk={HEADS_K}, D={HEAD_DIM})",
               ylabel="% of copy bandwidth (minimal bytes)",
               title=f"rope {pass_name}, {dtype}")  # fmt: skip
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(quick=False, dtypes=None):
    ceiling, impls, rows = copy_ceiling_gbps(), implementations(), []
    floors = call_floors_us()
    for dtype in dtypes or (DTYPES[:1] if quick else DTYPES):
        if not quick:
            rows += per_call_rows(impls, dtype)
        for seq in QUICK_SEQS if quick else SEQS:
            rows += shape_rows(impls, dtype, seq, ceiling)
            torch.cuda.empty_cache()
        if not quick:
            rows += shape_rows(impls, dtype, FULL_K_SEQ, ceiling, heads_k=HEADS)
    print(f"copy ceiling {ceiling:.0f} GB/s; per call: torch {floors['torch_call_us']:.1f} us, "
          f"Triton launch {floors['triton_launch_us']:.1f} us")  # fmt: skip
    ceilings = {"copy_GBps": ceiling, **floors}
    results = {"device": torch.cuda.get_device_name(), "ceilings": ceilings, "rows": rows}
    if not quick:
        (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(rows, HERE / "perf.png")
    return results


def arguments(argv):
    """(quick, dtypes or None) from the command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dtype", action="append", choices=[str(d)[6:] for d in DTYPES])
    args = parser.parse_args(argv)
    return args.quick, [getattr(torch, name) for name in args.dtype] if args.dtype else None


if __name__ == "__main__":
    main(*arguments(sys.argv[1:]))
