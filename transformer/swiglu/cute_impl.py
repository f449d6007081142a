"""SwiGLU forward and backward in the CuTe DSL: one elementwise kernel per pass, a block per
tile of a row.

    s = 1 / (1 + exp(-g))     y = g * s * u
    dg = dy * u * s * (1 + g * (1 - s))     du = dy * (g * s)     (s recomputed, not saved)

The map (README.md, "cute_impl.py", draws it): the (M, N) rows are cut into tiles of
TILE_VECTORS * 256 runs of 16 bytes; block b takes tile b % tiles_n of row b // tiles_n, and
thread t the same runs of every operand (runs t and t + 256 of its tile). The vector build moves
each run with one 128-bit access under one predicate (run inside the row or not), the any-stride
build element by element under a predicate each. The fused gate-up tensor is two strided views
of one (M, 2N) matrix, so the same kernels serve both forms.

exp(-g) is ex2.approx.ftz of `-g * log2 e` (two roundings of the argument:
EXP_ARGUMENT_ROUNDINGS, which README.md's bound counts with common/README.md's ex2 figure); the
reciprocal is div.rn, correctly rounded; every other operation is an ordinary float32 rounding.
"""

import functools
import math
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from reference import as_rows, check_backward, check_forward, halves
from torch_impl import model_plumbing

THREADS_PER_BLOCK = 256
VECTOR_BYTES = 16  # the widest access a thread can issue: 128 bits
# Runs of 16 bytes per thread and operand: a bf16 forward has 4 128-bit loads in flight per
# thread, and 8 blocks of 256 threads fit on an SM, ~128 kB in flight: past the H200's
# bandwidth-latency product per SM (~20 kB).
TILE_VECTORS = 2
EXP_ARGUMENT_ROUNDINGS = 2
# Blocks a launch takes: the launcher forms the grid, M x tiles_n blocks, and the kernel a
# block's row and tile, in Int32; 2**30 stays inside it and grid.x's limit (2**31 - 1).
BLOCKS_PER_LAUNCH = 2**30
LOG2_E = math.log2(math.e)

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}


@cute.jit
def sigmoid(g):
    """1 / (1 + exp(-g)) in float32: ex2.approx.ftz(fl(-g * fl(log2 e))), an add, div.rn.
    g = -inf gives 1 / inf = 0, g = +inf 1 / 1 = 1, NaN stays NaN."""
    exp_minus_g = cute.math.exp2(-g * cutlass.Float32(LOG2_E), fastmath=True)
    return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + exp_minus_g)


@cute.jit
def run_mask(thread_copy, tile_coords, n):
    """One predicate per access of the copy's atom: True where its first element's index is
    < n. The partition is ((atom values, accesses per run), runs); a 128-bit access covers a
    whole run (and the vector build needs n a multiple of the run), an element access one."""
    coords = thread_copy.partition_S(tile_coords)
    accesses = cute.size(coords.shape[0][1])
    runs = cute.size(coords, mode=[1])
    mask = cute.make_rmem_tensor((accesses, runs), cutlass.Boolean)
    for run in cutlass.range_constexpr(runs):
        for access in cutlass.range_constexpr(accesses):
            mask[access, run] = cute.elem_less(coords[(0, access), run], n)
    return mask


@cute.jit
def tile_of_row(tiled_copy, row, tile, n, tile_elems: cutlass.Constexpr[int]):
    """(this thread's elements of the row's tile `tile`, their predicates)."""
    thread, _, _ = cute.arch.thread_idx()
    thread_copy = tiled_copy.get_slice(thread)
    coords = cute.local_tile(cute.make_identity_tensor(n), (tile_elems,), (tile,))
    mine = thread_copy.partition_S(cute.local_tile(row, (tile_elems,), (tile,)))
    return mine, run_mask(thread_copy, coords, n)


@cute.jit
def load_tile(tiled_copy, row, tile, n, tile_elems: cutlass.Constexpr[int]):
    """This thread's elements of the tile, widened to float32. Those past n are not loaded and
    hold whatever the registers held: they are computed on but never stored."""
    mine, in_row = tile_of_row(tiled_copy, row, tile, n, tile_elems)
    loaded = cute.make_rmem_tensor_like(mine)
    cute.copy(tiled_copy, mine, loaded, pred=in_row)
    values = cute.make_rmem_tensor(cute.size(loaded), cutlass.Float32)
    for j in cutlass.range_constexpr(cute.size(values)):
        values[j] = loaded[j].to(cutlass.Float32)
    return values


