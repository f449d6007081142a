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
    """[first byte, one past the last byte] that the elements of t occupy (torch strides are
    never negative); None for an empty tensor."""
    if t.numel() == 0:
        return None
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


def may_share_memory(a, b):
    """True when a and b live in one storage and their address ranges meet (numpy's
    may_share_memory test): views whose elements interleave without touching, such as two
    columns of one matrix, count as sharing. Exact answers need a search over the strides."""
    range_a, range_b = address_range(a), address_range(b)
    if range_a is None or range_b is None:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return range_a[0] < range_b[1] and range_b[0] < range_a[1]


def to_float32(value):
    """Round a Python float to the nearest float32 (ties to even), overflowing to infinity."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # struct refuses values that round past the largest float32
        return math.copysign(math.inf, value)


def check_operands(alpha, A, x, beta, y):
    """Raise TypeError/ValueError, naming the operand, for anything gemv does not accept."""
    for name, scalar in (("alpha", alpha), ("beta", beta)):
        if not isinstance(scalar, numbers.Real) or isinstance(scalar, bool):
            raise TypeError(f"{name} must be a real Python number, got {type(scalar).__name__}")
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
        if may_share_memory(y, t):
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
