"""RMSNorm over the last dimension, forward and backward: the definition.

    rstd = 1 / sqrt(mean_j x_j**2 + eps)          y_i = x_i * rstd * w_i
    dx_i = rstd (g_i - xhat_i * mean_j g_j xhat_j),   g_i = dy_i w_i,  xhat_i = x_i rstd
    dw_i = sum over rows of dy_i xhat_i

for every row of an (..., N) tensor (the leading dimensions flatten to M rows); README.md
derives the backward by hand. With a residual fused in front (Llama's pre-norm block), the
forward first forms the residual stream h = x + residual, stores it rounded to x's dtype (the
tensor the next block reads), and normalises that stored h; the backward is then given h as
`x` and the gradient of the stream, dresidual_out, which it adds to dx: the gradient of both
x and residual is dx = d(norm)/dh + dresidual_out.

eps is rounded to float32 before anything else (the kernels take it as a float32 scalar), so
that rounding is part of the definition. rstd is a float32 output, saved for the backward; the
backward takes it as given (like softmax's backward takes y), so `rmsnorm_backward` is the
exact backward at the saved statistic.

This file is the contract: `check_forward` and `check_backward` say which operands are valid
(every implementation calls them before launching anything), `rmsnorm_forward` and
`rmsnorm_backward` what the answer is, in plain Python over Python floats: float16, bfloat16
and float32 values widen exactly to float64, a square or a product of two of them is exact
there, and `math.fsum` rounds each sum once. They return new float64 tensors, mutate nothing.
"""

import math
import struct

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def to_float32(value):
    """value rounded to the nearest float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


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
    """'none', 'same' (the very same elements in the same order) or 'partial', by address:
    a and b with their address_range."""
    if range_a is None or range_b is None or range_a[1] <= range_b[0] or range_b[1] <= range_a[0]:
        return "none"
    same_layout = a.shape == b.shape and all(
        a.stride(d) == b.stride(d) for d in range(a.dim()) if a.shape[d] > 1
    )
    return "same" if range_a[0] == range_b[0] and same_layout else "partial"


def elements_collide(t):
    """True unless t's elements have distinct addresses by the simple test: sorted by stride,
    each dimension's stride steps past everything the smaller ones span (conservative)."""
    if t.is_contiguous():
        return False
    span = 0
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size > 1:
            if stride <= span:
                return True
            span += (size - 1) * stride
    return False


# The dtypes of each operand, built once: float32 weights may scale 16-bit activations.
SAME_DTYPE = {dtype: (dtype,) for dtype in SUPPORTED_DTYPES}
WEIGHT_DTYPES = {dtype: (dtype,) if dtype == torch.float32 else (dtype, torch.float32)
                 for dtype in SUPPORTED_DTYPES}  # fmt: skip
FLOAT32 = (torch.float32,)
# The inputs an output of x's shape may be itself (in place): each element is read before the
# same element is written.
IN_PLACE_INPUTS = ("x", "residual", "dy", "dresidual_out")


