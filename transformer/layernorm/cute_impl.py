"""layernorm forward and backward in the CuTe DSL: rows on a warp, several warps or a block.

    y = (x - mean) rstd w + b            dx = rstd (g - mean(g) - xhat mean(g xhat)),  g = w dy
    dw = sum over rows of dy xhat        db = sum over rows of dy

The map (README.md, "CuTe", draws it): P threads own a row and walk it in tiles of
P * VECTORS_PER_THREAD 16-byte vectors; thread t holds the same V elements of every tile
(V = VECTORS_PER_THREAD * 16 bytes / element size), loaded with 128-bit copies. The weight,
the bias and the float32 partial rows go through the same map in their own dtypes.

forward  `forward_map`: P the fewest threads (32 to 256) holding the row in registers; rows
         held (N <= 8192, `forward_row_in_registers`): x read once, K = the row's mean, the
         sums of x - K and (x - K)**2 reduced together (`row_sums`: one barrier for both),
         mean = K + m1, var = q - m1**2, rstd = rsqrt(var + eps) (rsqrt.approx.ftz.f32),
         y = xhat w + b (`normalise_tile`). Longer rows (`forward_row_streamed`, a block
         each): K = the mean of tile 0, pass 1 the shifted sums, pass 2 y, last tile first.
backward one block per row group (`row_groups`). Rows of at most ROW_REGISTERS_MAX values a
         thread (`layernorm_backward_rows_kernel`): the row's x and dy read once (whole-tile
         vector builds keep the next STAGES rows flying into shared memory by cp.async,
         `stage_row`, and read the row from there twice, for the sums and for dx, so none is
         held in registers across the barrier), g and g xhat summed (`row_sums`, one
         barrier for both), dx written, dy xhat and dy added into the group's sums in
         registers, written once as two float32 partial rows. Longer
         rows (`layernorm_backward_kernel`): per row, pass 1 sums g and g xhat, pass 2 writes
         dx and adds into the group's partial rows in memory. `sum_partials_kernel`: per
         column, eight slices of the groups in order, then the slices in order.

Every sum is a fixed tree, so the same inputs give the same bits; `statistics_path` and
`backward_path` export what README.md's bound counts. Rows of N >= 32768 spread over a
thread-block cluster are not done yet (README.md, open questions).
"""

import functools
import math
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import as_rows, as_vector, check_backward, check_forward, to_float32
from torch_impl import LayerNorm as TorchLayerNorm
from torch_impl import autograd_function, custom_ops

THREADS_PER_BLOCK = 256
WARP_SIZE = 32
WARPS_PER_BLOCK = THREADS_PER_BLOCK // WARP_SIZE
VECTOR_BYTES = 16  # the widest load a thread can issue: 128 bits
# Two 16-byte vectors per thread and operand per tile: two loads in flight before the first
# use, in 16 (16-bit data) or 8 (float32) float32 registers per operand.
VECTORS_PER_THREAD = 2
PARTIALS_MAX = 512  # the backward's row groups, as in triton_impl.py
# The rows kernel keeps x, dy, w and the group's dweight and dbias in float32 registers, this
# many values of each a thread (5 * 32 = 160 registers): rows of up to 256 * 32 = 8192 elements.
ROW_REGISTERS_MAX = 32
# Rows the backward's staged build keeps flying into shared memory ahead of the one it works on:
# 32 KB of shared memory a block at bf16 N = 4096 (README.md, tuning log).
STAGES = 2

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


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
def block_sum(value):
    """The sum of `value` over the 256 threads of the block, in every thread: 5 shuffle levels
    inside each warp, then the 8 warp sums through shared memory and 3 more levels."""
    return row_sums([value], THREADS_PER_BLOCK)[0]


@cute.jit
def row_sums(values, threads_per_row: cutlass.Constexpr[int]):
    """The sums of each of `values` over the row's `threads_per_row` threads (a warp, or the
    row's consecutive warps of the block), in all of them, each by block_sum's tree: 5 shuffle
    levels inside each warp; past a warp, the warps' sums of every value land in shared memory
    behind one barrier (the row's own, named, when the block holds several rows), then
    log2(warps a row) more levels. A pair of sums costs one barrier, not two."""
    values = [butterfly_sum(v, WARP_SIZE) for v in values]
    if cutlass.const_expr(threads_per_row > WARP_SIZE):
        warps_per_row = threads_per_row // WARP_SIZE
        warp_sums = cute.make_tensor(
            cute.arch.alloc_smem(cutlass.Float32, WARPS_PER_BLOCK * len(values)),
            cute.make_layout((WARPS_PER_BLOCK, len(values))),
        )
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        if lane == 0:
            for k in cutlass.range_constexpr(len(values)):
                warp_sums[warp, k] = values[k]
        # every warp's sums are in shared memory before anyone reads
        if cutlass.const_expr(threads_per_row == THREADS_PER_BLOCK):
            cute.arch.sync_threads()
        else:  # barrier 0 is the block's; a row past M never arrives, and no other row waits
            cute.arch.barrier(
                barrier_id=1 + warp // warps_per_row, number_of_threads=threads_per_row
            )
        first = warp - warp % warps_per_row  # the row's first warp
        values = [
            butterfly_sum(warp_sums[first + lane % warps_per_row, k], warps_per_row)
            for k in range(len(values))
        ]
    return values


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
def load_tile(tiled_copies, row, tile, n, tile_elems: cutlass.Constexpr[int], values):
    """values = this thread's elements of the row's tile `tile`, in float32. A full tile moves
    in 128-bit vectors; the row's last, partial tile element by element, each under a
    predicate (index < n); what it skips holds 0."""
    tile_copy, element_copy = tiled_copies
    thread = cute.arch.thread_idx()[0] % tile_copy.size  # its place among the row's threads
    row_tile = cute.local_tile(row, (tile_elems,), (tile,))
    if (tile + 1) * tile_elems <= n:
        copy_in(tile_copy.get_slice(thread), row_tile, values, None)
    else:
        thread_copy = element_copy.get_slice(thread)
        coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (tile,))
        copy_in(thread_copy, row_tile, values, in_bounds_mask(thread_copy, coords, n))


