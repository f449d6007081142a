"""Benchmark dot on the GPU: every implementation against the device's copy bandwidth.

    python bench.py            writes results.json and perf.png beside this file

dot reads x and y and writes one number: 2n elements of traffic, the minimum any version can
move (the Triton kernel's partials add 4 bytes per program, at most 528 of them).
Time is the median of `triton.testing.do_bench`, which flushes the L2 cache before every call,
so each call reads its inputs from DRAM. The ceiling is a large device-to-device copy measured in
the same run; the library op a user would otherwise call is torch.dot, which is torch_impl.
cute_impl is measured when it can be imported.
"""

import json
from pathlib import Path

import torch
import triton

import torch_impl
import triton_impl

KERNEL = "dot"
ELEMENTS_MOVED_PER_ENTRY = 2  # read x_i and y_i
HERE = Path(__file__).resolve().parent
IMPLS = {"torch": torch_impl.dot, "triton": triton_impl.dot}
try:
    import cute_impl

    IMPLS["cute"] = cute_impl.dot
except ImportError as error:
    print(f"cute_impl is not measured: {error}")
SIZES = [2**k for k in range(10, 29, 2)]
DTYPES = [torch.float32, torch.bfloat16]


def make_operands(n, dtype):
    return torch.randn(n, device="cuda").to(dtype), torch.randn(n, device="cuda").to(dtype)


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
        for impl in IMPLS:
            points = [r for r in rows if r["impl"] == impl and r["dtype"] == str(dtype)[6:]]
            ax.plot([r["shape"][0] for r in points], [r["GBps"] for r in points], "o-", label=impl)
        ax.axhline(ceiling, color="gray", linestyle="--", label="device copy")
        ax.set(xscale="log", xlabel="n (elements)", title=f"{KERNEL}, {str(dtype)[6:]}")
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
        for n in SIZES:
            operands = make_operands(n, dtype)
            times = {name: median_ms(lambda f=f, a=operands: f(*a)) for name, f in IMPLS.items()}
            for impl, ms in times.items():
                gbps = ELEMENTS_MOVED_PER_ENTRY * n * operands[-1].element_size() / ms / 1e6
                rows.append(
                    {"impl": impl, "dtype": str(dtype)[6:], "shape": [n], "ms": ms,
                     "GBps": gbps, "TFLOPs": None, "pct_of_ceiling": 100 * gbps / ceiling,
                     "vs_library": times["torch"] / ms}
                )  # fmt: skip
                print(f"{impl:7s} {str(dtype)[6:]:9s} n=2**{n.bit_length() - 1:<3d} "
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
