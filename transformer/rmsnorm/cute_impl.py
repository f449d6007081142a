"""RMSNorm forward and backward in the CuTe DSL: rows on a warp, several warps or a block for
the forward; a block per group of rows (long rows: per column tile and group) for the backward.

    rstd = 1 / sqrt(mean(h**2) + eps)     y = h * rstd * w     (h = x, or x + residual stored)
    dx = rstd (g - xhat * mean(g * xhat))  (+ dresidual_out)   g = dy * w, xhat = h * rstd

The map (README.md, "CuTe", draws it): P threads walk a row in tiles of P * V elements;
thread t holds the same V elements of every tile (two runs of 16 bytes of x's dtype, moved by
128-bit copies; a float32 weight or partial row uses the same runs, two copies each).

forward  `rmsnorm_forward_kernel` on `forward_map`: P the fewest threads (32 to 256) holding
         the row in registers. Rows held (N <= 8192, `forward_row_in_registers`): x (and
         the residual) read once, h stored when fused, each thread's squares (`pairwise_sum`
         per tile), `row_sum` (dot/'s warp -> block tree, one barrier a row, the row's own
         named one when a block holds several) gives the row's; rstd = rsqrt.approx(sum / n
         + eps); y = h * rstd * w from the same registers. Longer rows
         (`forward_row_streamed`, a block each): pass 1 the squares, pass 2 y, last tile first.
backward rows of at most ROW_REGISTERS_MAX values a thread: `rmsnorm_backward_rows_kernel`, a
         block per group of rows: each row's x and dy read once (3MN in all; whole-tile
         vector builds keep the next STAGES rows flying into shared memory by cp.async,
         `stage_row`, and read the row from there twice, for the sum and for dx, so none is
         held in registers across the barrier), mean(g * xhat) by `block_sum`, dx written,
         dy * xhat summed over the group's rows in registers and written once as the group's
         float32 `partials` row.
         Longer rows: `row_dots_kernel`, a block per row: mean(g * xhat); then
         `rmsnorm_backward_columns_kernel`, a block per (tile, group): dx of its tile for each
         row of its group and the tile's partial (x and dy read twice: 5MN).
         `sum_partials_kernel`, a block per 32 columns: each warp adds a slice of the groups in
         order, then the slices' sums are added in warp order.

Every sum is a fixed order, so the same inputs give the same bits; `forward_path`,
`backward_path` and `dweight_path` export what README.md's bounds count. Rows of N >= 32768
are not spread over a cluster: README.md, open questions.
"""

import functools
import math
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import as_rows, check_backward, check_forward
from torch_impl import model_plumbing

THREADS_PER_BLOCK = 256
WARP_SIZE = 32
WARPS_PER_BLOCK = THREADS_PER_BLOCK // WARP_SIZE
VECTOR_BYTES = 16  # the widest load a thread can issue: 128 bits
# Two 16-byte vectors of x's dtype per thread and operand per tile: two loads in flight.
VECTORS_PER_THREAD = 2
# Blocks of the backward (the columns kernel's over all its tiles): about four per H200 SM,
# fixed by the shape alone so that the order of dweight's sum does not depend on the device.
GROUPS_MAX = 512
# A row held in registers: this many float32 values of it a thread (the forward's x; the
# backward's x, dy, w and the dweight row: 4 * 32 = 128 registers), so a block holds rows of up
# to 256 * 32 = 8192 elements in any dtype.
ROW_REGISTERS_MAX = 32
# Rows the backward's staged build keeps flying into shared memory ahead of the one it works on:
# 32 KB of shared memory a block at bf16 N = 4096 (README.md, tuning log).
STAGES = 2
# The staged rows kernel at one 16-bit tile (bf16 N = 4096, no residual) asks ptxas for four
# blocks an SM (64 registers a thread, no spills): 512 groups then run as one wave of 528 slots,
# where the 68 registers ptxas picks alone fit three (396 slots: 1.3 waves, the second a
# quarter full).
# Measured on the H200: backward 74.0 -> 84.4% of copy (README.md, tuning log).
STAGED_ONE_TILE_BLOCKS_PER_SM = 4

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
    return row_sum(value, THREADS_PER_BLOCK)


