"""Softmax tests, section (4): the CuTe builds, their plans and their PTX (sm_90a, on the CPU).
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
import torch
from test import DTYPES, cute_1_two_pass, cute_2_cluster, cute_impl, each_dtype, needs_cute

# (4) CuTe builds and PTX ---------------------------------------------------------------------


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_ptx(direction, dtype):
    """The CuTe kernels build for sm_90a: 128-bit loads and stores on the vector path (none in
    the any-stride build), the warp shuffles of block_sum, and in the forward the ex2.approx
    and the correctly rounded reciprocal README.md's bound counts."""
    vector = cute_impl.ptx_of(direction, dtype, contiguous=True)
    scalar = cute_impl.ptx_of(direction, dtype, contiguous=False)
    assert "ld.global.v4" in vector and "st.global.v4" in vector
    assert "ld.global.v4" not in scalar
    assert "shfl.sync.bfly" in vector
    if direction == "forward":
        assert "ex2.approx.ftz.f32" in vector and "rcp.rn.f32" in vector
        assert "div.approx" not in vector and "rcp.approx" not in vector


LONGEST_PLANNED = {"forward": 131072, "backward": 131072}  # clusters of 8 and 16 blocks


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
@each_dtype
def test_cute_cluster_ptx(direction, dtype):
    """Step 2 builds for sm_90a: the block's rank in its cluster, mapa and st.async into the
    peers' shared memory completing an mbarrier's bytes, the wait on it, the cluster barrier
    that orders the mbarriers' set-up, 128-bit accesses, in the forward one exp per element
    held (no online rescale: the max is known first), and what keeps the slice of every
    operand in flight (README.md, step 2)."""
    plan = cute_impl.kernel_plan(direction, LONGEST_PLANNED[direction], dtype)
    assert plan[1] > 1
    ptx = cute_impl.ptx_of(direction, dtype, contiguous=True, plan=plan)
    for instruction in (
        "%cluster_ctarank", "mapa.shared::cluster", "mbarrier.try_wait", "barrier.cluster.arrive",
        "st.async.shared::cluster.mbarrier::complete_tx::bytes", "barrier.cluster.wait",
        "ld.global.v4", "st.global.v4",
    ):  # fmt: skip
        assert instruction in ptx, instruction
    exps = cute_2_cluster.CLUSTER_VALUES if direction == "forward" else 0
    assert ptx.count("ex2.approx.ftz.f32") == exps
    assert ("rcp.rn.f32" in ptx) == (direction == "forward")
    # The whole slice of every operand in flight at once: its 128-bit loads in one
    # straight-line block (no branch between two of them), and the register budget of
    # BLOCKS_PER_SM blocks an SM.
    slice_vectors = cute_2_cluster.CLUSTER_VALUES * dtype.itemsize // cute_impl.VECTOR_BYTES
    assert longest_load_run(ptx) == slice_vectors
    assert f".minnctapersm {cute_2_cluster.BLOCKS_PER_SM}" in ptx


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_cute_single_block_ptx(direction):
    """A row one block holds (C = 1, bf16 N = 8192: two tiles of each operand): no cluster
    instructions, and the loads of every operand in one straight-line block."""
    plan = cute_impl.kernel_plan(direction, 8192, torch.bfloat16)
    assert plan == (2, 1)
    ptx = cute_impl.ptx_of(direction, torch.bfloat16, contiguous=True, plan=plan)
    for instruction in ("%cluster_ctarank", "mapa", "st.async", "barrier.cluster", "mbarrier"):
        assert instruction not in ptx, instruction
    operands = cute_2_cluster.OPERANDS_HELD[direction]
    assert longest_load_run(ptx) == operands * 2 * cute_1_two_pass.VECTORS_PER_THREAD


def longest_load_run(ptx):
    """The most 128-bit loads in a row of PTX with no label or branch between them."""
    run = longest = 0
    for line in ptx.splitlines():
        if "ld.global.v4" in line:
            run += 1
            longest = max(longest, run)
        elif line.startswith("$L") or "bra" in line:
            run = 0
    return longest


@needs_cute
def test_load_run_rejects_tile_by_tile_loads():
    """Negative control of the check above: step 1, which loads a tile (two vectors a
    thread) and uses it before the next, shows runs of two."""
    ptx = cute_impl.ptx_of("forward", torch.bfloat16, contiguous=True)
    assert longest_load_run(ptx) == cute_1_two_pass.VECTORS_PER_THREAD


