"""gemv: y = alpha*A*x + beta*y, the definition.

    y_i = alpha32 * sum_{j=0}^{n-1} a_ij x_j + beta32 * y_i        for i = 0 .. m-1

As in BLAS, the scalars live in the precision of the computation, float32 for every storage
dtype: alpha and beta are first rounded to float32 (alpha32, beta32). Every a_ij, x_j and y_i
is a float32 number (float16 and bfloat16 widen exactly), so each product a_ij x_j (at most
24 + 24 = 48 significant bits) and beta32 * y_i are exact in Python's float64, and
`math.fsum` adds the n products of a row with a single rounding. The one other rounding is
the triple product: alpha32 * a_ij * x_j can need 72 bits, so the row sum S_i is rounded to
float64 first and then multiplied by alpha32 (a second rounding), and the two terms are added
by fsum (a third). So this returns

    r_i = fl64( fl64(alpha32 * fl64(S_i)) + beta32 y_i ),   |r_i - y_i| <= gamma_3(2**-53) W_i,

W_i = |alpha32| sum_j |a_ij x_j| + |beta32 y_i|: within 3.4e-16 W_i of the exact answer, and no
step can underflow or overflow in float64 (products of float32 numbers lie between 2**-298
and 2**256). Implementations round far more; README.md derives how much.

BLAS's corner semantics are part of the definition: beta == 0 means y is not read (a NaN in y
does not propagate), alpha == 0 means A and x are not read (y = beta*y; both zero: y = 0), and
n == 0 gives y = beta*y. y is written while A and x are read, so it may share no memory with
either. This file is the contract: `check_operands` says which inputs are valid (every
implementation calls it before launching anything) and `gemv` what the answer is, as plain
Python over Python floats. It returns a new float64 tensor and mutates nothing.
"""

import math
import numbers
import struct

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_tensor(name, t, ndim, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {what}, got a tensor of shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


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


def check_operands(alpha, A, x, beta, y):
    """Raise TypeError/ValueError, naming the operand, for anything gemv does not accept."""
    check_scalar("alpha", alpha)
    check_scalar("beta", beta)
    _check_tensor("A", A, 2, "a 2-D matrix")
    _check_tensor("x", x, 1, "a 1-D vector")
    _check_tensor("y", y, 1, "a 1-D vector")
    for name, t in (("x", x), ("y", y)):
        if t.dtype != A.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but A has {A.dtype}; gemv does not convert"
            )
        if t.device != A.device:
            raise ValueError(f"{name} is on {t.device} but A is on {A.device}")
    m, n = A.shape
    if x.numel() != n:
        raise ValueError(f"x has {x.numel()} elements but A has {n} columns")
    if y.numel() != m:
        raise ValueError(f"y has {y.numel()} elements but A has {m} rows")
    if m > 1 and y.stride(0) == 0:
        raise ValueError("y has stride 0: its elements overlap, so the result is undefined")
    for name, t in (("A", A), ("x", x)):
        if overlap(y, t) != "none":
            raise ValueError(f"y overlaps {name}: gemv writes y while it reads {name}")


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def gemv(alpha, A, x, beta, y):
    check_operands(alpha, A, x, beta, y)
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    x_values = x.tolist()
    result = []
    for row, y_i in zip(A.tolist(), y.tolist(), strict=True):
        terms = []
        if alpha32 != 0.0:  # alpha == 0: A and x are not read
            row_sum = exact_sum([a_ij * x_j for a_ij, x_j in zip(row, x_values, strict=True)])
            terms.append(alpha32 * row_sum)
        if beta32 != 0.0:  # beta == 0: y is not read
            terms.append(beta32 * y_i)
        result.append(exact_sum(terms))
    return torch.tensor(result, dtype=torch.float64)
