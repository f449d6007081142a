"""gemv tests, section (2): the contract over every implementation, and the split path of both
kernels. The set-up, the bound model and the shared helpers live in test.py, which runs this
file."""

import pytest
import torch
from test import (
    ALPHA,
    BETA,
    DEVICE,
    DTYPES,
    IMPLS,
    LAYOUTS,
    ON_GPU,
    SHAPES,
    alias,
    assert_only_y_written,
    check,
    cute_impl,
    element_addresses,
    entry_point,
    guarded,
    guarded_matrix,
    implementation,
    random_matrix,
    random_vector,
    special_case,
    splits_of,
)

import reference
import torch_impl
import triton_impl
from common.tolerance import assert_matches_rounded, assert_same_bits

# ---------------------------------------------------------------------------------------------
# 2. The contract over every implementation: the reference on fresh data, guards,
#    repeatability, corner semantics, bad input; the split path of both kernels


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(impl, layout, dtype, shape):
    """ALPHA and BETA, then for torch on 16-bit data scalars both 16-bit dtypes hold (0.375,
    -1.75), which keep torch_impl on the library's own 16-bit addmv that ALPHA and BETA route
    around: torch's bound, with its TORCH_EXTRA_ROUNDINGS, must hold there too."""
    m, n = shape
    A, x, y = random_matrix(m, n, dtype, layout), random_vector(n, dtype), random_vector(m, dtype)
    check(impl, ALPHA, A, x, BETA, y, layout)
    if impl == "torch" and dtype != torch.float32:
        assert torch_impl.held_exactly(0.375, dtype) and torch_impl.held_exactly(-1.75, dtype)
        check("torch", 0.375, A, x, -1.75, random_vector(m, dtype), f"{layout}, 16-bit addmv")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 300), (130, 70)], ids=str)
@pytest.mark.parametrize(
    "view, step_x, step_y",
    [
        ("row-sliced", 3, 2), ("col-sliced", 0, 1), ("strided", 1, 3), ("col-sliced", 2, 5),
        ("col-padded", 1, 2), ("col-padded", 0, 1),
    ],
)  # fmt: skip
def test_views_inside_guard(impl, dtype, shape, view, step_x, step_y):
    """Sliced and strided A, strided and stride-0 x, and a strided y, each a view into NaN: a
    read outside A or x makes y NaN, every element of y must be written (its old value is far
    from the new one), and nothing around or between y's elements may change."""
    m, n = shape
    A = guarded_matrix(m, n, dtype, view)
    x, _ = guarded(random_vector(n, dtype), step_x)
    y, y_buffer = guarded(random_vector(m, dtype), step_y)
    A_before, x_before = A.clone(), x.clone()
    check(impl, ALPHA, A, x, BETA, y, view)
    assert_only_y_written(y_buffer, m, step_y)
    assert_same_bits(A.reshape(-1), A_before.reshape(-1), "A after the call")
    assert_same_bits(x, x_before, "x after the call")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_scalars_do_not_read(impl, layout, dtype):
    """beta == 0 ignores NaN in y; alpha == 0 ignores NaN in A and x (y = beta*y); both zero give
    +0 without reading anything. A scalar that rounds to 0 in float32 (1e-50) is a 0."""
    m, n = 70, 300
    nan_y = torch.full((m,), float("nan"), device=DEVICE, dtype=dtype)
    nan_A = random_matrix(m, n, dtype, layout).fill_(float("nan"))
    nan_x = torch.full((n,), float("nan"), device=DEVICE, dtype=dtype)
    A, x = random_matrix(m, n, dtype, layout), random_vector(n, dtype)
    check(impl, ALPHA, A, x, 0.0, nan_y.clone(), "beta = 0")
    check(impl, 0.0, nan_A, nan_x, BETA, random_vector(m, dtype), "alpha = 0")
    check(impl, 1e-50, nan_A, nan_x, BETA, random_vector(m, dtype), "alpha rounds to 0")
    check(impl, ALPHA, A, x, 1e-50, nan_y.clone(), "beta rounds to 0")
    for alpha, beta in ((0.0, 0.0), (1e-50, -1e-50)):
        y = nan_y.clone()
        implementation(impl)(alpha, nan_A, nan_x, beta, y)
        assert_same_bits(y, torch.zeros_like(y), f"alpha = {alpha}, beta = {beta}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_shapes(impl, dtype):
    """m == 0 leaves the empty y alone; n == 0 is the empty sum, y = beta*y (y = 0 for beta
    == 0, even over NaN)."""
    gemv = implementation(impl)
    no_rows, empty_y = torch.empty(0, 5, device=DEVICE, dtype=dtype), random_vector(0, dtype)
    assert gemv(ALPHA, no_rows, random_vector(5, dtype), BETA, empty_y) is empty_y
    no_columns, no_x = torch.empty(9, 0, device=DEVICE, dtype=dtype), random_vector(0, dtype)
    check(impl, ALPHA, no_columns, no_x, BETA, random_vector(9, dtype), "n = 0")
    y = torch.full((9,), float("nan"), device=DEVICE, dtype=dtype)
    gemv(ALPHA, no_columns, no_x, 0.0, y)
    assert_same_bits(y, torch.zeros_like(y), "n = 0, beta = 0")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case", ["nan in A", "inf in A", "inf - inf", "inf * 0", "inf in x", "nan in y", "subnormal"]
)
def test_special_values(impl, layout, dtype, case):
    """NaN and infinities in read operands propagate as IEEE says (the exact result must come
    back exactly, NaN where NaN); subnormal products stay within the underflow terms."""
    A, x, y = special_case(case, 50, 300, dtype, layout)
    check(impl, ALPHA, A, x, BETA, y, case)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_accumulates_in_float32(impl, layout, dtype):
    """Each row is one 1 and 4/eps terms of eps/4: a 16-bit accumulator rounds every addition
    back to 1, float32 holds every partial sum exactly, so y must be 2 exactly. This is the
    measurement behind torch_impl's claim."""
    n, term = int(4 / torch.finfo(dtype).eps) + 1, torch.finfo(dtype).eps / 4
    A = random_matrix(3, n, dtype, layout).fill_(term)
    A[:, 0] = 1.0
    y = torch.empty(3, device=DEVICE, dtype=dtype)
    implementation(impl)(1.0, A, torch.ones(n, device=DEVICE, dtype=dtype), 0.0, y)
    assert_same_bits(y, torch.full_like(y, 2.0))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scalars_rounded_to_float32(impl, layout, dtype):
    """alpha = 1 + 2**-8 + 2**-20 and beta = 1, A = x = 1, y = -1: the kernels compute
    alpha32 * 1 - 1 exactly in float32, so y must be alpha32 - 1 rounded once. No 16-bit dtype
    holds alpha32, so torch_impl computes on float32 copies (addmv would round alpha to the
    dtype first)."""
    alpha = 1 + 2**-8 + 2**-20
    A = random_matrix(5, 1, dtype, layout).fill_(1.0)
    y = torch.full((5,), -1.0, device=DEVICE, dtype=dtype)
    implementation(impl)(alpha, A, torch.ones(1, device=DEVICE, dtype=dtype), 1.0, y)
    expected = torch.full((5,), reference.to_float32(alpha) - 1, dtype=torch.float64)
    assert_matches_rounded(y, expected)


