"""Tests for layernorm: every implementation, forward and backward, lands within README.md's bound.

Run with `python test.py` (or `nox -s layernorm` from the top). Without a GPU, torch runs on the
CPU, Triton under its interpreter, and the CuTe kernels are compiled for sm_90a and their PTX
read; launching them needs the GPU, and those tests say so when they skip.
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # CuTe builds for the H200 without one

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import reference
import torch_impl
import triton_impl

try:
    from common.tolerance import (
        APPROX_RELATIVE_ERROR,
        assert_same_bits,
        assert_within_bound,
        gamma,
        store_roundoff,
        underflow,
        unit_roundoff,
    )
except ImportError as error:  # the folder was copied on its own, without common/
    raise ImportError(
        "test.py takes its tolerance checks from the course's common/ folder, which is not "
        f"two levels up: copy the course's common/ folder to {HERE.parent.parent / 'common'}"
    ) from error

try:
    import cute_impl
except ImportError as error:  # no CuTe DSL: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"cute_impl cannot be imported ({error})"

# (1) Set-up and the bound model ----------------------------------------------------------------

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
# (M, N): no rows, 1, primes, 2**k +- 1 and the edges of a CuTe tile (2048 float32, 4096
# 16-bit elements); the CuTe forward's maps (cute_impl.forward_map): a warp a row (7, 31), 2
# and 4 warps (3, 4000), (3, 2048) with the last block's second row past M, whole and partial
# tiles, a block's row held (2, 8191) and streamed (2, 8193).
SHAPES = [(0, 5), (1, 1), (2, 3), (7, 31), (3, 128), (5, 129), (2, 1023), (1, 4097), (3, 2048),
          (3, 4000), (2, 8191), (2, 8193)]  # fmt: skip
EPS = 1e-5
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny
# rsqrt.approx.ftz.f32: "maximum relative error 2**-22.9 over the full range" (PTX ISA, rsqrt).
# common/README.md carries the figure and its H200 measurement (transformer/rmsnorm's test).
RSQRT = APPROX_RELATIVE_ERROR["rsqrt.approx.ftz.f32"]


def module(name):
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    return {"reference": reference, "torch": torch_impl, "triton": triton_impl, "cute": cute_impl}[
        name
    ]


def implementation(name):
    """The implementation's module, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return module(name)


def statistics_path(impl, n, dtype):
    """(k, C): k additions on a term's way into each row sum; the variance is taken around
    the mean of the row's first C elements and corrected (C None: torch's plain two-pass)."""
    if impl == "torch":  # any order: up to n additions
        return n, None
    if impl == "torch.nn":  # torch.nn.LayerNorm, ATen's Welford updates: 3 roundings an element
        return 3 * n, None
    return module(impl).statistics_path(n, dtype)


def backward_path(impl, m, n, dtype):
    """(row additions, column additions) on a term's way into a, b and dweight, dbias."""
    return (n, m) if impl == "torch" else module(impl).backward_path(m, n, dtype)


def as_rows(t):
    """t's rows as a float64 CPU (M, N) matrix (reshape(-1, N) is ambiguous for M = 0)."""
    return t.detach().cpu().double().reshape(math.prod(t.shape[:-1]), t.shape[-1])


def statistics_bound(impl, x, eps):
    """README.md's bounds on the computed mean and variance, per row: (e_mu, e_var, var).

    corrected, around a shift K (the float32 mean of the first C elements, within dK of exact):
        e1 = gamma_{k+3} mean|x - K|            |m1_hat - (mean - K)|
        e_mu = e1 + u (|mean| + e1)
        e_var = (1 + u)(gamma_{k+5} (var + D**2) + e1 (2D + e1) + u (D + e1)**2) + u var
    plain two-pass (torch):
        e_mu = gamma_{k+2} mean|x|,  e_var = e_mu**2 + gamma_{k+5} (var + e_mu**2)."""
    n = x.shape[-1]
    k, shift_elems = statistics_path(impl, n, x.dtype)
    rows = as_rows(x)
    mu = rows.mean(dim=-1, keepdim=True)
    var = (rows - mu).square().mean(dim=-1, keepdim=True)
    if shift_elems is None:
        e_mu = gamma(k + 2, U32) * rows.abs().mean(dim=-1, keepdim=True)
        return e_mu, e_mu**2 + gamma(k + 5, U32) * (var + e_mu**2), var
    first = rows[:, : min(shift_elems, n)]
    shift = first.mean(dim=-1, keepdim=True)
    d_shift = gamma(k + 2, U32) * first.abs().mean(dim=-1, keepdim=True)
    d = (mu - shift).abs() + d_shift
    e1 = gamma(k + 3, U32) * ((rows - shift).abs().mean(dim=-1, keepdim=True) + d_shift)
    e_mu = e1 + U32 * (mu.abs() + e1)
    g = gamma(k + 5, U32)
    e_var = (1 + U32) * (g * (var + d**2) + e1 * (2 * d + e1) + U32 * (d + e1) ** 2) + U32 * var
    return e_mu, e_var, var


def forward_bounds(impl, x, weight, eps, exact):
    """README.md's forward bound: (bound on y, on mean, on rstd), elementwise.
        rho = ((1 - e_var / v)(1 - u))**-1/2 (1 + RSQRT) - 1        rstd's relative error
        |y_hat - y| <= u|y| + (1 + u)(|c w| rstd ((1 + g3)(1 + rho) - 1)
                                      + e_mu rstd |w| (1 + g3)(1 + rho)) + 4 tiny
    then the store's rounding u_s |y| + (1 + u_s)(...) + underflow(dtype)."""
    y, _, rstd = exact
    if x.numel() == 0:
        return tuple(torch.zeros(t.shape, dtype=torch.float64) for t in exact)
    e_mu, e_var, var = statistics_bound(impl, x, eps)
    v = var + reference.to_float32(eps)
    rho = ((1 - e_var / v).clamp_min(0) * (1 - U32)) ** -0.5 * (1 + RSQRT) - 1
    rows, r = as_rows(x), 1 / v.sqrt()
    w = torch.ones(x.shape[-1]) if weight is None else weight.detach().cpu().double()
    centred = (rows - rows.mean(dim=-1, keepdim=True)).abs()
    g3 = gamma(3, U32)
    y64 = as_rows(y)
    inner = centred * w.abs() * r * ((1 + g3) * (1 + rho) - 1)
    inner = inner + e_mu * r * w.abs() * (1 + g3) * (1 + rho)
    bound = U32 * y64.abs() + (1 + U32) * inner + 4 * TINY32
    u_s = store_roundoff(x.dtype)
    y_bound = u_s * y64.abs() + (1 + u_s) * bound + underflow(x.dtype)
    shape = x.shape[:-1]
    return y_bound.reshape(y.shape), e_mu.reshape(shape), (rho * r).reshape(shape)


def backward_bounds(impl, x, weight, mean, rstd, dy, exact):
    """README.md's backward bound: (bound on dx, on dweight, on dbias).
        da = gamma_{k+3} mean|g|,  db = gamma_{k+6} mean|g xhat|       (g = w dy)
        |dx_hat - dx| <= u|dx| + (1 + u) rstd (gamma_4 (|g| + |a| + |xhat b|)
                                               + (1 + gamma_4)(da + |xhat| db)) + 4 tiny
        |dw_hat - dw| <= gamma_{c+3} sum|dy xhat|     |db_hat - db| <= gamma_c sum|dy|
    each then rounded to its dtype."""
    dx, dweight, dbias = exact
    m, n = math.prod(x.shape[:-1]), x.shape[-1]
    k, c = backward_path(impl, m, n, x.dtype)
    rows, dy64 = as_rows(x), as_rows(dy)
    mu, r = mean.detach().cpu().double().reshape(-1, 1), rstd.detach().cpu().double().reshape(-1, 1)
    w = torch.ones(n) if weight is None else weight.detach().cpu().double()
    xhat = (rows - mu) * r
    g = dy64 * w
    a, b = g.mean(dim=-1, keepdim=True), (g * xhat).mean(dim=-1, keepdim=True)
    da = gamma(k + 3, U32) * g.abs().mean(dim=-1, keepdim=True)
    db = gamma(k + 6, U32) * (g * xhat).abs().mean(dim=-1, keepdim=True)
    g4 = gamma(4, U32)
    inner = g4 * (g.abs() + a.abs() + (xhat * b).abs()) + (1 + g4) * (da + xhat.abs() * db)
    dx64 = as_rows(dx)
    bound = U32 * dx64.abs() + (1 + U32) * r * inner + 4 * TINY32
    u_s = store_roundoff(x.dtype)
    dx_bound = (u_s * dx64.abs() + (1 + u_s) * bound + underflow(x.dtype)).reshape(dx.shape)
    parameter_dtype = x.dtype if weight is None else weight.dtype
    u_p = store_roundoff(parameter_dtype)

    def column_bound(terms, roundings, total):
        error = gamma(roundings, U32) * terms.abs().sum(dim=0) + m * 4 * TINY32
        return u_p * total.abs() + (1 + u_p) * error + underflow(parameter_dtype)

    dw_bound = None if dweight is None else column_bound(dy64 * xhat, c + 3, dweight)
    return dx_bound, dw_bound, column_bound(dy64, max(c, 1), dbias)


