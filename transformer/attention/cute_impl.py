"""Attention in the CuTe DSL: the public functions, with triton_impl.py's signatures.

On a Hopper GPU (the H100, the H200) `attention_forward` runs step 3's kernel
(cute_3_overlap.py: TMA, wgmma, warp specialisation and the FlashAttention-3 schedule), on any
other GPU (from Ampere on) step 1's (cute_1_tiled.py: a FlashAttention-2 forward on warp-level
MMA, cp.async and ldmatrix). `attention_backward` runs step 3's own backward
(cute_3_backward.py: one pass over the keys, dQ summed in a fixed order) on a Hopper GPU at the
head dimensions where it is the faster of the two (`CUTE_BACKWARD_HEAD_DIMS`, measured side by
side with Triton's on an H100: README.md, "Tuning log"), Triton's (triton_impl.
attention_backward) everywhere else. Every forward writes the same lse (float32, natural log),
which every backward reads.

A kernel takes CUDA float16 and bfloat16 operands with a head dimension it is built for (D =
64 or 128, each step's `TILES`) whose bases lie on 16-byte boundaries and whose batch, sequence
and head strides are multiples of 8 elements (cp.async, TMA and the stores move 16 bytes), and
for TMA (steps 2 and 3) positive. Every other valid input (float32, other head dimensions,
misaligned or expanded views) runs Triton's kernels, by an explicit check (`kernel_takes`,
`backward_kernel_takes`). Every function validates every operand (reference.check_operands)
before any launch.

`attention_forward_step1`, `attention_forward_step2` (cute_2_wgmma.py: TMA and wgmma, no
overlap), `attention_forward_step3` and `attention_backward_cute` call one step whatever the
GPU, for the tests and bench.py; steps 2 and 3 need a Hopper GPU.
"""

import functools
import math
import tempfile

import cutlass
import cutlass.cute as cute
import torch

import cute_1_tiled
import cute_2_wgmma
import cute_3_backward
import cute_3_overlap
import triton_impl
from reference import (
    backward_inputs,
    backward_outputs,
    check_operands,
    default_scale,
    forward_outputs,
)
from torch_impl import model_plumbing

TORCH_TO_CUTLASS = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}
ALIGN_BYTES = 16


def aligned(t):
    """t's base on a 16-byte boundary and every stride but the head dimension's a multiple of
    8 elements, so that each row of a tile starts on a 16-byte boundary."""
    per_vector = ALIGN_BYTES // t.element_size()
    return t.data_ptr() % ALIGN_BYTES == 0 and all(s % per_vector == 0 for s in t.stride()[:3])


# The CuTe steps' forward kernels by number: step 1 (warp-level MMA, any GPU from Ampere on),
# 2 (TMA and wgmma) and 3 (the FlashAttention-3 schedule), Hopper only. Step 3's backward is
# cute_3_backward.py (`attention_backward_cute`).
STEPS = {1: cute_1_tiled, 2: cute_2_wgmma, 3: cute_3_overlap}


@functools.cache
def hopper(device_index):
    """Whether GPU `device_index` is a Hopper (compute capability 9.0: wgmma, TMA, setmaxnreg),
    where step 3 is the default. Cached: the query costs microseconds a call."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def on_hopper(q):
    return q.is_cuda and hopper(q.device.index)


def kernel_takes(q, k, v, o, step=1):
    """Whether step `step`'s kernel runs these (validated) operands: 16-bit dtype, a head
    dimension it is built for, every tensor `aligned` (16-byte rows: cp.async's vectors in step
    1, TMA's descriptors in step 2). The rest goes to Triton."""
    return takes(STEPS[step].TILES, (q, k, v, o), tma=step > 1)


def backward_kernel_takes(q, k, v, o, do, dq, dk, dv):
    """Whether step 3's backward kernels run these (validated) operands: kernel_takes's rules
    for TMA over every tensor they load or store (lse takes any strides; dq is written by
    torch from the float32 sum). The rest goes to Triton's backward."""
    return takes(cute_3_backward.TILES, (q, k, v, o, do, dk, dv), tma=True)


def takes(tiles, tensors, tma):
    """16-bit dtype, a head dimension in `tiles`, every tensor `aligned` and, for TMA, its
    strides positive: a descriptor cannot take an expanded (stride 0) view."""
    q = tensors[0]
    return (
        q.dtype in TORCH_TO_CUTLASS
        and q.shape[3] in tiles
        and all(aligned(t) for t in tensors)
        and (not tma or all(s > 0 for t in tensors for s in t.stride()[:3]))
    )


def fake_operand(dtype, batch, seq, heads, head_dim):
    """A (B, S, H, D) operand for cute.compile: D a constant, the strides 64-bit symbols that
    are multiples of 8 elements, the base 16-byte aligned."""
    strides = (*(cute.sym_int64(divisibility=cute_1_tiled.VECTOR_ELEMS) for _ in range(3)), 1)
    return cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], (batch, seq, heads, head_dim), stride=strides,
        assumed_align=ALIGN_BYTES,
    )  # fmt: skip


