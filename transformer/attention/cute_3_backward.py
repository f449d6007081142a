"""Attention in the CuTe DSL, step 3: the backward on Hopper's TMA and wgmma, deterministic.

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
accumulators or in registers. The design is the Triton backward's (triton_impl.py, README.md's
"The backward rebuilt"): two kernels and no atomics, so every run gives the same bits.

1. The dQ kernel, one block per BLOCK_M = 128 queries of one head: delta of its rows (stored
   for kernel 2), then over the key tiles its rows see, S = Q K^T and dP = dO V^T (wgmmas
   from shared memory), P and dS in registers, dQ += dS K (dS rounded in registers as the A
   operand; K the B operand seen transposed, D contiguous: MN-major). dQ scale is stored.
2. The dK/dV kernel, one block per BLOCK_N = 128 keys of one KV head: for each query head of
   the group in order, over the query tiles that see its keys, the products transposed,
   S^T = K Q^T and dP^T = V dO^T, so that P^T and dS^T come out of the tensor cores in the
   accumulator layout that dV += P^T dO and dK += dS^T Q take as their register A operand
   (Q and dO seen transposed as MN-major B operands). No transpose goes through shared memory.

The map. Both kernels are step 2's (cute_2_wgmma.py) machinery: 384 threads, warpgroup 0 the
producer (one thread issues every TMA load; setmaxnreg down to 24 registers), warpgroups 1 and
2 the consumers (up to 240), each owning 64 rows of the block (queries in kernel 1, keys in
kernel 2) and issuing its own 64-row wgmmas; loads into 128-byte-swizzled shared memory,
completing on mbarriers (PipelineTmaAsync); the accumulators seen as rows by columns (step 2's
`by_rows`) for masks and row operations, regrouped as register A operands (`as_a_operand`);
the epilogue by stmatrix into a buffer nothing reads any more, then one TMA store a warpgroup.

- Kernel 1 loads Q, dO and O once (one barrier, a 64-row half a consumer), then K and V tile by
  tile into a ring of 3 stages. Each consumer thread holds dQ (64 x D / 128 floats: 64 at
  D = 128), S and dP (64 x BLOCK_N / 128 each: 32 at BLOCK_N = 64), dS rounded (half as many
  registers) and its 2 rows' lse and delta; delta is summed from dO and O in shared memory,
  D / 4 products a thread, then over the quad's 4 lanes. dQ is staged in Q's half. Shared
  memory: at D = 128, 64-key tiles, Q, dO, O 3 x 32 KB + 3 stages x (K, V 16 KB) = 192 KB; at
  D = 64, 128-key tiles, 3 x 16 + 3 x (16 + 16) = 144 KB.
- Kernel 2 loads K and V once (one barrier, a half a consumer), then Q and dO tile by tile,
  head after head of the group, into a ring of 3 stages. Each consumer thread holds dK and dV
  (64 x D / 128 floats each: 128 together at D = 128), S^T and dP^T (64 x BLOCK_M / 128 each:
  16 at BLOCK_M = 32), P^T and dS^T rounded, and its columns' lse and delta (BLOCK_M / 4 of
  each, read from global memory a tile, before the tile's wgmmas are issued: L1 and L2 serve
  the 8 warps alike). dK and dV are staged in K's and V's halves. Shared memory: at D = 128,
  32-query tiles, K, V 2 x 32 KB + 3 x (Q, dO 8 KB) = 112 KB; at D = 64, 64-query tiles,
  2 x 16 + 3 x (8 + 8) = 80 KB.
- Registers: `TILES` is what `ptxas -arch=sm_90a -v` fits in the consumers' 240 without
  spilling, fp16 and bf16, causal or not (test.py's test_cute_tiles_fit_the_registers checks
  the bf16 builds). Tried and spilled: dK/dV with 64-query tiles at D = 128 (8 bytes, causal)
  and 128-query tiles at D = 64 (368-620 bytes). dQ with 128-key tiles fits the registers at
  D = 128 too, but 2 stages of them beside Q, dO and O take 224 KB of the SM's 227: 64-key
  tiles are also what the Triton backward measured best (README.md); a GPU should decide.
- setmaxnreg needs the launch bound `min_blocks_per_mp=1` (.minnctapersm 1): without it
  ptxas could not tell the registers a thread has at entry for the dK/dV kernel at D = 64,
  ignored both setmaxnreg (its warning C7508) and spilled within the even share of 168.
- The loops are the Triton kernels' in two parts, with and without a mask. Kernel 1: whole key
  tiles left of the block's diagonal, then the tail past S_k (zero-filled keys would give
  P = 2^-lse) and the diagonal band; causal blocks are launched longest first. Kernel 2: the
  query tiles that hold the diagonal of its keys (masked), then those whose every row sees
  every key of the block; query rows past S_q read zeros (TMA fills them) and lse = delta = 0,
  so they add exactly 0, and keys past S_k only reach rows of dK and dV that TMA does not
  store: neither needs a mask.

Within a tile, the products overlap the row work where the data allow: S and dP (S^T and
dP^T) are issued together and P is computed while dP's wgmmas run; in kernel 2, dS^T while
dV's run. Not yet in it: lse and delta staged through shared memory by TMA, the products of one
tile overlapping the row work of the next (step 3's forward schedule) and the two consumers
taking turns; dQ computed in kernel 2's pass (one recomputation of S instead of two) needs
atomics or per-tile partials summed in order.
"""

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from cute_1_tiled import LOG2E, key_limit, key_tiles, mask_scores, quad_reduce, query_block
from cute_2_wgmma import (
    BLOCK_M,
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
    multiply,
    pipelines,
    seq_major,
    smem_layouts,
    stage_barriers,
    store_accumulator,
    tiled_mmas,
    tma_tiles,
    transposed,
)

