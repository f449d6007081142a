"""gemm in the CuTe DSL: C = alpha*A@B + beta*C, the public entry point of the lesson's steps
(README.md, "cute_impl.py: from a plain tiled kernel to a Hopper kernel").

    cute_1_tiled.py      step 1: tiles on the CUDA cores; any strides, IEEE float32, 64-bit
                         offsets, alpha == 0 and k == 0
    cute_2_tma_wgmma.py  step 2: TMA, wgmma, warp specialisation and clusters on Hopper; hands
                         what TMA and wgmma cannot take to step 1
    cute_3_split_k.py    step 3: split k for decode shapes (C with fewer tiles than SMs and a
                         long k), partials summed in a fixed order; hands the rest to step 2
    cute_4_staged.py     step 4: operands TMA cannot load, copied to K-major 16-byte lines
                         first, so that every tensor-core product runs on step 2's or 3's kernel

`gemm` runs the last step; `additions` is the count the error bound needs. Copy the five files
with reference.py (operand checks): each step imports only the ones before it.
"""

import cute_4_staged


def gemm(alpha, A, B, beta, C, *, allow_tf32=False, cluster_m=2):
    """C = alpha*A@B + beta*C for CUDA tensors of one dtype, in float32; returns C. 16-bit data,
    and float32 with allow_tf32, runs on the tensor cores (operands TMA cannot load copied
    first, cute_4_staged.staged_operands): split along k where C has fewer 128 x 128 tiles than
    SMs and k is long (cute_3_split_k.choose_split), else on step 2's Hopper kernel in clusters
    of `cluster_m` blocks (1 or 2) along m. IEEE float32 runs on step 1's plain kernel."""
    return cute_4_staged.gemm(alpha, A, B, beta, C, allow_tf32=allow_tf32, cluster_m=cluster_m)


def additions(m, n, k, dtype, allow_tf32=False):
    """Additions a term alpha a_il b_lj meets in the float32 sum before alpha and beta are
    applied, on every step's path (README.md, "Counting r"): k. Step 1 adds serially along k,
    step 2 counts each wgmma k step as a serial sum, and step 3's slices of k_s values plus the
    S - 1 additions of their partials are never more, since no slice is empty."""
    return k
