"""Rotary position embedding (RoPE) of q and k, forward and backward: the definition.

Every head vector x (length D, even) of the token at position p is cut into D/2 pairs, and
pair i is turned by the angle theta_i(p):

    y_a = x_a cos(theta) - x_b sin(theta)        y_b = x_b cos(theta) + x_a sin(theta)

with the pair (a, b) = (i, i + D/2) in the rotate-half convention (Llama) or (2i, 2i + 1) in
the interleaved one (GPT-J). The backward is the rotation by -theta: a rotation's transpose
is its inverse, so dx = R(-theta) dy (README.md, "The definition").

The angles come either from a table, cos[p, i] and sin[p, i] given (shape (P, D/2), or
(P, D) with repeating halves as Hugging Face builds it, read through its first half for
rotate-half and its even columns for interleaved; both float32, or both q's dtype), or
from frequencies: theta_i(p) = p * inv_freq[i], inv_freq a float32 vector
(`inverse_frequencies`: base 10000 or 500000, Llama 3's scaling optional). Positions are
position_ids[b, s] (shape (B, S), (1, S) or (S,)) or s when None; a table row outside
[0, P) gives NaN for its token (never a read out of bounds), and a computed angle takes the
position rounded to float32.

q has shape (B, S, H, D) and k (B, S, Hk, D) (any Hk: grouped-query attention), any strides;
layout="bhsd" takes both as (B, H, S, D). This file is the contract: `check_rope` says which
operands are valid (every implementation calls it before launching), `rope_forward` and
`rope_backward` what the answer is, in float64: a float16, bfloat16 or float32 value and a
float32 cos, sin or inv_freq widen exactly, p * inv_freq (24 by 24 bits) is exact in float64,
and each output is x_a c - x_b s with its two products exact and one rounding in float64.
They return new float64 tensors and mutate nothing.
"""

import functools
import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("bshd", "bhsd")


def inverse_frequencies(head_dim, base=10000.0, llama3_scaling=None):
    """inv_freq[i] = base**(-2i / D), i < D/2, in float64 and rounded once to float32.

    llama3_scaling = dict(factor, low_freq_factor, high_freq_factor, original_max_position):
    Llama 3.1's long-context rule. Wavelengths 2 pi / inv_freq longer than original_max /
    low_freq_factor are slowed by `factor`, those shorter than original_max / high_freq_factor
    are kept, and in between the frequency blends the two linearly in original_max / wavelength."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be even and positive, got {head_dim}")
    freqs = [base ** (-2 * i / head_dim) for i in range(head_dim // 2)]
    if llama3_scaling is not None:
        s = llama3_scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        context = s["original_max_position"]
        scaled = []
        for f in freqs:
            wavelength = 2 * math.pi / f
            if wavelength > context / low:
                f = f / factor
            elif wavelength >= context / high:
                blend = (context / wavelength - low) / (high - low)
                f = (1 - blend) * f / factor + blend * f
            scaled.append(f)
        freqs = scaled
    return torch.tensor(freqs, dtype=torch.float64).float()


# --- Operand checks ---------------------------------------------------------------------------


def address_range(t):
    """[first byte, one past the last byte] of t's elements (torch strides are never negative)."""
    if t.numel() == 0:
        return None
    if t.is_contiguous():  # the common case, without a Python loop over the dimensions
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


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
    views that move along nested strides, as slices and permutations of one tensor do (q, k and
    v cut from one fused qkv projection, by heads or by a (3, H) split); True (refused) where
    that is not decided here.

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


def _check_tensor(name, t, dtypes, shape, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d)[6:] for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected {names}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def canonical(t, layout):
    """t as a (B, S, H, D) view over its own memory (layout 'bhsd' swaps the middle two)."""
    return t if layout == "bshd" else t.transpose(1, 2)


