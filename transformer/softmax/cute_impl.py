"""softmax forward and backward in the CuTe DSL: one block per row, two passes over the row.

    y_i = exp(x_i - m) / sum_j exp(x_j - m)          dx_i = y_i (dy_i - sum_j dy_j y_j)

The map (README.md, "CuTe", draws it): a block of 256 threads owns one row and walks it in tiles
of TILE = 256 * VECTORS_PER_THREAD 16-byte vectors; thread t holds the same V elements of every
tile (V = VECTORS_PER_THREAD * 16 bytes / element size), loaded with 128-bit copies.

forward  pass 1: each thread keeps the max of the elements it has seen and the sum of their
         exp(x - max); a tile that raises the max rescales the sum by exp(old - new) (an online
         softmax per thread, one rescale per tile). The threads' maxima meet in `block_max`,
         their rescaled sums in `block_sum`, the warp -> block reductions of dot/.
         pass 2, last tile first (the most recently read, likeliest still cached): y = exp(x -
         max) * (1 / sum).
backward pass 1: each thread sums dy*y over its elements; `block_sum` gives the row's dot.
         pass 2: dx = y * (dy - dot).

exp(v) is exp2(v * log2 e) (ex2.approx.ftz.f32; its error is in common/README.md). Every sum is
a fixed tree, so the same inputs give the same bits; `forward_path` and `backward_path` export
what README.md's bound counts. Rows in registers for short N and rows spread over a thread-block
cluster for long N are not done yet (README.md, open questions).
"""

import functools
import math
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import SoftmaxModule, as_rows, check_backward, check_forward

THREADS_PER_BLOCK = 256
WARP_SIZE = 32
WARPS_PER_BLOCK = THREADS_PER_BLOCK // WARP_SIZE
VECTOR_BYTES = 16  # the widest load a thread can issue: 128 bits
# Two 16-byte vectors per thread and operand per tile: two loads in flight before the first
# use, in 16 (16-bit data) or 8 (float32) float32 registers per operand.
VECTORS_PER_THREAD = 2
LOG2E = 1.4426950408889634  # exp(v) = exp2(v * log2 e); rounded to float32 when traced

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
    """Sum `value` over each aligned group of `width` lanes of a warp, log2(width) levels of
    shfl.sync.bfly; every lane of the group ends with the group's sum, built by one tree."""
    offset = width // 2
    for _ in cutlass.range_constexpr(int(math.log2(width))):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
        offset //= 2
    return value


@cute.jit
def butterfly_max(value, width: cutlass.Constexpr[int]):
    """butterfly_sum's shape with max: exact, so its order does not matter."""
    offset = width // 2
    for _ in cutlass.range_constexpr(int(math.log2(width))):
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
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
    return butterfly_sum(warp_sums[lane % WARPS_PER_BLOCK], WARPS_PER_BLOCK)


@cute.jit
def block_max(value):
    """block_sum's shape with max (its own shared memory, so the two never share a buffer)."""
    warp_maxima = cute.make_tensor(
        cute.arch.alloc_smem(cutlass.Float32, WARPS_PER_BLOCK), cute.make_layout(WARPS_PER_BLOCK)
    )
    value = butterfly_max(value, WARP_SIZE)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        warp_maxima[warp] = value
    cute.arch.sync_threads()
    return butterfly_max(warp_maxima[lane % WARPS_PER_BLOCK], WARPS_PER_BLOCK)


@cute.jit
def exp_shifted(v, shift):
    """exp(v - shift) as exp2((v - shift) * log2 e): subtract first, so the argument's error is
    relative to |v - shift| (with 1e4-sized logits, v*log2e - shift*log2e would not be)."""
    return cute.math.exp2((v - shift) * cutlass.Float32(LOG2E), fastmath=True)


@cute.jit
def finite_shift(row_max):
    """The row max, or 0 for a row of -inf: then every exp is 0, the sum 0, y = 0 * inf = NaN."""
    shift = row_max
    if row_max == -cutlass.Float32.inf:
        shift = cutlass.Float32(0.0)
    return shift


@cute.jit
def in_bounds_mask(thread_copy, row_tile_coords, n):
    """The predicate tensor: True where this thread's element has an index < n. One entry per
    copy atom, so it goes with the element copy, whose atoms move one element each."""
    coords = thread_copy.partition_S(row_tile_coords)
    mask = cute.make_rmem_tensor(coords.shape, cutlass.Boolean)
    for i in cutlass.range_constexpr(cute.size(mask)):
        mask[i] = cute.elem_less(coords[i], n)
    return mask


