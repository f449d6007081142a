"""gemm in the CuTe DSL, step 2: TMA, wgmma, warp specialisation and clusters (README.md,
"Step 2").

Compared with step 1 (cute_1_tiled.py), this adds the tensor cores and what feeds them: TMA
copies A and B tiles into a ring of swizzled shared-memory buffers guarded by mbarriers
(`make_ring`), one producer thread keeps the ring full (`produce`) while two consumer
warpgroups multiply with wgmma into float32 accumulators and finish C (`consume`): through
shared memory and TMA stores where C's rows allow it (`store_tile_by_tma`), else from
registers, two columns a time where they can (`finish_tile`); blocks are persistent, in
clusters of two that share each B tile by TMA multicast, walking step 1's grouped order
(`run_roles` gives the two roles their work units: here whole tiles, `whole_tile`). A C of
at most 64 rows takes 64-row tiles, which the two warpgroups split along n (`hopper_tile_m`,
`make_tiled_mma`; README.md, "Step 3"). The arithmetic is step 1's, r = k + 2.
Then the TF32 MMA atom, the launcher, the dispatch (`tma_major`, `choose_kernel`), the builds
and `gemm`, which runs here what TMA and wgmma take and everything else on step 1.
"""

import collections
import functools
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass.cute.atom import make_atom
from cutlass.cute.core import _pack_shape
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warpgroup.mma import MmaF16BF16Trait, MmaOp
from cutlass.memory import SmemAllocator
from cutlass.utils import LayoutEnum

from cute_1_tiled import (
    checked_scalars,
    finish_element,
    placeholder,
    run_plain,
    sm90a_ptx,
    tile_of_block,
)

# The H200 has 132 SMs: the large Hopper tile when C has at least one per SM.
SM_COUNT = 132

# The Hopper kernel. wgmma is issued by a warpgroup, 4 warps of 32 threads, and its M is 64:
# two consumer warpgroups make a 128-row tile, so each B tile in shared memory feeds 128 rows.
# A C of at most WGMMA_M rows (a decode step) takes tiles of WGMMA_M rows instead, which the
# two warpgroups split along n (`make_tiled_mma`): no row of the A tile is padding.
WARPGROUP_THREADS = 128
CONSUMER_WARPGROUPS = 2
CONSUMER_THREADS = CONSUMER_WARPGROUPS * WARPGROUP_THREADS
HOPPER_THREADS = WARPGROUP_THREADS + CONSUMER_THREADS
# The named barrier the consumers meet at in the epilogue (0 is the block's __syncthreads).
EPILOGUE_BARRIER = 1
WGMMA_M = 64
TILE_M = WGMMA_M * CONSUMER_WARPGROUPS
# 128 bytes of a row per k step: one swizzle atom of the 128-byte swizzle, which wgmma reads
# without bank conflicts (64 16-bit or 32 float32 values).
TILE_K_BYTES = 128
# Shared memory for the ring of A and B buffers: 4 stages of 128 x 64 + 256 x 64 16-bit values
# (48 KiB each) or 6 of 128 x 64 + 128 x 64 (32 KiB each); 64-row tiles fit 5 of 40 KiB or 9
# of 24 KiB, more of W in flight. Within the H200's 227 KiB a block, with the mbarriers.
STAGE_BUDGET_BYTES = 216 * 1024
# The epilogue through shared memory (`store_tile_by_tma`): the consumers write C's tile
# EPILOGUE_COLUMNS columns at a time into one of EPILOGUE_BUFFERS buffers of TILE_M x 32
# 16-bit values (8 KiB each, 32 KiB in all), and one thread hands each buffer to a TMA store,
# which writes C in whole 32-byte sectors (64 bytes a row) while the consumers go on, where
# each thread's own stores wrote 4 bytes apart in 8 rows at once. The ring then keeps
# RING_BUDGET_WITH_EPILOGUE_BYTES: the same 4 stages at 128 x 256 and 6 at 128 x 128, 8 (not 9)
# at 128 x 64; 32 + 192 KiB, with the mbarriers and alignment, fit the 227 KiB.
EPILOGUE_COLUMNS = 32
EPILOGUE_BUFFERS = 4
RING_BUDGET_WITH_EPILOGUE_BYTES = 192 * 1024
# setmaxnreg: the producer only computes addresses; the consumers hold the accumulators
# (128 float32 a thread at tile_n = 256). 128 * 40 + 256 * 232 fits the 64 Ki registers of an SM.
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
# TMA's coordinates and box counts are 32-bit: larger dimensions take the plain kernel.
TMA_MAX_DIM = 2**31 - 1
TMA_ALIGN_BYTES = 16


def ceil_div(a, b):
    return (a + b - 1) // b


def ring_stages(tile_m, tile_n, c_by_tma=False):
    """How many stages of tile_m + tile_n rows of TILE_K_BYTES the ring holds (beside the
    epilogue's buffers when C is stored by TMA)."""
    budget = RING_BUDGET_WITH_EPILOGUE_BYTES if c_by_tma else STAGE_BUDGET_BYTES
    return budget // ((tile_m + tile_n) * TILE_K_BYTES)


