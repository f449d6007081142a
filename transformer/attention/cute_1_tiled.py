"""Attention in the CuTe DSL, step 1: a tiled FlashAttention-2 forward on warp-level MMA.

Per batch b, query head h (key and value head g = h // (H / H_kv)) and block of BLOCK_M queries,
with c = scale log2 e (one float32 constant):

    for each tile of BLOCK_N keys:       S = Q K^T                  (float32, tensor cores)
                                         m_new = max(m, c max_j S_ij)          (log2 units)
                                         P = exp2(c S - m_new)       (ex2.approx.ftz.f32)
                                         l = l exp2(m - m_new) + sum_j P_ij
                                         O = O exp2(m - m_new) + round(P) V    (float32)
    O = O / l        lse = (m + log2 l) ln 2                   (the natural log, float32)

round(P) is P rounded to the input dtype: the tensor cores multiply 16-bit operands, so P is
rounded once and used straight from registers as the A operand of P V (README.md's bound
counts that rounding as u_in). Keys past S_k and, causal, right of the bottom-right-aligned
diagonal (query i sees key j when j <= i + S_k - S_q) are set to -inf before the max, so their
P is exactly 0. A row that sees no key keeps m = -inf and l = 0: O = 0 and lse = -inf, as
reference.py defines it.

The map (one block of WARPS = 4 warps, 128 threads, per BLOCK_M = 64 queries of one head):

- The products use mma.sync.m16n8k16 (`cute.nvgpu.warp.MmaF16BF16Op`, the Ampere
  instruction, which sm_90a still runs): a warp multiplies 16 rows at a time. The 4 warps
  stand side by side along the queries: warp w owns query rows [16 w, 16 w + 16) of the
  block, for S and for O, and never needs another warp's rows. Within the warp, a row's S and
  O values live in the 4 lanes of a quad (lane // 4), two adjacent columns at a time, so its
  max and sum are reduced by two butterfly shuffles within the quad.
- Shared memory holds Q (BLOCK_M x D, loaded once) and STAGES = 2 buffers each of K and V
  (BLOCK_N x D): tile i + 2 is copied by cp.async (16 bytes a thread, L1 bypassed) while the
  warps multiply tiles i and i + 1, so the copies have a whole tile of work to land behind.
  Every buffer is laid out in 8-row x 64-column atoms (128 bytes a row) with the 16-byte
  chunks of row r XOR-swizzled by r mod 8: ldmatrix reads one 16-byte chunk from each of 8
  rows at once, and unswizzled those 8 chunks would sit in the same 4 banks (an 8-way
  conflict); swizzled they cover all 32.
- Shared memory to registers goes through ldmatrix (x4: four 8x8 matrices a warp-wide
  instruction), transposed for V, whose D dimension must be the B operand's N.
- S stays in registers (BLOCK_M x BLOCK_N float32 over 128 threads: 32 a thread at 64 x 64),
  and so does the accumulator O (BLOCK_M x D / 128: 64 a thread at D = 128). The registers
  set the tiles (`TILES`, ptxas -v for sm_90a): 64 x 64 needs 206-211 registers a thread at
  D = 128 and 168 at D = 64, no spills; 128 x 64 (two 16-row slabs a warp, each K and V
  fragment used twice) reached 255 registers and spilled 80-124 bytes at D = 128 and causal
  D = 64. Shared memory is 80 KB at D = 128 (40 KB at D = 64): two blocks (three at D = 64)
  share an SM, so one block's softmax runs while another's products do.
- The key loop runs in two parts, as the Triton kernel's: the whole tiles left of every
  row's diagonal without a mask (`masked` False, no comparisons built), then the tail past
  S_k's last whole tile and the causal diagonal band with one. A causal block stops at the
  last key its last row sees, and causal blocks are launched last query block first, so the
  short ones fill the end of the grid.
- The epilogue writes O through shared memory (Q's buffer, free by then) so that each thread
  stores 16 contiguous bytes at once; lse is written by the first lane of each quad.

Rows of Q, K, V past S_q or S_k are filled with zeros in shared memory instead of copied: K's
are masked anyway, but a garbage V row times P = 0 could be NaN. Offsets are 64-bit: the
strides are Int64, so b * stride_b and the tile offsets are formed in 64 bits.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.memory import SmemAllocator

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
WARPS = 4
THREADS = 32 * WARPS
MMA_SHAPE = (16, 8, 16)  # mma.sync.m16n8k16: 16 query rows x 8 columns x 16 summed a warp
STAGES = 2  # K and V buffers: one tile multiplied while the next one lands
VECTOR_BITS = 128  # a cp.async, a 128-bit shared load or global store: 8 16-bit elements
VECTOR_ELEMS = VECTOR_BITS // 16
# Shared-memory atom: 8 rows of 64 16-bit elements (128 bytes, all 32 banks), its 8 chunks of 16
# bytes XOR-swizzled by the row. The swizzle rides on the shared-memory pointer, so it acts on
# byte addresses: Swizzle(3 bits of chunk, 4 bits of byte within a 16-byte chunk, shift 3), the
# S<3,4,3> of the Hopper helpers' 128-byte atoms. (S<3,3,3> there moved 8-byte halves: every
# 16-byte cp.async and ldmatrix row then straddled two chunks, a misaligned address.)
ATOM_ROWS, ATOM_COLUMNS = 8, 64
# Tiles (BLOCK_M queries, BLOCK_N keys) per head dimension: the head dimensions the kernel is
# built for. Others go to the Triton kernel (cute_impl.py says so).
TILES = {64: (64, 64), 128: (64, 64)}
# The lowest float32: a row that has seen only masked keys (max -inf) shifts by it instead, so
# exp2(-inf - shift) = 0 rather than exp2(-inf + inf) = NaN.
LOWEST = -3.4028234663852886e38


@cute.jit
def quad_reduce(value, op):
    """op over the 4 lanes of a quad (lane // 4 equal): the lanes that share a query row."""
    value = op(value, cute.arch.shuffle_sync_bfly(value, offset=2))
    return op(value, cute.arch.shuffle_sync_bfly(value, offset=1))


def by_rows(tensor):
    """An MMA accumulator partition ((column pair, row half), MMA_M, MMA_N) seen as (rows,
    columns): row index (row half, MMA_M), column index (column pair, MMA_N). The C fragment
    of m16n8k16 gives a thread two adjacent columns of row r and of row r + 8."""
    compact = cute.make_layout(tensor.layout.shape)
    (pair, half), mma_m, mma_n = compact.shape
    (pair_stride, half_stride), m_stride, n_stride = compact.stride
    rows_columns = cute.make_layout(
        ((half, mma_m), (pair, mma_n)), stride=((half_stride, m_stride), (pair_stride, n_stride))
    )
    return cute.make_tensor(tensor.iterator, cute.composition(tensor.layout, rows_columns))


def as_a_operand(p):
    """P ((column pair, row half), MMA_M, MMA_N) as the A operand of the next product:
    ((column pair, row half, 2), MMA_M, MMA_N / 2). An A fragment of m16n8k16 spans 16
    columns (the k of P V), the C fragments of two neighbouring 8-column tiles."""
    split = cute.logical_divide(p.layout, (None, None, 2))
    return cute.make_tensor(
        p.iterator,
        cute.make_layout(
            ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
            stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1]),
        ),
    )


