"""The map of gemv's CuTe kernels, the vocabulary cute_kernels.py builds them from: README.md,
"The mapping onto the GPU", cute_impl.py, draws the thread-value maps.

    constants, block_geometry   the tiles: a warp per row (row-major), a block down D 16-byte
                                vectors of each column (column-major)
    part_tiles                  a split part's column tiles
    pairwise_sum, warp_sum      the fixed trees (dot/'s names)
    add_products                one tile's products into the float32 lanes
    in_bounds_mask              the predicate of a partial tile
    finish_row, store_row       y_i = alpha * sum + beta * y_i, or a part's sum of the row
    tiled_copies                the thread-value layouts and access widths of both kernels
"""

import functools

import cutlass
import cutlass.cute as cute

# 256 threads = 8 warps per block (the row-major kernel; column-major below).
THREADS_PER_BLOCK = 256
WARP_SIZE = 32
WARPS_PER_BLOCK = THREADS_PER_BLOCK // WARP_SIZE
# The widest load a thread can issue: 128 bits.
VECTOR_BYTES = 16
# Float32 running sums per thread, as in dot/cute_impl.py; register k adds into lane k mod 16.
LANES_PER_THREAD = 16
# Row-major: a warp owns whole rows (no shared memory for a row's sum), each thread loading 128
# bytes of A a tile, all in flight: eight vectors of one float32 row, or four of each of two
# 16-bit rows, which share each x vector (the fastest in the H200 sweep, README.md "Tuning log").
ROW_VECTORS_PER_THREAD = {32: 8, 16: 4}  # by element width in bits
ROWS_PER_WARP = {32: 1, 16: 2}
# Column-major: 32 threads across the columns, D down each column, one 16-byte vector each:
# D = 8 for float32 (a 128-byte line of each column), 16 for 16-bit data (two lines: one
# 512-thread block an SM, as cuBLAS runs); a thread loads V vectors across, 64 or 128 bytes in
# flight, the fastest in the H200 sweep (README.md "Tuning log").
THREADS_ACROSS_COLUMNS = 32
THREADS_DOWN_A_COLUMN = {32: 8, 16: 16}  # D by element width in bits
COLUMN_VECTORS_PER_THREAD = {32: 4, 16: 8}  # V by element width in bits


def elems_per_vector(width):
    """Elements of `width` bits in one 16-byte vector: 4 float32, 8 16-bit."""
    return VECTOR_BYTES * 8 // width


def row_tile(width):
    """Elements of a row that its warp loads per tile: 1024 float32, 1024 16-bit."""
    return WARP_SIZE * ROW_VECTORS_PER_THREAD[width] * elems_per_vector(width)


def rows_per_block(width):
    """Rows of A a row-major block owns: 8 float32, 16 16-bit."""
    return WARPS_PER_BLOCK * ROWS_PER_WARP[width]


def column_tile(width):
    """(rows, columns) of a column-major block's tile: 32 x 128 float32, 128 x 256 16-bit."""
    rows = THREADS_DOWN_A_COLUMN[width] * elems_per_vector(width)
    return rows, THREADS_ACROSS_COLUMNS * COLUMN_VECTORS_PER_THREAD[width]


def column_threads(width):
    """Threads of a column-major block: 256 float32, 512 16-bit."""
    return THREADS_DOWN_A_COLUMN[width] * THREADS_ACROSS_COLUMNS


@functools.cache  # looked up on every call: worked out once
def block_geometry(dtype, layout):
    """(rows, columns, threads) of one block's tile: rows of A a block owns, the columns it takes
    a tile, and its threads."""
    width = dtype.itemsize * 8
    if layout == "row":
        return rows_per_block(width), row_tile(width), THREADS_PER_BLOCK
    return (*column_tile(width), column_threads(width))


