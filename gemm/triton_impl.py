"""gemm: C = alpha*A@B + beta*C as tiled Triton kernels.

    c_ij = alpha * sum_l a_il b_lj + beta * c_ij

Program p owns one BLOCK_M x BLOCK_N tile of C. It walks along k, BLOCK_K at a step, loading a
BLOCK_M x BLOCK_K tile of A and a BLOCK_K x BLOCK_N tile of B, and `tl.dot` adds their product
into a float32 accumulator held in registers (on Hopper, wgmma on the tensor cores). After the
last step the tile is finished in float32, alpha * acc + beta * c, and rounded once as it is
stored. Masks cover the tiles that hang over the edges of m, n and k: an element past the edge
loads as 0 and adds nothing, and nothing past the edge of C is stored.

Tiles are numbered so that GROUP_M consecutive programs share their tiles of B, the grouped
order README.md explains ("Tiles to programs"): it makes the tiles running at one time touch
fewer distinct rows of A and columns of B, so more of their loads hit in L2.

Two kernels share that tile loop and its finish, `finish_tile`:

gemm_kernel      one program per tile, A and B loaded through pointers with masks: any strides.
gemm_tma_kernel  persistent: one program per SM walks the tiles p, p + programs, ... in the
                 grouped order, and A and B tiles come through TMA tensor descriptors (the
                 copy engine fetches a whole tile into shared memory and fills what lies past
                 the edge with zeros, so the loop has no masks and no address arithmetic).
                 With `flatten=True` Triton software-pipelines across tile boundaries, so the
                 next tile's loads are in flight while this tile is finished. TMA needs rows
                 of stride 1 and a row stride and address 16-byte aligned (`tma_ready`).
                 Work for the tensor cores takes this path when both A and B qualify;
                 everything else takes the pointer kernel. A transposed operand could be
                 described as the contiguous matrix it is the transpose of and its tile
                 transposed in shared memory, but that kernel, right under the interpreter,
                 failed to compile for the H200 with Triton 3.6 (not yet understood), so
                 transposed operands take the pointer kernel for now.

No program needs another's result, so there are no atomics and every addition is fixed by the
shape and the configuration: the same inputs give the same bits on every run.
"""

import contextlib
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from reference import check_operands, to_float32

# Eight tiles of C along m share each tile of B before the order moves on along n.
GROUP_M = 8
# The H200 has 132 SMs: the largest tile of which C has at least one per SM, else 64 x 64 so
# that a small C still spreads over the chip.
SM_COUNT = 132
# Measured on the H200 at 8192^3 (one run each, against torch.addmm in the same run):
#   16-bit, 8 warps  128 x 256, 3 stages  594 TFLOP/s bf16 (86% of cuBLAS), 523 fp16 (81%)
#                    128 x 256, 4 stages  573 bf16, 545 fp16 (85%)
#                    256 x 128, 3 stages  532 bf16;  128 x 128, 3 stages  486 bf16 (71%)
#   IEEE float32, 4096^3: 128 x 64 x 32, 4 warps, 3 stages  43.5 TFLOP/s (85% of cuBLAS's
#                    50.9); 128 x 128 x 32, 8 warps  41.8; the same with BLOCK_K 16  39.9
# A wide tile halves the loads per flop of a 128 x 128 one; its float32 accumulator is 128 of a
# thread's registers over 8 warps, and 3 stages of A and B tiles take 144 KiB of shared memory.
LARGE_TENSOR_CORE = {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3}
# 16-bit data with fewer than 132 wide tiles: 128 x 128 while C still has one per SM. 2048^3
# bf16 on the H200: 469 TFLOP/s against 205 for 64 x 64 (cuBLAS 551); 4 warps: 237.
MEDIUM_TENSOR_CORE = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4}
# float32 through TF32 has the same 128 bytes of k per row of a stage, but 128 x 256 asked for
# 245808 bytes of shared memory on the TMA path (Triton 3.6 on the H200), over the 232448 a
# block may have: half as wide.
LARGE_TF32 = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
# IEEE float32 has no tensor-core path: tl.dot becomes FMAs on the CUDA cores.
LARGE_IEEE_FLOAT32 = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
SMALL = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def on_tensor_cores(dtype, allow_tf32):
    """16-bit data, and float32 with TF32, go to the tensor cores; IEEE float32 does not."""
    return dtype != torch.float32 or allow_tf32


