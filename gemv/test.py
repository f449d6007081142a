"""Tests for gemv: every implementation lands within the bound README.md derives.

This file is section (1), the set-up and the bound model (its stand-in, its negative controls),
with the helpers the sections share; each later section is a file of its own, run in this order:
test_2_contract.py (the contract over every implementation), test_3_triton.py (Triton's builds
and dispatch, with the column split both kernels share), test_4_cute.py (CuTe's builds, dispatch
and PTX), test_5_gpu.py (GPU-only sizes). Run them all with `python test.py` (extra arguments go
to pytest: `python test.py -k triton -x`) or `nox -s gemv` from the top. Without a GPU, torch
runs on the CPU, Triton under its interpreter, and the CuTe kernels are compiled for sm_90a and
their PTX checked; launching them needs the GPU, and those tests say so when they skip.
"""

import os
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

CUTE_MISSING = None  # why the CuTe tests skip: set below where cute_impl cannot be imported
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


# Sections (2) and (3) both count the column split.
def splits_of(impl, A):
    """How many parts impl's kernels cut A's columns into."""
    if impl == "triton":
        return triton_impl.column_split(A)[0]
    return cute_impl.split_columns(*A.shape, A.dtype, cute_impl.mapping(A))[0]


if __name__ == "__main__":
    options = ["-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    # The section files, in their numbered order: every test_*.py beside this file.
    files = [__file__, *sorted(str(path) for path in HERE.glob("test_*.py"))]
    sys.exit(pytest.main([*files, *options, *sys.argv[1:]]))