def epilogue_buffers(tile_n):
    """The epilogue's buffers: EPILOGUE_BUFFERS, or fewer when a tile has fewer column chunks,
    so that every tile starts on buffer 0 and finds it free (a multiple of them a tile)."""
    return min(EPILOGUE_BUFFERS, tile_n // EPILOGUE_COLUMNS)


@cute.jit
def tile_of_cta(
    cluster_tile, rank, m, n, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
    cluster_m: cutlass.Constexpr,
):  # fmt: skip
    """(tile row, tile column) of the Hopper kernel's block of rank `rank` in its cluster, when
    the cluster computes cluster tile `cluster_tile`: cluster tiles (cluster_m tile rows, one
    tile column) run in the grouped order, and the blocks of a cluster take its rows in turn."""
    cluster_row, tile_column = tile_of_block(cluster_tile, m, n, cluster_m * tile_m, tile_n)
    return cluster_row * cluster_m + rank, tile_column


@cute.jit
def finish_each_element(c_mine, coords_mine, acc, m, n, alpha, beta, read_c: cutlass.Constexpr):
    """The epilogue for any C: each of the thread's elements on its own, if inside (m, n)."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        if cute.elem_less(coords_mine[i], (m, n)):
            finish_element(c_mine, i, acc[i], alpha, beta, True, read_c)


@cute.jit
def finish_in_pairs(
    c_mine, c_registers, acc, alpha, beta, read_c: cutlass.Constexpr,
    c_read_early: cutlass.Constexpr,
):  # fmt: skip
    """The epilogue of a whole tile of a row-major C: wgmma leaves each thread pairs of adjacent
    columns, so C is read into registers (c_registers, unless `c_registers_of` read it before
    the k loop) and written back one pair per access (autovec_copy finds the width from the
    layouts), and finish_element does its arithmetic on the copy."""
    if cutlass.const_expr(read_c and not c_read_early):
        cute.autovec_copy(c_mine, c_registers)
    for i in cutlass.range_constexpr(cute.size(acc)):
        finish_element(c_registers, i, acc[i], alpha, beta, True, read_c)
    cute.autovec_copy(c_registers, c_mine)


def consume_k_step(mainloop, state, tiled_mma, acc, a_fragments, b_fragments):
    """Wait until TMA has filled the buffer of `state`, then issue the wgmmas of its k step
    (asynchronous: they read shared memory and add into acc) and commit them as one group."""
    mainloop.consumer_wait(state)
    warpgroup.fence()  # acc's registers are ordered before the wgmmas that read them
    for kb in range(cute.size(a_fragments, mode=[2])):  # plain Python: unrolled while tracing
        where = (None, None, kb, state.index)
        cute.gemm(tiled_mma, acc, a_fragments[where], b_fragments[where], acc)
    warpgroup.commit_group()


@cute.jit
def make_ring(
    dtype, a_smem_layout, b_smem_layout, stages: cutlass.Constexpr, cluster_m: cutlass.Constexpr
):
    """The ring of `stages` A and B buffers in shared memory and its pipeline of mbarriers."""
    # Shared memory: the mbarriers ("full" and "empty" per stage), then the A and B rings,
    # 1024-byte aligned as the 128-byte swizzle pattern repeats every 8 rows of 128 bytes.
    smem = SmemAllocator()
    barriers = smem.allocate_array(cutlass.Int64, 2 * stages, byte_alignment=8)
    a_ring = smem.allocate_tensor(
        dtype, a_smem_layout.outer, byte_alignment=1024, swizzle=a_smem_layout.inner
    )
    b_ring = smem.allocate_tensor(
        dtype, b_smem_layout.outer, byte_alignment=1024, swizzle=b_smem_layout.inner
    )
    a_stage = cute.slice_(a_smem_layout, (None, None, 0))
    b_stage = cute.slice_(b_smem_layout, (None, None, 0))
    # A stage is full when its A tile and its whole B tile have landed, whichever block of the
    # cluster loaded each part of B.
    bytes_per_stage = cute.size_in_bytes(dtype, a_stage) + cute.size_in_bytes(dtype, b_stage)
    # One producer thread arrives (with the byte count TMA must deliver) on "full". On "empty",
    # lane j < cluster_m of each consumer warp arrives on the barrier of the cluster's block j
    # (the pipeline finds these from the cluster's layout (v, m, n, l) = (1, cluster_m, 1, 1)):
    # a block's TMA writes B into every block of the cluster, so it may refill a stage only
    # when all their consumer warps are done with it. create() initialises the barriers and
    # syncs the block, or the cluster, so that no arrive reaches a barrier before its init.
    mainloop = pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(
            pipeline.Agent.Thread, cluster_m * CONSUMER_WARPGROUPS * WARPGROUP_THREADS // 32
        ),
        tx_count=bytes_per_stage,
        cta_layout_vmnk=cute.make_layout((1, cluster_m, 1, 1)),
    )
    return mainloop, a_ring, b_ring


@cute.jit
def produce(
    mainloop, tma_a, A_tma, tma_b, B_tma, a_ring, b_ring, rank, units, work,
    tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, tile_k: cutlass.Constexpr,
    stages: cutlass.Constexpr, cluster_m: cutlass.Constexpr,
):  # fmt: skip
    """The producer (one thread): for each k step of each of the block's work units (`units`,
    `work`: see run_roles), wait until the next buffer of the ring is empty, then TMA-copy the
    A tile and this block's part of the B tile into it, completing on its "full" barrier."""
    # (tile_m, tile_k, tile row, k step) and (tile_n, tile_k, tile column, k step) tiles of
    # the TMA tensors, then TMA's view of them: one copy per operand per step.
    a_tiles = cute.local_tile(A_tma, (tile_m, tile_k), (None, None))
    b_tiles = cute.local_tile(B_tma, (tile_n, tile_k), (None, None))
    a_smem_part, a_gmem_part = cpasync.tma_partition(
        tma_a, 0, cute.make_layout(1),
        cute.group_modes(a_ring, 0, 2), cute.group_modes(a_tiles, 0, 2),
    )  # fmt: skip
    # The cluster's blocks share each B tile: block `rank` loads slice `rank` of cluster_m and
    # multicasts it to every block of the cluster (mask: all of them), into the same place of
    # each one's ring. The mask is ignored by the plain TMA load of cluster_m = 1.
    b_smem_part, b_gmem_part = cpasync.tma_partition(
        tma_b, rank, cute.make_layout(cluster_m),
        cute.group_modes(b_ring, 0, 2), cute.group_modes(b_tiles, 0, 2),
    )  # fmt: skip
    b_receivers = cutlass.Int16((1 << cluster_m) - 1)
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    first_unit, end_unit, unit_step = units
    for unit in cutlass.range(first_unit, end_unit, unit_step, unroll=1):
        tile_m_index, tile_n_index, first_k_step, k_steps = work(unit)
        for k_step in cutlass.range(first_k_step, first_k_step + k_steps, unroll=1):
            mainloop.producer_acquire(state)  # the buffer is empty; expect its bytes
            full = mainloop.producer_get_barrier(state)
            cute.copy(
                tma_a, a_gmem_part[(None, tile_m_index, k_step)],
                a_smem_part[(None, state.index)], tma_bar_ptr=full,
            )  # fmt: skip
            cute.copy(
                tma_b, b_gmem_part[(None, tile_n_index, k_step)],
                b_smem_part[(None, state.index)], tma_bar_ptr=full, mcast_mask=b_receivers,
            )  # fmt: skip
            mainloop.producer_commit(state)
            state.advance()
    # Exit only after the consumers freed every buffer; with a cluster, this also waits for
    # the partner's remote arrives, which must not reach an exited block.
    mainloop.producer_tail(state)


