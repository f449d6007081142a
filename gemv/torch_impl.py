"""gemv: y = alpha*A*x + beta*y with PyTorch, the way a researcher writes it.

`Tensor.addmv_` hands the whole update to a BLAS in one call: cuBLAS on the GPU (cublasSgemv
for float32; for float16 and bfloat16 a cuBLAS GEMM with one column, computing in float32), on
the CPU MKL's sgemv for float32 and ATen's own loops for the 16-bit types. It already ignores
y when beta == 0. BLAS says that alpha == 0 leaves A and x unread, but not every backend is
BLAS, so that case takes its own path here: y = beta*y without touching A or x.

Measured on the CPU (torch 2.13): every path accumulates in float32; for the 16-bit types alpha
and beta are first rounded to the storage dtype, one rounding more than the definition. On the
GPU torch lets cuBLAS reduce split-K partial sums of 16-bit GEMMs in the 16-bit dtype (its
allow_bf16/fp16_reduced_precision_reduction flags are on by default). The summation order is
the library's own and undocumented; README.md bounds it accordingly.
"""

from reference import check_operands, to_float32


def gemv(alpha, A, x, beta, y):
    check_operands(alpha, A, x, beta, y)
    # The definition's scalars: a value that rounds to 0 in float32 is a zero.
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    if alpha32 == 0.0:
        return y.zero_() if beta32 == 0.0 else y.mul_(beta32)
    return y.addmv_(A, x, beta=beta32, alpha=alpha32)
