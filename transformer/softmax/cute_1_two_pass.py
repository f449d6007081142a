"""CuTe step 1, softmax forward and backward: one block per row, two passes over the row (any N).

    y_i = exp(x_i - m) / sum_j exp(x_j - m)          dx_i = y_i (dy_i - sum_j dy_j y_j)

The map (README.md, "CuTe", draws it): a block of 256 threads owns one row and walks it in tiles
of TILE = 256 * VECTORS_PER_THREAD 16-byte vectors; thread t holds the same V elements of every
tile (V = VECTORS_PER_THREAD * 16 bytes / element size), loaded with 128-bit copies.

forward  pass 1: each thread keeps the max of the elements it has seen and the sum of their
         exp(x - max); a tile that raises the max rescales the sum by exp(old - new) (an online
         softmax per thread, one rescale per tile). The threads' maxima meet in `block_max`,
         their rescaled sums in `block_sum`, the warp -> block reductions of dot/.
         pass 2, last tile first (the most recently read, likeliest still cached): y = exp(x -
         max) * (1 / sum).
backward pass 1: each thread sums dy*y over its elements; `block_sum` gives the row's dot.
         pass 2: dx = y * (dy - dot).

exp(v) is exp2(v * log2 e) (ex2.approx.ftz.f32; its error is in common/README.md). Every sum is
a fixed tree, so the same inputs give the same bits; cute_impl.py's `forward_path` and
`backward_path` export what README.md's bound counts. This file is also the reduction and copy
vocabulary step 2 (cute_2_cluster.py) builds on; cute_impl.py compiles, caches and dispatches.
"""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

THREADS_PER_BLOCK = 256
WARP_SIZE = 32
WARPS_PER_BLOCK = THREADS_PER_BLOCK // WARP_SIZE
VECTOR_BYTES = 16  # the widest load a thread can issue: 128 bits
# Two 16-byte vectors per thread and operand per tile: two loads in flight before the first
# use, in 16 (16-bit data) or 8 (float32) float32 registers per operand.
VECTORS_PER_THREAD = 2
LOG2E = 1.4426950408889634  # exp(v) = exp2(v * log2 e); rounded to float32 when traced


def pairwise_sum(values):
    """The sum of a power-of-two list of float32 registers, adding neighbours in pairs. Plain
    Python, run while the kernel is traced: it emits the log2(len) levels of additions."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


@cute.jit
def butterfly_sum(value, width: cutlass.Constexpr[int]):
    """Sum `value` over each aligned group of `width` lanes of a warp, log2(width) levels of
    shfl.sync.bfly; every lane of the group ends with the group's sum, built by one tree."""
    offset = width // 2
    for _ in cutlass.range_constexpr(int(math.log2(width))):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
        offset //= 2
    return value


@cute.jit
def butterfly_max(value, width: cutlass.Constexpr[int]):
    """butterfly_sum's shape with max: exact, so its order does not matter."""
    offset = width // 2
    for _ in cutlass.range_constexpr(int(math.log2(width))):
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
        offset //= 2
    return value


@cute.jit
def block_sum(value):
    """The sum of `value` over the 256 threads of the block, in every thread: 5 shuffle levels
    inside each warp, then the 8 warp sums through shared memory and 3 more levels."""
    warp_sums = cute.make_tensor(
        cute.arch.alloc_smem(cutlass.Float32, WARPS_PER_BLOCK), cute.make_layout(WARPS_PER_BLOCK)
    )
    value = butterfly_sum(value, WARP_SIZE)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        warp_sums[warp] = value
    cute.arch.sync_threads()  # every warp's sum is in shared memory before anyone reads
    return butterfly_sum(warp_sums[lane % WARPS_PER_BLOCK], WARPS_PER_BLOCK)


@cute.jit
def block_max(value):
    """block_sum's shape with max (its own shared memory, so the two never share a buffer)."""
    warp_maxima = cute.make_tensor(
        cute.arch.alloc_smem(cutlass.Float32, WARPS_PER_BLOCK), cute.make_layout(WARPS_PER_BLOCK)
    )
    value = butterfly_max(value, WARP_SIZE)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        warp_maxima[warp] = value
    cute.arch.sync_threads()
    return butterfly_max(warp_maxima[lane % WARPS_PER_BLOCK], WARPS_PER_BLOCK)


@cute.jit
def exp_shifted(v, shift):
    """exp(v - shift) as exp2((v - shift) * log2 e): subtract first, so the argument's error is
    relative to |v - shift| (with 1e4-sized logits, v*log2e - shift*log2e would not be)."""
    return cute.math.exp2((v - shift) * cutlass.Float32(LOG2E), fastmath=True)


