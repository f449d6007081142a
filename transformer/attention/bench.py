"""Benchmark attention on the GPU, forward and forward+backward, against the anchors.

    python bench.py            writes results.json and perf.png beside this file
    python bench.py --quick    bf16 B = 4, H = 32, S = 4096, D = 128 causal and not, fwd and
                               fwd+bwd, the anchors but not the materialised torch_impl, and
                               the per-call rows of triton and the library; no files, < 3 minutes
                               (BENCH_QUICK=1 does the same)
    python bench.py --headline that shape causal and not, with the per-call rows; files
    python bench.py --tiles    the Triton forward at that shape under each of TILE_SWEEP's
                               tiles, causal and not (for FORWARD_TILES); no files
    python bench.py --backward-tiles   the Triton backward alone at that shape (D = 64 and 128)
                               under each of BACKWARD_SWEEP's dK/dV tiles (dQ's as chosen),
                               then each dQ tile (dK/dV's as chosen), causal and not (for
                               BACKWARD_TILES); no files
    python bench.py --cute-tiles   CuTe step 3's forward under each CUTE_FORWARD_SWEEP entry
                               (cute_3_overlap.TILES) and its backward under each
                               CUTE_BACKWARD_SWEEP entry (cute_3_backward.TILES) at that shape,
                               D = 64 and 128, causal and not; no files

Flops: the forward's two products are 4 B H S_q S_k D (halved for causal, where half the scores
are masked); fwd+bwd counts 3.5 times that (the backward's five products, as flash-attention
counts). Times are medians of `triton.testing.do_bench` (L2 flushed) of each pass captured in a
CUDA graph and replayed: the kernels' time; a pass the capture refuses is timed eagerly and its
row's `timing` says why. Implementations are interleaved in ROUNDS rounds, shape by shape,
each round in its own shuffled order (`round_order`), and each pass is run for WARMUP_MS before
it is timed. The ceiling is torch.matmul on bf16 8192^3 in the same run. The library op is torch's
`scaled_dot_product_attention` as it chooses; the anchors: SDPA forced to cuDNN and to
flash-attention 2, FlashAttention-4's CuTe kernels (`flash_attn.cute.flash_attn_func`) when
importable. torch_impl (the materialised scores) is timed where its float32 scores fit.
"""

import functools
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import torch_impl
import triton_impl

HERE = Path(__file__).resolve().parent
ROUNDS = 3
# The card's clock follows its power draw over milliseconds, so a pass may time faster right
# after a light kernel than after a heavy one. In rounds rotated from one fixed list every name
# had the same predecessor each round, and on an H100 `cute` (after fa2, the slowest) timed
# 3-8% faster than `cute.step3`, the same kernels (after step 2): README.md, tuning log. So
# each round has its own order and each pass first runs WARMUP_MS on its own.
WARMUP_MS = 25
HEADLINE = (4, 4096, 32, 32, 128)  # (B, S, H, H_kv, D)
# perf.png: 16384 tokens a batch at S = 512 ... 16384, D = 64 and 128; GQA (8 KV heads) once.
SWEEP = [
    (16384 // s, s, 32, 32, d) for d in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384)
]
SWEEP += [(4, 4096, 32, 8, 128)]
TINY, CALLS = (1, 16, 2, 2, 64), 1000
# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by --tiles for 16-bit D = 128: the
# neighbourhood of FORWARD_TILES's entry, and 4-warp tiles of which two or three programs fit
# an SM (the backward's winners: README.md's tuning log).
TILE_SWEEP = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 128, 4, 3),
              (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3)]  # fmt: skip
