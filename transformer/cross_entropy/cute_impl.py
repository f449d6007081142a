"""cross-entropy forward and backward in the CuTe DSL, one block of 256 threads per row.

    lse = m + log sum_j exp(x_j - m)     loss = lse - x_t + eps (x_t - mean_j x_j)
    dx_j = dloss (exp(x_j - lse) - q_j),   q_j = (1 - eps) [j = t] + eps / V

The map (README.md, "cute_impl.py", draws it): the block walks its row in tiles of TILE_ELEMS;
thread t holds the same ELEMS_PER_THREAD elements of every tile, in runs of 16 bytes (runs t,
t + 256, ... of the tile), each run one 128-bit load when the rows allow it. Full tiles move in
vectors, the row's last partial tile element by element under a predicate each.

forward   each thread keeps the max of its elements and the sum of their exp(x - max): a tile
          that raises the max rescales the sum once (one extra ex2 per thread and tile, not per
          element), and with label smoothing the sum of x. `block_max` and `block_sum` (dot/'s
          warp -> block reductions) combine the threads; thread 0 reads the target's logit and
          writes the row's float32 loss and lse. MV elements read, the minimum.
backward  each thread reads a tile, writes dx over the same elements: dx may be x itself.
reduce    `loss_sum_kernel`, one block: thread t adds rows t, t + 256, ..., then `block_sum`.

Every sum is a fixed tree (the same bits every run); `forward_path`, `smoothing_path` and
`reduction_path` export what README.md's bound counts. exp is ex2.approx.ftz of
(v - shift) log2 e; log(S) is log2(S) ln 2 once a row, with the accurate log2 (cute.math.log2
without fastmath compiles to libdevice's polynomial, no lg2.approx), as in triton_impl.py.
"""

import functools
import math
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import check_backward, check_forward, check_reduction
from torch_impl import CrossEntropyLossModule, autograd_function, traceable_cross_entropy

THREADS_PER_BLOCK = 256
WARP_SIZE = 32
WARPS_PER_BLOCK = THREADS_PER_BLOCK // WARP_SIZE
VECTOR_BYTES = 16  # the widest load a thread can issue: 128 bits
# 16 float32 registers per thread and statistic, whatever the dtype: bf16 has two 128-bit loads
# in flight per thread and tile, float32 four; 8 blocks of 256 threads fit on an SM, ~64 kB in
# flight, past the H200's bandwidth-latency product per SM (~20 kB).
ELEMS_PER_THREAD = 16
TILE_ELEMS = THREADS_PER_BLOCK * ELEMS_PER_THREAD  # 4096, Triton's CHUNK
# The kernels count a row's classes and tiles in Int32 (n + TILE_ELEMS - 1 and (tile + 1) *
# TILE_ELEMS included): longer rows would wrap them (silently wrong), so they are refused.
ROW_CLASSES_MAX = 2**31 - TILE_ELEMS
LOG2E = 1.4426950408889634  # exp(v) = exp2(v log2 e); rounded to float32 when traced
LN2 = 0.6931471805599453  # log(S) = log2(S) ln 2

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.int64: cutlass.Int64,
    torch.int32: cutlass.Int32,
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
    inside each warp, then the 8 warp sums through shared memory and 3 more levels. Each call
    site has its own shared memory, so two reductions never share a buffer."""
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
    """block_sum's shape with max."""
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
    """exp(v - shift) as exp2((v - shift) log2 e): subtract first, so the argument's error is
    relative to |v - shift| (with 1e4-sized logits, v log2e - shift log2e would not be)."""
    return cute.math.exp2((v - shift) * cutlass.Float32(LOG2E), fastmath=True)


@cute.jit
def finite_shift(row_max):
    """The max, or 0 where it is -inf (every logit so far masked): exp(-inf - 0) = 0, and a row
    of -inf ends with log 0 = -inf, as the definition says."""
    shift = row_max
    if row_max == -cutlass.Float32.inf:
        shift = cutlass.Float32(0.0)
    return shift


@cute.jit
def thread_columns(element_copy, tile, n):
    """The column of each of this thread's elements of tile `tile`, one per element copy atom
    (the tile copy gives a thread the same elements, in the same order)."""
    thread, _, _ = cute.arch.thread_idx()
    coords = cute.local_tile(cute.make_identity_tensor(n), (TILE_ELEMS,), (tile,))
    return element_copy.get_slice(thread).partition_S(coords)


