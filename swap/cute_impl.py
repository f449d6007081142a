"""swap in the CuTe DSL: x <-> y, bit for bit.

The mapping is copy's with swap's own tile shape (README.md's "cute_impl.py" section, with the
ASCII map of the thread-value layout; the shape's sweep is its tuning log). In this file, top to
bottom:

* `swap_tile`, `swap_tail`, `in_bounds_mask`, `swap_kernel`: one block swaps one tile through
  registers; the last tile one pair at a time under a predicate tensor.
* `launch_swap`: the thread-value layout, the copy atoms and the grid.
* `placeholder`, `build`, `compile_kernel`, `ptx_of`: what `cute.compile` sees, the TVM-FFI
  build cached per (dtype, vector width), and its sm_90a PTX for the tests.
* `swap`: the public function; picks the vector or the any-stride build.
"""

import functools
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import check_operands

# Four warps per block.
THREADS_PER_BLOCK = 128
# The widest load/store a thread can issue: 128 bits.
VECTOR_BYTES = 16
# Bytes each thread moves per operand: two vectors, so 4 KiB tiles; the fastest of the shapes
# swept, and 64 bytes a thread collapses (README.md, tuning log).
BYTES_PER_THREAD = 2 * VECTOR_BYTES

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


@cute.jit
def swap_tile(thread_copy, x_tile, y_tile):
    """Swap this thread's share of a full tile through registers."""
    # Each tensor is read, then written: the universal copy's source and destination layouts
    # are the same, so one partition of each serves for both directions.
    x_mine = thread_copy.partition_S(x_tile)
    y_mine = thread_copy.partition_S(y_tile)
    x_registers = cute.make_rmem_tensor_like(x_mine)
    y_registers = cute.make_rmem_tensor_like(y_mine)
    cute.copy(thread_copy, x_mine, x_registers)
    cute.copy(thread_copy, y_mine, y_registers)
    cute.copy(thread_copy, x_registers, y_mine)
    cute.copy(thread_copy, y_registers, x_mine)


@cute.jit
def swap_tail(thread_copy, x_tile, y_tile, in_bounds):
    """Swap this thread's elements of the last tile one pair at a time, each under its entry
    of the predicate tensor. ptxas sizes the kernel's registers for its largest branch, so a
    tail that loaded both whole shares first, as swap_tile does, would cost every block
    registers (README.md, tuning log); a load cannot move above a store to memory it may
    alias, so here only one pair is ever live."""
    x_mine = thread_copy.partition_S(x_tile)
    y_mine = thread_copy.partition_S(y_tile)
    for i in cutlass.range_constexpr(cute.size(x_mine)):
        if in_bounds[i]:
            x_value = x_mine[i]
            x_mine[i] = y_mine[i]
            y_mine[i] = x_value


@cute.jit
def in_bounds_mask(thread_copy, coord_tile, n):
    """The predicate tensor: True where this thread's element has an index < n."""
    coords = thread_copy.partition_S(coord_tile)
    mask = cute.make_rmem_tensor(coords.shape, cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(mask)):
        mask[i] = cute.elem_less(coords[i], n)
    return mask


@cute.kernel
def swap_kernel(
    x: cute.Tensor,
    y: cute.Tensor,
    n: cutlass.Int64,
    vector_copy: cute.TiledCopy,
    element_copy: cute.TiledCopy,
    tile_elems: cutlass.Constexpr[int],
):
    thread, _, _ = cute.arch.thread_idx()
    block_idx, _, _ = cute.arch.block_idx()
    # blockIdx is a 32-bit register: widen it before multiplying by the tile size, or the tile
    # start wraps around for vectors of 2**32 elements and more.
    block = cutlass.Int64(block_idx)
    x_tile = cute.local_tile(x, (tile_elems,), (block,))
    y_tile = cute.local_tile(y, (tile_elems,), (block,))
    # n comes from its own 64-bit argument, never from x.shape: CuTe DSL 4.8.1 truncates a
    # dynamic shape read back from a tensor to 32 bits.
    if (block + 1) * tile_elems <= n:
        swap_tile(vector_copy.get_slice(thread), x_tile, y_tile)
    else:
        thread_copy = element_copy.get_slice(thread)
        coord_tile = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (block,))
        swap_tail(thread_copy, x_tile, y_tile, in_bounds_mask(thread_copy, coord_tile, n))


