"""SwiGLU tests, section (2): the contract over every implementation, and training.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import math

import pytest
import torch
from test import (
    DEVICE,
    DTYPES,
    FORMS,
    IMPLS,
    ON_GPU,
    SHAPES,
    backward_bounds,
    check_backward,
    check_forward,
    cute_impl,
    forward_bound,
    forward_then_backward,
    implementation,
    module,
    operands,
    random_rows,
)
from torch._subclasses.fake_tensor import FakeTensorMode

import reference
from common.tolerance import assert_same_bits, assert_within_bound

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


def far_rows(t, path):
    """t copied into a view whose rows lie 2**27 elements apart, so that rows from the 17th
    on start past 2**31 elements from the first: device memory on a GPU, on the CPU a sparse
    file at `path` mapped privately, so that only the pages of its rows take any."""
    m, width = t.shape
    size = (m - 1) * 2**27 + width
    if t.is_cuda:
        buffer = torch.empty(size, dtype=t.dtype, device=t.device)
    else:
        with open(path, "wb") as file:
            file.truncate(size * t.element_size())
        buffer = torch.from_file(str(path), shared=False, size=size, dtype=t.dtype)
    return buffer.as_strided(t.shape, (2**27, 1)).copy_(t)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", FORMS)
def test_rows_past_2_31_elements(impl, form, tmp_path):
    """g and u (or the fused gu, whose up half starts N elements into each row) read from, and
    y, dg and du written into, views whose rows from the 17th on start past 2**31 elements
    from their first (bf16, whole 16-byte runs: CuTe's vector build): within the bound, where
    a 32-bit row offset wraps and reads or writes outside the view (on the CPU a segmentation
    fault of the interpreter; on a GPU an illegal address, which ends the process's CUDA
    context: run it alone first, `python test.py -k past_2_31`)."""
    m, n = 20, 24
    g, u = operands(form, m, n, torch.bfloat16)
    far = {name: None if t is None else far_rows(t, tmp_path / name)
           for name, t in (("g", g), ("u", u), ("y", torch.empty(m, n, dtype=g.dtype,
           device=g.device)), ("dg", g), ("du", u))}  # fmt: skip
    check_forward(impl, far["g"], far["u"], far["y"])
    dy = random_rows(m, n, torch.bfloat16, scale=1.0)
    check_backward(impl, far["g"], far["u"], dy, far["dg"], far["du"])


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_operands_sharing_one_buffer(impl, dtype):
    """Views that interleave in memory but share no element: y beside g and u in one (M, 3N)
    buffer (g and u unchanged), and dg and du as the two halves of one NaN-filled (M, 2N)
    gradient, within the bounds; then in place over the halves of the fused gate-up tensor
    (dg = g, du = u), the same bits."""
    m, n = 3, 1000
    gate_up_y = random_rows(m, 3 * n, dtype)
    g, u, y = gate_up_y.split(n, dim=1)
    before = gate_up_y[:, : 2 * n].clone()
    check_forward(impl, g, u, y)
    assert_same_bits(gate_up_y[:, : 2 * n], before, "g and u beside y")
    g, u = reference.halves(random_rows(m, 2 * n, dtype))
    dy = random_rows(m, n, dtype, 1.0)
    gradient = torch.full((m, 2 * n), math.nan, dtype=dtype, device=DEVICE)
    check_backward(impl, g, u, dy, *reference.halves(gradient))
    implementation(impl).swiglu_backward(g, u, dy, g, u)
    assert_same_bits(torch.cat((g, u), dim=1), gradient, "dg, du in place over g, u")


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


# In a training loop: what a model does around the op beyond forward and backward


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", FORMS)
def test_double_backward_raises(impl, form):
    """The backward is not itself differentiable: a second derivative (create_graph=True, as a
    gradient penalty asks) raises rather than giving a wrong answer silently (zero through the
    kernels' outputs, or an in-place error from inside torch's backward)."""
    fns = implementation(impl)
    g, u = operands(form, 3, 17, torch.float32)
    inputs = [t.requires_grad_() for t in (g, u) if t is not None]
    c = random_rows(3, 17, torch.float32)
    # a loss quadratic in y (dy requires grad) and one linear in y (dy a constant: the
    # gradients still depend on g and u)
    for loss in (lambda y: y.square().sum(), lambda y: (y * c).sum()):
        grads = torch.autograd.grad(loss(fns.swiglu(g, u)), inputs, create_graph=True)
        with pytest.raises(RuntimeError, match="not differentiable"):
            (sum(d.square().sum() for d in grads) + g.sum()).backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_module_pickles(impl):
    """torch.save of a whole model pickles the module's class by name: the class must be found
    where the implementation file binds it."""
    import pickle

    fns = implementation(impl)
    again = pickle.loads(pickle.dumps(fns.SwiGLU()))
    assert type(again) is fns.SwiGLU
    g, u = operands("two tensors", 3, 17, torch.float32)
    assert_same_bits(again(g, u), fns.swiglu(g, u))


def check_op(impl, name, args):
    """torch.library.opcheck of kernel_course::<name> (the schema: no undeclared mutation or
    alias; the fake against the real outputs' shapes, strides and dtypes; the autograd
    registration; AOTAutograd's dynamic-shape trace). CuTe's kernels launch only on a GPU:
    without one, its fake is checked against the real Triton op's outputs."""
    if impl == "cute" and cute_impl is None:
        pytest.skip("cute_impl cannot be imported (test.py says why)")
    op = getattr(torch.ops.kernel_course, name.format(impl))
    if impl != "cute" or ON_GPU:
        torch.library.opcheck(op, args)
        return
    real = getattr(torch.ops.kernel_course, name.format("triton"))(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


@pytest.mark.parametrize("impl", ["torch", "triton", "cute"])
def test_custom_ops_pass_opcheck(impl):
    """Both ops on representative operands: float32 that requires grad (two tensors and the
    fused gate-up one), row-strided bfloat16 slices, and the backward given the stride-0
    gradient that loss = y.sum() sends and a transposed one."""
    g, u = (random_rows(5, 33, torch.float32) for _ in range(2))
    gu = random_rows(5, 66, torch.float32)
    grad = lambda t: t.clone().requires_grad_()  # noqa: E731
    forward, backward = "swiglu_{}_forward", "swiglu_{}_backward"
    check_op(impl, forward, (grad(g), grad(u)))
    check_op(impl, forward, (grad(gu), None))
    check_op(impl, forward, tuple(random_rows(5, 40, torch.bfloat16)[:, :33] for _ in range(2)))
    check_op(impl, backward, (g, u, torch.ones((), device=DEVICE).expand(5, 33)))
    check_op(impl, backward, (gu, None, random_rows(33, 5, torch.float32).t()))