def random_rows(m, n, dtype, scale=1.0, offset=0.0):
    return (offset + scale * torch.randn(m, n, device=DEVICE)).to(dtype)


def parameters(n, kind, dtype):
    """(weight, bias) of a kind: 'affine' (x's dtype), 'float32 affine', 'weight only', 'none'."""
    if kind == "none":
        return None, None
    p_dtype = torch.float32 if kind == "float32 affine" else dtype
    weight = (1 + 0.5 * torch.randn(n, device=DEVICE)).to(p_dtype)
    bias = None if kind == "weight only" else (0.5 * torch.randn(n, device=DEVICE)).to(p_dtype)
    return weight, bias


def fresh_outputs(x):
    return (torch.empty_like(x), *torch_impl.stats_like(x))


def check_forward(impl, x, weight, bias, eps=EPS, outputs=None):
    """Run impl's forward into outputs (fresh if None), hold all three to the bound."""
    outputs = fresh_outputs(x) if outputs is None else outputs
    exact = reference.layernorm_forward(x.cpu(), *cpu(weight, bias), eps)
    got = implementation(impl).layernorm_forward(x, weight, bias, eps, *outputs)
    assert all(a is b for a, b in zip(got, outputs, strict=True))
    bounds = forward_bounds(impl, x, weight, eps, exact)
    for name, value, want, bound in zip(("y", "mean", "rstd"), got, exact, bounds, strict=True):
        assert_within_bound(value, want, bound, f"{impl} forward {name}")
    return got


def check_backward(impl, x, weight, mean, rstd, dy, want_db=True, outputs=None):
    n = x.shape[-1]
    if outputs is None:
        dw = None if weight is None else torch.empty_like(weight)
        db = torch.empty(n, dtype=x.dtype if weight is None else weight.dtype, device=x.device)
        outputs = (torch.empty_like(x), dw, db if want_db else None)
    exact = reference.layernorm_backward(*cpu(x, weight, mean, rstd, dy))
    got = implementation(impl).layernorm_backward(x, weight, mean, rstd, dy, *outputs)
    assert all(a is b for a, b in zip(got, outputs, strict=True))
    bounds = backward_bounds(impl, x, weight, mean, rstd, dy, exact)
    for name, value, want, bound in zip(
        ("dx", "dweight", "dbias"), got, exact, bounds, strict=True
    ):
        if value is not None:
            assert_within_bound(value, want, bound, f"{impl} backward {name}")
    return got


def cpu(*tensors):
    return tuple(None if t is None else t.cpu() for t in tensors)


def forward_then_backward(impl, x, dy, kind="affine", eps=EPS):
    weight, bias = parameters(x.shape[-1], kind, x.dtype)
    _, mean, rstd = check_forward(impl, x, weight, bias, eps)
    return check_backward(impl, x, weight, mean, rstd, dy, want_db=bias is not None)


# (2) The contract over every implementation ---------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n", SHAPES, ids=str)
def test_matches_reference(impl, dtype, m, n):
    forward_then_backward(impl, random_rows(m, n, dtype), random_rows(m, n, dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["float32 affine", "weight only", "none"])
def test_parameter_kinds(impl, dtype, kind):
    """float32 weight and bias over 16-bit x (mixed precision), no bias, no weight at all."""
    forward_then_backward(impl, random_rows(5, 300, dtype), random_rows(5, 300, dtype), kind)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_leading_dims_flatten_to_rows(impl, dtype):
    """A (2, 3, 5, 33) tensor is 30 rows of 33; mean and rstd are (2, 3, 5)."""
    x, dy = (random_rows(30, 33, dtype).view(2, 3, 5, 33) for _ in range(2))
    forward_then_backward(impl, x, dy)


def test_one_dimensional_input():
    """A single row of shape (N,): mean and rstd are 0-dim."""
    forward_then_backward(
        "torch", random_rows(1, 77, torch.float32)[0], random_rows(1, 77, torch.float32)[0]
    )


def strided_operands(kind, dtype, m=5, n=1031):
    """(x, dy) in a layout other than contiguous rows."""
    if kind == "row slice":  # rows of a wider tensor
        return (random_rows(m, n + 13, dtype)[:, 3 : 3 + n] for _ in range(2))
    if kind == "column step":  # every other element of each row
        return (random_rows(m, 2 * n, dtype)[:, ::2] for _ in range(2))
    if kind == "transposed":  # a row is a column of the storage
        return (random_rows(n, m, dtype).t() for _ in range(2))
    if kind == "unmergeable":  # leading dims whose strides do not merge: the copy path
        return (random_rows(6 * m, n, dtype).view(3, 2 * m, n)[:, ::2] for _ in range(2))
    assert kind == "broadcast dy"
    return random_rows(m, n, dtype), random_rows(1, n, dtype).expand(m, n)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "kind", ["row slice", "column step", "transposed", "unmergeable", "broadcast dy"]
)
def test_strided_operands(impl, dtype, kind):
    forward_then_backward(impl, *strided_operands(kind, dtype))


def poisoned_view(m, n, dtype, margin=7):
    """An (m, n) view inside a NaN-filled buffer, rows 2n + 2 margin apart, and its mask."""
    buffer = torch.full((m + 2, 2 * n + 2 * margin), float("nan"), device=DEVICE, dtype=dtype)
    inside = torch.zeros_like(buffer, dtype=torch.bool)
    inside[1 : m + 1, margin : margin + n] = True
    return buffer, buffer[1 : m + 1, margin : margin + n], inside


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 129, 4099])
def test_outputs_inside_guard(impl, dtype, n):
    """y, mean, rstd, dx, dweight and dbias are views into NaN: every element of each view is
    written (within the bound, so not NaN) and nothing outside it changes."""
    m = 3
    x, dy = random_rows(m, n, dtype), random_rows(m, n, dtype)
    weight, bias = parameters(n, "affine", dtype)
    views = {
        "y": poisoned_view(m, n, dtype), "dx": poisoned_view(m, n, dtype),
        "mean": poisoned_view(1, m, torch.float32), "rstd": poisoned_view(1, m, torch.float32),
        "dweight": poisoned_view(1, n, dtype), "dbias": poisoned_view(1, n, dtype),
    }  # fmt: skip
    out = {name: view[1] for name, view in views.items()}
    for name in ("mean", "rstd", "dweight", "dbias"):
        out[name] = out[name][0]
    check_forward(impl, x, weight, bias, outputs=(out["y"], out["mean"], out["rstd"]))
    check_backward(impl, x, weight, out["mean"], out["rstd"], dy,
                   outputs=(out["dx"], out["dweight"], out["dbias"]))  # fmt: skip
    for name, (buffer, _, inside) in views.items():
        assert buffer[~inside].isnan().all(), f"an element outside {name} was written"
        assert not buffer[inside].isnan().any(), f"an element of {name} was not written"


