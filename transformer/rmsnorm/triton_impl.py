"""RMSNorm forward and backward as Triton kernels, one program per row (or several short rows).

    rstd = 1 / sqrt(mean(h**2) + eps)     y = h * rstd * w     (h = x, or x + residual stored)
    dx = rstd (g - xhat * mean(g * xhat))  (+ dresidual_out)   g = dy * w, xhat = h * rstd
    dweight = sum over rows of dy * xhat

Kernels, by row length N (README.md, "Triton"):

* forward, N <= ROW_BLOCK_MAX: `rmsnorm_forward_rows_kernel` holds a block of ROWS rows in
  registers: one read of x (and residual), one write of y (and h): the minimal traffic.
  Longer rows: `rmsnorm_forward_looped_kernel` streams the row twice in chunks of CHUNK lanes
  (sum of squares, then y, last chunk first: the chunks read last are likeliest still in L2).
* backward, N <= BACKWARD_ROW_BLOCK_MAX: `rmsnorm_backward_rows_kernel`, one program per group
  of rows, each row in registers once (3MN), the group's dweight summed in a float32 register
  row and written as one row of `partials`; 16-bit rows on up to 16 warps are loaded a step
  ahead (PREFETCH). Longer rows: `rmsnorm_row_dots_kernel` (the row's mean(g * xhat),
  streamed) then `rmsnorm_backward_columns_kernel` (a program per group of rows and chunk of
  columns: dx, and that chunk's dweight partial).
* `sum_partials_kernel` adds the partials in a fixed pairwise tree: dweight has the same bits
  on every run (no atomics), and README.md counts its roundings (`dweight_path`).

rsqrt compiles to rsqrt.approx (its error is in common/README.md); mean = sum / N is div.rn.
Every row sum is a fixed tree (`pairwise_sum`); `forward_path`, `backward_path` and
`dweight_path` export the counts README.md's bounds use.
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

from reference import as_rows, check_backward, check_forward
from torch_impl import model_plumbing

# The longest row held in registers: 32768 elements over 32 warps is 32 float32 values per
# thread. The backward holds x, dy and the dweight row: 16384 keeps them at 16 values each.
ROW_BLOCK_MAX = 32768
BACKWARD_ROW_BLOCK_MAX = 16384
CHUNK = 4096
CHUNK_WARPS = 8
# A program of the rows kernels handles at least this many elements (several short rows), and
# gives each thread about ELEMS_PER_THREAD of them: 2 to 4 16-byte loads in flight per operand.
PROGRAM_ELEMS_MIN = 2048
ELEMS_PER_THREAD = 16
# dweight partials: at most GROUPS_MAX groups of rows (about four programs per H200 SM, fixed
# by the shape alone so that the tree, and the bits, do not depend on the device); on the
# columns path GROUPS_MAX programs per CHUNK columns, which caps partials at GROUPS_MAX * CHUNK.
GROUPS_MAX = 512
SUM_BLOCK_N = 32  # columns per program of sum_partials_kernel


@triton.jit
def pairwise_sum(values, LEVELS: tl.constexpr):
    """The sums of the rows of a [ROWS, 2**LEVELS] float32 block: add neighbours in pairs,
    LEVELS times, so each value passes through exactly LEVELS additions on the GPU and in the
    interpreter alike (tl.sum of a whole row would leave the tree to the compiler)."""
    for _ in tl.static_range(LEVELS):
        values = tl.sum(tl.reshape(values, [values.shape[0], values.shape[1] // 2, 2]), axis=2)
    return tl.sum(values, axis=1)  # one value per row is left: this adds nothing


@triton.jit
def load_block(ptr, offs_m, offs_n, stride_m, stride_n, mask):
    """The [len(offs_m), len(offs_n)] block at ptr, widened to float32; 0 where masked."""
    ptrs = ptr + offs_m[:, None] * stride_m + offs_n[None, :] * stride_n
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_block(ptr, offs_m, offs_n, stride_m, stride_n, mask, values):
    """values rounded to ptr's dtype (round to nearest even) and stored where mask holds."""
    ptrs = ptr + offs_m[:, None] * stride_m + offs_n[None, :] * stride_n
    tl.store(ptrs, values.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def residual_stream(
    x_ptr, res_ptr, h_ptr, offs_m, offs_n, mask, stride_xm, stride_xn, stride_rm, stride_rn,
    stride_hm, stride_hn, FUSED: tl.constexpr,
):  # fmt: skip
    """The normalised input in float32: x, or h = x + residual rounded once to x's dtype and
    stored as the new residual stream (the float32 sum of two 16-bit values is exact or
    rounds below their half-ulp, so this is the correctly rounded sum)."""
    x = load_block(x_ptr, offs_m, offs_n, stride_xm, stride_xn, mask)
    if FUSED:
        h = (x + load_block(res_ptr, offs_m, offs_n, stride_rm, stride_rn, mask)).to(
            h_ptr.dtype.element_ty
        )
        store_block(h_ptr, offs_m, offs_n, stride_hm, stride_hn, mask, h)
        x = h.to(tl.float32)
    return x


@triton.jit
def row_mean(total, n):
    """total / n, div.rn. tl.cast, not n.to: Triton compiles an int argument equal to 1 in as
    the constant 1 (a constexpr, which has no .to), so n = 1 arrives here as a constant."""
    return tl.math.div_rn(total, tl.cast(n, tl.float32))


@triton.jit
def row_rstd(sum_of_squares, n, eps):
    """1 / sqrt(sum / n + eps): div.rn, one add, rsqrt.approx."""
    return tl.math.rsqrt(row_mean(sum_of_squares, n) + eps)


@triton.jit
def rmsnorm_forward_rows_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, rstd_ptr, h_ptr, m, n, eps, stride_xm, stride_xn, stride_rm,
    stride_rn, stride_w, stride_ym, stride_yn, stride_hm, stride_hn, stride_rstd,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_BLOCK_N: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # 64-bit row offsets
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask = (offs_m[:, None] < m) & (offs_n[None, :] < n)
    h = residual_stream(x_ptr, res_ptr, h_ptr, offs_m, offs_n, mask, stride_xm, stride_xn,
                        stride_rm, stride_rn, stride_hm, stride_hn, FUSED)  # fmt: skip
    rstd = row_rstd(pairwise_sum(h * h, LOG2_BLOCK_N), n, eps)  # lanes past n add 0 * 0
    tl.store(rstd_ptr + offs_m * stride_rstd, rstd, mask=offs_m < m)
    w = tl.load(w_ptr + offs_n * stride_w, mask=offs_n < n, other=0.0).to(tl.float32)
    store_block(y_ptr, offs_m, offs_n, stride_ym, stride_yn, mask, h * rstd[:, None] * w[None, :])


@triton.jit
def rmsnorm_forward_looped_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, rstd_ptr, h_ptr, n, eps, stride_xm, stride_xn, stride_rm,
    stride_rn, stride_w, stride_ym, stride_yn, stride_hm, stride_hn, stride_rstd,
    CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # a block of one row
    offs = tl.arange(0, CHUNK).to(tl.int64)
    chunks = tl.cdiv(n, CHUNK)
    lanes = tl.zeros([1, CHUNK], tl.float32)  # lane j sums the squares of its elements
    for chunk in range(0, chunks):
        cols = chunk * CHUNK + offs
        mask = cols[None, :] < n
        h = residual_stream(x_ptr, res_ptr, h_ptr, offs_m, cols, mask, stride_xm, stride_xn,
                            stride_rm, stride_rn, stride_hm, stride_hn, FUSED)  # fmt: skip
        lanes += h * h
    rstd = row_rstd(pairwise_sum(lanes, LOG2_CHUNK), n, eps)
    tl.store(rstd_ptr + offs_m * stride_rstd, rstd)
    # Pass 2, last chunk first; the stream is read back from h when fused.
    source_ptr = h_ptr if FUSED else x_ptr
    stride_sm = stride_hm if FUSED else stride_xm
    stride_sn = stride_hn if FUSED else stride_xn
    for back in range(0, chunks):
        cols = (chunks - 1 - back) * CHUNK + offs
        mask = cols[None, :] < n
        h = load_block(source_ptr, offs_m, cols, stride_sm, stride_sn, mask)
        w = tl.load(w_ptr + cols * stride_w, mask=cols < n, other=0.0).to(tl.float32)
        store_block(y_ptr, offs_m, cols, stride_ym, stride_yn, mask, h * rstd[:, None] * w[None, :])


@triton.jit
def input_gradient(xhat, g, rstd, mean_dot, dres_ptr, offs_m, offs_n, mask, stride_dm,
                   stride_dn, FUSED: tl.constexpr):  # fmt: skip
    """dx = rstd (g - xhat * mean(g xhat)), plus the residual stream's gradient when fused."""
    dx = rstd[:, None] * (g - xhat * mean_dot[:, None])
    if FUSED:
        dx += load_block(dres_ptr, offs_m, offs_n, stride_dm, stride_dn, mask)
    return dx


@triton.jit
def load_step(x_ptr, dy_ptr, offs_m, offs_n, end, n, stride_xm, stride_xn, stride_dym, stride_dyn):
    """x and dy of the rows offs_m (those before `end`) in their own dtype: 16-bit values stay
    packed two to a register until they are used (load_block widens them at once)."""
    mask = (offs_m[:, None] < end) & (offs_n[None, :] < n)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask,
                other=0.0)  # fmt: skip
    dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :] * stride_dyn,
                 mask=mask, other=0.0)  # fmt: skip
    return x, dy


