"""RMSNorm tests, section (5): GPU-only sizes, CUDA graphs and the rsqrt figure.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import math

import pytest
import torch
from test import (
    DEVICE,
    DTYPES,
    EPS,
    IMPLS,
    ON_GPU,
    RSQRT,
    backward_bounds,
    float64_forward,
    forward_bounds,
    forward_outputs,
    implementation,
    random_rows,
    random_weight,
)

import reference
from common.tolerance import assert_same_bits, assert_within_bound

# (5) GPU only --------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def float64_backward(x, weight, rstd, dy):
    x64, dy64, r = x.double(), dy.double(), rstd.double()[..., None]
    xhat, g = x64 * r, dy64 * weight.double()
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.cpu(), (dy64 * xhat).reshape(-1, x.shape[-1]).sum(0).cpu()


def test_stand_ins_match_reference():
    """The float64 stand-ins agree with reference.py to far below any float32 bound."""
    x, dy = random_rows(3, 1000, torch.float32), random_rows(3, 1000, torch.float32)
    weight = random_weight(1000, torch.float32)
    exact_y, exact_rstd = reference.rmsnorm_forward(x.cpu(), weight.cpu(), EPS)
    y, rstd = float64_forward(x, weight, EPS)
    assert (y - exact_y).abs().max() < 1e-14 and (rstd - exact_rstd).abs().max() < 1e-14
    exact = reference.rmsnorm_backward(x.cpu(), weight.cpu(), exact_rstd.float(), dy.cpu())
    for a, b in zip(float64_backward(x, weight, exact_rstd.float().to(DEVICE), dy), exact,
                    strict=True):  # fmt: skip
        assert (a - b).abs().max() < 1e-13


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "m, n", [(4099, 1024), (4096, 4096), (1030, 8192), (16, 16384), (8, 65537), (2, 262144)]
)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_large_rows_against_float64(impl, dtype, m, n, fused):
    """Rows the CuTe backward stages (4096, 8192: groups of 8 and 3 rows, the last group of
    1030 a single row) and streams, against float64; fused, h = x + residual bit for bit."""
    fns = implementation(impl)
    x, dy = random_rows(m, n, dtype, scale=3.0), random_rows(m, n, dtype)
    weight = random_weight(n, dtype)
    residual = random_rows(m, n, dtype) if fused else None
    outputs = forward_outputs(x, residual)
    if fused:
        y, rstd, h = fns.rmsnorm_forward(x, weight, EPS, *outputs[:2], residual, outputs[2])
        assert_same_bits(h, (x.float() + residual.float()).to(dtype), f"{impl} residual_out")
    else:
        (y, rstd), h = fns.rmsnorm_forward(x, weight, EPS, *outputs), x
    exact_y, exact_rstd = float64_forward(h, weight, EPS)
    y_bound, rstd_bound = forward_bounds(impl, h, weight, EPS, exact_y, exact_rstd)
    assert_within_bound(y, exact_y, y_bound, f"{impl} y")
    assert_within_bound(rstd, exact_rstd, rstd_bound, f"{impl} rstd")
    dh = random_rows(m, n, dtype) if fused else None
    dx, dw = fns.rmsnorm_backward(
        h, weight, rstd, dy, torch.empty_like(x), torch.empty_like(weight), dh
    )
    exact_dx, exact_dw = float64_backward(h, weight, rstd, dy)
    if fused:
        exact_dx = exact_dx + dh.double().cpu()
    dx_bound, dw_bound = backward_bounds(impl, h, weight, rstd, dy, exact_dx, exact_dw, dh)
    assert_within_bound(dx, exact_dx, dx_bound, f"{impl} dx")
    assert_within_bound(dw, exact_dw, dw_bound, f"{impl} dweight")


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_replays_the_eager_call(impl, dtype):
    """Captured in a CUDA graph, the fused forward and the backward replay on fresh data with
    the bits of an eager call: the launchers work on torch's current stream."""
    fns = implementation(impl)
    x, residual, dy = (random_rows(5, 4099, dtype) for _ in range(3))
    weight = random_weight(4099, dtype)
    outputs = forward_outputs(x, residual)
    grads = torch.empty_like(x), torch.empty_like(weight)

    def step():
        fns.rmsnorm_forward(x, weight, EPS, *outputs[:2], residual, outputs[2])
        fns.rmsnorm_backward(outputs[2], weight, outputs[1], dy, *grads)

    step()  # compile and load first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in (x, residual, dy):
        t.copy_(random_rows(5, 4099, dtype))
    graph.replay()
    replayed = [t.clone() for t in (*outputs, *grads)]
    step()
    torch.cuda.synchronize()
    for a, b in zip(replayed, (*outputs, *grads), strict=True):
        assert_same_bits(a, b)


@gpu_only
def test_rsqrt_error_within_common_figure():
    """The measurement behind common/README.md's rsqrt.approx.ftz.f32 figure: tl.math.rsqrt (which
    compiles to rsqrt.approx.ftz.f32) on every float32 in [1, 4) (two binades: the error
    pattern repeats every factor of 4) against float64 1/sqrt."""
    import triton
    import triton.language as tl

    @triton.jit
    def rsqrt_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.math.rsqrt(tl.load(a_ptr + offs)))

    start = torch.tensor(1.0).view(torch.int32).item()
    a = torch.arange(start, start + 2**24, device=DEVICE, dtype=torch.int32).view(torch.float32)
    out = torch.empty_like(a)
    rsqrt_kernel[(a.numel() // 1024,)](a, out, BLOCK=1024)
    exact = 1 / torch.sqrt(a.double())
    relative = ((out.double() - exact) / exact).abs().max().item()
    print(
        f"rsqrt.approx.ftz.f32: largest relative error {relative:.3e} "
        f"= 2**{math.log2(relative):.2f}"
    )
    assert relative <= RSQRT
