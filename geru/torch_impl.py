"""geru: A = A + alpha * x * y^T with PyTorch, the way a researcher writes it.

`A.addr_(x, y, alpha=alpha32)` is ATen's addr kernel, one elementwise pass over A (any strides)
that evaluates `beta * a_ij + alpha_s * x_i * y_j` with beta = 1 in the storage dtype: on the
CPU and on the GPU alike, alpha is first converted to that dtype (alpha_s = fl_s(alpha32)), and
for float16 and bfloat16 each product and the sum is computed in float32 and rounded back to 16
bits. The conversion of alpha is not a rounding the contract allows (1e5 overflows float16 with
a RuntimeError, 1e-8 becomes 0), so an alpha the dtype does not hold exactly takes float32
copies of the operands instead (`held_exactly`), and the conversion changes nothing otherwise.
What remains is two roundings to the storage dtype more than the fused kernels make, and
README.md bounds them. alpha == 0 takes its own
path, so that x and y are never touched and A keeps its bits: addr would compute 0 * x_i * y_j,
NaN for an infinite x_i.
"""

import struct

import torch

from reference import check_operands, to_float32


def held_exactly(value, dtype):
    """True when the float32 number `value` is also a number of `dtype`: torch converts the
    scalar of a 16-bit addr to that dtype, which must then change nothing."""
    if dtype == torch.float16:
        try:
            return struct.unpack("e", struct.pack("e", value))[0] == value
        except OverflowError:  # beyond float16's range
            return False
    if dtype == torch.bfloat16:  # bfloat16 is float32 with the low 16 significand bits dropped
        return struct.unpack("<I", struct.pack("<f", value))[0] & 0xFFFF == 0
    return True


def geru(alpha, x, y, A):
    check_operands(alpha, x, y, A)
    alpha32 = to_float32(float(alpha))  # the definition's scalar: rounding to 0 makes it 0
    if alpha32 == 0.0 or A.numel() == 0:
        return A
    if not held_exactly(alpha32, A.dtype):
        return A.copy_(torch.addr(A.float(), x.float(), y.float(), alpha=alpha32))
    return A.addr_(x, y, alpha=alpha32)