@cute.jit
def fill_past_end(tiled_copies, tile, n, tile_elems: cutlass.Constexpr[int], fill, values):
    """values of the tile's elements at index >= n (a partial tile's) = fill, a float32 value
    (the shift K: those elements then add exactly 0 to the shifted sums)."""
    element_copy = tiled_copies[1]
    if (tile + 1) * tile_elems > n:
        thread_copy = element_copy.get_slice(cute.arch.thread_idx()[0] % element_copy.size)
        coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (tile,))
        in_bounds = in_bounds_mask(thread_copy, coords, n)
        for j in cutlass.range_constexpr(cute.size(values)):
            values[j] = cutlass.Float32(cutlass.select_(in_bounds[j], values[j], fill))


@cute.jit
def copy_in(thread_copy, source, values, in_bounds):
    """values[j] = this thread's j-th element of `source`, widened to float32 (in_bounds None:
    all of them; else the elements it skips hold 0)."""
    mine = thread_copy.partition_S(source)
    registers = cute.make_rmem_tensor_like(mine)
    if cutlass.const_expr(in_bounds is not None):
        registers.fill(0.0)
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
def store_tile(tiled_copies, row, tile, n, tile_elems: cutlass.Constexpr[int], values):
    """The reverse of load_tile: values rounded to the row's dtype and stored."""
    tile_copy, element_copy = tiled_copies
    thread = cute.arch.thread_idx()[0] % tile_copy.size  # its place among the row's threads
    row_tile = cute.local_tile(row, (tile_elems,), (tile,))
    if (tile + 1) * tile_elems <= n:
        copy_out(tile_copy.get_slice(thread), values, row_tile, None)
    else:
        thread_copy = element_copy.get_slice(thread)
        coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (tile,))
        copy_out(thread_copy, values, row_tile, in_bounds_mask(thread_copy, coords, n))


@cute.jit
def thread_sums(values, shift, count: cutlass.Constexpr[int]):
    """(sum of v - K, sum of (v - K)**2) over this thread's `count` values: two pairwise trees."""
    shifted = [values[j] - shift for j in range(count)]
    return pairwise_sum(shifted), pairwise_sum([d * d for d in shifted])


def registers(count):
    return cute.make_rmem_tensor(count, cutlass.Float32)


@cute.jit
def row_statistics(shift, thread_s1, thread_s2, inv_n, eps, threads_per_row):
    """(mean, rstd) of a row from its threads' shifted sums, both reduced through one
    barrier: m1 = sum(x - K) / N, var = sum((x - K)**2) / N - m1**2, mean = K + m1."""
    s1, s2 = row_sums([thread_s1, thread_s2], threads_per_row)
    m1 = s1 * inv_n
    var = s2 * inv_n - m1 * m1
    if var < 0.0:  # rounding below zero (a NaN compares false and stays)
        var = cutlass.Float32(0.0)
    return shift + m1, cute.math.rsqrt(var + eps, fastmath=True)


@cute.jit
def normalise_tile(copies, w, b, y_row, tile, n, tile_elems: cutlass.Constexpr[int], row_mean,
                   row_rstd, values):  # fmt: skip
    """y = (x - mean) rstd w + b over one tile, x in `values`; the tile of y stored."""
    x_copies, w_copies = copies
    weights, biases = registers(cute.size(values)), registers(cute.size(values))
    load_tile(w_copies, w, tile, n, tile_elems, weights)
    load_tile(w_copies, b, tile, n, tile_elems, biases)
    for j in cutlass.range_constexpr(cute.size(values)):
        values[j] = (values[j] - row_mean) * row_rstd * weights[j] + biases[j]
    store_tile(x_copies, y_row, tile, n, tile_elems, values)


@cute.jit
def forward_row_in_registers(
    x_row, w, b, y_row, n, inv_n, eps, copies, tile_elems: cutlass.Constexpr[int],
    per_thread: cutlass.Constexpr[int], threads_per_row: cutlass.Constexpr[int],
    row_tiles: cutlass.Constexpr[int],
):  # fmt: skip
    """A row of row_tiles tiles read once into registers: K = its mean, then the shifted sums
    of the same registers (C = N in README.md's bound), y written. Returns (mean, rstd)."""
    xs = [registers(per_thread) for _ in range(row_tiles)]
    for tile in cutlass.range_constexpr(row_tiles):  # every load in flight before a use
        load_tile(copies[0], x_row, tile, n, tile_elems, xs[tile])
    thread_x = cutlass.Float32(0.0)
    for tile in cutlass.range_constexpr(row_tiles):
        thread_x = thread_x + pairwise_sum([xs[tile][j] for j in range(per_thread)])
    shift = row_sums([thread_x], threads_per_row)[0] * inv_n
    thread_s1, thread_s2 = cutlass.Float32(0.0), cutlass.Float32(0.0)
    for tile in cutlass.range_constexpr(row_tiles):
        fill_past_end(copies[0], tile, n, tile_elems, shift, xs[tile])
        s1, s2 = thread_sums(xs[tile], shift, per_thread)
        thread_s1, thread_s2 = thread_s1 + s1, thread_s2 + s2
    row_mean, row_rstd = row_statistics(shift, thread_s1, thread_s2, inv_n, eps, threads_per_row)
    for tile in cutlass.range_constexpr(row_tiles):
        normalise_tile(copies, w, b, y_row, tile, n, tile_elems, row_mean, row_rstd, xs[tile])
    return row_mean, row_rstd


