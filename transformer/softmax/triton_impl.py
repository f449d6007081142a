"""softmax forward and backward as Triton kernels, one program per row (or several short rows).

    y_i = exp(x_i - m) / sum_j exp(x_j - m)          dx_i = y_i (dy_i - sum_j dy_j y_j)

Two shapes of kernel, picked by the row length N (README.md, "Triton"):

* rows of at most ROW_BLOCK_MAX elements (BACKWARD_ROW_BLOCK_MAX in the backward) live in
  registers: `softmax_forward_rows_kernel` loads a block of ROWS rows once, takes each row's
  max, exp and sum, and writes y (2MN elements of traffic, the minimum);
  `softmax_backward_rows_kernel` loads y and dy once, sums dy*y per row and writes dx (3MN).
* longer rows (up to 262144 and beyond) do not fit: `softmax_forward_looped_kernel` streams the
  row in chunks of CHUNK lanes keeping an online max and sum per lane, combines the lanes, then
  streams the row again, last chunk first (the chunks read last are the likeliest to still be
  in L2), to write y; `softmax_backward_looped_kernel` likewise sums dy*y, then writes dx.

exp(v) is computed as exp2(v * log2(e)), which the GPU runs as one approximate instruction
(ex2.approx.ftz.f32); its error is in common/README.md and in README.md's bound. Every sum is a
fixed tree (`pairwise_sum`), so the same inputs give the same bits, and README.md counts the
roundings each term meets (`forward_path`, `backward_path` export the counts).
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

from reference import SoftmaxModule, as_rows, check_backward, check_forward
from torch_impl import autograd_function, traceable_softmax

# The longest row held in registers: 32768 elements over 32 warps is 32 float32 values per
# thread. Longer rows stream through CHUNK lanes twice.
ROW_BLOCK_MAX = 32768
BACKWARD_ROW_BLOCK_MAX = 16384  # y and dy both in registers: 32768 would spill
CHUNK = 4096
CHUNK_WARPS = 8
# A program of the rows kernels handles at least this many elements (several short rows), and
# gives each thread about ELEMS_PER_THREAD of them: 2 to 4 16-byte loads in flight per operand.
# The forward, which holds one operand, takes twice as many a thread on half the warps: at
# bf16 16384, 32 warps left an SM one program (66.8% of copy on an H100) where 16 warps fit
# two (100.7%; README.md, tuning log).
PROGRAM_ELEMS_MIN = 2048
ELEMS_PER_THREAD = 16
FORWARD_ELEMS_PER_THREAD = 32


@triton.jit
def pairwise_sum(values, LEVELS: tl.constexpr):
    """The sums of the rows of a [ROWS, 2**LEVELS] float32 block: add neighbours in pairs,
    LEVELS times, so each value passes through exactly LEVELS additions on the GPU and in the
    interpreter alike (tl.sum of a whole row would leave the tree to the compiler)."""
    for _ in tl.static_range(LEVELS):
        values = tl.sum(tl.reshape(values, [values.shape[0], values.shape[1] // 2, 2]), axis=2)
    return tl.sum(values, axis=1)  # one value per row is left: this adds nothing


@triton.jit
def exp_shifted(x, shift):
    """exp(x - shift) as exp2((x - shift) * log2 e): subtract first, so the argument is exact
    up to a rounding relative to |x - shift| (with 1e4-sized logits, x*log2e - shift*log2e
    would carry an absolute error of 1e4 * 2**-24 into every term). log2 e is a literal, rounded
    to float32, not a global: `launch` sends a kernel that reads globals through Triton's path."""
    return tl.exp2((x - shift) * 1.4426950408889634)


@triton.jit
def finite_shift(row_max):
    """The shift for exp: the row max, or 0 where the max is -inf (a row of -inf): then every
    exp(-inf - 0) is 0, the sum is 0, and y = 0 * (1 / 0) is NaN, as the definition says."""
    return tl.where(row_max == float("-inf"), 0.0, row_max)


