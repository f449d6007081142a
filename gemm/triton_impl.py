"""gemm: C = alpha*A@B + beta*C as tiled Triton kernels (README.md, "triton_impl.py").

    c_ij = alpha * sum_l a_il b_lj + beta * c_ij

A program computes one BLOCK_M x BLOCK_N tile of C over a range of k (a *unit*): `tl.dot` adds
the products of A and B tiles into a float32 accumulator, and the tile is finished in float32,
alpha * acc + beta * c, rounded once by the store. The file, top to bottom:

constants        the tile tiers, the one-row (decode) plan, split k, TMA's threshold, staging
plans            `configuration` (tile, warps, stages, split of k: `row_plan`, `split_count`)
                 and `additions`, the rounding count the bound needs (README.md, "Counting r")
kernels          `gemm_kernel` (pointers and masks: any strides) and `gemm_tma_kernel`
                 (persistent, tiles through TMA descriptors); both share `tile_of_program`
                 (the grouped order) and `finish_unit` (split k's fixed-order sum of partials)
host             `choose_path` (pointer, TMA or staged), `split_workspace`,
                 `patch_triton_interpreter` (so the kernels run on a CPU under
                 TRITON_INTERPRET=1), `launch` (Triton's host work done once per
                 specialisation) and `gemm`, the public entry point
"""

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.knobs import HookChain
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from reference import check_operands, to_float32

# Eight tiles of C along m share each tile of B before the order moves on along n.
GROUP_M = 8
# The H200 has 132 SMs: a tier is used while C has at least FULL_WAVE of its tiles (below).
SM_COUNT = 132
# The tiers: the largest tile of which C has at least FULL_WAVE, each the fastest of the H200
# sweeps in README.md's tuning log. 16-bit data: a 128 x 256 tile halves the loads per flop of a
# 128 x 128 one; its float32 accumulator is 128 of a thread's registers over 8 warps, and 3
# stages of A and B tiles take 144 KiB of shared memory.
LARGE_TENSOR_CORE = {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3}
# 16-bit data with fewer than FULL_WAVE wide tiles: 128 x 128 while C still has about one per SM,
# then 64 x 128 (1024^3: 128 tiles, one wave; 0.76x cuBLAS against 0.64x on 64 x 64 tiles).
MEDIUM_TENSOR_CORE = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4}
NARROW_TENSOR_CORE = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
# TF32: 128 x 256 needs more shared memory on the TMA path than a block may have: half as wide.
LARGE_TF32 = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
# IEEE float32 has no tensor-core path: tl.dot becomes FMAs on the CUDA cores.
LARGE_IEEE_FLOAT32 = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# Fewer than FULL_WAVE tiles of every larger tier: 64 x 64, so that a small C still spreads out.
SMALL = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# A tier is taken when C has at least FULL_WAVE of its tiles: one wave with at most 1/16 of the
# SMs idle beats two waves of tiles half the size (2048^3: 128 tiles of 128 x 256 ran at 0.93x
# cuBLAS, 256 of 128 x 128 at 0.82x; README.md, "Medium sizes").
FULL_WAVE = SM_COUNT - SM_COUNT // 16
# A C of at most ONE_ROW rows (a decode step's tokens) is one row of tiles BLOCK_M = the next
# power of two >= m rows tall (16 at least: tl.dot's smallest), so each element of B, the
# weight, is loaded once: the call is bound by B's 2nk bytes, not by flops. `row_plan` picks the
# tiles' width among ROW_WIDTHS and the split of k. A k step is ROW_K_BYTES of each row (two
# cache lines: fewer, longer loads in flight per stage), and the stages fill ROW_SMEM_BYTES of
# shared memory (at most ROW_STAGES): a program keeps 100-200 KiB of W in flight. 8 warps only
# for 128 rows, where the float32 accumulator needs two warpgroups.
ONE_ROW = 128
ROW_WIDTHS = (128, 64)
ROW_K_BYTES = 256
ROW_SMEM_BYTES = 200 * 1024
ROW_STAGES = 6
# A block may have 227 KiB of shared memory on the H200; less 1 KiB for the mbarriers, the TMA
# kernel's stages and its epilogue's C tile (BLOCK_M x BLOCK_N of C's dtype, rearranged through
# shared memory while the stages stay live: the kernel pipelines across units) fit in
# ROW_BLOCK_SMEM_BYTES. 16-bit tiles fit ROW_SMEM_BYTES of stages beside it; a 128 x 128 float32
# (TF32) tile fits 2 of its 64 KiB stages, not 3 (262168 bytes: the launch would fail).
ROW_BLOCK_SMEM_BYTES = 226 * 1024
# A unit's fixed cost (filling its pipeline, storing and re-reading a partial) is about that of
# streaming ROW_UNIT_K more values of k (fitted to the H200 sweep in README.md's tuning log).
ROW_UNIT_K = 2560
# Split k only into ranges of at least MIN_SPLIT_STEPS k steps (each fills the pipeline of
# num_stages), and into at most MAX_SPLITS: the last program of a tile reads that many partial
# tiles, and a term's sum gains SPLITS - 1 additions.
MIN_SPLIT_STEPS = 4
MAX_SPLITS = 8
# Tensor-core work of m n k < TMA_MIN_VOLUME goes to the pointer kernel even where TMA can fetch
# its operands: below it the pointer kernel is as fast on the GPU and about 5 us cheaper on the
# host (no descriptors). The H200's crossover lies between 1024^3 and 2048^3 (README.md, "Which
# kernel"); this is halfway on a side.
TMA_MIN_VOLUME = 1536**3
# Stage an operand TMA cannot fetch (an aligned copy, then TMA) when each of its elements feeds
# at least STAGE_MIN_REUSE products: the copy reads and writes 2 s bytes an element at about
# 3.5 TB/s, the product does 2 * reuse flops with it at about 650 TFLOP/s, so for 16-bit data
# the copy costs at most a third of the product it feeds (186 s / reuse).
STAGE_MIN_REUSE = 1024


