"""Attention in the CuTe DSL, step 2: the forward on Hopper's TMA and wgmma.

The same forward as step 1 (cute_1_tiled.py, whose docstring gives the arithmetic): the same
online softmax in log2 units, the same masks (keys past S_k, bottom-right causal), the same
outputs (O rounded to the input dtype, lse in float32 natural log, O = 0 and lse = -inf for a
row that sees no key). What changes is the machinery that feeds the tensor cores:

- TMA (`cp.async.bulk.tensor`) copies whole tiles of Q, K and V from global memory into
  shared memory laid out in the 128-byte swizzle (`sm90_utils` layouts: 8 rows of 128 bytes,
  the 16-byte chunks XOR-swizzled by the row, `Swizzle<3,4,3>` on byte addresses), and signals
  their arrival on mbarriers: the barrier expects the tile's bytes, and a thread waiting on it
  wakes when they have landed. Rows past S_q or S_k are filled with zeros by TMA itself (the
  descriptor knows the tensor's extent), so no thread tests a row before a load.
- Warp specialisation, as the course's Hopper gemm (gemm/cute_2_tma_wgmma.py): a block is 3
  warpgroups. Warpgroup 0 is the producer: it gives most of its registers away
  (`setmaxnreg.dec`) and one of its threads issues every TMA load, Q once, then K and V tile
  by tile into a ring of STAGES buffers (`PipelineTmaAsync`: a "full" mbarrier a stage that
  TMA completes, an "empty" one that the consumers' warps arrive on when they are done with
  it). Warpgroups 1 and 2 are the consumers (`setmaxnreg.inc`): each owns 64 query rows of the
  block's BLOCK_M = 128, for S and for O. A dedicated producer was chosen over TMA issued by a
  consumer thread because the ring's waits then never sit in the consumers' instruction
  stream: a consumer only waits when the tile it needs has not landed, and the producer
  refills a stage as soon as both consumers have released it.
- S = Q K^T is `wgmma.mma_async` (64 x BLOCK_N x 16 an instruction, issued by the 128 threads
  of a warpgroup together, both operands read from shared memory through descriptors):
  warpgroup.fence, D / 16 wgmmas, commit_group, then wait_group(0) before the softmax reads
  S. Its float32 accumulator gives each thread, as mma.sync's did, two adjacent columns of
  rows r and r + 8 in each 8-column slice, so a row lives in the 4 lanes of a quad and step
  1's `quad_reduce`, `mask_scores` and online softmax (`softmax_rows`, `rescale_rows`) run
  unchanged on a (rows, columns) view of it (`by_rows`).
- P V is a wgmma whose A operand comes from registers (`OperandSource.RMEM`): P is rounded to
  the input dtype in place of S's accumulator and reinterpreted as the A fragments of the next
  product (`as_a_operand`: the C fragments of two neighbouring 8-column slices make the A
  fragment of one 16-key step), so P never touches shared memory. V is the B operand (N = D,
  K = keys) straight from its TMA buffer, seen transposed: its D dimension is contiguous, so
  this B operand is MN-major, which wgmma reads for 16-bit types.
- The epilogue: O / l in the accumulator, rounded, written by stmatrix into the warpgroup's
  half of Q's buffer (free: its last S wgmma has completed), then one thread of the warpgroup
  stores those 64 rows by TMA (rows past S_q are dropped by TMA itself). lse is written as in
  step 1.

The map (one block of 384 threads per BLOCK_M = 128 queries of one head; `TILES` per D):

- Shared memory: Q (128 x D, two 64-row halves, one per consumer), STAGES buffers each of K
  and V (BLOCK_N x D), after 1 KB of mbarriers and alignment: 1 + 32 + 2 x 64 = 161 KB at
  D = 128 (2 stages), 1 + 16 + 3 x 32 = 113 KB at D = 64 (3 stages). One block an SM: the
  registers allow no more.
- Registers (ptxas -v for sm_90a, `test_cute_tiles_fit_the_registers`): the consumers hold O
  (64 x D / 128 = 64 floats a thread at D = 128), S (64 x BLOCK_N / 128 = 64 at BLOCK_N =
  128) and P (32 registers of packed 16-bit pairs); they get CONSUMER_REGISTERS = 240 a
  thread, the producer 24 (128 x 24 + 256 x 240 = 64512 of the SM's 65536). ptxas allocates
  within those setmaxnreg budgets: no spills at 240 for any build; with the consumers held to
  the launch's 168 (65536 / 384), D = 128 spilled 20 bytes and D = 64 fitted, so BLOCK_N =
  128 at D = 128 needs the warp specialisation's register shift.
- The key loop is step 1's in two parts (whole tiles without a mask, then the tail and the
  causal band with one), the producer walking the same tiles in the same order; causal blocks
  are launched longest first.

Step 2 does not overlap the softmax with the tensor cores inside a warpgroup (each wgmma is
waited for before its result is read; the two consumer warpgroups overlap each other only as
the warp schedulers interleave them): that is step 3's FlashAttention-3 schedule
(cute_3_overlap.py), which reorders the same pieces (`TileSteps`) of a key tile.
"""

