"""Attention in Triton: a FlashAttention-2 forward on Hopper's TMA, a deterministic backward.

`attention_forward_kernel`: one program per (BLOCK_M queries, batch x query head) keeps the
online softmax's row max, row sum and unnormalised output in registers while K and V stream by
in BLOCK_N-key tiles (`online_softmax_step`, exp2 domain): first the whole tiles without a mask,
then the tail and the causal diagonal with one. Tiles arrive through TMA tensor descriptors
where the operands allow it (`describable`), through masked pointer loads otherwise
(`load_tile`). `forward_plan` caches per shape what a launch needs (the tiles: FORWARD_TILES)
and, after a shape's first call, launches the compiled kernel directly.

The backward recomputes P from the saved lse and never adds into memory shared between
programs, so the same inputs give the same bits: `attention_dq_kernel` (per query block; it
also stores D_i), then `attention_dkdv_kernel` (per key block, the group's query heads in
order, transposed). README.md's "Triton" section maps them, its bound counts the roundings and
its tuning log holds the predictions behind the tiles.
"""

import contextlib
import ctypes
import functools
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from reference import (
    backward_inputs,
    backward_outputs,
    check_no_overlap,
    check_operands,
    default_scale,
    forward_outputs,
    reach,
)
from torch_impl import model_plumbing

LOG2E = 1.4426950408889634
# Forward tiles per head dimension (BLOCK_D, D padded to a power of two) and dtype width, as
# (BLOCK_M, BLOCK_N, num_warps, num_stages). 16-bit data on Hopper's wgmma. D = 128: 64 queries
# by 64 keys on one warpgroup, K and V triple-buffered, so that two programs share an SM and the
# exponentials of one run under the other's products (README.md, tuning log: 552 TFLOP/s against
# 501 for 128 x 128 on 8 warps). D = 64: 128 queries over two warpgroups, 128 keys; a 128 x
# BLOCK_D float32 accumulator costs BLOCK_D / 2 registers a thread. D = 256 halves the key tile
# and double-buffers to stay inside 227 KB of shared memory (Q 64 KB + 2 x (K 32 KB + V 32 KB)).
# float32 (IEEE, no tensor cores) keeps 4 warps and smaller tiles, as its operands are twice as
# wide. README.md's tuning log has the predictions behind each entry.
FORWARD_TILES = {
    (2, 64): (128, 128, 8, 3), (2, 128): (64, 64, 4, 3), (2, 256): (128, 64, 8, 2),
    (4, 64): (64, 64, 4, 2), (4, 128): (64, 32, 4, 2), (4, 256): (32, 32, 4, 1),
}  # fmt: skip
# Without TMA (before Hopper, or operands no descriptor can address) 16-bit data keeps the tile
# of the earlier cp.async forward: the 3-stage 128 x 128 tile's pointer loads would take 224 KB
# of shared memory at D = 128, past what GPUs before Hopper have.
POINTER_TILE = (128, 64, 8, 2)
# Backward tiles, keyed as FORWARD_TILES, as (dK/dV kernel, dQ kernel), each (BLOCK_M queries,
# BLOCK_N keys, num_warps, num_stages). The dK/dV kernel holds a key tile's float32 dK and dV
# (BLOCK_N x BLOCK_D each) and, as left operands of its transposed products, K and V in
# registers; the dQ kernel holds one query tile's dQ, Q and dO. At 16-bit D = 64 and 128 the
# sweeps (README.md's tuning log) chose 4 warps a program for both, 64 keys x 32 queries for
# dK/dV (254 registers) and 64 x 64 for dQ (239): two programs an SM, so one's softmax runs
# under the other's products. D = 256 and float32 (no tensor cores) are correct, not fast: their
# tiles are the largest that fit shared memory with the fewest spills.
BACKWARD_TILES = {
    (2, 64): ((32, 64, 4, 3), (64, 64, 4, 3)), (2, 128): ((32, 64, 4, 3), (64, 64, 4, 3)),
    (2, 256): ((16, 64, 8, 2), (64, 32, 8, 2)), (4, 64): ((16, 32, 4, 1), (32, 16, 4, 1)),
    (4, 128): ((16, 32, 4, 1), (32, 16, 4, 1)), (4, 256): ((16, 32, 4, 1), (32, 16, 4, 1)),
}  # fmt: skip
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
# Under the interpreter: small tiles, the backward's two unequal (both kernels' tails tested).
SMALL_TILE = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
SMALL_BACKWARD_TILES = ({**SMALL_TILE, "BLOCK_N": 32}, {**SMALL_TILE, "BLOCK_M": 32})