@cute.jit
def finite_shift(row_max):
    """The row max, or 0 for a row of -inf: then every exp is 0, the sum 0, y = 0 * inf = NaN."""
    shift = row_max
    if row_max == -cutlass.Float32.inf:
        shift = cutlass.Float32(0.0)
    return shift


@cute.jit
def in_bounds_mask(thread_copy, row_tile_coords, n):
    """The predicate tensor: True where this thread's element has an index < n. One entry per
    copy atom, so it goes with the element copy, whose atoms move one element each."""
    coords = thread_copy.partition_S(row_tile_coords)
    mask = cute.make_rmem_tensor(coords.shape, cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(mask)):
        mask[i] = cute.elem_less(coords[i], n)
    return mask


@cute.jit
def copy_in(thread_copy, source, values, fill, in_bounds):
    """values[j] = this thread's j-th element of `source`, widened to float32 (in_bounds None:
    all of them; else the elements it skips hold `fill`)."""
    mine = thread_copy.partition_S(source)
    registers = cute.make_rmem_tensor_like(mine)
    if cutlass.const_expr(in_bounds is not None):
        registers.fill(fill)
    cute.copy(thread_copy, mine, registers, pred=in_bounds)
    for j in cutlass.range_constexpr(cute.size(values)):
        values[j] = registers[j].to(cutlass.Float32)


@cute.jit
def copy_out(thread_copy, values, target, in_bounds):
    """The reverse: values rounded to target's dtype (cvt.rn, to nearest even) and stored."""
    mine = thread_copy.partition_D(target)
    registers = cute.make_rmem_tensor_like(mine)
    for j in cutlass.range_constexpr(cute.size(values)):
        registers[j] = values[j].to(target.element_type)
    cute.copy(thread_copy, registers, mine, pred=in_bounds)


@cute.jit
def load_tile(tiled_copies, row, tile, n, tile_elems: cutlass.Constexpr[int], fill, values):
    """values = this thread's elements of the row's tile `tile`, in float32. A full tile moves
    in 128-bit vectors; the row's last, partial tile element by element, each under a
    predicate (index < n); what it skips holds `fill`."""
    tile_copy, element_copy = tiled_copies
    thread, _, _ = cute.arch.thread_idx()
    row_tile = cute.local_tile(row, (tile_elems,), (tile,))
    if (tile + 1) * tile_elems <= n:
        copy_in(tile_copy.get_slice(thread), row_tile, values, fill, None)
    else:
        thread_copy = element_copy.get_slice(thread)
        coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (tile,))
        copy_in(thread_copy, row_tile, values, fill, in_bounds_mask(thread_copy, coords, n))


@cute.jit
def store_tile(tiled_copies, row, tile, n, tile_elems: cutlass.Constexpr[int], values):
    """The reverse of load_tile: values rounded to the row's dtype and stored."""
    tile_copy, element_copy = tiled_copies
    thread, _, _ = cute.arch.thread_idx()
    row_tile = cute.local_tile(row, (tile_elems,), (tile,))
    if (tile + 1) * tile_elems <= n:
        copy_out(tile_copy.get_slice(thread), values, row_tile, None)
    else:
        thread_copy = element_copy.get_slice(thread)
        coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (tile,))
        copy_out(thread_copy, values, row_tile, in_bounds_mask(thread_copy, coords, n))


@cute.kernel
def softmax_forward_kernel(
    x: cute.Tensor, y: cute.Tensor, n: cutlass.Int32, x_copies, y_copies,
    tile_elems: cutlass.Constexpr[int], values_per_thread: cutlass.Constexpr[int],
):  # fmt: skip
    row, _, _ = cute.arch.block_idx()
    x_row, y_row = x[row, None], y[row, None]
    tiles = (n + tile_elems - 1) // tile_elems
    values = cute.make_rmem_tensor(values_per_thread, cutlass.Float32)
    thread_max, thread_sum = -cutlass.Float32.inf, cutlass.Float32(0.0)
    for tile in cutlass.range(tiles):
        load_tile(x_copies, x_row, tile, n, tile_elems, -cutlass.Float32.inf, values)
        tile_max = values[0]
        for j in cutlass.range_constexpr(1, values_per_thread):
            tile_max = cute.arch.fmax(tile_max, values[j])
        new_max = cute.arch.fmax(thread_max, tile_max)
        shift = finite_shift(new_max)
        exps = [exp_shifted(values[j], shift) for j in range(values_per_thread)]
        thread_sum = thread_sum * exp_shifted(thread_max, shift) + pairwise_sum(exps)
        thread_max = new_max
    shift = finite_shift(block_max(thread_max))
    inverse = cutlass.Float32(1.0) / block_sum(thread_sum * exp_shifted(thread_max, shift))
    for back in cutlass.range(tiles):
        tile = tiles - 1 - back
        load_tile(x_copies, x_row, tile, n, tile_elems, -cutlass.Float32.inf, values)
        for j in cutlass.range_constexpr(values_per_thread):
            values[j] = exp_shifted(values[j], shift) * inverse
        store_tile(y_copies, y_row, tile, n, tile_elems, values)


