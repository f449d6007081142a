"""Tests for gemv: every implementation lands within the bound README.md derives.

Run with `python test.py` (or `nox -s gemv` from the top). Without a GPU, torch runs on the CPU,
Triton under its interpreter, and the CuTe kernels are compiled for sm_90a and their PTX
checked; launching them needs the GPU, and those tests say so when they skip. Sections:
(1) set-up and the bound model, (2) the contract over every implementation, (3) Triton's builds
and dispatch, with the column split both kernels share, (4) CuTe's builds, dispatch and PTX,
(5) GPU-only sizes.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

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
    from common.tolerance import (
        assert_matches_rounded,
        assert_same_bits,
        assert_within_bound,
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
except ImportError as error:  # no CuTe DSL: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"cute_impl cannot be imported ({error})"

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
LAYOUTS = ["row", "col"]
# (m, n): 1x1, primes, 2**k +- 1, and the edges of the tiles: Triton's 16 x 256 (float32) and
# 16 x 1024 (16-bit) row tiles, 32 x 128 column tiles and 64 x 64 / 64 x 128 TMA tiles; CuTe's
# row blocks of 8 / 16 rows with 1024-element row tiles and its 32 x 128 / 128 x 256 column tiles.
# Column-major A is the transpose of an (n, m) tensor, so m a multiple of 8 (16, 32, 64) takes
# Triton's TMA kernel and the other m its pointer kernel.
SHAPES = [
    (1, 1), (2, 3), (7, 1), (1, 31), (31, 127), (16, 256), (17, 257), (33, 129), (32, 256),
    (65, 513), (127, 63), (3, 2047), (2, 2048), (63, 2049), (257, 17), (9, 1025), (64, 300),
]  # fmt: skip
ALPHA, BETA = 0.3, -1.7  # the scalars of most tests: neither term dominates
U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)
# Storage-dtype roundings torch may add on each term (README.md, "torch_impl.py"): one store of
# alpha s_i or beta y_i before the final addition. alpha and beta reach a 16-bit addmv only when
# the dtype holds them exactly, so their conversion rounds nothing.
TORCH_EXTRA_ROUNDINGS = 1
# reference.py's own error, in units of W_i = |alpha| T_i + |beta y_i| (its docstring).
REFERENCE_ERROR = gamma(3, U64)


def entry_point(name):
    """The implementation's gemv. CuTe's can be called without a GPU: it validates, then refuses."""
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return cute_impl.gemv if name == "cute" else modules[name].gemv


def implementation(name):
    """The implementation's gemv, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return entry_point(name)


def random_vector(n, dtype, step=1):
    return torch.randn(n * step, device=DEVICE).to(dtype)[::step]


def random_matrix(m, n, dtype, layout):
    """Fresh random (m, n) values, row-major, or column-major (the transpose of an (n, m))."""
    if layout == "row":
        return torch.randn(m, n, device=DEVICE).to(dtype)
    return torch.randn(n, m, device=DEVICE).to(dtype).T


# README.md's k on A for each kernel, from the module whose tiles and split fix its tree.
ROUNDINGS = {"triton": triton_impl.roundings}
if cute_impl is not None:
    ROUNDINGS["cute"] = cute_impl.roundings


def float64_row_sums(A, x, rows=4096, absolute=False):
    """sum_j a_ij x_j, or T_i = sum_j |a_ij x_j| if absolute, in float64 (the products are
    exact), a block of rows at a time so that the float64 copies of a large A stay small."""
    part = torch.abs if absolute else torch.positive
    x64 = part(x.double())
    blocks = [part(A[s : s + rows].double()) @ x64 for s in range(0, A.shape[0], rows)]
    return torch.cat(blocks).cpu() if blocks else torch.zeros(0, dtype=torch.float64)