@cute.jit
def forward_row_streamed(
    x_row, w, b, y_row, n, inv_n, eps, copies, tile_elems: cutlass.Constexpr[int],
    per_thread: cutlass.Constexpr[int],
):  # fmt: skip
    """A row longer than the registers, a block's: K = the mean of tile 0 (a full tile: such
    rows are longer than one), pass 1 the shifted sums, pass 2 y, last tile first (the last
    tile is still in registers, the others likely in L2). Returns (mean, rstd)."""
    tiles = (n + tile_elems - 1) // tile_elems
    values = registers(per_thread)
    load_tile(copies[0], x_row, 0, n, tile_elems, values)
    inv_tile = cutlass.Float32(1.0 / tile_elems)  # a power of two: exact
    shift = block_sum(pairwise_sum([values[j] for j in range(per_thread)])) * inv_tile
    thread_s1, thread_s2 = cutlass.Float32(0.0), cutlass.Float32(0.0)
    for tile in cutlass.range(tiles):
        if tile > 0:  # tile 0 is in registers
            load_tile(copies[0], x_row, tile, n, tile_elems, values)
        fill_past_end(copies[0], tile, n, tile_elems, shift, values)
        s1, s2 = thread_sums(values, shift, per_thread)
        thread_s1, thread_s2 = thread_s1 + s1, thread_s2 + s2
    row_mean, row_rstd = row_statistics(shift, thread_s1, thread_s2, inv_n, eps, THREADS_PER_BLOCK)
    for back in cutlass.range(tiles):
        tile = tiles - 1 - back
        if back > 0:
            load_tile(copies[0], x_row, tile, n, tile_elems, values)
        normalise_tile(copies, w, b, y_row, tile, n, tile_elems, row_mean, row_rstd, values)
    return row_mean, row_rstd


