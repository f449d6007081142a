"""RoPE forward and backward as one Triton kernel: q and k in one launch, one program per
(token, block of heads).

    y_a = x_a cos(theta) - x_b sin(theta)     y_b = x_b cos(theta) + x_a sin(theta)

`rope_kernel`'s grid is (B * S tokens, q's head blocks then k's): a program finds its token's
position, its D/2 angles (a table's row, or float32 p * inv_freq and cos/sin of it, computed
once per program and shared by its HEADS heads) and rotates HEADS heads of q or of k. The
backward is the same launch with sin negated (README.md, "Triton"). Rotate-half loads the two
halves of each head as two contiguous runs; interleaved loads whole heads and splits the pairs
in registers, so both read 16 bytes a lane where the head dimension is contiguous.
"""

import contextlib
import os

import torch
import triton
import triton.language as tl

from reference import canonical, check_rope, table_half
from torch_impl import model_plumbing

# A program rotates about PROGRAM_ELEMS elements of one tensor: HEADS heads, at most all of the
# smaller of q's and k's head counts so that k's blocks (fewer heads) are not mostly masked.
PROGRAM_ELEMS = 4096
# Each thread holds ELEMS_PER_THREAD elements of each half: one 16-byte load in 16-bit dtypes.
ELEMS_PER_THREAD = 8


@triton.jit
def pair_angles(cos_ptr, sin_ptr, freq_ptr, position, offs_i, half, table_rows, stride_cp,
                stride_ci, stride_sp, stride_si, stride_f, TABLE: tl.constexpr,
                INVERSE: tl.constexpr):  # fmt: skip
    """cos and sin of the token's D/2 angles in float32: the table's row (NaN for a position
    outside the table), or of theta = float32(p) * inv_freq, rounded once (README's bound)."""
    mask = offs_i < half
    if TABLE:
        inside = (position >= 0) & (position < table_rows)
        row = tl.where(inside, position, 0)  # the address stays inside the table
        c = tl.load(cos_ptr + row * stride_cp + offs_i * stride_ci, mask=mask).to(tl.float32)
        s = tl.load(sin_ptr + row * stride_sp + offs_i * stride_si, mask=mask).to(tl.float32)
        c = tl.where(inside, c, float("nan"))
        s = tl.where(inside, s, float("nan"))
    else:
        inv_freq = tl.load(freq_ptr + offs_i * stride_f, mask=mask, other=0.0)
        theta = position.to(tl.float32) * inv_freq
        c, s = tl.cos(theta), tl.sin(theta)
    if INVERSE:
        s = -s
    return c, s


@triton.jit
def rotate_heads(x_ptr, out_ptr, row_x, row_out, head0, heads, stride_xh, stride_xd, stride_oh,
                 stride_od, cos_ptr, sin_ptr, freq_ptr, position, half, table_rows, stride_cp,
                 stride_ci, stride_sp, stride_si, stride_f, HEADS: tl.constexpr,
                 HALF_BLOCK: tl.constexpr, TABLE: tl.constexpr, INTERLEAVED: tl.constexpr,
                 INVERSE: tl.constexpr):  # fmt: skip
    """Rotate heads head0 .. head0 + HEADS - 1 (those below `heads`) of one token; row_x and
    row_out are the token's offsets in x and out. The heads' loads come first, then the
    angles' (pair_angles), in one basic block, so the two are in flight together."""
    offs_h = head0 + tl.arange(0, HEADS).to(tl.int64)
    x_heads = x_ptr + row_x + offs_h[:, None] * stride_xh
    out_heads = out_ptr + row_out + offs_h[:, None] * stride_oh
    offs_i = tl.arange(0, HALF_BLOCK).to(tl.int64)  # 64-bit: D/2 column steps pass 2**31
    if INTERLEAVED:  # whole heads, then the pairs split in registers
        offs_d = tl.arange(0, 2 * HALF_BLOCK).to(tl.int64)
        mask = (offs_h[:, None] < heads) & (offs_d[None, :] < 2 * half)
        pairs = tl.load(x_heads + offs_d[None, :] * stride_xd, mask=mask).to(tl.float32)
        x_a, x_b = tl.split(tl.reshape(pairs, [HEADS, HALF_BLOCK, 2]))
    else:  # two contiguous runs: the first half and the second
        mask = (offs_h[:, None] < heads) & (offs_i[None, :] < half)
        x_a = tl.load(x_heads + offs_i[None, :] * stride_xd, mask=mask).to(tl.float32)
        x_b = tl.load(x_heads + (offs_i[None, :] + half) * stride_xd, mask=mask).to(tl.float32)
    if TABLE and not INTERLEAVED:  # in the heads' own layout: each head's threads read the
        # table's row (L1 hits), with no copy of it moved through shared memory behind barriers
        c, s = pair_angles(cos_ptr, sin_ptr, freq_ptr, position,
                           tl.broadcast_to(offs_i[None, :], (HEADS, HALF_BLOCK)), half,
                           table_rows, stride_cp, stride_ci, stride_sp, stride_si, stride_f,
                           TABLE, INVERSE)  # fmt: skip
    else:  # once for the HEADS heads (cosf and sinf HEADS times fewer), then moved into the
        # heads' layout (interleaved's pairs, split in registers, take such a move anyway)
        c, s = pair_angles(cos_ptr, sin_ptr, freq_ptr, position, offs_i, half, table_rows,
                           stride_cp, stride_ci, stride_sp, stride_si, stride_f, TABLE,
                           INVERSE)  # fmt: skip
        c, s = c[None, :], s[None, :]
    y_a = x_a * c - x_b * s
    y_b = x_b * c + x_a * s
    dtype = out_ptr.dtype.element_ty
    if INTERLEAVED:
        pairs = tl.reshape(tl.join(y_a, y_b), [HEADS, 2 * HALF_BLOCK])
        tl.store(out_heads + offs_d[None, :] * stride_od, pairs.to(dtype), mask=mask)
    else:
        tl.store(out_heads + offs_i[None, :] * stride_od, y_a.to(dtype), mask=mask)
        tl.store(out_heads + (offs_i[None, :] + half) * stride_od, y_b.to(dtype), mask=mask)


