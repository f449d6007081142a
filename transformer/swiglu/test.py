"""Tests for SwiGLU: every implementation, forward and backward, lands within README.md's bound.

Run with `python test.py`. Without a GPU, torch runs on the CPU and Triton under its
interpreter; the Triton and CuTe kernels are also compiled for sm_90(a) and their PTX read
(launching a CuTe kernel needs the GPU: those tests skip and say so).
"""

import json
import math
import os
import re
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
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # what cute.compile builds for

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
FORMS = ["two tensors", "fused"]
# (M, N): no rows, 1, primes, 2**k +- 1 and the tiles' edges (2048 and 4096 elements).
SHAPES = [(0, 5), (1, 1), (2, 3), (7, 31), (3, 128), (5, 129), (2, 1023), (1, 4097), (3, 2048)]
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny
# exp's own relative error at its (rounded) argument: ex2.approx.f32 for Triton and CuTe (2 ulp,
# 5u by common/README.md); torch's sigmoid calls an accurate exp (CUDA's expf: 2 ulp, also 5u;
# the CPU's Sleef exp: 1 ulp).
EX2 = APPROX_RELATIVE_ERROR["ex2.approx.ftz.f32"]
EXP_ERROR = {"torch": 5 * U32, "triton": EX2, "cute": EX2}


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


def sigmoid_bound(impl, g):
    """(s, |s_hat - s| bound) for float64 g (README.md, "The error bound"):
    eta = exp(gamma_k |g|)(1 + X) - 1       exp(-g)'s relative error (k argument roundings)
    delta = (1 + eta (1 - s))(1 + u) - 1    1 + exp(-g)'s
    |s_hat - s| <= ((1 + u) / (1 - delta) - 1) s + tiny   (flushed or overflowed exp)."""
    s = torch.sigmoid(g)
    k = module(impl).EXP_ARGUMENT_ROUNDINGS
    eta = torch.exp(gamma(k, U32) * g.abs()) * (1 + EXP_ERROR[impl]) - 1
    delta = (1 + eta * (1 - s)) * (1 + U32) - 1
    bound = ((1 + U32) / (1 - delta) - 1) * s + TINY32
    return s, bound.nan_to_num(0.0, 0.0, 0.0)


def stored(bound, exact, dtype):
    """The float32 result's bound, then the store's rounding to dtype."""
    u_s = store_roundoff(dtype)
    return u_s * exact.abs() + (1 + u_s) * bound + underflow(dtype)


def forward_bound(impl, g, u, exact_y):
    """|y_hat - y| <= ((1 + u)**2 - 1) |y| + (1 + u)**2 |g u| e_s + tiny, then the store."""
    g64, u64 = g.detach().cpu().double(), u.detach().cpu().double()
    _, e_s = sigmoid_bound(impl, g64)
    bound = ((1 + U32) ** 2 - 1) * exact_y.abs() + (1 + U32) ** 2 * (g64 * u64).abs() * e_s
    return stored((bound + TINY32).nan_to_num(0.0, 0.0, 0.0), exact_y, g.dtype)


def backward_bounds(impl, g, u, dy, exact_dg, exact_du):
    """du: as y with |dy g| for |g u|. dg = dy u s f, f = 1 + g q, q = 1 - s:
    e_q = u q + (1 + u) e_s,  e_f = u |f| + (1 + u)(u |g q| + (1 + u) |g| e_q)
    |dg_hat - dg| <= ((1 + u)**3 - 1) |dg| + (1 + u)**3 |dy u| (e_s |f| + (s + e_s) e_f) + tiny."""
    g64, u64, dy64 = (t.detach().cpu().double() for t in (g, u, dy))
    s, e_s = sigmoid_bound(impl, g64)
    q = torch.sigmoid(-g64)
    f = 1 + g64 * q
    e_q = U32 * q + (1 + U32) * e_s
    e_f = U32 * f.abs() + (1 + U32) * (U32 * (g64 * q).abs() + (1 + U32) * g64.abs() * e_q)
    dg = ((1 + U32) ** 3 - 1) * exact_dg.abs() + (1 + U32) ** 3 * (dy64 * u64).abs() * (
        e_s * f.abs() + (s + e_s) * e_f
    )
    du = ((1 + U32) ** 2 - 1) * exact_du.abs() + (1 + U32) ** 2 * (dy64 * g64).abs() * e_s
    return tuple(
        stored((b + TINY32).nan_to_num(0.0, 0.0, 0.0), exact, g.dtype)
        for b, exact in ((dg, exact_dg), (du, exact_du))
    )