@cute.jit
def consume(
    mainloop, tiled_mma, a_ring, b_ring, thread, warpgroup_index, units, work, prepare, finish,
    tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, stages: cutlass.Constexpr,
):  # fmt: skip
    """A consumer warpgroup: for each of the block's work units, let `prepare` set up what the
    epilogue needs, multiply its 64 rows of the A tile by the B tile (of a 64-row tile, the A
    tile by its half of the B tile), k step by k step as the ring fills, then hand the float32
    accumulator and what `prepare` gave to `finish` (see run_roles)."""
    consumer_thread = thread - WARPGROUP_THREADS
    # wgmma's A and B "fragments" are shared-memory descriptors, the same for the 128
    # threads of a warpgroup: partition with the warpgroup's first thread.
    warpgroup_mma = tiled_mma.get_slice((warpgroup_index - 1) * WARPGROUP_THREADS)
    a_fragments = tiled_mma.make_fragment_A(warpgroup_mma.partition_A(a_ring))
    b_fragments = tiled_mma.make_fragment_B(warpgroup_mma.partition_B(b_ring))
    # The accumulator is per thread: the epilogue partitions its tile by this thread.
    thread_mma = tiled_mma.get_slice(consumer_thread)
    acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((tile_m, tile_n)), cutlass.Float32)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)

    read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    first_unit, end_unit, unit_step = units
    for unit in cutlass.range(first_unit, end_unit, unit_step, unroll=1):
        tile_m_index, tile_n_index, _, k_steps = work(unit)
        prepared = prepare(thread_mma, tile_m_index, tile_n_index)
        acc.fill(0.0)  # the wgmmas add into it: 0 + s is exact
        consume_k_step(mainloop, read_state, tiled_mma, acc, a_fragments, b_fragments)
        read_state.advance()
        for _ in cutlass.range(1, k_steps, unroll=1):
            consume_k_step(mainloop, read_state, tiled_mma, acc, a_fragments, b_fragments)
            read_state.advance()
            # At most this step's group still runs: the previous step's buffer is free.
            warpgroup.wait_group(1)
            mainloop.consumer_release(release_state)
            release_state.advance()
        warpgroup.wait_group(0)
        mainloop.consumer_release(release_state)
        release_state.advance()
        finish(thread_mma, acc, prepared, unit, tile_m_index, tile_n_index)


@cute.jit
def c_registers_of(
    thread_mma, tile_m_index, tile_n_index, C, m, n, tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr, c_read_early: cutlass.Constexpr,
):  # fmt: skip
    """The thread's registers for its elements of tile (tile_m_index, tile_n_index) of C, the
    work unit's `prepare` (see run_roles). With c_read_early, C is read into them now, before
    the k loop, when the tile is whole: the loads' latency then passes under the ring's first
    fill instead of after the last wgmma (README.md, tuning log, "Medium sizes, read with
    ncu")."""
    tile_shape, tile = (tile_m, tile_n), (tile_m_index, tile_n_index)
    c_mine = thread_mma.partition_C(cute.local_tile(C, tile_shape, tile))
    c_registers = cute.make_rmem_tensor_like(c_mine)
    if cutlass.const_expr(c_read_early):
        if (tile_m_index + 1) * tile_m <= m and (tile_n_index + 1) * tile_n <= n:
            cute.autovec_copy(c_mine, c_registers)
    return c_registers


@cute.jit
def finish_tile(
    thread_mma, acc, c_registers, unit, tile_m_index, tile_n_index, C, m, n, alpha, beta,
    tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, read_c: cutlass.Constexpr,
    c_pairs: cutlass.Constexpr, c_read_early: cutlass.Constexpr,
):  # fmt: skip
    """The epilogue of this step's work unit: tile (tile_m_index, tile_n_index) of C becomes
    alpha * acc + beta * C, in column pairs (through c_registers, from c_registers_of) on a
    whole tile of a paired C (c_pairs), else element by element inside (m, n)."""
    tile_shape, tile = (tile_m, tile_n), (tile_m_index, tile_n_index)
    c_mine = thread_mma.partition_C(cute.local_tile(C, tile_shape, tile))
    coords = cute.local_tile(cute.make_identity_tensor((m, n)), tile_shape, tile)
    coords_mine = thread_mma.partition_C(coords)
    if cutlass.const_expr(c_pairs):
        inside = (tile_m_index + 1) * tile_m <= m and (tile_n_index + 1) * tile_n <= n
        if inside:
            finish_in_pairs(c_mine, c_registers, acc, alpha, beta, read_c, c_read_early)
        else:
            finish_each_element(c_mine, coords_mine, acc, m, n, alpha, beta, read_c)
    else:
        finish_each_element(c_mine, coords_mine, acc, m, n, alpha, beta, read_c)