# (alpha, beta, scale of A and x, scale of y): scalars that float16 or bfloat16 cannot hold
# (1e5 overflows float16; 1e-8 and 3e-8 are no 16-bit numbers, 1e-6 a float16 subnormal), with
# operands scaled so that every term and result stays far inside float16's range.
UNHELD_SCALARS = [(1e5, 1.0, 1e-2, 100.0), (1e-8, 1.0, 100.0, 1e-3), (1e-6, 3e-8, 5.0, 1e4),
                  (-3e-8, 1e5, 300.0, 1e-6)]  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scalars", UNHELD_SCALARS, ids=str)
def test_scalars_the_dtype_cannot_hold(impl, layout, dtype, scalars):
    """The scalars are float32 numbers whatever the storage dtype: none may be converted to a
    16-bit one on the way (torch's addmv does that unless routed around)."""
    alpha, beta, operand_scale, y_scale = scalars
    m, n = 37, 300
    A, x = random_matrix(m, n, dtype, layout).mul_(operand_scale), random_vector(n, dtype)
    y = random_vector(m, dtype).mul_(y_scale)
    check(impl, alpha, A, x.mul_(operand_scale), beta, y, f"alpha={alpha} beta={beta}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeatability(impl, layout, dtype):
    """Two runs on the same inputs give the same bits: the summation order depends on the
    shape only."""
    gemv = implementation(impl)
    m, n = 67, 3000
    A, x, y = random_matrix(m, n, dtype, layout), random_vector(n, dtype), random_vector(m, dtype)
    first, second = y.clone(), y.clone()
    gemv(ALPHA, A, x, BETA, first)
    gemv(ALPHA, A, x, BETA, second)
    assert_same_bits(second, first)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_cuda_graph_replays_the_eager_call(request, impl, layout, dtype, split):
    """Captured in a CUDA graph (as a decode loop would run it), the call replays on fresh A,
    x and y with the bits of an eager call on the same A and x and a copy of y: the launcher
    works on the stream torch has current and does nothing outside it that a capture would
    miss. m = 72 and n = 400 make A one that Triton's TMA kernel (column-major: its descriptor
    is a kernel argument, captured by value) and CuTe's vector builds take, and that no kernel
    splits: a row block's tiles come to at most SPLIT_MIN_BYTES (two of CuTe's 64 KiB 16-bit
    column tiles), one part's worth. Split (split_small cuts the columns of this small A),
    the workspace comes from the graph's memory pool and both launches are captured. The
    shape's kernel choices are checked on the CPU too; only the capture needs the GPU."""
    if split:
        if impl == "torch":
            pytest.skip("torch_impl does not split")
        request.getfixturevalue("split_small")
    gemv = entry_point(impl)
    m, n = 72, 400
    A, x, y = random_matrix(m, n, dtype, layout), random_vector(n, dtype), random_vector(m, dtype)
    assert impl == "torch" or (splits_of(impl, A) > 1) == split
    if impl == "triton":
        assert triton_impl.tma_reads(A) == (layout == "col")
    if impl == "cute":
        assert cute_impl.is_vector_friendly(A, x, cute_impl.mapping(A))
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    gemv(ALPHA, A, x, BETA, y)  # the first call compiles and loads the kernel: no capture can
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(ALPHA, A, x, BETA, y)
    A.copy_(random_matrix(m, n, dtype, layout))
    x.copy_(random_vector(n, dtype))
    y.copy_(random_vector(m, dtype))
    eager = y.clone()
    graph.replay()
    gemv(ALPHA, A, x, BETA, eager)
    torch.cuda.synchronize()
    assert_same_bits(y, eager, f"{impl} replayed")


def test_disjoint_views_of_one_buffer():
    """A, x and y may come from one buffer as long as y's addresses meet neither A's nor x's."""
    m, n = 20, 30
    buffer = torch.randn(m * n + n + m, device=DEVICE)
    A, x, y = buffer[: m * n].view(m, n), buffer[m * n : m * n + n], buffer[m * n + n :]
    check("triton", ALPHA, A, x, BETA, y)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strides_blas_refuses(impl, dtype):
    """Valid strides that a BLAS call refuses, so torch_impl copies such operands: y of step 0
    with m = 1, x of step 0 with n > 1, and an A of one row (or column) whose other stride,
    2**31 + 1, has no memory behind it."""
    n, huge = 37, 2**31 + 1
    A, x = random_matrix(1, n, dtype, "row"), random_vector(n, dtype)
    check(impl, ALPHA, A, x, BETA, random_vector(1, dtype).as_strided((1,), (0,)), "y step 0")
    broadcast_x, y = random_vector(1, dtype).expand(n), random_vector(5, dtype)
    check(impl, ALPHA, random_matrix(5, n, dtype, "row"), broadcast_x, BETA, y, "x step 0")
    far_rows = random_vector(n, dtype).as_strided((1, n), (huge, 1))
    check(impl, ALPHA, far_rows, x, BETA, random_vector(1, dtype), "row stride 2**31 + 1")
    far_columns = random_vector(n, dtype).as_strided((n, 1), (1, huge))
    check(impl, ALPHA, far_columns, x[:1], BETA, random_vector(n, dtype), "column stride")


def bad_inputs():
    """(alpha, A, x, beta, y, expected error, words the message must contain)"""
    f32 = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    A, x, y = f32(3, 4), f32(4), f32(3)
    buffer = f32(40)
    yield torch.tensor(1.0), A, x, 1.0, y, TypeError, "alpha must be a real"
    yield 1.0, A, x, True, y, TypeError, "beta must be a real"
    yield 1.0, A.tolist(), x, 1.0, y, TypeError, "A must be a torch.Tensor"
    yield 1.0, A, [1.0] * 4, 1.0, y, TypeError, "x must be a torch.Tensor"
    yield 1.0, f32(12), x, 1.0, y, ValueError, "A must be a 2-D"
    yield 1.0, A, f32(4, 1), 1.0, y, ValueError, "x must be a 1-D"
    yield 1.0, A, x, 1.0, f32(1)[0], ValueError, "y must be a 1-D"
    yield 1.0, A, f32(5), 1.0, y, ValueError, "x has 5 elements but A has 4 columns"
    yield 1.0, A, x, 1.0, f32(4), ValueError, "y has 4 elements but A has 3 rows"
    yield 1.0, A.double(), x.double(), 1.0, y.double(), TypeError, "A has dtype torch.float64"
    yield 1.0, A.int(), x.int(), 1.0, y.int(), TypeError, "supported"
    yield 1.0, A, x.half(), 1.0, y, TypeError, "x has dtype torch.float16 but A"
    yield 1.0, A.bfloat16(), x.bfloat16(), 1.0, y, TypeError, "y has dtype torch.float32 but A"
    yield 1.0, A, x, 1.0, f32(1).expand(3), ValueError, "y has stride 0"
    yield 1.0, buffer[:12].view(3, 4), x, 1.0, buffer[10:13], ValueError, "y overlaps A"
    yield 1.0, A, buffer[20:24], 1.0, buffer[23:26], ValueError, "y overlaps x"
    yield 1.0, A, x, 1.0, A[:, 1], ValueError, "y overlaps A"
    # y through another storage over the same memory (a DLPack import) overlaps all the same
    y_over_A, y_over_x = alias(buffer[10:13]), alias(buffer[23:26])
    for y_alias in (y_over_A, y_over_x):
        assert y_alias.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    yield 1.0, buffer[:12].view(3, 4), x, 1.0, y_over_A, ValueError, "y overlaps A"
    yield 1.0, A, buffer[20:24], 1.0, y_over_x, ValueError, "y overlaps x"
    yield 10**400, A, x, 1.0, y, ValueError, "alpha is beyond the range"
    yield 1.0, A, x, -(10**400), y, ValueError, "beta is beyond the range"
    if ON_GPU:
        yield 1.0, A, x.cpu(), 1.0, y, ValueError, "x is on cpu"
        yield 1.0, A, x, 1.0, y.cpu(), ValueError, "y is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from check_operands, before any launch, so CuTe is checked on the CPU too."""
    *operands, error, words = case
    y = operands[4]
    before = y.clone() if isinstance(y, torch.Tensor) else None
    with pytest.raises(error, match=words):
        entry_point(impl)(*operands)
    if before is not None:
        assert_same_bits(y.reshape(-1), before.reshape(-1), "y after a rejected call")


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


def test_held_exactly():
    """torch_impl.held_exactly, which decides whether a 16-bit addmv may convert a scalar, on
    the edges of each dtype, and against a round trip through torch on random float32 bits."""
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


@pytest.fixture
def split_small(monkeypatch):
    """Split small matrices too: any part of A is big enough (SPLIT_MIN_BYTES = 1), so the
    shapes the CPU can run take the split path, Triton's up to MAX_SPLITS parts with the last
    ones empty. CuTe compiles a build per part count (about a second each), so its parts stop
    at 4. The bounds read the same constants, through *_roundings."""
    monkeypatch.setattr(triton_impl, "SPLIT_MIN_BYTES", 1)
    if cute_impl is not None:
        monkeypatch.setattr(cute_impl, "SPLIT_MIN_BYTES", 1)
        monkeypatch.setattr(cute_impl, "MAX_SPLITS", 4)


@pytest.mark.parametrize("impl", ["triton", "cute"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 700), (37, 300), (64, 1000), (130, 2049)], ids=str)
def test_split_matches_reference(split_small, impl, layout, dtype, shape):
    """The split path against the reference, within the bound of its tree: fewer column steps
    in a lane, log2(splits) levels more. y is a strided view inside a NaN guard (every element
    written, nothing around it); a second run gives the same bits; beta = 0 does not read y.
    64 x 1000 column-major takes Triton's TMA kernel, the other shapes its pointer kernel."""
    m, n = shape
    A, x = random_matrix(m, n, dtype, layout), random_vector(n, dtype)
    assert splits_of(impl, A) > 1
    y, y_buffer = guarded(random_vector(m, dtype), 2)
    y_before = y.clone()
    check(impl, ALPHA, A, x, BETA, y, f"{layout}, {splits_of(impl, A)} parts")
    assert_only_y_written(y_buffer, m, 2)
    again = y_before.clone()
    implementation(impl)(ALPHA, A, x, BETA, again)
    assert_same_bits(again, y, "a second run")
    check(impl, ALPHA, A, x, 0.0, torch.full_like(y_before, float("nan")), "beta = 0")


@pytest.mark.parametrize("impl", ["triton", "cute"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["nan in A", "inf - inf", "inf * 0", "subnormal"])
def test_split_special_values(split_small, impl, layout, case):
    """NaN and infinities reach y through the parts' tree as IEEE says; with 300 columns in
    parts of one step, inf - inf meets only in the tree over the parts."""
    A, x, y = special_case(case, 50, 300, torch.float32, layout)
    assert splits_of(impl, A) > 1
    check(impl, ALPHA, A, x, BETA, y, case)
