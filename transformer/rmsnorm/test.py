"""Tests for RMSNorm: every implementation, forward and backward, lands within README.md's bound.

This file is section (1), the set-up and the bound model, with the helpers the sections share;
each later section is a file of its own: test_2_contract.py (every implementation),
test_2_training.py (autograd, the custom ops, the module, torch.compile, a model's training),
test_3_triton.py, test_4_cute.py (maps, builds and PTX), test_5_gpu.py. Run them all with
`python test.py` (extra arguments go to pytest: `python test.py -k cute -x`) or `nox -s rmsnorm`
from the top. Without a GPU, torch runs on the CPU, Triton under its interpreter, and the CuTe
kernels are compiled for sm_90a and their PTX read; launching them needs the GPU, and those
tests say so when they skip.
"""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # CuTe builds for the H200 without one

import reference
import torch_impl
import triton_impl

try:
    from common.tolerance import (
        APPROX_RELATIVE_ERROR,
        assert_same_bits,
        assert_within_bound,
        gamma,
        store_roundoff,
        underflow,
        unit_roundoff,
    )
except ImportError as error:  # the folder was copied on its own, without common/
    raise ImportError(
        "test.py takes its tolerance checks from the course's common/ folder, which is not "
        f"two levels up: copy the course's common/ folder to {HERE.parent.parent / 'common'}"
    ) from error

try:
    import cute_impl
except ImportError as error:  # no CuTe DSL: its tests skip and say why
    cute_impl, CUTE_MISSING = None, f"cute_impl cannot be imported ({error})"

# (1) Set-up and the bound model ----------------------------------------------------------------

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
# (M, N): no rows, 1, primes, 2**k +- 1 and block edges; the CuTe forward's maps
# (cute_impl.forward_map): a warp a row (7, 31), 2 and 4 warps (3, 2048), (3, 4000), (3, 4096)
# with the last block's second row past M, whole and partial tiles, a block's row (1, 4097),
# (2, 8191), (2, 8192) (streamed rows, N > 8192: the GPU-only sizes); the backward's
# whole-tile builds (3, 4096), (2, 8192), which stage rows in shared memory.
SHAPES = [
    (0, 5),
    (1, 1),
    (2, 3),
    (7, 31),
    (3, 128),
    (5, 129),
    (2, 1023),
    (1, 4097),
    (3, 2048),
    (3, 4000),
    (3, 4096),
    (2, 8191),
    (2, 8192),
]
EPS = 1e-6
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny  # .ftz flushes results below it to 0
RSQRT = APPROX_RELATIVE_ERROR["rsqrt.approx.ftz.f32"]
# torch.rsqrt: CUDA's rsqrtf is within 2 ulp (CUDA math API), 5u by common/README.md's argument
# for ex2; on the CPU 1/sqrt rounds twice, well inside that.
TORCH_RSQRT = 5 * U32


def module(name):
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    modules = {"reference": reference, "torch": torch_impl, "triton": triton_impl}
    return cute_impl if name == "cute" else modules[name]


def implementation(name):
    """The implementation's module, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return module(name)


def paths(impl, m, n, dtype):
    """(forward, backward, dweight) roundings of README.md's bound: on a square's way into
    mean(h**2), on a product's way into mean(g * xhat), on a term's way into dweight. torch
    sums in an undocumented order: what holds for every order, plus two for each mean."""
    if impl == "torch":
        return n + 2, n + 2, max(m - 1, 0)
    fns = module(impl)
    return fns.forward_path(n, dtype), fns.backward_path(n, dtype), fns.dweight_path(m, n, dtype)


def rows(t):
    """t's rows as a float64 CPU (M, N) matrix (reshape(-1, N) is ambiguous for N = 0)."""
    return t.detach().cpu().double().reshape(math.prod(t.shape[:-1]), t.shape[-1])


