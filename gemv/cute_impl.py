"""gemv, y = alpha*A*x + beta*y, in the CuTe DSL: README.md, "The mapping onto the GPU",
cute_impl.py, has the thread-value maps drawn out.

    constants, block_geometry   the tiles: a warp per row (row-major), a block down D 16-byte
                                vectors of each column (column-major)
    split_columns, part_tiles   how many parts the columns are cut into, and a part's tiles
    roundings                   README's k for A: the most roundings on one term's way to y_i
    pairwise_sum, warp_sum      the fixed trees (dot/'s names)
    add_products                one tile's products into the float32 lanes
    row_major_kernel            a warp owns whole rows; lanes, then shuffles
    column_major_kernel         a thread sums down its own columns; shared memory across them
    sum_splits_kernel           the second pass of a split
    tiled_copies, launch_gemv   the thread-value layouts and the launch
    placeholders, build, compile_kernel   compiled once per specialisation, called by TVM-FFI
    ptx_of, register_coordinates          what the tests read on the CPU
    gemv                        the launcher
"""

import functools
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import check_operands, to_float32

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
# The split (split_columns): fill FILL_THREADS, two 256-thread blocks for each of the H200's 132
# SMs (the occupancy the kernels run at), a constant so that the bits of y depend on the shape
# alone; a part must stream SPLIT_MIN_BYTES of A to outlast the second pass's start; at most
# MAX_SPLITS parts (a tree of 6 levels, one register a part in the second pass).
FILL_THREADS = 2 * 132 * THREADS_PER_BLOCK
SPLIT_MIN_BYTES = 128 * 1024
MAX_SPLITS = 64

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


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


