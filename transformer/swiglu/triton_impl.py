"""SwiGLU forward and backward as Triton kernels: one elementwise kernel per pass.

    s = 1 / (1 + exp(-g))     y = g * s * u
    dg = dy * u * s * (1 + g * (1 - s))     du = dy * (g * s)     (s recomputed, not saved)

Each program owns a tile of ROWS x BLOCK_N elements of the (M, N) rows (`TILES`, per pass and
dtype): the forward reads g and u and writes y (3MN elements, the minimum), the backward reads
g, u and dy and writes dg and du (5MN). The fused gate-up tensor is two strided views of one
(M, 2N) matrix, so the same kernels serve both forms.

tl.exp compiles to ex2.approx of `-g * log2 e` (two roundings of the argument: log2 e to
float32, the product; `EXP_ARGUMENT_ROUNDINGS`, which README.md's bound uses with
common/README.md's ex2 figure); the reciprocal is div.rn, correctly rounded.
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

from reference import as_rows, check_backward, check_forward, halves
from torch_impl import model_plumbing

# (tile elements, warps) of a program, per pass and element size; bench.py --tiles times others
# beside them. 2048 over 4 warps (16 values a thread) was the best or level with the best in
# every pass, dtype and size of the H200 sweep (README.md, tuning log). Short rows pack several
# to a tile.
TILES = {
    ("forward", 2): (2048, 4),
    ("forward", 4): (2048, 4),
    ("backward", 2): (2048, 4),
    ("backward", 4): (2048, 4),
}
EXP_ARGUMENT_ROUNDINGS = 2


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
def sigmoid(g):
    """1 / (1 + exp(-g)): exp(-g) = ex2.approx(-g * log2 e), then add and div.rn. g = -inf
    gives 1 / inf = 0, g = +inf 1 / 1 = 1, NaN stays NaN."""
    return tl.math.div_rn(1.0, 1.0 + tl.exp(-g))


@triton.jit
def tile_offsets(m, n, tiles_n, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows and columns (64-bit: M N may pass 2**31) and their mask. One grid
    dimension: the second is capped at 65535 programs, which a long batch of rows would pass."""
    tile = tl.program_id(0)
    offs_m = (tile // tiles_n).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs_n = (tile % tiles_n).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, (offs_m[:, None] < m) & (offs_n[None, :] < n)


@triton.jit
def swiglu_forward_kernel(
    g_ptr, u_ptr, y_ptr, m, n, tiles_n, stride_gm, stride_gn, stride_um, stride_un, stride_ym,
    stride_yn, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, mask = tile_offsets(m, n, tiles_n, ROWS, BLOCK_N)
    g = load_block(g_ptr, offs_m, offs_n, stride_gm, stride_gn, mask)
    u = load_block(u_ptr, offs_m, offs_n, stride_um, stride_un, mask)
    store_block(y_ptr, offs_m, offs_n, stride_ym, stride_yn, mask, g * sigmoid(g) * u)


@triton.jit
def swiglu_backward_kernel(
    g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, m, n, tiles_n, stride_gm, stride_gn, stride_um,
    stride_un, stride_dym, stride_dyn, stride_dgm, stride_dgn, stride_dum, stride_dun,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, mask = tile_offsets(m, n, tiles_n, ROWS, BLOCK_N)
    g = load_block(g_ptr, offs_m, offs_n, stride_gm, stride_gn, mask)
    u = load_block(u_ptr, offs_m, offs_n, stride_um, stride_un, mask)
    dy = load_block(dy_ptr, offs_m, offs_n, stride_dym, stride_dyn, mask)
    s = sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    store_block(dg_ptr, offs_m, offs_n, stride_dgm, stride_dgn, mask, dg)
    store_block(du_ptr, offs_m, offs_n, stride_dum, stride_dun, mask, dy * (g * s))


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
def tile_of(m, n, tile_elems):
    """(ROWS, BLOCK_N, tiles along N): BLOCK_N covers n up to tile_elems, short rows are
    packed ROWS to a tile (never more rows than m needs)."""
    block_n = min(1 << (n - 1).bit_length(), tile_elems)
    rows = min(tile_elems // block_n, 1 << (m - 1).bit_length())
    return rows, block_n, -(-n // block_n)


@functools.cache
def launch_grid(m, n, tile):
    """(grid, tiles along N, constants) of a kernel with tile = (elements, warps). Cached: a
    model calls a few shapes over and over, and the constants are a dict `launch` only reads."""
    tile_elems, num_warps = tile
    rows, block_n, tiles_n = tile_of(m, n, tile_elems)
    constants = {"ROWS": rows, "BLOCK_N": block_n, "num_warps": num_warps}
    return (-(-m // rows) * tiles_n,), tiles_n, constants


def rows_of(t, for_output=False):
    """(t as (M, N) rows, copied, its two strides)."""
    rows, copied = as_rows(t, for_output)
    return rows, copied, rows.stride()


def swiglu_forward(g, u, y):
    check_forward(g, u, y)
    device = on_device_of(g)
    if y.numel() == 0:
        return y
    gate, up = halves(g) if u is None else (g, u)
    (g_rows, _, g_strides), (u_rows, _, u_strides) = rows_of(gate), rows_of(up)
    y_rows, y_copied, y_strides = rows_of(y, True)
    tile = TILES["forward", g.element_size()]
    (m, n), (grid, tiles_n, meta) = g_rows.shape, launch_grid(*g_rows.shape, tile)
    tensors, ints = (g_rows, u_rows, y_rows), (m, n, tiles_n, *g_strides, *u_strides, *y_strides)
    with device:
        launch(swiglu_forward_kernel, grid, (*tensors, *ints), meta, specialisation(ints, tensors))
    if y_copied:
        y.copy_(y_rows.view(y.shape))
    return y


def swiglu_backward(g, u, dy, dg, du=None):
    check_backward(g, u, dy, dg, du)
    device = on_device_of(g)
    if dy.numel() == 0:
        return dg, du
    gate, up = halves(g) if u is None else (g, u)
    d_gate, d_up = halves(dg) if u is None else (dg, du)
    (g_rows, _, g_strides), (u_rows, _, u_strides) = rows_of(gate), rows_of(up)
    dy_rows, _, dy_strides = rows_of(dy)
    dg_rows, dg_copied, dg_strides = rows_of(d_gate, True)
    du_rows, du_copied, du_strides = rows_of(d_up, True)
    tile = TILES["backward", g.element_size()]
    (m, n), (grid, tiles_n, meta) = g_rows.shape, launch_grid(*g_rows.shape, tile)
    tensors = (g_rows, u_rows, dy_rows, dg_rows, du_rows)
    ints = (m, n, tiles_n, *g_strides, *u_strides, *dy_strides, *dg_strides, *du_strides)
    with device:
        launch(swiglu_backward_kernel, grid, (*tensors, *ints), meta, specialisation(ints, tensors))
    for copied, target, source in ((dg_copied, d_gate, dg_rows), (du_copied, d_up, du_rows)):
        if copied:
            target.copy_(source.view(target.shape))
    return dg, du


_plumbing = model_plumbing("triton", swiglu_forward, swiglu_backward)
SwiGLUFunction, swiglu, SwiGLU = _plumbing.SwiGLUFunction, _plumbing.swiglu, _plumbing.SwiGLU
