"""dot: z = x^T y with PyTorch, the way a researcher writes it.

`torch.dot` hands the work to a BLAS: on the GPU cuBLAS (cublasSdot for float32, cublasDotEx
computing in float32 for float16 and bfloat16), on the CPU MKL's sdot for float32 and ATen's own
loops for the 16-bit types. All of them accumulate in float32: on the CPU a test vector of one 1
and many terms below a 16-bit half-ulp of 1 keeps every term, which a 16-bit accumulator would
drop. Their summation order is their own and undocumented, so README.md can only bound them by
what holds for every order, the serial gamma_n.

cuBLAS counts elements and strides in C ints, and torch.dot on the GPU refuses anything larger.
Longer vectors are cut into chunks; each chunk is widened to float32 first (exact), so that its
dot stays in float32 rather than being rounded to the 16-bit dtype before the chunks are added.
"""

import torch

from reference import check_operands

INT_MAX = 2**31 - 1
CHUNK = 2**30


def dot(x, y):
    check_operands(x, y)
    if max(x.numel(), x.stride(0), y.stride(0)) <= INT_MAX:
        return torch.dot(x, y)
    chunk_dots = [
        torch.dot(x[s : s + CHUNK].float().contiguous(), y[s : s + CHUNK].float().contiguous())
        for s in range(0, x.numel(), CHUNK)
    ]
    return torch.stack(chunk_dots).sum().to(x.dtype)
