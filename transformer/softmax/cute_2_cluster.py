"""CuTe step 2, softmax forward for long rows: one row over a thread-block cluster, read once.

Compared with step 1 (cute_1_two_pass.py) this adds: the row is split over the C blocks
(CTAs) of a cluster, each holding its slice in registers, and the blocks reduce through
distributed shared memory (README.md, "CuTe: long rows over a cluster", draws the map):

    block r of the cluster loads elements [r S, (r + 1) S) of the row, S = 256 * CLUSTER_VALUES,
          every load issued before the first is used (load_slice), BLOCKS_PER_SM blocks an SM
    max:  thread max -> block_max -> every block writes it into slot r of every block's
          `maxima` (mapa + st.shared::cluster), cluster barrier, each block takes the max of
          its C slots (max is exact: any order gives the same bits)
    sum:  exp of every value held, thread pairwise_sum -> block_sum -> the same exchange into
          `sums`, then each block adds its C slots in one fixed pairwise tree: the same bits in
          every block and on every run, whatever order the blocks ran in
    y = exp * (1 / sum), stored from the registers: x is read from HBM once (2MN traffic).

Each exchange waits on an mbarrier that counts the bytes the peers' st.async stores deliver, so
a block reads its slots only once all C values have landed; one cluster barrier at the start
makes sure every block's mbarriers are set before anyone sends. cute_impl.py dispatches
forward rows of CLUSTER_MIN_N <= N <= CLUSTER_MAX_N here.
"""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

import cute_1_two_pass as blocks  # the warp/block reductions, exp and tile copies

# Each thread holds 64 float32 values of its slice (8 16-byte vectors of bf16, 16 of float32):
# 64 registers for the row, 80 in all, so that BLOCKS_PER_SM blocks of 256 threads fit an SM.
CLUSTER_VALUES = 64
BLOCKS_PER_SM = 3  # 3 * 256 threads * 80 registers <= the SM's 65536: ptxas keeps to 80
SLICE_ELEMS = blocks.THREADS_PER_BLOCK * CLUSTER_VALUES
MAX_CLUSTER = 8  # the largest portable cluster
CLUSTER_MIN_N = 32768  # shorter rows: the two-pass kernel re-reads them from L2, nearly free
CLUSTER_MAX_N = MAX_CLUSTER * SLICE_ELEMS


