"""geru: A = A + alpha * x * y^T, the definition (BLAS's rank-1 update `ger`).

    a_ij <- a_ij + alpha32 * x_i * y_j        for i = 0 .. m-1, j = 0 .. n-1

As in BLAS, alpha lives in the precision of the computation, float32 for every storage dtype: it
is first rounded to float32 (alpha32). How exact is plain Python here? alpha32 * x_i is a product
of two float32 numbers, at most 48 significant bits, so it is exact in float64. Its product with
y_j can have 72 bits and is rounded once, to float64: a relative error of at most 2**-53. Then
`math.fsum` adds a_ij to it exactly and rounds once more. So the returned entry is

    z_ref = fl64(a_ij + p (1 + d)),   p = alpha32 x_i y_j,   |d| <= 2**-53,
    |z_ref - z| <= 2**-53 |p| + 2**-53 |z_ref| / (1 - 2**-53)

away from the exact z = a_ij + p: some 10**9 times smaller than the float32 errors the kernels
make, and test.py adds it to the bound all the same. (No underflow: the smallest product of three
float32 numbers, 2**-447, is a normal float64.)

BLAS's corner semantics are part of the definition: alpha32 == 0 means x and y are not read and
A is left as it is (a NaN in x or y does not propagate; a NaN in A stays the NaN it was);
m == 0 or n == 0 is nothing to do. This file is the contract: `check_operands` says which inputs
are valid, `geru` what the answer is, as plain Python; it returns a new float64 tensor and
mutates nothing.
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


def elements_collide(matrix):
    """True if two different (i, j) of a 2-D tensor have one address, so that writing one would
    overwrite the other. With strides s, t of dims of sizes m, n > 1, i s + j t = i' s + j' t
    means (i - i') s = (j' - j) t, whose smallest nonzero solution is |i - i'| = t / g,
    |j - j'| = s / g with g = gcd(s, t): a collision exactly when t / g < m and s / g < n. A dim
    of size 1 never moves; a stride 0 along a longer dim always collides."""
    (m, n), (s, t) = matrix.shape, matrix.stride()
    if m == 0 or n == 0:
        return False
    if m == 1 or n == 1:
        return (m > 1 and s == 0) or (n > 1 and t == 0)
    if s == 0 or t == 0:
        return True
    g = math.gcd(s, t)
    return t // g < m and s // g < n


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


def fastest_dim(A):
    """The dim along which A's neighbouring elements are closest in memory: 1 for a row-major
    matrix, 0 for a column-major one. A dim of size 1 never steps, so its stride does not count.
    The kernels lay the long side of their tiles along it."""
    (m, n), (s, t) = A.shape, A.stride()
    return 1 if (t if n > 1 else math.inf) <= (s if m > 1 else math.inf) else 0


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


def check_operands(alpha, x, y, A):
    """Raise TypeError/ValueError, naming the operand, for anything geru does not accept."""
    check_scalar("alpha", alpha)
    _check_tensor("x", x, 1, "a 1-D vector")
    _check_tensor("y", y, 1, "a 1-D vector")
    _check_tensor("A", A, 2, "a 2-D matrix")
    for name, v in (("x", x), ("y", y)):
        if v.dtype != A.dtype:
            raise TypeError(
                f"{name} has dtype {v.dtype} but A has {A.dtype}; geru does not convert"
            )
        if v.device != A.device:
            raise ValueError(f"{name} is on {v.device} but A is on {A.device}")
    if tuple(A.shape) != (x.numel(), y.numel()):
        raise ValueError(
            f"A has shape {tuple(A.shape)} but x has {x.numel()} elements and y {y.numel()}: "
            f"A must be (len(x), len(y)) = ({x.numel()}, {y.numel()})"
        )
    if elements_collide(A):
        raise ValueError(
            f"A's strides {A.stride()} give two of its elements one address (a stride-0 or "
            "overlapping dim): the update is undefined"
        )
    for name, v in (("x", x), ("y", y)):
        if overlap(v, A) != "none":
            raise ValueError(f"{name} shares memory with A, which geru writes while reading {name}")


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def geru(alpha, x, y, A):
    check_operands(alpha, x, y, A)
    alpha32 = to_float32(float(alpha))
    m, n = A.shape
    if alpha32 == 0.0:  # x and y are not read
        return torch.tensor(A.tolist(), dtype=torch.float64).reshape(m, n)
    y_list, rows = y.tolist(), []
    for x_i, a_row in zip(x.tolist(), A.tolist(), strict=True):
        alpha_x = alpha32 * x_i  # exact: 48 bits at most
        rows.append(
            [exact_sum([a_ij, alpha_x * y_j]) for a_ij, y_j in zip(a_row, y_list, strict=True)]
        )
    return torch.tensor(rows, dtype=torch.float64).reshape(m, n)
