"""Tests for geru: every implementation lands within the bound README.md derives.

This file is section (1), the set-up and the bound model (its stand-in, its negative controls),
with the helpers the sections share; each later section is a file of its own, run in this order:
test_2_contract.py (the contract over every implementation), test_3_triton.py (Triton's builds:
the interpreter outside test.py, the PTX), test_4_cute.py (CuTe's builds and PTX), test_5_gpu.py
(GPU-only sizes). Run them all with `python test.py` (extra arguments go to pytest: `python
test.py -k triton -x`) or `nox -s geru` from the top. Without a GPU, torch runs on the CPU,
Triton under its interpreter, and the CuTe kernel is compiled for sm_90a and its PTX checked
(the Triton kernel's too); launching the CuTe kernel needs the GPU, and those tests say so when
they skip.

Every matrix under test is a view inside a NaN-filled buffer (`matrix_in_guard`): each check
also makes sure the poison around and between A's elements keeps its bits.
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


if __name__ == "__main__":
    options = ["-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    # The section files, in their numbered order: every test_*.py beside this file.
    files = [__file__, *sorted(str(path) for path in HERE.glob("test_*.py"))]
    sys.exit(pytest.main([*files, *options, *sys.argv[1:]]))
