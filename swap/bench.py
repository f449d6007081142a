"""Benchmark swap on the GPU: every implementation against the device's copy bandwidth.

    python bench.py            writes results.json and perf.png beside this file

swap reads x and y and writes both: 4n elements of traffic, the minimum any version can move
(torch_impl's three copies through a temporary move 6n). Time is the median of
`triton.testing.do_bench`, which flushes the L2 cache before every call, so each call reads its
inputs from DRAM, taken in ROUNDS rounds that rotate the order of the implementations (the
median of the rounds), so that a clock or temperature drift favours none of them. The ceiling is
a large device-to-device copy measured in the same run; torch has no fused swap, so torch_impl,
the researcher's version, stands for the library op.

The per-call rows time the host path: the wall time of CALLS back-to-back calls at TINY
elements, where the GPU work is far shorter than the Python and driver work of a call, beside
the torch ops torch_impl issues, without its checks (row "library": a clone and two copies),
and the run's floors, as in every folder: torch's `y.copy_(x)` and a bare Triton launch of a copy.
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

KERNEL = "swap"
ELEMENTS_MOVED_PER_ENTRY = 4  # read x_i and y_i, write both
HERE = Path(__file__).resolve().parent
IMPLS = {"torch": torch_impl.swap, "triton": triton_impl.swap, "cute": cute_impl.swap}
SIZES = [2**k for k in range(10, 29, 2)]
DTYPES = [torch.float32, torch.bfloat16]
TINY, CALLS, ROUNDS = 4096, 2000, 3  # the per-call rows: size, calls timed, rotated rounds


def make_operands(n, dtype):
    return torch.randn(n, device="cuda").to(dtype), torch.randn(n, device="cuda").to(dtype)


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
    """The run's floors: torch's y.copy_(x) and a bare Triton launch, on TINY float32 elements."""
    x, y = torch.randn(TINY, device="cuda"), torch.empty(TINY, device="cuda")
    return per_call_us({
        "torch_call_us": lambda: y.copy_(x),
        "triton_launch_us": lambda: bare_copy_kernel[(TINY // 1024,)](x, y, TINY, BLOCK=1024),
    })  # fmt: skip


def torch_ops_swap(x, y):
    """torch_impl's three copies through a temporary without its checks: torch's own swap."""
    saved = x.clone()
    x.copy_(y)
    y.copy_(saved)


def per_call_rows(dtype):
    """One row per implementation and the library op: host_us at TINY elements."""
    x, y = make_operands(TINY, dtype)
    calls = {name: lambda f=f: f(x, y) for name, f in IMPLS.items()}
    calls["library"] = lambda: torch_ops_swap(x, y)
    host = per_call_us(calls)
    return [
        {"impl": impl, "dtype": str(dtype)[6:], "shape": [TINY], "ms": None, "GBps": None,
         "TFLOPs": None, "pct_of_ceiling": None, "vs_library": host["library"] / us,
         "host_us": us}
        for impl, us in host.items()
    ]  # fmt: skip


def copy_ceiling_gbps():
    """Bytes read plus bytes written per second by a 1 GiB device-to-device copy."""
    source = torch.randn(2**28, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source))
    return 2 * source.nbytes / ms / 1e6


def plot_per_call(ax, rows, floors):
    """Bars of microseconds per call, per implementation and dtype, with the run's floors."""
    names = list(dict.fromkeys(r["impl"] for r in rows))
    for i, dtype in enumerate(dict.fromkeys(r["dtype"] for r in rows)):
        us = {r["impl"]: r["host_us"] for r in rows if r["dtype"] == dtype}
        ax.bar([k + 0.4 * i for k in range(len(names))], [us[n] for n in names], 0.4, label=dtype)
    for (name, value), style in zip(floors.items(), ("--", ":"), strict=True):
        ax.axhline(value, color="gray", linestyle=style, label=name)
    ax.set_xticks([k + 0.2 for k in range(len(names))], names)
    ax.set(ylabel="us per call", title=f"{KERNEL}: host cost per call, n = {TINY}")
    ax.legend()


def plot(rows, ceiling, floors, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(DTYPES) + 1, figsize=(6 * (len(DTYPES) + 1), 4.5))
    timed = [r for r in rows if r["ms"] is not None]
    for ax, dtype in zip(axes, DTYPES, strict=False):
        for impl in IMPLS:
            points = [r for r in timed if r["impl"] == impl and r["dtype"] == str(dtype)[6:]]
            ax.plot([r["shape"][0] for r in points], [r["GBps"] for r in points], "o-", label=impl)
        ax.axhline(ceiling, color="gray", linestyle="--", label="device copy")
        ax.set(xscale="log", xlabel="n (elements)", title=f"{KERNEL}, {str(dtype)[6:]}")
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
        rows += per_call_rows(dtype)
        for row in rows[-len(IMPLS) - 1 :]:
            print(f"{row['impl']:7s} {row['dtype']:9s} per call {row['host_us']:6.1f} us")
        for n in SIZES:
            operands = make_operands(n, dtype)
            times = interleaved_ms(
                {name: lambda f=f, a=operands: f(*a) for name, f in IMPLS.items()}
            )
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