@cute.jit
def store_tile_by_tma(
    thread_mma, acc, c_registers, unit, tile_m_index, tile_n_index, C, m, n, alpha, beta,
    tiled_mma, tma_c, C_tma, c_buffers, stores, tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr, read_c: cutlass.Constexpr, c_read_early: cutlass.Constexpr,
):  # fmt: skip
    """finish_tile's epilogue through shared memory, for 16-bit C whose rows TMA can store: a
    whole tile's alpha * acc + beta * C is computed in the accumulator's registers (the same
    float32 arithmetic as finish_element), then EPILOGUE_COLUMNS columns at a time rounded to
    C's dtype, written by stmatrix into a buffer of shared memory and stored by one TMA copy
    (`store_chunks_by_tma`); a partial tile goes element by element, as finish_tile's."""
    tile_shape, tile = (tile_m, tile_n), (tile_m_index, tile_n_index)
    c_mine = thread_mma.partition_C(cute.local_tile(C, tile_shape, tile))
    if (tile_m_index + 1) * tile_m <= m and (tile_n_index + 1) * tile_n <= n:
        if cutlass.const_expr(read_c and not c_read_early):
            cute.autovec_copy(c_mine, c_registers)
        for i in cutlass.range_constexpr(cute.size(acc)):
            result = alpha * acc[i]
            if cutlass.const_expr(read_c):
                result = result + beta * c_registers[i].to(cutlass.Float32)
            acc[i] = result
        store_chunks_by_tma(
            acc, tile_m_index, tile_n_index, tiled_mma, tma_c, C_tma, c_buffers, stores, tile_m,
            tile_n,
        )  # fmt: skip
    else:
        coords = cute.local_tile(cute.make_identity_tensor((m, n)), tile_shape, tile)
        finish_each_element(c_mine, thread_mma.partition_C(coords), acc, m, n, alpha, beta, read_c)


