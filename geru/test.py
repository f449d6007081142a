"""Tests for geru: every implementation lands within the bound README.md derives.

Run with `python test.py` (or `nox -s geru` from the top). Without a GPU, torch runs on the CPU,
Triton under its interpreter, and the CuTe kernel is compiled for sm_90a and its PTX checked
(the Triton kernel's too); launching the CuTe kernel needs the GPU, and those tests say so when
they skip.

Every matrix under test is a view inside a NaN-filled buffer (`matrix_in_guard`): each check
also makes sure the poison around and between A's elements keeps its bits. Sections: (1) set-up
and the bound model, (2) the contract over every implementation, (3) Triton's builds (the
interpreter outside test.py, the PTX), (4) CuTe's builds and PTX, (5) GPU-only sizes.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# ---------------------------------------------------------------------------------------------
# 1. Set-up and the bound model: README.md's bound as code, its stand-in, its negative controls

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import reference
import torch_impl
import triton_impl

try:
    from common import tolerance
    from common.tolerance import (
        assert_same_bits,
        gamma,
        store_roundoff,
        underflow,
        unit_roundoff,
    )
except ImportError as error:  # the folder was copied on its own, without common/
    raise ImportError(
        "test.py takes its tolerance checks from the course's common/ folder, which is not beside "
        f"this folder: copy the course's common/ folder beside it, to {HERE.parent / 'common'}"
    ) from error

try:
    import cute_impl
except ImportError as error:  # the CuTe DSL is absent: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"the CuTe DSL is not installed ({error})"

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)
# 1 x 1, thin matrices, primes, 2**k +- 1 and the edges of the tiles: 8 x 256 float32 and
# 8 x 512 16-bit elements (transposed for column-major matrices).
SHAPES = [(1, 1), (1, 13), (13, 1), (2, 3), (7, 31), (31, 7), (8, 256), (9, 257), (7, 255),
          (16, 512), (17, 511), (33, 513), (127, 129)]  # fmt: skip
# row: contiguous; col: A.T of a contiguous matrix; *_pitched: rows (columns) of a wider,
# aligned matrix, so the last tile of each row is partial; sliced: an odd offset and row stride
# (no 16-byte vectors possible); strided: every second row and third column.
LAYOUTS = ["row", "col", "row_pitched", "col_pitched", "sliced", "strided"]
CASES = [(shape, layout) for shape in SHAPES for layout in ("row", "col")] + [
    (shape, layout)
    for shape in [(1, 1), (9, 257), (17, 511), (33, 513), (127, 129)]
    for layout in LAYOUTS[2:]
]
MARGIN = 64  # elements of poison before and after the matrix: 16-byte aligned for every dtype


def entry_point(name):
    """The implementation's geru. CuTe's runs without a GPU: it validates, then refuses."""
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return cute_impl.geru if name == "cute" else modules[name].geru


def implementation(name):
    """The implementation's geru, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return entry_point(name)


def random_vector(n, dtype, step=1):
    """n random values with the given step; step 0 broadcasts one value."""
    if step == 0:
        return torch.randn(1, device=DEVICE).to(dtype).expand(n)
    return torch.randn(n * step, device=DEVICE).to(dtype)[::step]


