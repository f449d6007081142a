"""gemv, y = alpha*A*x + beta*y, in Triton: README.md, "The mapping onto the GPU", triton_impl.py.

TILES, TMA_TILES        the tile of each kernel by layout and element size
mapping, tma_reads      which kernel A takes (row-major, column-major pointer, column-major TMA)
split_columns           how many parts the columns are cut into when the row blocks alone
                        leave the GPU idle
roundings               README's k for A: the most roundings on one term's way to y_i
pairwise_sum_rows       the fixed tree over a row's lanes
gemv_kernel             pointer loads, one tile shape per layout
gemv_tma_kernel         column-major A through the TMA unit, software-pipelined
sum_splits_kernel       the second pass of a split: each row's parts in a fixed tree
patch_triton_interpreter  Triton 3.6's CPU interpreter under numpy 2.4 (TRITON_INTERPRET=1)
gemv                    the launcher
"""

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.knobs import HookChain
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from reference import check_operands, to_float32

# (BLOCK_M, BLOCK_N, num_warps) of gemv_kernel by mapping and element size in bytes. Row-major
# tiles are wide (a warp reads 512 contiguous bytes of a row), column-major ones tall (each
# column's part is a 128-byte line of float32, half a line of 16-bit data); float32 moves 16 KiB
# a step, 64 bytes a thread in flight; the 16-bit tiles won a sweep on the H200 (README.md,
# "Tuning log").
TILES = {
    ("row", 4): (16, 256, 8),
    ("row", 2): (16, 1024, 8),
    ("col", 4): (32, 128, 8),
    ("col", 2): (32, 128, 4),  # 4 warps: all 512 programs of m = 16384 fit on the chip at once
}
# (BLOCK_M, BLOCK_N, num_warps, num_stages) of gemv_tma_kernel by element size: BLOCK_N whole
# columns of 64 rows (a line of each 16-bit column, two of float32), 16 KiB a stage, 3 stages in
# flight while one is summed; the fastest in the H200 sweep (README.md, "Tuning log").
TMA_TILES = {4: (64, 64, 4, 4), 2: (64, 128, 4, 4)}
# The split (split_columns): fill FILL_PROGRAMS, two programs for each of the H200's 132 SMs (the
# occupancy the tiles were tuned at), a constant so that the bits of y depend on the shape alone;
# a part must stream SPLIT_MIN_BYTES of A to outlast the second pass's start; at most MAX_SPLITS
# parts, so that sum_splits_kernel's SUM_BLOCK_M x MAX_SPLITS tile stays in registers.
FILL_PROGRAMS = 2 * 132
SPLIT_MIN_BYTES = 128 * 1024
MAX_SPLITS = 64
SUM_BLOCK_M, SUM_WARPS = 64, 4
# The TMA unit's requirements: a 16-byte aligned base and row stride of A.T, coordinates in 32
# bits.
TMA_ALIGN = 16
TMA_COORDINATE_LIMIT = 2**31


def mapping(A):
    """'col' when A's rows are adjacent in memory (column-major, A.stride(0) < A.stride(1)),
    else 'row': the contiguous dimension, or the nearer one for a strided view."""
    stride_m, stride_n = A.stride()
    return "col" if stride_m < stride_n else "row"


def tma_reads(A):
    """True when A is column-major with what the TMA unit needs: stride 1 down the columns, a
    16-byte aligned start and column stride, and sizes whose tile coordinates fit in 32 bits."""
    stride_m, stride_n = A.stride()
    return (
        stride_m == 1  # column-major (mapping 'col'), unit stride down the columns
        and stride_n > 1
        and A.data_ptr() % TMA_ALIGN == 0
        and stride_n * A.element_size() % TMA_ALIGN == 0
        and max(A.shape) < TMA_COORDINATE_LIMIT
    )


def tile_shape(A):
    """(BLOCK_M, BLOCK_N) of the kernel that gemv runs on A."""
    if tma_reads(A):
        return TMA_TILES[A.element_size()][:2]
    return TILES[mapping(A), A.element_size()][:2]


