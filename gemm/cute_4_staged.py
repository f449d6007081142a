"""gemm in the CuTe DSL, step 4: operands TMA cannot take, staged (README.md, "Step 4").

Compared with step 3 (cute_3_split_k.py), this adds a staging copy in front of the tensor-core
kernels of steps 2 and 3. TMA fetches tiles only from a matrix whose contiguous dimension has
stride 1 and whose other stride and base address are multiples of 16 bytes, and TF32 wgmma reads
K-major operands only. A bfloat16 A of k = 3079 columns has rows 6158 bytes apart, so step 2
hands the whole product to step 1's CUDA-core kernel, several times slower than the tensor
cores. Here such an operand is first copied, exactly, into a new K-major buffer whose other
stride is rounded up to 16 bytes (`k_major_copy`), and step 3 runs on the copy (splitting k or
handing it to step 2).

The copy changes no value, so the bound is the earlier steps'; what it costs and buys is in
README.md ("Step 4"). A dimension of 2**31 or more is beyond TMA whatever the strides, and stays
on step 1.
"""

import torch

from cute_1_tiled import checked_scalars
from cute_2_tma_wgmma import TMA_ALIGN_BYTES, TMA_MAX_DIM, tma_major
from cute_3_split_k import run_checked


def k_major_copy(t, k_dim):
    """t's values in a new buffer TMA can read K-major: dimension k_dim (1 for A, 0 for B)
    contiguous, the other stride rounded up to a multiple of 16 bytes. The padding is never
    read: the TMA descriptor has t's own shape and fills what lies past k with zeros."""
    rows, cols = t.shape
    k, other = (cols, rows) if k_dim == 1 else (rows, cols)
    per_line = TMA_ALIGN_BYTES // t.itemsize
    line = -(-k // per_line) * per_line
    buffer = torch.empty(other, line, dtype=t.dtype, device=t.device)[:, :k]
    return (buffer if k_dim == 1 else buffer.T).copy_(t)


def tma_takes(t, k_dim, k_major_only):
    """True when steps 2 and 3 can load t as it is: TMA takes it, K-major if `k_major_only`."""
    major = tma_major(t)
    k_major = "rows" if k_dim == 1 else "cols"
    return major == k_major or (major is not None and not k_major_only)


def staged_operands(A, B, allow_tf32):
    """(A, B) as the tensor-core kernels will take them: each operand the tensor cores would
    multiply but TMA cannot load replaced by its `k_major_copy`. IEEE float32 stays on the CUDA
    cores, and a dimension TMA cannot count (2**31 or more) on step 1, copies or not."""
    if A.dtype == torch.float32 and not allow_tf32:
        return A, B
    if max(A.shape[0], A.shape[1], B.shape[1]) > TMA_MAX_DIM:
        return A, B
    k_major_only = A.dtype == torch.float32  # TF32 wgmma
    if not tma_takes(A, 1, k_major_only):
        A = k_major_copy(A, 1)
    if not tma_takes(B, 0, k_major_only):
        B = k_major_copy(B, 0)
    return A, B


def gemm(alpha, A, B, beta, C, *, allow_tf32=False, cluster_m=2):
    """C = alpha*A@B + beta*C for CUDA tensors of one dtype, in float32; returns C. Validated
    first; then what the tensor cores multiply is staged where TMA cannot read it, and step 3
    runs (alpha32 == 0 or k == 0 reads neither operand, so nothing is copied)."""
    alpha32, beta32, read_ab, read_c = checked_scalars(alpha, A, B, beta, C)
    if read_ab and C.numel() > 0:  # m == 0 or n == 0: nothing to compute, nothing to copy
        A, B = staged_operands(A, B, allow_tf32)
    return run_checked(A, B, C, alpha32, beta32, read_ab, read_c, allow_tf32, cluster_m)
