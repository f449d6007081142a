"""geru, A = A + alpha * x * y^T, in the CuTe DSL: README.md, "The mapping onto the GPU",
cute_impl.py, draws the thread-value layout.

constants                    the tile: 8 rows x 1 KiB of the kernel's rows, 256 threads
load_broadcast, update_tile  one thread's share of a tile: a + (alpha x_i) y_j in float32
in_bounds_mask, geru_kernel  full tiles as 16-byte vectors, edge tiles element by element
row_major_layout, launch_geru   A (or A^T) seen as row-major, x and y as broadcast layouts
placeholders, build, compile_kernel   compiled once per specialisation, called by TVM-FFI
ptx_of                       the sm_90a PTX that test.py reads
steps, is_vector_friendly    which build A (and the operand along its rows) can take
geru                         the launcher
"""

import functools
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import check_operands, fastest_dim, to_float32

# 256 threads = 8 warps per block.
THREADS_PER_BLOCK = 256
# The widest load/store a thread can issue: 128 bits.
VECTOR_BYTES = 16
# The tile, as in triton_impl: 1 KiB along a row (64 threads of one 16-byte vector, two warps),
# 8 rows across, so 8 KiB of A per block and two vectors per thread. A chip-filling matrix,
# 16384 x 16384 float32, is 131072 blocks, some 124 waves of the H200's 132 SMs.
TILE_ROW_BYTES = 1024
TILE_ROWS = 8
THREADS_ALONG_ROW = TILE_ROW_BYTES // VECTOR_BYTES  # 64

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


@cute.jit
def load_broadcast(atom, mine, in_bounds):
    """This thread's x or y values (`mine`, a partition of X or Y), widened to float32."""
    registers = cute.make_rmem_tensor(mine.shape, mine.element_type)
    cute.copy(atom, mine, registers, pred=in_bounds)
    return registers.load().to(cutlass.Float32)


@cute.jit
def update_tile(thread_copy, x_atom, y_atom, a_tile, x_tile, y_tile, alpha, in_bounds):
    """a <- a + (alpha x) y on this thread's share of one tile (in_bounds None: all of it)."""
    # A is read, then written: the universal copy's source and destination layouts are the
    # same, so one partition serves both directions.
    a_mine = thread_copy.partition_S(a_tile)
    a_registers = cute.make_rmem_tensor_like(a_mine)
    cute.copy(thread_copy, a_mine, a_registers, pred=in_bounds)
    alpha_x = alpha * load_broadcast(x_atom, thread_copy.partition_S(x_tile), in_bounds)
    y = load_broadcast(y_atom, thread_copy.partition_S(y_tile), in_bounds)
    result = a_registers.load().to(cutlass.Float32) + alpha_x * y
    a_registers.store(result.to(a_registers.element_type))
    cute.copy(thread_copy, a_registers, a_mine, pred=in_bounds)


@cute.jit
def in_bounds_mask(thread_copy, coord_tile, rows, cols):
    """The predicate tensor: True where this thread's element has coordinates < (rows, cols)."""
    coords = thread_copy.partition_S(coord_tile)
    mask = cute.make_rmem_tensor(coords.shape, cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(mask)):
        mask[i] = cute.elem_less(coords[i], (rows, cols))
    return mask