@cute.jit
def copy_in(thread_copy, source, values, fill, in_bounds):
    """values[j] = this thread's j-th element of `source`, widened to float32 (in_bounds None:
    all of them; else the elements it skips hold `fill`)."""
    mine = thread_copy.partition_S(source)
    registers = cute.make_rmem_tensor_like(mine)
    if cutlass.const_expr(in_bounds is not None):
        registers.fill(fill)
    cute.copy(thread_copy, mine, registers, pred=in_bounds)
    for j in cutlass.range_constexpr(cute.size(values)):
        values[j] = registers[j].to(cutlass.Float32)


@cute.jit
def copy_out(thread_copy, values, target, in_bounds):
    """The reverse: values rounded to target's dtype (cvt.rn, to nearest even) and stored."""
    mine = thread_copy.partition_D(target)
    registers = cute.make_rmem_tensor_like(mine)
    for j in cutlass.range_constexpr(cute.size(values)):
        registers[j] = values[j].to(target.element_type)
    cute.copy(thread_copy, registers, mine, pred=in_bounds)


@cute.jit
def load_tile(tiled_copies, row, tile, n, tile_elems: cutlass.Constexpr[int], fill, values):
    """values = this thread's elements of the row's tile `tile`, in float32. A full tile moves
    in 128-bit vectors; the row's last, partial tile element by element, each under a
    predicate (index < n); what it skips holds `fill`."""
    tile_copy, element_copy = tiled_copies
    thread, _, _ = cute.arch.thread_idx()
    row_tile = cute.local_tile(row, (tile_elems,), (tile,))
    if (tile + 1) * tile_elems <= n:
        copy_in(tile_copy.get_slice(thread), row_tile, values, fill, None)
    else:
        thread_copy = element_copy.get_slice(thread)
        coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (tile,))
        copy_in(thread_copy, row_tile, values, fill, in_bounds_mask(thread_copy, coords, n))


@cute.jit
def store_tile(tiled_copies, row, tile, n, tile_elems: cutlass.Constexpr[int], values):
    """The reverse of load_tile: values rounded to the row's dtype and stored."""
    tile_copy, element_copy = tiled_copies
    thread, _, _ = cute.arch.thread_idx()
    row_tile = cute.local_tile(row, (tile_elems,), (tile,))
    if (tile + 1) * tile_elems <= n:
        copy_out(tile_copy.get_slice(thread), values, row_tile, None)
    else:
        thread_copy = element_copy.get_slice(thread)
        coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (tile,))
        copy_out(thread_copy, values, row_tile, in_bounds_mask(thread_copy, coords, n))


@cute.kernel
def softmax_forward_kernel(
    x: cute.Tensor, y: cute.Tensor, n: cutlass.Int32, x_copies, y_copies,
    tile_elems: cutlass.Constexpr[int], values_per_thread: cutlass.Constexpr[int],
):  # fmt: skip
    row, _, _ = cute.arch.block_idx()
    x_row, y_row = x[row, None], y[row, None]
    tiles = (n + tile_elems - 1) // tile_elems
    values = cute.make_rmem_tensor(values_per_thread, cutlass.Float32)
    thread_max, thread_sum = -cutlass.Float32.inf, cutlass.Float32(0.0)
    for tile in cutlass.range(tiles):
        load_tile(x_copies, x_row, tile, n, tile_elems, -cutlass.Float32.inf, values)
        tile_max = values[0]
        for j in cutlass.range_constexpr(1, values_per_thread):
            tile_max = cute.arch.fmax(tile_max, values[j])
        new_max = cute.arch.fmax(thread_max, tile_max)
        shift = finite_shift(new_max)
        exps = [exp_shifted(values[j], shift) for j in range(values_per_thread)]
        thread_sum = thread_sum * exp_shifted(thread_max, shift) + pairwise_sum(exps)
        thread_max = new_max
    shift = finite_shift(block_max(thread_max))
    inverse = cutlass.Float32(1.0) / block_sum(thread_sum * exp_shifted(thread_max, shift))
    for back in cutlass.range(tiles):
        tile = tiles - 1 - back
        load_tile(x_copies, x_row, tile, n, tile_elems, -cutlass.Float32.inf, values)
        for j in cutlass.range_constexpr(values_per_thread):
            values[j] = exp_shifted(values[j], shift) * inverse
        store_tile(y_copies, y_row, tile, n, tile_elems, values)