def random_rows(m, n, dtype, scale=3.0):
    """scale 3: sigmoid's whole range, its flat tails included."""
    return (scale * torch.randn(m, n, device=DEVICE)).to(dtype)


def operands(form, m, n, dtype):
    """(g, u) as two tensors, or (gu, None): the fused (M, 2N) gate-up tensor."""
    if form == "fused":
        return random_rows(m, 2 * n, dtype), None
    return random_rows(m, n, dtype), random_rows(m, n, dtype)


def check_forward(impl, g, u, y=None):
    """Run impl's forward into y (fresh if None) and hold it to the bound; returns y."""
    fns = implementation(impl)
    y = torch_impl.fresh_output(g, u) if y is None else y
    exact = reference.swiglu_forward(g.cpu(), None if u is None else u.cpu())
    assert fns.swiglu_forward(g, u, y) is y
    gate, up = reference.halves(g) if u is None else (g, u)
    assert_within_bound(y, exact, forward_bound(impl, gate, up, exact), f"{impl} y")
    return y


def check_backward(impl, g, u, dy, dg=None, du=None):
    fns = implementation(impl)
    dg = torch.empty_like(g) if dg is None else dg
    du = None if u is None else torch.empty_like(u) if du is None else du
    exact_dg, exact_du = reference.swiglu_backward(g.cpu(), None if u is None else u.cpu(),
                                                   dy.cpu())  # fmt: skip
    got = fns.swiglu_backward(g, u, dy, dg, du)
    assert got[0] is dg and got[1] is du
    gate, up = reference.halves(g) if u is None else (g, u)
    d_gate, d_up = reference.halves(dg) if u is None else (dg, du)
    if u is None:
        exact_dg, exact_du = reference.halves(exact_dg)
    dg_bound, du_bound = backward_bounds(impl, gate, up, dy, exact_dg, exact_du)
    assert_within_bound(d_gate, exact_dg, dg_bound, f"{impl} dg")
    assert_within_bound(d_up, exact_du, du_bound, f"{impl} du")
    return dg, du


def forward_then_backward(impl, g, u, dy):
    check_forward(impl, g, u)
    check_backward(impl, g, u, dy)


# (2) The contract over every implementation ---------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, n", SHAPES, ids=str)
def test_matches_reference(impl, form, dtype, m, n):
    g, u = operands(form, m, n, dtype)
    forward_then_backward(impl, g, u, random_rows(m, n, dtype, scale=1.0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", FORMS)
def test_leading_dims_flatten_to_rows(impl, form):
    """A (2, 3, 5, 33) tensor is 30 rows of 33 (the fused one: of 66)."""
    g, u = operands(form, 30, 33, torch.bfloat16)
    g, u = g.view(2, 3, 5, -1), None if u is None else u.view(2, 3, 5, 33)
    forward_then_backward(impl, g, u, random_rows(30, 33, torch.bfloat16).view(2, 3, 5, 33))


def strided(kind, m, n, dtype):
    """A random (m, n) tensor in a layout other than contiguous rows."""
    if kind == "row slice":  # rows of a wider tensor
        return random_rows(m, n + 13, dtype)[:, 3 : 3 + n]
    if kind == "column step":  # every other element of each row
        return random_rows(m, 2 * n, dtype)[:, ::2]
    if kind == "transposed":  # a row is a column of the storage
        return random_rows(n, m, dtype).t()
    assert kind == "unmergeable"  # leading dims whose strides do not merge: the copy path
    return random_rows(6 * m, n, dtype).view(3, 2 * m, n)[:, :m]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["row slice", "column step", "transposed", "unmergeable"])
def test_strided_operands(impl, dtype, kind):
    m, n = 5, 1031
    g, u, dy = (strided(kind, m, n, dtype) for _ in range(3))
    forward_then_backward(impl, g, u, dy)
    y, dg, du = (strided(kind, m, n, dtype) for _ in range(3))  # outputs in that layout too
    check_forward(impl, g, u, y)
    check_backward(impl, g, u, dy, dg, du)


def poisoned_view(m, n, dtype, margin=7):
    """An (m, n) view inside a NaN-filled buffer, rows 2n + 2 margin apart, and the mask of the
    buffer's elements outside the view."""
    buffer = torch.full((m + 2, 2 * n + 2 * margin), float("nan"), device=DEVICE, dtype=dtype)
    view = buffer[1 : m + 1, margin : margin + n]
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[1 : m + 1, margin : margin + n] = False
    return buffer, view, outside


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 129, 4099])
def test_outputs_inside_guard(impl, form, dtype, n):
    """y, dg and du (or the fused dgu) are views into NaN: every element of each view is
    written (within the bound, so not NaN) and nothing outside it changes."""
    m = 3
    g, u = operands(form, m, n, dtype)
    guards = [poisoned_view(m, n, dtype)]  # y, then dgu or dg and du
    guards += (
        [poisoned_view(m, 2 * n, dtype)]
        if u is None
        else [poisoned_view(m, n, dtype) for _ in range(2)]
    )
    views = [view for _, view, _ in guards]
    check_forward(impl, g, u, views[0])
    check_backward(impl, g, u, random_rows(m, n, dtype, 1.0), *views[1:])
    for buffer, view, outside in guards:
        assert buffer[outside].isnan().all(), "an element outside an output was written"
        assert not view.isnan().any()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", FORMS)