# Tiles tried by --backward-tiles, as TILE_SWEEP's entries: the dK/dV kernel's (a key tile's dK
# and dV, K and V held in registers) and the dQ kernel's.
BACKWARD_SWEEP = {
    "dkdv": [(32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (16, 64, 4, 3), (32, 64, 8, 3),
             (32, 128, 8, 3)],
    "dq": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3),
           (128, 64, 8, 4)],
}  # fmt: skip
# (BLOCK_N, STAGES) tried by --cute-tiles for step 3's forward, and (queries, stages) for its
# backward: the entries in use and their neighbours that fit shared memory and, by ptxas, the
# registers without spills.
CUTE_FORWARD_SWEEP = {128: [(128, 2), (128, 3)], 64: [(128, 3), (128, 4), (64, 4)]}
CUTE_BACKWARD_SWEEP = {128: [(64, 2), (64, 3)], 64: [(64, 3), (64, 2), (64, 4)]}
MATERIALISED_LIMIT = 2**33  # bytes of float32 scores torch_impl may allocate (8 GiB)


def sdpa(backend=None):
    def attention(q, k, v, causal):
        heads = [t.transpose(1, 2) for t in (q, k, v)]
        gqa = q.shape[2] != k.shape[2]
        if backend is None:
            out = F.scaled_dot_product_attention(*heads, is_causal=causal, enable_gqa=gqa)
        else:
            with torch.nn.attention.sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*heads, is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2)

    return attention


def implementations():
    from torch.nn.attention import SDPBackend

    impls = {
        "library": sdpa(),
        "torch": lambda q, k, v, causal: torch_impl.attention(q, k, v, causal=causal),
        "triton": lambda q, k, v, causal: triton_impl.attention(q, k, v, causal=causal),
        "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "fa2": sdpa(SDPBackend.FLASH_ATTENTION),
    }
    try:  # CuTe: the default (on a Hopper GPU step 3's forward, and its backward at D = 128),
        # steps 1 and 2 with Triton's backward, step 3 with its own
        import cute_impl

        impls["cute"] = lambda q, k, v, causal: cute_impl.attention(q, k, v, causal=causal)
        for step in (1, 2, 3):
            impls[f"cute.step{step}"] = getattr(cute_impl, f"attention_step{step}")
    except ImportError as error:
        print(f"cute is not measured: {error}")
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v, causal):
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        impls["fa4"] = fa4
    except ImportError as error:
        print(f"fa4 is not measured: {error}")
    return impls


def round_order(names, round_index):
    """The names in round `round_index`'s order: a shuffle seeded by the round, the same in
    every run, so that a name follows a different one each round (WARMUP_MS)."""
    order = list(names)
    random.Random(round_index).shuffle(order)
    return order


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=30, return_mode="median")


def graph_ms(fn):
    """(median ms, timing) of fn replayed from one captured CUDA graph; eagerly if refused."""
    stream, graph, timing = torch.cuda.Stream(), torch.cuda.CUDAGraph(), "graph"
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        try:
            with torch.cuda.graph(graph, stream=stream):
                fn()
        except Exception as error:
            timing = f"eager: not capturable ({str(error).splitlines()[0][:80]})"
    return median_ms(graph.replay if timing == "graph" else fn), timing


def matmul_ceiling_tflops(size=8192):
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * size**3 / median_ms(lambda: a @ b) / 1e9


def timed_passes(attention, q, k, v, do, causal):
    """((fwd ms, fwd+bwd ms), timings); the result is checked against SDPA's first."""
    expected = sdpa()(q, k, v, causal).float()
    got = attention(q, k, v, causal).float()
    if not torch.allclose(got, expected, atol=2e-2, rtol=0):  # a sanity check, not the bound
        raise RuntimeError(f"wrong result (largest error {(got - expected).abs().max():.3g})")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fwd = graph_ms(lambda: attention(q, k, v, causal))

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        attention(*leaves, causal).backward(do)

    both = graph_ms(forward_backward)
    return (fwd[0], both[0]), (fwd[1], both[1])


