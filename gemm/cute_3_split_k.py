"""gemm in the CuTe DSL, step 3: split k, for decode-shaped products (README.md, "Step 3").

Compared with step 2 (cute_2_tma_wgmma.py), this adds split k. A decode step multiplies a few
rows of activations by a weight matrix, C = x W^T with m <= 128: C is one row of n / 128
tiles (32 at n = 4096), so step 2's blocks, one a tile, stream W through 32 of the H200's 132
SMs while 100 idle, and the call is bound by W's 2nk bytes read through a quarter of the chip.
Here a work unit is a tile AND a slice of k: unit (tile, s) multiplies k steps
[s K, (s + 1) K) with step 2's ring, wgmma and warp specialisation (`run_roles`, given
`split_unit` and `store_partial`) and stores its float32 sum, unrounded, in partials[s], a
workspace from torch's allocator; a second kernel on the same stream (`sum_partials`) adds the
S partials of each element in the fixed order s = 0, 1, ..., S - 1 and finishes it as every
step does, alpha * sum + beta * c rounded once. No atomics and no order that depends on which
block finishes first: the same bits on every run. At m <= 128 a unit's tile has 64 rows
(`split_tile_m`), split along n between the two consumer warpgroups: no A row of the ring is
padding, so the ring holds more stages of W (README.md, "Step 3").

Rounding: a term of slice s meets at most k_s additions there (k_s of the slice's k values,
step 2's serial count) and at most S - 1 in the sum of the partials. Every slice holds at least
one k value (`split_plan`), so k_s <= k - (S - 1): r = k + 2 still, as for steps 1 and 2.

The file: `split_plan`, the host's rule for the tile width and S; the unit's work and
epilogue; the two kernels and their launcher; `choose_split` (the dispatch) and `gemm`, which
splits what `choose_split` gives it and hands everything else to step 2.
"""

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

import cute_2_tma_wgmma as step2
from cute_1_tiled import checked_scalars, finish_element, placeholder, sm90a_ptx, tile_of_block
from cute_2_tma_wgmma import (
    HOPPER_THREADS,
    SM_COUNT,
    TILE_K_BYTES,
    TILE_M,
    TMA_ALIGN_BYTES,
    WGMMA_M,
    c_registers_of,
    ceil_div,
    choose_kernel,
    finish_tile,
    hopper_operands,
    hopper_tile_m,
    hopper_tile_n,
    run_roles,
    sm_count,
)

# A slice of k is at least about the ring's depth (6 stages of 128 x 128 tiles, 4 of 128 x 256,
# 9 of 64 x 128, 5 of 64 x 256), so that a unit streams W at full rate for longer than it takes
# to fill the ring.
MIN_SPLIT_STEPS = 8
# A unit advances one k step (TILE_K_BYTES of each column of its B tile) about every STEP_US,
# whatever its width: on the H200, units of 64 x 128 and 64 x 256 both took 0.45-0.5 us a step
# (16 and 32 KiB of W), so a unit's time is its count of k steps, and the chip's is its busiest
# SM's units or W's bytes at HBM's rate, whichever is longer (README.md, tuning log, "The decode
# plan measured"). The constants below price every plan of that sweep within 3% of its best.
STEP_US = 0.45
HBM_BYTES_PER_US = 4.24e6
# A partial costs 8 bytes an element: written by its unit, read back by sum_partials, both at
# HBM's rate; the second kernel's start and tail cost about SPLIT_START_US.
PARTIAL_BYTES = 8
SPLIT_START_US = 3.0
# Workspace rows start on 16-byte boundaries (4 float32): pairs of columns store as one access.
PARTIAL_ROW_ALIGN = 4
SUM_THREADS = 256  # sum_partials: a block sums 256 adjacent columns of one row


def split_tile_m(m):
    """A split unit's tile height: 64 rows while C has at most one 128-row tile row (m <= 128;
    two 64-row tiles read the same W tile, the second mostly from L2), else TILE_M. A 128-row
    unit of a decode step does twice the wgmma work of a 64-row one for the same W."""
    return WGMMA_M if m <= TILE_M else TILE_M