def view_in(storage, m, n, layout):
    """The m x n matrix of `layout` as a view of the 1-D tensor `storage`, after the margin."""
    transposed = layout.startswith("col")
    rows, cols = (n, m) if transposed else (m, n)
    if layout in ("row", "col"):
        view = storage[MARGIN : MARGIN + rows * cols].view(rows, cols)
    elif layout.endswith("pitched"):
        pitch = -(-cols // 64) * 64 + 64  # a multiple of 64 elements: every row 16-byte aligned
        view = storage[MARGIN : MARGIN + rows * pitch].view(rows, pitch)[:, :cols]
    elif layout == "sliced":
        view = storage[MARGIN : MARGIN + (rows + 2) * (cols + 5)].view(rows + 2, cols + 5)
        view = view[1 : 1 + rows, 3 : 3 + cols]
    else:  # strided
        view = storage[MARGIN : MARGIN + (2 * rows + 1) * (3 * cols + 1)]
        view = view.view(2 * rows + 1, 3 * cols + 1)[1::2, 1::3][:rows, :cols]
    return view.t() if transposed else view


def matrix_in_guard(m, n, dtype, layout):
    """(buffer, A, outside): A a random m x n matrix of `layout`, a view inside `buffer`, which
    is NaN everywhere else; `outside` marks the buffer's elements that are not A's."""
    size = 2 * MARGIN + (2 * max(m, n) + 1) * (3 * max(m, n) + 64 + 1)
    buffer = torch.full((size,), float("nan"), device=DEVICE, dtype=dtype)
    A = view_in(buffer, m, n, layout)
    A.copy_(torch.randn(m, n, device=DEVICE).to(dtype))
    outside = torch.ones(size, dtype=torch.bool, device=DEVICE)
    view_in(outside, m, n, layout).fill_(False)
    return buffer, A, outside


def float64_stand_in(alpha, x, y, A):
    """reference.geru's math in float64 torch, for sizes plain Python is too slow for:
    alpha32 * x_i is exact, its product with y_j is rounded once to float64 and the sum once
    more, exactly as reference.py does (fsum of two terms is their correctly rounded sum)."""
    alpha_x = reference.to_float32(float(alpha)) * x.double()
    return A.double() + alpha_x[:, None] * y.double()[None, :]


def error_bound(impl, alpha, x, y, exact):
    """README.md's bound for `impl`, elementwise, with p = alpha32 x_i y_j and z = a_ij + p:

    fused kernels (Triton, CuTe), a_hat = fl_s(fl32(fl32(alpha32 x_i) y_j + a_ij)), FMA or not:
        r_err = u|z| + (1 + u)(gamma_2 |p| + (1 + u) e |y_j| + e)
        bound = u_s |z| + (1 + u_s) r_err + e_s
    torch (both products and the sum each rounded to float32, then to the dtype; alpha32 is
    converted to the dtype only where that is exact):
        bound = c1 |z| + (1 + c1) c2 |p| + (1 + c1)**2 e_c (|y_j| + 2)
        c1 = (1 + u)(1 + u_s) - 1, c2 = (1 + c1)**2 - 1, e_c = (1 + u_s) e + e_s

    u = 2**-24, u_s the store's unit roundoff (0 for float32), e = tiny32 u and e_s = tiny_s u_s
    the absolute errors of a rounding among the subnormals. Both get 2 u64 (|p| + |z|) more for
    reference.py's own float64 rounding of the triple product and of the sum."""
    dtype = x.dtype
    u_s = store_roundoff(dtype)
    e, e_s = underflow(torch.float32), underflow(dtype) if u_s else 0.0
    abs_x, abs_y = (v.to(exact.device, torch.float64).abs() for v in (x, y))
    abs_xy = torch.outer(abs_x, abs_y)
    abs_p, abs_z = abs(reference.to_float32(float(alpha))) * abs_xy, exact.abs()
    if impl == "torch":
        c1 = (1 + U32) * (1 + u_s) - 1
        c2, e_c = (1 + c1) ** 2 - 1, (1 + u_s) * e + e_s
        computed = c1 * abs_z + (1 + c1) * c2 * abs_p + (1 + c1) ** 2 * e_c * (abs_y + 2)
    else:
        r_err = U32 * abs_z + (1 + U32) * (gamma(2, U32) * abs_p + (1 + U32) * e * abs_y + e)
        computed = u_s * abs_z + (1 + u_s) * r_err + e_s
    return computed + 2 * U64 * (abs_p + abs_z)


def assert_within_bound(actual, exact, bound, what="result"):
    """common.tolerance's check, which reports the first bad element of a 1-D tensor: the
    matrices go in as their row-major flattening, so 'first at k' is element (k // n, k % n)."""
    flat = (t.reshape(-1) for t in (actual, exact, bound))
    tolerance.assert_within_bound(*flat, what=what)


def check(impl, alpha, x, y, buffer, A, outside):
    """Run impl and check A against the reference within the bound, and the guard untouched."""
    exact = reference.geru(alpha, x.cpu(), y.cpu(), A.cpu())
    bound = error_bound(impl, alpha, x, y, exact)
    poison = buffer[outside].clone()
    result = implementation(impl)(alpha, x, y, A)
    assert result is A
    assert_within_bound(A, exact, bound, f"{impl} {A.dtype} {tuple(A.shape)} {A.stride()}")
    assert_same_bits(buffer[outside], poison, "the poison around A")


def alias(t):
    """The elements of t through a second storage that starts at t's first element, as DLPack
    imports and numpy views make them: unless t starts its own storage, a check by storage
    identity misses that the two share memory."""
    other = torch.from_dlpack(t)
    assert other.untyped_storage().data_ptr() == t.data_ptr()
    return other


def element_addresses(t):
    """The address of every element of t, in index order, by brute force."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return (t.data_ptr() + offsets.flatten() * t.element_size()).tolist()


def test_float64_stand_in_matches_reference():
    """The float64 torch stand-in used at sizes plain Python cannot reach gives reference.py's
    bits, special values included."""
    for dtype in DTYPES:
        A = torch.randn(37, 61).to(dtype)
        x, y = torch.randn(37).to(dtype), torch.randn(61).to(dtype)
        x[:3] = torch.tensor([float("inf"), torch.finfo(dtype).tiny / 8, float("nan")])
        exact = reference.geru(-0.37, x, y, A)
        stand_in = float64_stand_in(-0.37, x, y, A)
        assert_same_bits(stand_in.reshape(-1), exact.reshape(-1), "the float64 stand-in")


def test_negative_controls():
    """The fused bound rejects an element updated with its neighbour's y_j, or updated twice, and
    it is tight enough to reject torch's extra roundings to bfloat16, which pass torch's bound.
    alpha = 0.375 is a bfloat16 number, so torch_impl takes addr's 16-bit evaluation."""
    m, n, alpha = 64, 200, 0.375
    dtype = torch.bfloat16
    A, x, y = torch.randn(m, n).to(dtype), torch.randn(m).to(dtype), torch.randn(n).to(dtype)
    alpha32, (i, j) = reference.to_float32(alpha), (10, 20)
    # The wrong element must differ from the right one by far more than its bound on every draw:
    # a random x_i y_j near 0, or y_j near y_{j+1}, made the first two controls pass in about 6%
    # of draws.
    x[i], y[j], y[j + 1] = 1.5, 1.25, -1.75
    exact = reference.geru(alpha, x, y, A)
    fused_bound = error_bound("triton", alpha, x, y, exact)
    assert_within_bound(exact.to(dtype), exact, fused_bound)  # the correctly rounded answer
    neighbour = exact.to(dtype)
    neighbour[i, j] = A[i, j].double() + alpha32 * x[i].double() * y[j + 1].double()
    twice = exact.to(dtype)
    twice[i, j] = A[i, j].double() + 2 * alpha32 * x[i].double() * y[j].double()
    for wrong in (neighbour, twice):
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong, exact, fused_bound)
    # torch's evaluation: alpha*x_i, (alpha*x_i)*y_j and the sum each rounded to bf16.
    assert torch_impl.held_exactly(alpha32, dtype)
    alpha_x = (alpha32 * x.float()).to(dtype).float()
    product = (alpha_x[:, None] * y.float()[None, :]).to(dtype).float()
    rounded_each_time = (A.float() + product).to(dtype)
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(rounded_each_time, exact, fused_bound)
    assert_within_bound(rounded_each_time, exact, error_bound("torch", alpha, x, y, exact))


