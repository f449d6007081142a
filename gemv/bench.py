"""Benchmark gemv on the GPU: every implementation against the device's copy bandwidth.

    python bench.py            writes results.json and perf.png beside this file

gemv reads A, x and y and writes y: (mn + n + 2m) elements of traffic, the minimum any version
can move (each block reads x again, but from L2). Square matrices from 1024 to 16384, each
row-major and column-major (the transpose of a row-major (n, m) tensor), float32 and bfloat16.
Time is the median of `triton.testing.do_bench`, which flushes the L2 cache before every call,
so each call reads A from DRAM, taken in ROUNDS rounds that rotate the order of the
implementations (the median of the rounds): cuBLAS's own rate moves by a percent or two with
clock and temperature, so a fixed order would favour whichever runs first. The ceiling is a
large device-to-device copy measured in the same run; the library op a user would otherwise
call is torch.addmv (cuBLAS), in place on y.
cute_impl is measured when it can be imported.

The per-call rows time the host path: the wall time of CALLS back-to-back calls on a TINY x TINY
matrix of each layout, where the GPU work is far shorter than the Python and driver work of a
call, beside the run's floors: torch's own `y.copy_(x)` and a bare Triton launch of the same copy,
on TINY**2 = 4096 float32 elements.
"""

import json
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import torch_impl
import triton_impl

KERNEL = "gemv"
HERE = Path(__file__).resolve().parent
ALPHA, BETA = 1.5, 0.5  # y stays bounded over the repeated in-place calls


def library_gemv(alpha, A, x, beta, y):
    return y.addmv_(A, x, beta=beta, alpha=alpha)


IMPLS = {"library": library_gemv, "torch": torch_impl.gemv, "triton": triton_impl.gemv}
try:
    import cute_impl

    IMPLS["cute"] = cute_impl.gemv
except ImportError as error:
    print(f"cute_impl is not measured: {error}")
SIZES = [1024, 2048, 4096, 8192, 16384]
LAYOUTS = ["row", "col"]
DTYPES = [torch.float32, torch.bfloat16]
ROUNDS = 3
TINY, CALLS = 64, 2000  # the per-call rows: TINY x TINY matrices, calls timed per round


def make_operands(m, n, dtype, layout):
    shape = (m, n) if layout == "row" else (n, m)
    A = torch.randn(shape, device="cuda").to(dtype)
    A = A if layout == "row" else A.T
    return A, torch.randn(n, device="cuda").to(dtype), torch.randn(m, device="cuda").to(dtype)


def elements_moved(m, n):
    """Read A, x and y, write y."""
    return m * n + n + 2 * m


def gemv_call(gemv, A, x, y):
    return lambda: gemv(ALPHA, A, x, BETA, y)