__all__ = ["TILES", "launch_backward"]

# The dK/dV kernel's block of keys: a 64-row half for each consumer warpgroup.
BLOCK_N = CONSUMER_WARPGROUPS * WGMMA_M
# Tiles per head dimension: dQ's (keys a tile, stages), dK/dV's (queries a tile, stages); the
# registers set them (the docstring's map). Other head dimensions go to Triton.
TILES = {64: ((128, 3), (64, 3)), 128: ((64, 3), (32, 3))}
# Launched with .minnctapersm 1: without a bound on the blocks an SM, ptxas may not know the
# registers a thread has at entry, and then ignores every setmaxnreg (its warning C7508) and
# fits the consumers in the launch's even share of 168 (the dK/dV kernel at D = 64 spilled).
ONE_BLOCK_AN_SM = 1


@cute.jit
def query_stats(values, score_coords, first_query, s_q, along_rows: cutlass.Constexpr,
                to_log2: cutlass.Constexpr):  # fmt: skip
    """A register tensor of one head's lse (times log2 e when to_log2) or delta (values,
    float32 over S_q) at the thread's queries: first_query plus the row coordinates of its
    accumulator (along_rows, kernel 1) or its column coordinates (kernel 2's transposed
    products). 0 past S_q, where the zero-filled rows then add exactly 0."""
    count = cute.size(score_coords, mode=[0 if along_rows else 1])
    stats = cute.make_rmem_tensor(count, cutlass.Float32)
    for i in cutlass.range_constexpr(count):
        if cutlass.const_expr(along_rows):
            query = first_query + score_coords[i, 0][0]
        else:
            query = first_query + score_coords[0, i][1]
        value = cutlass.Float32(0.0)
        if query < s_q:
            value = values[query]
            if cutlass.const_expr(to_log2):
                value = value * LOG2E
        stats[i] = value
    return stats


# (1) dQ ---------------------------------------------------------------------------------------