def on_tensor_cores(dtype, allow_tf32):
    """16-bit data, and float32 with TF32, go to the tensor cores; IEEE float32 does not."""
    return dtype != torch.float32 or allow_tf32


def ceil_div(a, b):
    """Python's integer ceil(a / b): triton.cdiv costs about 2.5 us a call on the host."""
    return -(-a // b)


def tiers_of(dtype, allow_tf32):
    """(the tiers to try, largest first; the fallback) for `dtype`, each with its BLOCK_K: 128
    bytes of each row of an A tile, 32 float32 or 64 16-bit values (one cache line, and the k
    extent of a few wgmma instructions). float32 with TF32 runs on the tensor cores and takes
    their shape."""
    block_k = {"BLOCK_K": 128 // dtype.itemsize}
    if dtype != torch.float32:
        tiers = [LARGE_TENSOR_CORE, MEDIUM_TENSOR_CORE, NARROW_TENSOR_CORE]
    else:
        tiers = [LARGE_TF32 if allow_tf32 else LARGE_IEEE_FLOAT32]
    return [{**tile, **block_k} for tile in tiers], {**SMALL, **block_k}


# Built once: configuration() only compares tile counts.
TIERS = {
    (dtype, allow_tf32): tiers_of(dtype, allow_tf32)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for allow_tf32 in (False, True)
}


def row_plan(m, n, k, itemsize):
    """(tile, SPLITS) of a one-row C (m <= ONE_ROW): the width in ROW_WIDTHS and the split of k
    whose busiest SM streams the fewest columns of W, ceil(units / SM_COUNT) units of
    BLOCK_N x (k_per_split + ROW_UNIT_K), the wider tile, then the fewer splits, among equals.
    Long ranges win: each unit pays to fill its pipeline and to store its partial."""
    block_m, block_k = max(16, 1 << (m - 1).bit_length()), ROW_K_BYTES // itemsize
    k_steps, best = ceil_div(k, block_k), None
    for block_n in ROW_WIDTHS:
        tiles = ceil_div(n, block_n)
        for splits in range(1, min(MAX_SPLITS, k_steps // MIN_SPLIT_STEPS) + 1):
            k_per_split = ceil_div(k_steps, splits) * block_k
            busiest = ceil_div(tiles * splits, SM_COUNT) * block_n * (k_per_split + ROW_UNIT_K)
            if best is None or busiest < best[0]:
                best = busiest, block_n, splits
    block_n, splits = (ROW_WIDTHS[0], 1) if best is None else best[1:]
    stage_bytes = (block_m + block_n) * block_k * itemsize
    stages_bytes = min(ROW_SMEM_BYTES, ROW_BLOCK_SMEM_BYTES - block_m * block_n * itemsize)
    tile = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "num_warps": 8 if block_m == 128 else 4,
            "num_stages": min(ROW_STAGES, stages_bytes // stage_bytes)}  # fmt: skip
    return tile, splits


def split_count(tiles, k_steps):
    """Into how many ranges to split k: 1 when C has a tile for every SM. Else the count s that
    spreads the tiles * s units most evenly over the SMs, i.e. that minimises the time of the
    busiest SM, ceil(tiles * s / SM_COUNT) / s units of unsplit work, the fewest splits among
    equals (fewer partials to write and add), each split MIN_SPLIT_STEPS k steps or more."""
    most = min(MAX_SPLITS, k_steps // MIN_SPLIT_STEPS)
    if tiles >= SM_COUNT or most < 2:
        return 1
    return min(range(1, most + 1), key=lambda s: (ceil_div(tiles * s, SM_COUNT) / s, s))


def tiles_of(m, n, tile):
    """How many tiles of `tile`'s shape cover an m x n C."""
    return ceil_div(m, tile["BLOCK_M"]) * ceil_div(n, tile["BLOCK_N"])


@functools.lru_cache(maxsize=4096)
def configuration(m, n, k, dtype, allow_tf32=False):
    """The launch's constants for an m x n C of `dtype` summed over k (k = 0: nothing read):
    one row of tiles for m <= ONE_ROW, else the first tier of which C has at least FULL_WAVE
    tiles, else the small one (`tiers_of`); SPLITS ranges of k_per_split (a whole number of k
    steps), none empty; the precision of tl.dot. Cached, so that a call builds no dict: a model
    calls a few shapes over and over. The dicts are shared; nobody edits them."""
    if m <= ONE_ROW:
        tile, splits = row_plan(m, n, k, dtype.itemsize)
    else:
        tiers, small = TIERS[dtype, bool(allow_tf32)]
        tile = next((t for t in tiers if tiles_of(m, n, t) >= FULL_WAVE), small)
        splits = split_count(tiles_of(m, n, tile), ceil_div(k, tile["BLOCK_K"]))
    block_k = tile["BLOCK_K"]
    k_per_split = ceil_div(ceil_div(k, splits), block_k) * block_k
    return {
        **tile, "SPLITS": ceil_div(k, k_per_split) if k else 1, "k_per_split": k_per_split,
        # TF32 applies to float32 inputs only; 16-bit inputs go to the tensor cores as they are.
        "INPUT_PRECISION": "tf32" if allow_tf32 and dtype == torch.float32 else "ieee",
        "UPCAST": INTERPRETED and dtype == torch.bfloat16, "GROUP_M": GROUP_M,
    }  # fmt: skip


def additions(m, n, k, dtype, allow_tf32=False):
    """For the error bound (README.md, "Split k"): the most float32 additions a product meets
    on its way into its entry's sum, the serial chain of its range of k, then SPLITS - 1 in the
    fixed-order sum of the partials. At most k: with SPLITS >= 2 ranges, none empty,
    k >= (SPLITS - 1) k_per_split + 1 >= k_per_split + SPLITS - 1."""
    config = configuration(m, n, k, dtype, allow_tf32)
    return min(k, config["k_per_split"]) + config["SPLITS"] - 1


@triton.jit
def tile_of_program(pid, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program pid in the grouped order: programs run down a group
    of GROUP_M tile rows, column by column, and only then move to the next group."""
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    programs_per_group = GROUP_M * tiles_n
    group = pid // programs_per_group
    first_tile_m = group * GROUP_M
    rows_in_group = min(tiles_m - first_tile_m, GROUP_M)  # the last group may be short
    within = pid % programs_per_group
    return first_tile_m + within % rows_in_group, within // rows_in_group


@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, c_ptr, partials_ptr, counters_ptr, m, n, k,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, alpha, beta, k_per_split,
    READ_AB: tl.constexpr, READ_C: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    unit = tl.program_id(0)
    tile, split = unit // SPLITS, unit % SPLITS
    tile_m, tile_n = tile_of_program(tile, m, n, BLOCK_M, BLOCK_N, GROUP_M)
    # 64-bit offsets: m*k, k*n or m*n elements may pass 2**31, and row * stride with it.
    offs_m = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = offs_m < m, offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # "Not read" is a compile-time choice: the alpha == 0 variant has no load of A or B at all.
    if READ_AB:
        a_ptrs = a_ptr + offs_m[:, None] * stride_am
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn
        # k_per_split is whole k steps, so only k's own end needs a mask.
        k_begin = split * k_per_split
        for k_start in range(k_begin, min(k, k_begin + k_per_split), BLOCK_K):
            offs_k = (k_start + tl.arange(0, BLOCK_K)).to(tl.int64)
            k_in = offs_k < k
            a_in, b_in = row_in[:, None] & k_in[None, :], k_in[:, None] & col_in[None, :]
            a = tl.load(a_ptrs + offs_k[None, :] * stride_ak, mask=a_in, other=0.0)
            b = tl.load(b_ptrs + offs_k[:, None] * stride_bk, mask=b_in, other=0.0)
            if UPCAST:  # the interpreter's dot is wrong on bfloat16 values; widening is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=tl.float32)
        acc = alpha * acc
    finish_unit(
        acc, tile, split, partials_ptr, counters_ptr, c_ptr, offs_m, offs_n, m, n,
        stride_cm, stride_cn, beta, READ_C, BLOCK_M, BLOCK_N, SPLITS,
    )  # fmt: skip


@triton.jit
def finish_unit(
    acc, tile, split, partials_ptr, counters_ptr, c_ptr, offs_m, offs_n, m, n,
    stride_cm, stride_cn, beta, READ_C: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Finish the tile from acc, alpha times the sum over this unit's range of k. With one range
    that is the whole sum. With SPLITS ranges, acc goes to this unit's slot among the tile's SPLITS
    float32 partial tiles, and the program that brings the tile's count to SPLITS adds them in
    the order 0, 1, ..., SPLITS - 1 (whichever program that is, the same additions), finishes
    the tile and sets the count back to 0 for the next launch."""
    if SPLITS == 1:
        finish_tile(acc, c_ptr, offs_m, offs_n, m, n, stride_cm, stride_cn, beta, READ_C)
    else:
        in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_partials = partials_ptr + tile * (SPLITS * BLOCK_M * BLOCK_N) + in_tile
        tl.store(tile_partials + split * (BLOCK_M * BLOCK_N), acc)
        # One thread performs the atomic: the barrier orders every thread's stores before it, and
        # its release (acq_rel, GPU scope) publishes them to the program that acquires after it.
        tl.debug_barrier()
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            # .cg: read the partials from L2, where the other SMs' stores are.
            total = tl.load(tile_partials, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                total += tl.load(tile_partials + s * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            finish_tile(total, c_ptr, offs_m, offs_n, m, n, stride_cm, stride_cn, beta, READ_C)
            tl.store(counters_ptr + tile, 0)


@triton.jit
def finish_tile(acc, c_ptr, offs_m, offs_n, m, n, stride_cm, stride_cn, beta, READ_C: tl.constexpr):
    """C tile = acc + beta * C tile in float32 (acc holds alpha * sum), rounded once by the
    store; nothing outside (m, n) is read or written."""
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    in_bounds = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    if READ_C:
        acc += beta * tl.load(c_ptrs, mask=in_bounds).to(tl.float32)  # 0 + v is exact
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def load_tile(desc, row, col, TRANSPOSED: tl.constexpr):
    """The tile at (row, col) of an operand given by its TMA descriptor. A transposed operand is
    described as the contiguous matrix it is the transpose of, so its tile is fetched at
    (col, row) and transposed in shared memory. One return statement: after an `if` whose
    branch returns, Triton 3.6 still compiles the code that follows, which Python (and so the
    interpreter) skips, and two returns of transposed shapes failed to compile."""
    if TRANSPOSED:
        tile = desc.load([col, row]).T
    else:
        tile = desc.load([row, col])
    return tile


@triton.jit
def gemm_tma_kernel(
    a_desc, b_desc, c_ptr, partials_ptr, counters_ptr, m, n, k, stride_cm, stride_cn,
    alpha, beta, k_per_split, A_TRANSPOSED: tl.constexpr, B_TRANSPOSED: tl.constexpr,
    READ_C: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    units = tl.cdiv(m, BLOCK_M) * tl.cdiv(n, BLOCK_N) * SPLITS
    # flatten=True: Triton pipelines across units, so the next unit's loads are in flight
    # while this one is finished.
    for unit in tl.range(tl.program_id(0), units, tl.num_programs(0), flatten=True):
        tile, split = unit // SPLITS, unit % SPLITS
        tile_m, tile_n = tile_of_program(tile, m, n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_begin = split * k_per_split
        for k_start in range(k_begin, min(k, k_begin + k_per_split), BLOCK_K):
            a = load_tile(a_desc, tile_m * BLOCK_M, k_start, A_TRANSPOSED)
            b = load_tile(b_desc, k_start, tile_n * BLOCK_N, B_TRANSPOSED)
            if UPCAST:  # the interpreter's dot is wrong on bfloat16 values; widening is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=tl.float32)
        offs_m = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        finish_unit(
            alpha * acc, tile, split, partials_ptr, counters_ptr, c_ptr, offs_m, offs_n, m, n,
            stride_cm, stride_cn, beta, READ_C, BLOCK_M, BLOCK_N, SPLITS,
        )  # fmt: skip


def tma_ready(t):
    """True when TMA can fetch tiles of matrix t: t or its transpose has rows of stride 1, and
    the other stride and the address are 16-byte aligned."""
    row_stride, col_stride = t.stride()
    if t.data_ptr() % 16:
        return False
    if col_stride == 1:
        return row_stride > 0 and row_stride * t.itemsize % 16 == 0
    return row_stride == 1 and col_stride > 0 and col_stride * t.itemsize % 16 == 0


def tma_operand(t, block_rows, block_cols):
    """(the TMA descriptor of t's block_rows x block_cols tiles, whether t is transposed) for a
    tma_ready t. A transposed t (columns of stride 1) is described as t.T, the contiguous matrix
    it is the transpose of, with the block shape swapped; the kernel transposes each tile back.
    TensorDescriptor.from_tensor's checks are skipped (tma_ready and the configurations already
    guarantee them): 0.4 us where from_tensor takes 2.1. The descriptor holds the tensor itself,
    so it is not kept between calls (that would keep the tensor's memory alive), and Triton
    3.6's launcher encodes the CUtensorMap from it on every launch."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.padding, strides = t, "zero", t.stride()
    if strides[1] == 1:
        desc.shape, desc.strides, desc.block_shape = t.shape, strides, [block_rows, block_cols]
        return desc, False
    desc.shape, desc.strides = t.shape[::-1], strides[::-1]
    desc.block_shape = [block_cols, block_rows]
    return desc, True


def aligned_copy(t):
    """t's values in a new matrix that TMA can fetch, in t's own order (row- or column-major, so
    the copy reads t along its contiguous dimension), the leading dimension rounded up to 16
    bytes: torch.empty((rows, padded))[:, :cols]. The padding is never read as data: the
    descriptor keeps t's true shape and TMA fills past it with zeros."""
    row_major = t.stride(0) >= t.stride(1)
    source = t if row_major else t.T
    rows, cols = source.shape
    per_16_bytes = 16 // t.itemsize
    padded = torch.empty(
        (rows, ceil_div(cols, per_16_bytes) * per_16_bytes), dtype=t.dtype, device=t.device
    )
    copy = padded[:, :cols].copy_(source)
    return copy if row_major else copy.T


def choose_path(A, B, tensor_cores):
    """Which kernel takes the call: "pointer" unless the work is for the tensor cores and of
    TMA_MIN_VOLUME = m n k or more; then "tma" when TMA can fetch A and B as they are; "staged"
    when it can fetch each one that it cannot after an aligned copy worth its cost (the
    operand's elements each feed STAGE_MIN_REUSE products or more: n for A, m for B); else
    "pointer". The copy costs 2 s bytes of traffic per element: at 4097 x 5121 x 3079 bf16 NN,
    A and B are 56.7 MB, 113 MB moved, about 30 us at 3.5 TB/s against about 200 us for the
    product on the tensor cores."""
    (m, k), n = A.shape, B.shape[1]
    if not tensor_cores or m * n * k < TMA_MIN_VOLUME:
        return "pointer"
    a_ready, b_ready = tma_ready(A), tma_ready(B)
    if a_ready and b_ready:
        return "tma"
    if (a_ready or n >= STAGE_MIN_REUSE) and (b_ready or m >= STAGE_MIN_REUSE):
        return "staged"
    return "pointer"


# (device index, stream) -> (float32 partial tiles, int32 zeroed counts) of split launches.
SPLIT_WORKSPACES = {}


def split_workspace(device, partial_elements, tiles):
    """(at least `partial_elements` float32 for a split launch's partial tiles, at least `tiles`
    int32 zeros for its counts), which the launch leaves zeroed (the last program of each tile
    sets its count back to 0). Launches on one stream run one after another, so one workspace
    per device and stream serves them all, grown when a launch needs more, and launches on
    other streams cannot disturb it. While a CUDA graph is captured, the call gets its own from
    the graph's pool, the zeroing captured with it (a cached one created then would only be
    zeroed on replay); the interpreter gets its own too."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return (
            torch.empty(partial_elements, dtype=torch.float32, device=device),
            torch.zeros(tiles, dtype=torch.int32, device=device),
        )
    key = (device.index, driver.active.get_current_stream(device.index))
    workspace = SPLIT_WORKSPACES.get(key)
    if workspace is None or workspace[0].numel() < partial_elements or workspace[1].numel() < tiles:
        workspace = (
            torch.empty(partial_elements, dtype=torch.float32, device=device),
            torch.zeros(max(tiles, SM_COUNT), dtype=torch.int32, device=device),
        )
        SPLIT_WORKSPACES[key] = workspace
    return workspace


# Read once: test.py sets it before importing Triton, and the launcher should not pay for a look-up.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_triton_interpreter():
    """Make Triton 3.6's CPU interpreter compute what the GPU computes; called at import only
    under TRITON_INTERPRET=1, so the GPU path never runs it. With numpy 2.4 the interpreter fails
    where it makes a Python int of a scalar (a one-element array) with int(array): numpy 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"), so a loop over
    runtime bounds fails; .item() does it. And it converts float32 <-> bfloat16 bit by bit,
    truncating (its 'rtne' rounds half up) and mangling subnormals where the GPU rounds to
    nearest even and keeps them; torch's exact conversions replace those two cases."""
    import numpy as np  # the interpreter's own dependency; the GPU path needs no numpy
    from triton.runtime import interpreter

    patch_tensor, convert = interpreter._patch_lang_tensor, interpreter._convert_float

    def patch_with_item(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: self.handle.data.item())

    def exact(values, src, dst, rounding_mode):
        values = np.ascontiguousarray(values)
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(values.view(np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy()
        if src == tl.bfloat16 and dst == tl.float32:
            return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16).float().numpy()
        return convert(values, src, dst, rounding_mode)

    interpreter._patch_lang_tensor, interpreter._convert_float = patch_with_item, exact


if INTERPRETED:
    patch_triton_interpreter()


def on_device_of(t):
    """Launch context for t. Triton launches on the current CUDA device, so t's GPU is made
    current when it is another one (entering torch.cuda.device costs more than a launch's own
    Python, so only then); the CPU serves when Triton runs as an interpreter."""
    if t.is_cuda:
        if t.get_device() == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(t.device)
    if INTERPRETED:
        return contextlib.nullcontext()
    raise ValueError(
        f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}"
    )


# -- The launch: Triton's host work done once per specialisation ------------------------------
# kernel[grid](...) costs Triton 3.6 tens of microseconds of host time a call: it binds each
# argument by name, asks each what the compiled code depends on and builds a string key to
# find the compiled kernel. `launch` keeps the compiled kernel Triton returns at the first call
# of a specialisation and hands later calls straight to its launcher (gemm/README.md, "The
# host path"). Every folder's triton_impl.py holds these same lines: a folder imports nothing
# from another.

# (id of the kernel, device, Triton's debug and instrumentation knobs, specialisation(), the
# constants) -> (the CompiledKernel, the kernel's arguments after `args`). A JITFunction hashes
# its source (0.6 us), so the key holds its id: the CompiledKernel holds the kernel (src.fn), so
# that id is no other kernel's while the entry lives.
COMPILED = {}


def specialisation(ints, tensors):
    """What Triton 3.6 compiles a kernel for, of these arguments (its binder,
    native_specialize_impl): an int is compiled in as the constant 1, else as an i32 (below
    2**31) or i64 known to be a multiple of 16 or not; a tensor is a pointer of its dtype known
    to be 16-byte aligned or not. Sizes and strides are never negative nor past 2**63."""
    return (
        *[1 if x == 1 else (x % 16 == 0, x < 2**31) for x in ints],
        *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors],
    )


def unhooked(hook):
    """True for a launch hook that does nothing: None, or Triton 3.6's default, an empty chain."""
    return hook is None or (type(hook) is HookChain and not hook.calls)


def launch(kernel, grid, args, constants, specialised):
    """kernel[grid](*args, **constants), where `specialised` is specialisation() of the ints
    and tensors among `args` (Triton passes a float as float32 whatever its value, and the
    constants, num_warps among them, are in the key). The first call of each key goes through
    Triton, which compiles the kernel or finds it compiled; later ones call its launcher on the
    current stream, as Triton's last step does. Triton's own path stays for whatever needs it:
    the interpreter and wrapped kernels (no JITFunction), pre-run and launch hooks (a profiler),
    a kernel that reads globals (Triton checks them at each launch)."""
    if (
        not isinstance(kernel, JITFunction)
        or kernel.pre_run_hooks
        or kernel.used_global_vals
        or not unhooked(knobs.runtime.launch_enter_hook)
        or not unhooked(knobs.runtime.launch_exit_hook)
    ):
        kernel[grid](*args, **constants)
        return
    device = driver.active.get_current_device()
    key = (
        id(kernel), device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
        specialised, *constants.values(),
    )  # fmt: skip
    found = COMPILED.get(key)
    if found is None:
        compiled = kernel[grid](*args, **constants)
        if compiled is not None:  # None: a jit_cache_hook skipped the compile and the launch
            rest = tuple(constants[param.name] for param in kernel.params[len(args) :])
            COMPILED[key] = compiled, rest
        return
    compiled, rest = found
    compiled.run(
        *(*grid, 1, 1)[:3], driver.active.get_current_stream(device), compiled.function,
        compiled.packed_metadata, None, None, None, *args, *rest,
    )  # fmt: skip


def gemm(alpha, A, B, beta, C, *, allow_tf32=False):
    check_operands(alpha, A, B, beta, C)
    device = on_device_of(C)
    (m, k), n = A.shape, B.shape[1]
    if m == 0 or n == 0:
        return C
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    tf32 = A.dtype == torch.float32 and bool(allow_tf32)
    read_ab, read_c = alpha32 != 0.0 and k > 0, beta32 != 0.0
    config = configuration(m, n, k if read_ab else 0, A.dtype, tf32)
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    splits = config["SPLITS"]
    units = ceil_div(m, block_m) * ceil_div(n, block_n) * splits
    path = choose_path(A, B, read_ab and on_tensor_cores(A.dtype, tf32))
    with device:
        partials = counters = None  # one range of k: the kernels touch neither
        if splits > 1:
            tiles = units // splits
            partials, counters = split_workspace(C.device, units * block_m * block_n, tiles)
        if path == "pointer":
            ints = (m, n, k, *A.stride(), *B.stride(), *C.stride())
            args = (A, B, C, partials, counters, *ints, alpha32, beta32)
            flags = {"READ_AB": read_ab, "READ_C": read_c}
            specialised = specialisation(ints, (A, B, C))
            launch(gemm_kernel, (units,), args, {**flags, **config}, specialised)
            return C
        if path == "staged":
            A, B = (t if tma_ready(t) else aligned_copy(t) for t in (A, B))
        a_desc, a_transposed = tma_operand(A, block_m, block_k)
        b_desc, b_transposed = tma_operand(B, block_k, block_n)
        # One unit a program for a split launch, whose programs run in one or two waves; else
        # one program per SM, persistent.
        programs = units if splits > 1 else min(units, SM_COUNT)
        ints = (m, n, k, *C.stride())
        args = (a_desc, b_desc, C, partials, counters, *ints, alpha32, beta32)
        flags = {"A_TRANSPOSED": a_transposed, "B_TRANSPOSED": b_transposed, "READ_C": read_c}
        launch(gemm_tma_kernel, (programs,), args, {**flags, **config}, specialisation(ints, (C,)))
    return C
