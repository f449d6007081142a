"""gemm in the CuTe DSL: C = alpha*A@B + beta*C, from a plain tiled kernel to a Hopper one.

The math
--------
    c_ij = round_to_dtype( alpha32 * s_ij + beta32 * c_ij ),   s_ij = sum_l a_il b_lj in float32

alpha and beta are rounded to float32 once, on the host. Every element is widened to float32
(exact), the k products of an entry are summed in a float32 accumulator, the tile is finished
in float32 and rounded once, to nearest even, when it is stored. No block needs another's
result: no atomics, and the order of every addition is fixed by the shape and the kernel, so
the same inputs give the same bits on every run. BLAS's corner semantics are compile-time
variants: alpha32 == 0 or k == 0 builds no load of A or B at all, beta32 == 0 no load of C.

Step 1: `plain_kernel`, tiles on the CUDA cores
-----------------------------------------------
A block of 256 threads owns a 128 x 128 tile of C and walks k tile_k at a step; thread t owns
an 8 x 8 register tile, four 4 x 4 sub-tiles at rows 4 (t div 16) + 64 i + r and columns 4 (t
mod 16) + 64 j + c. Per k it reads 8 values of A and 8 of B from shared memory (four 128-bit
ld.shared.v4) for 64 fmas. Shared memory holds a k step of A transposed (k-major, rows padded
to 132 words so the transposing stores do not collide in a bank) and of B as it is, in two
buffers. Global loads (predicated on the m, n and k edges, 0 outside, widened to float32) run
two steps ahead: at the top of step s the registers loaded during step s - 1 are stored to the
other buffer, step s + 2's loads are issued, step s is multiplied, one barrier. Two builds
(PlainConfig): A and B row-major with bases, row strides, k and n multiples of 4
(`vector_loads_ok`) load 4 adjacent elements at a time, k steps of 8, two blocks an SM;
anything else (any strides) loads one element at a time, k steps of 16, one block an SM. Each
update is one fma.rn.f32 (the product is not rounded on its own), so s_ij is a serial sum
along k, in the same order in both builds. This path takes what the tensor cores cannot: IEEE
float32 (wgmma has no IEEE float32, only TF32), operands whose strides TMA refuses, and
dimensions of 2**31 and more; its offsets are 64-bit, so matrices of 2**31 elements and more
index correctly. It also serves alpha32 == 0 and k == 0, where nothing is multiplied.

Final step: `hopper_kernel`, TMA + wgmma + warp specialisation
--------------------------------------------------------------
C is cut into TILE_M x tile_n tiles (128 x 256 when C has at least one such tile per SM, else
128 x 128), and a tile's product is a walk along k in steps of 128 bytes of a row (tile_k = 64
16-bit or 32 float32 values). Blocks are launched in clusters of cluster_m (1 or 2) along m,
and a cluster computes a "cluster tile" of cluster_m x 1 tiles, one per block. The kernel is
persistent: it launches one block per SM (fewer when C has fewer tiles), and cluster c
computes cluster tiles c, c + clusters, c + 2 clusters, ... in the grouped order of README.md
("Why the grouped order helps L2": GROUP_M rows of cluster tiles, column by column; the
clusters running together still cover consecutive tiles). A block is three warpgroups (384
threads) with two jobs:

* Producer, warpgroup 0: one thread of warp 0 issues TMA copies (cp.async.bulk.tensor) of
  the A tile (TILE_M x tile_k) and the B tile (tile_n x tile_k) of each k step into a ring of
  `stages` shared-memory buffers. TMA writes each buffer in the 128-byte swizzled layout that
  wgmma reads without bank conflicts, and zero-fills what lies past the edge of m, n or k, so
  a partial tile adds exact zeros. Each buffer has two mbarriers: "full" completes when TMA
  has written all its bytes (the transaction count), "empty" when both consumers are done
  with it. The producer waits for "empty" before it reuses a buffer. The warpgroup gives
  its registers back (setmaxnreg) to the consumers: it only computes addresses.
* Consumers, warpgroups 1 and 2: each owns 64 rows of the tile. It waits on "full", issues
  tile_k / k_instr wgmma.mma_async (k_instr = 16 for 16-bit data, 8 for TF32) that read A and
  B straight from shared memory and add into a float32 accumulator in registers (64 x tile_n
  per warpgroup: 128 registers a thread at tile_n = 256), commits them, and waits until only
  this step's group is in flight: the previous step's buffer is then free and its "empty"
  barrier is signalled, so TMA refills it while this step's wgmmas run. Producer and
  consumers walk the same tiles and the ring runs on from one tile to the next, so TMA is
  already loading the next tile while the consumers finish this one.
* Epilogue: each consumer thread holds its accumulator fragment and computes alpha * acc +
  beta * c in float32, reading C only in the beta32 != 0 build, and stores it with one
  rounding. The fragment holds pairs of adjacent columns: for a row-major C whose rows start
  on 2-element boundaries (`in_pairs`), whole tiles move each pair as one access. Edge tiles
  and any other C (any strides) go element by element, each inside (m, n) (the coordinates
  come from an identity tensor partitioned like the accumulator).
* Clusters (cluster_m = 2): two blocks of a thread-block cluster, on two SMs of one GPC,
  compute tile rows 2r and 2r + 1 of one tile column, so they need the same B tile at every
  k step. Each block loads half of it and its TMA multicasts that half into the shared memory
  of both (cp.async.bulk.tensor...multicast::cluster), at the same place of the same stage,
  completing the transaction count of each block's own "full" barrier: B crosses L2 once per
  pair of tiles instead of twice. A stays per block. Since the block's TMA now writes into its
  partner's buffers too, it may refill a stage only when the consumers of both blocks are done
  with it: every consumer warp arrives on the "empty" barrier of each block of the cluster
  (a remote arrive, mbarrier.arrive.shared::cluster), and each "empty" barrier waits for all
  of them. The two blocks therefore walk the same tiles in lockstep, one ring step for one
  ring step. When C has an odd number of tile rows, the block on the last, missing row still
  runs: TMA zero-fills its A tile (the whole box lies past m), it loads and multicasts its half
  of B for its partner, and its epilogue stores nothing (every element is outside (m, n)).
* Shared memory: the ring takes STAGE_BUDGET_BYTES = 192 KiB, 4 stages of 48 KiB at 128 x 256
  (16 KiB of A, 32 KiB of B, in either dtype: a k step is 128 bytes of a row) or 6 stages of
  32 KiB at 128 x 128, plus 2 mbarriers a stage: one block per SM. The consumers' code fits
  in 168 registers with no spills (ptxas -v), under the 232 that setmaxnreg gives them.
* TF32: CuTe DSL 4.8.1 wraps wgmma for 16-bit and 8-bit inputs only; `MmaTF32Op` builds the
  same SM90 MMA atom with the TF32 element type (wgmma.mma_async...m64nNk8.f32.tf32.tf32).

TMA needs a stride-1 dimension, the other stride and the base 16-byte aligned, and dimensions
below 2**31 (`tma_major`). wgmma reads 16-bit A and B K-major or MN-major from shared memory,
so NN, NT, TN and TT all run here; TF32 wgmma takes K-major operands only, so float32 with
allow_tf32=True runs here when A is row-major and B column-major (k contiguous in both), and
on the IEEE plain kernel otherwise, whose error is within TF32's bound.

Roundings (README.md, "Counting r"): r = f + k + 2 on each term alpha a_il b_lj, whatever
the path. The plain kernel: the first fma rounds the product, each of the k - 1 further fmas
rounds once, then alpha * s and the addition of beta * c (k + 2: f = 0 for every dtype,
since the fma does not round the product on its own). The Hopper kernel: 16-bit and TF32
products are exact in float32 (f = 0); the order and the rounding of the additions inside
one wgmma (k_instr products and the accumulator) are not documented, so each of the k / 16
(or k / 8) steps is bounded as a serial sum, k additions in all, plus the two of the
epilogue. TF32 inputs are the float32 bits with the low 13 bits dropped by the tensor core
(no cvt.rna.tf32 in the PTX): a chop, 2 u_tf32 on each input, as for Triton.
"""

