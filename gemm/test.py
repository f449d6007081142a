"""Tests for gemm: every implementation lands within the bound README.md derives.

Run with `python test.py` (or `nox -s gemm` from the top). Without a GPU, torch runs on the CPU
and Triton under its interpreter, on small shapes; the CuTe kernels are compiled for sm_90a and
their PTX checked (launching them needs the GPU, and those tests skip saying so).

Sections, as in every folder: (1) set-up and the bound model, (2) the contract over every
implementation, (3) Triton's plans, paths, PTX and launch, (4) CuTe's builds, dispatch and PTX,
(5) GPU-only sizes.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import reference
import torch_impl
import triton_impl

try:
    from common.tolerance import (
        assert_matches_rounded,
        assert_same_bits,
        assert_within_bound,
        gamma,
        store_roundoff,
        underflow,
        unit_roundoff,
    )
except ImportError as error:  # the folder was copied on its own, without common/
    raise ImportError(
        "test.py takes its tolerance checks from the course's common/ folder, which is not beside "
        f"this folder: copy the course's common/ folder beside it, to {HERE.parent / 'common'}"
    ) from error

try:
    import cute_1_tiled as cute_step1
    import cute_2_tma_wgmma as cute_step2
    import cute_3_split_k as cute_step3
    import cute_4_staged as cute_step4
    import cute_impl
except ImportError as error:  # no CuTe kernel yet, or no CuTe DSL: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"cute_impl cannot be imported ({error})"

# (1) Set-up and the bound model ----------------------------------------------------------------
# The README's bound as code (`roundings`, `error_bound`), the operands the tests draw, and the
# fixtures that move triton_impl's thresholds.
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
# The steps of the CuTe lesson, each with its own gemm (README.md, "cute_impl.py: from a plain
# tiled kernel to a Hopper kernel"); "cute" is cute_impl, which runs the last one.
CUTE_STEPS = ["cute.step1", "cute.step2", "cute.step3", "cute.step4"]
# NN: A and B row-major; T: that operand is the transpose of a contiguous matrix.
LAYOUTS = ["NN", "NT", "TN", "TT"]
# (m, n, k): 1x1x1, primes, and the edges of Triton's 64 x 64 tiles, of the CuTe plain
# kernel's 128 x 128 ones and of BLOCK_K (32 float32, 64 16-bit values; 8 for CuTe).
# test_large_tiles covers Triton's large configurations, test_grouped_order more tile rows than
# GROUP_M.
SHAPES = [
    (1, 1, 1), (2, 3, 5), (7, 1, 13), (1, 17, 3), (13, 11, 31), (64, 64, 32), (65, 63, 33),
    (31, 67, 65), (3, 5, 129), (129, 130, 9),
]  # fmt: skip
ALPHA, BETA = 0.3, -1.7  # the scalars of most tests: neither term dominates
U32, U64 = unit_roundoff(torch.float32), unit_roundoff(torch.float64)
U_TF32 = 2.0**-11  # TF32 keeps 10 fraction bits: 11 significant bits, as float16
# Triton hands float32 bits to wgmma without a cvt.rna.tf32 (test_triton_ptx), and the tensor
# cores drop the low 13 bits: a chop, which moves an input by up to 2u, not u.
TF32_INPUT_ERROR = 2 * U_TF32
# Storage-dtype roundings torch may add on each term (README.md, "torch_impl.py").
TORCH_EXTRA_ROUNDINGS = 2
# reference.py's own error, in units of W_ij = |alpha| T_ij + |beta c_ij| (its docstring).
REFERENCE_ERROR = gamma(3, U64)


def entry_point(name):
    """The implementation's gemm ("cute.step1" to "cute.step4": that step's). CuTe's can be
    called without a GPU: it validates, then refuses."""
    if name.startswith("cute"):
        if cute_impl is None:
            pytest.skip(CUTE_MISSING)
        steps = dict(zip(CUTE_STEPS, (cute_step1, cute_step2, cute_step3, cute_step4), strict=True))
        return {"cute": cute_impl, **steps}[name].gemm
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return modules[name].gemm


def implementation(name):
    """The implementation's gemm, for tests that launch it."""
    if name.startswith("cute") and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU")
    return entry_point(name)


def random_matrix(rows, cols, dtype, transposed=False):
    """Fresh random (rows, cols) values, row-major, or the transpose of a contiguous matrix."""
    if transposed:
        return torch.randn(cols, rows, device=DEVICE).to(dtype).T
    return torch.randn(rows, cols, device=DEVICE).to(dtype)


def operands(m, n, k, dtype, layout):
    """(A, B, C) for one of NN, NT, TN, TT; C row-major."""
    A = random_matrix(m, k, dtype, layout[0] == "T")
    B = random_matrix(k, n, dtype, layout[1] == "T")
    return A, B, random_matrix(m, n, dtype)


def abs_product(A, B, rows=1024):
    """T = |A| |B| in float64 (each product of float32 numbers is exact; float64 sums add a
    relative gamma_k(2**-53) that the bound's float32 gammas dwarf), a block of rows at a time."""
    B_abs = B.double().abs()
    blocks = [A[s : s + rows].double().abs() @ B_abs for s in range(0, A.shape[0], rows)]
    if not blocks:
        return torch.zeros(0, B.shape[1], dtype=torch.float64)
    return torch.cat(blocks).cpu()


def roundings(impl, m, n, k, dtype, allow_tf32=False):
    """README.md's count of roundings on one term alpha a_il b_lj's way to c_ij.

    The product: one for float32 data in IEEE mode, none for 16-bit or TF32 inputs, whose
    products (at most 11 + 11 significant bits) are exact in float32. The sum: tl.dot's order
    inside a tile is not documented, and the accumulator enters the tensor cores' chain, so each
    step is bounded as a serial sum of acc and its BLOCK_K products; additions of the masked
    zeros are exact, so k additions in all, whatever BLOCK_K is. Triton splits k for a C of few
    tiles: a range's serial chain, then the fixed-order sum of the partials, as many as
    triton_impl.additions says (never more than k); CuTe's as cute_impl.additions says (k on
    every step: step 3's slices and the sum of their partials are never more, since no slice is
    empty, test_cute_split_plan). torch's library order is undocumented: k. Then alpha times the
    sum (or each partial) and the addition of beta * c: two."""
    product = 1 if dtype == torch.float32 and not allow_tf32 else 0
    if impl == "triton":
        additions = triton_impl.additions(m, n, k, dtype, allow_tf32)
    elif impl.startswith("cute"):
        additions = cute_impl.additions(m, n, k, dtype, allow_tf32)
    else:
        additions = k  # torch: the library's order, undocumented
    return product + additions + 2


def error_bound(impl, alpha, A, B, beta, C, exact, exact_error=REFERENCE_ERROR, allow_tf32=False):
    """README.md's bound on |c_hat_ij - c_ij|:

        u_s |c| + (1 + u_s) (c_a |a| T + c_b |b c| + (1 + c_a) |a| k e + 2 (1 + u) e) + e_s

    a, b the float32 scalars, T = |A||B|, u_s the store's unit roundoff (0 for float32), e and
    e_s the absolute error of a float32 and of a storing rounding among the subnormals,
    c_a = gamma_r with r from `roundings` (times (1 + 2 U_TF32)**2 for TF32's chopped inputs),
    c_b = gamma_2. torch may round each term up to TORCH_EXTRA_ROUNDINGS more times to the
    storage dtype (and add their subnormal errors), and its library may start the sum from
    beta * c, so that term meets the k additions too: c_b = gamma_{k+2} for torch (seen on the
    CPU, where gamma_2 failed about once in 125 draws of a 1 x 17 x 3 float32 product). The
    exact answer is known to within exact_error * W, W = |a| T + |b c|: gamma_3 of float64
    for reference.py."""
    (m, k), n, dtype = A.shape, B.shape[1], A.dtype
    a32, b32 = reference.to_float32(float(alpha)), reference.to_float32(float(beta))
    zeros = torch.zeros(m, n, dtype=torch.float64)
    alpha_part = abs(a32) * abs_product(A, B) if a32 != 0 and k > 0 else zeros
    beta_part = abs(b32) * C.cpu().double().abs() if b32 != 0 else zeros
    u_s, e, e_s = store_roundoff(dtype), underflow(torch.float32), underflow(dtype)
    tf32 = allow_tf32 and dtype == torch.float32
    input_error = (1 + TF32_INPUT_ERROR) ** (2 * tf32)
    c_a = (1 + gamma(roundings(impl, m, n, k, dtype, tf32), U32)) * input_error - 1
    c_b = gamma(k + 2 if impl == "torch" else 2, U32)
    if impl == "torch":
        extra = (1 + u_s) ** TORCH_EXTRA_ROUNDINGS
        c_a, c_b = extra * (1 + c_a) - 1, extra * (1 + c_b) - 1
        e = e + TORCH_EXTRA_ROUNDINGS * e_s
    float32_error = c_a * alpha_part + c_b * beta_part + (1 + c_a) * abs(a32) * k * e
    bound = u_s * exact.abs() + (1 + u_s) * (float32_error + 2 * (1 + U32) * e) + e_s
    return bound + (1 + u_s) * exact_error * (alpha_part + beta_part)


def padded_matrix(rows, cols, dtype, transposed, device=DEVICE):
    """Random (rows, cols) values in a buffer whose leading dimension is rounded up to 16
    elements: 16-byte aligned rows (or, transposed, columns) for any rows and cols."""
    if transposed:
        return padded_matrix(cols, rows, dtype, False, device).T
    buffer = torch.randn(rows, -(-cols // 16) * 16, device=device).to(dtype)
    return buffer[:, :cols]


def check(impl, alpha, A, B, beta, C, what="", allow_tf32=False):
    """Run impl in place on C and check it against the reference within the bound."""
    exact = reference.gemm(alpha, A.cpu(), B.cpu(), beta, C.cpu())
    bound = error_bound(impl, alpha, A, B, beta, C, exact, allow_tf32=allow_tf32)
    result = implementation(impl)(alpha, A, B, beta, C, allow_tf32=allow_tf32)
    assert result is C
    assert_within_bound(C, exact, bound, f"{impl} {tuple(A.shape)}x{tuple(B.shape)} {what}")


@pytest.fixture
def sm_count(monkeypatch):
    """set(count) makes triton_impl plan for `count` SMs for the rest of the test; configuration's
    cache is emptied then and afterwards, so no plan made for one count serves another."""

    def set_count(count):
        monkeypatch.setattr(triton_impl, "SM_COUNT", count)
        triton_impl.configuration.cache_clear()

    yield set_count
    triton_impl.configuration.cache_clear()


@pytest.fixture
def tma_at_any_size(monkeypatch):
    """TMA takes tensor-core work of any size for the rest of the test (TMA_MIN_VOLUME set to
    0), so that the interpreter's small shapes run the TMA and staged kernels, which the real
    rule keeps for larger products (test_tma_min_volume)."""
    monkeypatch.setattr(triton_impl, "TMA_MIN_VOLUME", 0)


# (2) The contract over every implementation ----------------------------------------------------
# Each implementation against reference.py on fresh random data in every dtype and layout, guard
# buffers, repeatability, BLAS corner semantics, TF32, negative controls and every bad input.


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.usefixtures("tma_at_any_size")
def test_matches_reference(impl, layout, dtype, shape):
    m, n, k = shape
    A, B, C = operands(m, n, k, dtype, layout)
    check(impl, ALPHA, A, B, BETA, C, layout)


MARGIN = 3  # rows and columns of NaN around a guarded matrix


def guarded(values, transposed):
    """A view of `values` inside a NaN-filled buffer with MARGIN rows and columns on each side
    and every other column skipped (transposed: the same, laid out column-major)."""
    rows, cols = values.shape
    if transposed:
        view, buffer = guarded(values.T, False)
        return view.T, buffer
    buffer = torch.full(
        (rows + 2 * MARGIN, 2 * cols + 2 * MARGIN), float("nan"), device=DEVICE, dtype=values.dtype
    )
    view = buffer[MARGIN : MARGIN + rows, MARGIN : MARGIN + 2 * cols : 2]
    view.copy_(values)
    return view, buffer


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["NN", "TT"])
@pytest.mark.parametrize("c_transposed", [False, True], ids=["C row-major", "C col-major"])
def test_views_inside_guard(impl, dtype, layout, c_transposed):
    """A, B and C strided views into NaN: a read outside A or B makes C NaN, every element of C
    must be written (its old value is far from the new one), and nothing around or between C's
    elements may change."""
    m, n, k = 37, 19, 41
    A, _ = guarded(random_matrix(m, k, dtype), layout[0] == "T")
    B, _ = guarded(random_matrix(k, n, dtype), layout[1] == "T")
    C, C_buffer = guarded(random_matrix(m, n, dtype), c_transposed)
    A_before, B_before = A.clone(), B.clone()
    check(impl, ALPHA, A, B, BETA, C, f"{layout} guarded")
    inside = torch.zeros_like(C_buffer, dtype=torch.bool)
    inside.as_strided(C.shape, C.stride(), C.storage_offset()).fill_(True)
    assert C_buffer[~inside].isnan().all(), "an element outside C was written"
    assert_same_bits(A, A_before, "A after the call")
    assert_same_bits(B, B_before, "B after the call")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.usefixtures("tma_at_any_size")
def test_zero_scalars_do_not_read(impl, dtype):
    """beta == 0 ignores NaN in C; alpha == 0 ignores NaN in A and B (C = beta*C); both zero
    give +0 without reading anything."""
    m, n, k = 20, 30, 40
    nan_C = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    nan_A = torch.full((m, k), float("nan"), device=DEVICE, dtype=dtype)
    nan_B = torch.full((k, n), float("nan"), device=DEVICE, dtype=dtype)
    A, B, C = operands(m, n, k, dtype, "NT")
    check(impl, ALPHA, A, B, 0.0, nan_C.clone(), "beta = 0")
    check(impl, 0.0, nan_A, nan_B, BETA, C.clone(), "alpha = 0")
    check(impl, 1e-50, nan_A, nan_B, BETA, C.clone(), "alpha rounds to 0")
    check(impl, ALPHA, A, B, -1e-46, nan_C.clone(), "beta rounds to -0")
    out = nan_C.clone()
    implementation(impl)(0.0, nan_A, nan_B, 0.0, out)
    assert_same_bits(out, torch.zeros_like(out), "alpha = beta = 0")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_shapes(impl, dtype):
    """m == 0 or n == 0 leaves the empty C alone; k == 0 is the empty sum, C = beta*C (C = 0
    for beta == 0, even over NaN)."""
    gemm = implementation(impl)
    for m, n in ((0, 5), (5, 0)):
        C = torch.empty(m, n, device=DEVICE, dtype=dtype)
        A, B = random_matrix(m, 4, dtype), random_matrix(4, n, dtype)
        assert gemm(ALPHA, A, B, BETA, C) is C
    A, B = random_matrix(9, 0, dtype), random_matrix(0, 7, dtype)
    check(impl, ALPHA, A, B, BETA, random_matrix(9, 7, dtype), "k = 0")
    C = torch.full((9, 7), float("nan"), device=DEVICE, dtype=dtype)
    gemm(ALPHA, A, B, 0.0, C)
    assert_same_bits(C, torch.zeros_like(C), "k = 0, beta = 0")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["nan in A", "inf in B", "nan in C"])
