"""layernorm over the last dimension, forward and backward: the definition.

    mean = (1/N) sum_j x_j            var = (1/N) sum_j (x_j - mean)**2      (biased)
    rstd = 1 / sqrt(var + eps)        xhat_i = (x_i - mean) rstd
    y_i  = xhat_i w_i + b_i

    dx_i = rstd (g_i - mean_j(g_j) - xhat_i mean_j(g_j xhat_j)),     g_i = w_i dy_i
    dw_i = sum over rows of dy_i xhat_i                                db_i = sum over rows of dy_i

for every row of an (..., N) tensor; the leading dimensions flatten to M rows, and mean and rstd
have the shape of those leading dimensions. README.md derives the backward by hand. Without a
weight w = 1, without a bias b = 0 (torch.nn.LayerNorm's elementwise_affine=False and
bias=False). eps is rounded to float32 first, as every kernel receives it.

The backward is the gradient at the statistics the forward saved (float32 mean and rstd), the
way every implementation computes it: xhat is rebuilt from x, mean and rstd.

Special values follow IEEE arithmetic applied to the formulas: a NaN or an infinity in a row
makes its rstd and y NaN (var holds inf - inf), its mean NaN or infinite (the kernels may meet
inf - inf there too); eps = 0 with a constant row gives rstd = inf and y = NaN.

This file is the contract: `check_forward` and `check_backward` say which operands are valid
(every implementation calls them before launching anything), `layernorm_forward` and
`layernorm_backward` what the answer is, in plain Python over Python floats (16-bit and float32
values widen exactly to float64; `math.fsum` rounds each sum once). They return new float64
tensors and mutate nothing.
"""

import math
import numbers

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


def _check_tensor(name, t, shape, dtypes, device):
    """t is a tensor of this shape, one of these dtypes, on this device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d)[6:] for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected {names}")
    if t.shape != shape:  # a torch.Size equals the tuple of its sizes
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def _check_x(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have a last dimension to normalise over, got a 0-dim tensor")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported: float32, float16, bfloat16")
    if x.shape[-1] == 0:
        raise ValueError("x's last dimension is 0: the mean of no elements is undefined")


# The dtypes of each operand, built once: float32 parameters may scale 16-bit activations.
SAME_DTYPE = {dtype: (dtype,) for dtype in SUPPORTED_DTYPES}
PARAMETER_DTYPES = {dtype: (dtype, torch.float32) for dtype in SUPPORTED_DTYPES}
FLOAT32 = (torch.float32,)


def _check_parameters(x, named):
    """weight, bias and their gradients: None, or (N,) in x's dtype or float32 (the mixed
    precision torch.nn.LayerNorm accepts: float32 parameters over 16-bit activations)."""
    shape, dtypes, device = (x.shape[-1],), PARAMETER_DTYPES[x.dtype], x.device
    for name, t in named:
        if t is not None:
            _check_tensor(name, t, shape, dtypes, device)


def _with_ranges(named):
    """(name, tensor, address range) of each operand given (None: not given)."""
    return [(name, t, address_range(t)) for name, t in named if t is not None]


def _check_outputs(inputs, outputs):
    """No output has two elements at one address, shares memory with another output, or
    partially overlaps an input (an output may be an input itself: in place)."""
    inputs, outputs = _with_ranges(inputs), _with_ranges(outputs)
    for i, (name, t, span) in enumerate(outputs):
        if elements_collide(t):
            raise ValueError(f"{name}'s strides {t.stride()} give two of its elements one address")
        for other_name, other, other_span in outputs[:i]:
            if overlap(t, span, other, other_span) != "none":
                raise ValueError(f"{name} overlaps {other_name}: two outputs share memory")
        for other_name, other, other_span in inputs:
            if overlap(t, span, other, other_span) == "partial":
                raise ValueError(f"{name} partially overlaps {other_name}")


def _require(named):
    for name, t in named:
        if t is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")


def check_forward(x, weight, bias, eps, y, mean, rstd, outputs_optional=False):
    """Raise TypeError/ValueError, naming the operand, for anything layernorm_forward refuses
    (outputs_optional: y, mean and rstd may be None, as the reference allows)."""
    if not outputs_optional:
        _require((("y", y), ("mean", mean), ("rstd", rstd)))
    _check_x(x)
    _check_parameters(x, (("weight", weight), ("bias", bias)))
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"bias has dtype {bias.dtype} but weight has {weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps must be a real number >= 0, got {eps!r}")
    shape, device = x.shape, x.device
    if y is not None:
        _check_tensor("y", y, shape, SAME_DTYPE[x.dtype], device)
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t is not None:
            _check_tensor(name, t, shape[:-1], FLOAT32, device)
    _check_outputs(
        (("x", x), ("weight", weight), ("bias", bias)), (("y", y), ("mean", mean), ("rstd", rstd))
    )


def check_backward(x, weight, mean, rstd, dy, dx, dweight, dbias, outputs_optional=False):
    """The same for layernorm_backward (dweight and dbias None: not computed; dweight only
    with a weight)."""
    if not outputs_optional:
        _require((("dx", dx),))
    _check_x(x)
    _check_parameters(x, (("weight", weight), ("dweight", dweight), ("dbias", dbias)))
    shape, like_x, device = x.shape, SAME_DTYPE[x.dtype], x.device
    for name, t in (("mean", mean), ("rstd", rstd)):
        _check_tensor(name, t, shape[:-1], FLOAT32, device)
    _check_tensor("dy", dy, shape, like_x, device)
    if dx is not None:
        _check_tensor("dx", dx, shape, like_x, device)
    if dweight is not None and weight is None:
        raise ValueError(
            "dweight was given but weight is None: there is no weight to differentiate"
        )
    _check_outputs(
        (("x", x), ("weight", weight), ("mean", mean), ("rstd", rstd), ("dy", dy)),
        (("dx", dx), ("dweight", dweight), ("dbias", dbias)),
    )


def as_rows(t, for_output=False):
    """(rows, copied): t as an (M, N) matrix over its own memory when its leading dimensions
    merge into one row stride, else a fresh contiguous matrix: a copy of t's values for an
    input, an uninitialised one for an output (copied = True: the caller copies back)."""
    n = t.shape[-1]
    try:
        return t.view(-1, n), False
    except RuntimeError:  # the leading dimensions' strides do not merge
        if for_output:
            return torch.empty(t.numel() // n, n, dtype=t.dtype, device=t.device), True
        return t.reshape(-1, n), True


def as_vector(t, for_output=False):
    """(vector, copied): a statistic of shape (...) as an (M,) vector, in the same way."""
    try:
        return t.view(-1), False
    except RuntimeError:
        if for_output:
            return torch.empty(t.numel(), dtype=t.dtype, device=t.device), True
        return t.reshape(-1), True


def to_float32(v):
    """A Python float rounded to float32, as a kernel receives it."""
    return torch.tensor(v, dtype=torch.float32).item()


def exact_sum(terms):
    """The correctly rounded sum; fsum refuses infinities and NaN, where IEEE addition is exact."""
    if all(math.isfinite(t) for t in terms):
        return math.fsum(terms)
    return sum(terms)


def inverse_sqrt(v):
    """1 / sqrt(v) with IEEE's limits: 1/sqrt(0) = inf, NaN stays NaN."""
    if math.isnan(v):
        return math.nan
    return math.inf if v == 0 else 1 / math.sqrt(v)