@cute.jit
def in_row_mask(element_copy, tile, n):
    """The element copy's predicates for tile `tile`: True where the column is < n."""
    columns = thread_columns(element_copy, tile, n)
    in_row = cute.make_rmem_tensor(columns.shape, cutlass.Boolean)
    for j in cutlass.range_constexpr(cute.size(in_row)):
        in_row[j] = cute.elem_less(columns[j], n)
    return in_row


@cute.jit
def copy_in(tiled_copy, source, values, fill, in_row):
    """values[j] = this thread's j-th element of the tile `source`, widened to float32 (in_row
    None: all of them; else the elements it skips hold `fill`)."""
    thread, _, _ = cute.arch.thread_idx()
    mine = tiled_copy.get_slice(thread).partition_S(source)
    registers = cute.make_rmem_tensor_like(mine)
    if cutlass.const_expr(in_row is not None):
        registers.fill(fill)
    cute.copy(tiled_copy, mine, registers, pred=in_row)
    for j in cutlass.range_constexpr(ELEMS_PER_THREAD):
        values[j] = registers[j].to(cutlass.Float32)


@cute.jit
def copy_out(tiled_copy, values, target, in_row):
    """The reverse: values rounded to target's dtype (cvt.rn, to nearest even) and stored."""
    thread, _, _ = cute.arch.thread_idx()
    mine = tiled_copy.get_slice(thread).partition_D(target)
    registers = cute.make_rmem_tensor_like(mine)
    for j in cutlass.range_constexpr(ELEMS_PER_THREAD):
        registers[j] = values[j].to(target.element_type)
    cute.copy(tiled_copy, registers, mine, pred=in_row)


@cute.jit
def load_tile(tiled_copies, row, tile, n, fill, values):
    """values = this thread's elements of the row's tile `tile`, in float32. A full tile moves
    in 16-byte vectors (the vector build); the row's last, partial tile element by element,
    each under its predicate; what it skips holds `fill`."""
    tile_copy, element_copy = tiled_copies
    row_tile = cute.local_tile(row, (TILE_ELEMS,), (tile,))
    if (tile + 1) * TILE_ELEMS <= n:
        copy_in(tile_copy, row_tile, values, fill, None)
    else:
        copy_in(element_copy, row_tile, values, fill, in_row_mask(element_copy, tile, n))


@cute.jit
def store_tile(tiled_copies, values, row, tile, n):
    """The reverse of load_tile: values rounded to the row's dtype and stored."""
    tile_copy, element_copy = tiled_copies
    row_tile = cute.local_tile(row, (TILE_ELEMS,), (tile,))
    if (tile + 1) * TILE_ELEMS <= n:
        copy_out(tile_copy, values, row_tile, None)
    else:
        copy_out(element_copy, values, row_tile, in_row_mask(element_copy, tile, n))


@cute.kernel
def cross_entropy_forward_kernel(
    x: cute.Tensor, target: cute.Tensor, loss: cute.Tensor, lse: cute.Tensor, n: cutlass.Int32,
    ignore_index: cutlass.Int64, label_smoothing: cutlass.Float32, inverse_n: cutlass.Float32,
    x_copies, smoothing: cutlass.Constexpr[bool],
):  # fmt: skip
    row, _, _ = cute.arch.block_idx()
    thread, _, _ = cute.arch.thread_idx()
    x_row = x[row, None]
    tiles = (n + TILE_ELEMS - 1) // TILE_ELEMS
    values = cute.make_rmem_tensor(ELEMS_PER_THREAD, cutlass.Float32)
    thread_max, thread_sum = -cutlass.Float32.inf, cutlass.Float32(0.0)
    thread_total = cutlass.Float32(0.0)  # the sum of x, for label smoothing's mean
    for tile in cutlass.range(tiles):
        # Elements past n read -inf: they raise no max and add exp(-inf) = 0.
        load_tile(x_copies, x_row, tile, n, -cutlass.Float32.inf, values)
        tile_max = values[0]
        for j in cutlass.range_constexpr(1, ELEMS_PER_THREAD):
            tile_max = cute.arch.fmax(tile_max, values[j])
        new_max = cute.arch.fmax(thread_max, tile_max)
        shift = finite_shift(new_max)
        exps = [exp_shifted(values[j], shift) for j in range(ELEMS_PER_THREAD)]
        thread_sum = thread_sum * exp_shifted(thread_max, shift) + pairwise_sum(exps)
        thread_max = new_max
        if cutlass.const_expr(smoothing):
            columns = thread_columns(x_copies[1], tile, n)
            zero = cutlass.Float32(0.0)
            terms = [
                cutlass.select_(cute.elem_less(columns[j], n), values[j], zero)
                for j in range(ELEMS_PER_THREAD)
            ]
            thread_total = thread_total + pairwise_sum(terms)
    shift = finite_shift(block_max(thread_max))
    total_exp = block_sum(thread_sum * exp_shifted(thread_max, shift))
    row_lse = shift + cute.math.log2(total_exp) * cutlass.Float32(LN2)
    row_total = cutlass.Float32(0.0)
    if cutlass.const_expr(smoothing):
        row_total = block_sum(thread_total)
    if thread == 0:
        row_target = target[row].to(cutlass.Int64)
        kept = row_target != ignore_index
        # The target's logit, one more load of a line the block has just read (an ignored row
        # reads column 0 instead of its out-of-range target).
        target_logit = x_row[cutlass.select_(kept, row_target, cutlass.Int64(0))]
        target_logit = target_logit.to(cutlass.Float32)
        row_loss = row_lse - target_logit
        if cutlass.const_expr(smoothing):
            row_loss = row_loss + label_smoothing * (target_logit - row_total * inverse_n)
        loss[row] = cutlass.select_(kept, row_loss, cutlass.Float32(0.0))
        lse[row] = row_lse


