"""Benchmark geru on the GPU: every implementation against the device's copy bandwidth.

    python bench.py            writes results.json and perf.png beside this file

geru reads A, x and y and writes A: (2mn + m + n) elements of traffic, the minimum any version can
move, which is what GB/s counts here. Square matrices from 1024 x 1024 to 16384 x 16384 (1 GiB of
float32), each in both layouts: row-major, and column-major (A.T of a contiguous matrix), the
case that needs its tiles turned. Time is the median of `triton.testing.do_bench`, which
flushes the L2 cache before every call, so each call reads A from DRAM. The ceiling is a large
device-to-device copy measured in the same run. The library op a user would otherwise call is
`A.addr_`, which is torch_impl.
"""

import json
from pathlib import Path

import torch
import triton

import cute_impl
import torch_impl
import triton_impl

KERNEL = "geru"
HERE = Path(__file__).resolve().parent
IMPLS = {"torch": torch_impl.geru, "triton": triton_impl.geru, "cute": cute_impl.geru}
SIDES = [2**k for k in range(10, 15)]
DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = ["row", "col"]


def make_operands(side, dtype, layout):
    """alpha = 2**-10: A changes little over thousands of timed calls."""
    A = torch.randn(side, side, device="cuda").to(dtype)
    A = A if layout == "row" else A.t()
    x, y = (torch.randn(side, device="cuda").to(dtype) for _ in range(2))
    return 2**-10, x, y, A


def elements_moved(m, n):
    return 2 * m * n + m + n  # read and write A, read x and y


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


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

    figure, axes = plt.subplots(1, len(DTYPES), figsize=(6 * len(DTYPES), 4.5), sharey=True)
    for ax, dtype in zip(axes, DTYPES, strict=True):
        for index, impl in enumerate(IMPLS):
            for layout, style in zip(LAYOUTS, ("o-", "s--"), strict=True):
                points = [
                    r
                    for r in rows
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
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    ceiling = copy_ceiling_gbps()
    rows = []
    for dtype in DTYPES:
        for side in SIDES:
            for layout in LAYOUTS:
                operands = make_operands(side, dtype, layout)
                times = {
                    name: median_ms(lambda f=f, a=operands: f(*a)) for name, f in IMPLS.items()
                }
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
        "ceilings": {"copy_GBps": ceiling},
        "rows": rows,
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(rows, ceiling, HERE / "perf.png")
    print(f"copy ceiling {ceiling:.0f} GB/s; wrote results.json and perf.png")


if __name__ == "__main__":
    main()