@cute.jit
def store_chunks_by_tma(
    results, tile_m_index, tile_n_index, tiled_mma, tma_c, C_tma, c_buffers, stores,
    tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
):  # fmt: skip
    """Store the float32 `results` of tile (tile_m_index, tile_n_index), in the accumulator's
    thread map, into C: for each chunk of EPILOGUE_COLUMNS columns, the 256 consumer threads
    round their part of it and write it by stmatrix (8 x 8 16-bit matrices, four at once)
    into the next of the ring of `c_buffers` (swizzled, so the rows a warp writes at once
    fall in different banks); then one thread issues the chunk's TMA store and
    waits until at most EPILOGUE_BUFFERS - 1 stores still read their buffers, so the next
    buffer is free when the consumers pass the barrier. The stores of a tile's last chunks
    run on while the consumers start the next tile's wgmmas."""
    consumer_thread = cute.arch.thread_idx()[0] - WARPGROUP_THREADS
    consumer_warp = cute.arch.make_warp_uniform(consumer_thread // 32)
    dtype = c_buffers.element_type
    stmatrix = sm90_utils.sm90_get_smem_store_op(LayoutEnum.ROW_MAJOR, dtype, cutlass.Float32)
    to_shared = cute.make_tiled_copy_S(stmatrix, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
    thread_copy = to_shared.get_slice(consumer_thread)
    buffers_mine = thread_copy.partition_D(c_buffers)  # (copy, rows, columns, buffer)
    results_mine = to_shared.retile(results)  # the same registers, in the copy's order
    chunk_layout = cute.make_layout(cute.shape(thread_copy.partition_S(c_buffers))[:3])
    values_per_chunk = cute.size(chunk_layout)
    # TMA's view: C as (tile_m, EPILOGUE_COLUMNS) chunks, a copy per chunk and buffer.
    c_chunks = cute.local_tile(C_tma, (tile_m, EPILOGUE_COLUMNS), (None, None))
    buffers_tma, chunks_tma = cpasync.tma_partition(
        tma_c, 0, cute.make_layout(1),
        cute.group_modes(c_buffers, 0, 2), cute.group_modes(c_chunks, 0, 2),
    )  # fmt: skip
    chunks = tile_n // EPILOGUE_COLUMNS
    buffers = cute.size(c_buffers, mode=[2])
    for chunk in cutlass.range_constexpr(chunks):
        buffer = chunk % buffers
        chunk_f32 = cute.make_rmem_tensor(chunk_layout, cutlass.Float32)
        for v in cutlass.range_constexpr(values_per_chunk):
            chunk_f32[v] = results_mine[chunk * values_per_chunk + v]
        rounded = cute.make_rmem_tensor(chunk_layout, dtype)
        rounded.store(chunk_f32.load().to(dtype))  # cvt.rn, to nearest even, two at a time
        cute.copy(to_shared, rounded, buffers_mine[(None, None, None, buffer)])
        # The generic-proxy writes become visible to TMA (the async proxy), then every
        # consumer's writes are in before the store starts.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=CONSUMER_THREADS)
        if consumer_warp == 0:
            with cute.arch.elect_one():  # one thread issues, commits and counts the stores
                cute.copy(
                    tma_c, buffers_tma[(None, buffer)],
                    chunks_tma[(None, tile_m_index, tile_n_index * chunks + chunk)],
                )  # fmt: skip
                stores.producer_commit()
                stores.producer_acquire()  # the next buffer's earlier store has read it
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=CONSUMER_THREADS)


@cute.jit
def whole_tile(
    cluster_tile, rank, m, n, k_steps, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
    cluster_m: cutlass.Constexpr,
):  # fmt: skip
    """This step's work unit, cluster tile `cluster_tile`: the block's tile of it (tile_of_cta)
    and all of k, as (tile row, tile column, first k step, k steps)."""
    tile_m_index, tile_n_index = tile_of_cta(cluster_tile, rank, m, n, tile_m, tile_n, cluster_m)
    return tile_m_index, tile_n_index, 0, k_steps


@cute.jit
def run_roles(
    tma_a, A_tma, tma_b, B_tma, tiled_mma, a_smem_layout, b_smem_layout, rank, units, work,
    prepare, finish, dtype: cutlass.Constexpr, tile_m: cutlass.Constexpr,
    tile_n: cutlass.Constexpr, tile_k: cutlass.Constexpr, stages: cutlass.Constexpr,
    cluster_m: cutlass.Constexpr,
):  # fmt: skip
    """The block's work: the ring, then warp specialisation over the work units `units` =
    (first, end, step) of `range`. work(unit) says what a unit multiplies, (tile row, tile
    column, first k step, k steps); prepare(thread_mma, tile row, tile column), run before its
    k loop, what its epilogue needs; finish(thread_mma, acc, prepared, unit, tile row, tile
    column) what becomes of its float32 accumulator. All three are traced into the loops (this
    step's: whole_tile, c_registers_of, finish_tile; step 3 passes its own)."""
    thread, _, _ = cute.arch.thread_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    warpgroup_index = cute.arch.make_warp_uniform(thread // WARPGROUP_THREADS)
    if warp == 0:
        cpasync.prefetch_descriptor(tma_a)
        cpasync.prefetch_descriptor(tma_b)

    mainloop, a_ring, b_ring = make_ring(dtype, a_smem_layout, b_smem_layout, stages, cluster_m)
    # Producer and consumers walk the same units and the ring's state runs on across them, so
    # TMA already loads the next unit while the consumers finish the last one.
    # Warp specialisation: warpgroup 0 gives its registers to the consumers (it only computes
    # addresses) and one of its threads produces; warpgroups 1 and 2 consume.
    if warpgroup_index == 0:
        cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
        if warp == 0:
            produce(
                mainloop, tma_a, A_tma, tma_b, B_tma, a_ring, b_ring, rank, units, work, tile_m,
                tile_n, tile_k, stages, cluster_m,
            )  # fmt: skip
    else:
        cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
        consume(
            mainloop, tiled_mma, a_ring, b_ring, thread, warpgroup_index, units, work, prepare,
            finish, tile_m, tile_n, stages,
        )  # fmt: skip


@cute.kernel
def hopper_kernel(
    tma_a: cute.CopyAtom,
    A_tma: cute.Tensor,
    tma_b: cute.CopyAtom,
    B_tma: cute.Tensor,
    C: cute.Tensor,
    m: cutlass.Int64,
    n: cutlass.Int64,
    k: cutlass.Int64,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    tiled_mma: cute.TiledMma,
    a_smem_layout: cute.ComposedLayout,
    b_smem_layout: cute.ComposedLayout,
    dtype: cutlass.Constexpr,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    tile_k: cutlass.Constexpr[int],
    stages: cutlass.Constexpr[int],
    read_c: cutlass.Constexpr[bool],
    c_pairs: cutlass.Constexpr[bool],
    c_read_early: cutlass.Constexpr[bool],
    cluster_m: cutlass.Constexpr[int],
    tma_c: cute.CopyAtom | None,
    C_tma: cute.Tensor | None,
    c_smem_layout: cute.ComposedLayout | None,
):
    block, _, _ = cute.arch.block_idx()
    blocks, _, _ = cute.arch.grid_dim()
    # A 1-D grid in clusters of cluster_m x 1 x 1: block b is block b mod cluster_m of cluster
    # b div cluster_m (its %cluster_ctarank, which multicast masks and remote arrives name).
    cluster, rank = block // cluster_m, block % cluster_m
    clusters = blocks // cluster_m
    k_steps = cutlass.Int32((k + tile_k - 1) // tile_k)
    # Persistent: cluster c computes cluster tiles c, c + clusters, c + 2 clusters, ... of the
    # grouped order, each of its blocks one tile. Both blocks of a cluster walk the same cluster
    # tiles, so their rings advance together (when m has an odd number of tile rows, one block
    # of the last cluster row computes a tile past m: zeros in, nothing stored). The tile index
    # is 32-bit (CuTe DSL 4.8.1 does not compile these loops over an Int64 index; TMA's
    # dimensions are below 2**31 anyway).
    cluster_tile_m = cluster_m * tile_m
    cluster_tiles = cutlass.Int32(
        ((m + cluster_tile_m - 1) // cluster_tile_m) * ((n + tile_n - 1) // tile_n)
    )
    work = functools.partial(
        whole_tile, rank=rank, m=m, n=n, k_steps=k_steps, tile_m=tile_m, tile_n=tile_n,
        cluster_m=cluster_m,
    )  # fmt: skip
    prepare = functools.partial(
        c_registers_of, C=C, m=m, n=n, tile_m=tile_m, tile_n=tile_n, c_read_early=c_read_early
    )
    finish = functools.partial(
        finish_tile, C=C, m=m, n=n, alpha=alpha, beta=beta, tile_m=tile_m, tile_n=tile_n,
        read_c=read_c, c_pairs=c_pairs, c_read_early=c_read_early,
    )  # fmt: skip
    if cutlass.const_expr(tma_c is not None):  # C stored through shared memory by TMA
        c_buffers = SmemAllocator().allocate_tensor(
            dtype, c_smem_layout.outer, byte_alignment=1024, swizzle=c_smem_layout.inner
        )
        # No mbarriers: the issuing warp counts its bulk stores (cp.async.bulk.wait_group).
        stores = pipeline.PipelineTmaStore.create(
            num_stages=cute.size(c_buffers, mode=[2]),
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS),
        )
        finish = functools.partial(
            store_tile_by_tma, C=C, m=m, n=n, alpha=alpha, beta=beta, tiled_mma=tiled_mma,
            tma_c=tma_c, C_tma=C_tma, c_buffers=c_buffers, stores=stores, tile_m=tile_m,
            tile_n=tile_n, read_c=read_c, c_read_early=c_read_early,
        )  # fmt: skip
    run_roles(
        tma_a, A_tma, tma_b, B_tma, tiled_mma, a_smem_layout, b_smem_layout, rank,
        (cluster, cluster_tiles, clusters), work, prepare, finish, dtype, tile_m, tile_n, tile_k,
        stages, cluster_m,
    )  # fmt: skip
    if cutlass.const_expr(tma_c is not None):
        # The block's shared memory must outlive the TMA stores that read it: the thread that
        # issued them (elect_one's, the first consumer warp's lane 0) waits for them.
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == WARPGROUP_THREADS // 32:
            stores.producer_tail()


class MmaTF32Op(MmaOp):
    """wgmma.mma_async with TF32 inputs (k = 8 per instruction) and a float32 accumulator,
    which CuTe DSL 4.8.1 does not wrap: the same SM90 MMA atom as the 16-bit one, with the
    TF32 element type. PTX allows it K-major only."""

    def __init__(self, n):
        k_major = OperandMajorMode.K
        super().__init__(
            cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32, (64, n, 8),
            warpgroup.OperandSource.SMEM, k_major, k_major,
        )  # fmt: skip

    def _make_trait(self, *, loc=None, ip=None, **kwargs):
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            _pack_shape(self.shape_mnk, loc=loc, ip=ip).type.attribute,
            self.a_major_mode._to_ir(), self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type,
            self.a_src._to_ir(),
        )  # fmt: skip
        return MmaF16BF16Trait(
            make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip)
        )


def make_tiled_mma(dtype, a_major, b_major, tile_m, tile_n):
    """The two consumer warpgroups on a tile_m x tile_n tile: side by side along m, each
    issuing 64 x tile_n wgmmas, when tile_m = TILE_M; along n, each issuing 64 x (tile_n / 2)
    wgmmas on the same 64 rows of A, when tile_m = WGMMA_M."""
    along_m = tile_m == TILE_M
    warpgroups = (CONSUMER_WARPGROUPS, 1, 1) if along_m else (1, CONSUMER_WARPGROUPS, 1)
    wgmma_n = tile_n if along_m else tile_n // CONSUMER_WARPGROUPS
    if cutlass.const_expr(dtype == cutlass.Float32):
        return cute.make_tiled_mma(cute.make_mma_atom(MmaTF32Op(wgmma_n)), warpgroups)
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
        cutlass.Float32, warpgroups, tiler_mn=(WGMMA_M, wgmma_n),
    )  # fmt: skip