import functools
import tempfile
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.atom import make_atom
from cutlass.cute.core import _pack_shape
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warpgroup.mma import MmaF16BF16Trait, MmaOp
from cutlass.memory import SmemAllocator
from cutlass.utils import LayoutEnum

from reference import check_operands, to_float32

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}
# Tiles of C are handed to blocks in the grouped order: GROUP_M tile rows, column by column.
GROUP_M = 8
# The H200 has 132 SMs: the large Hopper tile when C has at least one per SM.
SM_COUNT = 132

# Step 1, the plain kernel: 256 threads, a 128 x 128 tile of C, 16 x 16 threads of 8 x 8 each
# (four 4 x 4 sub-tiles, 64 rows and 64 columns apart).
PLAIN_THREADS = 256
PLAIN_TILE = 128
PLAIN_THREADS_PER_ROW = 16
PLAIN_VECTOR = 4  # a 4 x 4 sub-tile: 4 adjacent words of shared memory, one ld.shared.v4
PLAIN_SUBTILES = PLAIN_TILE // (PLAIN_THREADS_PER_ROW * PLAIN_VECTOR)  # 2 along m and along n
PLAIN_PER_THREAD = PLAIN_VECTOR * PLAIN_SUBTILES  # 8 x 8 outputs a thread
# Each shared-memory k row of A is padded from 128 to 132 words: the transposing store of a
# warp's A elements (4 rows x 8 adjacent k) then hits 32 different banks, where 128 words a row
# would put all 8 k of a row in one bank. 132 keeps the rows 16-byte aligned for v4 loads.
PLAIN_A_ROW_WORDS = PLAIN_TILE + PLAIN_VECTOR
# A warp's scalar A loads cover 8 adjacent k of 4 rows (one 32-byte sector a row when A is
# row-major); a k step of 16 takes two such groups.
PLAIN_A_K_GROUP = 8
PLAIN_STAGES = 2
# The fast global loads move PLAIN_VECTOR adjacent elements at once (16 bytes of float32).
PLAIN_LOAD_VECTOR = 4


class PlainConfig(NamedTuple):
    """Compile-time choices of the plain kernel (README.md says what each measured on the H200).

    tile_k: k values a k step, 8 or 16. Every step ends in a barrier, and with one block an SM
        a barrier idles the whole SM until its slowest warp arrives: 16 halves the barriers per
        fma and doubles the time the next step's global loads have to land, for 8 more staging
        registers and twice the shared memory (33 KiB).
    vector_loads: load A and B PLAIN_LOAD_VECTOR elements at a time (ld.global.v4 for float32)
        instead of one. Only valid when both are row-major, their bases and row strides are
        multiples of the vector and k and n are too (`vector_loads_ok`), so a vector is either
        wholly inside the matrix or wholly outside: a quarter of the load instructions, of the
        predicates and of the 64-bit address adds. `gemm` takes it only where it is valid.
    blocks_per_sm: 1 lets a thread use 255 registers; 2 caps it at 128 (nvvm.minctasm), twice
        the warps to hide latency with, if ptxas fits the kernel without spilling.
    """

    tile_k: int
    vector_loads: bool
    blocks_per_sm: int


# The two builds `gemm` chooses between, each the fastest of its kind on the H200 (IEEE float32
# 8192^3 against cuBLAS's 51.1 TFLOP/s, README.md). Vector loads leave a thread 126 registers,
# so two blocks fit an SM without spills: 48.7 TFLOP/s. Scalar loads need more (64-bit
# addresses and predicates per element): at 128 registers ptxas spills, so one block an SM,
# and k steps of 16 to halve its barriers: 41.9 TFLOP/s.
PLAIN_VECTORS = PlainConfig(tile_k=8, vector_loads=True, blocks_per_sm=2)
PLAIN_SCALARS = PlainConfig(tile_k=16, vector_loads=False, blocks_per_sm=1)

# The Hopper kernel. wgmma is issued by a warpgroup, 4 warps of 32 threads, and its M is 64:
# two consumer warpgroups make a 128-row tile, so each B tile in shared memory feeds 128 rows.
WARPGROUP_THREADS = 128
CONSUMER_WARPGROUPS = 2
HOPPER_THREADS = (1 + CONSUMER_WARPGROUPS) * WARPGROUP_THREADS
TILE_M = 64 * CONSUMER_WARPGROUPS
# 128 bytes of a row per k step: one swizzle atom of the 128-byte swizzle, which wgmma reads
# without bank conflicts (64 16-bit or 32 float32 values).
TILE_K_BYTES = 128
# Shared memory for the ring of A and B buffers: 4 stages of 128 x 64 + 256 x 64 16-bit values
# (48 KiB each) or 6 of 128 x 64 + 128 x 64 (32 KiB each), within the H200's 227 KiB a block.
STAGE_BUDGET_BYTES = 192 * 1024
# setmaxnreg: the producer only computes addresses; the consumers hold the accumulators
# (128 float32 a thread at tile_n = 256). 128 * 40 + 256 * 232 fits the 64 Ki registers of an SM.
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
# TMA's coordinates and box counts are 32-bit: larger dimensions take the plain kernel.
TMA_MAX_DIM = 2**31 - 1
TMA_ALIGN_BYTES = 16