def shape_rows(impls, shape, causal, ceiling, dtype=torch.bfloat16):
    batch, seq, heads, heads_kv, head_dim = shape
    q = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, seq, heads_kv, head_dim, device="cuda", dtype=dtype) for _ in "kv")
    do = torch.randn_like(q)
    names = [
        n for n in impls if n != "torch" or 4 * batch * heads * seq * seq <= MATERIALISED_LIMIT
    ]
    samples = {name: [] for name in names}
    for round_index in range(ROUNDS):
        for name in round_order(names, round_index):
            if name not in samples:
                continue
            try:
                samples[name].append(timed_passes(impls[name], q, k, v, do, causal))
            except Exception as error:  # an anchor that refuses a shape or a layout
                print(f"{name:8s} {shape} causal={causal}: skipped ({type(error).__name__}: "
                      f"{str(error).splitlines()[0][:100]})")  # fmt: skip
                del samples[name]
    flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    rows = []
    library = {p: statistics.median(s[0][p] for s in samples["library"]) for p in (0, 1)}
    for name, runs in samples.items():
        for index, (pass_name, factor) in enumerate((("fwd", 1.0), ("fwd+bwd", 3.5))):
            ms = statistics.median(run[0][index] for run in runs)
            tflops = factor * flops / ms / 1e9
            row = {"impl": name, "pass": pass_name, "dtype": str(dtype)[6:],
                   "shape": [batch, seq, heads, head_dim], "causal": causal, "ms": ms,
                   "GBps": None, "TFLOPs": tflops, "pct_of_ceiling": 100 * tflops / ceiling,
                   "vs_library": library[index] / ms, "timing": runs[-1][1][index]}  # fmt: skip
            if heads_kv != heads:
                row["kv_heads"] = heads_kv
            rows.append(row)
            print(f"{name:8s} {pass_name:7s} B{batch} S{seq} H{heads}/{heads_kv} D{head_dim} "
                  f"causal={causal!s:5s} {ms * 1e3:9.1f} us {tflops:6.1f} TFLOP/s "
                  f"x{library[index] / ms:.2f} vs SDPA {row['timing'][:5]}")  # fmt: skip
    return rows


def per_call_rows(impls):
    """host_us: wall time of back-to-back forward calls at TINY, rounds rotated."""
    batch, seq, heads, heads_kv, head_dim = TINY
    q = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seq, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")  # fmt: skip
    samples = {name: [] for name in impls}
    for round_index in range(ROUNDS):
        for name in round_order(list(impls), round_index):
            call = impls[name]
            call(q, k, v, False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                call(q, k, v, False)
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / CALLS * 1e6)
    host = {name: statistics.median(us) for name, us in samples.items()}
    return [
        {"impl": name, "pass": "fwd", "dtype": "bfloat16", "shape": [batch, seq, heads, head_dim],
         "causal": False, "ms": None, "GBps": None, "TFLOPs": None, "pct_of_ceiling": None,
         "vs_library": host["library"] / us, "host_us": us}
        for name, us in host.items()
    ]  # fmt: skip


