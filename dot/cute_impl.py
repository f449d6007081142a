"""dot in the CuTe DSL: z = x^T y as two kernels with a fixed reduction tree.

README.md's "cute_impl.py" section explains the tree (a thread's lanes, a warp's shuffles, the
warps through shared memory) and the thread-value layout with its ASCII map; "The error bound"
counts the roundings on a product's way through it. In this file, top to bottom:

* `pairwise_sum`, `butterfly_sum`, `block_sum`: the reduction building blocks (one name and one
  shape in every folder that uses them).
* `add_products`, `in_bounds_mask`, `partial_dots_kernel` (pass 1): a block sums its chunk of
  tiles into LANES_PER_THREAD lanes per thread and folds them into partials[block];
  `sum_partials_kernel` (pass 2): folds the partials into z.
* `launch_dot`: the thread-value layout, the copy atoms and the two launches.
* `split`, `roundings`: the tree's shape for n, and the bound's rounding count k_cute(n).
* `placeholder`, `build`, `compile_kernel`, `ptx_of`: what `cute.compile` sees, the TVM-FFI
  build cached per (dtype, vector width), and its sm_90a PTX for the tests.
* `dot`: the public function.
"""

import functools
import math
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import check_operands

# 256 threads = 8 warps per block.
THREADS_PER_BLOCK = 256
WARP_SIZE = 32
WARPS_PER_BLOCK = THREADS_PER_BLOCK // WARP_SIZE
# The widest load a thread can issue: 128 bits.
VECTOR_BYTES = 16
# Float32 running sums per thread. 16 lanes are four 16-byte vectors of float32 per operand and
# tile (two of 16-bit data): enough loads in flight per thread to stream from DRAM, in about 40
# registers, so four blocks fit on an SM (64 registers per thread at 1024 threads).
LANES_PER_THREAD = 16
TILE_ELEMS = THREADS_PER_BLOCK * LANES_PER_THREAD  # 4096
# The H200 has 132 SMs: four blocks per SM, all resident at once. A constant rather than the
# device's SM count, so that the reduction tree, and with it the bits of z, depend on n only.
MAX_BLOCKS = 4 * 132

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


def pairwise_sum(values):
    """The sum of a power-of-two list of float32 registers, adding neighbours in pairs. Plain
    Python, run while the kernel is traced: it emits the log2(len) levels of additions."""
    while len(values) > 1:
        values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
    return values[0]


@cute.jit
def butterfly_sum(value, width: cutlass.Constexpr[int]):
    """Sum `value` over each aligned group of `width` lanes of a warp, log2(width) levels.

    At the level with offset o, lane l adds the value of lane l ^ o (shfl.sync.bfly): both
    partners compute the same sum (a + b = b + a exactly), so after the last level every lane
    of the group holds the group's sum, built by the same tree."""
    offset = width // 2
    for _ in cutlass.range_constexpr(int(math.log2(width))):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
        offset //= 2
    return value


@cute.jit
def block_sum(value):
    """The sum of `value` over the 256 threads of the block, in every thread: 5 shuffle levels
    inside each warp, then the 8 warp sums through shared memory and 3 more levels."""
    warp_sums = cute.make_tensor(
        cute.arch.alloc_smem(cutlass.Float32, WARPS_PER_BLOCK), cute.make_layout(WARPS_PER_BLOCK)
    )
    value = butterfly_sum(value, WARP_SIZE)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        warp_sums[warp] = value
    cute.arch.sync_threads()  # every warp's sum is in shared memory before anyone reads
    # Lane l reads warp l mod 8's sum: each group of 8 lanes holds all 8 and sums them alike.
    return butterfly_sum(warp_sums[lane % WARPS_PER_BLOCK], WARPS_PER_BLOCK)


@cute.jit
def add_products(thread_copy, x_tile, y_tile, lanes, in_bounds):
    """lanes[j] += x_j * y_j over this thread's 16 elements of one tile, widened to float32
    (in_bounds None: the whole tile is inside the vector, no predicate)."""
    x_mine = thread_copy.partition_S(x_tile)
    y_mine = thread_copy.partition_S(y_tile)
    x_registers = cute.make_rmem_tensor_like(x_mine)
    y_registers = cute.make_rmem_tensor_like(y_mine)
    if cutlass.const_expr(in_bounds is not None):
        x_registers.fill(0)  # what the predicate skips adds 0 * 0 = 0
        y_registers.fill(0)
    # All loads are issued before the first product, so they are in flight together.
    cute.copy(thread_copy, x_mine, x_registers, pred=in_bounds)
    cute.copy(thread_copy, y_mine, y_registers, pred=in_bounds)
    # Widening is exact, and the compiler fuses each multiply and add into one fma.rn.f32.
    for j in cutlass.range_constexpr(LANES_PER_THREAD):
        lanes[j] += x_registers[j].to(cutlass.Float32) * y_registers[j].to(cutlass.Float32)


