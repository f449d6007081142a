"""geru, A = A + alpha * x * y^T, in Triton: README.md, "The mapping onto the GPU",
triton_impl.py.

TILE_CONTIGUOUS_BYTES, TILE_ACROSS, NUM_WARPS   the tile: 1 KiB along A's contiguous
                                                dimension, 8 lines across it
update_tile, geru_kernel     one program per tile: a + (alpha x_i) y_j in float32, one store
patch_triton_interpreter     Triton 3.6's CPU interpreter under numpy 2.4 (TRITON_INTERPRET=1)
TILES, tile_shape            the tile turned to follow reference.fastest_dim(A)
ptx_of                       the sm_90 PTX, compiled on the CPU, that test.py reads
geru                         the launcher
"""

import contextlib
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.knobs import HookChain
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from reference import check_operands, fastest_dim, to_float32

# The tile: 1 KiB along the contiguous dimension (64 threads of one 16-byte vector), 8 lines
# across it; 8 KiB over 8 warps is two vectors a thread, so x and y are reloaded once per 8 KiB
# (README.md, "Tuning log").
TILE_CONTIGUOUS_BYTES = 1024
TILE_ACROSS = 8
NUM_WARPS = 8


@triton.jit
def update_tile(a_ptrs, alpha_x, y, in_tile):
    """a <- a + alpha_x[i] * y[j] on one tile, rounded once at the store; in_tile None: all."""
    a = tl.load(a_ptrs, mask=in_tile).to(tl.float32)
    result = a + alpha_x[:, None] * y[None, :]
    tl.store(a_ptrs, result.to(a_ptrs.dtype.element_ty), mask=in_tile)


@triton.jit
def is_whole_tile(tile_m, tile_n, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """True when tile (tile_m, tile_n) of BLOCK_M x BLOCK_N lies wholly inside the m x n A. In
    64 bits: the end of the tile that ends at row 2**31 is 2**31, which 32 bits wrap to -2**31."""
    whole_m = (tile_m.to(tl.int64) + 1) * BLOCK_M <= m
    return whole_m & ((tile_n.to(tl.int64) + 1) * BLOCK_N <= n)


@triton.jit
def geru_kernel(
    x_ptr, y_ptr, a_ptr, m, n, stride_x, stride_y, stride_am, stride_an, alpha, tiles_along,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS_CONTIGUOUS: tl.constexpr,
):  # fmt: skip
    # Neighbouring programs take neighbouring tiles along the contiguous dimension (tiles_along
    # of them per row of tiles), so the programs resident at any moment sweep A in address
    # order, as a copy would.
    pid = tl.program_id(0)
    tile_along, tile_across = pid % tiles_along, pid // tiles_along
    if ROWS_CONTIGUOUS:
        tile_m, tile_n = tile_across, tile_along
    else:
        tile_m, tile_n = tile_along, tile_across
    # 64-bit offsets: A may hold 2**31 elements or more.
    offs_m = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = offs_m < m, offs_n < n
    # float32 arithmetic for every dtype (the interpreter also mishandles bf16 arithmetic).
    alpha_x = alpha * tl.load(x_ptr + offs_m * stride_x, mask=in_m).to(tl.float32)
    y = tl.load(y_ptr + offs_n * stride_y, mask=in_n).to(tl.float32)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_n[None, :] * stride_an
    # Tiles inside A go without a mask: Triton vectorises a masked access only as far as it can
    # prove the mask constant, and `offs_n < n` is not when n is not a multiple of 16, even
    # where the rows themselves are 16-byte aligned (a slice A = B[:, :1001] of an aligned B).
    if is_whole_tile(tile_m, tile_n, m, n, BLOCK_M, BLOCK_N):
        update_tile(a_ptrs, alpha_x, y, None)
    else:
        update_tile(a_ptrs, alpha_x, y, in_m[:, None] & in_n[None, :])


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


# (BLOCK_M, BLOCK_N, rows contiguous) by (dtype, rows contiguous), worked out once.
TILES = {
    (dtype, rows_contiguous): (
        (TILE_ACROSS, TILE_CONTIGUOUS_BYTES // dtype.itemsize, True)
        if rows_contiguous
        else (TILE_CONTIGUOUS_BYTES // dtype.itemsize, TILE_ACROSS, False)
    )
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for rows_contiguous in (True, False)
}


def tile_shape(A):
    """(BLOCK_M, BLOCK_N, rows contiguous): the tile with its long side along fastest_dim(A)."""
    return TILES[A.dtype, fastest_dim(A) == 1]


def ptx_of(dtype, rows_contiguous, sizes_divisible_by_16=True):
    """The PTX for sm_90 (H200) of the kernel as the launcher specialises it for a contiguous
    x, y and an A with a unit stride along its rows (rows_contiguous) or columns, its address
    and other stride multiples of 16, and m, n multiples of 16 or not. Triton compiles without a
    GPU; under TRITON_INTERPRET=1 @triton.jit gives interpreted functions, which cannot be."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    element = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    long_side = TILE_CONTIGUOUS_BYTES // dtype.itemsize
    if rows_contiguous:
        block_m, block_n, unit, pitch = TILE_ACROSS, long_side, "stride_an", "stride_am"
    else:
        block_m, block_n, unit, pitch = long_side, TILE_ACROSS, "stride_am", "stride_an"
    names = list(geru_kernel.arg_names)
    signature = dict.fromkeys(names, "constexpr")
    signature.update(x_ptr=f"*{element}", y_ptr=f"*{element}", a_ptr=f"*{element}")
    signature.update(m="i32", n="i32", alpha="fp32", tiles_along="i32", **{pitch: "i32"})
    constexprs = {"stride_x": 1, "stride_y": 1, unit: 1, "BLOCK_M": block_m, "BLOCK_N": block_n}
    constexprs["ROWS_CONTIGUOUS"] = rows_contiguous
    divisible = ["x_ptr", "y_ptr", "a_ptr", pitch] + (["m", "n"] if sizes_divisible_by_16 else [])
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(geru_kernel, signature, constexprs, attrs)
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(source, target=target, options={"num_warps": NUM_WARPS}).asm["ptx"]


def geru(alpha, x, y, A):
    check_operands(alpha, x, y, A)
    device = on_device_of(A)
    alpha32 = to_float32(float(alpha))
    m, n = A.shape
    if alpha32 == 0.0 or m == 0 or n == 0:  # alpha == 0: x and y are not read, A not written
        return A
    block_m, block_n, rows_contiguous = tile_shape(A)
    # Plain integer ceilings: triton.cdiv is a constexpr function, ~2 us a call on the host.
    tiles_m, tiles_n = (m + block_m - 1) // block_m, (n + block_n - 1) // block_n
    tiles_along = tiles_n if rows_contiguous else tiles_m
    with device:
        sizes_and_strides = (m, n, x.stride(0), y.stride(0), *A.stride())
        constants = {"BLOCK_M": block_m, "BLOCK_N": block_n, "ROWS_CONTIGUOUS": rows_contiguous,
                     "num_warps": NUM_WARPS}  # fmt: skip
        launch(
            geru_kernel, (tiles_m * tiles_n,), (x, y, A, *sizes_and_strides, alpha32, tiles_along),
            constants, specialisation((*sizes_and_strides, tiles_along), (x, y, A)),
        )  # fmt: skip
    return A