def error_bound(impl, alpha, A, x, beta, y, exact, exact_error=REFERENCE_ERROR):
    """README.md's bound on |y_hat_i - y_i|, row by row:

        u_s |y_i| + (1 + u_s) (c_a |a| T_i + c_b |b y_i| + (1 + c_a) |a| n e + 2 (1 + u) e) + e_s

    a, b the float32 scalars, T_i = sum_j |a_ij x_j|, u_s the store's unit roundoff (0 for
    float32), e and e_s the absolute error of a float32 and of a storing rounding among the
    subnormals. For the kernels c_a = gamma_k with k from ROUNDINGS and c_b = gamma_2. torch
    adds in its library's undocumented order, so for it only what holds for every order of
    float32 additions, k = n + 2, on both terms (its library may add beta y_i into the sum),
    with up to TORCH_EXTRA_ROUNDINGS roundings to the storage
    dtype on each term (and their subnormal errors). The exact answer is known to within
    exact_error * W_i, W_i = |a| T_i + |b y_i|: gamma_3 of float64 for reference.py."""
    m, n = A.shape
    dtype = A.dtype
    a32, b32 = reference.to_float32(float(alpha)), reference.to_float32(float(beta))
    zeros = torch.zeros(m, dtype=torch.float64)
    alpha_part = abs(a32) * float64_row_sums(A, x, absolute=True) if a32 != 0 and n > 0 else zeros
    beta_part = abs(b32) * y.cpu().double().abs() if b32 != 0 else zeros
    u_s, e, e_s = store_roundoff(dtype), underflow(torch.float32), underflow(dtype)
    if impl == "torch":
        extra = (1 + u_s) ** TORCH_EXTRA_ROUNDINGS
        c_a = extra * (1 + gamma(n + 2, U32)) - 1
        # The library may start each row's sum from beta * y_i (the CPU's does: with gamma_2
        # here the bound failed about once in 100 draws of 3-column matrices): n + 2 roundings.
        c_b = extra * (1 + gamma(n + 2, U32)) - 1
        e = e + TORCH_EXTRA_ROUNDINGS * e_s
    else:
        c_a = gamma(ROUNDINGS[impl](A), U32) if n > 0 else 0.0
        c_b = gamma(2, U32)
    float32_error = c_a * alpha_part + c_b * beta_part + (1 + c_a) * abs(a32) * n * e
    bound = u_s * exact.abs() + (1 + u_s) * (float32_error + 2 * (1 + U32) * e) + e_s
    return bound + (1 + u_s) * exact_error * (alpha_part + beta_part)


def check(impl, alpha, A, x, beta, y, what=""):
    """Run impl in place on y and check it against the reference within the bound."""
    exact = reference.gemv(alpha, A.cpu(), x.cpu(), beta, y.cpu())
    bound = error_bound(impl, alpha, A, x, beta, y, exact)
    result = implementation(impl)(alpha, A, x, beta, y)
    assert result is y
    assert_within_bound(y, exact, bound, f"{impl} {tuple(A.shape)} {what}")


MARGIN = 5  # elements of NaN before a guarded vector


def guarded(values, step, margin=MARGIN):
    """A view with the given step of `values` (1-D) inside a NaN-filled buffer: (view, buffer).
    Step 0 broadcasts one value and needs no buffer."""
    if step == 0:
        return values[:1].expand(values.numel()), None
    size = 2 * margin + values.numel() * step
    buffer = torch.full((size,), float("nan"), device=DEVICE, dtype=values.dtype)
    view = buffer[margin : margin + values.numel() * step : step]
    view.copy_(values)
    return view, buffer


def assert_only_y_written(y_buffer, m, step):
    """Every element of y_buffer outside the m elements of y (step apart) is still NaN."""
    untouched = torch.ones_like(y_buffer, dtype=torch.bool)
    untouched[MARGIN : MARGIN + m * step : step] = False
    assert y_buffer[untouched].isnan().all(), "an element outside y was written"