@cute.jit
def row_deltas(do_half, o_half, score_coords, quad_lane, head_dim: cutlass.Constexpr):
    """delta = sum_d dO_d O_d (float32) of the thread's rows, from the warpgroup's 64-row halves
    of dO and O in shared memory: each lane of a quad sums every fourth column, then the quad
    adds its four partial sums (a fixed order: the same bits every run)."""
    rows_held = cute.size(score_coords, mode=[0])
    deltas = cute.make_rmem_tensor(rows_held, cutlass.Float32)
    for r in cutlass.range_constexpr(rows_held):
        row = score_coords[r, 0][0]
        partial = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(head_dim // 4):
            d_o, o = do_half[row, quad_lane + 4 * c], o_half[row, quad_lane + 4 * c]
            partial = partial + d_o.to(cutlass.Float32) * o.to(cutlass.Float32)
        deltas[r] = quad_reduce(partial, lambda x, y: x + y)
    return deltas


@cute.jit
def dq_key_tile(
    stage, tile, mmas, frags, scores, dp, dq, lse_log2, deltas, score_coords, first_row, s_q,
    s_k, scale_log2, block_n: cutlass.Constexpr, masked: cutlass.Constexpr,
    causal: cutlass.Constexpr,
):  # fmt: skip
    """Key tile `tile`, landed in ring stage `stage`, into this warpgroup's dQ."""
    mma_qk, mma_dq, overwrite = mmas
    q_frag, do_frag, k_frag, v_frag, k_t_frag = frags
    issue(mma_qk, scores, q_frag, k_frag[None, None, None, stage], overwrite)
    issue(mma_qk, dp, do_frag, v_frag[None, None, None, stage], overwrite)
    warpgroup.wait_group(1)  # S has landed; P is computed while dP's wgmmas run
    p_rows, dp_rows = by_rows(scores), by_rows(dp)
    for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(p_rows, mode=[1])):
            p_rows[r, c] = cute.math.exp2(p_rows[r, c] * scale_log2 - lse_log2[r], fastmath=True)
    if cutlass.const_expr(masked):  # after the exp2: a row that sees no key has lse = -inf
        mask_scores(p_rows, score_coords, first_row, tile * block_n, s_q, s_k, causal, 0.0)
    warpgroup.wait_group(0)
    for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(p_rows, mode=[1])):
            dp_rows[r, c] = p_rows[r, c] * (dp_rows[r, c] - deltas[r])  # dS, in dP's registers
    ds = cute.make_rmem_tensor_like(dp, mma_dq.op.a_dtype)
    ds.store(dp.load().to(mma_dq.op.a_dtype))  # round(dS): the A operand, from registers
    multiply(mma_dq, dq, as_a_operand(ds), k_t_frag[None, None, None, stage])


