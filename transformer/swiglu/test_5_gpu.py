"""SwiGLU tests, section (5): GPU-only sizes against the float64 stand-ins.
The set-up, the bound model and the shared helpers live in test.py, which runs this file."""

import pytest
import torch
from test import DEVICE, IMPLS, ON_GPU, backward_bounds, forward_bound, implementation, random_rows

import reference
import torch_impl
from common.tolerance import assert_same_bits, assert_within_bound

# (5) GPU only --------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def float64_forward(g, u):
    """The stand-in for reference.py where Python is too slow: the same formula in float64."""
    g64 = g.double()
    return (g64 * torch.sigmoid(g64) * u.double()).cpu()


def float64_backward(g, u, dy):
    g64, u64, dy64 = g.double(), u.double(), dy.double()
    s = torch.sigmoid(g64)
    return (dy64 * u64 * s * (1 + g64 * torch.sigmoid(-g64))).cpu(), (dy64 * g64 * s).cpu()


def test_stand_ins_match_reference():
    """The float64 stand-ins agree with reference.py far below any float32 bound."""
    g, u, dy = (random_rows(3, 1000, torch.float32) for _ in range(3))
    assert (float64_forward(g, u) - reference.swiglu_forward(g.cpu(), u.cpu())).abs().max() < 1e-13
    exact = reference.swiglu_backward(g.cpu(), u.cpu(), dy.cpu())
    for a, b in zip(float64_backward(g, u, dy), exact, strict=True):
        assert (a - b).abs().max() < 1e-13


@gpu_only
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, n", [(4096, 14336), (1, 262144), (65537, 64)], ids=str)
def test_large_against_float64(impl, dtype, m, n):
    """Llama-sized rows, fused form: y, dg and du within the bound of the float64 stand-in."""
    fns = implementation(impl)
    gu, dy = random_rows(m, 2 * n, dtype), random_rows(m, n, dtype, 1.0)
    gate, up = reference.halves(gu)
    y = fns.swiglu_forward(gu, None, torch_impl.fresh_output(gu, None))
    exact_y = float64_forward(gate, up)
    assert_within_bound(y, exact_y, forward_bound(impl, gate, up, exact_y), f"{impl} y")
    dgu, _ = fns.swiglu_backward(gu, None, dy, torch.empty_like(gu))
    exact_dg, exact_du = float64_backward(gate, up, dy)
    dg_bound, du_bound = backward_bounds(impl, gate, up, dy, exact_dg, exact_du)
    d_gate, d_up = reference.halves(dgu)
    assert_within_bound(d_gate, exact_dg, dg_bound, f"{impl} dg")
    assert_within_bound(d_up, exact_du, du_bound, f"{impl} du")


# Rows past an Int32 (an Int32 M keeps 3 of them), through every slice boundary of cute_impl's
# BLOCKS_PER_LAUNCH (one block a row at N = 2); rows of 2 bf16 values, 8.6 GB an operand.
PAST_INT32_ROWS = 2**31 + 3


@gpu_only
def test_cute_rows_past_2_31():
    """2**31 + 3 rows of N = 2 in bfloat16 (g, u, y, dy, dg: 43 GB, and 4.3 GB of isnan
    flags): outputs poisoned with NaN come back finite in every row, and the rows around the
    slices' boundaries and the last ones carry the bits of the same rows launched alone."""
    cute_impl = implementation("cute")
    m, limit = PAST_INT32_ROWS, cute_impl.BLOCKS_PER_LAUNCH
    g, u, dy = (torch.randn(m, 2, dtype=torch.bfloat16, device=DEVICE) for _ in range(3))
    y = cute_impl.swiglu_forward(g, u, torch.full_like(g, float("nan")))
    assert not y.isnan().any()
    rows = torch.tensor([0, limit - 1, limit, 2**31 - 1, 2**31, m - 1], device=DEVICE)
    alone = cute_impl.swiglu_forward(g[rows], u[rows], torch.empty_like(g[rows]))
    assert_same_bits(y[rows], alone)
    want = torch.nn.functional.silu(g[rows].float()) * u[rows].float()
    assert (alone.float() - want).abs().max() <= 2**-7 * want.abs().max()
    dg, du = cute_impl.swiglu_backward(
        g, u, dy, torch.full_like(g, float("nan")), y.fill_(float("nan"))
    )
    assert not (dg.isnan().any() or du.isnan().any())
    fresh = (torch.empty_like(alone), torch.empty_like(alone))
    alone_grads = cute_impl.swiglu_backward(g[rows], u[rows], dy[rows], *fresh)
    for got, want in zip((dg[rows], du[rows]), alone_grads, strict=True):
        assert_same_bits(got, want)
    del g, u, dy, y, dg, du
    torch.cuda.empty_cache()  # 43 GB: back to the device, which other suites may share
