"""Benchmark geru on the GPU: every implementation against the device's copy bandwidth.

    python bench.py            writes results.json and perf.png beside this file

geru reads A, x and y and writes A: (2mn + m + n) elements of traffic, the minimum any version
can move, which is what GB/s counts here. Square matrices from 1024 x 1024 to 16384 x 16384 (1
GiB of float32), each in both layouts: row-major, and column-major (A.T of a contiguous matrix),
the case that needs its tiles turned. Time is the median of `triton.testing.do_bench`, which
flushes the L2 cache before every call, so each call reads A from DRAM, taken in ROUNDS rounds
that rotate the order of the implementations (the median of the rounds), so that a clock or
temperature drift favours none of them. The ceiling is a large device-to-device copy measured in
the same run. The library op a user would otherwise call is `A.addr_`, which is torch_impl.

The per-call rows time the host path: the wall time of CALLS back-to-back calls on a TINY x TINY
matrix, where the GPU work is far shorter than the Python and driver work of a call, beside the
run's floors: torch's own `y.copy_(x)` and a bare Triton launch of the same copy, on 4096
elements as in every folder.
"""

import json
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import cute_impl
import torch_impl
import triton_impl

KERNEL = "geru"
HERE = Path(__file__).resolve().parent
IMPLS = {"torch": torch_impl.geru, "triton": triton_impl.geru, "cute": cute_impl.geru}
SIDES = [2**k for k in range(10, 15)]
DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = ["row", "col"]
TINY, CALLS, ROUNDS = 64, 2000, 3  # the per-call rows: side, calls timed, rotated rounds
FLOOR_ELEMENTS = 4096  # the floors' copy, the same in every folder


def make_operands(side, dtype, layout):
    """alpha = 2**-10: A changes little over thousands of timed calls."""
    A = torch.randn(side, side, device="cuda").to(dtype)
    A = A if layout == "row" else A.t()
    x, y = (torch.randn(side, device="cuda").to(dtype) for _ in range(2))
    return 2**-10, x, y, A


def elements_moved(m, n):
    return 2 * m * n + m + n  # read and write A, read x and y


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
    """The run's floors: torch's y.copy_(x) and a bare Triton launch, on 4096 float32 elements."""
    n = FLOOR_ELEMENTS
    x, y = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    return per_call_us({
        "torch_call_us": lambda: y.copy_(x),
        "triton_launch_us": lambda: bare_copy_kernel[(n // 1024,)](x, y, n, BLOCK=1024),
    })  # fmt: skip


def per_call_rows(dtype, layout):
    """One row per implementation and the library op, A.addr_: host_us on a TINY x TINY A."""
    alpha, x, y, A = make_operands(TINY, dtype, layout)
    calls = {name: lambda f=f: f(alpha, x, y, A) for name, f in IMPLS.items()}
    calls["library"] = lambda: A.addr_(x, y, alpha=alpha)
    host = per_call_us(calls)
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


def plot_per_call(ax, rows, floors):
    """Bars of microseconds per call, per implementation, dtype and layout, with the floors."""
    names = list(dict.fromkeys(r["impl"] for r in rows))
    series = list(dict.fromkeys((r["dtype"], r["layout"]) for r in rows))
    width = 0.8 / len(series)
    for i, (dtype, layout) in enumerate(series):
        us = {r["impl"]: r["host_us"] for r in rows if (r["dtype"], r["layout"]) == (dtype, layout)}
        ax.bar(
            [k + width * i for k in range(len(names))], [us[n] for n in names], width,
            label=f"{dtype}, {layout}-major",
        )  # fmt: skip
    for (name, value), style in zip(floors.items(), ("--", ":"), strict=True):
        ax.axhline(value, color="gray", linestyle=style, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names)
    ax.set(ylabel="us per call", title=f"{KERNEL}: host cost per call, {TINY} x {TINY}")
    ax.legend()


def plot(rows, ceiling, floors, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(DTYPES) + 1, figsize=(6 * (len(DTYPES) + 1), 4.5))
    timed = [r for r in rows if r["ms"] is not None]
    for ax, dtype in zip(axes, DTYPES, strict=False):
        for index, impl in enumerate(IMPLS):
            for layout, style in zip(LAYOUTS, ("o-", "s--"), strict=True):
                points = [
                    r
                    for r in timed
                    if (r["impl"], r["dtype"], r["layout"]) == (impl, str(dtype)[6:], layout)
                ]
                ax.plot(
                    [r["shape"][0] for r in points],
                    [r["GBps"] for r in points],
                    style,
                    color=f"C{index}",
                    label=f"{impl}, {layout}-major",
                )
        ax.axhline(ceiling, color="gray", linestyle="--", label="device copy")
        ax.set(xlabel="m = n", title=f"{KERNEL}, {str(dtype)[6:]}")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s (minimal bytes)")
    axes[0].legend()
    plot_per_call(axes[-1], [r for r in rows if r["ms"] is None], floors)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    ceiling, floors = copy_ceiling_gbps(), per_call_floors()
    rows = []
    for dtype in DTYPES:
        for layout in LAYOUTS:
            rows += per_call_rows(dtype, layout)
            for row in rows[-len(IMPLS) - 1 :]:
                print(f"{row['impl']:7s} {row['dtype']:9s} {layout}-major per call "
                      f"{row['host_us']:6.1f} us")  # fmt: skip
        for side in SIDES:
            for layout in LAYOUTS:
                operands = make_operands(side, dtype, layout)
                times = interleaved_ms(
                    {name: lambda f=f, a=operands: f(*a) for name, f in IMPLS.items()}
                )
                moved = elements_moved(side, side) * operands[-1].element_size()
                for impl, ms in times.items():
                    gbps = moved / ms / 1e6
                    rows.append(
                        {"impl": impl, "dtype": str(dtype)[6:], "shape": [side, side],
                         "layout": layout, "ms": ms, "GBps": gbps, "TFLOPs": None,
                         "pct_of_ceiling": 100 * gbps / ceiling,
                         "vs_library": times["torch"] / ms}
                    )  # fmt: skip
                    print(f"{impl:7s} {str(dtype)[6:]:9s} {side:5d}^2 {layout}-major "
                          f"{ms * 1e3:9.1f} us {gbps:7.0f} GB/s {100 * gbps / ceiling:5.1f}% "
                          f"x{times['torch'] / ms:.2f} vs torch")  # fmt: skip
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