@pytest.mark.parametrize("impl", IMPLS)
def test_in_place(impl):
    """y may be x itself, and dx may be dy: every row is read before it is written."""
    x, dy = random_rows(4, 3001, torch.float32), random_rows(4, 3001, torch.float32)
    weight, bias = parameters(3001, "affine", torch.float32)
    x_before = x.clone()
    exact = reference.layernorm_forward(x.cpu(), *cpu(weight, bias), EPS)
    bounds = forward_bounds(impl, x, weight, EPS, exact)
    y, mean, rstd = implementation(impl).layernorm_forward(
        x, weight, bias, EPS, x, *torch_impl.stats_like(x)
    )
    assert y is x
    assert_within_bound(y, exact[0], bounds[0])
    exact = reference.layernorm_backward(*cpu(x_before, weight, mean, rstd, dy))
    bounds = backward_bounds(impl, x_before, weight, mean, rstd, dy, exact)
    dx, _, _ = implementation(impl).layernorm_backward(
        x_before, weight, mean, rstd, dy, dy, None, None
    )
    assert dx is dy
    assert_within_bound(dx, exact[0], bounds[0])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(impl, dtype):
    """A NaN or an infinity makes its row's rstd and y NaN and leaves the other rows alone
    (its mean is NaN or infinite: inf - inf depends on where the infinity meets the shift);
    a constant row has var = 0 and y = b; rows far from 0 (1e3 + N(0, 1) in float32) keep
    their small variance: it is taken around a shift, not as E[x^2] - mean^2."""
    n = 300
    x = random_rows(5, n, dtype)
    x[0, 17] = float("nan")
    x[1, 200] = float("inf")
    x[2, :] = x[2, 0]
    if dtype == torch.float32:
        x[3, :] = random_rows(1, n, dtype, offset=1e3)
    weight, bias = parameters(n, "affine", dtype)
    exact = reference.layernorm_forward(x.cpu(), *cpu(weight, bias), EPS)
    bounds = forward_bounds(impl, x, weight, EPS, exact)
    y, mean, rstd = implementation(impl).layernorm_forward(x, weight, bias, EPS, *fresh_outputs(x))
    assert_within_bound(y, exact[0], bounds[0])
    assert_within_bound(rstd, exact[2], bounds[2])
    assert_within_bound(mean[2:], exact[1][2:], bounds[1][2:])
    assert not mean[:2].isfinite().any() and y[:2].isnan().all() and rstd[:2].isnan().all()
    check_backward(impl, x[2:], None, mean[2:], rstd[2:], random_rows(3, n, dtype))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeatability(impl, dtype):
    """Two runs give the same bits, dweight and dbias included: every sum is a fixed tree."""
    fns = implementation(impl)
    m, n = 67, 1001
    x, dy = random_rows(m, n, dtype), random_rows(m, n, dtype)
    weight, bias = parameters(n, "affine", dtype)
    first = fns.layernorm_forward(x, weight, bias, EPS, *fresh_outputs(x))
    for a, b in zip(
        first, fns.layernorm_forward(x, weight, bias, EPS, *fresh_outputs(x)), strict=True
    ):
        assert_same_bits(a, b)
    grads = [
        fns.layernorm_backward(
            x,
            weight,
            first[1],
            first[2],
            dy,
            torch.empty_like(x),
            torch.empty_like(weight),
            torch.empty_like(bias),
        )  # fmt: skip
        for _ in range(2)
    ]
    for a, b in zip(*grads, strict=True):
        assert_same_bits(a, b)


