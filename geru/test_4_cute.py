"""geru tests, section (4): CuTe's builds and PTX, compiled for sm_90a on the CPU.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
from test import (
    DTYPES,
    cute_impl,
)

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
