"""geru: A = A + alpha * x * y^T with PyTorch, the way a researcher writes it.

`A.addr_(x, y, alpha=alpha)` is ATen's addr kernel, one elementwise pass over A (any strides) that
evaluates `beta * a_ij + alpha_s * x_i * y_j` with beta = 1 in the storage dtype: on the CPU and
on the GPU alike, alpha is first converted to that dtype (alpha_s = fl_s(alpha32)), and for
float16 and bfloat16 every product and the sum is computed in float32 and rounded back to 16
bits. That is three roundings to the storage dtype more than the fused kernels make, and
README.md bounds them. (The conversion of alpha also refuses values a float16 cannot hold,
|alpha| > 65504, with a RuntimeError.) alpha == 0 takes its own path, so that x and y are never
touched and A keeps its bits: addr would compute 0 * x_i * y_j, NaN for an infinite x_i.
"""

from reference import check_operands, to_float32


def geru(alpha, x, y, A):
    check_operands(alpha, x, y, A)
    if to_float32(float(alpha)) == 0.0 or A.numel() == 0:
        return A
    return A.addr_(x, y, alpha=alpha)
