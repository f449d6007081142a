"""gemv tests, section (5): GPU-only sizes.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
import torch
from test import (
    ALPHA,
    BETA,
    DEVICE,
    IMPLS,
    LAYOUTS,
    ON_GPU,
    U64,
    check,
    error_bound,
    float64_gemv,
    implementation,
    random_vector,
)

import reference
import triton_impl
from common.tolerance import assert_within_bound, gamma

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


@pytest.mark.skipif(not ON_GPU, reason="an A of 8 x (2**31 - 64) needs 32 GiB: GPU only")
def test_triton_tma_split_near_2_to_31():
    """A column-major 8 x (2**31 - 64) bfloat16 A on the TMA kernel, its columns split into 64
    parts of 2**25: the last part ends at n, past 2**31 - 1 in 32 bits (its columns were
    dropped). A is ones and x zeros but for 64 ones spread over n, the last at n - 1, so
    y = alpha * 64 + beta * y exactly in float32, whatever the order of the sums."""
    m, n = 8, 2**31 - 64
    A = torch.ones(n, m, dtype=torch.bfloat16, device=DEVICE).T
    x = torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)
    # float64: a float32 linspace rounds n - 1 = 2**31 - 65 to 2**31 - 128 (spacing 128 there)
    x[torch.linspace(0, n - 1, 64, dtype=torch.float64, device=DEVICE).long()] = 1.0
    y = torch.randn(m, device=DEVICE).to(torch.bfloat16)
    assert triton_impl.tma_reads(A) and triton_impl.column_split(A)[0] == 64
    a32, b32 = reference.to_float32(ALPHA), reference.to_float32(BETA)
    exact = a32 * 64 + b32 * y.double()
    bound = 2**-8 * exact.abs() + 2**-22 * (abs(a32) * 64 + abs(b32) * y.double().abs())
    triton_impl.gemv(ALPHA, A, x, BETA, y)
    assert_within_bound(y, exact, bound, "triton, n = 2**31 - 64")