@triton.jit
def load_block(ptr, rows, row_stride, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               UPCAST: tl.constexpr):  # fmt: skip
    """A [len(rows), BLOCK_D] block: rows past n_rows and columns past HEAD_DIM read 0."""
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    block = tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)
    if UPCAST:  # the interpreter's dot is wrong on 16-bit values; widening is exact
        block = block.to(tl.float32)
    return block


@triton.jit
def load_tile(src, b, h, start, n_rows, stride_b, stride_s, stride_h, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr,
              TMA: tl.constexpr):  # fmt: skip
    """Rows start .. start + ROWS of head h in batch b of a (B, S, H, D) operand, [ROWS, BLOCK_D]:
    through its tensor descriptor (one TMA copy into shared memory, rows past S and columns past
    D filled with 0 by the copy engine) or through a pointer and masks."""
    if TMA:
        # TMA coordinates are 32-bit (B, S and H all fit); the pointer path needs 64-bit offsets.
        block = src.load([tl.cast(b, tl.int32), start, tl.cast(h, tl.int32), 0])
        block = block.reshape(ROWS, BLOCK_D)
        if UPCAST:
            block = block.to(tl.float32)
    else:
        rows = start + tl.arange(0, ROWS)
        block = load_block(src + b * stride_b + h * stride_h, rows, stride_s, n_rows, HEAD_DIM,
                           BLOCK_D, UPCAST)  # fmt: skip
    return block


@triton.jit
def visible_keys(rows, cols, s_q, s_k, CAUSAL: tl.constexpr):
    """[rows, cols] mask: key inside S_k and, causal, j <= i + S_k - S_q."""
    seen = (cols[None, :] < s_k) & (rows[:, None] >= 0)
    if CAUSAL:
        seen = seen & (cols[None, :] <= rows[:, None] + (s_k - s_q))
    return seen


@triton.jit
def online_softmax_step(acc, row_max, row_sum, q, k_src, v_src, b, g, start, rows, s_q, s_k,
                        qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                        stride_vh, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        UPCAST: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """One key tile into the running (acc, max, sum), in log2 units: exp(S) = exp2(qk qk_scale).
    Only MASKED tiles (the tail past S_k, the causal diagonal) build the visibility mask."""
    k = load_tile(k_src, b, g, start, s_k, stride_kb, stride_ks, stride_kh, HEAD_DIM, BLOCK_D,
                  BLOCK_N, UPCAST, TMA)  # fmt: skip
    qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    if MASKED:
        qk = tl.where(visible_keys(rows, start + tl.arange(0, BLOCK_N), s_q, s_k, CAUSAL), qk,
                      float("-inf"))  # fmt: skip
    # scale > 0, so the scaled max is the max of the scaled scores (rounding is monotone).
    new_max = tl.maximum(row_max, tl.max(qk, axis=1) * qk_scale)
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that sees nothing yet
    p = tl.exp2(qk * qk_scale - shift[:, None])
    rescale = tl.exp2(row_max - shift)
    row_sum = row_sum * rescale + tl.sum(p, axis=1)
    v = load_tile(v_src, b, g, start, s_k, stride_vb, stride_vs, stride_vh, HEAD_DIM, BLOCK_D,
                  BLOCK_N, UPCAST, TMA)  # fmt: skip
    acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision="ieee")
    return acc, new_max, row_sum