@cute.jit
def load_rows(tiled_copy, source, target, coords, first_row, rows):
    """cp.async this thread's part of a tile (source, target: (copy, row, column) partitions;
    coords: the tile's (row, column) coordinates likewise) for rows first_row + r < rows;
    zeros into the slots of rows past the end."""
    for r in cutlass.range_constexpr(cute.size(source, mode=[1])):
        if first_row + coords[0, r, 0][0] < rows:
            cute.copy(tiled_copy, source[None, r, None], target[None, r, None])
        else:
            target[None, r, None].fill(0)


@cute.jit
def load_key_tile(kv, tile, stage, block_n: cutlass.Constexpr[int], s_k):
    """cp.async key tile `tile` of K and V into buffer `stage` (their rows past S_k: zeros).
    kv: the cp.async copy, the K and V partitions (copy, row, column, tile or stage) of global
    and shared memory, and the tile's coordinates."""
    load_copy, k_source, v_source, k_target, v_target, coords = kv
    first_key = tile * block_n
    load_rows(load_copy, k_source[None, None, None, tile], k_target[None, None, None, stage],
              coords, first_key, s_k)  # fmt: skip
    load_rows(load_copy, v_source[None, None, None, tile], v_target[None, None, None, stage],
              coords, first_key, s_k)  # fmt: skip