def split_columns(m, n, block_m, block_n, element_size):
    """(splits, column steps per split) for an (m, n) A in tiles of block_m x block_n elements:
    how many parts the columns are cut into, and how many column steps each part takes (the last
    may take fewer). splits is a power of two, 1 when the row blocks alone fill the GPU."""
    row_blocks, steps = -(-m // block_m), -(-n // block_n)
    tile_bytes = block_m * block_n * element_size
    most = min(FILL_PROGRAMS // row_blocks, steps * tile_bytes // SPLIT_MIN_BYTES, MAX_SPLITS)
    splits = 1 << (most.bit_length() - 1) if most > 1 else 1
    return splits, -(-steps // splits)


def column_split(A):
    """(splits, column steps per split) of the kernels gemv runs on A: what the bound needs."""
    return split_columns(*A.shape, *tile_shape(A), A.element_size())


def roundings(A):
    """README.md's k for the kernels gemv runs on A (n > 0): the most roundings on one term
    alpha a_ij x_j's way to y_i. One for the product of two float32 numbers (none for 16-bit
    data, exact in float32), one per further column step of its part added into a lane,
    log2(BLOCK_N) levels of pairwise_sum_rows, log2(splits) levels of sum_splits_kernel's tree,
    and two for alpha * sum and the addition of beta * y_i."""
    _, block_n = tile_shape(A)
    splits, steps = column_split(A)
    product = 1 if A.element_size() == 4 else 0
    return product + (steps - 1) + (block_n.bit_length() - 1) + (splits.bit_length() - 1) + 2


@triton.jit
def pairwise_sum_rows(values, LEVELS: tl.constexpr, HALVES: tl.constexpr):
    """The row sums of a [rows, 2**LEVELS] float32 block by a pairwise tree: LEVELS times,
    each lane is added to a partner, so that each value passes through exactly LEVELS
    additions, on the GPU and in the interpreter alike (tl.sum over a whole row would leave the
    tree to the compiler). The error bound depends only on the depth, so the partners are
    chosen to keep the first levels inside a thread's own registers:

    HALVES False  neighbours, lane 2k with 2k + 1: a row-major tile gives each thread runs of
                  adjacent lanes.
    HALVES True   the row folded in half, lane k with k + 2**(LEVELS - 1), then again: a
                  column-major tile spreads adjacent lanes over threads and hands a thread
                  lanes that lie a power of two apart. For the bfloat16 TMA tile, neighbours
                  compiled to 152 warp shuffles and 161 shared-memory stores a thread after
                  the loop, halves to 28 and 37 (sm_90 PTX)."""
    for _ in tl.static_range(LEVELS):
        if HALVES:
            values = tl.sum(tl.reshape(values, [values.shape[0], 2, values.shape[1] // 2]), axis=1)
        else:
            values = tl.sum(tl.reshape(values, [values.shape[0], values.shape[1] // 2, 2]), axis=2)
    return tl.sum(values, axis=1)  # a single value per row is left: this adds nothing


@triton.jit
def finish_rows(y_ptr, offs_m, row_in, stride_y, result, beta, READ_Y: tl.constexpr):
    """y_i = result_i + beta * y_i in float32 (result_i = alpha * s_i), rounded once by the
    store; y is read only when READ_Y."""
    y_ptrs = y_ptr + offs_m * stride_y
    if READ_Y:
        result += beta * tl.load(y_ptrs, mask=row_in).to(tl.float32)  # 0 + v is exact
    tl.store(y_ptrs, result.to(y_ptr.dtype.element_ty), mask=row_in)


@triton.jit
def store_row_sums(partials_ptr, y_ptr, m, offs_m, row_in, stride_y, row_sums, alpha, beta,
                   READ_Y: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """Split: store this part's row sums at partials[part, row] for sum_splits_kernel. Else
    finish the rows: y_i = alpha * s_i + beta * y_i."""
    if SPLIT:
        tl.store(partials_ptr + tl.program_id(1) * m + offs_m, row_sums, mask=row_in)
    else:
        finish_rows(y_ptr, offs_m, row_in, stride_y, alpha * row_sums, beta, READ_Y)


@triton.jit
def part_columns(part, split_cols, n):
    """[start, stop) of the columns of part `part`, split_cols a part, none past n: stop as
    start plus what is left, for start + split_cols passes 2**31 in 32 bits for n just below."""
    start = part * split_cols
    return start, start + tl.minimum(n - start, split_cols)


@triton.jit
def gemv_kernel(
    a_ptr, x_ptr, y_ptr, partials_ptr, m, n, split_cols, stride_am, stride_an, stride_x, stride_y,
    alpha, beta, READ_A: tl.constexpr, READ_Y: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_BLOCK_N: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    """Program (p, s) sums rows p BLOCK_M .. of A over the columns of part s, split_cols of them
    (a multiple of BLOCK_N; at least n when the columns are not split)."""
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: A may hold 2**31 elements and more
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = offs_m < m
    # "Not read" is a compile-time choice: the alpha == 0 variant has no load of A or x at all.
    if not READ_A:
        finish_rows(y_ptr, offs_m, row_in, stride_y, tl.zeros([BLOCK_M], tl.float32), beta, READ_Y)
    else:
        row_ptrs = a_ptr + offs_m[:, None] * stride_am
        lanes = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        cols_start, cols_stop = part_columns(tl.program_id(1).to(tl.int64), split_cols, n)
        # Full column steps mask only the rows. That mask is constant along a row, so it does
        # not stop the compiler from merging a row-major row into 16-byte loads; in a
        # column-major tile it runs along the contiguous dimension and is constant over 16
        # rows when m is a multiple of 16, which is also when the columns start 16-byte
        # aligned. The columns of the last step, when partial, pay for their own mask.
        # A part that starts past n (parts of ceil(steps / splits) steps can leave the last
        # ones empty) takes no step and stores zeros.
        full_cols_stop = tl.maximum(cols_start, tl.minimum(cols_stop, n // BLOCK_N * BLOCK_N))
        for col_start in range(cols_start, full_cols_stop, BLOCK_N):
            offs_n = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
            a = tl.load(row_ptrs + offs_n[None, :] * stride_an, mask=row_in[:, None], other=0.0)
            x = tl.load(x_ptr + offs_n * stride_x)
            # Widening is exact, and so is the product of two widened 16-bit values; on the
            # GPU each multiply and add fuse into one FMA.
            lanes += a.to(tl.float32) * x.to(tl.float32)[None, :]
        if full_cols_stop < cols_stop:
            offs_n = (full_cols_stop + tl.arange(0, BLOCK_N)).to(tl.int64)
            col_in = offs_n < n
            in_bounds = row_in[:, None] & col_in[None, :]
            a = tl.load(row_ptrs + offs_n[None, :] * stride_an, mask=in_bounds, other=0.0)
            x = tl.load(x_ptr + offs_n * stride_x, mask=col_in, other=0.0)
            lanes += a.to(tl.float32) * x.to(tl.float32)[None, :]  # lanes past n add 0
        row_sums = pairwise_sum_rows(lanes, LOG2_BLOCK_N, HALVES)
        store_row_sums(partials_ptr, y_ptr, m, offs_m, row_in, stride_y, row_sums, alpha, beta,
                       READ_Y, SPLIT)  # fmt: skip


@triton.jit
def gemv_tma_kernel(
    a_tiles, x_ptr, y_ptr, partials_ptr, m, n, split_cols, stride_x, stride_y, alpha, beta,
    READ_Y: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOG2_BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """The column-major mapping with A's tiles fetched by the TMA unit. a_tiles describes A.T,
    the (n, m) row-major matrix A's columns form, in blocks of BLOCK_N columns of A by BLOCK_M
    rows; a load copies one block into shared memory, and the compiler's software pipeline
    keeps NUM_STAGES - 1 blocks in flight while one is summed (asked for on the loop itself:
    the launch's num_stages alone left this loop unpipelined, one 16 KiB buffer). Reads past m or n
    come back as zeros. The lanes are the transposed tile: lane (j mod BLOCK_N, i), the same
    sums in the same order as gemv_kernel with these BLOCK_M and BLOCK_N, over the columns of
    part program_id(1) as there."""
    pid = tl.program_id(0)
    lanes = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # TMA coordinates are 32-bit (n < 2**31): the part's columns in 32 bits, and a loop over
    # its column steps, not `col < stop; col += BLOCK_N`, whose last step would wrap past
    # 2**31 - 1 for n within BLOCK_N of 2**31 and never end.
    cols_start, cols_stop = part_columns(tl.program_id(1), split_cols, n)
    for step in tl.range(0, tl.cdiv(cols_stop - cols_start, BLOCK_N), num_stages=NUM_STAGES):
        col_start = cols_start + step * BLOCK_N
        a = a_tiles.load([col_start, pid * BLOCK_M])
        offs_n = col_start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + offs_n.to(tl.int64) * stride_x, mask=offs_n < n, other=0.0)
        lanes += a.to(tl.float32) * x.to(tl.float32)[:, None]
    row_sums = pairwise_sum_rows(tl.trans(lanes), LOG2_BLOCK_N, True)
    offs_m = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    store_row_sums(partials_ptr, y_ptr, m, offs_m, offs_m < m, stride_y, row_sums, alpha, beta,
                   READ_Y, SPLIT)  # fmt: skip


@triton.jit
def sum_splits_kernel(
    partials_ptr, y_ptr, m, stride_y, alpha, beta,
    READ_Y: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, LOG2_SPLITS: tl.constexpr,
):  # fmt: skip
    """The second pass of a split: row i's SPLITS parts partials[s, i], added by neighbours in
    a pairwise tree of LOG2_SPLITS levels, then y_i = alpha * sum + beta * y_i, stored once."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = offs_m < m
    offs_split = tl.arange(0, SPLITS)
    parts = tl.load(partials_ptr + offs_split[None, :] * m + offs_m[:, None], mask=row_in[:, None])
    result = alpha * pairwise_sum_rows(parts, LOG2_SPLITS, False)
    finish_rows(y_ptr, offs_m, row_in, stride_y, result, beta, READ_Y)


# The launch options of each kernel, worked out once: gemv_kernel's by mapping and element size,
# gemv_tma_kernel's by element size. The launchers count the programs, ceil(m / BLOCK_M), as
# -(-m // BLOCK_M): triton.cdiv is a constexpr function in Triton 3.6, 2 us a call on the host.
POINTER_LAUNCH = {
    (layout, size): {"BLOCK_M": block_m, "BLOCK_N": block_n,
                     "LOG2_BLOCK_N": block_n.bit_length() - 1, "HALVES": layout == "col",
                     "num_warps": warps}
    for (layout, size), (block_m, block_n, warps) in TILES.items()
}  # fmt: skip
TMA_LAUNCH = {
    size: {"BLOCK_M": block_m, "BLOCK_N": block_n, "LOG2_BLOCK_N": block_n.bit_length() - 1,
           "NUM_STAGES": stages, "num_warps": warps}
    for size, (block_m, block_n, warps, stages) in TMA_TILES.items()
}  # fmt: skip

# Read once: test.py sets it before importing Triton, and the launcher should not pay for a look-up.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_triton_interpreter():
    """Make Triton 3.6's CPU interpreter compute what the GPU computes; called at import only
    under TRITON_INTERPRET=1, so the GPU path never runs it. With numpy 2.4 the interpreter fails
    where it makes a Python int of a scalar (a one-element array) with int(array): numpy 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"), so a loop over
    runtime bounds fails; .item() does it. And it converts float32 <-> bfloat16 bit by bit,
    truncating (its 'rtne' rounds half up) and mangling subnormals where the GPU rounds to
    nearest even and keeps them; torch's exact conversions replace those two cases."""
    import numpy as np  # the interpreter's own dependency; the GPU path needs no numpy
    from triton.runtime import interpreter

    patch_tensor, convert = interpreter._patch_lang_tensor, interpreter._convert_float

    def patch_with_item(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: self.handle.data.item())

    def exact(values, src, dst, rounding_mode):
        values = np.ascontiguousarray(values)
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(values.view(np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy()
        if src == tl.bfloat16 and dst == tl.float32:
            return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16).float().numpy()
        return convert(values, src, dst, rounding_mode)

    interpreter._patch_lang_tensor, interpreter._convert_float = patch_with_item, exact


if INTERPRETED:
    patch_triton_interpreter()


class Address:
    """What a host TensorDescriptor needs of its base on the GPU: Triton 3.6 reads the dtype
    when it specialises the kernel and data_ptr() when it encodes the TMA descriptor. Holding
    no tensor, a cached descriptor keeps no memory alive."""

    __slots__ = ("address", "dtype")

    def __init__(self, address, dtype):
        self.address, self.dtype = address, dtype

    def data_ptr(self):
        return self.address


@functools.lru_cache(maxsize=64)
def tma_descriptor(address, dtype, m, n, column_stride):
    """The descriptor of A.T, the (n, m) row-major matrix a column-major A's columns form, in
    blocks of BLOCK_N columns of A by BLOCK_M rows. It depends on nothing but these numbers, so
    it is built (with TensorDescriptor's checks, 2-3 us of Python) once per matrix, not per
    call. Triton 3.6 still encodes the CUtensorMap from it at every launch: that is in its
    launcher, and no host-side descriptor avoids it."""
    block_m, block_n, _, _ = TMA_TILES[dtype.itemsize]
    return TensorDescriptor(Address(address, dtype), [n, m], [column_stride, 1], [block_n, block_m])


def a_tiles(A):
    """A's TMA descriptor: the cached one on the GPU; a fresh one over the tensor itself under
    the interpreter, which reads the elements through it."""
    m, n = A.shape
    if INTERPRETED:
        block_m, block_n, _, _ = TMA_TILES[A.element_size()]
        return TensorDescriptor(A.T, [n, m], [A.stride(1), 1], [block_n, block_m])
    return tma_descriptor(A.data_ptr(), A.dtype, m, n, A.stride(1))


def on_device_of(t):
    """Launch context for t. Triton launches on the current CUDA device, so t's GPU is made
    current when it is another one (entering torch.cuda.device costs more than a launch's own
    Python, so only then); the CPU serves when Triton runs as an interpreter."""
    if t.is_cuda:
        if t.get_device() == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(t.device)
    if INTERPRETED:
        return contextlib.nullcontext()
    raise ValueError(
        f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}"
    )


# -- The launch: Triton's host work done once per specialisation ------------------------------
# kernel[grid](...) costs Triton 3.6 tens of microseconds of host time a call: it binds each
# argument by name, asks each what the compiled code depends on and builds a string key to
# find the compiled kernel. `launch` keeps the compiled kernel Triton returns at the first call
# of a specialisation and hands later calls straight to its launcher (gemm/README.md, "The
# host path"). Every folder's triton_impl.py holds these same lines: a folder imports nothing
# from another.

# (id of the kernel, device, Triton's debug and instrumentation knobs, specialisation(), the
# constants) -> (the CompiledKernel, the kernel's arguments after `args`). A JITFunction hashes
# its source (0.6 us), so the key holds its id: the CompiledKernel holds the kernel (src.fn), so
# that id is no other kernel's while the entry lives.
COMPILED = {}


def specialisation(ints, tensors):
    """What Triton 3.6 compiles a kernel for, of these arguments (its binder,
    native_specialize_impl): an int is compiled in as the constant 1, else as an i32 (below
    2**31) or i64 known to be a multiple of 16 or not; a tensor is a pointer of its dtype known
    to be 16-byte aligned or not. Sizes and strides are never negative nor past 2**63."""
    return (
        *[1 if x == 1 else (x % 16 == 0, x < 2**31) for x in ints],
        *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors],
    )


def unhooked(hook):
    """True for a launch hook that does nothing: None, or Triton 3.6's default, an empty chain."""
    return hook is None or (type(hook) is HookChain and not hook.calls)


def launch(kernel, grid, args, constants, specialised):
    """kernel[grid](*args, **constants), where `specialised` is specialisation() of the ints
    and tensors among `args` (Triton passes a float as float32 whatever its value, and the
    constants, num_warps among them, are in the key). The first call of each key goes through
    Triton, which compiles the kernel or finds it compiled; later ones call its launcher on the
    current stream, as Triton's last step does. Triton's own path stays for whatever needs it:
    the interpreter and wrapped kernels (no JITFunction), pre-run and launch hooks (a profiler),
    a kernel that reads globals (Triton checks them at each launch)."""
    if (
        not isinstance(kernel, JITFunction)
        or kernel.pre_run_hooks
        or kernel.used_global_vals
        or not unhooked(knobs.runtime.launch_enter_hook)
        or not unhooked(knobs.runtime.launch_exit_hook)
    ):
        kernel[grid](*args, **constants)
        return
    device = driver.active.get_current_device()
    key = (
        id(kernel), device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
        specialised, *constants.values(),
    )  # fmt: skip
    found = COMPILED.get(key)
    if found is None:
        compiled = kernel[grid](*args, **constants)
        if compiled is not None:  # None: a jit_cache_hook skipped the compile and the launch
            rest = tuple(constants[param.name] for param in kernel.params[len(args) :])
            COMPILED[key] = compiled, rest
        return
    compiled, rest = found
    compiled.run(
        *(*grid, 1, 1)[:3], driver.active.get_current_stream(device), compiled.function,
        compiled.packed_metadata, None, None, None, *args, *rest,
    )  # fmt: skip


def gemv(alpha, A, x, beta, y):
    check_operands(alpha, A, x, beta, y)
    device = on_device_of(y)
    m, n = A.shape
    if m == 0:
        return y
    alpha32, beta32 = to_float32(float(alpha)), to_float32(float(beta))
    read_a, read_y = alpha32 != 0.0 and n > 0, beta32 != 0.0
    tma = read_a and tma_reads(A)
    tile = TMA_LAUNCH[A.element_size()] if tma else POINTER_LAUNCH[mapping(A), A.element_size()]
    splits, split_cols = 1, n  # one part of all n columns (alpha == 0: none is read)
    if read_a:
        block_m, block_n = tile["BLOCK_M"], tile["BLOCK_N"]
        splits, split_steps = split_columns(m, n, block_m, block_n, A.element_size())
        split_cols = split_steps * block_n
    # The parts' row sums, per call from torch's caching allocator (calls on different streams
    # may run side by side); unsplit, the kernel stores none and y stands in for the pointer.
    partials = torch.empty((splits, m), dtype=torch.float32, device=y.device) if splits > 1 else y
    grid = (-(-m // tile["BLOCK_M"]), splits)
    constants = {"READ_Y": read_y, "SPLIT": splits > 1, **tile}
    with device:
        if tma:
            # The descriptor's dtype is x's, its block shape the tile's: both in the key.
            ints = (m, n, split_cols, x.stride(0), y.stride(0))
            args = (a_tiles(A), x, y, partials, *ints, alpha32, beta32)
            launch(gemv_tma_kernel, grid, args, constants, specialisation(ints, (x, y, partials)))
        else:
            ints = (m, n, split_cols, *A.stride(), x.stride(0), y.stride(0))
            args = (A, x, y, partials, *ints, alpha32, beta32)
            constants["READ_A"] = read_a
            launch(gemv_kernel, grid, args, constants, specialisation(ints, (A, x, y, partials)))
        if splits > 1:
            levels = splits.bit_length() - 1
            constants = {"READ_Y": read_y, "BLOCK_M": SUM_BLOCK_M, "SPLITS": splits,
                         "LOG2_SPLITS": levels, "num_warps": SUM_WARPS}  # fmt: skip
            launch(
                sum_splits_kernel, (-(-m // SUM_BLOCK_M),),
                (partials, y, m, y.stride(0), alpha32, beta32), constants,
                specialisation((m, y.stride(0)), (partials, y)),
            )  # fmt: skip
    return y
