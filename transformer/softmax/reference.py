"""softmax over the last dimension, forward and backward: the definition.

    y_i  = exp(x_i - m) / sum_j exp(x_j - m),      m = max_j x_j
    dx_i = y_i (dy_i - sum_j dy_j y_j)

for every row of an (..., N) tensor; the leading dimensions flatten to M rows. README.md
derives the backward by hand. The row maximum m changes nothing in exact arithmetic (it cancels
between numerator and denominator); it keeps exp from overflowing and makes the largest term
exactly exp(0) = 1, so the denominator is at least 1.

Special values follow IEEE arithmetic applied to the formula as written, which is what
torch.softmax returns too:
  * x_i = -inf (a masked logit) gives y_i = 0, and the rest of the row is unchanged;
  * a row of -inf only has m = -inf and x_i - m = -inf - (-inf) = NaN: the whole row is NaN;
  * a +inf gives m = +inf and inf - inf = NaN in the sum: the whole row is NaN;
  * a NaN anywhere enters the sum: the whole row is NaN.

This file is the contract: `check_forward` and `check_backward` say which operands are valid
(every implementation calls them before launching anything), `SoftmaxModule` is the
torch.nn.Softmax interface every implementation's `Softmax` drop-in shares, `softmax_forward` and
`softmax_backward` what the answer is, in plain Python over Python floats: float16, bfloat16
and float32 values widen exactly to float64, a product of two of them is exact there, and
`math.fsum` rounds each sum once. exp is float64's (an error of about 2**-52, far below the
float32 bounds the kernels are held to). They return new float64 tensors and mutate nothing.
"""

import functools
import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def address_range(t):
    """[first byte, one past the last byte] of t's elements (torch strides are never negative);
    None for an empty t. A check computes it once per operand and compares the ranges pairwise."""
    start = t.data_ptr()
    if t.is_contiguous():  # the common case, without a Python loop over the dimensions
        size = t.nbytes
        return (start, start + size) if size else None
    if t.numel() == 0:
        return None
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (span + 1) * t.element_size()


def overlap(a, range_a, b, range_b):
    """'none', 'same' (the very same elements in the same order) or 'partial' for a and b
    (of one shape) with their address_range: by range first, then, where the ranges meet,
    element by element."""
    if range_a is None or range_b is None or range_a[1] <= range_b[0] or range_b[1] <= range_a[0]:
        return "none"
    if a is b:
        return "same"
    if range_a[0] == range_b[0] and a.shape == b.shape:
        if all(a.stride(d) == b.stride(d) for d in range(a.dim()) if a.shape[d] > 1):
            return "same"
    return "partial" if share_an_element(a, b) else "none"


def share_an_element(a, b):
    """Whether views a and b, whose address ranges meet, have an element in common: exact for
    views that move along nested strides, as slices and permutations of one tensor do (x and y
    as the two halves of one (M, 2N) buffer); True (refused) where that is not decided here.

    a's elements lie at a0 + sum_s i_s s and b's at b0 + sum_s j_s s, over the strides s either
    view moves along (0 <= i_s < m_s and 0 <= j_s < n_s, a size 1 along a stride its view does
    not move on), so they meet iff b0 - a0 = sum_s k_s s for integers k_s = i_s - j_s in
    [1 - n_s, m_s - 1]: a point of a bounded lattice, found by `lattice_reaches`."""
    return views_meet(b.data_ptr() - a.data_ptr(), a.element_size(), b.element_size(),
                      a.shape, a.stride(), b.shape, b.stride())  # fmt: skip


@functools.lru_cache(maxsize=256)  # far more view pairs than a model's layers ever cut
def views_meet(offset, a_size, b_size, a_shape, a_strides, b_shape, b_strides):
    """share_an_element on integers alone (b's first byte minus a's, element sizes, shapes and
    strides), memoised: a model passes the same few pairs of views every layer and step, and
    the offset between two views of one buffer does not move with the buffer, so the search
    runs once per pair of layouts and a repeated call is a dictionary look-up."""
    if 0 in a_shape or 0 in b_shape:
        return False
    delta, misaligned = divmod(offset, a_size)
    if misaligned or b_size != a_size:
        return True
    extents = {}  # stride: [a's size along it, b's size along it]; stride 0 repeats elements
    for m, stride in zip(a_shape, a_strides, strict=True):
        if m > 1 and stride:
            if stride in extents:
                return True  # two dimensions of one view on one stride: not decided here
            extents[stride] = [m, 1]
    for n, stride in zip(b_shape, b_strides, strict=True):
        if n > 1 and stride:
            sizes = extents.setdefault(stride, [1, 1])
            if sizes[1] > 1:
                return True
            sizes[1] = n
    steps = sorted(((s, 1 - n, m - 1) for s, (m, n) in extents.items()), reverse=True)
    return lattice_reaches(delta, steps)