def fake_rows(batch, heads, s_q):
    """A (B, H, S_q) float32 tensor (lse, delta) with any strides."""
    return cute.runtime.make_fake_tensor(
        cutlass.Float32, (batch, heads, s_q), stride=tuple(cute.sym_int64() for _ in range(3)),
        assumed_align=4,
    )  # fmt: skip


def build(dtype, head_dim, causal, options="", step=1, backward=False):
    """cute.compile step `step`'s forward launcher for TVM-FFI calls on torch tensors, on
    torch's current stream. q and o share the symbols (B, S_q, H), k and v (B, S_k, H_kv); D
    is a constant; the strides are 64-bit symbols, multiples of 8 elements, on 16-byte aligned
    bases; lse (B, H, S_q) float32 takes any strides. backward: step 3's backward
    (`build_backward`)."""
    if backward:
        return build_backward(dtype, head_dim, causal, options)
    batch, s_q, s_k, heads, heads_kv = (cute.sym_int64() for _ in range(5))
    q, o = (fake_operand(dtype, batch, s_q, heads, head_dim) for _ in range(2))
    k, v = (fake_operand(dtype, batch, s_k, heads_kv, head_dim) for _ in range(2))
    lse = fake_rows(batch, heads, s_q)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        STEPS[step].launch_forward, q, k, v, o, lse, 1.0, stream, head_dim, causal,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


def build_backward(dtype, head_dim, causal, options=""):
    """cute.compile step 3's backward launcher as `build` does the forward's: q, o and dO
    share (B, S_q, H), k, v, dK and dV (B, S_k, H_kv); lse and delta (B, H, S_q) float32; the
    dQ sums (B, S_q, H, sums x D) float32 with 16-byte rows; their semaphores (B, H, sums,
    query tiles) (`cute_3_backward.sums`)."""
    batch, s_q, s_k, heads, heads_kv, tiles = (cute.sym_int64() for _ in range(6))
    sums = cute_3_backward.sums(causal)
    q, o, do = (fake_operand(dtype, batch, s_q, heads, head_dim) for _ in range(3))
    k, v, dk, dv = (fake_operand(dtype, batch, s_k, heads_kv, head_dim) for _ in range(4))
    lse, delta = fake_rows(batch, heads, s_q), fake_rows(batch, heads, s_q)
    dq_sum = cute.runtime.make_fake_tensor(
        cutlass.Float32, (batch, s_q, heads, sums * head_dim),
        stride=(*(cute.sym_int64(divisibility=4) for _ in range(3)), 1), assumed_align=16,
    )  # fmt: skip
    semaphores = cute.runtime.make_fake_tensor(
        cutlass.Int32, (batch, heads, sums, tiles),
        stride=tuple(cute.sym_int64() for _ in range(4)), assumed_align=4,
    )  # fmt: skip
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        cute_3_backward.launch_backward, q, k, v, o, lse, do, dk, dv, delta, dq_sum, semaphores,
        1.0, 1.0, stream, head_dim, causal, options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_step(dtype, head_dim, causal, step=1, backward=False):
    """The compiled forward of step `step` (or the backward) for (dtype, D, causal), built
    once (seconds, no GPU needed)."""
    return build(dtype, head_dim, causal, step=step, backward=backward).__tvm_ffi_object__()


def ptx_of(dtype, head_dim, causal, step=1, backward=False):
    """The sm_90a PTX of a build: what the tests read (step 1: mma.sync, ldmatrix and
    cp.async; steps 2 and 3: wgmma, TMA and mbarriers; the backward: its two kernels)."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(dtype, head_dim, causal, options, step, backward).__ptx__


def attention_forward(q, k, v, causal, scale, o, lse):
    """The forward on step 3's kernel on a Hopper GPU, on step 1's elsewhere (module
    docstring)."""
    return run_forward(q, k, v, causal, scale, o, lse, step=3 if on_hopper(q) else 1)


def run_forward(q, k, v, causal, scale, o, lse, step):
    """The forward on CuTe step `step`'s kernel where it takes the operands, else Triton's."""
    check_operands(q, k, v, causal, scale, forward_outputs(q, o, lse))
    if not q.is_cuda:
        raise ValueError(f"the operands are on {q.device}; the CuTe kernel needs CUDA tensors")
    if not kernel_takes(q, k, v, o, step):  # float32, another D, misaligned: Triton's kernel
        return triton_impl.attention_forward(q, k, v, causal, scale, o, lse)
    if o.numel() == 0:
        return o, lse
    if k.shape[1] == 0:  # no key at all: every row sees none
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    scale_log2 = default_scale(q.shape[3], scale) * cute_1_tiled.LOG2E
    kernel = compile_step(q.dtype, q.shape[3], causal, step)
    # TVM-FFI launches on torch's current stream of the operands' GPU, as every CuTe launcher
    # of the course does: no device guard (entering torch.cuda.device costs microseconds).
    kernel(q, k, v, o, lse, scale_log2)
    return o, lse


def attention_forward_step1(q, k, v, causal, scale, o, lse):
    """The forward on step 1's kernel (cute_1_tiled.py: warp-level MMA; any GPU from Ampere
    on), with attention_forward's validation and routing."""
    return run_forward(q, k, v, causal, scale, o, lse, step=1)


