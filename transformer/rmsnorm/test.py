"""Tests for RMSNorm: every implementation, forward and backward, lands within README.md's bound.

Run with `python test.py` (or `nox -s rmsnorm` from the top). Without a GPU, torch runs on the
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
# (M, N): no rows, 1, primes, 2**k +- 1 and block edges; the CuTe forward's maps
# (cute_impl.forward_map): a warp a row (7, 31), 2 and 4 warps (3, 2048), (3, 4000), (3, 4096)
# with the last block's second row past M, whole and partial tiles, a block's row (1, 4097),
# (2, 8191), (2, 8192) (streamed rows, N > 8192: the GPU-only sizes); the backward's
# whole-tile builds (3, 4096), (2, 8192), which stage rows in shared memory.
SHAPES = [
    (0, 5),
    (1, 1),
    (2, 3),
    (7, 31),
    (3, 128),
    (5, 129),
    (2, 1023),
    (1, 4097),
    (3, 2048),
    (3, 4000),
    (3, 4096),
    (2, 8191),
    (2, 8192),
]
EPS = 1e-6
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny  # .ftz flushes results below it to 0
RSQRT = APPROX_RELATIVE_ERROR["rsqrt.approx.ftz.f32"]
# torch.rsqrt: CUDA's rsqrtf is within 2 ulp (CUDA math API), 5u by common/README.md's argument
# for ex2; on the CPU 1/sqrt rounds twice, well inside that.
TORCH_RSQRT = 5 * U32


def module(name):
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return cute_impl if name == "cute" else modules[name]


def implementation(name):
    """The implementation's module, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return module(name)


def paths(impl, m, n, dtype):
    """(forward, backward, dweight) roundings of README.md's bound: on a square's way into
    mean(h**2), on a product's way into mean(g * xhat), on a term's way into dweight. torch
    sums in an undocumented order: what holds for every order, plus two for each mean."""
    if impl == "torch":
        return n + 2, n + 2, max(m - 1, 0)
    fns = module(impl)
    return fns.forward_path(n, dtype), fns.backward_path(n, dtype), fns.dweight_path(m, n, dtype)


def rows(t):
    """t's rows as a float64 CPU (M, N) matrix (reshape(-1, N) is ambiguous for N = 0)."""
    return t.detach().cpu().double().reshape(math.prod(t.shape[:-1]), t.shape[-1])


def forward_bounds(impl, h, weight, eps, exact_y, exact_rstd):
    """README.md's forward bounds (y, rstd) from the exact results, h the normalised input:

    a = S/N + eps, S = sum h_j**2;  K roundings on a square's way into mean(h**2)
    g = (u a + (1 + u)(gamma_K S + (1 + gamma_K) n tiny) / N) / a     (a_hat's error)
    rho = (1 - g)**-1/2 (1 + R) - 1                               (rstd's relative error)
    |y_hat - y| <= ((1 + rho)(1 + u)**2 - 1) |y| + (2 + |w|) tiny, then the store."""
    m, n = math.prod(h.shape[:-1]), h.shape[-1]
    if h.numel() == 0:
        return torch.zeros(exact_y.shape, dtype=torch.float64), exact_rstd.abs()
    k = paths(impl, m, n, h.dtype)[0] + (1 if h.dtype == torch.float32 else 0)  # the square
    h64, w = rows(h), weight.detach().cpu().double()
    s = h64.square().sum(dim=-1, keepdim=True)
    a = s / n + reference.to_float32(eps)
    g = (U32 * a + (1 + U32) * (gamma(k, U32) * s + (1 + gamma(k, U32)) * n * TINY32) / n) / a
    g = g.nan_to_num(0.0, 0.0)  # rows with inf or NaN (or 0 / 0): y is 0 or not finite there
    rho = (1 - g) ** -0.5 * (1 + (TORCH_RSQRT if impl == "torch" else RSQRT)) - 1
    y = rows(exact_y)
    bound = ((1 + rho) * (1 + U32) ** 2 - 1) * y.abs() + (2 + w.abs()) * TINY32
    u_s = store_roundoff(h.dtype)
    y_bound = u_s * y.abs() + (1 + u_s) * bound + underflow(h.dtype)
    return y_bound.reshape(exact_y.shape), (rho.squeeze(-1) * rows(exact_rstd[..., None])[:, 0])


def backward_bounds(impl, x, weight, rstd, dy, exact_dx, exact_dweight, dresidual_out=None):
    """README.md's backward bounds (dx, dweight), r = rstd and xhat = x r taken as exact:

    c = sum g_j xhat_j, C = sum |g_j xhat_j|; K = the backward path + 3 (x r, dy w, product)
    E = gamma_K C / N + n tiny                                  (mean(g xhat)'s error)
    |dx_hat - dx| <= gamma_2 |dx| + (1 + gamma_2) r (u |g| + gamma_3 |xhat c| / N
                     + (1 + gamma_3) |xhat| E) + tiny terms, dx the norm's part; fused, the
                     sum's rounding: u |dx + dresidual_out| + (1 + u)(that)
    |dw_hat - dw| <= gamma_(P + 2) sum_rows |dy xhat| + m tiny, then the stores."""
    m, n = math.prod(x.shape[:-1]), x.shape[-1]
    forward_k, backward_k, dweight_k = paths(impl, m, n, x.dtype)
    x64, dy64, w = rows(x), rows(dy), weight.detach().cpu().double()
    r = rstd.detach().cpu().double().reshape(-1, 1)
    xhat, g = x64 * r, dy64 * w
    c = (g * xhat).sum(dim=-1, keepdim=True)
    mean_error = (
        gamma(backward_k + 3, U32) * (g * xhat).abs().sum(dim=-1, keepdim=True) / max(n, 1)
        + n * TINY32
    )
    dx = rows(exact_dx)
    dx_norm = dx if dresidual_out is None else dx - rows(dresidual_out)
    g2, g3 = gamma(2, U32), gamma(3, U32)
    inner = U32 * g.abs() + g3 * (xhat * c).abs() / max(n, 1) + (1 + g3) * xhat.abs() * mean_error
    bound = g2 * dx_norm.abs() + (1 + g2) * r * inner + 4 * (1 + r) * (1 + w.abs()) * TINY32
    if dresidual_out is not None:
        bound = U32 * dx.abs() + (1 + U32) * bound
    u_s = store_roundoff(x.dtype)
    dx_bound = u_s * dx.abs() + (1 + u_s) * bound + underflow(x.dtype)
    dw = exact_dweight.double()
    dw_bound = gamma(dweight_k + 2, U32) * (dy64 * xhat).abs().sum(dim=0) + m * TINY32
    u_w = store_roundoff(weight.dtype)
    dw_bound = u_w * dw.abs() + (1 + u_w) * dw_bound + underflow(weight.dtype)
    return dx_bound.reshape(exact_dx.shape), dw_bound


