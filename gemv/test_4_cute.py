"""gemv tests, section (4): CuTe's builds, dispatch and PTX, compiled for sm_90a on the CPU.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
import torch
from test import (
    DTYPES,
    LAYOUTS,
    cute_impl,
)

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
