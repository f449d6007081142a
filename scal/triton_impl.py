"""scal: y = alpha * y as a Triton kernel.

README.md's "triton_impl.py" section explains the mapping (copy's, with a float32 multiply). In
this file: `scal_kernel` (one program scales one block of BLOCK elements, masked past n; a
compile-time variant for alpha32 == 0 stores zeros without reading y), `patch_triton_interpreter`
(lets the kernel run on CPU tensors under TRITON_INTERPRET=1), `on_device_of` and the launcher
`scal`.
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

from reference import check_operands, to_float32

# 4 KiB per operand per program over 8 warps: one 16-byte vector per thread; many small programs
# keep every SM streaming and leave a short last wave (README.md, tuning log: 16 KiB ran slower).
BLOCK_BYTES = 4096
NUM_WARPS = 8


@triton.jit
def scal_kernel(y_ptr, n, stride_y, alpha, ALPHA_IS_ZERO: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: n may pass 2**31
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offs < n
    y_ptrs = y_ptr + offs * stride_y
    if ALPHA_IS_ZERO:
        # BLAS: a zero scale means y is not read, so NaN or infinity in y does not survive.
        scaled = tl.zeros([BLOCK], dtype=tl.float32)
    else:
        # float32 arithmetic for every dtype (the interpreter also mishandles bf16 arithmetic).
        scaled = tl.load(y_ptrs, mask=in_bounds).to(tl.float32) * alpha
    tl.store(y_ptrs, scaled.to(y_ptr.dtype.element_ty), mask=in_bounds)


# Read once: test.py sets it before importing Triton, and the launcher should not pay for a look-up.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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


def scal(alpha, y):
    check_operands(alpha, y)
    device = on_device_of(y)
    n = y.numel()
    if n == 0:
        return y
    alpha32 = to_float32(float(alpha))  # a value that rounds to 0 in float32 is a zero
    block = BLOCK_BYTES // y.element_size()
    with device:
        # ceil(n / block) programs, in plain integers: triton.cdiv is a constexpr function that
        # costs about 2 us a call on the host.
        ints = (n, y.stride(0))
        constants = {"ALPHA_IS_ZERO": alpha32 == 0.0, "BLOCK": block, "num_warps": NUM_WARPS}
        launch(
            scal_kernel, ((n + block - 1) // block,), (y, *ints, alpha32), constants,
            specialisation(ints, (y,)),
        )  # fmt: skip
    return y