@cute.kernel
def layernorm_forward_kernel(
    x: cute.Tensor, w: cute.Tensor, b: cute.Tensor, y: cute.Tensor, mean: cute.Tensor,
    rstd: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, inv_n: cutlass.Float32,
    eps: cutlass.Float32, copies, tile_elems: cutlass.Constexpr[int],
    per_thread: cutlass.Constexpr[int], threads_per_row: cutlass.Constexpr[int],
    row_tiles: cutlass.Constexpr[int], whole_tiles: cutlass.Constexpr[bool],
):  # fmt: skip
    """A row per `threads_per_row` threads (one to eight warps); row_tiles > 0: the row held in
    registers, 0: streamed. whole_tiles: N is row_tiles whole tiles, a constant here, so the
    predicated path of a partial tile is not compiled (its registers would set the kernel's)."""
    block, _, _ = cute.arch.block_idx()
    thread, _, _ = cute.arch.thread_idx()
    row = block * (THREADS_PER_BLOCK // threads_per_row) + thread // threads_per_row
    # Rows of fewer than 256 threads: the last block's rows past M have none (their warps skip
    # row_sums' barrier, named per row: only the row's own warps wait there). A block's: all.
    if row < m:
        if cutlass.const_expr(row_tiles > 0):
            row_n = row_tiles * tile_elems if cutlass.const_expr(whole_tiles) else n
            row_mean, row_rstd = forward_row_in_registers(
                x[row, None], w, b, y[row, None], row_n, inv_n, eps, copies, tile_elems,
                per_thread, threads_per_row, row_tiles,
            )  # fmt: skip
        else:
            row_mean, row_rstd = forward_row_streamed(
                x[row, None], w, b, y[row, None], n, inv_n, eps, copies, tile_elems, per_thread
            )
        if thread % threads_per_row == 0:
            mean[row] = row_mean
            rstd[row] = row_rstd


@cute.jit
def load_row_tile(copies, x_row, dy_row, w, tile, n, tile_elems: cutlass.Constexpr[int], regs):
    """x, dy and w of a tile into the registers regs = (x, dy, w), zero past n."""
    x_copies, w_copies = copies
    load_tile(x_copies, x_row, tile, n, tile_elems, regs[0])
    load_tile(x_copies, dy_row, tile, n, tile_elems, regs[1])
    load_tile(w_copies, w, tile, n, tile_elems, regs[2])


@cute.jit
def backward_row(
    x_row, dy_row, dx_row, w, dw_partial, db_partial, row_mean, row_rstd, n, inv_n, copies,
    tile_elems: cutlass.Constexpr[int], per_thread: cutlass.Constexpr[int],
):  # fmt: skip
    """One row of the backward: dx, and dy xhat, dy added into the group's partial rows."""
    x_copies, w_copies, partial_copies = copies
    tiles = (n + tile_elems - 1) // tile_elems
    regs = [cute.make_rmem_tensor(per_thread, cutlass.Float32) for _ in range(5)]
    thread_a, thread_b = cutlass.Float32(0.0), cutlass.Float32(0.0)
    for tile in cutlass.range(tiles):
        load_row_tile((x_copies, w_copies), x_row, dy_row, w, tile, n, tile_elems, regs)
        g = [regs[1][j] * regs[2][j] for j in range(per_thread)]
        xhat = [(regs[0][j] - row_mean) * row_rstd for j in range(per_thread)]
        thread_a = thread_a + pairwise_sum(g)
        thread_b = thread_b + pairwise_sum([g[j] * xhat[j] for j in range(per_thread)])
    a, b = block_sum(thread_a) * inv_n, block_sum(thread_b) * inv_n
    for back in cutlass.range(tiles):
        tile = tiles - 1 - back
        if back > 0:  # the last tile is still in registers
            load_row_tile((x_copies, w_copies), x_row, dy_row, w, tile, n, tile_elems, regs)
        load_tile(partial_copies, dw_partial, tile, n, tile_elems, regs[3])
        load_tile(partial_copies, db_partial, tile, n, tile_elems, regs[4])
        for j in cutlass.range_constexpr(per_thread):
            xhat = (regs[0][j] - row_mean) * row_rstd
            regs[3][j] = regs[3][j] + regs[1][j] * xhat
            regs[4][j] = regs[4][j] + regs[1][j]
            regs[0][j] = (regs[1][j] * regs[2][j] - a - xhat * b) * row_rstd
        store_tile(x_copies, dx_row, tile, n, tile_elems, regs[0])
        store_tile(partial_copies, dw_partial, tile, n, tile_elems, regs[3])
        store_tile(partial_copies, db_partial, tile, n, tile_elems, regs[4])


@cute.kernel
def layernorm_backward_kernel(
    x: cute.Tensor, w: cute.Tensor, mean: cute.Tensor, rstd: cute.Tensor, dy: cute.Tensor,
    dx: cute.Tensor, dw_partial: cute.Tensor, db_partial: cute.Tensor, m: cutlass.Int32,
    n: cutlass.Int32, rows_per_group: cutlass.Int32, inv_n: cutlass.Float32, copies,
    tile_elems: cutlass.Constexpr[int], per_thread: cutlass.Constexpr[int],
):  # fmt: skip
    group, _, _ = cute.arch.block_idx()
    for i in cutlass.range(rows_per_group):
        row = group * rows_per_group + i
        if row < m:  # the whole block takes the same branch: block_sum's barriers are safe
            backward_row(
                x[row, None], dy[row, None], dx[row, None], w, dw_partial[group, None],
                db_partial[group, None], mean[row], rstd[row], n, inv_n, copies, tile_elems,
                per_thread,
            )  # fmt: skip


@cute.jit
def stage_row(stage_copy, sources, staged, row, tile_elems: cutlass.Constexpr[int],
              row_tiles: cutlass.Constexpr[int]):  # fmt: skip
    """cp.async this thread's elements of `row` of each source (x, dy) into the same slots of
    staged[k, None] (the caller commits the group): the loads fly while the block works on
    earlier rows. Each thread reads back only what it staged, so its own cp.async.wait_group
    orders it: no barrier."""
    thread_copy = stage_copy.get_slice(cute.arch.thread_idx()[0])
    for k in cutlass.range_constexpr(len(sources)):
        for tile in cutlass.range_constexpr(row_tiles):
            source = cute.local_tile(sources[k][row, None], (tile_elems,), (tile,))
            target = cute.local_tile(staged[k, None], (tile_elems,), (tile,))
            cute.copy(stage_copy, thread_copy.partition_S(source), thread_copy.partition_D(target))


@cute.kernel
def layernorm_backward_rows_kernel(
    x: cute.Tensor, w: cute.Tensor, mean: cute.Tensor, rstd: cute.Tensor, dy: cute.Tensor,
    dx: cute.Tensor, dw_partial: cute.Tensor, db_partial: cute.Tensor, m: cutlass.Int32,
    n: cutlass.Int32, rows_per_group: cutlass.Int32, inv_n: cutlass.Float32, copies,
    tile_elems: cutlass.Constexpr[int], per_thread: cutlass.Constexpr[int],
    row_tiles: cutlass.Constexpr[int], whole_tiles: cutlass.Constexpr[bool], stage_copy,
):  # fmt: skip
    """The backward of a group of rows that fit the block's registers (row_tiles tiles): x and
    dy read once, dx written once; dy xhat and dy summed over the group's rows in registers
    and written once as the group's two partial rows. backward_row's trees: the same bits.
    A whole-tile vector build (stage_copy not None) keeps rows i + 1 .. i + STAGES of x and dy
    flying into shared memory and reads row i from there twice, for the sums and for dx, so
    no row is held in registers across the barrier (with w and both sums held, x and dy in
    registers too gave 128 registers a thread: two blocks an SM, each with one row in
    flight); whole_tiles also drops the partial tile's predicated path."""
    x_copies, w_copies, partial_copies = copies
    group, _, _ = cute.arch.block_idx()
    row_n = row_tiles * tile_elems if cutlass.const_expr(whole_tiles) else n
    xs, dys, ws, dws, dbs = ([registers(per_thread) for _ in range(row_tiles)] for _ in range(5))
    for tile in cutlass.range_constexpr(row_tiles):
        dws[tile].fill(0.0)
        dbs[tile].fill(0.0)
        load_tile(w_copies, w, tile, row_n, tile_elems, ws[tile])
    first = group * rows_per_group
    last = cutlass.min(first + rows_per_group, m)
    staged = None
    if cutlass.const_expr(stage_copy is not None):  # (STAGES, x and dy, the row's elements)
        row_elems = row_tiles * tile_elems
        staged = cute.make_tensor(
            cute.arch.get_dyn_smem(x.element_type, alignment=VECTOR_BYTES),
            cute.make_layout((STAGES, 2, row_elems), stride=(2 * row_elems, row_elems, 1)),
        )
        for ahead in cutlass.range_constexpr(STAGES):
            if first + ahead < last:
                stage_row(stage_copy, (x, dy), staged[ahead, None, None], first + ahead,
                          tile_elems, row_tiles)  # fmt: skip
            cute.arch.cp_async_commit_group()  # empty past the group: the count stays even
    for row in cutlass.range(first, last):
        row_mean, row_rstd = mean[row], rstd[row]
        if cutlass.const_expr(staged is not None):
            stage = (row - first) % STAGES
            cute.arch.cp_async_wait_group(STAGES - 1)  # this thread's copies of row landed
            x_row, dy_row = staged[stage, 0, None], staged[stage, 1, None]
        else:
            x_row, dy_row = x[row, None], dy[row, None]
        for tile in cutlass.range_constexpr(row_tiles):  # every load in flight before a use
            load_tile(x_copies, x_row, tile, row_n, tile_elems, xs[tile])
            load_tile(x_copies, dy_row, tile, row_n, tile_elems, dys[tile])
        thread_a, thread_b = cutlass.Float32(0.0), cutlass.Float32(0.0)
        for tile in cutlass.range_constexpr(row_tiles):
            g = [dys[tile][j] * ws[tile][j] for j in range(per_thread)]
            xhat = [(xs[tile][j] - row_mean) * row_rstd for j in range(per_thread)]
            thread_a = thread_a + pairwise_sum(g)
            thread_b = thread_b + pairwise_sum([g[j] * xhat[j] for j in range(per_thread)])
        a, b = row_sums([thread_a, thread_b], THREADS_PER_BLOCK)  # block_sum's tree for each
        a, b = a * inv_n, b * inv_n
        for tile in cutlass.range_constexpr(row_tiles):
            if cutlass.const_expr(staged is not None):  # read again: no row held across the sums
                load_tile(x_copies, x_row, tile, row_n, tile_elems, xs[tile])
                load_tile(x_copies, dy_row, tile, row_n, tile_elems, dys[tile])
            for j in cutlass.range_constexpr(per_thread):
                xhat = (xs[tile][j] - row_mean) * row_rstd
                dws[tile][j] = dws[tile][j] + dys[tile][j] * xhat
                dbs[tile][j] = dbs[tile][j] + dys[tile][j]
                xs[tile][j] = (dys[tile][j] * ws[tile][j] - a - xhat * b) * row_rstd
            store_tile(x_copies, dx[row, None], tile, row_n, tile_elems, xs[tile])
        if cutlass.const_expr(staged is not None):  # the slots just read take row + STAGES
            if row + STAGES < last:
                stage_row(stage_copy, (x, dy), staged[stage, None, None], row + STAGES,
                          tile_elems, row_tiles)  # fmt: skip
            cute.arch.cp_async_commit_group()
        cute.arch.sync_threads()  # row_sums' warp sums all read before the next row's land
    for tile in cutlass.range_constexpr(row_tiles):
        store_tile(partial_copies, dw_partial[group, None], tile, row_n, tile_elems, dws[tile])
        store_tile(partial_copies, db_partial[group, None], tile, row_n, tile_elems, dbs[tile])


@cute.kernel
def sum_partials_kernel(partials: cute.Tensor, out: cute.Tensor, groups: cutlass.Int32,
                        n: cutlass.Int32):  # fmt: skip
    """out[j] = column j of the partials added in a fixed order, rounded once: a block owns
    WARP_SIZE columns (a lane each: 128-byte rows of float32), warp k adds the k-th of
    WARPS_PER_BLOCK contiguous slices of the groups in group order, then the slices' sums are
    added in warp order. The slices keep WARPS_PER_BLOCK loads per column in flight."""
    block, _, _ = cute.arch.block_idx()
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    slice_sums = cute.make_tensor(
        cute.arch.alloc_smem(cutlass.Float32, THREADS_PER_BLOCK),
        cute.make_layout((WARPS_PER_BLOCK, WARP_SIZE), stride=(WARP_SIZE, 1)),
    )
    col = block * WARP_SIZE + lane
    per_slice = (groups + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK
    total = cutlass.Float32(0.0)
    if col < n:
        first = warp * per_slice
        for group in cutlass.range(first, cutlass.min(first + per_slice, groups), unroll=8):
            total = total + partials[group, col]
    slice_sums[warp, lane] = total
    cute.arch.sync_threads()  # every slice's sum is in shared memory before warp 0 reads
    if warp == 0 and col < n:  # (the DSL lowers `and` to a predicate: PTX or.pred)
        total = cutlass.Float32(0.0)
        for k in cutlass.range_constexpr(WARPS_PER_BLOCK):
            total = total + slice_sums[k, lane]
        out[col] = total.to(out.element_type)


def tiled_copies(dtype, run, vector, threads=THREADS_PER_BLOCK):
    """(tile copy, element copy) of one operand: thread t owns runs of `run` adjacent elements
    (16 bytes of x), the row's `threads` side by side, VECTORS_PER_THREAD runs each per tile. The
    tile copy moves up to 128 bits per access when `vector`, one element otherwise; the
    element copy one element under its own predicate; both give a thread the same elements."""
    thread_layout, value_layout = cute.make_layout(threads), cute.make_layout(run)
    access = min(run, VECTOR_BYTES * 8 // dtype.width) if vector else 1
    tile_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width * access
    )
    element_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width
    )
    return (
        cute.make_tiled_copy_tv(tile_atom, thread_layout, value_layout),
        cute.make_tiled_copy_tv(element_atom, thread_layout, value_layout),
    )


def tile_shape(dtype_width, threads=THREADS_PER_BLOCK):
    """(elements per tile, elements per thread per tile, elements per run) for x's dtype and
    `threads` per row."""
    run = VECTOR_BYTES * 8 // dtype_width
    return threads * VECTORS_PER_THREAD * run, VECTORS_PER_THREAD * run, run


@cute.jit
def launch_forward(
    x: cute.Tensor, w: cute.Tensor, b: cute.Tensor, y: cute.Tensor, mean: cute.Tensor,
    rstd: cute.Tensor, inv_n: cutlass.Float32, eps: cutlass.Float32, stream: cuda.CUstream,
    vector: cutlass.Constexpr[bool], threads_per_row: cutlass.Constexpr[int],
    row_tiles: cutlass.Constexpr[int], whole_tiles: cutlass.Constexpr[bool],
):  # fmt: skip
    """The forward on forward_map's (threads_per_row, row_tiles, whole_tiles)."""
    m, n = cutlass.Int32(cute.size(x, mode=[0])), cutlass.Int32(cute.size(x, mode=[1]))
    tile_elems, per_thread, run = tile_shape(x.element_type.width, threads_per_row)
    copies = (
        tiled_copies(x.element_type, run, vector, threads_per_row),
        tiled_copies(w.element_type, run, vector, threads_per_row),
    )
    rows_per_block = THREADS_PER_BLOCK // threads_per_row
    layernorm_forward_kernel(
        x, w, b, y, mean, rstd, m, n, inv_n, eps, copies, tile_elems, per_thread,
        threads_per_row, row_tiles, whole_tiles,
    ).launch(grid=[(m + rows_per_block - 1) // rows_per_block, 1, 1],
             block=[THREADS_PER_BLOCK, 1, 1], stream=stream)  # fmt: skip


def stage_copy_of(dtype, run):
    """The rows kernel's cp.async (16 bytes a copy, bypassing L1: x and dy are read once) on
    the tile copy's map, so each thread stages exactly the elements it reads back."""
    atom = cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.cpasync.LoadCacheMode.GLOBAL), dtype,
        num_bits_per_copy=VECTOR_BYTES * 8,
    )  # fmt: skip
    return cute.make_tiled_copy_tv(atom, cute.make_layout(THREADS_PER_BLOCK), cute.make_layout(run))