@cute.jit
def dq_consume(
    once_pipe, ring, mma_qk, mma_dq, overwrite, tma_dq, DQ_tma, lse, delta, buffers, thread,
    warpgroup_index, b, h, m_block, n_tiles, full_tiles, s_q, s_k, scale_log2, scale,
    head_dim: cutlass.Constexpr, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
    causal: cutlass.Constexpr,
):  # fmt: skip
    """A consumer warpgroup: its 64 query rows' delta, their dQ over every key tile of the
    block, then dQ scale."""
    q_smem, do_smem, o_smem, k_smem, v_smem = buffers
    half = warpgroup_index - 1  # which 64 rows of the block, and which half of the buffers
    mine = thread % WARPGROUP_THREADS
    first_row = m_block * BLOCK_M + half * WGMMA_M
    qk_thread, dq_thread = mma_qk.get_slice(mine), mma_dq.get_slice(mine)
    # Shared-memory operands are descriptors, the same for the whole warpgroup.
    frags = (
        mma_qk.make_fragment_A(qk_thread.partition_A(q_smem[None, None, half])),
        mma_qk.make_fragment_A(qk_thread.partition_A(do_smem[None, None, half])),
        mma_qk.make_fragment_B(qk_thread.partition_B(k_smem)),
        mma_qk.make_fragment_B(qk_thread.partition_B(v_smem)),
        mma_dq.make_fragment_B(
            dq_thread.partition_B(transposed(k_smem, head_dim, block_n, stages))
        ),
    )  # fmt: skip
    score_shape = qk_thread.partition_shape_C((WGMMA_M, block_n))
    scores = cute.make_rmem_tensor(score_shape, cutlass.Float32)
    dp = cute.make_rmem_tensor(score_shape, cutlass.Float32)
    dq = cute.make_rmem_tensor(dq_thread.partition_shape_C((WGMMA_M, head_dim)), cutlass.Float32)
    dq.fill(0.0)
    mma_qk.set(warpgroup.Field.ACCUMULATE, True)
    mma_dq.set(warpgroup.Field.ACCUMULATE, True)
    overwrite.set(warpgroup.Field.ACCUMULATE, False)  # S's and dP's first k step
    score_coords = by_rows(qk_thread.partition_C(cute.make_identity_tensor((WGMMA_M, block_n))))
    lse_log2 = query_stats(lse[b, h, None], score_coords, first_row, s_q, True, True)

    once_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
    once_pipe.consumer_wait(once_state)  # Q, dO and O have landed
    lane = thread % 32
    deltas = row_deltas(do_smem[None, None, half], o_smem[None, None, half], score_coords,
                        lane % 4, head_dim)  # fmt: skip
    for r in cutlass.range_constexpr(cute.size(deltas)):  # rows r and r + 8 of the warp's 16
        row = first_row + score_coords[r, 0][0]
        if lane % 4 == 0 and row < s_q:
            delta[b, h, row] = deltas[r]  # for kernel 2, launched after this one

    mmas = (mma_qk, mma_dq, overwrite)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    visit = functools.partial(
        dq_key_tile, mmas=mmas, frags=frags, scores=scores, dp=dp, dq=dq, lse_log2=lse_log2,
        deltas=deltas, score_coords=score_coords, first_row=first_row, s_q=s_q, s_k=s_k,
        scale_log2=scale_log2, block_n=block_n, causal=causal,
    )  # fmt: skip
    state = consume_tiles(ring, state, 0, full_tiles, visit, False)
    state = consume_tiles(ring, state, full_tiles, n_tiles, visit, True)

    for i in cutlass.range_constexpr(cute.size(dq)):
        dq[i] = dq[i] * scale
    # dQ into this warpgroup's half of Q's buffer: its S wgmmas, the only readers, completed.
    store_accumulator(dq, q_smem, half, mine, mma_dq, tma_dq, DQ_tma[None, None, h, b], m_block,
                      head_dim)  # fmt: skip