# ---------------------------------------------------------------------------------------------
# 2. The contract over every implementation: the reference on fresh data inside a guard,
#    strided and broadcast vectors, repeatability, corner semantics, bad input


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, layout", CASES, ids=lambda c: str(c).replace(" ", ""))
def test_matches_reference(impl, dtype, shape, layout):
    m, n = shape
    for alpha in (0.3, -1.7e-3):
        buffer, A, outside = matrix_in_guard(m, n, dtype, layout)
        check(impl, alpha, random_vector(m, dtype), random_vector(n, dtype), buffer, A, outside)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("step_x, step_y", [(3, 1), (1, 2), (5, 7), (0, 1), (1, 0), (0, 0)])
def test_strided_and_broadcast_vectors(impl, dtype, layout, step_x, step_y):
    """x and y with steps other than 1, and step 0 (one value broadcast)."""
    m, n = 19, 517
    x, y = random_vector(m, dtype, step_x), random_vector(n, dtype, step_y)
    check(impl, 0.3, x, y, *matrix_in_guard(m, n, dtype, layout))


@pytest.mark.parametrize("impl", ["triton", "cute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["row", "col"])
def test_vectors_off_the_16_byte_grid(impl, dtype, layout):
    """x and y that start one element past a 16-byte boundary cannot be read as vectors (the
    CuTe kernel then reads the operand along A's rows element by element): the result is
    within the bound and has the same bits as with aligned copies of the same values."""
    m, n = 19, 517
    x, y = random_vector(m, dtype), random_vector(n, dtype)
    x_off = torch.empty(m + 1, device=DEVICE, dtype=dtype)[1:].copy_(x)
    y_off = torch.empty(n + 1, device=DEVICE, dtype=dtype)[1:].copy_(y)
    buffer, A, outside = matrix_in_guard(m, n, dtype, layout)
    aligned = buffer.clone()
    A_aligned = aligned.as_strided(A.shape, A.stride(), A.storage_offset())
    check(impl, 0.3, x_off, y_off, buffer, A, outside)
    implementation(impl)(0.3, x, y, A_aligned)
    assert_same_bits(buffer, aligned, "the result with aligned x and y")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (5, 0)], ids=str)
