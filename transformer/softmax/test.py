"""Tests for softmax: every implementation, forward and backward, lands within README.md's bound.

This file is section (1), the set-up and the bound model, with the helpers the sections share;
each later section is a file of its own: test_2_contract.py (every implementation, autograd,
the module, torch.compile), test_3_triton.py, test_4_cute.py (builds and PTX), test_5_gpu.py.
Run them all with `python test.py` (extra arguments go to pytest: `python test.py -k cute -x`)
or `nox -s softmax` from the top. Without a GPU, torch runs on the CPU, Triton under its
interpreter, and the CuTe kernels are compiled for sm_90a and their PTX read; launching them
needs the GPU, and those tests say so when they skip.
"""

import itertools
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
    import cute_1_two_pass  # noqa: F401 (test_4_cute.py uses it)
    import cute_2_cluster  # noqa: F401 (test_4_cute.py uses it)
    import cute_impl
except ImportError as error:  # no CuTe DSL: its tests skip and say why
    cute_1_two_pass = cute_2_cluster = cute_impl = None
    CUTE_MISSING = f"cute_impl cannot be imported ({error})"

# (1) Set-up and the bound model ----------------------------------------------------------------

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", "triton", "cute"]
MODULES = {"reference": reference, "torch": torch_impl, "triton": triton_impl, "cute": cute_impl}
# (M, N): no rows, empty rows, 1, primes, 2**k +- 1 and the edges of a CuTe tile (2048 float32,
# 4096 16-bit elements).
SHAPES = [(0, 5), (3, 0), (1, 1), (2, 3), (7, 31), (3, 128), (5, 129), (2, 1023), (1, 4097),
          (3, 2048), (2, 8191)]  # fmt: skip
REFERENCE_MAX_ELEMS = 2**17  # past this, plain Python is slow: the float64 stand-ins take over
U32 = unit_roundoff(torch.float32)
TINY32 = torch.finfo(torch.float32).tiny  # ex2.approx.ftz flushes results below it to 0
EX2 = APPROX_RELATIVE_ERROR["ex2.approx.ftz.f32"]
LOG2E = 1 / math.log(2)
each_impl = pytest.mark.parametrize("impl", IMPLS)
each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
each_impl_and_dtype = pytest.mark.parametrize(
    "impl, dtype", list(itertools.product(IMPLS, DTYPES)), ids=str
)
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
needs_cute = pytest.mark.skipif(cute_impl is None, reason="the CuTe DSL is not installed")


def module(name):
    if name == "cute" and cute_impl is None:
        pytest.skip(CUTE_MISSING)
    return MODULES[name]


def implementation(name):
    """The implementation's module, for tests that launch it."""
    if name == "cute" and not ON_GPU:
        pytest.skip("launching a CuTe kernel needs a CUDA GPU; test_cute_ptx checks the build")
    return module(name)


def forward_bound(impl, x, exact):
    """README.md's forward bound, elementwise, from the exact y (float64 rows):

        t_i = |x_i - max| log2 e,  a_i = 2**(gamma_3 t_i)   (the exp argument's roundings)
        rho_i = a_i (1 + EX2)**E (1 + u)**K - 1             (term i's error in the row sum)
        beta = sum_j y_j rho_j + n (E + K) tiny              (the row sum's relative error)
        |y_hat_i - y_i| <= y_i (a_i (1 + EX2)(1 + u)**2 / (1 - beta) - 1) + 4 tiny
    then the store's rounding u_s |y| + (1 + u_s)(...) + underflow(dtype)."""
    n, dtype = x.shape[-1], x.dtype
    if x.numel() == 0:
        return torch.zeros(exact.shape, dtype=torch.float64)
    # E and K each implementation exports; torch sums in an undocumented order, possibly
    # rescaling online: what holds for any order is an exp per element seen and two roundings
    # per addition.
    path = (n + 1, 2 * n) if impl == "torch" else module(impl).forward_path(n, dtype)
    exp_calls, roundings = path
    x64, y = as_rows(x), as_rows(exact)
    shifted = x64 - x64.max(dim=-1, keepdim=True).values
    t = torch.where(torch.isfinite(shifted), shifted.abs() * LOG2E, torch.zeros_like(shifted))
    argument = torch.exp2(gamma(3, U32) * t)
    rho = argument * (1 + EX2) ** exp_calls * (1 + U32) ** roundings - 1
    beta = (y * rho).nan_to_num().sum(dim=-1, keepdim=True) + n * (exp_calls + roundings) * TINY32
    relative = argument * (1 + EX2) * (1 + U32) ** 2 / (1 - beta) - 1
    bound = y.abs() * relative + 4 * TINY32
    u_s = store_roundoff(dtype)
    return (u_s * y.abs() + (1 + u_s) * bound + underflow(dtype)).reshape(exact.shape)


