"""SwiGLU, the gated activation of Llama's MLP, forward and backward: the definition.

    s = sigmoid(g) = 1 / (1 + exp(-g))        y = silu(g) * u = g * s * u
    dg = dy * u * s * (1 + g * (1 - s))       du = dy * g * s

elementwise over two (..., N) tensors, the gate g and the up projection u. A model usually
gets them as the two halves of one (..., 2N) tensor, the output of the fused gate-up
projection: g = gu[..., :N], u = gu[..., N:]. Every function takes either form: `u = None`
says that `g` is the fused (..., 2N) tensor, and then the backward's `dg` is its (..., 2N)
gradient (and `du` is None). README.md derives the backward by hand.

This file is the contract: `check_forward` and `check_backward` say which operands are valid
(every implementation calls them before launching anything), `swiglu_forward` and
`swiglu_backward` what the answer is, in plain Python over float64 (float16, bfloat16 and
float32 widen exactly). exp is float64's, within a few units of 2**-53 relative: that error,
times exp's condition number |g|, stays below 1e-11 relative for every |g| the tests use, far
below any float32 bound. 1 - s is computed as sigmoid(-g), without cancellation. NaN and
infinities follow IEEE arithmetic on the formula (README.md, "Special values"). The
functions return new float64 tensors and mutate nothing.
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
    """'none', 'same' (the very same elements in the same order) or 'partial' for a and b with
    their address_range: by range first, then, where the ranges meet, element by element."""
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
    views that move along nested strides, as slices and permutations of one tensor do (dg and du
    as the two halves of one (M, 2N) gradient, or over g and u of the fused gate-up tensor);
    True (refused) where that is not decided here.

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


# The one dtype every operand after g must have, as the tuple _check_tensor takes, built once.
SAME_DTYPE = {dtype: (dtype,) for dtype in SUPPORTED_DTYPES}


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
        raise ValueError(f"{name} is on {t.device} but g is on {device}")


def _check_inputs(g, u):
    """g (and u) valid; returns the shape (..., N) of y."""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"g must be a torch.Tensor, got {type(g).__name__}")
    if g.dim() == 0:
        raise ValueError("g must have a last dimension, got a 0-dim tensor")
    _check_dtype("g", g, SUPPORTED_DTYPES)
    shape = g.shape
    if u is None:
        if shape[-1] % 2:
            raise ValueError(
                f"g without u is the fused gate-up tensor (..., 2N); its last dimension "
                f"{shape[-1]} is odd"
            )
        return (*shape[:-1], shape[-1] // 2)
    _check_tensor("u", u, SAME_DTYPE[g.dtype], shape, g.device)
    return shape


def _check_outputs(inputs, outputs):
    """outputs: ((name, tensor, shape), ...) of g's dtype and device. Each element is read
    before its own output element is written, so an output may be an input itself (in place);
    nothing else may share an element with an output."""
    g = inputs[0][1]
    dtypes, device = SAME_DTYPE[g.dtype], g.device
    for name, t, shape in outputs:
        _check_tensor(name, t, dtypes, shape, device)
    read = [(name, t, address_range(t), True) for name, t in inputs]
    written = [(name, t, address_range(t), False) for name, t, _ in outputs]
    for k, (name, t, span, _) in enumerate(written):
        if elements_collide(t):
            raise ValueError(f"{name}'s strides {t.stride()} give two of its elements one address")
        for other_name, other, other_span, is_input in read + written[k + 1 :]:
            kind = overlap(t, span, other, other_span)
            if kind == "partial" or (kind == "same" and not is_input):
                raise ValueError(f"{name} overlaps {other_name}")


def _present(*named):
    return tuple((name, t) for name, t in named if t is not None)


def check_forward(g, u, y=None):
    """Raise TypeError/ValueError, naming the operand, for anything swiglu_forward refuses
    (y None: the inputs only)."""
    shape = _check_inputs(g, u)
    if y is not None:
        _check_outputs(_present(("g", g), ("u", u)), (("y", y, shape),))


def check_backward(g, u, dy, dg=None, du=None):
    """The same for swiglu_backward (dg and du None: the inputs only). With u None, dg has
    g's fused shape (..., 2N) and du must be None."""
    shape = _check_inputs(g, u)
    _check_tensor("dy", dy, (g.dtype,), shape, g.device)
    if u is None and du is not None:
        raise ValueError("du must be None when g is the fused gate-up tensor (dg holds both)")
    outputs = () if dg is None else (("dg", dg, g.shape),)
    outputs += () if du is None else (("du", du, shape),)
    _check_outputs(_present(("g", g), ("u", u), ("dy", dy)), outputs)


def halves(gu):
    """The gate and up halves of a fused (..., 2N) tensor, as views."""
    n = gu.shape[-1] // 2
    return gu[..., :n], gu[..., n:]


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


def sigmoid(v):
    """1 / (1 + exp(-v)), with exp's argument never positive (no overflow); NaN stays NaN."""
    if v >= 0:
        return 1 / (1 + math.exp(-v))
    e = math.exp(v)  # v < 0, or NaN: then e and the result are NaN
    return e / (1 + e)


def _values(t):
    return t.detach().cpu().double().flatten().tolist()


def _tensor(values, shape):
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


def swiglu_forward(g, u, y=None):
    """y = g * sigmoid(g) * u as a new float64 tensor (y, if given, is only checked)."""
    check_forward(g, u, y)
    gate, up = halves(g) if u is None else (g, u)
    out = [v * sigmoid(v) * w for v, w in zip(_values(gate), _values(up), strict=True)]
    return _tensor(out, gate.shape)


def swiglu_backward(g, u, dy, dg=None, du=None):
    """(dg, du) as new float64 tensors; with u None, (dgu, None): dgu = cat(dg, du) on the
    last dimension, the gradient of the fused tensor."""
    check_backward(g, u, dy, dg, du)
    gate, up = halves(g) if u is None else (g, u)
    dgs, dus = [], []
    for v, w, d in zip(_values(gate), _values(up), _values(dy), strict=True):
        s, one_minus_s = sigmoid(v), sigmoid(-v)
        dgs.append(d * w * s * (1 + v * one_minus_s))
        dus.append(d * v * s)
    dg_exact, du_exact = _tensor(dgs, gate.shape), _tensor(dus, gate.shape)
    if u is None:
        return torch.cat((dg_exact, du_exact), dim=-1), None
    return dg_exact, du_exact