@cute.jit
def in_bounds_mask(thread_copy, coord_tile, n):
    """The predicate tensor: True where this thread's element has an index < n. One entry per
    copy atom, and the partial tile's atoms move one element each."""
    coords = thread_copy.partition_S(coord_tile)
    mask = cute.make_rmem_tensor(coords.shape, cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(mask)):
        mask[i] = cute.elem_less(coords[i], n)
    return mask


@cute.kernel
def partial_dots_kernel(
    x: cute.Tensor,
    y: cute.Tensor,
    partials: cute.Tensor,
    n: cutlass.Int64,
    tiles_per_block: cutlass.Int64,
    tile_copy: cute.TiledCopy,
    element_copy: cute.TiledCopy,
):
    thread, _, _ = cute.arch.thread_idx()
    block_idx, _, _ = cute.arch.block_idx()
    # blockIdx is a 32-bit register: widen it before multiplying, so tile indices and the
    # offsets computed from them are 64-bit. n comes from its own 64-bit argument, never from
    # x.shape: CuTe DSL 4.8.1 truncates a dynamic shape read back from a tensor to 32 bits.
    block = cutlass.Int64(block_idx)
    first_tile = block * tiles_per_block
    stop_tile = cutlass.min(first_tile + tiles_per_block, (n + TILE_ELEMS - 1) // TILE_ELEMS)
    full_tiles_stop = cutlass.min(stop_tile, n // TILE_ELEMS)

    lanes = cute.make_rmem_tensor(LANES_PER_THREAD, cutlass.Float32)
    lanes.fill(0.0)
    thread_tile_copy = tile_copy.get_slice(thread)
    for tile in cutlass.range(first_tile, full_tiles_stop):
        x_tile = cute.local_tile(x, (TILE_ELEMS,), (tile,))
        y_tile = cute.local_tile(y, (TILE_ELEMS,), (tile,))
        add_products(thread_tile_copy, x_tile, y_tile, lanes, None)
    if full_tiles_stop < stop_tile:  # this block holds the vector's last, partial tile
        thread_element_copy = element_copy.get_slice(thread)
        last = full_tiles_stop
        coord_tile = cute.local_tile(cute.make_identity_tensor(n), (TILE_ELEMS,), (last,))
        x_tile = cute.local_tile(x, (TILE_ELEMS,), (last,))
        y_tile = cute.local_tile(y, (TILE_ELEMS,), (last,))
        in_bounds = in_bounds_mask(thread_element_copy, coord_tile, n)
        add_products(thread_element_copy, x_tile, y_tile, lanes, in_bounds)

    total = block_sum(pairwise_sum([lanes[j] for j in range(LANES_PER_THREAD)]))
    if thread == 0:
        partials[block] = total


@cute.kernel
def sum_partials_kernel(partials: cute.Tensor, z: cute.Tensor, num_partials: cutlass.Int32):
    thread, _, _ = cute.arch.thread_idx()
    acc = cutlass.Float32(0.0)
    for i in cutlass.range(thread, num_partials, THREADS_PER_BLOCK):
        acc += partials[i]
    total = block_sum(acc)
    if thread == 0:
        z[0] = total.to(z.element_type)  # the one rounding to the dtype, to nearest even


@cute.jit
def launch_dot(
    x: cute.Tensor,
    y: cute.Tensor,
    partials: cute.Tensor,
    z: cute.Tensor,
    tiles_per_block: cutlass.Int64,
    stream: cuda.CUstream,
    vector_elems: cutlass.Constexpr[int],
):
    # x, y, partials and z (0-dim) arrive as torch tensors through TVM-FFI, with the layouts
    # they were compiled for (`placeholder`): a vector build knows the stride 1 and a 16-byte
    # aligned start when it compiles, which lets it merge adjacent elements into one 128-bit
    # load. Pass 1 has one block per partial.
    dtype = x.element_type
    # n from cute.size, a 64-bit product: CuTe DSL 4.8.1 reads x.shape[0] back as 32 bits.
    n = cutlass.Int64(cute.size(x))
    blocks = cutlass.Int32(cute.size(partials))  # at most MAX_BLOCKS
    z = cute.make_tensor(z.iterator, cute.make_layout(1))  # the 0-dim z as z[0]

    # The TV layout: thread_layout sets the 256 threads side by side, value_layout gives each
    # of them one 16-byte vector's worth of adjacent elements; the tiled copy repeats this row
    # over the tile, 16 elements per thread in all. It is the same in both builds: only the
    # copy atom, the width of one access, changes.
    elems_per_vector = VECTOR_BYTES * 8 // dtype.width
    thread_layout = cute.make_layout(THREADS_PER_BLOCK)
    value_layout = cute.make_layout(elems_per_vector)
    tile_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width * vector_elems
    )
    element_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width
    )
    tile_copy = cute.make_tiled_copy_tv(tile_atom, thread_layout, value_layout)
    element_copy = cute.make_tiled_copy_tv(element_atom, thread_layout, value_layout)

    # Two launches on one stream: pass 2 starts after pass 1 has written every partial.
    partial_dots_kernel(x, y, partials, n, tiles_per_block, tile_copy, element_copy).launch(
        grid=[blocks, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream
    )
    sum_partials_kernel(partials, z, blocks).launch(
        grid=[1, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream
    )


def split(n):
    """(blocks, tiles per block) of pass 1 for a vector of n > 0 elements: as few tiles per
    block as MAX_BLOCKS allows, then only as many blocks as those tiles need."""
    tiles = -(-n // TILE_ELEMS)
    tiles_per_block = -(-tiles // min(tiles, MAX_BLOCKS))
    return -(-tiles // tiles_per_block), tiles_per_block


def roundings(n, dtype):
    """README.md's k_cute(n) for n > 0: the most float32 roundings on one product's way to z
    through this file's tree, which the error bound needs. One for the product of two float32
    numbers (16-bit products are exact in float32), one per further tile added into a lane,
    log2(LANES_PER_THREAD) levels of pairwise_sum, block_sum's levels (the warp's shuffles, then
    across the warps); in pass 2 one per further partial a thread adds, then block_sum again."""
    blocks, tiles_per_block = split(n)
    product = 1 if dtype == torch.float32 else 0
    block_tree = int(math.log2(THREADS_PER_BLOCK))  # log2(WARP_SIZE) + log2(WARPS_PER_BLOCK)
    pass_1 = (tiles_per_block - 1) + int(math.log2(LANES_PER_THREAD)) + block_tree
    pass_2 = (-(-blocks // THREADS_PER_BLOCK) - 1) + block_tree
    return product + pass_1 + pass_2


def placeholder(dtype, length, vector_elems):
    """What cute.compile sees of x or y: its dtype, a 64-bit symbolic length, and either the
    constant stride 1 on a 16-byte boundary (a vector build) or a 64-bit symbolic stride on an
    element boundary. The compiled function checks each call's tensors against it (dtype,
    device, alignment, stride) and raises rather than run on a mismatch."""
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
    current for their device. x and y share one symbolic length: each call checks they match.
    partials is a contiguous float32 vector of any length, z a 0-dim tensor of the dtype."""
    if vector_elems not in (1, elements_per_access(dtype, True)):
        raise ValueError(f"vector_elems must be 1 or {elements_per_access(dtype, True)}")
    length = cute.sym_int64()
    partials = cute.runtime.make_fake_tensor(
        cutlass.Float32, (cute.sym_int64(),), stride=(1,), assumed_align=4
    )
    z = cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], (), stride=(), assumed_align=dtype.itemsize
    )
    return cute.compile(
        launch_dot,
        placeholder(dtype, length, vector_elems), placeholder(dtype, length, vector_elems),
        partials, z, 1, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), vector_elems,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(dtype, vector_elems):
    """The compiled dot for torch `dtype` loading `vector_elems` elements per access, built
    once (about half a second) and cached. Compiling needs no GPU. What is cached is the
    TVM-FFI function itself, which takes torch tensors and checks them against its build."""
    return build(dtype, vector_elems).__tvm_ffi_object__()


def ptx_of(dtype, contiguous):
    """The PTX of the vector build (contiguous=True) or of the any-stride build, for sm_90a
    (H200): what the tests read to check for 128-bit loads and warp shuffles."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(dtype, elements_per_access(dtype, contiguous), options).__ptx__


def is_vector_friendly(t):
    """Adjacent elements (stride 1, or a single element) starting on a 16-byte boundary."""
    return t.is_contiguous() and t.data_ptr() % VECTOR_BYTES == 0


def dot(x, y):
    """z = x^T y for 1-D CUDA vectors of one dtype, accumulated in float32; a new 0-dim tensor."""
    check_operands(x, y)
    if not x.is_cuda:
        raise ValueError(f"x and y are on {x.device}; the CuTe kernel needs CUDA tensors")
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)  # the empty sum
    blocks, tiles_per_block = split(n)
    vector_elems = elements_per_access(x.dtype, is_vector_friendly(x) and is_vector_friendly(y))
    partials = torch.empty(blocks, dtype=torch.float32, device=x.device)
    z = torch.empty((), dtype=x.dtype, device=x.device)
    # TVM-FFI launches both kernels on torch's current stream: ordered with the caller's torch
    # work and capturable by a CUDA graph (call once before capturing: the first call loads the
    # module). partials comes from torch's caching allocator, as z does.
    compile_kernel(x.dtype, vector_elems)(x, y, partials, z, tiles_per_block)
    return z