def bad_inputs():
    """(direction, operands, expected error, words the message must contain)"""
    f32 = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    x, w, s = f32(3, 4), f32(4), f32(3)
    buffer = f32(4, 20)
    fwd = lambda **kw: {"x": x, "weight": w, "bias": f32(4), "eps": EPS, "y": f32(3, 4),  # noqa: E731
                        "mean": f32(3), "rstd": f32(3), **kw}  # fmt: skip
    yield "forward", fwd(x=[[1.0]]), TypeError, "x must be a torch.Tensor"
    yield "forward", fwd(x=f32(()), y=f32(()), mean=f32(()), rstd=f32(())), ValueError, "0-dim"
    yield (
        "forward",
        fwd(x=f32(3, 0), y=f32(3, 0), weight=None, bias=None),
        ValueError,
        "no elements",
    )
    yield "forward", fwd(y=f32(3, 5)), ValueError, "y has shape"
    yield "forward", fwd(x=x.double(), y=x.double()), TypeError, "supported"
    yield "forward", fwd(y=f32(3, 4).half()), TypeError, "y has dtype"
    yield "forward", fwd(weight=f32(5)), ValueError, "weight has shape"
    yield "forward", fwd(weight=w.double()), TypeError, "weight has dtype"
    yield "forward", fwd(bias=f32(4).half()), TypeError, "bias has dtype"
    yield "forward", fwd(eps=-1.0), ValueError, "eps must be"
    yield "forward", fwd(eps=True), ValueError, "eps must be"
    yield "forward", fwd(mean=f32(3).half()), TypeError, "mean has dtype"
    yield "forward", fwd(rstd=f32(4)), ValueError, "rstd has shape"
    yield "forward", fwd(mean=None), TypeError, "mean must be a torch.Tensor"
    yield "forward", fwd(y=f32(1, 4).expand(3, 4)), ValueError, "one address"
    yield (
        "forward",
        fwd(x=buffer[:, 0:4], y=buffer[:, 2:6], mean=f32(4), rstd=f32(4)),
        ValueError,
        "partially overlaps",
    )
    yield "forward", fwd(mean=s, rstd=s), ValueError, "rstd overlaps mean"
    bwd = lambda **kw: {"x": x, "weight": w, "mean": s, "rstd": f32(3), "dy": f32(3, 4),  # noqa: E731
                        "dx": f32(3, 4), "dweight": f32(4), "dbias": f32(4), **kw}  # fmt: skip
    yield "backward", bwd(dy=f32(3, 4).bfloat16()), TypeError, "dy has dtype"
    yield "backward", bwd(dy=f32(4, 3)), ValueError, "dy has shape"
    yield "backward", bwd(mean=f32(4)), ValueError, "mean has shape"
    yield "backward", bwd(weight=None), ValueError, "dweight was given"
    yield "backward", bwd(dweight=f32(5)), ValueError, "dweight has shape"
    yield "backward", bwd(dx=None), TypeError, "dx must be"
    yield (
        "backward",
        bwd(x=buffer[:, 0:4], dx=buffer[:, 2:6], mean=f32(4), rstd=f32(4), dy=f32(4, 4)),
        ValueError,
        "dx partially",
    )
    if ON_GPU:
        yield "forward", fwd(y=torch.randn(3, 4)), ValueError, "is on cpu"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from reference.check_*, the first thing every implementation calls, so the
    CuTe entry points are checked on the CPU too; the outputs are untouched."""
    direction, operands, error, words = case
    names = ("y", "mean", "rstd") if direction == "forward" else ("dx", "dweight", "dbias")
    before = {n: operands[n].clone() for n in names if isinstance(operands[n], torch.Tensor)}
    with pytest.raises(error, match=words):
        getattr(module(impl), f"layernorm_{direction}")(*operands.values())
    for name, value in before.items():
        assert_same_bits(operands[name], value, f"{name} after a rejected call")


# Negative controls: the bounds reject plausible bugs. Rows of N(0, 0.1**2) with eps = 1e-3
# (eps is 10% of the variance, so dropping it moves rstd by 5%), one element pinned at 0.6.

CONTROL_EPS = 1e-3
CONTROL_IMPL = "torch"  # the loosest bound (any summation order) must still reject them


def control_rows(dtype, m=4, n=1024):
    x = random_rows(m, n, dtype, scale=0.1).cpu()
    x[:, 10] = 0.6
    weight, bias = (t.cpu() for t in parameters(n, "affine", dtype))
    return x, weight, bias


def layernorm64(x, weight, bias, eps, mean=None, var=None):
    """The forward in float64 torch with the statistics replaceable (a wrong one planted)."""
    x64 = x.double()
    mean = x64.mean(dim=-1, keepdim=True) if mean is None else mean
    var = (x64 - mean).square().mean(dim=-1, keepdim=True) if var is None else var
    rstd = 1 / (var + eps).sqrt()
    return (x64 - mean) * rstd * weight.double() + bias.double(), mean[:, 0], rstd[:, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_negative_controls(dtype):
    """eps dropped, one term dropped from the mean's sum, the neighbour row's mean: each lies
    outside the bound on y (and on the float32 statistics it touches); the exact answer
    rounded once lies inside."""
    x, weight, bias = control_rows(dtype)
    exact = reference.layernorm_forward(x, weight, bias, CONTROL_EPS)
    bounds = forward_bounds(CONTROL_IMPL, x, weight, CONTROL_EPS, exact)
    x64 = x.double()
    mean = x64.mean(dim=-1, keepdim=True)
    var = (x64 - mean).square().mean(dim=-1, keepdim=True)
    eps32 = reference.to_float32(CONTROL_EPS)
    wrongs = {  # name: (wrong (y, mean, rstd), the statistic the bug moves: 1 mean, 2 rstd)
        "eps dropped": (layernorm64(x, weight, bias, 0.0, var=var), 2),
        "a term dropped": (
            layernorm64(x, weight, bias, eps32, mean=mean - x64[:, 10:11] / 1024),
            1,
        ),
        "neighbour's mean": (
            layernorm64(x, weight, bias, eps32, mean=mean.roll(1, dims=0), var=var),
            1,
        ),
    }
    for name, (wrong, stat) in wrongs.items():
        for index in (0, stat):
            with pytest.raises(AssertionError, match="outside the bound"):
                value = wrong[index].to(dtype if index == 0 else torch.float32)
                assert_within_bound(value, exact[index], bounds[index], name)
    for value, want, bound in zip(exact, exact, bounds, strict=True):
        assert_within_bound(value.to(dtype if value.dim() == 2 else torch.float32), want, bound)


def test_one_pass_variance_is_rejected():
    """The textbook one-pass variance E[x^2] - mean^2 in float32, on rows 1e3 + N(0, 1), loses
    the variance to cancellation (about u 1e6 absolute): its rstd lies outside the bound."""
    x = random_rows(4, 1024, torch.float32, offset=1e3).cpu()
    exact = reference.layernorm_forward(x, None, None, EPS)
    bounds = forward_bounds(CONTROL_IMPL, x, None, EPS, exact)
    one_pass = x.square().mean(dim=-1) - x.mean(dim=-1).square()
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(torch.rsqrt(one_pass + EPS), exact[2], bounds[2])


def backward_inputs(dtype, m=64, n=1024):
    x, weight, _ = control_rows(dtype, m, n)
    # The planted term g_10 = dy_10 w_10 must be large: with w_10 random (1 + 0.5 z), a weight
    # near 0 let the control that drops it fall inside the bound (about 1 run in 150).
    weight[10] = 1.0
    _, mean, rstd = reference.layernorm_forward(x, weight, None, CONTROL_EPS)
    dy = random_rows(m, n, dtype).cpu()
    dy[:, 10] = 3.0
    return x, weight, mean.float(), rstd.float(), dy


def backward64(x, weight, mean, rstd, dy, drop_term=False, rows_used=None):
    """The backward in float64 torch, with one of the plausible bugs planted."""
    x64, dy64, w = x.double(), dy.double(), weight.double()
    xhat = (x64 - mean.double()[:, None]) * rstd.double()[:, None]
    g = dy64 * w
    a = (g.sum(dim=-1, keepdim=True) - drop_term * g[:, 10:11]) / x.shape[-1]
    b = (g * xhat).mean(dim=-1, keepdim=True)
    dx = rstd.double()[:, None] * (g - a - xhat * b)
    used = slice(0, rows_used)
    return dx, (dy64 * xhat)[used].sum(dim=0), dy64[used].sum(dim=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_negative_controls(dtype):
    """A dx whose mean(w dy) dropped one term or that rebuilt xhat from the neighbour row's
    mean, and a dweight and dbias summed over one row too few, lie outside the bound."""
    x, weight, mean, rstd, dy = backward_inputs(dtype)
    exact = reference.layernorm_backward(x, weight, mean, rstd, dy, None, None, None)
    bounds = backward_bounds(CONTROL_IMPL, x, weight, mean, rstd, dy, exact)
    p_dtype = weight.dtype
    wrong_dx = (backward64(x, weight, mean, rstd, dy, drop_term=True)[0],
                backward64(x, weight, mean.roll(1), rstd, dy)[0])  # fmt: skip
    for wrong in wrong_dx:
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong.to(dtype), exact[0], bounds[0])
    short = backward64(x, weight, mean, rstd, dy, rows_used=x.shape[0] - 1)
    for wrong, want, bound in zip(short[1:], exact[1:], bounds[1:], strict=True):
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong.to(p_dtype), want, bound)
    for value, bound in zip(exact, bounds, strict=True):
        assert_within_bound(value.to(dtype if value.dim() == 2 else p_dtype), value, bound)


def test_reference_backward_matches_autograd():
    """The hand-derived backward (README.md) against float64 torch.autograd of
    F.layer_norm. They differ only by the rounding of mean and rstd to float32 (a relative u
    each), which moves dx_i by at most (first order, doubled for the rest)
        2u (rstd (|g_i - a| + 3 |xhat_i b|) + |mean| rstd**2 (|b| + |xhat_i a|))
    and dweight_j by 2u sum_i |dy_ij| (|xhat_ij| + rstd |mean|); dbias not at all."""
    m, n = 5, 37
    x = (0.5 + torch.randn(m, n, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(n, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(n, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.float64)
    torch.nn.functional.layer_norm(x, (n,), weight, bias, EPS).backward(dy)
    x32, w32, dy32 = x.detach().float(), weight.detach().float(), dy.float()
    _, mean, rstd = reference.layernorm_forward(x32, w32, None, EPS)
    ours = reference.layernorm_backward(x32, w32, mean.float(), rstd.float(), dy32)
    r, mu = rstd[:, None], mean[:, None]
    xhat, g = (x32.double() - mu) * r, dy32.double() * w32.double()
    a, b = g.mean(dim=-1, keepdim=True), (g * xhat).mean(dim=-1, keepdim=True)
    slack_dx = 2 * U32 * (r * ((g - a).abs() + 3 * (xhat * b).abs())
                          + mu.abs() * r**2 * (b.abs() + (xhat * a).abs()))  # fmt: skip
    slack_dw = 2 * U32 * (dy32.double().abs() * (xhat.abs() + r * mu.abs())).sum(dim=0)
    # The float64 inputs were rounded to float32 for ours: compare at the rounded point.
    x_r = x32.double().requires_grad_()
    w_r, b_r = w32.double().requires_grad_(), bias.detach().requires_grad_()
    torch.nn.functional.layer_norm(x_r, (n,), w_r, b_r, EPS).backward(dy32.double())
    assert_within_bound(ours[0], x_r.grad, slack_dx + 1e-15)
    assert_within_bound(ours[1], w_r.grad, slack_dw + 1e-15)
    assert_within_bound(ours[2], b_r.grad, torch.full((n,), 1e-15))


# Autograd, the drop-in module, the custom ops and torch.compile


def entry_point(impl, entry):
    fns = implementation(impl)
    return fns.LayerNormFunction.apply if entry == "LayerNormFunction.apply" else fns.layernorm


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("entry", ["LayerNormFunction.apply", "layernorm"])
@pytest.mark.parametrize("kind", ["affine", "weight only", "none"])
def test_autograd_matches_reference_backward(impl, entry, kind):
    """The autograd.Function and the user-facing layernorm (custom ops with their own autograd
    for Triton and CuTe) give the reference gradients at their own saved statistics, within
    the backward bound."""
    m, n = 3, 257
    x, dy = random_rows(m, n, torch.float32), random_rows(m, n, torch.float32)
    weight, bias = parameters(n, kind, torch.float32)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    entry_point(impl, entry)(*leaves, EPS).backward(dy)
    # The statistics the entry point saved: its forward is deterministic, so a second call
    # of the plain function gives the same bits.
    _, mean, rstd = implementation(impl).layernorm_forward(x, weight, bias, EPS, *fresh_outputs(x))
    exact = reference.layernorm_backward(*cpu(x, weight, mean, rstd, dy))
    bounds = backward_bounds(impl, x, weight, mean, rstd, dy, exact)
    for leaf, want, bound in zip(leaves, exact, bounds, strict=True):
        if leaf is not None:
            assert_within_bound(leaf.grad, want, bound)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [8, (4, 8)], ids=str)
def test_module_is_a_drop_in(impl, shape):
    """LayerNorm has torch.nn.LayerNorm's parameters and state_dict keys, loads its state
    strictly, and computes within the forward bound of its flattened rows."""
    fns = implementation(impl)
    ours, theirs = (
        fns.LayerNorm(shape, eps=EPS).to(DEVICE),
        torch.nn.LayerNorm(shape, eps=EPS).to(DEVICE),
    )
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    for flags in ({"elementwise_affine": False}, {"bias": False}):
        mine, torch_one = fns.LayerNorm(shape, **flags), torch.nn.LayerNorm(shape, **flags)
        assert list(mine.state_dict()) == list(torch_one.state_dict()), flags
    x = torch.randn(2, 3, *((shape,) if isinstance(shape, int) else shape), device=DEVICE)
    n = math.prod((shape,) if isinstance(shape, int) else shape)
    rows, weight = x.reshape(6, n), theirs.weight.detach().reshape(n)
    exact = reference.layernorm_forward(
        rows.cpu(), weight.cpu(), theirs.bias.detach().reshape(n).cpu(), EPS
    )
    bound = forward_bounds(impl, rows, weight, EPS, exact)[0]
    assert_within_bound(ours(x).reshape(6, n), exact[0], bound)


class TinyBlock(torch.nn.Module):
    """A linear layer whose output goes through a layernorm, then another linear layer."""

    def __init__(self, norm):
        super().__init__()
        self.up, self.norm, self.down = torch.nn.Linear(16, 33), norm, torch.nn.Linear(33, 4)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


def mlp(norm):
    """The training check's model: two blocks of Linear -> layernorm -> ReLU, a linear head."""
    return torch.nn.Sequential(
        torch.nn.Linear(32, 32), norm(32), torch.nn.ReLU(),
        torch.nn.Linear(32, 32), norm(32), torch.nn.ReLU(),
        torch.nn.Linear(32, 8),
    ).to(DEVICE)  # fmt: skip