def test_empty(impl, dtype, shape):
    """m == 0 or n == 0: nothing to do, and nothing around A is touched."""
    m, n = shape
    check(impl, 0.3, random_vector(m, dtype), random_vector(n, dtype),
          *matrix_in_guard(m, n, dtype, "row"))  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alpha", [0.0, -0.0, 1e-50], ids=["0", "-0", "1e-50"])
def test_alpha_zero_reads_nothing(impl, dtype, alpha):
    """alpha32 == 0 (1e-50 rounds to 0 in float32): A keeps its bits, its NaNs included, and
    NaN and infinities in x and y do not reach it."""
    m, n = 37, 300
    buffer, A, _ = matrix_in_guard(m, n, dtype, "row")
    A[::3, ::7] = float("nan")
    x, y = random_vector(m, dtype), random_vector(n, dtype)
    x[::2], y[1::2] = float("nan"), float("inf")
    before = buffer.clone()
    assert implementation(impl)(alpha, x, y, A) is A
    assert_same_bits(buffer, before, "A and its guard after alpha = 0")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["row", "col"])
def test_special_values_and_repeatability(impl, dtype, layout):
    """NaN, infinities and subnormals in x, y and A propagate as IEEE says (inf * 0 and
    inf - inf are NaN); two runs give the same bits."""
    m, n = 21, 300
    buffer, A, outside = matrix_in_guard(m, n, dtype, layout)
    x, y = random_vector(m, dtype), random_vector(n, dtype)
    specials = [float("nan"), float("inf"), -float("inf"), torch.finfo(dtype).tiny / 4, 0.0]
    x[: len(specials)] = torch.tensor(specials, dtype=dtype, device=DEVICE)
    y[3 : 3 + len(specials)] = torch.tensor(specials, dtype=dtype, device=DEVICE)
    A[5, : len(specials)] = torch.tensor(specials, dtype=dtype, device=DEVICE)
    A[6:9, 3:6] = -float("inf")
    second = buffer.clone()
    check(impl, 0.3, x, y, buffer, A, outside)
    implementation(impl)(0.3, x, y, view_in(second, m, n, layout))
    assert_same_bits(second, buffer, "a second run")


