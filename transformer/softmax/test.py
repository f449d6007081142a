"""Tests for softmax: every implementation, forward and backward, lands within README.md's bound.

Run with `python test.py` (or `nox -s softmax` from the top). Without a GPU, torch runs on the
CPU, Triton under its interpreter, and the CuTe kernels are compiled for sm_90a and their PTX
read; launching them needs the GPU, and those tests say so when they skip.
"""

import itertools
import json
import math
import os
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
    import cute_1_two_pass
    import cute_2_cluster
    import cute_impl
except ImportError as error:  # no CuTe DSL: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"cute_impl cannot be imported ({error})"

# (1) Set-up and the bound model ----------------------------------------------------------------

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
MODULES = {"reference": reference, "torch": torch_impl, "triton": triton_impl, "cute": cute_impl}
# (M, N): no rows, empty rows, 1, primes, 2**k +- 1 and the edges of a CuTe tile (2048 float32,
# 4096 16-bit elements).
SHAPES = [(0, 5), (3, 0), (1, 1), (2, 3), (7, 31), (3, 128), (5, 129), (2, 1023), (1, 4097),
          (3, 2048), (2, 8191)]  # fmt: skip
REFERENCE_MAX_ELEMS = 2**17  # past this, plain Python is slow: the float64 stand-ins take over
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny  # ex2.approx.ftz flushes results below it to 0
EX2 = APPROX_RELATIVE_ERROR["ex2.approx.ftz.f32"]
LOG2E = 1 / math.log(2)
each_impl = pytest.mark.parametrize("impl", IMPLS)
each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
each_impl_and_dtype = pytest.mark.parametrize(
    "impl, dtype", list(itertools.product(IMPLS, DTYPES)), ids=str
)
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
needs_cute = pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")


def module(name):
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    return MODULES[name]


