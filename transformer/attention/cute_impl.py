"""Attention in the CuTe DSL: the public functions, with triton_impl.py's signatures.

`attention_forward` runs step 1's kernel (cute_1_tiled.py: a FlashAttention-2 forward on
warp-level MMA, cp.async and ldmatrix) on CUDA float16 and bfloat16 operands with a head
dimension it is built for (D = 64 or 128, `cute_1_tiled.TILES`) whose bases lie on 16-byte
boundaries and whose batch, sequence and head strides are multiples of 8 elements (cp.async
and the output's stores move 16 bytes). Every other valid input (float32, other head
dimensions, misaligned views) runs Triton's forward (triton_impl.attention_forward), by an
explicit check, `kernel_takes`. The backward is not written in CuTe yet (steps 2 and 3 bring
it): `attention_backward` is triton_impl's, which reads the lse this forward writes (float32,
natural log). Both validate every operand (reference.check_operands) before any launch.
"""

import functools
import math
import tempfile

import cutlass
import cutlass.cute as cute
import torch

import cute_1_tiled
import triton_impl
from reference import check_operands, default_scale, forward_outputs
from torch_impl import model_plumbing

TORCH_TO_CUTLASS = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}
ALIGN_BYTES = 16


def aligned(t):
    """t's base on a 16-byte boundary and every stride but the head dimension's a multiple of
    8 elements, so that each row of a tile starts on a 16-byte boundary."""
    per_vector = ALIGN_BYTES // t.element_size()
    return t.data_ptr() % ALIGN_BYTES == 0 and all(s % per_vector == 0 for s in t.stride()[:3])


def kernel_takes(q, k, v, o):
    """Whether step 1's kernel runs these (validated) operands: 16-bit dtype, a head dimension
    it is built for, every tensor `aligned`. The rest goes to Triton."""
    return (
        q.dtype in TORCH_TO_CUTLASS
        and q.shape[3] in cute_1_tiled.TILES
        and all(aligned(t) for t in (q, k, v, o))
    )


def build(dtype, head_dim, causal, options=""):
    """cute.compile the launcher for TVM-FFI calls on torch tensors, on torch's current
    stream. q and o share the symbols (B, S_q, H), k and v (B, S_k, H_kv); D is a constant;
    the strides are 64-bit symbols, multiples of 8 elements, on 16-byte aligned bases; lse
    (B, H, S_q) float32 takes any strides."""
    batch, s_q, s_k, heads, heads_kv = (cute.sym_int64() for _ in range(5))

    def operand(seq, h):
        strides = (*(cute.sym_int64(divisibility=cute_1_tiled.VECTOR_ELEMS) for _ in range(3)), 1)
        return cute.runtime.make_fake_tensor(
            TORCH_TO_CUTLASS[dtype], (batch, seq, h, head_dim), stride=strides,
            assumed_align=ALIGN_BYTES,
        )  # fmt: skip

    lse = cute.runtime.make_fake_tensor(
        cutlass.Float32, (batch, heads, s_q), stride=tuple(cute.sym_int64() for _ in range(3)),
        assumed_align=4,
    )  # fmt: skip
    q, o = operand(s_q, heads), operand(s_q, heads)
    k, v = operand(s_k, heads_kv), operand(s_k, heads_kv)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        cute_1_tiled.launch_forward, q, k, v, o, lse, 1.0, stream, head_dim, causal,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_forward(dtype, head_dim, causal):
    """The compiled forward for (dtype, D, causal), built once (seconds, no GPU needed)."""
    return build(dtype, head_dim, causal).__tvm_ffi_object__()


def ptx_of(dtype, head_dim, causal):
    """The sm_90a PTX of a build: what the tests read for mma.sync, ldmatrix and cp.async."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(dtype, head_dim, causal, options).__ptx__


def attention_forward(q, k, v, causal, scale, o, lse):
    check_operands(q, k, v, causal, scale, forward_outputs(q, o, lse))
    if not q.is_cuda:
        raise ValueError(f"the operands are on {q.device}; the CuTe kernel needs CUDA tensors")
    if not kernel_takes(q, k, v, o):  # float32, another D, a misaligned view: Triton's kernel
        return triton_impl.attention_forward(q, k, v, causal, scale, o, lse)
    if o.numel() == 0:
        return o, lse
    if k.shape[1] == 0:  # no key at all: every row sees none
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    scale_log2 = default_scale(q.shape[3], scale) * cute_1_tiled.LOG2E
    kernel = compile_forward(q.dtype, q.shape[3], causal)
    with torch.cuda.device(q.device):
        kernel(q, k, v, o, lse, scale_log2)
    return o, lse


def attention_backward(q, k, v, o, lse, do, causal, scale, dq, dk, dv):
    """Triton's backward (triton_impl.attention_backward, which validates every operand): the
    CuTe backward is a later step."""
    return triton_impl.attention_backward(q, k, v, o, lse, do, causal, scale, dq, dk, dv)


AttentionFunction, attention, _forward_op = model_plumbing(
    "cute", attention_forward, attention_backward
)