@cute.kernel
def cross_entropy_backward_kernel(
    x: cute.Tensor, target: cute.Tensor, lse: cute.Tensor, dloss: cute.Tensor, dx: cute.Tensor,
    n: cutlass.Int32, ignore_index: cutlass.Int64, smooth_weight: cutlass.Float32,
    target_weight: cutlass.Float32, x_copies, dx_copies,
):  # fmt: skip
    row, _, _ = cute.arch.block_idx()
    x_row, dx_row = x[row, None], dx[row, None]
    row_target = target[row].to(cutlass.Int64)
    kept = row_target != ignore_index
    row_lse, row_dloss = lse[row], dloss[row]
    tiles = (n + TILE_ELEMS - 1) // TILE_ELEMS
    values = cute.make_rmem_tensor(ELEMS_PER_THREAD, cutlass.Float32)
    zero = cutlass.Float32(0.0)
    # Each thread reads its elements of a tile before it writes them, and no other thread
    # touches them: dx may be x itself.
    for tile in cutlass.range(tiles):
        load_tile(x_copies, x_row, tile, n, 0.0, values)
        columns = thread_columns(x_copies[1], tile, n)
        for j in cutlass.range_constexpr(ELEMS_PER_THREAD):
            on_target = cutlass.Int64(columns[j]) == row_target
            q = cutlass.select_(on_target, target_weight, smooth_weight)
            # An ignored row writes exact zeros (its dloss may be 1/0 when every row is ignored).
            gradient = (exp_shifted(values[j], row_lse) - q) * row_dloss
            values[j] = cutlass.select_(kept, gradient, zero)
        store_tile(dx_copies, values, dx_row, tile, n)


@cute.kernel
def loss_sum_kernel(loss: cute.Tensor, total: cute.Tensor, m: cutlass.Int32):
    thread, _, _ = cute.arch.thread_idx()
    thread_sum = cutlass.Float32(0.0)
    for row in cutlass.range(thread, m, THREADS_PER_BLOCK):
        thread_sum = thread_sum + loss[row]
    row_sum = block_sum(thread_sum)
    if thread == 0:
        total[0] = row_sum


def tiled_copies(dtype, vector_elems):
    """(tile copy, element copy) of one operand: thread t owns 16-byte runs of adjacent
    elements, the 256 threads side by side, ELEMS_PER_THREAD elements each per tile. The tile
    copy moves vector_elems elements per access (128 bits in the vector build), the element copy
    one; both give a thread the same elements in the same order."""
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


