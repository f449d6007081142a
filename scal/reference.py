"""scal: y = alpha * y, the definition.

    y_i = fl(alpha32 * y_i)        for i = 0 .. n-1

BLAS computes in the precision of its scalars. Here that is float32 for every storage dtype:
alpha is first rounded to float32 (alpha32), each element is widened to float32 (exact), the
product is rounded once to float32 and the store rounds it once more to y's dtype (nothing for
float32 data). The product of two float32 numbers has at most 48 significant bits, so Python's
float64 holds it exactly and `to_float32` below performs the one rounding the GPU performs: every
implementation must agree with this bit for bit.

alpha == 0 is BLAS's "the output is not read": y becomes +0 everywhere, even where it held NaN
or infinity. This file is the contract: `check_operands` says which inputs are valid and
`scal` what the answer is, as plain Python; it returns a new float64 tensor and mutates nothing.
"""

import math
import numbers
import struct

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def to_float32(value):
    """Round a Python float to the nearest float32 (ties to even), overflowing to infinity."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # struct refuses values that round past the largest float32
        return math.copysign(math.inf, value)


def check_scalar(name, value):
    """A scalar is a real Python number that a float can hold (float() of a huge int overflows)."""
    if type(value) is float:  # the common case, checked first: every call pays for this one
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real Python number, got {type(value).__name__}")
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"{name} is beyond the range of a float (|{name}| > 1.8e308)") from None


def check_operands(alpha, y):
    """Raise TypeError/ValueError, naming the operand, for anything scal does not accept."""
    check_scalar("alpha", alpha)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if y.dim() != 1:
        raise ValueError(f"y must be a 1-D vector, got a tensor of shape {tuple(y.shape)}")
    if y.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"y has dtype {y.dtype}; supported: float32, float16, bfloat16")
    if y.numel() > 1 and y.stride(0) == 0:
        raise ValueError("y has stride 0: its elements overlap, so the result is undefined")


def scal(alpha, y):
    check_operands(alpha, y)
    alpha32 = to_float32(float(alpha))
    if alpha32 == 0.0:
        result = [0.0] * y.numel()
    else:
        result = [to_float32(alpha32 * y_i) for y_i in y.tolist()]
    return torch.tensor(result, dtype=torch.float64)