def layernorm_row(row, weight, bias, eps):
    """(y, mean, rstd) of one row, weight and bias lists of its length."""
    n = len(row)
    mean = exact_sum(row) / n
    var = exact_sum([(v - mean) ** 2 for v in row]) / n
    rstd = inverse_sqrt(var + eps)
    y = [(v - mean) * rstd * w + b for v, w, b in zip(row, weight, bias, strict=True)]
    return y, mean, rstd


def layernorm_backward_row(row, weight, mean, rstd, dy_row):
    """(dx, the row's dw terms dy*xhat) of one row."""
    n = len(row)
    xhat = [(v - mean) * rstd for v in row]
    g = [w * d for w, d in zip(weight, dy_row, strict=True)]
    a = exact_sum(g) / n
    b = exact_sum([gi * hi for gi, hi in zip(g, xhat, strict=True)]) / n
    dx = [rstd * (gi - a - hi * b) for gi, hi in zip(g, xhat, strict=True)]
    return dx, [d * hi for d, hi in zip(dy_row, xhat, strict=True)]


def _rows(t):
    return t.detach().cpu().reshape(-1, t.shape[-1]).tolist() if t.numel() else []


def _parameter(t, n, default):
    return [float(default)] * n if t is None else t.detach().cpu().tolist()


def _column_sums(rows, n):
    return torch.tensor(
        [exact_sum([row[j] for row in rows]) for j in range(n)], dtype=torch.float64
    )


def layernorm_forward(x, weight, bias, eps, y=None, mean=None, rstd=None):
    """(y, mean, rstd) exactly, new float64 tensors (y of x's shape, mean and rstd of its
    leading shape); the outputs, if given, are only checked: the reference never writes."""
    check_forward(x, weight, bias, eps, y, mean, rstd, outputs_optional=True)
    n, eps32 = x.shape[-1], to_float32(eps)
    w, b = _parameter(weight, n, 1.0), _parameter(bias, n, 0.0)
    rows = [layernorm_row(row, w, b, eps32) for row in _rows(x)]
    y_out = torch.tensor([r[0] for r in rows], dtype=torch.float64).reshape(x.shape)
    stats = torch.tensor([[r[1], r[2]] for r in rows], dtype=torch.float64).reshape(-1, 2)
    return y_out, stats[:, 0].reshape(x.shape[:-1]), stats[:, 1].reshape(x.shape[:-1])


def layernorm_backward(x, weight, mean, rstd, dy, dx=None, dweight=None, dbias=None):
    """(dx, dweight, dbias) exactly, new float64 tensors; dweight is None without a weight."""
    check_backward(x, weight, mean, rstd, dy, dx, dweight, dbias, outputs_optional=True)
    n = x.shape[-1]
    w = _parameter(weight, n, 1.0)
    means, rstds = (
        mean.detach().cpu().reshape(-1).tolist(),
        rstd.detach().cpu().reshape(-1).tolist(),
    )
    dy_rows = _rows(dy)
    rows = [
        layernorm_backward_row(row, w, mu, r, d)
        for row, mu, r, d in zip(_rows(x), means, rstds, dy_rows, strict=True)
    ]
    dx_out = torch.tensor([r[0] for r in rows], dtype=torch.float64).reshape(x.shape)
    dweight_out = _column_sums([r[1] for r in rows], n) if weight is not None else None
    return dx_out, dweight_out, _column_sums(dy_rows, n)