def tile_sweep():
    """TFLOP/s of the Triton forward at HEADLINE under each TILE_SWEEP tile, causal and not."""
    batch, seq, heads, heads_kv, head_dim = HEADLINE
    q = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seq, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")  # fmt: skip
    chosen = triton_impl.FORWARD_TILES[(2, head_dim)]
    for tile in TILE_SWEEP:
        triton_impl.FORWARD_TILES[(2, head_dim)] = tile
        triton_impl.PLANS.clear()
        for causal in (False, True):
            forward = functools.partial(triton_impl.attention, q, k, v, causal=causal)
            try:
                error = (forward().float() - sdpa()(q, k, v, causal).float()).abs().max()
                ms, _ = graph_ms(forward)
            except Exception as failure:  # a tile that does not fit shared memory or registers
                print(f"tile {tile} causal={causal}: {type(failure).__name__}")
                continue
            flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
            mark = "  (FORWARD_TILES)" if tile == chosen else ""
            print(f"tile {tile} causal={causal!s:5s} {ms * 1e3:8.1f} us "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s, error vs SDPA {error:.2g}{mark}")  # fmt: skip
    triton_impl.FORWARD_TILES[(2, head_dim)] = chosen
    triton_impl.PLANS.clear()


def backward_tile_sweep():
    """TFLOP/s of the Triton backward alone (2.5 times the forward's flops) at HEADLINE with
    D = 64 and 128, under each BACKWARD_SWEEP tile of one kernel, the other as chosen."""
    batch, seq, heads, heads_kv, _ = HEADLINE
    for head_dim, causal in [(d, c) for d in (128, 64) for c in (False, True)]:
        q, k, v, do = (torch.randn(batch, seq, h, head_dim, device="cuda", dtype=torch.bfloat16)
                       for h in (heads, heads_kv, heads_kv, heads))  # fmt: skip
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal
                                       ).backward(do.transpose(1, 2))  # fmt: skip
        expected = [leaf.grad.float() for leaf in leaves]
        o, lse = torch.empty_like(q), torch.empty(batch, heads, seq, device="cuda")
        triton_impl.attention_forward(q, k, v, causal, None, o, lse)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        flops = 2.5 * 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
        key = (2, head_dim)
        chosen = triton_impl.BACKWARD_TILES[key]
        for which, tiles in BACKWARD_SWEEP.items():
            for tile in tiles:
                entry = (tile, chosen[1]) if which == "dkdv" else (chosen[0], tile)
                triton_impl.BACKWARD_TILES[key] = entry
                triton_impl.PLANS.clear()  # plans keep their tiles
                backward = functools.partial(triton_impl.attention_backward, q, k, v, o, lse, do,
                                             causal, None, *grads)  # fmt: skip
                try:
                    backward()
                    error = max((g.float() - e).abs().max().item()
                                for g, e in zip(grads, expected, strict=True))  # fmt: skip
                    ms, _ = graph_ms(backward)
                except Exception as failure:  # a tile past shared memory or registers
                    print(f"D={head_dim} causal={causal} {which} {tile}: {type(failure).__name__}")
                    continue
                mark = "  (BACKWARD_TILES)" if entry == chosen else ""
                rate = flops / ms / 1e9
                print(f"D={head_dim} causal={causal!s:5s} {which:4s} {tile} {ms * 1e3:8.1f} us "
                      f"{rate:6.1f} TFLOP/s, error vs SDPA {error:.2g}{mark}")  # fmt: skip
        triton_impl.BACKWARD_TILES[key] = chosen
        triton_impl.PLANS.clear()


