"""gemv's CuTe kernels and their launch: README.md, "The mapping onto the GPU", cute_impl.py.

row_major_kernel            a warp owns whole rows; lanes, then shuffles
column_major_kernel         a thread sums down its own columns; shared memory across them
sum_splits_kernel           the second pass of a split
launch_gemv                 either kernel's launch, and the second pass's when split
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from cute_tiles import (
    LANES_PER_THREAD,
    ROWS_PER_WARP,
    THREADS_ACROSS_COLUMNS,
    THREADS_DOWN_A_COLUMN,
    THREADS_PER_BLOCK,
    WARP_SIZE,
    add_products,
    column_threads,
    column_tile,
    elems_per_vector,
    finish_row,
    in_bounds_mask,
    pairwise_sum,
    part_tiles,
    row_tile,
    rows_per_block,
    store_row,
    tiled_copies,
    warp_sum,
)


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