def random_rows(m, n, dtype, scale=1.0):
    return (scale * torch.randn(m, n, device=DEVICE)).to(dtype)


def random_weight(n, dtype):
    return (1 + 0.5 * torch.randn(n, device=DEVICE)).to(dtype)


def forward_outputs(x, residual=None):
    y, rstd = torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)
    return (y, rstd) if residual is None else (y, rstd, torch.empty_like(x))


def check_forward(impl, x, weight, eps=EPS, residual=None, outputs=None):
    """Run impl's forward into outputs (fresh if None), hold y and rstd to the bound and
    residual_out to bitwise equality; returns the outputs."""
    outputs = forward_outputs(x, residual) if outputs is None else outputs
    extra = {} if residual is None else {"residual": residual.cpu(), "residual_out": x.cpu()}
    exact = reference.rmsnorm_forward(x.cpu(), weight.cpu(), eps, **extra)
    fused = () if residual is None else (residual, outputs[2])
    got = implementation(impl).rmsnorm_forward(x, weight, eps, *outputs[:2], *fused)
    assert all(a is b for a, b in zip(got, outputs, strict=True))
    h = x if residual is None else outputs[2]
    if residual is not None:
        assert_same_bits(outputs[2].cpu(), exact[2].to(x.dtype), f"{impl} residual_out")
    y_bound, rstd_bound = forward_bounds(impl, h, weight, eps, exact[0], exact[1])
    assert_within_bound(outputs[0], exact[0], y_bound, f"{impl} y")
    assert_within_bound(outputs[1], exact[1], rstd_bound, f"{impl} rstd")
    return outputs


def check_backward(impl, x, weight, rstd, dy, dresidual_out=None, dx=None, dweight=None):
    dx = torch.empty_like(x) if dx is None else dx
    dweight = torch.empty_like(weight) if dweight is None else dweight
    extra = () if dresidual_out is None else (dresidual_out.cpu(),)
    exact_dx, exact_dw = reference.rmsnorm_backward(
        x.cpu(), weight.cpu(), rstd.cpu(), dy.cpu(), None, None, *extra
    )
    got = implementation(impl).rmsnorm_backward(x, weight, rstd, dy, dx, dweight, dresidual_out)
    assert got[0] is dx and got[1] is dweight
    dx_bound, dw_bound = backward_bounds(
        impl, x, weight, rstd, dy, exact_dx, exact_dw, dresidual_out
    )
    assert_within_bound(dx, exact_dx, dx_bound, f"{impl} dx")
    assert_within_bound(dweight, exact_dw, dw_bound, f"{impl} dweight")
    return dx, dweight


def forward_then_backward(impl, x, weight, dy, residual=None, dresidual_out=None):
    outputs = check_forward(impl, x, weight, residual=residual)
    h = x if residual is None else outputs[2]
    return outputs, check_backward(impl, h, weight, outputs[1], dy, dresidual_out)


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