@cute.kernel
def attention_dq_kernel(
    tma_q: cute.CopyAtom, Q_tma: cute.Tensor, tma_do: cute.CopyAtom, DO_tma: cute.Tensor,
    tma_o: cute.CopyAtom, O_tma: cute.Tensor, tma_k: cute.CopyAtom, K_tma: cute.Tensor,
    tma_v: cute.CopyAtom, V_tma: cute.Tensor, tma_dq: cute.CopyAtom, DQ_tma: cute.Tensor,
    lse: cute.Tensor, delta: cute.Tensor, scale_log2: cutlass.Float32, scale: cutlass.Float32,
    s_q: cutlass.Int32, s_k: cutlass.Int32, heads: cutlass.Int32, group: cutlass.Int32,
    m_blocks: cutlass.Int32, mma_qk: cute.TiledMma, mma_dq: cute.TiledMma,
    overwrite: cute.TiledMma,
    half_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
    dtype: cutlass.Constexpr, head_dim: cutlass.Constexpr[int],
    block_n: cutlass.Constexpr[int], stages: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):  # fmt: skip
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    warpgroup_index = cute.arch.make_warp_uniform(thread // WARPGROUP_THREADS)
    m_block, h, b, g = query_block(block, m_blocks, heads, group, causal)  # the forward's grid
    n_tiles, full_tiles = key_tiles(m_block * BLOCK_M, s_q, s_k, BLOCK_M, block_n, causal)
    if warp == 0:
        for atom in (tma_q, tma_do, tma_o, tma_k, tma_v, tma_dq):
            cpasync.prefetch_descriptor(atom)

    smem = SmemAllocator()
    barriers = stage_barriers(smem, stages)
    q_smem, do_smem, o_smem = allocate(smem, dtype, half_layout, 3)
    k_smem, v_smem = allocate(smem, dtype, ring_layout, 2)
    half_bytes = cute.size_in_bytes(dtype, half_layout)  # both halves
    tile_bytes = cute.size_in_bytes(dtype, cute.slice_(ring_layout, (None, None, 0)))
    once_pipe, ring = pipelines(barriers, 3 * half_bytes, 2 * tile_bytes, stages)

    if warpgroup_index == 0:
        cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
        if warp == 0:
            once = [(tma, *tma_tiles(tma, T[None, None, h, b], buffers, WGMMA_M, head_dim))
                    for tma, T, buffers in ((tma_q, Q_tma, q_smem), (tma_do, DO_tma, do_smem),
                                            (tma_o, O_tma, o_smem))]  # fmt: skip
            load_once(once_pipe, once, m_block)
            tiles = [
                (tma, *tma_tiles(tma, T[None, None, g, b], buffers, block_n, head_dim))
                for tma, T, buffers in ((tma_k, K_tma, k_smem), (tma_v, V_tma, v_smem))
            ]
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            state = load_tiles(ring, state, tiles, 0, n_tiles)
            ring.producer_tail(state)  # exit once the consumers have released every stage
    else:
        cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
        dq_consume(once_pipe, ring, mma_qk, mma_dq, overwrite, tma_dq, DQ_tma, lse, delta,
                   (q_smem, do_smem, o_smem, k_smem, v_smem), thread, warpgroup_index, b, h,
                   m_block, n_tiles, full_tiles, s_q, s_k, scale_log2, scale, head_dim,
                   block_n, stages, causal)  # fmt: skip


# (2) dK and dV --------------------------------------------------------------------------------


@cute.jit
def query_tiles(first_key, s_q, s_k, block_m: cutlass.Constexpr, causal: cutlass.Constexpr):
    """(first, full, end) query tiles of block_m rows for the keys [first_key, first_key +
    BLOCK_N): tiles [first, full) hold their causal diagonal (masked), [full, end) see every
    one of them; the rows before tile `first` see none (triton_impl's dK/dV kernel)."""
    end = (s_q + block_m - 1) // block_m
    first, full = 0, 0
    if cutlass.const_expr(causal):
        shift = s_k - s_q  # row i sees key j when j <= i + shift
        first = cutlass.max(first_key - shift, 0) // block_m
        all_keys_row = cutlass.max(first_key + BLOCK_N - 1 - shift, 0)  # sees the last key
        full = cutlass.min(cutlass.max((all_keys_row + block_m - 1) // block_m, first), end)
    return first, full, end


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
def dkdv_query_tile(
    stage, tile, mmas, frags, scores_t, dp_t, dk, dv, lse, delta, score_coords, first_key, s_q,
    s_k, scale_log2, block_m: cutlass.Constexpr, masked: cutlass.Constexpr,
):  # fmt: skip
    """Query tile `tile` of one head (its lse and delta rows given), landed in ring stage
    `stage`, into this warpgroup's dK and dV."""
    mma_kq, mma_acc, overwrite = mmas
    k_frag, v_frag, q_frag, do_frag, q_t_frag, do_t_frag = frags
    first_query = tile * block_m
    # Loaded before the wgmmas are issued: the loads land while they run.
    lse_log2 = query_stats(lse, score_coords, first_query, s_q, False, True)
    deltas = query_stats(delta, score_coords, first_query, s_q, False, False)
    issue(mma_kq, scores_t, k_frag, q_frag[None, None, None, stage], overwrite)
    issue(mma_kq, dp_t, v_frag, do_frag[None, None, None, stage], overwrite)
    warpgroup.wait_group(1)  # S^T has landed; P^T is computed while dP^T's wgmmas run
    p_rows, dp_rows = by_rows(scores_t), by_rows(dp_t)
    for c in cutlass.range_constexpr(cute.size(p_rows, mode=[1])):
        for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
            p_rows[r, c] = cute.math.exp2(p_rows[r, c] * scale_log2 - lse_log2[c], fastmath=True)
    if cutlass.const_expr(masked):
        mask_transposed(p_rows, score_coords, first_key, first_query, s_q, s_k)
    dtype = mma_acc.op.a_dtype
    p_t = cute.make_rmem_tensor_like(scores_t, dtype)
    p_t.store(scores_t.load().to(dtype))  # round(P^T): dV's A operand, from registers
    warpgroup.wait_group(0)
    issue(mma_acc, dv, as_a_operand(p_t), do_t_frag[None, None, None, stage])  # dS^T under it
    for c in cutlass.range_constexpr(cute.size(p_rows, mode=[1])):
        for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
            dp_rows[r, c] = p_rows[r, c] * (dp_rows[r, c] - deltas[c])  # dS^T in dP^T's place
    ds_t = cute.make_rmem_tensor_like(dp_t, dtype)
    ds_t.store(dp_t.load().to(dtype))  # round(dS^T): dK's A operand
    multiply(mma_acc, dk, as_a_operand(ds_t), q_t_frag[None, None, None, stage])


@cute.jit
def dkdv_consume(
    once_pipe, ring, mma_kq, mma_acc, overwrite, stores, lse, delta, buffers, thread,
    warpgroup_index, b, g, group, n_block, tiles, s_q, s_k, scale_log2, scale,
    head_dim: cutlass.Constexpr, block_m: cutlass.Constexpr, stages: cutlass.Constexpr,
    causal: cutlass.Constexpr,
):  # fmt: skip
    """A consumer warpgroup: its 64 keys' dK and dV over the group's query heads in order and
    their query tiles, then dK scale and dV."""
    k_smem, v_smem, q_smem, do_smem = buffers
    tma_dk, DK_tma, tma_dv, DV_tma = stores
    first, full, end = tiles
    half = warpgroup_index - 1  # which 64 keys of the block, and which half of K's and V's buffers
    mine = thread % WARPGROUP_THREADS
    first_key = n_block * BLOCK_N + half * WGMMA_M
    kq_thread, acc_thread = mma_kq.get_slice(mine), mma_acc.get_slice(mine)
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
    )  # fmt: skip
    score_shape = kq_thread.partition_shape_C((WGMMA_M, block_m))
    scores_t = cute.make_rmem_tensor(score_shape, cutlass.Float32)
    dp_t = cute.make_rmem_tensor(score_shape, cutlass.Float32)
    acc_shape = acc_thread.partition_shape_C((WGMMA_M, head_dim))
    dk = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
    dv = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
    dk.fill(0.0)
    dv.fill(0.0)
    mma_kq.set(warpgroup.Field.ACCUMULATE, True)
    mma_acc.set(warpgroup.Field.ACCUMULATE, True)
    overwrite.set(warpgroup.Field.ACCUMULATE, False)  # S^T's and dP^T's first k step
    score_coords = by_rows(kq_thread.partition_C(cute.make_identity_tensor((WGMMA_M, block_m))))

    once_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
    once_pipe.consumer_wait(once_state)  # K and V have landed
    mmas = (mma_kq, mma_acc, overwrite)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    for head in cutlass.range(group, unroll=1):  # the group's query heads, in order
        h = g * group + head
        visit = functools.partial(
            dkdv_query_tile, mmas=mmas, frags=frags, scores_t=scores_t, dp_t=dp_t, dk=dk,
            dv=dv, lse=lse[b, h, None], delta=delta[b, h, None], score_coords=score_coords,
            first_key=first_key, s_q=s_q, s_k=s_k, scale_log2=scale_log2, block_m=block_m,
        )  # fmt: skip
        state = consume_tiles(ring, state, first, full, visit, True)  # the diagonal's tiles
        state = consume_tiles(ring, state, full, end, visit, False)

    for i in cutlass.range_constexpr(cute.size(dk)):
        dk[i] = dk[i] * scale
    # dK and dV into this warpgroup's halves of K's and V's buffers, whose only readers (the
    # S^T and dP^T wgmmas of this warpgroup) have completed.
    store_accumulator(dk, k_smem, half, mine, mma_acc, tma_dk, DK_tma[None, None, g, b], n_block,
                      head_dim)  # fmt: skip
    store_accumulator(dv, v_smem, half, mine, mma_acc, tma_dv, DV_tma[None, None, g, b], n_block,
                      head_dim)  # fmt: skip


@cute.kernel
def attention_dkdv_kernel(
    tma_k: cute.CopyAtom, K_tma: cute.Tensor, tma_v: cute.CopyAtom, V_tma: cute.Tensor,
    tma_q: cute.CopyAtom, Q_tma: cute.Tensor, tma_do: cute.CopyAtom, DO_tma: cute.Tensor,
    tma_dk: cute.CopyAtom, DK_tma: cute.Tensor, tma_dv: cute.CopyAtom, DV_tma: cute.Tensor,
    lse: cute.Tensor, delta: cute.Tensor, scale_log2: cutlass.Float32, scale: cutlass.Float32,
    s_q: cutlass.Int32, s_k: cutlass.Int32, heads_kv: cutlass.Int32, group: cutlass.Int32,
    n_blocks: cutlass.Int32, mma_kq: cute.TiledMma, mma_acc: cute.TiledMma,
    overwrite: cute.TiledMma,
    half_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
    dtype: cutlass.Constexpr, head_dim: cutlass.Constexpr[int],
    block_m: cutlass.Constexpr[int], stages: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):  # fmt: skip
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    warpgroup_index = cute.arch.make_warp_uniform(thread // WARPGROUP_THREADS)
    # Key block fastest, then KV head, then batch. Causal: the first key blocks see the most
    # queries, and they come first already.
    n_block = block % n_blocks
    g = block // n_blocks % heads_kv
    b = block // n_blocks // heads_kv
    tiles = query_tiles(n_block * BLOCK_N, s_q, s_k, block_m, causal)
    first, _, end = tiles
    if warp == 0:
        for atom in (tma_k, tma_v, tma_q, tma_do, tma_dk, tma_dv):
            cpasync.prefetch_descriptor(atom)

    smem = SmemAllocator()
    barriers = stage_barriers(smem, stages)
    k_smem, v_smem = allocate(smem, dtype, half_layout, 2)
    q_smem, do_smem = allocate(smem, dtype, ring_layout, 2)
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
                state = load_tiles(ring, state, loads, first, end)
            ring.producer_tail(state)
    else:
        cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
        dkdv_consume(once_pipe, ring, mma_kq, mma_acc, overwrite,
                     (tma_dk, DK_tma, tma_dv, DV_tma), lse, delta,
                     (k_smem, v_smem, q_smem, do_smem), thread, warpgroup_index, b, g,
                     group, n_block, tiles, s_q, s_k, scale_log2, scale, head_dim, block_m,
                     stages, causal)  # fmt: skip


# The launch -----------------------------------------------------------------------------------


def tma_atom(op, t, seq, heads, batch, layout, rows, head_dim):
    """A TMA atom (and its coordinate tensor) for tiles of `rows` x D of t, a (B, S, H, D)
    tensor, into or out of one slot of `layout`."""
    return cpasync.make_tiled_tma_atom(
        op, seq_major(t, seq, heads, batch), cute.slice_(layout, (None, None, 0)),
        (rows, head_dim),
    )  # fmt: skip


@cute.jit
def launch_backward(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
    do: cute.Tensor, dq: cute.Tensor, dk: cute.Tensor, dv: cute.Tensor, delta: cute.Tensor,
    scale_log2: cutlass.Float32, scale: cutlass.Float32, stream: cuda.CUstream,
    head_dim: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool],
):  # fmt: skip
    """The backward over (B, S, H, D) operands with 16-byte aligned bases and positive batch,
    sequence and head strides that are multiples of 16 bytes (TMA's rules; cute_impl checks);
    delta (B, H, S_q) float32 scratch. The dQ kernel, then (same stream) the dK/dV kernel
    that reads its delta."""
    (block_n, dq_stages), (block_m, dkdv_stages) = TILES[head_dim]
    dtype = q.element_type
    batch = cutlass.Int32(cute.size(q, mode=[0]))
    s_q, heads = cutlass.Int32(cute.size(q, mode=[1])), cutlass.Int32(cute.size(q, mode=[2]))
    s_k, heads_kv = cutlass.Int32(cute.size(k, mode=[1])), cutlass.Int32(cute.size(k, mode=[2]))
    group = heads // heads_kv
    load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()

    # (1) dQ: Q, dO, O and dQ in 64-row halves, K and V in a ring of block_n-key tiles.
    half_layout, ring_layout = smem_layouts(dtype, head_dim, block_n, dq_stages)
    by_query = [tma_atom(op, t, s_q, heads, batch, half_layout, WGMMA_M, head_dim)
                for op, t in ((load, q), (load, do), (load, o), (store, dq))]  # fmt: skip
    by_key = [tma_atom(load, t, s_k, heads_kv, batch, ring_layout, block_n, head_dim)
              for t in (k, v)]  # fmt: skip
    mma_qk, mma_dq = tiled_mmas(dtype, head_dim, block_n)
    overwrite, _ = tiled_mmas(dtype, head_dim, block_n)  # S's and dP's first k step
    (tma_q, Q_tma), (tma_do, DO_tma), (tma_o, O_tma), (tma_dq, DQ_tma) = by_query
    (tma_k, K_tma), (tma_v, V_tma) = by_key
    m_blocks = (s_q + BLOCK_M - 1) // BLOCK_M
    attention_dq_kernel(
        tma_q, Q_tma, tma_do, DO_tma, tma_o, O_tma, tma_k, K_tma, tma_v, V_tma, tma_dq, DQ_tma,
        lse, delta, scale_log2, scale, s_q, s_k, heads, group, m_blocks, mma_qk, mma_dq,
        overwrite, half_layout, ring_layout, dtype, head_dim, block_n, dq_stages, causal,
    ).launch(grid=[m_blocks * heads * batch, 1, 1], block=[THREADS, 1, 1], stream=stream,
             min_blocks_per_mp=ONE_BLOCK_AN_SM)  # fmt: skip

    # (2) dK, dV: K, V, dK and dV in 64-row halves, Q and dO in a ring of block_m-query tiles.
    half_layout, ring_layout = smem_layouts(dtype, head_dim, block_m, dkdv_stages)
    by_key = [tma_atom(op, t, s_k, heads_kv, batch, half_layout, WGMMA_M, head_dim)
              for op, t in ((load, k), (load, v), (store, dk), (store, dv))]  # fmt: skip
    by_query = [tma_atom(load, t, s_q, heads, batch, ring_layout, block_m, head_dim)
                for t in (q, do)]  # fmt: skip
    mma_kq, mma_acc = tiled_mmas(dtype, head_dim, block_m)
    overwrite, _ = tiled_mmas(dtype, head_dim, block_m)  # S^T's and dP^T's first k step
    (tma_k, K_tma), (tma_v, V_tma), (tma_dk, DK_tma), (tma_dv, DV_tma) = by_key
    (tma_q, Q_tma), (tma_do, DO_tma) = by_query
    n_blocks = (s_k + BLOCK_N - 1) // BLOCK_N
    attention_dkdv_kernel(
        tma_k, K_tma, tma_v, V_tma, tma_q, Q_tma, tma_do, DO_tma, tma_dk, DK_tma, tma_dv,
        DV_tma, lse, delta, scale_log2, scale, s_q, s_k, heads_kv, group, n_blocks, mma_kq,
        mma_acc, overwrite, half_layout, ring_layout, dtype, head_dim, block_m, dkdv_stages, causal,
    ).launch(grid=[n_blocks * heads_kv * batch, 1, 1], block=[THREADS, 1, 1], stream=stream,
             min_blocks_per_mp=ONE_BLOCK_AN_SM)  # fmt: skip
