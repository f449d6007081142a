"""dot: z = x^T y as two Triton kernels with a fixed reduction tree.

README.md's "triton_impl.py" section explains the two passes and "The error bound" counts the
roundings on a product's way through them. In this file:

* `pairwise_sum`: the tree's building block, log2 levels of pairs, the same on the GPU and in
  the interpreter.
* `partial_dots_kernel` (pass 1): program p sums its chunk of blocks into BLOCK float32 lanes
  and folds them into partials[p]; `sum_partials_kernel` (pass 2): folds the partials into z.
* `patch_triton_interpreter`, `on_device_of`: running on CPU tensors under TRITON_INTERPRET=1.
* `split`, `roundings`: the tree's shape for n, and the bound's rounding count k(n) from it.
* `dot`: the launcher.
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

from reference import check_operands

# 2048 lanes over 8 warps: each thread owns 8 lanes, so a block is two 16-byte loads per thread
# of float32 (one of 16-bit data) for each operand, and the lanes stay in registers.
BLOCK = 2048
NUM_WARPS = 8
# The H200 has 132 SMs; four programs per SM keep enough loads in flight to stream from DRAM.
# A constant rather than the device's SM count, so the reduction tree, and with it the bits of
# z, depend only on n (README.md, tuning log: the sweep that chose it with BLOCK).
MAX_PROGRAMS = 4 * 132


@triton.jit
def pairwise_sum(values, LEVELS: tl.constexpr):
    """The sum of 2**LEVELS float32 values: add neighbours in pairs, LEVELS times, so that each
    value passes through exactly LEVELS additions, on the GPU and in the interpreter alike. A
    sum of two values is one addition however it is lowered; tl.sum of the whole block would
    leave the tree to the compiler's layout and version (and to numpy in the interpreter), and
    the error bound needs to know it."""
    for _ in tl.static_range(LEVELS):
        values = tl.sum(tl.reshape(values, [values.shape[0] // 2, 2]), axis=1)
    return tl.sum(values, axis=0)  # a single value is left: this adds nothing


@triton.jit
def partial_dots_kernel(
    x_ptr, y_ptr, partials_ptr, n, stride_x, stride_y, chunk,
    BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: n may pass 2**31
    chunk_start = pid * chunk
    chunk_stop = tl.minimum(chunk_start + chunk, n)
    full_blocks_stop = tl.minimum(chunk_stop, n // BLOCK * BLOCK)
    lanes = tl.zeros([BLOCK], dtype=tl.float32)
    # Widening 16-bit data to float32 is exact, and so is the product of two widened values
    # (8+8 or 11+11 significant bits fit in float32's 24). On the GPU the compiler fuses each
    # multiply and add into one FMA, one rounding instead of two.
    #
    # Full blocks load without a mask: the compiler vectorises a masked load only as far as it
    # can prove the mask constant, which `offs < n` is not unless n is a multiple of 16. So only
    # the vector's last block, when partial, pays for the mask (its lanes past n add 0).
    for block_start in range(chunk_start, full_blocks_stop, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs * stride_x).to(tl.float32)
        y = tl.load(y_ptr + offs * stride_y).to(tl.float32)
        lanes += x * y
    if full_blocks_stop < chunk_stop:
        offs = full_blocks_stop + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs * stride_x, mask=offs < n, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs * stride_y, mask=offs < n, other=0.0).to(tl.float32)
        lanes += x * y
    tl.store(partials_ptr + pid, pairwise_sum(lanes, LOG2_BLOCK))


@triton.jit
def sum_partials_kernel(partials_ptr, z_ptr, num_partials, LOG2_PARTIALS: tl.constexpr):
    offs = tl.arange(0, 2**LOG2_PARTIALS)
    # Padding to a power of two with zeros: x + 0 is exact, so the padding adds no rounding.
    partials = tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0)
    tl.store(z_ptr, pairwise_sum(partials, LOG2_PARTIALS).to(z_ptr.dtype.element_ty))


# Read once: test.py sets it before importing Triton, and the launcher should not pay for a look-up.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOG2_BLOCK = BLOCK.bit_length() - 1  # pass 1's in-program tree levels


def patch_triton_interpreter():
    """Make Triton 3.6's CPU interpreter compute what the GPU computes; called at import only
    under TRITON_INTERPRET=1, so the GPU path never runs it. With numpy 2.4 the interpreter fails
    where it makes a Python int of a scalar (a one-element array) with int(array): numpy 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars"), so a loop over
    runtime bounds fails; .item() does it. And it converts float32 <-> bfloat16 bit by bit,
    truncating (its 'rtne' rounds half up) and mangling subnormals where the GPU rounds to
    nearest even and keeps them; torch's exact conversions replace those two cases. The same
    function, word for word, is in every folder's triton_impl.py: a copied folder works alone."""
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


def split(n):
    """(programs, blocks per program) of pass 1 for a vector of n > 0 elements: as few blocks
    per program as MAX_PROGRAMS allows, then only as many programs as those blocks need."""
    # Plain integer ceilings: triton.cdiv is a constexpr function, ~2 us a call on the host.
    blocks = (n + BLOCK - 1) // BLOCK
    programs = min(blocks, MAX_PROGRAMS)
    blocks_per_program = (blocks + programs - 1) // programs
    return (blocks + blocks_per_program - 1) // blocks_per_program, blocks_per_program


def roundings(n, dtype):
    """README.md's k(n) for n > 0: the most float32 roundings on one product's way to z through
    this file's tree, which the error bound needs. One for the product of two float32 numbers
    (16-bit products are exact in float32), one per further block added into a lane, LOG2_BLOCK
    levels of pass 1's pairwise_sum and ceil(log2 programs) levels of pass 2's."""
    programs, blocks_per_program = split(n)
    product = 1 if dtype == torch.float32 else 0
    return product + (blocks_per_program - 1) + LOG2_BLOCK + (programs - 1).bit_length()


def dot(x, y):
    check_operands(x, y)
    device = on_device_of(x)
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)  # the empty sum
    programs, blocks_per_program = split(n)
    # Per call, from torch's caching allocator: z is the result, and partials cannot be shared
    # between calls that may run side by side on different streams.
    z = torch.empty((), dtype=x.dtype, device=x.device)
    partials = torch.empty(programs, dtype=torch.float32, device=x.device)
    with device:
        ints = (n, x.stride(0), y.stride(0), blocks_per_program * BLOCK)
        constants = {"BLOCK": BLOCK, "LOG2_BLOCK": LOG2_BLOCK, "num_warps": NUM_WARPS}
        launch(
            partial_dots_kernel, (programs,), (x, y, partials, *ints), constants,
            specialisation(ints, (x, y, partials)),
        )  # fmt: skip
        constants = {"LOG2_PARTIALS": (programs - 1).bit_length(), "num_warps": NUM_WARPS}
        launch(
            sum_partials_kernel, (1,), (partials, z, programs), constants,
            specialisation((programs,), (partials, z)),
        )  # fmt: skip
    return z