# Autograd, the custom ops, the module and torch.compile


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("entry", ["RMSNormFunction.apply", "rmsnorm"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_autograd_matches_reference_backward(impl, entry, fused):
    """The autograd.Function and `rmsnorm` (a custom op with its own autograd) give the
    reference backward at their own rstd, within the backward bound; with a residual the
    gradients of x and of the residual are both dx."""
    fns = implementation(impl)
    call = getattr(fns, entry.split(".")[0])
    call = call.apply if entry.endswith("apply") else call
    m, n = 3, 257
    x, residual = (random_rows(m, n, torch.float32).requires_grad_() for _ in range(2))
    weight = random_weight(n, torch.float32).requires_grad_()
    dy, dh = random_rows(m, n, torch.float32), random_rows(m, n, torch.float32)
    if fused:
        y, h = call(x, weight, EPS, residual)
        torch.autograd.backward((y, h), (dy, dh))
    else:
        h, y = x.detach(), call(x, weight, EPS)
        y.backward(dy)
    _, rstd = reference.rmsnorm_forward(h.detach().cpu(), weight.detach().cpu(), EPS)
    rstd = rstd.float()
    extra = (dh.cpu(),) if fused else ()
    exact_dx, exact_dw = reference.rmsnorm_backward(
        h.detach().cpu(), weight.detach().cpu(), rstd, dy.cpu(), None, None, *extra
    )
    dx_bound, dw_bound = backward_bounds(
        impl, h.detach(), weight.detach(), rstd, dy, exact_dx, exact_dw, dh if fused else None
    )
    # The kernel's own rstd differs from the exact one by the forward's rho: widen by it.
    rho = forward_bounds(impl, h.detach(), weight.detach(), EPS, exact_dx, rstd.double())[1]
    widen = 4 * (rho / rstd.double())[:, None].cpu()
    assert_within_bound(x.grad, exact_dx, dx_bound + widen * (rows(exact_dx).abs() + 1))
    if fused:
        assert_same_bits(residual.grad, x.grad)
    assert_within_bound(weight.grad, exact_dw, dw_bound * 2 + 4 * widen.max() * exact_dw.abs())


@pytest.mark.parametrize("impl", IMPLS)
def test_module_is_a_drop_in(impl):
    """RMSNorm loads torch.nn.RMSNorm's state_dict (the key `weight`), keeps its arguments
    (normalized_shape over several dimensions, eps None = the dtype's machine epsilon,
    elementwise_affine False: no parameter, nothing saved), and computes what it computes."""
    fns = implementation(impl)
    for shape, affine in (((6, 7), True), (42, False)):
        theirs = torch.nn.RMSNorm(shape, elementwise_affine=affine, device=DEVICE)
        ours = fns.RMSNorm(shape, elementwise_affine=affine, device=DEVICE)
        if affine:
            with torch.no_grad():
                theirs.weight.copy_(random_weight(42, torch.float32).view(6, 7))
        assert ours.load_state_dict(theirs.state_dict()) is not None
        assert list(ours.state_dict()) == list(theirs.state_dict())
        assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
        x = random_rows(10, 42, torch.bfloat16).view(2, 5, 6, 7)
        if not affine:
            x = x.view(2, 5, 42)
        expected = theirs(x.float()).double()
        got = ours(x)
        assert got.shape == x.shape and got.dtype == x.dtype
        # both within their bounds of the exact answer: within the sum of each other
        assert (got.double() - expected).abs().max().item() <= 3 * 2**-8 * expected.abs().max()


class PreNormBlocks(torch.nn.Module):
    """Two Llama-style pre-norm blocks: h = x + residual, y = norm(h), residual = h."""

    def __init__(self, norm_class, n=32):
        super().__init__()
        self.norms = torch.nn.ModuleList(norm_class(n) for _ in range(2))
        self.linears = torch.nn.ModuleList(torch.nn.Linear(n, n) for _ in range(2))

    def forward(self, x):
        residual, out = x, torch.zeros_like(x)
        for norm, linear in zip(self.norms, self.linears, strict=True):
            out, residual = norm(out, residual)
            out = linear(out)
        return out + residual


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_fullgraph(impl):
    """torch.compile(fullgraph=True) traces a model that calls the custom ops, forward and
    backward with the residual fused, without graph breaks, and computes what the eager model
    computes. On the CPU the aot_eager backend (no code generation) runs the kernels."""
    fns = implementation(impl)
    torch.manual_seed(0)
    model = PreNormBlocks(fns.RMSNorm).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = torch.randn(5, 32, device=DEVICE)
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


# 20 training steps of an MLP stack, the losses against torch.nn.RMSNorm's (README.md, "In
# training")

TRAIN_WIDTHS, TRAIN_BATCH, TRAIN_STEPS, TRAIN_LR = (16, 32, 32, 32, 4), 16, 20, 0.05


def mlp_stack(norm_class):
    """Linear -> norm -> ReLU, three times, then a Linear to 4 outputs (float32)."""
    layers, widths = [], TRAIN_WIDTHS
    for k_in, n in zip(widths[:-2], widths[1:-1], strict=True):
        layers += [torch.nn.Linear(k_in, n), norm_class(n, eps=EPS), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(widths[-2], widths[-1])).to(DEVICE)


def mse(out, target):
    return (out - target).square().mean()


def row_norms(t):
    return t.square().sum(-1, keepdim=True).sqrt()


def norm_error(impl, z, e_z, weight):
    """(y, e_y): the exact RMSNorm of the exact input z (float64 rows) and a bound on each
    row's ||y_hat - y||_2 when the computed input z_hat is within e_z of z (a row's 2-norm).
    y = w z / rho(z), rho = sqrt(mean z**2 + eps), has the Jacobian diag(w) (I - z z^T / (n
    rho**2)) / rho, of 2-norm <= max|w| / rho (z z^T / (n rho**2) has the eigenvalue
    1 - eps / rho**2 in [0, 1)); along the segment from z to z_hat rho >= rho - e_z / sqrt(n)
    (rho is the Euclidean norm of (z / sqrt n, sqrt eps)). The kernel's own rounding at z_hat
    is forward_bounds' with eps = 0 (where mean(h**2)'s relative error is largest, so it does
    not depend on z_hat's sum of squares) of |y| + that shift, taken over the row."""
    n, w = z.shape[-1], weight.detach().cpu().double()
    y, rstd = float64_forward(z, w, EPS)
    rho_low = 1 / rstd[:, None] - e_z / math.sqrt(n)
    assert (rho_low > 0).all(), "the input error swamps the row's scale: no bound"
    moved = w.abs().max() * e_z / rho_low
    local, _ = forward_bounds(impl, z.float(), weight.detach().cpu(), 0.0, y.abs() + moved, rstd)
    return y, moved + row_norms(local)


def loss_error(impl, model, x, target):
    """(loss, E): the exact loss of `model`'s parameters on (x, target) (float64: the stand-in
    of test_stand_ins_match_reference) and README.md's bound on the computed loss when the
    norms are `impl`'s. Errors are carried as each row's 2-norm e. A Linear's k-term dot
    products plus the bias, summed in any order (a GEMM's blocking, FMA or not), are within
    gamma_(k+1) (|W| |a_hat| + |b|) of W a_hat + b, so e' = ||W||_2 e + gamma_(k+1) (|||W| |a|
    + |b||| + |||W|||_2 e); ReLU is exact and 1-Lipschitz; the loss: (out - t) rounds once, its
    square once, the mean of B d terms gamma_(B d), with sum |r_hat**2 - r**2| <= sum over rows
    e_r (2 ||r|| + e_r) (Cauchy-Schwarz)."""
    a, e = x.cpu().double(), torch.zeros(x.shape[0], 1, dtype=torch.float64)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            w, b = layer.weight.detach().cpu().double(), layer.bias.detach().cpu().double()
            spectral, spectral_abs = (torch.linalg.matrix_norm(m, ord=2) for m in (w, w.abs()))
            rounding = gamma(w.shape[1] + 1, U32) * (
                row_norms(a.abs() @ w.abs().T + b.abs()) + spectral_abs * e
            )
            a, e = a @ w.T + b, spectral * e + rounding
        elif isinstance(layer, torch.nn.ReLU):
            a = a.clamp_min(0)
        else:
            a, e = norm_error(impl, a, e, layer.weight)
    r = a - target.cpu().double()
    r_norm = row_norms(r)
    e_r = e + U32 * (r_norm + e)
    e_square = e_r * (2 * r_norm + e_r) + U32 * (r_norm + e_r).square()
    terms = r.numel()
    loss = r.square().mean()
    return loss, (e_square.sum() + gamma(terms, U32) * (r.square().sum() + e_square.sum())) / terms


class UnbiasedRMSNorm(torch.nn.RMSNorm):
    """A negative control: mean(x**2) over N - 1 (a plausible slip), rstd 1 + 1/(2N) off."""

    def forward(self, x):
        n = x.shape[-1]
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) / (n - 1) + self.eps) * self.weight


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_trains_like_torch(impl, compiled):
    """An MLP stack (Linear -> RMSNorm -> ReLU, three blocks) with our RMSNorm and with
    torch.nn.RMSNorm, 20 SGD steps on synthetic regression data: at every step both start
    from torch's parameters (ours loads torch's state_dict: the drop-in's keys), and the two
    losses differ by at most the sum of each side's bound (README.md, "In training"). Ours
    also steps (its backward runs, under torch.compile too) and is re-anchored. Negative
    controls: at every step, the loss of a batch that missed one example; at the first, a
    norm taking mean(x**2) over N - 1 (3-4 bounds off there; later steps move its first-order
    effect on the loss through 0, so it is no per-step control)."""
    fns = implementation(impl)
    torch.manual_seed(0)
    theirs, ours = mlp_stack(torch.nn.RMSNorm), mlp_stack(fns.RMSNorm)
    wrong = mlp_stack(UnbiasedRMSNorm)
    with torch.no_grad():  # drawn on the CPU: the same numbers, so the same bounds, on a GPU
        for layer in theirs:
            if isinstance(layer, torch.nn.RMSNorm):
                layer.weight.copy_(1 + 0.5 * torch.randn(layer.weight.shape))
    x = torch.randn(TRAIN_BATCH, TRAIN_WIDTHS[0])
    target = torch.sin(x @ torch.randn(TRAIN_WIDTHS[0], TRAIN_WIDTHS[-1])).to(DEVICE)
    x = x.to(DEVICE)
    backend = "inductor" if ON_GPU else "aot_eager"
    run = torch.compile(ours, fullgraph=True, backend=backend) if compiled else ours
    sgd_theirs = torch.optim.SGD(theirs.parameters(), lr=TRAIN_LR)
    sgd_ours = torch.optim.SGD(ours.parameters(), lr=TRAIN_LR)
    losses, worst, control = [], 0.0, math.inf
    for _ in range(TRAIN_STEPS):
        ours.load_state_dict(theirs.state_dict())
        wrong.load_state_dict(theirs.state_dict())
        loss_ours = mse(run(x), target)
        loss_theirs = mse(theirs(x), target)
        with torch.no_grad():
            loss_wrong = mse(wrong(x), target)
        exact, bound_ours = loss_error(impl, theirs, x, target)
        _, bound_theirs = loss_error("torch", theirs, x, target)
        bound = (bound_ours + bound_theirs).reshape(1)
        assert_within_bound(loss_ours.reshape(1), loss_theirs.detach().reshape(1), bound,
                            f"{impl} loss at step {len(losses)}")  # fmt: skip
        missed_one = mse(theirs(x)[1:], target[1:]).detach()
        for wrong_loss in [missed_one] + ([loss_wrong] if not losses else []):
            with pytest.raises(AssertionError, match="outside the bound"):
                assert_within_bound(wrong_loss.reshape(1), loss_theirs.detach().reshape(1), bound)
        worst = max(worst, (loss_ours - loss_theirs).abs().item() / bound.item())
        control = min(control, (missed_one - loss_theirs).abs().item() / bound.item())
        losses.append(loss_theirs.item())
        for loss, sgd in ((loss_ours, sgd_ours), (loss_theirs, sgd_theirs)):
            sgd.zero_grad()
            loss.backward()
            sgd.step()
        assert all(p.isfinite().all() for p in ours.parameters())
    print(f"{impl} {'compiled' if compiled else 'eager'}: losses {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}, largest |loss - torch's| / bound {worst:.3g}, control's smallest "
          f"{control:.3g}")  # fmt: skip
    assert losses[-1] < losses[0]