@cute.jit
def launch_backward(
    x: cute.Tensor, w: cute.Tensor, mean: cute.Tensor, rstd: cute.Tensor, dy: cute.Tensor,
    dx: cute.Tensor, dw_partial: cute.Tensor, db_partial: cute.Tensor,
    rows_per_group: cutlass.Int32, inv_n: cutlass.Float32, stream: cuda.CUstream,
    vector: cutlass.Constexpr[bool], row_tiles: cutlass.Constexpr[int],
    whole_tiles: cutlass.Constexpr[bool],
):  # fmt: skip
    """row_tiles > 0: the rows kernel, staging rows in shared memory in a whole-tile vector
    build; 0: a row at a time through zeroed partial rows."""
    m, n = cutlass.Int32(cute.size(x, mode=[0])), cutlass.Int32(cute.size(x, mode=[1]))
    groups = cutlass.Int32(cute.size(dw_partial, mode=[0]))
    tile_elems, per_thread, run = tile_shape(x.element_type.width)
    copies = (
        tiled_copies(x.element_type, run, vector),
        tiled_copies(w.element_type, run, vector),
        tiled_copies(cutlass.Float32, run, vector),
    )
    operands = (x, w, mean, rstd, dy, dx, dw_partial, db_partial, m, n, rows_per_group, inv_n,
                copies, tile_elems, per_thread)  # fmt: skip
    staged_bytes = 0
    if cutlass.const_expr(row_tiles > 0):
        staging = whole_tiles and vector  # cp.async moves 16-byte runs of whole tiles
        stage_copy = stage_copy_of(x.element_type, run) if cutlass.const_expr(staging) else None
        if cutlass.const_expr(staging):  # x and dy, STAGES rows each
            staged_bytes = STAGES * 2 * row_tiles * tile_elems * x.element_type.width // 8
        kernel = layernorm_backward_rows_kernel(*operands, row_tiles, whole_tiles, stage_copy)
    else:
        kernel = layernorm_backward_kernel(*operands)
    kernel.launch(grid=[groups, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], smem=staged_bytes,
                  stream=stream)  # fmt: skip