def test_in_place(impl, form):
    """Two tensors: y may be u itself, dg may be g and du may be dy; fused: dgu may be gu
    itself. Every element is read before its own output element is written."""
    fns, (m, n) = implementation(impl), (4, 3001)
    g, u = operands(form, m, n, torch.float32)
    dy = random_rows(m, n, torch.float32, 1.0)
    gate, up = reference.halves(g) if u is None else (g, u)
    exact_y = reference.swiglu_forward(gate.cpu(), up.cpu())
    exact_dg, exact_du = reference.swiglu_backward(gate.cpu(), up.cpu(), dy.cpu())
    y_bound = forward_bound(impl, gate, up, exact_y)
    dg_bound, du_bound = backward_bounds(impl, gate, up, dy, exact_dg, exact_du)
    if u is None:
        dgu, du = fns.swiglu_backward(g, None, dy, g)
        assert dgu is g and du is None
        d_gate, d_up = reference.halves(g)
    else:
        up_copy = u.clone()
        assert fns.swiglu_forward(g, up_copy, up_copy) is up_copy
        assert_within_bound(up_copy, exact_y, y_bound)
        d_gate, d_up = fns.swiglu_backward(g, u, dy, g, dy)
        assert d_gate is g and d_up is dy
    assert_within_bound(d_gate, exact_dg, dg_bound)
    assert_within_bound(d_up, exact_du, du_bound)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(impl, dtype):
    """IEEE arithmetic on the formula, as reference.py (and torch's composite ops) compute it:
    a NaN in g, u or dy makes its outputs NaN; g = +inf gives s = 1 and y = inf * u; g = -inf
    gives s = 0 and y = -inf * 0 = NaN (the limit would be 0: README.md, "Special values");
    |g| = 1e4 does not overflow (exp(1e4) = inf gives s = 0 exactly, y = -0)."""
    n = 300
    g, u, dy = (random_rows(2, n, dtype) for _ in range(3))
    g[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4], dtype=dtype)
    g[1, :2] = -1e4
    u[0, 10], dy[1, 20] = float("nan"), float("nan")
    u[0, 3] = dy[0, 3] = 0.5  # y = silu(1e4) u and du = dy silu(1e4) stay inside float16's range
    y = check_forward(impl, g, u)
    assert y[0, 0].isnan() and y[0, 1] == math.inf * u[0, 1].sign() and y[0, 2].isnan()
    assert y[0, 10].isnan() and y[1, :2].eq(0).all() and y[0, 3].isfinite()
    dg, du = check_backward(impl, g, u, dy)
    assert dg[1, 20].isnan() and du[1, 20].isnan()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeatability(impl, dtype):
    """Two runs give the same bits (elementwise: no order to vary)."""
    fns = implementation(impl)
    g, u, dy = (random_rows(67, 1003, dtype) for _ in range(3))
    ys = [fns.swiglu_forward(g, u, torch.empty_like(g)) for _ in range(2)]
    assert_same_bits(*ys)
    grads = [fns.swiglu_backward(g, u, dy, torch.empty_like(g), torch.empty_like(u))
             for _ in range(2)]  # fmt: skip
    for a, b in zip(*grads, strict=True):
        assert_same_bits(a, b)


