"""gemv, y = alpha*A*x + beta*y, in the CuTe DSL: README.md, "The mapping onto the GPU",
cute_impl.py, has the thread-value maps drawn out.

The files, in reading order:
cute_tiles.py     the map: the tiles' constants and geometry, the trees, one tile's products,
                  the tiled copies
cute_kernels.py   `row_major_kernel`, `column_major_kernel`, `sum_splits_kernel`, `launch_gemv`
cute_impl.py      this file:

    split_columns               how many parts the columns are cut into, and a part's tiles
    roundings                   README's k for A: the most roundings on one term's way to y_i
    mapping, is_vector_friendly which kernel, and whether its vector build takes A and x
    placeholders, build, compile_kernel   compiled once per specialisation, called by TVM-FFI
    ptx_of, register_coordinates          what the tests read on the CPU
    gemv                        the launcher
"""

import functools
import tempfile

import cutlass
import cutlass.cute as cute
import torch

from cute_kernels import launch_gemv
from cute_tiles import (
    COLUMN_VECTORS_PER_THREAD,
    LANES_PER_THREAD,
    ROW_VECTORS_PER_THREAD,
    THREADS_ACROSS_COLUMNS,
    THREADS_PER_BLOCK,
    VECTOR_BYTES,
    WARP_SIZE,
    block_geometry,
    column_tile,
    elems_per_vector,
    row_tile,
    tiled_copies,
)
from cute_tiles import THREADS_DOWN_A_COLUMN as THREADS_DOWN_A_COLUMN  # read by the tests
from cute_tiles import column_threads as column_threads  # read by the tests
from cute_tiles import rows_per_block as rows_per_block  # read by the tests
from reference import check_operands, to_float32

# The split (split_columns): fill FILL_THREADS, two 256-thread blocks for each of the H200's 132
# SMs (the occupancy the kernels run at), a constant so that the bits of y depend on the shape
# alone; a part must stream SPLIT_MIN_BYTES of A to outlast the second pass's start; at most
# MAX_SPLITS parts (a tree of 6 levels, one register a part in the second pass).
FILL_THREADS = 2 * 132 * THREADS_PER_BLOCK
SPLIT_MIN_BYTES = 128 * 1024
MAX_SPLITS = 64

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