@cute.jit
def key_limit(row, s_q, s_k, causal: cutlass.Constexpr):
    """Query row i sees the keys j < key_limit: those inside S_k and, causal, up to its
    bottom-right-aligned diagonal, j <= i + S_k - S_q."""
    limit = s_k
    if cutlass.const_expr(causal):
        limit = cutlass.min(s_k, row + 1 + s_k - s_q)
    return limit


@cute.jit
def mask_scores(scores, coords, first_row, first_key, s_q, s_k, causal: cutlass.Constexpr,
                fill=-cutlass.Float32.inf):  # fmt: skip
    """Scores (rows x columns view) of keys past S_k or, causal, past row i's last visible key
    (i + S_k - S_q) set to `fill`: -inf before the softmax (the forward), 0 for probabilities
    already exponentiated (the backward, whose rows that see no key have lse = -inf)."""
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        limit = key_limit(first_row + coords[r, 0][0], s_q, s_k, causal)
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            if first_key + coords[0, c][1] >= limit:
                scores[r, c] = fill


@cute.jit
def online_softmax(scores, acc, row_max, row_sum, scale_log2):
    """One key tile into the running softmax of the thread's rows: `softmax_rows`, then the
    accumulator rescaled by exp2(m_old - m) (`rescale_rows`)."""
    rescale = cute.make_rmem_tensor(cute.size(scores, mode=[0]), cutlass.Float32)
    softmax_rows(scores, row_max, row_sum, rescale, scale_log2)
    rescale_rows(acc, rescale)


@cute.jit
def softmax_rows(scores, row_max, row_sum, rescale, scale_log2):
    """The tile's max over the quad, the new max m (log2 units), scores replaced by
    P = exp2(c S - m), the thread's part of the row sum, and in `rescale` the factor
    exp2(m_old - m) the accumulator's rows still owe. The row sums stay partial per thread
    until the end (each adds its own columns): one quad reduction instead of one a tile."""
    for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
        tile_max = -cutlass.Float32.inf
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            tile_max = cute.arch.fmax(tile_max, scores[r, c])
        tile_max = quad_reduce(tile_max, cute.arch.fmax)
        # scale > 0: the max of the scaled scores is the scaled max
        new_max = cute.arch.fmax(row_max[r], tile_max * scale_log2)
        shift = cute.arch.fmax(new_max, LOWEST)
        rescale[r] = cute.math.exp2(row_max[r] - shift, fastmath=True)
        tile_sum = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            p = cute.math.exp2(scores[r, c] * scale_log2 - shift, fastmath=True)
            scores[r, c] = p
            tile_sum = tile_sum + p
        row_sum[r] = row_sum[r] * rescale[r] + tile_sum
        row_max[r] = new_max


@cute.jit
def rescale_rows(acc, rescale):
    """Each row of the accumulator (a rows-by-columns view) times its factor."""
    for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            acc[r, c] = acc[r, c] * rescale[r]


