"""gemm: C = alpha*A@B + beta*C with PyTorch, the way a researcher writes it.

`Tensor.addmm_` hands the whole update to a BLAS in one call: cuBLAS on the GPU (a GEMM with
float32 compute for every storage dtype), MKL/oneDNN or ATen's own loops on the CPU. It already
ignores C when beta == 0 and handles any strides (a transposed view is passed to the BLAS as a
transpose flag, other views are copied first). BLAS says alpha == 0 leaves A and B unread, but
not every backend is BLAS, so that case takes its own path: C = beta*C without touching A or B.

float32 means IEEE float32 unless the caller passes allow_tf32=True. torch decides that with a
process-wide flag (`torch.backends.cuda.matmul.fp32_precision`, whose legacy spelling is
`allow_tf32`), so the call sets the flag it needs and restores the caller's afterwards: the
choice never leaks in or out. torch 2.13 refuses to mix the legacy and the new spelling, so
only the new one is touched when it exists. The CPU has no TF32 path here; it computes IEEE
float32, which satisfies the TF32 bound too. The summation order is the library's own and
undocumented; README.md bounds it accordingly.

Two kinds of strides are routed around (`blas_operand`): cuBLAS refuses a leading dimension of
2**31 - 1 or more, and torch 2.13's CPU bfloat16 mm was seen reading the padding past the end of
A's rows (NaN there reached C) when the rows are padded and k is not a multiple of 8, so such
operands are copied to contiguous ones first, and a C that needs it is computed in a copy.
"""

import contextlib

import torch

from reference import check_operands, to_float32

INT_MAX = 2**31 - 1  # BLAS takes sizes, strides and leading dimensions as 32-bit integers


def blas_operand(t):
    """t, or a contiguous copy of it when the BLAS call would mishandle its strides: a stride of
    INT_MAX or more, or (16-bit data on the CPU) rows or columns padded apart."""
    padded = t.device.type == "cpu" and t.dtype != torch.float32
    padded = padded and not (t.is_contiguous() or t.T.is_contiguous())
    if not padded and all(stride < INT_MAX for stride in t.stride()):
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


@contextlib.contextmanager
def float32_matmul_precision(device, allow_tf32):
    """Run the block with float32 matmuls on `device` in TF32 or IEEE, then restore the flag."""
    if device.type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul
    if hasattr(flags, "fp32_precision"):
        name, value = "fp32_precision", "tf32" if allow_tf32 else "ieee"
    else:  # torch before the fp32_precision API
        name, value = "allow_tf32", allow_tf32
    saved = getattr(flags, name)
    setattr(flags, name, value)
    try:
        yield
    finally:
        setattr(flags, name, saved)


def gemm(alpha, A, B, beta, C, *, allow_tf32=False):
    check_operands(alpha, A, B, beta, C)
    # The definition's scalars: a value that rounds to 0 in float32 is a zero.
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    if alpha32 == 0.0 or A.shape[1] == 0:
        return C.zero_() if beta32 == 0.0 else C.mul_(beta32)
    C_blas = blas_operand(C)
    with float32_matmul_precision(C.device, allow_tf32):
        C_blas.addmm_(blas_operand(A), blas_operand(B), beta=beta32, alpha=alpha32)
    return C if C_blas is C else C.copy_(C_blas)
