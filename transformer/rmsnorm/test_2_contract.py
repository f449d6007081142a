"""RMSNorm tests, section (2): the contract over every implementation (training: test_2_training).
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import math

import pytest
import torch
from test import (
    DEVICE,
    DTYPES,
    EPS,
    IMPLS,
    ON_GPU,
    SHAPES,
    U32,
    backward_bounds,
    check_backward,
    check_forward,
    forward_bounds,
    forward_outputs,
    forward_then_backward,
    implementation,
    module,
    random_rows,
    random_weight,
)

import reference
from common.tolerance import assert_same_bits, assert_within_bound

# (2) The contract over every implementation ---------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n", SHAPES, ids=str)
def test_matches_reference(impl, dtype, m, n):
    x, dy = random_rows(m, n, dtype), random_rows(m, n, dtype)
    forward_then_backward(impl, x, random_weight(n, dtype), dy)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n", [(1, 1), (7, 31), (3, 2048), (2, 4099)], ids=str)
def test_fused_residual(impl, dtype, m, n):
    """h = x + residual is stored bit for bit as the reference rounds it, y normalises h, and
    the backward adds the stream's gradient: dx (= dresidual) within the fused bound."""
    x, residual, dy, dh = (random_rows(m, n, dtype) for _ in range(4))
    forward_then_backward(impl, x, random_weight(n, dtype), dy, residual, dh)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float32_weight(impl, dtype):
    """A float32 weight with 16-bit x (torch.nn.RMSNorm's default parameter): y keeps x's
    dtype, dweight the weight's."""
    x, dy = random_rows(5, 1000, dtype), random_rows(5, 1000, dtype)
    forward_then_backward(impl, x, random_weight(1000, torch.float32), dy)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_leading_dims_flatten_to_rows(impl, dtype):
    """A (2, 3, 5, 33) tensor is 30 rows of 33; rstd has shape (2, 3, 5)."""
    x, dy = (random_rows(30, 33, dtype).view(2, 3, 5, 33) for _ in range(2))
    forward_then_backward(impl, x, random_weight(33, dtype), dy)


def strided_operands(kind, dtype, m=5, n=1031):
    """(x, dy, weight) in a layout other than contiguous rows."""
    weight = random_weight(n, dtype)
    if kind == "row slice":  # rows of a wider tensor
        return (*(random_rows(m, n + 13, dtype)[:, 3 : 3 + n] for _ in range(2)), weight)
    if kind == "column step":  # every other element of each row, and of the weight
        return (
            *(random_rows(m, 2 * n, dtype)[:, ::2] for _ in range(2)),
            random_weight(2 * n, dtype)[::2],
        )
    if kind == "transposed":  # a row is a column of the storage
        return (*(random_rows(n, m, dtype).t() for _ in range(2)), weight)
    if kind == "unmergeable":  # leading dims whose strides do not merge: the copy path
        return (*(random_rows(6 * m, n, dtype).view(3, 2 * m, n)[:, :m] for _ in range(2)), weight)
    assert kind == "broadcast dy"
    return random_rows(m, n, dtype), random_rows(1, n, dtype).expand(m, n), weight


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "kind", ["row slice", "column step", "transposed", "unmergeable", "broadcast dy"]
)
def test_strided_operands(impl, dtype, kind):
    x, dy, weight = strided_operands(kind, dtype)
    forward_then_backward(impl, x, weight, dy)


