"""gemv tests, section (3): Triton's builds and dispatch, and the column split and grids both
kernels share. The set-up, the bound model and the shared helpers live in test.py, which runs
this file."""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from test import (
    ALPHA,
    BETA,
    CUTE_MISSING,
    DEVICE,
    DTYPES,
    HERE,
    LAYOUTS,
    SHAPES,
    cute_impl,
    error_bound,
    guarded_matrix,
    h200_sized,
    random_matrix,
    random_vector,
    splits_of,
)

import reference
import triton_impl
from common.tolerance import assert_within_bound

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
TRITON_PTX_SCRIPT = r"""
import json
import re
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
    # A 32-bit loop stepping by a constant > 1 wraps past 2**31 - 1 on its last step.
    steps = re.findall(r"scf\.for .* step %c(\d+)_i32", kernel.asm["ttir"])
    # Split, the row sums go to the float32 partials instead of y: a store of 32 bits.
    return [ptx.count("cp.async.bulk.tensor"), kernel.metadata.shared,
            ptx.count("st.global.b32") + ptx.count("st.global.v4.b32"),
            sum(step != "1" for step in steps)]

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
    stores, 32-bit loops stepping by a constant > 1] of the TMA kernel unsplit and split,
    'dtype sum_splits s': global loads of sum_splits_kernel over s parts}"""
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
    sum_splits_kernel compiles from 2 up to MAX_SPLITS parts. The column loop counts steps:
    `col < stop; col += BLOCK_N` in 32 bits wraps on its last step when n is within BLOCK_N of
    2**31 (TMA takes n up to 2**31 - 1), and would never end."""
    block_m, block_n, _, stages = triton_impl.TMA_TILES[dtype.itemsize]
    name = str(dtype)[6:]
    for variant in ("tma", "tma split"):
        copies, shared, _, stepped_loops = triton_loads[f"{name} {variant}"]
        assert copies >= 2, variant
        assert stepped_loops == 0, f"{variant}: a column loop by BLOCK_N can wrap past 2**31"
        assert shared >= (stages - 1) * block_m * block_n * dtype.itemsize, variant
    assert triton_loads[f"{name} tma split"][2] > 0
    if dtype == torch.bfloat16:
        assert triton_loads[f"{name} tma"][2] == 0
    for splits in (2, triton_impl.MAX_SPLITS):
        assert triton_loads[f"{name} sum_splits {splits}"] >= 1


@triton.jit
def part_columns_probe(out_ptr, split_cols, n):
    """out[2 p], out[2 p + 1] = triton_impl.part_columns(p, split_cols, n) for a 32-bit part p
    = program_id(0), as gemv_tma_kernel has them."""
    part = tl.program_id(0)
    start, stop = triton_impl.part_columns(part, split_cols, n)
    tl.store(out_ptr + 2 * part, start.to(tl.int64))
    tl.store(out_ptr + 2 * part + 1, stop.to(tl.int64))


def test_tma_columns_near_2_to_31():
    """gemv_tma_kernel's column arithmetic for a column-major A of n = 2**31 - 64 (8 x n
    bfloat16, 32 GiB, splits into 64 parts of 2**25 columns): the last part ends at n, where
    its start + 2**25 = 2**31 in 32 bits wrapped to -2**31 and the part came out empty, its
    columns silently dropped. (A column step starts on a multiple of BLOCK_N below n, so its
    columns stay below 2**31.)"""
    n, parts = 2**31 - 64, 64
    block_m, block_n = triton_impl.TMA_TILES[2][:2]
    splits, steps = triton_impl.split_columns(8, n, block_m, block_n, 2)
    split_cols = steps * block_n
    assert (splits, split_cols) == (parts, 2**25)
    found = torch.zeros(2 * parts, dtype=torch.int64, device=DEVICE)
    part_columns_probe[(parts,)](found, split_cols, n)
    expected = [[p * split_cols, min(n, (p + 1) * split_cols)] for p in range(parts)]
    assert found.view(parts, 2).tolist() == expected


def test_specialisation_is_tritons():
    """triton_impl.specialisation(), which keys the direct launches (`launch`), tells two ints,
    or two tensors, apart exactly when Triton's binder (native_specialize_impl, for sm_90) does:
    1, multiples of 16 and not, on both sides of 2**31; each dtype at addresses 16-byte aligned
    and not. A key that missed one of these would launch a kernel compiled for another."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    ints = [0, 1, 2, 15, 16, 17, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 16, 2**62]
    buffer = torch.empty(64, device=DEVICE)
    tensors = [buffer.to(dtype)[offset:] for dtype in DTYPES for offset in (0, 1, 4, 8)]
    for values, ours in [
        (ints, lambda x: triton_impl.specialisation((x,), ())),
        (tensors, lambda t: triton_impl.specialisation((), (t,))),
    ]:
        theirs = lambda x: native_specialize_impl(backend, x, False, True, True)  # noqa: E731
        for x in values:
            for y in values:
                assert (ours(x) == ours(y)) == (theirs(x) == theirs(y)), (x, y)