def bad_inputs():
    """(direction, operands, expected error, words the message must contain)"""
    f32 = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    g, u = f32(3, 4), f32(3, 4)
    buffer = f32(4, 20)
    fwd, bwd = "forward", "backward"
    yield fwd, ([[1.0]], u, f32(1, 1)), TypeError, "g must be a torch.Tensor"
    yield fwd, (f32(()), None, f32(())), ValueError, "0-dim"
    yield fwd, (g.double(), None, f32(3, 2)), TypeError, "g has dtype"
    yield fwd, (g, u.half(), f32(3, 4)), TypeError, "u has dtype"
    yield fwd, (g, f32(3, 5), f32(3, 4)), ValueError, "u has shape"
    yield fwd, (f32(3, 5), None, f32(3, 2)), ValueError, "odd"
    yield fwd, (g, None, f32(3, 4)), ValueError, "y has shape"
    yield fwd, (g, u, f32(3, 4).half()), TypeError, "y has dtype"
    yield fwd, (g, u, f32(1, 4).expand(3, 4)), ValueError, "one address"
    yield fwd, (buffer[:3, :10], buffer[:3, 10:], buffer[:3, 5:15]), ValueError, "y overlaps g"
    yield fwd, (g, None, g[:, 1:3]), ValueError, "y overlaps g"
    yield bwd, (g, u, g.bfloat16(), f32(3, 4), f32(3, 4)), TypeError, "dy has dtype"
    yield bwd, (g, u, f32(4, 3), f32(3, 4), f32(3, 4)), ValueError, "dy has shape"
    yield bwd, (g, None, f32(3, 2), f32(3, 4), f32(3, 2)), ValueError, "du must be None"
    yield bwd, (g, None, f32(3, 2), f32(3, 2)), ValueError, "dg has shape"
    yield bwd, (g, u, f32(3, 4), buffer[:3, :4], buffer[:3, 2:6]), ValueError, "dg overlaps du"
    yield (
        bwd,
        (buffer[:3, :4], u, f32(3, 4), buffer[:3, 2:6], f32(3, 4)),
        ValueError,
        "dg overlaps g",
    )
    if ON_GPU:
        yield fwd, (g, u, torch.randn(3, 4)), ValueError, "is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from reference.check_*, the first thing every implementation calls; the
    outputs are untouched."""
    direction, operands_, error, words = case
    first_output = 2 if direction == "forward" else 3
    tensors = [t for t in operands_[first_output:] if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    with pytest.raises(error, match=words):
        getattr(module(impl), f"swiglu_{direction}")(*operands_)
    for t, b in zip(tensors, before, strict=True):
        assert_same_bits(t, b, "an output after a rejected call")


# Negative controls: the bounds reject plausible bugs.


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_negative_controls(impl, dtype):
    """A y with g and u swapped (silu(u) * g: the halves of the fused tensor read the wrong
    way round), or, in 16-bit, with silu(g) rounded to the dtype before the product (an
    intermediate stored once too often), lies outside the bound; the exact y rounded once
    lies inside."""
    g, u = random_rows(8, 512, dtype).cpu(), random_rows(8, 512, dtype).cpu()
    exact = reference.swiglu_forward(g, u)
    bound = forward_bound(impl, g, u, exact)
    g64, u64 = g.double(), u.double()
    wrong = [u64 * torch.sigmoid(u64) * g64]
    if dtype != torch.float32:
        wrong.append((g64 * torch.sigmoid(g64)).to(dtype).double() * u64)
    for y in wrong:
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(y.to(dtype), exact, bound)
    assert_within_bound(exact.to(dtype), exact, bound)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_negative_controls(impl, dtype):
    """A dg without the (1 - s) factor (sigmoid's derivative taken as s), or with dg and du
    exchanged, lies outside the bound; the exact answers rounded once lie inside."""
    g, u, dy = (random_rows(8, 512, dtype).cpu() for _ in range(3))
    exact_dg, exact_du = reference.swiglu_backward(g, u, dy)
    dg_bound, du_bound = backward_bounds(impl, g, u, dy, exact_dg, exact_du)
    g64, u64, dy64 = g.double(), u.double(), dy.double()
    s = torch.sigmoid(g64)
    for wrong in (dy64 * u64 * s * (1 + g64), exact_du):
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong.to(dtype), exact_dg, dg_bound)
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(exact_dg.to(dtype), exact_du, du_bound)
    assert_within_bound(exact_dg.to(dtype), exact_dg, dg_bound)
    assert_within_bound(exact_du.to(dtype), exact_du, du_bound)


def test_reference_backward_matches_autograd():
    """The hand-derived backward (README.md) against float64 torch.autograd of silu(g) * u:
    the same function, so they agree to float64 rounding."""
    g32, u32, dy32 = (3 * torch.randn(5, 37) for _ in range(3))
    g, u, dy = (t.double() for t in (g32, u32, dy32))
    g.requires_grad_(), u.requires_grad_()
    (torch.nn.functional.silu(g) * u).backward(dy)
    dg, du = reference.swiglu_backward(g32, u32, dy32)
    scale = (dy * u).abs() * (1 + g.abs()) + (dy * g).abs()
    assert_within_bound(dg, g.grad, 1e-14 * scale.detach())
    assert_within_bound(du, u.grad, 1e-14 * scale.detach())


# Autograd, the custom ops, the module and torch.compile


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("entry", ["SwiGLUFunction.apply", "swiglu", "SwiGLU"])
@pytest.mark.parametrize("form", FORMS)
def test_autograd_matches_reference_backward(impl, entry, form):
    """Every entry point gives the reference gradients within the backward bound; with the
    fused tensor, its gradient is cat(dg, du)."""
    fns = implementation(impl)
    call = {"SwiGLUFunction.apply": fns.SwiGLUFunction.apply, "swiglu": fns.swiglu,
            "SwiGLU": fns.SwiGLU()}[entry]  # fmt: skip
    g, u = operands(form, 3, 257, torch.float32)
    g.requires_grad_()
    if u is not None:
        u.requires_grad_()
    dy = random_rows(3, 257, torch.float32, 1.0)
    y = call(g, u) if u is not None else call(g)
    check = check_forward(impl, g.detach(), None if u is None else u.detach())
    assert_same_bits(y.detach(), check)
    y.backward(dy)
    dg, du = check_backward(impl, g.detach(), None if u is None else u.detach(), dy)
    assert_same_bits(g.grad, dg)
    if u is not None:
        assert_same_bits(u.grad, du)


class MLP(torch.nn.Module):
    """Llama's MLP: down(swiglu(gate_up(x))), the fused gate-up projection."""

    def __init__(self, swiglu_class, width=32, hidden=48):
        super().__init__()
        self.gate_up = torch.nn.Linear(width, 2 * hidden, bias=False)
        self.act = swiglu_class()
        self.down = torch.nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down(self.act(self.gate_up(x)))


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_compile_fullgraph(impl):
    """torch.compile(fullgraph=True) traces the MLP with the custom op, forward and backward,
    without graph breaks, and computes what the eager model computes. On the CPU the
    aot_eager backend (no code generation) runs the kernels: the same bits."""
    torch.manual_seed(0)
    model = MLP(implementation(impl).SwiGLU).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = torch.randn(5, 32, device=DEVICE)
    eager_out = model(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled_out = compiled(x)
    compiled_out.square().sum().backward()
    same = (
        (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5))
        if ON_GPU
        else assert_same_bits
    )
    same(compiled_out.detach(), eager_out.detach())
    for p, eager_grad in zip(model.parameters(), eager_grads, strict=True):
        same(p.grad, eager_grad)


# (3) Triton: the tiles, and the sm_90 build ------------------------------------------------


def test_triton_tiles():
    """Tiles of a pass's element count: short rows packed several to a tile, never more rows
    than m, long rows split along N; every dtype and pass has a tile, a power of two."""
    assert triton_impl.tile_of(1000, 1, 4096) == (1024, 1, 1)
    assert triton_impl.tile_of(3, 100, 4096) == (4, 128, 1)
    assert triton_impl.tile_of(16384, 14336, 4096) == (1, 4096, 4)
    assert triton_impl.tile_of(16384, 14336, 2048) == (1, 2048, 7)
    assert triton_impl.launch_grid(16384, 14336, (4096, 8))[0] == (65536,)
    assert triton_impl.launch_grid(16384, 14336, (4096, 8))[2]["num_warps"] == 8
    for direction in ("forward", "backward"):
        for dtype in DTYPES:
            elems, warps = triton_impl.TILES[direction, dtype.itemsize]
            assert elems & (elems - 1) == 0 and elems % (32 * warps) == 0


def launch_cases():
    """Forward and backward calls that change what Triton compiles for, one thing at a time:
    the dtype, n (BLOCK_N), m = 1, a row stride off a multiple of 16, an address off 16 bytes,
    the fused gate-up tensor (u's address is g's plus n elements), rows longer than a tile.
    The stand-ins compute nothing."""

    def both(g, u=None):
        y = torch_impl.fresh_output(g, u)
        dy = torch.randn_like(y)
        dg, du = torch.empty_like(g), None if u is None else torch.empty_like(u)
        return lambda: (
            triton_impl.swiglu_forward(g, u, y),
            triton_impl.swiglu_backward(g, u, dy, dg, du),
        )

    for dtype in DTYPES:
        yield both(*operands("separate", 4, 96, dtype))
    yield both(*operands("separate", 4, 1000, torch.float32))
    yield both(*operands("separate", 1, 96, torch.float32))
    yield both(random_rows(4, 97, torch.float32)[:, :96], random_rows(4, 96, torch.float32))
    yield both(
        torch.randn(4 * 96 + 1, device=DEVICE)[1:].view(4, 96), random_rows(4, 96, torch.float32)
    )
    yield both(*operands("fused", 4, 100, torch.bfloat16))
    yield both(*operands("separate", 2, 10000, torch.bfloat16))


# 9 cases of two launches, each a key of its own (g, strided or misaligned, is the backward's
# input too).
MIN_SPECIALISATIONS = 18

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


# Builds both kernels for sm_90 in a child process (under TRITON_INTERPRET=1 they cannot be
# compiled): once with every int argument the constant 1 (what a launch at M = N = 1 does), and
# once as the H200 sees a bf16 (or float32) launch of aligned rows, whose PTX must load and
# store 128 bits at a time, call ex2.approx once and div.rn once per element, and not spill.
TRITON_BUILD_SCRIPT = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl as t

def build(kernel, dtype, ones, tile):
    names = [p.name for p in kernel.params]
    kinds = {p.name: "constexpr" if p.is_constexpr else "*" + dtype if p.name.endswith("_ptr")
             else "i32" for p in kernel.params}
    constexprs = {"ROWS": 1, "BLOCK_N": tile[0]}
    unit = [n for n in names if kinds[n] == "i32" and (ones or n.endswith("n") and
            n.startswith("stride"))]
    constexprs.update({n: 1 for n in unit})
    aligned = [n for n in names if n not in unit and kinds[n] != "constexpr" and n != "m"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(kernel, kinds, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tile[1]}).asm["ptx"]

for kernel, loads, stores in ((t.swiglu_forward_kernel, 2, 1), (t.swiglu_backward_kernel, 3, 2)):
    direction = kernel.fn.__name__.split("_")[1]
    build(kernel, "fp32", ones=True, tile=t.TILES[direction, 4])
    for dtype, size in (("bf16", 2), ("fp32", 4)):
        tile = t.TILES[direction, size]
        ptx = build(kernel, dtype, ones=False, tile=tile)
        per_thread = tile[0] // (32 * tile[1])
        vectors = per_thread * size // 16
        count = lambda op: len(re.findall(op, ptx))
        found = (count(r"ld\\.global\\.v4"), count(r"st\\.global\\.v4"), count(r"ex2\\.approx"),
                 count(r"div\\.rn\\.f32"), count(r"\\.local"))
        expected = (loads * vectors, stores * vectors, per_thread, per_thread, 0)
        assert found == expected, (kernel.fn.__name__, dtype, found, expected)
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the contract tests launch these builds")
def test_triton_builds_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", TRITON_BUILD_SCRIPT], cwd=HERE, env=env,
                           capture_output=True, text=True, check=False)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]