def ceil_div(a, b):
    return (a + b - 1) // b


@cute.jit
def tile_of_block(block, m, n, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr):
    """(tile row, tile column) of block `block` in the grouped order: blocks run down a group
    of GROUP_M tile rows, column by column, and only then move to the next group."""
    tiles_m = (m + tile_m - 1) // tile_m
    tiles_n = (n + tile_n - 1) // tile_n
    blocks_per_group = GROUP_M * tiles_n
    group = block // blocks_per_group
    first_tile_m = group * GROUP_M
    rows_in_group = cutlass.min(tiles_m - first_tile_m, GROUP_M)  # the last group may be short
    within = block % blocks_per_group
    return first_tile_m + within % rows_in_group, within // rows_in_group


@cute.jit
def tile_of_cta(
    cluster_tile, rank, m, n, tile_n: cutlass.Constexpr, cluster_m: cutlass.Constexpr
):  # fmt: skip
    """(tile row, tile column) of the Hopper kernel's block of rank `rank` in its cluster, when
    the cluster computes cluster tile `cluster_tile`: cluster tiles (cluster_m tile rows, one
    tile column) run in the grouped order, and the blocks of a cluster take its rows in turn."""
    cluster_row, tile_column = tile_of_block(cluster_tile, m, n, cluster_m * TILE_M, tile_n)
    return cluster_row * cluster_m + rank, tile_column


@cute.jit
def finish_element(
    C, where, acc, alpha, beta, read_ab: cutlass.Constexpr, read_c: cutlass.Constexpr
):
    """C[where] = alpha * acc + beta * C[where] in float32, rounded once by the store."""
    result = cutlass.Float32(0.0)
    if cutlass.const_expr(read_ab):
        result = alpha * acc
    if cutlass.const_expr(read_c):
        result = result + beta * C[where].to(cutlass.Float32)  # 0 + v is exact
    C[where] = result.to(C.element_type)


