"""GPU probe for the CuTe Hopper epilogue (README.md, tuning log "C stored by TMA"): cuBLAS
against cute_impl.gemm with C stored through shared memory by TMA (`stores_by_tma`, now the
default for 16-bit row-major C on 128-row tiles) and with each thread's column pairs stored
from registers (the epilogue before it), side by side in one run, graph-timed as bench.py
times them (operand sets past the L2, one CUDA graph, do_bench, the median of ROUNDS rotated
rounds, alpha = 1 and beta = 0.5 as bench.py). Prints TFLOP/s and x cuBLAS for each; the
squares from 1024 to 8192 in NN, fp16 8192^3 NN, every transposed layout at 8192^3 and the
projections of a 7B-class layer in NT at 4096 tokens. Then (`--plans`) the medium squares
that wave quantisation costs, 1536^3, 2048^3 and 3072^3 bf16 NN, with every tile width
(64, 128, 256) and cluster size (1, 2) forced, the TMA epilogue on. About two minutes each.
Run from gemm/:

    python probe_epilogue.py [--plans]     (writes $OUT/probe_epilogue.json when OUT is set)
"""

import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
import bench  # noqa: E402

import cute_2_tma_wgmma as step2  # noqa: E402
import cute_impl  # noqa: E402
import triton_impl  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
CASES = (
    [(BF16, "NN", (s, s, s)) for s in (1024, 2048, 4096, 8192)]
    + [(BF16, "NN", (3072,) * 3), (FP16, "NN", (8192,) * 3)]
    + [(BF16, layout, (8192,) * 3) for layout in ("NT", "TN")]
    + [(BF16, "NT", (4096, n, k)) for n, k in bench.PROJECTIONS]
)


def cute_from_registers(*args):
    """cute_impl.gemm with C stored from registers (stores_by_tma answers False)."""
    with mock.patch.object(step2, "stores_by_tma", lambda C, tile_m: False):
        return cute_impl.gemm(*args)


IMPLS = {
    "cublas": bench.library_gemm,
    "cute": cute_impl.gemm,
    "cute_registers": cute_from_registers,
    "triton": triton_impl.gemm,
}


PLAN_SQUARES = (1536, 2048, 3072)


def forced_plan(tile_n, cluster_m):
    """cute_impl.gemm on tiles of tile_n columns at every shape, in clusters of cluster_m."""

    def gemm(*args):
        with mock.patch.object(step2, "hopper_tile_n", lambda m, n: tile_n):
            return cute_impl.gemm(*args, cluster_m=cluster_m)

    return gemm


def plan_cases():
    """(dtype, layout, shape, {name: gemm}) for --plans: cuBLAS, the chosen plan, every forced."""
    plans = {"cublas": bench.library_gemm, "cute": cute_impl.gemm}
    for tile_n in (64, 128, 256):
        for cluster_m in (1, 2):
            plans[f"cute_{tile_n}x{cluster_m}"] = forced_plan(tile_n, cluster_m)
    return [(BF16, "NN", (s, s, s), plans) for s in PLAN_SQUARES]


def main():
    rows = []
    if "--plans" in sys.argv:
        cases = plan_cases()
    else:
        cases = [(dtype, layout, shape, IMPLS) for dtype, layout, shape in CASES]
    for dtype, layout, (m, n, k), impls in cases:
        operands = bench.operand_sets(m, n, k, dtype, layout)
        calls = {name: bench.gemm_call(f, operands) for name, f in impls.items()}
        times = bench.interleaved_ms(calls, len(operands))
        tflops = {name: 2 * m * n * k / ms * 1e-9 for name, (ms, _) in times.items()}
        row = {"dtype": str(dtype)[6:], "layout": layout, "shape": [m, n, k], "TFLOPs": tflops}
        rows.append(row)
        ratios = "  ".join(
            f"{name} {t:6.1f} ({t / tflops['cublas']:.3f})" for name, t in tflops.items()
        )
        print(f"{row['dtype']:8} {layout} {m}x{n}x{k}: {ratios}", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_epilogue.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
