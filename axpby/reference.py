"""axpby: y = alpha*x + beta*y, the definition.

    y_i = alpha32 * x_i + beta32 * y_i        for i = 0 .. n-1

As in BLAS, the scalars live in the precision of the computation, float32 for every storage dtype:
alpha and beta are first rounded to float32 (alpha32, beta32). Each product of two float32 numbers
is exact in Python's float64, and `math.fsum` adds the two exactly before the single rounding to
float64, so this returns the exact answer as nearly as float64 can hold it. Implementations round
the products, the sum and the store; README.md derives how far that can take them from this.

BLAS's corner semantics are part of the definition: beta == 0 means y is not read (a NaN in y
does not propagate) and alpha == 0 means x is not read. This file is the contract:
`check_operands` says which inputs are valid, `axpby` what the answer is, as plain Python; it
returns a new float64 tensor and mutates nothing.
"""

import math
import numbers
import struct

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_vector(name, v):
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if v.dim() != 1:
        raise ValueError(f"{name} must be a 1-D vector, got a tensor of shape {tuple(v.shape)}")
    if v.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {v.dtype}; supported: float32, float16, bfloat16")


def address_range(t):
    """[first byte, one past the last byte] of the memory t's elements occupy (torch strides are
    never negative); None for an empty tensor."""
    n, start = t.numel(), t.data_ptr()
    if n == 0:
        return None
    if t.is_contiguous():  # the common case, and 3x cheaper: n elements side by side
        return start, start + n * t.element_size()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (span + 1) * t.element_size()


def overlap(a, b):
    """How the elements of a and b share memory: 'none', 'same' (the very same elements in the
    same order) or 'partial'. Judged by addresses, not by storages: two storages can cover one
    memory (views of one numpy array, DLPack imports). Conservative: address ranges that cross
    are 'partial' without a search for a common element, except two 1-D views of one step whose
    elements sit in the gaps between each other's (buf[0::2] and buf[1::2]), which are 'none'."""
    range_a, range_b = address_range(a), address_range(b)
    if range_a is None or range_b is None or range_a[1] <= range_b[0] or range_b[1] <= range_a[0]:
        return "none"
    if (
        a.dtype == b.dtype
        and a.shape == b.shape
        and range_a[0] == range_b[0]
        and all(a.stride(d) == b.stride(d) for d in range(a.dim()) if a.shape[d] > 1)
    ):
        return "same"
    if a.dim() == b.dim() == 1 and a.dtype == b.dtype:
        size, step = a.element_size(), a.stride(0) * a.element_size()
        if (
            0 < a.stride(0) == b.stride(0)
            and size <= (range_a[0] - range_b[0]) % step <= step - size
        ):
            return "none"  # one step: the elements of one sit in the gaps between the other's
    return "partial"


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


def check_operands(alpha, x, beta, y):
    """Raise TypeError/ValueError, naming the operand, for anything axpby does not accept."""
    check_scalar("alpha", alpha)
    check_scalar("beta", beta)
    _check_vector("x", x)
    _check_vector("y", y)
    if y.dtype != x.dtype:
        raise TypeError(f"y has dtype {y.dtype} but x has {x.dtype}; axpby does not convert")
    if y.numel() != x.numel():
        raise ValueError(f"y has {y.numel()} elements but x has {x.numel()}")
    if y.device != x.device:
        raise ValueError(f"y is on {y.device} but x is on {x.device}")
    if y.numel() > 1 and y.stride(0) == 0:
        raise ValueError("y has stride 0: its elements overlap, so the result is undefined")
    if overlap(x, y) == "partial":
        raise ValueError("x and y partially overlap: axpby needs them disjoint or identical")


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def axpby(alpha, x, beta, y):
    check_operands(alpha, x, beta, y)
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    result = []
    for x_i, y_i in zip(x.tolist(), y.tolist(), strict=True):
        terms = []
        if alpha32 != 0.0:  # alpha == 0: x is not read
            terms.append(alpha32 * x_i)
        if beta32 != 0.0:  # beta == 0: y is not read
            terms.append(beta32 * y_i)
        result.append(exact_sum(terms))
    return torch.tensor(result, dtype=torch.float64)