# (3) Triton: the looped and columns kernels, the groups, and the dispatch ------------------


@pytest.fixture
def small_triton_limits(monkeypatch):
    """Register limits of 32, chunks of 16 lanes and at most 4 groups: short rows take the
    looped forward and the dots-then-columns backward, the paths the H200 takes past
    ROW_BLOCK_MAX and BACKWARD_ROW_BLOCK_MAX, at sizes the interpreter runs."""
    for name, value in (("ROW_BLOCK_MAX", 32), ("BACKWARD_ROW_BLOCK_MAX", 32), ("CHUNK", 16),
                        ("GROUPS_MAX", 4)):  # fmt: skip
        monkeypatch.setattr(triton_impl, name, value)
    triton_impl.rows_launch.cache_clear()
    triton_impl.groups_of.cache_clear()
    yield
    triton_impl.rows_launch.cache_clear()
    triton_impl.groups_of.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n", [(3, 33), (9, 100), (2, 257)], ids=str)
def test_triton_looped_kernels(dtype, m, n, small_triton_limits):
    """Several chunks per row, rows split into groups of several rows, fused and not."""
    x, residual, dy, dh = (random_rows(m, n, dtype) for _ in range(4))
    weight = random_weight(n, dtype)
    forward_then_backward("triton", x, weight, dy)
    forward_then_backward("triton", x, weight, dy, residual, dh)
    assert triton_impl.forward_path(n, dtype) == -(-n // 16) - 1 + 4 + 1


def test_triton_dispatch():
    """Rows up to the register limits go to the rows kernels, several short rows a program;
    the backward's groups: at most GROUPS_MAX (the columns path: GROUPS_MAX per CHUNK)."""
    assert triton_impl.rows_launch(1000, 1, 32768) == (1024, 1, 4)
    assert triton_impl.rows_launch(3, 100, 32768)[0] == 4  # never more rows than m needs
    assert triton_impl.rows_launch(8, 32768, 32768) == (1, 32768, 32)
    assert triton_impl.rows_launch(8, 32769, 32768) is None
    assert triton_impl.groups_of(32768, 4096) == (64, 512)
    assert triton_impl.groups_of(5, 4096) == (1, 5)
    assert triton_impl.groups_of(100, 65536) == (4, 25)  # 16 chunks: 32 groups at most


def test_triton_long_rows_at_real_size():
    """N = 40000 > BACKWARD_ROW_BLOCK_MAX and > ROW_BLOCK_MAX at the real constants."""
    x, dy = random_rows(2, 40000, torch.bfloat16), random_rows(2, 40000, torch.bfloat16)
    forward_then_backward("triton", x, random_weight(40000, torch.bfloat16), dy)


def launch_cases():
    """Forward and backward calls that change what Triton compiles for, one thing at a time:
    the dtype, n (BLOCK_N), m = 1, a row stride off a multiple of 16, an address off 16 bytes,
    a float32 weight, the fused residual, an int eps (passed as float32 like any float), rows
    past the register limits (the looped forward, the dots and columns backward). The
    stand-ins compute nothing."""

    def both(x, weight=None, eps=EPS, fused=False):
        weight = random_weight(x.shape[-1], x.dtype) if weight is None else weight
        y, rstd = forward_outputs(x)
        dy, dx, dweight = torch.randn_like(x), torch.empty_like(x), torch.empty_like(weight)
        extra = (torch.randn_like(x), torch.empty_like(x)) if fused else ()
        return lambda: (
            triton_impl.rmsnorm_forward(x, weight, eps, y, rstd, *extra),
            triton_impl.rmsnorm_backward(x, weight, rstd, dy, dx, dweight, *extra[:1]),
        )

    for dtype in DTYPES:
        yield both(random_rows(4, 96, dtype))
    yield both(random_rows(4, 1000, torch.float32))
    yield both(random_rows(1, 96, torch.float32))
    yield both(random_rows(4, 97, torch.float32)[:, :96])
    yield both(torch.randn(4 * 96 + 1, device=DEVICE)[1:].view(4, 96))
    yield both(random_rows(4, 96, torch.bfloat16), random_weight(96, torch.float32))
    yield both(random_rows(4, 96, torch.bfloat16), fused=True)
    yield both(random_rows(4, 96, torch.float32), eps=1)
    yield both(random_rows(2, 40000, torch.bfloat16))


# Each case: a forward, then the backward's rows kernel and partials sum (long rows: the dots,
# columns and sum kernels). Some cases change nothing for some kernels (the backwards after the
# strided and the misaligned x see contiguous, aligned operands; the int eps is the float32
# case again): 26 keys in all.
MIN_SPECIALISATIONS = 26

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


# Builds every kernel for sm_90 as a launch at M = N = 1 specialises it: Triton compiles an int
# argument equal to 1 in as the constant 1 (a constexpr), so n, m, the strides and the group
# counts all arrive as constants, which the interpreter never shows. A child process: under
# TRITON_INTERPRET=1 the kernels cannot be compiled.
TRITON_ONES_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl as t

def build(kernel, **constexprs):
    kinds = {p.name: "constexpr" if p.is_constexpr or not (p.name.endswith("_ptr") or
             p.name == "eps") else "fp32" if p.name == "eps" else "*fp32" for p in kernel.params}
    ones = {(i,): constexprs.get(name, 1) for i, name in enumerate(kinds)
            if kinds[name] == "constexpr"}
    triton.compile(ASTSource(kernel, kinds, ones), target=GPUTarget("cuda", 90, 32))

chunk = dict(CHUNK=t.CHUNK, LOG2_CHUNK=t.log2(t.CHUNK))
for fused in (False, True):
    build(t.rmsnorm_forward_rows_kernel, ROWS=1, BLOCK_N=1, LOG2_BLOCK_N=0, FUSED=fused)
    build(t.rmsnorm_backward_rows_kernel, ROWS=1, BLOCK_N=1, LOG2_BLOCK_N=0, FUSED=fused)
    build(t.rmsnorm_forward_looped_kernel, **chunk, FUSED=fused)
    build(t.rmsnorm_backward_columns_kernel, CHUNK=t.CHUNK, FUSED=fused)
build(t.rmsnorm_row_dots_kernel, **chunk)
build(t.sum_partials_kernel, GROUPS_POW2=1, LOG2_GROUPS=0, BLOCK_N=t.SUM_BLOCK_N)
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the contract tests launch these builds at N = 1")
def test_triton_builds_with_every_int_one():
    """Each kernel compiles for sm_90 with every int argument the constant 1 (N = 1 once
    failed there: n.to() of a constexpr)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", TRITON_ONES_SCRIPT], cwd=HERE, env=env,
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    x, dy = torch.randn(3, 300).to(dtype), torch.randn(3, 300).to(dtype)
    w = (1 + 0.5 * torch.randn(300)).to(dtype)
    y, rstd = triton_impl.rmsnorm_forward(x, w, 1e-6, torch.empty_like(x), torch.empty(3))
    dx, dw = triton_impl.rmsnorm_backward(x, w, rstd, dy, torch.empty_like(x), torch.empty_like(w))
    outputs = dict(x=x, w=w, dy=dy, y=y, rstd=rstd, dx=dx, dw=dw)
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
        x, w, rstd = t["x"], t["w"], t["rstd"]
        exact_y, exact_rstd = reference.rmsnorm_forward(x, w, EPS)
        y_bound, rstd_bound = forward_bounds("triton", x, w, EPS, exact_y, exact_rstd)
        assert_within_bound(t["y"], exact_y, y_bound, "fresh y")
        assert_within_bound(rstd, exact_rstd, rstd_bound, "fresh rstd")
        exact_dx, exact_dw = reference.rmsnorm_backward(x, w, rstd, t["dy"], None, None)
        bounds = backward_bounds("triton", x, w, rstd, t["dy"], exact_dx, exact_dw)
        assert_within_bound(t["dx"], exact_dx, bounds[0], "fresh dx")
        assert_within_bound(t["dw"], exact_dw, bounds[1], "fresh dweight")


# (4) CuTe builds and PTX ---------------------------------------------------------------------


# N = 1, 7, 1024, 2048, 4096, 8193: forward_map's threads a row and forward_path's K (log2 V +
# tiles + log2 threads + 1; V = 16 in bf16 and fp16, 8 in float32): a warp holds 1024 elements
# in every dtype (32 values a thread), 2 and 4 warps 2048 and 4096; 8193 is streamed by a block.
CUTE_FORWARD_MAPS = {
    torch.bfloat16: [(32, 11), (32, 11), (32, 12), (64, 13), (128, 14), (256, 16)],
    torch.float16: [(32, 11), (32, 11), (32, 12), (64, 13), (128, 14), (256, 16)],
    torch.float32: [(32, 10), (32, 10), (32, 13), (64, 14), (128, 15), (256, 17)],
}


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_forward_map(dtype):
    """The fewest warps whose registers hold the row, a block streaming longer rows;
    forward_path counts the tree of that map (backward_path: a block a row at every N)."""
    for n, (threads, path) in zip([1, 7, 1024, 2048, 4096, 8193], CUTE_FORWARD_MAPS[dtype],
                                  strict=True):  # fmt: skip
        assert cute_impl.forward_map(n, dtype)[0] == threads
        assert cute_impl.forward_path(n, dtype) == path
        assert cute_impl.backward_path(n, dtype) == cute_impl.row_sum_path(n, dtype, 256)
    maps = [cute_impl.forward_map(n, dtype) for n, dtype in [
        (1, torch.bfloat16), (1024, torch.bfloat16), (2048, torch.float16), (4000, torch.bfloat16),
        (4096, torch.float32), (8192, torch.bfloat16), (8191, torch.float32),
        (8193, torch.bfloat16)]]  # fmt: skip
    assert maps == [(32, 1, False), (32, 2, True), (64, 2, True), (128, 2, False),
                    (128, 4, True), (256, 2, True), (256, 4, False), (256, 0, False)]  # fmt: skip


# The CuTe builds: the forward on forward_map's (threads a row, tiles held, whole tiles) (a
# warp's row held, 4 warps' partial tiles, a block's whole tiles, a block streaming), the
# backward on backward_map's (tiles held, whole tiles) (the columns path, partial and whole).
CUTE_BUILDS = [("forward", (32, 2, True)), ("forward", (128, 2, False)),
               ("forward", (256, 2, True)), ("forward", (256, 0, False)), ("backward", (0, False)),
               ("backward", (1, False)), ("backward", (2, True))]  # fmt: skip


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("direction, shape", CUTE_BUILDS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_ptx(direction, shape, dtype):
    """The CuTe kernels build for sm_90a (N is symbolic: one build serves every N of its map):
    128-bit loads and stores on the vector path (none in the any-stride build), warp shuffles,
    div.rn for the means, no spills; in the forward the rsqrt.approx README.md's bound counts
    and the barriers of its map (none for a warp's row, the row's own named one for 2-4 warps,
    bar.sync 0 for a block's); the backward's whole-tile vector build stages rows by cp.async."""
    vector = cute_impl.ptx_of(direction, dtype, True, True, shape)
    scalar = cute_impl.ptx_of(direction, dtype, False, False, shape)
    for ptx in (vector, scalar):
        assert "shfl.sync.bfly" in ptx and "div.rn.f32" in ptx and "div.approx" not in ptx
        assert "ld.local" not in ptx
    assert "ld.global.v4" in vector and "st.global.v4" in vector
    assert "ld.global.v4" not in scalar
    staged = direction == "backward" and shape[1]
    assert ("cp.async.cg.shared.global" in vector) == staged
    assert "cp.async" not in scalar
    if direction == "forward":
        assert "rsqrt.approx.ftz.f32" in vector
        threads = shape[0]
        barriers = re.findall(r"\bbar\.sync\s+[^;]*;|\bbarrier\.sync[^;]*;", vector)
        block_wide = [bool(re.fullmatch(r"bar\.sync\s+0;", bar)) for bar in barriers]
        assert block_wide == [threads == 256] * (0 if threads == 32 else 1), barriers


# bf16 and float32 rows of the headline sizes, forward and backward.
HEADLINE_BUILDS = [(torch.bfloat16, 4096), (torch.bfloat16, 8192), (torch.float32, 4096),
                   (torch.float32, 8192)]  # fmt: skip


@pytest.mark.skipif(
    cute_impl is None or shutil.which("ptxas") is None,
    reason="needs the CuTe DSL and ptxas (CUDA toolkit) to count registers",
)
@pytest.mark.parametrize("dtype, n", HEADLINE_BUILDS, ids=str)
def test_cute_registers(dtype, n, tmp_path):
    """ptxas -v on the sm_90a PTX of the headline builds: the forward (plain and fused) at
    most 64 registers a thread, four blocks of 256 threads an SM (README.md's tuning log counts
    on it); the plain forward and the backward spill nothing (ptxas puts 8 bytes of the fused
    bf16 8192 forward on the stack at 48 registers, under any limit: its choice, so not held)."""
    for direction, fused in [("forward", False), ("forward", True), ("backward", False)]:
        shape = (cute_impl.forward_map if direction == "forward" else cute_impl.backward_map)(
            n, dtype
        )
        ptx = tmp_path / f"{direction}.ptx"
        ptx.write_text(cute_impl.ptx_of(direction, dtype, True, fused, shape))
        run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True)  # fmt: skip
        if "Unsupported .version" in run.stderr:  # the H200 machine's ptxas is older than the DSL
            pytest.skip(f"this ptxas cannot read the CuTe DSL's PTX: {run.stderr.strip()}")
        assert run.returncode == 0, run.stderr
        for entry in run.stderr.split("Compiling entry function")[1:]:
            assert fused or "0 bytes spill stores" in entry, entry
            registers = int(re.search(r"Used (\d+) registers", entry).group(1))
            if direction == "forward":
                assert registers <= 65536 // (4 * cute_impl.THREADS_PER_BLOCK), entry


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
def test_cute_groups():
    """Rows of up to ROW_REGISTERS_MAX values a thread go to the rows kernel (8192 elements in
    every dtype), longer ones to the columns path; at most GROUPS_MAX blocks (the columns
    kernel's over all its tiles), every row in a group."""
    tiles = [cute_impl.row_tiles_of(n, dtype) for n, dtype in [
        (1, torch.bfloat16), (4096, torch.bfloat16), (4097, torch.float16),
        (8192, torch.bfloat16), (8193, torch.bfloat16), (2048, torch.float32),
        (8192, torch.float32), (8193, torch.float32)]]  # fmt: skip
    assert tiles == [1, 1, 2, 2, 0, 1, 4, 0]
    assert cute_impl.groups_of(32768, 4096, torch.bfloat16) == (64, 512)
    assert cute_impl.groups_of(32768, 8192, torch.bfloat16) == (64, 512)  # one block a row
    assert cute_impl.groups_of(32768, 16384, torch.bfloat16) == (256, 128)  # four tiles
    assert cute_impl.groups_of(7, 65536, torch.bfloat16) == (1, 7)


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


def entry_operands(direction, vectorized, m=5, n=1024):
    """CPU operands for a float32 build, no two (M, N) or (N,) ones laid out alike: slices of
    wider rows, a column step and a broadcast where the build takes any stride; row slices whose
    rows stay whole 16-byte vectors where it is the vector build."""
    wide = (lambda: torch.randn(m, n + 16)[:, :n]) if vectorized else (
        lambda: torch.randn(m, n + 13)[:, 3 : 3 + n])  # fmt: skip
    step = (lambda k: torch.randn(k)) if vectorized else (lambda k: torch.randn(2 * k)[::2])
    stat = lambda: torch.empty(m, 3)[:, 1]  # noqa: E731
    if direction == "forward":  # x, residual, w, y, rstd, h, eps
        return wide(), torch.randn(m, n), step(n), torch.empty(m, n), stat(), wide(), 1e-6
    dy = torch.randn(m, n + 8)[:, :n] if vectorized else torch.randn(1, n).expand(m, n)
    partials = torch.empty(1, n + 8)[:, :n]
    return (wide(), torch.randn(n), stat(), dy, torch.randn(m, n), torch.empty(m, n), stat(),
            partials, step(n), m)  # fmt: skip


@pytest.mark.skipif(cute_impl is None or ON_GPU,
                    reason="CPU only (the CuTe DSL installed): on a GPU the contract tests call "
                    "these builds")  # fmt: skip
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("vectorized", [False, True], ids=["any stride", "vector"])
def test_cute_entry_takes_each_operands_layout(direction, vectorized):
    """TVM-FFI checks every operand before the launch; operands in unlike layouts pass those
    checks and reach the launch, which fails here without a driver (when operands shared one
    fake tensor's stride symbols, a ValueError 'Mismatched res.strides[0]', on the H200 too)."""
    shape = cute_impl.forward_map(1024, torch.float32) if direction == "forward" else (1, True)
    kernel = cute_impl.compile_kernel(
        direction, torch.float32, torch.float32, vectorized, True, shape
    )
    operands = entry_operands(direction, vectorized)
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        kernel(*(cuda_labelled(t) if isinstance(t, torch.Tensor) else t for t in operands))


# (5) GPU only --------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def float64_forward(x, weight, eps):
    """The stand-in for reference.py where Python is too slow: the same formula in float64."""
    x64 = x.double()
    rstd = 1 / torch.sqrt(x64.square().mean(-1) + reference.to_float32(eps))
    return (x64 * rstd[..., None] * weight.double()).cpu(), rstd.cpu()


def float64_backward(x, weight, rstd, dy):
    x64, dy64, r = x.double(), dy.double(), rstd.double()[..., None]
    xhat, g = x64 * r, dy64 * weight.double()
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.cpu(), (dy64 * xhat).reshape(-1, x.shape[-1]).sum(0).cpu()


def test_stand_ins_match_reference():
    """The float64 stand-ins agree with reference.py to far below any float32 bound."""
    x, dy = random_rows(3, 1000, torch.float32), random_rows(3, 1000, torch.float32)
    weight = random_weight(1000, torch.float32)
    exact_y, exact_rstd = reference.rmsnorm_forward(x.cpu(), weight.cpu(), EPS)
    y, rstd = float64_forward(x, weight, EPS)
    assert (y - exact_y).abs().max() < 1e-14 and (rstd - exact_rstd).abs().max() < 1e-14
    exact = reference.rmsnorm_backward(x.cpu(), weight.cpu(), exact_rstd.float(), dy.cpu())
    for a, b in zip(float64_backward(x, weight, exact_rstd.float().to(DEVICE), dy), exact,
                    strict=True):  # fmt: skip
        assert (a - b).abs().max() < 1e-13


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "m, n", [(4099, 1024), (4096, 4096), (1030, 8192), (16, 16384), (8, 65537), (2, 262144)]
)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_large_rows_against_float64(impl, dtype, m, n, fused):
    """Rows the CuTe backward stages (4096, 8192: groups of 8 and 3 rows, the last group of
    1030 a single row) and streams, against float64; fused, h = x + residual bit for bit."""
    fns = implementation(impl)
    x, dy = random_rows(m, n, dtype, scale=3.0), random_rows(m, n, dtype)
    weight = random_weight(n, dtype)
    residual = random_rows(m, n, dtype) if fused else None
    outputs = forward_outputs(x, residual)
    if fused:
        y, rstd, h = fns.rmsnorm_forward(x, weight, EPS, *outputs[:2], residual, outputs[2])
        assert_same_bits(h, (x.float() + residual.float()).to(dtype), f"{impl} residual_out")
    else:
        (y, rstd), h = fns.rmsnorm_forward(x, weight, EPS, *outputs), x
    exact_y, exact_rstd = float64_forward(h, weight, EPS)
    y_bound, rstd_bound = forward_bounds(impl, h, weight, EPS, exact_y, exact_rstd)
    assert_within_bound(y, exact_y, y_bound, f"{impl} y")
    assert_within_bound(rstd, exact_rstd, rstd_bound, f"{impl} rstd")
    dh = random_rows(m, n, dtype) if fused else None
    dx, dw = fns.rmsnorm_backward(
        h, weight, rstd, dy, torch.empty_like(x), torch.empty_like(weight), dh
    )
    exact_dx, exact_dw = float64_backward(h, weight, rstd, dy)
    if fused:
        exact_dx = exact_dx + dh.double().cpu()
    dx_bound, dw_bound = backward_bounds(impl, h, weight, rstd, dy, exact_dx, exact_dw, dh)
    assert_within_bound(dx, exact_dx, dx_bound, f"{impl} dx")
    assert_within_bound(dw, exact_dw, dw_bound, f"{impl} dweight")


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_replays_the_eager_call(impl, dtype):
    """Captured in a CUDA graph, the fused forward and the backward replay on fresh data with
    the bits of an eager call: the launchers work on torch's current stream."""
    fns = implementation(impl)
    x, residual, dy = (random_rows(5, 4099, dtype) for _ in range(3))
    weight = random_weight(4099, dtype)
    outputs = forward_outputs(x, residual)
    grads = torch.empty_like(x), torch.empty_like(weight)

    def step():
        fns.rmsnorm_forward(x, weight, EPS, *outputs[:2], residual, outputs[2])
        fns.rmsnorm_backward(outputs[2], weight, outputs[1], dy, *grads)

    step()  # compile and load first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in (x, residual, dy):
        t.copy_(random_rows(5, 4099, dtype))
    graph.replay()
    replayed = [t.clone() for t in (*outputs, *grads)]
    step()
    torch.cuda.synchronize()
    for a, b in zip(replayed, (*outputs, *grads), strict=True):
        assert_same_bits(a, b)


@gpu_only
def test_rsqrt_error_within_common_figure():
    """The measurement behind common/README.md's rsqrt.approx.ftz.f32 figure: tl.math.rsqrt (which
    compiles to rsqrt.approx.ftz.f32) on every float32 in [1, 4) (two binades: the error
    pattern repeats every factor of 4) against float64 1/sqrt."""
    import triton
    import triton.language as tl

    @triton.jit
    def rsqrt_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.math.rsqrt(tl.load(a_ptr + offs)))

    start = torch.tensor(1.0).view(torch.int32).item()
    a = torch.arange(start, start + 2**24, device=DEVICE, dtype=torch.int32).view(torch.float32)
    out = torch.empty_like(a)
    rsqrt_kernel[(a.numel() // 1024,)](a, out, BLOCK=1024)
    exact = 1 / torch.sqrt(a.double())
    relative = ((out.double() - exact) / exact).abs().max().item()
    print(
        f"rsqrt.approx.ftz.f32: largest relative error {relative:.3e} "
        f"= 2**{math.log2(relative):.2f}"
    )
    assert relative <= RSQRT


if __name__ == "__main__":
    sys.exit(
        pytest.main(
            [
                __file__,
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore::RuntimeWarning",
                *sys.argv[1:],
            ]
        )
    )