def cluster_size(n):
    """The blocks per row: the power of two whose slices cover n (2, 4 or 8)."""
    return max(2, 1 << (-(-n // SLICE_ELEMS) - 1).bit_length())


def pairwise_max(values):
    """pairwise_sum's shape with max (plain Python, run while tracing; max is exact)."""
    while len(values) > 1:
        values = [cute.arch.fmax(values[i], values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


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


@cute.jit
def load_slice(x_copies, x_row, first_tile, n, tile_elems: cutlass.Constexpr[int], values):
    """values[t] = this thread's elements of the row's tile first_tile + t, in float32. A slice
    wholly inside the row moves as 128-bit vectors in one straight-line block, so every load is
    issued before the first one is used (README.md, "Why bf16 step 2 stopped at 68%"); the slice
    holding the row's end goes tile by tile (load_tile), elements past n read as -inf."""
    tiles = len(values)
    fill = -cutlass.Float32.inf  # exp(-inf) = 0: lanes past n add nothing
    if (first_tile + tiles) * tile_elems <= n:
        thread, _, _ = cute.arch.thread_idx()
        tile_copy = x_copies[0].get_slice(thread)
        for t in cutlass.range_constexpr(tiles):
            x_tile = cute.local_tile(x_row, (tile_elems,), (first_tile + t,))
            blocks.copy_in(tile_copy, x_tile, values[t], fill, None)
    else:
        for t in cutlass.range_constexpr(tiles):
            blocks.load_tile(x_copies, x_row, first_tile + t, n, tile_elems, fill, values[t])


@cute.kernel
def softmax_forward_cluster_kernel(
    x: cute.Tensor, y: cute.Tensor, n: cutlass.Int32, x_copies, y_copies,
    tile_elems: cutlass.Constexpr[int], values_per_tile: cutlass.Constexpr[int],
    tiles: cutlass.Constexpr[int], size: cutlass.Constexpr[int],
):  # fmt: skip
    block, _, _ = cute.arch.block_idx()
    row, rank = block // size, cute.arch.block_idx_in_cluster()
    x_row, y_row = x[row, None], y[row, None]
    # One slot per block of the cluster and one mbarrier for each of the two exchanges.
    maxima = cute.make_tensor(cute.arch.alloc_smem(cutlass.Float32, size), cute.make_layout(size))
    sums = cute.make_tensor(cute.arch.alloc_smem(cutlass.Float32, size), cute.make_layout(size))
    arrived = cute.arch.alloc_smem(cutlass.Int64, 2)
    thread, _, _ = cute.arch.thread_idx()
    if thread == 0:
        cute.arch.mbarrier_init(arrived, 1)
        cute.arch.mbarrier_init(arrived + 1, 1)
    cute.arch.mbarrier_init_fence()
    # "This block has started, its mbarriers set": no block sends to a peer before all have.
    cute.arch.cluster_arrive_relaxed()
    values = [cute.make_rmem_tensor(values_per_tile, cutlass.Float32) for _ in range(tiles)]
    load_slice(x_copies, x_row, rank * tiles, n, tile_elems, values)
    thread_max = pairwise_max([values[t][j] for t in range(tiles) for j in range(values_per_tile)])
    cute.arch.cluster_wait()
    share_with_cluster(blocks.block_max(thread_max), maxima, arrived, size)
    shift = blocks.finite_shift(pairwise_max([maxima[r] for r in range(size)]))
    for t in cutlass.range_constexpr(tiles):
        for j in cutlass.range_constexpr(values_per_tile):
            values[t][j] = blocks.exp_shifted(values[t][j], shift)
    thread_sum = blocks.pairwise_sum(
        [values[t][j] for t in range(tiles) for j in range(values_per_tile)]
    )
    share_with_cluster(blocks.block_sum(thread_sum), sums, arrived + 1, size)
    inverse = cutlass.Float32(1.0) / blocks.pairwise_sum([sums[r] for r in range(size)])
    for t in cutlass.range_constexpr(tiles):
        for j in cutlass.range_constexpr(values_per_tile):
            values[t][j] = values[t][j] * inverse
        blocks.store_tile(y_copies, y_row, rank * tiles + t, n, tile_elems, values[t])


@cute.jit
def launch_forward_cluster(
    x: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream, vector_elems: cutlass.Constexpr[int],
    size: cutlass.Constexpr[int],
):  # fmt: skip
    m, n = cutlass.Int32(cute.size(x, mode=[0])), cutlass.Int32(cute.size(x, mode=[1]))
    tile_elems, per_thread = blocks.tile_shape(x.element_type.width)
    copies = blocks.tiled_copies(x.element_type, vector_elems)
    kernel = softmax_forward_cluster_kernel(
        x, y, n, copies, copies, tile_elems, per_thread, CLUSTER_VALUES // per_thread, size
    )
    # Blocks r*C .. r*C + C - 1 of the grid form row r's cluster: block_idx // C is the row.
    # min_blocks_per_mp: .minnctapersm, the register budget; carveout -1, the driver's default
    # (set, so that compiling does not ask a device for its shared memory).
    kernel.launch(
        grid=[m * size, 1, 1], block=[blocks.THREADS_PER_BLOCK, 1, 1], cluster=[size, 1, 1],
        min_blocks_per_mp=BLOCKS_PER_SM, preferred_smem_carveout=-1, stream=stream,
    )  # fmt: skip


def forward_path(n, dtype):
    """(exp2 evaluations, float32 roundings after the exp) on a term's way into the row sum:
    one exp (the max is known first), the thread's pairwise tree over CLUSTER_VALUES, the 8
    levels of block_sum and log2(C) levels over the cluster's slots."""
    levels = int(math.log2(CLUSTER_VALUES)) + int(math.log2(blocks.THREADS_PER_BLOCK))
    return 1, levels + int(math.log2(cluster_size(n)))