@triton.jit
def rmsnorm_backward_rows_kernel(
    x_ptr, w_ptr, rstd_ptr, dy_ptr, dres_ptr, dx_ptr, partials_ptr, m, n, rows_per_group,
    stride_xm, stride_xn, stride_w, stride_rstd, stride_dym, stride_dyn, stride_dm, stride_dn,
    stride_dxm, stride_dxn, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    LOG2_BLOCK_N: tl.constexpr, FUSED: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    w = tl.load(w_ptr + offs_n * stride_w, mask=offs_n < n, other=0.0).to(tl.float32)
    dweight = tl.zeros([BLOCK_N], tl.float32)  # this group's sum of dy * xhat, column by column
    if PREFETCH:
        end = tl.minimum(group * rows_per_group + rows_per_group, m)  # the group's last row + 1
        first = group * rows_per_group + tl.arange(0, ROWS)
        x_next, dy_next = load_step(x_ptr, dy_ptr, first, offs_n, end, n, stride_xm, stride_xn,
                                    stride_dym, stride_dyn)  # fmt: skip
    for step in range(0, rows_per_group, ROWS):
        offs_m = group * rows_per_group + step + tl.arange(0, ROWS)
        if PREFETCH:
            # The next step's rows are loaded before this step's row sum: they are in flight
            # while the block waits on the sum's barriers and stores dx (README.md, tuning log).
            x, dy = x_next, dy_next
            x_next, dy_next = load_step(x_ptr, dy_ptr, offs_m + ROWS, offs_n, end, n,
                                        stride_xm, stride_xn, stride_dym, stride_dyn)  # fmt: skip
        else:
            x, dy = load_step(x_ptr, dy_ptr, offs_m, offs_n, m, n, stride_xm, stride_xn,
                              stride_dym, stride_dyn)  # fmt: skip
        mask = (offs_m[:, None] < m) & (offs_n[None, :] < n)
        rstd = tl.load(rstd_ptr + offs_m * stride_rstd, mask=offs_m < m, other=0.0)
        xhat = x.to(tl.float32) * rstd[:, None]
        dy = dy.to(tl.float32)
        dweight += tl.sum(dy * xhat, axis=0)  # masked rows and columns add 0
        g = dy * w[None, :]  # dy is not needed past here: fewer registers held across the sum
        mean_dot = row_mean(pairwise_sum(g * xhat, LOG2_BLOCK_N), n)
        dx = input_gradient(xhat, g, rstd, mean_dot, dres_ptr, offs_m, offs_n, mask, stride_dm,
                            stride_dn, FUSED)  # fmt: skip
        store_block(dx_ptr, offs_m, offs_n, stride_dxm, stride_dxn, mask, dx)
    tl.store(partials_ptr + group * n + offs_n, dweight, mask=offs_n < n)


@triton.jit
def rmsnorm_row_dots_kernel(
    x_ptr, w_ptr, rstd_ptr, dy_ptr, mean_dots_ptr, n, stride_xm, stride_xn, stride_w,
    stride_rstd, stride_dym, stride_dyn, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
):  # fmt: skip
    """mean(g * xhat) of one long row, streamed in chunks (the columns kernel needs it first)."""
    offs_m = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    offs = tl.arange(0, CHUNK).to(tl.int64)
    rstd = tl.load(rstd_ptr + offs_m * stride_rstd)
    lanes = tl.zeros([1, CHUNK], tl.float32)
    for chunk in range(0, tl.cdiv(n, CHUNK)):
        cols = chunk * CHUNK + offs
        mask = cols[None, :] < n
        xhat = load_block(x_ptr, offs_m, cols, stride_xm, stride_xn, mask) * rstd[:, None]
        w = tl.load(w_ptr + cols * stride_w, mask=cols < n, other=0.0).to(tl.float32)
        lanes += load_block(dy_ptr, offs_m, cols, stride_dym, stride_dyn, mask) * w * xhat
    mean_dot = row_mean(pairwise_sum(lanes, LOG2_CHUNK), n)
    tl.store(mean_dots_ptr + offs_m, mean_dot)


@triton.jit
def rmsnorm_backward_columns_kernel(
    x_ptr, w_ptr, rstd_ptr, dy_ptr, dres_ptr, dx_ptr, mean_dots_ptr, partials_ptr, m, n,
    rows_per_group, stride_xm, stride_xn, stride_w, stride_rstd, stride_dym, stride_dyn,
    stride_dm, stride_dn, stride_dxm, stride_dxn, CHUNK: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    w = tl.load(w_ptr + cols * stride_w, mask=cols < n, other=0.0).to(tl.float32)
    dweight = tl.zeros([CHUNK], tl.float32)
    for step in range(0, rows_per_group):
        offs_m = group * rows_per_group + step + tl.arange(0, 1)
        mask = (offs_m[:, None] < m) & (cols[None, :] < n)
        rstd = tl.load(rstd_ptr + offs_m * stride_rstd, mask=offs_m < m, other=0.0)
        mean_dot = tl.load(mean_dots_ptr + offs_m, mask=offs_m < m, other=0.0)
        xhat = load_block(x_ptr, offs_m, cols, stride_xm, stride_xn, mask) * rstd[:, None]
        dy = load_block(dy_ptr, offs_m, cols, stride_dym, stride_dyn, mask)
        dx = input_gradient(xhat, dy * w[None, :], rstd, mean_dot, dres_ptr, offs_m, cols, mask,
                            stride_dm, stride_dn, FUSED)  # fmt: skip
        store_block(dx_ptr, offs_m, cols, stride_dxm, stride_dxn, mask, dx)
        dweight += tl.sum(dy * xhat, axis=0)  # one row: adds nothing
    tl.store(partials_ptr + group * n + cols, dweight, mask=cols < n)


@triton.jit
def sum_partials_kernel(
    partials_ptr, dweight_ptr, groups, n, stride_dw, GROUPS_POW2: tl.constexpr,
    LOG2_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dweight[j] = the partials of column j added in a pairwise tree over the groups (groups
    past the last read 0), rounded once to dweight's dtype."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUPS_POW2)
    mask = (cols[:, None] < n) & (offs_g[None, :] < groups)
    values = tl.load(partials_ptr + offs_g[None, :] * n + cols[:, None], mask=mask, other=0.0)
    total = pairwise_sum(values, LOG2_GROUPS)
    tl.store(dweight_ptr + cols * stride_dw, total.to(dweight_ptr.dtype.element_ty), mask=cols < n)


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


def launch_with(kernel, grid, tensors, ints, constants):
    """launch() of a kernel whose parameters are its tensors, then its ints (eps apart)."""
    launch(kernel, grid, (*tensors, *ints), constants, specialisation(ints, tensors))


def log2(power_of_two):
    return power_of_two.bit_length() - 1


@functools.cache
def rows_launch(m, n, block_max):
    """(rows per program, BLOCK_N, num_warps) of the rows kernels, None past block_max:
    BLOCK_N is n's next power of two, ROWS packs short rows (never more than m needs) so a
    program has PROGRAM_ELEMS_MIN elements, and ELEMS_PER_THREAD sets the warps."""
    block_n = 1 << (n - 1).bit_length()
    if block_n > block_max:
        return None
    rows = min(max(PROGRAM_ELEMS_MIN // block_n, 1), 1 << (m - 1).bit_length())
    num_warps = min(max(rows * block_n // (32 * ELEMS_PER_THREAD), 4), 32)
    return rows, block_n, num_warps


@functools.cache
def groups_of(m, n):
    """(rows per group, groups) of the backward: rows in blocks of ROWS on the rows path (one
    on the columns path), at most GROUPS_MAX groups, or GROUPS_MAX per CHUNK columns."""
    tile = rows_launch(m, n, BACKWARD_ROW_BLOCK_MAX)
    rows = tile[0] if tile else 1
    groups_max = GROUPS_MAX if tile else max(GROUPS_MAX // -(-n // CHUNK), 1)
    blocks = -(-m // rows)
    rows_per_group = -(-blocks // min(blocks, groups_max)) * rows
    return rows_per_group, -(-m // rows_per_group)


def forward_path(n, dtype):
    """(dtype: the same counts for every dtype here.) Roundings on a square's way into
    mean(h**2): log2(BLOCK_N) tree levels, or one add per later chunk and log2(CHUNK) levels;
    then the division by n."""
    tile = rows_launch(1, n, ROW_BLOCK_MAX)
    levels = log2(tile[1]) if tile else -(-n // CHUNK) - 1 + log2(CHUNK)
    return levels + 1


def backward_path(n, dtype):
    """The same for a product g_j xhat_j's way into mean(g * xhat)."""
    tile = rows_launch(1, n, BACKWARD_ROW_BLOCK_MAX)
    levels = log2(tile[1]) if tile else -(-n // CHUNK) - 1 + log2(CHUNK)
    return levels + 1


def dweight_path(m, n, dtype):
    """Additions on a term dy xhat's way into dweight: tl.sum over ROWS rows (any order: ROWS
    - 1), the add into the group's row per step, then log2 of the padded group count."""
    rows_per_group, groups = groups_of(max(m, 1), n)
    tile = rows_launch(max(m, 1), n, BACKWARD_ROW_BLOCK_MAX)
    rows = tile[0] if tile else 1
    return rows - 1 + rows_per_group // rows + (groups - 1).bit_length()


def rows_of(t, for_output=False):
    """(t as (M, N) rows, copied) and its two strides."""
    rows, copied = as_rows(t, for_output)
    return rows, copied, rows.stride()


def rstd_rows(rstd):
    """rstd (shape x.shape[:-1]) as a vector of M entries over its own memory (or a copy)."""
    rows, copied = as_rows(rstd.unsqueeze(-1), for_output=True)
    return rows, copied, rows.stride(0)


def rmsnorm_forward(x, weight, eps, y, rstd, residual=None, residual_out=None):
    check_forward(x, weight, eps, y, rstd, residual, residual_out)
    device = on_device_of(x)
    fused = residual is not None
    outputs = (y, rstd) if not fused else (y, rstd, residual_out)
    if x.numel() == 0:
        return outputs
    x_rows, _, x_strides = rows_of(x)
    res_rows, _, res_strides = rows_of(residual) if fused else (x_rows, False, x_strides)
    h_rows, h_copied, h_strides = rows_of(residual_out, True) if fused else (x_rows, False,
                                                                             x_strides)  # fmt: skip
    y_rows, y_copied, y_strides = rows_of(y, True)
    rstd_vec, rstd_copied, rstd_stride = rstd_rows(rstd)
    (m, n), tile = x_rows.shape, rows_launch(*x_rows.shape, ROW_BLOCK_MAX)
    tensors = (x_rows, res_rows, weight, y_rows, rstd_vec, h_rows)
    strides = (*x_strides, *res_strides, weight.stride(0), *y_strides, *h_strides, rstd_stride)
    if tile is not None:
        rows, block_n, num_warps = tile
        kernel, grid, sizes = rmsnorm_forward_rows_kernel, (-(-m // rows),), (m, n)
        constants = {"ROWS": rows, "BLOCK_N": block_n, "LOG2_BLOCK_N": log2(block_n)}
    else:
        kernel, grid, sizes, num_warps = rmsnorm_forward_looped_kernel, (m,), (n,), CHUNK_WARPS
        constants = {"CHUNK": CHUNK, "LOG2_CHUNK": log2(CHUNK)}
    # float(eps): Triton would compile an int eps in as an integer (1 as a constant), which
    # specialisation() does not cover; a float is always passed as float32.
    args = (*tensors, *sizes, float(eps), *strides)
    constants = {**constants, "FUSED": fused, "num_warps": num_warps}
    with device:
        launch(kernel, grid, args, constants, specialisation((*sizes, *strides), tensors))
    for copied, target, source in ((y_copied, y, y_rows), (rstd_copied, rstd, rstd_vec),
                                   (h_copied, residual_out, h_rows)):  # fmt: skip
        if copied:
            target.copy_(source.view(target.shape))
    return outputs


def rmsnorm_backward(x, weight, rstd, dy, dx, dweight, dresidual_out=None):
    check_backward(x, weight, rstd, dy, dx, dweight, dresidual_out)
    device = on_device_of(x)
    fused = dresidual_out is not None
    if x.numel() == 0:
        dweight.zero_()  # a sum over no rows (or of rows of no elements)
        return dx, dweight
    x_rows, _, x_strides = rows_of(x)
    dy_rows, _, dy_strides = rows_of(dy)
    dres_rows, _, dres_strides = rows_of(dresidual_out) if fused else (x_rows, False, x_strides)
    dx_rows, dx_copied, dx_strides = rows_of(dx, True)
    rstd_vec, _, rstd_stride = rstd_rows(rstd)
    (m, n) = x_rows.shape
    rows_per_group, groups = groups_of(m, n)
    partials = torch.empty(groups, n, device=x.device, dtype=torch.float32)
    tile = rows_launch(m, n, BACKWARD_ROW_BLOCK_MAX)
    tensors = (x_rows, weight, rstd_vec, dy_rows, dres_rows, dx_rows)
    strides = (*x_strides, weight.stride(0), rstd_stride, *dy_strides, *dres_strides, *dx_strides)
    with device:
        if tile is not None:
            rows, block_n, num_warps = tile
            # A step ahead for 16-bit rows on at most 16 warps: 32 warps leave a thread 64
            # registers, which the prefetch spills past (bf16 16384: 120 -> 140 bytes, slower).
            prefetch = x.element_size() == 2 and num_warps <= 16
            constants = {"ROWS": rows, "BLOCK_N": block_n, "LOG2_BLOCK_N": log2(block_n),
                         "FUSED": fused, "PREFETCH": prefetch, "num_warps": num_warps}  # fmt: skip
            launch_with(
                rmsnorm_backward_rows_kernel, (groups,), (*tensors, partials),
                (m, n, rows_per_group, *strides), constants,
            )  # fmt: skip
        else:
            mean_dots = torch.empty(m, device=x.device, dtype=torch.float32)
            launch_with(
                rmsnorm_row_dots_kernel, (m,), (*tensors[:4], mean_dots), (n, *strides[:6]),
                {"CHUNK": CHUNK, "LOG2_CHUNK": log2(CHUNK), "num_warps": CHUNK_WARPS},
            )  # fmt: skip
            launch_with(
                rmsnorm_backward_columns_kernel, (groups, -(-n // CHUNK)),
                (*tensors, mean_dots, partials), (m, n, rows_per_group, *strides),
                {"CHUNK": CHUNK, "FUSED": fused, "num_warps": CHUNK_WARPS},
            )  # fmt: skip
        groups_pow2 = 1 << (groups - 1).bit_length()
        launch_with(
            sum_partials_kernel, (-(-n // SUM_BLOCK_N),), (partials, dweight),
            (groups, n, dweight.stride(0)), {"GROUPS_POW2": groups_pow2,
            "LOG2_GROUPS": log2(groups_pow2), "BLOCK_N": SUM_BLOCK_N, "num_warps": 4},
        )  # fmt: skip
    if dx_copied:
        dx.copy_(dx_rows.view(dx.shape))
    return dx, dweight


_plumbing = model_plumbing("triton", rmsnorm_forward, rmsnorm_backward)
RMSNormFunction, rmsnorm, RMSNorm = _plumbing.RMSNormFunction, _plumbing.rmsnorm, _plumbing.RMSNorm