def guarded_matrix(m, n, dtype, view):
    """An (m, n) view of fresh random values inside a NaN-filled buffer.

    row-sliced   A = buffer[2 : 2 + m, 3 : 3 + n], rows padded on both sides
    col-sliced   the transpose of such a slice: column-major with padded columns
    col-padded   column-major with padded columns whose start and stride are multiples of 16
                 bytes, as Triton's TMA kernel needs
    strided      A = buffer[1::2, ::3], no stride 1 at all"""
    if view == "row-sliced":
        buffer = torch.full((m + 4, n + 7), float("nan"), device=DEVICE, dtype=dtype)
        A = buffer[2 : 2 + m, 3 : 3 + n]
    elif view == "col-sliced":
        buffer = torch.full((n + 4, m + 7), float("nan"), device=DEVICE, dtype=dtype)
        A = buffer[2 : 2 + n, 3 : 3 + m].T
    elif view == "col-padded":
        columns = -(-(m + 16) // 8) * 8  # 8 elements before A, 8 or more after, a multiple of 8
        buffer = torch.full((n + 1, columns), float("nan"), device=DEVICE, dtype=dtype)
        A = buffer[:n, 8 : 8 + m].T
    else:
        buffer = torch.full((2 * m + 1, 3 * n), float("nan"), device=DEVICE, dtype=dtype)
        A = buffer[1::2, ::3]
    A.copy_(torch.randn(m, n, device=DEVICE))
    return A


def special_case(name, m, n, dtype, layout):
    """(A, x, y) of random values with special values planted in rows 3 and 40 (or in x)."""
    A, x, y = random_matrix(m, n, dtype, layout), random_vector(n, dtype), random_vector(m, dtype)
    inf, nan, tiny = float("inf"), float("nan"), torch.finfo(dtype).tiny
    if name == "nan in A":
        A[3, 200] = nan
    elif name == "inf in A":
        A[3, 5], A[40, 290] = inf, -inf
    elif name == "inf - inf":
        A[3, 5], A[3, 250] = inf, inf
        x[5], x[250] = 1.0, -1.0
    elif name == "inf * 0":
        A[40, 7], x[7] = inf, 0.0
    elif name == "inf in x":
        x[100] = inf
    elif name == "nan in y":
        y[3] = nan
    else:  # subnormal products, below float32's and (bfloat16, float16) the dtype's range
        A[3, :8] = tiny / 4
        x[:8] = torch.tensor([0.5, -3.0, tiny, 1.0, 2.0, -tiny, 0.25, 1.0], dtype=dtype)
        y[3] = 0.0
    return A, x, y


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


def float64_gemv(alpha, A, x, beta, y, rows=4096):
    """The stand-in for reference.gemv where Python is too slow: float64 products (exact)
    summed by torch in float64, then alpha * sum + beta * y in float64, a block of rows at a
    time so that the float64 copies stay small."""
    a32, b32 = reference.to_float32(float(alpha)), reference.to_float32(float(beta))
    return a32 * float64_row_sums(A, x, rows) + b32 * y.double().cpu()


def h200_sized(dtype, layout, size=16384):
    """A size x size matrix of the benchmark's largest square on the meta device: its shape,
    strides and (zero, so aligned) address, without the memory."""
    A = torch.empty(size, size, dtype=dtype, device="meta")
    return A if layout == "row" else A.T


@pytest.mark.parametrize("shape", [(1, 1), (37, 300), (300, 4097)], ids=str)
def test_stand_in_matches_reference(shape):
    """float64_gemv agrees with reference.gemv within float64's serial bound gamma_{n+2}
    (any order of the sum, then the multiply and the add) plus the reference's gamma_3."""
    m, n = shape
    A = random_matrix(m, n, torch.bfloat16, "row")
    x, y = random_vector(n, torch.bfloat16), random_vector(m, torch.bfloat16)
    exact = reference.gemv(ALPHA, A.cpu(), x.cpu(), BETA, y.cpu())
    stand_in = float64_gemv(ALPHA, A, x, BETA, y, rows=16)
    a32, b32 = reference.to_float32(ALPHA), reference.to_float32(BETA)
    W = abs(a32) * float64_row_sums(A, x, absolute=True) + abs(b32) * y.cpu().double().abs()
    assert_within_bound(stand_in, exact, (gamma(n + 2, U64) + gamma(3, U64)) * W)


def kernel_bounds(alpha, A, x, beta, y, exact):
    """(name, bound) for every kernel's bound on this problem, CuTe's where it can be imported."""
    return [(impl, error_bound(impl, alpha, A, x, beta, y, exact)) for impl in ROUNDINGS]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_controls(layout):
    """Each kernel's bound rejects a result that dropped or doubled one term of a row (the
    largest), every row stored one place down (an off-by-one row index), and one extra bfloat16
    rounding of the alpha term (alpha rounded to bfloat16, as a 16-bit addmv would), which
    torch's own bound lets through."""
    m, n, dtype, alpha, beta = 64, 2048, torch.bfloat16, 1 + 2**-8 + 2**-20, -1.7
    A = random_matrix(m, n, dtype, layout).cpu()
    x, y = random_vector(n, dtype).cpu(), random_vector(m, dtype).cpu()
    exact = reference.gemv(alpha, A, x, beta, y)
    a32 = reference.to_float32(alpha)
    products = A.double() * x.double()
    largest = products[5].abs().argmax()
    dropped, doubled = exact.clone(), exact.clone()
    dropped[5] -= a32 * products[5, largest]
    doubled[5] += a32 * products[5, largest]
    # All rows, not one: a single row copied from the next passed about once in 2000 draws,
    # when the two random values happened to lie within the row's bound of each other.
    shifted = exact.roll(1)
    alpha_in_bfloat16 = torch.tensor(a32).bfloat16().double()
    rounded_alpha = alpha_in_bfloat16 * products.sum(1) + reference.to_float32(beta) * y.double()
    for impl, bound in kernel_bounds(alpha, A, x, beta, y, exact):
        assert_within_bound(exact.to(dtype), exact, bound, f"{impl} the exact answer")
        for wrong in (dropped, doubled, shifted, rounded_alpha):
            with pytest.raises(AssertionError, match="outside the bound"):
                assert_within_bound(wrong.to(dtype), exact, bound, impl)
    torch_bound = error_bound("torch", alpha, A, x, beta, y, exact)
    assert_within_bound(rounded_alpha.to(dtype), exact, torch_bound, "torch")


# README.md's k at the benchmark's sizes, counted by hand: (impl, dtype, layout, side) -> the
# product, the further steps of a lane, the trees, the parts' tree, alpha and beta.
H200_ROUNDINGS = {
    ("triton", torch.float32, "row", 16384): 1 + 63 + 8 + 2,
    ("triton", torch.bfloat16, "row", 16384): 0 + 15 + 10 + 2,
    ("triton", torch.float32, "col", 16384): 1 + 255 + 6 + 2,  # TMA tiles
    ("triton", torch.bfloat16, "col", 16384): 0 + 127 + 7 + 2,
    # 4096 x 4096 column-major: the TMA kernels' columns in 4 parts (16 or 8 steps each)
    ("triton", torch.float32, "col", 4096): 1 + 15 + 6 + 2 + 2,
    ("triton", torch.bfloat16, "col", 4096): 0 + 7 + 7 + 2 + 2,
    ("cute", torch.float32, "row", 16384): 1 + 31 + 4 + 5 + 2,
    ("cute", torch.bfloat16, "row", 16384): 0 + 31 + 4 + 5 + 2,
    ("cute", torch.float32, "col", 16384): 1 + 127 + 2 + 5 + 2,
    ("cute", torch.bfloat16, "col", 16384): 0 + 255 + 1 + 5 + 2,
    # 16 tiles of 256 columns in 4 parts, 4 products a lane and tile
    ("cute", torch.bfloat16, "col", 4096): 0 + 15 + 1 + 5 + 2 + 2,
}


@pytest.mark.parametrize("case", list(H200_ROUNDINGS), ids=str)
def test_roundings_at_h200_sizes(case):
    """Each kernel's exported k at the benchmark's sizes is README.md's table: in the tens or
    low hundreds, against the serial bound's n + 2 = 16386 for torch."""
    impl, dtype, layout, side = case
    if impl not in ROUNDINGS:
        pytest.skip(CUTE_MISSING)
    assert ROUNDINGS[impl](h200_sized(dtype, layout, side)) == H200_ROUNDINGS[case]


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


# ---------------------------------------------------------------------------------------------
# 3. Triton's builds and dispatch (the interpreter outside test.py, the PTX), and the
#    column split and grids, which both kernels share


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_triton_column_kernels_are_tested(dtype):
    """The column-major cases above reach both of Triton's column-major kernels: the TMA one
    (16-byte aligned start and column stride) and the pointer one (anything else)."""
    assert triton_impl.tma_reads(guarded_matrix(37, 300, dtype, "col-padded"))
    assert not triton_impl.tma_reads(guarded_matrix(37, 300, dtype, "col-sliced"))
    taken = {triton_impl.tma_reads(random_matrix(m, n, dtype, "col")) for m, n in SHAPES}
    assert taken == {True, False}


def test_empty_launches_nothing(monkeypatch):
    """m == 0 returns y without touching the kernel."""
    monkeypatch.setattr(triton_impl, "gemv_kernel", None)
    no_rows, x = torch.empty(0, 4, device=DEVICE), torch.ones(4, device=DEVICE)
    y = torch.empty(0, device=DEVICE)
    assert triton_impl.gemv(1.0, no_rows, x, 1.0, y) is y


# A learner's call outside test.py: a fresh Python in this folder, TRITON_INTERPRET=1, no test.py
# set-up. It loads the operands test.py saved, runs triton_impl.gemv on them in place and saves
# them back: triton_impl itself must make Triton 3.6's interpreter work under numpy 2.4.
FRESH_INTERPRETER_SCRIPT = """
import sys
import torch
import triton_impl
calls = torch.load(sys.argv[1])
for alpha, A, x, beta, y in calls:
    triton_impl.gemv(alpha, A, x, beta, y)
torch.save(calls, sys.argv[1])
"""


def test_triton_in_a_fresh_interpreter(tmp_path):
    """triton_impl.gemv runs on CPU tensors in a fresh interpreter process and lands within its
    bound: float32 row-major (gemv_kernel, a loop over runtime bounds, which numpy 2.4 broke)
    and bfloat16 column-major through the TMA kernel (exact bfloat16 conversions)."""
    calls = []
    for m, n, dtype, layout in [(33, 300, torch.float32, "row"), (64, 300, torch.bfloat16, "col")]:
        A, x = random_matrix(m, n, dtype, layout).cpu(), random_vector(n, dtype).cpu()
        calls.append((ALPHA, A, x, BETA, random_vector(m, dtype).cpu()))
    assert triton_impl.tma_reads(calls[1][1])
    path = tmp_path / "calls.pt"
    torch.save(calls, path)
    env = os.environ | {"TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_INTERPRETER_SCRIPT, str(path)],
        cwd=HERE, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    for (alpha, A, x, beta, y), (_, _, _, _, y_hat) in zip(calls, torch.load(path), strict=True):
        exact = reference.gemv(alpha, A, x, beta, y)
        bound = error_bound("triton", alpha, A, x, beta, y, exact)
        assert_within_bound(y_hat, exact, bound, f"fresh interpreter {A.dtype}")


def splits_of(impl, A):
    """How many parts impl's kernels cut A's columns into."""
    if impl == "triton":
        return triton_impl.column_split(A)[0]
    return cute_impl.split_columns(*A.shape, A.dtype, cute_impl.mapping(A))[0]


def grid_of(impl, A):
    """(row blocks, column tiles, bytes of a tile, fill) of impl's kernel on A: the blocks or
    programs down the rows, the tiles along a row block, and how many blocks its module counts
    as filling the H200."""
    (m, n), size = A.shape, A.element_size()
    if impl == "triton":
        (rows, columns), fill = triton_impl.tile_shape(A), triton_impl.FILL_PROGRAMS
    else:
        rows, columns, threads = cute_impl.block_geometry(A.dtype, cute_impl.mapping(A))
        fill = cute_impl.FILL_THREADS // threads
    return -(-m // rows), -(-n // columns), rows * columns * size, fill


# Column-major A at the sizes of the issue (x cuBLAS on the H200 before the split: Triton
# 0.70-0.71 at 4096^2, 0.86 bfloat16 at 8192^2; CuTe 0.74-0.86 at 4096^2): (impl, dtype, size)
# -> parts. 16384^2, and row-major A at all three sizes, fill the GPU unsplit.
COLUMN_SPLITS = {
    ("triton", torch.float32, 4096): 4, ("triton", torch.float32, 8192): 2,
    ("triton", torch.bfloat16, 4096): 4, ("triton", torch.bfloat16, 8192): 2,
    ("cute", torch.float32, 4096): 2, ("cute", torch.float32, 8192): 1,
    ("cute", torch.bfloat16, 4096): 4, ("cute", torch.bfloat16, 8192): 2,
}  # fmt: skip


@pytest.mark.parametrize("impl", ["triton", "cute"])
def test_split_rule(impl):
    """The split rule on the H200 sizes (COLUMN_SPLITS), where at 4096 and 8192 every grid (row
    blocks times parts) holds at least half its fill, so no SM is left without a block; then on
    random shapes: a power of two of at most MAX_SPLITS parts that keeps the grid within its
    fill and each part at SPLIT_MIN_BYTES of A on average, and the largest such (twice as many
    would break one of these limits)."""
    if impl == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    module = triton_impl if impl == "triton" else cute_impl
    for dtype in (torch.float32, torch.bfloat16):
        for size in (4096, 8192, 16384):
            assert splits_of(impl, h200_sized(dtype, "row", size)) == 1
            expected = COLUMN_SPLITS.get((impl, dtype, size), 1)
            assert splits_of(impl, h200_sized(dtype, "col", size)) == expected, (dtype, size)
            for layout in LAYOUTS if size < 16384 else []:
                A = h200_sized(dtype, layout, size)
                row_blocks, _, _, fill = grid_of(impl, A)
                assert row_blocks * splits_of(impl, A) >= fill // 2, (dtype, layout, size)
    generator = torch.Generator().manual_seed(13)
    for _ in range(300):
        m, n = (int(2 ** (18 * torch.rand((), generator=generator))) for _ in range(2))
        dtype = DTYPES[int(torch.randint(3, (), generator=generator))]
        row_major = torch.empty(m, n, dtype=dtype, device="meta")
        for A in (row_major, row_major.T):
            splits = splits_of(impl, A)
            row_blocks, tiles, tile_bytes, fill = grid_of(impl, A)
            parts_fit = tiles * tile_bytes // module.SPLIT_MIN_BYTES  # parts of enough bytes
            assert splits & (splits - 1) == 0 and splits <= module.MAX_SPLITS
            assert splits == 1 or (row_blocks * splits <= fill and splits <= parts_fit)
            twice = 2 * splits
            assert row_blocks * twice > fill or twice > parts_fit or twice > module.MAX_SPLITS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grids_at_h200_sizes(dtype):
    """At m = 16384 every kernel keeps the H200's 132 SMs busy: at least 256 programs or
    blocks of at most 256 threads, about two for each SM, or, for CuTe's 16-bit column-major
    kernel, 128 blocks of 512 threads, one an SM, in a single wave, as cuBLAS's kernel runs."""
    m, width = 16384, dtype.itemsize * 8
    for layout in LAYOUTS:
        assert m // triton_impl.tile_shape(h200_sized(dtype, layout))[0] >= 256
    if cute_impl is not None:
        assert m // cute_impl.rows_per_block(width) >= 256
        column_blocks = m // cute_impl.column_tile(width)[0]
        if cute_impl.column_threads(width) == 512:
            assert 128 <= column_blocks <= 132
        else:
            assert column_blocks >= 256


# Compiles triton_impl's kernels for sm_90 without a GPU and prints what the PTX tests read. Run
# in a child process, because under TRITON_INTERPRET=1 the kernels are interpreted functions the
# compiler cannot take.
TRITON_PTX_SCRIPT = """
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl

ELEMENT = {"float32": "fp32", "bfloat16": "bf16"}

def compiled(kernel, kinds, constexprs, warps, aligned=()):
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constexprs else kinds.get(name, "i32")
                 for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

def operands(dtype):
    element = "*" + ELEMENT[dtype]
    return {"a_ptr": element, "x_ptr": element, "y_ptr": element, "partials_ptr": "*fp32",
            "alpha": "fp32", "beta": "fp32"}

def vector_loads(dtype, layout, a_contiguous):
    block_m, block_n, warps = triton_impl.TILES[layout, getattr(torch, dtype).itemsize]
    constexprs = {"READ_A": True, "READ_Y": True, "SPLIT": False, "BLOCK_M": block_m,
                  "BLOCK_N": block_n, "LOG2_BLOCK_N": block_n.bit_length() - 1,
                  "HALVES": layout == "col", "stride_x": 1, "stride_y": 1}
    if a_contiguous:
        constexprs["stride_an" if layout == "row" else "stride_am"] = 1
    # What Triton assumes of a contiguous A whose sizes are multiples of 16: 16-byte aligned
    # pointers and 16-divisible m, n and leading stride.
    lead = "stride_am" if layout == "row" else "stride_an"
    aligned = ["a_ptr", "x_ptr", "y_ptr", "m", "n", lead]
    kernel = compiled(triton_impl.gemv_kernel, operands(dtype), constexprs, warps, aligned)
    return kernel.asm["ptx"].count("ld.global.v4")

def tma_pipeline(dtype, split):
    block_m, block_n, warps, stages = triton_impl.TMA_TILES[getattr(torch, dtype).itemsize]
    constexprs = {"READ_Y": True, "SPLIT": split, "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "LOG2_BLOCK_N": block_n.bit_length() - 1, "NUM_STAGES": stages,
                  "stride_x": 1, "stride_y": 1}
    kinds = operands(dtype) | {"a_tiles": f"tensordesc<{ELEMENT[dtype]}[{block_n}, {block_m}]>"}
    kernel = compiled(triton_impl.gemv_tma_kernel, kinds, constexprs, warps)
    ptx = kernel.asm["ptx"]
    # Split, the row sums go to the float32 partials instead of y: a store of 32 bits.
    return [ptx.count("cp.async.bulk.tensor"), kernel.metadata.shared,
            ptx.count("st.global.b32") + ptx.count("st.global.v4.b32")]

def sum_splits(dtype, splits):
    constexprs = {"READ_Y": True, "BLOCK_M": triton_impl.SUM_BLOCK_M, "SPLITS": splits,
                  "LOG2_SPLITS": splits.bit_length() - 1, "stride_y": 1}
    kernel = compiled(triton_impl.sum_splits_kernel, operands(dtype), constexprs,
                      triton_impl.SUM_WARPS)
    return kernel.asm["ptx"].count("ld.global")

dtypes = ("float32", "bfloat16")
loads = {f"{dtype} {layout}": [vector_loads(dtype, layout, contiguous)
                               for contiguous in (True, False)]
         for dtype in dtypes for layout in ("row", "col")}
tma = {f"{dtype} tma{' split' * split}": tma_pipeline(dtype, split)
       for dtype in dtypes for split in (False, True)}
sums = {f"{dtype} sum_splits {splits}": sum_splits(dtype, splits)
        for dtype in dtypes for splits in (2, triton_impl.MAX_SPLITS)}
print(json.dumps(loads | tma | sums))
"""


@pytest.fixture(scope="module")
def triton_loads():
    """{'dtype layout': [128-bit loads for a contiguous A, for the control],
    'dtype tma' and 'dtype tma split': [bulk tensor copies, shared memory bytes, 32-bit global
    stores] of the TMA kernel unsplit and split, 'dtype sum_splits s': global loads of
    sum_splits_kernel over s parts}"""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-c", TRITON_PTX_SCRIPT],
        cwd=HERE, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_ptx(triton_loads, layout, dtype):
    """For a contiguous A of either layout (sizes multiples of 16) the Triton kernel compiles
    for sm_90 with 128-bit loads of A: more of them than when A's stride is not known to be 1
    (x and y may still load as vectors then). Each tile shape puts the threads along the
    contiguous dimension, as README.md's two mappings need."""
    contiguous, control = triton_loads[f"{dtype} {layout}"]
    assert contiguous > control


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_tma_and_split_builds(triton_loads, dtype):
    """The TMA kernel, unsplit and split, compiles for sm_90 to bulk tensor copies
    (cp.async.bulk.tensor) into a ring of shared-memory buffers: enough for num_stages - 1
    tiles in flight beside the one being summed, so the loop really is pipelined (a plain range
    with the launch's num_stages compiled to a single buffer). The split build stores float32
    row sums (32-bit stores, none in the bfloat16 unsplit build, which stores y), and
    sum_splits_kernel compiles from 2 up to MAX_SPLITS parts."""
    block_m, block_n, _, stages = triton_impl.TMA_TILES[dtype.itemsize]
    name = str(dtype)[6:]
    for variant in ("tma", "tma split"):
        copies, shared, _ = triton_loads[f"{name} {variant}"]
        assert copies >= 2, variant
        assert shared >= (stages - 1) * block_m * block_n * dtype.itemsize, variant
    assert triton_loads[f"{name} tma split"][2] > 0
    if dtype == torch.bfloat16:
        assert triton_loads[f"{name} tma"][2] == 0
    for splits in (2, triton_impl.MAX_SPLITS):
        assert triton_loads[f"{name} sum_splits {splits}"] >= 1


# ---------------------------------------------------------------------------------------------
# 4. CuTe's builds, dispatch and PTX, compiled for sm_90a on the CPU


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_ptx(layout, dtype):
    """The CuTe kernels build for sm_90a with 128-bit vector loads of A on the fast path (none
    in the any-stride build), row-major with the L2 prefetch hint cute_impl asks for.
    Row-major, a warp's row sum ends in the warp shuffles README.md counts, with no barrier;
    column-major, the rows' partial sums meet in shared memory behind one barrier, with no
    shuffle."""
    vector, scalar = cute_impl.ptx_of(dtype, layout, True), cute_impl.ptx_of(dtype, layout, False)
    vector_load = "ld.global.L2::128B.v4" if layout == "row" else "ld.global.v4"
    assert vector_load in vector and ".v4" not in scalar
    shuffles = layout == "row"
    assert ("bar.sync" in vector) != shuffles and ("bar.sync" in scalar) != shuffles
    assert ("shfl.sync.bfly" in vector) == shuffles and ("shfl.sync.bfly" in scalar) == shuffles


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cute_split_ptx(layout, dtype):
    """A split build compiles for sm_90a to two kernels, the parts' one with the unsplit
    build's 128-bit loads of A, and sum_splits_kernel; the unsplit build has one. Every kernel
    stores to global memory (y, or the parts' row sums): a kernel that keeps its row sums in
    shared memory would leave y unwritten, which no CPU run would see."""
    unsplit, split = (cute_impl.ptx_of(dtype, layout, True, splits=s) for s in (1, 4))
    assert unsplit.count(".entry") == 1 and split.count(".entry") == 2
    for kernel in [*unsplit.split(".entry")[1:], *split.split(".entry")[1:]]:
        assert "st.global" in kernel, kernel.split("(")[0]
    assert "sum_splits_kernel" in split and "sum_splits_kernel" not in unsplit
    assert split.count(".v4") == unsplit.count(".v4")


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
def test_cute_alpha_zero_reads_nothing():
    """The alpha == 0 build has no load of A or x: its only global load is y's."""
    ptx = cute_impl.ptx_of(torch.float32, "row", True, read_a=False)
    assert ptx.count("ld.global") == 1 and "shfl.sync" not in ptx


@pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("contiguous", [True, False], ids=["vector", "any-stride"])
def test_cute_thread_value_layouts(layout, dtype, contiguous):
    """The kernels' thread-value layouts, run on the host, put register k of thread t where
    README.md says, in the vector and the any-stride build alike and for the tile and the
    element copy alike (so x and A registers pair up, and the row sums are the rows'):
    row-major, lane t's register k is element 32 v (k div v) + v t + (k mod v) of the row's
    tile, 8 (float32) or 4 (16-bit) vectors; column-major, with D = 8 (float32) or 16 (16-bit)
    threads down a column, thread t's register k is row (t mod D) v + (k mod v) and column
    (t div D) + 32 (k div v) of the block's tile, 4 (float32) or 8 (16-bit) vectors."""
    v = cute_impl.VECTOR_BYTES // dtype.itemsize
    if layout == "row":
        threads = [0, 1, 7, 8, 30, 31]
        vectors = cute_impl.ROW_VECTORS_PER_THREAD[dtype.itemsize * 8]
    else:
        down = cute_impl.THREADS_DOWN_A_COLUMN[dtype.itemsize * 8]
        threads = [0, 1, 7, 8, 9, 15, 16, 31, 32, 127, 128, 200, 255]
        threads += [t for t in (256, 300, 511) if t < cute_impl.column_threads(dtype.itemsize * 8)]
        vectors = cute_impl.COLUMN_VECTORS_PER_THREAD[dtype.itemsize * 8]
    found = cute_impl.register_coordinates(dtype, layout, contiguous, threads)
    for (t, _), coords in found.items():
        assert len(coords) == vectors * v
        for k, coord in enumerate(coords):
            if layout == "row":
                expected = 32 * v * (k // v) + v * t + k % v
            else:
                expected = ((t % down) * v + k % v, t // down + 32 * (k // v))
            assert coord == expected, f"thread {t} register {k}: {coord}, not {expected}"


# ---------------------------------------------------------------------------------------------
# 5. GPU-only sizes


@pytest.mark.skipif(not ON_GPU, reason="A of 2**31 elements and more needs a GPU (4.3 GiB)")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_more_than_2_to_31_elements(impl, layout):
    """m = 2**16 + 8, n = 2**15 + 3 in bfloat16: 2.148e9 elements, so the last rows (row-major)
    or columns (column-major) start past 2**31 and a 32-bit offset would wrap and read the
    wrong ones. Column-major, m is a multiple of 8, so Triton takes its TMA kernel and CuTe
    its vector build. Checked against float64_gemv, with its own error in the bound."""
    m, n, dtype = 2**16 + 8, 2**15 + 3, torch.bfloat16
    shape = (m, n) if layout == "row" else (n, m)
    A = torch.randn(shape, device=DEVICE, dtype=dtype)
    A = A if layout == "row" else A.T
    x, y = random_vector(n, dtype), random_vector(m, dtype)
    exact = float64_gemv(ALPHA, A, x, BETA, y)
    bound = error_bound(impl, ALPHA, A, x, BETA, y, exact, gamma(n + 2, U64) + gamma(3, U64))
    implementation(impl)(ALPHA, A, x, BETA, y)
    assert_within_bound(y, exact, bound, f"{impl} {layout}")


@pytest.mark.skipif(not ON_GPU, reason="a stride of 2**31 + 1 needs 4.3 GB behind it: GPU only")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_leading_dimension_past_32_bits(impl, layout):
    """The two rows (row-major) or two columns (column-major) of A lie 2**31 + 1 bfloat16
    elements apart: cuBLAS refuses that leading dimension, so torch_impl copies A; the kernels
    index in 64 bits."""
    n, huge, dtype = 1000, 2**31 + 1, torch.bfloat16
    buffer = torch.empty(huge + n, device=DEVICE, dtype=dtype)
    if layout == "row":
        A = buffer.as_strided((2, n), (huge, 1))
    else:
        A = buffer.as_strided((n, 2), (1, huge))
    A.copy_(torch.randn(A.shape, device=DEVICE))
    x, y = random_vector(A.shape[1], dtype), random_vector(A.shape[0], dtype)
    try:
        check(impl, ALPHA, A, x, BETA, y, f"{layout} lines 2**31 + 1 apart")
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