@cute.jit
def launch_sum(partials: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
    groups = cutlass.Int32(cute.size(partials, mode=[0]))
    n = cutlass.Int32(cute.size(partials, mode=[1]))
    blocks = (n + WARP_SIZE - 1) // WARP_SIZE
    sum_partials_kernel(partials, out, groups, n).launch(
        grid=[blocks, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream
    )


def fake_rows(dtype, m, n, vector, run):
    """What cute.compile sees of an (M, N) operand: symbolic sizes, and either unit column
    stride with a row stride divisible by the run on a 16-byte boundary (the vector build) or
    two symbolic strides on an element boundary."""
    if vector:
        stride = (cute.sym_int64(divisibility=run), 1)
    else:
        stride = (cute.sym_int64(), cute.sym_int64())
    align = min(16, dtype.width // 8 * run) if vector else dtype.width // 8
    return cute.runtime.make_fake_tensor(dtype, (m, n), stride=stride, assumed_align=align)


def fake_vector(dtype, n, vector):
    """A weight, bias or gradient (N,), unit stride; 16-byte aligned in the vector build."""
    stride = (1,) if vector else (cute.sym_int64(),)
    align = 16 if vector else dtype.width // 8
    return cute.runtime.make_fake_tensor(dtype, (n,), stride=stride, assumed_align=align)


def fake_stats(m):
    return cute.runtime.make_fake_tensor(cutlass.Float32, (m,), stride=(cute.sym_int64(),))


def build(direction, dtype, parameter_dtype, vector, shape, options=""):
    """cute.compile the forward (on `shape` = forward_map's triple) or backward (on `shape` =
    backward_map's pair) launcher for TVM-FFI calls on torch tensors, on torch's current
    stream; the operands share symbolic M and N."""
    m, n, groups = cute.sym_int64(), cute.sym_int64(), cute.sym_int64()
    x_type, p_type = TORCH_TO_CUTLASS[dtype], TORCH_TO_CUTLASS[parameter_dtype]
    run = tile_shape(x_type.width)[2]
    rows = lambda t: fake_rows(t, m, n, vector, run)  # noqa: E731
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if direction == "forward":
        operands = (rows(x_type), fake_vector(p_type, n, vector), fake_vector(p_type, n, vector),
                    rows(x_type), fake_stats(m), fake_stats(m), cutlass.Float32(1.0),
                    cutlass.Float32(0.0))  # fmt: skip
        launcher = launch_forward
    else:
        partial = fake_rows(cutlass.Float32, groups, n, vector, run)
        operands = (rows(x_type), fake_vector(p_type, n, vector), fake_stats(m), fake_stats(m),
                    rows(x_type), rows(x_type), partial, partial, cutlass.Int32(1),
                    cutlass.Float32(1.0))  # fmt: skip
        launcher = launch_backward
    operands = (*operands, stream, vector, *shape)
    return cute.compile(launcher, *operands, options=f"--enable-tvm-ffi {options}")


@functools.cache
def compile_kernel(direction, dtype, parameter_dtype, vector, shape):
    """The compiled launcher, built once per (direction, dtypes, access width, the forward's
    or the backward's map) and cached."""
    built = build(direction, dtype, parameter_dtype, vector, shape)
    return built.__tvm_ffi_object__()


@functools.cache
def compile_sum(dtype):
    groups, n = cute.sym_int64(), cute.sym_int64()
    partials = cute.runtime.make_fake_tensor(
        cutlass.Float32, (groups, n), stride=(cute.sym_int64(), 1)
    )  # rows padded (partial_rows)
    out = cute.runtime.make_fake_tensor(TORCH_TO_CUTLASS[dtype], (n,), stride=(cute.sym_int64(),))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch_sum, partials, out, stream, options="--enable-tvm-ffi")


def ptx_of(direction, dtype, contiguous, shape):
    """The sm_90a PTX of a build: what the tests read for 128-bit loads, rsqrt and shuffles."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        built = build(direction, dtype, dtype, contiguous, shape, options)
        return built.__ptx__


def is_vector_friendly(t):
    """Unit stride along N, 16-byte aligned start, and (for rows) a row stride that keeps every
    row on a 16-byte boundary."""
    run = VECTOR_BYTES // t.element_size()
    if t.data_ptr() % VECTOR_BYTES or (t.stride(-1) != 1 and t.shape[-1] > 1):
        return False
    return t.dim() == 1 or t.stride(0) % run == 0 or t.shape[0] == 1


def row_groups(m):
    """(groups, rows per group): m rows cut into at most PARTIALS_MAX runs of equal length (the
    last may be shorter), one block and one partial row each (triton_impl.row_groups's cut for
    rows of one row a step)."""
    rows_per_group = max(-(-m // PARTIALS_MAX), 1)
    return -(-m // rows_per_group), rows_per_group


@functools.cache
def row_tiles_of(n, dtype, threads=THREADS_PER_BLOCK):
    """The tiles of a row of `threads` threads held in registers (the forward's rows and the
    backward's rows kernel), or 0: streamed, a row at a time."""
    tile_elems, per_thread, _ = tile_shape(dtype.itemsize * 8, threads)
    tiles = -(-n // tile_elems)
    return tiles if tiles * per_thread <= ROW_REGISTERS_MAX else 0


@functools.cache
def forward_map(n, dtype):
    """(threads a row, tiles held, whole tiles): the fewest threads (a warp, 2, 4 or 8 warps) whose
    registers hold the row, ROW_REGISTERS_MAX values a thread (N <= 8192): each thread then
    keeps up to 64 bytes of bf16 x in flight, where a block per row leaves 32 or fewer and
    most of the block's registers idle (README.md, tuning log). Longer rows: a block each,
    streamed. Whole tiles (N a multiple of the tile, as 1024, 4096, 8192 are): a build with
    no partial tile, 64 registers a thread where the predicated path takes 78 (ptxas, bf16
    at 4096), so four blocks fit an SM, not three."""
    threads = WARP_SIZE
    while threads < THREADS_PER_BLOCK and not row_tiles_of(n, dtype, threads):
        threads *= 2
    row_tiles = row_tiles_of(n, dtype, threads)
    tile_elems = tile_shape(dtype.itemsize * 8, threads)[0]
    return threads, row_tiles, row_tiles > 0 and n == row_tiles * tile_elems


@functools.cache
def backward_map(n, dtype):
    """(tiles held, whole tiles) of the backward's block of 256 threads (0 tiles: a row at a
    time, streamed); a whole-tile vector build stages the next rows in shared memory."""
    row_tiles = row_tiles_of(n, dtype)
    return row_tiles, row_tiles > 0 and n == row_tiles * tile_shape(dtype.itemsize * 8)[0]


def row_sum_path(n, dtype, threads):
    """Additions on a term's way into a row sum: a tile's pairwise tree (log2 V), an add per
    tile into the thread's sum, log2(threads) levels across the row's threads (a warp's 5,
    block_sum's 8)."""
    tile_elems, per_thread, _ = tile_shape(dtype.itemsize * 8, threads)
    return int(math.log2(per_thread)) + -(-n // tile_elems) + int(math.log2(threads))


def statistics_path(n, dtype):
    """(k, C) of README.md's bound on forward_map's map; the shift is the row's mean when the
    row is held (C = N), else tile 0's."""
    threads, row_tiles, _ = forward_map(n, dtype)
    tile_elems = tile_shape(dtype.itemsize * 8, threads)[0]
    return row_sum_path(n, dtype, threads), (n if row_tiles else tile_elems)


def backward_path(m, n, dtype):
    """(row additions, column additions): a block's row sums (row_sum_path); a group's rows one
    after another into its partial row (which starts at 0), then sum_partials_kernel: the
    groups of a slice in order, then the WARPS_PER_BLOCK slices."""
    groups, rows_per_group = row_groups(m)
    slices = -(-groups // WARPS_PER_BLOCK) + WARPS_PER_BLOCK
    return row_sum_path(n, dtype, THREADS_PER_BLOCK), rows_per_group + slices


@functools.lru_cache(maxsize=16)
def identity_parameters(n, dtype, device):
    """(ones, zeros) of length n: an absent weight or bias (x * 1 and x + 0 are exact)."""
    return torch.ones(n, dtype=dtype, device=device), torch.zeros(n, dtype=dtype, device=device)


def parameters_or_identity(x, weight, bias):
    dtype = (weight if weight is not None else bias if bias is not None else x).dtype
    ones, zeros = identity_parameters(x.shape[-1], dtype, x.device)
    return (ones if weight is None else weight), (zeros if bias is None else bias)


def require_cuda(x):
    if not x.is_cuda:
        raise ValueError(f"the operands are on {x.device}; the CuTe kernel needs CUDA tensors")


def layernorm_forward(x, weight, bias, eps, y, mean, rstd):
    check_forward(x, weight, bias, eps, y, mean, rstd)
    require_cuda(x)
    if x.numel() == 0:
        return y, mean, rstd
    w, b = parameters_or_identity(x, weight, bias)
    (x_rows, _), (y_rows, y_copied) = as_rows(x), as_rows(y, for_output=True)
    (mean_v, mean_copied), (rstd_v, rstd_copied) = as_vector(mean, True), as_vector(rstd, True)
    vector = all(is_vector_friendly(t) for t in (x_rows, y_rows, w, b))
    kernel = compile_kernel("forward", x.dtype, w.dtype, vector, forward_map(x.shape[-1], x.dtype))
    # TVM-FFI launches on torch's current stream (capturable by a CUDA graph after a first call).
    kernel(x_rows, w, b, y_rows, mean_v, rstd_v, 1.0 / x.shape[-1], to_float32(eps))
    for copied, result, target in ((y_copied, y_rows, y), (mean_copied, mean_v, mean),
                                   (rstd_copied, rstd_v, rstd)):  # fmt: skip
        if copied:
            target.copy_(result.view(target.shape))
    return y, mean, rstd


def partial_rows(groups, n, device, zeroed=True):
    """The backward's two float32 partial planes (dweight's, dbias's), (groups, N) each; zeros
    for the row-at-a-time kernel, which adds into them (the rows kernel writes them once).
    Rows padded to whole 32-byte runs (8 floats, a 16-bit x's run), so that every row of both
    planes, the second plane's first included, starts on a 16-byte boundary with a row stride
    the vector build accepts."""
    padded = -(-n // 8) * 8
    make = torch.zeros if zeroed else torch.empty
    return make(2, groups, padded, dtype=torch.float32, device=device)[..., :n]


def layernorm_backward(x, weight, mean, rstd, dy, dx, dweight, dbias):
    check_backward(x, weight, mean, rstd, dy, dx, dweight, dbias)
    require_cuda(x)
    sums = [(out, k) for k, out in enumerate((dweight, dbias)) if out is not None]
    if x.numel() == 0:  # no rows: the column sums are sums of nothing
        for out, _ in sums:
            out.zero_()
        return dx, dweight, dbias
    w, _ = parameters_or_identity(x, weight, None)
    (x_rows, _), (dy_rows, _) = as_rows(x), as_rows(dy)
    (dx_rows, dx_copied), mean_v, rstd_v = as_rows(dx, True), as_vector(mean)[0], as_vector(rstd)[0]
    n, (groups, rows_per_group) = x_rows.shape[1], row_groups(x_rows.shape[0])
    shape = backward_map(n, x.dtype)
    partials = partial_rows(groups, n, x.device, zeroed=not shape[0])
    vector = all(is_vector_friendly(t) for t in (x_rows, dy_rows, dx_rows, w, partials[0]))
    kernel = compile_kernel("backward", x.dtype, w.dtype, vector, shape)
    kernel(x_rows, w, mean_v, rstd_v, dy_rows, dx_rows, partials[0], partials[1],
           rows_per_group, 1.0 / n)  # fmt: skip
    for out, k in sums:
        compile_sum(out.dtype)(partials[k], out)
    if dx_copied:
        dx.copy_(dx_rows.view(dx.shape))
    return dx, dweight, dbias


# The model glue of torch_impl.py over the two functions above.
LayerNormFunction = autograd_function(layernorm_forward, layernorm_backward)
layernorm = custom_ops("cute", layernorm_forward, layernorm_backward, LayerNormFunction)


class LayerNorm(TorchLayerNorm):
    """torch.nn.LayerNorm's drop-in over the CuTe kernels."""

    function = staticmethod(layernorm)
