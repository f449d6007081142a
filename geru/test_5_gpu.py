"""geru tests, section (5): GPU-only sizes.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
import torch
from test import (
    DEVICE,
    IMPLS,
    MARGIN,
    ON_GPU,
    assert_within_bound,
    error_bound,
    float64_stand_in,
    implementation,
    random_vector,
)

import reference

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