PLANNED_N = sorted({n for k in range(19) for n in (2**k - 1, 2**k, 2**k + 1)} - {0})


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
@each_dtype
def test_cute_plans(direction, dtype):
    """Every N from 1 to 262144 (2**k and its neighbours): step 2's plan (T tiles a block, C
    blocks a cluster) covers the row with the fewest powers of two, within the registers a
    thread holds (CLUSTER_VALUES over the operands) and MAX_CLUSTER; the rows past that, and
    only those, take step 1."""
    width = dtype.itemsize * 8
    tile_elems, per_thread = cute_1_two_pass.tile_shape(width)
    slice_tiles = cute_2_cluster.CLUSTER_VALUES // cute_2_cluster.OPERANDS_HELD[direction]
    slice_tiles //= per_thread
    longest = cute_2_cluster.MAX_CLUSTER * slice_tiles * tile_elems
    for n in PLANNED_N:
        plan = cute_impl.kernel_plan(direction, n, dtype)
        if n > longest:
            assert plan is None, n
            continue
        tiles, size = plan
        assert tiles & (tiles - 1) == 0 and size & (size - 1) == 0, (n, plan)
        assert tiles * size * tile_elems >= n, (n, plan)  # covers the row
        assert tiles <= slice_tiles and size <= cute_2_cluster.MAX_CLUSTER, (n, plan)
        assert size == 1 or tiles == slice_tiles, (n, plan)  # a cluster only past one block
        assert tiles * size == 1 or tiles * size * tile_elems < 2 * n, (n, plan)  # the fewest
    assert cute_impl.kernel_plan(direction, longest + 1, dtype) is None


@needs_cute
def test_cute_dispatch():
    """The plans bench.py's shapes take, and the bound's counts that follow from them."""
    plan = cute_impl.kernel_plan
    assert plan("forward", 131072, torch.bfloat16) == (4, 8)
    assert plan("backward", 131072, torch.bfloat16) == (2, 16)
    assert plan("backward", 131072, torch.float32) == (4, 16)
    assert plan("forward", 262144, torch.float32) == (8, 16)
    assert plan("backward", 262144, torch.bfloat16) is None
    assert plan("backward", 4096, torch.bfloat16) == plan("forward", 1, torch.float32) == (1, 1)
    assert cute_impl.forward_path(65536, torch.bfloat16) == (1, 6 + 8 + 2)
    assert cute_impl.backward_path(131072, torch.bfloat16) == 5 + 8 + 4
    assert cute_impl.backward_path(262144, torch.bfloat16) == 4 + 1 + 63 + 8  # step 1


@needs_cute
@pytest.mark.parametrize("direction", ["forward", "backward"])
@each_dtype
def test_cute_every_plan_builds(direction, dtype):
    """Every plan of the N above compiles for sm_90a (both access widths of the largest)."""
    plans = {cute_impl.kernel_plan(direction, n, dtype) for n in PLANNED_N} - {None}
    for plan in sorted(plans):
        assert "ld.global" in cute_impl.ptx_of(direction, dtype, contiguous=True, plan=plan)
    assert "ld.global.v4" not in cute_impl.ptx_of(direction, dtype, False, plan=max(plans))


PAST_INT32_ROWS = 2**31 + 3  # an Int32 M would keep 3 of these rows


@needs_cute
def test_cute_launches_row_slices():
    """Past ROWS_PER_LAUNCH rows the compiled launcher runs once a slice of at most that many
    rows: views of every operand, covering the rows once and in order (meta tensors, sized
    but never allocated, stand in for the GPU's and a recorder for the launcher). Up to it,
    one launch on the operands themselves."""
    limit = cute_impl.ROWS_PER_LAUNCH
    y, dy, dx = (torch.empty(PAST_INT32_ROWS, 2, dtype=torch.bfloat16, device="meta")
                 for _ in range(3))  # fmt: skip
    launches = []
    cute_impl.launch_on_row_slices(lambda *rows: launches.append(rows), (y, dy, dx))
    assert len(launches) == -(-PAST_INT32_ROWS // limit) == 33
    start = 0
    for rows in launches:
        m = rows[0].shape[0]
        assert 0 < m <= limit
        for row_slice, whole in zip(rows, (y, dy, dx), strict=True):
            assert row_slice.shape == (m, 2) and row_slice.stride() == whole.stride()
            assert row_slice.storage_offset() == start * whole.stride(0)
        start += m
    assert start == PAST_INT32_ROWS
    launches.clear()
    at_limit = (y[:limit], dy[:limit], dx[:limit])
    cute_impl.launch_on_row_slices(lambda *rows: launches.append(rows), at_limit)
    assert len(launches) == 1 and all(a is b for a, b in zip(launches[0], at_limit, strict=True))
