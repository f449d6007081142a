"""Attention in the CuTe DSL, step 3: the backward on Hopper's TMA and wgmma, in one pass over
the keys, deterministic.

The gradients of O = softmax(c' S) V with S = Q K^T, c' = scale (README.md, "The math"), per
query head, P recomputed from the forward's lse (float32, natural log) instead of stored:

    P    = exp2(S c - lse log2 e)        c = scale log2 e; masked keys: P = 0
    dV   = P^T dO                        (a KV head sums its group's query heads)
    dP   = dO V^T
    dS   = P (dP - delta)                delta_i = sum_d dO_id O_id   (float32)
    dQ   = scale dS K
    dK   = scale dS^T Q

P and dS are rounded to the input dtype as the A operands of the products that follow (the
bound of README.md counts that rounding as u_in); every sum is float32 in the tensor cores'
accumulators, in registers, or (dQ) in global memory.

The Triton backward (triton_impl.py, README.md's "The backward rebuilt") runs two kernels, one
for dQ over the key tiles, one for dK and dV over the query tiles, and so computes S and dP
twice: 7 products a tile pair where 5 suffice. This one computes them once, as FlashAttention-2
and -3 do: each block of 128 keys walks the query tiles that see it, adds dV and dK in registers,
and adds its share of each query tile's dQ, dS_m K_n, into a float32 sum in global memory. Many
key blocks add into one query tile, and float addition is not associative: for the same bits
every run the adds must come in a fixed order. Each query tile has a semaphore (an int32
counting the key blocks that have added); block n adds only once it reads the number of blocks
before it in the order, then counts itself in. Each order is the last key block first, and the
grid launches the last key block first, so a block only ever waits on blocks already running
(a block waiting on one that cannot start would hang the GPU). Under causal masking a block
starts at its diagonal's tile, which no later block sees, so it adds first there and starts
without waiting. Without a mask every block sees every tile; block n starts at tile n x tiles /
n_blocks and wraps around to tile 0 at the end, adding the tiles after the wrap into a second
sum (`query_tiles`, `blocks_before`): each block then reaches a tile a few tiles after the
block before it in the order, where with one walk from tile 0 for all, block n waited at tile 0
for the n_blocks - 1 - n blocks before it, one after another.

1. `delta_kernel`: delta = rowsum(dO O) per query row (a warp a row, a butterfly sum), the dQ
   sums' rows zeroed and the semaphores zeroed.
2. `attention_backward_kernel`, one block per BLOCK_N = 128 keys of one KV head: for each query
   head of the group in order, over the query tiles that see its keys, the products transposed,
   S^T = K Q^T and dP^T = V dO^T, so that P^T and dS^T come out of the tensor cores in the
   accumulator layout that dV += P^T dO and dK += dS^T Q take as their register A operand (Q
   and dO seen transposed as MN-major B operands). dQ = dS K needs dS with the queries as rows:
   each consumer writes its 64 keys of dS^T into shared memory (queries contiguous: dS read as
   an MN-major A operand), the two meet on a named barrier, and each multiplies all 128 keys'
   dS by its half of D of K. A writer warp adds the halves to the float32 sum by TMA reduce-add
   (`cp.reduce.async.bulk.tensor`, performed in L2) in the semaphore's order.
3. dQ = the sum (of the two sums, each already scaled by the consumers), rounded (cute_impl:
   one torch add, or copy).

The map of kernel 2. Step 2's (cute_2_wgmma.py) machinery: 384 threads; warpgroup 0 the producer
(setmaxnreg down to 24 registers), in which warp 0 issues every TMA load and warp 1 is the dQ
writer; warpgroups 1 and 2 the consumers (up to 240 registers), each owning 64 keys of the
block and issuing its own 64-row wgmmas; loads into 128-byte-swizzled shared memory on mbarriers
(PipelineTmaAsync); the accumulators seen as rows by columns (step 2's `by_rows`) for masks and
row operations, regrouped as register A operands (`as_a_operand`); dK and dV at the end by
stmatrix and one TMA store a warpgroup.

- K and V are loaded once (one barrier, a 64-key half a consumer), then Q and dO tile by tile,
  head after head of the group, into a ring of `stages`.
- A consumer thread holds dK and dV (64 x D / 128 floats each: 128 together at D = 128), S^T and
  dP^T (64 x 64 / 128 each: 32), P^T and dS^T rounded, its columns' lse and delta (read from
  shared memory), and its dQ half (64 x D / 2 / 128: 32 at D = 128) from the start of a tile
  until its handover, in the registers dP^T takes after it.
- lse and delta come a tile ahead: each consumer thread loads one of the next tile's 64 lse
  and 64 delta values at the start of a tile (no branch: the query clamped, then 0 selected
  past S_q) and stores it into the consumer's own buffer (two by parity) before the tile's
  barrier; after it the whole warpgroup reads them. Loaded where they were used, under a branch
  each, a thread's 32 loads went to L2 one after another, and the kernel took 6.1 ms on an
  H100 where it now takes 2.9 (README.md, tuning log).
- The query tile is 64 rows, one wgmma's M: dQ's wgmma has the tile's queries as its rows.
- dS^T goes into one of two buffers by the tile's parity: the other consumer may still be
  reading the previous tile's from the other. dQ goes into a float32 staging buffer a consumer
  (64 x D / 2, in 128-byte-swizzled boxes of 64 x 32 floats, TMA's widest with that swizzle);
  the consumer and the writer hand it back and forth on two named barriers ("empty", "full").
  The writer waits for its adds to complete (not only to be read) before counting the block
  in, so that the next block in the order adds onto them.
- Shared memory at D = 128, 2 stages: K, V 2 x 32 KB + 2 x (Q, dO 16 KB) + dS 2 x 16 KB + dQ
  32 KB + statistics 2 KB = 194 KB; at D = 64, 3 stages: 2 x 16 + 3 x (8 + 8) + 32 + 16 + 2 =
  130 KB.
- setmaxnreg needs the launch bound `min_blocks_per_mp=1` (.minnctapersm 1): without it ptxas
  could not tell the registers a thread has at entry, ignored setmaxnreg (its warning C7508)
  and spilled within the even share of 168.
- The loop over query tiles is in two parts: causal, the tiles that hold the diagonal of the
  block's keys (masked), then those whose every row sees every key of the block; without a
  mask, the tiles from the block's start on, then those before it (wrapped around); query
  rows past S_q read zeros (TMA fills them) with lse = delta = 0, so they add exactly 0, and
  keys past S_k are zero rows of K and V: they only reach rows of dK and dV that TMA does not
  store, and add dS x 0 = 0 to dQ.

Within a tile the products overlap the row work where the data allow. A tile begins with the
tile before's dQ product (both consumers' dS^T met on that tile's barrier) and its own S^T
issued together; dQ's handover to the writer (scale, stores into the staging buffer, fence)
runs while S^T's wgmmas do, then dP^T is issued into the registers dQ left, P^T is computed
while dP^T's wgmmas run, dS^T while dV's run, and dS^T's store to shared memory while dK's
run. dQ is issued a tile late because the consumers cannot wait for it at the end of its own
tile without the tensor cores idling through the handover, and cannot leave it running past
the loop's end into the next tile either: ptxas then no longer sees that the wait before the
handover covers it, and serializes every wgmma of the kernel (its warning C7514). Not yet in
it: the two consumers taking turns (step 3's forward's ping-pong).
"""

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cute_1_tiled import LOG2E, key_limit
from cute_2_wgmma import (
    CONSUMER_REGISTERS,
    CONSUMER_WARPGROUPS,
    PRODUCER_REGISTERS,
    THREADS,
    WARPGROUP_THREADS,
    WGMMA_M,
    allocate,
    as_a_operand,
    by_rows,
    consume_tiles,
    issue,
    load_once,
    load_tiles,
    pipelines,
    seq_major,
    smem_layouts,
    stage_barriers,
    store_accumulator,
    tiled_mmas,
    tma_tiles,
    transposed,
)