def backward_bound(impl, y, dy, exact):
    """README.md's backward bound: with s = sum_j dy_j y_j, T = sum_j |dy_j y_j| and k the
    roundings on a product's way into s (one for the float32 product, none for 16-bit data),
        |s_hat - s| <= gamma_k T + n tiny (1 + gamma_k)
        |dx_hat_i - dx_i| <= gamma_2 |dx_i| + (1 + gamma_2) |y_i| |s_hat - s| + 2 tiny
    then the store's rounding."""
    n, dtype = y.shape[-1], y.dtype
    if y.numel() == 0:
        return torch.zeros(exact.shape, dtype=torch.float64)
    additions = n if impl == "torch" else module(impl).backward_path(n, dtype)
    k = additions + (1 if dtype == torch.float32 else 0)
    y64, dy64 = as_rows(y), as_rows(dy)
    total = (y64 * dy64).abs().sum(dim=-1, keepdim=True)
    dot_error = gamma(k, U32) * total + n * TINY32 * (1 + gamma(k, U32))
    dx = as_rows(exact)
    g2 = gamma(2, U32)
    bound = g2 * dx.abs() + (1 + g2) * y64.abs() * dot_error + 2 * TINY32
    u_s = store_roundoff(dtype)
    return (u_s * dx.abs() + (1 + u_s) * bound + underflow(dtype)).reshape(exact.shape)


def as_rows(t):
    """t's rows as a float64 CPU (M, N) matrix (reshape(-1, N) is ambiguous for N = 0)."""
    return t.detach().cpu().double().reshape(math.prod(t.shape[:-1]), t.shape[-1])


def random_rows(m, n, dtype, scale=1.0):
    return (scale * torch.randn(m, n, device=DEVICE)).to(dtype)


def float64_softmax(x):
    """The stand-in for reference.py where Python is too slow: the same formula in float64."""
    x64 = x.double()
    e = torch.exp(x64 - x64.max(dim=-1, keepdim=True).values)
    return (e / e.sum(dim=-1, keepdim=True)).cpu()


def float64_softmax_backward(y, dy):
    y64, dy64 = y.double(), dy.double()
    return (y64 * (dy64 - (y64 * dy64).sum(dim=-1, keepdim=True))).cpu()


EXACT = {"forward": (reference.softmax_forward, float64_softmax),
         "backward": (reference.softmax_backward, float64_softmax_backward)}  # fmt: skip
BOUND = {"forward": forward_bound, "backward": backward_bound}


def check(impl, direction, *inputs, out=None):
    """Run impl's forward (inputs x) or backward (y, dy) into out (fresh if None) and hold it
    to the bound; returns out. The exact answer and the bound come first: out may be an input."""
    out = torch.empty_like(inputs[0]) if out is None else out
    exact = EXACT[direction][inputs[0].numel() > REFERENCE_MAX_ELEMS](*(t.cpu() for t in inputs))
    bound = BOUND[direction](impl, *inputs, exact)
    assert getattr(implementation(impl), f"softmax_{direction}")(*inputs, out) is out
    assert_within_bound(out, exact, bound, f"{impl} {direction}")
    return out


def forward_then_backward(impl, x, dy):
    y = check(impl, "forward", x)
    return y, check(impl, "backward", y, dy)


def run_both(fns, x, dy, y=None, dx=None):
    """fns' forward, then its backward on that y, into y and dx (fresh if None)."""
    y = fns.softmax_forward(x, torch.empty_like(x) if y is None else y)
    return y, fns.softmax_backward(y, dy, torch.empty_like(x) if dx is None else dx)


def assert_rejects(wrongs, exact, bound, dtype):
    """A negative control: each wrong answer, rounded to dtype, lies outside the bound; the
    exact answer rounded once lies inside."""
    for wrong in wrongs:
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_within_bound(wrong.to(dtype), exact, bound)
    assert_within_bound(exact.to(dtype), exact, bound)


def special_rows(dtype, n=300):
    """Rows of random logits with special values planted, one case per row."""
    inf, nan = float("inf"), float("nan")
    x = random_rows(7, n, dtype)
    x[0, ::3] = -inf  # masked logits
    x[1, :] = -inf  # a fully masked row: NaN, as in torch
    x[2, 17] = inf
    x[3, n // 2] = nan
    x[4, :] = (1e4 * torch.randn(n, device=DEVICE)).to(dtype)  # large logits: no overflow
    x[5, :-1] = -inf  # one live logit: y = 1 there
    x[6, :] = x[6, 0]  # all equal: y = 1/n
    return x


if __name__ == "__main__":
    options = ["-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    # The section files, in their numbered order: every test_*.py beside this file.
    files = [__file__, *sorted(str(path) for path in HERE.glob("test_*.py"))]
    sys.exit(pytest.main([*files, *options, *sys.argv[1:]]))