@cute.jit
def row_sum(value, threads_per_row: cutlass.Constexpr[int]):
    """The sum of `value` over the row's threads (a warp, or the row's consecutive warps of the
    block), in all of them, by block_sum's tree: 5 shuffle levels inside each warp; past a warp,
    the warps' sums in shared memory behind one barrier (the row's own, named, when the block
    holds several rows), then log2(warps a row) more levels."""
    value = butterfly_sum(value, WARP_SIZE)
    if cutlass.const_expr(threads_per_row > WARP_SIZE):
        warps_per_row = threads_per_row // WARP_SIZE
        warp_sums = cute.make_tensor(
            cute.arch.alloc_smem(cutlass.Float32, WARPS_PER_BLOCK),
            cute.make_layout(WARPS_PER_BLOCK),
        )
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        if lane == 0:
            warp_sums[warp] = value
        # every warp's sum is in shared memory before anyone reads
        if cutlass.const_expr(threads_per_row == THREADS_PER_BLOCK):
            cute.arch.sync_threads()
        else:  # barrier 0 is the block's; a row past M never arrives, and no other row waits
            cute.arch.barrier(
                barrier_id=1 + warp // warps_per_row, number_of_threads=threads_per_row
            )
        first = warp - warp % warps_per_row  # the row's first warp
        value = butterfly_sum(warp_sums[first + lane % warps_per_row], warps_per_row)
    return value


@cute.jit
def in_bounds_mask(thread_copy, row_tile_coords, n):
    """The predicate tensor: True where this thread's element has an index < n."""
    coords = thread_copy.partition_S(row_tile_coords)
    mask = cute.make_rmem_tensor(coords.shape, cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(mask)):
        mask[i] = cute.elem_less(coords[i], n)
    return mask


@cute.jit
def copy_in(thread_copy, source, values, in_bounds):
    """values[j] = this thread's j-th element of `source`, widened to float32 (in_bounds None:
    all of them; else the elements it skips hold 0)."""
    mine = thread_copy.partition_S(source)
    registers = cute.make_rmem_tensor_like(mine)
    if cutlass.const_expr(in_bounds is not None):
        registers.fill(0)
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


def registers(count):
    return cute.make_rmem_tensor(count, cutlass.Float32)


@cute.jit
def add_residual(copies, res_row, h_row, tile, n, tile_elems: cutlass.Constexpr[int], values,
                 other):  # fmt: skip
    """values = h = x + residual of a tile (x in values, the residual in other), rounded once to
    x's dtype as the stream is, and stored as the new residual stream."""
    for j in cutlass.range_constexpr(cute.size(values)):
        values[j] = (values[j] + other[j]).to(h_row.element_type).to(cutlass.Float32)
    store_tile(copies, h_row, tile, n, tile_elems, values)


@cute.jit
def normalise_tile(copies, w, y_row, tile, n, tile_elems: cutlass.Constexpr[int], row_rstd,
                   values):  # fmt: skip
    """y = h rstd w over one tile, h in `values`; the tile of y stored."""
    x_copies, w_copies = copies
    weights = registers(cute.size(values))
    load_tile(w_copies, w, tile, n, tile_elems, weights)
    for j in cutlass.range_constexpr(cute.size(values)):
        values[j] = values[j] * row_rstd * weights[j]
    store_tile(x_copies, y_row, tile, n, tile_elems, values)


def sum_of_squares(values, count):
    """The pairwise tree of a tile's squares (traced Python, as pairwise_sum)."""
    return pairwise_sum([values[j] * values[j] for j in range(count)])


@cute.jit
def row_rstd_of(thread_sum, n, eps, threads_per_row: cutlass.Constexpr[int]):
    """rstd = rsqrt.approx(sum of the row's squares / n + eps), from the threads' sums."""
    row_sum_of_squares = row_sum(thread_sum, threads_per_row)
    return cute.math.rsqrt(row_sum_of_squares / n.to(cutlass.Float32) + eps, fastmath=True)


@cute.jit
def forward_row_in_registers(
    rows, w, n, row_n, eps, copies, tile_elems: cutlass.Constexpr[int],
    per_thread: cutlass.Constexpr[int], threads_per_row: cutlass.Constexpr[int],
    row_tiles: cutlass.Constexpr[int], fused: cutlass.Constexpr[bool],
):  # fmt: skip
    """A row of row_tiles tiles read once into registers (rows = its x, residual, y, h): h,
    the sum of its squares, y written from the same registers. row_n bounds the tiles (a
    constant in a whole-tile build); n divides the mean. Returns rstd."""
    x_row, res_row, y_row, h_row = rows
    hs = [registers(per_thread) for _ in range(row_tiles)]
    others = [registers(per_thread) for _ in range(row_tiles if fused else 0)]
    for tile in cutlass.range_constexpr(row_tiles):  # every load in flight before a use
        load_tile(copies[0], x_row, tile, row_n, tile_elems, hs[tile])
        if cutlass.const_expr(fused):
            load_tile(copies[0], res_row, tile, row_n, tile_elems, others[tile])
    thread_sum = cutlass.Float32(0.0)
    for tile in cutlass.range_constexpr(row_tiles):
        if cutlass.const_expr(fused):
            add_residual(copies[0], res_row, h_row, tile, row_n, tile_elems, hs[tile], others[tile])
        thread_sum = thread_sum + sum_of_squares(hs[tile], per_thread)
    row_rstd = row_rstd_of(thread_sum, n, eps, threads_per_row)
    for tile in cutlass.range_constexpr(row_tiles):
        normalise_tile(copies, w, y_row, tile, row_n, tile_elems, row_rstd, hs[tile])
    return row_rstd