__all__ = ["TILES", "launch_backward", "sums"]

# The block of keys: a 64-row half for each consumer warpgroup.
BLOCK_N = CONSUMER_WARPGROUPS * WGMMA_M
# (queries a tile, stages of the Q/dO ring) per head dimension. The query tile is one wgmma's
# M (dQ's rows); the stages are what shared memory holds (the docstring's map). Other head
# dimensions go to Triton.
TILES = {64: (WGMMA_M, 3), 128: (WGMMA_M, 2)}
# Launched with .minnctapersm 1: without a bound on the blocks an SM, ptxas may not know the
# registers a thread has at entry, and then ignores every setmaxnreg (its warning C7508).
ONE_BLOCK_AN_SM = 1
# dQ's float32 sum is added in boxes of 64 rows x 32 floats: 128-byte rows, the widest TMA box
# the 128-byte swizzle allows (the swizzle spreads a warp's stores over the banks).
DQ_BOX = 32
WRITER_WARP = 1  # of the producer warpgroup; warp 0 issues the loads
# Named barriers (0 is __syncthreads; 1 and 2 are store_accumulator's, one a consumer).
DS_READY = 3  # both consumers' dS^T are in shared memory
DQ_EMPTY = 4  # + consumer half: the writer is done reading that consumer's staged dQ
DQ_FULL = 6  # + consumer half: that consumer's dQ is staged
CONSUMERS = CONSUMER_WARPGROUPS * WARPGROUP_THREADS
# A query tile's statistics in shared memory: the lse x log2 e of its WGMMA_M queries, then their
# delta; each consumer warpgroup its own copy, two by parity (a thread stages one value).
STATS = 2 * WGMMA_M
CONSUMER_AND_WRITER = WARPGROUP_THREADS + 32
DELTA_WARPS = 4  # rows of delta_kernel's block, a warp each


# (1) delta ------------------------------------------------------------------------------------


