"""Softmax tests, section (2): the contract over every implementation, and training.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
import torch
from test import (
    DEVICE,
    IMPLS,
    ON_GPU,
    SHAPES,
    U32,
    assert_rejects,
    backward_bound,
    check,
    cute_impl,
    each_dtype,
    each_impl,
    each_impl_and_dtype,
    forward_bound,
    forward_then_backward,
    implementation,
    module,
    random_rows,
    run_both,
    special_rows,
)
from torch._subclasses.fake_tensor import FakeTensorMode

import reference
from common.tolerance import assert_same_bits, assert_within_bound, gamma

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
def test_operands_sharing_one_buffer(impl):
    """x and y as the two halves of one (M, 2N) buffer, then the backward's dx written over x's
    half beside y: views that interleave in memory but share no element are valid (within the
    bounds, x unchanged by the forward); a y one column into x is refused (bad inputs)."""
    m, n = 3, 1000
    buffer = random_rows(m, 2 * n, torch.float32)
    x, y = buffer[:, :n], buffer[:, n:]
    x_before = x.clone()
    check(impl, "forward", x, out=y)
    assert_same_bits(x, x_before, "x beside y")
    check(impl, "backward", y, random_rows(m, n, torch.float32), out=x)


@each_impl
def test_in_place(impl):
    """y may be x itself, and dx may be dy: every row is read before it is written."""
    x, dy = random_rows(4, 3001, torch.float32), random_rows(4, 3001, torch.float32)
    assert check(impl, "backward", check(impl, "forward", x, out=x), dy, out=dy) is dy


FAR_ROW_STRIDE = 2**29  # rows 4 and 5 of 6 start at and past 2**31 elements from the first


def far_rows(t, path, offset):
    """t copied into a view whose rows lie FAR_ROW_STRIDE elements apart, its first element
    `offset` elements into a buffer of its own (1: every row off 16 bytes, the element-wise
    builds): device memory on a GPU, on the CPU a sparse file at `path` mapped privately into
    memory, so that only the pages of its rows take any."""
    m, n = t.shape
    size = offset + (m - 1) * FAR_ROW_STRIDE + n
    if t.is_cuda:
        buffer = torch.empty(size, dtype=t.dtype, device=t.device)
    else:
        with open(path, "wb") as file:
            file.truncate(size * t.element_size())
        buffer = torch.from_file(str(path), shared=False, size=size, dtype=t.dtype)
    return buffer.as_strided((m, n), (FAR_ROW_STRIDE, 1), offset).copy_(t)


def long_row_path(impl, path, monkeypatch):
    """N for each kernel path, with the limits that send rows that long there: the rows
    kernels (24); Triton's looped kernels (registers of 32, chunks of 16: N = 100); CuTe's
    cluster (N = 40000) and its two-pass step 1 (no step 2 plan)."""
    if path == "looped":
        for name, value in (("ROW_BLOCK_MAX", 32), ("BACKWARD_ROW_BLOCK_MAX", 32), ("CHUNK", 16)):
            monkeypatch.setattr(module(impl), name, value)
        return 100
    if path == "two_pass":
        monkeypatch.setattr(module(impl), "kernel_plan", lambda direction, n, dtype: None)
    return 40000 if path == "cluster" else 24 if path == "rows" else 4099


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("impl, path", [("torch", "rows"), ("triton", "rows"), ("triton", "looped"),
                         ("cute", "rows"), ("cute", "cluster"), ("cute", "two_pass")])  # fmt: skip
def test_rows_past_2_31_elements(impl, path, offset, tmp_path, monkeypatch):
    """x and dy read from, y and dx written into, views whose rows 4 and 5 start at and past
    2**31 elements from their first (bf16; offset 1: every row off 16 bytes), on every kernel
    path: within the bound, where a 32-bit row offset wraps and reads or writes outside the
    view (on the CPU a segmentation fault of the interpreter; on a GPU an illegal address,
    which ends the process's CUDA context: run it alone first, `python test.py -k past_2_31`)."""
    implementation(impl)  # skips CuTe without a GPU before any buffer is made
    n = long_row_path(impl, path, monkeypatch)
    x, dy = random_rows(6, n, torch.bfloat16, scale=3.0), random_rows(6, n, torch.bfloat16)
    far = {name: far_rows(t, tmp_path / name, offset)
           for name, t in (("x", x), ("y", x), ("dy", dy), ("dx", dy))}  # fmt: skip
    y = check(impl, "forward", far["x"], out=far["y"])
    check(impl, "backward", y, far["dy"], out=far["dx"])
    far.clear()
    if ON_GPU:  # buffers of gigabytes: back to the device, which other suites may share
        torch.cuda.empty_cache()


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


# In a training loop: what a model does around the op beyond forward and backward


@each_impl
def test_torch_compile_dynamic_shapes(impl):
    """torch.compile(fullgraph=True, dynamic=True) of a model on every implementation's Softmax,
    the batch and the row length changing between steps (as sequence lengths do): no graph
    break, no failure tracing the operand checks, and what the eager model computes."""
    fns = implementation(impl)
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 40).to(DEVICE)
    softmax = fns.Softmax(dim=-1)
    model = lambda x, n: softmax(linear(x)[..., :n])  # noqa: E731
    compiled = torch.compile(model, fullgraph=True, dynamic=True,
                             backend="inductor" if ON_GPU else "aot_eager")  # fmt: skip
    # inductor's own code for the linear layer rounds differently; aot_eager runs eager's
    same = (
        (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5))
        if ON_GPU
        else assert_same_bits
    )
    for shape, n in (((5, 16), 33), ((2, 7, 16), 40), ((3, 16), 17)):
        x = torch.randn(shape, device=DEVICE)
        eager_out = model(x, n)
        eager_out.square().sum().backward()
        eager_grad = linear.weight.grad.clone()
        linear.zero_grad()
        compiled_out = compiled(x, n)
        compiled_out.square().sum().backward()
        same(compiled_out.detach(), eager_out.detach())
        same(linear.weight.grad, eager_grad)
        linear.zero_grad()


@each_impl
def test_double_backward_raises(impl):
    """The backward is not itself differentiable: a second derivative (create_graph=True, as a
    gradient penalty asks) raises rather than giving a wrong answer silently (torch's backward
    differentiated with y as a constant, or zero through the kernels' outputs)."""
    x = random_rows(3, 17, torch.float32).requires_grad_()
    y = implementation(impl).softmax(x)
    (dx,) = torch.autograd.grad((y * y.detach().flip(-1)).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        (dx.square().sum() + x.sum()).backward()


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
    """Both ops on representative operands: float32 that requires grad, a row-strided bfloat16
    slice, and the backward given the stride-0 gradient that loss = y.sum() sends and a
    transposed one."""
    y = torch.softmax(random_rows(4, 9, torch.float32), dim=-1)
    forward, backward = "softmax_{}_forward", "softmax_{}_backward"
    check_op(impl, forward, (random_rows(4, 9, torch.float32).requires_grad_(),))
    check_op(impl, forward, (random_rows(4, 20, torch.bfloat16)[:, :9],))
    check_op(impl, backward, (y, torch.ones((), device=DEVICE).expand(4, 9)))
    check_op(impl, backward, (y, random_rows(9, 4, torch.float32).t()))