@cute.jit
def forward_row_streamed(
    rows, w, n, eps, copies, tile_elems: cutlass.Constexpr[int],
    per_thread: cutlass.Constexpr[int], fused: cutlass.Constexpr[bool],
):  # fmt: skip
    """A row longer than the registers, a block's: pass 1 h (stored when fused) and the sum of
    its squares, pass 2 y, last tile first (the last tile is still in registers, the others
    likely in L2; fused, pass 2 reads the stored h back). Returns rstd."""
    x_row, res_row, y_row, h_row = rows
    tiles = (n + tile_elems - 1) // tile_elems
    values, other = registers(per_thread), registers(per_thread)
    thread_sum = cutlass.Float32(0.0)
    for tile in cutlass.range(tiles):
        load_tile(copies[0], x_row, tile, n, tile_elems, values)
        if cutlass.const_expr(fused):
            load_tile(copies[0], res_row, tile, n, tile_elems, other)
            add_residual(copies[0], res_row, h_row, tile, n, tile_elems, values, other)
        thread_sum = thread_sum + sum_of_squares(values, per_thread)
    row_rstd = row_rstd_of(thread_sum, n, eps, THREADS_PER_BLOCK)
    for back in cutlass.range(tiles):
        tile = tiles - 1 - back
        if back > 0:
            load_tile(copies[0], h_row if cutlass.const_expr(fused) else x_row, tile, n,
                      tile_elems, values)  # fmt: skip
        normalise_tile(copies, w, y_row, tile, n, tile_elems, row_rstd, values)
    return row_rstd