@cute.jit
def key_tile(
    tile, n_tiles, kv, smem, mma, acc, row_max, row_sum, first_row, s_q, s_k, scale_log2,
    masked: cutlass.Constexpr[bool], causal: cutlass.Constexpr[bool],
):  # fmt: skip
    """Key tile `tile` (in buffer tile % STAGES) into O, then the copies of tile + STAGES into
    the buffer it frees. kv, smem and mma are the kernel's tuples of this thread's partitions:
    the cp.async copies, the ldmatrix views and fragments, the MMA and the tile's shape."""
    q_view, q_regs, k_view, k_regs, v_view, v_regs, copies = smem
    tiled_mma, block_n, score_shape, score_coords, dtype = mma
    q_copy, k_copy, v_copy = copies
    stage = tile % STAGES
    # This thread's copies of the tile have landed (all groups but the newest, tile + 1's);
    # the barrier says every thread's have.
    cute.arch.cp_async_wait_group(STAGES - 1)
    cute.arch.sync_threads()
    scores = cute.make_rmem_tensor(score_shape, cutlass.Float32)
    scores.fill(0.0)
    for kk in cutlass.range_constexpr(cute.size(q_view, mode=[2])):  # D in steps of 16
        cute.copy(q_copy, q_view[None, None, kk], q_regs[0][None, None, kk])
        cute.copy(k_copy, k_view[None, None, kk, stage], k_regs[0][None, None, kk])
        cute.gemm(tiled_mma, scores, q_regs[1][None, None, kk], k_regs[1][None, None, kk], scores)
    score_rows = by_rows(scores)
    if cutlass.const_expr(masked):
        mask_scores(score_rows, score_coords, first_row, tile * block_n, s_q, s_k, causal)
    online_softmax(score_rows, by_rows(acc), row_max, row_sum, scale_log2)
    p = cute.make_rmem_tensor_like(scores, dtype)
    p.store(scores.load().to(dtype))  # round(P): the A operand, straight from registers
    p_operand = as_a_operand(p)
    for kk in cutlass.range_constexpr(cute.size(p_operand, mode=[2])):  # keys in steps of 16
        cute.copy(v_copy, v_view[None, None, kk, stage], v_regs[0][None, None, kk])
        cute.gemm(tiled_mma, acc, p_operand[None, None, kk], v_regs[1][None, None, kk], acc)
    cute.arch.sync_threads()  # every warp is done with this buffer before it is refilled
    if tile + STAGES < n_tiles:
        load_key_tile(kv, tile + STAGES, stage, block_n, s_k)
    cute.arch.cp_async_commit_group()  # empty past the last tile: the group count stays even


@cute.jit
def query_block(block, m_blocks, heads, group, causal: cutlass.Constexpr):
    """(query block, head, batch, KV head) of block `block` of the flat grid: one grid
    dimension (no 65535 limit on batch or heads), query block fastest, then head, then batch.
    Causal: the last query blocks see the most keys, so they go first."""
    m_block = block % m_blocks
    if cutlass.const_expr(causal):
        m_block = m_blocks - 1 - m_block
    h = block // m_blocks % heads
    return m_block, h, block // m_blocks // heads, h // group