# What the Hopper kernel is given for A and B (`hopper_operands`): 32-bit sizes, the k step and
# ring depth, the MMA, the shared-memory layouts, the TMA atoms and tensors.
HopperOperands = collections.namedtuple(
    "HopperOperands",
    "m n k tile_k stages tiled_mma a_smem_layout b_smem_layout tma_a A_tma tma_b B_tma",
)


@cute.jit
def hopper_operands(
    A, B, a_k_major: cutlass.Constexpr, b_k_major: cutlass.Constexpr,
    tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, cluster_m: cutlass.Constexpr,
    c_by_tma: cutlass.Constexpr = False,
):  # fmt: skip
    """The Hopper kernel's view of A and B (HopperOperands), built on the host."""
    dtype = A.element_type
    tile_k = TILE_K_BYTES * 8 // dtype.width
    stages = ring_stages(tile_m, tile_n, c_by_tma)
    # The MMA's view: A is (m, k), B is (n, k); "K-major" means k has stride 1. Its sizes are
    # 32-bit, as TMA's coordinates are: `tma_major` sends only dimensions below 2**31 here.
    m, k = cutlass.Int32(cute.size(A, mode=[0])), cutlass.Int32(cute.size(A, mode=[1]))
    n = cutlass.Int32(cute.size(B, mode=[1]))
    A = cute.make_tensor(A.iterator, cute.make_layout((m, k), stride=A.stride))
    B = cute.make_tensor(B.iterator, cute.make_layout((n, k), stride=B.stride[::-1]))
    a_major = LayoutEnum.ROW_MAJOR if a_k_major else LayoutEnum.COL_MAJOR
    b_major = LayoutEnum.ROW_MAJOR if b_k_major else LayoutEnum.COL_MAJOR
    tiled_mma = make_tiled_mma(dtype, a_major, b_major, tile_m, tile_n)
    tile_mnk = (tile_m, tile_n, tile_k)
    a_smem_layout = sm90_utils.make_smem_layout_a(a_major, tile_mnk, dtype, stages)
    b_smem_layout = sm90_utils.make_smem_layout_b(b_major, tile_mnk, dtype, stages)
    load = cpasync.CopyBulkTensorTileG2SOp()
    tma_a, A_tma = cpasync.make_tiled_tma_atom(
        load, A, cute.slice_(a_smem_layout, (None, None, 0)), (tile_m, tile_k)
    )
    # In a cluster, each block's TMA loads 1 / cluster_m of the B tile and multicasts it.
    load_b = cpasync.CopyBulkTensorTileG2SMulticastOp() if cluster_m > 1 else load
    tma_b, B_tma = cpasync.make_tiled_tma_atom(
        load_b, B, cute.slice_(b_smem_layout, (None, None, 0)), (tile_n, tile_k), cluster_m
    )
    return HopperOperands(
        m, n, k, tile_k, stages, tiled_mma, a_smem_layout, b_smem_layout, tma_a, A_tma, tma_b,
        B_tma,
    )  # fmt: skip


@cute.jit
def launch_hopper(
    A: cute.Tensor,
    B: cute.Tensor,
    C: cute.Tensor,
    alpha: cutlass.Float32,
    beta: cutlass.Float32,
    blocks: cutlass.Int32,
    stream: cuda.CUstream,
    a_k_major: cutlass.Constexpr[bool],
    b_k_major: cutlass.Constexpr[bool],
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    read_c: cutlass.Constexpr[bool],
    c_pairs: cutlass.Constexpr[bool],
    c_read_early: cutlass.Constexpr[bool],
    cluster_m: cutlass.Constexpr[int],
    c_by_tma: cutlass.Constexpr[bool],
):
    # A, B and C arrive as torch tensors through TVM-FFI, with the layouts of `build_hopper`:
    # A and B with their stride-1 dimension known, bases and other strides on 16-byte
    # boundaries (`tma_major`), which TMA needs; C with column stride 1 and an even row stride
    # in the paired build (`in_pairs`), rows as A's in the TMA-stored build (`stores_by_tma`),
    # any strides otherwise.
    ops = hopper_operands(A, B, a_k_major, b_k_major, tile_m, tile_n, cluster_m, c_by_tma)
    C = cute.make_tensor(C.iterator, cute.make_layout((ops.m, ops.n), stride=C.stride))
    tma_c = C_tma = c_smem_layout = None
    if cutlass.const_expr(c_by_tma):
        c_smem_layout = sm90_utils.make_smem_layout_epi(
            A.element_type, LayoutEnum.ROW_MAJOR, (tile_m, EPILOGUE_COLUMNS),
            epilogue_buffers(tile_n),
        )  # fmt: skip
        tma_c, C_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), C, cute.slice_(c_smem_layout, (None, None, 0)),
            (tile_m, EPILOGUE_COLUMNS),
        )  # fmt: skip
    hopper_kernel(
        ops.tma_a, ops.A_tma, ops.tma_b, ops.B_tma, C, cutlass.Int64(ops.m),
        cutlass.Int64(ops.n), cutlass.Int64(ops.k), alpha, beta, ops.tiled_mma,
        ops.a_smem_layout, ops.b_smem_layout, A.element_type, tile_m, tile_n, ops.tile_k,
        ops.stages, read_c, c_pairs, c_read_early, cluster_m, tma_c, C_tma, c_smem_layout,
    ).launch(
        grid=[blocks, 1, 1], block=[HOPPER_THREADS, 1, 1], stream=stream,
        cluster=[cluster_m, 1, 1] if cluster_m > 1 else None,  # 1: a plain launch, as before
    )  # fmt: skip


