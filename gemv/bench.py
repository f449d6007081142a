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
"""

import json
import statistics
from pathlib import Path

import torch
import triton

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


def copy_ceiling_gbps():
    """Bytes read plus bytes written per second by a 1 GiB device-to-device copy."""
    source = torch.randn(2**28, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source))
    return 2 * source.nbytes / ms / 1e6


def plot(rows, ceiling, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        len(DTYPES), len(LAYOUTS), figsize=(6 * len(LAYOUTS), 4.5 * len(DTYPES)), sharey=True
    )
    for ax_row, dtype in zip(axes, DTYPES, strict=True):
        for ax, layout in zip(ax_row, LAYOUTS, strict=True):
            for impl in IMPLS:
                points = [
                    r
                    for r in rows
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
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    ceiling = copy_ceiling_gbps()
    rows = []
    for dtype in DTYPES:
        for layout in LAYOUTS:
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
        "ceilings": {"copy_GBps": ceiling},
        "rows": rows,
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(rows, ceiling, HERE / "perf.png")
    print(f"copy ceiling {ceiling:.0f} GB/s; wrote results.json and perf.png")


if __name__ == "__main__":
    main()