import dataclasses
import functools
from collections.abc import Callable

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cute_1_tiled import (
    LOG2E,
    finish_rows,
    key_tiles,
    mask_scores,
    query_block,
    rescale_rows,
    softmax_rows,
)

__all__ = ["LOG2E", "TILES", "launch", "launch_forward"]

WARPGROUP_THREADS = 128
CONSUMER_WARPGROUPS = 2
THREADS = (1 + CONSUMER_WARPGROUPS) * WARPGROUP_THREADS  # the producer warpgroup, then two
WGMMA_M = 64  # the rows of one wgmma, and of one consumer warpgroup
BLOCK_M = CONSUMER_WARPGROUPS * WGMMA_M
WGMMA_K = 16  # 16-bit operands: 16 summed per instruction
# Tiles per head dimension: (BLOCK_N keys a tile, STAGES K/V buffers). Others go to Triton.
TILES = {64: (128, 3), 128: (128, 2)}
# setmaxnreg: the producer only computes TMA coordinates; the consumers hold S, P and O.
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240
# Named barriers (0 is __syncthreads): one per consumer warpgroup, before its O store.
EPILOGUE_BARRIER = 1


def by_rows(tensor):
    """A wgmma accumulator partition ((column pair, row half, 8-column slice), MMA_M, MMA_N)
    seen as (rows, columns): row index (row half, MMA_M), column index (column pair, slice,
    MMA_N). Within each 8-column slice a thread holds two adjacent columns of row r and of
    row r + 8, as mma.sync's C fragment does (cute_1_tiled.by_rows, one slice per atom)."""
    compact = cute.make_layout(tensor.layout.shape)
    (pair, half, slices), mma_m, mma_n = compact.shape
    (pair_stride, half_stride, slice_stride), m_stride, n_stride = compact.stride
    rows_columns = cute.make_layout(
        ((half, mma_m), (pair, slices, mma_n)),
        stride=((half_stride, m_stride), (pair_stride, slice_stride, n_stride)),
    )
    return cute.make_tensor(tensor.iterator, cute.composition(tensor.layout, rows_columns))


def as_a_operand(p):
    """P ((column pair, row half, slice), MMA_M, MMA_N), rounded, as the register A operand
    of the next wgmma: ((column pair, row half, 2 slices), MMA_M, (slices / 2, MMA_N)). The A
    fragment of a 64 x 16 step holds, per thread, the same rows and two column pairs 8 apart:
    the C fragments of two neighbouring 8-column slices."""
    split = cute.logical_divide(p.layout, ((None, None, 2), None, None))
    (pair, half, (two, steps)), mma_m, mma_n = split.shape
    (pair_s, half_s, (two_s, steps_s)), m_s, n_s = split.stride
    return cute.make_tensor(
        p.iterator,
        cute.make_layout(
            ((pair, half, two), mma_m, (steps, mma_n)),
            stride=((pair_s, half_s, two_s), m_s, (steps_s, n_s)),
        ),
    )