def poisoned_view(shape, dtype, margin=7):
    """A view of `shape` inside a NaN-filled buffer (rows 2n + 2 margin apart for 2-D), and
    the mask of the buffer's elements outside the view."""
    if len(shape) == 1:
        buffer = torch.full((shape[0] + 2 * margin,), float("nan"), device=DEVICE, dtype=dtype)
        view = buffer[margin : margin + shape[0]]
    else:
        m, n = shape
        buffer = torch.full((m + 2, 2 * n + 2 * margin), float("nan"), device=DEVICE, dtype=dtype)
        view = buffer[1 : m + 1, margin : margin + n]
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[(slice(margin, margin + shape[0]),) if len(shape) == 1 else
            (slice(1, shape[0] + 1), slice(margin, margin + shape[1]))] = False  # fmt: skip
    return buffer, view, outside


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 129, 4099])
def test_outputs_inside_guard(impl, dtype, n):
    """y, rstd, residual_out, dx and dweight are views into NaN: every element of each view is
    written (within the bound, so not NaN) and nothing outside it changes."""
    m = 3
    x, residual, dy = (random_rows(m, n, dtype) for _ in range(3))
    weight = random_weight(n, dtype)
    guards = [poisoned_view((m, n), dtype) for _ in range(2)] + [
        poisoned_view((m,), torch.float32),
        poisoned_view((m, n), dtype),
        poisoned_view((n,), dtype),
    ]
    y, residual_out, rstd, dx, dweight = (view for _, view, _ in guards)
    check_forward(impl, x, weight, residual=residual, outputs=(y, rstd, residual_out))
    check_backward(impl, residual_out, weight, rstd, dy, None, dx, dweight)
    for buffer, view, outside in guards:
        assert buffer[outside].isnan().all(), "an element outside an output was written"
        assert not view.isnan().any()