@triton.jit
def rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, freq_ptr, pos_ptr, seq, heads_q, heads_k,
    half, table_rows, q_blocks, stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks,
    stride_kh, stride_kd, stride_qob, stride_qos, stride_qoh, stride_qod, stride_kob, stride_kos,
    stride_koh, stride_kod, stride_cp, stride_ci, stride_sp, stride_si, stride_f, stride_pb,
    stride_ps, HEADS: tl.constexpr, HALF_BLOCK: tl.constexpr, TABLE: tl.constexpr,
    POSITIONS: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # 64-bit offsets from here on
    b, s = token // seq, token % seq
    position = s
    if POSITIONS:
        position = tl.load(pos_ptr + b * stride_pb + s * stride_ps).to(tl.int64)
    block = tl.program_id(1)
    if block < q_blocks:
        rotate_heads(q_ptr, qo_ptr, b * stride_qb + s * stride_qs, b * stride_qob + s * stride_qos,
                     block * HEADS, heads_q, stride_qh, stride_qd, stride_qoh, stride_qod,
                     cos_ptr, sin_ptr, freq_ptr, position, half, table_rows, stride_cp,
                     stride_ci, stride_sp, stride_si, stride_f, HEADS, HALF_BLOCK, TABLE,
                     INTERLEAVED, INVERSE)  # fmt: skip
    else:
        rotate_heads(k_ptr, ko_ptr, b * stride_kb + s * stride_ks, b * stride_kob + s * stride_kos,
                     (block - q_blocks) * HEADS, heads_k, stride_kh, stride_kd, stride_koh,
                     stride_kod, cos_ptr, sin_ptr, freq_ptr, position, half, table_rows,
                     stride_cp, stride_ci, stride_sp, stride_si, stride_f, HEADS, HALF_BLOCK,
                     TABLE, INTERLEAVED, INVERSE)  # fmt: skip


# Read once: test.py sets it before importing Triton, and the launcher should not pay for a look-up.
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


def launch_shape(heads_q, heads_k, half):
    """(HEADS, HALF_BLOCK, num_warps): README.md, "Triton"."""
    half_block = triton.next_power_of_2(half)
    heads = min(triton.next_power_of_2(min(heads_q, heads_k)),
                max(1, PROGRAM_ELEMS // (2 * half_block)))  # fmt: skip
    num_warps = min(8, max(1, heads * half_block // (32 * ELEMS_PER_THREAD)))
    return heads, half_block, num_warps


def rope_rotate(q, k, q_out, k_out, cos, sin, inv_freq, position_ids, interleaved, layout,
                inverse):  # fmt: skip
    check_rope(q, k, q_out, k_out, cos=cos, sin=sin, inv_freq=inv_freq,
               position_ids=position_ids, layout=layout)  # fmt: skip
    device = on_device_of(q)
    views = [canonical(t, layout) for t in (q, k, q_out, k_out)]
    batch, seq, heads_q, head_dim = views[0].shape
    heads_k, half = views[1].shape[2], head_dim // 2
    if batch * seq == 0 or half == 0 or heads_q + heads_k == 0:
        return q_out, k_out
    table = cos is not None
    if table:
        cos, sin = (table_half(t, half, interleaved) for t in (cos, sin))
        angle_args = (cos, sin, cos, cos.shape[0], *cos.stride(), *sin.stride(), 0)
    else:
        angle_args = (inv_freq, inv_freq, inv_freq, 1, 0, 0, 0, 0, inv_freq.stride(0))
    positions = position_ids.expand(batch, seq) if position_ids is not None else q
    pos_strides = positions.stride()[:2] if position_ids is not None else (0, 0)
    heads, half_block, num_warps = launch_shape(max(heads_q, 1), max(heads_k, 1), half)
    q_blocks, k_blocks = -(-heads_q // heads), -(-heads_k // heads)
    strides = [stride for view in views for stride in view.stride()]
    with device:
        rope_kernel[(batch * seq, q_blocks + k_blocks)](
            *views, *angle_args[:3], positions, seq, heads_q, heads_k, half, angle_args[3],
            q_blocks, *strides, *angle_args[4:], *pos_strides, HEADS=heads,
            HALF_BLOCK=half_block, TABLE=table, POSITIONS=position_ids is not None,
            INTERLEAVED=interleaved, INVERSE=inverse, num_warps=num_warps,
        )  # fmt: skip
    return q_out, k_out


def rope_forward(q, k, q_out, k_out, *, cos=None, sin=None, inv_freq=None, position_ids=None,
                 interleaved=False, layout="bshd"):  # fmt: skip
    return rope_rotate(q, k, q_out, k_out, cos, sin, inv_freq, position_ids, interleaved, layout,
                       False)  # fmt: skip


def rope_backward(dq, dk, dq_out, dk_out, *, cos=None, sin=None, inv_freq=None,
                  position_ids=None, interleaved=False, layout="bshd"):  # fmt: skip
    return rope_rotate(dq, dk, dq_out, dk_out, cos, sin, inv_freq, position_ids, interleaved,
                       layout, True)  # fmt: skip


_plumbing = model_plumbing("triton", rope_forward, rope_backward)
RoPEFunction, RotaryEmbedding = _plumbing.RoPEFunction, _plumbing.RotaryEmbedding
rope = _plumbing.rope
