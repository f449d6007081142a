"""Attention in the CuTe DSL, step 3: the forward on the FlashAttention-3 schedule.

Step 2 (cute_2_wgmma.py) leaves the tensor cores idle while a consumer warpgroup works on its
scores: each key tile is S = Q K^T (wgmma), wait, the softmax (exp2, max and sum on the CUDA
cores and the MUFU unit), then O += P V (wgmma), wait. The two consumers overlap only as far as
the warp schedulers happen to interleave them. Step 3 keeps every piece of step 2 (the
producer, the ring, the masks, the softmax, the epilogue: `TileSteps`) and changes only the
order in which a consumer issues them, in two ways (FlashAttention-3, Shah et al. 2024,
sections 3.1 and 3.2):

- Within a warpgroup, the products of one tile overlap the softmax of the next. For key tile
  j the consumer issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1} (the previous tile's P,
  kept in registers), waits for S_j alone (`wait_group(1)`: groups complete in order), runs
  the softmax of S_j while P_{j-1} V_{j-1} still runs, then waits for it, releases tile j-1's
  stage, rescales O by tile j's factor and rounds P_j. The order of the sums is step 2's:
  O_j = O_{j-1} exp2(m_{j-1} - m_j) + P_j V_j, with O_{j-1} complete before it is rescaled.
  The price is registers (S_j, P_{j-1} and O live together: 64 + 32 + 64 a thread at
  D = 128) and one tile more held in the ring.
- Between the warpgroups, a ping-pong: two named barriers hand the right to issue wgmmas
  from one consumer to the other (`take_turn`, `pass_turn`), so that while one warpgroup
  runs its softmax, the other's products occupy the tensor cores. Warpgroup 1 starts (it
  arrives on its own barrier once); each then waits for its turn before issuing a tile's
  wgmmas and passes the turn after. Both take the same number of turns (one a key tile, one
  for the last P V), and warpgroup 2 does not pass its last, so no arrival is left over.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import warpgroup

from cute_2_wgmma import LOG2E, WARPGROUP_THREADS, launch

__all__ = ["LOG2E", "TILES", "launch_forward"]

# (BLOCK_N keys a tile, STAGES K/V buffers) per head dimension. The overlap holds two stages
# at once (tile j's K, tile j-1's V) and frees j-1's only once tile j's softmax is done: with
# step 2's 2 stages at D = 128 the next tile's loads could start only then and the consumers
# waited for them (482 TFLOP/s on an H100, against step 2's 552); a third stage (Q 32 KB +
# 3 x 64 KB = 224 of the SM's 227 KB) gave 620. At D = 64 a fourth stage changed nothing.
TILES = {64: (128, 3), 128: (128, 3)}
# Named barriers (0 is __syncthreads, 1 and 2 step 2's epilogue): 3 + w is consumer
# warpgroup w's turn to issue wgmmas; both warpgroups count on it (one waits, one arrives).
SCHEDULER_BARRIER = 3
TURN_THREADS = 2 * WARPGROUP_THREADS


@cute.jit
def take_turn(half):
    """Wait until it is consumer `half`'s turn to issue wgmmas."""
    cute.arch.barrier(barrier_id=SCHEDULER_BARRIER + half, number_of_threads=TURN_THREADS)


@cute.jit
def pass_turn(to):
    """Give the turn to consumer `to` (an arrive: the caller does not wait)."""
    cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + to, number_of_threads=TURN_THREADS)


@cute.jit
def overlapped_tiles(ring, read, release, first, end, steps, half, masked: cutlass.Constexpr):
    """Key tiles [first, end): tile j's S and tile j-1's P V issued in one turn, tile j's
    softmax under tile j-1's P V. `read` is tile j's ring state, `release` tile j-1's; both
    are returned (the loop's states are its own)."""
    for tile in cutlass.range(first, end, unroll=1):
        ring.consumer_wait(read)
        take_turn(half)
        steps.scores(read.index)
        steps.values(release.index)
        pass_turn(1 - half)
        warpgroup.wait_group(1)  # S_j has landed; P_{j-1} V_{j-1} may still be running
        steps.softmax(tile, masked=masked)
        warpgroup.wait_group(0)
        ring.consumer_release(release)  # tile j-1's K and V are read
        steps.rescale()
        steps.round()  # P_j into the registers P_{j-1} V_{j-1} has finished reading
        read.advance()
        release.advance()
    return read, release


@cute.jit
def overlapped_key_loop(ring, steps, n_tiles, full_tiles, half, stages: cutlass.Constexpr):
    """Step 3's schedule over the block's key tiles (whole tiles without a mask, then the tail
    and the causal band with one): tile 0's S and softmax alone, then `overlapped_tiles`, then
    the last tile's P V. A block whose rows see no key has nothing to do."""
    if n_tiles > 0:
        if half == 0:
            pass_turn(0)  # warpgroup 1 goes first
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        ring.consumer_wait(read)
        take_turn(half)
        steps.scores(read.index)
        pass_turn(1 - half)
        warpgroup.wait_group(0)
        # Tile 0 always takes the mask (a no-op on a whole tile), so its piece is compiled once.
        steps.softmax(0, masked=True)
        steps.round()  # O is still 0: nothing to rescale
        release = read.clone()
        read.advance()
        unmasked_end = cutlass.max(full_tiles, 1)
        read, release = overlapped_tiles(ring, read, release, 1, unmasked_end, steps, half,
                                         False)  # fmt: skip
        read, release = overlapped_tiles(ring, read, release, unmasked_end, n_tiles, steps,
                                         half, True)  # fmt: skip
        take_turn(half)
        steps.values(release.index)
        if half == 0:
            pass_turn(1)  # warpgroup 2's last turn; it passes none back
        warpgroup.wait_group(0)
        ring.consumer_release(release)


@cute.jit
def launch_forward(
    q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
    scale_log2: cutlass.Float32, stream: cuda.CUstream, head_dim: cutlass.Constexpr[int],
    causal: cutlass.Constexpr[bool],
):  # fmt: skip
    """Step 2's launch_forward with the consumers on `overlapped_key_loop`."""
    block_n, stages = TILES[head_dim]
    launch(q, k, v, o, lse, scale_log2, stream, head_dim, causal, block_n, stages,
           overlapped_key_loop)  # fmt: skip