def ceil_div(a, b):
    """Python's integer ceil(a / b): triton.cdiv costs about 2.5 us a call on the host."""
    return -(-a // b)


def tiers_of(dtype, allow_tf32):
    """(the tiers to try, largest first, and the fallback) for `dtype`, each with its BLOCK_K:
    128 bytes of each row of an A tile, 32 float32 or 64 16-bit values (one cache line, and the
    k extent of a few wgmma instructions). float32 with TF32 runs on the tensor cores and takes
    their shape."""
    block_k = {"BLOCK_K": 128 // dtype.itemsize}
    if dtype != torch.float32:
        tiers = [LARGE_TENSOR_CORE, MEDIUM_TENSOR_CORE]
    else:
        tiers = [LARGE_TF32 if allow_tf32 else LARGE_IEEE_FLOAT32]
    return [{**tile, **block_k} for tile in tiers], {**SMALL, **block_k}


# Built once: configuration() only compares tile counts. The dicts are shared; nobody edits them.
TIERS = {
    (dtype, allow_tf32): tiers_of(dtype, allow_tf32)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for allow_tf32 in (False, True)
}


def configuration(m, n, dtype, allow_tf32=False):
    """The kernel's constants for an m x n C of `dtype`: the first tier of which C has at least
    one tile per SM, else the small one (`tiers_of` says which, and BLOCK_K)."""
    tiers, small = TIERS[dtype, bool(allow_tf32)]
    for tile in tiers:
        if ceil_div(m, tile["BLOCK_M"]) * ceil_div(n, tile["BLOCK_N"]) >= SM_COUNT:
            return tile
    return small


@triton.jit
def tile_of_program(pid, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of program pid in the grouped order: programs run down a group
    of GROUP_M tile rows, column by column, and only then move to the next group."""
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    programs_per_group = GROUP_M * tiles_n
    group = pid // programs_per_group
    first_tile_m = group * GROUP_M
    rows_in_group = min(tiles_m - first_tile_m, GROUP_M)  # the last group may be short
    within = pid % programs_per_group
    return first_tile_m + within % rows_in_group, within // rows_in_group


@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, c_ptr, m, n, k,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, alpha, beta,
    READ_AB: tl.constexpr, READ_C: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    tile_m, tile_n = tile_of_program(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, GROUP_M)
    # 64-bit offsets: m*k, k*n or m*n elements may pass 2**31, and row * stride with it.
    offs_m = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = offs_m < m, offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # "Not read" is a compile-time choice: the alpha == 0 variant has no load of A or B at all.
    if READ_AB:
        a_ptrs = a_ptr + offs_m[:, None] * stride_am
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn
        for k_start in range(0, k, BLOCK_K):
            offs_k = (k_start + tl.arange(0, BLOCK_K)).to(tl.int64)
            k_in = offs_k < k
            a_in, b_in = row_in[:, None] & k_in[None, :], k_in[:, None] & col_in[None, :]
            a = tl.load(a_ptrs + offs_k[None, :] * stride_ak, mask=a_in, other=0.0)
            b = tl.load(b_ptrs + offs_k[:, None] * stride_bk, mask=b_in, other=0.0)
            if UPCAST:  # the interpreter's dot is wrong on bfloat16 values; widening is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=tl.float32)
        acc = alpha * acc
    finish_tile(acc, c_ptr, offs_m, offs_n, m, n, stride_cm, stride_cn, beta, READ_C)


@triton.jit
def finish_tile(acc, c_ptr, offs_m, offs_n, m, n, stride_cm, stride_cn, beta, READ_C: tl.constexpr):
    """C tile = acc + beta * C tile in float32 (acc holds alpha * sum), rounded once by the
    store; nothing outside (m, n) is read or written."""
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    in_bounds = (offs_m < m)[:, None] & (offs_n < n)[None, :]
    if READ_C:
        acc += beta * tl.load(c_ptrs, mask=in_bounds).to(tl.float32)  # 0 + v is exact
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def gemm_tma_kernel(
    a_desc, b_desc, c_ptr, m, n, k, stride_cm, stride_cn, alpha, beta,
    READ_C: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
):  # fmt: skip
    tiles = tl.cdiv(m, BLOCK_M) * tl.cdiv(n, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        tile_m, tile_n = tile_of_program(tile, m, n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_start in range(0, k, BLOCK_K):
            a = a_desc.load([tile_m * BLOCK_M, k_start])
            b = b_desc.load([k_start, tile_n * BLOCK_N])
            if UPCAST:  # the interpreter's dot is wrong on bfloat16 values; widening is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=tl.float32)
        offs_m = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        finish_tile(alpha * acc, c_ptr, offs_m, offs_n, m, n, stride_cm, stride_cn, beta, READ_C)


def tma_ready(t):
    """True when TMA can fetch tiles of matrix t: rows of stride 1, the row stride and the
    address 16-byte aligned."""
    row_stride, col_stride = t.stride()
    return (
        col_stride == 1
        and row_stride > 0
        and row_stride * t.itemsize % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def tma_descriptor(t, block_shape):
    """TensorDescriptor.from_tensor(t, block_shape) without its checks, which tma_ready and the
    configurations already guarantee (16-byte aligned base and row stride, rows of stride 1,
    dimensions above 0, power-of-two blocks): 0.4 us where from_tensor takes 2.1 (this
    machine). The descriptor holds the tensor itself, so it is not kept between calls (that
    would keep the tensor's memory alive), and Triton 3.6's launcher encodes the CUtensorMap
    from it on every launch: host descriptors leave no way to keep one."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = t, t.shape, t.stride()
    desc.block_shape, desc.padding = block_shape, "zero"
    return desc


# Read once: test.py sets it before importing Triton, and the launcher should not pay for a look-up.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_triton_interpreter():
    """Make Triton 3.6's CPU interpreter compute what the GPU computes; called at import only
    under TRITON_INTERPRET=1, so the GPU path never runs it. With numpy 2.4 the interpreter fails
    where it makes a Python int of a scalar (a one-element array) with int(array): numpy 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"), so a loop over
    runtime bounds fails; .item() does it. And it converts float32 <-> bfloat16 bit by bit,
    truncating (its 'rtne' rounds half up) and mangling subnormals where the GPU rounds to
    nearest even and keeps them; torch's exact conversions replace those two cases."""
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
    """Launch context for t. Triton launches on the current CUDA device, so t's GPU is made
    current when it is another one (entering torch.cuda.device costs more than a launch's own
    Python, so only then); the CPU serves when Triton runs as an interpreter."""
    if t.is_cuda:
        if t.get_device() == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(t.device)
    if INTERPRETED:
        return contextlib.nullcontext()
    raise ValueError(
        f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}"
    )


def gemm(alpha, A, B, beta, C, *, allow_tf32=False):
    check_operands(alpha, A, B, beta, C)
    device = on_device_of(C)
    (m, k), n = A.shape, B.shape[1]
    if m == 0 or n == 0:
        return C
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    # TF32 applies to float32 inputs only; 16-bit inputs go to the tensor cores as they are.
    tf32 = A.dtype == torch.float32 and bool(allow_tf32)
    config = configuration(m, n, A.dtype, tf32)
    read_ab = alpha32 != 0.0 and k > 0
    common = {
        "READ_C": beta32 != 0.0, "INPUT_PRECISION": "tf32" if tf32 else "ieee",
        "UPCAST": INTERPRETED and A.dtype == torch.bfloat16, "GROUP_M": GROUP_M, **config,
    }  # fmt: skip
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    tiles = ceil_div(m, block_m) * ceil_div(n, block_n)
    with device:
        if on_tensor_cores(A.dtype, allow_tf32) and read_ab and tma_ready(A) and tma_ready(B):
            a_desc = tma_descriptor(A, [block_m, block_k])
            b_desc = tma_descriptor(B, [block_k, block_n])
            programs = min(tiles, SM_COUNT)
            gemm_tma_kernel[(programs,)](
                a_desc, b_desc, C, m, n, k, C.stride(0), C.stride(1), alpha32, beta32,
                PROGRAMS=programs, **common,
            )  # fmt: skip
        else:
            gemm_kernel[(tiles,)](
                A, B, C, m, n, k, A.stride(0), A.stride(1), B.stride(0), B.stride(1),
                C.stride(0), C.stride(1), alpha32, beta32, READ_AB=read_ab, **common,
            )  # fmt: skip
    return C
