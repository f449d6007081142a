"""scal in the CuTe DSL: y = alpha * y, bit for bit the reference's two roundings.

The mapping is copy's (README.md's "cute_impl.py" section, with the ASCII map of the thread-value
layout). In this file, top to bottom:

* `scale_tile`, `in_bounds_mask`, `scal_kernel`: one block scales one tile in float32 (or only
  writes zeros when alpha32 == 0); the last tile under a predicate tensor.
* `launch_scal`: the thread-value layout, the copy atoms and the grid.
* `placeholder`, `build`, `compile_kernel`, `ptx_of`: what `cute.compile` sees, the TVM-FFI
  build cached per (dtype, vector width, read_y), and its sm_90a PTX for the tests.
* `scal`: the public function; rounds alpha to float32 and picks the build.
"""

import functools
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import check_operands, to_float32

# 256 threads = 8 warps per block.
THREADS_PER_BLOCK = 256
# The widest load/store a thread can issue: 128 bits.
VECTOR_BYTES = 16
# Bytes each thread moves per operand: one vector, so 4 KiB tiles; many small blocks keep every
# SM streaming and the last wave short (README.md, tuning log: 16 KiB tiles ran 4-5% slower).
BYTES_PER_THREAD = VECTOR_BYTES

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


@cute.jit
def scale_tile(thread_copy, y_tile, alpha, read_y: cutlass.Constexpr[bool], in_bounds):
    """y <- alpha*y on this thread's share of one tile (in_bounds None: all of it)."""
    # y is read, then written: the universal copy's source and destination layouts are the
    # same, so one partition serves both directions.
    y_mine = thread_copy.partition_S(y_tile)
    registers = cute.make_rmem_tensor_like(y_mine)
    if cutlass.const_expr(read_y):
        cute.copy(thread_copy, y_mine, registers, pred=in_bounds)
        scaled = alpha * registers.load().to(cutlass.Float32)
        registers.store(scaled.to(registers.element_type))
    else:
        registers.fill(0.0)
    cute.copy(thread_copy, registers, y_mine, pred=in_bounds)


@cute.jit
def in_bounds_mask(thread_copy, coord_tile, n):
    """The predicate tensor: True where this thread's element has an index < n."""
    coords = thread_copy.partition_S(coord_tile)
    mask = cute.make_rmem_tensor(coords.shape, cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(mask)):
        mask[i] = cute.elem_less(coords[i], n)
    return mask


@cute.kernel
def scal_kernel(
    y: cute.Tensor,
    n: cutlass.Int64,
    alpha: cutlass.Float32,
    vector_copy: cute.TiledCopy,
    element_copy: cute.TiledCopy,
    tile_elems: cutlass.Constexpr[int],
    read_y: cutlass.Constexpr[bool],
):
    thread, _, _ = cute.arch.thread_idx()
    block_idx, _, _ = cute.arch.block_idx()
    # blockIdx is a 32-bit register: widen it before multiplying by the tile size, or the tile
    # start wraps around for vectors of 2**32 elements and more.
    block = cutlass.Int64(block_idx)
    y_tile = cute.local_tile(y, (tile_elems,), (block,))
    # n comes from its own 64-bit argument, never from y.shape: CuTe DSL 4.8.1 truncates a
    # dynamic shape read back from a tensor to 32 bits.
    if (block + 1) * tile_elems <= n:
        scale_tile(vector_copy.get_slice(thread), y_tile, alpha, read_y, None)
    else:
        thread_copy = element_copy.get_slice(thread)
        coord_tile = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (block,))
        in_bounds = in_bounds_mask(thread_copy, coord_tile, n)
        scale_tile(thread_copy, y_tile, alpha, read_y, in_bounds)