def attention_forward_step2(q, k, v, causal, scale, o, lse):
    """The forward on step 2's kernel (cute_2_wgmma.py: TMA, wgmma, warp specialisation; a
    Hopper GPU), with attention_forward's validation and routing."""
    return run_forward(q, k, v, causal, scale, o, lse, step=2)


def attention_forward_step3(q, k, v, causal, scale, o, lse):
    """The forward on step 3's kernel (cute_3_overlap.py: step 2's on the FlashAttention-3
    schedule; a Hopper GPU), with attention_forward's validation and routing."""
    return run_forward(q, k, v, causal, scale, o, lse, step=3)


# Where step 3's backward beats Triton's, the backward alone at 4 x 4096 x 16 x 128 and 4 x 4096
# x 32 x 64, bf16, on an H100 (2026-12-06, the rotated walk), ms: D = 128 2.83-2.85 against
# 3.03-3.14, causal 1.52-1.53 against 1.66-1.71; D = 64 3.83 against 3.56, causal 2.07 both.
CUTE_BACKWARD_HEAD_DIMS = (128,)


def attention_backward(q, k, v, o, lse, do, causal, scale, dq, dk, dv):
    """The faster of the course's two deterministic backwards (module docstring): step 3's on a
    Hopper GPU at a head dimension in CUTE_BACKWARD_HEAD_DIMS, Triton's otherwise; each
    validates every operand first."""
    if q.dim() == 4 and q.shape[3] in CUTE_BACKWARD_HEAD_DIMS and on_hopper(q):
        return attention_backward_cute(q, k, v, o, lse, do, causal, scale, dq, dk, dv)
    return triton_impl.attention_backward(q, k, v, o, lse, do, causal, scale, dq, dk, dv)


def attention_backward_cute(q, k, v, o, lse, do, causal, scale, dq, dk, dv):
    """The backward on step 3's kernels (cute_3_backward.py: delta, then dK, dV and the float32
    sum of dQ in one pass over the keys, TMA and wgmma, deterministic; a Hopper GPU) where
    they take the operands (`backward_kernel_takes`), else Triton's, with attention_backward's
    validation first; dQ = scale x the sum, rounded into dq."""
    check_operands(q, k, v, causal, scale, backward_outputs(q, k, dq, dk, dv),
                   backward_inputs(q, o, lse, do))  # fmt: skip
    if not q.is_cuda:
        raise ValueError(f"the operands are on {q.device}; the CuTe kernel needs CUDA tensors")
    if not backward_kernel_takes(q, k, v, o, do, dq, dk, dv):
        return triton_impl.attention_backward(q, k, v, o, lse, do, causal, scale, dq, dk, dv)
    if dq.numel() == 0 or k.shape[1] == 0:  # no query: dK = dV = 0; no key: dQ = 0
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    run_backward(compile_step(q.dtype, q.shape[3], causal, backward=True), q, k, v, o, lse, do,
                 causal, default_scale(q.shape[3], scale), dq, dk, dv)  # fmt: skip
    return dq, dk, dv


def run_backward(kernel, q, k, v, o, lse, do, causal, scale, dq, dk, dv):
    """A compiled backward (`compile_step(..., backward=True)`) on validated operands, with
    its scratch: delta, the float32 dQ sums (side by side in a row) and their semaphores,
    zeroed by its first kernel; dQ = the first sum + the second (the kernel adds scale dS K),
    rounded once."""
    batch, s_q, heads, head_dim = q.shape
    block_m, _ = cute_3_backward.TILES[head_dim]
    sums = cute_3_backward.sums(causal)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    dq_sums = torch.empty((batch, s_q, heads, sums * head_dim), dtype=torch.float32,
                          device=q.device)  # fmt: skip
    semaphores = torch.empty((batch, heads, sums, -(-s_q // block_m)), dtype=torch.int32,
                             device=q.device)  # fmt: skip
    kernel(q, k, v, o, lse, do, dk, dv, delta, dq_sums, semaphores,
           scale * cute_1_tiled.LOG2E, scale)  # fmt: skip
    if sums == 2:
        torch.add(dq_sums[..., :head_dim], dq_sums[..., head_dim:], out=dq)
    else:
        dq.copy_(dq_sums)


AttentionFunction, attention, _forward_op = model_plumbing(
    "cute", attention_forward, attention_backward
)
# Each step in a model's place (bench.py times them beside the default: step 3's forward and,
# at D = 128, its backward on Hopper): steps 1 and 2 behind Triton's backward, step 3 with its own.
_, attention_step1, _ = model_plumbing("cute_step1", attention_forward_step1,
                                       triton_impl.attention_backward)  # fmt: skip
_, attention_step2, _ = model_plumbing("cute_step2", attention_forward_step2,
                                       triton_impl.attention_backward)  # fmt: skip
_, attention_step3, _ = model_plumbing("cute_step3", attention_forward_step3,
                                       attention_backward_cute)  # fmt: skip