def split_columns(m, n, dtype, layout):
    """(splits, tiles per split) for an (m, n) A of `dtype` in the 'row' or 'col' kernel: how many
    parts the columns are cut into, and how many column tiles each part takes (the last parts may
    take fewer, or none). splits is a power of two, 1 when the row blocks alone fill the GPU."""
    block_rows, tile_columns, threads = block_geometry(dtype, layout)
    row_blocks, tiles = -(-m // block_rows), -(-n // tile_columns)
    tile_bytes = block_rows * tile_columns * dtype.itemsize
    most = min(
        FILL_THREADS // threads // row_blocks, tiles * tile_bytes // SPLIT_MIN_BYTES, MAX_SPLITS
    )
    splits = 1 << (most.bit_length() - 1) if most > 1 else 1
    return splits, -(-tiles // splits)


def roundings(A):
    """README.md's k for the kernel gemv runs on A (n > 0): the most roundings on one term
    alpha a_ij x_j's way to y_i. A thread loads V vectors of v elements a tile and adds register
    k into lane k mod L (L = LANES_PER_THREAD), so each lane takes F = V v / L products a tile
    in series: F t - 1 additions over the t tiles of its part, after the product's own rounding
    (float32 data only; 16-bit products are exact). Then the trees: row-major, log2(L) levels
    in the thread and log2(WARP_SIZE) shuffle levels (warp_sum); column-major, log2(L / v)
    column slots in the thread and log2(THREADS_ACROSS_COLUMNS) levels over the row's partial
    sums; then log2(splits) levels over the parts, alpha * sum and the addition of beta * y_i."""
    (m, n), width = A.shape, A.element_size() * 8
    layout, v = mapping(A), elems_per_vector(width)
    if layout == "row":
        vectors, trees = ROW_VECTORS_PER_THREAD[width], [LANES_PER_THREAD, WARP_SIZE]
    else:
        vectors = COLUMN_VECTORS_PER_THREAD[width]
        trees = [LANES_PER_THREAD // v, THREADS_ACROSS_COLUMNS]
    splits, tiles = split_columns(m, n, A.dtype, layout)
    product = 1 if width == 32 else 0
    levels = sum(size.bit_length() - 1 for size in [*trees, splits])
    return product + (vectors * v // LANES_PER_THREAD * tiles - 1) + levels + 2


def mapping(A):
    """'col' when A's rows are adjacent in memory (column-major, A.stride(0) < A.stride(1)),
    else 'row': the contiguous dimension, or the nearer one for a strided view."""
    stride_m, stride_n = A.stride()
    return "col" if stride_m < stride_n else "row"


def elements_per_access(dtype, vector_friendly):
    """16 // element size for the vector build, 1 for the any-stride build."""
    return VECTOR_BYTES // dtype.itemsize if vector_friendly else 1


def is_vector_friendly(A, x, layout):
    """A's contiguous dimension has stride 1 and every row (row-major) or column (column-major)
    starts on a 16-byte boundary; row-major also reads x as vectors, so x must be contiguous
    and aligned as well."""
    stride_m, stride_n = A.stride()
    along, across = (stride_n, stride_m) if layout == "row" else (stride_m, stride_n)
    if along != 1 or across % (VECTOR_BYTES // A.element_size()) or A.data_ptr() % VECTOR_BYTES:
        return False
    return layout == "col" or (x.is_contiguous() and x.data_ptr() % VECTOR_BYTES == 0)


def placeholders(dtype, layout, vector_elems, splits):
    """What cute.compile sees of A, x, y and the split's partials: the dtype, 64-bit symbolic
    sizes (A's m shared with y's length and the partials' rows, its n with x's: each call checks
    they match) and strides. partials is None unsplit, else a float32 (splits, m) tensor with
    the constant stride 1 along m. A vector build
    has A's stride along the contiguous dimension the constant 1, the other a 64-bit symbolic
    multiple of v, and a 16-byte aligned start, and row-major x the stride 1 and a 16-byte
    aligned start; every other stride is a 64-bit symbolic one on an element boundary. The
    compiled function checks each call's tensors against them (dtype, device, alignment,
    strides, sizes) and raises rather than run on a mismatch."""
    element, size = TORCH_TO_CUTLASS[dtype], dtype.itemsize
    m, n = cute.sym_int64(), cute.sym_int64()
    if vector_elems == 1:
        a_stride = (cute.sym_int64(), cute.sym_int64())
    elif layout == "row":
        a_stride = (cute.sym_int64(divisibility=vector_elems), 1)
    else:
        a_stride = (1, cute.sym_int64(divisibility=vector_elems))
    x_vector = vector_elems > 1 and layout == "row"
    x_stride, x_align = (1, VECTOR_BYTES) if x_vector else (cute.sym_int64(), size)
    make = cute.runtime.make_fake_tensor
    partials = None
    if splits > 1:
        partials = make(cutlass.Float32, (splits, m), stride=(cute.sym_int64(), 1), assumed_align=4)
    return (
        make(element, (m, n), stride=a_stride, assumed_align=size * vector_elems),
        make(element, (n,), stride=(x_stride,), assumed_align=x_align),
        make(element, (m,), stride=(cute.sym_int64(),), assumed_align=size),
        partials,
    )


def build(dtype, layout, vector_elems, read_a, read_y, splits=1, options=""):
    """cute.compile the launcher for TVM-FFI calls on torch tensors and numbers (A, x, y,
    partials or None, alpha, beta, tiles per split), on the stream torch has current for their
    device."""
    if vector_elems not in (1, elements_per_access(dtype, True)):
        raise ValueError(f"vector_elems must be 1 or {elements_per_access(dtype, True)}")
    if layout not in ("row", "col"):
        raise ValueError(f"layout must be 'row' or 'col', got {layout!r}")
    A, x, y, partials = placeholders(dtype, layout, vector_elems, splits)
    return cute.compile(
        launch_gemv, A, x, y, partials, 1.0, 1.0, cutlass.Int64(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        layout, vector_elems, read_a, read_y, options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(dtype, layout, vector_elems, read_a, read_y, splits):
    """The compiled gemv for torch `dtype`, A's `layout` ('row' or 'col'), `vector_elems`
    elements per access of A, loading A and x only if read_a and y only if read_y, its columns
    in `splits` parts; built once (about a second) and cached. Compiling needs no GPU. What is
    cached is the TVM-FFI function itself, which takes torch tensors and checks them against
    its build."""
    return build(dtype, layout, vector_elems, read_a, read_y, splits).__tvm_ffi_object__()


def ptx_of(dtype, layout, contiguous, read_a=True, read_y=True, splits=1):
    """The PTX of the vector build (contiguous=True) or of the any-stride build of the 'row'
    or 'col' kernel, for sm_90a (H200): what the tests read to check for 128-bit loads and
    warp shuffles."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        vector_elems = elements_per_access(dtype, contiguous)
        return build(dtype, layout, vector_elems, read_a, read_y, splits, options).__ptx__


@cute.jit
def record_coordinates(
    dtype: cutlass.Constexpr,
    layout: cutlass.Constexpr[str],
    vector_elems: cutlass.Constexpr[int],
    threads: cutlass.Constexpr,
    found: cutlass.Constexpr,
):
    """Append to `found`, for each thread and for the tile copy then the element copy, the
    coordinates of its registers in one tile. Pure layout algebra, run while tracing."""
    tile_copy, element_copy = tiled_copies(dtype, layout, vector_elems)
    tile = (
        row_tile(dtype.width) if cutlass.const_expr(layout == "row") else column_tile(dtype.width)
    )
    identity = cute.make_identity_tensor(tile)
    for i in cutlass.range_constexpr(len(threads)):
        for thread_copy in (tile_copy, element_copy):
            coords = thread_copy.get_slice(threads[i]).partition_S(identity)
            found.append([coords[k] for k in range(cute.size(coords))])


def register_coordinates(dtype, layout, contiguous, threads):
    """{(thread, 'tile' or 'element'): the coordinate in one tile of each of its registers},
    from the layouts the kernels are built with: what the tests check README.md's formulas
    against. Runs on the host; needs no GPU."""
    found = []
    vector_elems = elements_per_access(dtype, contiguous)
    record_coordinates(TORCH_TO_CUTLASS[dtype], layout, vector_elems, tuple(threads), found)
    keys = [(t, copy) for t in threads for copy in ("tile", "element")]
    return dict(zip(keys, found, strict=True))


def gemv(alpha, A, x, beta, y):
    """y = alpha*A*x + beta*y for CUDA tensors of one dtype, in float32; returns y."""
    check_operands(alpha, A, x, beta, y)
    if not y.is_cuda:
        raise ValueError(f"A, x and y are on {y.device}; the CuTe kernel needs CUDA tensors")
    m, n = A.shape
    if m == 0:
        return y
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    layout = mapping(A)
    vector_elems = elements_per_access(A.dtype, is_vector_friendly(A, x, layout))
    read_a = alpha32 != 0.0 and n > 0
    splits, tiles_per_split = split_columns(m, n, A.dtype, layout) if read_a else (1, 0)
    # The parts' row sums, per call from torch's caching allocator: calls on different streams
    # may run side by side.
    partials = (
        torch.empty((splits, m), dtype=torch.float32, device=y.device) if splits > 1 else None
    )
    # TVM-FFI launches on torch's current stream of the operands' GPU: ordered with the caller's
    # torch work and capturable by a CUDA graph (call once before capturing: the first call
    # loads the compiled module). alpha32 and beta32 pass as Float32 exactly.
    compile_kernel(A.dtype, layout, vector_elems, read_a, beta32 != 0.0, splits)(
        A, x, y, partials, alpha32, beta32, tiles_per_split
    )
    return y