def row_grid(x, stream):
    return dict(grid=[cute.size(x, mode=[0]), 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream)


@cute.jit
def launch_forward(
    x: cute.Tensor, target: cute.Tensor, loss: cute.Tensor, lse: cute.Tensor,
    ignore_index: cutlass.Int64, label_smoothing: cutlass.Float32, inverse_n: cutlass.Float32,
    stream: cuda.CUstream, vector_elems: cutlass.Constexpr[int],
    smoothing: cutlass.Constexpr[bool],
):  # fmt: skip
    n = cutlass.Int32(cute.size(x, mode=[1]))
    copies = tiled_copies(x.element_type, vector_elems)
    cross_entropy_forward_kernel(
        x, target, loss, lse, n, ignore_index, label_smoothing, inverse_n, copies, smoothing
    ).launch(**row_grid(x, stream))


@cute.jit
def launch_backward(
    x: cute.Tensor, target: cute.Tensor, lse: cute.Tensor, dloss: cute.Tensor, dx: cute.Tensor,
    ignore_index: cutlass.Int64, smooth_weight: cutlass.Float32, target_weight: cutlass.Float32,
    stream: cuda.CUstream, vector_elems: cutlass.Constexpr[int],
):  # fmt: skip
    n = cutlass.Int32(cute.size(x, mode=[1]))
    copies = tiled_copies(x.element_type, vector_elems)
    cross_entropy_backward_kernel(
        x, target, lse, dloss, dx, n, ignore_index, smooth_weight, target_weight, copies, copies
    ).launch(**row_grid(x, stream))


@cute.jit
def launch_loss_sum(loss: cute.Tensor, total: cute.Tensor, stream: cuda.CUstream):
    m = cutlass.Int32(cute.size(loss, mode=[0]))
    loss_sum_kernel(loss, total, m).launch(
        grid=[1, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream
    )


def rows_placeholder(dtype, m, n, vector_elems):
    """What cute.compile sees of an (M, V) operand: symbolic sizes, and either unit column
    stride with a row stride divisible by the vector on a 16-byte boundary (the vector build)
    or two symbolic strides on an element boundary (any strides)."""
    if vector_elems > 1:
        stride = (cute.sym_int64(divisibility=vector_elems), 1)
    else:
        stride = (cute.sym_int64(), cute.sym_int64())
    return cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], (m, n), stride=stride, assumed_align=dtype.itemsize * vector_elems
    )


def vector_placeholder(dtype, m):
    """An (M,) operand with any stride (0 included: the mean's broadcast dloss)."""
    return cute.runtime.make_fake_tensor(
        TORCH_TO_CUTLASS[dtype], (m,), stride=(cute.sym_int64(),), assumed_align=dtype.itemsize
    )


def build(direction, dtype, target_dtype, vector_elems, smoothing, options=""):
    """cute.compile the forward (x, target, loss, lse; ignore_index, eps, 1/V), the backward
    (x, target, lse, dloss, dx; ignore_index, eps/V, 1 - eps + eps/V) or the loss sum (loss,
    total) for TVM-FFI calls on torch tensors and Python numbers, on torch's current stream.
    The (M, V) and (M,) operands share a symbolic M."""
    m, n = cute.sym_int64(), cute.sym_int64()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi {options}"
    floats = (vector_placeholder(torch.float32, m) for _ in range(3))
    if direction == "sum":
        total = cute.runtime.make_fake_tensor(cutlass.Float32, (1,), stride=(1,))
        return cute.compile(launch_loss_sum, next(floats), total, stream, options=options)
    x = rows_placeholder(dtype, m, n, vector_elems)
    target = vector_placeholder(target_dtype, m)
    scalars = (cutlass.Int64(0), cutlass.Float32(0.0), cutlass.Float32(0.0))
    if direction == "forward":
        operands, launcher, constants = (next(floats), next(floats)), launch_forward, (smoothing,)
    else:
        dx = rows_placeholder(dtype, m, n, vector_elems)
        operands, launcher, constants = (next(floats), next(floats), dx), launch_backward, ()
    return cute.compile(
        launcher, x, target, *operands, *scalars, stream, vector_elems, *constants,
        options=options,
    )  # fmt: skip


@functools.cache
def compile_kernel(direction, dtype=None, target_dtype=None, vector_elems=1, smoothing=False):
    """The compiled launcher, built once per specialisation and cached."""
    return build(direction, dtype, target_dtype, vector_elems, smoothing).__tvm_ffi_object__()