def tma_tiles(tma, rows_by_d, buffers, rows, head_dim):
    """(buffers' slots, the tensor's tiles) as one TMA atom copies them: rows_by_d, one head's
    (S, D) in global memory, cut into tiles of `rows` x D indexed by tile; buffers (rows, D,
    slot) in shared memory indexed by slot (a ring's stage, or a warpgroup's half)."""
    tiles = cute.local_tile(rows_by_d, (rows, head_dim), (None, 0))
    return cpasync.tma_partition(
        tma, 0, cute.make_layout(1), cute.group_modes(buffers, 0, 2),
        cute.group_modes(tiles, 0, 2),
    )  # fmt: skip


def stage_barriers(smem, stages):
    """A one-stage pipeline's barriers (the operands loaded once) and a ring's."""
    return (smem.allocate_array(cutlass.Int64, 2, byte_alignment=8),
            smem.allocate_array(cutlass.Int64, 2 * stages, byte_alignment=8))  # fmt: skip


def pipelines(barriers, once_bytes, tile_bytes, stages):
    """(the operands loaded once, the ring): PipelineTmaAsync's. "full": one producer thread
    arrives with the bytes TMA must deliver; "empty": lane 0 of each of the 8 consumer warps
    (PipelineTmaAsync's signalling threads). The second create fences the barriers'
    initialisation and syncs the block, so that no arrive or TMA completion reaches a barrier
    before its init."""
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
    consumers = pipeline.CooperativeGroup(
        pipeline.Agent.Thread, CONSUMER_WARPGROUPS * WARPGROUP_THREADS // 32
    )
    once = pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers[0], num_stages=1, producer_group=producer,
        consumer_group=consumers, tx_count=once_bytes, defer_sync=True,
    )  # fmt: skip
    ring = pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers[1], num_stages=stages, producer_group=producer,
        consumer_group=consumers, tx_count=tile_bytes,
    )  # fmt: skip
    return once, ring


def allocate(smem, dtype, layout, count):
    """`count` buffers of a 128-byte-swizzled layout, 1024-byte aligned (the swizzle repeats
    every 8 rows of 128 bytes)."""
    return [smem.allocate_tensor(dtype, layout.outer, byte_alignment=1024, swizzle=layout.inner)
            for _ in range(count)]  # fmt: skip


@cute.jit
def load_once(once_pipe, copies, block):
    """The producer's first loads: each (atom, buffers' halves, tiles) copy of 64-row halves
    `2 block` and `2 block + 1` into the two consumers' halves, all on one barrier."""
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
    once_pipe.producer_acquire(state)  # a fresh barrier: no wait, it expects every byte
    full = once_pipe.producer_get_barrier(state)
    for tma, smem_part, gmem_part in copies:
        for half in cutlass.range_constexpr(CONSUMER_WARPGROUPS):
            cute.copy(tma, gmem_part[None, block * CONSUMER_WARPGROUPS + half],
                      smem_part[None, half], tma_bar_ptr=full)  # fmt: skip


@cute.jit
def load_tile(ring, state, copies, tile):
    """Tile `tile` of each (atom, ring's stages, tiles) copy into the ring's stage `state`,
    once both consumers have released it."""
    ring.producer_acquire(state)
    full = ring.producer_get_barrier(state)
    for tma, smem_part, gmem_part in copies:
        cute.copy(tma, gmem_part[None, tile], smem_part[None, state.index], tma_bar_ptr=full)
    ring.producer_commit(state)


@cute.jit
def load_tiles(ring, state, copies, first, end):
    """Tiles [first, end) of each copy into the ring's stages in order (`load_tile` each),
    from `state` on; returns the state (the loop's is its own, so the caller takes it back)."""
    for tile in cutlass.range(first, end, unroll=1):
        load_tile(ring, state, copies, tile)
        state.advance()
    return state