@cute.kernel
def softmax_backward_kernel(
    y: cute.Tensor, dy: cute.Tensor, dx: cute.Tensor, n: cutlass.Int32, y_copies, dy_copies,
    dx_copies, tile_elems: cutlass.Constexpr[int], values_per_thread: cutlass.Constexpr[int],
):  # fmt: skip
    row, _, _ = cute.arch.block_idx()
    y_row, dy_row, dx_row = y[row, None], dy[row, None], dx[row, None]
    tiles = (n + tile_elems - 1) // tile_elems
    y_values = cute.make_rmem_tensor(values_per_thread, cutlass.Float32)
    dy_values = cute.make_rmem_tensor(values_per_thread, cutlass.Float32)
    thread_dot = cutlass.Float32(0.0)
    for tile in cutlass.range(tiles):
        load_tile(y_copies, y_row, tile, n, tile_elems, 0.0, y_values)
        load_tile(dy_copies, dy_row, tile, n, tile_elems, 0.0, dy_values)
        products = [dy_values[j] * y_values[j] for j in range(values_per_thread)]
        thread_dot = thread_dot + pairwise_sum(products)
    dot = block_sum(thread_dot)
    for back in cutlass.range(tiles):
        tile = tiles - 1 - back
        load_tile(y_copies, y_row, tile, n, tile_elems, 0.0, y_values)
        load_tile(dy_copies, dy_row, tile, n, tile_elems, 0.0, dy_values)
        for j in cutlass.range_constexpr(values_per_thread):
            y_values[j] = y_values[j] * (dy_values[j] - dot)
        store_tile(dx_copies, dx_row, tile, n, tile_elems, y_values)


def tiled_copies(dtype, vector_elems):
    """(tile copy, element copy) of one operand: thread t owns vector-sized runs of adjacent
    elements, the 256 threads side by side, VECTORS_PER_THREAD runs each per tile. The tile copy
    moves a run per access (128 bits when vector_elems is 16 bytes' worth), the element copy
    one element, each under its own predicate; both give a thread the same elements."""
    run = VECTOR_BYTES * 8 // dtype.width
    thread_layout, value_layout = cute.make_layout(THREADS_PER_BLOCK), cute.make_layout(run)
    tile_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width * vector_elems
    )
    element_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width
    )
    return (
        cute.make_tiled_copy_tv(tile_atom, thread_layout, value_layout),
        cute.make_tiled_copy_tv(element_atom, thread_layout, value_layout),
    )


def tile_shape(dtype_width):
    """(elements per tile, elements per thread per tile)."""
    per_thread = VECTORS_PER_THREAD * VECTOR_BYTES * 8 // dtype_width
    return THREADS_PER_BLOCK * per_thread, per_thread


@cute.jit
def launch_forward(
    x: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream, vector_elems: cutlass.Constexpr[int]
):
    m, n = cutlass.Int32(cute.size(x, mode=[0])), cutlass.Int32(cute.size(x, mode=[1]))
    tile_elems, per_thread = tile_shape(x.element_type.width)
    copies = tiled_copies(x.element_type, vector_elems)
    softmax_forward_kernel(x, y, n, copies, copies, tile_elems, per_thread).launch(
        grid=[m, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream
    )


@cute.jit
def launch_backward(
    y: cute.Tensor, dy: cute.Tensor, dx: cute.Tensor, stream: cuda.CUstream,
    vector_elems: cutlass.Constexpr[int],
):  # fmt: skip
    m, n = cutlass.Int32(cute.size(y, mode=[0])), cutlass.Int32(cute.size(y, mode=[1]))
    tile_elems, per_thread = tile_shape(y.element_type.width)
    copies = tiled_copies(y.element_type, vector_elems)
    softmax_backward_kernel(y, dy, dx, n, copies, copies, copies, tile_elems, per_thread).launch(
        grid=[m, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream
    )