@triton.jit
def attention_forward_kernel(
    q_src, k_src, v_src, o_dst, lse_ptr, s_q, s_k, heads, group, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
    stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    block_m, bh = tl.program_id(0), tl.program_id(1)
    if CAUSAL:  # the last query blocks see the most keys: launch them first, the short ones last
        block_m = tl.num_programs(0) - 1 - block_m
    b, h = (bh // heads).to(tl.int64), bh % heads
    g = (h // group).to(tl.int64)
    first_row = block_m * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    q = load_tile(q_src, b, h, first_row, s_q, stride_qb, stride_qs, stride_qh, HEAD_DIM, BLOCK_D,
                  BLOCK_M, UPCAST, TMA)  # fmt: skip
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys [0, full_end) are inside S_k and, causal, left of every row's diagonal: whole tiles
    # without a mask. [full_end, end) is the tail past S_k's last whole tile and the diagonal.
    full_end = s_k // BLOCK_N * BLOCK_N
    end = s_k
    if CAUSAL:  # row i sees j <= i + S_k - S_q: the first row bounds the unmasked part
        diagonal = first_row + s_k - s_q
        full_end = tl.minimum(full_end, tl.maximum(diagonal + 1, 0) // BLOCK_N * BLOCK_N)
        end = tl.minimum(s_k, tl.maximum(diagonal + BLOCK_M, 0))
    for masked in tl.static_range(2):  # two loops: the whole tiles, then the masked ones
        lo, hi = (0, full_end) if masked == 0 else (full_end, end)
        for start in range(lo, hi, BLOCK_N):
            acc, row_max, row_sum = online_softmax_step(
                acc, row_max, row_sum, q, k_src, v_src, b, g, start, rows, s_q, s_k, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, masked == 1,
                CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST, TMA,
            )  # fmt: skip
    # A row that saw no key has a sum of 0: O = 0 and lse = -inf, as the definition says.
    inverse = tl.where(row_sum > 0, 1.0 / row_sum, 0.0)
    o = acc * inverse[:, None]
    if TMA:  # the copy engine drops the rows past S_q and the columns past D
        o_tile = o.to(o_dst.dtype).reshape(1, BLOCK_M, 1, BLOCK_D)
        o_dst.store([b.to(tl.int32), first_row, h.to(tl.int32), 0], o_tile)
    else:
        cols = tl.arange(0, BLOCK_D)
        o_ptrs = o_dst + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + cols[None, :]
        tl.store(o_ptrs, o.to(o_dst.dtype.element_ty),
                 mask=(rows[:, None] < s_q) & (cols[None, :] < HEAD_DIM))  # fmt: skip
    lse = (row_max + tl.log2(row_sum)) * 0.6931471805599453  # back to the natural log
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + rows, lse, mask=rows < s_q)


@triton.jit
def dkdv_step(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, b, h, start, cols, s_q, s_k,
              stats, deltas, qk_scale, stride_qb, stride_qs, stride_qh, stride_db, stride_ds,
              stride_dh, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """One query tile into a key tile's (dK, dV), transposed: keys are the rows, so P^T and
    dS^T come out of the tensor cores in the accumulator layout that the next products take
    as their left operand straight from registers (no transpose through shared memory).
    Query rows past S_q read q = dO = 0 and lse = delta = 0, so they add exactly 0; keys past
    S_k only touch rows of dK and dV that are never stored: only MASKED tiles (the causal
    diagonal) build a mask."""
    rows = start + tl.arange(0, BLOCK_M)
    q = load_tile(q_src, b, h, start, s_q, stride_qb, stride_qs, stride_qh, HEAD_DIM, BLOCK_D,
                  BLOCK_M, UPCAST, TMA)  # fmt: skip
    do = load_tile(do_src, b, h, start, s_q, stride_db, stride_ds, stride_dh, HEAD_DIM, BLOCK_D,
                   BLOCK_M, UPCAST, TMA)  # fmt: skip
    lse = tl.load(lse_ptr + stats + rows, mask=rows < s_q, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + deltas + rows, mask=rows < s_q, other=0.0)
    scores_t = tl.dot(k, tl.trans(q), input_precision="ieee") * qk_scale  # log2 units
    p_t = tl.exp2(scores_t - lse[None, :])
    if MASKED:  # key j is seen by row i when j <= i + S_k - S_q
        p_t = tl.where(cols[:, None] <= rows[None, :] + (s_k - s_q), p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision="ieee")
    dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision="ieee")
    return dk, dv


@triton.jit
def attention_dkdv_kernel(
    q_src, k_src, v_src, do_src, lse_ptr, delta_ptr, dk_ptr, dv_ptr, s_q, s_k, heads, group,
    qk_scale, scale, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh, stride_lb, stride_lh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    block_n, bg = tl.program_id(0), tl.program_id(1)
    heads_kv = heads // group
    b, g = (bg // heads_kv).to(tl.int64), (bg % heads_kv).to(tl.int64)
    first_key = block_n * BLOCK_N
    cols = first_key + tl.arange(0, BLOCK_N)
    k = load_tile(k_src, b, g, first_key, s_k, stride_kb, stride_ks, stride_kh, HEAD_DIM,
                  BLOCK_D, BLOCK_N, UPCAST, TMA)  # fmt: skip
    v = load_tile(v_src, b, g, first_key, s_k, stride_vb, stride_vs, stride_vh, HEAD_DIM,
                  BLOCK_D, BLOCK_N, UPCAST, TMA)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Query tiles [first, full) hold the causal diagonal of this key tile (masked); from full
    # on every row sees every key of the tile. Row i sees key j when j <= i + S_k - S_q.
    first, full = 0, 0
    if CAUSAL:
        first = tl.maximum(first_key - (s_k - s_q), 0) // BLOCK_M * BLOCK_M
        last_key_row = first_key + BLOCK_N - 1 - (s_k - s_q)  # the first row seeing all keys
        full = tl.minimum(tl.maximum(tl.cdiv(last_key_row, BLOCK_M) * BLOCK_M, first), s_q)
    for h in range(g * group, g * group + group):  # the group's query heads, in order
        stats, deltas = b * stride_lb + h * stride_lh, (b * heads + h) * s_q
        for masked in tl.static_range(2):  # two loops: the diagonal's tiles, then the rest
            lo, hi = (first, full) if masked == 0 else (full, s_q)
            for start in range(lo, hi, BLOCK_M):
                dk, dv = dkdv_step(
                    dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, b, h, start, cols, s_q,
                    s_k, stats, deltas, qk_scale, stride_qb, stride_qs, stride_qh, stride_db,
                    stride_ds, stride_dh, masked == 0, HEAD_DIM, BLOCK_D, BLOCK_M, UPCAST, TMA,
                )  # fmt: skip
    mask = (cols[:, None] < s_k) & (tl.arange(0, BLOCK_D)[None, :] < HEAD_DIM)
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    dk_ptrs = dk_ptr + b * stride_dkb + g * stride_dkh + cols[:, None] * stride_dks + offs_d
    dv_ptrs = dv_ptr + b * stride_dvb + g * stride_dvh + cols[:, None] * stride_dvs + offs_d
    tl.store(dk_ptrs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dq_step(dq, q, do, lse, delta, k_src, v_src, b, g, start, rows, s_q, s_k, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
            TMA: tl.constexpr):  # fmt: skip
    """One key tile into a query tile's dQ. Only MASKED tiles (the tail past S_k, where a
    zero-filled key would give P = 2^-lse, and the causal diagonal) build the mask."""
    k = load_tile(k_src, b, g, start, s_k, stride_kb, stride_ks, stride_kh, HEAD_DIM, BLOCK_D,
                  BLOCK_N, UPCAST, TMA)  # fmt: skip
    v = load_tile(v_src, b, g, start, s_k, stride_vb, stride_vs, stride_vh, HEAD_DIM, BLOCK_D,
                  BLOCK_N, UPCAST, TMA)  # fmt: skip
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    p = tl.exp2(scores - lse[:, None])
    if MASKED:
        p = tl.where(visible_keys(rows, start + tl.arange(0, BLOCK_N), s_q, s_k, CAUSAL), p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")


@triton.jit
def attention_dq_kernel(
    q_src, k_src, v_src, do_src, o_ptr, lse_ptr, delta_ptr, dq_ptr, s_q, s_k, heads, group,
    qk_scale, scale, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh, stride_ob, stride_os,
    stride_oh, stride_lb, stride_lh, stride_dqb, stride_dqs, stride_dqh, CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile, and first its rows' D_i = sum_d dO_id O_id (float32), stored for
    the dK/dV kernel that runs after it."""
    block_m, bh = tl.program_id(0), tl.program_id(1)
    if CAUSAL:  # the last query blocks see the most keys: launch them first
        block_m = tl.num_programs(0) - 1 - block_m
    b, h = (bh // heads).to(tl.int64), bh % heads
    g = (h // group).to(tl.int64)
    first_row = block_m * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    q = load_tile(q_src, b, h, first_row, s_q, stride_qb, stride_qs, stride_qh, HEAD_DIM,
                  BLOCK_D, BLOCK_M, UPCAST, TMA)  # fmt: skip
    do = load_tile(do_src, b, h, first_row, s_q, stride_db, stride_ds, stride_dh, HEAD_DIM,
                   BLOCK_D, BLOCK_M, UPCAST, TMA)  # fmt: skip
    stats = b * stride_lb + h * stride_lh
    lse = tl.load(lse_ptr + stats + rows, mask=rows < s_q, other=0.0) * 1.4426950408889634
    o = load_block(o_ptr + b * stride_ob + h * stride_oh, rows, stride_os, s_q, HEAD_DIM, BLOCK_D,
                   True)  # fmt: skip
    delta = tl.sum(o * do.to(tl.float32), axis=1)  # rows past S_q: 0
    tl.store(delta_ptr + bh.to(tl.int64) * s_q + rows, delta, mask=rows < s_q)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The forward's split: whole key tiles left of the first row's diagonal, then the rest.
    full_end = s_k // BLOCK_N * BLOCK_N
    end = s_k
    if CAUSAL:
        diagonal = first_row + s_k - s_q
        full_end = tl.minimum(full_end, tl.maximum(diagonal + 1, 0) // BLOCK_N * BLOCK_N)
        end = tl.minimum(s_k, tl.maximum(diagonal + BLOCK_M, 0))
    for masked in tl.static_range(2):  # two loops, as the forward's
        lo, hi = (0, full_end) if masked == 0 else (full_end, end)
        for start in range(lo, hi, BLOCK_N):
            dq = dq_step(dq, q, do, lse, delta, k_src, v_src, b, g, start, rows, s_q, s_k,
                         qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                         stride_vh, masked == 1, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, UPCAST,
                         TMA)  # fmt: skip
    cols = tl.arange(0, BLOCK_D)
    dq_ptrs = dq_ptr + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqs + cols[None, :]
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=(rows[:, None] < s_q) & (cols[None, :] < HEAD_DIM))  # fmt: skip


# Read once: test.py sets it before importing Triton.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_triton_interpreter():
    """Make Triton 3.6's CPU interpreter compute what the GPU computes (see dot/triton_impl.py):
    numpy 2.4 refuses int() of a one-element array, which .item() does, and the interpreter's
    float32 <-> bfloat16 conversions truncate, which torch's exact conversions replace."""
    import numpy as np  # the interpreter's own dependency; the GPU path needs no numpy
    from triton.runtime import interpreter

    patch_tensor, convert = interpreter._patch_lang_tensor, interpreter._convert_float

    def patch_with_item(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: self.handle.data.item())

    def exact(values, src, dst, rounding_mode):
        values = np.ascontiguousarray(values)
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(values.view(np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy()
        if src == tl.bfloat16 and dst == tl.float32:
            return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16).float().numpy()
        return convert(values, src, dst, rounding_mode)

    interpreter._patch_lang_tensor, interpreter._convert_float = patch_with_item, exact


if INTERPRETED:
    patch_triton_interpreter()


def on_device_of(t):
    """Launch context for t: its GPU made current when it is not (the CPU under the interpreter)."""
    if t.is_cuda:
        if t.get_device() == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(t.device)
    if INTERPRETED:
        return contextlib.nullcontext()
    raise ValueError(
        f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}"
    )


def padded_head_dim(head_dim):
    """D rounded up to a power of two, 16 at least (tl.dot's smallest)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def constants(q, tile, small_tile=SMALL_TILE):
    """The launch's compile-time choices: the tile (small_tile under the interpreter), the head
    dimension padded to a power of two, the interpreter's upcast of 16-bit values, and IEEE
    float32 for float32 data (no TF32)."""
    head_dim = q.shape[3]
    tile = small_tile if INTERPRETED else tile
    return {**tile, "HEAD_DIM": head_dim, "BLOCK_D": padded_head_dim(head_dim),
            "UPCAST": INTERPRETED and q.dtype != torch.float32}  # fmt: skip


def forward_tile(dtype, head_dim, tma=True):
    """FORWARD_TILES's entry for this dtype's width and D (64 and below share D = 64's); 16-bit
    data without TMA takes POINTER_TILE."""
    width = 4 if dtype == torch.float32 else 2
    block_m, block_n, warps, stages = (
        POINTER_TILE if width == 2 and not tma
        else FORWARD_TILES[(width, max(64, padded_head_dim(head_dim)))]
    )  # fmt: skip
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def backward_tiles(dtype, head_dim):
    """BACKWARD_TILES's entry for this dtype's width and D: the (dK/dV, dQ) kernels' tiles."""
    width = 4 if dtype == torch.float32 else 2
    entry = BACKWARD_TILES[(width, max(64, padded_head_dim(head_dim)))]
    return tuple(dict(zip(TILE_KEYS, tile, strict=True)) for tile in entry)


@functools.cache
def has_tma(device):
    """The interpreter emulates tensor descriptors; a GPU copies them with TMA from Hopper on."""
    return INTERPRETED or torch.cuda.get_device_capability(device)[0] >= 9


def describable(t):
    """A TMA descriptor can address t: not empty, its base 16-byte aligned and every stride but
    the head dimension's a multiple of 16 bytes (the copy engine's rules)."""
    size = t.element_size()
    return (t.numel() > 0 and t.data_ptr() % 16 == 0
            and all(s * size % 16 == 0 for s in t.stride()[:3]))  # fmt: skip


class CheckedDescriptor(TensorDescriptor):
    """A TensorDescriptor whose copy-engine rules `describable` checked once, for its plan: the
    per-call re-check in TensorDescriptor.__post_init__ costs more than the rest of the object."""

    def __post_init__(self):
        pass


@functools.cache
def cuda_driver():
    return ctypes.CDLL("libcuda.so.1")


def bind_primary_context(device):
    """Make the GPU's primary context current on this thread if no context is. Triton encodes a
    TMA descriptor (a driver call that needs a current context) before its launcher binds one,
    and a thread that has not yet called the CUDA runtime (the autograd engine's, running a
    backward whose plan is cached; any new thread) has none: the encode fails with "invalid
    device context". torch's own calls bind it lazily; a cached plan makes none before the
    launch."""
    driver_api, context = cuda_driver(), ctypes.c_void_p()
    if driver_api.cuCtxGetCurrent(ctypes.byref(context)) == 0 and context.value:
        return
    handle = ctypes.c_int()
    for status in (driver_api.cuDeviceGet(ctypes.byref(handle), device),
                   driver_api.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
                   driver_api.cuCtxSetCurrent(context)):  # fmt: skip
        if status:
            raise RuntimeError(f"CUDA driver error {status} binding device {device}'s context")


class KernelLaunch:
    """One kernel's launch with all but its per-call arguments fixed: the grid, the compile-time
    constants and the launch options. The first call goes through the JIT, which compiles the
    kernel and binds the arguments; on a GPU the compiled kernel is kept and later calls run it
    directly, as JITFunction.run does once it has bound them (Triton 3.6), without binding some
    35 arguments again. Every kernel here ends with the parameters CAUSAL, *CONSTEXPRS."""

    def __init__(self, kernel, grid, config, causal):
        self.kernel, self.grid = kernel, grid
        self.constexprs = {"CAUSAL": causal, **{name: config[name] for name in CONSTEXPRS}}
        self.options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
        self.compiled = None

    def __call__(self, device, *args):
        if not INTERPRETED:
            bind_primary_context(device)
        if self.compiled is None:
            launched = self.kernel[self.grid](*args, **self.constexprs, **self.options)
            self.compiled = launched if isinstance(launched, CompiledKernel) else None
            return
        kernel, args = self.compiled, (*args, *self.constexprs.values())
        stream = driver.active.get_current_stream(device)
        hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        metadata = kernel.launch_metadata(self.grid, stream, *args)
        kernel.run(*self.grid, stream, kernel.function, kernel.packed_metadata, metadata, *hooks,
                   *args)  # fmt: skip


def descriptor_layouts(tensors, config, rows):
    """(shape, strides, box) of each tensor's descriptor: boxes of config[rows[i]] rows and
    BLOCK_D columns of one batch and head."""
    return [
        (list(t.shape), list(t.stride()), [1, config[r], 1, config["BLOCK_D"]])
        for t, r in zip(tensors, rows, strict=True)
    ]


def sources(tensors, config, layouts):
    """The operands as a kernel reads them: tensor descriptors with the plan's layouts (TMA), or
    the tensors themselves (pointers)."""
    if not config["TMA"]:
        return tensors
    return [CheckedDescriptor(t, *layout) for t, layout in zip(tensors, layouts, strict=True)]


# Descriptor boxes of q, k, v and dO (or O, last, in the forward): query rows and key rows.
TILE_ROWS = ("BLOCK_M", "BLOCK_N", "BLOCK_N", "BLOCK_M")


class ForwardPlan:
    """Everything about a forward launch that `plan_key` fixes, computed once with the full
    validation (check_operands): the grid, the scalar arguments, the compile-time constants, the
    descriptors' layouts, the bytes each operand reaches, and the launch (KernelLaunch). A later
    call of the key only checks what the key leaves out: overlaps."""

    def __init__(self, q, k, v, o, lse, causal, scale, use_tma):
        batch, s_q, heads, head_dim = q.shape
        tile = forward_tile(q.dtype, head_dim, use_tma)
        self.config = {**constants(q, tile), "TMA": use_tma}
        grid = (triton.cdiv(s_q, self.config["BLOCK_M"]), batch * heads, 1)
        self.layouts = descriptor_layouts((q, k, v, o), self.config, TILE_ROWS)
        self.reach = [reach(t) for t in (q, k, v, o, lse)]
        self.scalars = (s_q, k.shape[1], heads, heads // k.shape[2], scale * LOG2E,
                        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
                        *lse.stride()[:2])  # fmt: skip
        self.kernel = KernelLaunch(attention_forward_kernel, grid, self.config, causal)

    def check_overlaps(self, q, k, v, o, lse):
        check_overlaps((q, k, v), (o, lse), self.reach, OPERANDS)

    def launch(self, q, k, v, o, lse):
        operands = sources((q, k, v, o), self.config, self.layouts)
        self.kernel(q.get_device(), *operands, lse, *self.scalars)


class BackwardPlan:
    """A backward launch's fixed part, as ForwardPlan's: the dQ kernel's launch (it also stores
    D_i) and the dK/dV kernel's (none without keys), each with its own tile's descriptor layouts
    and scalars, and the bytes each operand reaches."""

    def __init__(self, q, k, v, o, lse, do, dq, dk, dv, causal, scale, use_tma):
        batch, s_q, heads, head_dim = q.shape
        s_k, heads_kv = k.shape[1], k.shape[2]
        tiles = zip(backward_tiles(q.dtype, head_dim), SMALL_BACKWARD_TILES, strict=True)
        dkdv_config, dq_config = ({**constants(q, tile, small), "TMA": use_tma}
                                  for tile, small in tiles)  # fmt: skip
        self.configs = {"dq": dq_config, "dkdv": dkdv_config}
        self.layouts = {name: descriptor_layouts((q, k, v, do), config, TILE_ROWS)
                        for name, config in self.configs.items()}  # fmt: skip
        self.reach = [reach(t) for t in (q, k, v, o, lse, do, dq, dk, dv)]
        common = (s_q, s_k, heads, heads // heads_kv, scale * LOG2E, scale, *q.stride()[:3],
                  *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])  # fmt: skip
        lse_strides = lse.stride()[:2]
        self.dq_scalars = (*common, *o.stride()[:3], *lse_strides, *dq.stride()[:3])
        self.dkdv_scalars = (*common, *lse_strides, *dk.stride()[:3], *dv.stride()[:3])
        self.delta_shape = (batch * heads, s_q)
        dq_grid = (triton.cdiv(s_q, dq_config["BLOCK_M"]), batch * heads, 1)
        dkdv_grid = (triton.cdiv(s_k, dkdv_config["BLOCK_N"]), batch * heads_kv, 1)
        self.dq_kernel = KernelLaunch(attention_dq_kernel, dq_grid, dq_config, causal)
        self.dkdv_kernel = (KernelLaunch(attention_dkdv_kernel, dkdv_grid, dkdv_config, causal)
                            if s_k else None)  # fmt: skip

    def check_overlaps(self, q, k, v, o, lse, do, dq, dk, dv):
        check_overlaps((q, k, v, o, lse, do), (dq, dk, dv), self.reach, BACKWARD_OPERANDS)

    def operands(self, name, q, k, v, do):
        return sources((q, k, v, do), self.configs[name], self.layouts[name])

    def launch(self, q, k, v, o, lse, do, dq, dk, dv):
        device = q.get_device()
        delta = torch.empty(self.delta_shape, dtype=torch.float32, device=q.device)
        self.dq_kernel(device, *self.operands("dq", q, k, v, do), o, lse, delta, dq,
                       *self.dq_scalars)  # fmt: skip
        if self.dkdv_kernel is not None:  # after the dQ programs stored D_i
            self.dkdv_kernel(device, *self.operands("dkdv", q, k, v, do), lse, delta, dk, dv,
                             *self.dkdv_scalars)  # fmt: skip


OPERANDS = ("q", "k", "v", "o", "lse")
BACKWARD_OPERANDS = ("q", "k", "v", "o", "lse", "do", "dq", "dk", "dv")
CONSTEXPRS = ("HEAD_DIM", "BLOCK_D", "BLOCK_M", "BLOCK_N", "UPCAST", "TMA")
PLANS = {}  # plan_key -> ForwardPlan or BackwardPlan, filled by calls that passed check_operands


def check_overlaps(inputs, outputs, reaches, names):
    """check_no_overlap on the inputs' and outputs' address ranges, their reaches precomputed."""
    tensors = (*inputs, *outputs)
    ranges = [(name, (t.data_ptr(), t.data_ptr() + span))
              for name, t, span in zip(names, tensors, reaches, strict=True)]  # fmt: skip
    check_no_overlap(ranges[: len(inputs)], ranges[len(inputs) :])


def plan_key(kind, tensors, causal, scale):
    """All that the validation and the launch read of the operands except their addresses: per
    tensor its shape, strides, dtype, device and base alignment (Triton specialises pointers on
    16 bytes); causal and scale with their types (True == 1 in a dict). None when an operand is
    not a tensor or scale is unhashable: check_operands says which."""
    try:
        described = [(t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors]
        hash(scale)
        return (kind, causal, type(causal), scale, type(scale), *described)
    except (AttributeError, TypeError):
        return None


def cached_plan(kind, tensors, causal, scale, make):
    """The plan of these operands: a key's first call validates fully and builds it (make(),
    None when there is nothing to launch); later calls check overlaps, all the key leaves out."""
    key = plan_key(kind, tensors, causal, scale)
    plan = PLANS.get(key)
    if plan is not None:
        plan.check_overlaps(*tensors)
        return plan
    plan = make()
    if key is not None and plan is not None:
        PLANS[key] = plan
    return plan


def forward_plan(q, k, v, o, lse, causal, scale):
    def make():
        check_operands(q, k, v, causal, scale, forward_outputs(q, o, lse))
        if o.numel() == 0:
            return None
        use_tma = has_tma(q.device) and all(describable(t) for t in (q, k, v, o))
        return ForwardPlan(q, k, v, o, lse, causal, default_scale(q.shape[3], scale), use_tma)

    return cached_plan("forward", (q, k, v, o, lse), causal, scale, make)


def attention_forward(q, k, v, causal, scale, o, lse):
    plan = forward_plan(q, k, v, o, lse, causal, scale)
    if plan is not None:  # None: nothing to compute (no query, head or batch)
        with on_device_of(q):
            plan.launch(q, k, v, o, lse)
    return o, lse


def backward_plan(q, k, v, o, lse, do, dq, dk, dv, causal, scale):
    def make():
        check_operands(q, k, v, causal, scale, backward_outputs(q, k, dq, dk, dv),
                       backward_inputs(q, o, lse, do))  # fmt: skip
        if dq.numel() == 0:
            return None
        use_tma = has_tma(q.device) and all(describable(t) for t in (q, k, v, do))
        scale_value = default_scale(q.shape[3], scale)
        return BackwardPlan(q, k, v, o, lse, do, dq, dk, dv, causal, scale_value, use_tma)

    return cached_plan("backward", (q, k, v, o, lse, do, dq, dk, dv), causal, scale, make)


def attention_backward(q, k, v, o, lse, do, causal, scale, dq, dk, dv):
    plan = backward_plan(q, k, v, o, lse, do, dq, dk, dv, causal, scale)
    if plan is None:  # no query (or head or batch): nothing to launch, every dK and dV is 0
        dk.zero_(), dv.zero_()
    else:
        with on_device_of(q):
            plan.launch(q, k, v, o, lse, do, dq, dk, dv)
    return dq, dk, dv


AttentionFunction, attention, _forward_op = model_plumbing(
    "triton", attention_forward, attention_backward
)