def split_columns(m, n, dtype, layout):
    """(splits, tiles per split) for an (m, n) A of `dtype` in the 'row' or 'col' kernel: how many
    parts the columns are cut into, and how many column tiles each part takes (the last parts may
    take fewer, or none). splits is a power of two, 1 when the row blocks alone fill the GPU."""
    block_rows, tile_columns, threads = block_geometry(dtype, layout)
    row_blocks, tiles = -(-m // block_rows), -(-n // tile_columns)
    tile_bytes = block_rows * tile_columns * dtype.itemsize
    most = min(
        FILL_THREADS // threads // row_blocks, tiles * tile_bytes // SPLIT_MIN_BYTES, MAX_SPLITS
    )
    splits = 1 << (most.bit_length() - 1) if most > 1 else 1
    return splits, -(-tiles // splits)


def roundings(A):
    """README.md's k for the kernel gemv runs on A (n > 0): the most roundings on one term
    alpha a_ij x_j's way to y_i. A thread loads V vectors of v elements a tile and adds register
    k into lane k mod L (L = LANES_PER_THREAD), so each lane takes F = V v / L products a tile
    in series: F t - 1 additions over the t tiles of its part, after the product's own rounding
    (float32 data only; 16-bit products are exact). Then the trees: row-major, log2(L) levels
    in the thread and log2(WARP_SIZE) shuffle levels (warp_sum); column-major, log2(L / v)
    column slots in the thread and log2(THREADS_ACROSS_COLUMNS) levels over the row's partial
    sums; then log2(splits) levels over the parts, alpha * sum and the addition of beta * y_i."""
    (m, n), width = A.shape, A.element_size() * 8
    layout, v = mapping(A), elems_per_vector(width)
    if layout == "row":
        vectors, trees = ROW_VECTORS_PER_THREAD[width], [LANES_PER_THREAD, WARP_SIZE]
    else:
        vectors = COLUMN_VECTORS_PER_THREAD[width]
        trees = [LANES_PER_THREAD // v, THREADS_ACROSS_COLUMNS]
    splits, tiles = split_columns(m, n, A.dtype, layout)
    product = 1 if width == 32 else 0
    levels = sum(size.bit_length() - 1 for size in [*trees, splits])
    return product + (vectors * v // LANES_PER_THREAD * tiles - 1) + levels + 2


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


@cute.kernel
def row_major_kernel(
    A: cute.Tensor,
    x: cute.Tensor,
    y: cute.Tensor,
    partials,
    m: cutlass.Int64,
    n: cutlass.Int64,
    tiles_per_split: cutlass.Int64,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    tile_copy: cute.TiledCopy,
    element_copy: cute.TiledCopy,
    read_a: cutlass.Constexpr[bool],
    read_y: cutlass.Constexpr[bool],
):
    thread, _, _ = cute.arch.thread_idx()
    block_idx, _, _ = cute.arch.block_idx()
    warp, lane = thread // WARP_SIZE, thread % WARP_SIZE
    width = A.element_type.width
    warp_rows = ROWS_PER_WARP[width]
    # blockIdx is a 32-bit register: widen it before multiplying.
    first_row = cutlass.Int64(block_idx) * rows_per_block(width) + warp * warp_rows
    row_sums = [cutlass.Float32(0.0)] * warp_rows
    if cutlass.const_expr(read_a):
        tile_elems = row_tile(width)
        lanes = [cute.make_rmem_tensor(LANES_PER_THREAD, cutlass.Float32) for _ in range(warp_rows)]
        for row_lanes in lanes:
            row_lanes.fill(0.0)
        if first_row < m:  # the same for the whole warp: no warp diverges
            # In the matrix's last warp, rows past m read row m - 1 again; their sums are not
            # stored.
            a_rows = [A[cutlass.min(first_row + r, m - 1), None] for r in range(warp_rows)]
            lane_tile_copy = tile_copy.get_slice(lane)
            first, whole_stop, stop = part_tiles(n, tile_elems, tiles_per_split)
            for tile in cutlass.range(first, whole_stop):
                a_tiles = [cute.local_tile(a_row, (tile_elems,), (tile,)) for a_row in a_rows]
                x_tile = cute.local_tile(x, (tile_elems,), (tile,))
                add_products(lane_tile_copy, a_tiles, lane_tile_copy, x_tile, lanes, None)
            if whole_stop < stop:  # the rows' last tile, cut by n, is in this part
                lane_element_copy = element_copy.get_slice(lane)
                coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (whole_stop,))
                in_bounds = in_bounds_mask(lane_element_copy, coords, n)
                a_tiles = [cute.local_tile(a_row, (tile_elems,), (whole_stop,)) for a_row in a_rows]
                x_tile = cute.local_tile(x, (tile_elems,), (whole_stop,))
                add_products(
                    lane_element_copy, a_tiles, lane_element_copy, x_tile, lanes, in_bounds
                )
        # Every lane takes part in the shuffles, inside the matrix or not.
        row_sums = [
            warp_sum(pairwise_sum([row_lanes[k] for k in range(LANES_PER_THREAD)]))
            for row_lanes in lanes
        ]
    for r in cutlass.range_constexpr(warp_rows):
        if lane == 0 and first_row + r < m:
            store_row(y, partials, first_row + r, row_sums[r], alpha, beta, read_a, read_y)


@cute.kernel
def column_major_kernel(
    A: cute.Tensor,
    x_rows: cute.Tensor,
    y: cute.Tensor,
    partials,
    m: cutlass.Int64,
    n: cutlass.Int64,
    tiles_per_split: cutlass.Int64,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    tile_copy: cute.TiledCopy,
    element_copy: cute.TiledCopy,
    read_a: cutlass.Constexpr[bool],
    read_y: cutlass.Constexpr[bool],
):
    thread, _, _ = cute.arch.thread_idx()
    block_idx, _, _ = cute.arch.block_idx()
    block = cutlass.Int64(block_idx)  # 32-bit register, widened before multiplying
    width = A.element_type.width
    v = elems_per_vector(width)
    block_rows, tile_columns = column_tile(width)
    row_sum = cutlass.Float32(0.0)
    if cutlass.const_expr(read_a):
        tile = (block_rows, tile_columns)
        lanes = cute.make_rmem_tensor(LANES_PER_THREAD, cutlass.Float32)
        lanes.fill(0.0)
        thread_tile_copy = tile_copy.get_slice(thread)
        thread_element_copy = element_copy.get_slice(thread)
        first, whole_stop, stop = part_tiles(n, tile_columns, tiles_per_split)
        # x_rows is x seen as an (m, n) matrix whose every row is x (row stride 0): partitioned
        # with the same thread-value layout as A, it hands each thread the x_j of each of its
        # a_ij. A stride-0 operand cannot be read as vectors, so x always uses 1-element
        # accesses; the v copies of one x_j in a thread are one address, loaded once.
        identity = cute.make_identity_tensor((m, n))
        first_partial = first  # in the matrix's last rows every tile is partial
        if (block + 1) * block_rows <= m:
            for t in cutlass.range(first, whole_stop):
                add_products(
                    thread_tile_copy, [cute.local_tile(A, tile, (block, t))],
                    thread_element_copy, cute.local_tile(x_rows, tile, (block, t)), [lanes], None,
                )  # fmt: skip
            first_partial = whole_stop
        for t in cutlass.range(first_partial, stop):
            in_bounds = in_bounds_mask(
                thread_element_copy, cute.local_tile(identity, tile, (block, t)), (m, n)
            )
            add_products(
                thread_element_copy, [cute.local_tile(A, tile, (block, t))],
                thread_element_copy, cute.local_tile(x_rows, tile, (block, t)), [lanes], in_bounds,
            )  # fmt: skip
        # Register k holds row k mod v of the thread's vector and its column k div v, and adds
        # into lane k mod 16: the lanes hold each of the v rows in 16 / v column slots.
        thread_sums = cute.make_tensor(
            cute.arch.alloc_smem(cutlass.Float32, block_rows * THREADS_ACROSS_COLUMNS),
            cute.make_layout((block_rows, THREADS_ACROSS_COLUMNS), stride=(1, block_rows)),
        )
        row_thread = thread % THREADS_DOWN_A_COLUMN[width]
        column_thread = thread // THREADS_DOWN_A_COLUMN[width]
        for r in cutlass.range_constexpr(v):
            slots = [lanes[r + v * c] for c in range(LANES_PER_THREAD // v)]
            thread_sums[row_thread * v + r, column_thread] = pairwise_sum(slots)
        cute.arch.sync_threads()  # all partial sums of every row are in shared memory
        if thread < block_rows:
            row_sum = pairwise_sum([thread_sums[thread, c] for c in range(THREADS_ACROSS_COLUMNS)])
    row = block * block_rows + thread
    if thread < block_rows and row < m:
        store_row(y, partials, row, row_sum, alpha, beta, read_a, read_y)


@cute.kernel
def sum_splits_kernel(
    partials: cute.Tensor,
    y: cute.Tensor,
    m: cutlass.Int64,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    read_y: cutlass.Constexpr[bool],
):
    """The second pass of a split: thread i of block b finishes row 256 b + i from its parts
    partials[s, row], added by neighbours in a pairwise tree of log2(splits) levels. Adjacent
    threads read adjacent rows of each part."""
    thread, _, _ = cute.arch.thread_idx()
    block_idx, _, _ = cute.arch.block_idx()
    row = cutlass.Int64(block_idx) * THREADS_PER_BLOCK + thread
    if row < m:
        parts = [partials[s, row] for s in range(cute.size(partials, mode=[0]))]
        finish_row(y, row, pairwise_sum(parts), alpha, beta, True, read_y)


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


@cute.jit
def launch_gemv(
    A: cute.Tensor,
    x: cute.Tensor,
    y: cute.Tensor,
    partials,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    tiles_per_split: cutlass.Int64,
    stream: cuda.CUstream,
    layout: cutlass.Constexpr[str],
    vector_elems: cutlass.Constexpr[int],
    read_a: cutlass.Constexpr[bool],
    read_y: cutlass.Constexpr[bool],
):
    # A, x and y arrive as torch tensors through TVM-FFI, with the layouts they were compiled
    # for (`placeholders`): a vector build knows A's stride 1 along the contiguous dimension, a
    # multiple of v for the other stride and a 16-byte aligned start (row-major, x's stride 1
    # and start too) when it compiles, which lets it merge adjacent elements into one 128-bit
    # access.
    dtype = A.element_type
    # m and n from cute.size, 64-bit: CuTe DSL 4.8.1 reads A.shape[i] back as 32 bits.
    m, n = cutlass.Int64(cute.size(A, mode=[0])), cutlass.Int64(cute.size(A, mode=[1]))
    tile_copy, element_copy = tiled_copies(dtype, layout, vector_elems)
    if cutlass.const_expr(layout == "row"):
        kernel = row_major_kernel(
            A, x, y, partials, m, n, tiles_per_split, alpha, beta, tile_copy, element_copy,
            read_a, read_y,
        )  # fmt: skip
        block_rows, threads = rows_per_block(dtype.width), THREADS_PER_BLOCK
    else:
        # x as an (m, n) matrix whose every row is x: row stride 0.
        x_rows = cute.make_tensor(x.iterator, cute.make_layout((m, n), stride=(0, x.stride[0])))
        kernel = column_major_kernel(
            A, x_rows, y, partials, m, n, tiles_per_split, alpha, beta, tile_copy, element_copy,
            read_a, read_y,
        )  # fmt: skip
        block_rows, threads = column_tile(dtype.width)[0], column_threads(dtype.width)
    # Split (partials given): a block for each row block and part, then the second pass. Two
    # launches on one stream: it starts after every part's row sums are stored.
    splits = 1 if partials is None else cute.size(partials, mode=[0])
    kernel.launch(
        grid=[cute.ceil_div(m, block_rows), splits, 1],
        block=[threads, 1, 1],
        stream=stream,
    )
    if cutlass.const_expr(partials is not None):
        sum_splits_kernel(partials, y, m, alpha, beta, read_y).launch(
            grid=[cute.ceil_div(m, THREADS_PER_BLOCK), 1, 1],
            block=[THREADS_PER_BLOCK, 1, 1],
            stream=stream,
        )


def mapping(A):
    """'col' when A's rows are adjacent in memory (column-major, A.stride(0) < A.stride(1)),
    else 'row': the contiguous dimension, or the nearer one for a strided view."""
    stride_m, stride_n = A.stride()
    return "col" if stride_m < stride_n else "row"


def elements_per_access(dtype, vector_friendly):
    """16 // element size for the vector build, 1 for the any-stride build."""
    return VECTOR_BYTES // dtype.itemsize if vector_friendly else 1


def is_vector_friendly(A, x, layout):
    """A's contiguous dimension has stride 1 and every row (row-major) or column (column-major)
    starts on a 16-byte boundary; row-major also reads x as vectors, so x must be contiguous
    and aligned as well."""
    stride_m, stride_n = A.stride()
    along, across = (stride_n, stride_m) if layout == "row" else (stride_m, stride_n)
    if along != 1 or across % (VECTOR_BYTES // A.element_size()) or A.data_ptr() % VECTOR_BYTES:
        return False
    return layout == "col" or (x.is_contiguous() and x.data_ptr() % VECTOR_BYTES == 0)


def placeholders(dtype, layout, vector_elems, splits):
    """What cute.compile sees of A, x, y and the split's partials: the dtype, 64-bit symbolic
    sizes (A's m shared with y's length and the partials' rows, its n with x's: each call checks
    they match) and strides. partials is None unsplit, else a float32 (splits, m) tensor with
    the constant stride 1 along m. A vector build
    has A's stride along the contiguous dimension the constant 1, the other a 64-bit symbolic
    multiple of v, and a 16-byte aligned start, and row-major x the stride 1 and a 16-byte
    aligned start; every other stride is a 64-bit symbolic one on an element boundary. The
    compiled function checks each call's tensors against them (dtype, device, alignment,
    strides, sizes) and raises rather than run on a mismatch."""
    element, size = TORCH_TO_CUTLASS[dtype], dtype.itemsize
    m, n = cute.sym_int64(), cute.sym_int64()
    if vector_elems == 1:
        a_stride = (cute.sym_int64(), cute.sym_int64())
    elif layout == "row":
        a_stride = (cute.sym_int64(divisibility=vector_elems), 1)
    else:
        a_stride = (1, cute.sym_int64(divisibility=vector_elems))
    x_vector = vector_elems > 1 and layout == "row"
    x_stride, x_align = (1, VECTOR_BYTES) if x_vector else (cute.sym_int64(), size)
    make = cute.runtime.make_fake_tensor
    partials = None
    if splits > 1:
        partials = make(cutlass.Float32, (splits, m), stride=(cute.sym_int64(), 1), assumed_align=4)
    return (
        make(element, (m, n), stride=a_stride, assumed_align=size * vector_elems),
        make(element, (n,), stride=(x_stride,), assumed_align=x_align),
        make(element, (m,), stride=(cute.sym_int64(),), assumed_align=size),
        partials,
    )


def build(dtype, layout, vector_elems, read_a, read_y, splits=1, options=""):
    """cute.compile the launcher for TVM-FFI calls on torch tensors and numbers (A, x, y,
    partials or None, alpha, beta, tiles per split), on the stream torch has current for their
    device."""
    if vector_elems not in (1, elements_per_access(dtype, True)):
        raise ValueError(f"vector_elems must be 1 or {elements_per_access(dtype, True)}")
    if layout not in ("row", "col"):
        raise ValueError(f"layout must be 'row' or 'col', got {layout!r}")
    A, x, y, partials = placeholders(dtype, layout, vector_elems, splits)
    return cute.compile(
        launch_gemv, A, x, y, partials, 1.0, 1.0, cutlass.Int64(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        layout, vector_elems, read_a, read_y, options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(dtype, layout, vector_elems, read_a, read_y, splits):
    """The compiled gemv for torch `dtype`, A's `layout` ('row' or 'col'), `vector_elems`
    elements per access of A, loading A and x only if read_a and y only if read_y, its columns
    in `splits` parts; built once (about a second) and cached. Compiling needs no GPU. What is
    cached is the TVM-FFI function itself, which takes torch tensors and checks them against
    its build."""
    return build(dtype, layout, vector_elems, read_a, read_y, splits).__tvm_ffi_object__()


def ptx_of(dtype, layout, contiguous, read_a=True, read_y=True, splits=1):
    """The PTX of the vector build (contiguous=True) or of the any-stride build of the 'row'
    or 'col' kernel, for sm_90a (H200): what the tests read to check for 128-bit loads and
    warp shuffles."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        vector_elems = elements_per_access(dtype, contiguous)
        return build(dtype, layout, vector_elems, read_a, read_y, splits, options).__ptx__


@cute.jit
def record_coordinates(
    dtype: cutlass.Constexpr,
    layout: cutlass.Constexpr[str],
    vector_elems: cutlass.Constexpr[int],
    threads: cutlass.Constexpr,
    found: cutlass.Constexpr,
):
    """Append to `found`, for each thread and for the tile copy then the element copy, the
    coordinates of its registers in one tile. Pure layout algebra, run while tracing."""
    tile_copy, element_copy = tiled_copies(dtype, layout, vector_elems)
    tile = (
        row_tile(dtype.width) if cutlass.const_expr(layout == "row") else column_tile(dtype.width)
    )
    identity = cute.make_identity_tensor(tile)
    for i in cutlass.range_constexpr(len(threads)):
        for thread_copy in (tile_copy, element_copy):
            coords = thread_copy.get_slice(threads[i]).partition_S(identity)
            found.append([coords[k] for k in range(cute.size(coords))])


def register_coordinates(dtype, layout, contiguous, threads):
    """{(thread, 'tile' or 'element'): the coordinate in one tile of each of its registers},
    from the layouts the kernels are built with: what the tests check README.md's formulas
    against. Runs on the host; needs no GPU."""
    found = []
    vector_elems = elements_per_access(dtype, contiguous)
    record_coordinates(TORCH_TO_CUTLASS[dtype], layout, vector_elems, tuple(threads), found)
    keys = [(t, copy) for t in threads for copy in ("tile", "element")]
    return dict(zip(keys, found, strict=True))


def gemv(alpha, A, x, beta, y):
    """y = alpha*A*x + beta*y for CUDA tensors of one dtype, in float32; returns y."""
    check_operands(alpha, A, x, beta, y)
    if not y.is_cuda:
        raise ValueError(f"A, x and y are on {y.device}; the CuTe kernel needs CUDA tensors")
    m, n = A.shape
    if m == 0:
        return y
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    layout = mapping(A)
    vector_elems = elements_per_access(A.dtype, is_vector_friendly(A, x, layout))
    read_a = alpha32 != 0.0 and n > 0
    splits, tiles_per_split = split_columns(m, n, A.dtype, layout) if read_a else (1, 0)
    # The parts' row sums, per call from torch's caching allocator: calls on different streams
    # may run side by side.
    partials = (
        torch.empty((splits, m), dtype=torch.float32, device=y.device) if splits > 1 else None
    )
    # TVM-FFI launches on torch's current stream of the operands' GPU: ordered with the caller's
    # torch work and capturable by a CUDA graph (call once before capturing: the first call
    # loads the compiled module). alpha32 and beta32 pass as Float32 exactly.
    compile_kernel(A.dtype, layout, vector_elems, read_a, beta32 != 0.0, splits)(
        A, x, y, partials, alpha32, beta32, tiles_per_split
    )
    return y
