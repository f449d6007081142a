"""GPU probe for the CuTe decode path (README.md, tuning log "The 64-row decode tile"): cuBLAS
against cute_impl at decode steps, then a sweep of forced plans.

Part 1: m x n x k NT bf16 (x @ W.T) for m = 1, 16, 64, 128 tokens and (n, k) of a 7B layer,
(4096, 4096), (11008, 4096), (4096, 11008): torch.addmm (cuBLAS) and cute_impl.gemm as chosen,
graph-timed as bench.py times them (operand sets past the L2, one CUDA graph, do_bench, the
median of ROUNDS rotated rounds); prints each time, x = cuBLAS / CuTe and the plan taken.
Part 2: m = 64 and 128 at the same (n, k), every plan forced: tile_m 64 or 128, tile_n 128 or
256, S = 1 (step 2's kernel, clusters of 1) to 8 (step 3's); one graph-timed round each, and
each result's largest error against float32 cuBLAS in units of |A||B| (a wrong plan shows as a
large number, not a silent time). About 90 s on the H200. Run from gemm/:

    python probe_decode_tile.py        (writes $OUT/probe_decode_tile.json when OUT is set)
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]
import bench  # noqa: E402

import cute_2_tma_wgmma as step2  # noqa: E402
import cute_3_split_k as step3  # noqa: E402
import cute_impl  # noqa: E402

TOKENS = (1, 16, 64, 128)
SWEEP_TOKENS = (64, 128)
WEIGHTS = ((4096, 4096), (11008, 4096), (4096, 11008))  # (n, k): q/k/v/o, gate/up, down
MAX_SPLITS = 8


def plan_taken(m, n, k):
    """(tile_m, tile_n, S) as cute_impl chooses them for NT bf16 (S = 1: step 2's kernel)."""
    plan = step3.split_plan(m, n, k, 2)
    if plan is None:
        return step2.hopper_tile_m(m), step2.hopper_tile_n(m, n), 1
    return step3.split_tile_m(m), *plan


@contextlib.contextmanager
def forced(tile_m, tile_n, splits):
    """Every call inside takes this plan: split_plan and the tile rules replaced."""
    saved = [
        (step3, "split_plan"), (step2, "hopper_tile_m"), (step3, "hopper_tile_m"),
        (step3, "split_tile_m"), (step2, "hopper_tile_n"),
    ]  # fmt: skip
    saved = [(module, name, getattr(module, name)) for module, name in saved]
    step3.split_plan = lambda *_: None if splits == 1 else (tile_n, splits)
    step2.hopper_tile_m = step3.hopper_tile_m = step3.split_tile_m = lambda m: tile_m
    step2.hopper_tile_n = lambda m, n: tile_n
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def cute_clusters_of_1(alpha, A, B, beta, C):
    return cute_impl.gemm(alpha, A, B, beta, C, cluster_m=1)


def error_units(gemm, A, B, C):
    """The largest |gemm's c_ij - float32 cuBLAS's| / (|A| |B| + |beta C|)_ij: at most about
    the bf16 store's 2**-8 when right, O(1) when wrong."""
    expected = torch.addmm(C.float(), A.float(), B.float(), beta=bench.BETA, alpha=bench.ALPHA)
    scale = A.float().abs() @ B.float().abs() + abs(bench.BETA) * C.float().abs()
    result = C.clone()
    gemm(bench.ALPHA, A, B, bench.BETA, result)
    return ((result.float() - expected).abs() / scale.clamp_min(1e-30)).max().item()


def main():
    started, record = time.time(), {"compare": [], "sweep": []}
    print("m x n x k NT bf16     cuBLAS us   CuTe us   x cuBLAS   plan (tile_m, tile_n, S)")
    for m in TOKENS:
        for n, k in WEIGHTS:
            sets = bench.operand_sets(m, n, k, torch.bfloat16, "NT")
            calls = {
                "library": bench.gemm_call(bench.library_gemm, sets),
                "cute": bench.gemm_call(cute_impl.gemm, sets),
            }
            times = bench.interleaved_ms(calls, len(sets))
            library_us, cute_us = (1e3 * times[name][0] for name in ("library", "cute"))
            plan = plan_taken(m, n, k)
            record["compare"].append([m, n, k, library_us, cute_us, plan])
            print(
                f"{m:4d} x {n:5d} x {k:5d}   {library_us:9.1f} {cute_us:9.1f}"
                f" {library_us / cute_us:9.2f}x   {plan}"
            )
    print(f"\nforced plans, one graph-timed round each ({time.time() - started:.0f} s so far)")
    for m in SWEEP_TOKENS:
        for n, k in WEIGHTS:
            sets = bench.operand_sets(m, n, k, torch.bfloat16, "NT")
            library = bench.gemm_call(bench.library_gemm, sets)
            library_us = 1e3 * bench.graph_ms(library, len(sets))[0]
            k_steps = -(-k * 2 // step2.TILE_K_BYTES)
            results = []
            for tile_m in (64, 128):
                for tile_n in (128, 256):
                    for splits in range(1, MAX_SPLITS + 1):
                        per_slice = -(-k_steps // splits)
                        if -(-k_steps // per_slice) < splits:
                            continue  # an empty last slice: split_plan never asks for one
                        with forced(tile_m, tile_n, splits):
                            call = bench.gemm_call(cute_clusters_of_1, sets)
                            us = 1e3 * bench.graph_ms(call, len(sets))[0]
                            error = error_units(cute_clusters_of_1, *sets[0])
                        results.append((us, tile_m, tile_n, splits, error))
            results.sort()
            record["sweep"].append([m, n, k, library_us, results])
            chosen = plan_taken(m, n, k)
            chosen_us = next((us for us, *plan, _ in results if tuple(plan) == chosen), None)
            print(f"{m} x {n} x {k}: cuBLAS {library_us:.1f} us; chosen {chosen}: {chosen_us} us")
            for us, tile_m, tile_n, splits, error in results[:6]:
                print(
                    f"    {us:6.1f} us  {library_us / us:5.2f}x  tile {tile_m} x {tile_n}, "
                    f"S = {splits}  (error {error:.1e})"
                )
            worst = max(result[4] for result in results)
            print(f"    slowest {results[-1][0]:.1f} us; largest error of any plan {worst:.1e}")
    print(f"{time.time() - started:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_decode_tile.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