@cute.jit
def produce(
    q_pipe, kv_pipe, tma_q, Q_tma, tma_k, K_tma, tma_v, V_tma, q_smem, k_smem, v_smem, b, h, g,
    m_block, n_tiles, head_dim: cutlass.Constexpr, block_n: cutlass.Constexpr,
    stages: cutlass.Constexpr,
):  # fmt: skip
    """The producer warp (TMA copies are issued by one elected thread): Q's two 64-row halves
    onto Q's barrier, then K and V tile by tile into the ring, each stage once both consumer
    warpgroups have released it."""
    q_copy = (tma_q, *tma_tiles(tma_q, Q_tma[None, None, h, b], q_smem, WGMMA_M, head_dim))
    kv_copies = [
        (tma, *tma_tiles(tma, T[None, None, g, b], buffers, block_n, head_dim))
        for tma, T, buffers in ((tma_k, K_tma, k_smem), (tma_v, V_tma, v_smem))
    ]
    load_once(q_pipe, [q_copy], m_block)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    state = load_tiles(kv_pipe, state, kv_copies, 0, n_tiles)
    # Exit only once the consumers have released every stage (their last arrives land here).
    kv_pipe.producer_tail(state)


@cute.jit
def issue(tiled_mma, acc, a_frag, b_frag, overwrite=None):
    """acc += A B over the k steps of the fragments: the warpgroup's wgmmas, issued together
    and committed as one group, not waited for (warpgroup.wait_group(n) waits until at most n
    groups are still running, oldest first). overwrite: tiled_mma's twin with ACCUMULATE off,
    which issues the first k step, so that acc = A B needs no zeros written first (zeros
    written while another of the warpgroup's wgmmas runs make ptxas wait for it, its message
    C7517, undoing the overlap)."""
    warpgroup.fence()  # acc's registers (and P's) are written before the wgmmas read them
    for kk in cutlass.range_constexpr(cute.size(a_frag, mode=[2])):
        mma = overwrite if cutlass.const_expr(kk == 0 and overwrite is not None) else tiled_mma
        cute.gemm(mma, acc, a_frag[None, None, kk], b_frag[None, None, kk], acc)
    warpgroup.commit_group()


@cute.jit
def multiply(tiled_mma, acc, a_frag, b_frag):
    """`issue`, then wait for the group: nothing else runs within the warpgroup meanwhile."""
    issue(tiled_mma, acc, a_frag, b_frag)
    warpgroup.wait_group(0)


@cute.jit
def consume_tiles(ring, state, first, end, visit, masked: cutlass.Constexpr):
    """The consumers' side of the ring for tiles [first, end), in the order the producer
    loaded them: wait until a tile's stage is full, visit(state, tile, masked=masked)
    (state.index: the tile's stage; state.count: the tiles visited before it), release the
    stage (every wgmma that read it has completed), move the state on; returns it (the loop's
    state is its own, so the caller takes it back)."""
    for tile in cutlass.range(first, end, unroll=1):
        ring.consumer_wait(state)
        visit(state, tile, masked=masked)
        ring.consumer_release(state)
        state.advance()
    return state


# A plain class, not a NamedTuple: the DSL carries a tuple's elements through a dynamic loop as
# loop values, and a partial cannot be one (it refused to trace).
@dataclasses.dataclass(frozen=True)
class TileSteps:
    """A consumer warpgroup's work on one key tile, in the pieces a schedule orders (each a
    partial over the warpgroup's fragments, registers and row statistics, `consume` builds):
    scores(stage) issues S = Q K^T (not waited for); softmax(tile, masked) masks S and turns
    it into P and the rows' rescale factors (`softmax_rows`); rescale() multiplies O's rows by
    those factors; round() rounds P to the dtype into the registers of the next product's A
    operand; values(stage) issues O += P V (not waited for)."""

    scores: Callable
    softmax: Callable
    rescale: Callable
    round: Callable
    values: Callable