def forward_bounds(impl, h, weight, eps, exact_y, exact_rstd):
    """README.md's forward bounds (y, rstd) from the exact results, h the normalised input:

    a = S/N + eps, S = sum h_j**2;  K roundings on a square's way into mean(h**2)
    g = (u a + (1 + u)(gamma_K S + (1 + gamma_K) n tiny) / N) / a     (a_hat's error)
    rho = (1 - g)**-1/2 (1 + R) - 1                               (rstd's relative error)
    |y_hat - y| <= ((1 + rho)(1 + u)**2 - 1) |y| + (2 + |w|) tiny, then the store."""
    m, n = math.prod(h.shape[:-1]), h.shape[-1]
    if h.numel() == 0:
        return torch.zeros(exact_y.shape, dtype=torch.float64), exact_rstd.abs()
    k = paths(impl, m, n, h.dtype)[0] + (1 if h.dtype == torch.float32 else 0)  # the square
    h64, w = rows(h), weight.detach().cpu().double()
    s = h64.square().sum(dim=-1, keepdim=True)
    a = s / n + reference.to_float32(eps)
    g = (U32 * a + (1 + U32) * (gamma(k, U32) * s + (1 + gamma(k, U32)) * n * TINY32) / n) / a
    g = g.nan_to_num(0.0, 0.0)  # rows with inf or NaN (or 0 / 0): y is 0 or not finite there
    rho = (1 - g) ** -0.5 * (1 + (TORCH_RSQRT if impl == "torch" else RSQRT)) - 1
    y = rows(exact_y)
    bound = ((1 + rho) * (1 + U32) ** 2 - 1) * y.abs() + (2 + w.abs()) * TINY32
    u_s = store_roundoff(h.dtype)
    y_bound = u_s * y.abs() + (1 + u_s) * bound + underflow(h.dtype)
    return y_bound.reshape(exact_y.shape), (rho.squeeze(-1) * rows(exact_rstd[..., None])[:, 0])


def backward_bounds(impl, x, weight, rstd, dy, exact_dx, exact_dweight, dresidual_out=None):
    """README.md's backward bounds (dx, dweight), r = rstd and xhat = x r taken as exact:

    c = sum g_j xhat_j, C = sum |g_j xhat_j|; K = the backward path + 3 (x r, dy w, product)
    E = gamma_K C / N + n tiny                                  (mean(g xhat)'s error)
    |dx_hat - dx| <= gamma_2 |dx| + (1 + gamma_2) r (u |g| + gamma_3 |xhat c| / N
                     + (1 + gamma_3) |xhat| E) + tiny terms, dx the norm's part; fused, the
                     sum's rounding: u |dx + dresidual_out| + (1 + u)(that)
    |dw_hat - dw| <= gamma_(P + 2) sum_rows |dy xhat| + m tiny, then the stores."""
    m, n = math.prod(x.shape[:-1]), x.shape[-1]
    forward_k, backward_k, dweight_k = paths(impl, m, n, x.dtype)
    x64, dy64, w = rows(x), rows(dy), weight.detach().cpu().double()
    r = rstd.detach().cpu().double().reshape(-1, 1)
    xhat, g = x64 * r, dy64 * w
    c = (g * xhat).sum(dim=-1, keepdim=True)
    mean_error = (
        gamma(backward_k + 3, U32) * (g * xhat).abs().sum(dim=-1, keepdim=True) / max(n, 1)
        + n * TINY32
    )
    dx = rows(exact_dx)
    dx_norm = dx if dresidual_out is None else dx - rows(dresidual_out)
    g2, g3 = gamma(2, U32), gamma(3, U32)
    inner = U32 * g.abs() + g3 * (xhat * c).abs() / max(n, 1) + (1 + g3) * xhat.abs() * mean_error
    bound = g2 * dx_norm.abs() + (1 + g2) * r * inner + 4 * (1 + r) * (1 + w.abs()) * TINY32
    if dresidual_out is not None:
        bound = U32 * dx.abs() + (1 + U32) * bound
    u_s = store_roundoff(x.dtype)
    dx_bound = u_s * dx.abs() + (1 + u_s) * bound + underflow(x.dtype)
    dw = exact_dweight.double()
    dw_bound = gamma(dweight_k + 2, U32) * (dy64 * xhat).abs().sum(dim=0) + m * TINY32
    u_w = store_roundoff(weight.dtype)
    dw_bound = u_w * dw.abs() + (1 + u_w) * dw_bound + underflow(weight.dtype)
    return dx_bound.reshape(exact_dx.shape), dw_bound