@cute.jit
def key_tiles(first_row, s_q, s_k, block_m: cutlass.Constexpr, block_n: cutlass.Constexpr,
              causal: cutlass.Constexpr):  # fmt: skip
    """(n_tiles, full_tiles) for the block of queries [first_row, first_row + block_m): key
    tiles [0, full_tiles) need no mask (whole tiles inside S_k and, causal, left of the first
    row's diagonal), [full_tiles, n_tiles) are the tail and the diagonal band; a causal block
    stops at the last key its last row sees."""
    end = s_k
    full_end = s_k // block_n * block_n
    if cutlass.const_expr(causal):
        diagonal = first_row + s_k - s_q  # the last key row first_row sees
        end = cutlass.min(s_k, cutlass.max(diagonal + block_m, 0))
        full_end = cutlass.min(full_end, cutlass.max(diagonal + 1, 0) // block_n * block_n)
    return (end + block_n - 1) // block_n, full_end // block_n


@cute.jit
def finish_rows(acc_rows, row_max, row_sum, score_coords, first_row, s_q, lse, b, h, lane):
    """The forward's last step for the thread's rows (acc_rows: the accumulator as rows x
    columns, `by_rows` of the step's MMA): the quads' row sums l, O / l (0 where no key was
    seen), and lse = (m + log2 l) ln 2, written by the first lane of each quad for the rows
    inside S_q."""
    for r in cutlass.range_constexpr(cute.size(row_sum)):
        total = quad_reduce(row_sum[r], lambda x, y: x + y)
        inverse = cutlass.Float32(0.0)
        if total > 0.0:  # a NaN total fails too: the NaN is in the accumulator already
            inverse = cutlass.Float32(1.0) / total
        for c in cutlass.range_constexpr(cute.size(acc_rows, mode=[1])):
            acc_rows[r, c] = acc_rows[r, c] * inverse
        row = first_row + score_coords[r, 0][0]
        if lane % 4 == 0 and row < s_q:
            lse[b, h, row] = (row_max[r] + cute.math.log2(total)) * LN2


@cute.kernel
def attention_forward_kernel(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
    scale_log2: cutlass.Float32, s_q: cutlass.Int32, s_k: cutlass.Int32, heads: cutlass.Int32,
    group: cutlass.Int32, m_blocks: cutlass.Int32, tiled_mma: cute.TiledMma,
    load_copy: cute.TiledCopy, store_copy: cute.TiledCopy, q_layout: cute.ComposedLayout,
    kv_layout: cute.ComposedLayout, head_dim: cutlass.Constexpr[int],
    block_m: cutlass.Constexpr[int], block_n: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):  # fmt: skip
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    m_block, h, b, g = query_block(block, m_blocks, heads, group, causal)
    first_row = m_block * block_m
    dtype = q.element_type
    n_tiles, full_tiles = key_tiles(first_row, s_q, s_k, block_m, block_n, causal)

    # The block's tiles in global memory: Q (block_m, D), K and V (block_n, D, tile).
    q_tile = cute.local_tile(q[b, None, h, None], (block_m, head_dim), (m_block, 0))
    k_tiles = cute.local_tile(k[b, None, g, None], (block_n, head_dim), (None, 0))
    v_tiles = cute.local_tile(v[b, None, g, None], (block_n, head_dim), (None, 0))

    smem = SmemAllocator()
    # 1024-byte alignment: the swizzle pattern repeats every 8 rows of 128 bytes.
    q_smem = smem.allocate_tensor(dtype, q_layout.outer, byte_alignment=1024,
                                  swizzle=q_layout.inner)  # fmt: skip
    k_smem = smem.allocate_tensor(dtype, kv_layout.outer, byte_alignment=1024,
                                  swizzle=kv_layout.inner)  # fmt: skip
    v_smem = smem.allocate_tensor(dtype, kv_layout.outer, byte_alignment=1024,
                                  swizzle=kv_layout.inner)  # fmt: skip
    # V seen as (D, keys, stage): the B operand of P V has D as its N and the keys as its K.
    v_t_smem = cute.composition(
        v_smem,
        cute.make_layout((head_dim, block_n, STAGES), stride=(block_n, 1, block_n * head_dim)),
    )

    # Global -> shared copies (cp.async) and the coordinates their predicates read.
    thread_load = load_copy.get_slice(thread)
    q_source, q_target = thread_load.partition_S(q_tile), thread_load.partition_D(q_smem)
    k_source, k_target = thread_load.partition_S(k_tiles), thread_load.partition_D(k_smem)
    v_source, v_target = thread_load.partition_S(v_tiles), thread_load.partition_D(v_smem)
    q_coords = thread_load.partition_S(cute.make_identity_tensor((block_m, head_dim)))
    kv_coords = thread_load.partition_S(cute.make_identity_tensor((block_n, head_dim)))

    # The MMA's register fragments, and the ldmatrix copies that fill them from shared memory.
    thread_mma = tiled_mma.get_slice(thread)
    q_frag = thread_mma.make_fragment_A(thread_mma.partition_A(q_smem))
    k_frag = thread_mma.make_fragment_B(thread_mma.partition_B(k_smem[None, None, 0]))
    v_frag = thread_mma.make_fragment_B(thread_mma.partition_B(v_t_smem[None, None, 0]))
    ldmatrix = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
    ldmatrix_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
    q_copy = cute.make_tiled_copy_A(cute.make_copy_atom(ldmatrix, dtype), tiled_mma)
    k_copy = cute.make_tiled_copy_B(cute.make_copy_atom(ldmatrix, dtype), tiled_mma)
    v_copy = cute.make_tiled_copy_B(cute.make_copy_atom(ldmatrix_t, dtype), tiled_mma)
    q_thread, k_thread = q_copy.get_slice(thread), k_copy.get_slice(thread)
    v_thread = v_copy.get_slice(thread)
    q_view, k_view = q_thread.partition_S(q_smem), k_thread.partition_S(k_smem)
    v_view = v_thread.partition_S(v_t_smem)
    q_regs = (q_thread.retile(q_frag), q_frag)  # (the copy's view, the MMA's view)
    k_regs = (k_thread.retile(k_frag), k_frag)
    v_regs = (v_thread.retile(v_frag), v_frag)

    acc = cute.make_rmem_tensor(thread_mma.partition_shape_C((block_m, head_dim)), cutlass.Float32)
    acc.fill(0.0)
    score_shape = thread_mma.partition_shape_C((block_m, block_n))
    score_coords = by_rows(thread_mma.partition_C(cute.make_identity_tensor((block_m, block_n))))
    rows_held = cute.size(score_coords, mode=[0])  # 2 rows a 16-row slab, per slab of the block
    row_max = cute.make_rmem_tensor(rows_held, cutlass.Float32)
    row_sum = cute.make_rmem_tensor(rows_held, cutlass.Float32)
    row_max.fill(-cutlass.Float32.inf)
    row_sum.fill(0.0)

    # Prologue: Q with tile 0 (one group), tile 1 (the next), both in flight before any wait.
    load_rows(load_copy, q_source, q_target, q_coords, first_row, s_q)
    kv = (load_copy, k_source, v_source, k_target, v_target, kv_coords)
    for ahead in cutlass.range_constexpr(STAGES):
        if ahead < n_tiles:
            load_key_tile(kv, ahead, ahead, block_n, s_k)
        cute.arch.cp_async_commit_group()

    operands = (q_view, q_regs, k_view, k_regs, v_view, v_regs, (q_copy, k_copy, v_copy))
    mma = (tiled_mma, block_n, score_shape, score_coords, dtype)
    for tile in cutlass.range(full_tiles, unroll=1):
        key_tile(tile, n_tiles, kv, operands, mma, acc, row_max, row_sum, first_row, s_q, s_k,
                 scale_log2, False, causal)  # fmt: skip
    for tile in cutlass.range(full_tiles, n_tiles, unroll=1):
        key_tile(tile, n_tiles, kv, operands, mma, acc, row_max, row_sum, first_row, s_q, s_k,
                 scale_log2, True, causal)  # fmt: skip

    finish_rows(by_rows(acc), row_max, row_sum, score_coords, first_row, s_q, lse, b, h,
                thread % 32)  # fmt: skip
    # O rounded to the dtype, through Q's buffer, then 16 bytes a thread to global memory, rows
    # past S_q dropped. Q's copies may still be in flight in a block that saw no key tile (a
    # causal block of queries before every key): all of them land, and every warp is past its
    # last read of Q, before the buffer is overwritten.
    cute.arch.cp_async_wait_group(0)
    cute.arch.sync_threads()
    o_regs = cute.make_rmem_tensor_like(acc, dtype)
    o_regs.store(acc.load().to(dtype))
    to_smem = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype),
                                     tiled_mma)  # fmt: skip
    thread_to_smem = to_smem.get_slice(thread)
    cute.copy(to_smem, thread_to_smem.retile(o_regs), thread_to_smem.partition_D(q_smem))
    cute.arch.sync_threads()
    thread_store = store_copy.get_slice(thread)
    o_tile = cute.local_tile(o[b, None, h, None], (block_m, head_dim), (m_block, 0))
    o_source, o_target = thread_store.partition_S(q_smem), thread_store.partition_D(o_tile)
    o_staged = cute.make_rmem_tensor_like(o_source)
    cute.copy(store_copy, o_source, o_staged)
    for r in cutlass.range_constexpr(cute.size(o_target, mode=[1])):
        if first_row + q_coords[0, r, 0][0] < s_q:
            cute.copy(store_copy, o_staged[None, r, None], o_target[None, r, None])