def implementation(name):
    """The implementation's module, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return module(name)


def forward_bound(impl, x, exact):
    """README.md's forward bound, elementwise, from the exact y (float64 rows):

        t_i = |x_i - max| log2 e,  a_i = 2**(gamma_3 t_i)   (the exp argument's roundings)
        rho_i = a_i (1 + EX2)**E (1 + u)**K - 1             (term i's error in the row sum)
        beta = sum_j y_j rho_j + n (E + K) tiny              (the row sum's relative error)
        |y_hat_i - y_i| <= y_i (a_i (1 + EX2)(1 + u)**2 / (1 - beta) - 1) + 4 tiny
    then the store's rounding u_s |y| + (1 + u_s)(...) + underflow(dtype)."""
    n, dtype = x.shape[-1], x.dtype
    if x.numel() == 0:
        return torch.zeros(exact.shape, dtype=torch.float64)
    # E and K each implementation exports; torch sums in an undocumented order, possibly
    # rescaling online: what holds for any order is an exp per element seen and two roundings
    # per addition.
    path = (n + 1, 2 * n) if impl == "torch" else module(impl).forward_path(n, dtype)
    exp_calls, roundings = path
    x64, y = as_rows(x), as_rows(exact)
    shifted = x64 - x64.max(dim=-1, keepdim=True).values
    t = torch.where(torch.isfinite(shifted), shifted.abs() * LOG2E, torch.zeros_like(shifted))
    argument = torch.exp2(gamma(3, U32) * t)
    rho = argument * (1 + EX2) ** exp_calls * (1 + U32) ** roundings - 1
    beta = (y * rho).nan_to_num().sum(dim=-1, keepdim=True) + n * (exp_calls + roundings) * TINY32
    relative = argument * (1 + EX2) * (1 + U32) ** 2 / (1 - beta) - 1
    bound = y.abs() * relative + 4 * TINY32
    u_s = store_roundoff(dtype)
    return (u_s * y.abs() + (1 + u_s) * bound + underflow(dtype)).reshape(exact.shape)


def backward_bound(impl, y, dy, exact):
    """README.md's backward bound: with s = sum_j dy_j y_j, T = sum_j |dy_j y_j| and k the
    roundings on a product's way into s (one for the float32 product, none for 16-bit data),
        |s_hat - s| <= gamma_k T + n tiny (1 + gamma_k)
        |dx_hat_i - dx_i| <= gamma_2 |dx_i| + (1 + gamma_2) |y_i| |s_hat - s| + 2 tiny
    then the store's rounding."""
    n, dtype = y.shape[-1], y.dtype
    if y.numel() == 0:
        return torch.zeros(exact.shape, dtype=torch.float64)
    additions = n if impl == "torch" else module(impl).backward_path(n, dtype)
    k = additions + (1 if dtype == torch.float32 else 0)
    y64, dy64 = as_rows(y), as_rows(dy)
    total = (y64 * dy64).abs().sum(dim=-1, keepdim=True)
    dot_error = gamma(k, U32) * total + n * TINY32 * (1 + gamma(k, U32))
    dx = as_rows(exact)
    g2 = gamma(2, U32)
    bound = g2 * dx.abs() + (1 + g2) * y64.abs() * dot_error + 2 * TINY32
    u_s = store_roundoff(dtype)
    return (u_s * dx.abs() + (1 + u_s) * bound + underflow(dtype)).reshape(exact.shape)


def as_rows(t):
    """t's rows as a float64 CPU (M, N) matrix (reshape(-1, N) is ambiguous for N = 0)."""
    return t.detach().cpu().double().reshape(math.prod(t.shape[:-1]), t.shape[-1])


def random_rows(m, n, dtype, scale=1.0):
    return (scale * torch.randn(m, n, device=DEVICE)).to(dtype)


def float64_softmax(x):
    """The stand-in for reference.py where Python is too slow: the same formula in float64."""
    x64 = x.double()
    e = torch.exp(x64 - x64.max(dim=-1, keepdim=True).values)
    return (e / e.sum(dim=-1, keepdim=True)).cpu()


def float64_softmax_backward(y, dy):
    y64, dy64 = y.double(), dy.double()
    return (y64 * (dy64 - (y64 * dy64).sum(dim=-1, keepdim=True))).cpu()


EXACT = {"forward": (reference.softmax_forward, float64_softmax),
         "backward": (reference.softmax_backward, float64_softmax_backward)}  # fmt: skip
BOUND = {"forward": forward_bound, "backward": backward_bound}


def check(impl, direction, *inputs, out=None):
    """Run impl's forward (inputs x) or backward (y, dy) into out (fresh if None) and hold it
    to the bound; returns out. The exact answer and the bound come first: out may be an input."""
    out = torch.empty_like(inputs[0]) if out is None else out
    exact = EXACT[direction][inputs[0].numel() > REFERENCE_MAX_ELEMS](*(t.cpu() for t in inputs))
    bound = BOUND[direction](impl, *inputs, exact)
    assert getattr(implementation(impl), f"softmax_{direction}")(*inputs, out) is out
    assert_within_bound(out, exact, bound, f"{impl} {direction}")
    return out


def forward_then_backward(impl, x, dy):
    y = check(impl, "forward", x)
    return y, check(impl, "backward", y, dy)


def run_both(fns, x, dy, y=None, dx=None):
    """fns' forward, then its backward on that y, into y and dx (fresh if None)."""
    y = fns.softmax_forward(x, torch.empty_like(x) if y is None else y)
    return y, fns.softmax_backward(y, dy, torch.empty_like(x) if dx is None else dx)


def assert_rejects(wrongs, exact, bound, dtype):
    """A negative control: each wrong answer, rounded to dtype, lies outside the bound; the
    exact answer rounded once lies inside."""
    for wrong in wrongs:
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong.to(dtype), exact, bound)
    assert_within_bound(exact.to(dtype), exact, bound)


# (2) The contract over every implementation ---------------------------------------------------


@each_impl_and_dtype
@pytest.mark.parametrize("m, n", SHAPES, ids=str)
def test_matches_reference(impl, dtype, m, n):
    forward_then_backward(impl, random_rows(m, n, dtype), random_rows(m, n, dtype))


def operands(kind, dtype, m=5, n=1031):
    """(x, dy) in a layout other than contiguous rows."""
    if kind == "leading dims":  # a (2, 3, 5, 33) tensor is 30 rows of 33
        return (random_rows(30, 33, dtype).view(2, 3, 5, 33) for _ in range(2))
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


@each_impl_and_dtype
@pytest.mark.parametrize(
    "kind",
    ["leading dims", "row slice", "column step", "transposed", "unmergeable", "broadcast dy"],
)
def test_strided_operands(impl, dtype, kind):
    forward_then_backward(impl, *operands(kind, dtype))


def poisoned_view(m, n, dtype, margin=7):
    """(buffer, view, outside): an (m, n) view inside a NaN-filled buffer, rows 2n + 2 margin
    apart, and the mask of the buffer's elements outside the view."""
    buffer = torch.full((m + 2, 2 * n + 2 * margin), float("nan"), device=DEVICE, dtype=dtype)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[1 : m + 1, margin : margin + n] = False
    return buffer, buffer[1 : m + 1, margin : margin + n], outside


@each_impl_and_dtype
@pytest.mark.parametrize("n", [1, 129, 4099])
def test_outputs_inside_guard(impl, dtype, n):
    """y and dx are views into NaN: every element of the view is written (within the bound,
    so not NaN) and nothing outside it changes."""
    x, dy = random_rows(3, n, dtype), random_rows(3, n, dtype)
    (y_buffer, y, y_outside), (dx_buffer, dx, dx_outside) = (
        poisoned_view(3, n, dtype) for _ in "yx"
    )
    check(impl, "backward", check(impl, "forward", x, out=y), dy, out=dx)
    assert y_buffer[y_outside].isnan().all() and dx_buffer[dx_outside].isnan().all()


@each_impl
def test_in_place(impl):
    """y may be x itself, and dx may be dy: every row is read before it is written."""
    x, dy = random_rows(4, 3001, torch.float32), random_rows(4, 3001, torch.float32)
    assert check(impl, "backward", check(impl, "forward", x, out=x), dy, out=dy) is dy


def special_rows(dtype, n=300):
    """Rows of random logits with special values planted, one case per row."""
    inf, nan = float("inf"), float("nan")
    x = random_rows(7, n, dtype)
    x[0, ::3] = -inf  # masked logits
    x[1, :] = -inf  # a fully masked row: NaN, as in torch
    x[2, 17] = inf
    x[3, n // 2] = nan
    x[4, :] = (1e4 * torch.randn(n, device=DEVICE)).to(dtype)  # large logits: no overflow
    x[5, :-1] = -inf  # one live logit: y = 1 there
    x[6, :] = x[6, 0]  # all equal: y = 1/n
    return x


@each_impl_and_dtype
def test_special_values(impl, dtype):
    """-inf entries give 0 and leave the row alone; a row of -inf, a +inf or a NaN make the
    row NaN; 1e4-sized logits do not overflow. The reference defines it, and torch agrees."""
    x = special_rows(dtype)
    y = check(impl, "forward", x)
    torch_y = torch.softmax(x.double(), dim=-1).to(dtype)
    assert torch.equal(y.isnan(), torch_y.isnan())
    assert y[[0, 4, 5, 6]].isfinite().all() and y[[1, 2, 3]].isnan().all()
    finite = y[[0, 4, 5, 6]]
    check(impl, "backward", finite, random_rows(*finite.shape, dtype))


@each_impl_and_dtype
def test_repeatability(impl, dtype):
    """Two runs give the same bits: every sum is a fixed tree."""
    fns, x, dy = implementation(impl), random_rows(3, 5003, dtype), random_rows(3, 5003, dtype)
    for first, second in zip(run_both(fns, x, dy), run_both(fns, x, dy), strict=True):
        assert_same_bits(first, second)


def bad_inputs():
    """(operands of forward or backward, expected error, words the message must contain)"""
    f32 = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    buffer = f32(4, 20)
    yield "forward", ([[1.0]], f32(1, 1)), TypeError, "x must be a torch.Tensor"
    yield "forward", (f32(()), f32(())), ValueError, "0-dim"
    yield "forward", (f32(3, 4), f32(3, 5)), ValueError, "y has shape"
    yield "forward", (f32(3, 4).double(), f32(3, 4).double()), TypeError, "supported"
    yield "forward", (f32(3, 4), f32(3, 4).half()), TypeError, "y has dtype"
    yield "forward", (f32(3, 4), f32(1, 4).expand(3, 4)), ValueError, "one address"
    yield "forward", (buffer[:, 0:10], buffer[:, 5:15]), ValueError, "partially overlaps"
    yield "backward", (f32(3, 4), f32(3, 4).bfloat16(), f32(3, 4)), TypeError, "dy has dtype"
    yield "backward", (f32(3, 4), f32(4, 3), f32(3, 4)), ValueError, "dy has shape"
    yield "backward", (buffer[:, 0:10], f32(4, 10), buffer[:, 2:12]), ValueError, "dx partially"
    if ON_GPU:
        yield "forward", (f32(3, 4), torch.randn(3, 4)), ValueError, "is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from reference.check_*, the first thing every implementation calls, so the
    CuTe entry points are checked on the CPU too; the output is untouched."""
    direction, operands, error, words = case
    output = operands[-1]
    before = output.clone() if isinstance(output, torch.Tensor) else None
    with pytest.raises(error, match=words):
        getattr(module(impl), f"softmax_{direction}")(*operands)
    if before is not None:
        assert_same_bits(output, before, "the output after a rejected call")


@each_dtype
def test_negative_controls(dtype):
    """The bounds reject plausible bugs. Two logits per row are pinned at 6, so each holds a
    few percent of the row's mass, far above any dtype's rounding. Forward: y normalised by
    the neighbour row's sum, or by a sum that dropped one term; backward: a dx whose dot
    dropped one (large) term, or took the neighbour row's dot."""
    x = random_rows(4, 1024, dtype).cpu()
    x[:, 10], x[:, 500] = 6.0, 6.0
    exact_y = reference.softmax_forward(x)
    x64 = x.double()
    e = torch.exp(x64 - x64.max(dim=-1, keepdim=True).values)
    sums = e.sum(dim=-1, keepdim=True)
    wrong_ys = [e / sums.roll(1, dims=0), e / (sums - e[:, 10:11])]
    assert_rejects(wrong_ys, exact_y, forward_bound("triton", x, exact_y), dtype)
    y, dy = exact_y.to(dtype), random_rows(4, 1024, dtype).cpu()
    dy[:, 10] = 3.0
    exact_dx = reference.softmax_backward(y, dy)
    y64, dy64 = y.double(), dy.double()
    dot = (y64 * dy64).sum(dim=-1, keepdim=True)
    wrong_dxs = [
        y64 * (dy64 - wrong)
        for wrong in (dot - y64[:, 10:11] * dy64[:, 10:11], dot.roll(1, dims=0))
    ]
    assert_rejects(wrong_dxs, exact_dx, backward_bound("triton", y, dy, exact_dx), dtype)


def test_reference_backward_matches_autograd():
    """The hand-derived backward (README.md) against float64 torch.autograd of torch.softmax:
    they differ only by the rounding of y to float32 that reference.softmax_backward is given,
    a change of at most u |y_j| in each y_j, so |d dx_i| <= 4u |y_i| (|dy_i - s| + T)."""
    x = torch.randn(5, 37, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 37, dtype=torch.float64)
    torch.softmax(x, dim=-1).backward(dy)
    y32 = torch.softmax(x.detach(), dim=-1).float()
    ours = reference.softmax_backward(y32, dy.float())
    y64, dy64 = y32.double(), dy.float().double()
    s = (y64 * dy64).sum(dim=-1, keepdim=True)
    slack = 4 * U32 * y64.abs() * ((dy64 - s).abs() + (y64 * dy64).abs().sum(-1, keepdim=True))
    assert_within_bound(ours, x.grad, slack + 1e-15)


# Autograd, the custom ops and torch.compile


ENTRIES = {
    "SoftmaxFunction.apply": lambda fns: fns.SoftmaxFunction.apply,
    "softmax": lambda fns: fns.softmax,
    "Softmax(dim=-1)": lambda fns: fns.Softmax(dim=-1),
    "Softmax(dim=0) of x.t()": lambda fns: lambda x: fns.Softmax(dim=0)(x.t()).t(),
}


@each_impl
@pytest.mark.parametrize("entry", ENTRIES)
def test_autograd_matches_reference(impl, entry):
    """The autograd.Function, the user-facing softmax (a custom op with its own autograd) and
    the nn.Module (over the last dim, and over dim 0 of a transpose: moved last and back) give
    the reference y within the forward bound, and the reference backward of their own y."""
    x, dy = random_rows(3, 257, torch.float32), random_rows(3, 257, torch.float32)
    y = ENTRIES[entry](implementation(impl))(x.requires_grad_())
    exact_y = reference.softmax_forward(x.detach().cpu())
    assert_within_bound(y, exact_y, forward_bound(impl, x.detach(), exact_y))
    y.backward(dy)
    exact = reference.softmax_backward(y.detach().cpu(), dy.cpu())
    assert_within_bound(x.grad, exact, backward_bound(impl, y.detach(), dy, exact))


@each_impl
def test_module_is_a_drop_in_for_torch(impl):
    """Softmax(dim) has torch.nn.Softmax's repr, empty state_dict and output layout."""
    fns = implementation(impl)
    ours, theirs = fns.Softmax(dim=1), torch.nn.Softmax(dim=1)
    assert repr(ours) == repr(theirs) and ours.state_dict() == theirs.state_dict() == {}
    x = random_rows(6, 200, torch.float32).view(6, 40, 5)
    assert ours(x).stride() == theirs(x).stride()
    with pytest.raises(TypeError, match="dim must be an int"):
        fns.Softmax(dim=None)


def dz_error(impl, z, y_hat, c):
    """The bound on |dz_hat - dz|, dz = y (c - sum_j c_j y_j) (README.md, "In training")."""
    y = reference.softmax_forward(z.cpu())
    f = forward_bound(impl, z, y)
    c64 = c.cpu().double()
    s = (y * c64).sum(dim=-1, keepdim=True)
    through_y = f * (c64.abs() + s.abs()) + (y + f) * (c64.abs() * f).sum(dim=-1, keepdim=True)
    exact_dz = reference.softmax_backward(y_hat.cpu(), c.cpu())
    return through_y + backward_bound(impl, y_hat, c, exact_dz)


def sgd_step(softmax, impl, state, x, c, lr):
    """One SGD step of linear -> softmax -> loss sum(c * y) from the linear layer's `state`:
    (the new state, the new P = [weight | bias], dloss/dz, dz_error's bound on it)."""
    linear = torch.nn.Linear(x.shape[1], c.shape[1], device=DEVICE)
    linear.load_state_dict(state)
    z = linear(x)
    z.retain_grad()
    y = softmax(z)
    (y * c).sum().backward()
    torch.optim.SGD(linear.parameters(), lr=lr).step()
    new = torch.cat([linear.weight, linear.bias[:, None]], dim=1).detach()
    return linear.state_dict(), new, z.grad, dz_error(impl, z.detach(), y.detach(), c)


@each_impl
def test_module_trains_like_torch(impl):
    """A linear layer, Softmax(dim=-1) and a loss sum(c * y), four SGD steps: from the same
    parameters P, a step with our Softmax lands on the step with torch.nn.Softmax within
    README.md's bound ("In training"). Both continue from torch's P, so the bound stays one
    step's. Negative control: a step whose gradient missed one example of the batch."""
    fns = implementation(impl)
    torch.manual_seed(0)
    lr, state = 0.5, torch.nn.Linear(16, 33, device=DEVICE).state_dict()
    for _ in range(4):
        old = torch.cat([state["weight"], state["bias"][:, None]], dim=1).cpu().double()
        x, c = random_rows(8, 16, torch.float32), random_rows(8, 33, torch.float32)
        x1 = torch.cat([x, torch.ones(8, 1, device=DEVICE)], dim=1)  # [x | 1]: 1 meets the bias
        _, ours, dz, error = sgd_step(fns.Softmax(dim=-1), impl, state, x, c, lr)
        state, theirs, dz_torch, error_torch = sgd_step(
            torch.nn.Softmax(-1), "torch", state, x, c, lr
        )
        x1_abs = x1.cpu().double().abs()
        g = (dz.cpu().double().abs() + dz_torch.cpu().double().abs()).T @ x1_abs
        gradient = (error + error_torch).T @ x1_abs + gamma(8, U32) * g
        bound = lr * gradient + gamma(2, U32) * (2 * old.abs() + lr * g)
        assert_within_bound(ours, theirs, bound, f"{impl} parameters")
        missing_one = theirs + lr * dz_torch[:1].T @ x1[:1]
        assert_rejects([missing_one], theirs, bound, torch.float32)


@pytest.mark.parametrize("impl", ["triton", "cute"])
def test_torch_compile_fullgraph(impl):
    """torch.compile(fullgraph=True) traces a model that calls the module (so the custom op),
    forward and backward, without graph breaks, and computes what the eager model computes.
    On the CPU the aot_eager backend (no code generation) runs the interpreted Triton kernels."""
    fns = implementation(impl)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), fns.Softmax(dim=-1)).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = torch.randn(5, 16, device=DEVICE)
    eager_out = model(x)
    eager_out.square().sum().backward()
    eager_grad = model[0].weight.grad.clone()
    model.zero_grad()
    compiled_out = compiled(x)
    compiled_out.square().sum().backward()
    assert_same_bits(compiled_out.detach(), eager_out.detach())
    assert_same_bits(model[0].weight.grad, eager_grad)


# (3) Triton: the looped kernels and the dispatch between the two kernel shapes ---------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [33, 100, 257])
def test_triton_looped_kernels(dtype, n, monkeypatch):
    """With the register limits at 32 and chunks of 16 lanes, short rows take the looped
    kernels (online max and sum over several chunks, the second pass last chunk first): the
    path the H200 takes past ROW_BLOCK_MAX, at sizes the interpreter runs."""
    monkeypatch.setattr(triton_impl, "ROW_BLOCK_MAX", 32)
    monkeypatch.setattr(triton_impl, "BACKWARD_ROW_BLOCK_MAX", 32)
    monkeypatch.setattr(triton_impl, "CHUNK", 16)
    x = random_rows(3, n, dtype)
    x[0, :20] = float("-inf")  # a first chunk of -inf only: the online rescale must not NaN
    x[1, 40:] = float("-inf")
    forward_then_backward("triton", x, random_rows(3, n, dtype))
    assert triton_impl.forward_path(n, dtype)[0] == -(-n // 16) + 1


def test_triton_dispatch():
    """Rows up to ROW_BLOCK_MAX go to the rows kernel, several short rows per program."""
    grid, constants = triton_impl.rows_launch(1000, 1, 32768)
    assert grid == (1,) and (constants["ROWS"], constants["BLOCK_N"]) == (1024, 1)
    assert triton_impl.rows_launch(3, 100, 32768)[1]["ROWS"] == 4  # never more than m needs
    grid, constants = triton_impl.rows_launch(8, 32768, 32768)
    assert grid == (8,) and (constants["ROWS"], constants["BLOCK_N"]) == (1, 32768)
    assert constants["num_warps"] == 32
    assert triton_impl.rows_launch(8, 32769, 32768) is None


def test_triton_looped_at_real_size():
    """N = 40000 > ROW_BLOCK_MAX at the real constants: 10 chunks of 4096 lanes."""
    forward_then_backward("triton", *(random_rows(2, 40000, torch.bfloat16) for _ in "xy"))


def launch_cases():
    """Forward and backward calls that change what Triton compiles for, one thing at a time:
    the dtype, n (BLOCK_N), m = 1, a row stride off a multiple of 16, an address off 16 bytes,
    rows past ROW_BLOCK_MAX (the looped kernels). The stand-ins compute nothing."""

    def both(x):
        y, dy, dx = torch.empty_like(x), torch.randn_like(x), torch.empty_like(x)
        return lambda: (triton_impl.softmax_forward(x, y), triton_impl.softmax_backward(y, dy, dx))

    for dtype in DTYPES:
        yield both(random_rows(4, 96, dtype))
    yield both(random_rows(4, 1000, torch.float32))
    yield both(random_rows(1, 96, torch.float32))
    yield both(random_rows(4, 97, torch.float32)[:, :96])
    yield both(torch.randn(4 * 96 + 1, device=DEVICE)[1:].view(4, 96))
    yield both(random_rows(2, 40000, torch.bfloat16))


# 8 cases of two launches; the backwards after the strided and the misaligned x see only
# contiguous, aligned operands (empty_like), as the float32 case's does.
MIN_SPECIALISATIONS = 14

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
    y = triton_impl.softmax_forward(x, torch.empty_like(x))
    dx = triton_impl.softmax_backward(y, dy, torch.empty_like(x))
    outputs = dict(x=x, dy=dy, y=y, dx=dx)
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
        exact = reference.softmax_forward(t["x"])
        assert_within_bound(t["y"], exact, forward_bound("triton", t["x"], exact), "fresh y")
        exact = reference.softmax_backward(t["y"], t["dy"])
        bound = backward_bound("triton", t["y"], t["dy"], exact)
        assert_within_bound(t["dx"], exact, bound, "fresh dx")


# (4) CuTe builds and PTX ---------------------------------------------------------------------


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_ptx(direction, dtype):
    """The CuTe kernels build for sm_90a: 128-bit loads and stores on the vector path (none in
    the any-stride build), the warp shuffles of block_sum, and in the forward the ex2.approx
    and the correctly rounded reciprocal README.md's bound counts."""
    vector = cute_impl.ptx_of(direction, dtype, contiguous=True)
    scalar = cute_impl.ptx_of(direction, dtype, contiguous=False)
    assert "ld.global.v4" in vector and "st.global.v4" in vector
    assert "ld.global.v4" not in scalar
    assert "shfl.sync.bfly" in vector
    if direction == "forward":
        assert "ex2.approx.ftz.f32" in vector and "rcp.rn.f32" in vector
        assert "div.approx" not in vector and "rcp.approx" not in vector


LONGEST_PLANNED = {"forward": 131072, "backward": 131072}  # clusters of 8 and 16 blocks


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
@each_dtype
def test_cute_cluster_ptx(direction, dtype):
    """Step 2 builds for sm_90a: the block's rank in its cluster, mapa and st.async into the
    peers' shared memory completing an mbarrier's bytes, the wait on it, the cluster barrier
    that orders the mbarriers' set-up, 128-bit accesses, in the forward one exp per element
    held (no online rescale: the max is known first), and what keeps the slice of every
    operand in flight (README.md, step 2)."""
    plan = cute_impl.kernel_plan(direction, LONGEST_PLANNED[direction], dtype)
    assert plan[1] > 1
    ptx = cute_impl.ptx_of(direction, dtype, contiguous=True, plan=plan)
    for instruction in (
        "%cluster_ctarank", "mapa.shared::cluster", "mbarrier.try_wait", "barrier.cluster.arrive",
        "st.async.shared::cluster.mbarrier::complete_tx::bytes", "barrier.cluster.wait",
        "ld.global.v4", "st.global.v4",
    ):  # fmt: skip
        assert instruction in ptx, instruction
    exps = cute_2_cluster.CLUSTER_VALUES if direction == "forward" else 0
    assert ptx.count("ex2.approx.ftz.f32") == exps
    assert ("rcp.rn.f32" in ptx) == (direction == "forward")
    # The whole slice of every operand in flight at once: its 128-bit loads in one
    # straight-line block (no branch between two of them), and the register budget of
    # BLOCKS_PER_SM blocks an SM.
    slice_vectors = cute_2_cluster.CLUSTER_VALUES * dtype.itemsize // cute_impl.VECTOR_BYTES
    assert longest_load_run(ptx) == slice_vectors
    assert f".minnctapersm {cute_2_cluster.BLOCKS_PER_SM}" in ptx


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_cute_single_block_ptx(direction):
    """A row one block holds (C = 1, bf16 N = 8192: two tiles of each operand): no cluster
    instructions, and the loads of every operand in one straight-line block."""
    plan = cute_impl.kernel_plan(direction, 8192, torch.bfloat16)
    assert plan == (2, 1)
    ptx = cute_impl.ptx_of(direction, torch.bfloat16, contiguous=True, plan=plan)
    for instruction in ("%cluster_ctarank", "mapa", "st.async", "barrier.cluster", "mbarrier"):
        assert instruction not in ptx, instruction
    operands = cute_2_cluster.OPERANDS_HELD[direction]
    assert longest_load_run(ptx) == operands * 2 * cute_1_two_pass.VECTORS_PER_THREAD


def longest_load_run(ptx):
    """The most 128-bit loads in a row of PTX with no label or branch between them."""
    run = longest = 0
    for line in ptx.splitlines():
        if "ld.global.v4" in line:
            run += 1
            longest = max(longest, run)
        elif line.startswith("$L") or "bra" in line:
            run = 0
    return longest


@needs_cute
def test_load_run_rejects_tile_by_tile_loads():
    """Negative control of the check above: step 1, which loads a tile (two vectors a
    thread) and uses it before the next, shows runs of two."""
    ptx = cute_impl.ptx_of("forward", torch.bfloat16, contiguous=True)
    assert longest_load_run(ptx) == cute_1_two_pass.VECTORS_PER_THREAD


PLANNED_N = sorted({n for k in range(19) for n in (2**k - 1, 2**k, 2**k + 1)} - {0})


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
@each_dtype
def test_cute_plans(direction, dtype):
    """Every N from 1 to 262144 (2**k and its neighbours): step 2's plan (T tiles a block, C
    blocks a cluster) covers the row with the fewest powers of two, within the registers a
    thread holds (CLUSTER_VALUES over the operands) and MAX_CLUSTER; the rows past that, and
    only those, take step 1."""
    width = dtype.itemsize * 8
    tile_elems, per_thread = cute_1_two_pass.tile_shape(width)
    slice_tiles = cute_2_cluster.CLUSTER_VALUES // cute_2_cluster.OPERANDS_HELD[direction]
    slice_tiles //= per_thread
    longest = cute_2_cluster.MAX_CLUSTER * slice_tiles * tile_elems
    for n in PLANNED_N:
        plan = cute_impl.kernel_plan(direction, n, dtype)
        if n > longest:
            assert plan is None, n
            continue
        tiles, size = plan
        assert tiles & (tiles - 1) == 0 and size & (size - 1) == 0, (n, plan)
        assert tiles * size * tile_elems >= n, (n, plan)  # covers the row
        assert tiles <= slice_tiles and size <= cute_2_cluster.MAX_CLUSTER, (n, plan)
        assert size == 1 or tiles == slice_tiles, (n, plan)  # a cluster only past one block
        assert tiles * size == 1 or tiles * size * tile_elems < 2 * n, (n, plan)  # the fewest
    assert cute_impl.kernel_plan(direction, longest + 1, dtype) is None


@needs_cute
def test_cute_dispatch():
    """The plans bench.py's shapes take, and the bound's counts that follow from them."""
    plan = cute_impl.kernel_plan
    assert plan("forward", 131072, torch.bfloat16) == (4, 8)
    assert plan("backward", 131072, torch.bfloat16) == (2, 16)
    assert plan("backward", 131072, torch.float32) == (4, 16)
    assert plan("forward", 262144, torch.float32) == (8, 16)
    assert plan("backward", 262144, torch.bfloat16) is None
    assert plan("backward", 4096, torch.bfloat16) == plan("forward", 1, torch.float32) == (1, 1)
    assert cute_impl.forward_path(65536, torch.bfloat16) == (1, 6 + 8 + 2)
    assert cute_impl.backward_path(131072, torch.bfloat16) == 5 + 8 + 4
    assert cute_impl.backward_path(262144, torch.bfloat16) == 4 + 1 + 63 + 8  # step 1


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
@each_dtype
def test_cute_every_plan_builds(direction, dtype):
    """Every plan of the N above compiles for sm_90a (both access widths of the largest)."""
    plans = {cute_impl.kernel_plan(direction, n, dtype) for n in PLANNED_N} - {None}
    for plan in sorted(plans):
        assert "ld.global" in cute_impl.ptx_of(direction, dtype, contiguous=True, plan=plan)
    assert "ld.global.v4" not in cute_impl.ptx_of(direction, dtype, False, plan=max(plans))


# (5) GPU only --------------------------------------------------------------------------------


def test_stand_ins_match_reference():
    """The float64 stand-ins agree with reference.py to far below any float32 bound."""
    x, dy = random_rows(3, 1000, torch.float32), random_rows(3, 1000, torch.float32)
    exact = reference.softmax_forward(x.cpu())
    assert (float64_softmax(x) - exact).abs().max() < 1e-15
    y = exact.float().to(dy.device)
    exact_dx = reference.softmax_backward(y.cpu(), dy.cpu())
    assert (float64_softmax_backward(y, dy) - exact_dx).abs().max() < 1e-15


@gpu_only
@each_impl
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "m, n", [(64, 8192), (16, 32000), (5, 32768), (4, 40000), (8, 65537), (3, 131072), (2, 262144)]
)
def test_large_rows_against_float64(impl, dtype, m, n):
    """Long rows (every kernel's long-row path) against the float64 stand-ins."""
    forward_then_backward(impl, random_rows(m, n, dtype, scale=3.0), random_rows(m, n, dtype))


@gpu_only
@each_dtype
def test_cute_cluster_special_values_and_bits(dtype):
    """Step 2 at N = 40000 (forward: clusters of 4, backward: of 8, the last block's slice
    mostly past N): the special rows follow the definition, as torch does, and two runs give
    the same bits, whichever block of a cluster sends first."""
    x = special_rows(dtype, n=40000)
    y = check("cute", "forward", x)
    assert torch.equal(y.isnan(), torch.softmax(x.double(), dim=-1).isnan())
    assert_same_bits(y, cute_impl.softmax_forward(x, torch.empty_like(x)))
    finite, dy = y[[0, 4, 5, 6]], random_rows(4, 40000, dtype)
    dx = check("cute", "backward", finite, dy)
    assert_same_bits(dx, cute_impl.softmax_backward(finite, dy, torch.empty_like(dy)))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n", [(5, 4099), (3, 40000)])
def test_cute_step1_at_step2_sizes(dtype, m, n, monkeypatch):
    """Step 1 (two passes), which bench.py times as cute.step1 and which takes only the rows
    past step 2's plans, still lands within its own bound at rows step 2 would take."""
    monkeypatch.setattr(cute_impl, "kernel_plan", lambda direction, n, dtype: None)
    forward_then_backward("cute", random_rows(m, n, dtype, scale=3.0), random_rows(m, n, dtype))


@gpu_only
@each_impl_and_dtype
def test_cuda_graph_replays_the_eager_call(impl, dtype):
    """Captured in a CUDA graph, forward and backward replay on fresh data with the bits of an
    eager call: the launchers work on torch's current stream and do nothing a capture misses."""
    fns = implementation(impl)
    x, dy, y, dx = (random_rows(5, 4099, dtype) for _ in range(4))
    run_both(fns, x, dy, y, dx)  # compile and load first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_both(fns, x, dy, y, dx)
    x.copy_(random_rows(5, 4099, dtype))
    dy.copy_(random_rows(5, 4099, dtype))
    graph.replay()
    replayed = (y.clone(), dx.clone())
    y.fill_(float("nan"))
    dx.fill_(float("nan"))
    for got, eager in zip(replayed, run_both(fns, x, dy, y, dx), strict=True):
        assert_same_bits(got, eager)


@gpu_only
def test_ex2_error_within_common_figure():
    """The measurement behind common/README.md's ex2.approx.ftz.f32 figure: tl.exp2 (which
    compiles to it) over 2**24 float32 arguments in [-126, 0], against float64 2**a."""
    import triton
    import triton.language as tl

    @triton.jit
    def exp2_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.exp2(tl.load(a_ptr + offs)))

    a = -126 * torch.rand(2**24, device=DEVICE)
    out = torch.empty_like(a)
    exp2_kernel[(a.numel() // 1024,)](a, out, BLOCK=1024)
    exact = torch.exp2(a.double())
    relative = ((out.double() - exact) / exact).abs().max().item()
    print(f"ex2.approx.ftz.f32: largest relative error {relative:.3e} = {relative / U32:.2f} u")
    assert relative <= EX2


if __name__ == "__main__":
    options = ["-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    sys.exit(pytest.main([__file__, *options, *sys.argv[1:]]))
