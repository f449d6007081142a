"""geru, A = A + alpha * x * y^T, with PyTorch, the way a researcher writes it: one
`Tensor.addr_`, ATen's elementwise kernel. README.md, "The error bound" and "The mapping onto the
GPU", torch_impl.py, say how it rounds and why alpha must be held by the dtype.

    held_exactly    whether a 16-bit addr may take alpha (it converts it to the dtype)
    geru            alpha == 0 on its own path (x and y unread, A kept), else addr
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