def random_rows(m, n, dtype, scale=1.0):
    return (scale * torch.randn(m, n, device=DEVICE)).to(dtype)


def random_weight(n, dtype):
    return (1 + 0.5 * torch.randn(n, device=DEVICE)).to(dtype)


def forward_outputs(x, residual=None):
    y, rstd = torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)
    return (y, rstd) if residual is None else (y, rstd, torch.empty_like(x))


def check_forward(impl, x, weight, eps=EPS, residual=None, outputs=None):
    """Run impl's forward into outputs (fresh if None), hold y and rstd to the bound and
    residual_out to bitwise equality; returns the outputs."""
    outputs = forward_outputs(x, residual) if outputs is None else outputs
    extra = {} if residual is None else {"residual": residual.cpu(), "residual_out": x.cpu()}
    exact = reference.rmsnorm_forward(x.cpu(), weight.cpu(), eps, **extra)
    fused = () if residual is None else (residual, outputs[2])
    got = implementation(impl).rmsnorm_forward(x, weight, eps, *outputs[:2], *fused)
    assert all(a is b for a, b in zip(got, outputs, strict=True))
    h = x if residual is None else outputs[2]
    if residual is not None:
        assert_same_bits(outputs[2].cpu(), exact[2].to(x.dtype), f"{impl} residual_out")
    y_bound, rstd_bound = forward_bounds(impl, h, weight, eps, exact[0], exact[1])
    assert_within_bound(outputs[0], exact[0], y_bound, f"{impl} y")
    assert_within_bound(outputs[1], exact[1], rstd_bound, f"{impl} rstd")
    return outputs


def check_backward(impl, x, weight, rstd, dy, dresidual_out=None, dx=None, dweight=None):
    dx = torch.empty_like(x) if dx is None else dx
    dweight = torch.empty_like(weight) if dweight is None else dweight
    extra = () if dresidual_out is None else (dresidual_out.cpu(),)
    exact_dx, exact_dw = reference.rmsnorm_backward(
        x.cpu(), weight.cpu(), rstd.cpu(), dy.cpu(), None, None, *extra
    )
    got = implementation(impl).rmsnorm_backward(x, weight, rstd, dy, dx, dweight, dresidual_out)
    assert got[0] is dx and got[1] is dweight
    dx_bound, dw_bound = backward_bounds(
        impl, x, weight, rstd, dy, exact_dx, exact_dw, dresidual_out
    )
    assert_within_bound(dx, exact_dx, dx_bound, f"{impl} dx")
    assert_within_bound(dweight, exact_dw, dw_bound, f"{impl} dweight")
    return dx, dweight


def forward_then_backward(impl, x, weight, dy, residual=None, dresidual_out=None):
    outputs = check_forward(impl, x, weight, residual=residual)
    h = x if residual is None else outputs[2]
    return outputs, check_backward(impl, h, weight, outputs[1], dy, dresidual_out)


def float64_forward(x, weight, eps):
    """The stand-in for reference.py where Python is too slow: the same formula in float64."""
    x64 = x.double()
    rstd = 1 / torch.sqrt(x64.square().mean(-1) + reference.to_float32(eps))
    return (x64 * rstd[..., None] * weight.double()).cpu(), rstd.cpu()


if __name__ == "__main__":
    options = ["-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    # The section files, in their numbered order: every test_*.py beside this file.
    files = [__file__, *sorted(str(path) for path in HERE.glob("test_*.py"))]
    sys.exit(pytest.main([*files, *options, *sys.argv[1:]]))