@cute.jit
def launch_scal(
    y: cute.Tensor,
    alpha: cutlass.Float32,
    stream: cuda.CUstream,
    vector_elems: cutlass.Constexpr[int],
    read_y: cutlass.Constexpr[bool],
):
    # y arrives as a torch tensor through TVM-FFI, with the layout it was compiled for
    # (`placeholder`): a vector build knows the stride 1 and a 16-byte aligned start when it
    # compiles, which lets it merge adjacent elements into one 128-bit access.
    dtype = y.element_type
    # n from cute.size, a 64-bit product: CuTe DSL 4.8.1 reads y.shape[0] back as 32 bits.
    n = cutlass.Int64(cute.size(y))

    # The TV layout: thread_layout sets the threads side by side, value_layout gives each
    # of them vector_elems adjacent elements. The tiled copy repeats this row of vectors
    # over the tile, so each thread ends up with vectors_per_thread vectors.
    thread_layout = cute.make_layout(THREADS_PER_BLOCK)
    value_layout = cute.make_layout(vector_elems)
    vectors_per_thread = BYTES_PER_THREAD // (dtype.width // 8 * vector_elems)
    tile_elems = THREADS_PER_BLOCK * vector_elems * vectors_per_thread
    # One thread-to-element map, two instruction widths: a whole vector per access (full
    # tiles), or one element per access, each under its own predicate (the last tile).
    vector_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width * vector_elems
    )
    element_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width
    )
    vector_copy = cute.make_tiled_copy_tv(vector_atom, thread_layout, value_layout)
    element_copy = cute.make_tiled_copy_tv(element_atom, thread_layout, value_layout)

    scal_kernel(y, n, alpha, vector_copy, element_copy, tile_elems, read_y).launch(
        grid=[cute.ceil_div(n, tile_elems), 1, 1],
        block=[THREADS_PER_BLOCK, 1, 1],
        stream=stream,
    )


def placeholder(dtype, length, vector_elems):
    """What cute.compile sees of a vector operand: its dtype, a 64-bit symbolic length, and
    either the constant stride 1 on a 16-byte boundary (a vector build) or a 64-bit symbolic
    stride on an element boundary. The compiled function checks each call's tensor against
    it (dtype, device, alignment, stride) and raises rather than run on a mismatch."""
    stride = 1 if vector_elems > 1 else cute.sym_int64()
    return cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], (length,), stride=(stride,),
        assumed_align=dtype.itemsize * vector_elems,
    )  # fmt: skip


def elements_per_access(dtype, vector_friendly):
    """16 // element size for the vector build, 1 for the any-stride build."""
    return VECTOR_BYTES // dtype.itemsize if vector_friendly else 1


def build(dtype, vector_elems, read_y, options=""):
    """cute.compile the launcher for TVM-FFI calls on a torch tensor and a Python float, on the
    stream torch has current for the tensor's device."""
    if vector_elems not in (1, elements_per_access(dtype, True)):
        raise ValueError(f"vector_elems must be 1 or {elements_per_access(dtype, True)}")
    return cute.compile(
        launch_scal,
        placeholder(dtype, cute.sym_int64(), vector_elems), cutlass.Float32(1.0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), vector_elems, read_y,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(dtype, vector_elems, read_y):
    """The compiled scal for torch `dtype` moving `vector_elems` elements per access, reading y
    or (read_y=False, for alpha == 0) only writing zeros; built once (a fraction of a second)
    and cached. Compiling needs no GPU. What is cached is the TVM-FFI function itself, which
    takes a torch tensor and a Python float and checks the tensor against its build."""
    return build(dtype, vector_elems, read_y).__tvm_ffi_object__()


def ptx_of(dtype, contiguous, read_y=True):
    """The PTX of the vector build (contiguous=True) or of the any-stride build, for sm_90a
    (H200): what the tests read to check for 128-bit loads and stores."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(dtype, elements_per_access(dtype, contiguous), read_y, options).__ptx__


def is_vector_friendly(t):
    """Adjacent elements (stride 1, or a single element) starting on a 16-byte boundary."""
    return t.is_contiguous() and t.data_ptr() % VECTOR_BYTES == 0


def scal(alpha, y):
    """y = alpha * y for a 1-D CUDA vector, in float32 arithmetic; returns y."""
    check_operands(alpha, y)
    if not y.is_cuda:
        raise ValueError(f"y is on {y.device}; the CuTe kernel needs CUDA tensors")
    if y.numel() == 0:
        return y
    alpha32 = to_float32(float(alpha))
    vector_elems = elements_per_access(y.dtype, is_vector_friendly(y))
    # TVM-FFI launches on torch's current stream: ordered with the caller's torch work and
    # capturable by a CUDA graph (call once before capturing: the first call loads the module).
    # alpha32 is a float32 value already, so TVM-FFI's conversion of the float is exact.
    compile_kernel(y.dtype, vector_elems, alpha32 != 0.0)(y, alpha32)
    return y
