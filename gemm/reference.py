"""gemm: C = alpha*A@B + beta*C, the definition.

    c_ij = alpha32 * sum_{l=0}^{k-1} a_il b_lj + beta32 * c_ij     i < m, j < n

A is m x k, B is k x n, C is m x n, each with any strides torch can produce, so the four
layouts of BLAS (NN, NT, TN, TT: A or B given as the transpose of a contiguous matrix) are
just four stride patterns of the same call. As in BLAS, the scalars live in the precision of
the computation, float32 for every storage dtype: alpha and beta are first rounded to float32
(alpha32, beta32). Every element is a float32 number (float16 and bfloat16 widen exactly), so
each product a_il b_lj (at most 48 significant bits) and beta32 * c_ij are exact in Python's
float64, and `math.fsum` adds the k products of an entry with a single rounding. alpha32 * S_ij
is a second rounding and the final fsum of the two terms a third, so this returns

    r_ij = fl64( fl64(alpha32 * fl64(S_ij)) + beta32 c_ij ),  |r_ij - c_ij| <= gamma_3(2**-53) W_ij,

W_ij = |alpha32| sum_l |a_il b_lj| + |beta32 c_ij|, with nothing able to underflow or overflow
in float64 (products of float32 numbers lie between 2**-298 and 2**256).

BLAS's corner semantics are part of the definition: beta == 0 means C is not read (a NaN in C
does not propagate), alpha == 0 means A and B are not read (C = beta*C; both zero: C = 0), and
k == 0 gives C = beta*C. C is written while A and B are read, so it may share no memory with
either, and no two of its elements may share an address (`elements_collide`). `check_operands` says
which inputs are valid (every implementation calls it before launching anything) and `gemm`
what the answer is, as plain Python over Python floats. It returns a new float64 tensor of
shape (m, n) and mutates nothing.
"""

import math
import numbers
import struct

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def ranges_cross(range_a, range_b):
    """True if two address ranges (address_range's, None for no memory) share a byte."""
    return (
        range_a is not None
        and range_b is not None
        and range_a[0] < range_b[1]
        and range_b[0] < range_a[1]
    )


def overlap(a, b):
    """How the elements of a and b share memory: 'none', 'same' (the very same elements in the
    same order) or 'partial'. Judged by addresses, not by storages: two storages can cover one
    memory (views of one numpy array, DLPack imports). Conservative: address ranges that cross
    are 'partial' without a search for a common element, except two 1-D views of one step whose
    elements sit in the gaps between each other's (buf[0::2] and buf[1::2]), which are 'none'."""
    range_a, range_b = address_range(a), address_range(b)
    if not ranges_cross(range_a, range_b):
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


def elements_collide(matrix):
    """True if two different (i, j) of a 2-D tensor have one address, so that writing one would
    overwrite the other. With strides s, t of dims of sizes m, n > 1, i s + j t = i' s + j' t
    means (i - i') s = (j' - j) t, whose smallest nonzero solution is |i - i'| = t / g,
    |j - j'| = s / g with g = gcd(s, t): a collision exactly when t / g < m and s / g < n. A dim
    of size 1 never moves; a stride 0 along a longer dim always collides."""
    if matrix.is_contiguous():  # the common case, and 4x cheaper: rows of n side by side
        return False
    (m, n), (s, t) = matrix.shape, matrix.stride()
    if m == 0 or n == 0:
        return False
    if m == 1 or n == 1:
        return (m > 1 and s == 0) or (n > 1 and t == 0)
    if s == 0 or t == 0:
        return True
    g = math.gcd(s, t)
    return t // g < m and s // g < n


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


def check_operands(alpha, A, B, beta, C):
    """Raise TypeError/ValueError, naming the operand, for anything gemm does not accept. Every
    call of every implementation pays for this on the host, so each property is read once."""
    check_scalar("alpha", alpha)
    check_scalar("beta", beta)
    for name, t in (("A", A), ("B", B), ("C", C)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got a tensor of shape {tuple(t.shape)}")
    dtype, device = A.dtype, A.device
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"A has dtype {dtype}; supported: float32, float16, bfloat16")
    for name, t in (("B", B), ("C", C)):
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but A has {dtype}; gemm does not convert")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but A is on {device}")
    (m, k), (k_b, n) = A.shape, B.shape
    if k_b != k:
        raise ValueError(f"B has {k_b} rows but A has {k} columns")
    if C.shape != (m, n):
        raise ValueError(f"C has shape {tuple(C.shape)} but A @ B has shape {(m, n)}")
    if elements_collide(C):
        raise ValueError(
            f"C's strides {C.stride()} give two of its elements one address: gemm would write "
            "both into one place"
        )
    c_range = address_range(C)  # read once; overlap() judges only ranges that cross
    for name, t in (("A", A), ("B", B)):
        if ranges_cross(c_range, address_range(t)) and overlap(C, t) != "none":
            raise ValueError(f"C overlaps {name}: gemm writes C while it reads {name}")


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def gemm(alpha, A, B, beta, C):
    check_operands(alpha, A, B, beta, C)
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    columns_of_B = B.T.tolist()
    result = []
    for row_of_A, row_of_C in zip(A.tolist(), C.tolist(), strict=True):
        out_row = []
        for column_of_B, c_ij in zip(columns_of_B, row_of_C, strict=True):
            terms = []
            if alpha32 != 0.0:  # alpha == 0: A and B are not read
                products = [a * b for a, b in zip(row_of_A, column_of_B, strict=True)]
                terms.append(alpha32 * exact_sum(products))
            if beta32 != 0.0:  # beta == 0: C is not read
                terms.append(beta32 * c_ij)
            out_row.append(exact_sum(terms))
        result.append(out_row)
    return torch.tensor(result, dtype=torch.float64).reshape(C.shape)
