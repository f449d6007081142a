"""Softmax tests, section (5): GPU-only sizes, CuTe launches, CUDA graphs and the ex2 figure.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
import torch
from test import (
    DEVICE,
    EX2,
    U32,
    check,
    cute_impl,
    each_dtype,
    each_impl,
    each_impl_and_dtype,
    float64_softmax,
    float64_softmax_backward,
    forward_then_backward,
    gpu_only,
    implementation,
    random_rows,
    run_both,
    special_rows,
)

import reference
from common.tolerance import assert_same_bits

# (5) GPU only --------------------------------------------------------------------------------


def test_stand_ins_match_reference():
    """The float64 stand-ins agree with reference.py to far below any float32 bound."""
    x, dy = random_rows(3, 1000, torch.float32), random_rows(3, 1000, torch.float32)
    exact = reference.softmax_forward(x.cpu())
    assert (float64_softmax(x) - exact).abs().max() < 1e-15
    y = exact.float().to(dy.device)
    exact_dx = reference.softmax_backward(y.cpu(), dy.cpu())
    assert (float64_softmax_backward(y, dy) - exact_dx).abs().max() < 1e-15


@gpu_only
@each_impl
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "m, n", [(64, 8192), (16, 32000), (5, 32768), (4, 40000), (8, 65537), (3, 131072), (2, 262144)]
)
def test_large_rows_against_float64(impl, dtype, m, n):
    """Long rows (every kernel's long-row path) against the float64 stand-ins."""
    forward_then_backward(impl, random_rows(m, n, dtype, scale=3.0), random_rows(m, n, dtype))


@gpu_only
@each_dtype
def test_cute_cluster_special_values_and_bits(dtype):
    """Step 2 at N = 40000 (forward: clusters of 4, backward: of 8, the last block's slice
    mostly past N): the special rows follow the definition, as torch does, and two runs give
    the same bits, whichever block of a cluster sends first."""
    x = special_rows(dtype, n=40000)
    y = check("cute", "forward", x)
    assert torch.equal(y.isnan(), torch.softmax(x.double(), dim=-1).isnan())
    assert_same_bits(y, cute_impl.softmax_forward(x, torch.empty_like(x)))
    finite, dy = y[[0, 4, 5, 6]], random_rows(4, 40000, dtype)
    dx = check("cute", "backward", finite, dy)
    assert_same_bits(dx, cute_impl.softmax_backward(finite, dy, torch.empty_like(dy)))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n", [(5, 4099), (3, 40000)])
def test_cute_step1_at_step2_sizes(dtype, m, n, monkeypatch):
    """Step 1 (two passes), which bench.py times as cute.step1 and which takes only the rows
    past step 2's plans, still lands within its own bound at rows step 2 would take."""
    monkeypatch.setattr(cute_impl, "kernel_plan", lambda direction, n, dtype: None)
    forward_then_backward("cute", random_rows(m, n, dtype, scale=3.0), random_rows(m, n, dtype))


@gpu_only
@each_dtype
def test_cute_step1_special_values(dtype, monkeypatch):
    """Step 1's online max and sum (a thread's running max is max.f32, which ignores NaN; a
    thread whose tiles are all -inf so far rescales by exp(-inf - 0) = 0) at N = 40000: the
    special rows follow the definition, as torch does."""
    monkeypatch.setattr(cute_impl, "kernel_plan", lambda direction, n, dtype: None)
    x = special_rows(dtype, n=40000)
    y = check("cute", "forward", x)
    assert torch.equal(y.isnan(), torch.softmax(x.double(), dim=-1).isnan())
    assert y[[0, 4, 5, 6]].isfinite().all() and y[[1, 2, 3]].isnan().all()
    finite = y[[0, 4, 5, 6]]
    check("cute", "backward", finite, random_rows(*finite.shape, dtype))


@gpu_only
@each_impl_and_dtype
def test_cuda_graph_replays_the_eager_call(impl, dtype):
    """Captured in a CUDA graph, forward and backward replay on fresh data with the bits of an
    eager call: the launchers work on torch's current stream and do nothing a capture misses."""
    fns = implementation(impl)
    x, dy, y, dx = (random_rows(5, 4099, dtype) for _ in range(4))
    run_both(fns, x, dy, y, dx)  # compile and load first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_both(fns, x, dy, y, dx)
    x.copy_(random_rows(5, 4099, dtype))
    dy.copy_(random_rows(5, 4099, dtype))
    graph.replay()
    replayed = (y.clone(), dx.clone())
    y.fill_(float("nan"))
    dx.fill_(float("nan"))
    for got, eager in zip(replayed, run_both(fns, x, dy, y, dx), strict=True):
        assert_same_bits(got, eager)


@gpu_only
def test_ex2_error_within_common_figure():
    """The measurement behind common/README.md's ex2.approx.ftz.f32 figure: tl.exp2 (which
    compiles to it) over 2**24 float32 arguments in [-126, 0], against float64 2**a."""
    import triton
    import triton.language as tl

    @triton.jit
    def exp2_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.exp2(tl.load(a_ptr + offs)))

    a = -126 * torch.rand(2**24, device=DEVICE)
    out = torch.empty_like(a)
    exp2_kernel[(a.numel() // 1024,)](a, out, BLOCK=1024)
    exact = torch.exp2(a.double())
    relative = ((out.double() - exact) / exact).abs().max().item()
    print(f"ex2.approx.ftz.f32: largest relative error {relative:.3e} = {relative / U32:.2f} u")
    assert relative <= EX2


# Rows past an Int32 (an Int32 M keeps 3 of them), through every slice boundary of cute_impl's
# ROWS_PER_LAUNCH; rows of 2 bf16 values, 8.6 GB an operand.
PAST_INT32_ROWS = 2**31 + 3


@gpu_only
def test_cute_rows_past_2_31():
    """2**31 + 3 rows of N = 2 in bfloat16 (x, y, dy, dx: 34 GB, and 4.3 GB of isnan
    flags): outputs poisoned with NaN come back finite in every row, and the rows around the
    slices' boundaries and the last ones carry the bits of the same rows launched alone."""
    m, limit = PAST_INT32_ROWS, cute_impl.ROWS_PER_LAUNCH
    x = torch.randn(m, 2, dtype=torch.bfloat16, device=DEVICE)
    y = cute_impl.softmax_forward(x, torch.full_like(x, float("nan")))
    assert not y.isnan().any()
    dy = torch.randn_like(x)
    dx = cute_impl.softmax_backward(y, dy, torch.full_like(x, float("nan")))
    assert not dx.isnan().any()
    rows = torch.tensor([0, limit - 1, limit, 2**31 - 1, 2**31, m - 1], device=DEVICE)
    alone = cute_impl.softmax_forward(x[rows], torch.empty(len(rows), 2, dtype=x.dtype,
                                                           device=DEVICE))  # fmt: skip
    assert_same_bits(y[rows], alone)
    assert (alone.float() - torch.softmax(x[rows].float(), dim=-1)).abs().max() < 2**-8
    alone_dx = cute_impl.softmax_backward(y[rows], dy[rows], torch.empty_like(alone))
    assert_same_bits(dx[rows], alone_dx)
    del x, y, dy, dx
    torch.cuda.empty_cache()  # 34 GB: back to the device, which other suites may share