@cute.kernel
def softmax_backward_kernel(
    y: cute.Tensor, dy: cute.Tensor, dx: cute.Tensor, n: cutlass.Int32, y_copies, dy_copies,
    dx_copies, tile_elems: cutlass.Constexpr[int], values_per_thread: cutlass.Constexpr[int],
):  # fmt: skip
    row, _, _ = cute.arch.block_idx()
    y_row, dy_row, dx_row = y[row, None], dy[row, None], dx[row, None]
    tiles = (n + tile_elems - 1) // tile_elems
    y_values = cute.make_rmem_tensor(values_per_thread, cutlass.Float32)
    dy_values = cute.make_rmem_tensor(values_per_thread, cutlass.Float32)
    thread_dot = cutlass.Float32(0.0)
    for tile in cutlass.range(tiles):
        load_tile(y_copies, y_row, tile, n, tile_elems, 0.0, y_values)
        load_tile(dy_copies, dy_row, tile, n, tile_elems, 0.0, dy_values)
        products = [dy_values[j] * y_values[j] for j in range(values_per_thread)]
        thread_dot = thread_dot + pairwise_sum(products)
    dot = block_sum(thread_dot)
    for back in cutlass.range(tiles):
        tile = tiles - 1 - back
        load_tile(y_copies, y_row, tile, n, tile_elems, 0.0, y_values)
        load_tile(dy_copies, dy_row, tile, n, tile_elems, 0.0, dy_values)
        for j in cutlass.range_constexpr(values_per_thread):
            y_values[j] = y_values[j] * (dy_values[j] - dot)
        store_tile(dx_copies, dx_row, tile, n, tile_elems, y_values)


def tiled_copies(dtype, vector_elems):
    """(tile copy, element copy) of one operand: thread t owns vector-sized runs of adjacent
    elements, the 256 threads side by side, VECTORS_PER_THREAD runs each per tile. The tile copy
    moves a run per access (128 bits when vector_elems is 16 bytes' worth), the element copy
    one element, each under its own predicate; both give a thread the same elements."""
    run = VECTOR_BYTES * 8 // dtype.width
    thread_layout, value_layout = cute.make_layout(THREADS_PER_BLOCK), cute.make_layout(run)
    tile_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width * vector_elems
    )
    element_atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width
    )
    return (
        cute.make_tiled_copy_tv(tile_atom, thread_layout, value_layout),
        cute.make_tiled_copy_tv(element_atom, thread_layout, value_layout),
    )


def tile_shape(dtype_width):
    """(elements per tile, elements per thread per tile)."""
    per_thread = VECTORS_PER_THREAD * VECTOR_BYTES * 8 // dtype_width
    return THREADS_PER_BLOCK * per_thread, per_thread


@cute.jit
def launch_forward(
    x: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream, vector_elems: cutlass.Constexpr[int]
):
    m, n = cutlass.Int32(cute.size(x, mode=[0])), cutlass.Int32(cute.size(x, mode=[1]))
    tile_elems, per_thread = tile_shape(x.element_type.width)
    copies = tiled_copies(x.element_type, vector_elems)
    softmax_forward_kernel(x, y, n, copies, copies, tile_elems, per_thread).launch(
        grid=[m, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream
    )


@cute.jit
def launch_backward(
    y: cute.Tensor, dy: cute.Tensor, dx: cute.Tensor, stream: cuda.CUstream,
    vector_elems: cutlass.Constexpr[int],
):  # fmt: skip
    m, n = cutlass.Int32(cute.size(y, mode=[0])), cutlass.Int32(cute.size(y, mode=[1]))
    tile_elems, per_thread = tile_shape(y.element_type.width)
    copies = tiled_copies(y.element_type, vector_elems)
    softmax_backward_kernel(y, dy, dx, n, copies, copies, copies, tile_elems, per_thread).launch(
        grid=[m, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream
    )


def placeholder(dtype, m, n, vector_elems):
    """What cute.compile sees of an (M, N) operand: symbolic sizes, and either unit column
    stride with a row stride divisible by the vector on a 16-byte boundary (the vector build,
    every full tile 16-byte aligned) or two symbolic strides on an element boundary."""
    if vector_elems > 1:
        stride = (cute.sym_int64(divisibility=vector_elems), 1)
    else:
        stride = (cute.sym_int64(), cute.sym_int64())
    return cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], (m, n), stride=stride, assumed_align=dtype.itemsize * vector_elems
    )


def elements_per_access(dtype, vector_friendly):
    return VECTOR_BYTES // dtype.itemsize if vector_friendly else 1