@triton.jit
def softmax_forward_rows_kernel(
    x_ptr, y_ptr, m, n, stride_xm, stride_xn, stride_ym, stride_yn,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # 64-bit row offsets
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask = (offs_m[:, None] < m) & (offs_n[None, :] < n)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn
    # Lanes past n read -inf: exp(-inf) = 0 adds exactly nothing.
    x = tl.load(x_ptrs, mask=mask, other=float("-inf")).to(tl.float32)
    shift = finite_shift(tl.max(x, axis=1))
    e = exp_shifted(x, shift[:, None])
    # One correctly rounded reciprocal per row (div.rn), then one multiply per element.
    inverse = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), pairwise_sum(e, LOG2_BLOCK_N))
    y = e * inverse[:, None]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_forward_looped_kernel(
    x_ptr, y_ptr, n, stride_xm, stride_xn, stride_ym, stride_yn,
    CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * stride_xm, y_ptr + row * stride_ym
    offs = tl.arange(0, CHUNK).to(tl.int64)
    chunks = tl.cdiv(n, CHUNK)
    # Pass 1: lane j keeps the max and the sum of exp(x - max) of the elements it has seen;
    # a new max rescales the lane's sum by exp(old max - new max).
    lane_max = tl.full([CHUNK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([CHUNK], tl.float32)
    for chunk in range(0, chunks):
        cols = chunk * CHUNK + offs
        x = tl.load(x_row + cols * stride_xn, mask=cols < n, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        shift = finite_shift(new_max)
        lane_sum = lane_sum * exp_shifted(lane_max, shift) + exp_shifted(x, shift)
        lane_max = new_max
    shift = finite_shift(tl.max(lane_max, axis=0))
    rescaled = lane_sum * exp_shifted(lane_max, shift)
    inverse = tl.math.div_rn(1.0, tl.sum(pairwise_sum(rescaled[None, :], LOG2_CHUNK), axis=0))
    # Pass 2, last chunk first: those were read most recently and may still be in L2.
    for back in range(0, chunks):
        cols = (chunks - 1 - back) * CHUNK + offs
        x = tl.load(x_row + cols * stride_xn, mask=cols < n, other=float("-inf")).to(tl.float32)
        y = exp_shifted(x, shift) * inverse
        tl.store(y_row + cols * stride_yn, y.to(y_ptr.dtype.element_ty), mask=cols < n)


@triton.jit
def softmax_backward_rows_kernel(
    y_ptr, dy_ptr, dx_ptr, m, n, stride_ym, stride_yn, stride_dym, stride_dyn,
    stride_dxm, stride_dxn, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask = (offs_m[:, None] < m) & (offs_n[None, :] < n)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    dy_ptrs = dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :] * stride_dyn
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
    dot = pairwise_sum(dy * y, LOG2_BLOCK_N)
    dx = y * (dy - dot[:, None])
    dx_ptrs = dx_ptr + offs_m[:, None] * stride_dxm + offs_n[None, :] * stride_dxn
    tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_backward_looped_kernel(
    y_ptr, dy_ptr, dx_ptr, n, stride_ym, stride_yn, stride_dym, stride_dyn, stride_dxm,
    stride_dxn, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    y_row, dy_row = y_ptr + row * stride_ym, dy_ptr + row * stride_dym
    dx_row = dx_ptr + row * stride_dxm
    offs = tl.arange(0, CHUNK).to(tl.int64)
    chunks = tl.cdiv(n, CHUNK)
    lanes = tl.zeros([CHUNK], tl.float32)  # lane j sums dy*y over its elements, chunk by chunk
    for chunk in range(0, chunks):
        cols = chunk * CHUNK + offs
        y = tl.load(y_row + cols * stride_yn, mask=cols < n, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols * stride_dyn, mask=cols < n, other=0.0).to(tl.float32)
        lanes += dy * y
    dot = tl.sum(pairwise_sum(lanes[None, :], LOG2_CHUNK), axis=0)
    for back in range(0, chunks):  # last chunk first, as in the forward
        cols = (chunks - 1 - back) * CHUNK + offs
        y = tl.load(y_row + cols * stride_yn, mask=cols < n, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols * stride_dyn, mask=cols < n, other=0.0).to(tl.float32)
        dx = y * (dy - dot)
        tl.store(dx_row + cols * stride_dxn, dx.to(dx_ptr.dtype.element_ty), mask=cols < n)


# Read once: test.py sets it before importing Triton, and the launcher should not pay for a look-up.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def patch_triton_interpreter():
    """Make Triton 3.6's CPU interpreter compute what the GPU computes (see dot/triton_impl.py):
    numpy 2.4 refuses int() of a one-element array, which .item() does, and the interpreter's
    float32 <-> bfloat16 conversions truncate, which torch's exact conversions replace."""
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


def on_device_of(t):
    """Launch context for t: its GPU made current when it is not (the CPU under the interpreter)."""
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


@functools.cache
def rows_launch(m, n, block_max, elems_per_thread=ELEMS_PER_THREAD):
    """(grid, constants) of the rows kernels, None past block_max: BLOCK_N is n's next power
    of two, ROWS packs short rows (never more than m) so a program has PROGRAM_ELEMS_MIN
    elements, and elems_per_thread sets the warps. Cached: a model calls a few shapes over and
    over, and the constants are a dict `launch` only reads."""
    block_n = 1 << (n - 1).bit_length()
    if block_n > block_max:
        return None
    rows = min(max(PROGRAM_ELEMS_MIN // block_n, 1), 1 << (m - 1).bit_length())
    num_warps = min(max(rows * block_n // (32 * elems_per_thread), 4), 32)
    constants = {"ROWS": rows, "BLOCK_N": block_n, "LOG2_BLOCK_N": block_n.bit_length() - 1}
    return ((m + rows - 1) // rows,), {**constants, "num_warps": num_warps}


def looped_constants():
    """The looped kernels' constants (rows this long run for tens of microseconds: a dict a
    call costs nothing that shows)."""
    return {"CHUNK": CHUNK, "LOG2_CHUNK": CHUNK.bit_length() - 1, "num_warps": CHUNK_WARPS}


def forward_path(n, dtype):
    """(dtype: the same counts for every dtype here; CuTe's tile depends on it.)
    What README.md's bound counts on a term's way into the row sum: (exp2 evaluations,
    float32 roundings after the exp). Rows kernel: one exp, then log2(BLOCK_N) tree levels.
    Looped: its own exp, a rescale per later chunk and one at the lane combine; per later
    chunk a multiply and an add, the combine's multiply, then log2(CHUNK) levels."""
    block_n = 1 << (n - 1).bit_length()
    if block_n <= ROW_BLOCK_MAX:
        return 1, block_n.bit_length() - 1
    chunks = -(-n // CHUNK)
    return chunks + 1, 2 * (chunks - 1) + 1 + CHUNK.bit_length() - 1


def backward_path(n, dtype):
    """Additions on a product dy_j*y_j's way into the row's dot (the product's own rounding is
    counted by the bound): log2(BLOCK_N) tree levels, or one per later chunk plus log2(CHUNK)."""
    block_n = 1 << (n - 1).bit_length()
    if block_n <= BACKWARD_ROW_BLOCK_MAX:
        return block_n.bit_length() - 1
    return -(-n // CHUNK) - 1 + CHUNK.bit_length() - 1


def softmax_forward(x, y):
    check_forward(x, y)
    device = on_device_of(x)
    if x.numel() == 0:
        return y
    (x_rows, _), (y_rows, copied) = as_rows(x), as_rows(y, for_output=True)
    (m, n), layout = x_rows.shape, (*x_rows.stride(), *y_rows.stride())
    rows = rows_launch(m, n, ROW_BLOCK_MAX, FORWARD_ELEMS_PER_THREAD)
    with device:
        if rows is not None:
            ints = (m, n, *layout)
            kernel, (grid, constants) = softmax_forward_rows_kernel, rows
        else:
            ints = (n, *layout)
            kernel, grid, constants = softmax_forward_looped_kernel, (m,), looped_constants()
        tensors = (x_rows, y_rows)
        launch(kernel, grid, (*tensors, *ints), constants, specialisation(ints, tensors))
    if copied:
        y.copy_(y_rows.view(y.shape))
    return y


def softmax_backward(y, dy, dx):
    check_backward(y, dy, dx)
    device = on_device_of(y)
    if y.numel() == 0:
        return dx
    (y_rows, _), (dy_rows, _) = as_rows(y), as_rows(dy)
    dx_rows, copied = as_rows(dx, for_output=True)
    (m, n), layout = y_rows.shape, (*y_rows.stride(), *dy_rows.stride(), *dx_rows.stride())
    rows = rows_launch(m, n, BACKWARD_ROW_BLOCK_MAX)
    with device:
        if rows is not None:
            ints = (m, n, *layout)
            kernel, (grid, constants) = softmax_backward_rows_kernel, rows
        else:
            ints = (n, *layout)
            kernel, grid, constants = softmax_backward_looped_kernel, (m,), looped_constants()
        tensors = (y_rows, dy_rows, dx_rows)
        launch(kernel, grid, (*tensors, *ints), constants, specialisation(ints, tensors))
    if copied:
        dx.copy_(dx_rows.view(dx.shape))
    return dx


SoftmaxFunction = autograd_function(softmax_forward, softmax_backward)
softmax = traceable_softmax("triton", softmax_forward, softmax_backward, SoftmaxFunction)


class Softmax(SoftmaxModule):
    """Drop-in for torch.nn.Softmax(dim), on this file's softmax."""

    last_dim_softmax = staticmethod(softmax)