def _check_dtype(name, t, dtypes):
    if t.dtype not in dtypes:
        names = " or ".join(str(d)[6:] for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected {names}")


def _check_tensor(name, t, dtypes, shape, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_dtype(name, t, dtypes)
    if t.shape != shape:  # a torch.Size equals the tuple of its sizes
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def _check_x(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have a last dimension to normalise over, got a 0-dim tensor")
    _check_dtype("x", x, SUPPORTED_DTYPES)


def _check_operands(x, weight, inputs, outputs):
    """x (checked first) sets shape, dtype and device. inputs and outputs: ((name, tensor,
    dtypes, shape), ...) after x. An output of x's shape may be an input of x's shape itself
    (in place); nothing else may share an address with an output."""
    device = x.device
    _check_tensor("weight", weight, WEIGHT_DTYPES[x.dtype], (x.shape[-1],), device)
    for name, t, dtypes, shape in inputs + outputs:
        _check_tensor(name, t, dtypes, shape, device)
    read = [("x", x, address_range(x)), ("weight", weight, address_range(weight))]
    read += [(name, t, address_range(t)) for name, t, *_ in inputs]
    written = [(name, t, address_range(t)) for name, t, *_ in outputs]
    for k, (name, t, span) in enumerate(written):
        if elements_collide(t):
            raise ValueError(f"{name}'s strides {t.stride()} give two of its elements one address")
        for other_name, other, other_span in read + written[k + 1 :]:
            kind = overlap(t, span, other, other_span)
            in_place = kind == "same" and other_name in IN_PLACE_INPUTS
            if kind != "none" and not in_place:
                raise ValueError(f"{name} overlaps {other_name}")


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, int | float):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def check_forward(x, weight, eps, y=None, rstd=None, residual=None, residual_out=None):
    """Raise TypeError/ValueError, naming the operand, for anything rmsnorm_forward refuses
    (y and rstd None: the inputs only). residual and residual_out come together."""
    _check_x(x)
    _check_eps(eps)
    if (residual is None) != (residual_out is None):
        raise ValueError("residual and residual_out must be given together (or neither)")
    shape, like_x = x.shape, SAME_DTYPE[x.dtype]
    inputs = () if residual is None else (("residual", residual, like_x, shape),)
    outputs = () if y is None else (("y", y, like_x, shape),)
    if residual_out is not None:
        outputs += (("residual_out", residual_out, like_x, shape),)
    if rstd is not None:
        outputs += (("rstd", rstd, FLOAT32, shape[:-1]),)
    _check_operands(x, weight, inputs, outputs)


def check_backward(x, weight, rstd, dy, dx=None, dweight=None, dresidual_out=None):
    """The same for rmsnorm_backward (dx and dweight None: the inputs only)."""
    _check_x(x)
    shape, like_x = x.shape, SAME_DTYPE[x.dtype]
    inputs = (("rstd", rstd, FLOAT32, shape[:-1]),)
    if dy is not None:
        inputs += (("dy", dy, like_x, shape),)
    if dresidual_out is not None:
        inputs += (("dresidual_out", dresidual_out, like_x, shape),)
    outputs = () if dx is None else (("dx", dx, like_x, shape),)
    if dweight is not None and isinstance(weight, torch.Tensor):
        outputs += (("dweight", dweight, (weight.dtype,), weight.shape),)
    _check_operands(x, weight, inputs, outputs)


def as_rows(t, for_output=False):
    """(rows, copied): t as an (M, N) matrix over its own memory when its leading dimensions
    merge into one row stride, else a fresh contiguous matrix: a copy of t's values for an
    input, an uninitialised one for an output (copied = True: the caller copies it back)."""
    n = t.shape[-1]
    try:
        return t.view(-1, n), False
    except RuntimeError:  # the leading dimensions' strides do not merge
        if for_output:
            return torch.empty(t.numel() // n, n, dtype=t.dtype, device=t.device), True
        return t.reshape(-1, n), True


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def rstd_of(row, eps32):
    """1 / sqrt(mean(row**2) + eps): inf for a zero row with eps = 0, NaN if the row has one."""
    mean_square = exact_sum([v * v for v in row]) / len(row)
    if mean_square + eps32 == 0:
        return math.inf
    return 1 / math.sqrt(mean_square + eps32)  # sqrt(inf) = inf gives rstd 0; NaN stays NaN


def rows_of(t):
    return t.detach().cpu().double().reshape(-1, t.shape[-1]).tolist() if t.numel() else []


def stored_stream(x, residual):
    """h = x + residual, rounded once to x's dtype: the residual stream the next block reads."""
    return (x.detach().cpu().double() + residual.detach().cpu().double()).to(x.dtype)


def rmsnorm_forward(x, weight, eps, y=None, rstd=None, residual=None, residual_out=None):
    """(y, rstd), or (y, rstd, residual_out) with a residual: new float64 tensors (y, rstd and
    residual_out, if given, are only checked: the reference never writes)."""
    check_forward(x, weight, eps, y, rstd, residual, residual_out)
    h = x if residual is None else stored_stream(x, residual)
    eps32, w = to_float32(eps), weight.detach().cpu().double().tolist()
    stds, outs = [], []
    for row in rows_of(h):
        r = rstd_of(row, eps32)
        stds.append(r)
        outs.append([v * r * w_i for v, w_i in zip(row, w, strict=True)])
    y_exact = torch.tensor(outs, dtype=torch.float64).reshape(x.shape)
    rstd_exact = torch.tensor(stds, dtype=torch.float64).reshape(x.shape[:-1])
    if residual is None:
        return y_exact, rstd_exact
    return y_exact, rstd_exact, h.double()


def rmsnorm_backward_row(x_row, w, r, dy_row):
    """dx of one row: r (g_i - xhat_i * mean_j g_j xhat_j), and the row's dy_i xhat_i."""
    xhat = [v * r for v in x_row]
    g = [d * w_i for d, w_i in zip(dy_row, w, strict=True)]
    mean_dot = exact_sum([g_j * xh_j for g_j, xh_j in zip(g, xhat, strict=True)]) / len(x_row)
    dx = [r * (g_i - xh_i * mean_dot) for g_i, xh_i in zip(g, xhat, strict=True)]
    return dx, [d * xh for d, xh in zip(dy_row, xhat, strict=True)]


def rmsnorm_backward(x, weight, rstd, dy, dx=None, dweight=None, dresidual_out=None):
    """(dx, dweight) as new float64 tensors; x is what the forward normalised (its h when a
    residual was fused), and dresidual_out, if given, is added to dx."""
    check_backward(x, weight, rstd, dy, dx, dweight, dresidual_out)
    n, w = x.shape[-1], weight.detach().cpu().double().tolist()
    stds = rstd.detach().cpu().double().reshape(-1).tolist()
    dx_rows, dw_terms = [], [[] for _ in range(n)]
    for x_row, r, dy_row in zip(rows_of(x), stds, rows_of(dy), strict=True):
        dx_row, terms = rmsnorm_backward_row(x_row, w, r, dy_row)
        dx_rows.append(dx_row)
        for column, term in zip(dw_terms, terms, strict=True):
            column.append(term)
    dx_exact = torch.tensor(dx_rows, dtype=torch.float64).reshape(x.shape)
    if dresidual_out is not None:
        dx_exact = dx_exact + dresidual_out.detach().cpu().double()
    dweight_exact = torch.tensor([exact_sum(column) for column in dw_terms], dtype=torch.float64)
    return dx_exact, dweight_exact