@cute.jit
def issue_scores(stage, mma_qk, q_frag, k_frag, scores):
    scores.fill(0.0)  # the wgmmas accumulate: 0 + s is exact
    issue(mma_qk, scores, q_frag, k_frag[None, None, None, stage])


@cute.jit
def issue_values(stage, mma_pv, p, v_frag, acc):
    issue(mma_pv, acc, as_a_operand(p), v_frag[None, None, None, stage])


@cute.jit
def round_scores(scores, p):
    p.store(scores.load().to(p.element_type))  # round(P): the A operand, from registers


@cute.jit
def softmax_tile(
    tile, scores, row_max, row_sum, rescale, score_coords, first_row, s_q, s_k, scale_log2,
    block_n: cutlass.Constexpr, causal: cutlass.Constexpr, masked: cutlass.Constexpr,
):  # fmt: skip
    score_rows = by_rows(scores)
    if cutlass.const_expr(masked):
        mask_scores(score_rows, score_coords, first_row, tile * block_n, s_q, s_k, causal)
    softmax_rows(score_rows, row_max, row_sum, rescale, scale_log2)


@cute.jit
def serial_tile(state, tile, steps, masked: cutlass.Constexpr):
    """Key tile `tile`, landed in the ring's stage state.index, into this warpgroup's O, one
    piece after the other: each product waited for before its result is read."""
    stage = state.index
    steps.scores(stage)
    warpgroup.wait_group(0)
    steps.softmax(tile, masked=masked)
    steps.rescale()
    steps.round()
    steps.values(stage)
    warpgroup.wait_group(0)


@cute.jit
def serial_key_loop(ring, steps, n_tiles, full_tiles, half, stages: cutlass.Constexpr):
    """Step 2's schedule: the key tiles one after the other (whole tiles without a mask, then
    the tail and the causal band with one), each released once its products completed."""
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    visit = functools.partial(serial_tile, steps=steps)
    state = consume_tiles(ring, state, 0, full_tiles, visit, False)
    state = consume_tiles(ring, state, full_tiles, n_tiles, visit, True)


