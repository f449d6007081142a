"""geru tests, section (2): the contract over every implementation, each matrix inside a guard.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import numpy as np
import pytest
import torch
from test import (
    CASES,
    DEVICE,
    DTYPES,
    IMPLS,
    MARGIN,
    ON_GPU,
    alias,
    check,
    element_addresses,
    entry_point,
    implementation,
    matrix_in_guard,
    random_vector,
    view_in,
)

import reference
import torch_impl
from common.tolerance import assert_same_bits

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