def loss_bound(norm_impl, model, x, target):
    """README.md's bound on |loss_hat - loss| for one forward of the stack ("In training"),
    with norm_impl's forward bound for its layernorms, and the exact loss. Float64 at the
    model's float32 parameters, carrying per element the exact value v and a bound d on the
    computed one's distance from it:
        Linear (K inputs):  d_z = |W| d_h + gamma_{K+1} (|W| (|h| + d_h) + |b|)
        layernorm:          d_y = (1 + 1/16) F + |w| (rstd (d_z + mean d_z)(1 + S) + |xhat| S)
                            T = 2 rstd mean(|xhat| d_z) + rstd**2 mean((d_z + mean d_z)**2),
                            S = (1 - T)**-1/2 - 1,  F its own forward bound (at the exact z)
        ReLU:               d unchanged (1-Lipschitz, exact)
        mean square loss:   mean(2 |o - t| d_o + d_o**2) + gamma_{n+3} mean((|o - t| + d_o)**2)
    The 1 + 1/16 covers F's move from the exact z to the computed one (T < 1/64, asserted).
    Returns ([bound on the batch's loss, on each example's], [the same losses, exact])."""
    h = x.detach().cpu().double()
    d = torch.zeros_like(h)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            w, b = layer.weight.detach().cpu().double(), layer.bias.detach().cpu().double()
            d = d @ w.abs().T + gamma(w.shape[1] + 1, U32) * ((h.abs() + d) @ w.abs().T + b.abs())
            h = h @ w.T + b
        elif isinstance(layer, torch.nn.ReLU):
            h = h.clamp_min(0)
        else:
            weight, bias = layer.weight.detach().cpu(), layer.bias.detach().cpu()
            exact = float64_forward(h, weight, bias, layer.eps)
            own = forward_bounds(norm_impl, h.float(), weight, layer.eps, exact)[0]
            rstd, spread = exact[2][:, None], d + d.mean(-1, keepdim=True)
            xhat = ((h - exact[1][:, None]) * rstd).abs()
            t = 2 * rstd * (xhat * d).mean(-1, keepdim=True) + rstd**2 * spread.square().mean(
                -1, keepdim=True
            )
            assert t.max() < 1 / 64, "F is taken at the exact z: the computed one must be near"
            s = (1 - t) ** -0.5 - 1
            moved = weight.double().abs() * (rstd * spread * (1 + s) + xhat * s)
            h, d = exact[0], (1 + 1 / 16) * own + moved
    miss = (h - target.cpu().double()).abs()
    bounds, losses = [], []
    for dims in ((0, 1), 1):  # the batch's loss, each example's
        n = h.numel() if dims == (0, 1) else h.shape[1]
        losses.append(miss.square().mean(dim=dims))
        bounds.append(
            (2 * miss * d + d**2).mean(dim=dims)
            + gamma(n + 3, U32) * (miss + d).square().mean(dim=dims)
        )
    return bounds, losses


class NeighbourRowLayerNorm(torch.nn.LayerNorm):
    """The negative control's bug: every row normalised with the next row's mean and rstd
    (a row index off by one where the statistics are read)."""

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        rstd = torch.rsqrt((x - mean).square().mean(dim=-1, keepdim=True) + self.eps)
        mean, rstd = mean.roll(-1, dims=0), rstd.roll(-1, dims=0)
        return (x - mean) * rstd * self.weight + self.bias


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_trains_like_torch(impl, compiled):
    """Two blocks of Linear -> LayerNorm -> ReLU and a linear head, 20 SGD steps of a mean
    square loss on synthetic regression data, with our LayerNorm and with torch.nn.LayerNorm
    from one state_dict (loaded strictly: the drop-in's keys), eagerly or under
    torch.compile(fullgraph=True). Every step both start from torch's parameters, so the two
    losses differ by one forward's error at most: README.md's bound ("In training"), ours
    plus torch's, for the batch's loss and for each example's. Negative control: torch's model
    with every row normalised with the next row's statistics gives example losses the bound
    rejects at every step (the batch's loss alone lets such errors cancel)."""
    if compiled and impl == "torch":
        pytest.skip(
            "torch_impl's operand checks (data pointers) do not trace: Triton and CuTe "
            "compile through their custom ops, as in test_torch_compile_fullgraph"
        )
    fns = implementation(impl)
    torch.manual_seed(0)
    theirs = mlp(torch.nn.LayerNorm)
    ours = mlp(fns.LayerNorm)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    wrong = mlp(NeighbourRowLayerNorm)
    mixing = (torch.randn(32, 8) / 32**0.5).to(DEVICE)
    backend = "inductor" if ON_GPU else "aot_eager"
    run = {"ours": ours, "theirs": theirs}
    if compiled:
        run = {k: torch.compile(m, fullgraph=True, backend=backend) for k, m in run.items()}
    step_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    step_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        ours.load_state_dict(theirs.state_dict())  # re-anchored: one step's error, not twenty
        wrong.load_state_dict(theirs.state_dict())
        x = torch.randn(8, 32).to(DEVICE)  # drawn on the CPU: the same data on a GPU
        target = torch.tanh(3 * x @ mixing)
        out = {name: model(x) for name, model in run.items()}
        with torch.no_grad():
            out["wrong"] = wrong(x)
        loss = {name: torch.nn.functional.mse_loss(o, target) for name, o in out.items()}
        each = {name: (o - target).square().mean(dim=1) for name, o in out.items()}
        bound_ours, exact = loss_bound(impl, ours, x, target)
        bound_theirs, _ = loss_bound("torch.nn", theirs, x, target)
        for k, (got, want) in enumerate(((loss, "batch loss"), (each, "example losses"))):
            bound = bound_ours[k] + bound_theirs[k]
            theirs64 = got["theirs"].detach().double()
            assert_within_bound(got["ours"], theirs64, bound, f"{impl} {want}")
            assert_within_bound(got["theirs"], exact[k], bound_theirs[k], f"torch {want}")
        bound = bound_ours[1] + bound_theirs[1]
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(each["wrong"], each["theirs"].detach().double(), bound)
        losses.append(loss["theirs"].item())
        for optimizer, name in ((step_ours, "ours"), (step_theirs, "theirs")):
            optimizer.zero_grad()
            loss[name].backward()
            optimizer.step()
    assert losses[-1] < 0.9 * losses[0], "20 steps should lower the loss"


@pytest.mark.parametrize("impl", ["triton", "cute"])
def test_torch_compile_fullgraph(impl):
    """torch.compile(fullgraph=True) traces a model that calls the custom ops, forward and
    backward, without graph breaks, and computes what the eager model computes. On the CPU
    the aot_eager backend (no code generation) runs the interpreted Triton kernels."""
    fns = implementation(impl)
    torch.manual_seed(0)
    model = TinyBlock(fns.LayerNorm(33)).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = torch.randn(5, 16, device=DEVICE)
    eager_out = model(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled_out = compiled(x)
    compiled_out.square().sum().backward()
    # On the GPU inductor generates its own code for the linear layers around the op (fused
    # epilogues, its own reduction order for their gradients): equal within float32 rounding.
    # On the CPU aot_eager runs the eager kernels: equal bit for bit.
    same = (
        (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5))
        if ON_GPU
        else assert_same_bits
    )
    same(compiled_out.detach(), eager_out.detach())
    for p, eager_grad in zip(model.parameters(), eager_grads, strict=True):
        same(p.grad, eager_grad)


