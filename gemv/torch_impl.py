"""gemv: y = alpha*A*x + beta*y with PyTorch, the way a researcher writes it.

`Tensor.addmv_` hands the whole update to a BLAS in one call: cuBLAS on the GPU (cublasSgemv
for float32; for float16 and bfloat16 a cuBLAS GEMM with one column, computing in float32), on
the CPU MKL's sgemv for float32 and ATen's own loops for the 16-bit types. It already ignores
y when beta == 0. BLAS says that alpha == 0 leaves A and x unread, but not every backend is
BLAS, so that case takes its own path here: y = beta*y without touching A or x.

Measured on the CPU (torch 2.13): every path accumulates in float32. Two things the call does
that the contract does not allow are routed around here. For the 16-bit types addmv rounds
alpha and beta to the storage dtype (1e5 overflows float16 with a RuntimeError, 1e-8 becomes 0),
so a scalar the dtype does not hold exactly takes a float32 copy of the operands instead
(`held_exactly`). And BLAS takes strides as 32-bit integers: cuBLAS refuses a leading dimension
of 2**31 - 1 or more and a vector step of 0, so such operands are copied first (`blas_operand`).
On the GPU torch lets cuBLAS reduce split-K partial sums of 16-bit GEMMs in the 16-bit dtype
(its allow_bf16/fp16_reduced_precision_reduction flags are on by default). The summation order
is the library's own and undocumented; README.md bounds it accordingly.
"""

import struct

import torch

from reference import check_operands, to_float32

INT_MAX = 2**31 - 1  # BLAS takes sizes, strides and leading dimensions as 32-bit integers


def held_exactly(value, dtype):
    """True when the float32 number `value` is also a number of `dtype`: torch converts the
    scalars of a 16-bit addmv to that dtype, which must then change nothing."""
    if dtype == torch.float16:
        try:
            return struct.unpack("e", struct.pack("e", value))[0] == value
        except OverflowError:  # beyond float16's range
            return False
    if dtype == torch.bfloat16:  # bfloat16 is float32 with the low 16 significand bits dropped
        return struct.unpack("<I", struct.pack("<f", value))[0] & 0xFFFF == 0
    return True


def blas_operand(t):
    """t, or a copy with strides a BLAS call takes: no stride of INT_MAX or more and no vector
    step of 0. A one-element vector's step means nothing, so it becomes a view of step 1."""
    if t.dim() == 1 and t.numel() == 1:
        return t.as_strided((1,), (1,))
    if all(0 < stride < INT_MAX for stride in t.stride()):
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def gemv(alpha, A, x, beta, y):
    check_operands(alpha, A, x, beta, y)
    # The definition's scalars: a value that rounds to 0 in float32 is a zero.
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    if alpha32 == 0.0:
        return y.zero_() if beta32 == 0.0 else y.mul_(beta32)
    if not (held_exactly(alpha32, y.dtype) and held_exactly(beta32, y.dtype)):
        A32, x32 = blas_operand(A.float()), blas_operand(x.float())
        return y.copy_(torch.addmv(y.float(), A32, x32, beta=beta32, alpha=alpha32))
    y_blas = blas_operand(y)
    y_blas.addmv_(blas_operand(A), blas_operand(x), beta=beta32, alpha=alpha32)
    return y if y_blas.data_ptr() == y.data_ptr() else y.copy_(y_blas)