@cute.jit
def consume(
    q_pipe, kv_pipe, mma_qk, mma_pv, tma_o, O_tma, lse, q_smem, k_smem, v_smem, thread,
    warpgroup_index, b, h, m_block, n_tiles, full_tiles, s_q, s_k, scale_log2,
    head_dim: cutlass.Constexpr, block_n: cutlass.Constexpr, stages: cutlass.Constexpr,
    causal: cutlass.Constexpr, key_loop: cutlass.Constexpr,
):  # fmt: skip
    """A consumer warpgroup: its 64 query rows against every key tile of the block, in the
    order `key_loop` schedules the pieces of each (`TileSteps`), then its part of O and
    lse."""
    half = warpgroup_index - 1  # which 64 rows of the block, and which half of Q's buffer
    mine = thread % WARPGROUP_THREADS
    first_row = m_block * BLOCK_M + half * WGMMA_M
    q_half = q_smem[None, None, half]
    v_t_smem = transposed(v_smem, head_dim, block_n, stages)  # (D, keys, stage)
    qk_thread, pv_thread = mma_qk.get_slice(mine), mma_pv.get_slice(mine)
    # Shared-memory operands are descriptors, the same for the whole warpgroup.
    q_frag = mma_qk.make_fragment_A(qk_thread.partition_A(q_half))
    k_frag = mma_qk.make_fragment_B(qk_thread.partition_B(k_smem))
    v_frag = mma_pv.make_fragment_B(pv_thread.partition_B(v_t_smem))
    scores = cute.make_rmem_tensor(qk_thread.partition_shape_C((WGMMA_M, block_n)),
                                   cutlass.Float32)  # fmt: skip
    p = cute.make_rmem_tensor_like(scores, mma_pv.op.a_dtype)
    acc = cute.make_rmem_tensor(pv_thread.partition_shape_C((WGMMA_M, head_dim)), cutlass.Float32)
    acc.fill(0.0)
    mma_qk.set(warpgroup.Field.ACCUMULATE, True)
    mma_pv.set(warpgroup.Field.ACCUMULATE, True)
    score_coords = by_rows(qk_thread.partition_C(cute.make_identity_tensor((WGMMA_M, block_n))))
    rows_held = cute.size(score_coords, mode=[0])  # 2: rows r and r + 8 of the thread's warp
    row_max = cute.make_rmem_tensor(rows_held, cutlass.Float32)
    row_sum = cute.make_rmem_tensor(rows_held, cutlass.Float32)
    rescale = cute.make_rmem_tensor(rows_held, cutlass.Float32)
    row_max.fill(-cutlass.Float32.inf)
    row_sum.fill(0.0)
    steps = TileSteps(
        scores=functools.partial(issue_scores, mma_qk=mma_qk, q_frag=q_frag, k_frag=k_frag,
                                 scores=scores),
        softmax=functools.partial(
            softmax_tile, scores=scores, row_max=row_max, row_sum=row_sum,
            rescale=rescale, score_coords=score_coords, first_row=first_row, s_q=s_q,
            s_k=s_k, scale_log2=scale_log2, block_n=block_n, causal=causal,
        ),
        rescale=functools.partial(rescale_rows, by_rows(acc), rescale),
        round=functools.partial(round_scores, scores, p),
        values=functools.partial(issue_values, mma_pv=mma_pv, p=p, v_frag=v_frag, acc=acc),
    )  # fmt: skip

    q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
    q_pipe.consumer_wait(q_state)  # Q has landed (always: the epilogue reuses its buffer)
    key_loop(kv_pipe, steps, n_tiles, full_tiles, half, stages)

    finish_rows(by_rows(acc), row_max, row_sum, score_coords, first_row, s_q, lse, b, h,
                thread % 32)  # fmt: skip
    # O into this warpgroup's half of Q's buffer: its S wgmmas, the only readers of those rows,
    # have completed.
    store_accumulator(acc, q_smem, half, mine, mma_pv, tma_o, O_tma[None, None, h, b],
                      m_block, head_dim)  # fmt: skip