def smem_layouts(head_dim, block_m, block_n):
    """(Q's, K's and V's) swizzled shared-memory layouts: (block_m, D) and (block_n, D,
    STAGES), tiled by the 8 x 64 atom."""
    atom = cute.make_composed_layout(
        cute.make_swizzle(3, 4, 3), 0,
        cute.make_layout((ATOM_ROWS, ATOM_COLUMNS), stride=(ATOM_COLUMNS, 1)),
    )  # fmt: skip
    q_layout = cute.tile_to_shape(atom, (block_m, head_dim), (0, 1))
    kv_layout = cute.tile_to_shape(atom, (block_n, head_dim, STAGES), (0, 1, 2))
    return q_layout, kv_layout


def vector_copy(op, dtype):
    """128 threads, 8 to a 64-element row (one 16-byte vector each): a 16 x 64 tile a pass."""
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=VECTOR_BITS)
    per_row = ATOM_COLUMNS // VECTOR_ELEMS
    threads = cute.make_layout((THREADS // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, VECTOR_ELEMS)))


@cute.jit
def launch_forward(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
    scale_log2: cutlass.Float32, stream: cuda.CUstream, head_dim: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):  # fmt: skip
    """The forward over (B, S, H, D) operands whose strides are multiples of 8 elements and
    bases 16-byte aligned (what cp.async and the 16-byte stores need; cute_impl checks)."""
    block_m, block_n = TILES[head_dim]
    dtype = q.element_type
    q_layout, kv_layout = smem_layouts(head_dim, block_m, block_n)
    load_copy = vector_copy(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype)
    store_copy = vector_copy(cute.nvgpu.CopyUniversalOp(), dtype)
    # 4 warps along the queries; the permutation makes a tile of the MMA 16 wide in N (two
    # 8-column atoms) so that one ldmatrix x4 loads the B operand of both.
    tiled_mma = cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, cutlass.Float32, MMA_SHAPE), (WARPS, 1, 1),
        permutation_mnk=(WARPS * MMA_SHAPE[0], 16, 16),
    )  # fmt: skip
    batch, s_q = cute.size(q, mode=[0]), cute.size(q, mode=[1])
    heads, s_k, heads_kv = cute.size(q, mode=[2]), cute.size(k, mode=[1]), cute.size(k, mode=[2])
    m_blocks = (s_q + block_m - 1) // block_m
    attention_forward_kernel(
        q, k, v, o, lse, scale_log2, s_q, s_k, heads, heads // heads_kv, m_blocks, tiled_mma,
        load_copy, store_copy, q_layout, kv_layout, head_dim, block_m, block_n, causal,
    ).launch(grid=[m_blocks * heads * batch, 1, 1], block=[THREADS, 1, 1],
             stream=stream)  # fmt: skip