@cute.kernel
def rmsnorm_forward_kernel(
    x: cute.Tensor, res: cute.Tensor, w: cute.Tensor, y: cute.Tensor, rstd: cute.Tensor,
    h: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32, eps: cutlass.Float32, copies,
    tile_elems: cutlass.Constexpr[int], per_thread: cutlass.Constexpr[int],
    threads_per_row: cutlass.Constexpr[int], row_tiles: cutlass.Constexpr[int],
    whole_tiles: cutlass.Constexpr[bool], fused: cutlass.Constexpr[bool],
):  # fmt: skip
    """A row per `threads_per_row` threads (one to eight warps); row_tiles > 0: the row held in
    registers, 0: streamed. whole_tiles: N is row_tiles whole tiles, a constant here, so the
    predicated path of a partial tile is not compiled (its registers would set the kernel's)."""
    block, _, _ = cute.arch.block_idx()
    thread, _, _ = cute.arch.thread_idx()
    row = block * (THREADS_PER_BLOCK // threads_per_row) + thread // threads_per_row
    # Rows of fewer than 256 threads: the last block's rows past M have none (their warps skip
    # row_sum's barrier, named per row: only the row's own warps wait there). A block's: all.
    if row < m:
        rows = (x[row, None], res[row, None], y[row, None], h[row, None])
        if cutlass.const_expr(row_tiles > 0):
            row_n = row_tiles * tile_elems if cutlass.const_expr(whole_tiles) else n
            row_rstd = forward_row_in_registers(
                rows, w, n, row_n, eps, copies, tile_elems, per_thread, threads_per_row,
                row_tiles, fused,
            )  # fmt: skip
        else:
            row_rstd = forward_row_streamed(rows, w, n, eps, copies, tile_elems, per_thread, fused)
        if thread % threads_per_row == 0:
            rstd[row] = row_rstd


@cute.kernel
def row_dots_kernel(
    x: cute.Tensor, w: cute.Tensor, rstd: cute.Tensor, dy: cute.Tensor, mean_dots: cute.Tensor,
    n: cutlass.Int32, copies, w_copies, tile_elems: cutlass.Constexpr[int],
    per_thread: cutlass.Constexpr[int],
):  # fmt: skip
    """mean(g * xhat) of a row, g = dy w, xhat = x rstd."""
    row, _, _ = cute.arch.block_idx()
    thread, _, _ = cute.arch.thread_idx()
    r = rstd[row]
    xs, dys, ws = registers(per_thread), registers(per_thread), registers(per_thread)
    thread_dot = cutlass.Float32(0.0)
    for tile in cutlass.range((n + tile_elems - 1) // tile_elems):
        load_tile(copies, x[row, None], tile, n, tile_elems, xs)
        load_tile(copies, dy[row, None], tile, n, tile_elems, dys)
        load_tile(w_copies, w, tile, n, tile_elems, ws)
        products = [(dys[j] * ws[j]) * (xs[j] * r) for j in range(per_thread)]
        thread_dot = thread_dot + pairwise_sum(products)
    mean_dot = block_sum(thread_dot) / n.to(cutlass.Float32)
    if thread == 0:
        mean_dots[row] = mean_dot


@cute.kernel
def rmsnorm_backward_columns_kernel(
    x: cute.Tensor, w: cute.Tensor, rstd: cute.Tensor, dy: cute.Tensor, dres: cute.Tensor,
    dx: cute.Tensor, mean_dots: cute.Tensor, partials: cute.Tensor, m: cutlass.Int32,
    n: cutlass.Int32, rows_per_group: cutlass.Int32, copies, f32_copies,
    tile_elems: cutlass.Constexpr[int], per_thread: cutlass.Constexpr[int],
    fused: cutlass.Constexpr[bool],
):  # fmt: skip
    """dx of one tile of columns for a group of rows, and that tile's dweight partial."""
    tile, group, _ = cute.arch.block_idx()
    xs, dys, ws, other = (registers(per_thread) for _ in range(4))
    dweight = registers(per_thread)
    dweight.fill(0.0)
    load_tile(f32_copies[1], w, tile, n, tile_elems, ws)
    first = group * rows_per_group
    for row in cutlass.range(first, cutlass.min(first + rows_per_group, m)):
        r, mean_dot = rstd[row], mean_dots[row]
        load_tile(copies, x[row, None], tile, n, tile_elems, xs)
        load_tile(copies, dy[row, None], tile, n, tile_elems, dys)
        if cutlass.const_expr(fused):
            load_tile(copies, dres[row, None], tile, n, tile_elems, other)
        for j in cutlass.range_constexpr(per_thread):
            xhat = xs[j] * r
            dweight[j] = dweight[j] + dys[j] * xhat
            xs[j] = r * (dys[j] * ws[j] - xhat * mean_dot)
            if cutlass.const_expr(fused):
                xs[j] = xs[j] + other[j]
        store_tile(copies, dx[row, None], tile, n, tile_elems, xs)
    store_tile(f32_copies[0], partials[group, None], tile, n, tile_elems, dweight)


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
def rmsnorm_backward_rows_kernel(
    x: cute.Tensor, w: cute.Tensor, rstd: cute.Tensor, dy: cute.Tensor, dres: cute.Tensor,
    dx: cute.Tensor, partials: cute.Tensor, m: cutlass.Int32, n: cutlass.Int32,
    rows_per_group: cutlass.Int32, copies, f32_copies, stage_copy,
    tile_elems: cutlass.Constexpr[int], per_thread: cutlass.Constexpr[int],
    row_tiles: cutlass.Constexpr[int], whole_tiles: cutlass.Constexpr[bool],
    fused: cutlass.Constexpr[bool],
):  # fmt: skip
    """The whole backward of a group of rows that fit the block's registers (row_tiles tiles):
    x and dy read once, dx written once, the group's dweight partial written once. A whole-tile
    vector build (stage_copy not None) keeps rows i + 1 .. i + STAGES of x and dy flying into
    shared memory and reads row i from there twice, for the sum and for dx, so no row is held
    in registers across the barrier; whole_tiles also drops the partial tile's predicated
    path."""
    group, _, _ = cute.arch.block_idx()
    row_n = row_tiles * tile_elems if cutlass.const_expr(whole_tiles) else n
    xs, dys, ws, dweight = ([registers(per_thread) for _ in range(row_tiles)] for _ in range(4))
    other = registers(per_thread)
    for tile in cutlass.range_constexpr(row_tiles):
        dweight[tile].fill(0.0)
        load_tile(f32_copies[1], w, tile, row_n, tile_elems, ws[tile])
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
        r = rstd[row]
        if cutlass.const_expr(staged is not None):
            stage = (row - first) % STAGES
            cute.arch.cp_async_wait_group(STAGES - 1)  # this thread's copies of row landed
            x_row, dy_row = staged[stage, 0, None], staged[stage, 1, None]
        else:
            x_row, dy_row = x[row, None], dy[row, None]
        for tile in cutlass.range_constexpr(row_tiles):  # every load in flight before a use
            load_tile(copies, x_row, tile, row_n, tile_elems, xs[tile])
            load_tile(copies, dy_row, tile, row_n, tile_elems, dys[tile])
        thread_dot = cutlass.Float32(0.0)  # row_dots_kernel's tree: the same bits
        for tile in cutlass.range_constexpr(row_tiles):
            products = [(dys[tile][j] * ws[tile][j]) * (xs[tile][j] * r) for j in range(per_thread)]
            thread_dot = thread_dot + pairwise_sum(products)
        mean_dot = block_sum(thread_dot) / n.to(cutlass.Float32)
        for tile in cutlass.range_constexpr(row_tiles):
            if cutlass.const_expr(staged is not None):  # read again: no row held across the sum
                load_tile(copies, x_row, tile, row_n, tile_elems, xs[tile])
                load_tile(copies, dy_row, tile, row_n, tile_elems, dys[tile])
            if cutlass.const_expr(fused):
                load_tile(copies, dres[row, None], tile, row_n, tile_elems, other)
            for j in cutlass.range_constexpr(per_thread):
                xhat = xs[tile][j] * r
                dweight[tile][j] = dweight[tile][j] + dys[tile][j] * xhat
                xs[tile][j] = r * (dys[tile][j] * ws[tile][j] - xhat * mean_dot)
                if cutlass.const_expr(fused):
                    xs[tile][j] = xs[tile][j] + other[j]
            store_tile(copies, dx[row, None], tile, row_n, tile_elems, xs[tile])
        if cutlass.const_expr(staged is not None):  # the slots just read take row + STAGES
            if row + STAGES < last:
                stage_row(stage_copy, (x, dy), staged[stage, None, None], row + STAGES,
                          tile_elems, row_tiles)  # fmt: skip
            cute.arch.cp_async_commit_group()
        cute.arch.sync_threads()  # block_sum's warp sums all read before the next row's land
    for tile in cutlass.range_constexpr(row_tiles):
        store_tile(f32_copies[0], partials[group, None], tile, row_n, tile_elems, dweight[tile])


@cute.kernel
def sum_partials_kernel(partials: cute.Tensor, dweight: cute.Tensor, groups: cutlass.Int32,
                        n: cutlass.Int32):  # fmt: skip
    """dweight[j] = column j of the partials added in a fixed order, rounded once: a block owns
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
        dweight[col] = total.to(dweight.element_type)


def tiled_copies(dtype, run, vectorized, threads=THREADS_PER_BLOCK):
    """(tile copy, element copy) of one operand: thread t owns runs of `run` adjacent elements
    (16 bytes of x's dtype), the row's `threads` side by side, VECTORS_PER_THREAD runs each per
    tile. The tile copy moves 128 bits per access (a float32 run of 8: two), the element copy
    one element under its own predicate; both give a thread the same elements."""
    thread_layout, value_layout = cute.make_layout(threads), cute.make_layout(run)
    bits = min(VECTOR_BYTES * 8, dtype.width * run) if vectorized else dtype.width
    tile_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
    element_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width
    )
    return (
        cute.make_tiled_copy_tv(tile_atom, thread_layout, value_layout),
        cute.make_tiled_copy_tv(element_atom, thread_layout, value_layout),
    )


def tile_shape(x_width, threads=THREADS_PER_BLOCK):
    """(run, elements per thread per tile, elements per tile) for x's dtype width in bits and
    `threads` per row."""
    run = VECTOR_BYTES * 8 // x_width
    return run, VECTORS_PER_THREAD * run, threads * VECTORS_PER_THREAD * run


@cute.jit
def launch_forward(
    x: cute.Tensor, res: cute.Tensor, w: cute.Tensor, y: cute.Tensor, rstd: cute.Tensor,
    h: cute.Tensor, eps: cutlass.Float32, stream: cuda.CUstream,
    vectorized: cutlass.Constexpr[bool], fused: cutlass.Constexpr[bool],
    threads_per_row: cutlass.Constexpr[int], row_tiles: cutlass.Constexpr[int],
    whole_tiles: cutlass.Constexpr[bool],
):  # fmt: skip
    """The forward on forward_map's (threads_per_row, row_tiles, whole_tiles)."""
    m, n = cutlass.Int32(cute.size(x, mode=[0])), cutlass.Int32(cute.size(x, mode=[1]))
    run, per_thread, tile_elems = tile_shape(x.element_type.width, threads_per_row)
    copies = (
        tiled_copies(x.element_type, run, vectorized, threads_per_row),
        tiled_copies(w.element_type, run, vectorized, threads_per_row),
    )
    rows_per_block = THREADS_PER_BLOCK // threads_per_row
    rmsnorm_forward_kernel(
        x, res, w, y, rstd, h, m, n, eps, copies, tile_elems, per_thread, threads_per_row,
        row_tiles, whole_tiles, fused,
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


def rows_kernel_blocks_per_sm(x_width, row_tiles, staged, fused):
    """The rows kernel's .minnctapersm: STAGED_ONE_TILE_BLOCKS_PER_SM for a staged 16-bit row of
    one tile without the residual, else 0, ptxas's choice (under a limit of four, the fused
    build spills 8-16 bytes, and two 16-bit tiles or float32 rows spill more)."""
    one_tile = staged and x_width == 16 and row_tiles == 1 and not fused
    return STAGED_ONE_TILE_BLOCKS_PER_SM if one_tile else 0


@cute.jit
def launch_backward(
    x: cute.Tensor, w: cute.Tensor, rstd: cute.Tensor, dy: cute.Tensor, dres: cute.Tensor,
    dx: cute.Tensor, mean_dots: cute.Tensor, partials: cute.Tensor, dweight: cute.Tensor,
    rows_per_group: cutlass.Int32, stream: cuda.CUstream, vectorized: cutlass.Constexpr[bool],
    fused: cutlass.Constexpr[bool], row_tiles: cutlass.Constexpr[int],
    whole_tiles: cutlass.Constexpr[bool],
):  # fmt: skip
    """row_tiles > 0: the rows kernel (mean_dots unused), staging rows in shared memory in a
    whole-tile vector build; 0: row_dots and columns kernels."""
    m, n = cutlass.Int32(cute.size(x, mode=[0])), cutlass.Int32(cute.size(x, mode=[1]))
    groups = cutlass.Int32(cute.size(partials, mode=[0]))
    run, per_thread, tile_elems = tile_shape(x.element_type.width)
    tiles = (n + tile_elems - 1) // tile_elems
    copies = tiled_copies(x.element_type, run, vectorized)
    w_copies = tiled_copies(w.element_type, run, vectorized)
    f32_copies = (tiled_copies(cutlass.Float32, run, vectorized), w_copies)
    block = [THREADS_PER_BLOCK, 1, 1]
    if cutlass.const_expr(row_tiles > 0):
        staging = whole_tiles and vectorized  # cp.async moves 16-byte runs of whole tiles
        stage_copy = stage_copy_of(x.element_type, run) if cutlass.const_expr(staging) else None
        row_bytes = row_tiles * tile_elems * x.element_type.width // 8
        staged_bytes = STAGES * 2 * row_bytes if staging else 0  # x and dy
        # .minnctapersm (0: ptxas's choice); carveout -1 is the driver's default, said so that
        # compiling does not ask a device for its shared memory.
        blocks_per_sm = rows_kernel_blocks_per_sm(x.element_type.width, row_tiles, staging, fused)
        rmsnorm_backward_rows_kernel(
            x, w, rstd, dy, dres, dx, partials, m, n, rows_per_group, copies, f32_copies,
            stage_copy, tile_elems, per_thread, row_tiles, whole_tiles, fused,
        ).launch(grid=[groups, 1, 1], block=block, smem=staged_bytes, stream=stream,
                 min_blocks_per_mp=blocks_per_sm, preferred_smem_carveout=-1)  # fmt: skip
    else:
        row_dots_kernel(
            x, w, rstd, dy, mean_dots, n, copies, w_copies, tile_elems, per_thread
        ).launch(grid=[m, 1, 1], block=block, stream=stream)
        rmsnorm_backward_columns_kernel(
            x, w, rstd, dy, dres, dx, mean_dots, partials, m, n, rows_per_group, copies,
            f32_copies, tile_elems, per_thread, fused,
        ).launch(grid=[tiles, groups, 1], block=block, stream=stream)  # fmt: skip
    sum_partials_kernel(partials, dweight, groups, n).launch(
        grid=[(n + WARP_SIZE - 1) // WARP_SIZE, 1, 1], block=block, stream=stream
    )


def operand(dtype, shape, vectorized):
    """What cute.compile sees of an operand: symbolic sizes, and either unit last stride with
    the other strides divisible by a 16-byte vector on a 16-byte boundary (the vector build)
    or symbolic strides on an element boundary."""
    per_vector = VECTOR_BYTES // dtype.itemsize
    if vectorized:
        stride = (*(cute.sym_int64(divisibility=per_vector) for _ in shape[:-1]), 1)
    else:
        stride = tuple(cute.sym_int64() for _ in shape)
    return cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], shape, stride=stride,
        assumed_align=VECTOR_BYTES if vectorized else dtype.itemsize,
    )  # fmt: skip


def statistic(m):
    """rstd or mean_dots: M float32 values at any stride."""
    return cute.runtime.make_fake_tensor(
        cutlass.Float32, (m,), stride=(cute.sym_int64(),), assumed_align=4
    )


def build(direction, dtype, weight_dtype, vectorized, fused, shape, options=""):
    """cute.compile the forward (x, residual, w, y, rstd, h, eps; on `shape` = forward_map's
    triple) or backward (x, w, rstd, dy, dresidual_out, dx, mean_dots, partials, dweight,
    rows_per_group; on `shape` = backward_map's pair) launcher for TVM-FFI calls on torch
    tensors, on torch's current stream. The operands share symbolic M and N; each has its own
    strides (TVM-FFI checks that operands sharing a symbol pass equal values)."""
    m, n = cute.sym_int64(), cute.sym_int64()
    rows = lambda: operand(dtype, (m, n), vectorized)  # noqa: E731
    w = lambda: operand(weight_dtype, (n,), vectorized)  # noqa: E731
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if direction == "forward":
        operands = (rows(), rows(), w(), rows(), statistic(m), rows(), 0.0)
        launcher = launch_forward
    else:
        partials = operand(torch.float32, (cute.sym_int64(), n), vectorized)
        operands = (rows(), w(), statistic(m), rows(), rows(), rows(), statistic(m), partials,
                    w(), 1)  # fmt: skip
        launcher = launch_backward
    return cute.compile(
        launcher, *operands, stream, vectorized, fused, *shape,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(direction, dtype, weight_dtype, vectorized, fused, shape):
    """The compiled launcher, built once per specialisation and cached."""
    built = build(direction, dtype, weight_dtype, vectorized, fused, shape)
    return built.__tvm_ffi_object__()


def ptx_of(direction, dtype, vectorized, fused, shape):
    """The sm_90a PTX of a build: what the tests read for 128-bit loads, rsqrt and shuffles."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(direction, dtype, dtype, vectorized, fused, shape, options).__ptx__


def is_vector_friendly(t):
    """Unit last stride, 16-byte aligned start, other strides whole 16-byte vectors."""
    per_vector = VECTOR_BYTES // t.element_size()
    return (
        t.data_ptr() % VECTOR_BYTES == 0
        and (t.stride(-1) == 1 or t.shape[-1] == 1)
        and all(t.stride(d) % per_vector == 0 or t.shape[d] == 1 for d in range(t.dim() - 1))
    )


@functools.cache
def row_tiles_of(n, dtype, threads=THREADS_PER_BLOCK):
    """The tiles of a row of `threads` threads held in registers, ROW_REGISTERS_MAX values a
    thread, or 0: the row does not fit (streamed forward, columns backward)."""
    _, per_thread, tile_elems = tile_shape(dtype.itemsize * 8, threads)
    tiles = -(-n // tile_elems)
    return tiles if tiles * per_thread <= ROW_REGISTERS_MAX else 0


@functools.cache
def forward_map(n, dtype):
    """(threads a row, tiles held, whole tiles): the fewest threads (a warp, 2, 4 or 8 warps)
    whose registers hold the row (N <= 8192): x read once, up to 64 bytes of it in flight a
    thread, more rows resident an SM than a block per row gives (README.md, tuning log).
    Longer rows: a block each, streamed. Whole tiles (N a multiple of the tile, as 1024, 4096,
    8192 are): a build without the partial tile's predicated path, which costs registers."""
    threads = WARP_SIZE
    while threads < THREADS_PER_BLOCK and not row_tiles_of(n, dtype, threads):
        threads *= 2
    row_tiles = row_tiles_of(n, dtype, threads)
    tile_elems = tile_shape(dtype.itemsize * 8, threads)[2]
    return threads, row_tiles, row_tiles > 0 and n == row_tiles * tile_elems


@functools.cache
def backward_map(n, dtype):
    """(tiles held, whole tiles) of the backward's block of 256 threads (0: the columns path);
    a whole-tile vector build stages the next row in shared memory."""
    row_tiles = row_tiles_of(n, dtype)
    return row_tiles, row_tiles > 0 and n == row_tiles * tile_shape(dtype.itemsize * 8)[2]


@functools.cache
def groups_of(m, n, dtype):
    """(rows per group, groups) of the backward: GROUPS_MAX blocks (the columns kernel's over
    all its tiles)."""
    tiles = 1 if row_tiles_of(n, dtype) else -(-n // tile_shape(dtype.itemsize * 8)[2])
    rows_per_group = -(-m // min(m, max(GROUPS_MAX // tiles, 1)))
    return rows_per_group, -(-m // rows_per_group)


def row_sum_path(n, dtype, threads):
    """Roundings on a term's way into a row's mean: the tile's pairwise tree, an add into the
    thread's sum per tile, log2(threads) levels across the row's threads (block_sum's 8, a
    warp's 5), the division by n."""
    _, per_thread, tile_elems = tile_shape(dtype.itemsize * 8, threads)
    levels = int(math.log2(per_thread)) + -(-n // tile_elems) + int(math.log2(threads))
    return levels + 1


def forward_path(n, dtype):
    """mean(h**2)'s roundings, on forward_map's map for n."""
    return row_sum_path(n, dtype, forward_map(n, dtype)[0])


def backward_path(n, dtype):
    """mean(g * xhat)'s roundings: a block per row (the rows kernel and row_dots_kernel)."""
    return row_sum_path(n, dtype, THREADS_PER_BLOCK)


def dweight_path(m, n, dtype):
    """Additions on a term's way into dweight: one per row of its group, one per group of its
    slice in sum_partials_kernel, one per slice."""
    rows_per_group, groups = groups_of(max(m, 1), n, dtype)
    return rows_per_group + -(-groups // WARPS_PER_BLOCK) + WARPS_PER_BLOCK


def rmsnorm_forward(x, weight, eps, y, rstd, residual=None, residual_out=None):
    check_forward(x, weight, eps, y, rstd, residual, residual_out)
    fused = residual is not None
    outputs = (y, rstd) if not fused else (y, rstd, residual_out)
    if not x.is_cuda:
        raise ValueError(f"the operands are on {x.device}; the CuTe kernel needs CUDA tensors")
    if x.numel() == 0:
        return outputs
    x_rows = as_rows(x)[0]
    res_rows = as_rows(residual)[0] if fused else x_rows
    (y_rows, y_copied), (rstd_vec, rstd_copied) = (as_rows(y, True), as_rows(rstd[..., None], True))
    h_rows, h_copied = as_rows(residual_out, True) if fused else (x_rows, False)
    vectorized = all(is_vector_friendly(t) for t in (x_rows, res_rows, weight, y_rows, h_rows))
    shape = forward_map(x_rows.shape[1], x.dtype)
    kernel = compile_kernel("forward", x.dtype, weight.dtype, vectorized, fused, shape)
    # TVM-FFI launches on torch's current stream (capturable by a CUDA graph after a first call).
    kernel(x_rows, res_rows, weight, y_rows, rstd_vec.view(-1), h_rows, eps)
    for copied, target, source in ((y_copied, y, y_rows), (rstd_copied, rstd, rstd_vec),
                                   (h_copied, residual_out, h_rows)):  # fmt: skip
        if copied:
            target.copy_(source.view(target.shape))
    return outputs


def rmsnorm_backward(x, weight, rstd, dy, dx, dweight, dresidual_out=None):
    check_backward(x, weight, rstd, dy, dx, dweight, dresidual_out)
    fused = dresidual_out is not None
    if not x.is_cuda:
        raise ValueError(f"the operands are on {x.device}; the CuTe kernel needs CUDA tensors")
    if x.numel() == 0:
        dweight.zero_()  # a sum over no rows (or of rows of no elements)
        return dx, dweight
    x_rows, dy_rows = as_rows(x)[0], as_rows(dy)[0]
    dres_rows = as_rows(dresidual_out)[0] if fused else x_rows
    dx_rows, dx_copied = as_rows(dx, for_output=True)
    rstd_vec = as_rows(rstd[..., None])[0].view(-1)
    m, n = x_rows.shape
    rows_per_group, groups = groups_of(m, n, x.dtype)
    row_tiles = row_tiles_of(n, x.dtype)
    padded = -(-n // 8) * 8  # partial rows start on 32-byte boundaries
    partials = torch.empty(groups, padded, device=x.device, dtype=torch.float32)[:, :n]
    # The rows kernel needs no mean_dots: rstd stands in for the unused operand.
    mean_dots = rstd_vec if row_tiles else torch.empty(m, device=x.device, dtype=torch.float32)
    operands = (x_rows, weight, dy_rows, dres_rows, dx_rows, partials, dweight)
    vectorized = all(is_vector_friendly(t) for t in operands)
    shape = backward_map(n, x.dtype)
    kernel = compile_kernel("backward", x.dtype, weight.dtype, vectorized, fused, shape)
    kernel(x_rows, weight, rstd_vec, dy_rows, dres_rows, dx_rows, mean_dots, partials, dweight,
           rows_per_group)  # fmt: skip
    if dx_copied:
        dx.copy_(dx_rows.view(dx.shape))
    return dx, dweight


_plumbing = model_plumbing("cute", rmsnorm_forward, rmsnorm_backward)
RMSNormFunction, rmsnorm, RMSNorm = _plumbing.RMSNormFunction, _plumbing.rmsnorm, _plumbing.RMSNorm