@cute.jit
def store_accumulator(acc, buffers, half, mine, tiled_mma, tma_store, rows_by_d, block,
                      head_dim: cutlass.Constexpr):  # fmt: skip
    """A consumer warpgroup's 64 x D accumulator rounded to the dtype, written by stmatrix into
    its half of `buffers` (which nothing reads any more), then stored by one TMA copy into
    rows [64 (2 block + half), + 64) of rows_by_d, one head's (S, D); rows past S are
    dropped by TMA."""
    dtype = buffers.element_type
    o_regs = cute.make_rmem_tensor_like(acc, dtype)
    o_regs.store(acc.load().to(dtype))
    stmatrix = sm90_utils.sm90_get_smem_store_op(LayoutEnum.ROW_MAJOR, dtype, cutlass.Float32)
    to_shared = cute.make_tiled_copy_C(stmatrix, tiled_mma)
    thread_copy = to_shared.get_slice(mine)
    cute.copy(
        to_shared, thread_copy.retile(o_regs), thread_copy.partition_D(buffers[None, None, half])
    )
    # The generic-proxy writes become visible to TMA (the async proxy), then the warpgroup's
    # 128 threads meet before one of them starts the store.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + half, number_of_threads=WARPGROUP_THREADS)
    smem_part, gmem_part = tma_tiles(tma_store, rows_by_d, buffers, WGMMA_M, head_dim)
    if cute.arch.make_warp_uniform(mine // 32) == 0:
        with cute.arch.elect_one():
            cute.copy(tma_store, smem_part[None, half],
                      gmem_part[None, block * CONSUMER_WARPGROUPS + half])  # fmt: skip
            cute.arch.cp_async_bulk_commit_group()
            # The block's shared memory must outlive the store's reads of it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.kernel
def attention_forward_kernel(
    tma_q: cute.CopyAtom, Q_tma: cute.Tensor, tma_k: cute.CopyAtom, K_tma: cute.Tensor,
    tma_v: cute.CopyAtom, V_tma: cute.Tensor, tma_o: cute.CopyAtom, O_tma: cute.Tensor,
    lse: cute.Tensor, scale_log2: cutlass.Float32, s_q: cutlass.Int32, s_k: cutlass.Int32,
    heads: cutlass.Int32, group: cutlass.Int32, m_blocks: cutlass.Int32,
    mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_layout: cute.ComposedLayout,
    kv_layout: cute.ComposedLayout, dtype: cutlass.Constexpr, head_dim: cutlass.Constexpr[int],
    block_n: cutlass.Constexpr[int], stages: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool], key_loop: cutlass.Constexpr,
):  # fmt: skip
    thread, _, _ = cute.arch.thread_idx()
    block, _, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    warpgroup_index = cute.arch.make_warp_uniform(thread // WARPGROUP_THREADS)
    m_block, h, b, g = query_block(block, m_blocks, heads, group, causal)
    n_tiles, full_tiles = key_tiles(m_block * BLOCK_M, s_q, s_k, BLOCK_M, block_n, causal)
    if warp == 0:
        for atom in (tma_q, tma_k, tma_v, tma_o):
            cpasync.prefetch_descriptor(atom)

    # Shared memory: the mbarriers (Q's full and empty, then the ring's), then the buffers.
    smem = SmemAllocator()
    barriers = stage_barriers(smem, stages)
    (q_smem,) = allocate(smem, dtype, q_layout, 1)
    k_smem, v_smem = allocate(smem, dtype, kv_layout, 2)
    kv_stage = cute.slice_(kv_layout, (None, None, 0))
    q_pipe, kv_pipe = pipelines(
        barriers, cute.size_in_bytes(dtype, q_layout), 2 * cute.size_in_bytes(dtype, kv_stage),
        stages,
    )  # fmt: skip

    if warpgroup_index == 0:
        cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
        if warp == 0:
            produce(q_pipe, kv_pipe, tma_q, Q_tma, tma_k, K_tma, tma_v, V_tma, q_smem, k_smem,
                    v_smem, b, h, g, m_block, n_tiles, head_dim, block_n, stages)  # fmt: skip
    else:
        cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
        consume(q_pipe, kv_pipe, mma_qk, mma_pv, tma_o, O_tma, lse, q_smem, k_smem, v_smem,
                thread, warpgroup_index, b, h, m_block, n_tiles, full_tiles, s_q, s_k,
                scale_log2, head_dim, block_n, stages, causal, key_loop)  # fmt: skip


def seq_major(t, seq, heads, batch):
    """A (B, S, H, D) tensor seen as (S, D, H, B): the tile modes first, as TMA's tiles
    take them, with 32-bit extents (TMA's coordinates are 32-bit) and its own strides."""
    (stride_b, stride_s, stride_h, _) = t.stride
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (seq, cute.size(t, mode=[3]), heads, batch), stride=(stride_s, 1, stride_h, stride_b)
        ),  # fmt: skip
    )


def smem_layouts(dtype, head_dim, block_n, stages):
    """(Q's, K's and V's) 128-byte-swizzled layouts: Q (64, D, 2), a half per consumer
    warpgroup; K and V (block_n, D, stages), rows of D contiguous (K-major for S = Q K^T; V is
    seen transposed, MN-major, by P V)."""
    q_layout = sm90_utils.make_smem_layout_a(
        LayoutEnum.ROW_MAJOR, (WGMMA_M, block_n, head_dim), dtype, CONSUMER_WARPGROUPS
    )
    kv_layout = sm90_utils.make_smem_layout_b(
        LayoutEnum.ROW_MAJOR, (WGMMA_M, block_n, head_dim), dtype, stages
    )
    return q_layout, kv_layout