@pytest.mark.parametrize("impl", IMPLS)
def test_in_place(impl):
    """y may be x itself, residual_out the residual (the stream updated in place), and dx may
    be dy: every element is read before it is written."""
    fns, n = implementation(impl), 3001
    x, residual = random_rows(4, n, torch.float32), random_rows(4, n, torch.float32)
    weight = random_weight(n, torch.float32)
    exact_y, exact_rstd, exact_h = reference.rmsnorm_forward(
        x.cpu(), weight.cpu(), EPS, residual=residual.cpu(), residual_out=residual.cpu()
    )
    rstd = x.new_empty(4)
    y, _, h = fns.rmsnorm_forward(x, weight, EPS, x, rstd, residual, residual)
    assert y is x and h is residual
    assert_same_bits(h.cpu(), exact_h.float())
    y_bound, _ = forward_bounds(impl, h, weight, EPS, exact_y, exact_rstd)
    assert_within_bound(y, exact_y, y_bound)
    dy = random_rows(4, n, torch.float32)
    exact_dx, exact_dw = reference.rmsnorm_backward(h.cpu(), weight.cpu(), rstd.cpu(), dy.cpu())
    dx_bound, _ = backward_bounds(impl, h, weight, rstd, dy, exact_dx, exact_dw)
    dx, _ = fns.rmsnorm_backward(h, weight, rstd, dy, dy, torch.empty_like(weight))
    assert dx is dy
    assert_within_bound(dx, exact_dx, dx_bound)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(impl, dtype):
    """As the formula says under IEEE arithmetic, and torch's composite rms_norm (the CPU's)
    agrees: a NaN makes its row NaN; an inf gives rstd 0 and the row 0 but NaN at the inf; a
    zero row with eps = 0 has rstd inf and y NaN; 1e4-sized values (squares 1e8) do not
    overflow. (On CUDA torch's kernel takes float64 moments by Welford's update, where an inf
    meets inf - inf: the whole row NaN; README.md, "Special values".)"""
    n = 300
    x = random_rows(5, n, dtype)
    x[0, 17] = float("nan")
    x[1, 30] = float("inf")
    x[2, :] = 0.0
    x[3, :] = (1e4 * torch.randn(n, device=DEVICE)).to(dtype)
    weight = random_weight(n, dtype)
    y, rstd = check_forward(impl, x, weight, eps=0.0)
    torch_y = torch.nn.functional.rms_norm(x.cpu().double(), (n,), weight.cpu().double(), eps=0.0)
    assert torch.equal(y.isnan().cpu(), torch_y.isnan().cpu())
    assert rstd[2].item() == math.inf and rstd[1].item() == 0.0 and rstd[0].isnan()
    assert y[3:].isfinite().all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeatability(impl, dtype):
    """Two runs give the same bits: every sum, dweight's over the rows included, is a fixed
    tree."""
    fns = implementation(impl)
    x, dy = random_rows(67, 1003, dtype), random_rows(67, 1003, dtype)
    weight = random_weight(1003, dtype)
    runs = [fns.rmsnorm_forward(x, weight, EPS, *forward_outputs(x)) for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert_same_bits(a, b)
    grads = [
        fns.rmsnorm_backward(
            x, weight, runs[0][1], dy, torch.empty_like(x), torch.empty_like(weight)
        )
        for _ in range(2)
    ]
    for a, b in zip(*grads, strict=True):
        assert_same_bits(a, b)


def bad_inputs():
    """(direction, operands, expected error, words the message must contain)"""
    f32 = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    x, w, r = f32(3, 4), f32(4), f32(3)
    buffer = f32(4, 20)
    fwd, bwd = "forward", "backward"
    yield fwd, ([[1.0]], w, EPS, f32(1, 1), r), TypeError, "x must be a torch.Tensor"
    yield fwd, (f32(()), w, EPS, f32(()), r), ValueError, "0-dim"
    yield fwd, (x, f32(5), EPS, f32(3, 4), r), ValueError, "weight has shape"
    yield fwd, (x, w.half(), EPS, f32(3, 4), r), TypeError, "weight has dtype"
    yield fwd, (x, w, "1e-6", f32(3, 4), r), TypeError, "eps must be a float"
    yield fwd, (x, w, -1.0, f32(3, 4), r), ValueError, "eps must be finite"
    yield fwd, (x, w, EPS, f32(3, 5), r), ValueError, "y has shape"
    yield fwd, (x.double(), w, EPS, f32(3, 4), r), TypeError, "x has dtype"
    yield fwd, (x, w, EPS, f32(3, 4).half(), r), TypeError, "y has dtype"
    yield fwd, (x, w, EPS, f32(3, 4), r.half()), TypeError, "rstd has dtype"
    yield fwd, (x, w, EPS, f32(3, 4), f32(4)), ValueError, "rstd has shape"
    yield fwd, (x, w, EPS, f32(1, 4).expand(3, 4), r), ValueError, "one address"
    yield fwd, (buffer[:3, :10], f32(10), EPS, buffer[:3, 5:15], r), ValueError, "y overlaps x"
    yield fwd, (x, w, EPS, f32(3, 4), r, f32(3, 4)), ValueError, "together"
    yield bwd, (x, w, r, x.bfloat16(), f32(3, 4), f32(4)), TypeError, "dy has dtype"
    yield bwd, (x, w, r, f32(4, 3), f32(3, 4), f32(4)), ValueError, "dy has shape"
    yield bwd, (x, w, r, f32(3, 4), f32(3, 4), w), ValueError, "dweight overlaps weight"
    yield bwd, (x, w, r, f32(3, 4), f32(3, 4), w.half()), TypeError, "dweight has dtype"
    if ON_GPU:
        yield fwd, (x, w, EPS, torch.randn(3, 4), r), ValueError, "is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from reference.check_*, the first thing every implementation calls, so the
    CuTe entry points are checked on the CPU too; the outputs are untouched."""
    direction, operands, error, words = case
    tensors = [t for t in operands[3:] if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    with pytest.raises(error, match=words):
        getattr(module(impl), f"rmsnorm_{direction}")(*operands)
    for t, b in zip(tensors, before, strict=True):
        assert_same_bits(t, b, "an output after a rejected call")


# Negative controls: the bounds reject plausible bugs.


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_negative_controls(impl, dtype):
    """A y whose rstd dropped eps (rows with mean(x**2) near eps), or dropped one term of the
    sum (a pinned x_j = 8 among ~N(0, 1)), lies outside the bound; the exact y rounded once
    lies inside."""
    n, eps = 1024, 1e-4
    x = random_rows(4, n, dtype).cpu()
    x[:2] *= 0.01  # mean(x**2) = 1e-4 = eps: dropping eps moves rstd by sqrt(2)
    x[2:, 10] = 8.0
    weight = random_weight(n, dtype).cpu()
    exact_y, exact_rstd = reference.rmsnorm_forward(x, weight, eps)
    y_bound, _ = forward_bounds(impl, x, weight, eps, exact_y, exact_rstd)
    x64, w64 = x.double(), weight.double()
    squares = x64.square()
    no_eps = x64 * w64 * squares.mean(-1, keepdim=True).rsqrt()
    dropped = x64 * w64 * ((squares.sum(-1, keepdim=True) - squares[:, 10:11]) / n + eps).rsqrt()
    for wrong, rows_hit in ((no_eps, slice(0, 2)), (dropped, slice(2, 4))):
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong[rows_hit].to(dtype), exact_y[rows_hit], y_bound[rows_hit])
    assert_within_bound(exact_y.to(dtype), exact_y, y_bound)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_negative_controls(impl, dtype):
    """A dweight summed over one row too few, or a dx whose mean(g xhat) dropped one (large)
    term, lies outside the bound; the exact answers rounded once lie inside."""
    m, n = 64, 512
    x, dy = random_rows(m, n, dtype).cpu(), random_rows(m, n, dtype).cpu()
    x[:, 10], dy[:, 10] = 8.0, 4.0
    weight = random_weight(n, dtype).cpu()
    _, rstd = reference.rmsnorm_forward(x, weight, EPS)
    rstd = rstd.float()
    exact_dx, exact_dw = reference.rmsnorm_backward(x, weight, rstd, dy)
    dx_bound, dw_bound = backward_bounds(impl, x, weight, rstd, dy, exact_dx, exact_dw)
    r = rstd.double()[:, None]
    xhat, g = x.double() * r, dy.double() * weight.double()
    short_dw = (dy.double() * xhat)[:-1].sum(dim=0)
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(short_dw.to(weight.dtype), exact_dw, dw_bound)
    dropped = ((g * xhat).sum(-1, keepdim=True) - g[:, 10:11] * xhat[:, 10:11]) / n
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound((r * (g - xhat * dropped)).to(dtype), exact_dx, dx_bound)
    assert_within_bound(exact_dx.to(dtype), exact_dx, dx_bound)
    assert_within_bound(exact_dw.to(weight.dtype), exact_dw, dw_bound)


def test_reference_backward_matches_autograd():
    """The hand-derived backward (README.md) against float64 torch.autograd of the definition,
    residual fused (h = x + residual with residual = 0, so h is exactly float32): they differ
    only by rstd's rounding to float32 (the reference is given the float32 rstd), a relative
    change of at most u, which moves dx by at most 3u r (|g| + |xhat| mean|g xhat|) and
    dweight by u sum|dy xhat|."""
    m, n, eps = 5, 37, reference.to_float32(1e-3)
    h32, dy32, dh32 = torch.randn(m, n), torch.randn(m, n), torch.randn(m, n)
    weight32 = torch.randn(n)
    x, weight = h32.double().requires_grad_(), weight32.double().requires_grad_()
    residual = torch.zeros(m, n, dtype=torch.float64, requires_grad=True)
    h = x + residual
    y = torch.nn.functional.rms_norm(h, (n,), weight, eps=eps)
    torch.autograd.backward((y, h), (dy32.double(), dh32.double()))
    rstd = torch.rsqrt(h32.double().square().mean(-1) + eps).float()
    dx, dw = reference.rmsnorm_backward(h32, weight32, rstd, dy32, dresidual_out=dh32)
    r, dy64 = rstd.double()[:, None], dy32.double()
    g, xhat = dy64 * weight32.double(), h32.double() * r
    slack = 3 * U32 * r * (g.abs() + xhat.abs() * (g * xhat).abs().mean(-1, keepdim=True))
    assert_within_bound(dx, x.grad, slack + 1e-14)
    assert_within_bound(dx, residual.grad, slack + 1e-14)
    assert_within_bound(dw, weight.grad, U32 * (dy64 * xhat).abs().sum(0) + 1e-14)