def lattice_reaches(delta, steps):
    """Whether delta = sum k_d s_d with low_d <= k_d <= high_d, steps = [(s_d, low_d, high_d)]
    from the largest stride down. The dimensions after d reach only [below_d, above_d], which
    leaves few k_d: at most two where each stride steps past both views' reach in the smaller
    dimensions (slices and permutations of one tensor), so the search visits at most 2**dims
    leaves. More than two means strides that interleave: True (refuse), not a longer search."""
    windows, below, above = [], 0, 0
    for stride, low, high in reversed(steps):
        windows.append((below, above))
        below, above = below + stride * low, above + stride * high
    windows.reverse()
    pending = [(delta, 0)]  # (what is left to reach, the next dimension)
    while pending:
        left, d = pending.pop()
        if d == len(steps):
            if left == 0:
                return True
            continue
        (stride, low, high), (below, above) = steps[d], windows[d]
        first = max(low, -((above - left) // stride))  # ceil((left - above) / stride)
        last = min(high, (left - below) // stride)
        if last - first > 1:
            return True
        pending += [(left - k * stride, d + 1) for k in range(first, last + 1)]
    return False


def elements_collide(t):
    """True unless t's elements have distinct addresses by the simple test: sorted by stride,
    each dimension's stride steps past everything the smaller ones span. (Conservative: a
    layout that interleaves dimensions without collisions is refused too; torch makes none.)"""
    if t.is_contiguous():
        return False
    span = 0
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size > 1:
            if stride <= span:
                return True
            span += (size - 1) * stride
    return False


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError(f"{name} must have a last dimension to normalise over, got a 0-dim tensor")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


def _check_operands(inputs, outputs):
    """inputs and outputs: ((name, tensor), ...); the first input sets shape, dtype and device.
    An output may be one of the inputs itself (in place), never a partial overlap."""
    named = inputs + outputs
    for name, t in named:
        _check_tensor(name, t)
    first_name, first = named[0]
    dtype, shape, device = first.dtype, first.shape, first.device
    for name, t in named[1:]:
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has {dtype}")
        if t.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {first_name} has {tuple(shape)}"
            )
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {device}")
    operands = [(name, t, address_range(t)) for name, t in named]
    for name, t, span in operands[len(inputs) :]:
        if elements_collide(t):
            raise ValueError(f"{name}'s strides {t.stride()} give two of its elements one address")
        for other_name, other, other_span in operands:
            if other is not t and overlap(t, span, other, other_span) == "partial":
                raise ValueError(f"{name} partially overlaps {other_name}")


def check_forward(x, y):
    """Raise TypeError/ValueError, naming the operand, for anything softmax_forward refuses
    (y None: the inputs only)."""
    _check_operands((("x", x),), () if y is None else (("y", y),))


def check_backward(y, dy, dx):
    """The same for softmax_backward (dx None: the inputs only)."""
    _check_operands((("y", y), ("dy", dy)), () if dx is None else (("dx", dx),))


def as_rows(t, for_output=False):
    """(rows, copied): t as an (M, N) matrix over its own memory when its leading dimensions
    merge into one row stride (contiguous tensors, slices of a wider last dimension, transposes
    of the last two), else a fresh contiguous matrix: a copy of t's values for an input, an
    uninitialised one for an output (copied = True: the caller copies the result back)."""
    n = t.shape[-1]
    try:
        return t.view(-1, n), False
    except RuntimeError:  # the leading dimensions' strides do not merge
        if for_output:
            return torch.empty(t.numel() // n, n, dtype=t.dtype, device=t.device), True
        return t.reshape(-1, n), True


class SoftmaxModule(torch.nn.Module):
    """torch.nn.Softmax(dim)'s interface over an implementation's softmax of the last dimension,
    `last_dim_softmax` (each implementation file's `Softmax` sets it). Another dim is moved last
    and back, so the output has torch's layout. No parameters: the state_dict is empty, as
    torch's is. dim must be given: torch's implicit choice for dim=None is deprecated."""

    last_dim_softmax = None

    def __init__(self, dim):
        super().__init__()
        if not isinstance(dim, int):
            raise TypeError(f"dim must be an int (the dimension to normalise over), got {dim!r}")
        self.dim = dim

    def forward(self, x):
        if self.dim in (-1, x.dim() - 1):
            return self.last_dim_softmax(x)
        return self.last_dim_softmax(x.movedim(self.dim, -1)).movedim(-1, self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def softmax_row(row):
    if any(math.isnan(v) for v in row):
        return [math.nan] * len(row)  # max() of a list with NaN depends on the order
    m = max(row)
    exps = [math.exp(v - m) for v in row]  # -inf - -inf and inf - inf are NaN: exp(NaN) = NaN
    total = exact_sum(exps)
    return [e / total for e in exps]


def softmax_backward_row(y_row, dy_row):
    s = exact_sum([dy_j * y_j for dy_j, y_j in zip(dy_row, y_row, strict=True)])
    return [y_i * (dy_i - s) for y_i, dy_i in zip(y_row, dy_row, strict=True)]


def softmax_forward(x, y=None):
    """The exact softmax of every row of x, a new float64 tensor of x's shape (y, if given, is
    only checked: the reference never writes)."""
    check_forward(x, y)
    rows = x.detach().cpu().reshape(-1, x.shape[-1]).tolist() if x.numel() else []
    result = [softmax_row(row) for row in rows]
    return torch.tensor(result, dtype=torch.float64).reshape(x.shape)


def softmax_backward(y, dy, dx=None):
    """dx for the stored forward output y and the incoming gradient dy, a new float64 tensor."""
    check_backward(y, dy, dx)
    n = y.shape[-1]
    y_rows = y.detach().cpu().reshape(-1, n).tolist() if y.numel() else []
    dy_rows = dy.detach().cpu().reshape(-1, n).tolist() if y.numel() else []
    result = [softmax_backward_row(a, b) for a, b in zip(y_rows, dy_rows, strict=True)]
    return torch.tensor(result, dtype=torch.float64).reshape(y.shape)