def test_special_values(impl, dtype, case):
    """NaN and infinities in read operands propagate as IEEE says: the exact result must come
    back exactly, NaN where NaN, the same infinity where one infinite term meets finite ones."""
    A, B, C = operands(20, 70, 45, dtype, "TN")
    if case == "nan in A":
        A[3, 40] = float("nan")
    elif case == "inf in B":
        B[33, 9] = float("inf")
    else:
        C[4, 5] = float("nan")
    check(impl, ALPHA, A, B, BETA, C, case)


@pytest.mark.parametrize("impl", ["triton", "cute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scalars_rounded_to_float32(impl, dtype):
    """alpha = 1 + 2**-8 + 2**-20 and beta = 1, A = B = 1 (k = 1), C = -1: the kernels compute
    alpha32 * 1 - 1 exactly in float32, so C must be alpha32 - 1 rounded once."""
    alpha = 1 + 2**-8 + 2**-20
    A = torch.ones(5, 1, device=DEVICE, dtype=dtype)
    B = torch.ones(1, 3, device=DEVICE, dtype=dtype)
    C = torch.full((5, 3), -1.0, device=DEVICE, dtype=dtype)
    implementation(impl)(alpha, A, B, 1.0, C)
    assert_matches_rounded(C, torch.full((5, 3), reference.to_float32(alpha) - 1.0).double())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeatability(impl, dtype):
    """Two runs on the same inputs give the same bits: the summation order depends on the shape
    and the configuration only."""
    gemm = implementation(impl)
    A, B, C = operands(67, 70, 300, dtype, "NT")
    first, second = C.clone(), C.clone()
    gemm(ALPHA, A, B, BETA, first)
    gemm(ALPHA, A, B, BETA, second)
    assert_same_bits(second, first)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.usefixtures("tma_at_any_size")
def test_cuda_graph_replays_the_eager_call(impl, dtype):
    """Captured in a CUDA graph (as a decode loop would run it), the in-place call replays on
    fresh A, B and C with the bits of an eager call on a copy of the same C: the launcher works
    on the stream torch has current and does nothing outside it that a capture would miss.
    Row-major rows of 16-byte multiples: the TMA kernels for 16-bit data (CuTe's Hopper kernel
    in clusters of 2, Triton's persistent one), the plain kernels for IEEE float32."""
    gemm = implementation(impl)
    m, n, k = 300, 264, 136
    A, B, C = operands(m, n, k, dtype, "NN")
    assert triton_impl.tma_ready(A) and triton_impl.tma_ready(B)
    if impl == "cute":
        kind = "plain" if dtype == torch.float32 else "hopper"
        assert cute_step2.choose_kernel(A, B, False).kernel == kind
    gemm(ALPHA, A, B, BETA, C)  # the first call compiles and loads the kernel: no capture can
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(ALPHA, A, B, BETA, C)
    A.copy_(random_matrix(m, k, dtype))
    B.copy_(random_matrix(k, n, dtype))
    C.copy_(random_matrix(m, n, dtype))
    eager = C.clone()
    graph.replay()
    gemm(ALPHA, A, B, BETA, eager)
    torch.cuda.synchronize()
    assert_same_bits(C, eager, "replayed against eager")


def tf32(values):
    """float32 values rounded to TF32's 11 significant bits, to nearest (ties away), as floats."""
    bits = values.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_tf32_within_its_bound(impl, layout):
    """allow_tf32=True: the result lies within the bound with TF32's u = 2**-11 (2u: a chop) on
    each input.
    (The CPU computes IEEE float32 here, which satisfies it; on the GPU this is TF32.)"""
    A, B, C = operands(45, 70, 300, torch.float32, layout)
    check(impl, ALPHA, A, B, BETA, C, "tf32", allow_tf32=True)


def test_tf32_flag_is_restored():
    """torch_impl sets torch's process-wide float32 matmul flag for the call only."""
    flags = torch.backends.cuda.matmul
    saved = flags.fp32_precision
    for allow, inside in ((True, "tf32"), (False, "ieee")):
        with torch_impl.float32_matmul_precision(torch.device("cuda"), allow):
            assert flags.fp32_precision == inside
        assert flags.fp32_precision == saved


def problem(m, n, k):
    """A bfloat16 problem on the CPU and its exact answer, for the negative controls."""
    A, B, C = (t.cpu() for t in operands(m, n, k, torch.bfloat16, "NN"))
    return A, B, C, reference.gemm(ALPHA, A, B, BETA, C)


def kernel_impls():
    return ["torch", "triton"] + (["cute"] if cute_impl is not None else [])


def test_negative_controls():
    """Every bound rejects a result that dropped or doubled the largest term of one entry, or
    took an entry from the neighbouring row."""
    A, B, C, exact = problem(64, 64, 256)
    a32 = reference.to_float32(ALPHA)
    products = A[5].double() * B[:, 7].double()
    largest = products.abs().argmax()
    dropped, doubled, neighbour = exact.clone(), exact.clone(), exact.clone()
    dropped[5, 7] -= a32 * products[largest]
    doubled[5, 7] += a32 * products[largest]
    neighbour[5] = exact[6]
    for impl in kernel_impls():
        bound = error_bound(impl, ALPHA, A, B, BETA, C, exact)
        assert_within_bound(exact.to(torch.bfloat16), exact, bound, f"{impl} the exact answer")
        for wrong in (dropped, doubled, neighbour):
            with pytest.raises(AssertionError, match="outside the bound"):
                assert_within_bound(wrong.to(torch.bfloat16), exact, bound, impl)


def test_tf32_negative_control():
    """A float32 product computed from TF32-rounded inputs passes the TF32 bound and fails the
    IEEE one: the default bound catches TF32 leaking into a float32 gemm."""
    A, B, C = operands(64, 64, 256, torch.float32, "NN")
    A, B, C = A.cpu(), B.cpu(), C.cpu()
    exact = reference.gemm(ALPHA, A, B, BETA, C)
    a32, b32 = reference.to_float32(ALPHA), reference.to_float32(BETA)
    leaked = (a32 * (tf32(A).double() @ tf32(B).double()) + b32 * C.double()).float()
    for impl in kernel_impls():
        tf32_bound = error_bound(impl, ALPHA, A, B, BETA, C, exact, allow_tf32=True)
        assert_within_bound(leaked, exact, tf32_bound, f"{impl} TF32")
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(leaked, exact, error_bound(impl, ALPHA, A, B, BETA, C, exact))


def alias(t):
    """The elements of t through a second storage that starts at t's first element, as DLPack
    imports and numpy views make them: unless t starts its own storage, a check by storage
    identity misses that the two share memory."""
    other = torch.from_dlpack(t)
    assert other.untyped_storage().data_ptr() == t.data_ptr()
    return other


def bad_inputs():
    """(alpha, A, B, beta, C, expected error, words the message must contain)"""
    f32 = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    A, B, C = f32(3, 4), f32(4, 5), f32(3, 5)
    buffer = f32(60)
    yield torch.tensor(1.0), A, B, 1.0, C, TypeError, "alpha must be a real"
    yield 1.0, A, B, True, C, TypeError, "beta must be a real"
    yield 1.0, A.tolist(), B, 1.0, C, TypeError, "A must be a torch.Tensor"
    yield 1.0, A, None, 1.0, C, TypeError, "B must be a torch.Tensor"
    yield 1.0, A, B, 1.0, C.numpy(force=True), TypeError, "C must be a torch.Tensor"
    yield 1.0, f32(12), B, 1.0, C, ValueError, "A must be a 2-D"
    yield 1.0, A, f32(4, 5, 1), 1.0, C, ValueError, "B must be a 2-D"
    yield 1.0, A, B, 1.0, f32(15), ValueError, "C must be a 2-D"
    yield 1.0, A, f32(5, 5), 1.0, C, ValueError, "B has 5 rows but A has 4 columns"
    yield 1.0, A, B, 1.0, f32(5, 3), ValueError, r"C has shape \(5, 3\)"
    yield 1.0, A.double(), B.double(), 1.0, C.double(), TypeError, "A has dtype torch.float64"
    yield 1.0, A.int(), B.int(), 1.0, C.int(), TypeError, "supported"
    yield 1.0, A, B.half(), 1.0, C, TypeError, "B has dtype torch.float16 but A"
    yield 1.0, A.bfloat16(), B.bfloat16(), 1.0, C, TypeError, "C has dtype torch.float32 but A"
    yield 10**400, A, B, 1.0, C, ValueError, "alpha is beyond the range of a float"
    yield 1.0, A, B, -(10**400), C, ValueError, "beta is beyond the range of a float"
    collide = "give two of its elements one address"
    yield 1.0, A, B, 1.0, f32(1, 5).expand(3, 5), ValueError, rf"\(0, 1\) {collide}"
    yield 1.0, A, B, 1.0, f32(3, 1).expand(3, 5), ValueError, rf"\(1, 0\) {collide}"
    yield 1.0, A, B, 1.0, f32(8).as_strided((3, 5), (1, 1)), ValueError, rf"\(1, 1\) {collide}"
    yield 1.0, A, B, 1.0, f32(20).as_strided((3, 5), (3, 2)), ValueError, rf"\(3, 2\) {collide}"
    yield 1.0, buffer[:12].view(3, 4), B, 1.0, buffer[10:25].view(3, 5), ValueError, "C overlaps A"
    yield 1.0, A, buffer[20:40].view(4, 5), 1.0, buffer[39:54].view(3, 5), ValueError, "overlaps B"
    # Another storage over the same memory (DLPack import) overlaps all the same.
    aliased_C = alias(buffer[10:25]).view(3, 5)
    yield 1.0, buffer[:12].view(3, 4), B, 1.0, aliased_C, ValueError, "C overlaps A"
    yield 1.0, A, B, 1.0, A[:, :1].expand(3, 5)[:, :5], ValueError, collide
    if ON_GPU:
        yield 1.0, A, B.cpu(), 1.0, C, ValueError, "B is on cpu"
        yield 1.0, A, B, 1.0, C.cpu(), ValueError, "C is on cpu"


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
@pytest.mark.parametrize("case", list(bad_inputs()), ids=lambda case: case[-1])
def test_bad_input_raises_before_launch(impl, case):
    """Errors come from check_operands, before any launch, so CuTe is checked on the CPU too."""
    *args, error, words = case
    C = args[4]
    before = C.clone() if isinstance(C, torch.Tensor) else None
    with pytest.raises(error, match=words):
        entry_point(impl)(*args)
    if before is not None:
        assert_same_bits(C.reshape(-1), before.reshape(-1), "C after a rejected call")


def element_addresses(t):
    """The address of every element of t, in index order, by brute force."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return (t.data_ptr() + offsets.flatten() * t.element_size()).tolist()


def test_elements_collide_is_exact():
    """The gcd rule agrees with a search of every pair of indices, for every shape up to 5 x 5
    and every pair of strides up to 6."""
    storage = torch.empty(64)
    for m, n, s, t in np.ndindex(6, 6, 7, 7):
        C = storage.as_strided((m, n), (s, t))
        addresses = element_addresses(C)
        assert reference.elements_collide(C) == (len(set(addresses)) < len(addresses)), (m, n, s, t)


def test_overlap_is_judged_by_address():
    """reference.overlap on random 2-D views of one buffer, half of them through a second
    storage: 'none' only when no byte is shared, 'same' only for the very same elements."""
    buffer, generator = torch.empty(256), torch.Generator().manual_seed(12)

    def random_view():
        shape = torch.randint(0, 5, (2,), generator=generator).tolist()
        strides = torch.randint(0, 9, (2,), generator=generator).tolist()
        offset = int(torch.randint(0, 40, (1,), generator=generator))
        view = buffer.as_strided(shape, strides, offset)
        return alias(view) if torch.rand(1, generator=generator) < 0.5 else view

    def byte_set(t):
        return {a + b for a in element_addresses(t) for b in range(t.element_size())}

    answers = set()
    for trial in range(2000):
        a = random_view()
        b = alias(a) if trial % 5 == 0 and a.numel() else random_view()
        answer = reference.overlap(a, b)
        answers.add(answer)
        if answer == "none":
            assert not byte_set(a) & byte_set(b), (a.shape, a.stride(), b.shape, b.stride())
        if answer == "same":
            assert element_addresses(a) == element_addresses(b)
    assert answers == {"none", "same", "partial"}


# (alpha, beta, scale of A and B, scale of C): scalars that float16 or bfloat16 cannot hold
# (1e5 overflows float16; 1e-8 and 3e-8 are no 16-bit numbers, 1e-6 a float16 subnormal), with
# operands scaled so that every term and result stays far inside float16's range.
UNHELD_SCALARS = [(1e5, 1.0, 1e-2, 1.0), (1e-8, 1.0, 100.0, 1e-3), (1e-6, 3e-8, 1.0, 100.0),
                  (-3e-8, 1e5, 100.0, 1e-2)]  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scalars", UNHELD_SCALARS, ids=str)
def test_scalars_the_dtype_cannot_hold(impl, dtype, scalars):
    """The scalars are float32 numbers whatever the storage dtype: none may be converted to a
    16-bit one on the way (torch's addmv and addr do that unless routed around)."""
    alpha, beta, operand_scale, c_scale = scalars
    A, B, C = operands(19, 23, 37, dtype, "NT")
    A.mul_(operand_scale), B.mul_(operand_scale), C.mul_(c_scale)
    check(impl, alpha, A, B, beta, C, f"alpha={alpha} beta={beta}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_rows_are_not_read(impl, dtype):
    """A and B with rows padded by NaN to the next multiple of 8 past k = 29 and n = 53, as a
    slice of a wider tensor makes them: a kernel that reads past a row's end gets NaN into C
    (torch 2.13's CPU bfloat16 mm was seen to, so torch_impl copies such operands on the CPU)."""
    m, n, k = 37, 53, 29

    def padded(rows, cols):
        buffer = torch.full((rows, cols + 8 - cols % 8), float("nan"), device=DEVICE, dtype=dtype)
        view = buffer[:, :cols]
        return view.copy_(torch.randn(rows, cols, device=DEVICE))

    check(impl, ALPHA, padded(m, k), padded(k, n), BETA, padded(m, n), "padded rows")


@pytest.mark.parametrize("impl", IMPLS)
def test_strides_past_32_bits_on_unit_dims(impl):
    """A dim of size 1 may carry any stride, 2**31 + 1 included, without any memory behind it:
    the kernels never step along it, and cuBLAS, which refuses such a leading dimension, gets a
    copy from torch_impl."""
    m, n, k, huge = 1, 5, 7, 2**31 + 1
    A = torch.randn(k, device=DEVICE).as_strided((m, k), (huge, 1))
    B = torch.randn(k, device=DEVICE).as_strided((k, 1), (1, huge))
    C = torch.randn(n, device=DEVICE).as_strided((m, n), (huge, 1))
    f32 = lambda *shape: random_matrix(*shape, torch.float32)  # noqa: E731
    check(impl, ALPHA, A, f32(k, n), BETA, C, "A and C")
    check(impl, ALPHA, f32(5, k), B, BETA, f32(5, 1), "B")


# (3) Triton: tile plans, kernel paths, PTX and the launch --------------------------------------
# Which configuration and kernel (pointer, TMA, staged, split k) a call takes, each path run on
# the interpreter's small shapes; the sm_90 PTX of each build; the direct launch's key.


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: kernel[grid](...) records the kernel's name, then
    launches it."""

    def __init__(self, kernel, name, launched):
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


# The kernel each of triton_impl's paths launches.
KERNEL_OF_PATH = {"pointer": "gemm_kernel", "tma": "gemm_tma_kernel", "staged": "gemm_tma_kernel"}


def record_launches(monkeypatch):
    """The list of the names of the Triton kernels launched from now on in this test."""
    launched = []
    for name in ("gemm_kernel", "gemm_tma_kernel"):
        kernel = getattr(triton_impl, name)
        monkeypatch.setattr(triton_impl, name, LaunchRecorder(kernel, name, launched))
    return launched


@pytest.mark.parametrize("aligned", [False, True], ids=["any rows", "16-byte rows"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.usefixtures("tma_at_any_size")
def test_large_tiles(monkeypatch, aligned, layout, dtype):
    """The tiers' configurations (128 x 256, 128 x 128 and 64 x 128 on the tensor cores, 128 x 64
    for IEEE float32), which the rule picks only for a C of FULL_WAVE = 124 tiles or more (too
    big for the interpreter), forced on a 129 x 130 x 65 problem: every tile edge at once.
    Operands with rows (or, transposed, columns) of any length take the pointer kernel, 16-byte
    aligned ones the TMA kernel (on the tensor cores), in all four layouts."""
    sides = (4096, 1536, 1024)  # 16-bit: 128 x 256, 128 x 128, 64 x 128 tiles
    configs = {tuple(triton_impl.configuration(s, s, 65, dtype).items()) for s in sides}
    assert len(configs) == (1 if dtype == torch.float32 else 3)
    m, n, k = 129, 130, 65
    matrix = padded_matrix if aligned else random_matrix
    A, B = matrix(m, k, dtype, layout[0] == "T"), matrix(k, n, dtype, layout[1] == "T")
    path = "tma" if aligned and dtype != torch.float32 else "pointer"
    assert triton_impl.choose_path(A, B, dtype != torch.float32) == path
    launched = record_launches(monkeypatch)
    for config in configs:
        config = dict(config)
        assert config["BLOCK_M"] in (64, 128) and config["BLOCK_N"] in (64, 128, 256)
        assert config["SPLITS"] == 1
        monkeypatch.setattr(triton_impl, "configuration", lambda *_, fixed=config: fixed)
        check("triton", ALPHA, A, B, BETA, random_matrix(m, n, dtype), f"tiles {config}")
    assert launched == [KERNEL_OF_PATH[path]] * len(configs)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_grouped_order(impl):
    """577 rows make 10 tile rows: one full group of GROUP_M = 8 and a short one of 2, whose
    tiles must all be computed once and in their right place."""
    A, B, C = operands(577, 130, 3, torch.float32, "NT")
    check(impl, ALPHA, A, B, BETA, C, "two groups")


def test_configuration_rule():
    """BLOCK_K is 128 bytes of a row; a C of at most 128 rows is one row of tiles 16, 32, 64 or
    128 rows tall (the next power of two, 16 at least) and 128 wide; a taller one takes the
    largest tile of which it has at least FULL_WAVE (124 of the H200's 132 SMs): 128 x 256, then
    128 x 128, then 64 x 128 for 16-bit data, 128 x 128 for float32 with TF32, 128 x 64 for IEEE
    float32; else 64 x 64."""
    rule = triton_impl.configuration
    for dtype, block_k in ((torch.float32, 32), (torch.float16, 64), (torch.bfloat16, 64)):
        assert rule(16384, 4096, 4096, dtype)["BLOCK_K"] == block_k
        for m, block_m in ((1, 16), (16, 16), (17, 32), (33, 64), (64, 64), (65, 128), (128, 128)):
            assert (rule(m, 4096, 4096, dtype)["BLOCK_M"], rule(m, 9, 9, dtype)["BLOCK_N"]) == (
                block_m,
                128,
            )
    assert rule(256, 256, 256, torch.bfloat16)["BLOCK_M"] == 64
    assert rule(1536, 2816, 64, torch.bfloat16)["BLOCK_N"] == 256  # 12 x 11
    medium = rule(1536, 2560, 64, torch.bfloat16)  # 12 x 10 wide, 12 x 20
    assert (medium["BLOCK_N"], medium["num_stages"]) == (128, 4)
    assert triton_impl.FULL_WAVE == 124
    assert rule(2048, 2048, 2048, torch.bfloat16)["BLOCK_N"] == 256  # 8 x 16 = 128 tiles
    for side in (1408, 1024):  # 11 x 11 and 8 x 8 of 128 x 128; 22 x 11 and 16 x 8 of 64 x 128
        narrow = rule(side, side, 64, torch.bfloat16)
        assert (narrow["BLOCK_M"], narrow["BLOCK_N"], narrow["num_warps"]) == (64, 128, 4)
    assert rule(768, 768, 64, torch.bfloat16)["BLOCK_N"] == 64  # 12 x 6 of 64 x 128
    assert rule(1536, 768, 64, torch.float32)["BLOCK_M"] == 128  # 12 x 12
    assert rule(1536, 640, 64, torch.float32)["BLOCK_M"] == 64  # 12 x 10
    tf32 = rule(1536, 2816, 64, torch.float32, True)
    assert (tf32["BLOCK_M"], tf32["BLOCK_N"]) == (128, 128)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.usefixtures("tma_at_any_size")
def test_tma_path(sm_count, monkeypatch, layout, dtype):
    """Operands whose rows, or (transposed) columns, are 16-byte aligned take the persistent
    TMA kernel on the tensor cores in all four layouts: 16-bit data, and float32 with TF32
    (IEEE float32 stays on the pointer kernel). Planned for 5 SMs, C has 2 tiles of 128 x 256
    and 4 of 128 x 128, so it takes 12 of 64 x 64 on five programs, each walking two or three;
    k = 72 ends on a partial k step that TMA fills with 0."""
    sm_count(5)
    launched = record_launches(monkeypatch)
    A, B, C = operands(136, 200, 72, dtype, layout)
    assert triton_impl.tma_ready(A) and triton_impl.tma_ready(B)
    for allow_tf32 in (False, True) if dtype == torch.float32 else (False,):
        tensor_cores = dtype != torch.float32 or allow_tf32
        path = "tma" if tensor_cores else "pointer"
        assert triton_impl.choose_path(A, B, tensor_cores) == path
        if tensor_cores:
            config = triton_impl.configuration(136, 200, 72, dtype, allow_tf32)
            assert (config["BLOCK_M"], config["BLOCK_N"], config["SPLITS"]) == (64, 64, 1)
        launched.clear()
        check("triton", ALPHA, A, B, BETA, C.clone(), f"{layout} tf32={allow_tf32}", allow_tf32)
        assert launched == [KERNEL_OF_PATH[path]]
    padded = torch.empty(136, 80, dtype=dtype, device=DEVICE)
    assert triton_impl.tma_ready(padded[:, :73])  # rows 160 or 320 bytes apart
    assert triton_impl.tma_ready(padded[:, :73].T)  # columns 160 or 320 bytes apart
    assert not triton_impl.tma_ready(padded[:, :74].contiguous())  # rows 148 or 296 bytes apart
    assert not triton_impl.tma_ready(padded[:, :74].contiguous().T)
    assert not triton_impl.tma_ready(padded[:, 1:])  # its address is off the 16-byte grid
    assert not triton_impl.tma_ready(padded[:, ::2])  # no stride 1
    assert triton_impl.tma_ready(padded[::2].T)  # columns 320 or 640 bytes apart
    assert not triton_impl.tma_ready(padded[:, ::2].T)  # no stride 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.usefixtures("tma_at_any_size")
def test_staged_path(monkeypatch, layout, dtype):
    """k = 41 and n = 27 give rows (or columns) of 82 and 54 bytes in 16-bit data (164 and 108
    in float32): TMA cannot fetch A or B. With the copy worth it (STAGE_MIN_REUSE lowered to
    fit the interpreter), each goes through aligned_copy and the TMA kernel takes them; an
    operand TMA can fetch is not copied; A and B are left as they were; below the threshold,
    the pointer kernel. IEEE float32 never stages."""
    m, n, k = 150, 27, 41
    monkeypatch.setattr(triton_impl, "STAGE_MIN_REUSE", n)
    copied, aligned_copy = [], triton_impl.aligned_copy
    monkeypatch.setattr(triton_impl, "aligned_copy", lambda t: copied.append(t) or aligned_copy(t))
    launched = record_launches(monkeypatch)
    A, B, C = operands(m, n, k, dtype, layout)
    A_before, B_before = A.clone(), B.clone()
    tensor_cores = dtype != torch.float32
    assert not triton_impl.tma_ready(A) and not triton_impl.tma_ready(B)
    path = "staged" if tensor_cores else "pointer"
    assert triton_impl.choose_path(A, B, tensor_cores) == path
    check("triton", ALPHA, A, B, BETA, C, f"{layout} {path}")
    assert launched == [KERNEL_OF_PATH[path]]
    assert [t.shape for t in copied] == ([A.shape, B.shape] if tensor_cores else [])
    assert_same_bits(A, A_before, "A after the call")
    assert_same_bits(B, B_before, "B after the call")
    A_aligned = padded_matrix(m, k, dtype, layout[0] == "T")
    copied.clear()
    check("triton", ALPHA, A_aligned, B, BETA, C, f"{layout} {path}, A aligned")
    assert [t.shape for t in copied] == ([B.shape] if tensor_cores else [])
    monkeypatch.setattr(triton_impl, "STAGE_MIN_REUSE", n + 1)  # A's n = 27 products: too few
    assert triton_impl.choose_path(A, B, tensor_cores) == "pointer"
    assert triton_impl.choose_path(A_aligned, B, tensor_cores) == path


def test_tma_min_volume(monkeypatch):
    """The real rule: tensor-core work of m n k < TMA_MIN_VOLUME takes the pointer kernel even
    when TMA could fetch its operands (1024^3, the decode steps of a 4096 x 4096 weight, k split
    as before), and is never staged; from TMA_MIN_VOLUME on (1536^3 either side of its edge,
    2048^3, 128 x 4096 x 11008) the TMA kernel takes it, staged where TMA cannot fetch an
    operand. IEEE float32 stays on the pointer kernel at every size, TF32 does not. The values
    are never read, and a small aligned call launches the pointer kernel."""
    dispatch = {
        (1024, 1024, 1024, "NN"): "pointer", (1024, 1024, 1023, "NN"): "pointer",
        (1536, 1536, 1528, "NN"): "pointer", (1536, 1536, 1536, "NN"): "tma",
        (2048, 2048, 2048, "NN"): "tma", (2048, 2048, 2047, "NN"): "staged",
        (1, 4096, 4096, "NT"): "pointer", (128, 4096, 4096, "NT"): "pointer",
        (128, 4096, 11008, "NT"): "tma", (128, 4096, 11007, "NT"): "pointer",
    }  # fmt: skip
    assert 1536 * 1536 * 1528 < triton_impl.TMA_MIN_VOLUME <= 1536**3  # its edge, both sides
    for (m, n, k, layout), path in dispatch.items():
        A = torch.empty(m, k, dtype=torch.bfloat16)
        B = torch.empty(n, k, dtype=torch.bfloat16).T if layout == "NT" else A.new_empty(k, n)
        assert triton_impl.choose_path(A, B, True) == path, (m, n, k)
    for m in (1, 128):  # one row of 4096 / 64 = 64 tiles: two ranges of k, either kernel
        assert triton_impl.configuration(m, 4096, 4096, torch.bfloat16)["SPLITS"] == 2
    A, B = torch.empty(2048, 2048), torch.empty(2048, 2048)
    assert (triton_impl.choose_path(A, B, False), triton_impl.choose_path(A, B, True)) == (
        "pointer",
        "tma",
    )
    launched = record_launches(monkeypatch)
    A, B, C = operands(64, 64, 32, torch.bfloat16, "NN")
    assert triton_impl.tma_ready(A) and triton_impl.tma_ready(B)
    check("triton", ALPHA, A, B, BETA, C, "below TMA_MIN_VOLUME")
    assert launched == ["gemm_kernel"]


@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "column-major"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aligned_copy(dtype, transposed):
    """aligned_copy keeps the values and the major order, and pads the leading dimension to the
    next multiple of 16 bytes, so that TMA can fetch it; the strides tell the padding."""
    t = random_matrix(37, 21, dtype, transposed)[:, 1:]  # 20 columns, off the 16-byte grid
    copy = triton_impl.aligned_copy(t)
    assert_same_bits(copy, t, "the copy")
    assert triton_impl.tma_ready(copy) and not triton_impl.tma_ready(t)
    per_16_bytes = 16 // t.itemsize
    leading = -(-(37 if transposed else 20) // per_16_bytes) * per_16_bytes
    assert copy.stride() == ((1, leading) if transposed else (leading, 1))


def test_split_rule():
    """k is split when C has fewer tiles than SMs, into the count that spreads tiles x splits
    units most evenly over 132 SMs (the fewest among equals), at most MAX_SPLITS, each range a
    whole number of k steps, MIN_SPLIT_STEPS or more, none empty; a term's additions stay
    within k. A one-row C (m <= ONE_ROW) takes `row_plan`'s width and split instead."""
    split = triton_impl.split_count
    assert split(132, 1000) == 1 and split(32, 7) == 1  # one tile per SM; k too short
    assert split(32, 64) == 4  # 128 units on 132 SMs (8: 256 units, two waves, no faster)
    assert split(86, 64) == 3  # 258 units, two waves of a third each (1 and 2: a full tile)
    assert split(1, 1000) == triton_impl.MAX_SPLITS
    # One row of tiles (m <= ONE_ROW): the width and split of `row_plan`, k steps of 128.
    for m, n, k, block_n, splits, k_per_split in (
        (1, 4096, 4096, 64, 2, 2048),  # the 7B decode step: 64 tiles of 16 x 64, 128 units
        (64, 11008, 4096, 128, 1, 4096),  # 86 tiles, unsplit (64 wide, split 2: three waves)
        (128, 4096, 11008, 64, 2, 5504),  # 11008 / 2 is 43 whole k steps
        (16, 32768, 4096, 128, 1, 4096),  # 256 tiles
        (1, 4096, 192, 128, 1, 256),  # two k steps, the second half past k
    ):
        config = triton_impl.configuration(m, n, k, torch.bfloat16)
        got = config["BLOCK_N"], config["SPLITS"], config["k_per_split"]
        assert got == (block_n, splits, k_per_split), (m, n, k)
    generator = torch.Generator().manual_seed(5)
    for _ in range(500):
        m, n, k = (
            int(torch.randint(1, limit, (1,), generator=generator)) for limit in (300, 9000, 9000)
        )
        config = triton_impl.configuration(m, n, k, torch.bfloat16)
        splits, k_per_split = config["SPLITS"], config["k_per_split"]
        assert (
            k_per_split % config["BLOCK_K"] == 0
            and (splits - 1) * k_per_split < k <= splits * k_per_split
        )
        assert triton_impl.additions(m, n, k, torch.bfloat16) <= k


def test_row_plan_fits_shared_memory():
    """A one-row plan's stages and its C tile (the TMA kernel rearranges C through shared memory
    while the stages stay live) fit ROW_BLOCK_SMEM_BYTES, within the H200's 227 KiB a block: a
    TF32 128 x 128 plan takes 2 stages (3 took 262168 bytes on the H200's compiler, over its
    232448), 16-bit plans keep the stages ROW_SMEM_BYTES gives them."""
    for m in (1, 16, 64, 128):
        for itemsize in (2, 4):
            for n, k in ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096)):
                tile, _ = triton_impl.row_plan(m, n, k, itemsize)
                stage = (tile["BLOCK_M"] + tile["BLOCK_N"]) * tile["BLOCK_K"] * itemsize
                c_tile = tile["BLOCK_M"] * tile["BLOCK_N"] * itemsize
                assert tile["num_stages"] * stage + c_tile <= 226 * 1024, (m, n, k, itemsize)
                if itemsize == 2:
                    assert tile["num_stages"] == min(6, 200 * 1024 // stage), (m, n, k)
    assert triton_impl.row_plan(128, 11008, 4096, 4)[0]["num_stages"] == 2


@pytest.mark.parametrize("m", [1, 7, 64, 128])
@pytest.mark.parametrize("k", [1024, 1001])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.usefixtures("tma_at_any_size")
def test_split_k(monkeypatch, m, k, dtype):
    """Decode-shaped NT calls (m token rows, W = B.T of 40 x k): one row of tiles, k split into
    the most ranges of MIN_SPLIT_STEPS k steps, two (16-bit) or four (float32's shorter k
    steps), on the TMA kernel for 16-bit and TF32 data whose rows TMA can fetch (k = 1024) and
    on the pointer kernel for IEEE float32 and for k = 1001 (W is never staged: m rows reuse it
    too little). Within the bound with the split's additions; the same bits twice; the count of
    each tile left at 0."""
    n = 40
    launched = record_launches(monkeypatch)
    A, B, C = operands(m, n, k, dtype, "NT")
    for allow_tf32 in (False, True) if dtype == torch.float32 else (False,):
        config = triton_impl.configuration(m, n, k, dtype, allow_tf32)
        assert config["SPLITS"] == (4 if dtype == torch.float32 else 2)
        assert config["BLOCK_M"] == max(16, 1 << (m - 1).bit_length())
        tensor_cores = dtype != torch.float32 or allow_tf32
        path = "tma" if tensor_cores and k == 1024 else "pointer"
        assert triton_impl.choose_path(A, B, tensor_cores) == path
        launched.clear()
        first, second = C.clone(), C.clone()
        check("triton", ALPHA, A, B, BETA, first, f"split k, tf32={allow_tf32}", allow_tf32)
        triton_impl.gemm(ALPHA, A, B, BETA, second, allow_tf32=allow_tf32)
        assert_same_bits(second, first, "a second run")
        assert launched == [KERNEL_OF_PATH[path]] * 2
    for _, counters in triton_impl.SPLIT_WORKSPACES.values():
        assert counters.count_nonzero() == 0, "a tile's count was not set back to 0"


def test_empty_launches_nothing(monkeypatch):
    """m == 0 or n == 0 returns C without touching the kernel."""
    monkeypatch.setattr(triton_impl, "gemm_kernel", None)
    C = torch.empty(0, 3, device=DEVICE)
    assert (
        triton_impl.gemm(
            1.0, torch.ones(0, 4, device=DEVICE), torch.ones(4, 3, device=DEVICE), 1.0, C
        )
        is C
    )


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(
    "path, shape",
    [("tma", (16, 264, 2048)), ("pointer", (16, 264, 2047)), ("staged", (1100, 1030, 131))],
)
@pytest.mark.usefixtures("tma_at_any_size")
def test_cuda_graph_replays_triton_paths(path, shape):
    """Triton's split launches (eight ranges of k: partials from the caching allocator, counts
    zeroed inside the capture) and its staged launch (the aligned copies captured with it)
    replay, twice on fresh data, with the bits of eager calls; the counts end at 0."""
    m, n, k = shape
    A, B, C = operands(m, n, k, torch.bfloat16, "NT" if path != "staged" else "NN")
    assert triton_impl.choose_path(A, B, True) == path
    assert (triton_impl.configuration(m, n, k, torch.bfloat16)["SPLITS"] > 1) == (path != "staged")
    triton_impl.gemm(ALPHA, A, B, BETA, C)  # compiles and loads the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_impl.gemm(ALPHA, A, B, BETA, C)
    for replay in range(2):
        A.copy_(random_matrix(*A.shape, torch.bfloat16))
        B.copy_(random_matrix(*B.shape, torch.bfloat16))
        C.copy_(random_matrix(m, n, torch.bfloat16))
        eager = C.clone()
        graph.replay()
        triton_impl.gemm(ALPHA, A, B, BETA, eager)
        torch.cuda.synchronize()
        assert_same_bits(C, eager, f"replay {replay} against eager")
    for _, counters in triton_impl.SPLIT_WORKSPACES.values():
        assert counters.count_nonzero() == 0, "a tile's count was not set back to 0"


# Compiles triton_impl's kernels for sm_90 without a GPU and reports what each build's PTX has:
# wgmma or mma.sync instructions, TMA copies, a rounding of inputs to TF32, the split launch's
# atomic count with the barrier before it and its L2 reads of the partials. Pointers are given
# the 16-byte alignment Triton sees at a launch. Run in a child process: under
# TRITON_INTERPRET=1 the kernels cannot be compiled.
TRITON_PTX_SCRIPT = """
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_impl

def facts(kernel_name, dtype, precision, layout, m, n, k):
    kernel = getattr(triton_impl, kernel_name)
    config = triton_impl.configuration(m, n, k, getattr(torch, dtype), precision == "tf32")
    bm, bn, bk, splits = (config[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLITS"))
    a_t, b_t = layout[0] == "T", layout[1] == "T"
    element = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    constexprs = {"READ_AB": True, "READ_C": True, "INPUT_PRECISION": precision, "UPCAST": False,
                  "GROUP_M": triton_impl.GROUP_M, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                  "SPLITS": splits, "A_TRANSPOSED": a_t, "B_TRANSPOSED": b_t, "stride_cn": 1,
                  # the pointer kernel's stride-1 dimension of A and of B
                  "stride_am" if a_t else "stride_ak": 1, "stride_bk" if b_t else "stride_bn": 1}
    if splits == 1:
        constexprs.update(partials_ptr=None, counters_ptr=None)
    constexprs = {name: value for name, value in constexprs.items() if name in kernel.arg_names}
    a_block, b_block = [bk, bm] if a_t else [bm, bk], [bn, bk] if b_t else [bk, bn]
    kinds = {"a_desc": f"tensordesc<{element}{a_block}>",
             "b_desc": f"tensordesc<{element}{b_block}>", "a_ptr": "*" + element,
             "b_ptr": "*" + element, "c_ptr": "*" + element,
             "partials_ptr": "*fp32", "counters_ptr": "*i32", "alpha": "fp32", "beta": "fp32"}
    signature = {name: "constexpr" if name in constexprs else kinds.get(name, "i32")
                 for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*")}
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    source = ASTSource(kernel, signature, constexprs, aligned)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    atomic = ptx.find("atom.global.gpu.acq_rel.add")
    after_stores = ptx[ptx.rfind("st.global", 0, atomic) : atomic] if atomic >= 0 else ""
    return {"wgmma": ptx.count("wgmma.mma_async"), "mma.sync": ptx.count("mma.sync.aligned"),
            "tma": ptx.count("cp.async.bulk.tensor"), "tf32 rounded": "cvt.rna.tf32" in ptx,
            "atomics": ptx.count("atom.global"), "barrier first": "bar.sync" in after_stores,
            "L2 reads": ptx.count("ld.global.cg")}

TENSOR_CORES = [("bfloat16", "ieee"), ("float16", "ieee"), ("float32", "tf32")]
builds = [("gemm_kernel", dtype, precision, "NN", 4096, 4096, 4096)
          for dtype, precision in TENSOR_CORES + [("float32", "ieee")]]
builds += [("gemm_tma_kernel", dtype, precision, layout, 4096, 4096, 4096)
           for dtype, precision in TENSOR_CORES for layout in ("NN", "NT", "TN", "TT")]
builds += [("gemm_tma_kernel", "bfloat16", "ieee", "NT", m, 4096, 4096) for m in (1, 64)]
builds += [("gemm_kernel", "float32", "ieee", "NN", 1, 4096, 4096)]
builds += [("gemm_kernel", "bfloat16", "ieee", "NT", m, 4096, 4096) for m in (1, 64)]
print(json.dumps({" ".join(map(str, build)): facts(*build) for build in builds}))
"""


def test_triton_ptx():
    """Built for sm_90, both kernels run 16-bit and TF32 tiles on wgmma, and keep IEEE float32
    off the tensor cores; TF32 inputs pass unrounded (the chop the TF32 bound allows). The TMA
    kernel compiles in all four layouts for each tensor-core type, with TMA copies. A split
    launch has one atomic, the count, after a barrier that follows its partial stores, and
    reads the partials from L2; a decode tile of 16 rows runs on mma.sync (wgmma's tile is 64
    rows), one of 64 rows on wgmma, on either kernel."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-c", TRITON_PTX_SCRIPT],
        cwd=HERE, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    found = json.loads(child.stdout)
    for name, facts in found.items():
        kernel, dtype, precision, layout, m, n, k = name.split()
        split = int(m) < 128
        assert not facts["tf32 rounded"], name
        assert facts["atomics"] == split, name
        if split:
            assert facts["barrier first"] and facts["L2 reads"] > 0, name
        if precision == "tf32" or dtype != "float32":
            assert facts["wgmma" if int(m) >= 64 else "mma.sync"] > 0, name
        else:
            assert facts["wgmma"] == facts["mma.sync"] == 0, name
        assert (facts["tma"] > 0) == (kernel == "gemm_tma_kernel"), name


# A learner's first call, in a fresh interpreter with nothing of test.py loaded: triton_impl must
# carry its own interpreter fixes (patch_triton_interpreter), or this fails inside Triton.
FRESH_CALL_SCRIPT = """
import sys
import torch
import triton_impl
A, B, C = torch.load(sys.argv[1])
torch.save(triton_impl.gemm(0.5, A, B, 2.0, C), sys.argv[2])
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_runs_in_a_fresh_interpreter(tmp_path, dtype):
    """`TRITON_INTERPRET=1 python -c "import triton_impl; triton_impl.gemm(...)"` on CPU tensors
    works in a fresh process, without test.py's set-up, and lands within the bound: a k past
    one BLOCK_K makes the kernel loop over a runtime bound (numpy 2.4's int() failure), and
    bfloat16 exercises the exact float32 <-> bfloat16 conversions."""
    m, n, k = 33, 9, 100
    A, B, C = (torch.randn(r, c).to(dtype) for r, c in ((m, k), (k, n), (m, n)))
    torch.save((A, B, C), tmp_path / "operands.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-c", FRESH_CALL_SCRIPT, tmp_path / "operands.pt", tmp_path / "C.pt"],
        cwd=HERE, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    result = torch.load(tmp_path / "C.pt")
    exact = reference.gemm(0.5, A, B, 2.0, C)
    bound = error_bound("triton", 0.5, A, B, 2.0, C, exact)
    assert_within_bound(result, exact, bound, f"triton in a fresh process, {dtype}")


# --- The launch: Triton's host work done once per specialisation (triton_impl.launch) ---


def sm90_backend():
    """Triton's backend for the H200 (sm_90), which needs no GPU."""
    return make_backend(GPUTarget("cuda", 90, 32))


def tritons_binder(kernel):
    """What kernel[grid](*args, **constants) runs first in Triton 3.6, for sm_90: its binder,
    binder(*args, **constants) -> (the arguments by name, their specialisation, the options).
    Built from the kernel's Python function: under the interpreter a kernel is no JITFunction."""
    jit = JITFunction(kernel.fn)
    return create_function_from_signature(jit.signature, jit.params, sm90_backend())


def off_alignment(rows, cols, dtype):
    """A row-major rows x cols matrix whose address is one element past a 16-byte boundary."""
    return torch.empty(rows * cols + 1, dtype=dtype, device=DEVICE)[1:].view(rows, cols)


def test_specialisation_is_tritons():
    """specialisation() tells two ints, or two tensors, apart exactly when Triton's binder
    (native_specialize_impl) does: 1, multiples of 16 and not, on both sides of 2**31; each
    dtype at addresses 16-byte aligned and not."""
    ints = [0, 1, 2, 15, 16, 17, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 16, 2**62]
    buffer = torch.empty(64, device=DEVICE)
    tensors = [buffer.to(dtype)[offset:] for dtype in DTYPES for offset in (0, 1, 4, 8)]
    backend = sm90_backend()
    for values, ours in [
        (ints, lambda x: triton_impl.specialisation((x,), ())),
        (tensors, lambda t: triton_impl.specialisation((), (t,))),
    ]:
        theirs = lambda x: native_specialize_impl(backend, x, False, True, True)  # noqa: E731
        for x in values:
            for y in values:
                assert (ours(x) == ours(y)) == (theirs(x) == theirs(y)), (x, y)


def launch_key_cases():
    """gemm calls (alpha, A, B, beta, C, allow_tf32) that vary everything Triton compiles for:
    dtypes, layouts, the three paths, split and not, sizes and strides of 1, multiples of 16 and
    not, past 2**31 on unit dims, pointers off 16-byte alignment, alpha or beta 0. The values
    are never read: the launches are recorded, not run."""
    for dtype in DTYPES:
        for layout in LAYOUTS:
            for m, n, k in [(1, 40, 1024), (1, 48, 1024), (17, 33, 65), (64, 64, 64), (3, 1, 7)]:
                A, B, C = (torch.empty_like(t) for t in operands(m, n, k, dtype, layout))
                yield ALPHA, A, B, BETA, C, False
                yield 0.0, A, B, BETA, C, False
                yield ALPHA, A, B, 0.0, C, dtype == torch.float32
    for dtype in DTYPES:  # the same shapes at addresses one element off 16 bytes
        for m, n, k in [(64, 64, 64), (1, 40, 1024), (1100, 1030, 131)]:
            A, B, C = (off_alignment(*shape, dtype) for shape in ((m, k), (k, n), (m, n)))
            yield ALPHA, A, B, BETA, C, False
            yield ALPHA, A.clone(), B.clone(), BETA, C, False  # A and B aligned, C not
    huge = 2**31 + 16
    A = torch.empty(64, device=DEVICE).as_strided((1, 64), (huge, 1))
    C = torch.empty(32, device=DEVICE).as_strided((1, 32), (huge, 1))
    yield ALPHA, A, torch.empty(64, 32, device=DEVICE), BETA, C, False


@pytest.mark.usefixtures("tma_at_any_size")
def test_launch_key_holds_tritons(monkeypatch):
    """Two of gemm's launches with one key (the kernel, specialisation() of the arguments the
    caller names, the constants) have one Triton key (its binder's specialisation and options):
    the key misses nothing Triton compiles for (without any one part of specialisation(), two of
    these launches share a key that Triton tells apart). The calls reach 197 of Triton's keys."""
    launches = []
    monkeypatch.setattr(triton_impl, "launch", lambda *launch: launches.append(launch))
    for alpha, A, B, beta, C, allow_tf32 in launch_key_cases():
        triton_impl.gemm(alpha, A, B, beta, C, allow_tf32=allow_tf32)
    binders, tritons_key_of = {}, {}
    for kernel, _programs, args, constants, specialised in launches:
        if kernel not in binders:
            binders[kernel] = tritons_binder(kernel)
        binder = binders[kernel]
        _, tritons_specialisation, options = binder(*args, **constants)
        theirs = str(tritons_specialisation) + str(options)
        ours = (kernel, specialised, *constants.values())
        assert tritons_key_of.setdefault(ours, theirs) == theirs, (ours, theirs)
    assert len(set(tritons_key_of.values())) >= 197


class CompiledStandIn:
    """Stands in for a CompiledKernel: run(grid x, y, z, stream, ...) records the stream and the
    arguments it hands the kernel."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, runs):
        self.runs = runs

    def run(self, grid_x, grid_y, grid_z, stream, function, metadata, *hooks_and_args):
        self.runs.append((stream, hooks_and_args[3:]))


class KernelStandIn(JITFunction):
    """A JITFunction whose kernel[grid](...) records the call instead of compiling it, and returns a
    CompiledStandIn."""

    def __init__(self, fn, through_triton, runs):
        super().__init__(fn)
        self.through_triton, self.runs = through_triton, runs

    def __getitem__(self, grid):
        def run(*args, **constants):
            self.through_triton.append(grid)
            return CompiledStandIn(self.runs)

        return run


def test_launch_goes_through_triton_once_per_key(monkeypatch):
    """The first launch of a key goes through kernel[grid], later ones to the compiled kernel's
    launcher with the arguments Triton binds, in order, on the stream current at each call; a
    pointer off 16-byte alignment or a size of 1 is a new key; a launch hook or a pre-run hook
    sends every launch through Triton."""
    recorded = []
    monkeypatch.setattr(triton_impl, "launch", lambda *launch: recorded.append(launch))
    A, B, C = operands(64, 48, 32, torch.float32, "NN")
    misaligned = off_alignment(64, 32, torch.float32)
    for A_, C_ in [(A, C), (A, C), (misaligned, C), (A, C), (A[:2], C[:2]), (A[:1], C[:1])]:
        triton_impl.gemm(ALPHA, A_, B, BETA, C_)
    monkeypatch.undo()
    streams = [7]
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda _: streams[-1])
    monkeypatch.setattr(triton_impl, "driver", SimpleNamespace(active=active))
    monkeypatch.setattr(triton_impl, "COMPILED", {})
    through_triton, runs = [], []
    kernel = KernelStandIn(triton_impl.gemm_kernel.fn, through_triton, runs)
    launch = lambda i: triton_impl.launch(kernel, *recorded[i][1:])  # noqa: E731

    launch(0), launch(1)
    assert len(through_triton) == 1 and len(runs) == 1
    bound, _, _ = tritons_binder(kernel)(*recorded[1][2], **recorded[1][3])
    stream, args = runs[0]
    assert stream == 7 and len(args) == len(bound)
    assert all(ours is theirs for ours, theirs in zip(args, bound.values(), strict=True))
    streams.append(8)  # another stream made current
    launch(1)
    assert runs[-1][0] == 8 and len(through_triton) == 1
    launch(2), launch(2), launch(3)
    assert len(through_triton) == 2 and len(runs) == 4, "a misaligned A needs its own kernel"
    launch(4), launch(5), launch(5)
    assert len(through_triton) == 4 and len(runs) == 5, "so does m = 1, after m = 2"
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(1)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(through_triton) == 5, "a launch hook is called on Triton's path only"
    kernel.add_pre_run_hook(lambda *args, **kwargs: None)
    launch(1)
    assert len(through_triton) == 6 and len(runs) == 5


class RecordingCompiled:
    """A CompiledKernel whose launches also record the stream each goes to."""

    def __init__(self, compiled, streams):
        self.compiled, self.streams = compiled, streams
        self.function, self.packed_metadata = compiled.function, compiled.packed_metadata

    def run(self, *launch):
        self.streams.append(launch[3])
        self.compiled.run(*launch)


def record_direct_launches():
    """The list of the streams of the direct launches of the kernels compiled so far."""
    streams = []
    for key, (compiled, rest) in triton_impl.COMPILED.items():
        triton_impl.COMPILED[key] = RecordingCompiled(compiled, streams), rest
    return streams


@pytest.mark.skipif(not ON_GPU, reason="a direct launch runs a compiled kernel: GPU only")
@pytest.mark.parametrize(
    "path, shape, layout",
    [("pointer", (65, 63, 33), "NN"), ("tma", (300, 264, 136), "NN"),
     ("staged", (1100, 1030, 131), "NN"), ("tma", (16, 264, 2048), "NT"),
     ("pointer", (16, 264, 2047), "NT")],
    ids=str,
)  # fmt: skip
@pytest.mark.usefixtures("tma_at_any_size")
def test_direct_launch_gives_tritons_bits(monkeypatch, path, shape, layout):
    """Each path, split and not: the first call goes through kernel[grid], the second straight to
    the compiled kernel, a third through kernel[grid] again (a launch hook is set): one set of
    bits."""
    monkeypatch.setattr(triton_impl, "COMPILED", {})
    m, n, k = shape
    A, B, C = operands(m, n, k, torch.bfloat16, layout)
    assert triton_impl.choose_path(A, B, True) == path
    first, direct, hooked = C.clone(), C.clone(), C.clone()
    triton_impl.gemm(ALPHA, A, B, BETA, first)
    streams = record_direct_launches()
    triton_impl.gemm(ALPHA, A, B, BETA, direct)
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        triton_impl.gemm(ALPHA, A, B, BETA, hooked)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert streams == [torch.cuda.current_stream().cuda_stream]
    assert_same_bits(direct, first, "direct against kernel[grid]")
    assert_same_bits(hooked, first, "kernel[grid] with a hook against without")


@pytest.mark.skipif(not ON_GPU, reason="a direct launch runs a compiled kernel: GPU only")
def test_direct_launch_on_a_second_stream(monkeypatch):
    """A direct split launch made on a second stream goes to that stream, with that stream's
    own workspace, and gives the bits of the first call."""
    monkeypatch.setattr(triton_impl, "COMPILED", {})
    A, B, C = operands(16, 264, 2048, torch.bfloat16, "NT")
    assert triton_impl.configuration(16, 264, 2048, torch.bfloat16)["SPLITS"] > 1
    first = C.clone()
    triton_impl.gemm(ALPHA, A, B, BETA, first)
    streams = record_direct_launches()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = C.clone()
        triton_impl.gemm(ALPHA, A, B, BETA, again)
    side.synchronize()
    assert streams == [side.cuda_stream]
    assert (torch.cuda.current_device(), side.cuda_stream) in triton_impl.SPLIT_WORKSPACES
    assert_same_bits(again, first, "on a second stream")


# (4) CuTe: builds, dispatch and PTX ------------------------------------------------------------
# The CuTe kernels compile without a GPU (CUTE_DSL_ARCH=sm_90a): these tests read their PTX and
# the host-side dispatch; those that launch a step (edge shapes whose strides TMA accepts: the
# contract's shapes mostly have unaligned rows and take the plain kernel) need the GPU.


needs_cute = pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")


@needs_cute
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("majors", [(True, True), (True, False), (False, True), (False, False)])
def test_cute_hopper_ptx(dtype, majors):
    """The Hopper build loads A and B with TMA (cp.async.bulk.tensor) completing on mbarriers,
    multiplies with wgmma (TF32 for float32, K-major only, its inputs not rounded first) and
    splits the block into producer and consumers (setmaxnreg)."""
    if dtype == torch.float32 and majors != (True, True):
        pytest.skip("TF32 wgmma takes K-major operands only; float32 goes to the plain kernel")
    ptx = cute_step2.ptx_of(dtype, *majors, tile_n=128)
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg"):
        assert instruction in ptx, instruction
    kind = {torch.float32: "tf32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert f".f32.{kind}.{kind}" in ptx and "cvt.rna.tf32" not in ptx


@needs_cute
@pytest.mark.parametrize("read_c", [True, False])
def test_cute_hopper_reads_c_only_if_beta(read_c):
    """A and B arrive by TMA, so the only plain global loads of the Hopper build are of C, and
    the beta == 0 build has none."""
    ptx = cute_step2.ptx_of(torch.bfloat16, tile_n=256, read_c=read_c)
    assert ("ld.global" in ptx) == read_c


@needs_cute
def test_cute_hopper_epilogue_in_pairs():
    """A row-major C whose rows start on 2-element boundaries gets the paired epilogue on whole
    tiles: two adjacent columns per load and store (ld.global.v2 of two bf16, st.global.b32),
    and still one element at a time on the edge tiles; any other C, one element at a time."""
    pairs = cute_step2.ptx_of(torch.bfloat16, c_pairs=True)
    single = cute_step2.ptx_of(torch.bfloat16, c_pairs=False)
    assert "ld.global.v2.b16" in pairs and "st.global.b32" in pairs
    assert "ld.global.b16" in pairs and "st.global.b16" in pairs
    assert "ld.global.v2" not in single and "st.global.b32" not in single
    C = torch.empty(6, 8)
    assert cute_step2.in_pairs(C) and cute_step2.in_pairs(C[:, :5])
    assert not cute_step2.in_pairs(C.T) and not cute_step2.in_pairs(C[:, 1:])
    assert not cute_step2.in_pairs(torch.empty(6, 7)[:, :5])  # rows 7 elements apart


@needs_cute
@pytest.mark.parametrize("tile_n", [64, 128, 256])
@pytest.mark.parametrize("read_c", [True, False])
def test_cute_hopper_epilogue_by_tma_ptx(tile_n, read_c):
    """A 16-bit row-major C that TMA can store gets the epilogue through shared memory: per
    32-column chunk, two stmatrix.x4 a thread, a fence to the async proxy and one TMA store
    (tile_n / 32 of them, each issued by one elected thread and counted by bulk groups); C is
    still read (beta != 0) by plain loads, and the partial tiles still store element by
    element. Its ring keeps 4 stages at 128 x 256 and 6 at 128 x 128, 8 at 128 x 64."""
    ptx = cute_step2.ptx_of(
        torch.bfloat16, tile_n=tile_n, read_c=read_c, c_pairs=True, c_by_tma=True,
        cluster_m=1 if tile_n == 64 else 2,
    )  # fmt: skip
    chunks = tile_n // cute_step2.EPILOGUE_COLUMNS
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared::cta") == chunks
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4") == 2 * chunks
    assert ptx.count("cp.async.bulk.commit_group") == chunks
    assert ptx.count("fence.proxy.async.shared::cta") == chunks
    assert ("ld.global" in ptx) == read_c and "st.global.b16" in ptx
    stages = cute_step2.ring_stages(128, tile_n, c_by_tma=True)
    assert ptx.count("mbarrier.init") == 2 * stages
    assert stages == {64: 8, 128: 6, 256: 4}[tile_n]
    assert "stmatrix" not in cute_step2.ptx_of(torch.bfloat16, tile_n=tile_n, c_pairs=True)


@needs_cute
def test_cute_hopper_stores_by_tma_rule():
    """stores_by_tma: 16-bit C on 128-row tiles whose rows TMA can store (stride 1 along a row,
    16-byte base and row stride); not float32, not 64-row (decode) tiles, not a column-major
    C, a row stride of 8 bytes or a base 2 bytes off 16."""
    rule = cute_step2.stores_by_tma
    C = torch.empty(64, 72, dtype=torch.bfloat16)
    assert rule(C, 128) and rule(C[:, :50], 128) and rule(C.half(), 128)
    assert not rule(C, 64) and not rule(C.float(), 128) and not rule(C.T, 128)
    assert not rule(torch.empty(64, 4, dtype=torch.bfloat16), 128)  # rows 8 bytes apart
    assert not rule(C[:, 1:], 128)  # the base 2 bytes past a 16-byte boundary


@needs_cute
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_plain_ptx(dtype):
    """The plain kernel is FMAs on the CUDA cores, IEEE float32 for float32: no wgmma, no TMA;
    its alpha == 0 build loads nothing but C (its thread's 8 x 8 elements, no tiles in shared
    memory), and with beta == 0 nothing at all; shared memory is read as 128-bit vectors."""
    ptx = cute_step1.ptx_of(dtype)
    assert "fma.rn.f32" in ptx and "wgmma" not in ptx and "cp.async.bulk" not in ptx
    assert "ld.shared.v4" in ptx
    no_ab = cute_step1.ptx_of(dtype, read_ab=False)
    assert "ld.shared" not in no_ab and "bar.sync" not in no_ab
    assert no_ab.count("ld.global") == cute_step1.PLAIN_PER_THREAD**2
    assert "ld.global" not in cute_step1.ptx_of(dtype, read_ab=False, read_c=False)


@needs_cute
def test_cute_plain_vector_build():
    """Row-major A and B whose bases, row strides, k and n are multiples of 4 take the build
    that loads 4 adjacent float32 as one ld.global.v4.b32; anything else the scalar build."""
    vectors = cute_step1.ptx_of(torch.float32, config=cute_step1.PLAIN_VECTORS)
    scalars = cute_step1.ptx_of(torch.float32, config=cute_step1.PLAIN_SCALARS)
    assert "ld.global.v4.b32" in vectors and "ld.global.v4" not in scalars
    ok = cute_step1.vector_loads_ok
    A, B = torch.randn(6, 8), torch.randn(8, 12)
    assert ok(A, B) and ok(A[:, :4], B[:4])
    assert not ok(A[:, :7], B[:7])  # k = 7: a vector would straddle the edge
    assert not ok(A, B[:, 1:])  # base not on a 4-element boundary, n = 11
    assert not ok(A.T.contiguous().T, B)  # column-major A
    assert not ok(torch.randn(6, 10)[:, :8], B)  # rows 10 elements apart


@needs_cute
def test_cute_hopper_cluster_ptx():
    """Clusters of 2 blocks along m load B with a multicast TMA copy and release each stage on
    the partner's "empty" barrier too; clusters of 1 do neither."""
    pair = cute_step2.ptx_of(torch.bfloat16, cluster_m=2)
    single = cute_step2.ptx_of(torch.bfloat16, cluster_m=1)
    assert ".multicast::cluster" in pair and "mbarrier.arrive.shared::cluster" in pair
    assert ".multicast::cluster" not in single


@needs_cute
def test_cute_dispatch():
    """Which kernel takes which operands (choose_kernel's rules), read on CPU tensors."""
    choose = cute_step2.choose_kernel
    for a_t, b_t in ((False, False), (False, True), (True, False), (True, True)):
        A = padded_matrix(37, 21, torch.bfloat16, a_t, "cpu")
        B = padded_matrix(21, 45, torch.bfloat16, b_t, "cpu")
        assert choose(A, B, False) == ("hopper", not a_t, b_t)
        A32, B32 = A.float(), B.float()  # float copies are contiguous: 21 * 4 bytes per row
        assert choose(A32, B32, True).kernel == "plain"
    A = padded_matrix(37, 21, torch.float32, False, "cpu")
    B = padded_matrix(21, 45, torch.float32, True, "cpu")
    assert choose(A, B, True) == ("hopper", True, True)
    assert choose(A, B, False).kernel == "plain"
    A_t = padded_matrix(37, 21, torch.float32, True, "cpu")  # M-major: no TF32 wgmma
    assert choose(A_t, B, True).kernel == "plain"
    A, B = padded_matrix(37, 21, torch.bfloat16, False, "cpu"), B.bfloat16()
    assert choose(A[:, 1:], B[1:], False).kernel == "plain"  # base not 16-byte aligned
    assert choose(A[:, ::2], B[::2], False).kernel == "plain"  # no stride-1 dimension
    A, B = torch.randn(5, 7).bfloat16(), torch.randn(7, 8).bfloat16()
    assert choose(A, B, False).kernel == "plain"  # rows of 14 bytes: off 16-byte boundaries


def test_cute_hopper_tile_rule():
    """hopper_tile_n's widths: 256 once C has a 128 x 256 tile per SM, unless 128 x 128 tiles
    fill their waves at least 10% better (3072^2: 5 waves of 128 against 3 of 256, wave_time
    5 against 6); 64 where 128 x 128 tiles would leave more than half the SMs idle and
    128 x 64 ones fit one wave (medium sizes); else 128; decode steps (one tile row, m <= 128)
    never 64."""
    rule = cute_step2.hopper_tile_n
    squares = (256, 512, 1024, 1040, 2048, 3072, 4096, 8192)
    assert [rule(s, s) for s in squares] == [64, 64, 64, 128, 128, 128, 256, 256]
    assert cute_step2.wave_time(3072, 3072, 128) == 5 and cute_step2.wave_time(3072, 3072, 256) == 6
    assert rule(4096, 11008) == 256  # 21 against 22: not 10% better
    assert rule(16384, 4096) == 256 and rule(1024, 2048) == 128 and rule(2048, 1024) == 128
    assert [rule(m, 4096) for m in (1, 16, 64, 65, 128)] == [128] * 5
    assert rule(129, 4096) == 64 and rule(129, 8192) == 128  # 128 and 256 tiles of 128 x 64


@needs_cute
def test_cute_narrow_tiles_run_alone(monkeypatch):
    """A call on 64-column tiles builds clusters of 1 (in pairs they measured 1.5x slower), one
    block a tile, which reads C before its k loop; 128-column tiles run alone too (in pairs
    0.86x cuBLAS at 2048^3, alone 0.92x), and at 2048^2 a block computes two tiles, so C is
    read after each k loop; 256-column tiles keep the pairs asked for."""
    builds = []

    def recorder(*key):
        builds.append(key)
        return lambda *args: None

    monkeypatch.setattr(cute_step2, "compile_hopper", recorder)
    monkeypatch.setattr(cute_step2, "sm_count", lambda device: 132)
    # (size, tile_n, cluster_m, C read before the k loop: one tile a block)
    cases = ((1024, 64, 1, True), (2048, 128, 1, False), (4096, 256, 2, False))
    for size, tile_n, cluster_m, early in cases:
        A, B, C = (torch.empty(size, size, dtype=torch.bfloat16) for _ in range(3))
        cute_step2.run_checked(A, B, C, 1.0, 1.0, True, True, False, 2)
        assert builds.pop()[3:] == (128, tile_n, True, True, cluster_m, early, True)


# The decode shapes of a 7B-class layer (issue 13): m rows of activations times W^T.
DECODE_NK = [(4096, 4096), (11008, 4096), (4096, 11008)]


@needs_cute
def test_cute_split_plan():
    """split_plan, the host's rule (a unit's time is its k steps at STEP_US each; the chip's,
    its busiest SM's or W's bytes at HBM's rate): up to 64 tokens, n = 4096 splits k into 4
    slices, 128 units of 64 x 128 for 132 SMs, and n = 11008 into 2 slices of 64 x 256 tiles (86
    units; its 86 unsplit 64 x 128 tiles were the slowest plan measured); 65 to 128 tokens split
    n = 4096 twice on two rows of 64-row tiles and leave n = 11008 to step 2's 128 x 128 tiles,
    which its 128 x 11008 partials would cost more than a split gains; a C with a 128 x 128
    tile per SM, or a k too short for two slices, runs step 2 (None). Over many shapes, every
    slice holds at least one k step, so a term meets k_s + S - 1 <= k additions (the count
    `roundings` keeps)."""
    plan = cute_step3.split_plan
    for m in (1, 16, 64):
        assert plan(m, 4096, 4096, 2) == (128, 4)  # 32 tiles x 4 slices of 16 k steps
        assert plan(m, 4096, 11008, 2) == (128, 4)  # 32 tiles x 4 slices of 43
        assert plan(m, 11008, 4096, 2) == (256, 2)  # 43 tiles x 2 slices of 32
    for m in (65, 128):
        assert cute_step3.split_tile_m(m) == 64
        assert plan(m, 4096, 4096, 2) == plan(m, 4096, 11008, 2) == (128, 2)  # 2 x 32 x 2 units
        assert plan(m, 11008, 4096, 2) is None  # 86 tiles of 128 x 128, one wave
    assert plan(4096, 4096, 4096, 2) is None  # 1024 tiles
    assert plan(129, 16384, 4096, 2) is None  # 2 x 128 = 256 tiles
    assert plan(64, 4096, 960, 2) is None  # 15 k steps: no two slices of 8
    for m, n, k, itemsize in np.ndindex(5, 4, 12, 2):
        m, n, k, itemsize = 1 + 97 * m, 1 + 1500 * n, 1 + 700 * k, 2 * (1 + itemsize)
        chosen = plan(m, n, k, itemsize)
        if chosen is None:
            continue
        tile_n, splits = chosen
        tile_k = cute_step2.TILE_K_BYTES // itemsize
        steps = -(-k // tile_k)
        per_slice = -(-steps // splits)
        assert splits >= 2 and per_slice >= cute_step3.MIN_SPLIT_STEPS
        assert steps - (splits - 1) * per_slice >= 1, "the last slice is empty"
        assert min(per_slice * tile_k, k) + splits - 1 <= k


@needs_cute
def test_cute_split_dispatch():
    """choose_split, read on CPU tensors: a decode product that step 2 would run on the Hopper
    kernel is split, in every layout; operands TMA refuses, IEEE float32 and a short k are not."""
    W = padded_matrix(4096, 4096, torch.bfloat16, False, "cpu")  # (n, k)
    for a_t, b_t in ((False, True), (False, False), (True, True)):
        x = padded_matrix(16, 4096, torch.bfloat16, a_t, "cpu")
        B = W.T if b_t else W
        assert cute_step3.choose_split(x, B, False) == (not a_t, b_t, 128, 4)
    x = padded_matrix(16, 4096, torch.bfloat16, False, "cpu")
    assert cute_step3.choose_split(x[:, 1:], W.T[1:], False) is None  # off the 16-byte grid
    assert cute_step3.choose_split(x.float(), W.T.float(), False) is None  # IEEE: step 1
    assert cute_step3.choose_split(x.float(), W.T.float(), True) == (True, True, 128, 4)  # TF32
    assert cute_step3.choose_split(x[:, :512], W.T[:512], False) is None  # 8 k steps


@needs_cute
@pytest.mark.parametrize("read_c", [True, False])
def test_cute_split_k_ptx(read_c):
    """The split build is two kernels: the Hopper mainloop (TMA, mbarriers, wgmma) storing
    float32 partials, then sum_partials, which adds them with plain float32 adds and reads C
    only if beta != 0. No atomic or reduction instruction anywhere: the sum's order is fixed."""
    ptx = cute_step3.ptx_of(torch.bfloat16, read_c=read_c)
    split_k, sum_partials = ptx.split(".entry")[1:]
    assert "split_k_kernel" in split_k and "sum_partials" in sum_partials
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier", "setmaxnreg"):
        assert instruction in split_k, instruction
    assert "st.global.v2.b32" in split_k  # float32 partials in column pairs on whole tiles
    assert "ld.global" not in split_k  # A and B come by TMA, C is not read
    assert "add.f32" in sum_partials and "wgmma" not in sum_partials
    assert ("ld.global.b16" in sum_partials) == read_c
    assert not re.search(r"^\s+(@%p\d+\s+)?(atom|red)\.", ptx, re.MULTILINE)


@needs_cute
@pytest.mark.parametrize("impl", ["cute", *CUTE_STEPS])
def test_cute_validates_before_any_cuda_call(monkeypatch, impl):
    """Bad operands raise check_operands' error and CPU tensors a ValueError, before a kernel is
    compiled or a CUDA API is touched; m == 0 returns C without a launch. So does each step."""

    def no_kernel(*args):
        raise AssertionError("a kernel was built")

    monkeypatch.setattr(cute_step1, "compile_plain", no_kernel)
    monkeypatch.setattr(cute_step2, "compile_hopper", no_kernel)
    monkeypatch.setattr(cute_step3, "compile_split_k", no_kernel)
    gemm = entry_point(impl)
    A, B, C = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gemm(1.0, A, B, 1.0, C)
    with pytest.raises(ValueError, match="B has 5 rows"):
        gemm(1.0, A, torch.randn(5, 5), 1.0, C)
    if ON_GPU:
        empty = torch.empty(0, 5, device="cuda")
        assert gemm(1.0, A[:0].cuda(), B.cuda(), 1.0, empty) is empty


@needs_cute
def test_cute_impl_runs_the_last_step(monkeypatch):
    """cute_impl.gemm is the last step's gemm, its arguments passed on unchanged."""
    calls = []
    monkeypatch.setattr(cute_step4, "gemm", lambda *args, **kwargs: calls.append((args, kwargs)))
    A, B, C = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    cute_impl.gemm(0.5, A, B, 2.0, C, allow_tf32=True, cluster_m=1)
    assert calls == [((0.5, A, B, 2.0, C), {"allow_tf32": True, "cluster_m": 1})]


@needs_cute
def test_cute_build_is_a_tvm_ffi_function_over_tensors():
    """What gemm caches and calls is the TVM-FFI function over torch tensors: A (m, k), B (k, n)
    and C (m, n) share their size symbols, so each call checks that they agree, and alpha and
    beta are float32 parameters. It refuses CPU tensors itself, before any launch (gemm refuses
    them first, with its own message)."""
    plain = cute_step1.compile_plain(torch.float32, True, True, cute_step1.PLAIN_SCALARS)
    A, B, C = torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 5)
    signature = (
        r"launch_plain\(A: Tensor\(\[(n\d), (n\d)\], float32\), B: Tensor\(\[\2, (n\d)\], "
        r"float32\), C: Tensor\(\[\1, \3\], float32\), alpha: float32, beta: float32\)"
    )
    before = C.clone()
    with pytest.raises(ValueError, match=signature + ".*expected device_type=cuda"):
        plain(A, B, C, 1.0, 0.5)
    assert_same_bits(C, before, "C after a refused call")


# Each step of the CuTe lesson on its own: m, n and k of 1, primes, one past a tile of either
# kernel, a k that ends on a partial k step of both, and a decode shape that step 3 splits.
STEP_SHAPES = [(1, 1, 1), (13, 11, 31), (129, 130, 9), (136, 264, 72), (5, 136, 1100)]


@pytest.mark.parametrize("step", CUTE_STEPS)
@pytest.mark.parametrize("layout", ["NN", "NT", "TT"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", STEP_SHAPES, ids=str)
def test_cute_step_matches_reference(step, layout, dtype, shape):
    """Each step's gemm lands within the bound, on operands whose strides TMA accepts: step 1
    runs everything on the plain kernel, step 2 runs 16-bit data and float32 with TF32 (asked
    for on NT, where A and B are K-major) on the Hopper kernel and IEEE float32 on step 1's."""
    implementation(step)  # skips without a GPU
    m, n, k = shape
    A = padded_matrix(m, k, dtype, layout[0] == "T")
    B = padded_matrix(k, n, dtype, layout[1] == "T")
    tf32 = dtype == torch.float32 and layout == "NT"
    tensor_cores = dtype != torch.float32 or tf32
    assert cute_step2.choose_kernel(A, B, tf32).kernel == ("hopper" if tensor_cores else "plain")
    C = padded_matrix(m, n, dtype, False)
    check(step, ALPHA, A, B, BETA, C, f"{layout} tf32={tf32}", tf32)


@needs_cute
def test_cute_staging_rule():
    """Step 4 copies exactly the operands the tensor cores would multiply but TMA cannot load
    (K-major ones for TF32), into exact K-major copies with 16-byte lines; what TMA takes, and
    IEEE float32, pass through as the very same tensors. Read on CPU tensors."""
    stage = cute_step4.staged_operands

    def lines_of(rows, cols, dtype, transposed):  # contiguous lines of rows or cols elements
        shape = (cols, rows) if transposed else (rows, cols)
        values = torch.randn(shape).to(dtype)
        return values.T if transposed else values

    for dtype in (torch.float16, torch.bfloat16):
        for a_t, b_t in ((False, False), (False, True), (True, False), (True, True)):
            A = padded_matrix(37, 21, dtype, a_t, "cpu")
            B = padded_matrix(21, 45, dtype, b_t, "cpu")
            same_A, same_B = stage(A, B, False)
            assert same_A is A and same_B is B
            # Lines of 21, 37 or 45 two-byte elements: 42, 74 or 90 bytes apart.
            odd_A, odd_B = lines_of(37, 21, dtype, a_t), lines_of(21, 45, dtype, b_t)
            staged_A, staged_B = stage(odd_A, odd_B, False)
            for original, copy, k_dim in ((odd_A, staged_A, 1), (odd_B, staged_B, 0)):
                assert copy.stride(k_dim) == 1 and cute_step2.tma_major(copy) is not None
                assert_same_bits(copy, original, "staged copy")
            assert cute_step2.choose_kernel(staged_A, staged_B, False) == ("hopper", True, True)
    A = padded_matrix(37, 21, torch.float32, True, "cpu")  # M-major: TF32 wgmma cannot read it
    B = padded_matrix(21, 45, torch.float32, False, "cpu")  # N-major, likewise
    same_A, same_B = stage(A, B, False)  # IEEE float32: the CUDA cores, nothing to stage
    assert same_A is A and same_B is B
    staged_A, staged_B = stage(A, B, True)
    assert cute_step2.choose_kernel(staged_A, staged_B, True) == ("hopper", True, True)
    assert_same_bits(staged_A, A, "staged A")
    assert_same_bits(staged_B, B, "staged B")


# Shapes whose rows TMA cannot take as they are: an odd k or n puts every other line off a
# 16-byte boundary (4097 x 5121 x 3079 is the bench's).
STAGED_SHAPES = [(1, 3, 7), (37, 45, 21), (129, 257, 65), (200, 131, 301)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", STAGED_SHAPES, ids=str)
def test_cute_staged_on_tensor_cores(monkeypatch, layout, dtype, shape):
    """Unaligned 16-bit operands, and float32 with TF32 in any layout, reach the Hopper kernel
    through step 3's copies (step 1's kernel is not launched) and land within step 2's bound."""
    implementation("cute")  # skips without a GPU
    monkeypatch.setattr(cute_step2, "run_plain", lambda *args: pytest.fail("plain kernel ran"))
    m, n, k = shape
    A, B, C = operands(m, n, k, dtype, layout)
    tf32 = dtype == torch.float32
    check("cute", ALPHA, A, B, BETA, C, f"{layout} staged", tf32)


HOPPER_SHAPES = [
    (1, 1, 1), (2, 3, 5), (7, 1, 13), (127, 129, 63), (128, 256, 64), (129, 257, 65),
    (61, 520, 130), (1153, 136, 8),
]  # fmt: skip


@pytest.mark.parametrize("tile_n", [64, 128, 256])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", HOPPER_SHAPES, ids=str)
def test_cute_hopper_edges(monkeypatch, tile_n, layout, dtype, shape):
    """The Hopper kernel on every tile edge (m, n, k of 1, primes, one past a tile, more tile
    rows than GROUP_M) with TMA-friendly strides, each tile width, all four layouts. Three
    SMs' worth of blocks, so that a block computes several tiles and the ring of buffers runs
    on from one tile to the next."""
    implementation("cute")  # skips without a GPU
    monkeypatch.setattr(cute_step2, "hopper_tile_n", lambda m, n: tile_n)
    monkeypatch.setattr(cute_step2, "sm_count", lambda device: 3)
    m, n, k = shape
    A = padded_matrix(m, k, dtype, layout[0] == "T")
    B = padded_matrix(k, n, dtype, layout[1] == "T")
    assert cute_step2.choose_kernel(A, B, False).kernel == "hopper"
    check("cute", ALPHA, A, B, BETA, padded_matrix(m, n, dtype, False), f"{layout} hopper")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cute_hopper_epilogues_agree(dtype):
    """The paired and the one-element epilogue do the same arithmetic: C row-major with an even
    row stride (paired on whole tiles) and with an odd one (never paired) get the same bits,
    on a C of whole and partial 128 x 256 tiles."""
    implementation("cute")  # skips without a GPU
    m, n, k = 300, 520, 130
    A = padded_matrix(m, k, dtype, False)
    B = padded_matrix(k, n, dtype, dtype == torch.float32)  # TF32 takes B column-major
    C_even = padded_matrix(m, n, dtype, False)
    C_odd = torch.empty(m, n + 1, device=DEVICE, dtype=dtype)[:, :n].copy_(C_even)
    assert cute_step2.in_pairs(C_even) and not cute_step2.in_pairs(C_odd)
    tf32 = dtype == torch.float32
    for C in (C_even, C_odd):
        cute_impl.gemm(ALPHA, A, B, BETA, C, allow_tf32=tf32)
    assert_same_bits(C_odd, C_even, "C with an odd row stride")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cute_hopper_reads_c_early_with_the_same_bits(monkeypatch, dtype):
    """C read before the k loop (reads_c_early: one 128 x 64 tile a block at 1000^2) and after
    it give the same bits, whole tiles and the partial ones at the edges (read element by
    element, after the k loop, either way)."""
    implementation("cute")  # skips without a GPU
    m, n, k = 1000, 1000, 200
    A = padded_matrix(m, k, dtype, False)
    B = padded_matrix(k, n, dtype, dtype == torch.float32)  # TF32 takes B column-major
    C_early = padded_matrix(m, n, dtype, False)
    C_late = C_early.clone()
    tf32 = dtype == torch.float32
    assert cute_step2.hopper_tile_n(m, n) == 64 and cute_step2.in_pairs(C_early)
    assert cute_step2.reads_c_early(True, True, 64, 8 * 16, cute_step2.sm_count(0))
    cute_impl.gemm(ALPHA, A, B, BETA, C_early, allow_tf32=tf32)
    monkeypatch.setattr(cute_step2, "reads_c_early", lambda *args: False)
    cute_impl.gemm(ALPHA, A, B, BETA, C_late, allow_tf32=tf32)
    assert_same_bits(C_early, C_late, "C read before the k loop against after it")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("beta", [BETA, 0.0])
@pytest.mark.parametrize(
    "m, n, k, tile_n", [(1000, 1000, 200, 64), (2048, 1030, 200, 128), (4100, 4200, 128, 256)]
)
def test_cute_hopper_stores_c_by_tma_with_the_same_bits(monkeypatch, dtype, beta, m, n, k, tile_n):
    """The epilogue through shared memory and TMA (stores_by_tma) gives the same bits as the
    one that stores each thread's pairs from registers: 64-, 128- and 256-column tiles, one
    or several tiles a block (the buffers reused across tiles), partial tiles at the edges,
    beta == 0 and not; and TMA writes nothing past C's columns into its buffer's padding."""
    implementation("cute")  # skips without a GPU
    A, B = padded_matrix(m, k, dtype, False), padded_matrix(k, n, dtype, False)
    buffer = torch.randn(m, -(-n // 8) * 8 + 16, device=DEVICE).to(dtype)  # 16-byte rows
    C_tma = buffer[:, :n]
    C_registers = C_tma.clone()
    padding = buffer[:, n:].clone()
    assert cute_step2.hopper_tile_n(m, n) == tile_n and cute_step2.stores_by_tma(C_tma, 128)
    cute_impl.gemm(ALPHA, A, B, beta, C_tma)
    monkeypatch.setattr(cute_step2, "stores_by_tma", lambda *args: False)
    cute_impl.gemm(ALPHA, A, B, beta, C_registers)
    assert_same_bits(C_tma, C_registers, "C stored by TMA against from registers")
    assert_same_bits(buffer[:, n:], padding, "the padding past C's columns")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cute_hopper_clusters_agree(dtype):
    """Clusters of 2 (B multicast to both blocks) and of 1 compute every tile alike: the same
    bits, on a C of 3 tile rows (the second cluster's partner row lies past m) in several
    tile columns."""
    implementation("cute")  # skips without a GPU
    m, n, k = 300, 1030, 200
    A, B = padded_matrix(m, k, dtype, False), padded_matrix(k, n, dtype, False)
    C_pair = padded_matrix(m, n, dtype, False)
    C_single = C_pair.clone()
    cute_impl.gemm(ALPHA, A, B, BETA, C_pair, cluster_m=2)
    cute_impl.gemm(ALPHA, A, B, BETA, C_single, cluster_m=1)
    assert_same_bits(C_pair, C_single, "clusters of 2 against clusters of 1")


def test_cute_plain_builds_agree():
    """The vector and the scalar builds of the plain kernel add the same products in the same
    order: an A with rows 4 elements apart (vector loads) and a copy with rows 4 n + 1 apart
    (scalar loads) give the same bits, on partial tiles in m, n and k."""
    implementation("cute")  # skips without a GPU
    m, n, k = 300, 260, 132
    A = torch.randn(m, k, device=DEVICE)
    B = torch.randn(k, n, device=DEVICE)
    A_odd = torch.empty(m, k + 1, device=DEVICE)[:, :k].copy_(A)
    assert cute_step1.vector_loads_ok(A, B) and not cute_step1.vector_loads_ok(A_odd, B)
    C_vectors = torch.randn(m, n, device=DEVICE)
    C_scalars = C_vectors.clone()
    cute_impl.gemm(ALPHA, A, B, BETA, C_vectors)
    cute_impl.gemm(ALPHA, A_odd, B, BETA, C_scalars)
    assert_same_bits(C_vectors, C_scalars, "scalar loads against vector loads")


@pytest.mark.parametrize("shape", HOPPER_SHAPES, ids=str)
def test_cute_hopper_tf32(monkeypatch, shape):
    """float32 with allow_tf32=True, A row-major and B column-major: TF32 wgmma, within the
    TF32 bound; the corner cases beta == 0 over NaN and a transposed C on the same kernel.
    Three blocks, each computing several tiles where there are more."""
    implementation("cute")  # skips without a GPU
    monkeypatch.setattr(cute_step2, "sm_count", lambda device: 3)
    m, n, k = shape
    A = padded_matrix(m, k, torch.float32, False)
    B = padded_matrix(k, n, torch.float32, True)
    assert cute_step2.choose_kernel(A, B, True).kernel == "hopper"
    check("cute", ALPHA, A, B, BETA, padded_matrix(m, n, torch.float32, True), "tf32", True)
    nan_C = torch.full((m, n), float("nan"), device=DEVICE)
    check("cute", ALPHA, A, B, 0.0, nan_C, "tf32 beta = 0", True)


# (m, n, k, (tile_n, S)): split_plan's choice forced onto small products: slices of unequal
# length, a k that ends on a partial k step, m and n one past a tile edge, a C of two tile rows.
SPLIT_CASES = [
    (1, 136, 1100, (128, 3)), (7, 264, 700, (256, 2)), (64, 520, 1030, (128, 4)),
    (129, 130, 520, (128, 2)), (128, 256, 2100, (256, 5)),
]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_cute_split_k_edges(monkeypatch, layout, dtype, case):
    """Step 3's split path on forced plans, all four layouts, against the float64 stand-in:
    with 3 SMs' worth of blocks, each block runs several units and its ring runs on from one
    to the next; then beta == 0 over a NaN C with any strides (C transposed)."""
    implementation("cute")  # skips without a GPU
    m, n, k, forced = case
    monkeypatch.setattr(cute_step3, "split_plan", lambda *_: forced)
    monkeypatch.setattr(cute_step3, "sm_count", lambda device: 3)
    A = padded_matrix(m, k, dtype, layout[0] == "T")
    B = padded_matrix(k, n, dtype, layout[1] == "T")
    assert cute_step3.choose_split(A, B, False)[2:] == forced
    nan_C = torch.full((n, m), float("nan"), device=DEVICE, dtype=dtype).T
    for beta, C in ((BETA, padded_matrix(m, n, dtype, False)), (0.0, nan_C)):
        exact = float64_gemm(ALPHA, A, B, beta, C)
        bound = error_bound("cute", ALPHA, A, B, beta, C, exact, STAND_IN_ERROR(k))
        cute_impl.gemm(ALPHA, A, B, beta, C)
        assert_within_bound(C, exact, bound, f"split {layout} beta={beta}")


@pytest.mark.parametrize("m", [1, 7, 64, 128])
@pytest.mark.parametrize("nk", DECODE_NK, ids=str)
def test_cute_split_k_decode(m, nk):
    """The decode shapes themselves, NT (x times W^T) in bfloat16, on split_plan's own choice
    (every shape split but 128 x 11008 x 4096, which step 2 runs whole), against the float64
    stand-in; two calls give the same bits, and so does a run with 3 blocks, which hands the
    units to blocks in another order: each element's sum depends on the plan only."""
    implementation("cute")  # skips without a GPU
    n, k = nk
    A = random_matrix(m, k, torch.bfloat16)
    B = random_matrix(k, n, torch.bfloat16, transposed=True)
    C = random_matrix(m, n, torch.bfloat16)
    unsplit = cute_step3.choose_split(A, B, False) is None
    assert unsplit == (n == 11008 and m > 64)
    exact = float64_gemm(ALPHA, A, B, BETA, C)
    bound = error_bound("cute", ALPHA, A, B, BETA, C, exact, STAND_IN_ERROR(k))
    first, second, few_blocks = C.clone(), C.clone(), C.clone()
    cute_impl.gemm(ALPHA, A, B, BETA, first)
    assert_within_bound(first, exact, bound, f"decode m={m}")
    cute_impl.gemm(ALPHA, A, B, BETA, second)
    assert_same_bits(second, first, "a second call")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cute_step3, "sm_count", lambda device: 3)
        cute_impl.gemm(ALPHA, A, B, BETA, few_blocks)
    assert_same_bits(few_blocks, first, "3 blocks against one a unit")


def test_cute_split_k_in_a_cuda_graph():
    """Captured in a CUDA graph, the split path (its workspace from torch's allocator inside
    the capture) replays on fresh inputs with the bits of an eager call."""
    implementation("cute")  # skips without a GPU
    m, n, k = 16, 4096, 4096
    A = random_matrix(m, k, torch.bfloat16)
    B = random_matrix(k, n, torch.bfloat16, transposed=True)
    C = random_matrix(m, n, torch.bfloat16)
    assert cute_step3.choose_split(A, B, False) is not None
    cute_impl.gemm(ALPHA, A, B, BETA, C)  # compiles and loads the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_impl.gemm(ALPHA, A, B, BETA, C)
    A.copy_(random_matrix(m, k, torch.bfloat16))
    C.copy_(random_matrix(m, n, torch.bfloat16))
    eager = C.clone()
    graph.replay()
    cute_impl.gemm(ALPHA, A, B, BETA, eager)
    torch.cuda.synchronize()
    assert_same_bits(C, eager, "replayed against eager")


# The 64-row tile of decode steps (m <= 64): its two consumer warpgroups split it along n.
# Rows of C around the tile height, and a C that step 3 splits or leaves to step 2 (15 k steps).
DECODE_TILE_ROWS = [1, 17, 63, 64, 65]
WGMMA_SHAPE = r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)"  # the shapes a PTX issues


@needs_cute
@pytest.mark.parametrize("step", [2, 3])
@pytest.mark.parametrize("tile_n", [128, 256])
def test_cute_decode_tile_ptx(step, tile_n):
    """A 64-row tile issues m64 n(tile_n / 2) k16 wgmmas, one half of the B tile each
    warpgroup, where the 128-row tile issues m64 n(tile_n) k16; with no A row of padding its
    ring holds more stages, 2 mbarriers each (ring_stages: 9 or 5, against 6 or 4)."""
    ptx_of = (cute_step2, cute_step3)[step - 2].ptx_of
    for tile_m, wgmma_n in ((64, tile_n // 2), (128, tile_n)):
        ptx = ptx_of(torch.bfloat16, tile_n=tile_n, tile_m=tile_m)
        assert set(re.findall(WGMMA_SHAPE, ptx)) == {f"m64n{wgmma_n}k16"}, (tile_m, tile_n)
        assert ptx.count("mbarrier.init") == 2 * cute_step2.ring_stages(tile_m, tile_n)
    assert cute_step2.ring_stages(64, 128) == 9 and cute_step2.ring_stages(128, 128) == 6


@needs_cute
def test_cute_decode_tile_tf32_ptx():
    """float32 with TF32 on a 64 x 128 tile: m64n64k8 wgmmas, half the tile's width each."""
    ptx = cute_step3.ptx_of(torch.float32, tile_n=128, tile_m=64)
    assert set(re.findall(WGMMA_SHAPE, ptx)) == {"m64n64k8"}


@needs_cute
@pytest.mark.parametrize("m", [*DECODE_TILE_ROWS, 128])
def test_cute_decode_tile_rule(monkeypatch, m):
    """The builds a call asks for, read on CPU tensors with the compiled functions replaced by
    recorders: step 3 splits k = 4096 on 64-row tiles up to 128 rows (split_tile_m: 32 tiles a
    tile row times split_plan's slices, a block each); step 2 runs k = 960 whole, in clusters
    of 1, on 64-row tiles up to 64 rows (hopper_tile_m) and 128-row tiles above."""
    builds = []

    def recorder(step):
        def compile_(*key):
            return lambda *args: builds.append((step, key, args[-1]))

        return compile_

    monkeypatch.setattr(cute_step2, "compile_hopper", recorder(2))
    monkeypatch.setattr(cute_step3, "compile_split_k", recorder(3))
    monkeypatch.setattr(cute_step2, "sm_count", lambda device: 132)
    monkeypatch.setattr(cute_step3, "sm_count", lambda device: 132)
    tile_m = 64 if m <= 64 else 128
    assert cute_step2.hopper_tile_m(m) == tile_m
    for k, step in ((4096, 3), (960, 2)):
        A = padded_matrix(m, k, torch.bfloat16, False, "cpu")
        B = padded_matrix(k, 4096, torch.bfloat16, True, "cpu")
        C = torch.empty(m, 4096, dtype=torch.bfloat16)
        cute_step3.run_checked(A, B, C, 1.0, 1.0, True, True, False, 2)
        built_step, key, blocks = builds.pop()
        assert built_step == step and key[4] == 128, key
        if step == 3:
            slices = cute_step3.split_plan(m, 4096, k, 2)[1]
            assert key[3] == 64 and blocks == -(-m // 64) * 32 * slices
        else:  # one tile row: clusters of 1, no partner block
            assert key[3] == tile_m and key[7] == 1 and blocks == 32


def aligned_guarded(values, transposed):
    """A view of `values` inside a NaN-filled buffer, MARGIN lines and at least 8 elements on
    each side of it (16 bytes of bfloat16): TMA can still load it (16-byte base and line
    stride), and a read past its edges brings NaN into C (transposed: the same, column-major)."""
    if transposed:
        view, buffer = aligned_guarded(values.T, False)
        return view.T, buffer
    rows, cols = values.shape
    line = -(-cols // 8) * 8 + 16
    buffer = torch.full(
        (rows + 2 * MARGIN, line), float("nan"), device=DEVICE, dtype=values.dtype
    )  # fmt: skip
    view = buffer[MARGIN : MARGIN + rows, 8 : 8 + cols]
    view.copy_(values)
    return view, buffer


# NT (x W^T, the model's) at each decode shape and one that step 2 runs whole (1000 x 520: 9 k
# steps, n one past a tile edge); the other operand majors at one decode shape.
DECODE_TILE_CASES = [
    *(("NT", nk) for nk in [*DECODE_NK, (1000, 520)]), ("NN", DECODE_NK[0]), ("TT", DECODE_NK[0]),
]  # fmt: skip


@pytest.mark.parametrize("m", DECODE_TILE_ROWS)
@pytest.mark.parametrize("case", DECODE_TILE_CASES, ids=str)
def test_cute_decode_tile_in_guard(m, case):
    """The 64-row tile (m <= 64) and the 128-row one (m = 65), split by step 3 or run whole
    by step 2, bfloat16, against the float64 stand-in: A, B and C lie inside NaN, so a read
    past A's or B's edges shows in C, and nothing around C may change. A second call gives
    the same bits."""
    implementation("cute")  # skips without a GPU
    layout, (n, k) = case
    A, _ = aligned_guarded(random_matrix(m, k, torch.bfloat16), layout[0] == "T")
    B, _ = aligned_guarded(random_matrix(k, n, torch.bfloat16), layout[1] == "T")
    C, C_buffer = aligned_guarded(random_matrix(m, n, torch.bfloat16), False)
    assert cute_step2.choose_kernel(A, B, False).kernel == "hopper"
    assert cute_step2.in_pairs(C)  # whole tiles take the paired epilogue
    exact = float64_gemm(ALPHA, A, B, BETA, C)
    bound = error_bound("cute", ALPHA, A, B, BETA, C, exact, STAND_IN_ERROR(k))
    start = C.clone()
    cute_impl.gemm(ALPHA, A, B, BETA, C)
    assert_within_bound(C, exact, bound, f"decode tile {m} x {n} x {k} {layout}")
    inside = torch.zeros_like(C_buffer, dtype=torch.bool)
    inside.as_strided(C.shape, C.stride(), C.storage_offset()).fill_(True)
    assert C_buffer[~inside].isnan().all(), "an element outside C was written"
    again = start.clone()
    cute_impl.gemm(ALPHA, A, B, BETA, again)
    assert_same_bits(again, C, "a second call")


# (5) GPU only: large sizes ---------------------------------------------------------------------
# Sizes plain Python is too slow for: float64 torch (`float64_gemm`, checked against reference.py
# first) stands in for reference.py.


@pytest.mark.skipif(not ON_GPU, reason="a stride of 2**31 needs 4.3 GiB behind it: GPU only")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("operand", ["A", "B", "C"])
def test_leading_dimension_past_32_bits(impl, operand):
    """m = n = 2: the two rows of A or C, or the two columns of B, lie 2**31 + 1 elements apart
    in bfloat16. cuBLAS refuses that leading dimension, so torch_impl copies the operand; the
    kernels index in 64 bits."""
    m, n, k, huge = 2, 2, 7, 2**31 + 1
    A, B, C = operands(m, n, k, torch.bfloat16, "NN")
    far_apart = torch.empty(huge + k, device=DEVICE, dtype=torch.bfloat16)
    lines = far_apart.as_strided((2, n if operand == "C" else k), (huge, 1))
    if operand == "A":
        A = lines.copy_(A)
    elif operand == "B":
        B = lines.copy_(B.T).T
    else:
        C = lines.copy_(C)
    check(impl, ALPHA, A, B, BETA, C, f"{operand} lines 2**31 + 1 apart")


def float64_gemm(alpha, A, B, beta, C, rows=1024):
    """The stand-in for reference.gemm where Python is too slow: float64 products (exact)
    summed by torch in float64, then alpha * sum + beta * c in float64, a block of rows at a
    time so that the float64 copies stay small."""
    a32, b32 = reference.to_float32(float(alpha)), reference.to_float32(float(beta))
    B64 = B.double()
    blocks = []
    for s in range(0, A.shape[0], rows):
        block = a32 * (A[s : s + rows].double() @ B64)
        if b32 != 0.0:  # beta == 0: C is not read (a NaN there does not propagate)
            block = block + b32 * C[s : s + rows].double()
        blocks.append(block.cpu())
    return torch.cat(blocks)


STAND_IN_ERROR = lambda k: gamma(k + 2, U64) + gamma(3, U64)  # noqa: E731


@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 29, 300), (20, 30, 1025)], ids=str)
def test_stand_in_matches_reference(shape):
    """float64_gemm agrees with reference.gemm within float64's serial bound gamma_{k+2} (any
    order of the sum, then the multiply and the add) plus the reference's gamma_3."""
    m, n, k = shape
    A, B, C = operands(m, n, k, torch.bfloat16, "NT")
    exact = reference.gemm(ALPHA, A.cpu(), B.cpu(), BETA, C.cpu())
    stand_in = float64_gemm(ALPHA, A, B, BETA, C, rows=16)
    a32, b32 = reference.to_float32(ALPHA), reference.to_float32(BETA)
    W = abs(a32) * abs_product(A, B) + abs(b32) * C.cpu().double().abs()
    assert_within_bound(stand_in, exact, STAND_IN_ERROR(k) * W)


@pytest.mark.skipif(not ON_GPU, reason="large problems need a GPU (Python is too slow)")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_against_float64(impl, layout, dtype):
    """A 4099 x 4097 x 4093 problem on the large configuration against float64_gemm, with
    its own error in the bound; TF32 for float32 as well."""
    m, n, k = 4099, 4097, 4093
    A, B, C = operands(m, n, k, dtype, layout)
    exact = float64_gemm(ALPHA, A, B, BETA, C)
    for allow_tf32 in (False, True) if dtype == torch.float32 else (False,):
        out = C.clone()
        bound = error_bound(impl, ALPHA, A, B, BETA, C, exact, STAND_IN_ERROR(k), allow_tf32)
        implementation(impl)(ALPHA, A, B, BETA, out, allow_tf32=allow_tf32)
        assert_within_bound(out, exact, bound, f"{impl} {layout} tf32={allow_tf32}")


@pytest.mark.skipif(not ON_GPU, reason="large problems need a GPU (Python is too slow)")
@pytest.mark.parametrize("m", [1, 16, 64, 128])
@pytest.mark.parametrize("n, k", [(4096, 4096), (11008, 4096), (4096, 11008)], ids=str)
@pytest.mark.parametrize("path", ["pointer", "tma"])
def test_triton_decode_against_float64(monkeypatch, m, n, k, path):
    """The 7B decode shapes, NT bf16 (x @ W.T), on each kernel (the real rule sends the
    products under TMA_MIN_VOLUME to the pointer kernel, larger ones to TMA; the other is
    forced): `row_plan` splits k in two for n = 4096 and leaves n = 11008's 86 tiles unsplit;
    within the bound with the split's additions against float64_gemm; twenty runs, whose
    programs arrive in whatever order, give the same bits; the counts end at 0."""
    monkeypatch.setattr(triton_impl, "TMA_MIN_VOLUME", 0 if path == "tma" else float("inf"))
    A, B, C = operands(m, n, k, torch.bfloat16, "NT")
    assert triton_impl.choose_path(A, B, True) == path
    splits = triton_impl.configuration(m, n, k, torch.bfloat16)["SPLITS"]
    assert splits == (1 if n == 11008 else 2)
    exact = float64_gemm(ALPHA, A, B, BETA, C)
    bound = error_bound("triton", ALPHA, A, B, BETA, C, exact, STAND_IN_ERROR(k))
    first = C.clone()
    triton_impl.gemm(ALPHA, A, B, BETA, first)
    assert_within_bound(first, exact, bound, f"triton decode {m} x {n} x {k}")
    for run in range(20):
        again = C.clone()
        triton_impl.gemm(ALPHA, A, B, BETA, again)
        assert_same_bits(again, first, f"run {run + 2}")
    for _, counters in triton_impl.SPLIT_WORKSPACES.values():
        assert counters.count_nonzero() == 0, "a tile's count was not set back to 0"


@pytest.mark.skipif(not ON_GPU, reason="large problems need a GPU (Python is too slow)")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_staged_against_float64(layout):
    """4097 x 5121 x 3079 bf16: k and m or n odd, so TMA can fetch neither operand as it is;
    the staged path copies both and runs the TMA kernel, within the bound."""
    m, n, k = 4097, 5121, 3079
    A, B, C = operands(m, n, k, torch.bfloat16, layout)
    assert triton_impl.choose_path(A, B, True) == "staged"
    exact = float64_gemm(ALPHA, A, B, BETA, C)
    bound = error_bound("triton", ALPHA, A, B, BETA, C, exact, STAND_IN_ERROR(k))
    triton_impl.gemm(ALPHA, A, B, BETA, C)
    assert_within_bound(C, exact, bound, f"triton staged {layout}")


@pytest.mark.skipif(not ON_GPU, reason="A of 2**31 elements and more needs a GPU (4.3 GiB)")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_more_than_2_to_31_elements(impl, layout):
    """m = 2**17 + 3, k = 2**14 + 1 in bfloat16: A has 2.15e9 elements, so its last rows (or,
    transposed, columns) start past 2**31 and a 32-bit offset would wrap. n = 80 keeps B, C and
    the float64 stand-in small."""
    m, n, k = 2**17 + 3, 80, 2**14 + 1
    A, B, C = operands(m, n, k, torch.bfloat16, layout)
    exact = float64_gemm(ALPHA, A, B, BETA, C)
    bound = error_bound(impl, ALPHA, A, B, BETA, C, exact, STAND_IN_ERROR(k))
    implementation(impl)(ALPHA, A, B, BETA, C)
    assert_within_bound(C, exact, bound, f"{impl} {layout}")


@pytest.mark.skipif(not ON_GPU, reason="large problems need a GPU (Python is too slow)")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cute_hopper_large(layout, dtype):
    """The Hopper kernel at 4099 x 4097 x 4093 (128 x 256 tiles, every edge partial) against
    float64_gemm; float32 runs TF32 with A row-major and B column-major only."""
    if dtype == torch.float32 and layout != "NT":
        pytest.skip("TF32 wgmma takes K-major operands only")
    m, n, k = 4099, 4097, 4093
    A = padded_matrix(m, k, dtype, layout[0] == "T")
    B = padded_matrix(k, n, dtype, layout[1] == "T")
    C = padded_matrix(m, n, dtype, False)
    tf32 = dtype == torch.float32
    assert cute_step2.choose_kernel(A, B, tf32).kernel == "hopper"
    assert cute_step2.hopper_tile_n(m, n) == 256
    exact = float64_gemm(ALPHA, A, B, BETA, C)
    bound = error_bound("cute", ALPHA, A, B, BETA, C, exact, STAND_IN_ERROR(k), tf32)
    cute_impl.gemm(ALPHA, A, B, BETA, C, allow_tf32=tf32)
    assert_within_bound(C, exact, bound, f"cute hopper {layout}")


@pytest.mark.skipif(not ON_GPU, reason="A of 2**31 elements and more needs a GPU (4.3 GiB)")
@pytest.mark.parametrize("layout", ["NN", "TT"])
def test_cute_hopper_more_than_2_to_31_elements(layout):
    """The Hopper kernel on an A of 2.15e9 bfloat16 elements (sizes chosen so that TMA takes
    both layouts): TMA's descriptor strides are 64-bit and so must the epilogue's be."""
    m, n, k = 2**17 + 8, 80, 2**14 + 8
    A, B, C = operands(m, n, k, torch.bfloat16, layout)
    assert cute_step2.choose_kernel(A, B, False).kernel == "hopper"
    exact = float64_gemm(ALPHA, A, B, BETA, C)
    bound = error_bound("cute", ALPHA, A, B, BETA, C, exact, STAND_IN_ERROR(k))
    cute_impl.gemm(ALPHA, A, B, BETA, C)
    assert_within_bound(C, exact, bound, f"cute hopper {layout}")


if __name__ == "__main__":
    sys.exit(
        pytest.main(
            [
                __file__,
                "-q",
                "-p",
                "no:cacheprovider",
                "-W",
                "ignore::RuntimeWarning",
                *sys.argv[1:],
            ]
        )
    )
