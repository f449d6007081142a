"""Benchmark gemm on the GPU: every implementation against the device's bf16 matmul rate.

    python bench.py            writes results.json and perf.png beside this file

gemm does 2mnk flops (mnk multiply-adds) on at least (mk + kn + 2mn) elements of traffic (read
A, B and C, write C); from a few hundred on a side it is compute bound, so the measure is
TFLOP/s = 2mnk / time. Shapes: squares from 256 to 16384, and m = 16384 with (n, k) from the
projections of a 7B-class transformer layer: (4096, 4096), (11008, 4096), (4096, 11008),
(14336, 4096); every shape in bfloat16, float16 and float32 (IEEE: no TF32), A and B row-major.
Time is the median of `triton.testing.do_bench`, which flushes the L2 cache before every call,
taken in ROUNDS rounds that rotate the order of the implementations (the median of the rounds):
at full tensor-core rate the H200's clock follows its power and temperature, so whichever ran
first on a cool card would otherwise be favoured by a few percent.
The ceiling is torch.matmul on bfloat16 8192 x 8192 x 8192, measured in the same run; the
library op a user would otherwise call is torch.addmm (cuBLAS), in place on C. cute_impl is
measured when it can be imported.
"""

import json
import statistics
from pathlib import Path

import torch
import triton

import torch_impl
import triton_impl

KERNEL = "gemm"
HERE = Path(__file__).resolve().parent
ALPHA, BETA = 1.0, 0.5  # C stays bounded over the repeated in-place calls
ROUNDS = 3


def library_gemm(alpha, A, B, beta, C):
    return C.addmm_(A, B, beta=beta, alpha=alpha)


IMPLS = {"library": library_gemm, "torch": torch_impl.gemm, "triton": triton_impl.gemm}
try:
    import cute_impl

    IMPLS["cute"] = cute_impl.gemm
except ImportError as error:
    print(f"cute_impl is not measured: {error}")
SQUARES = [256, 512, 1024, 2048, 4096, 8192, 16384]
SHAPES = [(s, s, s) for s in SQUARES] + [
    (16384, n, k) for n, k in ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_operands(m, n, k, dtype):
    def random(rows, cols):
        return torch.randn(rows, cols, device="cuda").to(dtype)

    return random(m, k), random(k, n), random(m, n)


def gemm_call(gemm, A, B, C):
    return lambda: gemm(ALPHA, A, B, BETA, C)


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


def matmul_ceiling_tflops(size=8192):
    """torch.matmul on bfloat16 size^3: the rate of the matrix units as cuBLAS reaches it."""
    A = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.matmul(A, B))
    return 2 * size**3 / ms / 1e9


def plot(rows, ceiling, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(DTYPES), figsize=(6 * len(DTYPES), 4.5), sharey=True)
    labels = [f"{m}x{n}x{k}" for m, n, k in SHAPES]
    for ax, dtype in zip(axes, DTYPES, strict=True):
        for impl in IMPLS:
            points = [r for r in rows if r["impl"] == impl and r["dtype"] == str(dtype)[6:]]
            ax.plot(range(len(points)), [r["TFLOPs"] for r in points], "o-", label=impl)
        ax.axhline(ceiling, color="gray", linestyle="--", label="torch.matmul bf16 8192^3")
        ax.set(ylabel="TFLOP/s (2mnk)", title=f"{KERNEL}, {str(dtype)[6:]}, NN")
        ax.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    ceiling = matmul_ceiling_tflops()
    rows = []
    for dtype in DTYPES:
        for m, n, k in SHAPES:
            A, B, C = make_operands(m, n, k, dtype)
            times = interleaved_ms({name: gemm_call(f, A, B, C) for name, f in IMPLS.items()})
            for impl, ms in times.items():
                tflops = 2 * m * n * k / ms / 1e9
                rows.append(
                    {"impl": impl, "dtype": str(dtype)[6:], "shape": [m, n, k], "ms": ms,
                     "GBps": None, "TFLOPs": tflops, "pct_of_ceiling": 100 * tflops / ceiling,
                     "vs_library": times["library"] / ms}
                )  # fmt: skip
                print(f"{impl:7s} {str(dtype)[6:]:9s} {m}x{n}x{k} {ms * 1e3:10.1f} us "
                      f"{tflops:6.1f} TFLOP/s {100 * tflops / ceiling:5.1f}% "
                      f"x{times['library'] / ms:.2f} vs torch.addmm")  # fmt: skip
            del A, B, C
    results = {
        "device": torch.cuda.get_device_name(),
        "ceilings": {"bf16_matmul_TFLOPs": ceiling},
        "rows": rows,
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(rows, ceiling, HERE / "perf.png")
    print(f"bf16 matmul ceiling {ceiling:.0f} TFLOP/s; wrote results.json and perf.png")


if __name__ == "__main__":
    main()