def cute_tile_sweep():
    """TFLOP/s of CuTe step 3's forward and backward (alone) at HEADLINE's B, S and H with
    D = 64 and 128, causal and not, under each entry of CUTE_FORWARD_SWEEP and
    CUTE_BACKWARD_SWEEP (each step's TILES replaced while its kernel is compiled)."""
    import cute_1_tiled
    import cute_3_backward
    import cute_3_overlap
    import cute_impl

    def compiled(module, head_dim, tiles, causal, backward):
        chosen = module.TILES[head_dim]
        module.TILES[head_dim] = tiles
        try:
            build = cute_impl.build(torch.bfloat16, head_dim, causal, step=3, backward=backward)
            return build.__tvm_ffi_object__()
        finally:
            module.TILES[head_dim] = chosen

    batch, seq, heads, heads_kv, _ = HEADLINE
    for head_dim, causal in [(d, c) for d in (128, 64) for c in (False, True)]:
        q, k, v, do = (torch.randn(batch, seq, h, head_dim, device="cuda", dtype=torch.bfloat16)
                       for h in (heads, heads_kv, heads_kv, heads))  # fmt: skip
        scale = head_dim**-0.5
        o, lse = torch.empty_like(q), torch.empty(batch, heads, seq, device="cuda")
        expected_o = sdpa()(q, k, v, causal).float()
        expected = [torch.empty_like(t) for t in (q, k, v)]
        triton_impl.attention_forward(q, k, v, causal, None, o, lse)
        triton_impl.attention_backward(q, k, v, o, lse, do, causal, None, *expected)
        flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
        for tiles in CUTE_FORWARD_SWEEP[head_dim]:
            kernel = compiled(cute_3_overlap, head_dim, tiles, causal, backward=False)
            out = torch.empty_like(q)
            forward = functools.partial(kernel, q, k, v, out, torch.empty_like(lse),
                                        scale * cute_1_tiled.LOG2E)  # fmt: skip
            forward()
            error = (out.float() - expected_o).abs().max().item()
            ms, _ = graph_ms(forward)
            mark = "  (TILES)" if tiles == cute_3_overlap.TILES[head_dim] else ""
            print(f"D={head_dim} causal={causal!s:5s} forward {tiles} {ms * 1e3:8.1f} us "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s, error vs SDPA {error:.2g}{mark}")  # fmt: skip
        grads = [torch.empty_like(t) for t in (q, k, v)]
        for tiles in CUTE_BACKWARD_SWEEP[head_dim]:
            kernel = compiled(cute_3_backward, head_dim, tiles, causal, backward=True)
            backward = functools.partial(cute_impl.run_backward, kernel, q, k, v, o, lse, do,
                                         causal, scale, *grads)  # fmt: skip
            backward()
            error = max((g.float() - e.float()).abs().max().item()
                        for g, e in zip(grads, expected, strict=True))  # fmt: skip
            ms, _ = graph_ms(backward)
            mark = "  (TILES)" if tiles == cute_3_backward.TILES[head_dim] else ""
            rate = 2.5 * flops / ms / 1e9
            print(f"D={head_dim} causal={causal!s:5s} backward {tiles} {ms * 1e3:8.1f} us "
                  f"{rate:6.1f} TFLOP/s, error vs Triton {error:.2g}{mark}")  # fmt: skip


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(d, c, p) for d in (64, 128) for c in (False, True) for p in ("fwd", "fwd+bwd")]
    figure, axes = plt.subplots(2, 4, figsize=(22, 9))
    for ax, (head_dim, causal, pass_name) in zip(axes.flat, panels, strict=True):
        chosen = [r for r in rows if r["ms"] and r["shape"][3] == head_dim and r["causal"] == causal
                  and r["pass"] == pass_name and "kv_heads" not in r]  # fmt: skip
        for name in dict.fromkeys(r["impl"] for r in chosen):
            points = sorted((r["shape"][1], r["TFLOPs"]) for r in chosen if r["impl"] == name)
            ax.plot(*zip(*points, strict=True), "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="S (B S = 16384 tokens, H = 32)", ylabel="TFLOP/s",
               title=f"attention {pass_name}, D={head_dim}, causal={causal}")  # fmt: skip
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(quick=False, headline=False):
    started = time.perf_counter()
    ceiling, impls, rows = matmul_ceiling_tflops(), implementations(), []
    if quick:  # the materialised scores: 8.6 GB of float32 and 17-40 ms a call at the headline
        del impls["torch"]
    rows += per_call_rows({n: impls[n] for n in ("library", "triton")} if quick else impls)
    for row in rows:
        print(f"{row['impl']:8s} per call {row['host_us']:.1f} us")
    for shape in [HEADLINE] if quick or headline else [HEADLINE, *SWEEP]:
        for causal in (False, True):
            rows += shape_rows(impls, shape, causal, ceiling)
            torch.cuda.empty_cache()
    print(f"bf16 matmul ceiling {ceiling:.0f} TFLOP/s ({time.perf_counter() - started:.0f} s)")
    results = {"device": torch.cuda.get_device_name(),
               "ceilings": {"bf16_matmul_TFLOPs": ceiling}, "rows": rows}  # fmt: skip
    if not quick:
        (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(rows, HERE / "perf.png")
    return results


if __name__ == "__main__":
    quick = "--quick" in sys.argv or os.environ.get("BENCH_QUICK") == "1"
    if "--tiles" in sys.argv:
        tile_sweep()
    elif "--backward-tiles" in sys.argv:
        backward_tile_sweep()
    elif "--cute-tiles" in sys.argv:
        cute_tile_sweep()
    else:
        main(quick=quick, headline="--headline" in sys.argv)
