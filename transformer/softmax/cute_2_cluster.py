"""CuTe step 2, softmax forward and backward with the row held on chip, over a thread-block cluster.

Compared with step 1 (cute_1_two_pass.py) this adds: the row is read once, split over the C blocks
(CTAs) of a cluster, each holding its slice in registers, and the blocks reduce through
distributed shared memory (README.md, "Step 2: the row held on chip" draws the map):

    block r of the cluster loads tiles [r T, (r + 1) T) of the row (`plan`: T tiles, C blocks),
          every load of every operand issued before the first is used (load_slice)
    forward  thread max -> cluster_max; exp of every value held; thread pairwise_sum ->
             cluster_sum; y = exp * (1 / sum), stored from the registers (2MN traffic)
    backward y and dy held together; thread pairwise_sum of dy*y -> cluster_sum;
             dx = y (dy - dot), stored from the registers (3MN traffic)

cluster_max and cluster_sum are block_max and block_sum (step 1's warp -> block reductions),
then, for C > 1, every block writes its value into slot r of every block's slots (mapa +
st.async counted by an mbarrier, share_with_cluster) and each block combines its C slots in one
fixed pairwise tree: the same bits in every block and on every run. One cluster barrier at the
start makes sure every block's mbarriers are set before anyone sends. Rows too long for
MAX_CLUSTER blocks stay on step 1 (cute_impl.py dispatches).
"""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

import cute_1_two_pass as blocks  # the warp/block reductions, exp and tile copies

# Each thread holds 64 float32 values of its slice, the operands together (forward: 64 of x;
# backward: 32 of y and 32 of dy): 64 registers for the row, 80 in all, so that BLOCKS_PER_SM
# blocks of 256 threads fit an SM.
CLUSTER_VALUES = 64
BLOCKS_PER_SM = 3  # 3 * 256 threads * 80 registers <= the SM's 65536: ptxas keeps to 80
# Hopper's largest cluster (16 is "non-portable"; the CuTe DSL allows it on every kernel it
# builds): the forward's rows to 16 x 16384 = 262144, the backward's to 131072.
MAX_CLUSTER = 16
OPERANDS_HELD = {"forward": 1, "backward": 2}  # x; y and dy