@functools.cache
def sm_count(device):
    """The number of SMs of CUDA device `device` (its index; 132 on the H200), asked once."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def hopper_tile_m(m):
    """WGMMA_M rows a tile when C has no more (a decode step), else TILE_M."""
    return WGMMA_M if m <= WGMMA_M else TILE_M


def wave_time(m, n, tile_n):
    """The time of C's tiles of 128 x tile_n on SM_COUNT SMs, in units of a 128-column tile's:
    whole waves (the last one costs as much as a full one), each as long as tile_n."""
    return ceil_div(ceil_div(m, TILE_M) * ceil_div(n, tile_n), SM_COUNT) * tile_n // 128


def hopper_tile_n(m, n):
    """256 columns a tile when C has at least one 128 x 256 tile per SM, unless 128-column
    tiles quantise into waves at least 10% better (`wave_time`: 3072^2, 288 tiles of 256 in 3
    waves against 576 of 128 in 5, 0.79x -> 0.86x cuBLAS; README.md, tuning log, "C stored by
    TMA"); the smaller tile's lower rate costs about that much where the waves tie (4096^2,
    8192^2). 64 when 128-row tiles of 128 columns would leave more than half the SMs idle and
    those of 64 fit one wave (1024^2: 128 tiles on 128 SMs, each with half the k loop's work,
    in place of 64 tiles on 64 SMs; tuning log, "Medium sizes, read with ncu"). Else 128.
    Decode steps (m <= TILE_M, one tile row) keep 128 and 256, which their plans were
    measured with."""
    if ceil_div(m, TILE_M) * ceil_div(n, 256) >= SM_COUNT:
        if m > TILE_M and wave_time(m, n, 128) < 0.9 * wave_time(m, n, 256):
            return 128
        return 256
    if m > TILE_M and 2 * ceil_div(m, TILE_M) * ceil_div(n, 128) <= SM_COUNT:
        return 64 if ceil_div(m, TILE_M) * ceil_div(n, 64) <= SM_COUNT else 128
    return 128


def tma_major(t):
    """How TMA can load the matrix t: 'rows' when its rows are contiguous (stride 1 along a
    row), 'cols' when its columns are; the other stride and the base must be multiples of 16
    bytes and the dimensions below 2**31. None when TMA cannot."""
    (rows, cols), (row_stride, col_stride) = t.shape, t.stride()
    if rows > TMA_MAX_DIM or cols > TMA_MAX_DIM or t.data_ptr() % TMA_ALIGN_BYTES:
        return None
    if col_stride == 1 and row_stride > 0 and row_stride * t.itemsize % TMA_ALIGN_BYTES == 0:
        return "rows"
    if row_stride == 1 and col_stride > 0 and col_stride * t.itemsize % TMA_ALIGN_BYTES == 0:
        return "cols"
    return None


def in_pairs(C):
    """True when the Hopper epilogue may move C two adjacent columns at a time: rows of stride 1
    that start on a 2-element boundary."""
    row_stride, col_stride = C.stride()
    return col_stride == 1 and row_stride % 2 == 0 and C.data_ptr() % (2 * C.itemsize) == 0


class KernelChoice(NamedTuple):
    """Which kernel runs a product: "hopper" (with its operands' majorness, compiled into the
    build) or "plain" (step 1's, which takes any strides: no majorness)."""

    kernel: str
    a_k_major: bool | None = None
    b_k_major: bool | None = None


PLAIN = KernelChoice("plain")


def choose_kernel(A, B, allow_tf32):
    """The KernelChoice for A and B: TMA must take both operands (`tma_major`), and float32
    goes to wgmma only as TF32, asked for (allow_tf32) and with both operands K-major, all that
    TF32 wgmma reads; everything else is step 1's."""
    a_major, b_major = tma_major(A), tma_major(B)
    if a_major is None or b_major is None:
        return PLAIN
    # A (m, k) is K-major when its rows are contiguous; B (k, n) when its columns are.
    a_k_major, b_k_major = a_major == "rows", b_major == "cols"
    if A.dtype == torch.float32 and not (allow_tf32 and a_k_major and b_k_major):
        return PLAIN
    return KernelChoice("hopper", a_k_major=a_k_major, b_k_major=b_k_major)


def build_hopper(
    dtype, a_k_major, b_k_major, tile_m, tile_n, read_c, c_pairs, cluster_m, c_read_early=False,
    c_by_tma=False, options="",
):  # fmt: skip
    """cute.compile the Hopper launcher for TVM-FFI calls (as build_plain). A and B get the
    stride 1 along their contiguous dimension (k if K-major) and 16-byte aligned bases and
    other strides, which TMA needs; C the pairs' layout if c_pairs; c_read_early (with read_c
    and c_pairs) reads a whole tile's C before its k loop (`reads_c_early`); c_by_tma stores
    C through shared memory by TMA (`stores_by_tma`), with C's layout as A's."""
    m, n, k = cute.sym_int64(), cute.sym_int64(), cute.sym_int64()
    tma_vector = TMA_ALIGN_BYTES // dtype.itemsize
    A = placeholder(dtype, m, k, 1 if a_k_major else 0, tma_vector)
    B = placeholder(dtype, k, n, 0 if b_k_major else 1, tma_vector)
    if c_by_tma:
        C = placeholder(dtype, m, n, 1, tma_vector)
    else:
        C = placeholder(dtype, m, n, 1, 2) if c_pairs else placeholder(dtype, m, n)
    alpha = beta = 1.0  # Float32 arguments: only their type is compiled in
    blocks = 1  # the persistent grid's size, an Int32 argument given at each call
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)  # torch's, at each call
    return cute.compile(
        launch_hopper, A, B, C, alpha, beta, blocks, stream,
        a_k_major, b_k_major, tile_m, tile_n, read_c, c_pairs, c_read_early, cluster_m,
        c_by_tma, options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_hopper(
    dtype, a_k_major, b_k_major, tile_m, tile_n, read_c, c_pairs, cluster_m, c_read_early,
    c_by_tma,
):  # fmt: skip
    """The Hopper kernel for `dtype`, operand majorness, tile, epilogue and cluster size, built
    once and cached (the TVM-FFI function, as compile_plain)."""
    build = build_hopper(
        dtype, a_k_major, b_k_major, tile_m, tile_n, read_c, c_pairs, cluster_m, c_read_early,
        c_by_tma,
    )  # fmt: skip
    return build.__tvm_ffi_object__()


def ptx_of(
    dtype, a_k_major=True, b_k_major=True, tile_n=256, read_c=True, c_pairs=False, cluster_m=2,
    tile_m=TILE_M, c_read_early=False, c_by_tma=False,
):  # fmt: skip
    """The sm_90a PTX of the Hopper kernel's build for these compile-time choices."""
    return sm90a_ptx(
        build_hopper, dtype, a_k_major, b_k_major, tile_m, tile_n, read_c, c_pairs, cluster_m,
        c_read_early, c_by_tma,
    )  # fmt: skip


def reads_c_early(read_c, c_pairs, tile_n, cluster_tiles, cluster_slots):
    """Whether the Hopper kernel reads C's whole tiles before their k loops: only when each
    block computes one tile (cluster_tiles fit the cluster_slots of the grid), whose C loads
    then overlap the ring's first fill, and at 128 columns or fewer (a 256-column tile's C
    beside its accumulator spills registers). Measured (H100, README.md, tuning log, "Medium
    sizes, read with ncu"): 1024^3 10.9 -> 9.2 us; where a block computes several tiles the C
    loads of the next delay its wgmmas instead, 2048^3 36.8 -> 39.4 us."""
    return read_c and c_pairs and tile_n <= 128 and cluster_tiles <= cluster_slots


def stores_by_tma(C, tile_m):
    """Whether the Hopper kernel stores C through shared memory by TMA (`store_tile_by_tma`):
    16-bit C (a float32 chunk would need twice the buffers) on 128-row tiles (the two
    warpgroups side by side along m, the layout the epilogue's chunks follow), with rows TMA
    can store (`tma_major`)."""
    return C.itemsize == 2 and tile_m == TILE_M and tma_major(C) == "rows"


def gemm(alpha, A, B, beta, C, *, allow_tf32=False, cluster_m=2):
    """C = alpha*A@B + beta*C for CUDA tensors of one dtype, in float32; returns C. The Hopper
    kernel takes what `choose_kernel` gives it and runs in clusters of `cluster_m` blocks along
    m (1 or 2) that share each B tile; a C of one tile row (m <= TILE_M) takes clusters of 1,
    whose partner would only compute zeros. Everything else, and alpha32 == 0 or k == 0 (no
    product to multiply), runs on step 1's plain kernel."""
    alpha32, beta32, read_ab, read_c = checked_scalars(alpha, A, B, beta, C)
    return run_checked(A, B, C, alpha32, beta32, read_ab, read_c, allow_tf32, cluster_m)


def run_checked(A, B, C, alpha32, beta32, read_ab, read_c, allow_tf32, cluster_m):
    """gemm once checked_scalars has passed; later steps hand here what they do not change."""
    m, n = C.shape
    if m == 0 or n == 0:
        return C
    choice = choose_kernel(A, B, allow_tf32) if read_ab else PLAIN
    if choice.kernel == "plain":
        run_plain(A, B, C, alpha32, beta32, read_ab, read_c)
        return C
    tile_m, tile_n = hopper_tile_m(m), hopper_tile_n(m, n)
    # 64- and 128-column tiles run alone. In clusters of 2, 64 measured 1.5x slower (1024^3:
    # 16.5 us against 11.0), their B tile split in two 32-column multicasts; 128, with C stored
    # by TMA, 0.86x cuBLAS at 2048^3 against 0.92x alone (3072^3: 0.84x, 0.86x; H100).
    cluster_m = cluster_m if m > tile_m and tile_n > 128 else 1
    # Persistent: one block per SM, fewer when C has fewer tiles, in whole clusters. TVM-FFI
    # launches on torch's current stream of C's GPU, as step 1's run_plain.
    cluster_tiles = ceil_div(m, cluster_m * tile_m) * ceil_div(n, tile_n)
    cluster_slots = sm_count(C.get_device()) // cluster_m
    c_pairs = in_pairs(C)
    kernel = compile_hopper(
        A.dtype, choice.a_k_major, choice.b_k_major, tile_m, tile_n, read_c, c_pairs, cluster_m,
        reads_c_early(read_c, c_pairs, tile_n, cluster_tiles, cluster_slots),
        stores_by_tma(C, tile_m),
    )  # fmt: skip
    kernel(A, B, C, alpha32, beta32, cluster_m * min(cluster_tiles, cluster_slots))
    return C