@cute.kernel
def geru_kernel(
    a: cute.Tensor,
    x: cute.Tensor,
    y: cute.Tensor,
    rows: cutlass.Int64,
    cols: cutlass.Int64,
    tiles_per_row: cutlass.Int64,
    alpha: cutlass.Float32,
    vector_copy: cute.TiledCopy,
    element_copy: cute.TiledCopy,
    element_atom: cute.CopyAtom,
    along_atom: cute.CopyAtom,
    x_along: cutlass.Constexpr[bool],
    tile: cutlass.Constexpr,
):
    thread, _, _ = cute.arch.thread_idx()
    block_idx, _, _ = cute.arch.block_idx()
    # blockIdx is a 32-bit register: widen it before it meets the 64-bit tile arithmetic.
    block = cutlass.Int64(block_idx)
    tile_coord = (block // tiles_per_row, block % tiles_per_row)
    a_tile = cute.local_tile(a, tile, tile_coord)
    x_tile = cute.local_tile(x, tile, tile_coord)
    y_tile = cute.local_tile(y, tile, tile_coord)
    # rows and cols come from their own 64-bit arguments, never from a.shape: CuTe DSL 4.8.1
    # truncates a dynamic shape read back from a tensor to 32 bits.
    inside_rows = (tile_coord[0] + 1) * tile[0] <= rows
    inside_cols = (tile_coord[1] + 1) * tile[1] <= cols
    if inside_rows & inside_cols:
        thread_copy = vector_copy.get_slice(thread)
        x_atom, y_atom = (along_atom, element_atom) if x_along else (element_atom, along_atom)
        update_tile(thread_copy, x_atom, y_atom, a_tile, x_tile, y_tile, alpha, None)
    else:
        thread_copy = element_copy.get_slice(thread)
        identity = cute.make_identity_tensor((rows, cols))
        coord_tile = cute.local_tile(identity, tile, tile_coord)
        in_bounds = in_bounds_mask(thread_copy, coord_tile, rows, cols)
        update_tile(
            thread_copy, element_atom, element_atom, a_tile, x_tile, y_tile, alpha, in_bounds
        )


def row_major_layout(rows, cols, row_stride, col_stride, vector_elems):
    """The layout (i, j) -> i*row_stride + j*col_stride as the kernel sees A. A vector build
    fixes the column stride to the compile-time constant 1 (col_stride is ignored) and promises
    a row stride divisible by the vector, so that CuTe can prove each 16-byte access aligned."""
    if cutlass.const_expr(vector_elems == 1):
        return cute.make_layout((rows, cols), stride=(row_stride, col_stride))
    return cute.make_layout((rows, cols), stride=(cute.assume(row_stride, divby=vector_elems), 1))


@cute.jit
def launch_geru(
    alpha: cutlass.Float32,
    x: cute.Tensor,
    y: cute.Tensor,
    a: cute.Tensor,
    stream: cuda.CUstream,
    vector_elems: cutlass.Constexpr[int],
    rows_contiguous: cutlass.Constexpr[bool],
    along_vector_elems: cutlass.Constexpr[int],
):
    # x, y and A arrive as torch tensors through TVM-FFI, with the layouts they were compiled
    # for (`placeholders`): a vector build knows A's unit stride, its other stride divisible by
    # the vector and its 16-byte aligned start when it compiles (and the same of the operand
    # along the rows when that is read as vectors), which lets it merge adjacent elements into
    # one 128-bit access. The kernel's tensors are new layouts over the same pointers.
    dtype = a.element_type
    elem_bytes = dtype.width // 8
    # m and n from cute.size, 64-bit: CuTe DSL 4.8.1 reads a.shape[i] back as 32 bits.
    m = cutlass.Int64(cute.size(a, mode=[0]))
    n = cutlass.Int64(cute.size(a, mode=[1]))
    # Strides read back whole: the constant 1 of a vector build stays a constant.
    a_row_stride, a_col_stride = a.stride[0], a.stride[1]
    x_stride, y_stride = x.stride[0], y.stride[0]
    # The kernel's rows and columns: A's own when its rows are contiguous, else those of A^T.
    # Either way X holds x_i wherever A holds a_ij, and Y holds y_j.
    if cutlass.const_expr(rows_contiguous):
        rows, cols, row_stride, col_stride = m, n, a_row_stride, a_col_stride
        x_layout = cute.make_layout((m, n), stride=(x_stride, 0))
        y_layout = cute.make_layout((m, n), stride=(0, y_stride))
    else:
        rows, cols, row_stride, col_stride = n, m, a_col_stride, a_row_stride
        x_layout = cute.make_layout((n, m), stride=(0, x_stride))
        y_layout = cute.make_layout((n, m), stride=(y_stride, 0))
    a = cute.make_tensor(
        a.iterator, row_major_layout(rows, cols, row_stride, col_stride, vector_elems)
    )
    x = cute.make_tensor(x.iterator, x_layout)
    y = cute.make_tensor(y.iterator, y_layout)

    # The TV layout: 64 threads side by side along a row, 4 rows of them (thread t sits at
    # (t // 64, t % 64)), each holding one 16-byte vector's worth of adjacent elements of its row.
    # It is the same in both builds: only the copy atom, the width of one access, changes.
    elems_per_vector = VECTOR_BYTES // elem_bytes
    thread_rows = THREADS_PER_BLOCK // THREADS_ALONG_ROW
    thread_layout = cute.make_layout(
        (thread_rows, THREADS_ALONG_ROW), stride=(THREADS_ALONG_ROW, 1)
    )
    value_layout = cute.make_layout((1, elems_per_vector))
    tile = (TILE_ROWS, THREADS_ALONG_ROW * elems_per_vector)
    vector_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width * vector_elems
    )
    element_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width
    )
    along_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width * along_vector_elems
    )
    vector_copy = cute.make_tiled_copy_tv(vector_atom, thread_layout, value_layout)
    element_copy = cute.make_tiled_copy_tv(element_atom, thread_layout, value_layout)

    tiles_per_row = (cols + tile[1] - 1) // tile[1]
    tiles = (rows + tile[0] - 1) // tile[0] * tiles_per_row
    kernel = geru_kernel(
        a, x, y, rows, cols, tiles_per_row, alpha, vector_copy, element_copy, element_atom,
        along_atom, not rows_contiguous, tile,
    )  # fmt: skip
    kernel.launch(grid=[tiles, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream)


def elements_per_access(dtype, vector_friendly):
    """16 // element size for the vector build, 1 for the any-stride build."""
    return VECTOR_BYTES // dtype.itemsize if vector_friendly else 1


def placeholders(dtype, vector_elems, rows_contiguous, along_vector_elems):
    """What cute.compile sees of x, y and A: the dtype, 64-bit symbolic sizes shared by the
    operands that must match (len(x) = m, len(y) = n), and 64-bit symbolic strides, except
    in a vector build: A's unit stride the constant 1, its other stride divisible by the
    vector and its start on a 16-byte boundary, and likewise the constant stride 1 and a
    16-byte start for the operand along the rows when it is read as vectors. The compiled
    function checks each call's tensors against them (dtype, device, sizes, alignment,
    strides, skipping the strides of dims of size 1) and raises rather than run on a mismatch."""
    cutlass_dtype, m, n = TORCH_TO_CUTLASS[dtype], cute.sym_int64(), cute.sym_int64()
    if vector_elems == 1:
        a_strides = (cute.sym_int64(), cute.sym_int64())
    elif rows_contiguous:
        a_strides = (cute.sym_int64(divisibility=vector_elems), 1)
    else:
        a_strides = (1, cute.sym_int64(divisibility=vector_elems))
    a = cute.runtime.make_fake_tensor(
        cutlass_dtype, (m, n), stride=a_strides, assumed_align=dtype.itemsize * vector_elems
    )

    def vector(length, along):  # x or y; `along`: the operand that varies along the rows
        elems = along_vector_elems if along else 1
        return cute.runtime.make_fake_tensor(
            cutlass_dtype, (length,), stride=(1 if elems > 1 else cute.sym_int64(),),
            assumed_align=dtype.itemsize * elems,
        )  # fmt: skip

    return vector(m, not rows_contiguous), vector(n, rows_contiguous), a


def build(dtype, vector_elems, rows_contiguous, along_vector_elems=1, options=""):
    """cute.compile the launcher for TVM-FFI calls on torch tensors, on the stream torch has
    current for their device, alpha a Python float (already a float32 value)."""
    if vector_elems not in (1, elements_per_access(dtype, True)):
        raise ValueError(f"vector_elems must be 1 or {elements_per_access(dtype, True)}")
    if along_vector_elems not in (1, vector_elems):
        raise ValueError("the operand along the rows is read as vectors only when A is")
    return cute.compile(
        launch_geru, 1.0, *placeholders(dtype, vector_elems, rows_contiguous, along_vector_elems),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        vector_elems, rows_contiguous, along_vector_elems,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(dtype, vector_elems, rows_contiguous, along_vector_elems):
    """The compiled geru for torch `dtype`, moving `vector_elems` elements of A and
    `along_vector_elems` of the operand along the rows per access, with the tile's rows along
    A's rows (rows_contiguous) or along its columns; built once (about a second) and cached.
    Compiling needs no GPU. What is cached is the TVM-FFI function itself, which takes torch
    tensors and checks them against its build."""
    return build(dtype, vector_elems, rows_contiguous, along_vector_elems).__tvm_ffi_object__()


def ptx_of(dtype, contiguous, rows_contiguous=True, along_vector=False):
    """The PTX of the vector build (contiguous=True) or of the any-stride build, for sm_90a
    (H200), reading the operand along the rows as vectors if along_vector: what the tests read
    to check for 128-bit loads and stores."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        vector_elems = elements_per_access(dtype, contiguous)
        along = elements_per_access(dtype, along_vector)
        return build(dtype, vector_elems, rows_contiguous, along, options).__ptx__


def steps(A):
    """A's strides, with 0 for a dim of size 1: it never steps, so whatever torch reports for it
    does not count against a vector build (the compiled function skips it as well)."""
    return tuple(
        stride if size > 1 else 0 for size, stride in zip(A.shape, A.stride(), strict=True)
    )


def is_vector_friendly(A, inner):
    """Rows, as the kernel sees A (along dim `inner`, `fastest_dim(A)`), of adjacent elements
    that all start on 16-byte boundaries."""
    step, vector_elems = steps(A), VECTOR_BYTES // A.element_size()
    return (
        step[inner] in (0, 1)
        and step[1 - inner] % vector_elems == 0
        and A.data_ptr() % VECTOR_BYTES == 0
    )


def geru(alpha, x, y, A):
    """A = A + alpha x y^T for a CUDA matrix A and vectors x, y of one dtype, in float32;
    returns A."""
    check_operands(alpha, x, y, A)
    if not A.is_cuda:
        raise ValueError(f"x, y and A are on {A.device}; the CuTe kernel needs CUDA tensors")
    alpha32 = to_float32(float(alpha))
    m, n = A.shape
    if alpha32 == 0.0 or m == 0 or n == 0:  # alpha == 0: x and y are not read, A not written
        return A
    inner = fastest_dim(A)
    vector_a = is_vector_friendly(A, inner)
    along = y if inner == 1 else x
    vector_along = vector_a and along.stride(0) == 1 and along.data_ptr() % VECTOR_BYTES == 0
    kernel = compile_kernel(
        A.dtype,
        elements_per_access(A.dtype, vector_a),
        inner == 1,
        elements_per_access(A.dtype, vector_along),
    )
    # TVM-FFI launches on torch's current stream: ordered with the caller's torch work and
    # capturable by a CUDA graph (call once before capturing: the first call loads the module).
    kernel(alpha32, x, y, A)
    return A