def plan(direction, n, dtype_width):
    """(T, C): each of the C blocks of a row's cluster holds T tiles of step 1's map (a power
    of two), the fewest that cover n; C = 1 for a row one block holds. None: the row is longer
    than MAX_CLUSTER slices, step 1's two passes take it."""
    tile_elems, per_thread = blocks.tile_shape(dtype_width)
    slice_tiles = CLUSTER_VALUES // OPERANDS_HELD[direction] // per_thread
    row_tiles = max(1, -(-n // tile_elems))
    size = 1 << (-(-row_tiles // slice_tiles) - 1).bit_length()
    if size > MAX_CLUSTER:
        return None
    return (slice_tiles if size > 1 else 1 << (row_tiles - 1).bit_length()), size


def additions(tiles, size, dtype_width):
    """Additions on a term's way into the row's sum or dot: the thread's pairwise tree over its
    held values, the 8 levels of block_sum and log2(C) levels over the cluster's slots."""
    held = tiles * blocks.tile_shape(dtype_width)[1]
    return int(math.log2(held)) + int(math.log2(blocks.THREADS_PER_BLOCK)) + int(math.log2(size))


def pairwise_max(values):
    """pairwise_sum's shape with max (plain Python, run while tracing; max is exact)."""
    while len(values) > 1:
        values = [cute.arch.fmax(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


def start_cluster(exchanges, size):
    """One mbarrier per exchange (a list; None for a block alone, C = 1, which exchanges
    nothing), set up by init_mbarriers (plain Python, run while tracing)."""
    if size == 1:
        return [None] * exchanges
    arrived = cute.arch.alloc_smem(cutlass.Int64, exchanges)
    init_mbarriers(arrived, exchanges)
    return [arrived + k for k in range(exchanges)]


@cute.jit
def init_mbarriers(arrived, exchanges: cutlass.Constexpr[int]):
    """Thread 0 sets the mbarriers up; then "this block has started, its mbarriers set"
    (barrier.cluster.arrive), which wait_for_cluster waits on: no block sends to a peer before
    all have."""
    thread, _, _ = cute.arch.thread_idx()
    if thread == 0:
        for k in cutlass.range_constexpr(exchanges):
            cute.arch.mbarrier_init(arrived + k, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()


def wait_for_cluster(size):
    """Every block of the cluster has started (called after the loads are issued)."""
    if size > 1:
        cute.arch.cluster_wait()


@cute.jit
def share_with_cluster(value, slots, arrived, size: cutlass.Constexpr[int]):
    """slots[r] of every block of the cluster := block r's float32 `value`. Thread p < size
    sends ours to block p (st.async into our slot's address mapped into block p's shared
    memory by mapa), which completes 4 of the bytes block p's mbarrier `arrived` expects;
    thread 0 arrives on ours expecting 4 * size bytes, and every thread waits for that phase:
    then all size values are in our slots, whichever block sent first."""
    thread, _, _ = cute.arch.thread_idx()
    if thread == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(arrived, 4 * size)
    if thread < size:
        box = cute.make_rmem_tensor(1, cutlass.Float32)
        box[0] = value
        bits = cute.recast_tensor(box, cutlass.Int32)[0]  # st.async moves b32
        slot = slots.iterator + cute.arch.block_idx_in_cluster()
        cute.arch.store_async_dsmem(slot, bits, arrived, thread)
    cute.arch.mbarrier_wait(arrived, 0)


def cluster_reduce(block_value, combine, arrived, size):
    """The cluster's value from each block's: the C values exchanged into slots by rank and
    combined in one fixed pairwise tree (plain Python, run while tracing)."""
    if size == 1:
        return block_value
    slots = cute.make_tensor(cute.arch.alloc_smem(cutlass.Float32, size), cute.make_layout(size))
    share_with_cluster(block_value, slots, arrived, size)
    return combine([slots[r] for r in range(size)])


def cluster_sum(value, arrived, size):
    """The sum of `value` over the cluster's threads, in every thread: block_sum, then the
    blocks' sums over the slots (`arrived`: this exchange's mbarrier)."""
    return cluster_reduce(blocks.block_sum(value), blocks.pairwise_sum, arrived, size)


def cluster_max(value, arrived, size):
    """cluster_sum's shape with max (exact: every block gets the same bits)."""
    return cluster_reduce(blocks.block_max(value), pairwise_max, arrived, size)


def held_values(tiles, values_per_tile):
    """One float32 register tensor per tile of the slice."""
    return [cute.make_rmem_tensor(values_per_tile, cutlass.Float32) for _ in range(tiles)]


def flat(values):
    return [tile[j] for tile in values for j in range(cute.size(tile))]


@cute.jit
def load_slice(operands, first_tile, n, tile_elems: cutlass.Constexpr[int], fill):
    """For each (copies, row, values) of operands: values[t] = this thread's elements of the
    row's tile first_tile + t, in float32. A slice wholly inside the row moves as 128-bit
    vectors in one straight-line block for all operands, so every load is issued before the
    first one is used (README.md, "Why bf16 step 2 stopped at 68%"); the slice holding the
    row's end goes tile by tile (load_tile), elements past n read as `fill`."""
    tiles = len(operands[0][2])
    if (first_tile + tiles) * tile_elems <= n:
        thread, _, _ = cute.arch.thread_idx()
        for k in cutlass.range_constexpr(len(operands)):
            copies, row, values = operands[k]
            tile_copy = copies[0].get_slice(thread)
            for t in cutlass.range_constexpr(tiles):
                row_tile = cute.local_tile(row, (tile_elems,), (first_tile + t,))
                blocks.copy_in(tile_copy, row_tile, values[t], fill, None)
    else:
        for k in cutlass.range_constexpr(len(operands)):
            copies, row, values = operands[k]
            for t in cutlass.range_constexpr(tiles):
                blocks.load_tile(copies, row, first_tile + t, n, tile_elems, fill, values[t])


@cute.jit
def store_slice(copies, row, first_tile, n, tile_elems: cutlass.Constexpr[int], values):
    for t in cutlass.range_constexpr(len(values)):
        blocks.store_tile(copies, row, first_tile + t, n, tile_elems, values[t])


@cute.kernel
def softmax_forward_cluster_kernel(
    x: cute.Tensor, y: cute.Tensor, n: cutlass.Int32, x_copies, y_copies,
    tile_elems: cutlass.Constexpr[int], values_per_tile: cutlass.Constexpr[int],
    tiles: cutlass.Constexpr[int], size: cutlass.Constexpr[int],
):  # fmt: skip
    block, _, _ = cute.arch.block_idx()
    row, first_tile = block // size, (block % size) * tiles
    x_row, y_row = x[row, None], y[row, None]
    max_arrived, sum_arrived = start_cluster(2, size)  # the two exchanges' mbarriers
    values = held_values(tiles, values_per_tile)
    fill = -cutlass.Float32.inf  # exp(-inf) = 0: lanes past n add nothing
    load_slice([(x_copies, x_row, values)], first_tile, n, tile_elems, fill)
    wait_for_cluster(size)
    shift = blocks.finite_shift(cluster_max(pairwise_max(flat(values)), max_arrived, size))
    for t in cutlass.range_constexpr(tiles):
        for j in cutlass.range_constexpr(values_per_tile):
            values[t][j] = blocks.exp_shifted(values[t][j], shift)
    row_sum = cluster_sum(blocks.pairwise_sum(flat(values)), sum_arrived, size)
    inverse = cutlass.Float32(1.0) / row_sum
    for t in cutlass.range_constexpr(tiles):
        for j in cutlass.range_constexpr(values_per_tile):
            values[t][j] = values[t][j] * inverse
    store_slice(y_copies, y_row, first_tile, n, tile_elems, values)


@cute.kernel
def softmax_backward_cluster_kernel(
    y: cute.Tensor, dy: cute.Tensor, dx: cute.Tensor, n: cutlass.Int32, y_copies, dy_copies,
    dx_copies, tile_elems: cutlass.Constexpr[int], values_per_tile: cutlass.Constexpr[int],
    tiles: cutlass.Constexpr[int], size: cutlass.Constexpr[int],
):  # fmt: skip
    block, _, _ = cute.arch.block_idx()
    row, first_tile = block // size, (block % size) * tiles
    y_row, dy_row, dx_row = y[row, None], dy[row, None], dx[row, None]
    (dot_arrived,) = start_cluster(1, size)  # the dot's exchange's mbarrier
    y_values, dy_values = held_values(tiles, values_per_tile), held_values(tiles, values_per_tile)
    operands = [(y_copies, y_row, y_values), (dy_copies, dy_row, dy_values)]
    load_slice(operands, first_tile, n, tile_elems, 0.0)  # 0 * 0: lanes past n add nothing
    wait_for_cluster(size)
    products = [p * q for p, q in zip(flat(dy_values), flat(y_values), strict=True)]
    dot = cluster_sum(blocks.pairwise_sum(products), dot_arrived, size)
    for t in cutlass.range_constexpr(tiles):
        for j in cutlass.range_constexpr(values_per_tile):
            y_values[t][j] = y_values[t][j] * (dy_values[t][j] - dot)
    store_slice(dx_copies, dx_row, first_tile, n, tile_elems, y_values)


def launch_on_clusters(kernel, m, size, stream):
    """Blocks r*C .. r*C + C - 1 of the grid form row r's cluster: block_idx // C is the row.
    min_blocks_per_mp: .minnctapersm, the register budget; carveout -1, the driver's default
    (set, so that compiling does not ask a device for its shared memory)."""
    kernel.launch(
        grid=[m * size, 1, 1], block=[blocks.THREADS_PER_BLOCK, 1, 1],
        cluster=[size, 1, 1] if size > 1 else None, min_blocks_per_mp=BLOCKS_PER_SM,
        preferred_smem_carveout=-1, stream=stream,
    )  # fmt: skip


@cute.jit
def launch_forward_cluster(
    x: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream, vector_elems: cutlass.Constexpr[int],
    tiles: cutlass.Constexpr[int], size: cutlass.Constexpr[int],
):  # fmt: skip
    m, n = cutlass.Int32(cute.size(x, mode=[0])), cutlass.Int32(cute.size(x, mode=[1]))
    tile_elems, per_thread = blocks.tile_shape(x.element_type.width)
    copies = blocks.tiled_copies(x.element_type, vector_elems)
    kernel = softmax_forward_cluster_kernel(
        x, y, n, copies, copies, tile_elems, per_thread, tiles, size
    )
    launch_on_clusters(kernel, m, size, stream)


@cute.jit
def launch_backward_cluster(
    y: cute.Tensor, dy: cute.Tensor, dx: cute.Tensor, stream: cuda.CUstream,
    vector_elems: cutlass.Constexpr[int], tiles: cutlass.Constexpr[int],
    size: cutlass.Constexpr[int],
):  # fmt: skip
    m, n = cutlass.Int32(cute.size(y, mode=[0])), cutlass.Int32(cute.size(y, mode=[1]))
    tile_elems, per_thread = blocks.tile_shape(y.element_type.width)
    copies = blocks.tiled_copies(y.element_type, vector_elems)
    kernel = softmax_backward_cluster_kernel(
        y, dy, dx, n, copies, copies, copies, tile_elems, per_thread, tiles, size
    )
    launch_on_clusters(kernel, m, size, stream)