@cute.jit
def store_tile(tiled_copy, values, row, tile, n, tile_elems: cutlass.Constexpr[int]):
    """The reverse: values rounded to the row's dtype (cvt.rn, to nearest even) and stored
    where inside the row."""
    mine, in_row = tile_of_row(tiled_copy, row, tile, n, tile_elems)
    rounded = cute.make_rmem_tensor_like(mine)
    for j in cutlass.range_constexpr(cute.size(values)):
        rounded[j] = values[j].to(row.element_type)
    cute.copy(tiled_copy, rounded, mine, pred=in_row)


@cute.kernel
def swiglu_forward_kernel(
    g: cute.Tensor, u: cute.Tensor, y: cute.Tensor, n: cutlass.Int32, tiles_n: cutlass.Int32,
    tiled_copy: cute.TiledCopy, tile_elems: cutlass.Constexpr[int],
):  # fmt: skip
    # A one-dimensional grid: the second dimension stops at 65535 blocks, which a long batch
    # of rows would pass.
    block, _, _ = cute.arch.block_idx()
    row, tile = block // tiles_n, block % tiles_n
    gs = load_tile(tiled_copy, g[row, None], tile, n, tile_elems)
    us = load_tile(tiled_copy, u[row, None], tile, n, tile_elems)
    for j in cutlass.range_constexpr(cute.size(gs)):
        gs[j] = gs[j] * sigmoid(gs[j]) * us[j]
    store_tile(tiled_copy, gs, y[row, None], tile, n, tile_elems)


@cute.kernel
def swiglu_backward_kernel(
    g: cute.Tensor, u: cute.Tensor, dy: cute.Tensor, dg: cute.Tensor, du: cute.Tensor,
    n: cutlass.Int32, tiles_n: cutlass.Int32, tiled_copy: cute.TiledCopy,
    tile_elems: cutlass.Constexpr[int],
):  # fmt: skip
    block, _, _ = cute.arch.block_idx()
    row, tile = block // tiles_n, block % tiles_n
    gs = load_tile(tiled_copy, g[row, None], tile, n, tile_elems)
    us = load_tile(tiled_copy, u[row, None], tile, n, tile_elems)
    dys = load_tile(tiled_copy, dy[row, None], tile, n, tile_elems)
    # Every load is issued before the first store: dg and du may be g, u or dy themselves.
    for j in cutlass.range_constexpr(cute.size(gs)):
        s = sigmoid(gs[j])
        g_s = gs[j] * s
        grad_gate = dys[j] * us[j] * s * (cutlass.Float32(1.0) + gs[j] * (1.0 - s))
        gs[j], us[j] = grad_gate, dys[j] * g_s
    store_tile(tiled_copy, gs, dg[row, None], tile, n, tile_elems)
    store_tile(tiled_copy, us, du[row, None], tile, n, tile_elems)


def run_of(dtype_width):
    """Elements of one 16-byte run, and of one tile."""
    run = VECTOR_BYTES * 8 // dtype_width
    return run, THREADS_PER_BLOCK * TILE_VECTORS * run


def tiled_copy_of(dtype, vectorized):
    """Thread t owns runs of 16 bytes, the 256 threads side by side, TILE_VECTORS runs each per
    tile; the vector build moves a run in one 128-bit access, the any-stride one element by
    element. Both give a thread the same elements."""
    run, _ = run_of(dtype.width)
    bits = VECTOR_BYTES * 8 if vectorized else dtype.width
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
    return cute.make_tiled_copy_tv(atom, cute.make_layout(THREADS_PER_BLOCK), cute.make_layout(run))


def launch_config(g, stream):
    m, n = cutlass.Int32(cute.size(g, mode=[0])), cutlass.Int32(cute.size(g, mode=[1]))
    _, tile_elems = run_of(g.element_type.width)
    tiles_n = (n + tile_elems - 1) // tile_elems
    launch = dict(grid=[m * tiles_n, 1, 1], block=[THREADS_PER_BLOCK, 1, 1], stream=stream)
    return n, tiles_n, tile_elems, launch


@cute.jit
def launch_forward(
    g: cute.Tensor, u: cute.Tensor, y: cute.Tensor, stream: cuda.CUstream,
    vectorized: cutlass.Constexpr[bool],
):  # fmt: skip
    n, tiles_n, tile_elems, launch = launch_config(g, stream)
    tiled_copy = tiled_copy_of(g.element_type, vectorized)
    swiglu_forward_kernel(g, u, y, n, tiles_n, tiled_copy, tile_elems).launch(**launch)


@cute.jit
def launch_backward(
    g: cute.Tensor, u: cute.Tensor, dy: cute.Tensor, dg: cute.Tensor, du: cute.Tensor,
    stream: cuda.CUstream, vectorized: cutlass.Constexpr[bool],
):  # fmt: skip
    n, tiles_n, tile_elems, launch = launch_config(g, stream)
    tiled_copy = tiled_copy_of(g.element_type, vectorized)
    swiglu_backward_kernel(g, u, dy, dg, du, n, tiles_n, tiled_copy, tile_elems).launch(**launch)