def median_ms(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def interleaved_ms(calls):
    """{name: ms}: the median over ROUNDS rounds of each call's median time, every round in a
    rotated order, so that no implementation always runs first (cool) or last (hot)."""
    names = list(calls)
    samples = {name: [] for name in names}
    for shift in range(ROUNDS):
        for name in names[shift:] + names[:shift]:
            samples[name].append(median_ms(calls[name], rep=40))
    return {name: statistics.median(ms) for name, ms in samples.items()}


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
    """The run's floors: torch's y.copy_(x) and a bare Triton launch, on TINY**2 float32
    elements (4096, as in every folder)."""
    n = TINY * TINY
    x, y = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    return per_call_us({
        "torch_call_us": lambda: y.copy_(x),
        "triton_launch_us": lambda: bare_copy_kernel[(n // 1024,)](x, y, n, BLOCK=1024),
    })  # fmt: skip


def per_call_rows(dtype, layout):
    """One row per implementation (the library op among them): host_us on a TINY x TINY A."""
    operands = make_operands(TINY, TINY, dtype, layout)
    host = per_call_us({name: gemv_call(f, *operands) for name, f in IMPLS.items()})
    return [
        {"impl": impl, "dtype": str(dtype)[6:], "shape": [TINY, TINY], "layout": layout,
         "ms": None, "GBps": None, "TFLOPs": None, "pct_of_ceiling": None,
         "vs_library": host["library"] / us, "host_us": us}
        for impl, us in host.items()
    ]  # fmt: skip


def copy_ceiling_gbps():
    """Bytes read plus bytes written per second by a 1 GiB device-to-device copy."""
    source = torch.randn(2**28, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source))
    return 2 * source.nbytes / ms / 1e6


def plot_per_call(ax, rows, floors, layout):
    """Bars of microseconds per call, per implementation and dtype, with the run's floors."""
    rows = [r for r in rows if r["layout"] == layout]
    names = list(dict.fromkeys(r["impl"] for r in rows))
    for i, dtype in enumerate(dict.fromkeys(r["dtype"] for r in rows)):
        us = {r["impl"]: r["host_us"] for r in rows if r["dtype"] == dtype}
        ax.bar([k + 0.4 * i for k in range(len(names))], [us[n] for n in names], 0.4, label=dtype)
    for (name, value), style in zip(floors.items(), ("--", ":"), strict=True):
        ax.axhline(value, color="gray", linestyle=style, label=name)
    ax.set_xticks([k + 0.2 for k in range(len(names))], names)
    title = f"{KERNEL}: host cost per call, {TINY} x {TINY} {layout}-major A"
    ax.set(ylabel="us per call", title=title)
    ax.legend()


def plot(rows, ceiling, floors, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One row of panels per dtype (GB/s against size), then one of host cost per call.
    figure, axes = plt.subplots(
        len(DTYPES) + 1, len(LAYOUTS), figsize=(6 * len(LAYOUTS), 4.5 * (len(DTYPES) + 1))
    )
    timed = [r for r in rows if r["ms"] is not None]
    for ax_row, dtype in zip(axes[:-1], DTYPES, strict=True):
        for ax, layout in zip(ax_row, LAYOUTS, strict=True):
            if ax is not axes[0][0]:
                ax.sharey(axes[0][0])  # the GB/s panels share one scale
            for impl in IMPLS:
                points = [
                    r
                    for r in timed
                    if r["impl"] == impl and r["dtype"] == str(dtype)[6:] and r["layout"] == layout
                ]
                sizes = [r["shape"][0] for r in points]
                ax.plot(sizes, [r["GBps"] for r in points], "o-", label=impl)
            ax.axhline(ceiling, color="gray", linestyle="--", label="device copy")
            title = f"{KERNEL}, {str(dtype)[6:]}, {layout}-major A"
            ax.set(xlabel="m = n", ylabel="GB/s (minimal bytes)", title=title)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    for ax, layout in zip(axes[-1], LAYOUTS, strict=True):
        plot_per_call(ax, [r for r in rows if r["ms"] is None], floors, layout)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    ceiling, floors = copy_ceiling_gbps(), per_call_floors()
    rows = []
    for dtype in DTYPES:
        for layout in LAYOUTS:
            rows += per_call_rows(dtype, layout)
            for row in rows[-len(IMPLS) :]:
                print(f"{row['impl']:7s} {row['dtype']:9s} {layout} per call "
                      f"{row['host_us']:6.1f} us")  # fmt: skip
            for size in SIZES:
                m = n = size
                operands = make_operands(m, n, dtype, layout)
                times = interleaved_ms({name: gemv_call(f, *operands) for name, f in IMPLS.items()})
                for impl, ms in times.items():
                    gbps = elements_moved(m, n) * operands[0].element_size() / ms / 1e6
                    rows.append(
                        {"impl": impl, "dtype": str(dtype)[6:], "shape": [m, n],
                         "layout": layout, "ms": ms, "GBps": gbps, "TFLOPs": None,
                         "pct_of_ceiling": 100 * gbps / ceiling,
                         "vs_library": times["library"] / ms}
                    )  # fmt: skip
                    print(f"{impl:7s} {str(dtype)[6:]:9s} {layout} {m}x{n} "
                          f"{ms * 1e3:9.1f} us {gbps:7.0f} GB/s {100 * gbps / ceiling:5.1f}% "
                          f"x{times['library'] / ms:.2f} vs torch.addmv")  # fmt: skip
    results = {
        "device": torch.cuda.get_device_name(),
        "ceilings": {"copy_GBps": ceiling, **floors},
        "rows": rows,
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(rows, ceiling, floors, HERE / "perf.png")
    print(f"floors per call: torch {floors['torch_call_us']:.1f} us, Triton launch "
          f"{floors['triton_launch_us']:.1f} us")  # fmt: skip
    print(f"copy ceiling {ceiling:.0f} GB/s; wrote results.json and perf.png")


if __name__ == "__main__":
    main()