# (3) Triton: the looped kernels, the row groups and the dispatch -----------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [33, 100, 257])
def test_triton_looped_kernels(dtype, n, monkeypatch):
    """With the register limits at 32, chunks of 16 lanes and at most 4 row groups, short rows
    take the looped kernels (the shifted one-pass statistics; the row sums, then a program per
    group and chunk of columns) and several rows share a group: the paths the H200 takes past
    the limits, at sizes the interpreter runs. One row's first chunk sits 50 above the rest: the
    shift is far from the mean there, which the bound's D term covers."""
    monkeypatch.setattr(triton_impl, "ROW_BLOCK_MAX", 32)
    monkeypatch.setattr(triton_impl, "BACKWARD_ROW_BLOCK_MAX", 32)
    monkeypatch.setattr(triton_impl, "CHUNK", 16)
    monkeypatch.setattr(triton_impl, "PARTIALS_MAX", 4)
    x = random_rows(7, n, dtype)
    x[2, :16] += 50
    forward_then_backward("triton", x, random_rows(7, n, dtype))
    assert triton_impl.statistics_path(n, dtype) == (-(-n // 16) - 1 + 4, 16)
    assert triton_impl.backward_path(7, n, dtype)[1] == 2 + 1 + 2  # 4 groups of 2 rows, 4 slices


def test_triton_dispatch():
    """Rows up to ROW_BLOCK_MAX (BACKWARD_ROW_BLOCK_MAX) go to the rows kernels, several short
    rows a program (a step); the backward cuts the rows into at most PARTIALS_MAX groups of
    equal length, each a whole number of steps."""
    forward, backward = triton_impl.ROW_BLOCK_MAX, triton_impl.BACKWARD_ROW_BLOCK_MAX
    assert triton_impl.rows_launch(1000, 1, forward)[:2] == (1024, 1)
    assert triton_impl.rows_launch(3, 100, forward)[0] == 4  # never more rows than m needs
    assert triton_impl.rows_launch(8, 32768, forward) == (1, 32768, 32)
    elems = triton_impl.FORWARD_ELEMS_PER_THREAD  # the forward's warps: 32 elements a thread
    warps = [triton_impl.rows_launch(8, n, forward, elems)[2] for n in (1024, 4096, 8192)]
    assert warps == [4, 4, 8]
    assert triton_impl.rows_launch(8, 32769, forward) is None
    assert triton_impl.rows_launch(8, 8192, backward) == (1, 8192, 16)
    assert triton_impl.rows_launch(8, 8193, backward) is None
    assert triton_impl.row_groups(1, 4096) == (1, 1)
    assert triton_impl.row_groups(512, 4096) == (512, 1)
    assert triton_impl.row_groups(513, 4096) == (257, 2)
    assert triton_impl.row_groups(32768, 4096) == (512, 64)
    assert triton_impl.row_groups(32768, 1024) == (512, 64)  # 32 steps of 2 rows
    assert triton_impl.row_groups(1000, 128) == (63, 16)  # one step of 16 rows each
    assert triton_impl.row_groups(1000, 8193) == (500, 2)  # looped: a row a step
    assert triton_impl.row_groups(32768, 32768) == (512, 64)  # 2 x 64 MiB of partial rows
    assert triton_impl.row_groups(4096, 262144) == (64, 64)  # not 512 groups: 1 GiB
    assert triton_impl.backward_path(32768, 1024, torch.bfloat16) == (10, 1 + 32 + 16 + 5)
    assert [triton_impl.partial_slices(g) for g in (1, 3, 4, 31, 512)] == [1, 4, 4, 32, 32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["affine", "none"])
def test_triton_row_blocks_in_groups(dtype, kind, monkeypatch):
    """With 512-element programs and at most 4 row groups, 37 rows of 100 take the backward
    rows kernel 4 rows a step, 3 steps a group, and the last group's one row leaves a step
    mostly past m: the H200's several steps of ROWS rows a group, at sizes the interpreter
    runs."""
    monkeypatch.setattr(triton_impl, "PROGRAM_ELEMS_MIN", 512)
    monkeypatch.setattr(triton_impl, "PARTIALS_MAX", 4)
    assert triton_impl.rows_launch(37, 100, triton_impl.BACKWARD_ROW_BLOCK_MAX)[:2] == (4, 128)
    assert triton_impl.row_groups(37, 100) == (4, 12)
    assert triton_impl.backward_path(37, 100, dtype) == (7, 3 + 3 + 1 + 2)
    forward_then_backward("triton", random_rows(37, 100, dtype), random_rows(37, 100, dtype), kind)


@pytest.mark.parametrize("kind", ["affine", "weight only"])
def test_triton_partial_slices(kind, monkeypatch):
    """3 row groups summed 2 slices at a time: the second load of the slices runs past the last
    group (masked: it adds 0), and backward_path counts 2 adds a slice and 1 tree level; an
    absent dbias is not written (both planes are summed in one launch)."""
    monkeypatch.setattr(triton_impl, "PROGRAM_ELEMS_MIN", 64)
    monkeypatch.setattr(triton_impl, "PARTIALS_MAX", 3)
    monkeypatch.setattr(triton_impl, "PARTIAL_SLICES", 2)
    assert triton_impl.row_groups(7, 40) == (3, 3)
    assert triton_impl.backward_path(7, 40, torch.float32)[1] == 0 + 3 + 2 + 1
    x, dy = random_rows(7, 40, torch.float32), random_rows(7, 40, torch.float32)
    forward_then_backward("triton", x, dy, kind)


def test_triton_looped_at_real_size():
    """N = 40000 > ROW_BLOCK_MAX at the real constants: 10 chunks of 4096 lanes, both ways."""
    x, dy = random_rows(2, 40000, torch.bfloat16), random_rows(2, 40000, torch.bfloat16)
    forward_then_backward("triton", x, dy)


def launch_cases():
    """Forward and backward calls that change what Triton compiles for, one thing at a time:
    the dtype, n (BLOCK_N), m = 1, a row stride off a multiple of 16, an address off 16 bytes,
    float32 or no parameters, an int eps (passed as float32 like any float), n = 98 after 100
    (the dbias partials, groups x n floats past the dweight ones, lose their 16-byte
    alignment), rows past the register limits (the looped kernels). The stand-ins compute
    nothing."""

    def both(x, kind="affine", eps=EPS):
        weight, bias = parameters(x.shape[-1], kind, x.dtype)
        y, mean, rstd = fresh_outputs(x)
        dy, dx = torch.randn_like(x), torch.empty_like(x)
        dw, db = (
            (None, None) if weight is None else (torch.empty_like(weight), torch.empty_like(bias))
        )
        return lambda: (
            triton_impl.layernorm_forward(x, weight, bias, eps, y, mean, rstd),
            triton_impl.layernorm_backward(x, weight, mean, rstd, dy, dx, dw, db),
        )

    for dtype in DTYPES:
        yield both(random_rows(4, 96, dtype))
    yield both(random_rows(4, 1000, torch.float32))
    yield both(random_rows(1, 96, torch.float32))
    yield both(random_rows(4, 97, torch.float32)[:, :96])
    yield both(torch.randn(4 * 96 + 1, device=DEVICE)[1:].view(4, 96))
    yield both(random_rows(4, 96, torch.bfloat16), "float32 affine")
    yield both(random_rows(4, 96, torch.bfloat16), "none")
    yield both(random_rows(4, 96, torch.float32), eps=1)
    yield both(random_rows(4, 100, torch.bfloat16))
    yield both(random_rows(4, 98, torch.bfloat16))
    yield both(random_rows(2, 40000, torch.bfloat16))


# Each case: a forward, the backward and one sum of both partial planes (none without
# parameters). Some cases change nothing for some kernels (the backwards after the strided and
# the misaligned x see contiguous, aligned dy and dx; the int eps is the float32 case again):
# 29 keys in all (30 while each plane had its own sum launch: n = 98 misaligned the dbias
# plane's start, now an offset the kernel adds to an aligned base).
MIN_SPECIALISATIONS = 29

# --- The launch: Triton's host work done once per specialisation (triton_impl.launch) ---


class CompiledStandIn:
    """Stands in for the CompiledKernel Triton returns for one specialisation: run() records the
    arguments a cached launch hands the GPU."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, kernel, specialised, launches):
        self.kernel, self.specialised, self.launches = kernel, specialised, launches

    def run(self, grid_x, grid_y, grid_z, stream, function, metadata, *hooks_and_args):
        self.launches.append((self, hooks_and_args[3:]))


class KernelStandIn(JITFunction):
    """A JITFunction whose kernel[grid](...) binds the arguments as Triton's sm_90 binder does
    and records them instead of compiling; it returns a CompiledStandIn."""

    def __init__(self, fn, launches):
        super().__init__(fn)
        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binder = create_function_from_signature(self.signature, self.params, backend)
        self.launches = launches

    def __getitem__(self, grid):
        def run(*args, **constants):
            bound, specialised, options = self.binder(*args, **constants)
            self.launches.append((self, tuple(bound.values()), str(specialised) + str(options)))
            return CompiledStandIn(self, str(specialised), self.launches)

        return run


def as_launched(values):
    """Launch arguments as comparable values: a tensor by its dtype, layout and address modulo
    16 (not the address: a scratch buffer is a fresh allocation at each call)."""
    return [
        (v.dtype, v.shape, v.stride(), v.data_ptr() % 16) if torch.is_tensor(v) else v
        for v in values
    ]


def test_triton_launch_once_through_triton_per_specialisation(monkeypatch):
    """Every kernel a stand-in, each case called twice: the second call takes the cached path
    (no kernel[grid]) and hands the launcher exactly the arguments Triton bound in the first;
    no specialisation goes through Triton twice, and every cached launch goes to a kernel
    compiled for the specialisation of its own arguments: a new dtype, alignment, stride class,
    size of 1 or constexpr is never served a stale kernel."""
    launches = []
    for name in dir(triton_impl):
        if name.endswith("_kernel"):
            kernel = getattr(triton_impl, name)
            monkeypatch.setattr(triton_impl, name, KernelStandIn(kernel.fn, launches))
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda _: 7)
    monkeypatch.setattr(triton_impl, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(triton_impl, "COMPILED", {})
    for call in launch_cases():
        start = len(launches)
        call()
        middle = len(launches)
        call()
        first, second = launches[start:middle], launches[middle:]
        assert all(isinstance(launch[0], CompiledStandIn) for launch in second), "went to Triton"
        assert [as_launched(f[1]) for f in first] == [as_launched(s[1]) for s in second]
    through_triton = [(id(launch[0]), launch[2]) for launch in launches if len(launch) == 3]
    assert len(set(through_triton)) == len(through_triton), "Triton compiled a key twice"
    assert len(through_triton) >= MIN_SPECIALISATIONS
    for compiled, args in (launch for launch in launches if len(launch) == 2):
        assert str(compiled.kernel.binder(*args)[1]) == compiled.specialised


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    x, dy = torch.randn(3, 300).to(dtype), torch.randn(3, 300).to(dtype)
    w, b = (1 + 0.5 * torch.randn(300)).to(dtype), (0.5 * torch.randn(300)).to(dtype)
    stats = torch.empty(3), torch.empty(3)
    y, mean, rstd = triton_impl.layernorm_forward(x, w, b, 1e-5, torch.empty_like(x), *stats)
    grads = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    dx, dw, db = triton_impl.layernorm_backward(x, w, mean, rstd, dy, *grads)
    outputs = dict(x=x, w=w, b=b, dy=dy, y=y, mean=mean, rstd=rstd, dx=dx, dw=dw, db=db)
    calls.append({name: (str(t.dtype), t.tolist()) for name, t in outputs.items()})
print(json.dumps(calls))
"""


def fresh_interpreter_calls(script):
    """Run script in a fresh process under TRITON_INTERPRET=1 in this folder (no test.py, no
    common/); returns its printed calls, each a {name: tensor} dict rebuilt with its dtype."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", script], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return [
        {name: torch.tensor(values, dtype=getattr(torch, dtype.removeprefix("torch.")))
         for name, (dtype, values) in call.items()}
        for call in json.loads(child.stdout)
    ]  # fmt: skip


def test_triton_kernels_run_in_a_fresh_interpreter():
    """In a fresh process under TRITON_INTERPRET=1, importing triton_impl alone (its interpreter
    patch included) runs the forward and the backward on CPU tensors, bfloat16 and float32,
    within their bounds: the README's laptop command works."""
    for t in fresh_interpreter_calls(FRESH_CALL):
        x, w, mean, rstd = t["x"], t["w"], t["mean"], t["rstd"]
        exact = reference.layernorm_forward(x, w, t["b"], EPS)
        bounds = forward_bounds("triton", x, w, EPS, exact)
        for name, want, bound in zip(("y", "mean", "rstd"), exact, bounds, strict=True):
            assert_within_bound(t[name], want, bound, f"fresh {name}")
        exact = reference.layernorm_backward(x, w, mean, rstd, t["dy"])
        bounds = backward_bounds("triton", x, w, mean, rstd, t["dy"], exact)
        for name, want, bound in zip(("dx", "dw", "db"), exact, bounds, strict=True):
            assert_within_bound(t[name], want, bound, f"fresh {name}")


# (4) CuTe builds and PTX ---------------------------------------------------------------------


# The CuTe builds: the forward on forward_map's (threads a row, tiles held, whole tiles) (a
# warp's row held, 4 warps' partial tiles, a block streaming), the backward on backward_map's
# (tiles held, whole tiles) (streamed; held with a partial tile; held and staged).
CUTE_BUILDS = [("forward", (32, 2, True)), ("forward", (128, 2, False)),
               ("forward", (256, 0, False)), ("backward", (0, False)), ("backward", (1, False)),
               ("backward", (2, False)), ("backward", (1, True)),
               ("backward", (2, True))]  # fmt: skip


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("direction, shape", CUTE_BUILDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_ptx(direction, shape, dtype):
    """The CuTe kernels build for sm_90a: 128-bit loads and stores on the vector path (none in
    the any-stride build), the warp shuffles of the row sums, and in the forward the
    rsqrt.approx.ftz.f32 README.md's bound counts and the barriers of its map: none for a
    warp's row, the row's own named barrier for 2-4 warps, two block barriers for a block's
    row (the shift, then both shifted sums together: was three)."""
    vector = cute_impl.ptx_of(direction, dtype, True, shape)
    scalar = cute_impl.ptx_of(direction, dtype, False, shape)
    assert "ld.global.v4" in vector and "st.global.v4" in vector
    assert "ld.global.v4" not in scalar
    assert "shfl.sync.bfly" in vector
    if direction == "forward":
        assert "rsqrt.approx.ftz.f32" in vector
        threads = shape[0]
        barriers = re.findall(r"\bbar\.sync\s+[^;]*;|\bbarrier\.sync[^;]*;", vector)
        block_wide = [bool(re.fullmatch(r"bar\.sync\s+0;", bar)) for bar in barriers]
        assert block_wide == [threads == 256] * (0 if threads == 32 else 2), barriers


HEADLINE_FORWARDS = [(torch.bfloat16, 1024), (torch.bfloat16, 4096), (torch.bfloat16, 8192),
                     (torch.float32, 4096)]  # fmt: skip


@pytest.mark.skipif(
    cute_impl is None or shutil.which("ptxas") is None,
    reason="needs the CuTe DSL and ptxas (CUDA toolkit) to count registers",
)
@pytest.mark.parametrize("dtype, n", HEADLINE_FORWARDS, ids=str)
def test_cute_forward_registers(dtype, n, tmp_path):
    """The forward's build at the headline sizes (whole tiles) takes at most 64 registers a
    thread without spills (ptxas -v on its sm_90a PTX): four blocks of 256 threads an SM, the
    occupancy README.md's tuning log counts on (the old kernel took 80: three)."""
    ptx = tmp_path / "forward.ptx"
    ptx.write_text(cute_impl.ptx_of("forward", dtype, True, cute_impl.forward_map(n, dtype)))
    run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                         capture_output=True, text=True)  # fmt: skip
    if "Unsupported .version" in run.stderr:  # the H200 machine's ptxas is older than the DSL
        pytest.skip(f"this ptxas cannot read the CuTe DSL's PTX: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    report = run.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers <= 65536 // (4 * cute_impl.THREADS_PER_BLOCK), report
    assert "0 bytes spill stores" in report, report


@pytest.mark.skipif(
    cute_impl is None or shutil.which("ptxas") is None,
    reason="needs the CuTe DSL and ptxas (CUDA toolkit) to count registers",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cute_backward_stages_rows(dtype, tmp_path):
    """The backward's rows kernel at N = 4096 (whole tiles, vector build) stages rows by
    cp.async and reads each from shared memory twice (for the sums, then for dx), through two
    block barriers a row, and fits 128 registers without spills: two blocks of 256 threads
    an SM, each with STAGES rows in flight (README.md, tuning log)."""
    shape = cute_impl.backward_map(4096, dtype)
    assert shape[1]  # whole tiles
    ptx = cute_impl.ptx_of("backward", dtype, True, shape)
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    loads_per_read = 2 * 4096 * dtype.itemsize // (16 * cute_impl.THREADS_PER_BLOCK)  # x, dy
    assert len(re.findall(r"ld\.shared\.v4", ptx)) == 2 * loads_per_read
    assert len(re.findall(r"\bbar\.sync\s+0;", ptx)) == 2
    (tmp_path / "backward.ptx").write_text(ptx)
    run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(tmp_path / "backward.ptx"), "-o",
                          os.devnull], capture_output=True, text=True)  # fmt: skip
    if "Unsupported .version" in run.stderr:  # the H200 machine's ptxas is older than the DSL
        pytest.skip(f"this ptxas cannot read the CuTe DSL's PTX: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    registers = int(re.search(r"Used (\d+) registers", run.stderr).group(1))
    assert registers <= 65536 // (2 * cute_impl.THREADS_PER_BLOCK), run.stderr
    assert "0 bytes spill stores" in run.stderr, run.stderr


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
def test_cute_mixed_precision_and_sum_build():
    """float32 weight over bfloat16 x builds both ways (two 128-bit weight loads per 16-byte
    run of x), and so does the partial-sum kernel of each dtype."""
    forward_shape = cute_impl.forward_map(4096, torch.bfloat16)
    assert cute_impl.build("forward", torch.bfloat16, torch.float32, True, forward_shape)
    backward_shape = cute_impl.backward_map(4096, torch.bfloat16)  # staged
    assert cute_impl.build("backward", torch.bfloat16, torch.float32, True, backward_shape)
    for dtype in DTYPES:
        assert cute_impl.compile_sum(dtype) is not None


def test_cute_paths_match_the_tile():
    """The counts README.md's bound uses: log2 V + tiles + log2(threads a row) additions on
    forward_map's map, the shift the row's mean when it is held (C = N), else the first 4096
    16-bit elements'; a column's partials add 64 rows, then a slice of 512 / 8 groups, then
    the 8 slices. Rows of up to 8192 elements in every dtype are held in registers."""
    if cute_impl is None:
        pytest.skip(CUTE_MISSING)
    assert cute_impl.statistics_path(4096, torch.bfloat16) == (4 + 2 + 7, 4096)  # 4 warps
    assert cute_impl.statistics_path(4097, torch.float32) == (3 + 3 + 8, 4097)  # held
    assert cute_impl.statistics_path(8193, torch.bfloat16) == (4 + 3 + 8, 4096)  # streamed
    maps = [cute_impl.forward_map(n, dtype) for n, dtype in [
        (1, torch.bfloat16), (1024, torch.bfloat16), (2048, torch.float16), (4000, torch.bfloat16),
        (4096, torch.float32), (8192, torch.bfloat16), (8191, torch.float32),
        (8193, torch.bfloat16)]]  # fmt: skip
    assert maps == [(32, 1, False), (32, 2, True), (64, 2, True), (128, 2, False),
                    (128, 4, True), (256, 2, True), (256, 4, False), (256, 0, False)]  # fmt: skip
    assert cute_impl.backward_path(32768, 8192, torch.bfloat16) == (4 + 2 + 8, 64 + 64 + 8)
    tiles = [cute_impl.row_tiles_of(n, dtype) for n, dtype in [
        (1, torch.bfloat16), (4096, torch.float16), (8192, torch.bfloat16),
        (8193, torch.bfloat16), (8192, torch.float32), (8193, torch.float32)]]  # fmt: skip
    assert tiles == [1, 1, 2, 0, 4, 0]


def cuda_labelled(t):
    """t, a CPU tensor, as a TVM-FFI tensor whose DLPack header says CUDA device 0: a compiled
    CuTe entry checks it (dtype, shape, strides, alignment) as it checks a GPU operand, and
    only the launch after the checks needs the GPU."""
    import ctypes

    import tvm_ffi

    class Relabelled:
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA, device 0

        def __dlpack__(self, *args, **kwargs):
            capsule = torch.utils.dlpack.to_dlpack(t)
            get = ctypes.pythonapi.PyCapsule_GetPointer
            get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
            header = get(capsule, b"dltensor")  # DLTensor: void *data, then the device type
            ctypes.c_int32.from_address(header + ctypes.sizeof(ctypes.c_void_p)).value = 2
            return capsule

    return tvm_ffi.from_dlpack(Relabelled())


@pytest.mark.skipif(cute_impl is None or ON_GPU,
                    reason="CPU only (the CuTe DSL installed): on a GPU the contract tests call "
                    "these builds")  # fmt: skip
@pytest.mark.parametrize("m, n", [(1, 1), (1, 4097), (3, 4097)], ids=str)
def test_cute_backward_entry_takes_the_partials(m, n):
    """The backward's operands as the launcher lays them out pass TVM-FFI's checks and reach
    the launch, which fails here without a driver: a single row of any length takes the vector
    build, whose partial planes must both start on 16-byte boundaries (the second one, at byte
    4 N, once raised 'Misaligned Tensor data' on the H200); so does the sum over the groups."""
    x, dy, dx, w = torch.randn(m, n), torch.randn(m, n), torch.empty(m, n), torch.randn(n)
    groups, rows_per_group = cute_impl.row_groups(m)
    shape = cute_impl.backward_map(n, torch.float32)  # the rows kernel: 1 or 3 tiles
    partials = cute_impl.partial_rows(groups, n, x.device, zeroed=not shape[0])
    vector = all(cute_impl.is_vector_friendly(t) for t in (x, dy, dx, w, partials[0]))
    assert vector == (m == 1)
    kernel = cute_impl.compile_kernel("backward", torch.float32, torch.float32, vector, shape)
    operands = (x, w, torch.zeros(m), torch.ones(m), dy, dx, partials[0], partials[1])
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        kernel(*map(cuda_labelled, operands), rows_per_group, 1.0 / n)
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        cute_impl.compile_sum(torch.float32)(cuda_labelled(partials[1]), cuda_labelled(w))


# (5) GPU only --------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def float64_forward(x, weight, bias, eps):
    """The stand-in for reference.py where Python is too slow: the same formulas in float64."""
    rows = x.double().reshape(-1, x.shape[-1])
    mean = rows.mean(dim=-1, keepdim=True)
    rstd = (
        1 / ((rows - mean).square().mean(dim=-1, keepdim=True) + reference.to_float32(eps)).sqrt()
    )
    y = (rows - mean) * rstd * weight.double() + bias.double()
    return (
        y.cpu().reshape(x.shape),
        mean.cpu().reshape(x.shape[:-1]),
        rstd.cpu().reshape(x.shape[:-1]),
    )


def float64_backward(x, weight, mean, rstd, dy):
    n = x.shape[-1]
    rows, dy64 = x.double().reshape(-1, n), dy.double().reshape(-1, n)
    xhat = (rows - mean.double().reshape(-1, 1)) * rstd.double().reshape(-1, 1)
    g = dy64 * weight.double()
    a, b = g.mean(dim=-1, keepdim=True), (g * xhat).mean(dim=-1, keepdim=True)
    dx = rstd.double().reshape(-1, 1) * (g - a - xhat * b)
    return dx.cpu().reshape(x.shape), (dy64 * xhat).sum(dim=0).cpu(), dy64.sum(dim=0).cpu()


def test_stand_ins_match_reference():
    """The float64 stand-ins agree with reference.py to far below any float32 bound."""
    x, dy = random_rows(3, 1000, torch.float32), random_rows(3, 1000, torch.float32)
    weight, bias = parameters(1000, "affine", torch.float32)
    exact = reference.layernorm_forward(*cpu(x, weight, bias), EPS)
    for ours, want in zip(float64_forward(x, weight, bias, EPS), exact, strict=True):
        assert (ours - want).abs().max() < 1e-12
    mean, rstd = exact[1].float().to(DEVICE), exact[2].float().to(DEVICE)
    exact = reference.layernorm_backward(*cpu(x, weight, mean, rstd, dy))
    for ours, want in zip(float64_backward(x, weight, mean, rstd, dy), exact, strict=True):
        assert (ours - want).abs().max() < 1e-12


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n", [(4096, 1024), (64, 8192), (16, 32000), (8, 65537), (2, 262144)])
def test_large_rows_against_float64(impl, dtype, m, n):
    fns = implementation(impl)
    x, dy = random_rows(m, n, dtype, scale=3.0, offset=1.0), random_rows(m, n, dtype)
    weight, bias = parameters(n, "affine", dtype)
    got = fns.layernorm_forward(x, weight, bias, EPS, *fresh_outputs(x))
    exact = float64_forward(x, weight, bias, EPS)
    bounds = forward_bounds(impl, x, weight, EPS, exact)
    for name, value, want, bound in zip(("y", "mean", "rstd"), got, exact, bounds, strict=True):
        assert_within_bound(value, want, bound, f"{impl} forward {name}")
    _, mean, rstd = got
    outputs = (torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias))
    grads = fns.layernorm_backward(x, weight, mean, rstd, dy, *outputs)
    exact = float64_backward(x, weight, mean, rstd, dy)
    bounds = backward_bounds(impl, x, weight, mean, rstd, dy, exact)
    for name, value, want, bound in zip(
        ("dx", "dweight", "dbias"), grads, exact, bounds, strict=True
    ):
        assert_within_bound(value, want, bound, f"{impl} backward {name}")


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_replays_the_eager_call(impl, dtype):
    """Captured in a CUDA graph, forward and backward replay on fresh data with the bits of an
    eager call: the launchers work on torch's current stream and do nothing a capture misses."""
    fns = implementation(impl)
    m, n = 5, 4099
    x, dy = random_rows(m, n, dtype), random_rows(m, n, dtype)
    weight, bias = parameters(n, "affine", dtype)
    outs, grads = (
        fresh_outputs(x),
        (torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)),
    )

    def step():
        fns.layernorm_forward(x, weight, bias, EPS, *outs)
        fns.layernorm_backward(x, weight, outs[1], outs[2], dy, *grads)

    step()  # compile and load first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(random_rows(m, n, dtype))
    dy.copy_(random_rows(m, n, dtype))
    for t in (*outs, *grads):
        t.fill_(float("nan"))
    graph.replay()
    eager = fns.layernorm_forward(x, weight, bias, EPS, *fresh_outputs(x))
    fresh_grads = (torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias))
    eager_grads = fns.layernorm_backward(x, weight, eager[1], eager[2], dy, *fresh_grads)
    torch.cuda.synchronize()
    for a, b in zip((*outs, *grads), (*eager, *eager_grads), strict=True):
        assert_same_bits(a, b)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
                          *sys.argv[1:]]))  # fmt: skip