def ptx_of(direction, dtype=None, target_dtype=torch.int64, vector_elems=1, smoothing=False):
    """The sm_90a PTX of a build: what the tests read for 128-bit loads, ex2 and shuffles."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(direction, dtype, target_dtype, vector_elems, smoothing, options).__ptx__


def elements_per_access(dtype, vector_friendly):
    return VECTOR_BYTES // dtype.itemsize if vector_friendly else 1


def is_vector_friendly(rows):
    """Unit column stride, rows starting on 16-byte boundaries."""
    run = VECTOR_BYTES // rows.element_size()
    return (
        (rows.stride(1) == 1 or rows.shape[1] == 1)
        and rows.data_ptr() % VECTOR_BYTES == 0
        and (rows.stride(0) % run == 0 or rows.shape[0] == 1)
    )


def tree_additions(count, lanes):
    """Additions on a value's way into a sum of count values over `lanes` running sums (one
    add per later round; the first lands on 0, exactly) and log2(lanes) levels of tree."""
    return -(-count // lanes) - 1 + lanes.bit_length() - 1


def forward_path(n):
    """What README.md's bound counts on a term's way into the row's sum of exp: (exp2
    evaluations, float32 roundings after the exp): its own exp, a rescale per later tile and
    one before block_sum; the thread's tree over its ELEMS_PER_THREAD exps, the add into its
    sum, a multiply and an add per later tile, the last rescale, block_sum's levels."""
    tiles = -(-n // TILE_ELEMS)
    thread_tree = ELEMS_PER_THREAD.bit_length() - 1
    block_levels = THREADS_PER_BLOCK.bit_length() - 1
    return tiles + 1, thread_tree + 1 + 2 * (tiles - 1) + 1 + block_levels


def smoothing_path(n):
    """Additions on a logit's way into the smoothing's sum of x."""
    return tree_additions(n, TILE_ELEMS)


def reduction_path(m):
    """Additions on a row loss's way into the sum over rows."""
    return tree_additions(m, THREADS_PER_BLOCK)


def on_cuda(t):
    if not t.is_cuda:
        raise ValueError(f"the operands are on {t.device}; the CuTe kernel needs CUDA tensors")


def refuse_long_rows(logits):
    """Rows of more than ROW_CLASSES_MAX classes: refused before any launch."""
    if logits.shape[1] > ROW_CLASSES_MAX:
        raise ValueError(
            f"logits has rows of {logits.shape[1]} classes; the CuTe kernels take at most "
            f"{ROW_CLASSES_MAX} (2**31 - {TILE_ELEMS}: their indices are 32-bit)"
        )


def cross_entropy_forward(logits, target, ignore_index, label_smoothing, loss, lse):
    check_forward(logits, target, ignore_index, label_smoothing, loss, lse)
    refuse_long_rows(logits)
    on_cuda(logits)
    m, n = logits.shape
    if m == 0:
        return loss, lse
    vector_elems = elements_per_access(logits.dtype, is_vector_friendly(logits))
    smoothing = label_smoothing != 0  # a constant: the eps = 0 build carries no sum of x
    kernel = compile_kernel("forward", logits.dtype, target.dtype, vector_elems, smoothing)
    # TVM-FFI launches on torch's current stream; eps and 1 / V are rounded once to float32.
    kernel(logits, target, loss, lse, ignore_index, label_smoothing, 1.0 / n)
    return loss, lse


def cross_entropy_backward(logits, target, lse, dloss, ignore_index, label_smoothing, dlogits):
    check_backward(logits, target, lse, dloss, ignore_index, label_smoothing, dlogits)
    refuse_long_rows(logits)
    on_cuda(logits)
    m, n = logits.shape
    if m == 0:
        return dlogits
    friendly = is_vector_friendly(logits) and is_vector_friendly(dlogits)
    vector_elems = elements_per_access(logits.dtype, friendly)
    kernel = compile_kernel("backward", logits.dtype, target.dtype, vector_elems)
    smooth_weight = label_smoothing / n  # q's two values, each rounded once to float32
    kernel(
        logits, target, lse, dloss, dlogits, ignore_index, smooth_weight,
        1.0 - label_smoothing + smooth_weight,
    )  # fmt: skip
    return dlogits


def reduce_loss(loss, target, ignore_index, reduction):
    check_reduction(loss, target, ignore_index, reduction)
    if reduction == "none":
        return loss
    on_cuda(loss)
    total = torch.zeros(1, dtype=torch.float32, device=loss.device)
    if loss.shape[0]:
        compile_kernel("sum")(loss, total)
    total = total[0]
    return total if reduction == "sum" else total / (target != ignore_index).sum()


CrossEntropyFunction = autograd_function(cross_entropy_forward, cross_entropy_backward, reduce_loss)
cross_entropy = traceable_cross_entropy(
    "cute", cross_entropy_forward, cross_entropy_backward, reduce_loss
)


class CrossEntropyLoss(CrossEntropyLossModule):
    """Drop-in for torch.nn.CrossEntropyLoss, on this file's cross_entropy."""

    loss_function = staticmethod(cross_entropy)
