"""softmax forward and backward in the CuTe DSL: the public functions over two kernel steps.

    y_i = exp(x_i - m) / sum_j exp(x_j - m)          dx_i = y_i (dy_i - sum_j dy_j y_j)

* step 2, cute_2_cluster.py: the row held on chip, read once (2MN forward, 3MN backward), by
  one block or spread over a thread-block cluster that reduces through distributed shared
  memory: every row its `plan` covers (forward N <= 262144, backward N <= 131072).
* step 1, cute_1_two_pass.py: one block of 256 threads per row, two passes over it (any N):
  the rows too long for step 2, and bench.py's `cute.step1` row.

README.md, "CuTe", draws both maps. This file compiles each launcher once per specialisation
(direction, dtype, access width, plan) for TVM-FFI calls on torch tensors, picks the step
(`kernel_plan`), exports what README.md's bound counts (`forward_path`, `backward_path`), and
gives the autograd.Function, the custom ops and the nn.Module.
"""

import functools
import math
import tempfile

import cutlass
import cutlass.cute as cute
import torch

import cute_2_cluster as cluster
from cute_1_two_pass import (
    THREADS_PER_BLOCK,
    VECTOR_BYTES,
    launch_backward,
    launch_forward,
    tile_shape,
)
from reference import SoftmaxModule, as_rows, check_backward, check_forward
from torch_impl import autograd_function, traceable_softmax

TORCH_TO_CUTLASS = {
    torch.float32: cutlass.Float32,
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
}
# Rows a launch takes: the launchers hold M in an Int32 and step 2's grid is M x (up to
# MAX_CLUSTER = 16) blocks, so 2**26 rows keep both at most 2**30 (grid.x's limit: 2**31 - 1).
ROWS_PER_LAUNCH = 2**26


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


def build(direction, dtype, vector_elems, plan=None, options=""):
    """cute.compile the forward (x, y) or backward (y, dy, dx) launcher for TVM-FFI calls on
    torch (M, N) tensors, on torch's current stream; the operands share symbolic M and N. A
    plan (tiles, cluster size) builds step 2, None step 1."""
    m, n = cute.sym_int64(), cute.sym_int64()
    forward = direction == "forward"
    if plan:
        launcher = cluster.launch_forward_cluster if forward else cluster.launch_backward_cluster
        constants = (vector_elems, *plan)
    else:
        launcher, constants = (launch_forward if forward else launch_backward), (vector_elems,)
    return cute.compile(
        launcher,
        *(placeholder(dtype, m, n, vector_elems) for _ in range(2 if forward else 3)),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), *constants,
        options=f"--enable-tvm-ffi {options}",
    )  # fmt: skip


@functools.cache
def compile_kernel(direction, dtype, vector_elems, plan):
    """The compiled launcher, built once per (direction, dtype, access width, plan)."""
    return build(direction, dtype, vector_elems, plan).__tvm_ffi_object__()


def kernel_plan(direction, n, dtype):
    """Step 2's (tiles a block holds, blocks a cluster) for rows of n, or None: step 1."""
    return cluster.plan(direction, n, dtype.itemsize * 8)


def ptx_of(direction, dtype, contiguous, plan=None):
    """The sm_90a PTX of a build: what the tests read for 128-bit loads, ex2, shuffles and the
    cluster's mapa, st.async and barriers."""
    vector_elems = elements_per_access(dtype, contiguous)
    with tempfile.TemporaryDirectory() as dump_dir:
        options = f"--keep-ptx --dump-dir={dump_dir} --gpu-arch=sm_90a"
        return build(direction, dtype, vector_elems, plan, options).__ptx__


def is_vector_friendly(rows):
    """Unit column stride, rows starting on 16-byte boundaries."""
    run = VECTOR_BYTES // rows.element_size()
    return (
        (rows.stride(1) == 1 or rows.shape[1] == 1)
        and rows.data_ptr() % VECTOR_BYTES == 0
        and (rows.stride(0) % run == 0 or rows.shape[0] == 1)
    )


def forward_path(n, dtype):
    """(exp2 evaluations, float32 roundings after the exp) on a term's way into the row sum.
    Step 2: one exp (the max is known first) and cute_2_cluster.additions. Step 1: its own
    exp, a rescale per later tile and one before block_sum; the tile's pairwise tree, the add
    into the thread's sum, a multiply and an add per later tile, the rescale's multiply, and
    the 8 levels of block_sum."""
    plan = kernel_plan("forward", n, dtype)
    if plan:
        return 1, cluster.additions(*plan, dtype.itemsize * 8)
    tile_elems, per_thread = tile_shape(dtype.itemsize * 8)
    tiles = -(-n // tile_elems)
    block_levels = int(math.log2(THREADS_PER_BLOCK))
    return tiles + 1, int(math.log2(per_thread)) + 1 + 2 * (tiles - 1) + 1 + block_levels


def backward_path(n, dtype):
    """Additions on a product's way into the row's dot. Step 2: cute_2_cluster.additions.
    Step 1: the tile's pairwise tree, the add into the thread's sum, one per later tile, and
    the 8 levels of block_sum."""
    plan = kernel_plan("backward", n, dtype)
    if plan:
        return cluster.additions(*plan, dtype.itemsize * 8)
    tile_elems, per_thread = tile_shape(dtype.itemsize * 8)
    tiles = -(-n // tile_elems)
    return int(math.log2(per_thread)) + 1 + (tiles - 1) + int(math.log2(THREADS_PER_BLOCK))


def launch_on_row_slices(kernel, rows):
    """kernel(*rows) on (M, N) operands: one launch up to ROWS_PER_LAUNCH rows, past that one a
    slice of that many rows (views; every row's result is its own, so slicing changes no bit)."""
    m = rows[0].shape[0]
    if m <= ROWS_PER_LAUNCH:
        return kernel(*rows)
    for start in range(0, m, ROWS_PER_LAUNCH):
        kernel(*(t[start : start + ROWS_PER_LAUNCH] for t in rows))


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
    plan = kernel_plan(direction, output.shape[-1], output.dtype)
    launch_on_row_slices(compile_kernel(direction, output.dtype, vector_elems, plan),
                         (*rows, output_rows))  # fmt: skip
    if copied:
        output.copy_(output_rows.view(output.shape))
    return output


def softmax_forward(x, y):
    check_forward(x, y)
    return run_on_rows("forward", (x,), y)


def softmax_backward(y, dy, dx):
    check_backward(y, dy, dx)
    return run_on_rows("backward", (y, dy), dx)


SoftmaxFunction = autograd_function(softmax_forward, softmax_backward)
softmax = traceable_softmax("cute", softmax_forward, softmax_backward, SoftmaxFunction)


class Softmax(SoftmaxModule):
    """Drop-in for torch.nn.Softmax(dim), on this file's softmax."""

    last_dim_softmax = staticmethod(softmax)