def tiled_mmas(dtype, head_dim, block_n):
    """(S = Q K^T's, P V's) MMAs, one warpgroup each (every consumer issues its own 64-row
    wgmmas). Q K^T: both operands K-major from shared memory. P V: P from registers (K-major,
    as a register A operand must be), V MN-major (D contiguous) from shared memory."""
    k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
    mma_qk = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, k_major, k_major, cutlass.Float32, (1, 1, 1), tiler_mn=(WGMMA_M, block_n)
    )
    mma_pv = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, k_major, mn_major, cutlass.Float32, (1, 1, 1),
        tiler_mn=(WGMMA_M, head_dim), a_source=warpgroup.OperandSource.RMEM,
    )  # fmt: skip
    return mma_qk, mma_pv


def transposed(v, head_dim, block_n, stages):
    """V's ring (block_n, D, stages) seen as (D, block_n, stages): the B operand of P V has D as
    its N and the keys as its K. Over the 128-byte-swizzled K-major buffer this is exactly the
    MN-major layout sm90_utils would give such a B (test.py checks it)."""
    return cute.composition(
        v, cute.make_layout((head_dim, block_n, stages), stride=(block_n, 1, block_n * head_dim))
    )


@cute.jit
def launch_forward(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
    scale_log2: cutlass.Float32, stream: cuda.CUstream, head_dim: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):  # fmt: skip
    """The forward over (B, S, H, D) operands with 16-byte aligned bases and batch, sequence
    and head strides that are multiples of 16 bytes (what TMA needs; cute_impl checks)."""
    block_n, stages = TILES[head_dim]
    launch(q, k, v, o, lse, scale_log2, stream, head_dim, causal, block_n, stages,
           serial_key_loop)  # fmt: skip


@cute.jit
def launch(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
    scale_log2: cutlass.Float32, stream: cuda.CUstream, head_dim: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool], block_n: cutlass.Constexpr[int],
    stages: cutlass.Constexpr[int], key_loop: cutlass.Constexpr,
):  # fmt: skip
    """launch_forward with the tile, the ring's depth and the consumers' schedule given (step
    3's forward changes only those)."""
    dtype = q.element_type
    batch = cutlass.Int32(cute.size(q, mode=[0]))
    s_q, heads = cutlass.Int32(cute.size(q, mode=[1])), cutlass.Int32(cute.size(q, mode=[2]))
    s_k, heads_kv = cutlass.Int32(cute.size(k, mode=[1])), cutlass.Int32(cute.size(k, mode=[2]))
    q_layout, kv_layout = smem_layouts(dtype, head_dim, block_n, stages)
    q_half = cute.slice_(q_layout, (None, None, 0))
    kv_stage = cute.slice_(kv_layout, (None, None, 0))
    load = cpasync.CopyBulkTensorTileG2SOp()
    tma_q, Q_tma = cpasync.make_tiled_tma_atom(
        load, seq_major(q, s_q, heads, batch), q_half, (WGMMA_M, head_dim)
    )
    tma_k, K_tma = cpasync.make_tiled_tma_atom(
        load, seq_major(k, s_k, heads_kv, batch), kv_stage, (block_n, head_dim)
    )
    tma_v, V_tma = cpasync.make_tiled_tma_atom(
        load, seq_major(v, s_k, heads_kv, batch), kv_stage, (block_n, head_dim)
    )
    tma_o, O_tma = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileS2GOp(), seq_major(o, s_q, heads, batch), q_half,
        (WGMMA_M, head_dim),
    )  # fmt: skip
    mma_qk, mma_pv = tiled_mmas(dtype, head_dim, block_n)
    m_blocks = (s_q + BLOCK_M - 1) // BLOCK_M
    attention_forward_kernel(
        tma_q, Q_tma, tma_k, K_tma, tma_v, V_tma, tma_o, O_tma, lse, scale_log2, s_q, s_k,
        heads, heads // heads_kv, m_blocks, mma_qk, mma_pv, q_layout, kv_layout, dtype,
        head_dim, block_n, stages, causal, key_loop,
    ).launch(grid=[m_blocks * heads * batch, 1, 1], block=[THREADS, 1, 1],
             stream=stream)  # fmt: skip