def check_rope(q, k, q_out=None, k_out=None, *, cos=None, sin=None, inv_freq=None,
               position_ids=None, layout="bshd"):  # fmt: skip
    """Raise TypeError/ValueError, naming the operand, for anything rope_forward or
    rope_backward refuses (q_out and k_out None: the inputs only). q_out may be q itself and
    k_out k itself (in place); nothing else may share an element with an output."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_tensor("q", q, SUPPORTED_DTYPES, None, None)
    if q.dim() != 4:
        raise ValueError(f"q must have 4 dimensions ({layout.upper()}), got shape {tuple(q.shape)}")
    batch, seq, _, head_dim = canonical(q, layout).shape
    if head_dim % 2:
        raise ValueError(f"q's head dimension must be even (pairs are rotated), got {head_dim}")
    _check_tensor("k", k, (q.dtype,), None, q.device)
    k_shape = canonical(k, layout).shape if k.dim() == 4 else None
    if k_shape is None or (k_shape[0], k_shape[1], k_shape[3]) != (batch, seq, head_dim):
        raise ValueError(
            f"k has shape {tuple(k.shape)}; expected q's batch, sequence and head dimensions "
            f"({layout.upper()}) with any number of heads"
        )
    if (cos is None) != (sin is None) or (cos is None) == (inv_freq is None):
        raise ValueError("give the angles as cos and sin together, or as inv_freq (one of them)")
    if cos is not None:
        for name, table in (("cos", cos), ("sin", sin)):
            _check_tensor(name, table, (torch.float32, q.dtype), None, q.device)
            if table.dim() != 2 or table.shape[1] not in (head_dim // 2, head_dim):
                raise ValueError(
                    f"{name} has shape {tuple(table.shape)}; expected (positions, "
                    f"{head_dim // 2}) or (positions, {head_dim})"
                )
        if cos.shape[0] == 0:
            raise ValueError("cos and sin have no rows: the table must hold at least one position")
        if cos.shape != sin.shape:
            raise ValueError(f"sin has shape {tuple(sin.shape)}; expected cos's {tuple(cos.shape)}")
        _check_tensor("sin", sin, (cos.dtype,), None, None)  # one table type, as CuTe builds for
    else:
        _check_tensor("inv_freq", inv_freq, (torch.float32,), (head_dim // 2,), q.device)
    if position_ids is not None:
        _check_tensor("position_ids", position_ids, (torch.int32, torch.int64), None, q.device)
        if tuple(position_ids.shape) not in ((batch, seq), (1, seq), (seq,)):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}; expected ({batch}, {seq}), "
                f"(1, {seq}) or ({seq},)"
            )
    outputs = [(n, t, like) for n, t, like in (("q_out", q_out, q), ("k_out", k_out, k))
               if t is not None]  # fmt: skip
    for name, out, like in outputs:
        _check_tensor(name, out, (q.dtype,), like.shape, q.device)
        if elements_collide(out):
            raise ValueError(f"{name}'s strides {out.stride()} give two elements one address")
    # Each operand's address range once, then every output against every other operand.
    read = [(n, t, address_range(t)) for n, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin),
            ("inv_freq", inv_freq), ("position_ids", position_ids)) if t is not None]  # fmt: skip
    written = [(name, out, address_range(out)) for name, out, _ in outputs]
    for j, (name, out, span) in enumerate(written):
        for other_name, other, other_span in read + written[j + 1 :]:
            kind = overlap(out, span, other, other_span)
            if kind != "none" and not (kind == "same" and other_name == name[:-4]):
                raise ValueError(
                    f"{name} overlaps {other_name}: they share elements (an output may be its "
                    "own input, in place, or interleave with other operands, never share with them)"
                )


# --- The definition ---------------------------------------------------------------------------


def pair_halves(x, interleaved):
    """(x_a, x_b): the first and second members of each pair along the last dimension."""
    return (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)


def join_halves(a, b, interleaved):
    return torch.stack((a, b), dim=-1).flatten(-2) if interleaved else torch.cat((a, b), dim=-1)


def table_half(table, half, interleaved):
    """The (P, D/2) table of one value per pair: a (P, D) table's first half or even columns."""
    if table.shape[1] == half:
        return table
    return table[:, 0::2] if interleaved else table[:, :half]


def positions_of(position_ids, batch, seq):
    """The (B, S) positions as int64 (s when position_ids is None)."""
    if position_ids is None:
        return torch.arange(seq).expand(batch, seq)
    return position_ids.detach().cpu().long().expand(batch, seq)


def angles(half, batch, seq, cos, sin, inv_freq, position_ids, interleaved):
    """(cos, sin) of every token's angles, float64 of shape (B, S, 1, D/2): a table's values
    (NaN rows for positions outside it), or the exact cos and sin of p * inv_freq."""
    positions = positions_of(position_ids, batch, seq)
    if cos is None:
        p = positions.float().double()  # the position as float32, then exact in float64
        theta = p[..., None] * inv_freq.detach().cpu().double()  # exact: 24 by 24 bits
        return theta.cos()[:, :, None], theta.sin()[:, :, None]
    inside = (positions >= 0) & (positions < cos.shape[0])
    index = positions.clamp(0, cos.shape[0] - 1)
    out = []
    for table in (cos, sin):
        values = table_half(table.detach().cpu().double(), half, interleaved)
        picked = values[index].masked_fill(~inside[..., None], math.nan)
        out.append(picked[:, :, None])
    return tuple(out)


def rotate(x, c, s, interleaved):
    """R(theta) x pair by pair, x of shape (B, S, H, D) in float64."""
    x_a, x_b = pair_halves(x, interleaved)
    return join_halves(x_a * c - x_b * s, x_b * c + x_a * s, interleaved)


def rope(q, k, cos, sin, inv_freq, position_ids, interleaved, layout, direction):
    batch, seq, _, head_dim = canonical(q, layout).shape
    c, s = angles(head_dim // 2, batch, seq, cos, sin, inv_freq, position_ids, interleaved)
    out = []
    for x in (q, k):
        x64 = canonical(x.detach().cpu().double(), layout)
        out.append(canonical(rotate(x64, c, direction * s, interleaved), layout))
    return tuple(out)


def rope_forward(q, k, q_out=None, k_out=None, *, cos=None, sin=None, inv_freq=None,
                 position_ids=None, interleaved=False, layout="bshd"):  # fmt: skip
    """(R(theta) q, R(theta) k) as new float64 tensors (q_out and k_out are only checked)."""
    check_rope(q, k, q_out, k_out, cos=cos, sin=sin, inv_freq=inv_freq,
               position_ids=position_ids, layout=layout)  # fmt: skip
    return rope(q, k, cos, sin, inv_freq, position_ids, interleaved, layout, 1.0)


def rope_backward(dq, dk, dq_out=None, dk_out=None, *, cos=None, sin=None, inv_freq=None,
                  position_ids=None, interleaved=False, layout="bshd"):  # fmt: skip
    """(R(-theta) dq, R(-theta) dk): the gradients of q and k, as new float64 tensors."""
    check_rope(dq, dk, dq_out, dk_out, cos=cos, sin=sin, inv_freq=inv_freq,
               position_ids=position_ids, layout=layout)  # fmt: skip
    return rope(dq, dk, cos, sin, inv_freq, position_ids, interleaved, layout, -1.0)