@cute.jit
def finish_each_element(c_mine, coords_mine, acc, m, n, alpha, beta, read_c: cutlass.Constexpr):
    """The epilogue for any C: each of the thread's elements on its own, if inside (m, n)."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        if cute.elem_less(coords_mine[i], (m, n)):
            finish_element(c_mine, i, acc[i], alpha, beta, True, read_c)


@cute.jit
def finish_in_pairs(c_mine, acc, alpha, beta, read_c: cutlass.Constexpr):
    """The epilogue of a whole tile of a row-major C: wgmma leaves each thread pairs of adjacent
    columns, so C is read into registers and written back one pair per access (autovec_copy
    finds the width from the layouts), and finish_element does its arithmetic on the copy."""
    c_registers = cute.make_rmem_tensor_like(c_mine)
    if cutlass.const_expr(read_c):
        cute.autovec_copy(c_mine, c_registers)
    for i in cutlass.range_constexpr(cute.size(acc)):
        finish_element(c_registers, i, acc[i], alpha, beta, True, read_c)
    cute.autovec_copy(c_registers, c_mine)


@cute.jit
def load_k_step(matrix, staged, offset, deltas, inside, ks, k_left, width: cutlass.Constexpr):
    """staged[None, q] = the thread's q-th vector of `width` elements of a k step, widened to
    float32: the elements at offset + deltas[q] + (0 .. width - 1) if inside[q] (its row of A
    or columns of B are inside the matrix) and ks[q] < k_left (its k, counted from the step's
    first, is); else 0.0 and nothing is read. The vectors lie along the matrix's stride-1
    dimension; width > 1 is only built when k and n are multiples of width, so a vector is
    inside or outside as a whole, and its offset is a multiple of width (one aligned load)."""
    for q in cutlass.range_constexpr(len(deltas)):
        staged[None, q].fill(0.0)
        if inside[q]:
            if ks[q] < k_left:
                where = (
                    cute.assume(offset + deltas[q], divby=width)
                    if width > 1
                    else offset + deltas[q]
                )
                vector = cute.make_tensor(matrix.iterator + where, cute.make_layout(width))
                staged[None, q].store(vector.load().to(cutlass.Float32))


@cute.jit
def store_k_step(a_tiles, b_tiles, a_next, b_next, a_places, b_places, stage):
    """The staged registers into shared-memory buffer `stage`: A transposed (a vector of A is
    adjacent k of one row: one scalar store each), B as it is (a vector of B is adjacent
    columns of one k: one store of the whole vector)."""
    width = cute.size(a_next, mode=[0])
    for q in cutlass.range_constexpr(len(a_places)):
        row, k0 = a_places[q]
        for w in cutlass.range_constexpr(width):
            a_tiles[row, k0 + w, stage] = a_next[w, q]
    b_runs = cute.flat_divide(b_tiles, (width,))  # (word, run of the row, k, stage)
    for q in cutlass.range_constexpr(len(b_places)):
        col, kk = b_places[q]
        b_runs[None, col // width, kk, stage].store(b_next[None, q].load())


@cute.jit
def multiply_k_step(acc, a_vectors, b_vectors, my_row, my_col, stage, tile_k: cutlass.Constexpr):
    """acc += this step's A x B from shared-memory buffer `stage`: per k, 2 + 2 ld.shared.v4
    (the thread's 8 rows of A and 8 columns of B) and 64 fmas."""
    for kk in cutlass.range_constexpr(tile_k):
        a_values = [
            a_vectors[None, my_row + PLAIN_THREADS_PER_ROW * i, kk, stage].load()
            for i in range(PLAIN_SUBTILES)
        ]
        b_values = [
            b_vectors[None, my_col + PLAIN_THREADS_PER_ROW * j, kk, stage].load()
            for j in range(PLAIN_SUBTILES)
        ]
        for i in cutlass.range_constexpr(PLAIN_SUBTILES):
            for r in cutlass.range_constexpr(PLAIN_VECTOR):
                for j in cutlass.range_constexpr(PLAIN_SUBTILES):
                    for c in cutlass.range_constexpr(PLAIN_VECTOR):
                        row, col = PLAIN_VECTOR * i + r, PLAIN_VECTOR * j + c
                        # one fma.rn.f32: the product is not rounded on its own
                        acc[row, col] = acc[row, col] + a_values[i][r] * b_values[j][c]


def staging_plan(thread, tile_k, vector_loads):
    """Which elements of a k step thread `thread` loads, as Python lists (q = the thread's
    load number): for A, (row in the tile, first k) and for B, (first column, k) of each
    load, plus `width` (elements a load). Consecutive threads take consecutive k of A (a warp:
    4 rows x 8 k, or 16 rows x 2 vectors of 4 k: whole 32-byte sectors of a row-major A and
    32 different banks for the transposing stores) and consecutive columns of B (a warp: one
    k, 32 columns or 32 vectors of 4). Only the thread-independent parts differ between loads,
    so load q sits a fixed (row, k) distance from load 0: `deltas` turns that into an offset."""
    width = PLAIN_LOAD_VECTOR if vector_loads else 1
    loads = PLAIN_TILE * tile_k // (PLAIN_THREADS * width)
    a_places, b_places = [], []
    for q in range(loads):
        v = thread + PLAIN_THREADS * q
        if vector_loads:  # 2 vectors (8 k) of a row per pair of threads
            a_places.append(
                ((v // 2) % PLAIN_TILE, width * (v % 2) + 2 * width * (v // (2 * PLAIN_TILE)))
            )
        else:  # 8 k of a row per 8 threads
            group = PLAIN_A_K_GROUP
            a_places.append(
                ((v // group) % PLAIN_TILE, v % group + group * (v // (group * PLAIN_TILE)))
            )
        b_places.append((width * (v % (PLAIN_TILE // width)), v // (PLAIN_TILE // width)))
    return a_places, b_places, width


@cute.kernel
def plain_kernel(
    A: cute.Tensor,
    B: cute.Tensor,
    C: cute.Tensor,
    m: cutlass.Int64,
    n: cutlass.Int64,
    k: cutlass.Int64,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    read_ab: cutlass.Constexpr[bool],
    read_c: cutlass.Constexpr[bool],
    config: cutlass.Constexpr,
):
    tile_k = config.tile_k
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    # blockIdx is a 32-bit register: widen it before the tile's first row and column are formed.
    tile_m, tile_n = tile_of_block(cutlass.Int64(block), m, n, PLAIN_TILE, PLAIN_TILE)
    first_row, first_col = tile_m * PLAIN_TILE, tile_n * PLAIN_TILE
    # The thread's sub-tiles start at row 4 my_row (+ 64 i) and column 4 my_col (+ 64 j): a
    # warp is two rows of 16 threads, so at each k it reads 2 vectors of A (broadcast) and 16
    # adjacent vectors of B.
    my_row, my_col = thread // PLAIN_THREADS_PER_ROW, thread % PLAIN_THREADS_PER_ROW
    acc = cute.make_rmem_tensor(
        (PLAIN_PER_THREAD, PLAIN_PER_THREAD), cutlass.Float32
    )  # acc[PLAIN_VECTOR * i + r, PLAIN_VECTOR * j + c]
    acc.fill(0.0)
    if cutlass.const_expr(read_ab):
        smem = SmemAllocator()
        # (tile row or column, k, stage); both k-major, A's k rows padded (PLAIN_A_ROW_WORDS).
        a_tiles = smem.allocate_tensor(
            cutlass.Float32,
            cute.make_layout(
                (PLAIN_TILE, tile_k, PLAIN_STAGES),
                stride=(1, PLAIN_A_ROW_WORDS, PLAIN_A_ROW_WORDS * tile_k),
            ),
            byte_alignment=16,
        )
        b_tiles = smem.allocate_tensor(
            cutlass.Float32,
            cute.make_layout(
                (PLAIN_TILE, tile_k, PLAIN_STAGES), stride=(1, PLAIN_TILE, PLAIN_TILE * tile_k)
            ),
            byte_alignment=16,
        )
        # The same buffers cut into 4-word vectors: (word, vector, k, stage).
        a_vectors = cute.flat_divide(a_tiles, (PLAIN_VECTOR,))
        b_vectors = cute.flat_divide(b_tiles, (PLAIN_VECTOR,))
        a_places, b_places, width = staging_plan(thread, tile_k, config.vector_loads)
        # Addresses: `a_offset` is the offset of the thread's first A element, moved one k step
        # at a time (a 64-bit add: the compiler would otherwise redo two 64-bit multiplies per
        # element), and load q sits a fixed distance (deltas[q]) further.
        a_offset = cute.crd2idx((first_row + a_places[0][0], a_places[0][1]), A.layout)
        b_offset = cute.crd2idx((b_places[0][1], first_col + b_places[0][0]), B.layout)
        a_deltas = [
            cute.crd2idx((row - a_places[0][0], k0 - a_places[0][1]), A.layout)
            for row, k0 in a_places
        ]
        b_deltas = [
            cute.crd2idx((kk - b_places[0][1], col - b_places[0][0]), B.layout)
            for col, kk in b_places
        ]
        a_inside = [first_row + row < m for row, _ in a_places]
        b_inside = [first_col + col < n for col, _ in b_places]
        a_ks = [k0 for _, k0 in a_places]
        b_ks = [kk for _, kk in b_places]
        a_k_step = cute.crd2idx((0, tile_k), A.layout)
        b_k_step = cute.crd2idx((tile_k, 0), B.layout)
        a_next = cute.make_rmem_tensor((width, len(a_places)), cutlass.Float32)
        b_next = cute.make_rmem_tensor((width, len(b_places)), cutlass.Float32)

        k_left = k  # k values from the first k of the step being loaded on
        load_k_step(A, a_next, a_offset, a_deltas, a_inside, a_ks, k_left, width)
        load_k_step(B, b_next, b_offset, b_deltas, b_inside, b_ks, k_left, width)
        store_k_step(a_tiles, b_tiles, a_next, b_next, a_places, b_places, 0)
        # The loads run two steps ahead: step 1 is in flight while step 0 is multiplied.
        a_offset, b_offset, k_left = a_offset + a_k_step, b_offset + b_k_step, k_left - tile_k
        load_k_step(A, a_next, a_offset, a_deltas, a_inside, a_ks, k_left, width)
        load_k_step(B, b_next, b_offset, b_deltas, b_inside, b_ks, k_left, width)
        cute.arch.sync_threads()
        k_steps = (k + tile_k - 1) // tile_k
        for step in cutlass.range(k_steps, unroll=1):
            stage = step % PLAIN_STAGES
            # Step + 1's values, loaded a whole step ago, into the other buffer (last read in
            # the previous step, before the last barrier). Stored here, at the top of the step,
            # the loads had a whole step and a barrier to land; stored after the fmas, ptxas
            # hoisted the stores and the barrier above most of them, so every step waited on
            # loads issued ~200 instructions before (H200: 32.4 -> 39.6 TFLOP/s with k = 16).
            store_k_step(a_tiles, b_tiles, a_next, b_next, a_places, b_places, 1 - stage)
            # Issue the next loads now; they land while the fmas below run. Past the last
            # step every load is predicated off (0.0 into a buffer nobody reads).
            a_offset, b_offset, k_left = a_offset + a_k_step, b_offset + b_k_step, k_left - tile_k
            load_k_step(A, a_next, a_offset, a_deltas, a_inside, a_ks, k_left, width)
            load_k_step(B, b_next, b_offset, b_deltas, b_inside, b_ks, k_left, width)
            multiply_k_step(acc, a_vectors, b_vectors, my_row, my_col, stage, tile_k)
            cute.arch.sync_threads()  # the next buffer is written before anyone reads it
    for i in cutlass.range_constexpr(PLAIN_SUBTILES):
        for r in cutlass.range_constexpr(PLAIN_VECTOR):
            row = first_row + PLAIN_VECTOR * (my_row + PLAIN_THREADS_PER_ROW * i) + r
            if row < m:
                for j in cutlass.range_constexpr(PLAIN_SUBTILES):
                    for c in cutlass.range_constexpr(PLAIN_VECTOR):
                        col = first_col + PLAIN_VECTOR * (my_col + PLAIN_THREADS_PER_ROW * j) + c
                        if col < n:
                            where = (row, col)
                            here = acc[PLAIN_VECTOR * i + r, PLAIN_VECTOR * j + c]
                            finish_element(C, where, here, alpha, beta, read_ab, read_c)


def consume_k_step(mainloop, state, tiled_mma, acc, a_fragments, b_fragments):
    """Wait until TMA has filled the buffer of `state`, then issue the wgmmas of its k step
    (asynchronous: they read shared memory and add into acc) and commit them as one group."""
    mainloop.consumer_wait(state)
    warpgroup.fence()  # acc's registers are ordered before the wgmmas that read them
    for kb in range(cute.size(a_fragments, mode=[2])):  # plain Python: unrolled while tracing
        where = (None, None, kb, state.index)
        cute.gemm(tiled_mma, acc, a_fragments[where], b_fragments[where], acc)
    warpgroup.commit_group()


@cute.kernel
def hopper_kernel(
    tma_a: cute.CopyAtom,
    A_tma: cute.Tensor,
    tma_b: cute.CopyAtom,
    B_tma: cute.Tensor,
    C: cute.Tensor,
    m: cutlass.Int64,
    n: cutlass.Int64,
    k: cutlass.Int64,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    tiled_mma: cute.TiledMma,
    a_smem_layout: cute.ComposedLayout,
    b_smem_layout: cute.ComposedLayout,
    dtype: cutlass.Constexpr,
    tile_n: cutlass.Constexpr[int],
    tile_k: cutlass.Constexpr[int],
    stages: cutlass.Constexpr[int],
    read_c: cutlass.Constexpr[bool],
    c_pairs: cutlass.Constexpr[bool],
    cluster_m: cutlass.Constexpr[int],
):
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    blocks, _, _ = cute.arch.grid_dim()
    # A 1-D grid in clusters of cluster_m x 1 x 1: block b is block b mod cluster_m of cluster
    # b div cluster_m (its %cluster_ctarank, which multicast masks and remote arrives name).
    cluster, rank = block // cluster_m, block % cluster_m
    clusters = blocks // cluster_m
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    warpgroup_index = cute.arch.make_warp_uniform(thread // WARPGROUP_THREADS)
    if warp == 0:
        cpasync.prefetch_descriptor(tma_a)
        cpasync.prefetch_descriptor(tma_b)

    # Shared memory: the mbarriers ("full" and "empty" per stage), then the A and B rings,
    # 1024-byte aligned as the 128-byte swizzle pattern repeats every 8 rows of 128 bytes.
    smem = SmemAllocator()
    barriers = smem.allocate_array(cutlass.Int64, 2 * stages, byte_alignment=8)
    a_ring = smem.allocate_tensor(
        dtype, a_smem_layout.outer, byte_alignment=1024, swizzle=a_smem_layout.inner
    )
    b_ring = smem.allocate_tensor(
        dtype, b_smem_layout.outer, byte_alignment=1024, swizzle=b_smem_layout.inner
    )
    a_stage = cute.slice_(a_smem_layout, (None, None, 0))
    b_stage = cute.slice_(b_smem_layout, (None, None, 0))
    # A stage is full when its A tile and its whole B tile have landed, whichever block of the
    # cluster loaded each part of B.
    bytes_per_stage = cute.size_in_bytes(dtype, a_stage) + cute.size_in_bytes(dtype, b_stage)
    # One producer thread arrives (with the byte count TMA must deliver) on "full". On "empty",
    # lane j < cluster_m of each consumer warp arrives on the barrier of the cluster's block j
    # (the pipeline finds these from the cluster's layout (v, m, n, l) = (1, cluster_m, 1, 1)):
    # a block's TMA writes B into every block of the cluster, so it may refill a stage only
    # when all their consumer warps are done with it. create() initialises the barriers and
    # syncs the block, or the cluster, so that no arrive reaches a barrier before its init.
    mainloop = pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(
            pipeline.Agent.Thread, cluster_m * CONSUMER_WARPGROUPS * WARPGROUP_THREADS // 32
        ),
        tx_count=bytes_per_stage,
        cta_layout_vmnk=cute.make_layout((1, cluster_m, 1, 1)),
    )
    k_steps = cutlass.Int32((k + tile_k - 1) // tile_k)
    # Persistent: cluster c computes cluster tiles c, c + clusters, c + 2 clusters, ... of the
    # grouped order, each of its blocks one tile. Both blocks of a cluster walk the same cluster
    # tiles, so their rings advance together (when m has an odd number of tile rows, one block
    # of the last cluster row computes a tile past m: zeros in, nothing stored). Producer and
    # consumers walk the same tiles and the ring's state runs on across them, so TMA already
    # loads the next tile while the consumers finish the last one. The tile index is 32-bit
    # (CuTe DSL 4.8.1 does not compile these loops over an Int64 index; TMA's dimensions are
    # below 2**31 anyway).
    cluster_tile_m = cluster_m * TILE_M
    cluster_tiles = cutlass.Int32(
        ((m + cluster_tile_m - 1) // cluster_tile_m) * ((n + tile_n - 1) // tile_n)
    )

    if warpgroup_index == 0:
        cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
        if warp == 0:
            # (TILE_M, tile_k, tile row, k step) and (tile_n, tile_k, tile column, k step)
            # tiles of the TMA tensors, then TMA's view of them: one copy per operand per step.
            a_tiles = cute.local_tile(A_tma, (TILE_M, tile_k), (None, None))
            b_tiles = cute.local_tile(B_tma, (tile_n, tile_k), (None, None))
            a_smem_part, a_gmem_part = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1),
                cute.group_modes(a_ring, 0, 2), cute.group_modes(a_tiles, 0, 2),
            )  # fmt: skip
            # The cluster's blocks share each B tile: block `rank` loads slice `rank` of
            # cluster_m and multicasts it to every block of the cluster (mask: all of them),
            # into the same place of each one's ring. The mask is ignored by the plain TMA
            # load of cluster_m = 1.
            b_smem_part, b_gmem_part = cpasync.tma_partition(
                tma_b, rank, cute.make_layout(cluster_m),
                cute.group_modes(b_ring, 0, 2), cute.group_modes(b_tiles, 0, 2),
            )  # fmt: skip
            b_receivers = cutlass.Int16((1 << cluster_m) - 1)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            for cluster_tile in cutlass.range(cluster, cluster_tiles, clusters, unroll=1):
                tile_m, tile_n_index = tile_of_cta(cluster_tile, rank, m, n, tile_n, cluster_m)
                for k_step in cutlass.range(k_steps, unroll=1):
                    mainloop.producer_acquire(state)  # the buffer is empty; expect its bytes
                    full = mainloop.producer_get_barrier(state)
                    cute.copy(
                        tma_a, a_gmem_part[(None, tile_m, k_step)],
                        a_smem_part[(None, state.index)], tma_bar_ptr=full,
                    )  # fmt: skip
                    cute.copy(
                        tma_b, b_gmem_part[(None, tile_n_index, k_step)],
                        b_smem_part[(None, state.index)], tma_bar_ptr=full,
                        mcast_mask=b_receivers,
                    )  # fmt: skip
                    mainloop.producer_commit(state)
                    state.advance()
            # Exit only after the consumers freed every buffer; with a cluster, this also
            # waits for the partner's remote arrives, which must not reach an exited block.
            mainloop.producer_tail(state)
    else:
        cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
        consumer_thread = thread - WARPGROUP_THREADS
        # wgmma's A and B "fragments" are shared-memory descriptors, the same for the 128
        # threads of a warpgroup: partition with the warpgroup's first thread.
        warpgroup_mma = tiled_mma.get_slice((warpgroup_index - 1) * WARPGROUP_THREADS)
        a_fragments = tiled_mma.make_fragment_A(warpgroup_mma.partition_A(a_ring))
        b_fragments = tiled_mma.make_fragment_B(warpgroup_mma.partition_B(b_ring))
        # The accumulator is per thread: C and its coordinates are partitioned by this thread.
        thread_mma = tiled_mma.get_slice(consumer_thread)
        tile_shape = (TILE_M, tile_n)
        c_tiles = cute.local_tile(C, tile_shape, (None, None))
        coord_tiles = cute.local_tile(cute.make_identity_tensor((m, n)), tile_shape, (None, None))
        acc = cute.make_rmem_tensor(
            thread_mma.partition_C(c_tiles[None, None, 0, 0]).shape, cutlass.Float32
        )
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        for cluster_tile in cutlass.range(cluster, cluster_tiles, clusters, unroll=1):
            tile_m, tile_n_index = tile_of_cta(cluster_tile, rank, m, n, tile_n, cluster_m)
            acc.fill(0.0)  # the wgmmas add into it: 0 + s is exact
            consume_k_step(mainloop, read_state, tiled_mma, acc, a_fragments, b_fragments)
            read_state.advance()
            for _ in cutlass.range(1, k_steps, unroll=1):
                consume_k_step(mainloop, read_state, tiled_mma, acc, a_fragments, b_fragments)
                read_state.advance()
                # At most this step's group still runs: the previous step's buffer is free.
                warpgroup.wait_group(1)
                mainloop.consumer_release(release_state)
                release_state.advance()
            warpgroup.wait_group(0)
            mainloop.consumer_release(release_state)
            release_state.advance()

            c_mine = thread_mma.partition_C(c_tiles[None, None, tile_m, tile_n_index])
            coords_mine = thread_mma.partition_C(coord_tiles[None, None, tile_m, tile_n_index])
            if cutlass.const_expr(c_pairs):
                inside = (tile_m + 1) * TILE_M <= m and (tile_n_index + 1) * tile_n <= n
                if inside:
                    finish_in_pairs(c_mine, acc, alpha, beta, read_c)
                else:
                    finish_each_element(c_mine, coords_mine, acc, m, n, alpha, beta, read_c)
            else:
                finish_each_element(c_mine, coords_mine, acc, m, n, alpha, beta, read_c)


def placeholder(dtype, rows, cols, unit_dim=None, vector=1):
    """What cute.compile sees of a (rows, cols) operand: its dtype, 64-bit symbolic sizes (the
    caller shares one symbol between operands whose sizes must match, so each call checks
    they do) and either two 64-bit symbolic strides on an element boundary (any layout), or
    the constant stride 1 along `unit_dim` with the base and the other stride multiples of
    `vector` elements: what a vector access or TMA relies on, promised at compile time. The
    compiled function checks each call's tensors against it (dtype, device, alignment,
    strides, sizes) and raises rather than run on a mismatch."""
    if unit_dim is None:
        stride = (cute.sym_int64(), cute.sym_int64())
    else:
        other = cute.sym_int64(divisibility=vector)
        stride = (1, other) if unit_dim == 0 else (other, 1)
    return cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], (rows, cols), stride=stride, assumed_align=dtype.itemsize * vector
    )


@cute.jit
def launch_plain(
    A: cute.Tensor,
    B: cute.Tensor,
    C: cute.Tensor,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    stream: cuda.CUstream,
    read_ab: cutlass.Constexpr[bool],
    read_c: cutlass.Constexpr[bool],
    config: cutlass.Constexpr,
):
    # A, B and C arrive as torch tensors through TVM-FFI, with the layouts of `build_plain`:
    # the vector build knows A's and B's column stride 1, their bases, row strides, n and k
    # multiples of the vector (`vector_loads_ok`); the scalar build takes any strides.
    # The sizes from cute.size, 64-bit: CuTe DSL 4.8.1 reads A.shape[0] back as 32 bits.
    m, k = cutlass.Int64(cute.size(A, mode=[0])), cutlass.Int64(cute.size(A, mode=[1]))
    n = cutlass.Int64(cute.size(B, mode=[1]))
    blocks = cute.ceil_div(m, PLAIN_TILE) * cute.ceil_div(n, PLAIN_TILE)
    # Two blocks an SM also need their shared memory (2 x 33 KiB at tile_k = 16) carved out of
    # the SM's 256 KiB of L1: said as a percentage, so the compiler need not ask the device.
    carveout = {} if config.blocks_per_sm == 1 else {"preferred_smem_carveout": 50}
    plain_kernel(A, B, C, m, n, k, alpha, beta, read_ab, read_c, config).launch(
        grid=[blocks, 1, 1], block=[PLAIN_THREADS, 1, 1], stream=stream,
        min_blocks_per_mp=config.blocks_per_sm, **carveout,
    )  # fmt: skip


def vector_loads_ok(A, B):
    """True when the plain kernel may load A and B PLAIN_LOAD_VECTOR elements at a time: both
    row-major, bases and row strides multiples of the vector, and k and n too (a vector is
    then wholly inside or wholly outside the matrix)."""
    v = PLAIN_LOAD_VECTOR
    for t in (A, B):
        (_, cols), (row_stride, col_stride) = t.shape, t.stride()
        if col_stride != 1 or row_stride % v or cols % v or t.data_ptr() % (v * t.itemsize):
            return False
    return True


class MmaTF32Op(MmaOp):
    """wgmma.mma_async with TF32 inputs (k = 8 per instruction) and a float32 accumulator,
    which CuTe DSL 4.8.1 does not wrap: the same SM90 MMA atom as the 16-bit one, with the
    TF32 element type. PTX allows it K-major only."""

    def __init__(self, n):
        k_major = OperandMajorMode.K
        super().__init__(
            cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32, (64, n, 8),
            warpgroup.OperandSource.SMEM, k_major, k_major,
        )  # fmt: skip

    def _make_trait(self, *, loc=None, ip=None, **kwargs):
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            _pack_shape(self.shape_mnk, loc=loc, ip=ip).type.attribute,
            self.a_major_mode._to_ir(), self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type,
            self.a_src._to_ir(),
        )  # fmt: skip
        return MmaF16BF16Trait(
            make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)
        )


def make_tiled_mma(dtype, a_major, b_major, tile_n):
    """Two warpgroups side by side along m, each issuing 64 x tile_n wgmmas."""
    if cutlass.const_expr(dtype == cutlass.Float32):
        atom = cute.make_mma_atom(MmaTF32Op(tile_n))
        return cute.make_tiled_mma(atom, (CONSUMER_WARPGROUPS, 1, 1))
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
        cutlass.Float32, (CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, tile_n),
    )  # fmt: skip


@cute.jit
def launch_hopper(
    A: cute.Tensor,
    B: cute.Tensor,
    C: cute.Tensor,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    blocks: cutlass.Int32,
    stream: cuda.CUstream,
    a_k_major: cutlass.Constexpr[bool],
    b_k_major: cutlass.Constexpr[bool],
    tile_n: cutlass.Constexpr[int],
    read_c: cutlass.Constexpr[bool],
    c_pairs: cutlass.Constexpr[bool],
    cluster_m: cutlass.Constexpr[int],
):
    # A, B and C arrive as torch tensors through TVM-FFI, with the layouts of `build_hopper`:
    # A and B with their stride-1 dimension known, bases and other strides on 16-byte
    # boundaries (`tma_major`), which TMA needs; C with column stride 1 and an even row stride
    # in the paired build (`in_pairs`), any strides otherwise.
    dtype = A.element_type
    tile_k = TILE_K_BYTES * 8 // dtype.width
    stages = STAGE_BUDGET_BYTES // ((TILE_M + tile_n) * TILE_K_BYTES)
    # The MMA's view: A is (m, k), B is (n, k); "K-major" means k has stride 1. Its sizes are
    # 32-bit, as TMA's coordinates are: `tma_major` sends only dimensions below 2**31 here.
    m, k = cutlass.Int32(cute.size(A, mode=[0])), cutlass.Int32(cute.size(A, mode=[1]))
    n = cutlass.Int32(cute.size(B, mode=[1]))
    A = cute.make_tensor(A.iterator, cute.make_layout((m, k), stride=A.stride))
    B = cute.make_tensor(B.iterator, cute.make_layout((n, k), stride=B.stride[::-1]))
    C = cute.make_tensor(C.iterator, cute.make_layout((m, n), stride=C.stride))
    a_major = LayoutEnum.ROW_MAJOR if a_k_major else LayoutEnum.COL_MAJOR
    b_major = LayoutEnum.ROW_MAJOR if b_k_major else LayoutEnum.COL_MAJOR
    tiled_mma = make_tiled_mma(dtype, a_major, b_major, tile_n)
    tile_mnk = (TILE_M, tile_n, tile_k)
    a_smem_layout = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
    b_smem_layout = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
    load = cpasync.CopyBulkTensorTileG2SOp()
    tma_a, A_tma = cpasync.make_tiled_tma_atom(
        load, A, cute.slice_(a_smem_layout, (None, None, 0)), (TILE_M, tile_k)
    )
    # In a cluster, each block's TMA loads 1 / cluster_m of the B tile and multicasts it.
    load_b = cpasync.CopyBulkTensorTileG2SMulticastOp() if cluster_m > 1 else load
    tma_b, B_tma = cpasync.make_tiled_tma_atom(
        load_b, B, cute.slice_(b_smem_layout, (None, None, 0)), (tile_n, tile_k), cluster_m
    )
    hopper_kernel(
        tma_a, A_tma, tma_b, B_tma, C, cutlass.Int64(m), cutlass.Int64(n), cutlass.Int64(k),
        alpha, beta, tiled_mma, a_smem_layout, b_smem_layout, dtype, tile_n, tile_k, stages, read_c,
        c_pairs, cluster_m,
    ).launch(
        grid=[blocks, 1, 1], block=[HOPPER_THREADS, 1, 1], stream=stream,
        cluster=[cluster_m, 1, 1] if cluster_m > 1 else None,  # 1: a plain launch, as before
    )  # fmt: skip


@functools.cache
def sm_count(device):
    """The number of SMs of CUDA device `device` (its index; 132 on the H200), asked once."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def hopper_tile_n(m, n):
    """256 columns a tile when C has at least one 128 x 256 tile per SM, else 128."""
    return 256 if ceil_div(m, TILE_M) * ceil_div(n, 256) >= SM_COUNT else 128


def tma_major(t):
    """How TMA can load the matrix t: 'rows' when its rows are contiguous (stride 1 along a
    row), 'cols' when its columns are; the other stride and the base must be multiples of 16
    bytes and the dimensions below 2**31. None when TMA cannot."""
    (rows, cols), (row_stride, col_stride) = t.shape, t.stride()
    if rows > TMA_MAX_DIM or cols > TMA_MAX_DIM or t.data_ptr() % TMA_ALIGN_BYTES:
        return None
    if col_stride == 1 and row_stride > 0 and row_stride * t.itemsize % TMA_ALIGN_BYTES == 0:
        return "rows"
    if row_stride == 1 and col_stride > 0 and col_stride * t.itemsize % TMA_ALIGN_BYTES == 0:
        return "cols"
    return None


def in_pairs(C):
    """True when the Hopper epilogue may move C two adjacent columns at a time: rows of stride 1
    that start on a 2-element boundary."""
    row_stride, col_stride = C.stride()
    return col_stride == 1 and row_stride % 2 == 0 and C.data_ptr() % (2 * C.itemsize) == 0


def choose_kernel(A, B, allow_tf32):
    """('hopper', a_k_major, b_k_major) or ('plain',), by the rules of the docstring."""
    a_major, b_major = tma_major(A), tma_major(B)
    if a_major is None or b_major is None:
        return ("plain",)
    # A (m, k) is K-major when its rows are contiguous; B (k, n) when its columns are.
    a_k_major, b_k_major = a_major == "rows", b_major == "cols"
    if A.dtype == torch.float32 and not (allow_tf32 and a_k_major and b_k_major):
        return ("plain",)
    return ("hopper", a_k_major, b_k_major)


def build_plain(dtype, read_ab, read_c, config, options=""):
    """cute.compile the plain launcher for TVM-FFI calls on torch tensors, on the stream torch
    has current for their device. A, B and C share the symbols m, n and k: each call checks
    that their sizes match."""
    # The vector build (`vector_loads_ok`): rows of stride 1; bases, row strides, n and k
    # multiples of the vector, so that a vector lies wholly inside or wholly outside.
    unit_dim, vector = (1, PLAIN_LOAD_VECTOR) if config.vector_loads else (None, 1)
    m, n, k = cute.sym_int64(), cute.sym_int64(vector), cute.sym_int64(vector)
    return cute.compile(
        launch_plain,
        placeholder(dtype, m, k, unit_dim, vector), placeholder(dtype, k, n, unit_dim, vector),
        placeholder(dtype, m, n), 1.0, 1.0,
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), read_ab, read_c, config,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


def build_hopper(dtype, a_k_major, b_k_major, tile_n, read_c, c_pairs, cluster_m, options=""):
    """cute.compile the Hopper launcher for TVM-FFI calls (as build_plain). A and B get the
    stride 1 along their contiguous dimension (k if K-major) and 16-byte aligned bases and
    other strides, which TMA needs; C the pairs' layout if c_pairs."""
    m, n, k = cute.sym_int64(), cute.sym_int64(), cute.sym_int64()
    tma_vector = TMA_ALIGN_BYTES // dtype.itemsize
    A = placeholder(dtype, m, k, 1 if a_k_major else 0, tma_vector)
    B = placeholder(dtype, k, n, 0 if b_k_major else 1, tma_vector)
    C = placeholder(dtype, m, n, 1, 2) if c_pairs else placeholder(dtype, m, n)
    return cute.compile(
        launch_hopper, A, B, C, 1.0, 1.0, 1,
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), a_k_major, b_k_major, tile_n,
        read_c, c_pairs, cluster_m, options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_plain(dtype, read_ab, read_c, config):
    """The plain kernel for torch `dtype`, built once (seconds) and cached; needs no GPU. What
    is cached is the TVM-FFI function itself, which takes torch tensors and checks them
    against its build."""
    return build_plain(dtype, read_ab, read_c, config).__tvm_ffi_object__()


@functools.cache
def compile_hopper(dtype, a_k_major, b_k_major, tile_n, read_c, c_pairs, cluster_m):
    """The Hopper kernel for `dtype`, operand majorness, epilogue and cluster size, built once
    and cached (the TVM-FFI function, as compile_plain)."""
    return build_hopper(
        dtype, a_k_major, b_k_major, tile_n, read_c, c_pairs, cluster_m
    ).__tvm_ffi_object__()


def ptx_of(
    kernel, dtype, a_k_major=True, b_k_major=True, tile_n=256, read_ab=True, read_c=True,
    c_pairs=False, cluster_m=2, config=PLAIN_SCALARS,
):  # fmt: skip
    """The sm_90a PTX of the 'plain' (with PlainConfig `config`) or 'hopper' build: what the
    tests read to check for wgmma, TMA and mbarriers in one and plain FMAs in the other."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        if kernel == "plain":
            return build_plain(dtype, read_ab, read_c, config, options).__ptx__
        return build_hopper(
            dtype, a_k_major, b_k_major, tile_n, read_c, c_pairs, cluster_m, options
        ).__ptx__


def gemm(alpha, A, B, beta, C, *, allow_tf32=False, cluster_m=2):
    """C = alpha*A@B + beta*C for CUDA tensors of one dtype, in float32; returns C. The Hopper
    kernel runs in clusters of `cluster_m` blocks along m (1 or 2) that share each B tile; a C
    of one tile row (m <= 128) takes clusters of 1, whose partner would only compute zeros."""
    check_operands(alpha, A, B, beta, C)
    if not C.is_cuda:
        raise ValueError(f"A, B and C are on {C.device}; the CuTe kernel needs CUDA tensors")
    (m, k), n = A.shape, B.shape[1]
    if m == 0 or n == 0:
        return C
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    read_ab, read_c = alpha32 != 0.0 and k > 0, beta32 != 0.0
    choice = choose_kernel(A, B, allow_tf32) if read_ab else ("plain",)
    # TVM-FFI launches on torch's current stream of C's GPU: ordered with the caller's torch
    # work and capturable by a CUDA graph (call once before capturing: the first call loads
    # the module). alpha32 and beta32 are float32 numbers, so their Float32 parameters hold
    # them exactly.
    if choice[0] == "hopper":
        _, a_k_major, b_k_major = choice
        tile_n = hopper_tile_n(m, n)
        cluster_m = cluster_m if m > TILE_M else 1
        kernel = compile_hopper(
            A.dtype, a_k_major, b_k_major, tile_n, read_c, in_pairs(C), cluster_m
        )
        # Persistent: one block per SM, fewer when C has fewer tiles, in whole clusters.
        cluster_tiles = ceil_div(m, cluster_m * TILE_M) * ceil_div(n, tile_n)
        blocks = cluster_m * min(cluster_tiles, sm_count(C.get_device()) // cluster_m)
        kernel(A, B, C, alpha32, beta32, blocks)
    else:
        config = PLAIN_VECTORS if read_ab and vector_loads_ok(A, B) else PLAIN_SCALARS
        compile_plain(A.dtype, read_ab, read_c, config)(A, B, C, alpha32, beta32)
    return C