def build(direction, dtype, vectorized, options=""):
    """cute.compile the forward (g, u, y) or backward (g, u, dy, dg, du) launcher for TVM-FFI
    calls on torch tensors, on torch's current stream. The operands share symbolic M and N;
    each has its own strides: unit last stride and a row stride of whole 16-byte runs on a
    16-byte boundary (the vector build), or any strides on an element boundary."""
    m, n = cute.sym_int64(), cute.sym_int64()
    per_vector = VECTOR_BYTES // dtype.itemsize

    def rows():
        if vectorized:
            stride = (cute.sym_int64(divisibility=per_vector), 1)
        else:
            stride = (cute.sym_int64(), cute.sym_int64())
        return cute.runtime.make_fake_tensor(
            TORCH_TO_CUTLASS[dtype], (m, n), stride=stride,
            assumed_align=VECTOR_BYTES if vectorized else dtype.itemsize,
        )  # fmt: skip

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    launcher, count = (launch_forward, 3) if direction == "forward" else (launch_backward, 5)
    operands = [rows() for _ in range(count)]
    return cute.compile(
        launcher, *operands, stream, vectorized, options=f"--enable-tvm-ffi {options}"
    )


@functools.cache
def compile_kernel(direction, dtype, vectorized):
    """The compiled launcher, built once per (direction, dtype, vectorized) and cached."""
    return build(direction, dtype, vectorized).__tvm_ffi_object__()


def ptx_of(direction, dtype, vectorized):
    """The sm_90a PTX of a build: what the tests read for 128-bit accesses, ex2 and div.rn."""
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(direction, dtype, vectorized, options).__ptx__


def is_vector_friendly(t):
    """(M, N) rows that split into whole 16-byte runs on 16-byte boundaries: unit column
    stride, N and the row stride multiples of the run, a 16-byte aligned start."""
    run = VECTOR_BYTES // t.element_size()
    return (
        t.data_ptr() % VECTOR_BYTES == 0
        and t.shape[1] % run == 0
        and (t.stride(1) == 1 or t.shape[1] == 1)
        and (t.stride(0) % run == 0 or t.shape[0] == 1)
    )


def on_cuda(g):
    if not g.is_cuda:
        raise ValueError(f"the operands are on {g.device}; the CuTe kernel needs CUDA tensors")


def launch_on_row_slices(kernel, operands):
    """kernel(*operands) on (M, N) operands: one launch up to BLOCKS_PER_LAUNCH blocks, past
    that one a slice of as many rows as that many blocks take (views; every element's result
    is its own, so slicing changes no bit)."""
    (m, n), tile_elems = operands[0].shape, run_of(operands[0].element_size() * 8)[1]
    tiles_n = -(-n // tile_elems)
    if m * tiles_n <= BLOCKS_PER_LAUNCH:
        return kernel(*operands)
    rows = BLOCKS_PER_LAUNCH // tiles_n
    for start in range(0, m, rows):
        kernel(*(t[start : start + rows] for t in operands))


def launch(direction, inputs, outputs):
    """Run the compiled kernel on (M, N) views of the operands; outputs whose leading
    dimensions do not merge into rows go through a contiguous copy."""
    input_rows = [as_rows(t)[0] for t in inputs]
    output_rows = [as_rows(t, for_output=True) for t in outputs]
    operands = input_rows + [rows for rows, _ in output_rows]
    vectorized = all(is_vector_friendly(t) for t in operands)
    # TVM-FFI launches on torch's current stream (capturable by a CUDA graph after a first call).
    launch_on_row_slices(compile_kernel(direction, inputs[0].dtype, vectorized), operands)
    for target, (rows, copied) in zip(outputs, output_rows, strict=True):
        if copied:
            target.copy_(rows.view(target.shape))


def swiglu_forward(g, u, y):
    check_forward(g, u, y)
    on_cuda(g)
    if y.numel():
        launch("forward", halves(g) if u is None else (g, u), (y,))
    return y


def swiglu_backward(g, u, dy, dg, du=None):
    check_backward(g, u, dy, dg, du)
    on_cuda(g)
    if dy.numel():
        gate, up = halves(g) if u is None else (g, u)
        launch("backward", (gate, up, dy), halves(dg) if u is None else (dg, du))
    return dg, du


_plumbing = model_plumbing("cute", swiglu_forward, swiglu_backward)
SwiGLUFunction, swiglu, SwiGLU = _plumbing.SwiGLUFunction, _plumbing.swiglu, _plumbing.SwiGLU
