"""gemm in the CuTe DSL, step 1: tiles on the CUDA cores (README.md, "Step 1").

Compared with the definition (reference.py, one sum per entry of C), this step adds the
mapping onto the GPU: a block of PLAIN_THREADS owns a PLAIN_TILE x PLAIN_TILE tile of C and
walks k through two shared-memory buffers, each thread an 8 x 8 register tile fed by 128-bit
shared reads, the global loads of A and B issued two k steps ahead. What every step computes:

    c_ij = round_to_dtype( alpha32 * s_ij + beta32 * c_ij ),   s_ij = sum_l a_il b_lj in float32

alpha and beta are rounded to float32 once, on the host; each element is widened to float32
(exact) and each update is one fma.rn.f32, so s_ij is a serial sum along k, in a fixed order
(no atomics: the same bits on every run), rounded once by the store: r = k + 2 (README.md,
"Counting r"). alpha32 == 0 or k == 0 builds no load of A or B, beta32 == 0 no load of C.

The file: the tile's constants and its two builds (PlainConfig); the grouped order and the
one-element finish, which step 2 reuses; the k-step helpers and `plain_kernel`; the operand
placeholders (reused by step 2), the launcher and its builds; `gemm`, which runs every call
here: IEEE float32 whatever allow_tf32 says, any strides, 64-bit offsets.
"""

import functools
import tempfile
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass.memory import SmemAllocator

from reference import check_operands, to_float32

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}
# Tiles of C are handed to blocks in the grouped order: GROUP_M tile rows, column by column.
GROUP_M = 8

# The plain kernel: 256 threads, a 128 x 128 tile of C, 16 x 16 threads of 8 x 8 each
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
        predicates and of the 64-bit address adds. `run_plain` takes it only where it is valid.
    blocks_per_sm: 1 lets a thread use 255 registers; 2 caps it at 128 (nvvm.minctasm), twice
        the warps to hide latency with, if ptxas fits the kernel without spilling.
    """

    tile_k: int
    vector_loads: bool
    blocks_per_sm: int


# The two builds `run_plain` chooses between, each the fastest of its kind on the H200 (IEEE float32
# 8192^3 against cuBLAS's 51.1 TFLOP/s, README.md). Vector loads fit a thread in 128 registers
# (ptxas -v), so two blocks fit an SM without spills: 48.7 TFLOP/s. Scalar loads need more (64-bit
# addresses and predicates per element): at 128 registers ptxas spills, so one block an SM,
# and k steps of 16 to halve its barriers: 41.9 TFLOP/s.
PLAIN_VECTORS = PlainConfig(tile_k=8, vector_loads=True, blocks_per_sm=2)
PLAIN_SCALARS = PlainConfig(tile_k=16, vector_loads=False, blocks_per_sm=1)


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


def build_plain(dtype, read_ab, read_c, config, options=""):
    """cute.compile the plain launcher for TVM-FFI calls on torch tensors, on the stream torch
    has current for their device. A, B and C share the symbols m, n and k: each call checks
    that their sizes match."""
    # The vector build (`vector_loads_ok`): rows of stride 1; bases, row strides, n and k
    # multiples of the vector, so that a vector lies wholly inside or wholly outside.
    unit_dim, vector = (1, PLAIN_LOAD_VECTOR) if config.vector_loads else (None, 1)
    m, n, k = cute.sym_int64(), cute.sym_int64(vector), cute.sym_int64(vector)
    A = placeholder(dtype, m, k, unit_dim, vector)
    B = placeholder(dtype, k, n, unit_dim, vector)
    C = placeholder(dtype, m, n)
    alpha = beta = 1.0  # Float32 arguments: only their type is compiled in
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)  # torch's, at each call
    return cute.compile(
        launch_plain, A, B, C, alpha, beta, stream, read_ab, read_c, config,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_plain(dtype, read_ab, read_c, config):
    """The plain kernel for torch `dtype`, built once (seconds) and cached; needs no GPU. What
    is cached is the TVM-FFI function itself, which takes torch tensors and checks them
    against its build."""
    return build_plain(dtype, read_ab, read_c, config).__tvm_ffi_object__()


def sm90a_ptx(build, *args):
    """The sm_90a PTX of build(*args, options): what the tests read to check the instructions
    a build promises (its wgmma, TMA and mbarriers, or its plain FMAs and vector loads)."""
    with tempfile.TemporaryDirectory() as dump_dir:
        return build(*args, f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a").__ptx__


def ptx_of(dtype, read_ab=True, read_c=True, config=PLAIN_SCALARS):
    """The sm_90a PTX of the plain kernel's build for torch `dtype` and PlainConfig `config`."""
    return sm90a_ptx(build_plain, dtype, read_ab, read_c, config)


def checked_scalars(alpha, A, B, beta, C):
    """Validate the call (check_operands, then CUDA tensors) before anything is built or
    launched; return alpha and beta rounded to float32 once, and whether the call reads A and
    B (alpha32 != 0 and k > 0) and C (beta32 != 0)."""
    check_operands(alpha, A, B, beta, C)
    if not C.is_cuda:
        raise ValueError(f"A, B and C are on {C.device}; the CuTe kernel needs CUDA tensors")
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    return alpha32, beta32, alpha32 != 0.0 and A.shape[1] > 0, beta32 != 0.0


def run_plain(A, B, C, alpha32, beta32, read_ab, read_c):
    """Launch the plain kernel's build for these operands: the vector build where
    `vector_loads_ok`, the scalar build otherwise. TVM-FFI launches it on torch's current
    stream of C's GPU: ordered with the caller's torch work and capturable by a CUDA graph
    (call once before capturing: the first call loads the module). alpha32 and beta32 are
    float32 numbers, so the Float32 parameters hold them exactly."""
    config = PLAIN_VECTORS if read_ab and vector_loads_ok(A, B) else PLAIN_SCALARS
    compile_plain(A.dtype, read_ab, read_c, config)(A, B, C, alpha32, beta32)


def gemm(alpha, A, B, beta, C, *, allow_tf32=False):
    """C = alpha*A@B + beta*C for CUDA tensors of one dtype, every call on the plain kernel, in
    IEEE float32 (allow_tf32 permits TF32, and the IEEE result is within its bound); returns C."""
    alpha32, beta32, read_ab, read_c = checked_scalars(alpha, A, B, beta, C)
    if C.numel() > 0:  # m == 0 or n == 0: nothing to compute, no launch
        run_plain(A, B, C, alpha32, beta32, read_ab, read_c)
    return C