@functools.lru_cache(maxsize=4096)
def split_plan(m, n, k, itemsize):
    """(tile_n, S) for split k, or None to run step 2: None when C already has a 128 x 128 tile
    per SM. Otherwise the plan of least modelled time: max(its busiest SM's waves of units times
    their k steps times STEP_US, W's bytes, read once per tile row, at HBM's rate), plus, when k
    is split, its partials' traffic (S m n PARTIAL_BYTES at HBM's rate) and SPLIT_START_US; over
    step 2's own tile unsplit (hopper_tile_m, hopper_tile_n), and split_tile_m(m) rows by 128 or
    256 columns with S from 2 to the most slices of MIN_SPLIT_STEPS or more. Ties go to fewer
    slices. Every slice gets at least one k step."""
    if ceil_div(m, hopper_tile_m(m)) * ceil_div(n, 128) >= SM_COUNT:
        return None
    k_steps = ceil_div(k * itemsize, TILE_K_BYTES)

    def modelled_us(tile_m, tile_n, splits):
        tiles_m = ceil_div(m, tile_m)
        units = tiles_m * ceil_div(n, tile_n) * splits
        streaming = ceil_div(units, SM_COUNT) * ceil_div(k_steps, splits) * STEP_US
        us = max(streaming, tiles_m * n * k * itemsize / HBM_BYTES_PER_US)
        if splits > 1:
            us += splits * m * n * PARTIAL_BYTES / HBM_BYTES_PER_US + SPLIT_START_US
        return us

    best = (modelled_us(hopper_tile_m(m), hopper_tile_n(m, n), 1), 1, 0)
    for tile_n in (128, 256):
        for splits in range(2, min(k_steps // MIN_SPLIT_STEPS, SM_COUNT) + 1):
            if ceil_div(k_steps, ceil_div(k_steps, splits)) < splits:
                continue  # the last slice would be empty: fewer slices do the same
            best = min(best, (modelled_us(split_tile_m(m), tile_n, splits), splits, tile_n))
    return None if best[1] == 1 else (best[2], best[1])


@cute.jit
def split_unit(
    unit, tiles, m, n, k_steps, steps_per_split, tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr,
):  # fmt: skip
    """Work unit `unit`: tile `unit mod tiles` of C (the grouped order) over slice `unit div
    tiles` of k, as (tile row, tile column, first k step, k steps)."""
    tile_m_index, tile_n_index = tile_of_block(unit % tiles, m, n, tile_m, tile_n)
    first_k_step = (unit // tiles) * steps_per_split
    steps = cutlass.min(steps_per_split, k_steps - first_k_step)
    return tile_m_index, tile_n_index, first_k_step, steps


@cute.jit
def store_partial(
    thread_mma, acc, registers, unit, tile_m_index, tile_n_index, partials, tiles, m, n,
    tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
):  # fmt: skip
    """A unit's epilogue: its float32 sum, unrounded, into its tile of partials[slice]: step
    2's finish_tile with alpha = 1 (1 * s is exact) and C not read (`registers`, step 2's
    c_registers_of the slice, hold the pairs on their way out)."""
    finish_tile(
        thread_mma, acc, registers, unit, tile_m_index, tile_n_index,
        partials[unit // tiles, None, None], m, n, cutlass.Float32(1.0), cutlass.Float32(0.0),
        tile_m, tile_n, False, True, False,
    )  # fmt: skip


@cute.kernel
def split_k_kernel(
    tma_a: cute.CopyAtom,
    A_tma: cute.Tensor,
    tma_b: cute.CopyAtom,
    B_tma: cute.Tensor,
    partials: cute.Tensor,
    m: cutlass.Int32,
    n: cutlass.Int32,
    k: cutlass.Int32,
    tiled_mma: cute.TiledMma,
    a_smem_layout: cute.ComposedLayout,
    b_smem_layout: cute.ComposedLayout,
    dtype: cutlass.Constexpr,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    tile_k: cutlass.Constexpr[int],
    stages: cutlass.Constexpr[int],
):
    block, _, _ = cute.arch.block_idx()
    blocks, _, _ = cute.arch.grid_dim()
    splits = cutlass.Int32(cute.size(partials, mode=[0]))
    k_steps = (k + tile_k - 1) // tile_k
    steps_per_split = (k_steps + splits - 1) // splits
    tiles = ((m + tile_m - 1) // tile_m) * ((n + tile_n - 1) // tile_n)
    work = functools.partial(
        split_unit, tiles=tiles, m=m, n=n, k_steps=k_steps, steps_per_split=steps_per_split,
        tile_m=tile_m, tile_n=tile_n,
    )  # fmt: skip
    # The epilogue's registers: step 2's, for a tile of one slice (every slice has its layout).
    prepare = functools.partial(
        c_registers_of, C=partials[0, None, None], m=m, n=n, tile_m=tile_m, tile_n=tile_n,
        c_read_early=False,
    )  # fmt: skip
    finish = functools.partial(
        store_partial, partials=partials, tiles=tiles, m=m, n=n, tile_m=tile_m, tile_n=tile_n
    )
    # Persistent as in step 2: block b runs units b, b + blocks, ... In clusters of 1: each
    # element of W is read once whatever the clusters, and one tile row has no partner row.
    run_roles(
        tma_a, A_tma, tma_b, B_tma, tiled_mma, a_smem_layout, b_smem_layout, 0,
        (block, tiles * splits, blocks), work, prepare, finish, dtype, tile_m, tile_n, tile_k,
        stages, 1,
    )  # fmt: skip


@cute.kernel
def sum_partials(
    partials: cute.Tensor,
    C: cute.Tensor,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    read_c: cutlass.Constexpr[bool],
):
    """c_ij = alpha * (((p_0 + p_1) + p_2) + ... + p_{S-1}) + beta * c_ij with p_s =
    partials[s, i, j]: a thread an element, block (x, i) the columns x SUM_THREADS + (0, 1,
    ...) of row i, so that a warp reads 128 adjacent bytes of each partial."""
    thread, _, _ = cute.arch.thread_idx()
    column_block, row, _ = cute.arch.block_idx()
    column = column_block * SUM_THREADS + thread
    if column < cute.size(C, mode=[1]):
        acc = partials[0, row, column]
        # unroll: the loads of several partials are in flight at once; the adds stay in order
        for split in cutlass.range(1, cute.size(partials, mode=[0]), unroll=4):
            acc = acc + partials[split, row, column]
        finish_element(C, (row, column), acc, alpha, beta, True, read_c)


@cute.jit
def launch_split_k(
    A: cute.Tensor,
    B: cute.Tensor,
    C: cute.Tensor,
    partials: cute.Tensor,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    blocks: cutlass.Int32,
    stream: cuda.CUstream,
    a_k_major: cutlass.Constexpr[bool],
    b_k_major: cutlass.Constexpr[bool],
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    read_c: cutlass.Constexpr[bool],
):
    # A and B as step 2's Hopper build has them; C any strides; partials (S, m, n) float32
    # with rows and slices an even number of elements apart (`build_split_k`).
    ops = hopper_operands(A, B, a_k_major, b_k_major, tile_m, tile_n, 1)
    split_k_kernel(
        ops.tma_a, ops.A_tma, ops.tma_b, ops.B_tma, partials, ops.m, ops.n, ops.k,
        ops.tiled_mma, ops.a_smem_layout, ops.b_smem_layout, A.element_type, tile_m, tile_n,
        ops.tile_k, ops.stages,
    ).launch(grid=[blocks, 1, 1], block=[HOPPER_THREADS, 1, 1], stream=stream)  # fmt: skip
    # The same stream: it starts when every partial has been stored.
    sum_partials(partials, C, alpha, beta, read_c).launch(
        grid=[cute.ceil_div(ops.n, SUM_THREADS), ops.m, 1], block=[SUM_THREADS, 1, 1],
        stream=stream,
    )  # fmt: skip


def choose_split(A, B, allow_tf32):
    """(a_k_major, b_k_major, tile_n, S) when step 2 would run its Hopper kernel on these
    operands (`choose_kernel`) and `split_plan` splits k; else None (step 2 runs the call).
    The cached plan, read from the shapes alone, comes first: a call it does not split reaches
    step 2 without choose_kernel run twice."""
    (m, k), n = A.shape, B.shape[1]
    plan = split_plan(m, n, k, A.itemsize)
    if plan is None:
        return None
    choice = choose_kernel(A, B, allow_tf32)
    return (*choice[1:], *plan) if choice[0] == "hopper" else None


def build_split_k(dtype, a_k_major, b_k_major, tile_m, tile_n, read_c, options=""):
    """cute.compile the split-k launcher for TVM-FFI calls (as step 2's build_hopper): A and
    B with step 2's TMA layouts, C any strides, partials (S, m, n) sharing m and n with them."""
    m, n, k = cute.sym_int64(), cute.sym_int64(), cute.sym_int64()
    tma_vector = TMA_ALIGN_BYTES // dtype.itemsize
    A = placeholder(dtype, m, k, 1 if a_k_major else 0, tma_vector)
    B = placeholder(dtype, k, n, 0 if b_k_major else 1, tma_vector)
    even = (cute.sym_int64(divisibility=2), cute.sym_int64(divisibility=2), 1)
    partials = cute.runtime.make_fake_tensor(
        cutlass.Float32, (cute.sym_int64(), m, n), stride=even, assumed_align=8
    )
    return cute.compile(
        launch_split_k, A, B, placeholder(dtype, m, n), partials, 1.0, 1.0, 1,
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), a_k_major, b_k_major, tile_m,
        tile_n, read_c, options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_split_k(dtype, a_k_major, b_k_major, tile_m, tile_n, read_c):
    """The split-k build, compiled once and cached (the TVM-FFI function, as compile_hopper)."""
    return build_split_k(dtype, a_k_major, b_k_major, tile_m, tile_n, read_c).__tvm_ffi_object__()


def ptx_of(dtype, a_k_major=True, b_k_major=True, tile_n=128, read_c=True, tile_m=TILE_M):
    """The sm_90a PTX of the split-k build (both kernels) for these compile-time choices."""
    return sm90a_ptx(build_split_k, dtype, a_k_major, b_k_major, tile_m, tile_n, read_c)


def run_checked(A, B, C, alpha32, beta32, read_ab, read_c, allow_tf32, cluster_m):
    """gemm once checked_scalars has passed: what `choose_split` splits runs here, everything
    else on step 2 (its run_checked, with cluster_m); step 4 hands its operands here."""
    plan = choose_split(A, B, allow_tf32) if read_ab and C.numel() else None
    if plan is None:
        return step2.run_checked(A, B, C, alpha32, beta32, read_ab, read_c, allow_tf32, cluster_m)
    a_k_major, b_k_major, tile_n, splits = plan
    (m, _), n = A.shape, B.shape[1]
    tile_m = split_tile_m(m)
    # From torch's caching allocator, on C's stream: safe to capture in a CUDA graph.
    row = ceil_div(n, PARTIAL_ROW_ALIGN) * PARTIAL_ROW_ALIGN
    partials = torch.empty((splits, m, row), dtype=torch.float32, device=C.device)[:, :, :n]
    units = ceil_div(m, tile_m) * ceil_div(n, tile_n) * splits
    kernel = compile_split_k(A.dtype, a_k_major, b_k_major, tile_m, tile_n, read_c)
    kernel(A, B, C, partials, alpha32, beta32, min(units, sm_count(C.get_device())))
    return C


def gemm(alpha, A, B, beta, C, *, allow_tf32=False, cluster_m=2):
    """C = alpha*A@B + beta*C for CUDA tensors of one dtype, in float32; returns C: validated,
    then `run_checked`."""
    alpha32, beta32, read_ab, read_c = checked_scalars(alpha, A, B, beta, C)
    return run_checked(A, B, C, alpha32, beta32, read_ab, read_c, allow_tf32, cluster_m)