# A learner's call outside test.py: Triton's interpreter patched by triton_impl.py alone.
FRESH_CALL = """
import json, torch, triton_impl
calls = []
for dtype in (torch.bfloat16, torch.float32):
    g, u = (3 * torch.randn(3, 300)).to(dtype), (3 * torch.randn(3, 300)).to(dtype)
    dy = torch.randn(3, 300).to(dtype)
    y = triton_impl.swiglu_forward(g, u, torch.empty_like(g))
    dg, du = triton_impl.swiglu_backward(g, u, dy, torch.empty_like(g), torch.empty_like(u))
    outputs = dict(g=g, u=u, dy=dy, y=y, dg=dg, du=du)
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
        g, u, dy = t["g"], t["u"], t["dy"]
        exact = reference.swiglu_forward(g, u)
        assert_within_bound(t["y"], exact, forward_bound("triton", g, u, exact), "fresh y")
        exact_dg, exact_du = reference.swiglu_backward(g, u, dy)
        dg_bound, du_bound = backward_bounds("triton", g, u, dy, exact_dg, exact_du)
        assert_within_bound(t["dg"], exact_dg, dg_bound, "fresh dg")
        assert_within_bound(t["du"], exact_du, du_bound, "fresh du")


# (4) CuTe builds, dispatch and PTX ---------------------------------------------------------

cute_installed = pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
PASS_OPERANDS = {"forward": (2, 1), "backward": (3, 2)}  # (inputs, outputs) of each pass


@cute_installed
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vectorized", [True, False], ids=["vector", "any stride"])
def test_cute_ptx(direction, dtype, vectorized):
    """The CuTe kernels build for sm_90a. Vector build: each operand's TILE_VECTORS runs per
    thread move as 128-bit accesses; any-stride build: one access per element, none of 128
    bits. Both: per element one mul.f32 by -log2 e (in float32: the two argument roundings of
    EXP_ARGUMENT_ROUNDINGS), one ex2.approx.ftz and one correctly rounded reciprocal (rcp.rn,
    what 1 / x compiles to); no other flushing (a flushed product would break the bound) or
    approximate instruction, no spills."""
    inputs, outputs = PASS_OPERANDS[direction]
    per_thread = cute_impl.TILE_VECTORS * cute_impl.VECTOR_BYTES // dtype.itemsize
    ptx = cute_impl.ptx_of(direction, dtype, vectorized)
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    accesses = cute_impl.TILE_VECTORS if vectorized else per_thread
    assert count(r"ld\.global") == inputs * accesses
    assert count(r"st\.global") == outputs * accesses
    assert count(r"ld\.global\.v4") == (inputs * accesses if vectorized else 0)
    assert count(r"mul\.f32\s+%r\d+, %r\d+, 0fBFB8AA3B") == per_thread
    assert count(r"ex2\.approx\.ftz\.f32") == per_thread == count(r"rcp\.rn\.f32")
    assert count(r"ftz") == count(r"\.approx") == per_thread
    assert count(r"\.local") == 0
    assert cute_impl.EXP_ARGUMENT_ROUNDINGS == 2


@cute_installed
def test_cute_dispatch():
    """The vector build takes rows of whole 16-byte runs on 16-byte boundaries: the fused
    tensor's halves at a model's width, not an odd width (the up half starts mid-run) nor a
    column step."""
    gu = torch.empty(4, 2 * 4096, dtype=torch.bfloat16)
    assert all(cute_impl.is_vector_friendly(half) for half in reference.halves(gu))
    gu_odd = torch.empty(4, 2 * 4100, dtype=torch.bfloat16)  # the up half 8200 bytes in
    assert not cute_impl.is_vector_friendly(reference.halves(gu_odd)[1])
    assert not cute_impl.is_vector_friendly(torch.empty(4, 8, dtype=torch.bfloat16)[:, :7])
    assert not cute_impl.is_vector_friendly(torch.empty(4, 16)[:, ::2])


@pytest.mark.skipif(cute_impl is None or ON_GPU, reason="CPU tensors: checked where no GPU is")
def test_cute_refuses_cpu_tensors():
    """Valid operands on the CPU: a clear error before any compilation or launch."""
    g, u, y = (torch.randn(2, 8) for _ in range(3))
    before = y.clone()
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cute_impl.swiglu_forward(g, u, y)
    assert_same_bits(y, before)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        cute_impl.swiglu_backward(g, None, torch.randn(2, 4), torch.empty(2, 8))


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
    """float32 (m, n) operands, no two laid out alike: the fused tensor's halves, a row slice
    and contiguous rows for the vector build; a column step, a transposed matrix and a row
    slice at an odd offset for the any-stride build."""
    if vectorized:
        gate, up = reference.halves(torch.randn(m, 2 * n))
        layouts = [gate, up, torch.randn(m, n + 16)[:, :n], torch.empty(m, n)]
    else:
        layouts = [torch.randn(m, 2 * n)[:, ::2], torch.randn(n, m).t(),
                   torch.randn(m, n + 13)[:, 3 : 3 + n]]  # fmt: skip
    inputs, outputs = PASS_OPERANDS[direction]
    return [layouts[k % len(layouts)] for k in range(inputs + outputs)]


@pytest.mark.skipif(cute_impl is None or ON_GPU,
                    reason="CPU only (the CuTe DSL installed): on a GPU the contract tests call "
                    "these builds")  # fmt: skip
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("vectorized", [False, True], ids=["any stride", "vector"])
def test_cute_entry_takes_each_operands_layout(direction, vectorized):
    """TVM-FFI checks every operand before the launch; operands in unlike layouts pass those
    checks and reach the launch, which fails here without a driver."""
    kernel = cute_impl.compile_kernel(direction, torch.float32, vectorized)
    operands = entry_operands(direction, vectorized)
    with pytest.raises(RuntimeError, match="Cuda Runtime Error"):
        kernel(*(cuda_labelled(t) for t in operands))


@pytest.mark.skipif(cute_impl is None or ON_GPU, reason="CPU only (the CuTe DSL installed)")
def test_cute_vector_entry_refuses_misaligned_rows():
    """The negative control of the test above: the vector build's entry refuses rows that start
    mid-run, the case is_vector_friendly sends to the any-stride build."""
    kernel = cute_impl.compile_kernel("forward", torch.float32, True)
    operands = [torch.randn(5, 1030)[:, 1:1025], torch.randn(5, 1024), torch.empty(5, 1024)]
    assert not cute_impl.is_vector_friendly(operands[0])
    with pytest.raises(ValueError, match="alignment"):
        kernel(*(cuda_labelled(t) for t in operands))


# (5) GPU only --------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def float64_forward(g, u):
    """The stand-in for reference.py where Python is too slow: the same formula in float64."""
    g64 = g.double()
    return (g64 * torch.sigmoid(g64) * u.double()).cpu()


def float64_backward(g, u, dy):
    g64, u64, dy64 = g.double(), u.double(), dy.double()
    s = torch.sigmoid(g64)
    return (dy64 * u64 * s * (1 + g64 * torch.sigmoid(-g64))).cpu(), (dy64 * g64 * s).cpu()


def test_stand_ins_match_reference():
    """The float64 stand-ins agree with reference.py far below any float32 bound."""
    g, u, dy = (random_rows(3, 1000, torch.float32) for _ in range(3))
    assert (float64_forward(g, u) - reference.swiglu_forward(g.cpu(), u.cpu())).abs().max() < 1e-13
    exact = reference.swiglu_backward(g.cpu(), u.cpu(), dy.cpu())
    for a, b in zip(float64_backward(g, u, dy), exact, strict=True):
        assert (a - b).abs().max() < 1e-13


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n", [(4096, 14336), (1, 262144), (65537, 64)], ids=str)
def test_large_against_float64(impl, dtype, m, n):
    """Llama-sized rows, fused form: y, dg and du within the bound of the float64 stand-in."""
    fns = implementation(impl)
    gu, dy = random_rows(m, 2 * n, dtype), random_rows(m, n, dtype, 1.0)
    gate, up = reference.halves(gu)
    y = fns.swiglu_forward(gu, None, torch_impl.fresh_output(gu, None))
    exact_y = float64_forward(gate, up)
    assert_within_bound(y, exact_y, forward_bound(impl, gate, up, exact_y), f"{impl} y")
    dgu, _ = fns.swiglu_backward(gu, None, dy, torch.empty_like(gu))
    exact_dg, exact_du = float64_backward(gate, up, dy)
    dg_bound, du_bound = backward_bounds(impl, gate, up, dy, exact_dg, exact_du)
    d_gate, d_up = reference.halves(dgu)
    assert_within_bound(d_gate, exact_dg, dg_bound, f"{impl} dg")
    assert_within_bound(d_up, exact_du, du_bound, f"{impl} du")


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
