"""gemv, y = alpha*A*x + beta*y, with PyTorch, the way a researcher writes it: one
`Tensor.addmv_` (cuBLAS on the GPU, MKL or ATen's loops on the CPU). README.md, "The mapping
onto the GPU", torch_impl.py, says what it computes in which precision and why the bound takes
any order of float32 additions.

    held_exactly    whether a 16-bit addmv may take the scalar (it converts it to the dtype)
    blas_operand    a copy of an operand whose strides a BLAS call refuses
    gemv            alpha == 0 on its own path (A and x unread), else addmv
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