@pytest.mark.parametrize("impl", ["triton", "cute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_give_the_same_bits(impl, dtype):
    """The fused kernels do the same arithmetic whichever way their tiles are turned: a
    row-major A and a column-major copy of it come out with the same bits."""
    m, n = 37, 300
    x, y = random_vector(m, dtype), random_vector(n, dtype)
    _, row_major, _ = matrix_in_guard(m, n, dtype, "row")
    _, col_major, _ = matrix_in_guard(m, n, dtype, "col")
    col_major.copy_(row_major)
    for A in (row_major, col_major):
        implementation(impl)(0.3, x, y, A)
    assert_same_bits(col_major.reshape(-1), row_major.reshape(-1), "the column-major result")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["row", "col"])
def test_cuda_graph_replays_the_eager_call(impl, dtype, layout):
    """Captured in a CUDA graph (as a decode loop would run it), the update replays on fresh
    x, y and A with the bits of an eager call on a copy of them: the launcher works on the
    stream torch has current and does nothing outside it that a capture would miss. 33 x 513
    has full tiles and edge tiles in both orientations."""
    geru = implementation(impl)
    m, n = 33, 513
    buffer, A, outside = matrix_in_guard(m, n, dtype, layout)
    x, y = random_vector(m, dtype), random_vector(n, dtype)
    geru(0.75, x, y, A)  # the first call compiles and loads the kernel, which a capture cannot
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        geru(0.75, x, y, A)
    x.copy_(random_vector(m, dtype))
    y.copy_(random_vector(n, dtype))
    A.copy_(torch.randn(m, n, device=DEVICE).to(dtype))
    eager = buffer.clone()  # the same inputs, in the same layout and alignment
    graph.replay()
    geru(0.75, x, y, view_in(eager, m, n, layout))
    torch.cuda.synchronize()
    assert_same_bits(buffer, eager, "the replayed A and its guard")
    assert buffer[outside].isnan().all()


# (alpha, scale of x and y, scale of A): alphas that float16 or bfloat16 cannot hold (1e5
# overflows float16; 1e-8 and 3e-8 are no 16-bit numbers, 1e-6 a float16 subnormal), with
# operands scaled so that every term and result stays far inside float16's range.
UNHELD_ALPHAS = [(1e5, 1e-2, 10.0), (1e-8, 1e3, 1e-2), (1e-6, 100.0, 1e-2), (-3e-8, 1e3, 1e-2)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("scaled", UNHELD_ALPHAS, ids=str)
def test_alpha_the_dtype_cannot_hold(impl, dtype, layout, scaled):
    """alpha is a float32 number whatever the storage dtype: it may not be converted to a 16-bit
    one on the way (torch's addr does that unless routed around)."""
    alpha, vector_scale, matrix_scale = scaled
    m, n = 37, 300
    buffer, A, outside = matrix_in_guard(m, n, dtype, layout)
    A.mul_(matrix_scale)
    x, y = random_vector(m, dtype).mul_(vector_scale), random_vector(n, dtype).mul_(vector_scale)
    check(impl, alpha, x, y, buffer, A, outside)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strides_blas_refuses(impl, dtype):
    """Valid strides that BLAS's ger refuses (torch's addr is no BLAS call, but every
    implementation must take them): x of step 0 with m = 1, y of step 0 with n > 1, and an A of
    one row (or column) whose other stride, 2**31 + 1, has no memory behind it."""
    n, huge = 37, 2**31 + 1
    x = random_vector(1, dtype).as_strided((1,), (0,))
    check(impl, 0.3, x, random_vector(n, dtype), *matrix_in_guard(1, n, dtype, "row"))
    check(impl, 0.3, random_vector(5, dtype), random_vector(n, dtype, step=0),
          *matrix_in_guard(5, n, dtype, "row"))  # fmt: skip
    for shape, strides in (((1, n), (huge, 1)), ((n, 1), (1, huge))):
        buffer = torch.full((2 * MARGIN + n,), float("nan"), device=DEVICE, dtype=dtype)
        A = buffer.as_strided(shape, strides, MARGIN).copy_(torch.randn(shape, device=DEVICE))
        outside = torch.ones(buffer.shape, dtype=torch.bool, device=DEVICE)
        outside[MARGIN : MARGIN + n] = False
        x, y = random_vector(shape[0], dtype), random_vector(shape[1], dtype)
        check(impl, 0.3, x, y, buffer, A, outside)


def test_held_exactly():
    """torch_impl.held_exactly, which decides whether a 16-bit addr may convert alpha, on the
    edges of each dtype, and against a round trip through torch on random float32 bits."""
    cases = [
        (torch.float16, 1e5, False), (torch.float16, 65504.0, True),
        (torch.float16, 2.0**-24, True), (torch.float16, 1e-8, False),
        (torch.float16, 0.1, False), (torch.bfloat16, 1e5, False),
        (torch.bfloat16, 2.0**-130, True), (torch.bfloat16, 1.0, True),
        (torch.float32, reference.to_float32(0.1), True), (torch.float32, 1e-45, True),
    ]  # fmt: skip
    for dtype, value, held in cases:
        assert torch_impl.held_exactly(value, dtype) == held, (dtype, value)
    values = torch.randint(-(2**31), 2**31, (2000,), dtype=torch.int64).int().view(torch.float32)
    for value in values[~values.isnan()].tolist():
        for dtype in DTYPES:
            round_trip = torch.tensor(value).to(dtype).item() == value
            assert torch_impl.held_exactly(value, dtype) == round_trip, (dtype, value)


def bad_inputs():
    """(alpha, x, y, A, expected error, words the message must contain)"""
    f32 = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    matrix, buffer = f32(4, 5), f32(40)
    yield 1.0, [1.0, 2.0], f32(5), f32(2, 5), TypeError, "x must be a torch.Tensor"
    yield 1.0, f32(4), f32(5), matrix.tolist(), TypeError, "A must be a torch.Tensor"
    yield torch.tensor(1.0), f32(4), f32(5), f32(4, 5), TypeError, "alpha must be a real"
    yield True, f32(4), f32(5), f32(4, 5), TypeError, "alpha must be a real"
    yield 1.0, f32(4), f32(5), f32(20), ValueError, "A must be a 2-D"
    yield 1.0, f32(4), f32(1, 5), f32(4, 5), ValueError, "y must be a 1-D"
    yield 1.0, f32(4), f32(5), f32(5, 4), ValueError, "A must be"
    yield 1.0, f32(4).half(), f32(5), f32(4, 5), TypeError, "does not convert"
    yield 1.0, f32(4), f32(5), f32(4, 5).half(), TypeError, "does not convert"
    yield 1.0, f32(4).double(), f32(5).double(), f32(4, 5).double(), TypeError, "supported"
    yield 1.0, f32(4), f32(5), f32(1, 5).expand(4, 5), ValueError, "one address"
    yield 1.0, f32(3), f32(3), f32(10).as_strided((3, 3), (1, 2)), ValueError, "one address"
    yield 1.0, matrix[:, 0], f32(5), matrix, ValueError, "x shares memory with A"
    yield 1.0, f32(4), matrix[1], matrix, ValueError, "y shares memory with A"
    # x or y through another storage over the same memory (a DLPack import) overlaps all the same
    x_over_A, y_over_A = alias(buffer[18:22]), alias(buffer[21:26])
    for v in (x_over_A, y_over_A):
        assert v.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    A_in_buffer = buffer[2:22].view(4, 5)
    yield 1.0, x_over_A, f32(5), A_in_buffer, ValueError, "x shares memory with A"
    yield 1.0, f32(4), y_over_A, A_in_buffer, ValueError, "y shares memory with A"
    yield 10**400, f32(4), f32(5), f32(4, 5), ValueError, "alpha is beyond the range"
    if ON_GPU:
        yield 1.0, f32(4), torch.randn(5), f32(4, 5), ValueError, "y is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from check_operands, before any launch, so CuTe is checked on the CPU too."""
    geru = entry_point(impl)
    *operands, error, words = case
    A = operands[3]
    before = A.clone() if isinstance(A, torch.Tensor) else None
    with pytest.raises(error, match=words):
        geru(*operands)
    if before is not None:
        assert_same_bits(A.reshape(-1), before.reshape(-1), "A after a rejected call")


def test_elements_collide_is_exact():
    """The gcd rule agrees with a search of every pair of indices, for every shape up to 5 x 5
    and every pair of strides up to 6."""
    storage = torch.empty(64)
    for m, n, s, t in np.ndindex(6, 6, 7, 7):
        A = storage.as_strided((m, n), (s, t))
        addresses = element_addresses(A)
        assert reference.elements_collide(A) == (len(set(addresses)) < len(addresses)), (m, n, s, t)


def test_overlap_is_judged_by_address():
    """reference.overlap on random 1-D and 2-D views of one buffer, some through a second
    storage: 'none' only when no byte is shared, 'same' only for the very same elements in the
    same order. Vectors of one step that interleave must come out 'none' at least once."""
    buffer, generator = torch.empty(256), torch.Generator().manual_seed(12)

    def randint(high, size=()):
        return torch.randint(0, high, size, generator=generator).tolist()

    def random_view():
        ndim = 1 + randint(2)
        shape, strides = randint(7 if ndim == 1 else 5, (ndim,)), randint(7, (ndim,))
        view = buffer.as_strided(shape, strides, randint(40))
        return alias(view) if view.numel() and randint(2) else view

    def byte_set(t):
        return {a + b for a in element_addresses(t) for b in range(t.element_size())}

    answers, interleaved = set(), 0
    for trial in range(3000):
        a = random_view()
        b = alias(a) if trial % 7 == 0 and a.numel() else random_view()
        answer = reference.overlap(a, b)
        assert reference.overlap(b, a) == answer
        answers.add(answer)
        if answer == "none":
            assert not byte_set(a) & byte_set(b), (a.shape, a.stride(), b.shape, b.stride())
            ranges = reference.address_range(a), reference.address_range(b)
            interleaved += None not in ranges and max(ranges)[0] < min(ranges)[1]
        if answer == "same":
            assert element_addresses(a) == element_addresses(b)
    assert answers == {"none", "same", "partial"} and interleaved > 0


# ---------------------------------------------------------------------------------------------
# 3. Triton's builds: the interpreter outside test.py, the PTX of both orientations

# A learner's call outside test.py: a fresh Python in this folder, TRITON_INTERPRET=1, no test.py
# set-up. It loads the operands test.py saved, runs triton_impl.geru on them in place and saves
# them back: triton_impl itself must make Triton 3.6's interpreter work under numpy 2.4.
FRESH_INTERPRETER_SCRIPT = """
import sys
import torch
import triton_impl
calls = torch.load(sys.argv[1])
for alpha, x, y, A in calls:
    triton_impl.geru(alpha, x, y, A)
torch.save(calls, sys.argv[1])
"""


def test_triton_in_a_fresh_interpreter(tmp_path):
    """triton_impl.geru runs on CPU tensors in a fresh interpreter process and lands within its
    bound: float32 row-major and bfloat16 column-major (exact bfloat16 conversions), each with
    full and edge tiles."""
    calls = []
    for m, n, dtype, layout in [(19, 517, torch.float32, "row"), (517, 19, torch.bfloat16, "col")]:
        A = view_in(torch.randn(m * n + 2 * MARGIN).to(dtype), m, n, layout)
        calls.append((0.3, torch.randn(m).to(dtype), torch.randn(n).to(dtype), A))
    path = tmp_path / "calls.pt"
    torch.save(calls, path)
    env = os.environ | {"TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_INTERPRETER_SCRIPT, str(path)],
        cwd=HERE, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    for (alpha, x, y, A), (_, _, _, A_hat) in zip(calls, torch.load(path), strict=True):
        exact = reference.geru(alpha, x, y, A)
        bound = error_bound("triton", alpha, x, y, exact)
        assert_within_bound(A_hat, exact, bound, f"fresh interpreter {A.dtype}")


TRITON_BUILDS = [
    (dtype, rows_contiguous, sizes_divisible)
    for dtype in DTYPES
    for rows_contiguous in (True, False)
    for sizes_divisible in (True, False)
]


@functools.cache
def triton_ptx():
    """{build: PTX} from triton_impl.ptx_of for every build. The interpreter's @triton.jit
    functions cannot be compiled, so under TRITON_INTERPRET=1 one fresh Python without it
    compiles them all."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return {build: triton_impl.ptx_of(*build) for build in TRITON_BUILDS}
    builds = [(str(dtype)[6:], rows, divisible) for dtype, rows, divisible in TRITON_BUILDS]
    program = (
        "import json, torch, triton_impl\n"
        f"builds = [(getattr(torch, d), r, s) for d, r, s in {builds}]\n"
        "print(json.dumps([triton_impl.ptx_of(*build) for build in builds]))"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=HERE, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return dict(zip(TRITON_BUILDS, json.loads(done.stdout), strict=True))


@pytest.mark.parametrize("build", TRITON_BUILDS, ids=lambda b: f"{b[0]}-rows{b[1]}-div16{b[2]}")
def test_triton_ptx(build):
    """One source, both orientations: 128-bit loads and stores of A, and the FMA. With m and n
    multiples of 16 every tile has them; otherwise the unmasked full tiles still do."""
    ptx = triton_ptx()[build]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    assert "fma.rn.f32" in ptx


# ---------------------------------------------------------------------------------------------
# 4. CuTe's builds and PTX, compiled for sm_90a on the CPU


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows_contiguous", [True, False], ids=["row", "col"])
def test_cute_ptx(dtype, rows_contiguous):
    """The CuTe kernel builds for sm_90a with 128-bit loads and stores of A on the fast path,
    in both orientations, and one more 128-bit load when the operand along the rows is read as
    vectors (its element build has v more 1-element loads instead); the any-stride build has
    none."""
    vector = cute_impl.ptx_of(dtype, True, rows_contiguous)
    along = cute_impl.ptx_of(dtype, True, rows_contiguous, along_vector=True)
    scalar = cute_impl.ptx_of(dtype, False, rows_contiguous)
    assert "ld.global.v4" in vector and "st.global.v4" in vector
    assert "fma.rn.f32" in vector
    v = cute_impl.VECTOR_BYTES // dtype.itemsize
    scalar_load = f"ld.global.b{8 * dtype.itemsize}"
    assert along.count("ld.global.v4") == vector.count("ld.global.v4") + 1
    assert along.count(scalar_load) == vector.count(scalar_load) - v
    assert "ld.global.v4" not in scalar and "st.global.v4" not in scalar


# ---------------------------------------------------------------------------------------------
# 5. GPU-only sizes


@pytest.mark.skipif(not ON_GPU, reason="a matrix of 2**31 elements needs a GPU (4 GiB in bf16)")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["row", "col"])
def test_more_than_2_to_31_elements(impl, layout):
    """46336 x 46400 bfloat16, 2**31 + 2506752 elements: a 32-bit offset would wrap and update
    the start twice. Both sides are multiples of 64, so the vector builds run, with partial
    tiles along the rows. The float64 stand-in (checked against reference.py above) gives the
    exact answer, and the bound is checked on the GPU, a slab of rows at a time."""
    m, n, alpha = 46336, 46400, 0.3
    if layout == "row":
        A = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    else:
        A = torch.randn(n, m, device=DEVICE, dtype=torch.bfloat16).t()
    x = torch.randn(m, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    before = A.clone()
    implementation(impl)(alpha, x, y, A)
    for start in range(0, m, 4096):
        rows = slice(start, start + 4096)
        exact = float64_stand_in(alpha, x[rows], y, before[rows])
        bound = error_bound(impl, alpha, x[rows], y, exact)
        if not ((A[rows].double() - exact).abs() <= bound).all():
            assert_within_bound(A[rows], exact, bound, f"{impl} rows {start}..")


@pytest.mark.skipif(not ON_GPU, reason="a stride of 2**31 + 1 needs 4.3 GB behind it: GPU only")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["row", "col"])
def test_leading_dimension_past_32_bits(impl, layout):
    """The two rows (row-major) or two columns (column-major) of A lie 2**31 + 1 bfloat16
    elements apart, with NaN between and after them: the kernels index in 64 bits, and write
    nothing next to either line."""
    n, huge, dtype = 1000, 2**31 + 1, torch.bfloat16
    buffer = torch.full((huge + n + MARGIN,), float("nan"), device=DEVICE, dtype=dtype)
    if layout == "row":
        A = buffer.as_strided((2, n), (huge, 1))
    else:
        A = buffer.as_strided((n, 2), (1, huge))
    A.copy_(torch.randn(A.shape, device=DEVICE))
    x, y = random_vector(A.shape[0], dtype), random_vector(A.shape[1], dtype)
    exact = reference.geru(0.3, x.cpu(), y.cpu(), A.cpu())
    try:
        assert implementation(impl)(0.3, x, y, A) is A
        assert_within_bound(A, exact, error_bound(impl, 0.3, x, y, exact), f"{impl} {layout}")
        for guard in (buffer[n : n + MARGIN], buffer[huge - MARGIN : huge], buffer[huge + n :]):
            assert guard.isnan().all(), "an element next to A's lines was written"
    finally:
        del A, buffer
        torch.cuda.empty_cache()


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