def build(direction, dtype, vector_elems, options=""):
    """cute.compile the forward (x, y) or backward (y, dy, dx) launcher for TVM-FFI calls on
    torch (M, N) tensors, on torch's current stream; the operands share symbolic M and N."""
    m, n = cute.sym_int64(), cute.sym_int64()
    operands = 2 if direction == "forward" else 3
    launcher = launch_forward if direction == "forward" else launch_backward
    return cute.compile(
        launcher,
        *(placeholder(dtype, m, n, vector_elems) for _ in range(operands)),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), vector_elems,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(direction, dtype, vector_elems):
    """The compiled launcher, built once per (direction, dtype, access width) and cached."""
    return build(direction, dtype, vector_elems).__tvm_ffi_object__()


def ptx_of(direction, dtype, contiguous):
    """The sm_90a PTX of a build: what the tests read for 128-bit loads, ex2 and shuffles."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(direction, dtype, elements_per_access(dtype, contiguous), options).__ptx__


def is_vector_friendly(rows):
    """Unit column stride, rows starting on 16-byte boundaries."""
    run = VECTOR_BYTES // rows.element_size()
    return (
        (rows.stride(1) == 1 or rows.shape[1] == 1)
        and rows.data_ptr() % VECTOR_BYTES == 0
        and (rows.stride(0) % run == 0 or rows.shape[0] == 1)
    )


def forward_path(n, dtype):
    """(exp2 evaluations, float32 roundings after the exp) on a term's way into the row sum:
    its own exp, a rescale per later tile and one before block_sum; the tile's pairwise tree,
    the add into the thread's sum, a multiply and an add per later tile, the rescale's
    multiply, and the 8 levels of block_sum."""
    tile_elems, per_thread = tile_shape(dtype.itemsize * 8)
    tiles = -(-n // tile_elems)
    block_levels = int(math.log2(THREADS_PER_BLOCK))
    return tiles + 1, int(math.log2(per_thread)) + 1 + 2 * (tiles - 1) + 1 + block_levels


def backward_path(n, dtype):
    """Additions on a product's way into the row's dot: the tile's pairwise tree, the add into
    the thread's sum, one per later tile, and the 8 levels of block_sum."""
    tile_elems, per_thread = tile_shape(dtype.itemsize * 8)
    tiles = -(-n // tile_elems)
    return int(math.log2(per_thread)) + 1 + (tiles - 1) + int(math.log2(THREADS_PER_BLOCK))


def run_on_rows(direction, inputs, output):
    """Launch the build that fits the operands, viewed as (M, N) rows; returns output."""
    if not output.is_cuda:
        raise ValueError(f"the operands are on {output.device}; the CuTe kernel needs CUDA tensors")
    if output.numel() == 0:
        return output
    rows = [as_rows(t)[0] for t in inputs]
    output_rows, copied = as_rows(output, for_output=True)
    friendly = all(is_vector_friendly(t) for t in (*rows, output_rows))
    vector_elems = elements_per_access(output.dtype, friendly)
    # TVM-FFI launches on torch's current stream (capturable by a CUDA graph after a first call).
    compile_kernel(direction, output.dtype, vector_elems)(*rows, output_rows)
    if copied:
        output.copy_(output_rows.view(output.shape))
    return output


def softmax_forward(x, y):
    check_forward(x, y)
    return run_on_rows("forward", (x,), y)


def softmax_backward(y, dy, dx):
    check_backward(y, dy, dx)
    return run_on_rows("backward", (y, dy), dx)


class SoftmaxFunction(torch.autograd.Function):
    """softmax as an autograd.Function over the two plain functions (the eager path)."""

    @staticmethod
    def forward(ctx, x):
        y = softmax_forward(x, torch.empty_like(x))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, dy, torch.empty_like(y))


# The same two functions as custom ops, so torch.compile traces a model that calls them.
@torch.library.custom_op("kernel_course::softmax_cute_forward", mutates_args=())
def forward_op(x: torch.Tensor) -> torch.Tensor:
    return softmax_forward(x, torch.empty_like(x))


@torch.library.custom_op("kernel_course::softmax_cute_backward", mutates_args=())
def backward_op(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return softmax_backward(y, dy, torch.empty_like(y))


@forward_op.register_fake
def _(x):
    return torch.empty_like(x)


@backward_op.register_fake
def _(y, dy):
    return torch.empty_like(y)


def save_output(ctx, inputs, output):
    ctx.save_for_backward(output)


def backward_of_forward_op(ctx, dy):
    (y,) = ctx.saved_tensors
    return backward_op(y, dy)


forward_op.register_autograd(backward_of_forward_op, setup_context=save_output)


def softmax(x):
    """softmax over x's last dimension: differentiable, and traceable by torch.compile."""
    return forward_op(x)


class Softmax(SoftmaxModule):
    """Drop-in for torch.nn.Softmax(dim), on this file's softmax."""

    last_dim_softmax = staticmethod(softmax)