@cute.jit
def launch_swap(
    x: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream, vector_elems: cutlass.Constexpr[int]
):
    # x and y arrive as torch tensors through TVM-FFI, with the layouts they were compiled for
    # (`placeholder`): a vector build knows the stride 1 and a 16-byte aligned start when it
    # compiles, which lets it merge adjacent elements into one 128-bit access.
    dtype = x.element_type
    # n from cute.size, a 64-bit product: CuTe DSL 4.8.1 reads x.shape[0] back as 32 bits.
    n = cutlass.Int64(cute.size(x))

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

    swap_kernel(x, y, n, vector_copy, element_copy, tile_elems).launch(
        grid=[cute.ceil_div(n, tile_elems), 1, 1],
        block=[THREADS_PER_BLOCK, 1, 1],
        stream=stream,
    )


def placeholder(dtype, length, vector_elems):
    """What cute.compile sees of a vector operand: its dtype, a 64-bit symbolic length, and
    either the constant stride 1 on a 16-byte boundary (a vector build) or a 64-bit symbolic
    stride on an element boundary. The compiled function checks each call's tensors against
    it (dtype, device, alignment, stride) and raises rather than run on a mismatch."""
    stride = 1 if vector_elems > 1 else cute.sym_int64()
    return cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], (length,), stride=(stride,),
        assumed_align=dtype.itemsize * vector_elems,
    )  # fmt: skip


def elements_per_access(dtype, vector_friendly):
    """16 // element size for the vector build, 1 for the any-stride build."""
    return VECTOR_BYTES // dtype.itemsize if vector_friendly else 1


def build(dtype, vector_elems, options=""):
    """cute.compile the launcher for TVM-FFI calls on torch tensors, on the stream torch has
    current for their device. x and y share one symbolic length: each call checks they match."""
    if vector_elems not in (1, elements_per_access(dtype, True)):
        raise ValueError(f"vector_elems must be 1 or {elements_per_access(dtype, True)}")
    length = cute.sym_int64()
    return cute.compile(
        launch_swap,
        placeholder(dtype, length, vector_elems), placeholder(dtype, length, vector_elems),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), vector_elems,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(dtype, vector_elems):
    """The compiled swap for torch `dtype` moving `vector_elems` elements per access, built
    once (a fraction of a second) and cached. Compiling needs no GPU. What is cached is the
    TVM-FFI function itself, which takes torch tensors and checks them against its build."""
    return build(dtype, vector_elems).__tvm_ffi_object__()


def ptx_of(dtype, contiguous):
    """The PTX of the vector build (contiguous=True) or of the any-stride build, for sm_90a
    (H200): what the tests read to check for 128-bit loads and stores."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(dtype, elements_per_access(dtype, contiguous), options).__ptx__


def is_vector_friendly(t):
    """Adjacent elements (stride 1, or a single element) starting on a 16-byte boundary."""
    return t.is_contiguous() and t.data_ptr() % VECTOR_BYTES == 0


def swap(x, y):
    """Exchange the contents of two 1-D CUDA vectors of one dtype; returns (x, y)."""
    check_operands(x, y)
    if not y.is_cuda:
        raise ValueError(f"x and y are on {y.device}; the CuTe kernel needs CUDA tensors")
    # check_operands let through disjoint or identical views only, so one start means identical.
    if y.numel() == 0 or x.data_ptr() == y.data_ptr():
        return x, y
    vector_elems = elements_per_access(y.dtype, is_vector_friendly(x) and is_vector_friendly(y))
    # TVM-FFI launches on torch's current stream: ordered with the caller's torch work and
    # capturable by a CUDA graph (call once before capturing: the first call loads the module).
    compile_kernel(y.dtype, vector_elems)(x, y)
    return x, y