def part_tiles(n, tile_columns, tiles_per_split):
    """(first, whole stop, stop): the column tiles of this block's part, [first, stop), of which
    [first, whole stop) lie inside n and the last, if n cuts it, is [whole stop, stop). The part
    is blockIdx.y; past the last tile a part is empty. Plain Python, run while the kernel is
    traced."""
    tiles = (n + tile_columns - 1) // tile_columns
    first = cutlass.min(cutlass.Int64(cute.arch.block_idx()[1]) * tiles_per_split, tiles)
    stop = cutlass.min(first + tiles_per_split, tiles)
    return first, cutlass.max(first, cutlass.min(stop, n // tile_columns)), stop


def pairwise_sum(values):
    """The sum of a power-of-two list of float32 registers, adding neighbours in pairs. Plain
    Python, run while the kernel is traced: it emits the log2(len) levels of additions."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


@cute.jit
def warp_sum(value):
    """The sum of `value` over the 32 lanes of a warp, in every lane: at the level with offset
    o, lane l adds the value of lane l ^ o (shfl.sync.bfly); both partners compute the same
    sum (a + b = b + a exactly), so all lanes end with the warp's sum, built by one tree."""
    offset = WARP_SIZE // 2
    for _ in cutlass.range_constexpr(WARP_SIZE.bit_length() - 1):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
        offset //= 2
    return value


@cute.jit
def add_products(a_copy, a_tiles, x_copy, x_tile, lanes, in_bounds):
    """lanes[r][k mod L] += a_k * x_k over this thread's elements of one tile of each row
    block r in a_tiles, widened to float32, in the order of k; the x tile is loaded once for
    all of them. The two thread copies partition their tiles alike, so register k of A and of
    x are a_ij and x_j of the same (i, j). in_bounds None: the whole tile is inside the
    matrix, no predicate."""
    a_mine = [a_copy.partition_S(a_tile) for a_tile in a_tiles]
    x_mine = x_copy.partition_S(x_tile)
    a_registers = [cute.make_rmem_tensor_like(mine) for mine in a_mine]
    x_registers = cute.make_rmem_tensor_like(x_mine)
    if cutlass.const_expr(in_bounds is not None):
        for registers in a_registers:
            registers.fill(0)  # what the predicate skips adds 0 * 0 = 0
        x_registers.fill(0)
    # All loads are issued before the first product, so they are in flight together.
    for r in cutlass.range_constexpr(len(a_tiles)):
        cute.copy(a_copy, a_mine[r], a_registers[r], pred=in_bounds)
    cute.copy(x_copy, x_mine, x_registers, pred=in_bounds)
    # Widening is exact, and the compiler fuses each multiply and add into one fma.rn.f32.
    for k in cutlass.range_constexpr(cute.size(x_registers)):
        x_k = x_registers[k].to(cutlass.Float32)
        for r in cutlass.range_constexpr(len(a_tiles)):
            lanes[r][k % LANES_PER_THREAD] += a_registers[r][k].to(cutlass.Float32) * x_k


@cute.jit
def in_bounds_mask(thread_copy, coord_tile, extent):
    """The predicate tensor: True where this thread's element has a coordinate inside
    `extent`. One entry per copy atom, and a predicated copy's atoms move one element each."""
    coords = thread_copy.partition_S(coord_tile)
    mask = cute.make_rmem_tensor(coords.shape, cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(mask)):
        mask[i] = cute.elem_less(coords[i], extent)
    return mask


@cute.jit
def finish_row(y, row, row_sum, alpha, beta, read_a: cutlass.Constexpr, read_y: cutlass.Constexpr):
    """y[row] = alpha * row_sum + beta * y[row] in float32, rounded once by the store."""
    result = cutlass.Float32(0.0)
    if cutlass.const_expr(read_a):
        result = alpha * row_sum
    if cutlass.const_expr(read_y):
        result = result + beta * y[row].to(cutlass.Float32)  # 0 + v is exact
    y[row] = result.to(y.element_type)


@cute.jit
def store_row(
    y, partials, row, row_sum, alpha, beta, read_a: cutlass.Constexpr, read_y: cutlass.Constexpr
):
    """Split (partials given): store this part's sum of the row at partials[part, row], for
    sum_splits_kernel. Else finish the row."""
    if cutlass.const_expr(partials is not None):
        partials[cute.arch.block_idx()[1], row] = row_sum
    else:
        finish_row(y, row, row_sum, alpha, beta, read_a, read_y)


def tiled_copies(dtype, layout, vector_elems):
    """(tile_copy, element_copy) of the 'row' or 'col' kernel, built while a launcher is traced:
    one thread-value layout and two access widths, vector_elems elements (a 16-byte vector, or
    1 in the any-stride build) and one element (the predicated copies of partial tiles)."""
    v = elems_per_vector(dtype.width)
    tile_op, tile_hints = cute.nvgpu.CopyUniversalOp(), {}
    if layout == "row":
        # Lane t of a row's warp owns v adjacent elements in each run of 32 v.
        thread_layout = cute.make_layout(WARP_SIZE)
        value_layout = cute.make_layout(v)
        # The full tiles' loads carry an L2 prefetch hint (ld.global.L2::128B): L2 fetches the
        # whole 128-byte line around each access from memory. Measured, not derived: on the
        # H200 at 16384 x 16384 bfloat16 it took the row-major kernel from 0.997x to 1.009x
        # cuBLAS; the column-major kernel ran no faster with it (README.md).
        tile_op = cute.nvgpu.CopyG2ROp()
        tile_hints = {"l2_prefetch_size": cute.nvgpu.L2PrefetchSize.SIZE_128B}
    else:
        # (D, 32):(1, D): thread t is (t mod D) down the rows and (t div D) across the
        # columns, and holds one vector of v rows of each of its columns.
        down = THREADS_DOWN_A_COLUMN[dtype.width]
        thread_layout = cute.make_layout((down, THREADS_ACROSS_COLUMNS), stride=(1, down))
        value_layout = cute.make_layout((v, 1))
    tile_atom = cute.make_copy_atom(
        tile_op, dtype, num_bits_per_copy=dtype.width * vector_elems, **tile_hints
    )
    element_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width
    )
    return tuple(
        cute.make_tiled_copy_tv(atom, thread_layout, value_layout)
        for atom in (tile_atom, element_atom)
    )
