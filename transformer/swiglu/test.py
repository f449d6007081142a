"""Tests for SwiGLU: every implementation, forward and backward, lands within README.md's bound.

This file is section (1), the set-up and the bound model, with the helpers the sections share;
each later section is a file of its own: test_2_contract.py (every implementation, autograd,
the module, torch.compile), test_3_triton.py, test_4_cute.py (builds, dispatch and PTX),
test_5_gpu.py. Run them all with `python test.py` (extra arguments go to pytest:
`python test.py -k cute -x`) or `nox -s swiglu` from the top. Without a GPU, torch runs on the
CPU and Triton under its interpreter; the Triton and CuTe kernels are also compiled for
sm_90(a) and their PTX read (launching a CuTe kernel needs the GPU: those tests skip and say so).
"""

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
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # what cute.compile builds for

import reference
import torch_impl
import triton_impl

try:
    from common.tolerance import (
        APPROX_RELATIVE_ERROR,
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
FORMS = ["two tensors", "fused"]
# (M, N): no rows, 1, primes, 2**k +- 1 and the tiles' edges (2048 and 4096 elements).
SHAPES = [(0, 5), (1, 1), (2, 3), (7, 31), (3, 128), (5, 129), (2, 1023), (1, 4097), (3, 2048)]
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny
# exp's own relative error at its (rounded) argument: ex2.approx.f32 for Triton and CuTe (2 ulp,
# 5u by common/README.md); torch's sigmoid calls an accurate exp (CUDA's expf: 2 ulp, also 5u;
# the CPU's Sleef exp: 1 ulp).
EX2 = APPROX_RELATIVE_ERROR["ex2.approx.ftz.f32"]
EXP_ERROR = {"torch": 5 * U32, "triton": EX2, "cute": EX2}


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


def sigmoid_bound(impl, g):
    """(s, |s_hat - s| bound) for float64 g (README.md, "The error bound"):
    eta = exp(gamma_k |g|)(1 + X) - 1       exp(-g)'s relative error (k argument roundings)
    delta = (1 + eta (1 - s))(1 + u) - 1    1 + exp(-g)'s
    |s_hat - s| <= ((1 + u) / (1 - delta) - 1) s + tiny   (flushed or overflowed exp)."""
    s = torch.sigmoid(g)
    k = module(impl).EXP_ARGUMENT_ROUNDINGS
    eta = torch.exp(gamma(k, U32) * g.abs()) * (1 + EXP_ERROR[impl]) - 1
    delta = (1 + eta * (1 - s)) * (1 + U32) - 1
    bound = ((1 + U32) / (1 - delta) - 1) * s + TINY32
    return s, bound.nan_to_num(0.0, 0.0, 0.0)


def stored(bound, exact, dtype):
    """The float32 result's bound, then the store's rounding to dtype."""
    u_s = store_roundoff(dtype)
    return u_s * exact.abs() + (1 + u_s) * bound + underflow(dtype)


def forward_bound(impl, g, u, exact_y):
    """|y_hat - y| <= ((1 + u)**2 - 1) |y| + (1 + u)**2 |g u| e_s + tiny, then the store."""
    g64, u64 = g.detach().cpu().double(), u.detach().cpu().double()
    _, e_s = sigmoid_bound(impl, g64)
    bound = ((1 + U32) ** 2 - 1) * exact_y.abs() + (1 + U32) ** 2 * (g64 * u64).abs() * e_s
    return stored((bound + TINY32).nan_to_num(0.0, 0.0, 0.0), exact_y, g.dtype)


def backward_bounds(impl, g, u, dy, exact_dg, exact_du):
    """du: as y with |dy g| for |g u|. dg = dy u s f, f = 1 + g q, q = 1 - s:
    e_q = u q + (1 + u) e_s,  e_f = u |f| + (1 + u)(u |g q| + (1 + u) |g| e_q)
    |dg_hat - dg| <= ((1 + u)**3 - 1) |dg| + (1 + u)**3 |dy u| (e_s |f| + (s + e_s) e_f) + tiny."""
    g64, u64, dy64 = (t.detach().cpu().double() for t in (g, u, dy))
    s, e_s = sigmoid_bound(impl, g64)
    q = torch.sigmoid(-g64)
    f = 1 + g64 * q
    e_q = U32 * q + (1 + U32) * e_s
    e_f = U32 * f.abs() + (1 + U32) * (U32 * (g64 * q).abs() + (1 + U32) * g64.abs() * e_q)
    dg = ((1 + U32) ** 3 - 1) * exact_dg.abs() + (1 + U32) ** 3 * (dy64 * u64).abs() * (
        e_s * f.abs() + (s + e_s) * e_f
    )
    du = ((1 + U32) ** 2 - 1) * exact_du.abs() + (1 + U32) ** 2 * (dy64 * g64).abs() * e_s
    return tuple(
        stored((b + TINY32).nan_to_num(0.0, 0.0, 0.0), exact, g.dtype)
        for b, exact in ((dg, exact_dg), (du, exact_du))
    )


def random_rows(m, n, dtype, scale=3.0):
    """scale 3: sigmoid's whole range, its flat tails included."""
    return (scale * torch.randn(m, n, device=DEVICE)).to(dtype)


def operands(form, m, n, dtype):
    """(g, u) as two tensors, or (gu, None): the fused (M, 2N) gate-up tensor."""
    if form == "fused":
        return random_rows(m, 2 * n, dtype), None
    return random_rows(m, n, dtype), random_rows(m, n, dtype)


def check_forward(impl, g, u, y=None):
    """Run impl's forward into y (fresh if None) and hold it to the bound; returns y."""
    fns = implementation(impl)
    y = torch_impl.fresh_output(g, u) if y is None else y
    exact = reference.swiglu_forward(g.cpu(), None if u is None else u.cpu())
    assert fns.swiglu_forward(g, u, y) is y
    gate, up = reference.halves(g) if u is None else (g, u)
    assert_within_bound(y, exact, forward_bound(impl, gate, up, exact), f"{impl} y")
    return y


def check_backward(impl, g, u, dy, dg=None, du=None):
    fns = implementation(impl)
    dg = torch.empty_like(g) if dg is None else dg
    du = None if u is None else torch.empty_like(u) if du is None else du
    exact_dg, exact_du = reference.swiglu_backward(g.cpu(), None if u is None else u.cpu(),
                                                   dy.cpu())  # fmt: skip
    got = fns.swiglu_backward(g, u, dy, dg, du)
    assert got[0] is dg and got[1] is du
    gate, up = reference.halves(g) if u is None else (g, u)
    d_gate, d_up = reference.halves(dg) if u is None else (dg, du)
    if u is None:
        exact_dg, exact_du = reference.halves(exact_dg)
    dg_bound, du_bound = backward_bounds(impl, gate, up, dy, exact_dg, exact_du)
    assert_within_bound(d_gate, exact_dg, dg_bound, f"{impl} dg")
    assert_within_bound(d_up, exact_du, du_bound, f"{impl} du")
    return dg, du


def forward_then_backward(impl, g, u, dy):
    check_forward(impl, g, u)
    check_backward(impl, g, u, dy)


if __name__ == "__main__":
    options = ["-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    # The section files, in their numbered order: every test_*.py beside this file.
    files = [__file__, *sorted(str(path) for path in HERE.glob("test_*.py"))]
    sys.exit(pytest.main([*files, *options, *sys.argv[1:]]))