@cute.kernel
def delta_kernel(o: cute.Tensor, do: cute.Tensor, delta: cute.Tensor, dq_sum: cute.Tensor,
                 semaphores: cute.Tensor, rows: cutlass.Int32, s_q: cutlass.Int32,
                 heads: cutlass.Int32, block_m: cutlass.Constexpr[int],
                 head_dim: cutlass.Constexpr[int], sums: cutlass.Constexpr[int]):  # fmt: skip
    """One warp a query row (b, s, h), rows in memory order: delta = sum_d dO O in float32 (a
    lane every 32nd column, then a butterfly over the warp: a fixed order), the row of each dQ
    sum zeroed, and, by the first row of each query tile, the tile's semaphores."""
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    row = block * DELTA_WARPS + thread // 32
    if row < rows:
        h = row % heads
        s = row // heads % s_q
        b = row // heads // s_q
        partial = cutlass.Float32(0.0)
        for j in cutlass.range_constexpr(head_dim // 32):
            d = lane + 32 * j  # a warp's loads are contiguous
            d_o, out = do[b, s, h, d].to(cutlass.Float32), o[b, s, h, d].to(cutlass.Float32)
            partial = partial + d_o * out
        for j in cutlass.range_constexpr(sums * head_dim // 32):
            dq_sum[b, s, h, lane + 32 * j] = cutlass.Float32(0.0)
        total = cute.arch.warp_reduction(partial, lambda x, y: x + y)
        if lane == 0:
            delta[b, h, s] = total
            if s % block_m == 0:
                for wrapped in cutlass.range_constexpr(sums):
                    semaphores[b, h, wrapped, s // block_m] = cutlass.Int32(0)


# (2) dK, dV and dQ ----------------------------------------------------------------------------


@cute.jit
def fetch_stats(lse, delta, b, h, tile, s_q, mine, block_m: cutlass.Constexpr):
    """This thread's share of query tile `tile`'s statistics (head h), issued a tile ahead and
    not waited for: the lse and the delta of query tile x block_m + mine % block_m, clamped to
    the last query (no branch, nothing read out of bounds)."""
    query = cutlass.min(tile * block_m + mine % block_m, s_q - 1)
    return lse[b, h, query], delta[b, h, query]


@cute.jit
def stage_stats(fetched, stats, slot, tile, s_q, mine, block_m: cutlass.Constexpr):
    """The fetched statistics into a slot of the consumer's buffer: threads [0, block_m) the
    lse x log2 e, the others the delta; 0 at queries past S_q, whose zero-filled rows then add
    exactly 0 (P = exp2(0 - 0) = 1 times dO = 0; dS = 1 x (0 - 0)). Selects, not branches."""
    lse_value, delta_value = fetched
    value = cutlass.select_(mine < block_m, lse_value * LOG2E, delta_value)
    inside = tile * block_m + mine % block_m < s_q
    stats[mine, slot] = cutlass.Float32(cutlass.select_(inside, value, cutlass.Float32(0.0)))


@cute.jit
def read_stats(stats, slot, score_coords, offset):
    """The staged statistics (offset 0: lse x log2 e; block_m: delta) at the queries of the
    thread's accumulator columns (the transposed products' queries)."""
    count = cute.size(score_coords, mode=[1])
    values = cute.make_rmem_tensor(count, cutlass.Float32)
    for i in cutlass.range_constexpr(count):
        values[i] = stats[offset + score_coords[0, i][1], slot]
    return values


# query_tiles and blocks_before are plain Python over ints or the kernel's Int32s (traced
# inline there): test.py plays the dQ order on the host with them.
def query_tiles(n_block, n_blocks, s_q, s_k, block_m, causal):
    """(first, full, start, end): the query tiles of block_m rows that key block n_block (keys
    [n_block BLOCK_N, + BLOCK_N)) visits, in three ranges, in this order: [first, full) hold
    their causal diagonal (masked); [start, end) and then [full, start) (the tiles "wrapped
    around") see every one of its keys. Causal, start = full: no tile is wrapped around, and
    the rows before tile `first` see none of the keys (triton_impl's dK/dV kernel). Without a
    mask every block sees every tile, and block n starts at tile n x end / n_blocks (its
    diagonal when S_q = S_k), so that the blocks do not all start on tile 0 (`blocks_before`)."""
    end = (s_q + block_m - 1) // block_m
    first, full, start = 0, 0, 0
    if cutlass.const_expr(causal):
        shift = s_k - s_q  # row i sees key j when j <= i + shift
        first_key = n_block * BLOCK_N
        first = cutlass.max(first_key - shift, 0) // block_m
        all_keys_row = cutlass.max(first_key + BLOCK_N - 1 - shift, 0)  # sees the last key
        full = cutlass.min(cutlass.max((all_keys_row + block_m - 1) // block_m, first), end)
        start = full
    else:
        start = n_block * end // n_blocks
    return first, full, start, end


def walk(tiles):
    """A block's walk over its query tiles (`query_tiles`), as the three ranges in its order,
    each (lo, hi, masked, wrapped): the producer loads, the consumers compute and the writer
    adds the same tiles in this order."""
    first, full, start, end = tiles
    return (first, full, True, False), (start, end, False, False), (full, start, False, True)


def walk_start(tiles, causal):
    """The first query tile of a block's walk (`walk`): causal, its first masked tile (or
    `full`, the same tile, when none is masked); without a mask, its start."""
    first, _, start, _ = tiles
    return first if causal else start


def blocks_before(n_block, tile, wrapped, n_blocks, s_q, s_k, block_m, causal):
    """How many key blocks add to query tile `tile`'s dQ sum before block n_block: the first sum
    for the tiles a block visits before it wraps around, the second for those after (`wrapped`,
    a Python bool). Each sum's adds come from the last block down, and the grid launches the
    last block first, so a block only waits on blocks already running. First sum: the tile is
    added to by blocks 0 .. last (`query_tiles`: causal, last is the block of the last key the
    tile's last row sees; without a mask, the last block that starts at or before the tile).
    Second sum: by the blocks that start after the tile, n_block + 1 .. n_blocks - 1.

    Why two sums: without a mask, block n reaches tile m (m >= its start) m - start(n) tiles
    into its walk, the block after it in the order one start's difference earlier, so it
    rarely waits; with one order over all the blocks from tile 0 (as before 2026-12-06), block
    n waited at tile 0 for the n_blocks - 1 - n blocks before it, one after another. The
    wrapped-around adds go into a sum of their own because a single order would have a block
    wait on blocks launched after it (deadlock when a head's blocks do not all fit the GPU)."""
    last = n_blocks - 1
    if cutlass.const_expr(causal):
        last = cutlass.min((tile * block_m + block_m - 1 + s_k - s_q) // BLOCK_N, last)
    elif cutlass.const_expr(not wrapped):
        end = (s_q + block_m - 1) // block_m
        last = cutlass.min(((tile + 1) * n_blocks + end - 1) // end - 1, last)
    return last - n_block


@cute.jit
def mask_transposed(p_t, coords, first_key, first_query, s_q, s_k):
    """P^T (keys x queries view) of the keys past each query's causal diagonal set to 0: the
    mask of cute_1_tiled.mask_scores, rows and columns exchanged."""
    for c in cutlass.range_constexpr(cute.size(p_t, mode=[1])):
        limit = key_limit(first_query + coords[0, c][1], s_q, s_k, True)
        for r in cutlass.range_constexpr(cute.size(p_t, mode=[0])):
            if first_key + coords[r, 0][0] >= limit:
                p_t[r, c] = 0.0


@cute.jit
def write_dq(tma_add, DQ_sum, staging, semaphores, b, g, group, n_block, n_blocks, tiles, s_q,
             s_k, block_m: cutlass.Constexpr, head_dim: cutlass.Constexpr,
             causal: cutlass.Constexpr):  # fmt: skip
    """The writer warp, over the query tiles in the consumers' order (`query_tiles`), each
    into its sum (`add_tile`)."""
    for head in cutlass.range(group, unroll=1):
        h = g * group + head
        boxes_of_sums = cute.local_tile(DQ_sum[None, None, h, b], (block_m, DQ_BOX), (None, None))
        staged, tiles_of_sum = cpasync.tma_partition(
            tma_add, 0, cute.make_layout(1), cute.group_modes(staging, 0, 2),
            cute.group_modes(boxes_of_sums, 0, 2),
        )  # fmt: skip
        add = functools.partial(
            add_tile, tma_add=tma_add, staged=staged, tiles_of_sum=tiles_of_sum,
            semaphores=semaphores, b=b, h=h, n_block=n_block, n_blocks=n_blocks, s_q=s_q,
            s_k=s_k, block_m=block_m, head_dim=head_dim, causal=causal,
        )  # fmt: skip
        for lo, hi, _, wrapped in walk(tiles):
            for tile in cutlass.range(lo, hi, unroll=1):
                add(tile=tile, wrapped=wrapped)


@cute.jit
def add_tile(tma_add, staged, tiles_of_sum, semaphores, b, h, tile, n_block, n_blocks, s_q,
             s_k, block_m: cutlass.Constexpr, head_dim: cutlass.Constexpr,
             causal: cutlass.Constexpr, wrapped: cutlass.Constexpr):  # fmt: skip
    """One query tile's dQ share, by the writer warp: hand both staging buffers to the
    consumers ("empty"), wait until the tile's semaphore in its sum (the second, D columns on,
    if `wrapped`) counts the key blocks before this one, add each consumer's staged dQ half
    once it is there ("full") by TMA reduce-add, wait until the adds are done in L2, then count
    this block in (release: the next block's acquire sees the adds)."""
    lane = cute.arch.lane_idx()
    boxes = head_dim // DQ_BOX // CONSUMER_WARPGROUPS  # a consumer's half of D
    in_sum = head_dim // DQ_BOX if cutlass.const_expr(wrapped) else 0  # the sum's first box
    for half in cutlass.range_constexpr(CONSUMER_WARPGROUPS):
        cute.arch.barrier_arrive(barrier_id=DQ_EMPTY + half, number_of_threads=CONSUMER_AND_WRITER)
    semaphore = semaphores.iterator + cute.crd2idx((b, h, int(wrapped), tile), semaphores.layout)
    if lane == 0:
        before = blocks_before(n_block, tile, wrapped, n_blocks, s_q, s_k, block_m, causal)
        seen = cute.arch.load(semaphore, cutlass.Int32, sem="acquire", scope="gpu")
        while seen != before:
            seen = cute.arch.load(semaphore, cutlass.Int32, sem="acquire", scope="gpu")
    for half in cutlass.range_constexpr(CONSUMER_WARPGROUPS):
        cute.arch.barrier(barrier_id=DQ_FULL + half, number_of_threads=CONSUMER_AND_WRITER)
        # The whole warp calls the copy: a TMA copy elects its lane itself (elect.sync over
        # the warp, which hangs when one lane reaches it alone).
        for i in cutlass.range_constexpr(boxes):
            box = half * boxes + i
            cute.copy(tma_add, staged[None, box], tiles_of_sum[None, tile, in_sum + box])
    with cute.arch.elect_one():  # the same lane as the copies' (the lowest)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0)  # the adds are done, not only read
        cute.arch.atomic_add(semaphore, cutlass.Int32(1), sem="release", scope="gpu")


@cute.jit
def next_in_order(tile, tiles, causal: cutlass.Constexpr):
    """The query tile after `tile` in a block's walk (`query_tiles`: causal [first, end), else
    [start, end) then [0, start)), and whether `tile` is the head's last, after which the walk
    begins again at its first tile (`next` is then that one)."""
    _, _, start, end = tiles
    after = tile + 1
    next_tile = after
    head_done = after == end
    if cutlass.const_expr(not causal):
        head_done = after == cutlass.select_(start > 0, start, end)
        next_tile = cutlass.select_(after == end, 0, after)
    return (cutlass.Int32(cutlass.select_(head_done, walk_start(tiles, causal), next_tile)),
            head_done)  # fmt: skip


@cute.jit
def backward_query_tile(
    state, tile, mmas, frags, views, scores_t, dp_t, dk, dv, dq, lse, delta, b, h, last_h,
    tiles, score_coords, first_key, s_q, s_k, scale_log2, scale, half, mine,
    block_m: cutlass.Constexpr, causal: cutlass.Constexpr, masked: cutlass.Constexpr,
):  # fmt: skip
    """Query tile `tile` of head h, landed in the ring's stage state.index, into this
    warpgroup's dK and dV; first the tile before's dQ share (this warpgroup's half of D) issued
    and handed to the writer, then this tile's dS^T left in shared memory for the next tile's
    (`issue_dq`). dS^T and the statistics go through the buffers of the parity of
    state.count, where this tile stages the next one's statistics (the next in the consumers'
    order, `next_in_order`; after the group's last, any tile)."""
    stage, parity = state.index, state.count % 2
    mma_kq, mma_acc, overwrite, mma_dq, overwrite_dq = mmas
    k_frag, v_frag, q_frag, do_frag, q_t_frag, do_t_frag, ds_frag, k_t_frag = frags
    ds_store, dq_staged, stats = views
    first_query = tile * block_m
    next_tile, head_done = next_in_order(tile, tiles, causal)
    next_h = cutlass.Int32(cutlass.select_(head_done, cutlass.min(h + 1, last_h), h))
    fetched = fetch_stats(lse, delta, b, next_h, next_tile, s_q, mine, block_m)  # lands a tile on
    issue_dq(state.count, mma_dq, overwrite_dq, dq, ds_frag, k_t_frag)  # the tile before's
    issue(mma_kq, scores_t, k_frag, q_frag[None, None, None, stage], overwrite)
    warpgroup.wait_group(1)  # dQ has landed; S^T's wgmmas run on under its handover
    if state.count > 0:
        hand_over(dq, mma_dq, dq_staged, scale, half, mine)
    issue(mma_kq, dp_t, v_frag, do_frag[None, None, None, stage], overwrite)
    warpgroup.wait_group(1)  # S^T has landed; P^T is computed while dP^T's wgmmas run
    p_rows, dp_rows = by_rows(scores_t), by_rows(dp_t)
    lse_log2 = read_stats(stats, parity, score_coords, 0)
    for c in cutlass.range_constexpr(cute.size(p_rows, mode=[1])):
        for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
            p_rows[r, c] = cute.math.exp2(p_rows[r, c] * scale_log2 - lse_log2[c], fastmath=True)
    if cutlass.const_expr(masked):  # after the exp2: a row that sees no key has lse = -inf
        mask_transposed(p_rows, score_coords, first_key, first_query, s_q, s_k)
    dtype = mma_acc.op.a_dtype
    p_t = cute.make_rmem_tensor_like(scores_t, dtype)
    p_t.store(scores_t.load().to(dtype))  # round(P^T): dV's A operand, from registers
    warpgroup.wait_group(0)
    issue(mma_acc, dv, as_a_operand(p_t), do_t_frag[None, None, None, stage])  # dS^T under it
    deltas = read_stats(stats, parity, score_coords, block_m)
    for c in cutlass.range_constexpr(cute.size(p_rows, mode=[1])):
        for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
            dp_rows[r, c] = p_rows[r, c] * (dp_rows[r, c] - deltas[c])  # dS^T in dP^T's place
    ds_t = cute.make_rmem_tensor_like(dp_t, dtype)
    ds_t.store(dp_t.load().to(dtype))  # round(dS^T): dK's A operand, and dQ's through memory
    issue(mma_acc, dk, as_a_operand(ds_t), q_t_frag[None, None, None, stage])  # stored under it
    # The next tile's statistics, read by the warpgroup after the barrier below (its slot was
    # last read in the tile before this one, before that tile's barrier).
    stage_stats(fetched, stats, 1 - parity, next_tile, s_q, mine, block_m)
    slot = parity * CONSUMER_WARPGROUPS + half
    cute.autovec_copy(ds_t, mma_kq.get_slice(mine).partition_C(ds_store[None, None, slot]))
    cute.arch.fence_proxy("async.shared", space="cta")  # seen by the wgmmas (async proxy)
    cute.arch.barrier(barrier_id=DS_READY, number_of_threads=CONSUMERS)
    warpgroup.wait_group(0)  # dV's and dK's wgmmas have read the stage (it is released next)


@cute.jit
def issue_dq(count, mma_dq, overwrite_dq, dq, ds_frag, k_t_frag):
    """The dQ share of the tile before the one `count` tiles into the walk, dS K over the
    block's 128 keys (both consumers' dS^T, in the buffers of the other parity, met on that
    tile's barrier), this warpgroup's half of D: issued, not waited for. Issued at the start of
    the next tile, so that its handover runs under that tile's S^T. On a walk's first tile there
    is no tile before: the product reads whatever the buffers hold and is not handed over.
    Issued on every tile all the same: with the wgmma groups the same on every path, ptxas sees
    that the wait before the handover covers it (behind a branch, it serialized every wgmma of
    the kernel, its warning C7514)."""
    slots = (1 - count % 2) * CONSUMER_WARPGROUPS
    for key_half in cutlass.range_constexpr(CONSUMER_WARPGROUPS):
        issue(mma_dq, dq, ds_frag[None, None, None, slots + key_half],
              k_t_frag[None, None, None, key_half],
              overwrite_dq if cutlass.const_expr(key_half == 0) else None)  # fmt: skip


@cute.jit
def hand_over(dq, mma_dq, dq_staged, scale, half, mine):
    """This warpgroup's dQ share of a tile (its wgmmas complete), scaled (the sums add dQ
    itself), into its staging buffer once the writer has handed the buffer back ("empty"),
    then to the writer ("full")."""
    for i in cutlass.range_constexpr(cute.size(dq)):
        dq[i] = dq[i] * scale
    cute.arch.barrier(barrier_id=DQ_EMPTY + half, number_of_threads=CONSUMER_AND_WRITER)
    cute.autovec_copy(dq, mma_dq.get_slice(mine).partition_C(dq_staged))
    cute.arch.fence_proxy("async.shared", space="cta")  # seen by TMA (async proxy)
    cute.arch.barrier_arrive(barrier_id=DQ_FULL + half, number_of_threads=CONSUMER_AND_WRITER)


@cute.jit
def consume(
    once_pipe, ring, mmas, stores, lse, delta, buffers, thread, warpgroup_index, b, g, group,
    n_block, tiles, s_q, s_k, scale_log2, scale, head_dim: cutlass.Constexpr,
    block_m: cutlass.Constexpr, stages: cutlass.Constexpr, causal: cutlass.Constexpr,
):  # fmt: skip
    """A consumer warpgroup: its 64 keys' dK and dV over the group's query heads in order and
    their query tiles, each tile's dQ half handed to the writer; then dK scale and dV."""
    mma_kq, mma_acc, overwrite, mma_dq, overwrite_dq = mmas
    k_smem, v_smem, q_smem, do_smem, ds_smem, staging, stats_smem = buffers
    tma_dk, DK_tma, tma_dv, DV_tma = stores
    half = warpgroup_index - 1  # which 64 keys of the block, and which half of D of dQ
    mine = thread % WARPGROUP_THREADS
    first_key = n_block * BLOCK_N + half * WGMMA_M
    kq_thread, acc_thread = mma_kq.get_slice(mine), mma_acc.get_slice(mine)
    dq_thread = mma_dq.get_slice(mine)
    d_half = head_dim // CONSUMER_WARPGROUPS
    # K's two 64-key halves seen as (D, keys, key half), this warpgroup's half of D: the B
    # operand of dS K, with D as its N and the keys as its K (MN-major, as `transposed`).
    k_t = cute.composition(
        k_smem,
        cute.make_layout(((d_half, CONSUMER_WARPGROUPS), WGMMA_M, CONSUMER_WARPGROUPS),
                         stride=((WGMMA_M, WGMMA_M * d_half), 1, WGMMA_M * head_dim)),
    )[(None, half), None, None]  # fmt: skip
    frags = (
        mma_kq.make_fragment_A(kq_thread.partition_A(k_smem[None, None, half])),
        mma_kq.make_fragment_A(kq_thread.partition_A(v_smem[None, None, half])),
        mma_kq.make_fragment_B(kq_thread.partition_B(q_smem)),
        mma_kq.make_fragment_B(kq_thread.partition_B(do_smem)),
        mma_acc.make_fragment_B(
            acc_thread.partition_B(transposed(q_smem, head_dim, block_m, stages))
        ),
        mma_acc.make_fragment_B(
            acc_thread.partition_B(transposed(do_smem, head_dim, block_m, stages))
        ),
        mma_dq.make_fragment_A(dq_thread.partition_A(ds_smem)),
        mma_dq.make_fragment_B(dq_thread.partition_B(k_t)),
    )  # fmt: skip
    boxes = d_half // DQ_BOX
    stats = stats_smem[None, None, half]  # this warpgroup's own: (STATS, parity)
    # This warpgroup's (queries, D / 2) of dQ onto its staging boxes (queries, 32).
    dq_staged = cute.composition(
        staging,
        cute.make_layout((block_m, (DQ_BOX, boxes), CONSUMER_WARPGROUPS),
                         stride=(1, (block_m, block_m * DQ_BOX), block_m * DQ_BOX * boxes)),
    )[None, None, half]  # fmt: skip
    views = (
        # dS^T's (keys, queries) onto the dS buffers' (queries, keys, slot).
        cute.composition(
            ds_smem,
            cute.make_layout((WGMMA_M, block_m, 2 * CONSUMER_WARPGROUPS),
                             stride=(block_m, 1, block_m * WGMMA_M)),
        ),
        dq_staged,
        stats,
    )  # fmt: skip
    score_shape = kq_thread.partition_shape_C((WGMMA_M, block_m))
    scores_t = cute.make_rmem_tensor(score_shape, cutlass.Float32)
    dp_t = cute.make_rmem_tensor(score_shape, cutlass.Float32)
    acc_shape = acc_thread.partition_shape_C((WGMMA_M, head_dim))
    dk = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
    dv = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
    dq = cute.make_rmem_tensor(dq_thread.partition_shape_C((block_m, d_half)), cutlass.Float32)
    dk.fill(0.0)
    dv.fill(0.0)
    for mma in (mma_kq, mma_acc, mma_dq):
        mma.set(warpgroup.Field.ACCUMULATE, True)
    for mma in (overwrite, overwrite_dq):  # S^T's, dP^T's and dQ's first k step
        mma.set(warpgroup.Field.ACCUMULATE, False)
    score_coords = by_rows(kq_thread.partition_C(cute.make_identity_tensor((WGMMA_M, block_m))))

    # The first tile's statistics (its parity is 0), seen by the warpgroup after the barrier.
    first_h, last_h = g * group, g * group + group - 1
    walk_first = walk_start(tiles, causal)
    stage_stats(fetch_stats(lse, delta, b, first_h, walk_first, s_q, mine, block_m), stats, 0,
                walk_first, s_q, mine, block_m)  # fmt: skip
    cute.arch.barrier(barrier_id=DS_READY, number_of_threads=CONSUMERS)
    once_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
    once_pipe.consumer_wait(once_state)  # K and V have landed
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    for head in cutlass.range(group, unroll=1):  # the group's query heads, in order
        visit = functools.partial(
            backward_query_tile, mmas=mmas, frags=frags, views=views, scores_t=scores_t,
            dp_t=dp_t, dk=dk, dv=dv, dq=dq, lse=lse, delta=delta, b=b, h=first_h + head,
            last_h=last_h, tiles=tiles, score_coords=score_coords, first_key=first_key,
            s_q=s_q, s_k=s_k, scale_log2=scale_log2, scale=scale, half=half, mine=mine,
            block_m=block_m, causal=causal,
        )  # fmt: skip
        for lo, hi, masked, _ in walk(tiles):
            state = consume_tiles(ring, state, lo, hi, visit, masked)
    ds_frag, k_t_frag = frags[-2:]  # dQ's operands
    issue_dq(state.count, mma_dq, overwrite_dq, dq, ds_frag, k_t_frag)  # the walk's last tile's
    warpgroup.wait_group(0)
    if state.count > 0:
        hand_over(dq, mma_dq, dq_staged, scale, half, mine)

    # dK and dV go into this warpgroup's halves of K's and V's buffers. V's half was read by
    # this warpgroup's dP^T only, K's by its S^T and by both consumers' dQ wgmmas: both have
    # waited for theirs once they meet here.
    cute.arch.barrier(barrier_id=DS_READY, number_of_threads=CONSUMERS)
    for i in cutlass.range_constexpr(cute.size(dk)):
        dk[i] = dk[i] * scale
    store_accumulator(dk, k_smem, half, mine, mma_acc, tma_dk, DK_tma[None, None, g, b], n_block,
                      head_dim)  # fmt: skip
    store_accumulator(dv, v_smem, half, mine, mma_acc, tma_dv, DV_tma[None, None, g, b], n_block,
                      head_dim)  # fmt: skip


@cute.kernel
def attention_backward_kernel(
    tma_k: cute.CopyAtom, K_tma: cute.Tensor, tma_v: cute.CopyAtom, V_tma: cute.Tensor,
    tma_q: cute.CopyAtom, Q_tma: cute.Tensor, tma_do: cute.CopyAtom, DO_tma: cute.Tensor,
    tma_dk: cute.CopyAtom, DK_tma: cute.Tensor, tma_dv: cute.CopyAtom, DV_tma: cute.Tensor,
    tma_add: cute.CopyAtom, DQ_sum: cute.Tensor, semaphores: cute.Tensor,
    lse: cute.Tensor, delta: cute.Tensor, scale_log2: cutlass.Float32, scale: cutlass.Float32,
    s_q: cutlass.Int32, s_k: cutlass.Int32, heads_kv: cutlass.Int32, group: cutlass.Int32,
    n_blocks: cutlass.Int32, mma_kq: cute.TiledMma, mma_acc: cute.TiledMma,
    overwrite: cute.TiledMma, mma_dq: cute.TiledMma, overwrite_dq: cute.TiledMma,
    half_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
    ds_layout: cute.ComposedLayout, staging_layout: cute.ComposedLayout,
    dtype: cutlass.Constexpr, head_dim: cutlass.Constexpr[int],
    block_m: cutlass.Constexpr[int], stages: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):  # fmt: skip
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    warpgroup_index = cute.arch.make_warp_uniform(thread // WARPGROUP_THREADS)
    # Key block fastest, the last first (the dQ order: a block waits only on blocks launched
    # before it), then KV head, then batch.
    n_block = n_blocks - 1 - block % n_blocks
    g = block // n_blocks % heads_kv
    b = block // n_blocks // heads_kv
    tiles = query_tiles(n_block, n_blocks, s_q, s_k, block_m, causal)
    if warp == 0:
        for atom in (tma_k, tma_v, tma_q, tma_do, tma_dk, tma_dv, tma_add):
            cpasync.prefetch_descriptor(atom)

    smem = SmemAllocator()
    barriers = stage_barriers(smem, stages)
    k_smem, v_smem = allocate(smem, dtype, half_layout, 2)
    q_smem, do_smem = allocate(smem, dtype, ring_layout, 2)
    (ds_smem,) = allocate(smem, dtype, ds_layout, 1)
    (staging,) = allocate(smem, cutlass.Float32, staging_layout, 1)
    stats_smem = smem.allocate_tensor(
        cutlass.Float32, cute.make_layout((STATS, 2, CONSUMER_WARPGROUPS)), byte_alignment=16
    )
    half_bytes = cute.size_in_bytes(dtype, half_layout)  # both halves
    tile_bytes = cute.size_in_bytes(dtype, cute.slice_(ring_layout, (None, None, 0)))
    once_pipe, ring = pipelines(barriers, 2 * half_bytes, 2 * tile_bytes, stages)

    if warpgroup_index == 0:
        cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
        if warp == 0:
            once = [
                (tma, *tma_tiles(tma, T[None, None, g, b], buffers, WGMMA_M, head_dim))
                for tma, T, buffers in ((tma_k, K_tma, k_smem), (tma_v, V_tma, v_smem))
            ]
            load_once(once_pipe, once, n_block)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            for head in cutlass.range(group, unroll=1):  # the consumers' order exactly
                h = g * group + head
                loads = [(tma, *tma_tiles(tma, T[None, None, h, b], buffers, block_m, head_dim))
                         for tma, T, buffers in ((tma_q, Q_tma, q_smem),
                                                 (tma_do, DO_tma, do_smem))]  # fmt: skip
                for lo, hi, _, _ in walk(tiles):
                    state = load_tiles(ring, state, loads, lo, hi)
            ring.producer_tail(state)
        if warp == WRITER_WARP:
            write_dq(tma_add, DQ_sum, staging, semaphores, b, g, group, n_block, n_blocks, tiles,
                     s_q, s_k, block_m, head_dim, causal)  # fmt: skip
    else:
        cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
        consume(once_pipe, ring, (mma_kq, mma_acc, overwrite, mma_dq, overwrite_dq),
                (tma_dk, DK_tma, tma_dv, DV_tma), lse, delta,
                (k_smem, v_smem, q_smem, do_smem, ds_smem, staging, stats_smem), thread,
                warpgroup_index,
                b, g, group, n_block, tiles, s_q, s_k, scale_log2, scale, head_dim, block_m,
                stages, causal)  # fmt: skip


# The launch -----------------------------------------------------------------------------------


def tma_atom(op, t, seq, heads, batch, layout, rows, columns):
    """A TMA atom (and its coordinate tensor) for tiles of `rows` x `columns` of t, a (B, S, H,
    D) tensor, into or out of one slot of `layout`."""
    return cpasync.make_tiled_tma_atom(
        op, seq_major(t, seq, heads, batch), cute.slice_(layout, (None, None, 0)),
        (rows, columns),
    )  # fmt: skip


def sums(causal):
    """How many float32 dQ sums the backward adds into (`blocks_before`): without a mask two,
    the tiles a block visits before it wraps around and those after."""
    return 1 if causal else 2


@cute.jit
def launch_backward(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
    do: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, delta: cute.Tensor, dq_sum: cute.Tensor,
    semaphores: cute.Tensor, scale_log2: cutlass.Float32, scale: cutlass.Float32,
    stream: cuda.CUstream, head_dim: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool],
):  # fmt: skip
    """The backward over (B, S, H, D) operands with 16-byte aligned bases and positive batch,
    sequence and head strides that are multiples of 16 bytes (TMA's rules; cute_impl checks),
    into dK, dV and dq_sum: delta_kernel, then (same stream) attention_backward_kernel. Scratch:
    delta (B, H, S_q) float32; dq_sum (B, S_q, H, SUMS D) float32, rows 16-byte aligned;
    semaphores (B, H, SUMS, ceil(S_q / 64)) int32 (`sums`). dQ = the sum of the sums (each D
    columns), rounded, is the caller's."""
    block_m, stages = TILES[head_dim]
    dtype = q.element_type
    batch = cutlass.Int32(cute.size(q, mode=[0]))
    s_q, heads = cutlass.Int32(cute.size(q, mode=[1])), cutlass.Int32(cute.size(q, mode=[2]))
    s_k, heads_kv = cutlass.Int32(cute.size(k, mode=[1])), cutlass.Int32(cute.size(k, mode=[2]))

    rows = batch * s_q * heads
    delta_kernel(o, do, delta, dq_sum, semaphores, rows, s_q, heads, block_m, head_dim,
                 sums(causal)).launch(
        grid=[(rows + DELTA_WARPS - 1) // DELTA_WARPS, 1, 1], block=[DELTA_WARPS * 32, 1, 1],
        stream=stream,
    )  # fmt: skip

    # K, V, dK and dV in 64-row halves; Q and dO in a ring of block_m-query tiles; dS^T in
    # four buffers (two parities x two consumers), queries contiguous (dQ's MN-major A); dQ
    # staged in float32 boxes of block_m x DQ_BOX.
    load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
    half_layout, ring_layout = smem_layouts(dtype, head_dim, block_m, stages)
    ds_layout = sm90_utils.make_smem_layout_a(
        LayoutEnum.COL_MAJOR, (block_m, head_dim, WGMMA_M), dtype, 2 * CONSUMER_WARPGROUPS
    )
    staging_layout = sm90_utils.make_smem_layout_epi(
        cutlass.Float32, LayoutEnum.ROW_MAJOR, (block_m, DQ_BOX), head_dim // DQ_BOX
    )
    by_key = [tma_atom(op, t, s_k, heads_kv, batch, half_layout, WGMMA_M, head_dim)
              for op, t in ((load, k), (load, v), (store, dk), (store, dv))]  # fmt: skip
    by_query = [tma_atom(load, t, s_q, heads, batch, ring_layout, block_m, head_dim)
                for t in (q, do)]  # fmt: skip
    tma_add, DQ_sum = tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), dq_sum, s_q, heads,
                               batch, staging_layout, block_m, DQ_BOX)  # fmt: skip
    mma_kq, mma_acc = tiled_mmas(dtype, head_dim, block_m)
    overwrite, _ = tiled_mmas(dtype, head_dim, block_m)  # S^T's and dP^T's first k step
    # dQ = dS K: dS from shared memory, queries contiguous, and K seen with D contiguous, both
    # MN-major; a consumer's half of D.
    mma_dq, overwrite_dq = (
        sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.MN, OperandMajorMode.MN, cutlass.Float32, (1, 1, 1),
            tiler_mn=(block_m, head_dim // CONSUMER_WARPGROUPS),
        )
        for _ in range(2)
    )  # fmt: skip
    (tma_k, K_tma), (tma_v, V_tma), (tma_dk, DK_tma), (tma_dv, DV_tma) = by_key
    (tma_q, Q_tma), (tma_do, DO_tma) = by_query
    n_blocks = (s_k + BLOCK_N - 1) // BLOCK_N
    attention_backward_kernel(
        tma_k, K_tma, tma_v, V_tma, tma_q, Q_tma, tma_do, DO_tma, tma_dk, DK_tma, tma_dv,
        DV_tma, tma_add, DQ_sum, semaphores, lse, delta, scale_log2, scale, s_q, s_k, heads_kv,
        heads // heads_kv, n_blocks, mma_kq, mma_acc, overwrite, mma_dq, overwrite_dq,
        half_layout, ring_layout, ds_layout, staging_layout, dtype, head_dim, block_m, stages,
        causal,
    ).launch(grid=[n_blocks * heads_kv * batch, 1, 1], block=[THREADS, 1, 1], stream=stream,
             min_blocks_per_mp=ONE_BLOCK_AN_SM)  # fmt: skip
