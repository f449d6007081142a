"""swap: x <-> y as a Triton kernel.

README.md's "triton_impl.py" section explains the mapping (copy's, with two operands each way).
In this file: `swap_kernel` (one program loads its block of x and of y, then stores each into
the other, masked past n; one thread reads and writes each element, so no barrier),
`patch_triton_interpreter` (lets the kernel run on CPU tensors under TRITON_INTERPRET=1),
`on_device_of` and the launcher `swap`.
"""

import contextlib
import os

import torch
import triton
import triton.language as tl

from reference import check_operands

# 4 KiB per operand per program over 4 warps: two 16-byte vectors of x and two of y per thread,
# the fastest of the shapes swept; swap is touchy about its shape (README.md, tuning log).
BLOCK_BYTES = 4096
NUM_WARPS = 4


@triton.jit
def swap_kernel(x_ptr, y_ptr, n, stride_x, stride_y, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: n may pass 2**31
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offs < n
    x_ptrs, y_ptrs = x_ptr + offs * stride_x, y_ptr + offs * stride_y
    x = tl.load(x_ptrs, mask=in_bounds)
    y = tl.load(y_ptrs, mask=in_bounds)
    tl.store(x_ptrs, y, mask=in_bounds)
    tl.store(y_ptrs, x, mask=in_bounds)


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


def swap(x, y):
    check_operands(x, y)
    device = on_device_of(x)
    n = x.numel()
    # check_operands let through disjoint or identical views only, so one start means identical.
    if n == 0 or x.data_ptr() == y.data_ptr():
        return x, y
    block = BLOCK_BYTES // x.element_size()
    with device:
        # ceil(n / block) programs, in plain integers: triton.cdiv is a constexpr function that
        # costs about 2 us a call on the host.
        swap_kernel[((n + block - 1) // block,)](
            x, y, n, x.stride(0), y.stride(0), BLOCK=block, num_warps=NUM_WARPS
        )
    return x, y
